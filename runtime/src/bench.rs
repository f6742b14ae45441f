//! `kiln-run bench`: a stream of requests (`--batch` sequences each, one sequence by default) of
//! seeded random lengths and random token ids, each served like any request (smallest bucket that holds it), with latency
//! percentiles per bucket and overall, throughput, padding waste, replays per bucket and the
//! process's resident memory before and after. For decoders, optionally, decode latency per token
//! through the KV-cached decode graph.

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_ir::inputs::TokenBatch;
use kiln_ir::philox::{philox4x32_10, seed_key};
use serde::Serialize;

use crate::forward::{
    forward, logits_chunks, prefill_bucket, prepare, stream_chunks, streams, Chunk,
};
use crate::generate::{generate_batch, Sampling};
use crate::{Artifact, Executor, RuntimeError};

/// What the benchmark sends.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// How many requests.
    pub requests: usize,
    /// Sequences per request (each of the request's drawn length).
    pub batch: usize,
    /// Shortest request, in tokens (at least 1).
    pub min_len: usize,
    /// Longest request, in tokens (at most the largest prefill bucket).
    pub max_len: usize,
    /// Tokens to generate after a one-token prompt for the decode measurement (decoders; 0 skips).
    pub decode_tokens: usize,
    /// Seed of the lengths and token ids.
    pub seed: i64,
}

/// Latency percentiles of a set of requests, in milliseconds (nearest rank).
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    /// How many requests.
    pub count: usize,
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

impl Latency {
    fn of(mut ms: Vec<f64>) -> Latency {
        ms.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            let i = ((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len());
            ms[i - 1]
        };
        Latency {
            count: ms.len(),
            p50_ms: rank(0.50),
            p95_ms: rank(0.95),
            p99_ms: rank(0.99),
        }
    }
}

/// What the benchmark measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Where the requests ran.
    pub device: String,
    /// Latency per prefill bucket (`b{batch}-s{seq}`).
    pub per_bucket: BTreeMap<String, Latency>,
    /// Latency over all requests.
    pub overall: Latency,
    /// Request tokens per second of wall time.
    pub tokens_per_s: f64,
    /// Fraction of the buckets' token slots that were padding.
    pub padding_waste: f64,
    /// Bucket runs (replays) per bucket.
    pub replays: BTreeMap<String, u64>,
    /// Resident set size of this process before the first request, in KiB (Linux only).
    pub rss_before_kib: Option<u64>,
    /// Resident set size after the last request, in KiB (Linux only).
    pub rss_after_kib: Option<u64>,
    /// Decode latency per step (one token for each of `decode_batch` sequences), in
    /// milliseconds, when measured.
    pub decode_ms_per_token: Option<f64>,
    /// Sequences decoded together in the decode measurement (`--batch`).
    pub decode_batch: usize,
    /// GPU memory in use (device-wide) before the first request, bytes (CUDA only).
    pub gpu_used_before_bytes: Option<u64>,
    /// GPU memory in use after the last request, bytes (CUDA only).
    pub gpu_used_after_bytes: Option<u64>,
    /// Replays since load, and the module loads, PTX JIT compilations, captures and allocations
    /// the executor counted during load and after it (CUDA only; the replays above are the
    /// requests per bucket, these the graph launches the executor counted).
    pub counters: Option<crate::cuda::Counters>,
    /// Seconds from the opened artifact to ready: on CUDA every graph captured, on the CPU the
    /// library loaded and the buffers allocated (none for the interpreter).
    pub load_seconds: Option<f64>,
    /// The last logits chunk's size the executor chose at load, when smaller than the largest.
    pub last_logits_chunk: Option<usize>,
    /// Buckets whose full requests the executor runs as groups of a smaller one (load found it
    /// faster), by graph file: the smaller bucket's graph file.
    pub batch_groups: BTreeMap<String, String>,
    /// Device bytes of the ring that copies logits chunks and batch groups to the host while
    /// the next computes (CUDA only; 0 where neither needs it).
    pub copy_ring_bytes: Option<u64>,
    /// Graph files whose graphs launch their kernels plainly rather than as programmatic
    /// dependents (CUDA only: load timed them faster, or `KILN_PDL=0`).
    pub plain_launches: Vec<String>,
}

/// Runs the benchmark on `exec`.
pub fn bench(
    art: &Artifact,
    exec: &mut Executor,
    opts: &BenchOptions,
) -> Result<BenchReport, RuntimeError> {
    check_options(art, opts)?;
    let rss_before_kib = resident_kib();
    let gpu_before = gpu_used(exec)?;
    let mut latencies: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut replays: BTreeMap<String, u64> = BTreeMap::new();
    let (mut tokens, mut slots) = (0usize, 0usize);
    let start = Instant::now();
    for r in 0..opts.requests {
        let batch = request(art, opts, r);
        let len = batch.ids[0].len();
        let chunks = logits_chunks(art, &batch, exec.last_logits_chunk())?;
        let label = match &chunks {
            Some(chunks) => {
                slots += chunks.iter().map(|c| c.entry.seq).sum::<usize>();
                "b1-logits-chunks".to_string()
            }
            None => {
                let bucket = prefill_bucket(art, opts.batch, len)?;
                slots += bucket.batch * bucket.seq;
                format!("b{}-s{}", bucket.batch, bucket.seq)
            }
        };
        tokens += opts.batch * len;
        let ms = timed_request(art, exec, &batch, chunks.as_deref())?;
        latencies.entry(label.clone()).or_default().push(ms);
        *replays.entry(label).or_default() += 1;
    }
    let wall = start.elapsed().as_secs_f64();
    let rss_after_kib = resident_kib();
    let gpu_after = gpu_used(exec)?;
    let decode_ms_per_token = if opts.decode_tokens > 0 && art.manifest.model.decoder {
        Some(decode_ms_per_token(art, exec, opts)?)
    } else {
        None
    };
    let overall = Latency::of(latencies.values().flatten().copied().collect());
    let (counters, load_seconds) = match exec {
        Executor::Cuda(c) => (Some(c.counters()), Some(c.load_seconds)),
        Executor::Cpu(c) => (None, Some(c.load_seconds)),
        Executor::Interpreter => (None, None),
    };
    let copy_ring_bytes = match exec {
        Executor::Cuda(c) => Some(c.copy_ring_bytes()),
        _ => None,
    };
    let plain_launches = match exec {
        Executor::Cuda(c) => c.plain_launches().iter().cloned().collect(),
        _ => Vec::new(),
    };
    let batch_groups = match exec {
        Executor::Cuda(c) => c.batch_groups(),
        _ => Default::default(),
    }
    .into_iter()
    .map(|(whole, g)| (whole, g.part))
    .collect();
    Ok(BenchReport {
        device: exec.describe(),
        gpu_used_before_bytes: gpu_before,
        gpu_used_after_bytes: gpu_after,
        counters,
        load_seconds,
        last_logits_chunk: exec.last_logits_chunk(),
        batch_groups,
        copy_ring_bytes,
        plain_launches,
        per_bucket: latencies
            .into_iter()
            .map(|(k, v)| (k, Latency::of(v)))
            .collect(),
        overall,
        tokens_per_s: tokens as f64 / wall,
        padding_waste: 1.0 - tokens as f64 / slots as f64,
        replays,
        rss_before_kib,
        rss_after_kib,
        decode_ms_per_token,
        decode_batch: opts.batch,
    })
}

/// `Err` naming what is wrong with `opts` for `art`: no requests, rows or tokens, or lengths
/// past the longest request it takes (a decoder's single sequences may be as long as the cache
/// when logits chunks take them).
fn check_options(art: &Artifact, opts: &BenchOptions) -> Result<(), RuntimeError> {
    let chunked = opts.batch == 1 && !art.manifest.logits_chunks.is_empty();
    let largest = match (chunked, art.manifest.max_context) {
        (true, Some(context)) => context,
        _ => art.longest_prefill(),
    };
    if opts.requests == 0 || opts.batch == 0 || opts.min_len == 0 || opts.min_len > opts.max_len {
        return Err(RuntimeError::Request(
            "bench needs --requests >= 1, --batch >= 1 and --lengths MIN..MAX with 1 <= MIN <= MAX"
                .into(),
        ));
    }
    if opts.max_len > largest {
        return Err(RuntimeError::Request(format!(
            "--lengths up to {} exceed the longest request the artifact takes ({largest} tokens)",
            opts.max_len
        )));
    }
    Ok(())
}

/// Request `r`'s rows: its length and token ids drawn from Philox under the seed's key.
fn request(art: &Artifact, opts: &BenchOptions, r: usize) -> TokenBatch {
    let vocab = art.manifest.model.vocab_size as u32;
    let key = seed_key(opts.seed);
    let span = (opts.max_len - opts.min_len + 1) as u32;
    let draw = philox4x32_10([r as u32, 0, 0, 0], key);
    let len = opts.min_len + (draw[0] % span) as usize;
    let rows: Vec<Vec<i64>> = (0..opts.batch)
        .map(|row| {
            (0..len)
                .map(|t| {
                    let w = philox4x32_10([r as u32, t as u32 + 1, row as u32, 0], key);
                    i64::from(w[0] % vocab)
                })
                .collect()
        })
        .collect();
    TokenBatch::unmasked(rows)
}

/// Milliseconds `batch` takes on `exec`, through `chunks` when logits chunks take it.
fn timed_request(
    art: &Artifact,
    exec: &mut Executor,
    batch: &TokenBatch,
    chunks: Option<&[Chunk]>,
) -> Result<f64, RuntimeError> {
    let t0 = Instant::now();
    let streamed = chunks.filter(|c| streams(exec, c));
    match (&mut *exec, streamed) {
        // A server hands the output bytes on: no conversion to host floats is timed.
        (Executor::Cuda(c), Some(chunks)) => {
            stream_chunks(art, c, &batch.ids[0], chunks)?;
        }
        (Executor::Cuda(c), None) if chunks.is_none() => {
            let (bucket, inputs) = prepare(art, batch)?;
            if bucket.plan.as_ref().is_some_and(|p| p.host_tail.is_some()) {
                // Part of the bucket runs on the host: the whole request is timed.
                exec.run_rows(art, bucket, &inputs, batch.ids.len())?;
            } else {
                c.replay_rows(&bucket.graph, &inputs, batch.ids.len())?;
            }
        }
        // Elsewhere, and logits chunks that run part of their graph on the host.
        (exec, _) => {
            forward(art, exec, batch)?;
        }
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

/// `--batch` one-token prompts decoded together, then `decode_tokens` new tokens each: the
/// first comes from the prompts' run, each other from one batched decode step, and only those
/// steps are timed (with one token, the whole run).
fn decode_ms_per_token(
    art: &Artifact,
    exec: &mut Executor,
    opts: &BenchOptions,
) -> Result<f64, RuntimeError> {
    let vocab = art.manifest.model.vocab_size as i64;
    let prompts: Vec<Vec<i64>> = (0..opts.batch as i64).map(|i| vec![i % vocab]).collect();
    let t0 = Instant::now();
    let greedy = Sampling::greedy();
    let (_, steps) = generate_batch(art, exec, &prompts, opts.decode_tokens, &greedy)?;
    Ok(if opts.decode_tokens > 1 {
        steps * 1e3 / (opts.decode_tokens - 1) as f64
    } else {
        t0.elapsed().as_secs_f64() * 1e3
    })
}

/// Device-wide GPU memory in use, for the CUDA executor.
fn gpu_used(exec: &Executor) -> Result<Option<u64>, RuntimeError> {
    match exec {
        Executor::Cuda(c) => c.device_memory_used().map(Some),
        Executor::Interpreter | Executor::Cpu(_) => Ok(None),
    }
}

/// This process's resident set size from `/proc/self/status` (`VmRSS`), in KiB.
fn resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
