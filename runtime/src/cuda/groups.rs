//! Batch groups on the GPU ([`crate::groups`]): a bucket replayed as groups of a smaller one.
//! After each group's replay its outputs move, on the replay stream, from the arena into one of
//! the copy ring's two buffers, and go from there to their rows of the staging buffer on the
//! copy stream while the next group computes. Copying device to device (some microseconds)
//! leaves the arena and the captured graphs as they are.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use kiln_ir::artifact::TensorSlot;
use kiln_ir::{DType, Tensor};

use super::{dev, packed, CopyRing, CudaExecutor};
use crate::forward::time_interleaved;
use crate::groups::{group_inputs, outputs_bytes, Grouping, Timings};
use crate::RuntimeError;

/// How a bucket that has groupings runs.
#[derive(Clone, Debug)]
pub(super) enum Choice {
    /// By load's timings, request by request ([`Timings::pick`]).
    Timed(Timings),
    /// As set by hand ([`CudaExecutor::group_bucket`]): always as this grouping, or as one
    /// replay.
    Fixed(Option<Grouping>),
}

impl Choice {
    /// The grouping a request whose first `rows` rows are its own runs as.
    fn pick(&self, rows: usize) -> Option<&Grouping> {
        match self {
            Choice::Timed(t) => t.pick(rows),
            Choice::Fixed(g) => g.as_ref(),
        }
    }
}

impl CudaExecutor {
    /// The grouping a full request of each bucket runs as, by the bucket's graph file (those
    /// that run as one replay left out). A request that fills part of a bucket may run as
    /// another ([`Timings::pick`]).
    pub fn batch_groups(&self) -> BTreeMap<String, Grouping> {
        // As many rows as any bucket holds: every group of each.
        self.choices
            .iter()
            .filter_map(|(whole, c)| Some((whole.clone(), c.pick(usize::MAX)?.clone())))
            .collect()
    }

    /// The grouping bucket `graph` runs as for a request whose first `rows` rows are its own,
    /// if any: none where the copy ring cannot hold a group's outputs (its reallocation by
    /// [`Self::group_bucket`] failed).
    pub fn grouping_for(&self, graph: &str, rows: usize) -> Option<Grouping> {
        let g = self.choices.get(graph)?.pick(rows)?;
        let fits = self
            .ring
            .as_ref()
            .is_some_and(|r| r.half >= self.part_bytes(g));
        fits.then(|| g.clone())
    }

    /// Runs bucket `whole` (its graph file) as groups of bucket `part` from now on, or with
    /// `None` as one replay, whatever a request's rows: load's timed choice set by hand (tests,
    /// measurements). `Err` unless `part`'s batch divides `whole`'s and the two compute alike
    /// ([`crate::groups::candidates`]). Where the copy ring load left is too small for a
    /// group's outputs (load fits it to the groupings requests take), it is allocated again:
    /// the one allocation this may make.
    pub fn group_bucket(&mut self, whole: &str, part: Option<&str>) -> Result<(), RuntimeError> {
        let Some(part) = part else {
            self.choices.insert(whole.to_string(), Choice::Fixed(None));
            return Ok(());
        };
        let grouping = self
            .groupings
            .iter()
            .find(|g| g.whole == whole && g.part == part)
            .ok_or_else(|| {
                RuntimeError::Request(format!("bucket {whole} does not run as groups of {part}"))
            })?
            .clone();
        let need = self.part_bytes(&grouping);
        if self.ring.as_ref().is_none_or(|r| r.half < need) {
            self.new_ring(need)?;
        }
        self.choices
            .insert(whole.to_string(), Choice::Fixed(Some(grouping)));
        Ok(())
    }

    /// Device bytes of the copy ring's two buffers (0 without one).
    pub fn copy_ring_bytes(&self) -> u64 {
        self.ring.as_ref().map_or(0, |r| 2 * r.half as u64)
    }

    /// Bytes of a group's outputs together (what a ring buffer holds of them).
    fn part_bytes(&self, grouping: &Grouping) -> usize {
        outputs_bytes(&self.plans[&grouping.part]) as usize
    }

    /// After [`Self::time_groups`]: the copy ring only as large as what runs through it. A ring
    /// that logits chunks' graphs write into stays as it is; otherwise one that no request
    /// groups through is freed, and one larger than the groupings requests take need
    /// ([`Timings::used`]) is allocated again at their size (load sized it for every candidate,
    /// [`super::staging_and_ring`]).
    pub(super) fn fit_ring(&mut self) -> Result<(), RuntimeError> {
        let Some(ring) = &self.ring else {
            return Ok(());
        };
        if !ring.graphs.is_empty() {
            return Ok(());
        }
        let used = self.choices.values().flat_map(|c| match c {
            Choice::Timed(t) => t.used(),
            Choice::Fixed(g) => g.iter().collect(),
        });
        let need = used.map(|g| self.part_bytes(g)).max();
        match need {
            None => self.ring = None,
            Some(need) if need < ring.half => self.new_ring(need)?,
            Some(_) => {}
        }
        Ok(())
    }

    /// A copy ring of two buffers of `half` bytes in place of the one there is, which holds no
    /// logits chunks' graphs (they write into its buffers). The old buffers are freed first, once
    /// the streams are done with them, so that both never take the memory at once.
    fn new_ring(&mut self, half: usize) -> Result<(), RuntimeError> {
        if self.ring.as_ref().is_some_and(|r| !r.graphs.is_empty()) {
            return Err(RuntimeError::Device(
                "the copy ring holds logits chunks' graphs and cannot be replaced".into(),
            ));
        }
        if let Some(old) = self.ring.take() {
            self.stream.synchronize().map_err(dev)?;
            old.copies.synchronize().map_err(dev)?;
        }
        self.ring = Some(CopyRing::new(
            &self.ctx,
            &self.stream,
            half,
            &mut self.counts,
        )?);
        Ok(())
    }

    /// Times each bucket that has groupings as one replay and as each of them
    /// ([`time_interleaved`], inputs of zeros as at capture), after which each request takes
    /// the way its rows make fastest ([`Timings::pick`]); not under `KILN_EAGER`, where every
    /// bucket runs as one replay. Leaves no replay counted.
    pub(super) fn time_groups(&mut self) -> Result<(), RuntimeError> {
        if self.eager || self.groupings.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let wholes: BTreeSet<String> = self.groupings.iter().map(|g| g.whole.clone()).collect();
        for whole in wholes {
            let timings = self.time_ways(&whole)?;
            self.choices.insert(whole, Choice::Timed(timings));
        }
        self.replays.clear();
        let full = self.batch_groups();
        for (whole, g) in &full {
            tracing::info!(bucket = %whole, part = %g.part, groups = g.count, "batch groups kept");
        }
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            kept = full.len(),
            "batch groups timed"
        );
        Ok(())
    }

    /// Bucket `whole` timed as one replay and as each of its groupings.
    fn time_ways(&mut self, whole: &str) -> Result<Timings, RuntimeError> {
        let inputs = self.zero_inputs(whole);
        let groupings: Vec<Grouping> = self
            .groupings
            .iter()
            .filter(|g| g.whole == whole)
            .cloned()
            .collect();
        // Way 0 is one replay, way i + 1 grouping i, every row the caller's.
        let times = time_interleaved(groupings.len() + 1, |way| {
            let grouping = way.checked_sub(1).map(|i| &groupings[i]);
            self.replay_as(whole, &inputs, usize::MAX, grouping)
                .map(|_| ())
        });
        let times = times?;
        Ok(Timings {
            whole: times[0],
            ways: groupings
                .into_iter()
                .zip(times[1..].iter().copied())
                .collect(),
        })
    }

    /// Zeros for every input of bucket `graph` (token 0, masked, position 0), as capture runs it.
    fn zero_inputs(&self, graph: &str) -> BTreeMap<String, Tensor> {
        self.plans[graph]
            .inputs
            .iter()
            .map(|slot| {
                let zeros = vec![0; slot.shape.iter().product()];
                (
                    slot.name.clone(),
                    Tensor::int(DType::I64, slot.shape.clone(), zeros),
                )
            })
            .collect()
    }

    /// Replays `grouping.whole` as those of its groups that hold the first `rows` rows, each
    /// group's outputs copied to their rows of the staging buffer while the next computes; the
    /// outputs as [`Self::replay_rows`] gives them.
    pub(super) fn replay_grouped(
        &mut self,
        grouping: &Grouping,
        inputs: &BTreeMap<String, Tensor>,
        rows: usize,
    ) -> Result<Vec<(&TensorSlot, &[u8])>, RuntimeError> {
        // The whole bucket's inputs, as one replay would take them.
        let tensors = self.checked_inputs(&grouping.whole, inputs)?;
        let slots = &self.plans[&grouping.whole].inputs;
        let whole: Vec<(String, &Tensor)> =
            slots.iter().map(|s| s.name.clone()).zip(tensors).collect();
        let outcome = self.stream_groups(grouping, &whole, grouping.groups_for(rows));
        let synced = self.settle(&grouping.whole);
        outcome?;
        synced?;
        let staging: &[u8] = self.staging.as_slice().map_err(dev)?;
        let outputs = &self.plans[&grouping.whole].outputs;
        Ok(outputs
            .iter()
            .zip(packed(outputs))
            .map(|(slot, r)| (slot, &staging[r]))
            .collect())
    }

    /// Launches the first `groups` groups of `grouping`, each with its rows of `inputs`, its
    /// outputs moved to a ring buffer and copied from there, without waiting.
    fn stream_groups(
        &mut self,
        grouping: &Grouping,
        inputs: &[(String, &Tensor)],
        groups: usize,
    ) -> Result<(), RuntimeError> {
        let inputs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        let arena = self.addresses.base + self.arena;
        let (part, whole) = (
            &self.plans[&grouping.part].outputs,
            &self.plans[&grouping.whole].outputs,
        );
        let sources: Vec<u64> = part.iter().map(|s| arena + s.offset).collect();
        let groups: Vec<_> = (0..groups).map(|g| group_copies(whole, part, g)).collect();
        let need = self.part_bytes(grouping);
        if self.ring.as_ref().is_none_or(|r| r.half < need) {
            return Err(RuntimeError::Device(format!(
                "batch groups of {} need a copy ring of {need} bytes a buffer",
                grouping.part
            )));
        }
        for (g, copies) in groups.into_iter().enumerate() {
            let ring = self.ring()?;
            let k = ring.take(&self.stream, g)?;
            let buffer = ring.buffer(&self.stream, k);
            self.launch(&grouping.part, &group_inputs(&inputs, g, grouping.count))?;
            for (&source, (within, at)) in sources.iter().zip(copies) {
                // SAFETY: the source is the part's output slot inside the one allocation
                // (`check_plan`); the destination, `within` of buffer `k`, lies inside it (a
                // buffer holds the part's outputs together, checked above). No copy still
                // reads it: `take` waited for the copy out of the group two before, and
                // a stream before this one was settled. The copy out below waits for this one.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        buffer + within.start as u64,
                        source,
                        within.len(),
                        self.stream.cu_stream(),
                    )
                }
                .map_err(dev)?;
                self.copy_out(k, at, within)?;
            }
            self.ring()?.release(k)?;
        }
        Ok(())
    }
}

/// Where group `g`'s outputs go: for each of the part's output slots, the bytes it takes in a
/// ring buffer (the slots one after the other) and where they land in the staging buffer (the
/// group's rows of the whole's slot, the whole's slots one after the other, as one replay
/// copies them).
fn group_copies(whole: &[TensorSlot], part: &[TensorSlot], g: usize) -> Vec<(Range<usize>, usize)> {
    part.iter()
        .zip(packed(part).into_iter().zip(packed(whole)))
        .map(|(slot, (within, rows))| (within, rows.start + g * slot.bytes() as usize))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::groups::tests::slot;

    /// A bucket of 8 rows as groups of 2: each group's rows of each output land after the
    /// rows of the groups before, the outputs one after the other as one replay copies them.
    #[test]
    fn a_groups_outputs_land_at_its_rows_of_each_output() {
        let outputs = |b| {
            vec![
                slot("last_hidden_state", DType::BF16, &[b, 3, 4]),
                slot("kiln.value.7", DType::F32, &[b, 5]),
            ]
        };
        let (whole, part) = (outputs(8), outputs(2));
        // Whole: 8 x 3 x 4 x 2 = 192 bytes, then 8 x 5 x 4 = 160. Part: 48, then 40.
        assert_eq!(
            group_copies(&whole, &part, 0),
            vec![(0..48, 0), (48..88, 192)]
        );
        assert_eq!(
            group_copies(&whole, &part, 3),
            vec![(0..48, 144), (48..88, 192 + 120)]
        );
    }
}
