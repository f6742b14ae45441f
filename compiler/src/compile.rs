//! The compile pipeline: saturate once (symbolic), extract and specialise one static graph per
//! bucket, list its kernels, and report what happened.

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_ir::artifact::KernelPath;
use kiln_ir::dim::CONTEXT;
use kiln_ir::{Graph, NodeId};
use rayon::prelude::*;
use serde::Serialize;

use crate::bucket::{Bucket, BucketPlan};
use crate::fusion::cost::{fusions, graph_work, CostModel, KernelKind};
use crate::fusion::{saturate, FusionError, Limits, PhaseStats, Saturated};
use crate::progress::Progress;

pub use kiln_ir::artifact::LOGITS;

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
    /// The prompt chunks: KV-cached graphs of this many prompts (their batch, rows `0..batch` of
    /// the cache, the same for all) and tokens, through which generation enters prompts
    /// (decoders only; none, or one token: one token per decode step). Several sizes let a
    /// prompt's last part take the smallest chunk that holds it.
    pub prefill_chunks: Vec<Bucket>,
    /// The logits chunks: KV-cached graphs of one sequence at these tokens that keep their
    /// logits (decoders only), through which long prompts run with every token's logits.
    pub logits_chunks: Vec<Bucket>,
    /// How the KV caches are paged (`None`: dense); lowering picks the paged kernels.
    pub kv_paging: Option<crate::plan::KvPaging>,
}

impl CompileOptions {
    /// The prefill buckets of `plan` alone: the default rule limits and cost model, no length
    /// histogram, no KV cache, prompt or logits chunks.
    pub fn prefill(plan: BucketPlan) -> CompileOptions {
        CompileOptions {
            plan,
            limits: Limits::default(),
            cost: CostModel::default(),
            histogram: None,
            max_context: None,
            prefill_chunks: Vec::new(),
            logits_chunks: Vec::new(),
            kv_paging: None,
        }
    }

    /// The prompt chunks that are graphs of their own (more than one token).
    fn prompt_chunks(&self) -> impl Iterator<Item = Bucket> + '_ {
        self.prefill_chunks.iter().copied().filter(|c| c.seq > 1)
    }
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
    /// The hardware path of the kernel lowering generated for it (its main kernel's, for a node
    /// lowered to several launches).
    pub path: KernelPath,
    /// The generated kernels it launches, in order (on a GPU without sm_90a, a Hopper kernel's
    /// launch runs its fallback instead).
    pub launches: Vec<String>,
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
    /// Logits chunks (KV-cached, every token's logits kept), largest first.
    pub logits_chunks: Vec<BucketReport>,
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
    /// Whether decode products take the same kernels at every batch size, so that a sequence
    /// decoded beside others gets what it gets alone (the artifact decodes several sequences
    /// together; `kiln_kernels::gemv::Rows`), rather than each batch size its fastest ones.
    pub batch_invariant_decode: bool,
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
    /// Logits chunks, largest first.
    pub logits_chunks: Vec<CompiledBucket>,
    /// The generated kernels of every bucket, deduplicated.
    pub kernels: crate::lower::Lowered,
}

/// Compiles `graph` for every bucket of `opts.plan` and, for decoders, the KV-cached graph
/// `cached` at `opts.max_context` cache entries: once at each of `opts.prefill_chunks` (the
/// prompt chunks), then for every batch bucket at one token (the decode steps), then at each of
/// `opts.logits_chunks` with its logits.
pub fn compile(
    graph: &Graph,
    cached: Option<&Graph>,
    opts: &CompileOptions,
) -> Result<(CompileReport, Compiled), FusionError> {
    compile_with_progress(graph, cached, opts, &Progress::shown(false))
}

/// [`compile`], showing the rule phases and each bucket's extraction on `progress`.
pub fn compile_with_progress(
    graph: &Graph,
    cached: Option<&Graph>,
    opts: &CompileOptions,
    progress: &Progress,
) -> Result<(CompileReport, Compiled), FusionError> {
    let mut stage_seconds = BTreeMap::new();
    let start = Instant::now();
    let stage = progress.stage("rules", 0);
    let saturated = saturate(graph, &opts.limits)?;
    let saturated_cached = match (cached, opts.max_context) {
        (Some(g), Some(_)) => Some(saturate(g, &opts.limits)?),
        _ => None,
    };
    drop(stage);
    stage_seconds.insert("saturate".to_string(), start.elapsed().as_secs_f64());
    let start = Instant::now();
    let jobs = bucket_jobs(opts, &saturated, saturated_cached.as_ref());
    let stage = progress.stage("fusion", jobs.len() as u64);
    let extracted: Vec<(Graph, f64)> = jobs
        .par_iter()
        .map(|&(sat, bucket, role)| {
            let done = extract_bucket(sat, bucket, role, &opts.cost);
            stage.inc(1);
            done
        })
        .collect::<Result<_, _>>()?;
    let mut generated = crate::lower::Lowered::new(
        crate::lower::batch_rows(extracted.iter().map(|(g, _)| g)),
        opts.kv_paging,
        crate::lower::cache_rows(extracted.iter().map(|(g, _)| g)),
    );
    let (mut prefill, mut decode, mut logits_chunks) = (Vec::new(), Vec::new(), Vec::new());
    for ((_, bucket, role), (graph, modelled)) in jobs.into_iter().zip(extracted) {
        let done = lower_bucket(graph, bucket, role.context(), modelled, &mut generated)?;
        match role {
            Role::Prefill => prefill.push(done),
            Role::Cached(_) => decode.push(done),
            Role::LogitsChunk(_) => logits_chunks.push(done),
        }
    }
    stage.say("");
    drop(stage);
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
    let (reports, buckets): (Vec<_>, Vec<_>) = prefill.into_iter().unzip();
    let (decode_reports, decode): (Vec<_>, Vec<_>) = decode.into_iter().unzip();
    let (chunk_reports, logits_chunks): (Vec<_>, Vec<_>) = logits_chunks.into_iter().unzip();
    Ok((
        CompileReport {
            buckets: reports,
            decode_buckets: decode_reports,
            logits_chunks: chunk_reports,
            rules,
            egraph,
            stage_seconds,
            padding,
            ptx_kernels: generated.kernels.len(),
            batch_invariant_decode: generated.rows == kiln_kernels::gemv::Rows::BatchInvariant,
        },
        Compiled {
            prefill: buckets,
            decode,
            logits_chunks,
            kernels: generated,
        },
    ))
}

/// Every bucket to extract, with the saturated graph it comes from and its role: the prefill
/// buckets, then, with a KV cache, the prompt chunks, the decode steps (largest batch first)
/// and the logits chunks. Extraction runs on every core; lowering then goes bucket after
/// bucket in this order, so the kernel table (names of kernels that clash included) is the
/// same whatever the scheduling.
fn bucket_jobs<'a>(
    opts: &CompileOptions,
    saturated: &'a Saturated,
    cached: Option<&'a Saturated>,
) -> Vec<(&'a Saturated, Bucket, Role)> {
    let mut jobs: Vec<_> = opts
        .plan
        .prefill()
        .into_iter()
        .map(|b| (saturated, b, Role::Prefill))
        .collect();
    if let (Some(sat), Some(context)) = (cached, opts.max_context) {
        let steps = opts
            .plan
            .batch_sizes
            .iter()
            .rev()
            .map(|&batch| Bucket { batch, seq: 1 });
        jobs.extend(
            opts.prompt_chunks()
                .chain(steps)
                .map(|b| (sat, b, Role::Cached(context))),
        );
        jobs.extend(
            opts.logits_chunks
                .iter()
                .map(|&b| (sat, b, Role::LogitsChunk(context))),
        );
    }
    jobs
}

/// What a bucket is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A prefill (or encode) bucket of the whole graph.
    Prefill,
    /// A KV-cached bucket at this many cache entries: a decode step, or, of more than one
    /// token, a prompt chunk.
    Cached(usize),
    /// A KV-cached chunk at this many cache entries that keeps its logits.
    LogitsChunk(usize),
}

impl Role {
    /// The KV-cache capacity of a KV-cached bucket.
    fn context(self) -> Option<usize> {
        match self {
            Role::Prefill => None,
            Role::Cached(c) | Role::LogitsChunk(c) => Some(c),
        }
    }
}

/// Extracts and specialises one bucket of `sat`, with the cost the model gives it; a KV-cached
/// bucket of more than one token that is not a logits chunk is a prompt chunk, which only fills
/// the cache: its `logits` output, and the LM head with it, are left out (generation takes the
/// prompt's last token through a decode step).
fn extract_bucket(
    sat: &Saturated,
    bucket: Bucket,
    role: Role,
    cost: &CostModel,
) -> Result<(Graph, f64), FusionError> {
    let mut bindings = bucket.bindings();
    if let Some(c) = role.context() {
        bindings.insert(CONTEXT.to_string(), c as i64);
    }
    let prompt_chunk = matches!(role, Role::Cached(_)) && bucket.seq > 1;
    let (fused, modelled_seconds) =
        sat.extract_outputs(&bindings, cost, |name| !(prompt_chunk && name == LOGITS))?;
    Ok((fused.specialize(&bindings)?, modelled_seconds))
}

/// Lowers one extracted bucket (its kernels into `generated`) and reports it.
fn lower_bucket(
    graph: Graph,
    bucket: Bucket,
    context: Option<usize>,
    modelled_seconds: f64,
    generated: &mut crate::lower::Lowered,
) -> Result<(BucketReport, CompiledBucket), FusionError> {
    // Lowered as the artifact writer lowers it: product weights stored `[N, K]` (`fold.rs`).
    let (stored, moved) = crate::fold::weights_n_by_k(&graph)?;
    let lowered = crate::lower::lower(&stored, generated);
    let origin: BTreeMap<NodeId, NodeId> = graph
        .nodes()
        .map(|(id, _)| (moved[id.index()], id))
        .collect();
    let launched = lowered
        .nodes
        .iter()
        .map(|(id, node)| {
            let path = KernelPath::main(
                node.launches
                    .iter()
                    .map(|l| generated.kernels[&l.kernel].path),
            );
            let names = node.launches.iter().map(|l| l.kernel.clone()).collect();
            (origin[id], (path, names))
        })
        .collect();
    let no_ptx = lowered
        .unsupported_nodes
        .iter()
        .map(|id| format!("{}_{}", graph.node(origin[id]).op.name(), origin[id].0))
        .collect();
    let report = BucketReport {
        batch: bucket.batch,
        seq: bucket.seq,
        context,
        kernels: kernels(&graph, &launched),
        modelled_seconds,
        no_ptx,
    };
    Ok((
        report,
        CompiledBucket {
            bucket,
            context,
            graph,
        },
    ))
}

/// The kernels of a static graph: every node that is not a leaf, a view, or a value computed from
/// weights alone (those are folded when the artifact is written), each with the path and the
/// launched kernels `launched` gives its node (the lowering's; `other` and none for a node
/// without them).
pub fn kernels(
    graph: &Graph,
    launched: &BTreeMap<NodeId, (KernelPath, Vec<String>)>,
) -> Vec<KernelReport> {
    graph_work(graph, &BTreeMap::new())
        .into_iter()
        .map(|(id, work)| {
            let (path, launches) = launched.get(&id).cloned().unwrap_or_default();
            KernelReport {
                name: format!("{}_{}", graph.node(id).op.name(), id.0),
                kind: work.kind,
                rules: fusions(&graph.node(id).op),
                path,
                launches,
                flops: work.flops,
                bytes: work.bytes,
            }
        })
        .collect()
}
