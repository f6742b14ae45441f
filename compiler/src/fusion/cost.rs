//! The cost model: a kernel costs `max(FLOPs / rate, bytes / bandwidth) + launch`, with the rates
//! of the kernel lowering will choose for it (its [`KernelPath`], asked of `kiln_kernels`), as
//! measured on the H200 (`calibration.ron`); ops no GPU kernel computes are priced on the host.
//! Views, graph leaves and weight-only values (folded at compile time) cost nothing.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use kiln_ir::artifact::KernelPath;
use kiln_ir::kernel::Activation;
use kiln_ir::{Graph, NodeId, Op, TensorType};
use kiln_kernels::attention::AttentionConfig;
use kiln_kernels::gemm::GemmConfig;
use kiln_kernels::Elem;
use serde::{Deserialize, Serialize};

/// What kind of kernel an op becomes, as reports name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelKind {
    /// Fused attention (prefill / encode).
    Attention,
    /// Attention of one new token over a KV cache.
    DecodeAttention,
    /// Matrix products, with or without epilogues.
    Gemm,
    /// LayerNorm / RMSNorm.
    Norm,
    /// Elementwise maps.
    Elementwise,
    /// Embedding lookups.
    Embedding,
    /// Reductions (softmax included).
    Reduction,
    /// Token sampling.
    Sampling,
    /// Anything else (concat, unfused RoPE, ...).
    Other,
}

/// The measured rates of the kernels of one kind on one path.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Rate {
    /// The kind it applies to; `None`: every kind.
    pub kind: Option<KernelKind>,
    /// The hardware path it applies to.
    pub path: KernelPath,
    /// Sustained arithmetic, FLOP/s; `None`: not the bound.
    pub flops_per_second: Option<f64>,
    /// Sustained memory traffic, bytes/s; `None`: the copy bandwidth.
    pub bytes_per_second: Option<f64>,
    /// Where the numbers come from.
    pub source: String,
}

/// The cost model's numbers (`calibration.ron`), each with its source.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct CostModel {
    /// One kernel launch replayed from a CUDA graph, seconds.
    pub launch_seconds: f64,
    /// Where `launch_seconds` comes from.
    pub launch_source: String,
    /// Device copy bandwidth, bytes/s (read + write).
    pub copy_bytes_per_second: f64,
    /// Where `copy_bytes_per_second` comes from.
    pub copy_source: String,
    /// Rates per kind and path; the first match applies.
    pub rates: Vec<Rate>,
    /// Arithmetic of the host, where ops without a GPU kernel run, FLOP/s.
    pub host_flops_per_second: f64,
    /// Where `host_flops_per_second` comes from.
    pub host_source: String,
    /// Device-to-host copy bandwidth, bytes/s: what a host op's operands and result cross.
    pub host_link_bytes_per_second: f64,
    /// Where `host_link_bytes_per_second` comes from.
    pub host_link_source: String,
    /// Added to every host op: a host op that a GPU kernel reads costs the bucket its GPU plan.
    pub host_fallback_seconds: f64,
    /// Why `host_fallback_seconds` is what it is.
    pub host_fallback_source: String,
}

impl Default for CostModel {
    /// The H200 calibration kept in the repository.
    fn default() -> CostModel {
        static MODEL: OnceLock<CostModel> = OnceLock::new();
        MODEL
            .get_or_init(|| {
                ron::from_str(include_str!("calibration.ron"))
                    .expect("calibration.ron is valid (tested)")
            })
            .clone()
    }
}

/// Where a kernel op runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Runs {
    /// A GPU kernel on this path.
    Gpu(KernelPath),
    /// The host: no GPU kernel computes the op (it would be a host-tail op).
    Host,
}

/// The work of one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KernelWork {
    /// Its kind.
    pub kind: KernelKind,
    /// Where it runs.
    pub runs: Runs,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written.
    pub bytes: f64,
}

impl CostModel {
    /// The rate of `kind` kernels on `path`.
    pub fn rate(&self, kind: KernelKind, path: KernelPath) -> Option<&Rate> {
        self.rates
            .iter()
            .find(|r| r.path == path && r.kind.is_none_or(|k| k == kind))
    }

    /// Seconds for `work`.
    pub fn seconds(&self, work: &KernelWork) -> f64 {
        let path = match work.runs {
            Runs::Host => {
                return work.flops / self.host_flops_per_second
                    + work.bytes / self.host_link_bytes_per_second
                    + self.launch_seconds
                    + self.host_fallback_seconds
            }
            Runs::Gpu(path) => path,
        };
        let rate = self.rate(work.kind, path);
        let compute = rate
            .and_then(|r| r.flops_per_second)
            .map_or(0.0, |f| work.flops / f);
        let bandwidth = rate
            .and_then(|r| r.bytes_per_second)
            .unwrap_or(self.copy_bytes_per_second);
        compute.max(work.bytes / bandwidth) + self.launch_seconds
    }
}

/// An operand as the cost model sees it.
#[derive(Clone, Copy, Debug)]
pub struct CostArg<'a> {
    /// Its type.
    pub ty: &'a TensorType,
    /// Computed from weights alone: folded when the artifact is written, a product's weight
    /// stored `[N, K]` (`fold.rs`).
    pub weight_only: bool,
}

/// True for ops that are views of their operand (kernels read them through strides).
pub fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape(_) | Op::Permute(_) | Op::Broadcast(_) | Op::Slice { .. } | Op::RepeatKv { .. }
    )
}

fn numel(t: &TensorType, bindings: &BTreeMap<String, i64>) -> f64 {
    t.shape
        .iter()
        .map(|d| d.eval(bindings).unwrap_or(1).max(0) as f64)
        .product()
}

fn bytes(t: &TensorType, bindings: &BTreeMap<String, i64>) -> f64 {
    numel(t, bindings) * t.dtype.size_bytes() as f64
}

/// The kernel `op` becomes, with where it runs and its FLOPs and bytes at `bindings`; `None` for
/// leaves and views.
pub fn kernel_work(
    op: &Op,
    operands: &[CostArg],
    out: &TensorType,
    bindings: &BTreeMap<String, i64>,
) -> Option<KernelWork> {
    if op.is_leaf() || is_view(op) {
        return None;
    }
    let runs = runs(op, operands, out, bindings);
    let args: Vec<&TensorType> = operands.iter().map(|a| a.ty).collect();
    let n = numel(out, bindings);
    if let Op::CacheWrite = op {
        // Written in place: the new entries are read and stored, the cache is not copied.
        return Some(KernelWork {
            kind: KernelKind::Other,
            runs,
            flops: 0.0,
            bytes: 2.0 * bytes(args[1], bindings),
        });
    }
    let mut io: f64 = args.iter().map(|a| bytes(a, bindings)).sum::<f64>() + bytes(out, bindings);
    if let (Op::Attention(spec), Runs::Gpu(KernelPath::Wgmma)) = (op, runs) {
        if spec.rope.is_some() {
            // `kiln_kernels::attention::prerotated`: q and k are rotated into buffers first,
            // written once and read again.
            io += 2.0 * (bytes(args[0], bindings) + bytes(args[1], bindings));
        }
    }
    let dim = |t: &TensorType, i: usize| t.shape[i].eval(bindings).unwrap_or(1) as f64;
    let (kind, flops) = match op {
        Op::Attention(_) => {
            // q [B, H, S, D], k [B, KVH, T, D]: two products of B*H*S*T*D, plus the softmax.
            let d = args[0].shape[3].eval(bindings).unwrap_or(1) as f64;
            let t = args[1].shape[2].eval(bindings).unwrap_or(1) as f64;
            let s_h_b = numel(args[0], bindings) / d;
            (KernelKind::Attention, 4.0 * s_h_b * t * d + 5.0 * s_h_b * t)
        }
        Op::DecodeAttention(_) => {
            // q [B, H, S, D] over the whole cache [B, KVH, T, D].
            let d = args[0].shape[3].eval(bindings).unwrap_or(1) as f64;
            let t = args[1].shape[2].eval(bindings).unwrap_or(1) as f64;
            let s_h_b = numel(args[0], bindings) / d;
            (
                KernelKind::DecodeAttention,
                4.0 * s_h_b * t * d + 5.0 * s_h_b * t,
            )
        }
        Op::Gemm(g) => {
            // x [.., M, K] times w: 2 * (M * K) * N, N read off the weight's layout.
            let cols = dim(args[1], usize::from(!g.transpose_b));
            (KernelKind::Gemm, 2.0 * numel(args[0], bindings) * cols + n)
        }
        Op::MatMul => {
            let k = dim(args[0], args[0].rank() - 1);
            (KernelKind::Gemm, 2.0 * k * n)
        }
        Op::Norm(_) => (KernelKind::Norm, 8.0 * n),
        Op::Embedding(_) | Op::Gather => (KernelKind::Embedding, n),
        Op::Softmax | Op::SoftmaxDropout { .. } | Op::Reduce { .. } => {
            (KernelKind::Reduction, 5.0 * numel(args[0], bindings))
        }
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Activation(_)
        | Op::CausalMask { .. }
        | Op::PaddingMask(_)
        | Op::PositionMask { .. }
        | Op::Dropout { .. } => (KernelKind::Elementwise, n),
        Op::Rope { .. } | Op::Concat(_) | Op::CacheWrite => (KernelKind::Other, n),
        Op::Input(_) | Op::Weight(_) | Op::Scalar(_) => return None,
        Op::Reshape(_)
        | Op::Permute(_)
        | Op::Broadcast(_)
        | Op::Slice { .. }
        | Op::RepeatKv { .. } => return None,
    };
    Some(KernelWork {
        kind,
        runs,
        flops,
        bytes: io,
    })
}

/// The kernels of `graph` at `bindings`, with their work: every node that is not a leaf, a view,
/// a value computed from weights alone (those are folded when the artifact is written) or work
/// another kernel does (a RoPE in its cache writes, the cache writes of a decode attention that
/// does them: [`decode_writes`]).
pub fn graph_work(graph: &Graph, bindings: &BTreeMap<String, i64>) -> Vec<(NodeId, KernelWork)> {
    let consumers = consumers(graph);
    let mut weight_only = vec![false; graph.len()];
    for (id, node) in graph.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
    }
    let work = |id: NodeId| {
        let node = graph.node(id);
        let args = cost_args(graph, node, &weight_only);
        kernel_work(&node.op, &args, &node.ty, bindings)
    };
    // Cache writes a decode attention on the decode kernel does, their bytes counted in it.
    let mut taken_in: BTreeMap<NodeId, f64> = BTreeMap::new();
    let mut done_elsewhere = std::collections::BTreeSet::new();
    for fused in decode_writes(graph, &consumers) {
        let node = graph.node(fused.attention);
        let args = cost_args(graph, node, &weight_only);
        if attention_config(&node.op, &args, &node.ty, bindings)
            .is_some_and(|c| kiln_kernels::attention_decode::supports(&c))
        {
            for w in fused.writes {
                let bytes = work(w).map_or(0.0, |w| w.bytes);
                *taken_in.entry(fused.attention).or_default() += bytes;
                done_elsewhere.insert(w);
            }
        }
    }
    let mut out = Vec::new();
    for (id, node) in graph.nodes() {
        let users = consumers[id.index()]
            .iter()
            .map(|(c, position)| (&graph.node(*c).op, *position));
        if weight_only[id.index()]
            || done_by_writes(&node.op, users)
            || done_elsewhere.contains(&id)
        {
            continue;
        }
        if let Some(mut w) = work(id) {
            w.bytes += taken_in.get(&id).copied().unwrap_or(0.0);
            out.push((id, w));
        }
    }
    out
}

/// The cost-model view of `node`'s operands.
fn cost_args<'g>(graph: &'g Graph, node: &kiln_ir::Node, weight_only: &[bool]) -> Vec<CostArg<'g>> {
    node.args
        .iter()
        .map(|a| CostArg {
            ty: graph.ty(*a),
            weight_only: weight_only[a.index()],
        })
        .collect()
}

/// Every node's consumers: the node reading it and the operand position it reads it at.
pub fn consumers(graph: &Graph) -> Vec<Vec<(NodeId, usize)>> {
    let mut consumers = vec![Vec::new(); graph.len()];
    for (id, node) in graph.nodes() {
        for (position, a) in node.args.iter().enumerate() {
            consumers[a.index()].push((id, position));
        }
    }
    consumers
}

/// A decode attention that writes the step's new key and value into the caches itself
/// (`kiln_kernels::attention_decode::NewEntries`) in place of the two cache writes it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeWrites {
    /// The decode attention.
    pub attention: NodeId,
    /// Its key and value cache writes.
    pub writes: [NodeId; 2],
}

/// The decode attentions of `graph` that can take in their cache writes (`consumers`:
/// [`consumers`]): each reads, as its keys and values, two cache writes at its own positions
/// under one mask that nothing else reads (graph outputs aside: the cache is written in place),
/// the keys rotated by q's own RoPE, or neither rotated, and the values not. Whether the kernel
/// lowering picks serves the attention is the caller's question
/// (`kiln_kernels::attention_decode::supports`).
pub fn decode_writes(graph: &Graph, consumers: &[Vec<(NodeId, usize)>]) -> Vec<DecodeWrites> {
    let mut out = Vec::new();
    for (id, node) in graph.nodes() {
        let Op::DecodeAttention(spec) = &node.op else {
            continue;
        };
        let [_, kw, vw, positions] = node.args[..] else {
            continue;
        };
        let write = |w: NodeId, slot: usize| {
            let n = graph.node(w);
            matches!(n.op, Op::CacheWrite)
                && n.args[2] == positions
                && consumers[w.index()] == [(id, slot)]
        };
        if kw == vw || !write(kw, 1) || !write(vw, 2) {
            continue;
        }
        let (k_new, v_new) = (
            graph.node(graph.node(kw).args[1]),
            graph.node(graph.node(vw).args[1]),
        );
        let keys_rotated_as_q = match (&k_new.op, &spec.rope) {
            (Op::Rope { theta, scaling }, Some((t, s))) => {
                theta == t && scaling == s && k_new.args[1] == positions
            }
            (op, None) => !matches!(op, Op::Rope { .. }),
            _ => false,
        };
        let same_mask = graph.node(kw).args[3] == graph.node(vw).args[3];
        if keys_rotated_as_q && same_mask && !matches!(v_new.op, Op::Rope { .. }) {
            out.push(DecodeWrites {
                attention: id,
                writes: [kw, vw],
            });
        }
    }
    out
}

/// True when `op` is a RoPE whose every consumer is a KV-cache write of its result (`consumers`:
/// each consumer's op and the operand position it reads it at): the writes rotate on the way, so
/// it is no kernel of its own (`lower.rs`).
pub fn done_by_writes<'a>(op: &Op, mut consumers: impl Iterator<Item = (&'a Op, usize)>) -> bool {
    matches!(op, Op::Rope { .. })
        && consumers.all(|(c, position)| matches!(c, Op::CacheWrite) && position == 1)
}

/// The modelled seconds of `graph` at `bindings`: the sum over [`graph_work`]'s kernels (what
/// extraction minimises, so an extracted graph can be compared with the unfused one).
pub fn graph_seconds(graph: &Graph, bindings: &BTreeMap<String, i64>, model: &CostModel) -> f64 {
    graph_work(graph, bindings)
        .iter()
        .map(|(_, w)| model.seconds(w))
        .sum()
}

/// Where `op` runs: the path `kiln_kernels` dispatches its configuration to for the kernels
/// lowering generates (`lower.rs`), the host for ops without a GPU kernel (a RoPE outside a
/// KV-cache write included), so extraction never prefers a form that lowering cannot run.
fn runs(op: &Op, args: &[CostArg], out: &TensorType, bindings: &BTreeMap<String, i64>) -> Runs {
    // A configuration that cannot be built (no static size) is priced as the fallback.
    let gpu = |path: Option<KernelPath>| Runs::Gpu(path.unwrap_or(KernelPath::Simt));
    match op {
        Op::Gemm(_) => {
            gpu(gemm_config(op, args, out, bindings).map(|c| kiln_kernels::gemm::path(&c)))
        }
        Op::Attention(_) | Op::DecodeAttention(_) => {
            gpu(attention_config(op, args, out, bindings)
                .map(|c| kiln_kernels::attention::path(&c)))
        }
        Op::Embedding(_) | Op::Norm(_) | Op::Activation(_) | Op::CacheWrite => {
            Runs::Gpu(KernelPath::Other)
        }
        _ => Runs::Host,
    }
}

fn dims(t: &TensorType, bindings: &BTreeMap<String, i64>) -> Option<Vec<u32>> {
    t.shape
        .iter()
        .map(|d| d.eval(bindings).and_then(|v| u32::try_from(v).ok()))
        .collect()
}

/// The configuration lowering gives the product `op` (a [`Op::Gemm`]): its weight stored `[N, K]`
/// when it is weight-only, as folding stores it.
pub fn gemm_config(
    op: &Op,
    args: &[CostArg],
    out: &TensorType,
    bindings: &BTreeMap<String, i64>,
) -> Option<GemmConfig> {
    let Op::Gemm(spec) = op else { return None };
    let x = dims(args[0].ty, bindings)?;
    let k = *x.last()?;
    let m = x.iter().try_fold(1u32, |a, d| a.checked_mul(*d))? / k.max(1);
    let w = dims(args[1].ty, bindings)?;
    Some(GemmConfig {
        m,
        k,
        n: if spec.transpose_b { w[0] } else { w[1] },
        transpose_b: spec.transpose_b || (args[1].weight_only && w.len() == 2),
        bias: spec.bias,
        activation: spec.activation,
        swiglu: spec.swiglu,
        residual: spec.residual,
        elem: Elem::of(out.dtype)?,
        row_norm: None,
    })
}

/// The configuration lowering gives the attention `op` ([`Op::Attention`] or
/// [`Op::DecodeAttention`], one key range), with contiguous q/k/v/out layouts: in the e-graph the
/// layouts are not known yet (lowering reads q/k/v in place from the QKV product or the cache).
pub fn attention_config(
    op: &Op,
    args: &[CostArg],
    out: &TensorType,
    bindings: &BTreeMap<String, i64>,
) -> Option<AttentionConfig> {
    let q = dims(args[0].ty, bindings)?;
    let k = dims(args[1].ty, bindings)?;
    let (&[batch, heads, q_len, head_dim], &[_, kv_heads, kv_len, _]) = (&q[..], &k[..]) else {
        return None;
    };
    let shape = [batch, heads, kv_heads, q_len, kv_len, head_dim];
    let mut cfg = AttentionConfig::plain(shape, Elem::of(out.dtype)?);
    match op {
        Op::Attention(spec) => cfg.take_attention(spec),
        Op::DecodeAttention(spec) => cfg.take_decode(spec),
        _ => return None,
    }
    Some(cfg)
}

/// The fusions a kernel op carries, named as the rules that make them.
pub fn fusions(op: &Op) -> Vec<&'static str> {
    let mut out = Vec::new();
    match op {
        Op::Attention(a) => {
            // The softmax idiom, then the one attention rule that fused it (RoPE on q and k is
            // taken in by that rule's builder).
            out.push("softmax");
            let masked = a.padding || a.causal;
            out.push(match (masked, a.dropout.is_some()) {
                (false, false) => "attention",
                (true, false) => "attention-masked",
                (false, true) => "attention-dropout",
                (true, true) => "attention-masked-dropout",
            });
            if a.dropout.is_some() {
                out.push("softmax-dropout");
            }
        }
        Op::Gemm(g) => {
            out.push(if g.transpose_b { "gemm-linear" } else { "gemm" });
            if let Some(n) = &g.prologue {
                out.push(match n.kind {
                    kiln_ir::kernel::NormKind::LayerNorm => "layer-norm-prologue",
                    kiln_ir::kernel::NormKind::RmsNorm => "norm-prologue",
                });
            }
            if g.bias {
                out.push("gemm-bias");
            }
            if g.activation.is_some() {
                out.push("gemm-activation");
            }
            if g.swiglu {
                out.push("gemm-swiglu");
            }
            if g.residual {
                out.push("gemm-residual");
            }
        }
        Op::Norm(n) => {
            out.push(match n.kind {
                kiln_ir::kernel::NormKind::LayerNorm => "layer-norm",
                kiln_ir::kernel::NormKind::RmsNorm => "rms-norm",
            });
            if n.residual {
                out.push(match n.kind {
                    kiln_ir::kernel::NormKind::LayerNorm => "layer-norm-residual",
                    kiln_ir::kernel::NormKind::RmsNorm => "rms-norm-residual",
                });
            }
        }
        Op::Embedding(e) => {
            out.push("embedding");
            if e.tables > 1 {
                out.push("embedding-sum");
            }
        }
        Op::DecodeAttention(_) => out.extend(["softmax", "decode-attention"]),
        Op::Softmax => out.push("softmax"),
        Op::SoftmaxDropout { .. } => out.extend(["softmax", "softmax-dropout"]),
        Op::Activation(a) => out.push(match a {
            Activation::GeluTanh => "gelu-tanh",
            Activation::GeluErf => "gelu-erf",
            Activation::Silu => "silu",
            Activation::Relu => "relu",
        }),
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::kernel::{AttentionSpec, GemmSpec};
    use kiln_ir::{DType, Dim};

    fn ty(dtype: DType, shape: &[usize]) -> TensorType {
        TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect())
    }

    fn arg(t: &TensorType) -> CostArg<'_> {
        CostArg {
            ty: t,
            weight_only: false,
        }
    }

    /// Seconds of the product `[m, k] x [n, k]^T` in `dtype`, and where it runs.
    fn product(dtype: DType, m: usize, n: usize, k: usize, swiglu: bool) -> (f64, Runs) {
        let (x, w) = (ty(dtype, &[m, k]), ty(dtype, &[n, k]));
        let out = ty(dtype, &[m, if swiglu { n / 2 } else { n }]);
        let op = Op::Gemm(GemmSpec {
            swiglu,
            ..GemmSpec::plain(true)
        });
        let work = kernel_work(&op, &[arg(&x), arg(&w)], &out, &BTreeMap::new()).unwrap();
        (CostModel::default().seconds(&work), work.runs)
    }

    /// The work of causal attention, d 128, over `s` tokens of `batch` sequences with `heads`
    /// query and `kv_heads` K/V heads.
    fn attention_work(
        dtype: DType,
        [batch, heads, kv_heads, s]: [usize; 4],
        rope: bool,
    ) -> KernelWork {
        let q = ty(dtype, &[batch, heads, s, 128]);
        let kv = ty(dtype, &[batch, kv_heads, s, 128]);
        let pos = ty(DType::I64, &[batch, s]);
        let op = Op::Attention(AttentionSpec {
            scale: 128f64.powf(-0.5),
            causal: true,
            window: None,
            padding: false,
            rope: rope.then_some((1e4, kiln_ir::RopeScaling::Default)),
            dropout: None,
        });
        let mut args = vec![arg(&q), arg(&kv), arg(&kv)];
        if rope {
            args.push(arg(&pos));
        }
        kernel_work(&op, &args, &q, &BTreeMap::new()).unwrap()
    }

    /// Seconds of causal attention over `s` tokens (16 heads, d 128, batch 4), and where it runs.
    fn attention(dtype: DType, s: usize, rope: bool) -> (f64, Runs) {
        let work = attention_work(dtype, [4, 16, 16, s], rope);
        (CostModel::default().seconds(&work), work.runs)
    }

    #[test]
    fn calibration_names_a_source_for_every_number() {
        let m = CostModel::default();
        assert!(m.launch_seconds > 0.0 && m.copy_bytes_per_second > 0.0);
        assert!(m.host_flops_per_second > 0.0);
        assert!(m.host_link_bytes_per_second > 0.0);
        for source in [
            &m.launch_source,
            &m.copy_source,
            &m.host_source,
            &m.host_link_source,
            &m.host_fallback_source,
        ] {
            assert!(!source.is_empty());
        }
        for r in &m.rates {
            assert!(!r.source.is_empty(), "{r:?}");
            assert!(r.flops_per_second.is_some() || r.bytes_per_second.is_some());
        }
        // The paths lowering picks for products and attention are all priced.
        for kind in [KernelKind::Gemm, KernelKind::Attention] {
            for path in [KernelPath::Wgmma, KernelPath::Mma, KernelPath::Simt] {
                assert!(m.rate(kind, path).is_some(), "{kind:?} on {path:?}");
            }
        }
    }

    /// Priced at the measured rate of the path the kernel generators pick: f32 products run on
    /// the SIMT GEMM (16.4 TFLOP/s), bf16 ones on the Hopper tensor-core kernel (696.2), so the
    /// same 4096^3 product is modelled about 42x slower in f32.
    #[test]
    fn products_are_priced_on_the_path_lowering_picks() {
        let flops = 2.0 * 4096f64.powi(3) + 4096.0 * 4096.0;
        let (f32_s, f32_runs) = product(DType::F32, 4096, 4096, 4096, false);
        assert_eq!(f32_runs, Runs::Gpu(KernelPath::Simt));
        assert!((f32_s - (flops / 16.4e12 + 3.2e-6)).abs() < 1e-9, "{f32_s}");
        let (bf16_s, bf16_runs) = product(DType::BF16, 4096, 4096, 4096, false);
        assert_eq!(bf16_runs, Runs::Gpu(KernelPath::Wgmma));
        assert!(
            (bf16_s - (flops / 696.2e12 + 3.2e-6)).abs() < 1e-9,
            "{bf16_s}"
        );
        // One row: the GEMV, bound by its weight bytes (2.45 TB/s).
        let (gemv_s, gemv_runs) = product(DType::BF16, 1, 4096, 4096, false);
        assert_eq!(gemv_runs, Runs::Gpu(KernelPath::Gemv));
        let bytes = 2.0 * (4096.0 * 4096.0 + 2.0 * 4096.0);
        assert!(
            (gemv_s - (bytes / 2.45e12 + 3.2e-6)).abs() < 1e-12,
            "{gemv_s}"
        );
        // SwiGLU is priced on whatever path the generator takes for it.
        let (swiglu_s, swiglu_runs) = product(DType::BF16, 4096, 8192, 4096, true);
        let Runs::Gpu(path) = swiglu_runs else {
            panic!("a product runs on the GPU")
        };
        let model = CostModel::default();
        let rate = model.rate(KernelKind::Gemm, path).unwrap();
        let swiglu_flops = 2.0 * 4096.0 * 4096.0 * 8192.0 + 4096.0 * 4096.0;
        let want = swiglu_flops / rate.flops_per_second.unwrap() + 3.2e-6;
        assert!((swiglu_s - want).abs() < 1e-9, "{swiglu_s} on {path:?}");
    }

    /// The near miss the model exists for: an attention whose fused form falls back to SIMT is
    /// priced at 3.58 TFLOP/s, over 40x the tensor-core forms, and the host (where an unfused
    /// form's softmax and products would run) is slower still.
    #[test]
    fn attention_fallbacks_and_host_ops_are_priced_honestly() {
        let (f32_s, f32_runs) = attention(DType::F32, 4096, false);
        assert_eq!(f32_runs, Runs::Gpu(KernelPath::Simt));
        let (bf16_s, bf16_runs) = attention(DType::BF16, 4096, false);
        assert_eq!(bf16_runs, Runs::Gpu(KernelPath::Wgmma));
        assert!(f32_s > 40.0 * bf16_s, "{f32_s} vs {bf16_s}");
        // With RoPE: the path the attention generators choose for it, priced at its rate.
        let (rope_s, rope_runs) = attention(DType::BF16, 4096, true);
        let model = CostModel::default();
        let rate = |runs: Runs| match runs {
            Runs::Gpu(path) => model
                .rate(KernelKind::Attention, path)
                .and_then(|r| r.flops_per_second)
                .expect("attention paths are priced"),
            Runs::Host => model.host_flops_per_second,
        };
        let expected = rate(bf16_runs) / rate(rope_runs);
        assert!((rope_s / bf16_s / expected - 1.0).abs() < 0.05, "{rope_s}");
        // An unfused product runs on the host.
        let (x, w) = (ty(DType::F32, &[4096, 4096]), ty(DType::F32, &[4096, 4096]));
        let work = kernel_work(&Op::MatMul, &[arg(&x), arg(&w)], &x, &BTreeMap::new()).unwrap();
        assert_eq!(work.runs, Runs::Host);
        let host = CostModel::default().seconds(&work);
        assert!(host > product(DType::F32, 4096, 4096, 4096, false).0);
    }

    /// An attention with RoPE runs on the Hopper kernel after q and k are rotated into buffers
    /// (`kiln_kernels::attention::prerotated`): the same FLOPs, and the rotated q and k written
    /// and read once more; in f32 (no Hopper kernel) no such bytes are added.
    #[test]
    fn rope_ahead_of_attention_costs_its_bytes() {
        let work = |dtype, rope| attention_work(dtype, [2, 32, 8, 1024], rope);
        let (plain, roped) = (work(DType::BF16, false), work(DType::BF16, true));
        assert_eq!(roped.runs, Runs::Gpu(KernelPath::Wgmma));
        assert_eq!(roped.flops, plain.flops);
        let (q, k, pos) = (
            2.0 * 32.0 * 1024.0 * 128.0 * 2.0,
            2.0 * 8.0 * 1024.0 * 128.0 * 2.0,
            2.0 * 1024.0 * 8.0,
        );
        assert_eq!(roped.bytes, plain.bytes + pos + 2.0 * (q + k));
        let (plain, roped) = (work(DType::F32, false), work(DType::F32, true));
        assert_ne!(roped.runs, Runs::Gpu(KernelPath::Wgmma));
        assert_eq!(roped.bytes, plain.bytes + 2.0 * 1024.0 * 8.0);
    }

    /// How a decode step's fragment differs from the one `decode_writes` matches.
    #[derive(Clone, Copy, Default)]
    struct Miss {
        /// The keys rotated with another base than q's.
        other_theta: bool,
        /// Neither q nor the keys rotated.
        no_rope: bool,
        /// The value write read by another node too.
        extra_reader: bool,
        /// The key write at other positions than the attention's.
        other_positions: bool,
    }

    /// A decode step's attention over two fresh cache writes (q `[1, 8, 1, 64]`, caches
    /// `[1, 2, 64, 64]`) in `dtype`, but for `miss`; returns the graph, the attention and its
    /// writes.
    fn decode_step(dtype: DType, miss: Miss) -> (Graph, NodeId, [NodeId; 2]) {
        let shape = |d: &[usize]| d.iter().map(|&x| Dim::from(x)).collect::<Vec<Dim>>();
        let mut g = Graph::new();
        let q = g.input("q", dtype, shape(&[1, 8, 1, 64])).unwrap();
        let k = g.input("k", dtype, shape(&[1, 2, 1, 64])).unwrap();
        let v = g.input("v", dtype, shape(&[1, 2, 1, 64])).unwrap();
        let pos = g.input("position_ids", DType::I64, shape(&[1, 1])).unwrap();
        let other = g
            .input("other_positions", DType::I64, shape(&[1, 1]))
            .unwrap();
        let mask = g
            .input("attention_mask", DType::I64, shape(&[1, 1]))
            .unwrap();
        let rope = |theta| Op::Rope {
            theta,
            scaling: kiln_ir::RopeScaling::Default,
        };
        let k_pos = if miss.other_positions { other } else { pos };
        let keys = if miss.no_rope {
            k
        } else {
            let theta = if miss.other_theta { 500000.0 } else { 10000.0 };
            g.add(rope(theta), &[k, k_pos]).unwrap()
        };
        let mut writes = [keys, v].into_iter().enumerate().map(|(i, new)| {
            let past = g
                .input(&format!("past_{i}"), dtype, shape(&[1, 2, 64, 64]))
                .unwrap();
            let at = if i == 0 { k_pos } else { pos };
            let w = g.add(Op::CacheWrite, &[past, new, at, mask]).unwrap();
            g.set_output(&format!("present_{i}"), w).unwrap();
            w
        });
        let writes = [writes.next().unwrap(), writes.next().unwrap()];
        let spec = kiln_ir::kernel::DecodeAttentionSpec {
            scale: 0.125,
            window: None,
            rope: (!miss.no_rope).then_some((10000.0, kiln_ir::RopeScaling::Default)),
        };
        let attention = g
            .add(Op::DecodeAttention(spec), &[q, writes[0], writes[1], pos])
            .unwrap();
        g.set_output("out", attention).unwrap();
        if miss.extra_reader {
            let read = g
                .add(Op::Unary(kiln_ir::UnaryOp::Neg), &[writes[1]])
                .unwrap();
            g.set_output("read", read).unwrap();
        }
        (g, attention, writes)
    }

    #[test]
    fn a_decode_attention_takes_in_its_fresh_cache_writes() {
        for no_rope in [false, true] {
            let miss = Miss {
                no_rope,
                ..Miss::default()
            };
            let (g, attention, writes) = decode_step(DType::BF16, miss);
            let found = decode_writes(&g, &consumers(&g));
            assert_eq!(
                found,
                [DecodeWrites { attention, writes }],
                "no_rope {no_rope}"
            );
            // Neither write is a kernel of its own; the attention moves their bytes.
            let work = graph_work(&g, &BTreeMap::new());
            assert!(work.iter().all(|(id, _)| !writes.contains(id)));
            let (apart, apart_attention, _) = decode_step(
                DType::BF16,
                Miss {
                    extra_reader: true,
                    no_rope,
                    ..Miss::default()
                },
            );
            assert!(
                work_of(&g, attention) > work_of(&apart, apart_attention),
                "no_rope {no_rope}"
            );
        }
    }

    /// The bytes `graph_work` gives node `id` of `g`.
    fn work_of(g: &Graph, id: NodeId) -> f64 {
        graph_work(g, &BTreeMap::new())
            .into_iter()
            .find(|(n, _)| *n == id)
            .map_or(0.0, |(_, w)| w.bytes)
    }

    #[test]
    fn near_misses_keep_their_cache_writes() {
        let misses = [
            (
                "keys rotated otherwise",
                Miss {
                    other_theta: true,
                    ..Miss::default()
                },
            ),
            (
                "value read elsewhere",
                Miss {
                    extra_reader: true,
                    ..Miss::default()
                },
            ),
            (
                "keys at other positions",
                Miss {
                    other_positions: true,
                    ..Miss::default()
                },
            ),
        ];
        for (what, miss) in misses {
            let (g, _, writes) = decode_step(DType::BF16, miss);
            assert!(decode_writes(&g, &consumers(&g)).is_empty(), "{what}");
            let work = graph_work(&g, &BTreeMap::new());
            assert!(
                writes.iter().all(|w| work.iter().any(|(id, _)| id == w)),
                "{what}"
            );
        }
        // Matched, but f32 runs on the SIMT attention, which does not write: the writes stay.
        let (g, _, writes) = decode_step(DType::F32, Miss::default());
        assert_eq!(decode_writes(&g, &consumers(&g)).len(), 1);
        let work = graph_work(&g, &BTreeMap::new());
        assert!(writes.iter().all(|w| work.iter().any(|(id, _)| id == w)));
    }
}
