//! The CUDA executor: one device allocation for the whole memory plan, the weights uploaded once,
//! the kernel module loaded once (the cubin when it matches the GPU, else the PTX), and one CUDA
//! graph per bucket captured at load, largest first (the faster of two ways to launch its
//! steps, `Loaded::capture_faster`). A request copies its inputs into their arena
//! slots, replays its bucket's graph, and copies the outputs back: nothing is compiled, captured
//! or allocated after load, and the counters (`counts.rs`: every module load, PTX JIT, capture
//! and allocation, counted where the executor asks the driver for it) measure it.
//!
//! NVTX ranges (no-ops unless a tool such as Nsight Systems is attached) name the load, each
//! bucket's capture (`kiln capture <bucket>`), each replay (`kiln <bucket>`) and, when
//! profiling or capturing, each step (`<node> <kernel>`), so that a timeline shows kiln's names.
//!
//! cudarc loads libcuda dynamically, so this builds (and the rest of the runtime runs) on machines
//! without a CUDA toolkit or driver; [`CudaExecutor::load`] says why it cannot run there.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr,
    LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;
use kiln_ir::artifact::{
    Arg, BucketEntry, CachePaging, ExecPlan, Image, KernelEntry, Manifest, ParamType, Region, Step,
    TensorSlot, LOGITS,
};
use kiln_ir::{DType, Data, Tensor};

use crate::executor::Work;
use crate::forward::{fastest, time_interleaved};
use crate::groups::{outputs_bytes, Grouping};
use crate::{Artifact, RuntimeError};
use launch::ArgValue;

mod counts;
mod groups;
mod launch;
mod tma;
pub use counts::DriverCounts;
pub use tma::{encode as encode_tensor_map, TensorMap};

/// What the executor has done: replays since load, and the driver work it did during load and
/// since.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    /// Graph replays per bucket graph file.
    pub replays: BTreeMap<String, u64>,
    /// Module loads, PTX JIT compilations, captures and allocations during load.
    pub at_load: DriverCounts,
    /// The same, after load (all zero unless something compiled, captured or allocated late).
    pub after_load: DriverCounts,
}

/// A loaded artifact on a GPU, ready to replay.
pub struct CudaExecutor {
    /// Page-locked host memory the outputs are copied into (the largest bucket's outputs).
    staging: PinnedHostSlice<u8>,
    functions: Kernels,
    addresses: Addresses,
    /// `KILN_EAGER` set: replays launch the steps one by one and synchronise after each, so that
    /// a failing kernel is named and each kernel's time measured (debugging and profiling; the
    /// counters still count replays).
    eager: bool,
    profile: BTreeMap<String, (u64, f64)>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    memory: CudaSlice<u8>,
    graphs: BTreeMap<String, CudaGraph>,
    /// The graph files whose graphs launch their steps plain, which load timed faster than
    /// dependent launches ([`Loaded::capture_faster`]); every other graph launches dependent.
    plain: BTreeSet<String>,
    plans: BTreeMap<String, ExecPlan>,
    arena: u64,
    cache: u64,
    cache_bytes: u64,
    /// The cache region's slots (offsets within it).
    cache_slots: Vec<TensorSlot>,
    /// How the cache is paged (`None`: dense).
    paging: Option<CachePaging>,
    /// What streaming logits chunks to the host takes, when the artifact has logits chunks.
    ring: Option<CopyRing>,
    /// The decode step [`CudaExecutor::launch_advanced`] launched and nothing has read yet.
    launched: Option<String>,
    /// The last logits chunk's size, when a smaller one than the largest ends a long prompt
    /// sooner ([`crate::forward::time_last_chunk`], at load).
    last_chunk: Option<usize>,
    /// Every way of running a bucket as groups of a smaller one ([`crate::groups::candidates`]).
    groupings: Vec<Grouping>,
    /// How each bucket that has groupings runs, by its graph file: by load's timings, or as
    /// set by hand.
    choices: BTreeMap<String, groups::Choice>,
    /// Driver work so far, and as it stood when `load` returned.
    counts: DriverCounts,
    at_load: DriverCounts,
    replays: BTreeMap<String, u64>,
    /// Seconds from the start of `load` until it returned: every graph captured and uploaded,
    /// the last logits chunk and the batch groups timed.
    pub load_seconds: f64,
    /// The GPU's name and compute capability.
    pub device: String,
    /// Whether the sm_90a kernels run (else their steps' fallbacks do).
    pub sm90a: bool,
}

/// What copying outputs to the host while the next work computes takes (logits chunks,
/// [`CudaExecutor::replay_logits_chunks`], and batch groups, [`crate::groups`]): a second
/// stream for the copies, two device buffers that chunks or groups fill in turn (each holds the
/// largest chunk's logits and the largest group's outputs), each logits chunk's graph captured
/// once per buffer with its logits written straight into it, and the events that order each
/// buffer's fill (on the replay stream) and its copy out (on the copy stream).
struct CopyRing {
    copies: Arc<CudaStream>,
    buffers: CudaSlice<u8>,
    /// Bytes of each buffer.
    half: usize,
    /// Each logits chunk's graph writing its logits into buffer 0 and into buffer 1, captured
    /// a segment at a time ([`ExecPlan::logits_segments`]), so that each segment's rows go to
    /// the host while the next computes.
    graphs: BTreeMap<String, [Vec<CudaGraph>; 2]>,
    /// `ready[k]`: buffer `k` holds a chunk's logits or a group's outputs.
    ready: [CudaEvent; 2],
    /// `copied[k]`: buffer `k`'s bytes are on the host.
    copied: [CudaEvent; 2],
}

/// One segment of a logits chunk ([`ExecPlan::logits_segments`]): the chunk's logits slot, the
/// ring buffer `k` it writes them into, the segment's index `j` and its steps.
struct Segment<'a> {
    slot: &'a TensorSlot,
    k: usize,
    j: usize,
    steps: std::ops::Range<usize>,
}

/// The error of a stream through a copy ring that load did not allocate.
fn no_ring() -> RuntimeError {
    RuntimeError::Device("no copy ring was allocated at load".into())
}

impl CopyRing {
    /// A ring of two buffers of `half` bytes (the logits chunks' graphs captured later).
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        half: usize,
        counts: &mut DriverCounts,
    ) -> Result<CopyRing, RuntimeError> {
        counts.allocated();
        let buffers = stream.alloc_zeros::<u8>(2 * half).map_err(dev)?;
        let event = || ctx.new_event(None).map_err(dev);
        Ok(CopyRing {
            copies: ctx.new_stream().map_err(dev)?,
            buffers,
            half,
            graphs: BTreeMap::new(),
            ready: [event()?, event()?],
            copied: [event()?, event()?],
        })
    }

    /// The buffer the `i`th chunk or group of a stream fills, `i % 2`, once `stream` has waited
    /// for the copy out of the one two before (the one before that, of an earlier stream, was
    /// settled with it).
    fn take(&self, stream: &CudaStream, i: usize) -> Result<usize, RuntimeError> {
        let k = i % 2;
        if i >= 2 {
            stream.wait(&self.copied[k]).map_err(dev)?;
        }
        Ok(k)
    }

    /// Buffer `k` free again once the copies queued out of it so far are done.
    fn release(&self, k: usize) -> Result<(), RuntimeError> {
        self.copied[k].record(&self.copies).map_err(dev)
    }

    /// Device address of buffer `k`.
    fn buffer(&self, stream: &CudaStream, k: usize) -> u64 {
        let (buffers, _sync) = self.buffers.device_ptr(stream);
        buffers + (k * self.half) as u64
    }

    /// `addresses` with the logits `slot` of the arena moved to buffer `k`.
    fn moved_to(
        &self,
        stream: &CudaStream,
        addresses: &Addresses,
        slot: &TensorSlot,
        k: usize,
    ) -> Addresses {
        let start = addresses.at(Region::Arena, slot.offset);
        Addresses {
            moved: Some((start, slot.bytes(), self.buffer(stream, k))),
            ..addresses.clone()
        }
    }
}

/// A kernel of the loaded modules, with its parameter kinds (tensor maps are encoded from them).
struct LoadedKernel {
    function: CudaFunction,
    params: Vec<ParamType>,
}

/// The loaded kernels by entry name, and how steps launch them.
struct Kernels {
    by_name: BTreeMap<String, LoadedKernel>,
    /// Whether each step launches as a programmatic dependent of the step before it
    /// (`launch.rs`): `Some` where `KILN_PDL` fixes it (`0` plain, else dependent) or
    /// `KILN_EAGER` (dependent); `None` where load captures each bucket's graph both ways and
    /// keeps the faster ([`Loaded::capture_faster`]).
    dependent_launch: Option<bool>,
}

impl Kernels {
    /// How steps launch outside a timed capture (eager runs, the sampler's step): as
    /// `KILN_PDL` fixes it, else as dependents.
    fn dependent(&self) -> bool {
        self.dependent_launch.unwrap_or(true)
    }
}

/// A bucket's graph of plain launches is kept only where it replays this much faster than its
/// graph of dependent launches: more than the spread of the fastest of `time_interleaved`'s
/// rounds, less than what plain launches saved where they won (1-3% on BERT-base's batch and
/// Llama-3.2-1B's prompt, H100).
const PLAIN_GAIN: f64 = 0.01;

/// The buckets a CUDA executor for `work` runs, each plan checked against the kernel table:
/// generation takes only the KV-cached steps; a forward request the prefill buckets and the
/// logits chunks too. `Err` when a plan fails its check, or when none of them runs on a GPU.
fn gpu_buckets<'a>(
    art: &'a Artifact,
    work: Work,
    table: &BTreeMap<&str, &KernelEntry>,
) -> Result<Vec<(&'a BucketEntry, &'a ExecPlan)>, RuntimeError> {
    let m = &art.manifest;
    let (prefill, logits_chunks): (&[BucketEntry], &[BucketEntry]) = match work {
        Work::All => (&m.prefill, &m.logits_chunks),
        Work::Generation => (&[], &[]),
    };
    let buckets: Vec<(&BucketEntry, &ExecPlan)> = prefill
        .iter()
        .chain(&m.decode)
        .chain(logits_chunks)
        .filter_map(|e| e.plan.as_ref().map(|p| (e, p)))
        .collect();
    if buckets.is_empty() {
        let missing = m.buckets().flat_map(|e| &e.no_gpu);
        return Err(RuntimeError::Device(format!(
            "no bucket of this artifact runs on a GPU (ops without a GPU kernel: {})",
            missing.cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    for (entry, plan) in &buckets {
        check_plan(art, entry, plan, table)?;
    }
    Ok(buckets)
}

/// `Err` naming both sizes when `device` has less than `total` bytes free.
fn check_free_memory(ctx: &CudaContext, total: u64, device: &str) -> Result<(), RuntimeError> {
    let (free, _) = ctx.mem_get_info().map_err(dev)?;
    if (free as u64) < total {
        return Err(RuntimeError::Device(format!(
            "the artifact needs {:.2} GiB of GPU memory; {device} has {:.2} GiB free",
            total as f64 / (1u64 << 30) as f64,
            free as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// The kernels of `table` from their modules (`hopper`'s, where this GPU runs the sm_90a
/// image; its kernels are left out otherwise), each granted its dynamic shared memory.
fn load_kernels(
    table: &[KernelEntry],
    module: &Arc<CudaModule>,
    hopper: Option<&Arc<CudaModule>>,
) -> Result<BTreeMap<String, LoadedKernel>, RuntimeError> {
    let mut by_name = BTreeMap::new();
    for k in table {
        let module = match (k.image, hopper) {
            (Image::Sm90, _) => module,
            (Image::Sm90a, Some(h)) => h,
            (Image::Sm90a, None) => continue,
        };
        let f = module.load_function(&k.name).map_err(|e| {
            RuntimeError::Device(format!("kernel `{}` is not in the module: {e}", k.name))
        })?;
        // The default allows 48 KB of static and dynamic shared memory together; a kernel with
        // both (a GEMV's partials and its normalised rows) may pass it with less than 48 KB of
        // dynamic memory, so every dynamic request is granted explicitly.
        if k.max_shared_bytes > 0 {
            f.set_attribute(
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                k.max_shared_bytes as i32,
            )
            .map_err(dev)?;
        }
        let params = k.params.iter().map(|(_, t)| *t).collect();
        by_name.insert(
            k.name.clone(),
            LoadedKernel {
                function: f,
                params,
            },
        );
    }
    Ok(by_name)
}

/// The bytes of page-locked staging the outputs need (a prompt of the whole context comes back
/// through the logits chunks), and the copy ring when a logits chunk among the buckets has
/// logits or `groupings` group a bucket (those [`fit_groupings`] keeps).
fn staging_and_ring(
    gpu: &Gpu,
    m: &Manifest,
    buckets: &[(&BucketEntry, ExecPlan)],
    groupings: &mut Vec<Grouping>,
    counts: &mut DriverCounts,
) -> Result<(usize, Option<CopyRing>), RuntimeError> {
    let mut staging_bytes = plans_outputs_bytes(buckets);
    let chunk_logits = buckets
        .iter()
        .filter(|(e, _)| m.logits_chunks.contains(e))
        .filter_map(|(e, p)| Some((e.seq, p.outputs.iter().find(|s| s.name == LOGITS)?)));
    let widest = chunk_logits.map(|(seq, s)| (s.bytes() as usize, s.bytes() as usize / seq));
    let mut half = 0;
    if let Some((logits, row)) = widest.reduce(|a, b| (a.0.max(b.0), a.1.max(b.1))) {
        staging_bytes = staging_bytes.max(row * m.max_context.unwrap_or(0));
        half = logits;
    }
    half = half.max(fit_groupings(&gpu.ctx, buckets, groupings, half)?);
    if half == 0 {
        return Ok((staging_bytes, None));
    }
    let ring = CopyRing::new(&gpu.ctx, &gpu.stream, half, counts)?;
    Ok((staging_bytes, Some(ring)))
}

/// Keeps the `groupings` whose outputs a ring buffer of `half` bytes holds, or whose two buffers
/// take at most half the GPU's free memory, and returns the bytes a buffer needs for them.
/// Grouping only saves time: a bucket whose groups the GPU has no room for runs as one replay
/// rather than the load failing.
fn fit_groupings(
    ctx: &CudaContext,
    buckets: &[(&BucketEntry, ExecPlan)],
    groupings: &mut Vec<Grouping>,
    half: usize,
) -> Result<usize, RuntimeError> {
    if groupings.is_empty() {
        return Ok(0);
    }
    let part_bytes = |g: &Grouping| {
        let part = buckets.iter().find(|(e, _)| e.graph == g.part);
        part.map_or(0, |(_, p)| outputs_bytes(p) as usize)
    };
    let (free, _) = ctx.mem_get_info().map_err(dev)?;
    groupings.retain(|g| {
        let fits = part_bytes(g) <= half.max(free / 4);
        if !fits {
            tracing::info!(bucket = %g.whole, part = %g.part, "no room for batch groups");
        }
        fits
    });
    Ok(groupings.iter().map(part_bytes).max().unwrap_or(0))
}

/// GPU 0 as load opens it: its context (event tracking off), the replay stream, and its name.
struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    device: String,
}

/// The kernel images a GPU runs: the module every GPU takes, and the sm_90a one where this GPU
/// takes it.
struct Images {
    base: KernelImage,
    hopper: Option<KernelImage>,
}

impl Gpu {
    /// GPU 0 and the images of `art` it runs ([`choose_image`], [`choose_sm90a_image`]).
    fn open(art: &Artifact, start: Instant) -> Result<(Gpu, Images), RuntimeError> {
        probe()?;
        let ctx = CudaContext::new(0).map_err(dev)?;
        let (major, minor) = ctx.compute_capability().map_err(dev)?;
        let sm = (major * 10 + minor) as u32;
        let device = format!("{} (sm_{sm})", ctx.name().map_err(dev)?);
        let images = Images {
            base: choose_image(art, sm)?,
            hopper: choose_sm90a_image(art, sm)?,
        };
        // SAFETY: called before any buffer exists; graph capture needs the context's event
        // tracking off (cudarc's per-buffer events would join the capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev)?;
        tracing::info!(seconds = start.elapsed().as_secs_f64(), %device, "CUDA context ready");
        let gpu = Gpu {
            ctx,
            stream,
            device,
        };
        Ok((gpu, images))
    }

    /// The one allocation of `art`'s memory plan, zeroed, with its weights (`region`, mapped
    /// from the artifact) uploaded into it.
    fn allocate(
        &self,
        art: &Artifact,
        region: &[u8],
        counts: &mut DriverCounts,
        start: Instant,
    ) -> Result<CudaSlice<u8>, RuntimeError> {
        let total = art.manifest.memory.total_bytes();
        counts.allocated();
        let memory = self.stream.alloc_zeros::<u8>(total as usize).map_err(dev)?;
        let base = memory.device_ptr(&self.stream).0;
        upload_weights(&self.ctx, &self.stream, base, art, region)?;
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            bytes = region.len(),
            "weights uploaded"
        );
        Ok(memory)
    }

    /// The kernels of `m`'s table from `images`' modules ([`load_kernels`]); `eager` where the
    /// executor launches step by step and replays no graph, so that no launch way is timed.
    fn kernels(
        &self,
        m: &Manifest,
        images: Images,
        eager: bool,
        counts: &mut DriverCounts,
        start: Instant,
    ) -> Result<Kernels, RuntimeError> {
        let module = load_image(&self.ctx, images.base, counts)?;
        let hopper = images
            .hopper
            .map(|h| load_image(&self.ctx, h, counts))
            .transpose()?;
        let functions = Kernels {
            by_name: load_kernels(&m.kernel_table, &module, hopper.as_ref())?,
            dependent_launch: std::env::var("KILN_PDL")
                .ok()
                .map(|v| v != "0")
                .or(eager.then_some(true)),
        };
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            dependent_launch = ?functions.dependent_launch,
            "kernels loaded"
        );
        Ok(functions)
    }

    /// Page-locked host memory of `bytes` that outputs are copied into.
    fn staging(
        &self,
        bytes: usize,
        counts: &mut DriverCounts,
        start: Instant,
    ) -> Result<PinnedHostSlice<u8>, RuntimeError> {
        counts.allocated();
        // SAFETY: host memory that is only read after a copy into it has completed; flags 0 is
        // ordinary (cached) page-locked memory, which the host reads fast. (Allocated on another
        // thread during the weight upload, it slowed the upload more than it saved: 0.57 -> 1.11 s
        // to uploaded weights, Llama-1B-shaped, H200.)
        let staging =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }.map_err(dev)?;
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            bytes,
            "output staging allocated"
        );
        Ok(staging)
    }
}

/// Every way of grouping a prefill bucket among `buckets` ([`crate::groups::candidates`]), none
/// where `KILN_BATCH_GROUPS=0` keeps every bucket whole.
fn batch_groupings(m: &Manifest, buckets: &[(&BucketEntry, ExecPlan)]) -> Vec<Grouping> {
    if std::env::var("KILN_BATCH_GROUPS").is_ok_and(|v| v == "0") {
        return Vec::new();
    }
    let prefill: Vec<(&BucketEntry, &ExecPlan)> = buckets
        .iter()
        .filter(|(e, _)| m.prefill.contains(e))
        .map(|(e, p)| (*e, p))
        .collect();
    crate::groups::candidates(&prefill)
}

/// What capturing the buckets at load works with: the stream, the loaded kernels and the
/// allocation's addresses.
struct Loaded<'a> {
    stream: &'a Arc<CudaStream>,
    functions: &'a Kernels,
    addresses: &'a Addresses,
    /// The arena's offset in the allocation.
    arena: u64,
    /// When loading started (for the log).
    start: Instant,
}

impl Loaded<'_> {
    /// Every bucket's graph, by graph file, each run once eagerly first; and each logits
    /// chunk's segment graphs into both of `ring`'s buffers, launched as the chunk's graph
    /// launches. Also returns the graph files whose graphs launch plain
    /// ([`Self::capture_faster`]).
    fn capture_all(
        &self,
        memory: &mut CudaSlice<u8>,
        m: &Manifest,
        buckets: &[(&BucketEntry, ExecPlan)],
        mut ring: Option<&mut CopyRing>,
        counts: &mut DriverCounts,
    ) -> Result<(BTreeMap<String, CudaGraph>, BTreeSet<String>), RuntimeError> {
        let (mut graphs, mut plain) = (BTreeMap::new(), BTreeSet::new());
        for (entry, plan) in buckets {
            let _range = nvtx::range!("kiln capture {}", bucket_name(&entry.graph));
            let (graph, dependent) = self.warm_and_capture(memory, (entry, plan), counts)?;
            let logits = plan.outputs.iter().find(|s| s.name == LOGITS);
            if let (Some(ring), Some(slot)) = (ring.as_deref_mut(), logits) {
                if m.logits_chunks.contains(entry) {
                    let mut into = |k| {
                        let segment = (slot, k, dependent);
                        self.capture_segments(ring, (entry, plan), segment, counts)
                    };
                    let pair = [into(0)?, into(1)?];
                    ring.graphs.insert(entry.graph.clone(), pair);
                }
            }
            tracing::info!(
                seconds = self.start.elapsed().as_secs_f64(),
                bucket = %entry.graph,
                dependent,
                "graph captured"
            );
            if !dependent {
                plain.insert(entry.graph.clone());
            }
            graphs.insert(entry.graph.clone(), graph);
        }
        Ok((graphs, plain))
    }

    /// Runs a bucket's steps once eagerly, then captures them as a graph
    /// ([`Self::capture_faster`]). The eager run checks every launch before capture, so that a
    /// failing kernel is reported as itself rather than as a failed capture. Its inputs are
    /// zeros (token 0, masked, position 0): the arena holds another bucket's values, and ids or
    /// positions read from those would address outside their tables.
    fn warm_and_capture(
        &self,
        memory: &mut CudaSlice<u8>,
        (entry, plan): (&BucketEntry, &ExecPlan),
        counts: &mut DriverCounts,
    ) -> Result<(CudaGraph, bool), RuntimeError> {
        for slot in &plan.inputs {
            let at = (self.arena + slot.offset) as usize;
            self.stream
                .memset_zeros(&mut memory.slice_mut(at..at + slot.bytes() as usize))
                .map_err(dev)?;
        }
        let (stream, functions, addresses) = (self.stream, self.functions, self.addresses);
        let dependent = functions.dependent();
        let graph = &entry.graph;
        launch_steps(
            stream,
            functions,
            &plan.steps,
            addresses,
            graph,
            dependent,
            None,
        )?;
        synchronized(stream, graph)?;
        self.capture_faster(&plan.steps, graph, counts)
    }

    /// `steps` (of bucket `graph`) captured as a graph of dependent launches and as one of
    /// plain launches, the two replayed in turn ([`time_interleaved`]) and the plain one kept
    /// where it is faster by [`PLAIN_GAIN`] (dependent launches start each kernel's prologue
    /// under its predecessor's tail, which pays on short kernels; on long ones plain launches
    /// have measured faster); one way only where `KILN_PDL` fixes it. Returns the graph and
    /// whether it launches dependent.
    fn capture_faster(
        &self,
        steps: &[Step],
        graph: &str,
        counts: &mut DriverCounts,
    ) -> Result<(CudaGraph, bool), RuntimeError> {
        let (stream, functions, addresses) = (self.stream, self.functions, self.addresses);
        let mut capture_as = |dependent| {
            capture(
                stream, functions, steps, addresses, graph, dependent, counts,
            )
        };
        if let Some(dependent) = functions.dependent_launch {
            return Ok((capture_as(dependent)?, dependent));
        }
        let ways = [capture_as(true)?, capture_as(false)?];
        let times = time_interleaved(ways.len(), |i| {
            ways[i].launch().map_err(dev)?;
            synchronized(stream, graph)
        })?;
        let plain = fastest([(None, times[0]), (Some(()), times[1])], PLAIN_GAIN).is_some();
        let [dependent, plain_graph] = ways;
        Ok(if plain {
            (plain_graph, false)
        } else {
            (dependent, true)
        })
    }

    /// A logits chunk's graphs writing its logits `slot` into the ring's buffer `k`, one a
    /// segment ([`ExecPlan::logits_segments`]), launched `dependent` or plain.
    fn capture_segments(
        &self,
        ring: &CopyRing,
        (entry, plan): (&BucketEntry, &ExecPlan),
        (slot, k, dependent): (&TensorSlot, usize, bool),
        counts: &mut DriverCounts,
    ) -> Result<Vec<CudaGraph>, RuntimeError> {
        let moved = ring.moved_to(self.stream, self.addresses, slot, k);
        plan.logits_segments()
            .iter()
            .map(|(steps, _)| {
                let steps = &plan.steps[steps.clone()];
                capture(
                    self.stream,
                    self.functions,
                    steps,
                    &moved,
                    &entry.graph,
                    dependent,
                    counts,
                )
            })
            .collect()
    }
}

/// `Err` with a one-line message when this machine has no usable CUDA GPU.
pub fn probe() -> Result<(), RuntimeError> {
    // SAFETY: only checks whether libcuda can be opened; no driver call is made without it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(RuntimeError::Device(
            "no CUDA driver on this machine (libcuda not found); use --device cpu".into(),
        ));
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(RuntimeError::Device(
            "no CUDA device found; use --device cpu".into(),
        )),
        Err(e) => Err(RuntimeError::Device(format!(
            "the CUDA driver reports no device ({e}); use --device cpu"
        ))),
    }
}

/// The SM version a cubin was assembled for (from its ELF `e_flags`, CUDA ELF ABI 8 and later),
/// or `None` if the bytes are not such a cubin.
pub fn cubin_sm(bytes: &[u8]) -> Option<u32> {
    const ELFOSABI_CUDA: u8 = 0x41;
    if bytes.len() < 0x34 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return None;
    }
    if bytes[7] != ELFOSABI_CUDA || bytes[8] < 8 {
        return None;
    }
    let flags = u32::from_le_bytes(bytes[0x30..0x34].try_into().ok()?);
    Some((flags >> 8) & 0xff)
}

/// Which kernel image to load for a GPU of SM version `sm`: the cubin when it was assembled for
/// it, the PTX (JIT-compiled by the driver) when the artifact has no cubin; a cubin for another SM
/// is refused, naming the file.
pub fn choose_image(art: &Artifact, sm: u32) -> Result<KernelImage, RuntimeError> {
    let m = &art.manifest;
    let bad = |file: &str, message: String| art.file_error(file, message);
    match &m.kernels_cubin {
        Some(file) => {
            let bytes = art.read_bytes(file)?;
            let built = cubin_sm(&bytes)
                .ok_or_else(|| bad(file, "is not a CUDA cubin (ELF ABI 8+)".into()))?;
            if !m.targets.contains(&built) {
                return Err(bad(
                    file,
                    format!(
                        "is built for sm_{built}, but the manifest lists targets {:?}",
                        m.targets
                    ),
                ));
            }
            if built != sm {
                return Err(bad(
                    file,
                    format!("is built for sm_{built}; this GPU is sm_{sm} (recompile the artifact on a machine whose ptxas targets it)"),
                ));
            }
            Ok(KernelImage::Cubin(bytes))
        }
        None => {
            let file = m.kernels_ptx.as_ref().ok_or_else(|| {
                RuntimeError::Device(
                    "the artifact has no GPU kernels (compiled with --target cpu)".into(),
                )
            })?;
            Ok(KernelImage::Ptx(art.read_text(file)?))
        }
    }
}

/// The Hopper-only module to load on a GPU of SM version `sm`: its cubin when the artifact has
/// one, else its PTX; `None` when the GPU cannot run sm_90a code (compute capability other than
/// 9.0), the artifact has no such kernels, or `KILN_SM90A=0` asks for the fallbacks.
pub fn choose_sm90a_image(art: &Artifact, sm: u32) -> Result<Option<KernelImage>, RuntimeError> {
    let m = &art.manifest;
    let disabled = std::env::var("KILN_SM90A").is_ok_and(|v| v == "0");
    if sm != 90 || disabled {
        return Ok(None);
    }
    if let Some(file) = &m.kernels_sm90a_cubin {
        let bytes = art.read_bytes(file)?;
        if cubin_sm(&bytes) != Some(90) {
            return Err(art.file_error(file, "is not an sm_90a cubin".into()));
        }
        return Ok(Some(KernelImage::Cubin(bytes)));
    }
    match &m.kernels_sm90a_ptx {
        Some(file) => Ok(Some(KernelImage::Ptx(art.read_text(file)?))),
        None => Ok(None),
    }
}

/// `plan` with every step whose kernel needs sm_90a replaced by its fallback when `sm90a` is off,
/// and without the steps only those fallbacks need when it is on ([`ExecPlan::drop_base_only`]).
pub fn resolve_plan(
    plan: &ExecPlan,
    table: &BTreeMap<&str, &KernelEntry>,
    sm90a: bool,
) -> Result<ExecPlan, RuntimeError> {
    let mut out = plan.clone();
    if sm90a {
        out.drop_base_only();
        return Ok(out);
    }
    for step in &mut out.steps {
        if table[step.kernel.as_str()].image == Image::Sm90a {
            let fallback = step.fallback.take().ok_or_else(|| {
                RuntimeError::Device(format!(
                    "step {} runs `{}`, which needs an sm_90a GPU, and has no fallback",
                    step.node, step.kernel
                ))
            })?;
            *step = *fallback;
        }
    }
    Ok(out)
}

/// A driver error as the runtime's.
fn dev(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Device(format!("CUDA: {e}"))
}

/// A kernel module image.
pub enum KernelImage {
    /// SASS for this GPU.
    Cubin(Vec<u8>),
    /// PTX text, compiled by the driver at load.
    Ptx(String),
}

/// Checks a plan against the kernel table and the allocation before anything is launched: every
/// step names a known kernel, passes one argument of the right kind per parameter, and every
/// pointer lies inside its region.
pub fn check_plan(
    art: &Artifact,
    entry: &BucketEntry,
    plan: &ExecPlan,
    table: &BTreeMap<&str, &KernelEntry>,
) -> Result<(), RuntimeError> {
    let m = &art.manifest;
    let bad = |message: String| art.plan_error(entry, message);
    let size = |r: Region| m.memory.region_bytes(r);
    if plan.arena_bytes > m.memory.arena_bytes {
        return Err(bad(format!(
            "needs {} arena bytes, the memory plan has {}",
            plan.arena_bytes, m.memory.arena_bytes
        )));
    }
    for step in &plan.steps {
        check_step(step, table, &size).map_err(&bad)?;
        if let Some(fallback) = &step.fallback {
            check_step(fallback, table, &size).map_err(&bad)?;
            if table[fallback.kernel.as_str()].image != Image::Sm90 || fallback.fallback.is_some() {
                return Err(bad(format!(
                    "step {}'s fallback `{}` is not a base-image kernel",
                    step.node, fallback.kernel
                )));
            }
        }
    }
    plan.check_logits_pieces().map_err(&bad)?;
    for slot in plan.inputs.iter().chain(&plan.outputs).chain(&plan.tokens) {
        if slot.offset + slot.bytes() > m.memory.arena_bytes {
            return Err(bad(format!("`{}` lies outside the arena", slot.name)));
        }
    }
    if let Some(t) = &plan.tokens {
        if t.dtype != DType::I64 || t.shape != [entry.batch] {
            return Err(bad(format!(
                "the token slot is {:?} {:?}; a batch of {} takes I64 [{}]",
                t.dtype, t.shape, entry.batch, entry.batch
            )));
        }
    }
    if let Some(sampler) = &plan.sampler {
        check_step(&sampler.step, table, &size).map_err(&bad)?;
        let p = &sampler.params;
        if plan.tokens.is_none()
            || p.dtype != DType::I32
            || p.shape != [entry.batch, 4]
            || p.offset + p.bytes() > m.memory.arena_bytes
        {
            return Err(bad(format!(
                "its sampler's parameters are {:?} {:?} at {} with{} a token slot; a batch of {} \
                 takes I32 [{}, 4] inside the arena beside its tokens",
                p.dtype,
                p.shape,
                p.offset,
                if plan.tokens.is_some() { "" } else { "out" },
                entry.batch,
                entry.batch
            )));
        }
    }
    if plan.advances {
        if plan.tokens.is_none() {
            return Err(bad("it advances its inputs but chooses no tokens".into()));
        }
        for name in kiln_ir::artifact::ADVANCED_INPUTS {
            let fits = |s: &&TensorSlot| {
                s.name == name && s.dtype == DType::I64 && s.shape == [entry.batch, 1]
            };
            if !plan.inputs.iter().any(|s| fits(&s)) {
                return Err(bad(format!(
                    "it advances its inputs but has no I64 [{}, 1] input `{name}`",
                    entry.batch
                )));
            }
        }
    }
    Ok(())
}

/// The most decode steps [`CudaExecutor::replay_steps`] queues at once.
pub const MAX_STEPS: usize = 64;

/// Checks one launch: a known kernel, one argument of the right kind per parameter, every
/// pointer (and every tensor map's matrix) inside its region, shared memory within the table's,
/// a grid of whole clusters.
fn check_step(
    step: &Step,
    table: &BTreeMap<&str, &KernelEntry>,
    size: &dyn Fn(Region) -> u64,
) -> Result<(), String> {
    let kernel = table.get(step.kernel.as_str()).ok_or_else(|| {
        format!(
            "step {} launches unknown kernel `{}`",
            step.node, step.kernel
        )
    })?;
    if kernel.params.len() != step.args.len() {
        return Err(format!(
            "step {} passes {} arguments to `{}`, which takes {}",
            step.node,
            step.args.len(),
            step.kernel,
            kernel.params.len()
        ));
    }
    let cluster = kernel.cluster;
    if cluster == 0 || !step.launch.grid[0].is_multiple_of(cluster) {
        return Err(format!(
            "step {} launches `{}` on {} blocks along x, not whole clusters of {cluster}",
            step.node, step.kernel, step.launch.grid[0]
        ));
    }
    if step.launch.shared_bytes > kernel.max_shared_bytes {
        return Err(format!(
            "step {} asks `{}` for {} bytes of shared memory; the kernel table allows {}",
            step.node, step.kernel, step.launch.shared_bytes, kernel.max_shared_bytes
        ));
    }
    for ((name, ty), arg) in kernel.params.iter().zip(&step.args) {
        let ok = match (ty, arg) {
            (ParamType::Ptr, Arg::Ptr(region, offset)) => *offset < size(*region).max(1),
            (ParamType::TensorMap(spec), Arg::TensorMap(region, offset)) => {
                if let Err(why) = spec.check() {
                    return Err(format!(
                        "step {}: the tensor map `{name}` of `{}`: {why}",
                        step.node, step.kernel
                    ));
                }
                offset.is_multiple_of(16) && offset + spec.extent_bytes() <= size(*region)
            }
            (ParamType::U32, Arg::U32(_)) | (ParamType::F32, Arg::F32(_)) => true,
            _ => false,
        };
        if !ok {
            return Err(format!(
                "step {} binds `{name}` of `{}` to {arg:?}, which is not a {ty:?} inside the plan",
                step.node, step.kernel
            ));
        }
    }
    Ok(())
}

impl CudaExecutor {
    /// Loads `art` on GPU 0: checks the GPU (compute capability against the cubin, free memory),
    /// allocates the plan, uploads the weights, loads the kernels and captures every bucket's
    /// graph, largest first; then times what it may choose (a last logits chunk, batch groups).
    pub fn load(art: &Artifact, work: Work) -> Result<CudaExecutor, RuntimeError> {
        let _range = nvtx::range!("kiln load");
        let start = Instant::now();
        let m = &art.manifest;
        let region = art.weights_region()?;
        let table: BTreeMap<&str, &KernelEntry> = m
            .kernel_table
            .iter()
            .map(|k| (k.name.as_str(), k))
            .collect();
        let buckets = gpu_buckets(art, work, &table)?;
        let (gpu, images) = Gpu::open(art, start)?;
        let sm90a = images.hopper.is_some();
        let buckets: Vec<(&BucketEntry, ExecPlan)> = buckets
            .into_iter()
            .map(|(e, p)| Ok((e, resolve_plan(p, &table, sm90a)?)))
            .collect::<Result<_, RuntimeError>>()?;
        check_free_memory(&gpu.ctx, m.memory.total_bytes(), &gpu.device)?;
        let mut counts = DriverCounts::default();
        let mut memory = gpu.allocate(art, region, &mut counts, start)?;
        let eager = std::env::var_os("KILN_EAGER").is_some();
        let functions = gpu.kernels(m, images, eager, &mut counts, start)?;
        let addresses = Addresses {
            base: memory.device_ptr(&gpu.stream).0,
            plan: m.memory.clone(),
            moved: None,
        };
        let mut groupings = batch_groupings(m, &buckets);
        let (staging_bytes, mut ring) =
            staging_and_ring(&gpu, m, &buckets, &mut groupings, &mut counts)?;
        let loaded = Loaded {
            stream: &gpu.stream,
            functions: &functions,
            addresses: &addresses,
            arena: m.memory.base(Region::Arena),
            start,
        };
        let (graphs, plain) =
            loaded.capture_all(&mut memory, m, &buckets, ring.as_mut(), &mut counts)?;
        let staging = gpu.staging(staging_bytes, &mut counts, start)?;
        let mut exec = CudaExecutor {
            staging,
            functions,
            addresses,
            eager,
            profile: BTreeMap::new(),
            arena: m.memory.base(Region::Arena),
            cache: m.memory.base(Region::Cache),
            cache_bytes: m.memory.cache_bytes,
            cache_slots: m.memory.cache.clone(),
            paging: m.memory.paging,
            ring,
            launched: None,
            last_chunk: None,
            groupings,
            choices: BTreeMap::new(),
            ctx: gpu.ctx,
            stream: gpu.stream,
            memory,
            graphs,
            plain,
            plans: buckets
                .into_iter()
                .map(|(e, p)| (e.graph.clone(), p))
                .collect(),
            counts,
            at_load: counts,
            replays: BTreeMap::new(),
            load_seconds: 0.0,
            device: gpu.device,
            sm90a,
        };
        exec.finish_load(art, start)?;
        Ok(exec)
    }

    /// The last of load: the cache the warm-up runs wrote emptied (a generation starts from an
    /// empty one), the choices timed, the ring fitted to them; what was done so far counted as
    /// load's.
    fn finish_load(&mut self, art: &Artifact, start: Instant) -> Result<(), RuntimeError> {
        self.reset_cache()?;
        self.stream.synchronize().map_err(dev)?;
        self.time_last_chunk(art)?;
        self.time_groups()?;
        self.fit_ring()?;
        self.at_load = self.counts;
        self.load_seconds = start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Times the logits chunks' last sizes ([`crate::forward::time_last_chunk`]; not under
    /// `KILN_EAGER`, whose launches one by one time something else), then leaves the executor
    /// as load did: the cache empty, no replay counted.
    fn time_last_chunk(&mut self, art: &Artifact) -> Result<(), RuntimeError> {
        if self.eager {
            return Ok(());
        }
        let start = Instant::now();
        self.last_chunk = crate::forward::time_last_chunk(art, self)?;
        self.reset_cache()?;
        self.stream.synchronize().map_err(dev)?;
        self.replays.clear();
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            last = ?self.last_chunk,
            "logits chunks timed"
        );
        Ok(())
    }

    /// The last logits chunk's size that load found to end a long prompt soonest, when it is not
    /// the largest ([`crate::forward::chunk_sizes`]).
    pub fn last_logits_chunk(&self) -> Option<usize> {
        self.last_chunk
    }

    /// The graph files whose captured graphs launch their steps plain rather than as
    /// programmatic dependents (load timed them faster, or `KILN_PDL=0` asked for it).
    pub fn plain_launches(&self) -> &BTreeSet<String> {
        &self.plain
    }

    /// Whether the bucket whose graph file is `graph` has a captured graph.
    pub fn has(&self, graph: &str) -> bool {
        self.graphs.contains_key(graph)
    }

    /// Runs one bucket: `inputs` (by name; every non-cache input of its plan) are copied into
    /// their slots, the graph is replayed, and the outputs in the arena are copied back; only
    /// their first `rows` rows are the caller's ([`Self::replay_rows`]), and the rows of groups
    /// it did not run are zeros (not what an earlier request left, which a host tail would read).
    pub fn run(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
        rows: usize,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let grouping = self.grouping_for(graph, rows);
        let computed = grouping.as_ref().map(|g| g.groups_for(rows) * g.rows);
        Ok(self
            .replay_as(graph, inputs, rows, grouping.as_ref())?
            .into_iter()
            .map(|(slot, bytes)| {
                let mut t = decode(bytes, slot.dtype, slot.shape.clone());
                if let Some(row) = computed {
                    zero_rows_from(&mut t, row);
                }
                (slot.name.clone(), t)
            })
            .collect())
    }

    /// Like [`CudaExecutor::run`], but the outputs stay the device's bytes (what a server hands
    /// on), in page-locked host memory that the next request reuses. A bucket that load found
    /// faster in groups runs as them ([`crate::groups`]).
    pub fn replay(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<Vec<(&TensorSlot, &[u8])>, RuntimeError> {
        self.replay_rows(graph, inputs, usize::MAX)
    }

    /// [`Self::replay`] where only the outputs' first `rows` rows are the caller's, the bucket's
    /// others padding: a bucket that runs as groups replays only the groups that hold one of
    /// them ([`Grouping::groups_for`]), and its outputs' rows past those groups keep the bytes
    /// the staging buffer held.
    pub fn replay_rows(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
        rows: usize,
    ) -> Result<Vec<(&TensorSlot, &[u8])>, RuntimeError> {
        let grouping = self.grouping_for(graph, rows);
        self.replay_as(graph, inputs, rows, grouping.as_ref())
    }

    /// [`Self::replay_rows`] as `grouping` (its groups that hold the first `rows` rows), or as
    /// one replay with `None`.
    fn replay_as(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
        rows: usize,
        grouping: Option<&Grouping>,
    ) -> Result<Vec<(&TensorSlot, &[u8])>, RuntimeError> {
        if let Some(grouping) = grouping {
            return self.replay_grouped(grouping, inputs, rows);
        }
        self.launch(graph, inputs)?;
        let plan = &self.plans[graph];
        let arena = self.addresses.base + self.arena;
        let ranges = copy_back(&self.stream, &mut self.staging, arena, graph, &plan.outputs)?;
        let staging: &[u8] = self.staging.as_slice().map_err(dev)?;
        Ok(plan
            .outputs
            .iter()
            .zip(ranges)
            .map(|(slot, r)| (slot, &staging[r]))
            .collect())
    }

    /// Replays a decode step and returns the tokens its graph chose on the device (the first
    /// largest logit of each row): 8 bytes per row come back instead of the logits. `None` when
    /// the bucket's plan chooses none (not a decode step, or logits its host tail computes).
    pub fn replay_tokens(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<Option<Vec<i64>>, RuntimeError> {
        if self.plans.get(graph).is_none_or(|p| p.tokens.is_none()) {
            return Ok(None);
        }
        self.launch(graph, inputs)?;
        self.read_tokens(graph)
    }

    /// Waits for the stream and reads `graph`'s token slot (8 bytes per row) back.
    fn read_tokens(&mut self, graph: &str) -> Result<Option<Vec<i64>>, RuntimeError> {
        let slots = self.plans[graph].tokens.as_slice();
        let arena = self.addresses.base + self.arena;
        let ranges = copy_back(&self.stream, &mut self.staging, arena, graph, slots)?;
        let Some(range) = ranges.into_iter().next() else {
            return Ok(None);
        };
        let staging: &[u8] = self.staging.as_slice().map_err(dev)?;
        // `check_plan` made the slot I64 `[batch]`.
        let rows = range.len() / 8;
        Ok(match decode(&staging[range], DType::I64, vec![rows]).data {
            Data::Int(tokens) => Some(tokens),
            Data::Float(_) => None,
        })
    }

    /// Replays a decode step and samples its tokens on the device (the plan's sampler, after the
    /// replay, over the step's logits): `params` holds four 32-bit words per row (temperature
    /// as f32 bits, top-k, top-p as f32 bits, the step's uniform word; temperature 0 takes the
    /// first largest logit), and only the token ids come back. `None` when the plan has no
    /// sampler.
    pub fn replay_sampled(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
        params: &[[u32; 4]],
    ) -> Result<Option<Vec<i64>>, RuntimeError> {
        let Some(sampler) = self.plans.get(graph).and_then(|p| p.sampler.clone()) else {
            return Ok(None);
        };
        if params.len() != sampler.params.shape[0] {
            return Err(RuntimeError::Request(format!(
                "sampling parameters for {} rows; bucket {graph} takes {}",
                params.len(),
                sampler.params.shape[0]
            )));
        }
        let bytes: Vec<u8> = params
            .iter()
            .flatten()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let at = (self.arena + sampler.params.offset) as usize;
        self.stream
            .memcpy_htod(&bytes, &mut self.memory.slice_mut(at..at + bytes.len()))
            .map_err(dev)?;
        self.launch(graph, inputs)?;
        let profile = self.eager.then_some(&mut self.profile);
        let step = std::slice::from_ref(&sampler.step);
        launch_steps(
            &self.stream,
            &self.functions,
            step,
            &self.addresses,
            graph,
            self.functions.dependent(),
            profile,
        )?;
        self.read_tokens(graph)
    }

    /// Replays the decode step `graph` over the inputs its last replay left
    /// ([`ExecPlan::advances`]) and queues its tokens' copy to page-locked memory behind it,
    /// without waiting ([`CudaExecutor::read_launched`] reads them); `false`, with nothing
    /// launched, when the plan does not advance its inputs.
    pub fn launch_advanced(&mut self, graph: &str) -> Result<bool, RuntimeError> {
        let Some(slot) = self.plans.get(graph).filter(|p| p.advances) else {
            return Ok(false);
        };
        let Some(slot) = slot.tokens.clone() else {
            return Ok(false);
        };
        self.enqueue(graph)?;
        let n = slot.bytes() as usize;
        let staging = self.staging.as_mut_slice().map_err(dev)?;
        // SAFETY: the token slot lies inside the one allocation (`check_plan`) and `staging[..n]`
        // inside the page-locked buffer (sized for every plan's tokens); the copy follows the
        // replay in the stream, and the bytes are read only after `read_launched` synchronises.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut staging[..n],
                self.addresses.base + self.arena + slot.offset,
                self.stream.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.launched = Some(graph.to_string());
        Ok(true)
    }

    /// Waits for the step [`CudaExecutor::launch_advanced`] launched and returns its tokens.
    pub fn read_launched(&mut self, graph: &str) -> Result<Vec<i64>, RuntimeError> {
        if self.launched.take().as_deref() != Some(graph) {
            return Err(RuntimeError::Request(format!(
                "no decode step of {graph} was launched ahead"
            )));
        }
        let slot = self.plans.get(graph).and_then(|p| p.tokens.clone());
        let Some(slot) = slot else {
            return Err(RuntimeError::Request(format!("{graph} chooses no tokens")));
        };
        self.stream
            .synchronize()
            .map_err(|e| RuntimeError::Device(format!("{graph}: a kernel failed: {e}")))?;
        let staging: &[u8] = self.staging.as_slice().map_err(dev)?;
        let bytes = &staging[..slot.bytes() as usize];
        match decode(bytes, DType::I64, slot.shape.clone()).data {
            Data::Int(tokens) => Ok(tokens),
            Data::Float(_) => Err(RuntimeError::Device(format!("{graph}: tokens not i64"))),
        }
    }

    /// Replays the decode step `graph` `steps` times (at most [`MAX_STEPS`]) from `inputs`, the
    /// first step's, without the host in between: each replay leaves the next step's inputs in
    /// place ([`ExecPlan::advances`]), and its tokens are copied to page-locked memory behind it,
    /// so the host waits once, after the last. Returns each step's tokens; `None` when the plan
    /// does not advance its inputs.
    pub fn replay_steps(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
        steps: usize,
    ) -> Result<Option<Vec<Vec<i64>>>, RuntimeError> {
        let Some(plan) = self.plans.get(graph).filter(|p| p.advances) else {
            return Ok(None);
        };
        let Some(slot) = plan.tokens.clone() else {
            return Ok(None);
        };
        if steps == 0 || steps > MAX_STEPS {
            return Err(RuntimeError::Request(format!(
                "{steps} decode steps at once; 1 to {MAX_STEPS} are queued together"
            )));
        }
        let n = slot.bytes() as usize;
        let src = self.addresses.base + self.arena + slot.offset;
        self.upload_inputs(graph, inputs)?;
        for step in 0..steps {
            self.enqueue(graph)?;
            let staging = self.staging.as_mut_slice().map_err(dev)?;
            // SAFETY: `src..src + n` is the token slot inside the one allocation
            // (`check_plan`), and `staging[step * n..(step + 1) * n]` lies inside the page-locked
            // buffer, sized for MAX_STEPS of every plan's tokens (`plans_outputs_bytes`); the
            // stream is synchronised below before the bytes are read, and each copy follows its
            // replay and precedes the next in the stream.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut staging[step * n..(step + 1) * n],
                    src,
                    self.stream.cu_stream(),
                )
            }
            .map_err(dev)?;
        }
        self.stream
            .synchronize()
            .map_err(|e| RuntimeError::Device(format!("{graph}: a kernel failed: {e}")))?;
        let staging: &[u8] = self.staging.as_slice().map_err(dev)?;
        Ok(Some(
            staging[..steps * n]
                .chunks(n)
                .map(
                    |bytes| match decode(bytes, DType::I64, slot.shape.clone()).data {
                        Data::Int(tokens) => tokens,
                        Data::Float(_) => Vec::new(),
                    },
                )
                .collect(),
        ))
    }

    /// Copies `inputs` into their slots and replays `graph` (or, when profiling, launches its
    /// steps one by one), without waiting for it.
    fn launch(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<(), RuntimeError> {
        self.upload_inputs(graph, inputs)?;
        self.enqueue(graph)
    }

    /// Replays `graph` on the stream (or, when profiling, launches its steps one by one, timing
    /// each), without waiting for it.
    fn enqueue(&mut self, graph: &str) -> Result<(), RuntimeError> {
        self.enqueue_to(graph, None)
    }

    /// [`Self::enqueue`], or where `into` says so, one segment of a logits chunk writing its
    /// logits into a ring buffer (its graph captured for that buffer, or its steps launched
    /// with the slot moved there). A chunk's replay is counted at its first segment.
    fn enqueue_to(&mut self, graph: &str, into: Option<&Segment>) -> Result<(), RuntimeError> {
        let captured = match into {
            None => self.graphs.get(graph),
            Some(seg) => self
                .ring
                .as_ref()
                .and_then(|r| r.graphs.get(graph)?[seg.k].get(seg.j)),
        };
        let (Some(plan), Some(captured)) = (self.plans.get(graph), captured) else {
            return Err(RuntimeError::Device(format!(
                "bucket {graph} has no captured graph"
            )));
        };
        let _range = nvtx::range!("kiln {}", bucket_name(graph));
        if self.eager {
            let (moved, steps) = match (into, &self.ring) {
                (Some(seg), Some(ring)) => (
                    Some(ring.moved_to(&self.stream, &self.addresses, seg.slot, seg.k)),
                    &plan.steps[seg.steps.clone()],
                ),
                _ => (None, &plan.steps[..]),
            };
            launch_steps(
                &self.stream,
                &self.functions,
                steps,
                moved.as_ref().unwrap_or(&self.addresses),
                graph,
                self.functions.dependent(),
                Some(&mut self.profile),
            )?;
        } else {
            captured.launch().map_err(dev)?;
        }
        if into.is_none_or(|seg| seg.j == 0) {
            *self.replays.entry(graph.to_string()).or_default() += 1;
        }
        Ok(())
    }

    /// Copies `inputs` (every non-cache input of `graph`'s plan, by name) into their slots.
    fn upload_inputs(
        &mut self,
        graph: &str,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<(), RuntimeError> {
        let tensors = self.checked_inputs(graph, inputs)?;
        let plan = &self.plans[graph];
        for (slot, t) in plan.inputs.iter().zip(tensors) {
            let bytes = encode(t, slot.dtype);
            let at = (self.arena + slot.offset) as usize;
            self.stream
                .memcpy_htod(&bytes, &mut self.memory.slice_mut(at..at + bytes.len()))
                .map_err(dev)?;
        }
        Ok(())
    }

    /// The tensor of `inputs` for each input slot of `graph`'s plan, in the plan's order: `Err`
    /// naming a missing one, or one of another shape.
    fn checked_inputs<'t>(
        &self,
        graph: &str,
        inputs: &'t BTreeMap<String, Tensor>,
    ) -> Result<Vec<&'t Tensor>, RuntimeError> {
        let plan = self
            .plans
            .get(graph)
            .ok_or_else(|| RuntimeError::Device(format!("bucket {graph} has no GPU plan")))?;
        plan.inputs
            .iter()
            .map(|slot| {
                let t = inputs.get(&slot.name).ok_or_else(|| {
                    RuntimeError::Request(format!("input `{}` is missing", slot.name))
                })?;
                if t.shape != slot.shape {
                    return Err(RuntimeError::Request(format!(
                        "input `{}` has shape {:?}; bucket {graph} takes {:?}",
                        slot.name, t.shape, slot.shape
                    )));
                }
                Ok(t)
            })
            .collect()
    }

    /// Empties the KV cache (a new generation).
    pub fn reset_cache(&mut self) -> Result<(), RuntimeError> {
        if self.cache_bytes > 0 {
            let (a, b) = (
                self.cache as usize,
                (self.cache + self.cache_bytes) as usize,
            );
            self.stream
                .memset_zeros(&mut self.memory.slice_mut(a..b))
                .map_err(dev)?;
        }
        Ok(())
    }

    /// Runs a sequence through logits chunks: each of `chunks` (graph, inputs, and the tokens of
    /// it that are the sequence's) is replayed after the one before; its logits go to one of two
    /// device buffers in turn, from which the copy stream moves them to the host while the next
    /// chunks compute. Returns every chunk's logits (its tokens' rows), one after the other, in
    /// page-locked memory the next request reuses, and their type.
    pub fn replay_logits_chunks(
        &mut self,
        chunks: &[(&str, BTreeMap<String, Tensor>, usize)],
    ) -> Result<(&[u8], DType), RuntimeError> {
        let logits = self.chunk_logits(chunks)?;
        let outcome = self.stream_chunks(chunks, &logits);
        let synced = self.settle("logits chunks");
        let at = outcome?;
        synced?;
        let dtype = logits.first().map_or(DType::F32, |(slot, _)| slot.dtype);
        Ok((&self.staging.as_slice().map_err(dev)?[..at], dtype))
    }

    /// Waits for the replay stream and the copy ring's stream, so that nothing is still landing
    /// in the staging buffer, whether what was streamed (`what`) failed or not.
    fn settle(&self, what: &str) -> Result<(), RuntimeError> {
        let replays = synchronized(&self.stream, what);
        let copies = match &self.ring {
            Some(ring) => synchronized(&ring.copies, what),
            None => Ok(()),
        };
        replays.and(copies)
    }

    /// Each chunk's logits slot and the bytes of its sequence's rows, checked to fit the ring
    /// and, all together, the staging buffer.
    fn chunk_logits(
        &self,
        chunks: &[(&str, BTreeMap<String, Tensor>, usize)],
    ) -> Result<Vec<(TensorSlot, usize)>, RuntimeError> {
        let ring = self
            .ring
            .as_ref()
            .ok_or_else(|| RuntimeError::Request("this executor loaded no logits chunks".into()))?;
        let mut total = 0usize;
        let mut all = Vec::with_capacity(chunks.len());
        for (graph, _, tokens) in chunks {
            let slot = self
                .plans
                .get(*graph)
                .and_then(|p| p.outputs.iter().find(|s| s.name == LOGITS));
            let seq = slot.and_then(|s| s.shape.get(1)).copied().unwrap_or(0);
            let (Some(slot), true) = (slot, seq >= *tokens && *tokens > 0) else {
                return Err(RuntimeError::Request(format!(
                    "{graph} does not keep the logits of {tokens} tokens"
                )));
            };
            let bytes = slot.bytes() as usize / seq * tokens;
            total += bytes;
            if bytes > ring.half || total > self.staging.len() {
                return Err(RuntimeError::Request(format!(
                    "the chunks' logits exceed the {} bytes kept for them",
                    self.staging.len()
                )));
            }
            all.push((slot.clone(), bytes));
        }
        Ok(all)
    }

    /// Launches `chunks` with the copies of `logits` (from [`Self::chunk_logits`]) behind them,
    /// each segment's rows ([`ExecPlan::logits_segments`]) copied once it is written, without
    /// waiting; returns the bytes the copies will have written.
    fn stream_chunks(
        &mut self,
        chunks: &[(&str, BTreeMap<String, Tensor>, usize)],
        logits: &[(TensorSlot, usize)],
    ) -> Result<usize, RuntimeError> {
        let mut at = 0usize;
        for (i, ((graph, inputs, _), (slot, bytes))) in chunks.iter().zip(logits).enumerate() {
            let k = self.ring()?.take(&self.stream, i)?;
            self.upload_inputs(graph, inputs)?;
            let seq = slot.shape[1];
            let row = slot.bytes() as usize / seq;
            let segments = self.plans[*graph].logits_segments();
            let mut copied = 0;
            for (j, (steps, rows)) in segments.into_iter().enumerate() {
                let seg = Segment { slot, k, j, steps };
                self.enqueue_to(graph, Some(&seg))?;
                // The bytes of the sequence's rows this segment finished.
                let written = (rows * row).min(*bytes);
                if written > copied {
                    self.copy_out(k, at + copied, copied..written)?;
                    copied = written;
                }
            }
            self.ring()?.release(k)?;
            at += bytes;
        }
        Ok(at)
    }

    /// The copy ring that logits chunks and batch groups go through: their callers checked
    /// that there is one, large enough, before the first launch.
    fn ring(&self) -> Result<&CopyRing, RuntimeError> {
        self.ring.as_ref().ok_or_else(no_ring)
    }

    /// Copies `bytes` of ring buffer `k` to `staging[at..]` on the copy stream, once the replay
    /// stream has written them.
    fn copy_out(
        &mut self,
        k: usize,
        at: usize,
        bytes: std::ops::Range<usize>,
    ) -> Result<(), RuntimeError> {
        // The fields apart: the ring is read while the staging buffer is written.
        let ring = self.ring.as_ref().ok_or_else(no_ring)?;
        let staging = self.staging.as_mut_slice().map_err(dev)?;
        let buffer = ring.buffer(&self.stream, k);
        ring.ready[k].record(&self.stream).map_err(dev)?;
        ring.copies.wait(&ring.ready[k]).map_err(dev)?;
        // SAFETY: `staging[at..at + bytes.len()]` lies inside the page-locked buffer (the chunks'
        // bytes together fit, `chunk_logits`; a group's rows of a bucket's outputs, which it
        // holds) and is read only after the copy stream is synchronised; `bytes` lies inside
        // buffer `k` (at most a chunk's logits, which `chunk_logits` checked against the buffer,
        // or a group's outputs, which `grouping_for` checked against it), and the copy waits for
        // the replay stream.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut staging[at..at + bytes.len()],
                buffer + bytes.start as u64,
                ring.copies.cu_stream(),
            )
        }
        .map_err(dev)
    }

    /// Writes the paged cache's block table (`[rows, entries]`, in stream order: every step
    /// launched later reads it).
    pub fn write_block_table(&mut self, table: &[u32]) -> Result<(), RuntimeError> {
        let at = crate::executor::block_table_at(self.paging.as_ref(), table)?;
        let (a, b) = (
            self.cache as usize + at,
            self.cache as usize + at + table.len() * 4,
        );
        self.stream
            .memcpy_htod(
                bytemuck::cast_slice::<u32, u8>(table),
                &mut self.memory.slice_mut(a..b),
            )
            .map_err(dev)
    }

    /// Copies row `from` of every slot of a dense KV cache to row `to` (device to device, in
    /// stream order).
    pub fn copy_cache_row(&mut self, from: usize, to: usize) -> Result<(), RuntimeError> {
        let copies =
            crate::executor::cache_row_copies(&self.cache_slots, self.paging.as_ref(), from, to)?;
        let (base, _sync) = self.memory.device_ptr(&self.stream);
        for (src, dst, bytes) in copies {
            // SAFETY: both ranges lie inside the cache region of `memory` (the slots are the
            // plan's, checked against the allocation at load), and rows of one slot never
            // overlap; the copy is ordered on `stream` with every launch.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    base + self.cache + dst,
                    base + self.cache + src,
                    bytes as usize,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| RuntimeError::Device(format!("CUDA: copying a cache row: {e}")))?;
        }
        Ok(())
    }

    /// Launches the steps of every later request one by one, each timed into [`Self::profile`]
    /// (what `KILN_EAGER` asks for at load), or replays the graphs again.
    pub fn set_profiling(&mut self, on: bool) {
        self.eager = on;
    }

    /// Per kernel: launches and seconds (launch to completion), measured when `KILN_EAGER` is
    /// set; empty otherwise.
    pub fn profile(&self) -> &BTreeMap<String, (u64, f64)> {
        &self.profile
    }

    /// The counters since load.
    pub fn counters(&self) -> Counters {
        Counters {
            replays: self.replays.clone(),
            at_load: self.at_load,
            after_load: self.after_load(),
        }
    }

    /// The driver work since load (what [`Self::counters`] reports, without copying the replays).
    pub fn after_load(&self) -> DriverCounts {
        self.counts.since(&self.at_load)
    }

    /// GPU memory in use on the device (all processes), bytes.
    pub fn device_memory_used(&self) -> Result<u64, RuntimeError> {
        let (free, total) = self.ctx.mem_get_info().map_err(dev)?;
        Ok((total - free) as u64)
    }

    /// Bytes of the one allocation this executor made.
    pub fn allocated_bytes(&self) -> u64 {
        self.memory.len() as u64
    }
}

/// Loads `image` as the kernel module, counted (a PTX image is JIT-compiled by the driver here).
fn load_image(
    ctx: &Arc<CudaContext>,
    image: KernelImage,
    counts: &mut DriverCounts,
) -> Result<Arc<CudaModule>, RuntimeError> {
    counts.module_loaded(&image);
    ctx.load_module(match image {
        KernelImage::Cubin(bytes) => Ptx::from_binary(bytes),
        KernelImage::Ptx(text) => Ptx::from_src(text),
    })
    .map_err(|e| RuntimeError::Device(format!("the kernel module does not load: {e}")))
}

/// Sets the rows of `t` (its leading dimension) from `row` on to zero.
fn zero_rows_from(t: &mut Tensor, row: usize) {
    let per_row: usize = t.shape.iter().skip(1).product();
    let from = (row * per_row).min(t.numel());
    match &mut t.data {
        Data::Float(v) => v[from..].fill(0.0),
        Data::Int(v) => v[from..].fill(0),
    }
}

/// Captures the launches of `steps` (of `graph`'s plan) on `stream`, `dependent` or plain
/// ([`launch::launch`]), as a CUDA graph, instantiated and uploaded, counted.
fn capture(
    stream: &Arc<CudaStream>,
    functions: &Kernels,
    steps: &[Step],
    addresses: &Addresses,
    graph: &str,
    dependent: bool,
    counts: &mut DriverCounts,
) -> Result<CudaGraph, RuntimeError> {
    counts.captured();
    stream
        .begin_capture(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(dev)?;
    launch_steps(stream, functions, steps, addresses, graph, dependent, None)?;
    let captured = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(dev)?
        .ok_or_else(|| RuntimeError::Device(format!("{graph}: empty capture")))?;
    captured.upload().map_err(dev)?;
    Ok(captured)
}

/// Waits for `stream`; a failure names `what` ran (a kernel's failure shows at the next wait).
fn synchronized(stream: &CudaStream, what: &str) -> Result<(), RuntimeError> {
    stream
        .synchronize()
        .map_err(|e| RuntimeError::Device(format!("{what}: a kernel failed: {e}")))
}

/// Copies `slots` of the arena (at device address `arena`) to the page-locked staging buffer,
/// one after the other, and waits for the stream (and so for the replay before them); returns
/// where each landed.
fn copy_back(
    stream: &CudaStream,
    staging: &mut PinnedHostSlice<u8>,
    arena: u64,
    graph: &str,
    slots: &[TensorSlot],
) -> Result<Vec<std::ops::Range<usize>>, RuntimeError> {
    let staging = staging.as_mut_slice().map_err(dev)?;
    let ranges = packed(slots);
    for (slot, r) in slots.iter().zip(&ranges) {
        let src = arena + slot.offset;
        // SAFETY: `src..src + r.len()` is the slot inside the one allocation (`check_plan`), and
        // `staging[r]` lies inside the page-locked buffer sized for the most any bucket copies
        // back (its outputs, or its tokens); the stream is synchronised below before the bytes
        // are read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut staging[r.clone()],
                src,
                stream.cu_stream(),
            )
        }
        .map_err(dev)?;
    }
    stream
        .synchronize()
        .map_err(|e| RuntimeError::Device(format!("{graph}: a kernel failed: {e}")))?;
    Ok(ranges)
}

/// Where `slots` land in the staging buffer: one after the other, from its start.
fn packed(slots: &[TensorSlot]) -> Vec<std::ops::Range<usize>> {
    let mut at = 0usize;
    slots
        .iter()
        .map(|slot| {
            let n = slot.bytes() as usize;
            at += n;
            at - n..at
        })
        .collect()
}

/// The most bytes any bucket copies back: its outputs, or a decode step's tokens ([`MAX_STEPS`]
/// of them when the step advances its inputs).
fn plans_outputs_bytes(buckets: &[(&BucketEntry, ExecPlan)]) -> usize {
    buckets
        .iter()
        .map(|(_, p)| {
            let outputs: usize = p.outputs.iter().map(|s| s.bytes() as usize).sum();
            let steps = if p.advances { MAX_STEPS } else { 1 };
            outputs.max(p.tokens.as_ref().map_or(0, |t| t.bytes() as usize * steps))
        })
        .max()
        .unwrap_or(0)
}

/// Bytes of each of the two page-locked chunks the weights go to the GPU through.
const UPLOAD_CHUNK: usize = 64 << 20;

/// Copies the weights `region` (mapped from the artifact) to the device at `base`, chunk by chunk
/// through two page-locked buffers: the host copies one chunk while the GPU takes the other, and
/// each chunk's mapped pages are released once copied, so the host holds about two chunks of the
/// weights whatever their size.
fn upload_weights(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    base: u64,
    art: &Artifact,
    region: &[u8],
) -> Result<(), RuntimeError> {
    let chunk = UPLOAD_CHUNK.min(region.len().max(1));
    // SAFETY: page-locked host memory written only by this function, each half only after the
    // copy that last read it has completed (the stream is synchronised before every new copy).
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(2 * chunk, 0) }.map_err(dev)?;
    let pinned = pinned.as_mut_slice().map_err(dev)?;
    for (k, src) in region.chunks(chunk).enumerate() {
        let half = &mut pinned[(k % 2) * chunk..][..src.len()];
        // The copy of chunk k - 1 (from the other half) runs while this one is filled.
        half.copy_from_slice(src);
        stream.synchronize().map_err(dev)?;
        // SAFETY: the destination `base + k * chunk .. + src.len()` lies inside the weights
        // region of the one allocation (`region` is that region's bytes); the source is the
        // page-locked half just filled, not written again until the stream is synchronised.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                base + (k * chunk) as u64,
                &*half,
                stream.cu_stream(),
            )
        }
        .map_err(dev)?;
        art.release_weights(k * chunk, src.len());
    }
    stream.synchronize().map_err(dev)
}

/// A bucket's name in NVTX ranges: its graph file's stem (`decode-b8-s1`).
fn bucket_name(graph: &str) -> &str {
    std::path::Path::new(graph)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(graph)
}

/// Device addresses of the plan's regions, and a range of them that the steps find elsewhere.
#[derive(Clone)]
struct Addresses {
    base: u64,
    plan: kiln_ir::artifact::MemoryPlan,
    /// `(start, bytes, to)`: addresses in `start..start + bytes` are read as `to` on (a logits
    /// chunk's logits written straight into a [`CopyRing`] buffer).
    moved: Option<(u64, u64, u64)>,
}

impl Addresses {
    /// Device address of byte `offset` of `region`, moved where `moved` says.
    fn at(&self, region: Region, offset: u64) -> u64 {
        let a = self.base + self.plan.base(region) + offset;
        match self.moved {
            Some((start, bytes, to)) if (start..start + bytes).contains(&a) => to + (a - start),
            _ => a,
        }
    }
}

/// Launches `plan`'s steps on `stream` (captured when the stream is capturing), each a
/// programmatic dependent of the one before where `dependent` says so ([`launch::launch`]);
/// with a `profile`, waits after each launch, names the step that failed, and adds each step's
/// wall time (launch to completion) to its kernel's entry.
fn launch_steps(
    stream: &Arc<CudaStream>,
    functions: &Kernels,
    steps: &[Step],
    addresses: &Addresses,
    graph: &str,
    dependent: bool,
    mut profile: Option<&mut BTreeMap<String, (u64, f64)>>,
) -> Result<(), RuntimeError> {
    for step in steps {
        let _range = nvtx::range!("{} {}", step.node, step.kernel);
        let start = Instant::now();
        let kernel = &functions.by_name[step.kernel.as_str()];
        let failed = |e: String| {
            RuntimeError::Device(format!(
                "{graph}: step {} (`{}`) failed: {e}",
                step.node, step.kernel
            ))
        };
        let mut values: Vec<ArgValue> = step
            .args
            .iter()
            .zip(&kernel.params)
            .map(|(a, ty)| {
                Ok(match (*a, ty) {
                    (Arg::Ptr(r, o), _) => ArgValue::U64(addresses.at(r, o)),
                    (Arg::U32(v), _) => ArgValue::U32(v),
                    (Arg::F32(v), _) => ArgValue::F32(v),
                    (Arg::TensorMap(r, o), ParamType::TensorMap(spec)) => {
                        ArgValue::Map(tma::encode(spec, addresses.at(r, o))?)
                    }
                    (Arg::TensorMap(..), _) => return Err("a tensor map for another kind".into()),
                })
            })
            .collect::<Result<_, String>>()
            .map_err(&failed)?;
        let l = step.launch;
        let cfg = LaunchConfig {
            grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
            block_dim: (l.block[0], l.block[1], l.block[2]),
            shared_mem_bytes: l.shared_bytes,
        };
        let driver = |e: cudarc::driver::DriverError| failed(e.to_string());
        // SAFETY: `check_plan` verified one argument of the declared kind per parameter, every
        // pointer inside the one allocation and every tensor map's matrix inside its region,
        // whose regions the compiler sized for these kernels' shapes (a logits slot `moved` to
        // a ring buffer lies in it whole: the buffers hold the widest logits slot); format 9
        // kernels wait for their predecessor before reading (`launch::launch`).
        unsafe { launch::launch(stream, &kernel.function, cfg, &mut values, dependent) }
            .map_err(driver)?;
        if let Some(profile) = profile.as_deref_mut() {
            stream.synchronize().map_err(driver)?;
            let e = profile.entry(step.kernel.clone()).or_default();
            e.0 += 1;
            e.1 += start.elapsed().as_secs_f64();
        }
    }
    Ok(())
}

/// A host tensor's bytes in `dtype` (little endian), as the device reads them.
pub(crate) fn encode(t: &Tensor, dtype: DType) -> Vec<u8> {
    match (&t.data, dtype) {
        (Data::Int(v), DType::I64) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (Data::Int(v), DType::I32) => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        (Data::Int(v), _) => v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect(),
        (Data::Float(v), DType::BF16) => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        (Data::Float(v), DType::F16) => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        (Data::Float(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Device bytes of `dtype` as a host tensor. Half-precision values widen to f32 exactly, so the
/// tensor is built as is rather than rounded again (a decode step's logits are 10^5-10^6 values).
pub(crate) fn decode(bytes: &[u8], dtype: DType, shape: Vec<usize>) -> Tensor {
    let widened = |values: Vec<f32>| Tensor {
        dtype,
        shape: shape.clone(),
        data: Data::Float(values),
    };
    match dtype {
        DType::BF16 => widened(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::F16 => widened(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::I64 => Tensor::i64(
            shape,
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ),
        _ => Tensor::f32(
            shape,
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cubin_versions_are_read_from_the_elf_flags() {
        let mut elf = vec![0u8; 0x40];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[7] = 0x41;
        elf[8] = 8;
        for (flags, sm) in [(0x600_5a04u32, 90), (0x600_5004, 80), (0x600_6402, 100)] {
            elf[0x30..0x34].copy_from_slice(&flags.to_le_bytes());
            assert_eq!(cubin_sm(&elf), Some(sm));
        }
        assert_eq!(cubin_sm(b"not an elf"), None);
    }

    /// A kernel of clusters launches on whole clusters only; one without takes any grid.
    #[test]
    fn a_cluster_kernels_grid_is_whole_clusters() {
        let entry = |cluster| KernelEntry {
            name: "pairs".into(),
            params: Vec::new(),
            max_shared_bytes: 0,
            path: Default::default(),
            image: Default::default(),
            cluster,
        };
        let step = |blocks| Step {
            kernel: "pairs".into(),
            args: Vec::new(),
            launch: kiln_ir::artifact::Launch {
                grid: [blocks, 1, 1],
                block: [384, 1, 1],
                shared_bytes: 0,
            },
            node: "attention_7".into(),
            fallback: None,
            base_only: false,
        };
        let size = |_: Region| 0u64;
        let check = |cluster, blocks| {
            let kernel = entry(cluster);
            let table = BTreeMap::from([("pairs", &kernel)]);
            check_step(&step(blocks), &table, &size)
        };
        assert_eq!(check(2, 64), Ok(()));
        assert_eq!(check(1, 63), Ok(()));
        assert_eq!(
            check(2, 63),
            Err(
                "step attention_7 launches `pairs` on 63 blocks along x, not whole clusters of 2"
                    .to_string()
            )
        );
        assert!(check(0, 64).is_err());
    }

    /// The rows a grouped request left uncomputed come back as zeros.
    #[test]
    fn rows_of_groups_not_run_are_zeros() {
        let mut t = Tensor::f32(vec![4, 2], (1..=8).map(|v| v as f32).collect());
        zero_rows_from(&mut t, 3);
        let want = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0];
        assert_eq!(t, Tensor::f32(vec![4, 2], want));
        // Every row computed: nothing changes.
        let mut ids = Tensor::i64(vec![2, 3], vec![7; 6]);
        zero_rows_from(&mut ids, 2);
        assert_eq!(ids, Tensor::i64(vec![2, 3], vec![7; 6]));
    }

    /// A logits slot moved to a ring buffer: every address inside it lands at the same offset
    /// in the buffer; its neighbours, and the other regions, stay where the plan puts them.
    #[test]
    fn addresses_inside_a_moved_slot_land_in_its_buffer() {
        let plan = kiln_ir::artifact::MemoryPlan {
            weights_bytes: 1000,
            weights: Vec::new(),
            cache_bytes: 512,
            cache: Vec::new(),
            paging: None,
            counter_bytes: 0,
            arena_bytes: 1 << 20,
        };
        let base = 1 << 40;
        let plain = Addresses {
            base,
            plan,
            moved: None,
        };
        let (offset, bytes, to) = (4096u64, 2048u64, 7 << 40);
        let start = plain.at(Region::Arena, offset);
        let moved = Addresses {
            moved: Some((start, bytes, to)),
            ..plain.clone()
        };
        assert_eq!(moved.at(Region::Arena, offset), to);
        assert_eq!(moved.at(Region::Arena, offset + bytes - 1), to + bytes - 1);
        for (region, o) in [
            (Region::Arena, offset - 1),
            (Region::Arena, offset + bytes),
            (Region::Weights, offset),
            (Region::Cache, 0),
        ] {
            assert_eq!(moved.at(region, o), plain.at(region, o), "{region:?} {o}");
        }
    }
}
