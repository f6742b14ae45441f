//! The artifact writer: a compiled model's manifest, bucket graphs, kernel modules (PTX, and
//! cubins when ptxas is found), CPU library, weights, tokenizer and checksums, written into a
//! staging folder and swapped into place whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use kiln_ir::artifact::{self, Image};
use kiln_ir::{checksum, DType};
use kiln_models::ModelKind;

use crate::bucket::BucketPlan;
use crate::compile::{Compiled, CompiledBucket};
use crate::plan::{ArtifactPlan, KvPaging};
use crate::progress::Progress;
use crate::staging::Staging;

/// What an artifact is written from.
pub(crate) struct ArtifactSource<'a> {
    pub(crate) model: &'a kiln_models::Model,
    pub(crate) plan: &'a BucketPlan,
    pub(crate) compiled: &'a Compiled,
    pub(crate) with_weights: bool,
    pub(crate) dtype: DType,
    pub(crate) target: Target,
    pub(crate) kv_paging: Option<KvPaging>,
}

/// Writes the artifact (`manifest.ron`, `buckets/*.ron`, `kernels.ptx` and the cubin,
/// `weights.safetensors`, the checkpoint's `tokenizer.json`, `tokenizer_config.json` and
/// `generation_config.json`, `checksums`) into a staging folder beside `out_dir`,
/// then swaps it into place ([`Staging`]), so that a failure or an interruption leaves nothing at
/// `out_dir` but the previous output, whole. Returns the seconds of each stage.
pub(crate) fn write_artifact(
    out_dir: &Path,
    src: &ArtifactSource,
    progress: &Progress,
) -> Result<BTreeMap<String, f64>> {
    let is_output = |dir: &Path| {
        dir.join(artifact::MANIFEST).is_file()
            || dir
                .read_dir()
                .map(|mut d| d.next().is_none())
                .unwrap_or(false)
    };
    let staging = Staging::new(out_dir, is_output)?;
    match fill_artifact(staging.path(), src, progress) {
        Ok(seconds) => {
            staging.commit()?;
            Ok(seconds)
        }
        Err(e) => bail!("cannot write {}: {e:#}", staging.out().display()),
    }
}

/// Writes every file of the artifact into `dir`.
fn fill_artifact(
    dir: &Path,
    src: &ArtifactSource,
    progress: &Progress,
) -> Result<BTreeMap<String, f64>> {
    let mut seconds = BTreeMap::new();
    let mut timed = |stage: &str, start: std::time::Instant| {
        seconds.insert(stage.to_string(), start.elapsed().as_secs_f64());
    };
    let start = std::time::Instant::now();
    let compiled = src.compiled;
    let graphs: Vec<&kiln_ir::Graph> = compiled
        .prefill
        .iter()
        .chain(&compiled.decode)
        .chain(&compiled.logits_chunks)
        .map(|b| &b.graph)
        .collect();
    let art = {
        let _stage = progress.stage("plan", 0);
        crate::plan::plan_artifact(&graphs, src.target.cpu(), src.kv_paging)?
    };
    timed("plan", start);
    std::fs::create_dir(dir.join("buckets"))?;
    let mut planned = art.buckets.iter();
    let mut entries = |kind: &str, buckets: &[CompiledBucket]| {
        buckets
            .iter()
            .map(|b| {
                let p = planned.next().expect("one planned bucket per bucket");
                bucket_entry(dir, kind, b, p)
            })
            .collect::<std::io::Result<Vec<_>>>()
    };
    let prefill = entries("prefill", &compiled.prefill)?;
    let decode = entries("decode", &compiled.decode)?;
    let logits_chunks = entries("logits", &compiled.logits_chunks)?;
    let start = std::time::Instant::now();
    let kernel_files = if src.target.cuda() {
        write_kernels(dir, &art.kernels, progress)?
    } else {
        KernelFiles::default()
    };
    timed("ptx", start);
    let start = std::time::Instant::now();
    let sampler_vocab = match src.model.kind {
        ModelKind::Decoder { vocab_size, .. } => Some(u32::try_from(vocab_size)?),
        ModelKind::Encoder { .. } => None,
    };
    let (cpu_library, cpu_sampler) = if src.target.cpu() {
        write_cpu_kernels(dir, &art, sampler_vocab, progress)?
    } else {
        (None, None)
    };
    timed("cpu", start);
    let start = std::time::Instant::now();
    let weights_digest = if src.with_weights {
        Some(write_weights(dir, src, &art, progress)?)
    } else {
        None
    };
    timed("weights", start);
    let files = Files {
        kernels: kernel_files,
        cpu: (cpu_library, cpu_sampler),
        weights_digest: weights_digest.clone(),
        checkpoint: copy_checkpoint_files(dir, src)?,
    };
    let manifest = manifest(src, &art, files, [prefill, decode, logits_chunks])?;
    let text = ron::ser::to_string_pretty(&manifest, ron::ser::PrettyConfig::new())?;
    std::fs::write(dir.join(artifact::MANIFEST), text)?;
    write_checksums(dir, &manifest, weights_digest)?;
    Ok(seconds)
}

/// The files an artifact's manifest names besides its buckets: the kernel modules, the CPU
/// library and sampler, the weights' digest (when written) and the checkpoint's tokenizer,
/// tokenizer settings and generation settings (when it has them).
struct Files {
    kernels: KernelFiles,
    cpu: (Option<String>, Option<String>),
    weights_digest: Option<String>,
    checkpoint: [Option<String>; 3],
}

/// Writes the weights file; returns its digest.
fn write_weights(
    dir: &Path,
    src: &ArtifactSource,
    art: &crate::plan::ArtifactPlan,
    progress: &Progress,
) -> Result<String> {
    let stage = progress.bytes(
        "weights",
        art.memory.weights.iter().map(|s| s.bytes()).sum(),
    );
    let checkpoint = &src.model.checkpoint;
    let digest =
        crate::weights::write_weights(&dir.join(artifact::WEIGHTS), checkpoint, art, &|n| {
            stage.inc(n)
        })?;
    Ok(digest)
}

/// Copies the checkpoint's tokenizer, tokenizer settings and generation settings, those it has;
/// returns their names.
fn copy_checkpoint_files(dir: &Path, src: &ArtifactSource) -> Result<[Option<String>; 3]> {
    let copy = |file: &str| -> Result<Option<String>> {
        let from = src.model.checkpoint.dir().join(file);
        if !from.is_file() {
            return Ok(None);
        }
        std::fs::copy(&from, dir.join(file))?;
        Ok(Some(file.to_string()))
    };
    Ok([
        copy(TOKENIZER)?,
        copy("tokenizer_config.json")?,
        copy("generation_config.json")?,
    ])
}

/// The manifest of the artifact planned as `art`, with its `files` and the entries of its
/// prefill, decode and logits-chunk buckets.
fn manifest(
    src: &ArtifactSource,
    art: &crate::plan::ArtifactPlan,
    files: Files,
    [prefill, decode, logits_chunks]: [Vec<artifact::BucketEntry>; 3],
) -> Result<artifact::Manifest> {
    let Files {
        kernels: kernel_files,
        cpu: (cpu_library, cpu_sampler),
        weights_digest,
        checkpoint: [tokenizer, tokenizer_config, generation_config],
    } = files;
    let compiled = src.compiled;
    Ok(artifact::Manifest {
        format_version: artifact::FORMAT_VERSION,
        compiler_version: env!("CARGO_PKG_VERSION").to_string(),
        compiler_git: env!("KILN_GIT_HASH").to_string(),
        model_config: std::fs::read_to_string(src.model.checkpoint.dir().join("config.json"))?,
        weights_digest: weights_digest.clone(),
        architecture: src.model.architecture.clone(),
        model: artifact::ModelSummary::new(
            src.model.contract(),
            src.model
                .graph
                .outputs()
                .iter()
                .map(|o| o.name.clone())
                .collect(),
        ),
        dtype: src.dtype,
        weights: weights_digest
            .as_ref()
            .map(|_| artifact::WEIGHTS.to_string()),
        tokenizer,
        tokenizer_config,
        generation_config,
        kernels_ptx: kernel_files.ptx,
        targets: if kernel_files.cubin.is_some() {
            vec![90]
        } else {
            vec![]
        },
        kernels_cubin: kernel_files.cubin,
        kernels_sm90a_ptx: kernel_files.sm90a_ptx,
        kernels_sm90a_cubin: kernel_files.sm90a_cubin,
        kernels_cpu: cpu_library,
        cpu_sampler,
        seq_buckets: src.plan.seq_lens.clone(),
        batch_buckets: src.plan.batch_sizes.clone(),
        max_context: compiled.decode.first().and_then(|b| b.context),
        prefill,
        decode,
        logits_chunks,
        memory: art.memory.clone(),
        cpu_memory: art.cpu_memory.clone(),
        kernel_table: art.kernel_table(),
    })
}

/// Writes bucket `b`'s static graph under `buckets/` and returns its manifest entry, with the plan
/// `p` made for it.
fn bucket_entry(
    dir: &Path,
    kind: &str,
    b: &CompiledBucket,
    p: &crate::plan::PlannedBucket,
) -> std::io::Result<artifact::BucketEntry> {
    let file = format!("buckets/{kind}-{}.ron", b.bucket.label());
    std::fs::write(dir.join(&file), p.graph.to_ron())?;
    let mut kernels: Vec<String> = Vec::new();
    for step in p.plan.iter().flat_map(|p| &p.steps) {
        if kernels.last() != Some(&step.node) {
            kernels.push(step.node.clone());
        }
    }
    Ok(artifact::BucketEntry {
        batch: b.bucket.batch,
        seq: b.bucket.seq,
        context: b.context,
        graph: file,
        kernels,
        plan: p.plan.clone(),
        no_gpu: p.unsupported.clone(),
        no_cpu: p.no_cpu.clone(),
    })
}

/// Writes `checksums`: every file the manifest names, the manifest included; the weights were
/// hashed as they were written (`weights_digest`).
fn write_checksums(
    dir: &Path,
    manifest: &artifact::Manifest,
    weights_digest: Option<String>,
) -> Result<()> {
    let mut files: Vec<String> = vec![artifact::MANIFEST.to_string()];
    files.extend(manifest.kernels_ptx.iter().cloned());
    files.extend(manifest.kernels_cubin.iter().cloned());
    files.extend(manifest.kernels_sm90a_ptx.iter().cloned());
    files.extend(manifest.kernels_sm90a_cubin.iter().cloned());
    files.extend(manifest.kernels_cpu.iter().cloned());
    files.extend(manifest.tokenizer.iter().cloned());
    files.extend(manifest.tokenizer_config.iter().cloned());
    files.extend(manifest.generation_config.iter().cloned());
    files.extend(manifest.buckets().map(|b| b.graph.clone()));
    let mut sums = checksum::digest_files(dir, &files)?;
    if let (Some(file), Some(digest)) = (&manifest.weights, weights_digest) {
        sums.push((digest, file.clone()));
    }
    std::fs::write(
        dir.join(artifact::CHECKSUMS),
        checksum::render_checksums(&sums),
    )?;
    Ok(())
}

const TOKENIZER: &str = "tokenizer.json";

/// The kernel files of an artifact: each image's PTX module and, when ptxas was found, its cubin.
#[derive(Default)]
struct KernelFiles {
    ptx: Option<String>,
    cubin: Option<String>,
    sm90a_ptx: Option<String>,
    sm90a_cubin: Option<String>,
}

/// Writes each image's module (`kernels.ptx`; `kernels.sm_90a.ptx` when some kernel needs sm_90a)
/// and, when a ptxas is found (`$KILN_PTXAS` or PATH), the cubin of each.
fn write_kernels(
    dir: &Path,
    kernels: &crate::lower::Lowered,
    progress: &Progress,
) -> Result<KernelFiles> {
    let ptxas = find_ptxas();
    let mut files = KernelFiles::default();
    for image in [Image::Sm90, Image::Sm90a] {
        let texts: Vec<String> = kernels
            .kernels
            .values()
            .filter(|k| k.image == image)
            .map(|k| k.ptx.clone())
            .collect();
        if texts.is_empty() && image == Image::Sm90a {
            continue;
        }
        let target = image.target();
        let ptx_name = match image {
            Image::Sm90 => "kernels.ptx".to_string(),
            Image::Sm90a => format!("kernels.{target}.ptx"),
        };
        let module = kiln_kernels::ptx::module_for(target, &texts);
        std::fs::write(dir.join(&ptx_name), &module)?;
        let cubin = match &ptxas {
            Some(ptxas) => Some(assemble(dir, ptxas, &ptx_name, &module, target, progress)?),
            None => None,
        };
        match image {
            Image::Sm90 => (files.ptx, files.cubin) = (Some(ptx_name), cubin),
            Image::Sm90a => (files.sm90a_ptx, files.sm90a_cubin) = (Some(ptx_name), cubin),
        }
    }
    Ok(files)
}

/// Assembles `dir/ptx_name` (whose text is `module`) for `target` into `kernels.{target}.cubin`,
/// or copies the cached cubin of the same PTX and ptxas; returns the cubin's name.
fn assemble(
    dir: &Path,
    ptxas: &Path,
    ptx_name: &str,
    module: &str,
    target: &str,
    progress: &Progress,
) -> Result<String> {
    let stage = progress.stage("ptxas", 0);
    let name = format!("kernels.{target}.cubin");
    let cubin = dir.join(&name);
    let cached = cubin_cache(ptxas, module, target);
    if let Some(hit) = cached.as_ref().filter(|c| c.is_file()) {
        stage.say("cached");
        std::fs::copy(hit, &cubin)?;
        return Ok(name);
    }
    stage.say(format!("kernels for {target}"));
    // `--split-compile 0`: optimise the module's functions on every core.
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={target}"))
        .args(["--split-compile", "0"])
        .arg(dir.join(ptx_name))
        .arg("-o")
        .arg(&cubin)
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", ptxas.display()))?;
    if !out.status.success() {
        let first = String::from_utf8_lossy(&out.stderr)
            .lines()
            .next()
            .unwrap_or("no message")
            .to_string();
        bail!("ptxas rejected {ptx_name}: {first}");
    }
    if let Some(path) = cached {
        // A cache that cannot be written only costs the next compile its ptxas run.
        let _ = path
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| std::fs::read(&cubin))
            .map(|bytes| crate::tensor_io::write_atomically(&path, &bytes));
    }
    Ok(name)
}

/// Where the cubin ptxas makes of `module` for `target` is cached across compiles: under
/// `$KILN_CACHE`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`, named by the digest of the
/// PTX and of the ptxas binary and flags (another ptxas or PTX is another entry); `None` without
/// a home.
fn cubin_cache(ptxas: &Path, module: &str, target: &str) -> Option<PathBuf> {
    let root = std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("kiln")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln")))?;
    let tool = checksum::digest_file(ptxas).ok()?;
    let mut d = checksum::Digester::new();
    let arch = format!("-arch={target}");
    for part in [tool.as_str(), arch.as_str(), module] {
        d.update(part.as_bytes());
        d.update(&[0]);
    }
    Some(
        root.join("cubin")
            .join(format!("{}.{target}.cubin", d.finish())),
    )
}

/// Which code `kiln compile` generates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// GPU and CPU kernels.
    All,
    /// GPU kernels only (PTX, and SASS when ptxas is found).
    Cuda,
    /// CPU kernels only (Cranelift).
    Cpu,
}

impl Target {
    fn cuda(self) -> bool {
        self != Target::Cpu
    }

    fn cpu(self) -> bool {
        self != Target::Cuda
    }
}

/// Generates every CPU kernel the plans call (Cranelift, ahead of time), and for a decoder the
/// token sampler over rows of `sampler_vocab` logits, and links them into the CPU library; returns
/// its name and the sampler's, or `None`s when no plan runs on the CPU.
fn write_cpu_kernels(
    dir: &Path,
    plan: &ArtifactPlan,
    sampler_vocab: Option<u32>,
    progress: &Progress,
) -> Result<(Option<String>, Option<String>)> {
    use crate::lower::CpuKernel;
    use kiln_kernels::cpu::{self, CpuModule};
    if plan.cpu_kernels.is_empty() {
        return Ok((None, None));
    }
    let stage = progress.stage("cpu code", plan.cpu_kernels.len() as u64);
    let mut module = CpuModule::new()?;
    for (symbol, kernel) in &plan.cpu_kernels {
        stage.inc(1);
        let made = match kernel {
            CpuKernel::Norm(c) => cpu::norm::norm(&mut module, c)?,
            CpuKernel::Activation(a) => cpu::elementwise::activation_kernel(&mut module, *a)?,
            CpuKernel::Embedding(c) => cpu::embedding::embedding(&mut module, c)?,
            CpuKernel::KvWrite(c) => cpu::kv_cache::kv_write(&mut module, c)?,
            CpuKernel::Attention(c) => cpu::attention::attention(&mut module, c)?,
            CpuKernel::Gemm(c) => cpu::epilogue::epilogue(&mut module, c)?,
            CpuKernel::Strided(c) => cpu::strided::strided(&mut module, c)?,
        };
        debug_assert_eq!(&made, symbol);
    }
    let sampler = sampler_vocab
        .map(|vocab| cpu::sampling::sample(&mut module, vocab))
        .transpose()?;
    let name = artifact::cpu_library_name();
    cpu::link_shared(&module.finish()?, &dir.join(&name))?;
    Ok((Some(name), sampler))
}

/// `$KILN_PTXAS`, else a `ptxas` on PATH.
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PTXAS") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("ptxas"))
        .find(|p| p.is_file())
}
