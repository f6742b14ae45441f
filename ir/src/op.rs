//! The operations of the IR; their typing rules are in `crate::infer`.
//!
//! These are the *primitives* that importers emit. Each op documents its semantics; the reference
//! interpreter (`crate::interp`) is the executable definition. Typing is strict: elementwise binary
//! ops take operands of one shape and dtype (importers insert `Broadcast` and `Cast` explicitly), so
//! that every later pass sees data movement as an op.

use serde::{Deserialize, Serialize};

use crate::dim::{Dim, Shape};
use crate::dtype::{DType, TensorType};
use crate::graph::Graph;
use crate::infer;
use crate::kernel::{
    self, Activation, AttentionSpec, DecodeAttentionSpec, EmbeddingSpec, GemmSpec, NormSpec,
};
use crate::rope::RopeScaling;

/// Elementwise unary operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// Hyperbolic tangent.
    Tanh,
    /// The Gauss error function.
    Erf,
    /// `1 / sqrt(x)`
    Rsqrt,
}

/// Elementwise binary operations over operands of one shape and dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b` (truncating for integers)
    Div,
    /// `max(a, b)`
    Max,
}

/// Reductions over one axis; the reduced axis is kept with size 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Sum (accumulated in f64 by the interpreter).
    Sum,
    /// Maximum.
    Max,
    /// Arithmetic mean.
    Mean,
}

/// An IR operation. Operands are the node's `args`, in the order each variant documents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A run-time input named `name` (`input_ids`, `attention_mask`, `position_ids`, ...). No args.
    Input(String),
    /// A weight, named by its key in the checkpoint. No args.
    Weight(String),
    /// A scalar constant (shape `[]`) of the node's dtype. No args.
    Scalar(f64),
    /// Elementwise unary op on a float tensor (`Neg` also on integers). Args: `[x]`.
    Unary(UnaryOp),
    /// Elementwise binary op. Args: `[a, b]`, same shape and dtype.
    Binary(BinaryOp),
    /// `cond ? a : b` elementwise. Args: `[cond (bool), a, b]`, same shape; `a`, `b` same dtype.
    Where,
    /// Converts the element type, rounding to the target's precision. Args: `[x]`.
    Cast(DType),
    /// Reduction over `axis`, keeping it with size 1. Args: `[x]`.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// The reduced axis.
        axis: usize,
    },
    /// Batched matrix product `[.., M, K] x [.., K, N] -> [.., M, N]`; the right operand may also be
    /// a plain `[K, N]` matrix shared by every batch. Args: `[a, b]`.
    MatMul,
    /// Same elements in row-major order, new shape. Args: `[x]`.
    Reshape(Shape),
    /// Axis permutation: output axis `i` is input axis `perm[i]`. Args: `[x]`.
    Permute(Vec<usize>),
    /// NumPy-style broadcast to `shape` (right-aligned; input dims equal or 1). Args: `[x]`.
    Broadcast(Shape),
    /// The half-open range `start..end` of `axis`. Args: `[x]`.
    Slice {
        /// Sliced axis.
        axis: usize,
        /// First index kept.
        start: Dim,
        /// One past the last index kept.
        end: Dim,
    },
    /// Concatenation along `axis`. Args: one or more tensors of one rank and dtype.
    Concat(usize),
    /// Row gather (embedding lookup): `out[i.., j..] = table[ids[i..], j..]`. Args: `[table, ids]`.
    /// An id outside `0..table.shape[0]` is an error.
    Gather,
    /// Additive causal mask `[rows, cols]` of float type `dtype`: 0 where key `j` is visible to
    /// query `i`, i.e. `j <= i + (cols - rows)` and, with a window `w`, `i + (cols - rows) - j < w`;
    /// `mask_value(dtype)` elsewhere. No args.
    CausalMask {
        /// Query rows.
        rows: Dim,
        /// Key columns.
        cols: Dim,
        /// Sliding-window width (Mistral), if any.
        window: Option<i64>,
        /// The mask's float type.
        dtype: DType,
    },
    /// Additive padding mask: `[B, L]` integer/bool mask (1 = token, 0 = padding) to
    /// `[B, 1, 1, L]` of float type `.0`, holding 0 for tokens and `mask_value(.0)` for padding.
    /// Args: `[mask]`.
    PaddingMask(DType),
    /// Additive mask of a query chunk over a KV cache, `[B, 1, S, cols]` of float type `dtype`:
    /// key `j` is visible to the query at position `p = positions[b, s]` when `j <= p` and, with a
    /// window `w`, `p - j < w`; `mask_value(dtype)` elsewhere. Args: `[positions [B, S]]`.
    PositionMask {
        /// Key columns (the cache capacity).
        cols: Dim,
        /// Sliding-window width, if any.
        window: Option<i64>,
        /// The mask's float type.
        dtype: DType,
    },
    /// Writes a chunk of keys or values into a KV cache: `out = cache` except
    /// `out[b, :, positions[b, s], :] = new[b, :, s, :]` wherever `mask[b, s]` is 1. A position
    /// outside the cache is an error. Args: `[cache [B, KVH, T, D], new [B, KVH, S, D],
    /// positions [B, S], mask [B, S]]`.
    CacheWrite,
    /// Rotary position embedding, rotate-half form (as in Hugging Face Llama):
    /// `out = x * cos(p * f) + rotate_half(x) * sin(p * f)` with `rotate_half(x) = [-x2, x1]`, the
    /// frequency of column `c` being `inv_freq[c mod D/2]`. Args: `[x [B, H, L, D], positions [B, L]]`.
    Rope {
        /// Base of the frequencies (`rope_theta`).
        theta: f64,
        /// Frequency scaling (`rope_scaling` / `rope_parameters`).
        scaling: RopeScaling,
    },
    /// Dropout with the Philox-4x32-10 mask of `crate::philox` (DESIGN.md section 2): an element
    /// is kept with probability `1 - p` and scaled by `1 / (1 - p)`. Args: `[x, seed (i64 [])]`.
    Dropout {
        /// Drop probability in `[0, 1)`.
        p: f64,
        /// Per-dropout-op stream id, assigned in program order.
        stream: u32,
    },

    // ----- Kernel ops (`crate::kernel`): each means its decomposition into the primitives above.
    /// Softmax over the last axis. Args: `[x]`.
    Softmax,
    /// Softmax over the last axis, then dropout. Args: `[x, seed]`.
    SoftmaxDropout {
        /// Drop probability.
        p: f64,
        /// Dropout stream id.
        stream: u32,
    },
    /// An elementwise activation. Args: `[x]`.
    Activation(Activation),
    /// K/V heads repeated for their query groups, `[B, KVH, T, D] -> [B, KVH * groups, T, D]`
    /// (a broadcast view). Args: `[x]`.
    RepeatKv {
        /// Query heads per K/V head.
        groups: usize,
    },
    /// LayerNorm / RMSNorm, optionally of `x + residual`. See `NormSpec`.
    Norm(NormSpec),
    /// Matrix product with a fused epilogue. See `GemmSpec`.
    Gemm(GemmSpec),
    /// Fused attention. See `AttentionSpec`.
    Attention(AttentionSpec),
    /// Summed embedding lookups. See `EmbeddingSpec`.
    Embedding(EmbeddingSpec),
    /// Attention of a query chunk over a KV cache. See `DecodeAttentionSpec`.
    DecodeAttention(DecodeAttentionSpec),
}

/// The pattern matching every kernel op (the ops `crate::kernel::decompose` defines), so that the
/// list is written once.
#[macro_export]
macro_rules! kernel_ops {
    () => {
        $crate::Op::Softmax
            | $crate::Op::SoftmaxDropout { .. }
            | $crate::Op::Activation(_)
            | $crate::Op::RepeatKv { .. }
            | $crate::Op::Norm(_)
            | $crate::Op::Gemm(_)
            | $crate::Op::Attention(_)
            | $crate::Op::Embedding(_)
            | $crate::Op::DecodeAttention(_)
    };
}

/// The value that f32 / bf16 masks use for "not visible": finite, so that sums of masks stay
/// finite and a softmax over a fully masked row is uniform rather than NaN.
pub const MASK_NEG: f32 = -1.0e30;

/// The "not visible" value of a mask of float type `dtype`: `MASK_NEG`, or for f16 half of its
/// most negative finite value (so that a padding mask plus a causal mask stays finite).
pub fn mask_value(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -32752.0,
        _ => MASK_NEG,
    }
}

impl Op {
    /// The same op with every dim attribute mapped by `dim` (reshape and broadcast shapes, slice
    /// bounds, mask sizes) and every dtype attribute by `dtype` (casts and masks).
    pub fn map_attributes(&self, dim: impl Fn(&Dim) -> Dim, dtype: impl Fn(DType) -> DType) -> Op {
        let shape = |s: &Shape| s.iter().map(&dim).collect::<Shape>();
        match self {
            Op::Reshape(s) => Op::Reshape(shape(s)),
            Op::Broadcast(s) => Op::Broadcast(shape(s)),
            Op::Slice { axis, start, end } => Op::Slice {
                axis: *axis,
                start: dim(start),
                end: dim(end),
            },
            Op::Cast(to) => Op::Cast(dtype(*to)),
            Op::PaddingMask(d) => Op::PaddingMask(dtype(*d)),
            Op::CausalMask {
                rows,
                cols,
                window,
                dtype: d,
            } => Op::CausalMask {
                rows: dim(rows),
                cols: dim(cols),
                window: *window,
                dtype: dtype(*d),
            },
            Op::PositionMask {
                cols,
                window,
                dtype: d,
            } => Op::PositionMask {
                cols: dim(cols),
                window: *window,
                dtype: dtype(*d),
            },
            other => other.clone(),
        }
    }

    /// A short lowercase name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::Weight(_) => "weight",
            Op::Scalar(_) => "scalar",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Erf => "erf",
                UnaryOp::Rsqrt => "rsqrt",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Max => "max",
            },
            Op::Where => "where",
            Op::Cast(_) => "cast",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "reduce_sum",
                ReduceOp::Max => "reduce_max",
                ReduceOp::Mean => "reduce_mean",
            },
            Op::MatMul => "matmul",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Broadcast(_) => "broadcast",
            Op::Slice { .. } => "slice",
            Op::Concat(_) => "concat",
            Op::Gather => "gather",
            Op::CausalMask { .. } => "causal_mask",
            Op::PaddingMask(_) => "padding_mask",
            Op::Rope { .. } => "rope",
            Op::Dropout { .. } => "dropout",
            Op::Softmax => "softmax",
            Op::SoftmaxDropout { .. } => "softmax_dropout",
            Op::Activation(_) => "activation",
            Op::RepeatKv { .. } => "repeat_kv",
            Op::Norm(_) => "norm",
            Op::Gemm(_) => "gemm",
            Op::Attention(_) => "attention",
            Op::Embedding(_) => "embedding",
            Op::DecodeAttention(_) => "decode_attention",
            Op::PositionMask { .. } => "position_mask",
            Op::CacheWrite => "cache_write",
        }
    }

    /// True for the leaf ops whose type is declared rather than inferred.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input(_) | Op::Weight(_) | Op::Scalar(_))
    }

    /// True for the kernel ops, which are defined by `decompose`.
    pub fn is_kernel(&self) -> bool {
        matches!(self, kernel_ops!())
    }

    /// Appends the primitive decomposition of kernel op `self` applied to `args` to `g` and
    /// returns its result. This is the definition of every kernel op.
    ///
    /// # Panics
    /// If `self` is not a kernel op.
    pub fn decompose(
        &self,
        g: &mut Graph,
        args: &[crate::NodeId],
    ) -> Result<crate::NodeId, crate::IrError> {
        kernel::decompose(self, g, args)
    }

    /// Infers the output type from the operand types, or says why the operands are invalid.
    /// Leaf ops have declared types and are not inferred here.
    pub fn infer(&self, args: &[&TensorType]) -> Result<TensorType, String> {
        match self {
            Op::Input(_) | Op::Weight(_) | Op::Scalar(_) => {
                Err("leaf ops carry a declared type".into())
            }
            kernel_ops!() => infer::by_decomposition(self, args),
            Op::Unary(u) => infer::unary(*u, args),
            Op::Binary(_) => infer::binary(args),
            Op::Where => infer::select(args),
            Op::Cast(to) => infer::cast(*to, args),
            Op::Reduce { axis, op } => infer::reduce(*axis, *op, args),
            Op::MatMul => infer::matmul(args),
            Op::Reshape(shape) => infer::reshape(shape, args),
            Op::Permute(perm) => infer::permute(perm, args),
            Op::Broadcast(shape) => infer::broadcast(shape, args),
            Op::Slice { axis, start, end } => infer::slice(*axis, start, end, args),
            Op::Concat(axis) => infer::concat(*axis, args),
            Op::Gather => infer::gather(args),
            Op::CausalMask {
                rows,
                cols,
                window,
                dtype,
            } => infer::causal_mask(rows, cols, *window, *dtype, args),
            Op::PaddingMask(dtype) => infer::padding_mask(*dtype, args),
            Op::PositionMask {
                cols,
                window,
                dtype,
            } => infer::position_mask(cols, *window, *dtype, args),
            Op::CacheWrite => infer::cache_write(args),
            Op::Rope { theta, scaling } => infer::rope(*theta, scaling, args),
            Op::Dropout { p, .. } => infer::dropout(*p, args),
        }
    }
}
