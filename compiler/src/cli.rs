//! The `kiln` command line: `kiln ir`, `compile`, `inspect` and `eval` (the artifact itself is
//! written by [`crate::writer`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use kiln_ir::artifact::{ExecPlan, KernelPath};
use kiln_ir::dim::{BATCH, SEQ};
use kiln_ir::{artifact, DType, Tensor};
use kiln_models::inputs::TokenBatch;
use kiln_models::{ImportOptions, ModelKind};

use crate::bucket::{Bucket, BucketPlan};
use crate::compile::{compile, compile_with_progress, CompileOptions, CompileReport, Compiled};
use crate::plan::KvPaging;
use crate::progress::Progress;
use crate::tensor_io::{parent_folder, read_tensors, write_tensors};
use crate::tokenize::tokenize;
use crate::writer::{write_artifact, ArtifactSource, Target};

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
    Ir(IrArgs),
    /// Compile a checkpoint: fuse it with the e-graph rules and write one static graph per bucket.
    Compile(CompileArgs),
    /// Print a readable summary of a compiled artifact (verified first): buckets, kernels per
    /// bucket, files.
    Inspect(InspectArgs),
    /// Run a checkpoint with the reference interpreter: weights converted to --dtype, every
    /// value stored as f32 and, with --dtype f16 or bf16, rounded to that type after every op;
    /// reductions and products accumulate in f64.
    Eval(EvalArgs),
}

/// The arguments of `kiln ir`.
#[derive(Debug, clap::Args)]
pub struct IrArgs {
    /// Checkpoint folder (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Fix the sequence length S.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Fix the batch size B.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Print the fused graph of one bucket (needs --bucket).
    #[arg(long, requires = "bucket")]
    pub fused: bool,
    /// The bucket's sequence length (with --fused; batch from --batch, default 1).
    #[arg(long, conflicts_with = "seq_len")]
    pub bucket: Option<usize>,
}

/// The arguments of `kiln compile`.
#[derive(Debug, clap::Args)]
pub struct CompileArgs {
    /// Checkpoint folder (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Output folder (created; an earlier kiln output there is replaced).
    #[arg(short = 'o', long = "output")]
    pub out_dir: PathBuf,
    /// Sequence buckets, e.g. 16,64,256.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["bucket_policy", "max_seq"])]
    pub buckets: Option<Vec<usize>>,
    /// How to choose sequence buckets when --buckets is absent.
    #[arg(long, value_enum, default_value_t = BucketPolicy::Pow2)]
    pub bucket_policy: BucketPolicy,
    /// The largest sequence bucket (pow2 policy).
    #[arg(long)]
    pub max_seq: Option<usize>,
    /// How many buckets the histogram policy chooses.
    #[arg(long, default_value_t = 8)]
    pub num_buckets: usize,
    /// Batch buckets, e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch_buckets: Vec<usize>,
    /// Compiled dtype (f32, f16 or bf16), whatever the checkpoint stores.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Lengths seen in traffic: lines of `LENGTH COUNT` (or one length per line).
    #[arg(long)]
    pub length_histogram: Option<PathBuf>,
    /// Write a JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Plan only: build the graph from config.json without reading weights.
    #[arg(long)]
    pub no_weights: bool,
    /// Keep attention dropout (a training-mode forward, seeded by an i64 `seed` input).
    #[arg(long)]
    pub dropout: bool,
    /// KV-cache capacity of the decode graphs (decoders; default: the largest sequence bucket).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Tokens per prompt chunk of generation, a KV-cached graph at batch 1 (decoders; default:
    /// the smallest of 128, the largest sequence bucket and the context; 1 enters prompts one
    /// token per step). Several sizes (`512,128`) make a graph each: a prompt's last part
    /// takes the smallest that holds it, the rest the largest.
    #[arg(long, value_delimiter = ',')]
    pub prefill_chunk: Vec<usize>,
    /// Prompts one prompt chunk takes at once: the chunk graph's batch (decoders; default 1,
    /// at most the largest batch bucket). Prompts arriving together then fill side by side.
    #[arg(long)]
    pub prefill_batch: Option<usize>,
    /// Tokens per logits chunk (decoders; none by default): a KV-cached graph of one
    /// sequence that keeps every token's logits. A prompt longer than the largest (or than
    /// every prefill bucket) then runs through them, each chunk's logits copied to the host
    /// while the next computes. Several sizes (`1024,256`): the prompt's last part takes the
    /// smallest that holds it, the rest the largest. A CUDA executor of such an artifact
    /// keeps page-locked host memory for a whole context of logits (context x vocab x dtype
    /// bytes) and two device buffers of the largest chunk's.
    #[arg(long, value_delimiter = ',')]
    pub logits_chunk: Vec<usize>,
    /// Keys per block of the paged KV cache (decoders; a power of two, default 16; 0 keeps
    /// one dense cache row of the whole context per sequence).
    #[arg(long)]
    pub kv_block_size: Option<u32>,
    /// Blocks in the paged KV cache, shared by all sequences, block 0 included, which no
    /// sequence holds (decoders; default: enough for every row of the largest batch at full
    /// context, plus block 0). Fewer save memory: requests then wait for blocks.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Which code to generate: GPU kernels (PTX, and SASS when ptxas is found), CPU kernels
    /// (Cranelift; f16/bf16 builds computed in f32), or both.
    #[arg(long, value_enum, default_value_t = Target::All)]
    pub target: Target,
    /// No progress bars (they are drawn only when standard error is a terminal).
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// The arguments of `kiln inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The artifact folder written by `kiln compile`.
    pub artifact: PathBuf,
}

/// The arguments of `kiln eval`.
#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// Checkpoint folder (config.json + safetensors).
    pub model_dir: PathBuf,
    /// safetensors file with `input_ids` (i64 `[L]` or `[B, L]`) and optionally
    /// `attention_mask` and, for BERT-family encoders, `token_type_ids` (i64, the ids'
    /// shape; zeros when absent).
    #[arg(long, conflicts_with = "text", required_unless_present = "text")]
    pub input: Option<PathBuf>,
    /// A text to tokenise with the folder's tokenizer.json (repeat for a batch).
    #[arg(long)]
    pub text: Vec<String>,
    /// The second segment of a sentence pair (token type 1), one per --text in order (repeat;
    /// give one for every text or none).
    #[arg(long, requires = "text")]
    pub pair: Vec<String>,
    /// The float type the graph computes in (f32, f16 or bf16), whatever the checkpoint
    /// stores; f32 by default, as `kiln compile`.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Where to write the outputs (`logits`, or `last_hidden_state` and
    /// `sentence_embedding`) as safetensors; without it a summary is printed.
    #[arg(long)]
    pub output: Option<PathBuf>,
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
        Command::Ir(args) => ir(args, out),
        Command::Compile(args) => compile_model(args, out),
        Command::Inspect(args) => inspect(args, out),
        Command::Eval(args) => eval(args, out),
    }
}

/// `kiln ir`: the checkpoint's graph as RON, symbolic, specialised, or fused for one bucket.
fn ir(args: &IrArgs, out: &mut dyn Write) -> Result<()> {
    let IrArgs {
        model_dir,
        seq_len,
        batch,
        fused,
        bucket,
    } = args;
    let model = kiln_models::import(model_dir)?;
    if *fused {
        let seq = positive(bucket.expect("clap requires --bucket"), "--bucket")? as usize;
        let batch = positive(batch.unwrap_or(1), "--batch")? as usize;
        let plan = BucketPlan::new(vec![seq], vec![batch]).map_err(anyhow::Error::msg)?;
        let (_, compiled) = compile(&model.graph, None, &CompileOptions::prefill(plan))?;
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
    Ok(())
}

/// `kiln compile`: the artifact, and a line saying what it holds.
fn compile_model(args: &CompileArgs, out: &mut dyn Write) -> Result<()> {
    let dtype = float_dtype(&args.dtype)?;
    let import = ImportOptions {
        dtype,
        dropout: args.dropout,
        kv_cache: false,
    };
    let histogram = args
        .length_histogram
        .as_deref()
        .map(read_histogram)
        .transpose()?;
    let plan = args.bucket_plan(histogram.as_ref())?;
    if let Some(path) = &args.report {
        check_writable(path)?;
    }
    let progress = Progress::new(args.quiet);
    let total = std::time::Instant::now();
    let start = std::time::Instant::now();
    let import_stage = progress.stage("import", 0);
    import_stage.say(args.model_dir.display().to_string());
    let model = args.import(&import)?;
    let (cached, context) = match model.kind {
        ModelKind::Decoder { max_positions, .. } => {
            let context = args.decoder_context(&plan, max_positions)?;
            let options = ImportOptions {
                kv_cache: true,
                dropout: false,
                ..import.clone()
            };
            (Some(args.import(&options)?.graph), Some(context))
        }
        ModelKind::Encoder { .. } => {
            args.check_encoder(&model.architecture)?;
            (None, None)
        }
    };
    drop(import_stage);
    let import_seconds = start.elapsed().as_secs_f64();
    let opts = args.options(&plan, histogram, context);
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
        with_weights: !args.no_weights,
        dtype,
        target: args.target,
        kv_paging: opts.kv_paging,
    };
    for (stage, seconds) in write_artifact(&args.out_dir, &src, &progress)? {
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
    if let Some(path) = &args.report {
        let json = serde_json::to_vec_pretty(&compiled)?;
        crate::tensor_io::write_atomically(path, &json)?;
    }
    // The finished stages stay on screen; the summary goes below them.
    drop(progress);
    let said = compiled_summary(&buckets);
    writeln!(
        out,
        "compiled {} {said} into {} in {:.2} s: {}",
        model.architecture,
        args.out_dir.display(),
        compiled.stage_seconds["total"],
        bucket_kernels(&compiled).join(", ")
    )?;
    Ok(())
}

impl CompileArgs {
    /// The sequence and batch buckets the flags ask for.
    fn bucket_plan(&self, histogram: Option<&BTreeMap<usize, u64>>) -> Result<BucketPlan> {
        let batches = self.batch_buckets.clone();
        match (&self.buckets, self.bucket_policy) {
            (Some(lens), _) => BucketPlan::new(lens.clone(), batches),
            (None, BucketPolicy::Pow2) => {
                let Some(max) = self.max_seq else {
                    bail!("--bucket-policy pow2 needs --max-seq (or give --buckets)");
                };
                BucketPlan::pow2(max, batches)
            }
            (None, BucketPolicy::Histogram) => {
                let Some(h) = histogram else {
                    bail!("--bucket-policy histogram needs --length-histogram");
                };
                BucketPlan::from_histogram(h, self.num_buckets, batches)
            }
        }
        .map_err(anyhow::Error::msg)
    }

    /// The checkpoint imported with `options`: from config.json alone with --no-weights.
    fn import(&self, options: &ImportOptions) -> Result<kiln_models::Model> {
        Ok(if self.no_weights {
            kiln_models::import_config_only(&self.model_dir, options)?
        } else {
            kiln_models::import_with(&self.model_dir, options)?
        })
    }

    /// A decoder's KV-cache context (--max-context, or the largest sequence bucket), with the
    /// decoder flags checked against it, the model's positions and the batch buckets.
    fn decoder_context(&self, plan: &BucketPlan, max_positions: Option<usize>) -> Result<usize> {
        let context = self
            .max_context
            .unwrap_or(*plan.seq_lens.last().expect("buckets"));
        if context == 0 {
            bail!("--max-context must be at least 1");
        }
        if let Some(limit) = max_positions.filter(|l| context > *l) {
            bail!("--max-context {context} exceeds the model's {limit} positions");
        }
        if let Some(c) = self.prefill_chunk.iter().find(|&&c| c == 0 || c > context) {
            bail!("--prefill-chunk {c} must be between 1 and the context ({context})");
        }
        if let Some(c) = self.logits_chunk.iter().find(|&&c| c < 2 || c > context) {
            bail!("--logits-chunk {c} must be between 2 and the context ({context})");
        }
        if self.prefill_chunk.len() > 1 && self.prefill_chunk.contains(&1) {
            bail!(
                "--prefill-chunk 1 enters prompts one token per step; it takes no other chunk sizes"
            );
        }
        let rows = *plan.batch_sizes.last().expect("batch buckets");
        if let Some(p) = self.prefill_batch.filter(|&p| p == 0 || p > rows) {
            bail!("--prefill-batch {p} must be between 1 and the largest batch bucket ({rows})");
        }
        let block = self.kv_block_size;
        if let Some(b) = block.filter(|&b| b != 0 && !b.is_power_of_two()) {
            bail!("--kv-block-size {b} must be a power of two (or 0 for a dense cache)");
        }
        if let Some(b) = block.filter(|&b| b as usize > context) {
            bail!("--kv-block-size {b} exceeds the context ({context} keys)");
        }
        if self.kv_blocks.is_some() && block == Some(0) {
            bail!("--kv-blocks sizes a paged cache; --kv-block-size 0 asks for a dense one");
        }
        Ok(context)
    }

    /// An encoder takes none of the decoder flags.
    fn check_encoder(&self, architecture: &str) -> Result<()> {
        if self.max_context.is_some()
            || !self.prefill_chunk.is_empty()
            || self.prefill_batch.is_some()
            || !self.logits_chunk.is_empty()
            || self.kv_block_size.is_some()
            || self.kv_blocks.is_some()
        {
            bail!(
                "--max-context, --prefill-chunk, --prefill-batch, --logits-chunk, --kv-block-size and --kv-blocks apply to decoders; {architecture} is an encoder"
            );
        }
        Ok(())
    }

    /// What the compiler builds: `plan`'s buckets, and with a decoder's `context` its prompt
    /// and logits chunks and its KV cache's paging.
    fn options(
        &self,
        plan: &BucketPlan,
        histogram: Option<BTreeMap<usize, u64>>,
        context: Option<usize>,
    ) -> CompileOptions {
        CompileOptions {
            histogram,
            max_context: context,
            prefill_chunks: context.map_or_else(Vec::new, |c| {
                chunk_buckets(
                    &self.prefill_chunk,
                    self.prefill_batch.unwrap_or(1),
                    plan,
                    c,
                )
            }),
            logits_chunks: logits_chunk_buckets(&self.logits_chunk),
            kv_paging: match self.kv_block_size.unwrap_or(DEFAULT_KV_BLOCK) {
                _ if context.is_none() => None,
                0 => None,
                block => Some(KvPaging {
                    block,
                    blocks: self.kv_blocks,
                }),
            },
            ..CompileOptions::prefill(plan.clone())
        }
    }
}

/// `(N prefill + M decode buckets + ...)`: the graphs `kiln compile` built, by kind.
fn compiled_summary(buckets: &Compiled) -> String {
    let chunks = buckets.decode.iter().filter(|b| b.bucket.seq > 1).count();
    let counted = |n: usize, what: &str| match n {
        0 => String::new(),
        1 => format!(" + 1 {what}"),
        n => format!(" + {n} {what}s"),
    };
    format!(
        "({} prefill + {} decode buckets{}{})",
        buckets.prefill.len(),
        buckets.decode.len() - chunks,
        counted(chunks, "prompt chunk"),
        counted(buckets.logits_chunks.len(), "logits chunk")
    )
}

/// Each graph's kernel count: `b8-s128: 62 kernels`, `decode b1: ..`, `prompt chunk b1-s256:
/// ..`, `logits chunk b1-s1024: ..`.
fn bucket_kernels(compiled: &CompileReport) -> Vec<String> {
    let prefill = compiled
        .buckets
        .iter()
        .map(|b| format!("b{}-s{}: {} kernels", b.batch, b.seq, b.kernels.len()));
    let decode = compiled.decode_buckets.iter().map(|b| {
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
    });
    let logits = compiled.logits_chunks.iter().map(|b| {
        format!(
            "logits chunk b{}-s{}: {} kernels",
            b.batch,
            b.seq,
            b.kernels.len()
        )
    });
    prefill.chain(decode).chain(logits).collect()
}

/// `kiln inspect`: the artifact's summary.
fn inspect(args: &InspectArgs, out: &mut dyn Write) -> Result<()> {
    let InspectArgs { artifact } = args;
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
    describe_memory(m, out)?;
    describe_graphs(m, out)
}

/// Mebibytes of `b` bytes.
fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// The memory plans: one allocation's parts on the GPU, the KV cache's paging, the CPU's.
fn describe_memory(m: &artifact::Manifest, out: &mut dyn Write) -> Result<()> {
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
    Ok(())
}

/// Each graph: its kernels, launches, arena and CPU plan, and its kernels by hardware path.
fn describe_graphs(m: &artifact::Manifest, out: &mut dyn Write) -> Result<()> {
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
    Ok(())
}

/// `kiln eval`: the reference interpreter's outputs, written or summarised.
fn eval(args: &EvalArgs, out: &mut dyn Write) -> Result<()> {
    let EvalArgs {
        model_dir,
        input,
        text,
        pair,
        dtype,
        output,
    } = args;
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

/// Keys per block of a paged KV cache unless `--kv-block-size` says otherwise (as vLLM's).
const DEFAULT_KV_BLOCK: u32 = 16;

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
