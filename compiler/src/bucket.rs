//! Sequence-length buckets: which static graphs to compile, which bucket serves a request, and how
//! much padding a length distribution costs.

use std::collections::BTreeMap;

use kiln_ir::dim::{BATCH, SEQ};
use serde::Serialize;

/// One prefill / encode bucket: a static (batch, sequence) shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Bucket {
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
}

impl Bucket {
    /// The symbol substitution that makes the graph static.
    pub fn bindings(&self) -> BTreeMap<String, i64> {
        BTreeMap::from([
            (BATCH.to_string(), self.batch as i64),
            (SEQ.to_string(), self.seq as i64),
        ])
    }

    /// A file-name-friendly label, `b1-s128`.
    pub fn label(&self) -> String {
        format!("b{}-s{}", self.batch, self.seq)
    }
}

/// The buckets to compile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BucketPlan {
    /// Sequence lengths, ascending.
    pub seq_lens: Vec<usize>,
    /// Batch sizes, ascending.
    pub batch_sizes: Vec<usize>,
}

impl BucketPlan {
    /// Explicit lengths and batch sizes (sorted, deduplicated; zero is refused).
    pub fn new(
        mut seq_lens: Vec<usize>,
        mut batch_sizes: Vec<usize>,
    ) -> Result<BucketPlan, String> {
        for (what, v) in [("sequence", &mut seq_lens), ("batch", &mut batch_sizes)] {
            if v.is_empty() {
                return Err(format!("no {what} buckets given"));
            }
            if v.contains(&0) {
                return Err(format!("a {what} bucket of 0"));
            }
            v.sort_unstable();
            v.dedup();
        }
        Ok(BucketPlan {
            seq_lens,
            batch_sizes,
        })
    }

    /// Powers of two from 16 up to `max_seq`, with `max_seq` itself last.
    pub fn pow2(max_seq: usize, batch_sizes: Vec<usize>) -> Result<BucketPlan, String> {
        if max_seq == 0 {
            return Err("--max-seq must be at least 1".into());
        }
        let mut lens = Vec::new();
        let mut l = 16usize.min(max_seq.next_power_of_two());
        while l < max_seq {
            lens.push(l);
            l *= 2;
        }
        lens.push(max_seq);
        BucketPlan::new(lens, batch_sizes)
    }

    /// Chooses `count` lengths (the largest being the longest length seen) that minimise the
    /// padded tokens of `histogram` (length -> number of requests), by dynamic programming over
    /// the distinct lengths. A range's padding comes from prefix sums in O(1), and each layer of
    /// the program is filled by divide and conquer over the split point, which is monotone
    /// because padding obeys the quadrangle inequality: O(count * n log n) for n distinct lengths.
    /// Ties go to the smallest split point, as a plain scan would choose.
    pub fn from_histogram(
        histogram: &BTreeMap<usize, u64>,
        count: usize,
        batch_sizes: Vec<usize>,
    ) -> Result<BucketPlan, String> {
        let (lens, padding) = Padding::new(histogram);
        if lens.is_empty() || count == 0 {
            return Err("the length histogram is empty".into());
        }
        let n = lens.len();
        let k = count.min(n);
        // best[b][j]: least padding for lens[..=j] with b + 1 buckets, the last at lens[j];
        // from[b][j]: where bucket b - 1 ends in that solution.
        let mut best = vec![(0..n).map(|j| padding.cost(0, j)).collect::<Vec<_>>()];
        let mut from = vec![vec![0usize; n]];
        for b in 1..k {
            let mut layer = Layer {
                prev: &best[b - 1],
                padding: &padding,
                best: vec![u128::MAX; n],
                from: vec![0; n],
            };
            layer.fill(b..n, b - 1, n - 1);
            let Layer {
                best: layer_best,
                from: layer_from,
                ..
            } = layer;
            best.push(layer_best);
            from.push(layer_from);
        }
        let mut chosen = Vec::with_capacity(k);
        let (mut b, mut j) = (k - 1, n - 1);
        loop {
            chosen.push(lens[j]);
            if b == 0 {
                break;
            }
            j = from[b][j];
            b -= 1;
        }
        BucketPlan::new(chosen, batch_sizes)
    }

    /// Every (batch, sequence) bucket, largest first.
    pub fn prefill(&self) -> Vec<Bucket> {
        let mut out: Vec<Bucket> = self
            .batch_sizes
            .iter()
            .flat_map(|&batch| self.seq_lens.iter().map(move |&seq| Bucket { batch, seq }))
            .collect();
        out.sort_by(|a, b| b.cmp(a));
        out
    }

    /// The smallest sequence bucket that holds `len`, if any.
    pub fn seq_bucket(&self, len: usize) -> Option<usize> {
        self.seq_lens.iter().copied().find(|&s| s >= len)
    }

    /// The fraction of computed tokens that are padding for `histogram`, and how many requests no
    /// bucket holds.
    pub fn padding_waste(&self, histogram: &BTreeMap<usize, u64>) -> (f64, u64) {
        let (mut padded, mut total, mut too_long) = (0u128, 0u128, 0u64);
        for (&len, &count) in histogram {
            match self.seq_bucket(len) {
                Some(b) => {
                    padded += u128::from(count) * (b - len) as u128;
                    total += u128::from(count) * b as u128;
                }
                None => too_long += count,
            }
        }
        let waste = if total == 0 {
            0.0
        } else {
            padded as f64 / total as f64
        };
        (waste, too_long)
    }
}

/// Prefix sums over a histogram's distinct (positive) lengths, for the padding of a range in O(1).
struct Padding {
    lens: Vec<u128>,
    /// counts[t]: requests with lengths lens[..t].
    counts: Vec<u128>,
    /// tokens[t]: their tokens.
    tokens: Vec<u128>,
}

impl Padding {
    /// The distinct positive lengths, ascending, and their prefix sums.
    fn new(histogram: &BTreeMap<usize, u64>) -> (Vec<usize>, Padding) {
        let kept: Vec<(usize, u64)> = histogram
            .iter()
            .filter(|(l, _)| **l > 0)
            .map(|(l, c)| (*l, *c))
            .collect();
        let (mut counts, mut tokens) = (vec![0u128], vec![0u128]);
        for &(len, count) in &kept {
            counts.push(counts.last().unwrap() + u128::from(count));
            tokens.push(tokens.last().unwrap() + u128::from(count) * len as u128);
        }
        let lens = kept.iter().map(|(l, _)| *l as u128).collect();
        let padding = Padding {
            lens,
            counts,
            tokens,
        };
        (kept.into_iter().map(|(l, _)| l).collect(), padding)
    }

    /// Padding of lengths `i..=j` served by a bucket of `lens[j]`.
    fn cost(&self, i: usize, j: usize) -> u128 {
        let served = self.counts[j + 1] - self.counts[i];
        self.lens[j] * served - (self.tokens[j + 1] - self.tokens[i])
    }
}

/// One layer of the bucket program: `best[j]` and `from[j]` for one more bucket, over the
/// previous layer's `prev`.
struct Layer<'a> {
    prev: &'a [u128],
    padding: &'a Padding,
    best: Vec<u128>,
    from: Vec<usize>,
}

impl Layer<'_> {
    /// Fills `js`, whose split points lie in `lo..=hi`: the middle `j` by a scan, then each half
    /// within the split points left of or right of the middle's.
    fn fill(&mut self, js: std::ops::Range<usize>, lo: usize, hi: usize) {
        if js.is_empty() {
            return;
        }
        let j = js.start + (js.end - js.start) / 2;
        for i in lo..=hi.min(j - 1) {
            let c = self.prev[i] + self.padding.cost(i + 1, j);
            if c < self.best[j] {
                self.best[j] = c;
                self.from[j] = i;
            }
        }
        let split = self.from[j];
        self.fill(js.start..j, lo, split);
        self.fill(j + 1..js.end, split, hi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_ends_at_max_seq() {
        let p = BucketPlan::pow2(100, vec![1]).unwrap();
        assert_eq!(p.seq_lens, vec![16, 32, 64, 100]);
        assert_eq!(BucketPlan::pow2(8, vec![1]).unwrap().seq_lens, vec![8]);
        assert_eq!(p.seq_bucket(17), Some(32));
        assert_eq!(p.seq_bucket(101), None);
    }

    #[test]
    fn histogram_buckets_minimise_padding() {
        // Two clusters: 10-12 and 100; two buckets must be 12 and 100.
        let h = BTreeMap::from([(10, 5), (11, 5), (12, 5), (100, 3)]);
        let p = BucketPlan::from_histogram(&h, 2, vec![1]).unwrap();
        assert_eq!(p.seq_lens, vec![12, 100]);
        let (waste, too_long) = p.padding_waste(&h);
        assert_eq!(too_long, 0);
        let padded = 5.0 * 2.0 + 5.0 * 1.0;
        let total = 15.0 * 12.0 + 3.0 * 100.0;
        assert!((waste - padded / total).abs() < 1e-12);
        // Three buckets can do no worse than two.
        let p3 = BucketPlan::from_histogram(&h, 3, vec![1]).unwrap();
        assert!(p3.padding_waste(&h).0 <= waste);
    }

    /// The planner before prefix sums: every range's padding summed afresh and every split point
    /// scanned, O(count * n^3). The reference the fast planner must agree with.
    fn cubic_plan(histogram: &BTreeMap<usize, u64>, count: usize) -> Vec<usize> {
        let lens: Vec<usize> = histogram.keys().copied().filter(|l| *l > 0).collect();
        let (n, k) = (lens.len(), count.min(lens.len()));
        let cost = |i: usize, j: usize| -> u128 {
            (i..=j)
                .map(|t| u128::from(histogram[&lens[t]]) * (lens[j] - lens[t]) as u128)
                .sum()
        };
        let mut best = vec![vec![u128::MAX; n]; k];
        let mut from = vec![vec![0usize; n]; k];
        for (j, b) in best[0].iter_mut().enumerate() {
            *b = cost(0, j);
        }
        for b in 1..k {
            for j in b..n {
                for i in b - 1..j {
                    let c = best[b - 1][i] + cost(i + 1, j);
                    if c < best[b][j] {
                        best[b][j] = c;
                        from[b][j] = i;
                    }
                }
            }
        }
        let mut chosen = Vec::new();
        let (mut b, mut j) = (k - 1, n - 1);
        loop {
            chosen.push(lens[j]);
            if b == 0 {
                break;
            }
            j = from[b][j];
            b -= 1;
        }
        chosen.reverse();
        chosen
    }

    #[test]
    fn histogram_plan_matches_the_cubic_planner() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for trial in 0..400 {
            let distinct = rng.random_range(1..40);
            // Small ranges and counts make ties between split points common.
            let max_len = if trial % 2 == 0 { 60 } else { 5_000 };
            let h: BTreeMap<usize, u64> = (0..distinct)
                .map(|_| (rng.random_range(0..max_len), rng.random_range(0..4)))
                .collect();
            if h.keys().all(|l| *l == 0) {
                continue;
            }
            for count in 1..10 {
                let fast = BucketPlan::from_histogram(&h, count, vec![1]).unwrap();
                assert_eq!(
                    fast.seq_lens,
                    cubic_plan(&h, count),
                    "{h:?}, {count} buckets"
                );
            }
        }
    }

    #[test]
    fn histogram_plan_scales_to_20000_lengths() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let h: BTreeMap<usize, u64> = (1..=20_000)
            .map(|l| (l, rng.random_range(1..1_000)))
            .collect();
        let start = std::time::Instant::now();
        let plan = BucketPlan::from_histogram(&h, 8, vec![1]).unwrap();
        let took = start.elapsed();
        // The bound holds in debug builds too (this profile is opt-level 1: 0.03 s here).
        assert!(
            took.as_secs_f64() < 2.0,
            "8 buckets over 20,000 lengths took {took:?}"
        );
        assert_eq!(plan.seq_lens.len(), 8);
        assert_eq!(*plan.seq_lens.last().unwrap(), 20_000);
    }
}
