//! The operations of the IR and their typing rules.
//!
//! These are the *primitives* that importers emit. Each op documents its semantics; the reference
//! interpreter (`crate::interp`) is the executable definition. Typing is strict: elementwise binary
//! ops take operands of one shape and dtype (importers insert `Broadcast` and `Cast` explicitly), so
//! that every later pass sees data movement as an op.

use serde::{Deserialize, Serialize};

use crate::dim::{numel, shape_to_string, Dim, Shape};
use crate::dtype::{DType, TensorType};
use crate::graph::Graph;
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
        let arity = |n: usize| -> Result<(), String> {
            if args.len() == n {
                Ok(())
            } else {
                Err(format!("expects {n} operand(s), got {}", args.len()))
            }
        };
        match self {
            Op::Input(_) | Op::Weight(_) | Op::Scalar(_) => {
                Err("leaf ops carry a declared type".into())
            }
            kernel_ops!() => {
                // The type of a kernel op is the type of its decomposition.
                let mut g = Graph::new();
                let mut ids = Vec::with_capacity(args.len());
                for (i, t) in args.iter().enumerate() {
                    ids.push(
                        g.input(&format!("arg{i}"), t.dtype, t.shape.clone())
                            .map_err(|e| e.to_string())?,
                    );
                }
                let out = self.decompose(&mut g, &ids).map_err(|e| match e {
                    crate::IrError::Type { op, message, .. } => format!("in {op}: {message}"),
                    other => other.to_string(),
                })?;
                Ok(g.ty(out).clone())
            }
            Op::Unary(u) => {
                arity(1)?;
                let x = args[0];
                let ok = x.dtype.is_float() || (*u == UnaryOp::Neg && x.dtype.is_int());
                if !ok {
                    return Err(format!("needs a float operand, got {x}"));
                }
                Ok(x.clone())
            }
            Op::Binary(_) => {
                arity(2)?;
                same_type(args[0], args[1])?;
                if args[0].dtype == DType::Bool {
                    return Err("arithmetic on bool tensors".into());
                }
                Ok(args[0].clone())
            }
            Op::Where => {
                arity(3)?;
                let (c, a, b) = (args[0], args[1], args[2]);
                if c.dtype != DType::Bool {
                    return Err(format!("condition must be bool, got {c}"));
                }
                same_type(a, b)?;
                if c.shape != a.shape {
                    return Err(format!("condition {c} and values {a} differ in shape"));
                }
                Ok(a.clone())
            }
            Op::Cast(to) => {
                arity(1)?;
                Ok(TensorType::new(*to, args[0].shape.clone()))
            }
            Op::Reduce { axis, op } => {
                arity(1)?;
                let x = args[0];
                check_axis(*axis, x.rank())?;
                if *op != ReduceOp::Max && !x.dtype.is_float() {
                    return Err(format!("sum/mean need a float operand, got {x}"));
                }
                let mut shape = x.shape.clone();
                shape[*axis] = Dim::constant(1);
                Ok(TensorType::new(x.dtype, shape))
            }
            Op::MatMul => {
                arity(2)?;
                let (a, b) = (args[0], args[1]);
                if a.dtype != b.dtype || !a.dtype.is_float() {
                    return Err(format!(
                        "operands must share a float dtype, got {a} and {b}"
                    ));
                }
                if a.rank() < 2 || b.rank() < 2 {
                    return Err(format!("operands must have rank >= 2, got {a} and {b}"));
                }
                let (m, k) = (&a.shape[a.rank() - 2], &a.shape[a.rank() - 1]);
                let (k2, n) = (&b.shape[b.rank() - 2], &b.shape[b.rank() - 1]);
                if k != k2 {
                    return Err(format!("contraction dims differ: {a} x {b}"));
                }
                if b.rank() != 2 && a.shape[..a.rank() - 2] != b.shape[..b.rank() - 2] {
                    return Err(format!("batch dims differ: {a} x {b}"));
                }
                let mut shape = a.shape[..a.rank() - 2].to_vec();
                shape.push(m.clone());
                shape.push(n.clone());
                Ok(TensorType::new(a.dtype, shape))
            }
            Op::Reshape(shape) => {
                arity(1)?;
                let x = args[0];
                if numel(&x.shape) != numel(shape) {
                    return Err(format!(
                        "cannot reshape {x} to {}: element counts differ",
                        shape_to_string(shape)
                    ));
                }
                Ok(TensorType::new(x.dtype, shape.clone()))
            }
            Op::Permute(perm) => {
                arity(1)?;
                let x = args[0];
                let mut seen = vec![false; x.rank()];
                if perm.len() != x.rank() {
                    return Err(format!("permutation {perm:?} does not fit {x}"));
                }
                for &p in perm {
                    if p >= x.rank() || seen[p] {
                        return Err(format!("{perm:?} is not a permutation of {x}'s axes"));
                    }
                    seen[p] = true;
                }
                let shape = perm.iter().map(|&p| x.shape[p].clone()).collect();
                Ok(TensorType::new(x.dtype, shape))
            }
            Op::Broadcast(shape) => {
                arity(1)?;
                let x = args[0];
                if x.rank() > shape.len() {
                    return Err(format!(
                        "cannot broadcast {x} to lower rank {}",
                        shape_to_string(shape)
                    ));
                }
                let offset = shape.len() - x.rank();
                for (i, d) in x.shape.iter().enumerate() {
                    if d != &shape[offset + i] && d.as_const() != Some(1) {
                        return Err(format!(
                            "cannot broadcast {x} to {}: axis {i} is {d}",
                            shape_to_string(shape)
                        ));
                    }
                }
                Ok(TensorType::new(x.dtype, shape.clone()))
            }
            Op::Slice { axis, start, end } => {
                arity(1)?;
                let x = args[0];
                check_axis(*axis, x.rank())?;
                let len = end.clone() - start.clone();
                if let (Some(s), Some(e)) = (start.as_const(), end.as_const()) {
                    if s < 0 || e < s {
                        return Err(format!("bad slice {start}..{end}"));
                    }
                }
                if let (Some(e), Some(n)) = (end.as_const(), x.shape[*axis].as_const()) {
                    if e > n {
                        return Err(format!("slice end {e} exceeds axis {axis} of {x}"));
                    }
                }
                let mut shape = x.shape.clone();
                shape[*axis] = len;
                Ok(TensorType::new(x.dtype, shape))
            }
            Op::Concat(axis) => {
                let first = args.first().ok_or("concat of zero tensors")?;
                check_axis(*axis, first.rank())?;
                let mut total = Dim::constant(0);
                for t in args {
                    let compatible = t.dtype == first.dtype
                        && t.rank() == first.rank()
                        && (0..t.rank()).all(|i| i == *axis || t.shape[i] == first.shape[i]);
                    if !compatible {
                        return Err(format!("cannot concat {t} with {first} on axis {axis}"));
                    }
                    total = total + t.shape[*axis].clone();
                }
                let mut shape = first.shape.clone();
                shape[*axis] = total;
                Ok(TensorType::new(first.dtype, shape))
            }
            Op::Gather => {
                arity(2)?;
                let (table, ids) = (args[0], args[1]);
                if !ids.dtype.is_int() {
                    return Err(format!("ids must be integers, got {ids}"));
                }
                if table.rank() < 1 {
                    return Err("table must have rank >= 1".into());
                }
                let mut shape = ids.shape.clone();
                shape.extend_from_slice(&table.shape[1..]);
                Ok(TensorType::new(table.dtype, shape))
            }
            Op::CausalMask {
                rows,
                cols,
                window,
                dtype,
            } => {
                arity(0)?;
                if window.is_some_and(|w| w < 1) {
                    return Err(format!("window must be >= 1, got {window:?}"));
                }
                if !dtype.is_float() {
                    return Err(format!("a mask must be a float type, got {dtype}"));
                }
                Ok(TensorType::new(*dtype, vec![rows.clone(), cols.clone()]))
            }
            Op::PaddingMask(dtype) => {
                arity(1)?;
                let m = args[0];
                if m.rank() != 2 || !(m.dtype.is_int() || m.dtype == DType::Bool) {
                    return Err(format!("mask must be an integer [B, L] tensor, got {m}"));
                }
                if !dtype.is_float() {
                    return Err(format!("a mask must be a float type, got {dtype}"));
                }
                let one = Dim::constant(1);
                Ok(TensorType::new(
                    *dtype,
                    vec![m.shape[0].clone(), one.clone(), one, m.shape[1].clone()],
                ))
            }
            Op::PositionMask {
                cols,
                window,
                dtype,
            } => {
                arity(1)?;
                let p = args[0];
                if p.rank() != 2 || !p.dtype.is_int() {
                    return Err(format!("positions must be integer [B, S], got {p}"));
                }
                if window.is_some_and(|w| w < 1) || !dtype.is_float() {
                    return Err(format!("bad window {window:?} or mask type {dtype}"));
                }
                Ok(TensorType::new(
                    *dtype,
                    vec![
                        p.shape[0].clone(),
                        Dim::constant(1),
                        p.shape[1].clone(),
                        cols.clone(),
                    ],
                ))
            }
            Op::CacheWrite => {
                arity(4)?;
                let (cache, new, pos, mask) = (args[0], args[1], args[2], args[3]);
                let fits = cache.rank() == 4
                    && new.rank() == 4
                    && cache.dtype == new.dtype
                    && cache.shape[0] == new.shape[0]
                    && cache.shape[1] == new.shape[1]
                    && cache.shape[3] == new.shape[3]
                    && pos.rank() == 2
                    && pos.dtype.is_int()
                    && pos.shape[0] == new.shape[0]
                    && pos.shape[1] == new.shape[2]
                    && mask.shape == pos.shape
                    && (mask.dtype.is_int() || mask.dtype == DType::Bool);
                if !fits {
                    return Err(format!(
                        "cannot write {new} at positions {pos} (mask {mask}) into cache {cache}"
                    ));
                }
                Ok(cache.clone())
            }
            Op::Rope { theta, scaling } => {
                arity(2)?;
                let (x, pos) = (args[0], args[1]);
                if !x.dtype.is_float() || x.rank() != 4 {
                    return Err(format!("x must be a float [B, H, L, D] tensor, got {x}"));
                }
                if !pos.dtype.is_int()
                    || pos.rank() != 2
                    || pos.shape[0] != x.shape[0]
                    || pos.shape[1] != x.shape[2]
                {
                    return Err(format!(
                        "positions must be integer [B, L] for {x}, got {pos}"
                    ));
                }
                if x.shape[3].as_const().is_none_or(|d| d % 2 != 0) {
                    return Err(format!("head dim of {x} must be a known even number"));
                }
                if theta.is_nan() || *theta <= 0.0 {
                    return Err(format!("theta must be positive, got {theta}"));
                }
                scaling.validate()?;
                Ok(x.clone())
            }
            Op::Dropout { p, .. } => {
                arity(2)?;
                let (x, seed) = (args[0], args[1]);
                if !x.dtype.is_float() {
                    return Err(format!("x must be float, got {x}"));
                }
                if seed.dtype != DType::I64 || seed.rank() != 0 {
                    return Err(format!("seed must be an i64 scalar, got {seed}"));
                }
                if !(0.0..1.0).contains(p) {
                    return Err(format!("p must be in [0, 1), got {p}"));
                }
                Ok(x.clone())
            }
        }
    }
}

fn same_type(a: &TensorType, b: &TensorType) -> Result<(), String> {
    if a == b {
        Ok(())
    } else {
        Err(format!("operands differ: {a} vs {b}"))
    }
}

fn check_axis(axis: usize, rank: usize) -> Result<(), String> {
    if axis < rank {
        Ok(())
    } else {
        Err(format!("axis {axis} out of range for rank {rank}"))
    }
}
