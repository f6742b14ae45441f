//! Where a bucket runs: the CUDA executor (graphs captured at load) or, on a machine without a
//! GPU, the reference interpreter. Both take the same inputs by name and give the same outputs;
//! the CUDA executor keeps the KV cache on the device between steps.

use std::collections::BTreeMap;

use kiln_ir::artifact::{BucketEntry, CachePaging, ADVANCED_INPUTS, LOGITS};
use kiln_ir::{Data, Tensor};

use crate::cpu::CpuExecutor;
use crate::cuda::CudaExecutor;
use crate::{Artifact, RuntimeError};

/// The prefix of the GPU values a host tail reads (not outputs of the model).
const HOST_VALUE: &str = "kiln.value.";

/// Which executor to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a GPU is present, the CPU otherwise.
    Auto,
    /// The CPU: the artifact's generated kernels.
    Cpu,
    /// The GPU.
    Cuda,
    /// The reference interpreter over the bucket graphs (slow; needs no code of the artifact:
    /// for checking results, or a machine the artifact's CPU library does not run on).
    Interpreter,
}

/// A loaded executor.
pub enum Executor {
    /// The reference interpreter.
    Interpreter,
    /// The CUDA executor.
    Cuda(Box<CudaExecutor>),
    /// The CPU executor (generated kernels and a GEMM library).
    Cpu(Box<CpuExecutor>),
}

/// The buckets a CUDA executor loads: all of them, or only what generation runs (the decode steps
/// and the prompt chunk), which spares a generating process the prefill buckets' captures and an
/// output buffer sized for their logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Every bucket.
    All,
    /// The KV-cached buckets only.
    Generation,
}

impl Executor {
    /// Loads `art` on `device` (`Auto`: CUDA when [`crate::cuda::probe`] finds a GPU), every bucket.
    pub fn open(art: &Artifact, device: Device) -> Result<Executor, RuntimeError> {
        Executor::open_for(art, device, Work::All)
    }

    /// Loads `art` on `device` for `work` (the CPU executor and the interpreter load everything).
    pub fn open_for(art: &Artifact, device: Device, work: Work) -> Result<Executor, RuntimeError> {
        let cuda = match device {
            Device::Interpreter => return Ok(Executor::Interpreter),
            Device::Cpu => false,
            Device::Cuda => true,
            Device::Auto => crate::cuda::probe().is_ok(),
        };
        if cuda {
            return Ok(Executor::Cuda(Box::new(CudaExecutor::load(art, work)?)));
        }
        let cpu = CpuExecutor::load(art).map_err(|e| match e {
            RuntimeError::Device(why) => {
                RuntimeError::Device(format!("{why}; --device interpreter runs it without"))
            }
            e => e,
        })?;
        Ok(Executor::Cpu(Box::new(cpu)))
    }

    /// The last logits chunk's size the CUDA executor chose at load
    /// ([`crate::forward::time_last_chunk`]); `None` elsewhere.
    pub fn last_logits_chunk(&self) -> Option<usize> {
        match self {
            Executor::Cuda(c) => c.last_logits_chunk(),
            _ => None,
        }
    }

    /// What runs requests, in words.
    pub fn describe(&self) -> String {
        match self {
            Executor::Interpreter => "cpu (reference interpreter)".into(),
            Executor::Cpu(_) => "cpu (generated kernels)".into(),
            Executor::Cuda(c) => format!("cuda: {}", c.device),
        }
    }

    /// Whether the KV cache lives in the executor (so callers neither pass nor receive it).
    pub fn keeps_cache(&self) -> bool {
        matches!(self, Executor::Cuda(_) | Executor::Cpu(_))
    }

    /// Runs `entry`'s graph on `inputs` (by input name).
    pub fn run(
        &mut self,
        art: &Artifact,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        self.run_rows(art, entry, inputs, entry.batch)
    }

    /// [`Self::run`] where only the outputs' first `rows` rows are the caller's, the bucket's
    /// others padding: what they hold is unspecified (the CUDA executor may leave groups of
    /// them uncomputed, and gives them as zeros, [`crate::cuda::CudaExecutor::run`]).
    pub fn run_rows(
        &mut self,
        art: &Artifact,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
        rows: usize,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let interpret = |inputs: &BTreeMap<String, Tensor>| {
            let weights = art.weights.as_ref().ok_or_else(|| {
                RuntimeError::Request("the artifact was compiled with --no-weights".into())
            })?;
            kiln_ir::evaluate(&art.graphs[&entry.graph], inputs, weights)
                .map_err(|e| RuntimeError::Request(format!("evaluation failed: {e}")))
        };
        let outputs = match self {
            Executor::Interpreter => return interpret(inputs),
            Executor::Cpu(c) if !c.has(&entry.graph) => {
                return Err(RuntimeError::Device(format!(
                    "bucket {} has ops without a CPU kernel ({}); --device interpreter runs it",
                    entry.graph,
                    entry.no_cpu.join(", ")
                )));
            }
            // The CPU plan covers the whole graph, what the GPU leaves to its host tail included.
            Executor::Cpu(c) => return c.run(entry, inputs),
            Executor::Cuda(c) => {
                if !c.has(&entry.graph) {
                    return Err(RuntimeError::Device(format!(
                        "bucket {} has ops without a GPU kernel ({}); use --device cpu",
                        entry.graph,
                        entry.no_gpu.join(", ")
                    )));
                }
                c.run(&entry.graph, inputs, rows)?
            }
        };
        host_tail(art, entry, inputs, outputs)
    }

    /// Runs the decode step `entry` on `inputs` and returns the greedy token of each row chosen
    /// on the device, when the executor and the bucket's plan choose them there (the CUDA
    /// executor; only the token ids come back); `None` otherwise, with nothing run.
    pub fn run_greedy(
        &mut self,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<Option<Vec<i64>>, RuntimeError> {
        match self {
            Executor::Cuda(c) if c.has(&entry.graph) => c.replay_tokens(&entry.graph, inputs),
            _ => Ok(None),
        }
    }

    /// Runs the decode step `entry` on `inputs` and samples each row's token on the device under
    /// `params` (four 32-bit words per row, see [`crate::cuda::CudaExecutor::replay_sampled`]):
    /// the picks of [`crate::generate::choose`], with only the token ids coming back. `None`,
    /// with nothing run, where the executor or the bucket's plan has no such sampler.
    pub fn run_sampled(
        &mut self,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
        params: &[[u32; 4]],
    ) -> Result<Option<Vec<i64>>, RuntimeError> {
        match self {
            Executor::Cuda(c) if c.has(&entry.graph) => {
                c.replay_sampled(&entry.graph, inputs, params)
            }
            _ => Ok(None),
        }
    }

    /// Runs the decode step `entry` `steps` times from `inputs` (the first step's), each step
    /// taking the tokens the one before chose greedily as its ids at the next positions
    /// ([`advance`]), and returns each step's tokens: on CUDA without the host in between (plans
    /// that advance their inputs on the device), on the CPU executor step by step on the host.
    /// `None` where neither applies (the interpreter, whose cache the caller keeps).
    pub fn run_greedy_steps(
        &mut self,
        art: &Artifact,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
        steps: usize,
    ) -> Result<Option<Vec<Vec<i64>>>, RuntimeError> {
        match self {
            Executor::Cuda(c) if c.has(&entry.graph) => c.replay_steps(&entry.graph, inputs, steps),
            Executor::Cpu(c)
                if c.has(&entry.graph)
                    && ADVANCED_INPUTS.iter().all(|n| inputs.contains_key(*n)) =>
            {
                self.chain_on_host(art, entry, inputs, steps).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Launches the decode step `entry` over the inputs its last run left (a plan that advances
    /// them: each row's chosen token at its next position), its tokens copied back behind it,
    /// without waiting; [`Executor::read_launched`] reads them. `false`, with nothing launched,
    /// where the executor or the plan cannot (only CUDA plans that advance their inputs can).
    pub fn launch_advanced(&mut self, entry: &BucketEntry) -> Result<bool, RuntimeError> {
        match self {
            Executor::Cuda(c) if c.has(&entry.graph) => c.launch_advanced(&entry.graph),
            _ => Ok(false),
        }
    }

    /// Waits for the step [`Executor::launch_advanced`] launched and returns its tokens.
    pub fn read_launched(&mut self, entry: &BucketEntry) -> Result<Vec<i64>, RuntimeError> {
        match self {
            Executor::Cuda(c) => c.read_launched(&entry.graph),
            _ => Err(RuntimeError::Request(format!(
                "no decode step of {} was launched ahead",
                entry.graph
            ))),
        }
    }

    /// [`Executor::run_greedy_steps`] with the host between the steps: each step runs, its
    /// greedy tokens are chosen from its logits, and [`advance`] makes the next step's inputs.
    fn chain_on_host(
        &mut self,
        art: &Artifact,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
        steps: usize,
    ) -> Result<Vec<Vec<i64>>, RuntimeError> {
        let mut inputs = inputs.clone();
        let vocab = art.manifest.model.vocab_size;
        let greedy = crate::generate::Sampling::greedy();
        let mut all = Vec::with_capacity(steps);
        for _ in 0..steps {
            let outputs = self.run(art, entry, &inputs)?;
            let Some(Data::Float(logits)) = outputs.get(LOGITS).map(|t| &t.data) else {
                return Err(RuntimeError::Request(
                    "the decode graph has no float logits".into(),
                ));
            };
            let tokens = logits
                .chunks(vocab)
                .map(|row| Ok(self.choose(row, &greedy, 0)? as i64))
                .collect::<Result<Vec<i64>, RuntimeError>>()?;
            advance(&mut inputs, &tokens)?;
            all.push(tokens);
        }
        Ok(all)
    }

    /// The token for one row of `logits` under `sampling` at generation step `step`: the
    /// artifact's generated sampler on the CPU executor, else the runtime's reference
    /// ([`crate::generate::choose`]); both have the same semantics.
    pub fn choose(
        &mut self,
        logits: &[f32],
        sampling: &crate::generate::Sampling,
        step: u32,
    ) -> Result<usize, RuntimeError> {
        sampling.validate()?;
        if let Executor::Cpu(c) = self {
            if let Some(token) = c.choose(logits, sampling, step)? {
                return Ok(token);
            }
        }
        Ok(crate::generate::choose(logits, sampling, step))
    }

    /// Per-kernel timing of later requests (`kiln-run bench --profile`): CUDA launches the steps
    /// one by one instead of replaying graphs; the interpreter has no kernels to time.
    pub fn set_profiling(&mut self, on: bool) {
        match self {
            Executor::Interpreter => {}
            Executor::Cpu(c) => c.set_profiling(on),
            Executor::Cuda(c) => c.set_profiling(on),
        }
    }

    /// Copies row `from` of every slot of the dense KV cache the executor keeps to row `to` (a
    /// prompt entered through the chunk bucket, moved to its sequence's row of a batched decode;
    /// a paged cache is an error: its rows move through the block table); the interpreter's
    /// cache is the caller's.
    pub fn copy_cache_row(&mut self, from: usize, to: usize) -> Result<(), RuntimeError> {
        match self {
            Executor::Interpreter => Ok(()),
            Executor::Cpu(c) => c.copy_cache_row(from, to),
            Executor::Cuda(c) => c.copy_cache_row(from, to),
        }
    }

    /// Writes the block table of the paged KV cache the executor keeps (the interpreter's
    /// caches are dense tensors: nothing to write).
    pub fn write_block_table(&mut self, table: &[u32]) -> Result<(), RuntimeError> {
        match self {
            Executor::Interpreter => Ok(()),
            Executor::Cpu(c) => c.write_block_table(table),
            Executor::Cuda(c) => c.write_block_table(table),
        }
    }

    /// Empties the KV cache the executor keeps (a new generation).
    pub fn reset_cache(&mut self) -> Result<(), RuntimeError> {
        match self {
            Executor::Interpreter => Ok(()),
            Executor::Cpu(c) => {
                c.reset_cache();
                Ok(())
            }
            Executor::Cuda(c) => c.reset_cache(),
        }
    }
}

/// What a decode step that advances its inputs leaves for the next step (the device's
/// `argmax_advance`): each row whose `attention_mask` is not 0 gets its chosen token as its
/// `input_ids` and its `position_ids` one further; masked rows keep theirs.
pub fn advance(inputs: &mut BTreeMap<String, Tensor>, tokens: &[i64]) -> Result<(), RuntimeError> {
    let int =
        |inputs: &BTreeMap<String, Tensor>, name: &str| match inputs.get(name).map(|t| &t.data) {
            Some(Data::Int(v)) if v.len() == tokens.len() => Ok(v.clone()),
            _ => Err(RuntimeError::Request(format!(
                "a decode step takes `{name}` as one i64 per row ({} rows)",
                tokens.len()
            ))),
        };
    let [ids_name, positions_name, mask_name] = ADVANCED_INPUTS;
    let mask = int(inputs, mask_name)?;
    let mut ids = int(inputs, ids_name)?;
    let mut positions = int(inputs, positions_name)?;
    for (r, &token) in tokens.iter().enumerate().filter(|(r, _)| mask[*r] != 0) {
        ids[r] = token;
        positions[r] += 1;
    }
    for (name, values) in [(ids_name, ids), (positions_name, positions)] {
        if let Some(t) = inputs.get_mut(name) {
            t.data = Data::Int(values);
        }
    }
    Ok(())
}

/// Finishes a plan's outputs with its host tail, when it has one: the ops without a kernel, on
/// the host, from the values the plan computed (`kiln.value.N`) and the request's inputs.
fn host_tail(
    art: &Artifact,
    entry: &BucketEntry,
    inputs: &BTreeMap<String, Tensor>,
    mut outputs: BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let Some(tail) = entry.plan.as_ref().and_then(|p| p.host_tail.as_ref()) else {
        return Ok(outputs);
    };
    let weights = art.weights.as_ref().ok_or_else(|| {
        RuntimeError::Request("the artifact was compiled with --no-weights".into())
    })?;
    let mut tail_inputs = BTreeMap::new();
    for (_, name, _) in tail.inputs() {
        let t = outputs
            .get(name)
            .or_else(|| inputs.get(name))
            .ok_or_else(|| {
                art.plan_error(
                    entry,
                    format!("the host tail reads `{name}`, which nothing provides"),
                )
            })?;
        tail_inputs.insert(name.to_string(), t.clone());
    }
    let host = kiln_ir::evaluate(tail, &tail_inputs, weights)
        .map_err(|e| RuntimeError::Request(format!("host tail evaluation failed: {e}")))?;
    outputs.retain(|name, _| !name.starts_with(HOST_VALUE));
    outputs.extend(host);
    Ok(outputs)
}

/// The byte offset in the cache region of `paging`'s block table, once `table` is checked to
/// fill it exactly with blocks of the pools (the kernels trust every entry).
pub(crate) fn block_table_at(
    paging: Option<&CachePaging>,
    table: &[u32],
) -> Result<usize, RuntimeError> {
    let p = paging
        .ok_or_else(|| RuntimeError::Request("the artifact's KV cache is not paged".into()))?;
    if table.len() != p.rows * p.entries {
        return Err(RuntimeError::Request(format!(
            "a block table of {} entries; the cache's holds {}",
            table.len(),
            p.rows * p.entries
        )));
    }
    if let Some(b) = table.iter().find(|&&b| b as usize >= p.blocks) {
        return Err(RuntimeError::Request(format!(
            "block {b} in a block table of {} blocks",
            p.blocks
        )));
    }
    Ok(p.table as usize)
}

/// The copies that move row `from` of every slot of a dense cache to row `to`: `(source,
/// destination, bytes)`, offsets within the cache region (a slot's leading axis is the decode
/// batch). A paged cache (`paging`) moves rows by its block table instead: an error.
pub(crate) fn cache_row_copies(
    slots: &[kiln_ir::artifact::TensorSlot],
    paging: Option<&CachePaging>,
    from: usize,
    to: usize,
) -> Result<Vec<(u64, u64, u64)>, RuntimeError> {
    if paging.is_some() {
        return Err(RuntimeError::Request(
            "a paged KV cache moves rows through its block table, not by copies".into(),
        ));
    }
    slots
        .iter()
        .map(|slot| {
            let rows = slot.shape.first().copied().unwrap_or(0);
            if from >= rows || to >= rows {
                return Err(RuntimeError::Request(format!(
                    "cache row {} is outside {}'s {rows} rows",
                    from.max(to),
                    slot.name
                )));
            }
            let row = slot.bytes() / rows as u64;
            Ok((
                slot.offset + from as u64 * row,
                slot.offset + to as u64 * row,
                row,
            ))
        })
        .collect()
}
