//! Lowering a bucket's static fused graph to generated kernels (`kiln-kernels`): each kernel node
//! becomes the generator configuration its shapes, dtypes and operand layouts call for. Operands
//! that are views are read in place: attention's q/k/v are head-split views of the fused QKV
//! product (strides and an element offset), and attention writes its output in the `[B, S, H, D]`
//! layout that the following head merge reads as a contiguous matrix.
//!
//! Each kernel node becomes one or more launches whose parameters are bound to [`Operand`]s: graph
//! values (resolved through views by the plan, `plan.rs`), scratch buffers of the node, RoPE tables
//! or constants. What has no GPU generator (sentence-transformers pooling, a RoPE that is not part
//! of a KV-cache write) is listed, not guessed at; on the CPU, such primitives run as strided
//! kernels (`lower/strided.rs`).

use std::collections::BTreeMap;

use kiln_ir::kernel::{
    Activation, AttentionSpec, DecodeAttentionSpec, EmbeddingSpec, GemmSpec, NormSpec,
};
use kiln_ir::{Graph, NodeId, Op, RopeScaling, TensorType};
use kiln_kernels::attention::{
    attention, attention_base, attention_combine, attention_simt, AttentionConfig,
};
use kiln_kernels::attention_decode::Extras;
use kiln_kernels::elementwise::activation_kernel;
use kiln_kernels::embedding::{embedding, EmbeddingConfig};
use kiln_kernels::gemm::{gemm_base, gemm_for, row_sum_parts, split_scratch, GemmConfig, RowNorm};
use kiln_kernels::gemv::{self, Rows};
use kiln_kernels::kv_cache::{chunk_entries, kv_write, ChunkEntriesConfig, KvWriteConfig};
use kiln_kernels::norm::{norm, NormConfig};
use kiln_kernels::paging::Paging;
use kiln_kernels::rope::rotate;
use kiln_kernels::{Elem, GeneratedKernel, Image};

use crate::fusion::cost::{consumers, decode_writes, done_by_writes, is_view};
use crate::plan::KvPaging;

mod strided;
pub use strided::materialize;

/// The RoPE cos/sin tables a kernel reads: `[positions, head_dim / 2]` f32.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    /// Base frequency.
    pub theta: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// Head dimension.
    pub head_dim: u32,
}

/// What a kernel parameter is bound to, before the memory plan gives it an address.
#[derive(Clone, Debug, PartialEq)]
pub enum Operand {
    /// The storage of a graph value (views resolved to the value they read, with its offset).
    Value(NodeId),
    /// The node's `i`-th scratch buffer (a norm prologue's output, split-attention partials, a
    /// split-K product's partial sums).
    Scratch(usize),
    /// A RoPE table: cos, or sin when `sin`.
    Rope {
        /// Which table.
        table: RopeTable,
        /// The sin table rather than the cos one.
        sin: bool,
    },
    /// A 32-bit constant (element counts).
    U32(u32),
    /// A byte offset in the arena that the plan fixed (the copy of an output that is a view).
    Arena(u64),
    /// The bucket's chosen-token slot (`ExecPlan::tokens`), which the plan places.
    Tokens,
    /// The bucket's sampling parameters (`ExecPlan::sampler`: four 32-bit words per row),
    /// which the plan places.
    SamplingParams,
    /// The counters region (`Region::Counters`), of which the launch uses this many bytes.
    Counters(u64),
    /// The paged KV cache's block table (`CachePaging::table` in the cache region).
    BlockTable,
    /// Another operand's storage this many bytes further (a row piece of a product).
    Offset(Box<Operand>, u64),
    /// The row sums of squares the product node writes for a product after it
    /// ([`RowNorm::Sums`]), which the plan places from that node to its last reader.
    RowSums(NodeId),
}

impl Operand {
    /// The graph value whose storage it addresses (through offsets), if any.
    pub fn value(&self) -> Option<NodeId> {
        match self {
            Operand::Value(v) => Some(*v),
            Operand::Offset(op, _) => op.value(),
            _ => None,
        }
    }
}

/// One kernel launch of a node: the kernel's (deduplicated) entry name and an operand per
/// pointer parameter, in the kernel's parameter order.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    /// Entry name in [`Lowered::kernels`].
    pub kernel: String,
    /// Parameter name and what it is bound to.
    pub args: Vec<(String, Operand)>,
    /// The launch configuration for this node's shapes (deduplicated kernels may share code
    /// across shapes, never launch configurations).
    pub launch: kiln_kernels::Launch,
    /// The same work on base-image kernels, when `kernel` needs sm_90a.
    pub fallback: Option<Box<KernelLaunch>>,
    /// Launched only where the sm_90a steps fall back: work the next step's sm_90a kernel does
    /// itself, and its fallback reads (an RMSNorm a product carries, [`RowNorm`]).
    pub base_only: bool,
}

/// The CPU version of a launch: the generated kernel (or the library product) it calls.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuKernel {
    /// `kiln_kernels::cpu::norm`.
    Norm(NormConfig),
    /// `kiln_kernels::cpu::elementwise`.
    Activation(Activation),
    /// `kiln_kernels::cpu::embedding`.
    Embedding(EmbeddingConfig),
    /// `kiln_kernels::cpu::kv_cache`.
    KvWrite(KvWriteConfig),
    /// `kiln_kernels::cpu::attention` (one key range).
    Attention(AttentionConfig),
    /// A library product followed by `kiln_kernels::cpu::epilogue` when it has one.
    Gemm(GemmConfig),
    /// `kiln_kernels::cpu::strided`: a primitive op no fused kernel covers.
    Strided(kiln_kernels::cpu::strided::StridedConfig),
}

/// One CPU call of a node: the kernel, its arguments in parameter order, and the extent of its
/// parallel axis (rows, elements, tokens or query rows).
#[derive(Clone, Debug)]
pub struct CpuLaunch {
    /// What it calls.
    pub kernel: CpuKernel,
    /// Its arguments, in parameter order.
    pub args: Vec<Operand>,
    /// `begin..end` ranges cover `0..extent`.
    pub extent: u64,
}

/// How one node runs: its launches in order, and the bytes of each scratch buffer they share.
#[derive(Clone, Debug, Default)]
pub struct NodeLaunches {
    /// Launches, in order.
    pub launches: Vec<KernelLaunch>,
    /// Scratch buffer sizes, bytes.
    pub scratch: Vec<u64>,
    /// The CPU calls, in order; `None` when some part of the node has no CPU version (f16/bf16).
    pub cpu: Option<Vec<CpuLaunch>>,
    /// A logits chunk's LM head in row pieces (`Fused::logits_pieces`): after launch `i`,
    /// the first `rows` rows of its output are final.
    pub pieces: Vec<(usize, u32)>,
    /// Bytes of the row sums this product writes ([`Operand::RowSums`]) and the last node
    /// that reads them.
    pub row_sums: Option<(u64, NodeId)>,
}

impl NodeLaunches {
    /// Adds a CPU call with the tensor parameters of the GPU kernel `like` (the CPU kernels share
    /// them; a count the GPU kernel takes as a scalar, such as a norm's rows, is the CPU call's
    /// extent), bound by `bind`.
    fn cpu_like(
        &mut self,
        kernel: CpuKernel,
        like: &GeneratedKernel,
        bind: &[(&str, Operand)],
        extent: u64,
    ) {
        // The CPU kernels take no scratch (a Hopper kernel's partials and counters).
        let params: Vec<&str> = like.operand_params().collect();
        self.cpu(kernel, bind, &params, extent);
    }

    /// Adds a CPU call with the operands `bind` gives the parameters `params`, in that order (or
    /// leaves the node without a CPU version when the CPU generator does not cover `kernel`).
    fn cpu(&mut self, kernel: CpuKernel, bind: &[(&str, Operand)], params: &[&str], extent: u64) {
        if let CpuKernel::Attention(cfg) = &kernel {
            if !kiln_kernels::cpu::attention::supports(cfg) {
                self.cpu = None;
                return;
            }
        }
        let args: Option<Vec<Operand>> = params
            .iter()
            .map(|p| bind.iter().find(|(n, _)| n == p).map(|(_, o)| o.clone()))
            .collect();
        match (self.cpu.as_mut(), args) {
            (Some(calls), Some(args)) => calls.push(CpuLaunch {
                kernel,
                args,
                extent,
            }),
            _ => self.cpu = None,
        }
    }
}

/// The kernels of one or more graphs, deduplicated by entry name.
#[derive(Default)]
pub struct Lowered {
    /// Kernels by entry name.
    pub kernels: BTreeMap<String, GeneratedKernel>,
    /// Every kernel generated so far, by generator and configuration: the nodes of a model's
    /// layers, and the buckets, share most of their kernels, and each is generated once.
    generated: std::collections::HashMap<String, GeneratedKernel>,
    /// How decode products of different batch sizes relate (see [`batch_rows`]).
    pub rows: Rows,
    /// How KV caches are paged, and the rows of the largest one (which size the default pool);
    /// `None`: dense caches.
    pub kv_paging: Option<(KvPaging, usize)>,
}

/// The row policy of an artifact's matrix-vector products: batch-invariant when one of `graphs`
/// decodes several sequences together (a KV-cached graph whose cache has more than one row), so
/// that each sequence gets the tokens it gets alone; otherwise the fastest kernel per row count.
pub fn batch_rows<'g>(mut graphs: impl Iterator<Item = &'g Graph>) -> Rows {
    let batched = graphs.any(|g| {
        g.inputs()
            .any(|(_, name, ty)| is_cache(name) && ty.shape[0].as_const() > Some(1))
    });
    if batched {
        Rows::BatchInvariant
    } else {
        Rows::Fastest
    }
}

/// The rows of the largest KV cache any of `graphs` declares (its largest decode batch); 0
/// without one.
pub fn cache_rows<'g>(graphs: impl Iterator<Item = &'g Graph>) -> usize {
    graphs
        .flat_map(|g| g.inputs())
        .filter(|(_, name, _)| is_cache(name))
        .filter_map(|(_, _, ty)| ty.shape[0].as_const())
        .max()
        .map_or(0, |rows| rows as usize)
}

/// How one graph runs: the launches of each lowered node, and the ops that have no generator yet.
#[derive(Default)]
pub struct GraphLaunches {
    /// The launches of every lowered node, in graph order.
    pub nodes: Vec<(NodeId, NodeLaunches)>,
    /// `{op}_{node}` of every op left without a kernel.
    pub unsupported: Vec<String>,
    /// Those ops' nodes.
    pub unsupported_nodes: Vec<NodeId>,
    /// Their CPU versions (strided primitive kernels), in the same order; `None` for an op
    /// without one.
    pub unsupported_cpu: Vec<Option<Vec<CpuLaunch>>>,
    /// A decode step's greedy token choice after everything else (see `greedy_tokens`).
    pub tokens: Option<TokenChoice>,
}

/// The launch that writes a decode step's chosen tokens (one i64 per row) into
/// [`Operand::Tokens`].
#[derive(Clone, Debug)]
pub struct TokenChoice {
    /// The argmax launch.
    pub launch: KernelLaunch,
    /// Rows (the bucket's batch).
    pub rows: u32,
    /// Whether the launch also leaves the next step's inputs in their slots: each unmasked
    /// row's token as its next id, its position one further.
    pub advances: bool,
    /// The sampler a step at temperature > 0 launches after the replay instead of reading the
    /// logits back: `kiln_kernels::sampling::top_k_top_p` over the same logits, its parameters
    /// in [`Operand::SamplingParams`], its tokens into [`Operand::Tokens`].
    pub sampler: KernelLaunch,
}

impl Lowered {
    /// No kernels yet; matrix-vector products under `rows`; KV caches paged as `kv_paging` says,
    /// the largest of `cache_rows` rows (`None`: dense).
    pub fn new(rows: Rows, kv_paging: Option<KvPaging>, cache_rows: usize) -> Lowered {
        Lowered {
            rows,
            kv_paging: kv_paging.map(|p| (p, cache_rows)),
            ..Lowered::default()
        }
    }

    /// The paging of a KV cache of `capacity` keys (a pool past `u32::MAX` blocks, which the
    /// memory plan refuses, saturates rather than reading as a dense cache).
    fn paging(&self, capacity: u32) -> Option<Paging> {
        let (p, rows) = self.kv_paging?;
        let entries = capacity.div_ceil(p.block) as usize;
        let blocks = u32::try_from(p.pool_blocks(rows, entries)).unwrap_or(u32::MAX);
        Paging::new(p.block, capacity, blocks)
    }

    /// The kernel `make` generates for `cfg`, generated the first time it is asked for.
    fn generate<C: std::fmt::Debug>(
        &mut self,
        cfg: &C,
        make: impl FnOnce(&C) -> GeneratedKernel,
    ) -> GeneratedKernel {
        let key = format!("{}{cfg:?}", std::any::type_name_of_val(&make));
        self.generated
            .entry(key)
            .or_insert_with(|| make(cfg))
            .clone()
    }

    /// Adds `kernel`, once, and returns the name it is kept under: another kernel under the same
    /// name is kept under a new name.
    pub fn add(&mut self, kernel: GeneratedKernel) -> String {
        let mut name = kernel.name.clone();
        let mut n = 1;
        // Same name, other code (for example other strides): keep both under distinct names.
        while let Some(existing) = self.kernels.get(&name) {
            if existing.ptx == kernel.ptx {
                return name;
            }
            n += 1;
            name = format!("{}_v{n}", kernel.name);
        }
        let mut kernel = kernel;
        if name != kernel.name {
            kernel.ptx = kernel.ptx.replacen(&kernel.name, &name, 1);
            kernel.name = name.clone();
        }
        self.kernels.insert(name.clone(), kernel);
        name
    }

    /// Adds `kernel` and a launch of it with its parameters bound by name from `bind`, which
    /// must bind every parameter the kernel declares (`None` otherwise).
    fn launch(
        &mut self,
        node: &mut NodeLaunches,
        kernel: GeneratedKernel,
        bind: &[(&str, Operand)],
    ) -> Option<()> {
        let launch = self.bound(kernel, bind)?;
        node.launches.push(launch);
        Some(())
    }

    /// [`Lowered::launch`] of `kernel`, and where it is an sm_90a kernel, with its base-image twin
    /// `base(cfg)` as the fallback ([`Lowered::launch_with_fallback`]).
    fn launch_best<C: std::fmt::Debug>(
        &mut self,
        node: &mut NodeLaunches,
        kernel: GeneratedKernel,
        (cfg, base): (&C, impl FnOnce(&C) -> GeneratedKernel),
        bind: &[(&str, Operand)],
    ) -> Option<()> {
        self.launch_best_over(node, (kernel, bind), (cfg, base), bind)
    }

    /// [`Lowered::launch_best`], the fallback's parameters bound from `base_bind` (a product
    /// that carries its norm reads x as it is, its fallback the normed x).
    fn launch_best_over<C: std::fmt::Debug>(
        &mut self,
        node: &mut NodeLaunches,
        (kernel, bind): (GeneratedKernel, &[(&str, Operand)]),
        (cfg, base): (&C, impl FnOnce(&C) -> GeneratedKernel),
        base_bind: &[(&str, Operand)],
    ) -> Option<()> {
        if kernel.image == Image::Sm90a {
            let fallback = self.generate(cfg, base);
            self.launch_with_fallback(node, (kernel, bind), (fallback, base_bind))
        } else {
            self.launch(node, kernel, bind)
        }
    }

    /// Like [`Lowered::launch`], with `fallback` (a base-image kernel) launched instead where the
    /// GPU cannot run `kernel`'s sm_90a image, each bound from its own operands.
    fn launch_with_fallback(
        &mut self,
        node: &mut NodeLaunches,
        (kernel, bind): (GeneratedKernel, &[(&str, Operand)]),
        (fallback, base_bind): (GeneratedKernel, &[(&str, Operand)]),
    ) -> Option<()> {
        let mut launch = self.bound(kernel, bind)?;
        launch.fallback = Some(Box::new(self.bound(fallback, base_bind)?));
        node.launches.push(launch);
        Some(())
    }

    /// Adds `kernel` and returns its launch with the parameters bound from `bind`.
    fn bound(&mut self, kernel: GeneratedKernel, bind: &[(&str, Operand)]) -> Option<KernelLaunch> {
        let mut args = Vec::new();
        for (param, _) in &kernel.signature {
            let (_, op) = bind.iter().find(|(name, _)| name == param)?;
            args.push((param.clone(), op.clone()));
        }
        let launch = kernel.launch;
        let kernel = self.add(kernel);
        Some(KernelLaunch {
            kernel,
            args,
            launch,
            fallback: None,
            base_only: false,
        })
    }
}

fn dims(t: &TensorType) -> Option<Vec<u32>> {
    t.shape
        .iter()
        .map(|d| d.as_const().and_then(|v| u32::try_from(v).ok()))
        .collect()
}

fn numel(t: &TensorType) -> Option<u32> {
    dims(t)?.iter().try_fold(1u32, |a, d| a.checked_mul(*d))
}

/// The `[batch, head, row]` strides (elements) and element offset of a `[B, H, S, D]` operand:
/// contiguous, or the head split `permute([0, 2, 1, 3], reshape([B, S, H, D], x))` of a
/// `[B, S, N]` tensor `x`, itself possibly a slice of the last axis of a wider product.
fn head_strides(g: &Graph, id: NodeId) -> Option<([u32; 3], u32)> {
    let node = g.node(id);
    let shape = dims(&node.ty)?;
    let [_, h, s, d] = shape[..] else { return None };
    match &node.op {
        Op::Permute(p) if p == &[0, 2, 1, 3] => {
            let reshape = g.node(node.args[0]);
            let Op::Reshape(_) = reshape.op else {
                return None;
            };
            let src = g.node(reshape.args[0]);
            match &src.op {
                Op::Slice { axis, start, .. } if *axis == src.ty.rank() - 1 => {
                    let wide = dims(&g.node(src.args[0]).ty)?;
                    let n = *wide.last()?;
                    let offset = u32::try_from(start.as_const()?).ok()?;
                    Some(([s * n, d, n], offset))
                }
                _ if !is_view(&src.op) => Some(([s * h * d, d, h * d], 0)),
                _ => None,
            }
        }
        op if !is_view(op) => Some(([h * s * d, s * d, d], 0)),
        _ => None,
    }
}

/// Lowers every kernel node of the static graph `g`, adding its kernels to `kernels`.
pub fn lower(g: &Graph, kernels: &mut Lowered) -> GraphLaunches {
    let mut out = GraphLaunches::default();
    let consumers = consumers(g);
    let fused = Fused::find(g, &consumers, kernels);
    let mut weight_only = vec![false; g.len()];
    for (id, node) in g.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
        // A RoPE whose only consumers are KV-cache writes is done by the writes themselves.
        let users = consumers[id.index()]
            .iter()
            .map(|(c, position)| (&g.node(*c).op, *position));
        if weight_only[id.index()]
            || node.op.is_leaf()
            || is_view(&node.op)
            || done_by_writes(&node.op, users)
        {
            continue;
        }
        let mut launches = NodeLaunches {
            cpu: Some(Vec::new()),
            ..NodeLaunches::default()
        };
        if lower_node(g, id, &fused, kernels, &mut launches).is_some() {
            out.nodes.push((id, launches));
        } else {
            out.unsupported.push(format!("{}_{}", node.op.name(), id.0));
            out.unsupported_nodes.push(id);
            out.unsupported_cpu.push(strided::lower_primitive(g, id));
        }
    }
    out.tokens = greedy_tokens(&fused, kernels);
    out
}

/// The greedy token choice a decode step (a KV-cached graph whose `logits` are `[B, 1, V]`)
/// ends with: each row's largest logit, the first on ties (`kiln_runtime::generate::choose` at
/// temperature 0), as i64, so generation reads back `B` token ids instead of `B` rows of
/// logits. When the step takes the decoder inputs (`input_ids`, `position_ids`,
/// `attention_mask`, i64 `[B, 1]`), the choice also advances them for the next step
/// ([`TokenChoice::advances`]). `None` for other graphs.
fn greedy_tokens(fused: &Fused, kernels: &mut Lowered) -> Option<TokenChoice> {
    let site = fused.token_site.clone()?;
    let chosen = fused.choosing.is_some();
    let TokenSite {
        logits,
        rows,
        vocab,
        elem,
        next,
    } = site;
    let advances = next.iter().all(|(_, op)| op.is_some());
    let (kernel, mut bind) = if chosen {
        // The LM head folded each row's choice into its key (`gemv::gemv_choosing`).
        let kernel = kernels.generate(&(rows, advances), |&(r, a)| {
            kiln_kernels::sampling::choose_from_keys(r, a)
        });
        let best = ("best", Operand::Counters(u64::from(rows) * 8));
        (kernel, vec![best, ("out", Operand::Tokens)])
    } else {
        let kernel = kernels.generate(&(elem, rows, vocab, advances), |&(e, r, v, a)| {
            kiln_kernels::sampling::argmax(e, r, v, a)
        });
        let bind = vec![("logits", Operand::Value(logits)), ("out", Operand::Tokens)];
        (kernel, bind)
    };
    if advances {
        bind.extend(next.into_iter().filter_map(|(name, op)| Some((name, op?))));
    }
    let launch = kernels.bound(kernel, &bind)?;
    let sampler = kernels.generate(&(elem, rows, vocab), |&(e, r, v)| {
        kiln_kernels::sampling::top_k_top_p(e, r, v)
    });
    let sampler = kernels.bound(
        sampler,
        &[
            ("logits", Operand::Value(logits)),
            ("params", Operand::SamplingParams),
            ("out", Operand::Tokens),
        ],
    )?;
    Some(TokenChoice {
        launch,
        rows,
        advances,
        sampler,
    })
}

/// Where a decode step (a KV-cached graph whose `logits` are `[B, 1, V]`) chooses its tokens:
/// the logits, their shape and type, and the decoder inputs the choice may advance
/// (`input_ids`, `position_ids`, `attention_mask`, i64 `[B, 1]`), where the graph takes them.
#[derive(Clone)]
struct TokenSite {
    logits: NodeId,
    rows: u32,
    vocab: u32,
    elem: Elem,
    next: [(&'static str, Option<Operand>); 3],
}

impl TokenSite {
    fn find(g: &Graph) -> Option<TokenSite> {
        let (logits, shape) = cached_logits(g)?;
        let ty = g.ty(logits);
        let [rows, 1, vocab] = shape[..] else {
            return None;
        };
        let elem = Elem::of(ty.dtype)?;
        let step_input = |name: &str| {
            g.inputs()
                .find(|(_, n, t)| {
                    *n == name
                        && t.dtype == kiln_ir::DType::I64
                        && dims(t).is_some_and(|d| d == [rows, 1])
                })
                .map(|(id, _, _)| Operand::Value(id))
        };
        let [ids, positions, mask] = kiln_ir::artifact::ADVANCED_INPUTS;
        Some(TokenSite {
            logits,
            rows,
            vocab,
            elem,
            next: [
                ("ids", step_input(ids)),
                ("positions", step_input(positions)),
                ("mask", step_input(mask)),
            ],
        })
    }
}

/// The decode step's LM head when it folds the greedy choice into its launch
/// (`gemv::gemv_choosing`, or `gemv::gemv_folded` with its RMSNorm): the logits are that
/// product's output, on the one-column-per-warp kernel under `rows`.
fn choosing_product(g: &Graph, site: &TokenSite, rows: Rows) -> Option<NodeId> {
    let (cfg, _) = gemm_parts(g, site.logits)?;
    gemv::chooses(&cfg, rows).then_some(site.logits)
}

/// Rows of the first piece of a logits chunk's LM head ([`logits_pieces`]): its logits' copy
/// to the host (1.2 ms at Llama-3.2-1B's vocabulary on an H100) starts after 256 rows' product
/// (0.24 ms), not after the whole LM head's.
const LOGITS_PIECE_ROWS: u32 = 256;

/// How many times the rows of the piece before it a later piece takes at most. Each piece
/// reads the whole LM head weight, so fewer, larger pieces cost less (Llama-3.2-1B's, H100:
/// 0.238 ms for 256 rows, 0.377 for 512), and a piece's product still lands before the copy of
/// the one before it ends: a row copies in about `6500 * elem / K` times the time it computes
/// (PCIe at 54 GB/s, products at 700 TFLOP/s), 6.3 at K = 2048 in bf16, 3.2 at 4096.
const LOGITS_PIECE_GROWTH: u32 = 3;

/// The LM head of a logits chunk (a KV-cached graph whose `logits` are `[1, S, V]`, `S` more
/// than one piece), which is lowered in row pieces ([`row_pieces`]), each its own launch, so
/// that the runtime copies each piece's logits to the host while the next computes.
fn logits_pieces(g: &Graph) -> Option<NodeId> {
    let (logits, shape) = cached_logits(g)?;
    let [1, rows, _] = shape[..] else {
        return None;
    };
    let gemm = matches!(g.node(logits).op, Op::Gemm(_));
    (gemm && rows > LOGITS_PIECE_ROWS).then_some(logits)
}

/// The `logits` output of a KV-cached graph (a decode step or a logits chunk) and its static
/// dims.
fn cached_logits(g: &Graph) -> Option<(NodeId, Vec<u32>)> {
    g.inputs().find(|(_, name, _)| is_cache(name))?;
    let logits = g
        .outputs()
        .iter()
        .find(|o| o.name == crate::compile::LOGITS)?;
    Some((logits.node, dims(g.ty(logits.node))?))
}

/// Work one kernel does for other nodes: the cache writes decode attentions do themselves.
#[derive(Default)]
struct Fused {
    /// Each such attention's key and value writes.
    attention_writes: BTreeMap<NodeId, [NodeId; 2]>,
    /// Each prompt chunk's attention over a KV cache whose key and value writes one launch
    /// does together with q's rotation ([`kiln_kernels::kv_cache::chunk_entries`]): the writes,
    /// and what that launch takes of them.
    chunk_writes: BTreeMap<NodeId, ([NodeId; 2], ChunkEntries)>,
    /// Where a decode step chooses its tokens ([`greedy_tokens`]).
    token_site: Option<TokenSite>,
    /// The decode step's LM head when it folds the greedy choice in ([`choosing_product`]).
    choosing: Option<NodeId>,
    /// A logits chunk's LM head, lowered in row pieces ([`logits_pieces`]).
    logits_pieces: Option<NodeId>,
    /// RMSNorms that products carry between them instead of a launch ([`RowNorms::find`]).
    row_norms: RowNorms,
}

impl Fused {
    /// The fusions of the static graph `g` whose kernels serve them: a decode attention takes in
    /// its writes ([`decode_writes`]) when it runs on `attention_decode` and reads their new rows
    /// in place.
    fn find(g: &Graph, consumers: &[Vec<(NodeId, usize)>], kernels: &Lowered) -> Fused {
        let mut attention_writes = BTreeMap::new();
        let mut chunk_writes = BTreeMap::new();
        for f in decode_writes(g, consumers) {
            let node = g.node(f.attention);
            let (Op::DecodeAttention(spec), Some(elem)) = (&node.op, Elem::of(node.ty.dtype))
            else {
                continue;
            };
            let Some((cfg, split, offsets)) = lower_decode(g, f.attention, spec, elem, kernels)
            else {
                continue;
            };
            if new_entries(g, f.writes).is_none() {
                continue;
            }
            if kiln_kernels::attention_decode::supports(&cfg) {
                attention_writes.insert(f.attention, f.writes);
            } else if prerotated_chunk(&cfg, split, offsets) {
                if let Some(entries) = chunk_entries_launch(g, f.writes, elem, kernels) {
                    chunk_writes.insert(f.attention, (f.writes, entries));
                }
            }
        }
        let token_site = TokenSite::find(g);
        let choosing = token_site
            .as_ref()
            .and_then(|site| choosing_product(g, site, kernels.rows));
        let logits_pieces = logits_pieces(g);
        Fused {
            attention_writes,
            chunk_writes,
            token_site,
            row_norms: RowNorms::find(g, kernels.rows, [choosing, logits_pieces]),
            choosing,
            logits_pieces,
        }
    }

    /// Whether the cache write `id` is done by its attention's kernel or its chunk's entries.
    fn write_done(&self, id: NodeId) -> bool {
        (self.attention_writes.values())
            .chain(self.chunk_writes.values().map(|(writes, _)| writes))
            .flatten()
            .any(|w| *w == id)
    }
}

/// The product node `id` takes, and the norm of its prologue: `None` for other nodes.
fn gemm_parts(g: &Graph, id: NodeId) -> Option<(GemmConfig, Option<NormConfig>)> {
    let node = g.node(id);
    let Op::Gemm(spec) = &node.op else {
        return None;
    };
    let elem = Elem::of(node.ty.dtype)?;
    let x = dims(g.ty(node.args[0]))?;
    let k = *x.last()?;
    let m = x.iter().product::<u32>() / k;
    let w = dims(g.ty(node.args[1]))?;
    let cols = if spec.transpose_b { w[0] } else { w[1] };
    if spec.swiglu && cols % 2 != 0 {
        return None;
    }
    let cfg = GemmConfig {
        m,
        k,
        n: cols,
        transpose_b: spec.transpose_b,
        bias: spec.bias,
        activation: spec.activation,
        swiglu: spec.swiglu,
        residual: spec.residual,
        elem,
        row_norm: None,
    };
    let norm = spec.prologue.as_ref().map(|p| NormConfig {
        kind: p.kind,
        residual: false,
        elem,
        rows: m,
        cols: k,
        eps: p.eps as f32,
    });
    Some((cfg, norm))
}

/// Launches the norm kernel of `cfg` over its tensors in `bind`, with its CPU twin; a kernel
/// that gives each row a warp also takes the rows.
fn launch_norm(
    out: &mut Lowered,
    n: &mut NodeLaunches,
    cfg: NormConfig,
    mut bind: Vec<(&str, Operand)>,
) -> Option<()> {
    let kernel = out.generate(&cfg, norm);
    let rows = cfg.rows;
    n.cpu_like(CpuKernel::Norm(cfg), &kernel, &bind, u64::from(rows));
    bind.push(("rows", Operand::U32(rows)));
    out.launch(n, kernel, &bind)
}

fn lower_node(
    g: &Graph,
    id: NodeId,
    fused: &Fused,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let node = g.node(id);
    let elem = Elem::of(node.ty.dtype)?;
    if elem != Elem::F32 {
        // The CPU kernels are f32.
        n.cpu = None;
    }
    let cx = NodeCx {
        g,
        id,
        node,
        elem,
        fused,
    };
    match &node.op {
        Op::Embedding(spec) => lower_embedding(&cx, spec, out, n),
        Op::Norm(spec) => lower_norm_op(&cx, spec, out, n),
        Op::Gemm(spec) => lower_gemm(&cx, spec, out, n),
        Op::Attention(spec) => lower_attention(&cx, spec, out, n),
        Op::DecodeAttention(spec) => lower_decode_attention(&cx, spec, out, n),
        Op::Activation(act) => lower_activation(&cx, *act, out, n),
        Op::CacheWrite => lower_cache_write(&cx, out, n),
        _ => None,
    }
}

/// The node being lowered: its graph and id, the node, its element type, the fused regions.
struct NodeCx<'a> {
    g: &'a Graph,
    id: NodeId,
    node: &'a kiln_ir::Node,
    elem: Elem,
    fused: &'a Fused,
}

impl NodeCx<'_> {
    /// Operand `i` of the node, as a launch operand.
    fn a(&self, i: usize) -> Operand {
        Operand::Value(self.node.args[i])
    }

    /// Operand `i`'s type.
    fn arg(&self, i: usize) -> &TensorType {
        self.g.ty(self.node.args[i])
    }

    /// The node's own value.
    fn this(&self) -> Operand {
        Operand::Value(self.id)
    }
}

/// An embedding: the lookups of its tables' ids, summed.
fn lower_embedding(
    cx: &NodeCx,
    spec: &EmbeddingSpec,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let hidden = *dims(&cx.node.ty)?.last()?;
    let table_rows = (0..spec.tables)
        .map(|i| dims(cx.arg(2 * i)).map(|d| d[0]))
        .collect::<Option<Vec<u32>>>()?;
    let tokens = numel(cx.arg(1))?;
    let cfg = EmbeddingConfig {
        table_rows,
        hidden,
        tokens,
        elem: cx.elem,
    };
    let kernel = out.generate(&cfg, embedding);
    let names: Vec<(String, String)> = (0..spec.tables)
        .map(|i| (format!("table_{i}"), format!("ids_{i}")))
        .collect();
    let mut bind: Vec<(&str, Operand)> = vec![("out", cx.this())];
    for (i, (t, ids)) in names.iter().enumerate() {
        bind.push((t, cx.a(2 * i)));
        bind.push((ids, cx.a(2 * i + 1)));
    }
    n.cpu_like(CpuKernel::Embedding(cfg), &kernel, &bind, u64::from(tokens));
    out.launch(n, kernel, &bind)
}

/// A LayerNorm / RMSNorm (of `x + residual` where it has one).
fn lower_norm_op(
    cx: &NodeCx,
    spec: &NormSpec,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let cols = *dims(&cx.node.ty)?.last()?;
    let rows = numel(&cx.node.ty)? / cols;
    let eps = spec.eps as f32;
    let cfg = NormConfig {
        kind: spec.kind,
        residual: spec.residual,
        elem: cx.elem,
        rows,
        cols,
        eps,
    };
    // Operands: x, [residual], weight, [bias].
    let mut rest = 1;
    let mut bind = vec![("x", cx.a(0)), ("out", cx.this())];
    if spec.residual {
        bind.push(("residual", cx.a(rest)));
        rest += 1;
    }
    bind.push(("weight", cx.a(rest)));
    if rest + 1 < cx.node.args.len() {
        bind.push(("bias", cx.a(rest + 1)));
    }
    launch_norm(out, n, cfg, bind)?;
    Some(())
}

/// Whether the norm prologue of the product `node` has a weight of ones (its last operand: the
/// norm's weight moved into the product's, `fold::scales_by_norm`).
fn norm_weight_is_ones(g: &Graph, node: &kiln_ir::Node) -> bool {
    node.args
        .last()
        .is_some_and(|&w| crate::fold::is_ones(g, w))
}

/// How a product takes the norm of its prologue.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PrologueForm {
    /// The one-row product scales its sums by the RMSNorm's 1/rms itself (f16/bf16, the norm's
    /// weight ones: it is in the product's, `fold::scales_by_norm`).
    Folded,
    /// The tensor-core GEMV normalises x and takes the product in one kernel (f16/bf16, whose
    /// CPU plans come from their f32 twins).
    Taken,
    /// The norm runs into a scratch buffer the product reads (unless the product carries it,
    /// [`RowNorms`]).
    Apart,
}

impl PrologueForm {
    fn of(cfg: &GemmConfig, norm: &NormConfig, rows: Rows, ones: bool) -> PrologueForm {
        if ones && gemv::folds_norm(cfg, norm, rows) {
            PrologueForm::Folded
        } else if gemv::takes_prologue(cfg, norm, rows) {
            PrologueForm::Taken
        } else {
            PrologueForm::Apart
        }
    }
}

/// RMSNorms the products on both sides carry instead of a launch ([`RowNorm`]): where a Hopper
/// product would normalise its input apart (an RMSNorm of a weight of ones, the norm's weight
/// in the product's) and that input is the whole output of a Hopper product over an even N
/// without SwiGLU (a pre-norm model's residual products), the first writes its rows' sums of
/// squares and the second scales its rows by their 1/rms. The norm's launch stays in the plan
/// for the GPUs where the sm_90a steps fall back, and only runs there.
#[derive(Default)]
struct RowNorms {
    /// Each product writing sums: its sums per row, and the last product that reads them.
    writers: BTreeMap<NodeId, (u32, NodeId)>,
    /// Each product scaling its rows: the product whose sums it reads.
    readers: BTreeMap<NodeId, NodeId>,
}

impl RowNorms {
    /// The writers and readers of `g` under `rows`, apart from the products lowered in their own
    /// ways (`special`: a decode step's choosing LM head, a logits chunk's LM head in pieces).
    fn find(g: &Graph, rows: Rows, special: [Option<NodeId>; 2]) -> RowNorms {
        let mut found = RowNorms::default();
        let plain = |id: NodeId| !special.contains(&Some(id));
        for (id, node) in g.nodes() {
            let Op::Gemm(spec) = &node.op else {
                continue;
            };
            let rms = (spec.prologue.as_ref())
                .is_some_and(|p| p.kind == kiln_ir::kernel::NormKind::RmsNorm && !p.residual);
            let Some((cfg, Some(norm))) = gemm_parts(g, id).filter(|_| rms && plain(id)) else {
                continue;
            };
            let ones = norm_weight_is_ones(g, node);
            let apart = PrologueForm::of(&cfg, &norm, rows, ones) == PrologueForm::Apart;
            if !(ones && apart && kiln_kernels::gemm::carries_row_norm(&cfg, rows)) {
                continue;
            }
            let x = node.args[0];
            let writer = match &g.node(x).op {
                Op::Gemm(s) if s.prologue.is_none() && plain(x) => gemm_parts(g, x),
                _ => None,
            };
            let Some(parts) = writer.and_then(|(c, _)| row_sum_parts(&c, rows)) else {
                continue;
            };
            found.readers.insert(id, x);
            let (_, last) = found.writers.entry(x).or_insert((parts, id));
            *last = (*last).max(id);
        }
        found
    }
}

/// A product with its epilogue: with a norm prologue, folded into a one-row product, taken by
/// it, or run first into scratch (or carried from the product before, [`RowNorms`]); a decode
/// step's LM head folding its greedy choice; a Hopper kernel (splitting K into scratch where it
/// does) with its base-image fallback.
fn lower_gemm(cx: &NodeCx, spec: &GemmSpec, out: &mut Lowered, n: &mut NodeLaunches) -> Option<()> {
    let (cfg, norm_cfg) = gemm_parts(cx.g, cx.id)?;
    // Operands: x, w, [bias], [residual], [prologue weight, [prologue bias]].
    let mut rest = 2..cx.node.args.len();
    let bias = spec.bias.then(|| rest.next()).flatten().map(|i| cx.a(i));
    let residual = spec
        .residual
        .then(|| rest.next())
        .flatten()
        .map(|i| cx.a(i));
    let mut bind = vec![("x", cx.a(0)), ("w", cx.a(1)), ("out", cx.this())];
    if let Some(b) = bias {
        bind.push(("bias", b));
    }
    if let Some(r) = residual {
        bind.push(("residual", r));
    }
    let choosing = cx.fused.choosing == Some(cx.id);
    if let Some(norm_cfg) = norm_cfg.clone() {
        let norm_weight = cx.a(rest.next()?);
        let norm_bias = rest.next().map(|i| cx.a(i));
        let operands = (norm_weight, norm_bias);
        if lower_prologue(cx, (&cfg, norm_cfg), &mut bind, operands, (out, n))? {
            return Some(());
        }
    }
    let m = u64::from(cfg.m);
    if choosing {
        // The decode step's LM head, folding each row's greedy choice into its key
        // (`greedy_tokens` reads it); the CPU takes the plain product.
        let kernel = out.generate(&cfg, gemv::gemv_choosing);
        let params: Vec<&str> = kernel
            .signature
            .iter()
            .map(|(p, _)| p.as_str())
            .filter(|p| *p != "best")
            .collect();
        n.cpu(CpuKernel::Gemm(cfg.clone()), &bind, &params, m);
        bind.push(("best", Operand::Counters(m * 8)));
        return out.launch(n, kernel, &bind);
    }
    let unsplit = |(_, p): &(u32, GemmConfig)| split_scratch(p, out.rows) == (0, 0);
    let pieces = (cx.fused.logits_pieces == Some(cx.id))
        .then(|| row_pieces(&cfg))
        .filter(|pieces| pieces.iter().all(unsplit));
    if let Some(pieces) = pieces {
        // The CPU takes the whole product, under the pieces' parameter names.
        let first = out.generate(&(pieces[0].1.clone(), out.rows), |(c, r)| gemm_for(c, *r));
        n.cpu_like(CpuKernel::Gemm(cfg.clone()), &first, &bind, m);
        return lower_pieces(&cfg, &pieces, out, n, &bind);
    }
    // The kernel's own configuration and operands, with the norm it carries; the CPU and the
    // base image take the plain product (of the normed x).
    let eps = norm_cfg.as_ref().map(|norm| norm.eps);
    let (own, mut own_bind) = with_row_norm(cx, (&cfg, eps), &bind, n);
    let kernel = out.generate(&(own.clone(), out.rows), |(c, r)| gemm_for(c, *r));
    let plain = if own == cfg {
        kernel.clone()
    } else {
        out.generate(&cfg, gemm_base)
    };
    n.cpu_like(CpuKernel::Gemm(cfg.clone()), &plain, &bind, m);
    // A Hopper kernel splitting K leaves each part's sums in a scratch buffer.
    let scratch = split_scratch(&own, out.rows);
    if scratch.0 > 0 {
        bind_scratch(n, &mut own_bind, scratch);
    }
    out.launch_best_over(n, (kernel, &own_bind), (&cfg, gemm_base), &bind)
}

/// The norm prologue of the product `cfg` whose operands `bind` holds (its weight and bias
/// `operands`): folded into or taken by a one-row product, which is then the whole node (true),
/// or launched into a scratch buffer that `bind`'s x becomes (false; base-only where the
/// product carries the norm, [`RowNorms`]).
fn lower_prologue(
    cx: &NodeCx,
    (cfg, norm_cfg): (&GemmConfig, NormConfig),
    bind: &mut Vec<(&str, Operand)>,
    (norm_weight, norm_bias): (Operand, Option<Operand>),
    (out, n): (&mut Lowered, &mut NodeLaunches),
) -> Option<bool> {
    let ones = norm_weight_is_ones(cx.g, cx.node);
    let choosing = cx.fused.choosing == Some(cx.id);
    match PrologueForm::of(cfg, &norm_cfg, out.rows, ones) {
        PrologueForm::Folded => {
            if choosing {
                bind.push(("best", Operand::Counters(u64::from(cfg.m) * 8)));
            }
            let kernel = out.generate(&(cfg.clone(), norm_cfg, choosing), gemv::gemv_folded);
            out.launch(n, kernel, bind).map(|()| true)
        }
        PrologueForm::Taken => {
            bind.push(("norm_weight", norm_weight));
            bind.extend(norm_bias.map(|b| ("norm_bias", b)));
            let kernel = out.generate(&(cfg.clone(), norm_cfg, !ones), gemv::gemv_normed);
            out.launch(n, kernel, bind).map(|()| true)
        }
        PrologueForm::Apart => {
            n.scratch
                .push(u64::from(cfg.m) * u64::from(cfg.k) * u64::from(cx.elem.bytes()));
            let mut norm_bind = vec![
                ("x", cx.a(0)),
                ("weight", norm_weight),
                ("out", Operand::Scratch(0)),
            ];
            norm_bind.extend(norm_bias.map(|b| ("bias", b)));
            launch_norm(out, n, norm_cfg, norm_bind)?;
            // A product that carries the norm reads x as it is; its fallback, the normed x.
            n.launches.last_mut()?.base_only = cx.fused.row_norms.readers.contains_key(&cx.id);
            bind[0].1 = Operand::Scratch(0);
            Some(false)
        }
    }
}

/// `cfg` and `bind` with the RMSNorm the product carries ([`RowNorms`]): writing its rows'
/// sums of squares, or scaling its rows by those of the product before (of a norm of `eps`),
/// reading x itself rather than the normed scratch; as they are otherwise.
fn with_row_norm<'a>(
    cx: &NodeCx,
    (cfg, eps): (&GemmConfig, Option<f32>),
    bind: &[(&'a str, Operand)],
    n: &mut NodeLaunches,
) -> (GemmConfig, Vec<(&'a str, Operand)>) {
    let norms = &cx.fused.row_norms;
    let (mut own, mut own_bind) = (cfg.clone(), bind.to_vec());
    if let Some(&(parts, last)) = norms.writers.get(&cx.id) {
        own.row_norm = Some(RowNorm::Sums);
        own_bind.push(("row_sums", Operand::RowSums(cx.id)));
        let m = u64::from(cfg.m);
        n.row_sums = Some((m * u64::from(parts) * 4, last));
    }
    if let (Some(writer), Some(eps)) = (norms.readers.get(&cx.id), eps) {
        let (parts, _) = norms.writers[writer];
        own.row_norm = Some(RowNorm::Scale { parts, eps });
        own_bind[0].1 = cx.a(0);
        own_bind.push(("norm_sums", Operand::RowSums(*writer)));
    }
    (own, own_bind)
}

/// `cfg`'s product in row pieces: [`LOGITS_PIECE_ROWS`] first, then each at most
/// [`LOGITS_PIECE_GROWTH`] times the one before, the last taking the rest; each piece's first
/// row and its product.
fn row_pieces(cfg: &GemmConfig) -> Vec<(u32, GemmConfig)> {
    let mut pieces = Vec::new();
    let (mut first, mut rows) = (0, LOGITS_PIECE_ROWS);
    while first < cfg.m {
        let m = rows.min(cfg.m - first);
        pieces.push((first, GemmConfig { m, ..cfg.clone() }));
        first += m;
        rows = m * LOGITS_PIECE_GROWTH;
    }
    pieces
}

/// `cfg`'s product as a launch per piece of `pieces` ([`row_pieces`]), each reading and
/// writing its own rows of the operands in `bind`.
fn lower_pieces(
    cfg: &GemmConfig,
    pieces: &[(u32, GemmConfig)],
    out: &mut Lowered,
    n: &mut NodeLaunches,
    bind: &[(&str, Operand)],
) -> Option<()> {
    let elem = u64::from(cfg.elem.bytes());
    for (first, piece) in pieces {
        let rows = |op: &Operand, cols: u32| {
            let bytes = u64::from(*first) * u64::from(cols) * elem;
            Operand::Offset(Box::new(op.clone()), bytes)
        };
        let bind: Vec<(&str, Operand)> = bind
            .iter()
            .map(|(name, op)| match *name {
                "x" => (*name, rows(op, cfg.k)),
                "out" | "residual" => (*name, rows(op, cfg.n_out())),
                _ => (*name, op.clone()),
            })
            .collect();
        let kernel = out.generate(&(piece.clone(), out.rows), |(c, r)| gemm_for(c, *r));
        out.launch_best(n, kernel, (piece, gemm_base), &bind)?;
        n.pieces.push((n.launches.len() - 1, first + piece.m));
    }
    Some(())
}

/// A prefill attention: rotated ahead where the kernels take RoPE that way, else one kernel
/// (a Hopper one with its base-image fallback).
fn lower_attention(
    cx: &NodeCx,
    spec: &AttentionSpec,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let (mut cfg, offsets) = base_config(cx.g, cx.id, cx.elem)?;
    cfg.take_attention(spec);
    // Operands: q, k, v, [attention_mask], [positions], [seed].
    let mut rest = 3;
    let mut bind = vec![
        ("q", cx.a(0)),
        ("k", cx.a(1)),
        ("v", cx.a(2)),
        ("out", cx.this()),
    ];
    if spec.padding {
        bind.push(("mask", cx.a(rest)));
        rest += 1;
    }
    if let Some((theta, scaling)) = &spec.rope {
        bind.push(("positions", cx.a(rest)));
        rest += 1;
        let table = rope_table(*theta, scaling, cx.arg(0))?;
        bind.extend(rope_tables(table));
    }
    if spec.dropout.is_some() {
        bind.push(("seed", cx.a(rest)));
    }
    let rows = u64::from(cfg.batch * cfg.heads * cfg.q_len);
    // The rotations' and the Hopper kernel's 16-byte accesses need 8-element offsets.
    let prerotated =
        kiln_kernels::attention::prerotated(&cfg).filter(|_| offsets.iter().all(|o| o % 8 == 0));
    if let Some(plain) = prerotated {
        // The CPU runs the fused kernel, RoPE included; the GPU rotates first.
        let params: Vec<&str> = bind.iter().map(|(p, _)| *p).collect();
        n.cpu(CpuKernel::Attention(cfg.clone()), &bind, &params, rows);
        lower_prerotated(out, n, &cfg, plain, &bind, None)?;
    } else {
        let kernel = attention_kernel(out, &cfg, offsets);
        n.cpu_like(CpuKernel::Attention(cfg.clone()), &kernel, &bind, rows);
        bind_stream_scratch(&cfg, &kernel, n, &mut bind);
        out.launch_best(n, kernel, (&cfg, attention_base), &bind)?;
    }
    Some(())
}

/// Attention over a KV cache (decode steps and prompt chunks): one call on the CPU; on the GPU
/// a prompt chunk rotated ahead (with its cache writes in one launch), the decode kernel taking
/// in the cache writes and merging its key ranges, or a kernel over split key ranges and their
/// combine.
fn lower_decode_attention(
    cx: &NodeCx,
    spec: &DecodeAttentionSpec,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let (cfg, split, offsets) = lower_decode(cx.g, cx.id, spec, cx.elem, out)?;
    // Operands: q, k cache, v cache, positions.
    let mut bind = vec![
        ("q", cx.a(0)),
        ("k", cx.a(1)),
        ("v", cx.a(2)),
        ("positions", cx.a(3)),
    ];
    if let Some((theta, scaling)) = &spec.rope {
        bind.extend(rope_tables(rope_table(*theta, scaling, cx.arg(0))?));
    }
    if cfg.paging.is_some() {
        bind.push(("table", Operand::BlockTable));
    }
    decode_attention_on_cpu(cx, &cfg, &bind, n);
    // The decode kernel takes in the cache writes and merges its own key ranges.
    let writes = cx
        .fused
        .attention_writes
        .get(&cx.id)
        .and_then(|w| new_entries(cx.g, *w));
    let decode = kiln_kernels::attention_decode::supports(&cfg);
    let extras = Extras {
        new: writes.as_ref().map(|(_, new)| new.clone()),
        combine: decode && kiln_kernels::attention_decode::combines(&cfg),
    };
    // A prompt chunk over a KV cache: q rotated ahead of the Hopper kernel, in one
    // launch with the cache writes where they are cx.this() attention's alone.
    let aligned = offsets.iter().all(|o| o % 8 == 0);
    let prerotated =
        decode_prerotated(&cfg, split, offsets).filter(|_| extras == Extras::default());
    if let Some(plain) = prerotated {
        bind.push(("out", cx.this()));
        let entries = cx.fused.chunk_writes.get(&cx.id).map(|(_, e)| e.clone());
        return lower_prerotated(out, n, &cfg, plain, &bind, entries);
    }
    if let Some(([keys, values, mask], _)) = writes {
        bind.extend([
            ("k_new", Operand::Value(keys)),
            ("v_new", Operand::Value(values)),
        ]);
        bind.push(("mask", Operand::Value(mask)));
    }
    if split {
        bind.extend(partials(&cfg, n));
    }
    // Kernels bind the parameters they declare: `out` unless they leave partials.
    bind.push(("out", cx.this()));
    let kernel = if extras == Extras::default() {
        // The Hopper kernel (a chunk without RoPE over a KV cache) only where aligned.
        let kernel = out.generate(&cfg, attention);
        if kernel.image == Image::Sm90a {
            let fallback = out.generate(&cfg, attention_base);
            return if aligned {
                out.launch_with_fallback(n, (kernel, &bind), (fallback, &bind))
            } else {
                out.launch(n, fallback, &bind)
            };
        }
        kernel
    } else {
        let counters = kiln_kernels::attention_decode::counter_bytes(&cfg);
        bind.push(("counters", Operand::Counters(counters)));
        out.generate(&(cfg.clone(), extras.clone()), |(c, e)| {
            kiln_kernels::attention_decode::attention_decode_with(c, e)
        })
    };
    out.launch(n, kernel, &bind)?;
    if split && !extras.combine {
        let bind = [
            ("partial_acc", Operand::Scratch(0)),
            ("partial_ml", Operand::Scratch(1)),
            ("out", cx.this()),
        ];
        let kernel = out.generate(&cfg, attention_combine);
        out.launch(n, kernel, &bind)?;
    }
    Some(())
}

/// Decode attention `cfg`'s CPU call, its operands bound by `bind` (without `out`): one call
/// over every key, with no partials to combine.
fn decode_attention_on_cpu(
    cx: &NodeCx,
    cfg: &AttentionConfig,
    bind: &[(&str, Operand)],
    n: &mut NodeLaunches,
) {
    let mut one = cfg.clone();
    one.splits = 1;
    let mut cpu_bind = bind.to_vec();
    cpu_bind.push(("out", cx.this()));
    let mut params = vec!["q", "k", "v", "out", "positions"];
    if cfg.rope {
        params.extend(["cos", "sin"]);
    }
    if cfg.paging.is_some() {
        params.push("table");
    }
    let rows = u64::from(cfg.batch * cfg.heads * cfg.q_len);
    n.cpu(CpuKernel::Attention(one), &cpu_bind, &params, rows);
}

/// The scratch buffers of split decode attention `cfg`'s partials (each split's accumulators,
/// and its rows' maxima and sums), added to the node's, bound as the kernels name them.
fn partials(cfg: &AttentionConfig, n: &mut NodeLaunches) -> [(&'static str, Operand); 2] {
    let rows = u64::from(cfg.batch * cfg.heads * cfg.q_len * cfg.splits);
    n.scratch.push(rows * u64::from(cfg.head_dim) * 4);
    n.scratch.push(rows * 2 * 4);
    [
        ("partial_acc", Operand::Scratch(0)),
        ("partial_ml", Operand::Scratch(1)),
    ]
}

/// An elementwise activation.
fn lower_activation(
    cx: &NodeCx,
    act: Activation,
    out: &mut Lowered,
    n: &mut NodeLaunches,
) -> Option<()> {
    let count = numel(&cx.node.ty)?;
    let kernel = out.generate(&(act, cx.elem, count), |&(act, elem, count)| {
        activation_kernel(act, elem, count)
    });
    let bind = [
        ("x", cx.a(0)),
        ("out", cx.this()),
        ("n", Operand::U32(count)),
    ];
    n.cpu(
        CpuKernel::Activation(act),
        &bind,
        &["x", "out", "n"],
        u64::from(count),
    );
    out.launch(n, kernel, &bind)
}

/// A KV-cache write (in place: the node's value is its cache operand's storage), unless its
/// attention or its chunk's entries write it.
fn lower_cache_write(cx: &NodeCx, out: &mut Lowered, n: &mut NodeLaunches) -> Option<()> {
    // Operands: cache, new (possibly its RoPE), positions, mask. The cache is updated in
    // place: cx.this() node's value is its first operand's storage.
    let (cfg, values, rope) = cache_write(cx.g, cx.id, cx.elem, out)?;
    let kernel = out.generate(&cfg, kv_write);
    let mut bind = vec![
        ("cache", cx.a(0)),
        ("new", Operand::Value(values)),
        ("positions", cx.a(2)),
        ("mask", cx.a(3)),
    ];
    if let Some(table) = rope {
        bind.extend(rope_tables(table));
    }
    if cfg.paging.is_some() {
        bind.push(("table", Operand::BlockTable));
    }
    let tokens = u64::from(cfg.batch * cfg.new_len);
    n.cpu_like(CpuKernel::KvWrite(cfg), &kernel, &bind, tokens);
    if !cx.fused.write_done(cx.id) {
        out.launch(n, kernel, &bind)?;
    }
    Some(())
}

/// Cache write `id`'s kernel configuration, the values it writes (before their RoPE) and its
/// RoPE table where it rotates them.
fn cache_write(
    g: &Graph,
    id: NodeId,
    elem: Elem,
    out: &Lowered,
) -> Option<(KvWriteConfig, NodeId, Option<RopeTable>)> {
    let node = g.node(id);
    let cache = dims(&node.ty)?;
    let new_id = node.args[1];
    let (values, rope) = match &g.node(new_id).op {
        Op::Rope { theta, scaling } => {
            let values = g.node(new_id).args[0];
            (values, Some(rope_table(*theta, scaling, g.ty(values))?))
        }
        _ => (new_id, None),
    };
    let (new_strides, _) = head_strides(g, values)?;
    let paging = out.paging(cache[2]);
    if paging.is_some() && !is_cache_input(g, node.args[0]) {
        return None;
    }
    let cfg = KvWriteConfig {
        batch: cache[0],
        kv_heads: cache[1],
        new_len: dims(g.ty(new_id))?[2],
        capacity: cache[2],
        head_dim: cache[3],
        new_strides,
        rope: rope.is_some(),
        elem,
        paging,
    };
    Some((cfg, values, rope))
}

/// Whether a decode attention of configuration `cfg` (split or not, at q/k/v element `offsets`)
/// is a prompt chunk that [`lower_prerotated`] runs with q alone rotated: the one whose cache
/// writes [`chunk_entries_launch`] can take in.
fn prerotated_chunk(cfg: &AttentionConfig, split: bool, offsets: [u32; 3]) -> bool {
    let rotations = kiln_kernels::attention::rotations(cfg);
    cfg.q_len > 1
        && decode_prerotated(cfg, split, offsets).is_some()
        && rotations[0].is_some()
        && rotations[1].is_none()
}

/// The plain configuration a decode attention of configuration `cfg` (split or not, at q/k/v
/// element `offsets`) runs on the Hopper kernel with its RoPE rotated ahead
/// ([`lower_prerotated`]): one key range, and offsets the kernel's 16-byte copies take.
fn decode_prerotated(
    cfg: &AttentionConfig,
    split: bool,
    offsets: [u32; 3],
) -> Option<AttentionConfig> {
    let aligned = offsets.iter().all(|o| o % 8 == 0);
    kiln_kernels::attention::prerotated(cfg).filter(|_| !split && aligned)
}

/// The writes `[kw, vw]` of a prompt chunk's keys and values, as one [`chunk_entries`] kernel
/// takes them: its configuration's keys and values, and its bindings but q's; `None` where the
/// writes cannot be built or their caches differ in shape (each then keeps its own launch).
fn chunk_entries_launch(
    g: &Graph,
    [kw, vw]: [NodeId; 2],
    elem: Elem,
    out: &Lowered,
) -> Option<ChunkEntries> {
    let (keys, k_new, _) = cache_write(g, kw, elem, out)?;
    let (values, v_new, _) = cache_write(g, vw, elem, out)?;
    // One launch covers both caches' rows: the values' cache is shaped as the keys'.
    let same_cache = KvWriteConfig {
        new_strides: values.new_strides,
        rope: false,
        ..keys.clone()
    };
    if values != same_cache {
        return None;
    }
    let write = g.node(kw);
    let mut bind = vec![
        ("k_cache", Operand::Value(write.args[0])),
        ("v_cache", Operand::Value(g.node(vw).args[0])),
        ("k_new", Operand::Value(k_new)),
        ("v_new", Operand::Value(v_new)),
        ("mask", Operand::Value(write.args[3])),
    ];
    if keys.paging.is_some() {
        bind.push(("table", Operand::BlockTable));
    }
    // The new keys and values start 16 bytes in when their views' element offsets do (q's
    // offset [`prerotated_chunk`] checks).
    let width = 16 / elem.bytes();
    let aligned = [k_new, v_new]
        .iter()
        .all(|&id| head_strides(g, id).is_some_and(|(_, offset)| offset % width == 0));
    Some(ChunkEntries {
        keys,
        value_strides: values.new_strides,
        aligned,
        bind,
    })
}

/// A prompt chunk's cache writes that its q rotation's launch takes in ([`chunk_entries`]).
#[derive(Clone)]
struct ChunkEntries {
    keys: KvWriteConfig,
    value_strides: [u32; 3],
    aligned: bool,
    bind: Vec<(&'static str, Operand)>,
}

/// What the decode attention reading the cache writes `writes` stores itself: the new keys
/// (before their RoPE), the new values and the writes' mask, and the keys' and values' strides;
/// `None` when their layouts are not head views the kernel reads.
fn new_entries(
    g: &Graph,
    [kw, vw]: [NodeId; 2],
) -> Option<([NodeId; 3], kiln_kernels::attention_decode::NewEntries)> {
    let k_new = g.node(kw).args[1];
    let keys = match g.node(k_new).op {
        Op::Rope { .. } => g.node(k_new).args[0],
        _ => k_new,
    };
    let values = g.node(vw).args[1];
    let (k_strides, _) = head_strides(g, keys)?;
    let (v_strides, _) = head_strides(g, values)?;
    let new = kiln_kernels::attention_decode::NewEntries {
        strides: [k_strides, v_strides],
    };
    Some(([keys, values, g.node(kw).args[3]], new))
}

/// Whether an input is a KV-cache slot.
pub(crate) fn is_cache(name: &str) -> bool {
    name.starts_with("past_")
}

/// Whether `id` is a KV-cache input itself (not a view of one): what a paged cache needs.
fn is_cache_input(g: &Graph, id: NodeId) -> bool {
    matches!(&g.node(id).op, Op::Input(name) if is_cache(name))
}

/// The RoPE table of a rotation over the last axis of values of type `ty`.
fn rope_table(theta: f64, scaling: &RopeScaling, ty: &TensorType) -> Option<RopeTable> {
    Some(RopeTable {
        theta,
        scaling: scaling.clone(),
        head_dim: *dims(ty)?.last()?,
    })
}

/// The `cos` and `sin` bindings of `table`.
fn rope_tables(table: RopeTable) -> [(&'static str, Operand); 2] {
    [
        (
            "cos",
            Operand::Rope {
                table: table.clone(),
                sin: false,
            },
        ),
        ("sin", Operand::Rope { table, sin: true }),
    ]
}

/// The configuration every attention kernel of node `id` shares: shapes, the q/k/v layouts read
/// in place, the `[B, S, H, D]` output layout, and the q/k/v element offsets. The caller sets the
/// key rule and the features.
fn base_config(g: &Graph, id: NodeId, elem: Elem) -> Option<(AttentionConfig, [u32; 3])> {
    let node = g.node(id);
    let q = dims(g.ty(node.args[0]))?;
    let k = dims(g.ty(node.args[1]))?;
    let (batch, heads, kv_heads, q_len, kv_len, head_dim) = (q[0], q[1], k[1], q[2], k[2], q[3]);
    let (qs, qo) = head_strides(g, node.args[0])?;
    let (ks, ko) = head_strides(g, node.args[1])?;
    let (vs, vo) = head_strides(g, node.args[2])?;
    let mut cfg = AttentionConfig::plain([batch, heads, kv_heads, q_len, kv_len, head_dim], elem);
    cfg.strides = [
        qs,
        ks,
        vs,
        [q_len * heads * head_dim, head_dim, heads * head_dim],
    ];
    Some((cfg, [qo, ko, vo]))
}

/// The kernel of attention `cfg` with q/k/v element offsets `offsets`.
fn attention_kernel(
    out: &mut Lowered,
    cfg: &AttentionConfig,
    offsets: [u32; 3],
) -> GeneratedKernel {
    // The element offsets are applied to the pointers at launch; the tensor-core kernels' 16-byte
    // copies need them to be multiples of 8 elements.
    if offsets.iter().all(|o| o % 8 == 0) {
        out.generate(cfg, attention)
    } else {
        out.generate(cfg, attention_simt)
    }
}

/// Attention `cfg` (with RoPE) as [`kiln_kernels::attention::prerotated`] runs it: q (and k) rotated
/// into scratch buffers, then `plain`'s Hopper kernel over them (the base-image kernel of `plain`
/// as its fallback). `bind` binds `cfg`'s parameters; `entries`, a prompt chunk's cache writes,
/// are done in q's rotation's launch.
fn lower_prerotated(
    out: &mut Lowered,
    n: &mut NodeLaunches,
    cfg: &AttentionConfig,
    plain: AttentionConfig,
    bind: &[(&str, Operand)],
    mut entries: Option<ChunkEntries>,
) -> Option<()> {
    let operand = |name: &str| {
        bind.iter()
            .find(|(p, _)| *p == name)
            .map(|(_, o)| o.clone())
    };
    let mut attention_bind: Vec<(&str, Operand)> = bind
        .iter()
        .filter(|(p, _)| !matches!(*p, "cos" | "sin"))
        .cloned()
        .collect();
    for (rotation, name) in kiln_kernels::attention::rotations(cfg)
        .into_iter()
        .zip(["q", "k"])
    {
        let Some(rotation) = rotation else { continue };
        let bytes = rotation.batch * rotation.heads * rotation.len * rotation.head_dim;
        let scratch = Operand::Scratch(n.scratch.len());
        n.scratch
            .push(u64::from(bytes) * u64::from(cfg.elem.bytes()));
        let tables = [
            ("positions", operand("positions")?),
            ("cos", operand("cos")?),
            ("sin", operand("sin")?),
        ];
        match entries.take().filter(|_| name == "q") {
            Some(e) => {
                let cfg = ChunkEntriesConfig {
                    keys: e.keys,
                    value_strides: e.value_strides,
                    query: rotation,
                    aligned: e.aligned,
                };
                let mut entries_bind = e.bind;
                entries_bind.extend([("q", operand(name)?), ("q_out", scratch.clone())]);
                entries_bind.extend(tables);
                let kernel = out.generate(&cfg, chunk_entries);
                out.launch(n, kernel, &entries_bind)?;
            }
            None => {
                let mut rotate_bind = vec![("x", operand(name)?), ("out", scratch.clone())];
                rotate_bind.extend(tables);
                let kernel = out.generate(&rotation, rotate);
                out.launch(n, kernel, &rotate_bind)?;
            }
        }
        attention_bind.iter_mut().find(|(p, _)| *p == name)?.1 = scratch;
    }
    let kernel = out.generate(&plain, attention);
    let fallback = out.generate(&plain, attention_base);
    bind_stream_scratch(&plain, &kernel, n, &mut attention_bind);
    out.launch_with_fallback(n, (kernel, &attention_bind), (fallback, &attention_bind))
}

/// The scratch of `kernel`, the Hopper attention of `cfg` on a stream grid, added to the node's
/// and bound: the split items' partials and counters ([`kiln_kernels::attention_wgmma::scratch`]).
fn bind_stream_scratch(
    cfg: &AttentionConfig,
    kernel: &GeneratedKernel,
    n: &mut NodeLaunches,
    bind: &mut Vec<(&str, Operand)>,
) {
    if !kernel.scratch.is_empty() {
        bind_scratch(n, bind, kiln_kernels::attention_wgmma::scratch(cfg));
    }
}

/// Binds a Hopper kernel's `partials` (`partials` bytes of scratch, added to the node's) and
/// its `counters` (bytes of the counters region), as split products and stream-grid attention
/// take them.
fn bind_scratch(
    n: &mut NodeLaunches,
    bind: &mut Vec<(&str, Operand)>,
    (partials, counters): (u64, u64),
) {
    bind.push(("partials", Operand::Scratch(n.scratch.len())));
    n.scratch.push(partials);
    bind.push(("counters", Operand::Counters(counters)));
}

/// The configuration of decode attention `id` (its keys and values the KV cache, paged as
/// `kernels` pages caches), whether it splits its keys, and its q/k/v element offsets.
fn lower_decode(
    g: &Graph,
    id: NodeId,
    spec: &DecodeAttentionSpec,
    elem: Elem,
    kernels: &Lowered,
) -> Option<(AttentionConfig, bool, [u32; 3])> {
    let (mut cfg, offsets) = base_config(g, id, elem)?;
    cfg.take_decode(spec);
    if let Some(paging) = kernels.paging(cfg.kv_len) {
        // A paged cache is read through its table: k and v must be the cache writes' values.
        let writes = &g.node(id).args[1..3];
        let cached = writes.iter().all(|&w| {
            matches!(g.node(w).op, Op::CacheWrite) && is_cache_input(g, g.node(w).args[0])
        });
        if !cached {
            return None;
        }
        cfg.take_paging(paging);
    }
    // Decode steps (one query row) over long caches split each query's keys evenly across
    // several warps (flash-decoding); prompt chunks take the Hopper or tensor-core kernel, whose
    // blocks already cover many rows.
    cfg.splits = if cfg.q_len == 1 {
        kiln_kernels::attention::decode_splits(cfg.kv_len, cfg.batch, cfg.heads)
    } else {
        1
    };
    Some((cfg.clone(), cfg.splits > 1, offsets))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(m: u32) -> Vec<(u32, u32)> {
        let cfg = GemmConfig::plain(m, 128256, 2048, Elem::BF16);
        row_pieces(&cfg).iter().map(|(f, c)| (*f, c.m)).collect()
    }

    #[test]
    fn logits_pieces_start_small_and_grow_threefold() {
        assert_eq!(rows(1024), [(0, 256), (256, 768)]);
        assert_eq!(rows(520), [(0, 256), (256, 264)]);
        assert_eq!(rows(768), [(0, 256), (256, 512)]);
        assert_eq!(
            rows(4096),
            [(0, 256), (256, 768), (1024, 2304), (3328, 768)]
        );
        // Near misses: a chunk of one piece, and one row more.
        assert_eq!(rows(256), [(0, 256)]);
        assert_eq!(rows(257), [(0, 256), (256, 1)]);
    }
}
