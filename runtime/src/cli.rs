//! `kiln-run`'s command line: the subcommands, their arguments and what they print. The binary
//! (`src/main.rs`) parses and calls [`run`]; tests call it in-process.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use crate::bench::{bench, BenchOptions, BenchReport};
use crate::executor::Work;
use crate::generate::{generate_batch, Sampling};
use crate::serve::{serve, ServeOptions};
use crate::{forward::forward, Artifact, Device, Executor};
use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use kiln_ir::inputs::TokenBatch;

/// kiln-run: runs an artifact compiled by `kiln compile`.
#[derive(Parser)]
#[command(name = "kiln-run", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where requests run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// CUDA when a GPU is present, the CPU otherwise.
    Auto,
    /// The CPU: the artifact's generated kernels (f16/bf16 builds computed in f32).
    Cpu,
    /// The GPU: CUDA graphs captured at load and replayed per request.
    Cuda,
    /// The reference interpreter (slow): to check results, or where the artifact's CPU library
    /// does not run.
    Interpreter,
}

/// Where a command runs (shared by every subcommand).
#[derive(Args)]
struct Placement {
    /// Where to run.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
}

impl Placement {
    /// Loads `art` on the chosen executor.
    fn open(&self, art: &Artifact) -> Result<Executor> {
        self.open_for(art, Work::All)
    }

    /// Loads what `work` runs of `art` on the chosen executor.
    fn open_for(&self, art: &Artifact, work: Work) -> Result<Executor> {
        Ok(Executor::open_for(art, self.device(), work)?)
    }

    /// The chosen device.
    fn device(&self) -> Device {
        match self.device {
            DeviceArg::Auto => Device::Auto,
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Interpreter => Device::Interpreter,
            DeviceArg::Cuda => Device::Cuda,
        }
    }
}

/// The subcommands.
#[derive(Subcommand)]
enum Command {
    /// One forward pass: IN holds `input_ids` (i64 [L] or [B, L]) and optionally
    /// `attention_mask` and, for BERT-family encoders, `token_type_ids` (i64, the ids' shape;
    /// zeros when absent); OUT gets the model's outputs (`logits`, or
    /// `last_hidden_state` and `sentence_embedding`).
    Forward(ForwardArgs),
    /// Generate tokens after one or more prompts through the decode graphs and their KV cache:
    /// several prompts are decoded together through the smallest decode batch bucket that holds
    /// them, each getting the tokens it gets alone; the output has one line (one JSON object per
    /// line with `--json`) per sequence, in order.
    Generate(GenerateArgs),
    /// Sentence embeddings of texts (encoders compiled from a sentence-transformers folder),
    /// one line per text: its numbers with 7 significant digits (`-4.496000e-33`).
    Embed(EmbedArgs),
    /// Serve the artifact over HTTP with an OpenAI-compatible API (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`),
    /// decoding concurrent requests together (continuous batching over the decode buckets).
    /// Prints `listening on http://ADDR` once the port is bound; `/health` answers 200 once the
    /// executor is loaded. SIGTERM or Ctrl-C stop accepting requests, let running ones finish for
    /// `--drain-seconds`, cancel the rest and exit 0.
    Serve(ServeArgs),
    /// Serve a stream of seeded random requests and report latency percentiles per bucket and
    /// overall, tokens/s, padding waste, replays per bucket and host memory before and after.
    Bench(BenchArgs),
}

/// The arguments of `kiln-run forward`.
#[derive(Args)]
struct ForwardArgs {
    /// The artifact folder.
    artifact: PathBuf,
    /// Input safetensors file.
    #[arg(long)]
    input: PathBuf,
    /// Output safetensors file.
    #[arg(long)]
    output: PathBuf,
    #[command(flatten)]
    placement: Placement,
}

/// The arguments of `kiln-run generate`.
#[derive(Args)]
struct GenerateArgs {
    /// The artifact folder.
    artifact: PathBuf,
    /// A prompt's token ids, comma-separated (repeat for several sequences).
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    prompt_ids: Vec<String>,
    /// A prompt as text, tokenised with the artifact's tokenizer.json (repeat for several
    /// sequences); each sequence's line is followed by its generated text.
    #[arg(long)]
    prompt: Vec<String>,
    /// How many tokens to generate.
    #[arg(long)]
    max_new_tokens: usize,
    /// 0 (the default) is greedy; otherwise logits are divided by it before sampling.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k largest logits (0 keeps all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of largest logits with this much of the mass (1 keeps all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling stream.
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Print JSON (`{"tokens": [...]}`, with `"text"` for a text prompt) instead of
    /// space-separated ids.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    placement: Placement,
}

/// The arguments of `kiln-run embed`.
#[derive(Args)]
struct EmbedArgs {
    /// The artifact folder.
    artifact: PathBuf,
    /// A text to embed (repeat for a batch).
    #[arg(long, required = true)]
    text: Vec<String>,
    /// The second segment of a sentence pair (token type 1), one per --text in order (repeat;
    /// give one for every text or none).
    #[arg(long)]
    pair: Vec<String>,
    /// Print JSON (`{"embeddings": [[...], ...]}`, exact values).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    placement: Placement,
}

/// The arguments of `kiln-run serve`.
#[derive(Args)]
struct ServeArgs {
    /// The artifact folder.
    artifact: PathBuf,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests that may wait for a KV-cache row; past this the server answers 503 with
    /// `Retry-After`.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Seconds a request may run before it is ended (504, or an error event in a stream).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Seconds running requests get to finish after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 30.0)]
    drain_seconds: f64,
    /// Prompt chunks (of the artifact's `--prefill-chunk` tokens) run between two decode
    /// steps: the per-step prompt budget.
    #[arg(long, default_value_t = 1)]
    chunks_per_step: usize,
    /// The time a prompt chunk may add to a decode step, as a fraction of that step (or of
    /// the largest chunk's time at a prompt's start, when that is longer): each chunk step
    /// takes the largest of the artifact's chunk sizes whose measured time fits it, so the
    /// sequences decoding beside a prompt wait at most this much longer for a token (0:
    /// always the largest chunk).
    #[arg(long, default_value_t = 0.9)]
    chunk_budget: f64,
    /// Launch each greedy decode step's successor before its tokens go out, so that the
    /// server's work between steps runs while the GPU computes (CUDA).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    launch_ahead: bool,
    /// The model's name in the API (default: the artifact folder's name without `.kiln`).
    #[arg(long)]
    model_name: Option<String>,
    #[command(flatten)]
    placement: Placement,
}

/// The arguments of `kiln-run bench`.
#[derive(Args)]
struct BenchArgs {
    /// The artifact folder.
    artifact: PathBuf,
    /// How many requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Sequences per request, all of the request's length.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Request lengths, drawn uniformly from MIN..MAX (inclusive); default 1 to the largest
    /// prefill bucket.
    #[arg(long, value_parser = parse_range)]
    lengths: Option<(usize, usize)>,
    /// Tokens to generate per sequence for the decode latency per step, with `--batch` sequences
    /// decoded together (decoders; 0 skips).
    #[arg(long, default_value_t = 0)]
    decode_tokens: usize,
    /// Seed of the lengths and token ids.
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Time every kernel (steps launched one by one instead of graph replays, so the
    /// latencies include launch gaps) and print where the time went, heaviest first, to
    /// stderr; `KILN_EAGER=1` does the same.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    placement: Placement,
}

/// `--chunk-budget`: a finite fraction, 0 for none.
fn budget(fraction: f64) -> Result<Option<f64>> {
    if !fraction.is_finite() || fraction < 0.0 {
        anyhow::bail!("--chunk-budget {fraction} must be a fraction of a decode step, 0 or more");
    }
    Ok((fraction > 0.0).then_some(fraction))
}

/// Parses `MIN..MAX`.
fn parse_range(text: &str) -> Result<(usize, usize), String> {
    let (lo, hi) = text
        .split_once("..")
        .ok_or_else(|| format!("`{text}` is not MIN..MAX"))?;
    let num = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("`{s}` in `{text}` is not a count"))
    };
    Ok((num(lo)?, num(hi)?))
}

/// Parses one `--prompt-ids` list: comma-separated token ids.
fn parse_ids(list: &str) -> Result<Vec<i64>> {
    list.split(',')
        .map(|id| {
            id.trim()
                .parse::<i64>()
                .map_err(|_| anyhow::anyhow!("--prompt-ids: `{id}` in `{list}` is not a token id"))
        })
        .collect()
}

/// Runs one `kiln-run` command, writing what it prints to `out` (progress and profiles go to
/// stderr).
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Forward(args) => forward_command(args),
        Command::Generate(args) => generate_command(args, out),
        Command::Embed(args) => embed_command(args, out),
        Command::Serve(args) => serve_command(args, out),
        Command::Bench(args) => bench_command(args, out),
    }
}

/// `kiln-run forward`: one forward pass, its outputs written as safetensors.
fn forward_command(args: ForwardArgs) -> Result<()> {
    let ForwardArgs {
        artifact,
        input,
        output,
        placement,
    } = args;
    kiln_ir::io::parent_folder(&output)?;
    let art = Artifact::open(&artifact)?;
    let tensors = kiln_ir::io::read_tensors(&input)?;
    let (batch, unbatched) = TokenBatch::from_request(&tensors)
        .map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
    let mut exec = placement.open(&art)?;
    let mut outputs = forward(&art, &mut exec, &batch)?;
    if unbatched {
        for t in outputs.values_mut() {
            t.shape.remove(0);
        }
    }
    kiln_ir::io::write_tensors(&output, &outputs)?;
    Ok(())
}

/// `kiln-run generate`: each prompt's tokens (and text, with a tokenizer), one line a prompt.
fn generate_command(args: GenerateArgs, out: &mut dyn Write) -> Result<()> {
    let GenerateArgs {
        artifact,
        prompt_ids,
        prompt,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        json,
        placement,
    } = args;
    let sampling = Sampling {
        temperature,
        top_k,
        top_p,
        seed,
    };
    sampling.validate()?;
    let prompts = prompt_ids
        .iter()
        .map(|list| parse_ids(list))
        .collect::<Result<Vec<_>>>()?;
    let art = Artifact::open(&artifact)?;
    let tokenizer = (!prompt.is_empty()).then(|| art.tokenizer()).transpose()?;
    let prompts = match &tokenizer {
        Some(t) => prompt
            .iter()
            .map(|text| t.encode(text))
            .collect::<Result<Vec<_>, _>>()?,
        None => prompts,
    };
    let mut exec = placement.open_for(&art, Work::Generation)?;
    let (sequences, _) = generate_batch(&art, &mut exec, &prompts, max_new_tokens, &sampling)?;
    for tokens in &sequences {
        let text = tokenizer.as_ref().map(|t| t.decode(tokens)).transpose()?;
        let ids: Vec<String> = tokens.iter().map(i64::to_string).collect();
        match (json, text) {
            (true, Some(text)) => writeln!(
                out,
                "{{\"tokens\": [{}], \"text\": {}}}",
                ids.join(", "),
                serde_json::to_string(&text)?
            )?,
            (true, None) => writeln!(out, "{{\"tokens\": [{}]}}", ids.join(", "))?,
            (false, Some(text)) => writeln!(out, "{}\n{text}", ids.join(" "))?,
            (false, None) => writeln!(out, "{}", ids.join(" "))?,
        }
    }
    Ok(())
}

/// `kiln-run embed`: sentence embeddings, one row a text.
fn embed_command(args: EmbedArgs, out: &mut dyn Write) -> Result<()> {
    let EmbedArgs {
        artifact,
        text,
        pair,
        json,
        placement,
    } = args;
    let art = Artifact::open(&artifact)?;
    if art.manifest.model.decoder {
        bail!(
            "{} is a decoder; embed needs an encoder",
            art.manifest.architecture
        );
    }
    if !art
        .manifest
        .model
        .outputs
        .iter()
        .any(|o| o == "sentence_embedding")
    {
        bail!(
            "{} has no sentence_embedding output (compile a sentence-transformers folder)",
            artifact.display()
        );
    }
    let batch = art.tokenizer()?.encode_batch(&text, &pair)?;
    let mut exec = placement.open(&art)?;
    let outputs = forward(&art, &mut exec, &batch)?;
    let emb = &outputs["sentence_embedding"];
    let Some(values) = emb.as_f32() else {
        bail!("sentence_embedding is not a float tensor");
    };
    let rows: Vec<Vec<f32>> = values
        .chunks(emb.shape[1].max(1))
        .map(<[f32]>::to_vec)
        .collect();
    if json {
        writeln!(out, "{}", serde_json::json!({ "embeddings": rows }))?;
    } else {
        for row in rows {
            let nums: Vec<String> = row.iter().map(|x| format!("{x:.6e}")).collect();
            writeln!(out, "{}", nums.join(" "))?;
        }
    }
    Ok(())
}

/// `kiln-run serve`: the HTTP server until it is told to stop.
fn serve_command(args: ServeArgs, out: &mut dyn Write) -> Result<()> {
    let ServeArgs {
        artifact,
        host,
        port,
        max_queue,
        request_timeout,
        drain_seconds,
        chunks_per_step,
        chunk_budget,
        launch_ahead,
        model_name,
        placement,
    } = args;
    let seconds = |name: &str, s: f64| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| anyhow::anyhow!("--{name} {s} must be a positive number of seconds"))
    };
    let opts = ServeOptions {
        artifact,
        device: placement.device(),
        host,
        port,
        max_queue,
        request_timeout: seconds("request-timeout", request_timeout)?,
        drain: seconds("drain-seconds", drain_seconds)?,
        stepping: crate::serve::engine::Stepping {
            chunks_per_step,
            chunk_budget: budget(chunk_budget)?,
            launch_ahead,
        },
        model_name,
    };
    serve(opts, out)?;
    Ok(())
}

/// `kiln-run bench`: the latency report (and with `--profile` the kernels' times on stderr).
fn bench_command(args: BenchArgs, out: &mut dyn Write) -> Result<()> {
    let BenchArgs {
        artifact,
        requests,
        batch,
        lengths,
        decode_tokens,
        seed,
        json,
        profile,
        placement,
    } = args;
    let art = Artifact::open(&artifact)?;
    let largest = art.longest_prefill();
    let (min_len, max_len) = lengths.unwrap_or((1, largest));
    let mut exec = placement.open(&art)?;
    if profile {
        exec.set_profiling(true);
    }
    let report = bench(
        &art,
        &mut exec,
        &BenchOptions {
            requests,
            batch,
            min_len,
            max_len,
            decode_tokens,
            seed,
        },
    )?;
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print_bench(&report, out)?;
    }
    let profile = match &exec {
        Executor::Cuda(c) => Some(c.profile().clone()),
        Executor::Cpu(c) => Some(c.profile()),
        Executor::Interpreter => None,
    };
    if let Some(profile) = profile {
        // --profile (or KILN_EAGER): where the time went, heaviest kernels first (to
        // stderr).
        let mut rows: Vec<_> = profile.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        for (kernel, (n, secs)) in rows.iter().take(25) {
            eprintln!("{:>10.3} ms {n:>8} x {kernel}", secs * 1e3);
        }
    }
    Ok(())
}

/// The bench report as a table.
fn print_bench(r: &BenchReport, out: &mut dyn Write) -> Result<()> {
    writeln!(out, "device: {}", r.device)?;
    writeln!(
        out,
        "{:<14} {:>8} {:>10} {:>10} {:>10}",
        "bucket", "requests", "p50 ms", "p95 ms", "p99 ms"
    )?;
    let rows = r
        .per_bucket
        .iter()
        .map(|(k, l)| (k.as_str(), l))
        .chain(std::iter::once(("overall", &r.overall)));
    for (name, l) in rows {
        writeln!(
            out,
            "{name:<14} {:>8} {:>10.3} {:>10.3} {:>10.3}",
            l.count, l.p50_ms, l.p95_ms, l.p99_ms
        )?;
    }
    writeln!(
        out,
        "tokens/s {:.0}, padding waste {:.1}%",
        r.tokens_per_s,
        r.padding_waste * 100.0
    )?;
    let kib = |v: Option<u64>| v.map_or("-".to_string(), |k| format!("{k} KiB"));
    writeln!(
        out,
        "host RSS before {}, after {}",
        kib(r.rss_before_kib),
        kib(r.rss_after_kib)
    )?;
    if let Some(ms) = r.decode_ms_per_token {
        let b = r.decode_batch;
        writeln!(
            out,
            "decode {ms:.3} ms/step at batch {b} ({:.0} tokens/s)",
            b as f64 * 1e3 / ms
        )?;
    }
    let mib = |v: Option<u64>| v.map_or("-".to_string(), |b| format!("{} MiB", b >> 20));
    if r.gpu_used_before_bytes.is_some() {
        writeln!(
            out,
            "GPU memory in use before {}, after {}",
            mib(r.gpu_used_before_bytes),
            mib(r.gpu_used_after_bytes)
        )?;
    }
    if let Some(last) = r.last_logits_chunk {
        writeln!(out, "long prompts end with a logits chunk of {last}")?;
    }
    for (whole, part) in &r.batch_groups {
        writeln!(out, "{whole} runs as groups of {part}")?;
    }
    if !r.plain_launches.is_empty() {
        let graphs = r.plain_launches.join(", ");
        writeln!(out, "graphs launching plainly: {graphs}")?;
    }
    if let Some(bytes) = r.copy_ring_bytes.filter(|&b| b > 0) {
        writeln!(out, "copy ring {}", mib(Some(bytes)))?;
    }
    if let Some(s) = r.load_seconds {
        writeln!(out, "load to ready {:.3} s", s)?;
    }
    if let Some(c) = &r.counters {
        writeln!(out, "at load: {}", c.at_load)?;
        writeln!(out, "after load: {}", c.after_load)?;
    }
    Ok(())
}
