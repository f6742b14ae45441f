//! Batch groups: a prefill bucket of many rows run as replays of a smaller bucket of the same
//! length, a group of rows each, every group's outputs copied to the host while the next group
//! computes. Run as one replay, a request computes everything and then waits for the whole copy:
//! BERT-base's `last_hidden_state` for 128 x 128 tokens is 25 MB, about 0.46 ms over PCIe after
//! some 6 ms of compute. Grouped, only the last group's copy is left after the compute.
//!
//! [`candidates`] says from the plans alone which buckets may be grouped, and by which smaller
//! ones; the CUDA executor times each at load ([`Timings`]), and a request takes a grouping only
//! where its rows make it faster ([`Timings::pick`]), since the smaller bucket's products may
//! run slower a row.

use std::collections::BTreeMap;

use kiln_ir::artifact::{BucketEntry, ExecPlan, TensorSlot};
use kiln_ir::Tensor;

use crate::forward::fastest;

/// A prefill bucket run as `count` replays of a smaller one, each taking the next `part`'s
/// batch of rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grouping {
    /// The graph file of the bucket a request takes.
    pub whole: String,
    /// The graph file of the bucket each group replays.
    pub part: String,
    /// Groups: the whole bucket's batch over the part's.
    pub count: usize,
    /// Rows each group takes: the part's batch.
    pub rows: usize,
}

impl Grouping {
    /// The groups a request replays when only its first `rows` rows are the caller's (the
    /// others padding): those that hold one of them, at least one and at most all. A group of
    /// padding rows alone computes nothing anyone reads.
    pub fn groups_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.rows).clamp(1, self.count)
    }
}

/// What load measured of a bucket that has groupings: one replay, and each grouping with all
/// of its groups, seconds (the fastest of interleaved rounds).
#[derive(Clone, Debug, PartialEq)]
pub struct Timings {
    /// One replay of the whole bucket.
    pub whole: f64,
    /// Each grouping, all of its groups replayed.
    pub ways: Vec<(Grouping, f64)>,
}

impl Timings {
    /// The grouping a request whose first `rows` rows are its own runs as: the one whose groups
    /// that hold them take least (each group an equal share of the grouping's time), where that
    /// beats one replay by [`MIN_GAIN`]; `None` for one replay. A full bucket takes the fastest
    /// way load timed; a bucket padded by whole groups may take a grouping that loses when full.
    pub fn pick(&self, rows: usize) -> Option<&Grouping> {
        let share = |g: &Grouping, t: f64| t * g.groups_for(rows) as f64 / g.count as f64;
        let timed = std::iter::once((None, self.whole))
            .chain(self.ways.iter().map(move |(g, t)| (Some(g), share(g, *t))));
        fastest(timed, MIN_GAIN)
    }

    /// Every grouping some request runs as ([`Self::pick`], for each count of rows the bucket
    /// holds).
    pub fn used(&self) -> Vec<&Grouping> {
        let batch = self.ways.first().map_or(0, |(g, _)| g.count * g.rows);
        let mut used: Vec<&Grouping> = Vec::new();
        for g in (1..=batch).filter_map(|rows| self.pick(rows)) {
            if !used.contains(&g) {
                used.push(g);
            }
        }
        used
    }
}

/// Outputs smaller than this copy in less than about 20 us over PCIe: less than the launches
/// that grouping adds.
pub const MIN_OUTPUT_BYTES: u64 = 1 << 20;

/// A grouping must be this much faster than one replay to be kept: more than the spread of the
/// fastest of several timed requests.
pub const MIN_GAIN: f64 = 0.01;

/// Every grouping of `prefill`'s buckets (each with its plan) that computes each row as the
/// whole bucket does: a bucket whose outputs take at least [`MIN_OUTPUT_BYTES`], by each smaller
/// bucket of the same length whose batch divides its batch. Both keep no state between requests
/// (no KV cache, no decode step), and every input and output of both has the batch as its
/// leading dimension, the part's slots being the whole's with the part's batch. A dropout seed
/// (a scalar input) keeps a bucket whole: its masks follow each row's index in the batch. The
/// part's kernels are generated for its own size, so its rows may differ from the whole's in
/// the last bit where a product of fewer rows splits its sums otherwise; `KILN_BATCH_GROUPS=0`
/// keeps every bucket whole.
pub fn candidates(prefill: &[(&BucketEntry, &ExecPlan)]) -> Vec<Grouping> {
    let mut groupings = Vec::new();
    for &(whole, wp) in prefill {
        if !stateless(wp) || outputs_bytes(wp) < MIN_OUTPUT_BYTES {
            continue;
        }
        for &(part, pp) in prefill {
            let divides = part.batch < whole.batch && whole.batch % part.batch == 0;
            let splits =
                |w: &[TensorSlot], p: &[TensorSlot]| slots_split(w, p, whole.batch, part.batch);
            if part.seq == whole.seq
                && divides
                && stateless(pp)
                && splits(&wp.inputs, &pp.inputs)
                && splits(&wp.outputs, &pp.outputs)
            {
                groupings.push(Grouping {
                    whole: whole.graph.clone(),
                    part: part.graph.clone(),
                    count: whole.batch / part.batch,
                    rows: part.batch,
                });
            }
        }
    }
    groupings
}

/// Bytes of `plan`'s outputs together.
pub fn outputs_bytes(plan: &ExecPlan) -> u64 {
    plan.outputs.iter().map(TensorSlot::bytes).sum()
}

/// Whether a replay of `plan` depends on nothing but its inputs and leaves nothing but its
/// outputs: no KV cache, no decode step's tokens, sampler or advanced inputs, no logits pieces.
fn stateless(plan: &ExecPlan) -> bool {
    plan.cache_inputs.is_empty()
        && plan.cache_outputs.is_empty()
        && plan.tokens.is_none()
        && plan.sampler.is_none()
        && !plan.advances
        && plan.logits_pieces.is_empty()
}

/// Whether `part` is `whole` with `b` rows for `batch`: slot by slot the same names and types,
/// the leading dimension `batch` in `whole` and `b` in `part`, the others equal.
fn slots_split(whole: &[TensorSlot], part: &[TensorSlot], batch: usize, b: usize) -> bool {
    whole.len() == part.len()
        && whole.iter().zip(part).all(|(w, p)| {
            let leading = match (w.shape.split_first(), p.shape.split_first()) {
                (Some((&wb, w_rest)), Some((&pb, p_rest))) => {
                    wb == batch && pb == b && w_rest == p_rest
                }
                _ => false,
            };
            w.name == p.name && w.dtype == p.dtype && leading
        })
}

/// Group `g` of `count` of each of `inputs` (a whole bucket's, by name): its rows of the leading
/// dimension.
pub fn group_inputs(
    inputs: &[(&str, &Tensor)],
    g: usize,
    count: usize,
) -> BTreeMap<String, Tensor> {
    inputs
        .iter()
        .map(|&(name, t)| {
            let rows = t.shape.first().copied().unwrap_or(0) / count;
            (name.to_string(), t.rows(g * rows..(g + 1) * rows))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kiln_ir::artifact::LogitsPiece;
    use kiln_ir::DType;

    /// A slot of `shape` at offset 0.
    pub(crate) fn slot(name: &str, dtype: DType, shape: &[usize]) -> TensorSlot {
        TensorSlot {
            name: name.into(),
            offset: 0,
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// An encoder's bucket of `batch` x `seq` tokens, hidden size 512 in f32.
    fn encoder(batch: usize, seq: usize) -> (BucketEntry, ExecPlan) {
        let plan = ExecPlan {
            arena_bytes: 0,
            inputs: vec![
                slot("attention_mask", DType::I64, &[batch, seq]),
                slot("input_ids", DType::I64, &[batch, seq]),
            ],
            cache_inputs: Vec::new(),
            outputs: vec![slot("last_hidden_state", DType::F32, &[batch, seq, 512])],
            cache_outputs: Vec::new(),
            steps: Vec::new(),
            tokens: None,
            advances: false,
            sampler: None,
            logits_pieces: Vec::new(),
            host_tail: None,
            cpu: None,
        };
        let entry = BucketEntry {
            batch,
            seq,
            context: None,
            graph: format!("prefill-b{batch}-s{seq}.ron"),
            kernels: Vec::new(),
            plan: None,
            no_gpu: Vec::new(),
            no_cpu: Vec::new(),
        };
        (entry, plan)
    }

    fn groupings(buckets: &[(BucketEntry, ExecPlan)]) -> Vec<(String, String, usize)> {
        let pairs: Vec<(&BucketEntry, &ExecPlan)> = buckets.iter().map(|(e, p)| (e, p)).collect();
        candidates(&pairs)
            .into_iter()
            .map(|g| (g.whole, g.part, g.count))
            .collect()
    }

    fn grouping(
        whole: (usize, usize),
        part: (usize, usize),
        count: usize,
    ) -> (String, String, usize) {
        let name = |(b, s)| format!("prefill-b{b}-s{s}.ron");
        (name(whole), name(part), count)
    }

    #[test]
    fn large_buckets_group_by_each_smaller_batch_that_divides_theirs() {
        // 128 x 128 x 512 f32 outputs are 32 MiB; 8 x 128 x 512 are 2 MiB; 4 x 128 x 512, 1 MiB.
        let buckets: Vec<_> = [4, 8, 32, 48, 128].map(|b| encoder(b, 128)).into();
        assert_eq!(
            groupings(&buckets),
            vec![
                grouping((8, 128), (4, 128), 2),
                grouping((32, 128), (4, 128), 8),
                grouping((32, 128), (8, 128), 4),
                grouping((48, 128), (4, 128), 12),
                grouping((48, 128), (8, 128), 6),
                grouping((128, 128), (4, 128), 32),
                grouping((128, 128), (8, 128), 16),
                grouping((128, 128), (32, 128), 4),
            ]
        );
    }

    #[test]
    fn near_misses_stay_whole() {
        // Another length, and outputs under a mebibyte.
        assert!(groupings(&[encoder(4, 64), encoder(32, 128)]).is_empty());
        assert!(groupings(&[encoder(1, 128), encoder(2, 128)]).is_empty());
        let with = |change: fn(&mut ExecPlan)| {
            let (part, mut pp) = encoder(32, 128);
            let (whole, mut wp) = encoder(128, 128);
            change(&mut pp);
            change(&mut wp);
            groupings(&[(part, pp), (whole, wp)])
        };
        assert_eq!(with(|_| ()).len(), 1);
        // A KV cache, a decode step's state, a dropout seed, an output without the batch.
        assert!(with(|p| p.cache_outputs.push("present.0.key".into())).is_empty());
        assert!(with(|p| p.cache_inputs.push("past.0.key".into())).is_empty());
        assert!(with(|p| p.advances = true).is_empty());
        assert!(
            with(|p| p.tokens = Some(slot("tokens", DType::I64, &[p.inputs[0].shape[0]])))
                .is_empty()
        );
        assert!(with(|p| p.logits_pieces.push(LogitsPiece { steps: 1, rows: 1 })).is_empty());
        assert!(with(|p| p.inputs.push(slot("seed", DType::I64, &[]))).is_empty());
        assert!(with(|p| p.outputs.push(slot("scale", DType::F32, &[512]))).is_empty());
        // The part's slots must be the whole's: a name, a type or a width apart is no split.
        let (part, mut pp) = encoder(32, 128);
        pp.outputs[0].dtype = DType::BF16;
        assert!(groupings(&[(part, pp), encoder(128, 128)]).is_empty());
        let (part, mut pp) = encoder(32, 128);
        pp.outputs[0].shape[2] = 256;
        assert!(groupings(&[(part, pp), encoder(128, 128)]).is_empty());
        let (part, mut pp) = encoder(32, 128);
        pp.inputs[0].name = "token_type_ids".into();
        assert!(groupings(&[(part, pp), encoder(128, 128)]).is_empty());
    }

    /// The outputs of a bucket take at least [`MIN_OUTPUT_BYTES`], or it stays whole.
    #[test]
    fn outputs_of_a_mebibyte_are_the_least_worth_grouping() {
        let with_width = |width: usize| {
            let mut buckets = [encoder(8, 128), encoder(16, 128)];
            for (e, p) in &mut buckets {
                p.outputs[0].shape = vec![e.batch, 128, width];
            }
            groupings(&buckets).len()
        };
        // 16 x 128 x 128 f32 outputs are 1 MiB exactly; 16 x 128 x 127, a row short of it.
        assert_eq!(with_width(128), 1);
        assert_eq!(with_width(127), 0);
    }

    #[test]
    fn only_groups_that_hold_a_callers_row_run() {
        let g = Grouping {
            whole: "prefill-b128-s128.ron".into(),
            part: "prefill-b32-s128.ron".into(),
            count: 4,
            rows: 32,
        };
        let runs: Vec<usize> = [0, 1, 32, 33, 64, 65, 96, 97, 128, 200]
            .map(|rows| g.groups_for(rows))
            .into();
        assert_eq!(runs, vec![1, 1, 1, 2, 2, 3, 3, 4, 4, 4]);
    }

    /// Groupings of a 128-row bucket by 64, 32 and 16 rows, timed (ms) as given.
    fn timings(whole: f64, by64: f64, by32: f64, by16: f64) -> Timings {
        let by = |rows: usize, t: f64| {
            let g = Grouping {
                whole: "prefill-b128-s128.ron".into(),
                part: format!("prefill-b{rows}-s128.ron"),
                count: 128 / rows,
                rows,
            };
            (g, t)
        };
        Timings {
            whole,
            ways: vec![by(64, by64), by(32, by32), by(16, by16)],
        }
    }

    fn picked(t: &Timings, rows: usize) -> Option<usize> {
        t.pick(rows).map(|g| g.rows)
    }

    #[test]
    fn a_request_takes_the_way_its_rows_make_fastest() {
        // BERT-base on an H200: 64-row groups fastest when full.
        let t = timings(6.45, 6.15, 6.20, 6.60);
        assert_eq!(picked(&t, 128), Some(64));
        assert_eq!(picked(&t, usize::MAX), Some(64));
        // 80 rows: two groups of 64 (6.15) against three of 32 (4.65) and five of 16 (4.13).
        assert_eq!(picked(&t, 80), Some(16));
        assert_eq!(picked(&t, 96), Some(32));
        assert_eq!(picked(&t, 65), Some(16));
        assert_eq!(picked(&t, 1), Some(16));
        assert_eq!(t.used().len(), 3);
        // Within 1% of one replay, a full bucket stays whole; a padded one need not.
        let close = timings(6.45, 6.40, 6.44, 7.0);
        assert_eq!(picked(&close, 128), None);
        assert_eq!(picked(&close, 64), Some(64));
        assert_eq!(picked(&close, 32), Some(32));
        // Groups that cost far more a row stay unused, whatever the rows.
        let slow = timings(6.45, 14.0, 28.0, 56.0);
        assert!((1..=128).all(|rows| slow.pick(rows).is_none()));
        assert!(slow.used().is_empty());
    }

    #[test]
    fn groups_take_consecutive_rows() {
        let ids = Tensor::i64(vec![4, 2], (0..8).collect());
        let inputs = [("input_ids", &ids)];
        let second = group_inputs(&inputs, 1, 2);
        assert_eq!(
            second["input_ids"],
            Tensor::i64(vec![2, 2], vec![4, 5, 6, 7])
        );
        let last = group_inputs(&inputs, 3, 4);
        assert_eq!(last["input_ids"], Tensor::i64(vec![1, 2], vec![6, 7]));
    }
}
