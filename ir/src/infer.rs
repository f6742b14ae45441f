//! The typing rules of the primitive ops, one function an op: what [`Op::infer`] checks of the
//! operand types and the result type it gives. Kernel ops are typed by their decomposition.

use crate::dim::{numel, shape_to_string, Dim};
use crate::dtype::{DType, TensorType};
use crate::graph::Graph;
use crate::op::{Op, ReduceOp, UnaryOp};
use crate::rope::RopeScaling;

/// `Err` unless there are `n` operands.
fn arity(args: &[&TensorType], n: usize) -> Result<(), String> {
    if args.len() == n {
        Ok(())
    } else {
        Err(format!("expects {n} operand(s), got {}", args.len()))
    }
}

/// A kernel op: the type of its decomposition ([`Op::decompose`]) over inputs of `args`' types.
pub(crate) fn by_decomposition(op: &Op, args: &[&TensorType]) -> Result<TensorType, String> {
    let mut g = Graph::new();
    let mut ids = Vec::with_capacity(args.len());
    for (i, t) in args.iter().enumerate() {
        ids.push(
            g.input(&format!("arg{i}"), t.dtype, t.shape.clone())
                .map_err(|e| e.to_string())?,
        );
    }
    let out = op.decompose(&mut g, &ids).map_err(|e| match e {
        crate::IrError::Type { op, message, .. } => format!("in {op}: {message}"),
        other => other.to_string(),
    })?;
    Ok(g.ty(out).clone())
}

/// `Unary`: a float operand (or an integer one for `Neg`), the result of its type.
pub(crate) fn unary(u: UnaryOp, args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
    let x = args[0];
    let ok = x.dtype.is_float() || (u == UnaryOp::Neg && x.dtype.is_int());
    if !ok {
        return Err(format!("needs a float operand, got {x}"));
    }
    Ok(x.clone())
}

/// `Binary`: two operands of one type (not bool), the result of that type.
pub(crate) fn binary(args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 2)?;
    same_type(args[0], args[1])?;
    if args[0].dtype == DType::Bool {
        return Err("arithmetic on bool tensors".into());
    }
    Ok(args[0].clone())
}

/// `Where`: a bool condition of the values' shape, two values of one type.
pub(crate) fn select(args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 3)?;
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

/// `Cast`: any operand, the result of its shape in `to`.
pub(crate) fn cast(to: DType, args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
    Ok(TensorType::new(to, args[0].shape.clone()))
}

/// `Reduce`: `axis` kept with size 1; sum and mean need a float operand.
pub(crate) fn reduce(
    axis: usize,
    op: ReduceOp,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    arity(args, 1)?;
    let x = args[0];
    check_axis(axis, x.rank())?;
    if op != ReduceOp::Max && !x.dtype.is_float() {
        return Err(format!("sum/mean need a float operand, got {x}"));
    }
    let mut shape = x.shape.clone();
    shape[axis] = Dim::constant(1);
    Ok(TensorType::new(x.dtype, shape))
}

/// `MatMul`: `[.., M, K] x [.., K, N]` of one float type, the batch dims equal (or `b` a matrix).
pub(crate) fn matmul(args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 2)?;
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

/// `Reshape`: the same element count in `shape`.
pub(crate) fn reshape(shape: &[Dim], args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
    let x = args[0];
    if numel(&x.shape) != numel(shape) {
        return Err(format!(
            "cannot reshape {x} to {}: element counts differ",
            shape_to_string(shape)
        ));
    }
    Ok(TensorType::new(x.dtype, shape.to_vec()))
}

/// `Permute`: `perm` a permutation of the operand's axes.
pub(crate) fn permute(perm: &[usize], args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
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

/// `Broadcast`: the operand's axes, aligned to the right, each equal to `shape`'s or 1.
pub(crate) fn broadcast(shape: &[Dim], args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
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
    Ok(TensorType::new(x.dtype, shape.to_vec()))
}

/// `Slice`: `start..end` of `axis`, within it where both are known.
pub(crate) fn slice(
    axis: usize,
    start: &Dim,
    end: &Dim,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    arity(args, 1)?;
    let x = args[0];
    check_axis(axis, x.rank())?;
    let len = end.clone() - start.clone();
    if let (Some(s), Some(e)) = (start.as_const(), end.as_const()) {
        if s < 0 || e < s {
            return Err(format!("bad slice {start}..{end}"));
        }
    }
    if let (Some(e), Some(n)) = (end.as_const(), x.shape[axis].as_const()) {
        if e > n {
            return Err(format!("slice end {e} exceeds axis {axis} of {x}"));
        }
    }
    let mut shape = x.shape.clone();
    shape[axis] = len;
    Ok(TensorType::new(x.dtype, shape))
}

/// `Concat`: one or more operands of one type and rank, equal but on `axis`.
pub(crate) fn concat(axis: usize, args: &[&TensorType]) -> Result<TensorType, String> {
    let first = args.first().ok_or("concat of zero tensors")?;
    check_axis(axis, first.rank())?;
    let mut total = Dim::constant(0);
    for t in args {
        let compatible = t.dtype == first.dtype
            && t.rank() == first.rank()
            && (0..t.rank()).all(|i| i == axis || t.shape[i] == first.shape[i]);
        if !compatible {
            return Err(format!("cannot concat {t} with {first} on axis {axis}"));
        }
        total = total + t.shape[axis].clone();
    }
    let mut shape = first.shape.clone();
    shape[axis] = total;
    Ok(TensorType::new(first.dtype, shape))
}

/// `Gather`: rows of `table` by integer `ids`, the result `ids`' shape then the row's.
pub(crate) fn gather(args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 2)?;
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

/// `CausalMask`: no operand, a float `[rows, cols]` mask, a window of at least 1.
pub(crate) fn causal_mask(
    rows: &Dim,
    cols: &Dim,
    window: Option<i64>,
    dtype: DType,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    arity(args, 0)?;
    if window.is_some_and(|w| w < 1) {
        return Err(format!("window must be >= 1, got {window:?}"));
    }
    float_mask(dtype)?;
    Ok(TensorType::new(dtype, vec![rows.clone(), cols.clone()]))
}

/// `Err` unless a mask's `dtype` is a float type.
fn float_mask(dtype: DType) -> Result<(), String> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(format!("a mask must be a float type, got {dtype}"))
    }
}

/// `PaddingMask`: an integer or bool `[B, L]` mask, the result a float `[B, 1, 1, L]`.
pub(crate) fn padding_mask(dtype: DType, args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 1)?;
    let m = args[0];
    if m.rank() != 2 || !(m.dtype.is_int() || m.dtype == DType::Bool) {
        return Err(format!("mask must be an integer [B, L] tensor, got {m}"));
    }
    float_mask(dtype)?;
    let one = Dim::constant(1);
    Ok(TensorType::new(
        dtype,
        vec![m.shape[0].clone(), one.clone(), one, m.shape[1].clone()],
    ))
}

/// `PositionMask`: integer `[B, S]` positions, the result a float `[B, 1, S, cols]`.
pub(crate) fn position_mask(
    cols: &Dim,
    window: Option<i64>,
    dtype: DType,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    arity(args, 1)?;
    let p = args[0];
    if p.rank() != 2 || !p.dtype.is_int() {
        return Err(format!("positions must be integer [B, S], got {p}"));
    }
    if window.is_some_and(|w| w < 1) || !dtype.is_float() {
        return Err(format!("bad window {window:?} or mask type {dtype}"));
    }
    Ok(TensorType::new(
        dtype,
        vec![
            p.shape[0].clone(),
            Dim::constant(1),
            p.shape[1].clone(),
            cols.clone(),
        ],
    ))
}

/// `CacheWrite`: `[B, H, L, D]` rows into a `[B, H, C, D]` cache at integer `[B, L]` positions
/// under a mask of their shape; the result is the cache's type.
pub(crate) fn cache_write(args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 4)?;
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

/// `Rope`: a float `[B, H, L, D]` operand of a known even `D`, integer `[B, L]` positions, a
/// positive `theta` and valid scaling; the result of the operand's type.
pub(crate) fn rope(
    theta: f64,
    scaling: &RopeScaling,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    arity(args, 2)?;
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
    if theta.is_nan() || theta <= 0.0 {
        return Err(format!("theta must be positive, got {theta}"));
    }
    scaling.validate()?;
    Ok(x.clone())
}

/// `Dropout`: a float operand, an i64 scalar seed, `p` in `[0, 1)`.
pub(crate) fn dropout(p: f64, args: &[&TensorType]) -> Result<TensorType, String> {
    arity(args, 2)?;
    let (x, seed) = (args[0], args[1]);
    if !x.dtype.is_float() {
        return Err(format!("x must be float, got {x}"));
    }
    if seed.dtype != DType::I64 || seed.rank() != 0 {
        return Err(format!("seed must be an i64 scalar, got {seed}"));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(format!("p must be in [0, 1), got {p}"));
    }
    Ok(x.clone())
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
