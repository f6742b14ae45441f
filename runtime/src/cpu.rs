//! The CPU executor: the artifact's CPU plans (over the GPU's memory plan, or for f16/bf16 builds
//! over their own f32 one, the weights widened at load), with the
//! kernels `kiln compile` generated ahead of time (Cranelift, linked into the artifact's CPU
//! library, loaded here with libloading: the runtime never links a code generator) and matrix
//! products from the `gemm` crate. Every kernel takes `(args, begin, end)`, so each call is split
//! across rayon's threads over its parallel axis. Weights are read in place from the
//! memory-mapped weights file; the KV cache and the arena are allocated once at load.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_ir::artifact::{
    cpu_library_name, Arg, BucketEntry, CpuCall, CpuPlan, CpuStep, MemoryPlan, Region, TensorSlot,
};
use kiln_ir::Tensor;
use rayon::prelude::*;

use crate::{Artifact, RuntimeError};

/// The kernel ABI every generated function has.
type KernelFn = unsafe extern "C" fn(*const u64, u64, u64);

/// The library's functions the plans call, by symbol.
type Functions = BTreeMap<String, KernelFn>;

/// The CPU plans, by graph file.
type Plans = BTreeMap<String, Arc<CpuPlan>>;

/// The generated token sampler and its scratch row.
type Sampler = (KernelFn, Vec<u64>);

/// A loaded artifact on the CPU.
pub struct CpuExecutor {
    /// Keeps the generated code mapped while the function pointers are used.
    _library: libloading::Library,
    functions: Functions,
    plans: Plans,
    memory: MemoryPlan,
    /// Address of the weights region: the memory-mapped file's data, or `_widened`.
    weights: u64,
    /// The widened weights region of a half-precision build.
    _widened: Option<Vec<u64>>,
    /// The artifact's dtype, which the outputs of a widened plan are rounded to.
    round_to: Option<kiln_ir::DType>,
    cache: Vec<u64>,
    /// The counters region (no CPU kernel counts with it; kept so every region has an address).
    counters: Vec<u64>,
    arena: Vec<u64>,
    product: Vec<f32>,
    /// `KILN_EAGER` set: seconds and calls per kernel (or `gemm MxNxK`), for profiling.
    profile: Option<BTreeMap<String, (u64, f64)>>,
    /// The generated token sampler (decoders) and its scratch row.
    sampler: Option<Sampler>,
    /// Seconds from the opened artifact to ready: library loaded, plans checked, weights
    /// widened (f16/bf16 builds), buffers allocated.
    pub load_seconds: f64,
}

impl CpuExecutor {
    /// Loads `art`'s CPU library and plans; `Err` naming the reason when the artifact has none
    /// for this machine (no library, another architecture).
    pub fn load(art: &Artifact) -> Result<CpuExecutor, RuntimeError> {
        let start = std::time::Instant::now();
        let m = &art.manifest;
        let file = m.kernels_cpu.as_ref().ok_or_else(|| {
            RuntimeError::Device(
                "the artifact has no CPU library (compiled with --target cuda, or no bucket has a CPU plan)".into(),
            )
        })?;
        check_machine(art, file)?;
        // Half-precision builds run their CPU plans in f32 over a memory plan of their own,
        // with the weights widened once, here; otherwise weights are read in place.
        let memory = m.cpu_memory.clone().unwrap_or_else(|| m.memory.clone());
        let (weights, widened) = cpu_weights(art)?;
        let library = Library::open(art, file)?;
        let (plans, functions, product) = library.plans()?;
        let sampler = library.sampler()?;
        let library = library.library;
        Ok(CpuExecutor {
            load_seconds: start.elapsed().as_secs_f64(),
            sampler,
            _library: library,
            functions,
            plans,
            cache: vec![0u64; memory.cache_bytes.div_ceil(8) as usize],
            counters: vec![0u64; memory.counter_bytes.div_ceil(8) as usize],
            arena: vec![0u64; memory.arena_bytes.div_ceil(8) as usize],
            round_to: widened.as_ref().map(|_| m.dtype),
            memory,
            weights,
            _widened: widened,
            product: vec![0f32; product],
            profile: std::env::var_os("KILN_EAGER").map(|_| BTreeMap::new()),
        })
    }

    /// Whether the bucket whose graph file is `graph` has a CPU plan.
    pub fn has(&self, graph: &str) -> bool {
        self.plans.contains_key(graph)
    }

    /// The token the generated sampler picks from one row of `logits` at step `step`, or `None`
    /// when the artifact has no sampler.
    pub fn choose(
        &mut self,
        logits: &[f32],
        sampling: &crate::generate::Sampling,
        step: u32,
    ) -> Result<Option<usize>, RuntimeError> {
        let Some((f, scratch)) = self.sampler.as_mut() else {
            return Ok(None);
        };
        if logits.len() != scratch.len() {
            return Err(RuntimeError::Request(format!(
                "a row of {} logits for a sampler over {}",
                logits.len(),
                scratch.len()
            )));
        }
        let mut token = -1i64;
        let args = [
            logits.as_ptr() as u64,
            &mut token as *mut i64 as u64,
            scratch.as_mut_ptr() as u64,
            u64::from(sampling.temperature.to_bits()),
            sampling.top_k as u64,
            u64::from(sampling.top_p.to_bits()),
            u64::from(crate::generate::uniform_word(sampling, step)),
        ];
        // SAFETY: the sampler was generated for rows of `scratch.len()` logits (the artifact's
        // vocabulary), which `logits` holds; `scratch` has the 8 bytes per logit it needs and
        // `token` is the one i64 it writes.
        unsafe { f(args.as_ptr(), 0, 1) };
        usize::try_from(token)
            .ok()
            .filter(|&t| t < logits.len())
            .map(Some)
            .ok_or_else(|| RuntimeError::Device(format!("the sampler returned token {token}")))
    }

    /// Empties the KV cache (a new generation).
    pub fn reset_cache(&mut self) {
        self.cache.fill(0);
    }

    /// Times every later call per kernel into [`Self::profile`] (what `KILN_EAGER` asks for at
    /// load), or stops timing.
    pub fn set_profiling(&mut self, on: bool) {
        match (on, self.profile.is_some()) {
            (true, false) => self.profile = Some(BTreeMap::new()),
            (false, true) => self.profile = None,
            _ => {}
        }
    }

    /// Writes the paged cache's block table (`[rows, entries]`).
    pub fn write_block_table(&mut self, table: &[u32]) -> Result<(), RuntimeError> {
        let at = crate::executor::block_table_at(self.memory.paging.as_ref(), table)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.cache);
        bytes[at..at + table.len() * 4].copy_from_slice(bytemuck::cast_slice(table));
        Ok(())
    }

    /// Copies row `from` of every slot of a dense KV cache to row `to`.
    pub fn copy_cache_row(&mut self, from: usize, to: usize) -> Result<(), RuntimeError> {
        let copies = crate::executor::cache_row_copies(
            &self.memory.cache,
            self.memory.paging.as_ref(),
            from,
            to,
        )?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.cache);
        for (src, dst, n) in copies {
            let (src, dst, n) = (src as usize, dst as usize, n as usize);
            bytes.copy_within(src..src + n, dst);
        }
        Ok(())
    }

    /// Runs one bucket: inputs into their arena slots, the steps in order, outputs back.
    pub fn run(
        &mut self,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let plan = self.plans.get(&entry.graph).cloned().ok_or_else(|| {
            RuntimeError::Device(format!("bucket {} has no CPU plan", entry.graph))
        })?;
        let arena = self.arena.as_mut_ptr() as *mut u8;
        for slot in &plan.inputs {
            let t = inputs.get(&slot.name).ok_or_else(|| {
                RuntimeError::Request(format!("input `{}` is missing", slot.name))
            })?;
            let bytes = crate::cuda::encode(t, slot.dtype);
            if t.shape != slot.shape || bytes.len() as u64 != slot.bytes() {
                return Err(RuntimeError::Request(format!(
                    "input `{}` has shape {:?}; bucket {} takes {:?}",
                    slot.name, t.shape, entry.graph, slot.shape
                )));
            }
            // SAFETY: the slot lies inside the arena (`check_plan` at load); `bytes` is exactly
            // the slot's size.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    arena.add(slot.offset as usize),
                    bytes.len(),
                )
            };
        }
        for step in &plan.steps {
            let start = std::time::Instant::now();
            self.step(step)?;
            if let Some(profile) = self.profile.as_mut() {
                let key = match &step.call {
                    CpuCall::Kernel { symbol, .. } => symbol.clone(),
                    CpuCall::Gemm { m, n, k, .. } => format!("gemm {m}x{n}x{k}"),
                };
                let e = profile.entry(key).or_default();
                e.0 += 1;
                e.1 += start.elapsed().as_secs_f64();
            }
        }
        let mut out = BTreeMap::new();
        for slot in &plan.outputs {
            // SAFETY: as above, the slot lies inside the arena.
            let bytes = unsafe {
                std::slice::from_raw_parts(arena.add(slot.offset as usize), slot.bytes() as usize)
            };
            let t = decode(bytes, slot);
            let t = match self.round_to {
                Some(dtype) if t.dtype.is_float() => t.cast(dtype),
                _ => t,
            };
            out.insert(slot.name.clone(), t);
        }
        Ok(out)
    }

    fn address(&self, region: Region, offset: u64) -> u64 {
        let base = match region {
            Region::Weights => self.weights,
            Region::Cache => self.cache.as_ptr() as u64,
            Region::Counters => self.counters.as_ptr() as u64,
            Region::Arena => self.arena.as_ptr() as u64,
        };
        base + offset
    }

    fn step(&mut self, step: &CpuStep) -> Result<(), RuntimeError> {
        let args: Vec<u64> = step
            .args
            .iter()
            .map(|a| match *a {
                // A CPU call takes every matrix by its address.
                Arg::Ptr(r, o) | Arg::TensorMap(r, o) => self.address(r, o),
                Arg::U32(v) => u64::from(v),
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        match &step.call {
            CpuCall::Kernel { symbol, extent } => {
                let f = self.functions[symbol];
                parallel(f, &args, *extent);
            }
            CpuCall::Gemm {
                m,
                n,
                k,
                transpose_b,
                bias,
                residual,
                epilogue,
            } => {
                let (m, n, k) = (*m as usize, *n as usize, *k as usize);
                let out = *args.last().expect("an output");
                let dst = match epilogue {
                    Some(_) => self.product.as_mut_ptr() as u64,
                    None => out,
                };
                let (rhs_cs, rhs_rs) = if *transpose_b {
                    (k as isize, 1)
                } else {
                    (1, n as isize)
                };
                // SAFETY: x is `[m, k]`, w `[n, k]` (or `[k, n]`), dst `[m, n]` — the compiler
                // sized every buffer for this product; the scratch product buffer holds the
                // largest `m x n` of the plans.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        dst as *mut f32,
                        1,
                        n as isize,
                        false,
                        args[0] as *const f32,
                        1,
                        k as isize,
                        args[1] as *const f32,
                        rhs_cs,
                        rhs_rs,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(0),
                    )
                };
                if let Some(symbol) = epilogue {
                    let mut epilogue_args = vec![dst];
                    let mut rest = args[2..args.len() - 1].iter();
                    if *bias {
                        epilogue_args.push(*rest.next().expect("a bias"));
                    }
                    if *residual {
                        epilogue_args.push(*rest.next().expect("a residual"));
                    }
                    epilogue_args.push(out);
                    parallel(self.functions[symbol], &epilogue_args, m as u64);
                }
            }
        }
        Ok(())
    }

    /// Per kernel: calls and seconds, measured when `KILN_EAGER` is set; empty otherwise.
    pub fn profile(&self) -> BTreeMap<String, (u64, f64)> {
        self.profile.clone().unwrap_or_default()
    }

    /// Bytes of the memory this executor allocated (cache and arena) and maps (weights).
    pub fn memory_bytes(&self) -> u64 {
        self.memory.total_bytes()
    }
}

/// Calls `f` over `0..extent` in chunks, in parallel.
fn parallel(f: KernelFn, args: &[u64], extent: u64) {
    let threads = rayon::current_num_threads() as u64;
    let chunks = (threads * 4).clamp(1, extent.max(1));
    let size = extent.div_ceil(chunks).max(1);
    let args_addr = args.as_ptr() as u64;
    (0..extent.div_ceil(size)).into_par_iter().for_each(|c| {
        let begin = c * size;
        let end = (begin + size).min(extent);
        // SAFETY: `args` outlives the parallel loop; every generated kernel only touches the
        // items `begin..end` of its parallel axis for its outputs, so chunks never overlap.
        unsafe { f(args_addr as *const u64, begin, end) };
    });
}

/// `Err` unless the artifact's CPU library `file` is this machine's kind (and, on x86-64, the
/// CPU has what its code uses).
fn check_machine(art: &Artifact, file: &str) -> Result<(), RuntimeError> {
    let here = cpu_library_name();
    if *file != here {
        let message = format!("is built for another machine (this one loads {here})");
        return Err(art.file_error(file, message));
    }
    #[cfg(target_arch = "x86_64")]
    if !(std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("bmi2")
        && std::arch::is_x86_feature_detected!("lzcnt"))
    {
        return Err(RuntimeError::Device(format!(
            "{file} needs an x86-64-v3 CPU (AVX2, FMA, BMI2, LZCNT); this one lacks them"
        )));
    }
    Ok(())
}

/// The address the CPU plans read weights at, and the widened words that hold them for a
/// half-precision build (its own f32 memory plan); otherwise the weights region in place.
fn cpu_weights(art: &Artifact) -> Result<(u64, Option<Vec<u64>>), RuntimeError> {
    let m = &art.manifest;
    let Some(plan) = &m.cpu_memory else {
        return Ok((art.weights_region()?.as_ptr() as u64, None));
    };
    let store = art.weights.as_ref().ok_or_else(|| {
        RuntimeError::Device("the artifact was compiled with --no-weights".into())
    })?;
    let words = store
        .widened(plan)
        .map_err(|message| art.weights_error(message))?;
    Ok((words.as_ptr() as u64, Some(words)))
}

/// The artifact's CPU library, loaded: where its plans' kernels and sampler are looked up.
struct Library<'a> {
    art: &'a Artifact,
    file: &'a str,
    library: libloading::Library,
}

impl<'a> Library<'a> {
    fn open(art: &'a Artifact, file: &'a str) -> Result<Library<'a>, RuntimeError> {
        // SAFETY: the library was written by `kiln compile` into this checksum-verified
        // artifact; it has no initialisers and exports functions of the kernel ABI only.
        let library = unsafe { libloading::Library::new(art.dir.join(file)) }
            .map_err(|e| art.file_error(file, format!("cannot be loaded: {e}")))?;
        Ok(Library { art, file, library })
    }

    /// The function `symbol` (`what` for the error: a kernel or the sampler).
    fn function(&self, symbol: &str, what: &str) -> Result<KernelFn, RuntimeError> {
        // SAFETY: every exported symbol of the library has the kernel ABI.
        let f = unsafe { self.library.get::<KernelFn>(symbol.as_bytes()) }.map_err(|e| {
            self.art
                .file_error(self.file, format!("lacks the {what}: {e}"))
        })?;
        Ok(*f)
    }

    /// Every bucket's CPU plan, checked, by graph file; the kernels they call, by symbol; and
    /// the most elements a product's result takes ahead of its epilogue.
    fn plans(&self) -> Result<(Plans, Functions, usize), RuntimeError> {
        let mut plans = BTreeMap::new();
        let mut functions = BTreeMap::new();
        let mut product = 0usize;
        for entry in self.art.manifest.buckets() {
            let Some(plan) = entry.plan.as_ref().and_then(|p| p.cpu.as_ref()) else {
                continue;
            };
            check_plan(self.art, entry, plan)?;
            for step in &plan.steps {
                let symbol = match &step.call {
                    CpuCall::Kernel { symbol, .. } => Some(symbol),
                    CpuCall::Gemm { m, n, epilogue, .. } => {
                        if epilogue.is_some() {
                            product = product.max((*m * *n) as usize);
                        }
                        epilogue.as_ref()
                    }
                };
                if let Some(symbol) = symbol.filter(|s| !functions.contains_key(*s)) {
                    let f = self.function(symbol, &format!("kernel `{symbol}`"))?;
                    functions.insert(symbol.clone(), f);
                }
            }
            plans.insert(entry.graph.clone(), Arc::new(plan.clone()));
        }
        Ok((plans, functions, product))
    }

    /// The sampler the manifest names, with its scratch words: `Err` unless it is the one for
    /// the model's vocabulary.
    fn sampler(&self) -> Result<Option<Sampler>, RuntimeError> {
        let m = &self.art.manifest;
        let Some(symbol) = &m.cpu_sampler else {
            return Ok(None);
        };
        if *symbol != kiln_ir::artifact::cpu_sampler_name(m.model.vocab_size) {
            return Err(self.art.file_error(
                kiln_ir::artifact::MANIFEST,
                format!(
                    "names the sampler `{symbol}`, which is not the one for a vocabulary of {}",
                    m.model.vocab_size
                ),
            ));
        }
        let f = self.function(symbol, &format!("sampler `{symbol}`"))?;
        Ok(Some((f, vec![0u64; m.model.vocab_size])))
    }
}

/// Checks a CPU plan against the memory plan before anything runs: every pointer argument lies
/// inside its region and every input and output slot inside the arena.
fn check_plan(art: &Artifact, entry: &BucketEntry, plan: &CpuPlan) -> Result<(), RuntimeError> {
    let m = art
        .manifest
        .cpu_memory
        .as_ref()
        .unwrap_or(&art.manifest.memory);
    let bad = |message: String| art.plan_error(entry, message);
    let size = |r: Region| m.region_bytes(r);
    for step in &plan.steps {
        for arg in &step.args {
            if let Arg::Ptr(region, offset) = *arg {
                if offset >= size(region).max(1) {
                    return Err(bad(format!(
                        "CPU step {} points at {region:?} + {offset}, past its end",
                        step.node
                    )));
                }
            }
        }
    }
    for step in &plan.steps {
        if let CpuCall::Gemm { bias, residual, .. } = step.call {
            let want = 3 + usize::from(bias) + usize::from(residual);
            if step.args.len() != want {
                return Err(bad(format!(
                    "CPU step {} passes {} arguments to a product that takes {want}",
                    step.node,
                    step.args.len()
                )));
            }
        }
    }
    for slot in plan.inputs.iter().chain(&plan.outputs) {
        if slot
            .offset
            .checked_add(slot.bytes())
            .is_none_or(|end| end > m.arena_bytes)
        {
            return Err(bad(format!("`{}` lies outside the arena", slot.name)));
        }
    }
    Ok(())
}

/// Bytes of `slot`'s dtype as a host tensor.
fn decode(bytes: &[u8], slot: &TensorSlot) -> Tensor {
    crate::cuda::decode(bytes, slot.dtype, slot.shape.clone())
}
