//! Kernel ops: what the compiler extracts, each defined by its decomposition into primitives.
//!
//! `decompose` IS the meaning of a kernel op: the interpreter evaluates a kernel node by building
//! its decomposition over the node's operands, and its type is the decomposition's type. The
//! importers build their primitive graphs with the same builders (`softmax`, `layer_norm`,
//! `repeat_kv`, ...), so a fusion rule is sound exactly when its left-hand side is the
//! decomposition of its right-hand side, which the compiler's tests check on random inputs.

use serde::{Deserialize, Serialize};

use crate::dim::Dim;
use crate::dtype::DType;
use crate::graph::{Graph, NodeId};
use crate::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::rope::RopeScaling;
use crate::IrError;

/// Elementwise activation functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Activation {
    /// `0.5 x (1 + erf(x / sqrt 2))`
    GeluErf,
    /// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`
    GeluTanh,
    /// `max(x, 0)`
    Relu,
    /// `x / (1 + exp(-x))`
    Silu,
}

/// Which normalisation a `Norm` kernel computes over the last axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NormKind {
    /// `(x - mean) * rsqrt(var + eps) * weight + bias`
    LayerNorm,
    /// `x * rsqrt(mean(x^2) + eps) * weight`
    RmsNorm,
}

/// A normalisation kernel. Operands: `[x, (residual), weight, (bias for LayerNorm)]`; with a
/// residual it normalises `x + residual`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NormSpec {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// The epsilon added to the variance.
    pub eps: f64,
    /// Whether a residual operand is added first.
    pub residual: bool,
}

/// A matrix product with its fused epilogue, applied in this order: bias, activation or SwiGLU,
/// residual. Operands: `[x [.., M, K], w, (bias [N]), (residual [.., M, N'])]` where `w` is
/// `[K, N]`, or `[N, K]` with `transpose_b`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmSpec {
    /// The weight operand is stored `[N, K]` (a Hugging Face `Linear`).
    pub transpose_b: bool,
    /// A bias operand is added.
    pub bias: bool,
    /// An activation applied to the product.
    pub activation: Option<Activation>,
    /// SwiGLU: the product's columns are `[gate | up]`; the result is `silu(gate) * up` (N / 2
    /// columns).
    pub swiglu: bool,
    /// A residual operand is added last.
    pub residual: bool,
    /// A normalisation of `x` computed in the prologue (Mirage-style: the row statistics are
    /// gathered while the rows stream through, and the scale is applied after the product). Its
    /// weight (and LayerNorm bias) are the last operands.
    pub prologue: Option<NormSpec>,
}

impl GemmSpec {
    /// A plain product.
    pub fn plain(transpose_b: bool) -> GemmSpec {
        GemmSpec {
            transpose_b,
            bias: false,
            activation: None,
            swiglu: false,
            residual: false,
            prologue: None,
        }
    }
}

/// Fused attention `softmax(q k^T * scale + masks) v` per head, with K/V heads shared by groups
/// of query heads (GQA / MQA). Operands: `[q [B, H, S, D], k [B, KVH, T, D], v [B, KVH, T, D],
/// (attention_mask [B, T]) if padding, (positions [B, S]) if rope, (seed) if dropout]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    /// Multiplies the scores.
    pub scale: f64,
    /// Causal mask (query `i` sees keys `j <= i + T - S`).
    pub causal: bool,
    /// Sliding window of the causal mask.
    pub window: Option<i64>,
    /// A padding mask operand (1 = key present).
    pub padding: bool,
    /// Rotary embedding applied to q and k first (theta, scaling), with a positions operand.
    pub rope: Option<(f64, RopeScaling)>,
    /// Dropout on the probabilities (p, stream), with a seed operand.
    pub dropout: Option<(f64, u32)>,
}

/// Attention of a query chunk over a KV cache (decode when the chunk is one token): per row, the
/// query at position `p` sees cache entries `0..=p` (within the window). Operands: `[q [B, H, S, D],
/// k_cache [B, KVH, T, D], v_cache [B, KVH, T, D], positions [B, S]]`; with `rope`, q is rotated at
/// its positions first (the cache holds rotated keys).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeAttentionSpec {
    /// Multiplies the scores.
    pub scale: f64,
    /// Sliding window, if any.
    pub window: Option<i64>,
    /// Rotary embedding of q (theta, scaling).
    pub rope: Option<(f64, RopeScaling)>,
}

/// Embedding lookup: the sum of `tables` gathers. Operands: `[table_0, ids_0, table_1, ids_1, ..]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingSpec {
    /// How many (table, ids) pairs are summed.
    pub tables: usize,
}

/// The kernel ops, as `Op` variants, decompose through this function.
pub(crate) fn decompose(op: &Op, g: &mut Graph, args: &[NodeId]) -> Result<NodeId, IrError> {
    let want = |g: &Graph, n: usize| operands(g, op.name(), args, n);
    match op {
        Op::Softmax => {
            want(g, 1)?;
            softmax(g, args[0])
        }
        Op::SoftmaxDropout { p, stream } => {
            want(g, 2)?;
            let s = softmax(g, args[0])?;
            g.add(
                Op::Dropout {
                    p: *p,
                    stream: *stream,
                },
                &[s, args[1]],
            )
        }
        Op::Activation(a) => {
            want(g, 1)?;
            activation(g, args[0], *a)
        }
        Op::RepeatKv { groups } => {
            want(g, 1)?;
            repeat_kv(g, args[0], *groups)
        }
        Op::Norm(spec) => {
            let with_bias = spec.kind == NormKind::LayerNorm;
            want(g, 2 + usize::from(spec.residual) + usize::from(with_bias))?;
            norm(g, spec, args)
        }
        Op::Gemm(spec) => gemm(g, spec, args),
        Op::Attention(spec) => {
            let n = 3
                + usize::from(spec.padding)
                + usize::from(spec.rope.is_some())
                + usize::from(spec.dropout.is_some());
            want(g, n)?;
            attention(g, spec, args)
        }
        Op::Embedding(spec) => {
            want(g, 2 * spec.tables)?;
            embedding(g, args)
        }
        Op::DecodeAttention(spec) => {
            want(g, 4)?;
            decode_attention(g, spec, args)
        }
        other => unreachable!("{} is not a kernel op", other.name()),
    }
}

/// `Err` naming kernel op `op` unless it has `n` operands.
fn operands(g: &Graph, op: &'static str, args: &[NodeId], n: usize) -> Result<(), IrError> {
    if args.len() == n {
        return Ok(());
    }
    Err(IrError::Type {
        node: NodeId(g.len() as u32),
        op,
        message: format!("expects {n} operand(s), got {}", args.len()),
    })
}

/// A norm kernel: `[x, (residual,) weight, (bias)]`, the residual added first.
fn norm(g: &mut Graph, spec: &NormSpec, args: &[NodeId]) -> Result<NodeId, IrError> {
    let mut i = 0;
    let mut x = args[0];
    if spec.residual {
        i += 1;
        x = g.add_(x, args[i])?;
    }
    let w = args[i + 1];
    match spec.kind {
        NormKind::LayerNorm => layer_norm(g, x, w, args[i + 2], spec.eps),
        NormKind::RmsNorm => rms_norm(g, x, w, spec.eps),
    }
}

/// A GEMM kernel: `[x, w, (bias,) (residual,) (norm weight, (norm bias))]`: the prologue's
/// norm of `x`, the product, then bias, activation, SwiGLU and residual in that order.
fn gemm(g: &mut Graph, spec: &GemmSpec, args: &[NodeId]) -> Result<NodeId, IrError> {
    let norm_args = match &spec.prologue {
        None => 0,
        Some(n) if n.residual => {
            return Err(IrError::Type {
                node: NodeId(g.len() as u32),
                op: "gemm",
                message: "a norm prologue cannot add a residual".into(),
            })
        }
        Some(n) => 1 + usize::from(n.kind == NormKind::LayerNorm),
    };
    let epilogue_args = usize::from(spec.bias) + usize::from(spec.residual);
    operands(g, "gemm", args, 2 + epilogue_args + norm_args)?;
    let mut x = args[0];
    if let Some(n) = &spec.prologue {
        let p = &args[2 + epilogue_args..];
        x = match n.kind {
            NormKind::LayerNorm => layer_norm(g, x, p[0], p[1], n.eps)?,
            NormKind::RmsNorm => rms_norm(g, x, p[0], n.eps)?,
        };
    }
    let w = if spec.transpose_b {
        g.transpose_last(args[1])?
    } else {
        args[1]
    };
    let mut y = g.matmul(x, w)?;
    let mut i = 2;
    if spec.bias {
        y = g.add_(y, args[i])?;
        i += 1;
    }
    if let Some(a) = spec.activation {
        y = activation(g, y, a)?;
    }
    if spec.swiglu {
        y = swiglu(g, y)?;
    }
    if spec.residual {
        y = g.add_(y, args[i])?;
    }
    Ok(y)
}

/// An embedding kernel: the sum of its `(table, ids)` pairs' gathers.
fn embedding(g: &mut Graph, args: &[NodeId]) -> Result<NodeId, IrError> {
    let mut sum: Option<NodeId> = None;
    for pair in args.chunks(2) {
        let e = g.add(Op::Gather, pair)?;
        sum = Some(match sum {
            None => e,
            Some(s) => g.add_(s, e)?,
        });
    }
    sum.ok_or_else(|| IrError::Type {
        node: NodeId(g.len() as u32),
        op: "embedding",
        message: "needs at least one table".into(),
    })
}

/// A decode attention kernel: `[q, k, v, positions]`, q rotated first where the spec says, K
/// and V repeated over the query groups, keys past each row's position (or outside its
/// window) masked.
fn decode_attention(
    g: &mut Graph,
    spec: &DecodeAttentionSpec,
    args: &[NodeId],
) -> Result<NodeId, IrError> {
    let (mut q, k, v, pos) = (args[0], args[1], args[2], args[3]);
    let groups = kv_groups(g, q, k)?;
    if let Some((theta, scaling)) = &spec.rope {
        let rope = Op::Rope {
            theta: *theta,
            scaling: scaling.clone(),
        };
        q = g.add(rope, &[q, pos])?;
    }
    let k = repeat_kv(g, k, groups)?;
    let v = repeat_kv(g, v, groups)?;
    let cols = g.ty(k).shape[2].clone();
    let mask = position_mask(g, pos, cols, spec.window, g.ty(q).dtype)?;
    sdpa(g, q, k, v, Some(mask), spec.scale, None)
}

/// Softmax over the last axis, max-subtracted: `exp(x - max) / sum(exp(x - max))`.
pub fn softmax(g: &mut Graph, x: NodeId) -> Result<NodeId, IrError> {
    let m = g.reduce(ReduceOp::Max, x, -1)?;
    let shifted = g.sub(x, m)?;
    let e = g.unary(UnaryOp::Exp, shifted)?;
    let s = g.reduce(ReduceOp::Sum, e, -1)?;
    g.div(e, s)
}

/// The activation `a` as primitives.
pub fn activation(g: &mut Graph, x: NodeId, a: Activation) -> Result<NodeId, IrError> {
    Ok(match a {
        Activation::GeluErf => {
            let scaled = g.mul_const(x, std::f64::consts::FRAC_1_SQRT_2)?;
            let erf = g.unary(UnaryOp::Erf, scaled)?;
            let one_plus = g.add_const(erf, 1.0)?;
            let half_x = g.mul_const(x, 0.5)?;
            g.mul(half_x, one_plus)?
        }
        Activation::GeluTanh => {
            let x2 = g.mul(x, x)?;
            let x3 = g.mul(x2, x)?;
            let cubic = g.mul_const(x3, GELU_CUBIC)?;
            let inner = g.add_(x, cubic)?;
            let scaled = g.mul_const(inner, (2.0 / std::f64::consts::PI).sqrt())?;
            let t = g.unary(UnaryOp::Tanh, scaled)?;
            let one_plus = g.add_const(t, 1.0)?;
            let half_x = g.mul_const(x, 0.5)?;
            g.mul(half_x, one_plus)?
        }
        Activation::Relu => {
            let zero = g.scalar(0.0, g.ty(x).dtype);
            g.binary(BinaryOp::Max, x, zero)?
        }
        Activation::Silu => {
            let neg = g.unary(UnaryOp::Neg, x)?;
            let e = g.unary(UnaryOp::Exp, neg)?;
            let denom = g.add_const(e, 1.0)?;
            g.div(x, denom)?
        }
    })
}

/// The cubic coefficient of the tanh GELU.
pub const GELU_CUBIC: f64 = 0.044715;

/// `silu(y[.., :N/2]) * y[.., N/2:]`.
pub fn swiglu(g: &mut Graph, y: NodeId) -> Result<NodeId, IrError> {
    let n = g.ty(y).shape.last().and_then(Dim::as_const).unwrap_or(1);
    if n % 2 != 0 {
        return Err(IrError::Type {
            node: y,
            op: "swiglu",
            message: format!("needs an even, known column count, got {}", g.ty(y)),
        });
    }
    let gate = g.slice(y, -1, Dim::constant(0), Dim::constant(n / 2))?;
    let up = g.slice(y, -1, Dim::constant(n / 2), Dim::constant(n))?;
    let act = activation(g, gate, Activation::Silu)?;
    g.mul(act, up)
}

/// LayerNorm over the last axis.
pub fn layer_norm(
    g: &mut Graph,
    x: NodeId,
    weight: NodeId,
    bias: NodeId,
    eps: f64,
) -> Result<NodeId, IrError> {
    let mean = g.reduce(ReduceOp::Mean, x, -1)?;
    let centered = g.sub(x, mean)?;
    let sq = g.mul(centered, centered)?;
    let var = g.reduce(ReduceOp::Mean, sq, -1)?;
    let var_eps = g.add_const(var, eps)?;
    let inv = g.unary(UnaryOp::Rsqrt, var_eps)?;
    let normed = g.mul(centered, inv)?;
    let scaled = g.mul(normed, weight)?;
    g.add_(scaled, bias)
}

/// RMSNorm over the last axis.
pub fn rms_norm(g: &mut Graph, x: NodeId, weight: NodeId, eps: f64) -> Result<NodeId, IrError> {
    let sq = g.mul(x, x)?;
    let ms = g.reduce(ReduceOp::Mean, sq, -1)?;
    let ms_eps = g.add_const(ms, eps)?;
    let inv = g.unary(UnaryOp::Rsqrt, ms_eps)?;
    let normed = g.mul(x, inv)?;
    g.mul(normed, weight)
}

/// Repeats each K/V head for its group of query heads: `[B, KVH, T, D] -> [B, KVH * groups, T, D]`
/// as reshape + broadcast + reshape.
pub fn repeat_kv(g: &mut Graph, x: NodeId, groups: usize) -> Result<NodeId, IrError> {
    if groups == 1 {
        return Ok(x);
    }
    let s = g.ty(x).shape.clone();
    if s.len() != 4 {
        return Err(IrError::Type {
            node: x,
            op: "repeat_kv",
            message: format!("needs [B, KVH, T, D], got {}", g.ty(x)),
        });
    }
    let (b, kvh, t, d) = (s[0].clone(), s[1].clone(), s[2].clone(), s[3].clone());
    let one = Dim::constant(1);
    let gr = Dim::from(groups);
    let r = g.reshape(x, vec![b.clone(), kvh.clone(), one, t.clone(), d.clone()])?;
    let bc = g.broadcast_to(
        r,
        &[b.clone(), kvh.clone(), gr.clone(), t.clone(), d.clone()],
    )?;
    g.reshape(bc, vec![b, kvh * gr, t, d])
}

/// The additive attention mask of float type `dtype`: padding (from an integer `[B, T]` mask) plus
/// causal, as importers build it.
pub fn attention_mask(
    g: &mut Graph,
    dtype: DType,
    padding: Option<NodeId>,
    causal: Option<(Dim, Dim, Option<i64>)>,
) -> Result<Option<NodeId>, IrError> {
    let pad = padding
        .map(|m| g.add(Op::PaddingMask(dtype), &[m]))
        .transpose()?;
    let causal = causal
        .map(|(rows, cols, window)| {
            g.add(
                Op::CausalMask {
                    rows,
                    cols,
                    window,
                    dtype,
                },
                &[],
            )
        })
        .transpose()?;
    Ok(match (pad, causal) {
        (Some(p), Some(c)) => Some(g.add_(p, c)?),
        (Some(m), None) | (None, Some(m)) => Some(m),
        (None, None) => None,
    })
}

/// Scaled dot-product attention over `[B, H, S, D]` q and `[B, H, T, D]` k, v with an optional
/// additive mask broadcastable to `[B, H, S, T]`, and optional dropout on the probabilities.
///
/// A query whose keys are all masked gets zeros, as the kernels store for a query that sees no
/// key: the output is multiplied by [`visible`], 1 where a row of the mask has a visible key and
/// 0 where it has none (the softmax alone would give such a row the mean of the values).
pub fn sdpa(
    g: &mut Graph,
    q: NodeId,
    k: NodeId,
    v: NodeId,
    mask: Option<NodeId>,
    scale: f64,
    dropout: Option<(f64, u32, NodeId)>,
) -> Result<NodeId, IrError> {
    let kt = g.transpose_last(k)?;
    let scores = g.matmul(q, kt)?;
    let mut x = g.mul_const(scores, scale)?;
    if let Some(m) = mask {
        x = g.add_(x, m)?;
    }
    let probs = match dropout {
        None => softmax(g, x)?,
        Some((p, stream, seed)) => {
            let s = softmax(g, x)?;
            g.add(Op::Dropout { p, stream }, &[s, seed])?
        }
    };
    let out = g.matmul(probs, v)?;
    match mask {
        Some(m) => {
            let seen = visible(g, m)?;
            g.mul(out, seen)
        }
        None => Ok(out),
    }
}

/// Per row of an additive mask (keys on the last axis), whether any key is visible:
/// `exp(max(mask))`, exactly 1 when a key's entry is 0 and exactly 0 when every entry is a
/// (finite, negative) mask value, whose `exp` underflows.
pub fn visible(g: &mut Graph, mask: NodeId) -> Result<NodeId, IrError> {
    let top = g.reduce(ReduceOp::Max, mask, -1)?;
    g.unary(UnaryOp::Exp, top)
}

/// The additive mask of a query chunk at `positions` over a cache of `cols` entries.
pub fn position_mask(
    g: &mut Graph,
    positions: NodeId,
    cols: Dim,
    window: Option<i64>,
    dtype: DType,
) -> Result<NodeId, IrError> {
    g.add(
        Op::PositionMask {
            cols,
            window,
            dtype,
        },
        &[positions],
    )
}

/// Query heads per K/V head of `[B, H, S, D]` q and `[B, KVH, T, D]` k.
fn kv_groups(g: &Graph, q: NodeId, k: NodeId) -> Result<usize, IrError> {
    let (qs, ks) = (&g.ty(q).shape, &g.ty(k).shape);
    if qs.len() != 4 || ks.len() != 4 {
        return Err(IrError::Type {
            node: q,
            op: "attention",
            message: format!(
                "q and k must be [B, H, S, D], got {} and {}",
                g.ty(q),
                g.ty(k)
            ),
        });
    }
    match (qs[1].as_const(), ks[1].as_const()) {
        (Some(h), Some(kvh)) if kvh > 0 && h % kvh == 0 => Ok((h / kvh) as usize),
        _ => Err(IrError::Type {
            node: k,
            op: "attention",
            message: format!(
                "K/V heads of {} must divide the heads of {}",
                g.ty(k),
                g.ty(q)
            ),
        }),
    }
}

fn attention(g: &mut Graph, spec: &AttentionSpec, args: &[NodeId]) -> Result<NodeId, IrError> {
    let (mut q, mut k, mut v) = (args[0], args[1], args[2]);
    let mut rest = args[3..].iter().copied();
    let mask = if spec.padding { rest.next() } else { None };
    let positions = if spec.rope.is_some() {
        rest.next()
    } else {
        None
    };
    let seed = if spec.dropout.is_some() {
        rest.next()
    } else {
        None
    };
    let groups = kv_groups(g, q, k)?;
    let (qs, ks) = (g.ty(q).shape.clone(), g.ty(k).shape.clone());
    if let (Some((theta, scaling)), Some(pos)) = (&spec.rope, positions) {
        let rope = Op::Rope {
            theta: *theta,
            scaling: scaling.clone(),
        };
        q = g.add(rope.clone(), &[q, pos])?;
        k = g.add(rope, &[k, pos])?;
    }
    k = repeat_kv(g, k, groups)?;
    v = repeat_kv(g, v, groups)?;
    let causal = spec
        .causal
        .then(|| (qs[2].clone(), ks[2].clone(), spec.window));
    let mask = attention_mask(g, g.ty(q).dtype, mask, causal)?;
    let dropout = match (spec.dropout, seed) {
        (Some((p, stream)), Some(s)) => Some((p, stream, s)),
        _ => None,
    };
    sdpa(g, q, k, v, mask, spec.scale, dropout)
}
