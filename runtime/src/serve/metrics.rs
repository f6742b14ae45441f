//! The server's Prometheus metrics (`GET /metrics`, OpenMetrics text through `prometheus-client`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// A bucket graph's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BucketLabel {
    /// The bucket's graph file.
    pub bucket: String,
}

/// A finished request's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    /// `stop`, `length`, `cancelled` (client gone or timed out) or `error`.
    pub reason: String,
}

/// An engine step's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabel {
    /// `decode` (a decode step alone) or `prompt_chunks` (prompt chunks ran before it).
    pub kind: String,
}

/// A latency histogram: bounds 25% apart from 0.5 ms to ~18 s, fine enough to tell a p99
/// within 2x of its p50.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 1.25, 48))
}

/// Everything `/metrics` reports.
pub struct Metrics {
    registry: Registry,
    /// Sequences decoding (in a cache row).
    pub running: Gauge,
    /// Requests waiting for a row (or for the blocks of a paged cache).
    pub waiting: Gauge,
    /// Tokens whose keys and values the running sequences hold in the KV cache.
    pub cache_tokens_used: Gauge,
    /// Blocks of the paged KV cache the running sequences hold (0 for a dense cache).
    pub kv_blocks_used: Gauge,
    /// Blocks of the paged KV cache sequences can hold (0 for a dense cache).
    pub kv_blocks: Gauge,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Generated tokens.
    pub generated_tokens: Counter,
    /// Finished requests by reason.
    pub finished: Family<FinishLabel, Counter>,
    /// Seconds from arrival to the first token.
    pub time_to_first_token: Histogram,
    /// Seconds between a sequence's consecutive tokens.
    pub inter_token: Histogram,
    /// Seconds from arrival to the last token.
    pub end_to_end: Histogram,
    /// Seconds from arrival to admission into a row.
    pub queue_time: Histogram,
    /// Seconds per engine step (its prompt chunks, its decode step and the hand-out of its
    /// tokens), by whether prompt chunks ran in it: where uneven inter-token latency comes from.
    pub step_seconds: Family<StepLabel, Histogram>,
    /// Seconds a prompt chunk may take under `--chunk-budget` (0: any chunk, before a decode
    /// step was timed or without a budget).
    pub chunk_limit: Gauge<f64, AtomicU64>,
    /// Bucket runs (graph replays on a GPU) since load.
    pub replays: Family<BucketLabel, Counter>,
    /// Graph captures after load (CUDA; stays 0 when nothing is captured late).
    pub captures_after_load: Gauge,
    /// Kernel module loads (each PTX one a JIT compilation) after load (CUDA; stays 0 when
    /// nothing compiles late).
    pub compilations_after_load: Gauge,
}

impl Metrics {
    /// Every metric, registered under the `kiln_` prefix; the driver counts after load only for
    /// a CUDA executor (`cuda`), the one that captures and compiles.
    pub fn new(cuda: bool) -> Metrics {
        let mut registry = Registry::with_prefix("kiln");
        let m = Metrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            cache_tokens_used: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks: Gauge::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            finished: Family::default(),
            time_to_first_token: latency(),
            inter_token: latency(),
            end_to_end: latency(),
            queue_time: latency(),
            step_seconds: Family::new_with_constructor(latency),
            chunk_limit: Gauge::default(),
            replays: Family::default(),
            captures_after_load: Gauge::default(),
            compilations_after_load: Gauge::default(),
            registry: Registry::default(),
        };
        m.register_gauges(&mut registry);
        m.register_counters(&mut registry);
        m.register_latencies(&mut registry);
        if cuda {
            m.register_driver_counts(&mut registry);
        }
        Metrics { registry, ..m }
    }

    /// The gauges of the running, the waiting and the KV cache.
    fn register_gauges(&self, r: &mut Registry) {
        let gauges = [
            ("requests_running", "Sequences decoding", &self.running),
            (
                "requests_waiting",
                "Requests waiting for a KV-cache row or its blocks",
                &self.waiting,
            ),
            (
                "kv_cache_tokens_used",
                "Tokens held in the KV cache",
                &self.cache_tokens_used,
            ),
            (
                "kv_blocks_used",
                "Blocks of the paged KV cache held (0: dense cache)",
                &self.kv_blocks_used,
            ),
            (
                "kv_blocks",
                "Blocks of the paged KV cache (0: dense cache)",
                &self.kv_blocks,
            ),
        ];
        for (name, help, gauge) in gauges {
            r.register(name, help, gauge.clone());
        }
    }

    /// The token, request and replay counters.
    fn register_counters(&self, r: &mut Registry) {
        let prompt = self.prompt_tokens.clone();
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            prompt,
        );
        let generated = self.generated_tokens.clone();
        r.register("generation_tokens", "Generated tokens", generated);
        r.register(
            "requests_finished",
            "Finished requests by reason",
            self.finished.clone(),
        );
        r.register(
            "bucket_replays",
            "Bucket runs since load",
            self.replays.clone(),
        );
    }

    /// The latency histograms (the engine's steps' by kind) and the prompt chunks' time limit.
    fn register_latencies(&self, r: &mut Registry) {
        let h = [
            (
                "time_to_first_token_seconds",
                "Arrival to first token",
                &self.time_to_first_token,
            ),
            (
                "inter_token_latency_seconds",
                "Between a sequence's tokens",
                &self.inter_token,
            ),
            (
                "e2e_request_latency_seconds",
                "Arrival to last token",
                &self.end_to_end,
            ),
            (
                "request_queue_time_seconds",
                "Arrival to admission",
                &self.queue_time,
            ),
        ];
        for (name, help, hist) in h {
            r.register(name, help, hist.clone());
        }
        r.register(
            "engine_step_seconds",
            "Engine steps, with or without prompt chunks",
            self.step_seconds.clone(),
        );
        r.register(
            "prompt_chunk_limit_seconds",
            "The time a prompt chunk may take under --chunk-budget (0: any)",
            self.chunk_limit.clone(),
        );
    }

    /// What the CUDA executor compiled and captured after load.
    fn register_driver_counts(&self, r: &mut Registry) {
        let captures = self.captures_after_load.clone();
        r.register(
            "graph_captures_after_load",
            "CUDA graph captures after load",
            captures,
        );
        let jit = self.compilations_after_load.clone();
        let help = "Kernel module loads (and PTX JIT compilations) after load";
        r.register("compilations_after_load", help, jit);
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}
