//! Pacing prompt chunks against decode steps: which chunk bucket a step takes, so that the decode
//! rows a chunk step holds up wait at most a set fraction of a decode step longer than they would
//! without it (Sarathi-Serve's stall-free batching, with the times measured on the run rather
//! than assumed).
//!
//! A step that runs a prompt chunk runs its decode step too, so every sequence decoding waits for
//! the chunk; and a chunk costs more the later in its prompt it starts, since each of its queries
//! attends to every key before it. The batcher runs each chunk on its own and times it:
//! [`Pacing`] fits, per chunk bucket, a line in the chunk's first position to those times
//! ([`Line`]), follows the decode-only steps' time (an exponential average), and lets a step
//! take the largest chunk bucket predicted to fit `fraction` of a decode step: the smallest
//! when none fits (prompts always advance), the largest before anything was measured. A
//! bucket not measured yet is predicted from the nearest measured one, in proportion to their
//! tokens (a chunk's products and its attention both grow with its rows).
//!
//! While few sequences decode, their steps are short, and a limit of a share of them would
//! shrink every chunk, so prompts would fill slowly and the batch stay small (BENCHMARKS.md
//! has a server paced that way from its first request on). So the limit is `fraction` of the
//! longer of a decode step and the largest chunk bucket's predicted time at a prompt's start:
//! chunks shrink below the largest only as far as a full batch's decode steps, or a prompt's
//! later positions, ask.

/// Least-squares line `y = a + b x` through observations, `b >= 0`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Line {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl Line {
    /// Adds the observation `(x, y)`.
    pub fn add(&mut self, x: f64, y: f64) {
        self.n += 1.0;
        self.sx += x;
        self.sy += y;
        self.sxx += x * x;
        self.sxy += x * y;
    }

    /// The line's value at `x`; `None` before any observation. Where the observations' `x`
    /// hardly vary (all of one position), the line is flat at their mean; a fitted slope below 0
    /// (noise: a later chunk is never cheaper) is taken as 0.
    pub fn at(&self, x: f64) -> Option<f64> {
        if self.n == 0.0 {
            return None;
        }
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        let var = self.sxx / self.n - mx * mx;
        let slope = if var > 1.0 {
            ((self.sxy / self.n - mx * my) / var).max(0.0)
        } else {
            0.0
        };
        Some(my + slope * (x - mx))
    }
}

/// Weight of the newest decode-only step in the running average.
const NEWEST: f64 = 1.0 / 16.0;

/// The chunk buckets' measured costs, the decode steps' pace, and the choice they make.
#[derive(Clone, Debug)]
pub struct Pacing {
    /// Tokens of each chunk bucket, ascending.
    sizes: Vec<usize>,
    /// Seconds of each chunk bucket against its first position.
    costs: Vec<Line>,
    /// Average seconds of a decode-only step; `None` before the first.
    decode: Option<f64>,
    /// The share of a decode step a chunk may add to it; `None`: chunks are not limited.
    fraction: Option<f64>,
}

impl Pacing {
    /// Pacing for chunk buckets of `sizes` tokens (ascending), a chunk allowed `fraction` of a
    /// decode step (`None`: any chunk).
    pub fn new(sizes: Vec<usize>, fraction: Option<f64>) -> Pacing {
        debug_assert!(sizes.windows(2).all(|w| w[0] < w[1]), "sizes ascend");
        Pacing {
            costs: vec![Line::default(); sizes.len()],
            sizes,
            decode: None,
            fraction,
        }
    }

    /// Limits chunks to `fraction` of a decode step (see [`Pacing::limit`]).
    pub fn limit_to(&mut self, fraction: f64) {
        self.fraction = Some(fraction);
    }

    /// Records a decode-only step of `seconds`.
    pub fn decoded(&mut self, seconds: f64) {
        self.decode = Some(match self.decode {
            Some(avg) => avg + NEWEST * (seconds - avg),
            None => seconds,
        });
    }

    /// Records that chunk bucket `bucket` (an index into the sizes) took `seconds` for a chunk
    /// whose costliest prompt started at position `start`.
    pub fn chunked(&mut self, bucket: usize, start: usize, seconds: f64) {
        self.costs[bucket].add(start as f64, seconds);
    }

    /// Predicted seconds of chunk bucket `bucket` starting at `start`: its own line, else the
    /// nearest measured bucket's scaled by their sizes; `None` before any chunk was measured.
    pub fn predict(&self, bucket: usize, start: usize) -> Option<f64> {
        let x = start as f64;
        if let Some(t) = self.costs[bucket].at(x) {
            return Some(t);
        }
        let near = (0..self.sizes.len())
            .filter(|&i| self.costs[i].n > 0.0)
            .min_by_key(|&i| i.abs_diff(bucket))?;
        let scale = self.sizes[bucket] as f64 / self.sizes[near] as f64;
        self.costs[near].at(x).map(|t| t * scale)
    }

    /// The seconds a chunk may take: `fraction` of a decode step or of the largest chunk
    /// bucket's predicted time at position 0, whichever is longer; `None` before a decode step
    /// was timed, or without a fraction.
    pub fn limit(&self) -> Option<f64> {
        let first = self
            .sizes
            .len()
            .checked_sub(1)
            .and_then(|l| self.predict(l, 0));
        Some(self.decode?.max(first.unwrap_or(0.0)) * self.fraction?)
    }

    /// The chunk bucket (an index into the sizes) for prompts whose longest has `left` tokens to
    /// go and whose costliest starts at `start`: of the buckets that fit the limit (the
    /// smallest when none does, all before anything was measured), the smallest that holds
    /// `left`, else the largest.
    pub fn pick(&self, left: usize, start: usize) -> usize {
        let limit = self.limit();
        let fits = |i: &usize| match (limit, self.predict(*i, start)) {
            (Some(limit), Some(t)) => t <= limit,
            _ => true,
        };
        let cap = (0..self.sizes.len()).rev().find(fits).unwrap_or(0);
        (0..=cap).find(|&i| self.sizes[i] >= left).unwrap_or(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_fits_its_points_and_never_slopes_down() {
        let mut line = Line::default();
        assert_eq!(line.at(0.0), None);
        line.add(100.0, 2.0);
        assert_eq!(line.at(5000.0), Some(2.0), "one position: flat");
        line.add(300.0, 4.0);
        line.add(200.0, 3.0);
        let at = line.at(400.0).unwrap();
        assert!((at - 5.0).abs() < 1e-9, "{at}");
        let mut falling = Line::default();
        falling.add(0.0, 3.0);
        falling.add(100.0, 1.0);
        assert_eq!(falling.at(1000.0), Some(2.0), "a falling fit is taken flat");
    }

    #[test]
    fn before_any_time_the_largest_chunk_runs() {
        let mut p = Pacing::new(vec![128, 256, 512], Some(1.0));
        assert_eq!(p.pick(4000, 3000), 2);
        // Chunk times alone do not limit: the limit is a share of a decode step.
        p.chunked(2, 0, 9.0);
        assert_eq!(p.pick(4000, 3000), 2);
        // What is left decides as before: the smallest bucket that holds it.
        assert_eq!(p.pick(200, 3000), 1);
    }

    /// Buckets of 128, 256 and 512 tokens at a budget of a whole decode step, decode steps of
    /// `decode` s, and the 512-token chunk measured at 2.0 s at position 0 and 3.0 at 2000 (a
    /// line of slope 1/2000).
    fn measured(decode: f64) -> Pacing {
        let mut p = Pacing::new(vec![128, 256, 512], Some(1.0));
        p.decoded(decode);
        p.chunked(2, 0, 2.0);
        p.chunked(2, 2000, 3.0);
        p
    }

    #[test]
    fn late_chunks_shrink_to_fit_a_decode_step() {
        let mut p = measured(2.5);
        assert_eq!(p.pick(4000, 0), 2);
        assert_eq!(p.pick(4000, 1000), 2, "2.5 fits exactly");
        // Past 1000 the 512 chunk is over; the 256 one is predicted at half of it.
        assert_eq!(p.pick(4000, 1001), 1);
        assert!((p.predict(1, 3000).unwrap() - 1.75).abs() < 1e-9);
        // Once measured, a bucket's own line counts.
        p.chunked(1, 0, 2.4);
        p.chunked(1, 2000, 2.6);
        assert_eq!(p.pick(4000, 3000), 0, "256 at 3000: 2.7 > 2.5");
        // A prompt's short tail takes the smallest bucket that holds it.
        assert_eq!(p.pick(100, 0), 0);
        assert_eq!(p.pick(300, 0), 2);
        assert_eq!(p.pick(300, 3000), 0, "but no larger one than fits");
        // When nothing fits, the smallest runs anyway.
        p.chunked(0, 0, 9.0);
        assert_eq!(p.pick(4000, 3000), 0);
    }

    #[test]
    fn short_decode_steps_leave_the_largest_chunk_its_start() {
        // A batch of a few rows: 0.5 s decode steps.
        let p = measured(0.5);
        assert_eq!(p.limit(), Some(2.0));
        assert_eq!(p.pick(4000, 0), 2, "a prompt's first chunk is the largest");
        assert_eq!(p.pick(4000, 1000), 1, "later ones shrink as the keys grow");
        // At half the budget neither a fresh prompt's largest chunk fits.
        let mut half = p.clone();
        half.limit_to(0.5);
        assert_eq!(half.pick(4000, 0), 1);
    }

    #[test]
    fn the_decode_pace_follows_recent_steps() {
        let mut p = Pacing::new(vec![64], Some(0.5));
        assert_eq!(p.limit(), None);
        p.decoded(2.0);
        assert_eq!(p.limit(), Some(1.0));
        for _ in 0..200 {
            p.decoded(4.0);
        }
        assert!((p.limit().unwrap() - 2.0).abs() < 1e-3);
        // Without a fraction nothing limits a chunk.
        let mut free = Pacing::new(vec![64, 128], None);
        free.decoded(1.0);
        free.chunked(1, 0, 5.0);
        assert_eq!(free.limit(), None);
        assert_eq!(free.pick(1000, 0), 1);
    }
}
