//! Batch groups on the GPU ([`crate::groups`]): a bucket replayed as groups of a smaller one.
//! After each group's replay its outputs move, on the replay stream, from the arena into one of
//! the copy ring's two buffers, and go from there to their rows of the staging buffer on the
//! copy stream while the next group computes. Copying device to device (some microseconds)
//! leaves the arena and the captured graphs as they are.

use std::collections::{BTreeMap, BTreeSet};

use kiln_ir::artifact::TensorSlot;
use kiln_ir::{DType, Tensor};

use super::{dev, packed, CudaExecutor};
use crate::forward::{fastest, time_interleaved};
use crate::groups::{group_inputs, Grouping, MIN_GAIN};
use crate::RuntimeError;

impl CudaExecutor {
    /// The groupings load kept, by the graph file of the bucket each groups.
    pub fn batch_groups(&self) -> &BTreeMap<String, Grouping> {
        &self.grouped
    }

    /// Runs bucket `whole` (its graph file) as groups of bucket `part` from now on, or with
    /// `None` as one replay: what load chose by timing, set by hand (tests, measurements).
    /// `Err` unless `part`'s batch divides `whole`'s and the two compute alike
    /// ([`crate::groups::candidates`]).
    pub fn group_bucket(&mut self, whole: &str, part: Option<&str>) -> Result<(), RuntimeError> {
        let Some(part) = part else {
            self.grouped.remove(whole);
            return Ok(());
        };
        let grouping = self
            .groupings
            .iter()
            .find(|g| g.whole == whole && g.part == part)
            .ok_or_else(|| {
                RuntimeError::Request(format!("bucket {whole} does not run as groups of {part}"))
            })?;
        self.grouped.insert(whole.to_string(), grouping.clone());
        Ok(())
    }

    /// Times each bucket that has groupings as one replay and as each of them
    /// ([`time_interleaved`], inputs of zeros as at capture) and keeps the fastest grouping
    /// where it beats one replay by [`MIN_GAIN`]; not under `KILN_EAGER`. Leaves no replay
    /// counted.
    pub(super) fn time_groups(&mut self) -> Result<(), RuntimeError> {
        if self.eager || self.groupings.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let wholes: BTreeSet<String> = self.groupings.iter().map(|g| g.whole.clone()).collect();
        for whole in wholes {
            let inputs = self.zero_inputs(&whole);
            let ways: Vec<Option<Grouping>> = std::iter::once(None)
                .chain(
                    self.groupings
                        .iter()
                        .filter(|g| g.whole == whole)
                        .cloned()
                        .map(Some),
                )
                .collect();
            let times = time_interleaved(ways.len(), |i| {
                match &ways[i] {
                    Some(g) => self.grouped.insert(whole.clone(), g.clone()),
                    None => self.grouped.remove(&whole),
                };
                self.replay(&whole, &inputs).map(|_| ())
            })?;
            let timed: Vec<(Option<usize>, f64)> = (0..ways.len())
                .map(|i| ways[i].as_ref().map(|_| i))
                .zip(times)
                .collect();
            self.grouped.remove(&whole);
            if let Some(i) = fastest(&timed, MIN_GAIN) {
                let g = ways[i].clone().expect("a grouping");
                tracing::info!(bucket = %whole, part = %g.part, groups = g.count, "batch groups kept");
                self.grouped.insert(whole, g);
            }
        }
        self.replays.clear();
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            kept = self.grouped.len(),
            "batch groups timed"
        );
        Ok(())
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

    /// Replays `grouping.whole` as its groups, each group's outputs copied to their rows of the
    /// staging buffer while the next computes; the outputs as [`Self::replay`] gives them.
    pub(super) fn replay_grouped(
        &mut self,
        grouping: &Grouping,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<Vec<(&TensorSlot, &[u8])>, RuntimeError> {
        let outcome = self.stream_groups(grouping, inputs);
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

    /// Launches the groups of `grouping`, each with its rows of `inputs`, its outputs moved to
    /// ring buffer `g % 2` and copied from there, without waiting.
    fn stream_groups(
        &mut self,
        grouping: &Grouping,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<(), RuntimeError> {
        let part = self.plans[&grouping.part].outputs.clone();
        let whole = packed(&self.plans[&grouping.whole].outputs);
        let arena = self.addresses.base + self.arena;
        for g in 0..grouping.count {
            let k = g % 2;
            let ring = self.ring.as_ref().expect("groupings load with the ring");
            if g >= 2 {
                // Buffer `k` takes this group's outputs after the copy out of the group two before.
                self.stream.wait(&ring.copied[k]).map_err(dev)?;
            }
            let buffer = ring.buffer(&self.stream, k);
            self.launch(&grouping.part, &group_inputs(inputs, g, grouping.count))?;
            let mut at = 0usize;
            for (slot, rows) in part.iter().zip(&whole) {
                let n = slot.bytes() as usize;
                // SAFETY: the source is the part's output slot inside the one allocation
                // (`check_plan`); the destination, bytes `at..at + n` of buffer `k`, lies inside
                // it (`staging_and_ring` sized the buffers for every part's outputs together),
                // which no copy reads until this stream records `ready[k]` after it.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        buffer + at as u64,
                        arena + slot.offset,
                        n,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(dev)?;
                // The group's rows of the whole bucket's output.
                self.copy_out(k, rows.start + g * n, at..at + n)?;
                at += n;
            }
            let ring = self.ring.as_ref().expect("groupings load with the ring");
            ring.copied[k].record(&ring.copies).map_err(dev)?;
        }
        Ok(())
    }
}
