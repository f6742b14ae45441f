//! The cost model: a kernel costs `max(FLOPs / peak, bytes / bandwidth) + launch`; views, graph
//! leaves and weight-only values (folded at compile time) cost nothing.

use std::collections::BTreeMap;

use kiln_ir::{Op, TensorType};
use serde::Serialize;

/// What kind of kernel an op becomes, as reports name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
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

/// Device ceilings the cost model divides by.
#[derive(Clone, Debug, Serialize)]
pub struct CostModel {
    /// Peak arithmetic throughput, FLOP/s.
    pub flops_per_second: f64,
    /// Memory bandwidth, bytes/s.
    pub bytes_per_second: f64,
    /// Cost of one kernel launch from a CUDA graph, seconds.
    pub launch_seconds: f64,
}

impl Default for CostModel {
    /// H200 figures from DESIGN.md section 8: bf16 GEMM 784 TFLOP/s (halved for the f32-accumulated
    /// mix the compiler plans for), copy 4.24 TB/s, 3.2 us per kernel replayed from a graph.
    fn default() -> CostModel {
        CostModel {
            flops_per_second: 392e12,
            bytes_per_second: 4.24e12,
            launch_seconds: 3.2e-6,
        }
    }
}

/// The work of one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KernelWork {
    /// Its kind.
    pub kind: KernelKind,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written.
    pub bytes: f64,
}

impl CostModel {
    /// Seconds for `work`.
    pub fn seconds(&self, work: &KernelWork) -> f64 {
        (work.flops / self.flops_per_second).max(work.bytes / self.bytes_per_second)
            + self.launch_seconds
    }
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

/// The kernel `op` becomes, with its FLOPs and bytes at `bindings`; `None` for leaves and views.
pub fn kernel_work(
    op: &Op,
    args: &[&TensorType],
    out: &TensorType,
    bindings: &BTreeMap<String, i64>,
) -> Option<KernelWork> {
    if op.is_leaf() || is_view(op) {
        return None;
    }
    let n = numel(out, bindings);
    if let Op::CacheWrite = op {
        // Written in place: the new entries are read and stored, the cache is not copied.
        return Some(KernelWork {
            kind: KernelKind::Other,
            flops: 0.0,
            bytes: 2.0 * bytes(args[1], bindings),
        });
    }
    let io: f64 = args.iter().map(|a| bytes(a, bindings)).sum::<f64>() + bytes(out, bindings);
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
        flops,
        bytes: io,
    })
}

/// The fusions a kernel op carries, named as the rules that make them.
pub fn fusions(op: &Op) -> Vec<&'static str> {
    let mut out = Vec::new();
    match op {
        Op::Attention(a) => {
            out.push("attention");
            out.push("softmax");
            if a.padding || a.causal {
                out.push("attention-masked");
            }
            if a.dropout.is_some() {
                out.push("softmax-dropout");
            }
            if a.rope.is_some() {
                out.push("rope-prologue");
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
                out.push("norm-residual");
            }
        }
        Op::Embedding(e) => {
            out.push("embedding");
            if e.tables > 1 {
                out.push("embedding-sum");
            }
        }
        Op::DecodeAttention(a) => {
            out.extend(["decode-attention", "softmax"]);
            if a.rope.is_some() {
                out.push("rope-prologue");
            }
        }
        Op::Softmax => out.push("softmax"),
        Op::SoftmaxDropout { .. } => out.extend(["softmax", "softmax-dropout"]),
        Op::Activation(_) => out.push("activation"),
        _ => {}
    }
    out
}
