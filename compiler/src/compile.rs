//! The compile pipeline: saturate once (symbolic), extract and specialise one static graph per
//! bucket, list its kernels, and report what happened.

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_ir::dim::CONTEXT;
use kiln_ir::{Graph, Op};
use serde::Serialize;

use crate::bucket::{Bucket, BucketPlan};
use crate::fusion::cost::{fusions, kernel_work, CostModel, KernelKind};
use crate::fusion::{saturate, FusionError, Limits, PhaseStats};

/// How to compile.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The buckets.
    pub plan: BucketPlan,
    /// Rule-phase limits.
    pub limits: Limits,
    /// Device ceilings for extraction.
    pub cost: CostModel,
    /// A length histogram to report padding waste for.
    pub histogram: Option<BTreeMap<usize, u64>>,
    /// KV-cache capacity of the decode graphs (decoders only).
    pub max_context: Option<usize>,
    /// Tokens per prompt chunk: a KV-cached graph at batch 1 and this many tokens, through which
    /// generation enters a prompt (decoders only; `None`: one token per step).
    pub prefill_chunk: Option<usize>,
}

/// One kernel of a bucket's static graph.
#[derive(Clone, Debug, Serialize)]
pub struct KernelReport {
    /// `{op}_{node}`.
    pub name: String,
    /// What kind of kernel it is.
    pub kind: KernelKind,
    /// The fusion rules whose work it carries.
    pub rules: Vec<&'static str>,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written.
    pub bytes: f64,
}

/// One compiled bucket.
#[derive(Clone, Debug, Serialize)]
pub struct BucketReport {
    /// Batch size.
    pub batch: usize,
    /// Sequence length (1 for decode).
    pub seq: usize,
    /// KV-cache capacity, for decode buckets.
    pub context: Option<usize>,
    /// Its kernels, in execution order.
    pub kernels: Vec<KernelReport>,
    /// The cost model's estimate, seconds.
    pub modelled_seconds: f64,
    /// Kernel nodes with no PTX generator yet (`{op}_{node}`).
    pub no_ptx: Vec<String>,
}

/// Padding waste of the bucket plan for a length histogram.
#[derive(Clone, Debug, Serialize)]
pub struct PaddingReport {
    /// Padded tokens / computed tokens.
    pub waste: f64,
    /// Requests longer than the largest bucket (served by chunked prefill).
    pub too_long: u64,
}

/// Everything `--report` writes.
#[derive(Clone, Debug, Serialize)]
pub struct CompileReport {
    /// Prefill / encode buckets, largest first.
    pub buckets: Vec<BucketReport>,
    /// Decode buckets (one token per row over the KV cache), largest batch first.
    pub decode_buckets: Vec<BucketReport>,
    /// Rule name -> times applied.
    pub rules: BTreeMap<String, usize>,
    /// E-graph sizes and times per phase (the prefill e-graph's phases, then the KV-cached one's).
    pub egraph: Vec<PhaseStats>,
    /// Seconds per stage (`saturate`, `extract`, ...).
    pub stage_seconds: BTreeMap<String, f64>,
    /// Padding waste for `--length-histogram`.
    pub padding: Option<PaddingReport>,
    /// Distinct PTX kernels generated for all buckets.
    pub ptx_kernels: usize,
}

/// A compiled bucket: its static graph and report.
pub struct CompiledBucket {
    /// The bucket (`seq` 1 for decode).
    pub bucket: Bucket,
    /// KV-cache capacity, for decode buckets.
    pub context: Option<usize>,
    /// The static fused graph.
    pub graph: Graph,
}

/// Everything compiled: prefill/encode buckets, decode buckets, and their PTX kernels.
pub struct Compiled {
    /// Prefill / encode buckets, largest first.
    pub prefill: Vec<CompiledBucket>,
    /// Decode buckets, largest batch first.
    pub decode: Vec<CompiledBucket>,
    /// The generated kernels of every bucket, deduplicated.
    pub kernels: crate::lower::Lowered,
}

/// Compiles `graph` for every bucket of `opts.plan` and, for decoders, the KV-cached graph
/// `cached` at `opts.max_context` cache entries: once at batch 1 and `opts.prefill_chunk` tokens
/// (the prompt chunk), then for every batch bucket at one token (the decode steps).
pub fn compile(
    graph: &Graph,
    cached: Option<&Graph>,
    opts: &CompileOptions,
) -> Result<(CompileReport, Compiled), FusionError> {
    let mut stage_seconds = BTreeMap::new();
    let start = Instant::now();
    let saturated = saturate(graph, &opts.limits)?;
    let saturated_cached = match (cached, opts.max_context) {
        (Some(g), Some(_)) => Some(saturate(g, &opts.limits)?),
        _ => None,
    };
    stage_seconds.insert("saturate".to_string(), start.elapsed().as_secs_f64());

    let start = Instant::now();
    let mut buckets = Vec::new();
    let mut reports = Vec::new();
    let mut generated = crate::lower::Lowered::default();
    for bucket in opts.plan.prefill() {
        let bindings = bucket.bindings();
        let (fused, cost) = saturated.extract(&bindings, &opts.cost)?;
        let fixed = fused.specialize(&bindings)?;
        let no_ptx = lower_into(&fixed, &mut generated);
        reports.push(BucketReport {
            batch: bucket.batch,
            seq: bucket.seq,
            context: None,
            kernels: kernels(&fixed),
            modelled_seconds: cost,
            no_ptx,
        });
        buckets.push(CompiledBucket {
            bucket,
            context: None,
            graph: fixed,
        });
    }
    let mut decode = Vec::new();
    let mut decode_reports = Vec::new();
    if let (Some(sat), Some(context)) = (&saturated_cached, opts.max_context) {
        let chunk = opts
            .prefill_chunk
            .filter(|&c| c > 1)
            .map(|seq| Bucket { batch: 1, seq });
        let steps = opts
            .plan
            .batch_sizes
            .iter()
            .rev()
            .map(|&batch| Bucket { batch, seq: 1 });
        for bucket in chunk.into_iter().chain(steps) {
            let batch = bucket.batch;
            let mut bindings = bucket.bindings();
            bindings.insert(CONTEXT.to_string(), context as i64);
            let (fused, cost) = sat.extract(&bindings, &opts.cost)?;
            let fixed = fused.specialize(&bindings)?;
            let no_ptx = lower_into(&fixed, &mut generated);
            decode_reports.push(BucketReport {
                batch,
                seq: bucket.seq,
                context: Some(context),
                kernels: kernels(&fixed),
                modelled_seconds: cost,
                no_ptx,
            });
            decode.push(CompiledBucket {
                bucket,
                context: Some(context),
                graph: fixed,
            });
        }
    }
    stage_seconds.insert("extract".to_string(), start.elapsed().as_secs_f64());
    let padding = opts.histogram.as_ref().map(|h| {
        let (waste, too_long) = opts.plan.padding_waste(h);
        PaddingReport { waste, too_long }
    });
    let mut rules = saturated.rule_counts;
    let mut egraph = saturated.phases;
    if let Some(sat) = saturated_cached {
        for (name, n) in sat.rule_counts {
            *rules.entry(name).or_insert(0) += n;
        }
        egraph.extend(sat.phases);
    }
    Ok((
        CompileReport {
            buckets: reports,
            decode_buckets: decode_reports,
            rules,
            egraph,
            stage_seconds,
            padding,
            ptx_kernels: generated.kernels.len(),
        },
        Compiled {
            prefill: buckets,
            decode,
            kernels: generated,
        },
    ))
}

/// Lowers `graph` into `all`; returns the kernel nodes left without a generator.
fn lower_into(graph: &Graph, all: &mut crate::lower::Lowered) -> Vec<String> {
    crate::lower::lower(graph, all).unsupported
}

/// The kernels of a static graph: every node that is not a leaf, a view, or a value computed from
/// weights alone (those are folded when the artifact is written).
pub fn kernels(graph: &Graph) -> Vec<KernelReport> {
    let none = BTreeMap::new();
    let mut weight_only = vec![false; graph.len()];
    let mut out = Vec::new();
    for (id, node) in graph.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
        if weight_only[id.index()] {
            continue;
        }
        let args: Vec<_> = node.args.iter().map(|a| graph.ty(*a)).collect();
        if let Some(work) = kernel_work(&node.op, &args, &node.ty, &none) {
            out.push(KernelReport {
                name: format!("{}_{}", node.op.name(), id.0),
                kind: work.kind,
                rules: fusions(&node.op),
                flops: work.flops,
                bytes: work.bytes,
            });
        }
    }
    out
}
