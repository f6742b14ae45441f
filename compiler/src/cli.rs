//! The `kiln` command line: `kiln ir` and `kiln eval`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use kiln_ir::artifact::{ExecPlan, Image, KernelPath};
use kiln_ir::dim::{BATCH, SEQ};
use kiln_ir::{artifact, checksum, DType, Tensor};
use kiln_models::inputs::TokenBatch;
use kiln_models::{ImportOptions, ModelKind};

use crate::bucket::{Bucket, BucketPlan};
use crate::compile::{compile, compile_with_progress, CompileOptions, Compiled, CompiledBucket};
use crate::fusion::cost::CostModel;
use crate::fusion::Limits;
use crate::plan::{ArtifactPlan, KvPaging};
use crate::progress::Progress;
use crate::staging::Staging;
use crate::tensor_io::{parent_folder, read_tensors, write_tensors};
use crate::tokenize::tokenize;

/// kiln: an ahead-of-time compiler from transformer checkpoints to fused GPU kernels.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print a Hugging Face checkpoint's IR graph as RON (symbolic in batch B and sequence S).
    Ir {
        /// Checkpoint folder (config.json + safetensors).
        model_dir: PathBuf,
        /// Fix the sequence length S.
        #[arg(long)]
        seq_len: Option<usize>,
        /// Fix the batch size B.
        #[arg(long)]
        batch: Option<usize>,
        /// Print the fused graph of one bucket (needs --bucket).
        #[arg(long, requires = "bucket")]
        fused: bool,
        /// The bucket's sequence length (with --fused; batch from --batch, default 1).
        #[arg(long, conflicts_with = "seq_len")]
        bucket: Option<usize>,
    },
    /// Compile a checkpoint: fuse it with the e-graph rules and write one static graph per bucket.
    Compile {
        /// Checkpoint folder (config.json + safetensors).
        model_dir: PathBuf,
        /// Output folder (created; an earlier kiln output there is replaced).
        #[arg(short = 'o', long = "output")]
        out_dir: PathBuf,
        /// Sequence buckets, e.g. 16,64,256.
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["bucket_policy", "max_seq"])]
        buckets: Option<Vec<usize>>,
        /// How to choose sequence buckets when --buckets is absent.
        #[arg(long, value_enum, default_value_t = BucketPolicy::Pow2)]
        bucket_policy: BucketPolicy,
        /// The largest sequence bucket (pow2 policy).
        #[arg(long)]
        max_seq: Option<usize>,
        /// How many buckets the histogram policy chooses.
        #[arg(long, default_value_t = 8)]
        num_buckets: usize,
        /// Batch buckets, e.g. 1,2,4,8.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        batch_buckets: Vec<usize>,
        /// Compiled dtype (f32, f16 or bf16), whatever the checkpoint stores.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Lengths seen in traffic: lines of `LENGTH COUNT` (or one length per line).
        #[arg(long)]
        length_histogram: Option<PathBuf>,
        /// Write a JSON report here.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Plan only: build the graph from config.json without reading weights.
        #[arg(long)]
        no_weights: bool,
        /// Keep attention dropout (a training-mode forward, seeded by an i64 `seed` input).
        #[arg(long)]
        dropout: bool,
        /// KV-cache capacity of the decode graphs (decoders; default: the largest sequence bucket).
        #[arg(long)]
        max_context: Option<usize>,
        /// Tokens per prompt chunk of generation, a KV-cached graph at batch 1 (decoders; default:
        /// the smallest of 128, the largest sequence bucket and the context; 1 enters prompts one
        /// token per step). Several sizes (`512,128`) make a graph each: a prompt's last part
        /// takes the smallest that holds it, the rest the largest.
        #[arg(long, value_delimiter = ',')]
        prefill_chunk: Vec<usize>,
        /// Prompts one prompt chunk takes at once: the chunk graph's batch (decoders; default 1,
        /// at most the largest batch bucket). Prompts arriving together then fill side by side.
        #[arg(long)]
        prefill_batch: Option<usize>,
        /// Tokens per logits chunk (decoders; none by default): a KV-cached graph of one
        /// sequence that keeps every token's logits. A prompt longer than the largest (or than
        /// every prefill bucket) then runs through them, each chunk's logits copied to the host
        /// while the next computes. Several sizes (`1024,256`): the prompt's last part takes the
        /// smallest that holds it, the rest the largest. A CUDA executor of such an artifact
        /// keeps page-locked host memory for a whole context of logits (context x vocab x dtype
        /// bytes) and two device buffers of the largest chunk's.
        #[arg(long, value_delimiter = ',')]
        logits_chunk: Vec<usize>,
        /// Keys per block of the paged KV cache (decoders; a power of two, default 16; 0 keeps
        /// one dense cache row of the whole context per sequence).
        #[arg(long)]
        kv_block_size: Option<u32>,
        /// Blocks in the paged KV cache, shared by all sequences, block 0 included, which no
        /// sequence holds (decoders; default: enough for every row of the largest batch at full
        /// context, plus block 0). Fewer save memory: requests then wait for blocks.
        #[arg(long)]
        kv_blocks: Option<usize>,
        /// Which code to generate: GPU kernels (PTX, and SASS when ptxas is found), CPU kernels
        /// (Cranelift; f16/bf16 builds computed in f32), or both.
        #[arg(long, value_enum, default_value_t = Target::All)]
        target: Target,
        /// No progress bars (they are drawn only when standard error is a terminal).
        #[arg(long, short = 'q')]
        quiet: bool,
    },
    /// Print a readable summary of a compiled artifact (verified first): buckets, kernels per
    /// bucket, files.
    Inspect {
        /// The artifact folder written by `kiln compile`.
        artifact: PathBuf,
    },
    /// Run a checkpoint with the reference interpreter: weights converted to --dtype, every
    /// value stored as f32 and, with --dtype f16 or bf16, rounded to that type after every op;
    /// reductions and products accumulate in f64.
    Eval {
        /// Checkpoint folder (config.json + safetensors).
        model_dir: PathBuf,
        /// safetensors file with `input_ids` (i64 [L] or [B, L]) and optionally
        /// `attention_mask` and, for BERT-family encoders, `token_type_ids` (i64, the ids'
        /// shape; zeros when absent).
        #[arg(long, conflicts_with = "text", required_unless_present = "text")]
        input: Option<PathBuf>,
        /// A text to tokenise with the folder's tokenizer.json (repeat for a batch).
        #[arg(long)]
        text: Vec<String>,
        /// The second segment of a sentence pair (token type 1), one per --text in order (repeat;
        /// give one for every text or none).
        #[arg(long, requires = "text")]
        pair: Vec<String>,
        /// The float type the graph computes in (f32, f16 or bf16), whatever the checkpoint
        /// stores; f32 by default, as `kiln compile`.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Where to write the outputs (`logits`, or `last_hidden_state` and
        /// `sentence_embedding`) as safetensors; without it a summary is printed.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

/// How `kiln compile` chooses sequence buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BucketPolicy {
    /// Powers of two from 16 up to --max-seq.
    Pow2,
    /// --num-buckets lengths minimising the padding of --length-histogram.
    Histogram,
}

/// Runs one command, writing its report to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    match &cli.command {
        Command::Ir {
            model_dir,
            seq_len,
            batch,
            fused,
            bucket,
        } => {
            let model = kiln_models::import(model_dir)?;
            if *fused {
                let seq = positive(bucket.expect("clap requires --bucket"), "--bucket")? as usize;
                let batch = positive(batch.unwrap_or(1), "--batch")? as usize;
                let plan = BucketPlan::new(vec![seq], vec![batch]).map_err(anyhow::Error::msg)?;
                let opts = CompileOptions {
                    plan,
                    limits: Limits::default(),
                    cost: CostModel::default(),
                    histogram: None,
                    max_context: None,
                    prefill_chunks: Vec::new(),
                    logits_chunks: Vec::new(),
                    kv_paging: None,
                };
                let (_, compiled) = compile(&model.graph, None, &opts)?;
                writeln!(out, "{}", compiled.prefill[0].graph.to_ron())?;
                return Ok(());
            }
            let mut bindings = BTreeMap::new();
            if let Some(s) = seq_len {
                bindings.insert(SEQ.to_string(), positive(*s, "--seq-len")?);
            }
            if let Some(b) = batch {
                bindings.insert(BATCH.to_string(), positive(*b, "--batch")?);
            }
            let graph = if bindings.is_empty() {
                model.graph
            } else {
                model.graph.specialize(&bindings)?
            };
            writeln!(out, "{}", graph.to_ron())?;
        }
        Command::Compile {
            model_dir,
            out_dir,
            buckets,
            bucket_policy,
            max_seq,
            num_buckets,
            batch_buckets,
            dtype,
            length_histogram,
            report,
            no_weights,
            dropout,
            max_context,
            prefill_chunk,
            prefill_batch,
            logits_chunk,
            kv_block_size,
            kv_blocks,
            target,
            quiet,
        } => {
            let dtype = float_dtype(dtype)?;
            let import = ImportOptions {
                dtype,
                dropout: *dropout,
                kv_cache: false,
            };
            let histogram = length_histogram
                .as_deref()
                .map(read_histogram)
                .transpose()?;
            let plan = match (buckets, bucket_policy) {
                (Some(lens), _) => BucketPlan::new(lens.clone(), batch_buckets.clone()),
                (None, BucketPolicy::Pow2) => {
                    let Some(max) = max_seq else {
                        bail!("--bucket-policy pow2 needs --max-seq (or give --buckets)");
                    };
                    BucketPlan::pow2(*max, batch_buckets.clone())
                }
                (None, BucketPolicy::Histogram) => {
                    let Some(h) = &histogram else {
                        bail!("--bucket-policy histogram needs --length-histogram");
                    };
                    BucketPlan::from_histogram(h, *num_buckets, batch_buckets.clone())
                }
            }
            .map_err(anyhow::Error::msg)?;
            if let Some(path) = report {
                check_writable(path)?;
            }
            let progress = Progress::new(*quiet);
            let total = std::time::Instant::now();
            let start = std::time::Instant::now();
            let import_stage = progress.stage("import", 0);
            import_stage.say(model_dir.display().to_string());
            let load = |options: &ImportOptions| {
                if *no_weights {
                    kiln_models::import_config_only(model_dir, options)
                } else {
                    kiln_models::import_with(model_dir, options)
                }
            };
            let model = load(&import)?;
            let (cached, context) = match model.kind {
                ModelKind::Decoder { max_positions, .. } => {
                    let context = max_context.unwrap_or(*plan.seq_lens.last().expect("buckets"));
                    if context == 0 {
                        bail!("--max-context must be at least 1");
                    }
                    if let Some(limit) = max_positions.filter(|l| context > *l) {
                        bail!("--max-context {context} exceeds the model's {limit} positions");
                    }
                    if let Some(c) = prefill_chunk.iter().find(|&&c| c == 0 || c > context) {
                        bail!("--prefill-chunk {c} must be between 1 and the context ({context})");
                    }
                    if let Some(c) = logits_chunk.iter().find(|&&c| c < 2 || c > context) {
                        bail!("--logits-chunk {c} must be between 2 and the context ({context})");
                    }
                    if prefill_chunk.len() > 1 && prefill_chunk.contains(&1) {
                        bail!("--prefill-chunk 1 enters prompts one token per step; it takes no other chunk sizes");
                    }
                    let rows = *plan.batch_sizes.last().expect("batch buckets");
                    if let Some(p) = prefill_batch.filter(|&p| p == 0 || p > rows) {
                        bail!(
                            "--prefill-batch {p} must be between 1 and the largest batch bucket ({rows})"
                        );
                    }
                    if let Some(b) = kv_block_size.filter(|&b| b != 0 && !b.is_power_of_two()) {
                        bail!(
                            "--kv-block-size {b} must be a power of two (or 0 for a dense cache)"
                        );
                    }
                    if let Some(b) = kv_block_size.filter(|&b| b as usize > context) {
                        bail!("--kv-block-size {b} exceeds the context ({context} keys)");
                    }
                    if kv_blocks.is_some() && *kv_block_size == Some(0) {
                        bail!("--kv-blocks sizes a paged cache; --kv-block-size 0 asks for a dense one");
                    }
                    let options = ImportOptions {
                        kv_cache: true,
                        dropout: false,
                        ..import.clone()
                    };
                    (Some(load(&options)?.graph), Some(context))
                }
                ModelKind::Encoder { .. } => {
                    if max_context.is_some()
                        || !prefill_chunk.is_empty()
                        || prefill_batch.is_some()
                        || !logits_chunk.is_empty()
                        || kv_block_size.is_some()
                        || kv_blocks.is_some()
                    {
                        bail!(
                            "--max-context, --prefill-chunk, --prefill-batch, --logits-chunk, --kv-block-size and --kv-blocks apply to decoders; {} is an encoder",
                            model.architecture
                        );
                    }
                    (None, None)
                }
            };
            drop(import_stage);
            let import_seconds = start.elapsed().as_secs_f64();
            let opts = CompileOptions {
                plan: plan.clone(),
                limits: Limits::default(),
                cost: CostModel::default(),
                histogram,
                max_context: context,
                prefill_chunks: context.map_or_else(Vec::new, |c| {
                    chunk_buckets(prefill_chunk, prefill_batch.unwrap_or(1), &plan, c)
                }),
                logits_chunks: logits_chunk_buckets(logits_chunk),
                kv_paging: match kv_block_size.unwrap_or(DEFAULT_KV_BLOCK) {
                    _ if context.is_none() => None,
                    0 => None,
                    block => Some(KvPaging {
                        block,
                        blocks: *kv_blocks,
                    }),
                },
            };
            let (mut compiled, buckets) =
                compile_with_progress(&model.graph, cached.as_ref(), &opts, &progress)?;
            compiled
                .stage_seconds
                .insert("import".into(), import_seconds);
            let start = std::time::Instant::now();
            let src = ArtifactSource {
                model: &model,
                plan: &plan,
                compiled: &buckets,
                with_weights: !*no_weights,
                dtype,
                target: *target,
                kv_paging: opts.kv_paging,
            };
            for (stage, seconds) in write_artifact(out_dir, &src, &progress)? {
                compiled
                    .stage_seconds
                    .insert(format!("write.{stage}"), seconds);
            }
            compiled
                .stage_seconds
                .insert("write".into(), start.elapsed().as_secs_f64());
            compiled
                .stage_seconds
                .insert("total".into(), total.elapsed().as_secs_f64());
            if let Some(path) = report {
                let json = serde_json::to_vec_pretty(&compiled)?;
                crate::tensor_io::write_atomically(path, &json)?;
            }
            // The finished stages stay on screen; the summary goes below them.
            drop(progress);
            let per_bucket: Vec<String> = compiled
                .buckets
                .iter()
                .map(|b| format!("b{}-s{}: {} kernels", b.batch, b.seq, b.kernels.len()))
                .chain(compiled.decode_buckets.iter().map(|b| {
                    if b.seq == 1 {
                        format!("decode b{}: {} kernels", b.batch, b.kernels.len())
                    } else {
                        format!(
                            "prompt chunk b{}-s{}: {} kernels",
                            b.batch,
                            b.seq,
                            b.kernels.len()
                        )
                    }
                }))
                .chain(compiled.logits_chunks.iter().map(|b| {
                    format!(
                        "logits chunk b{}-s{}: {} kernels",
                        b.batch,
                        b.seq,
                        b.kernels.len()
                    )
                }))
                .collect();
            let chunks = buckets.decode.iter().filter(|b| b.bucket.seq > 1).count();
            let counted = |n: usize, what: &str| match n {
                0 => String::new(),
                1 => format!(" + 1 {what}"),
                n => format!(" + {n} {what}s"),
            };
            let chunks_said = counted(chunks, "prompt chunk")
                + &counted(buckets.logits_chunks.len(), "logits chunk");
            writeln!(
                out,
                "compiled {} ({} prefill + {} decode buckets{}) into {} in {:.2} s: {}",
                model.architecture,
                buckets.prefill.len(),
                buckets.decode.len() - chunks,
                chunks_said,
                out_dir.display(),
                compiled.stage_seconds["total"],
                per_bucket.join(", ")
            )?;
        }
        Command::Inspect { artifact } => {
            let art = kiln_runtime::Artifact::open(artifact)?;
            let m = &art.manifest;
            writeln!(
                out,
                "{}: {} ({}), {}, format {}, compiled by kiln {} ({})",
                artifact.display(),
                m.architecture,
                if m.model.decoder {
                    "decoder"
                } else {
                    "encoder"
                },
                m.dtype,
                m.format_version,
                m.compiler_version,
                m.compiler_git
            )?;
            writeln!(
                out,
                "  vocab {}, outputs {}, weights: {}, tokenizer: {}, kernels: {}",
                m.model.vocab_size,
                m.model.outputs.join(", "),
                m.weights.as_deref().unwrap_or("none (plan only)"),
                m.tokenizer.as_deref().unwrap_or("none"),
                [
                    m.kernels_ptx.as_deref(),
                    m.kernels_cubin.as_deref(),
                    m.kernels_sm90a_ptx.as_deref(),
                    m.kernels_sm90a_cubin.as_deref(),
                    m.kernels_cpu.as_deref()
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" + ")
            )?;
            writeln!(
                out,
                "  sequence buckets {:?}, batch buckets {:?}, max context {}",
                m.seq_buckets,
                m.batch_buckets,
                m.max_context.map_or("-".to_string(), |c| c.to_string())
            )?;
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            let mem = &m.memory;
            writeln!(
                out,
                "  memory plan: {:.2} MiB in one allocation = weights {:.2} MiB ({} tensors) + KV cache {:.2} MiB ({} slots) + arena {:.2} MiB",
                mib(mem.total_bytes()),
                mib(mem.weights_bytes),
                mem.weights.len(),
                mib(mem.cache_bytes),
                mem.cache.len(),
                mib(mem.arena_bytes)
            )?;
            if let Some(p) = &mem.paging {
                writeln!(
                    out,
                    "  KV cache paged: {} blocks of {} keys (block 0 unused), a block table of {} rows x {} entries",
                    p.blocks, p.block_tokens, p.rows, p.entries
                )?;
            }
            if let Some(cpu) = &m.cpu_memory {
                writeln!(
                    out,
                    "  CPU memory plan (f32, weights widened at load): weights {:.2} MiB + KV cache {:.2} MiB + arena {:.2} MiB",
                    mib(cpu.weights_bytes),
                    mib(cpu.cache_bytes),
                    mib(cpu.arena_bytes)
                )?;
            }
            if let Some(sampler) = &m.cpu_sampler {
                writeln!(out, "  CPU sampler: {sampler}")?;
            }
            let paths: BTreeMap<&str, KernelPath> = m
                .kernel_table
                .iter()
                .map(|k| (k.name.as_str(), k.path))
                .collect();
            let cpu_code = m.kernels_cpu.is_some();
            if !cpu_code {
                writeln!(
                    out,
                    "  no CPU code compiled (--target cuda): the CPU executor cannot run it"
                )?;
            }
            let kinds = [
                ("prefill", &m.prefill),
                ("decode", &m.decode),
                ("logits chunk", &m.logits_chunks),
            ];
            for (kind, entries) in kinds {
                for e in entries {
                    let cpu = |p: &artifact::ExecPlan| match &p.cpu {
                        _ if !cpu_code => String::new(),
                        Some(c) => format!("; {} CPU calls", c.steps.len()),
                        None => format!("; no CPU plan: {}", e.no_cpu.join(", ")),
                    };
                    let gpu = match &e.plan {
                        Some(p) => format!(
                            "{} launches, arena {:.2} MiB{}",
                            p.steps.len(),
                            mib(p.arena_bytes),
                            cpu(p)
                        ),
                        None => format!("no GPU plan: {}", e.no_gpu.join(", ")),
                    };
                    writeln!(
                        out,
                        "  {kind} b{} s{}{}: {} kernels, {gpu} ({})",
                        e.batch,
                        e.seq,
                        e.context
                            .map(|c| format!(" (context {c})"))
                            .unwrap_or_default(),
                        e.kernels.len(),
                        e.kernels.join(" ")
                    )?;
                    if let Some(plan) = &e.plan {
                        writeln!(out, "    paths: {}", path_summary(plan, &paths))?;
                    }
                }
            }
        }
        Command::Eval {
            model_dir,
            input,
            text,
            pair,
            dtype,
            output,
        } => {
            let options = ImportOptions {
                dtype: float_dtype(dtype)?,
                ..ImportOptions::default()
            };
            if let Some(path) = output {
                check_writable(path)?;
            }
            let model = kiln_models::import_with(model_dir, &options)?;
            let (batch, unbatched) = match input {
                Some(path) => TokenBatch::from_request(&read_tensors(path)?)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
                None => (tokenize(model_dir, text, pair)?, false),
            };
            let mut outputs = model.evaluate(&batch)?;
            if unbatched {
                for t in outputs.values_mut() {
                    t.shape.remove(0);
                }
            }
            match output {
                Some(path) => write_tensors(path, &outputs)?,
                None => print_summary(out, &model.kind, text, &batch, &outputs)?,
            }
        }
    }
    Ok(())
}

/// The kernels of `plan` counted by hardware path (each node on its main kernel's path, see
/// [`KernelPath::main`]), then the nodes on the SIMT fallback by name, so none is silent.
fn path_summary(plan: &ExecPlan, paths: &BTreeMap<&str, KernelPath>) -> String {
    let mut nodes: Vec<(&str, Vec<KernelPath>)> = Vec::new();
    for step in &plan.steps {
        let path = paths.get(step.kernel.as_str()).copied().unwrap_or_default();
        match nodes.last_mut() {
            Some((node, p)) if *node == step.node => p.push(path),
            _ => nodes.push((&step.node, vec![path])),
        }
    }
    let mut counts: BTreeMap<KernelPath, usize> = BTreeMap::new();
    let mut simt = Vec::new();
    for (node, p) in nodes {
        let path = KernelPath::main(p);
        *counts.entry(path).or_default() += 1;
        if path == KernelPath::Simt {
            simt.push(node);
        }
    }
    let counts: Vec<String> = counts
        .iter()
        .map(|(p, n)| format!("{} {n}", p.name()))
        .collect();
    if simt.is_empty() {
        counts.join(", ")
    } else {
        format!("{}; on simt: {}", counts.join(", "), simt.join(" "))
    }
}

fn positive(v: usize, flag: &str) -> Result<i64> {
    if v == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(v as i64)
}

fn check_writable(path: &Path) -> Result<()> {
    parent_folder(path)?;
    if path.is_dir() {
        bail!("cannot write {}: it is a folder", path.display());
    }
    Ok(())
}

/// The float type `--dtype` names.
fn float_dtype(text: &str) -> Result<DType> {
    match DType::parse(text) {
        Some(d) if d.is_float() => Ok(d),
        _ => bail!("--dtype must be f32, f16 or bf16, not {text:?}"),
    }
}

fn print_summary(
    out: &mut dyn Write,
    kind: &ModelKind,
    texts: &[String],
    batch: &TokenBatch,
    outputs: &BTreeMap<String, Tensor>,
) -> Result<()> {
    for (i, row) in batch.ids.iter().enumerate() {
        let len = batch
            .mask
            .as_ref()
            .map_or(row.len(), |m| m[i].iter().filter(|&&v| v != 0).count());
        let label = texts
            .get(i)
            .map_or(format!("row {i}"), |t| format!("{t:?}"));
        writeln!(out, "[{i}] {label} ({len} tokens)")?;
        match kind {
            ModelKind::Encoder { .. } => {
                let (name, t) = match outputs.get("sentence_embedding") {
                    Some(t) => ("sentence_embedding", t),
                    None => ("last_hidden_state[0]", &outputs["last_hidden_state"]),
                };
                let dim = *t.shape.last().unwrap_or(&0);
                let values = t.as_f32().unwrap_or_default();
                let stride = values.len() / batch.ids.len();
                let v = &values[i * stride..i * stride + dim];
                let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let head: Vec<String> = v.iter().take(8).map(|x| format!("{x:+.5}")).collect();
                writeln!(
                    out,
                    "    {name}: dim {dim}, norm {norm:.6}, [{}, ...]",
                    head.join(", ")
                )?;
            }
            ModelKind::Decoder { vocab_size, .. } => {
                let logits = outputs["logits"].as_f32().unwrap_or_default();
                let l = row.len();
                // The last real token (left or right padding).
                let last = batch
                    .mask
                    .as_ref()
                    .and_then(|m| m[i].iter().rposition(|&v| v != 0))
                    .unwrap_or(l - 1);
                let start = (i * l + last) * vocab_size;
                let last = &logits[start..start + vocab_size];
                let (best, value) =
                    last.iter()
                        .enumerate()
                        .fold(
                            (0, f32::NEG_INFINITY),
                            |acc, (j, &x)| if x > acc.1 { (j, x) } else { acc },
                        );
                writeln!(out, "    next token (argmax): {best} (logit {value:.4})")?;
            }
        }
    }
    Ok(())
}

/// Reads a length histogram: lines of `LENGTH COUNT`, or a bare `LENGTH` (count 1); `#` comments.
fn read_histogram(path: &Path) -> Result<BTreeMap<usize, u64>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let mut h = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|p| !p.is_empty());
        let parse = |p: Option<&str>| p.map(|v| v.parse::<u64>());
        let (len, count) = match (parse(parts.next()), parse(parts.next()), parts.next()) {
            (Some(Ok(l)), None, None) => (l, 1),
            (Some(Ok(l)), Some(Ok(c)), None) => (l, c),
            _ => bail!(
                "{}:{}: expected `LENGTH [COUNT]`, found {line:?}",
                path.display(),
                i + 1
            ),
        };
        if len == 0 {
            bail!("{}:{}: a length of 0", path.display(), i + 1);
        }
        *h.entry(len as usize).or_insert(0) += count;
    }
    if h.is_empty() {
        bail!("{} holds no lengths", path.display());
    }
    Ok(h)
}

/// What an artifact is written from.
struct ArtifactSource<'a> {
    model: &'a kiln_models::Model,
    plan: &'a BucketPlan,
    compiled: &'a Compiled,
    with_weights: bool,
    dtype: DType,
    target: Target,
    kv_paging: Option<KvPaging>,
}

/// Writes the artifact (`manifest.ron`, `buckets/*.ron`, `kernels.ptx` and the cubin,
/// `weights.safetensors`, the checkpoint's `tokenizer.json`, `tokenizer_config.json` and
/// `generation_config.json`, `checksums`) into a staging folder beside `out_dir`,
/// then swaps it into place ([`Staging`]), so that a failure or an interruption leaves nothing at
/// `out_dir` but the previous output, whole. Returns the seconds of each stage.
fn write_artifact(
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
        let stage = progress.bytes(
            "weights",
            art.memory.weights.iter().map(|s| s.bytes()).sum(),
        );
        let digest =
            crate::weights::write_weights(&dir.join(WEIGHTS), &src.model.checkpoint, &art, &|n| {
                stage.inc(n)
            })?;
        Some(digest)
    } else {
        None
    };
    timed("weights", start);
    // The checkpoint's tokenizer and generation settings, when it has them.
    let copy = |file: &str| -> Result<Option<String>> {
        let from = src.model.checkpoint.dir().join(file);
        if !from.is_file() {
            return Ok(None);
        }
        std::fs::copy(&from, dir.join(file))?;
        Ok(Some(file.to_string()))
    };
    let tokenizer = copy(TOKENIZER)?;
    let tokenizer_config = copy("tokenizer_config.json")?;
    let generation_config = copy("generation_config.json")?;
    let manifest = artifact::Manifest {
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
        weights: weights_digest.as_ref().map(|_| WEIGHTS.to_string()),
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
    };
    let text = ron::ser::to_string_pretty(&manifest, ron::ser::PrettyConfig::new())?;
    std::fs::write(dir.join(artifact::MANIFEST), text)?;
    write_checksums(dir, &manifest, weights_digest)?;
    Ok(seconds)
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

const WEIGHTS: &str = "weights.safetensors";
/// Keys per block of a paged KV cache unless `--kv-block-size` says otherwise (as vLLM's).
const DEFAULT_KV_BLOCK: u32 = 16;
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

/// The logits chunk buckets of `sizes` (largest first, each once), of one sequence.
fn logits_chunk_buckets(sizes: &[usize]) -> Vec<Bucket> {
    let mut seqs = sizes.to_vec();
    seqs.sort_unstable_by(|a, b| b.cmp(a));
    seqs.dedup();
    seqs.into_iter()
        .map(|seq| Bucket { batch: 1, seq })
        .collect()
}

/// The prompt chunk buckets of `sizes` (largest first, each once) at `batch` prompts; with no
/// size given, one of the smallest of 128, the largest sequence bucket and the `context`.
fn chunk_buckets(sizes: &[usize], batch: usize, plan: &BucketPlan, context: usize) -> Vec<Bucket> {
    let mut seqs: Vec<usize> = sizes.to_vec();
    if seqs.is_empty() {
        seqs.push(
            128.min(*plan.seq_lens.last().expect("buckets"))
                .min(context),
        );
    }
    seqs.sort_unstable_by(|a, b| b.cmp(a));
    seqs.dedup();
    seqs.into_iter().map(|seq| Bucket { batch, seq }).collect()
}
