//! The compile pipeline: saturate once (symbolic), extract and specialise one static graph per
//! bucket, list its kernels, and report what happened.

use std::collections::BTreeMap;
use std::time::Instant;

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
    /// Sequence length.
    pub seq: usize,
    /// Its kernels, in execution order.
    pub kernels: Vec<KernelReport>,
    /// The cost model's estimate, seconds.
    pub modelled_seconds: f64,
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
    /// Rule name -> times applied.
    pub rules: BTreeMap<String, usize>,
    /// E-graph sizes and times per phase.
    pub egraph: Vec<PhaseStats>,
    /// Seconds per stage (`saturate`, `extract`, ...).
    pub stage_seconds: BTreeMap<String, f64>,
    /// Padding waste for `--length-histogram`.
    pub padding: Option<PaddingReport>,
}

/// A compiled bucket: its static graph and report.
pub struct CompiledBucket {
    /// The bucket.
    pub bucket: Bucket,
    /// The static fused graph.
    pub graph: Graph,
}

/// Compiles `graph` for every bucket of `opts.plan`.
pub fn compile(
    graph: &Graph,
    opts: &CompileOptions,
) -> Result<(CompileReport, Vec<CompiledBucket>), FusionError> {
    let mut stage_seconds = BTreeMap::new();
    let start = Instant::now();
    let saturated = saturate(graph, &opts.limits)?;
    stage_seconds.insert("saturate".to_string(), start.elapsed().as_secs_f64());

    let start = Instant::now();
    let mut buckets = Vec::new();
    let mut reports = Vec::new();
    for bucket in opts.plan.prefill() {
        let bindings = bucket.bindings();
        let (fused, cost) = saturated.extract(&bindings, &opts.cost)?;
        let fixed = fused.specialize(&bindings)?;
        reports.push(BucketReport {
            batch: bucket.batch,
            seq: bucket.seq,
            kernels: kernels(&fixed),
            modelled_seconds: cost,
        });
        buckets.push(CompiledBucket {
            bucket,
            graph: fixed,
        });
    }
    stage_seconds.insert("extract".to_string(), start.elapsed().as_secs_f64());
    let padding = opts.histogram.as_ref().map(|h| {
        let (waste, too_long) = opts.plan.padding_waste(h);
        PaddingReport { waste, too_long }
    });
    Ok((
        CompileReport {
            buckets: reports,
            rules: saturated.rule_counts,
            egraph: saturated.phases,
            stage_seconds,
            padding,
        },
        buckets,
    ))
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
