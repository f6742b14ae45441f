//! The reference interpreter: the executable meaning of every op.
//!
//! Storage is f32 (values rounded to the node's dtype after each op); reductions and matrix
//! products accumulate in f64; transcendental functions are evaluated in f64. The interpreter is
//! the oracle every backend is tested against: it favours obvious correctness over speed, and only
//! parallelises the matrix product (over output rows, which does not change any result).

use std::collections::BTreeMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::dim::{shape_to_string, Dim};
use crate::dtype::{DType, TensorType};
use crate::graph::{Graph, Node, NodeId};
use crate::op::{mask_value, BinaryOp, Op, ReduceOp, UnaryOp};
use crate::philox::{dropout_keep, dropout_scale, dropout_threshold, seed_key};
use crate::tensor::{copy_view, round_to_dtype, strides, Data, Tensor};
use crate::{kernel_ops, InterpError};

/// Where the interpreter gets weights: by checkpoint key, in the declared type.
pub trait WeightSource {
    /// The weight `name` as a tensor of type `ty` (concrete shape), or a message saying why not.
    fn load(&self, name: &str, ty: &TensorType) -> Result<Arc<Tensor>, String>;
}

/// A weight source backed by an in-memory map (tests, small graphs).
impl WeightSource for BTreeMap<String, Arc<Tensor>> {
    fn load(&self, name: &str, _ty: &TensorType) -> Result<Arc<Tensor>, String> {
        self.get(name)
            .cloned()
            .ok_or_else(|| format!("no weight named `{name}`"))
    }
}

/// Evaluates `graph` on `inputs` (by input name) and returns its outputs (by output name).
pub fn evaluate(
    graph: &Graph,
    inputs: &BTreeMap<String, Tensor>,
    weights: &dyn WeightSource,
) -> Result<BTreeMap<String, Tensor>, InterpError> {
    let bindings = bind_symbols(graph, inputs)?;
    // The last node that reads each value, so that intermediates are freed early.
    let mut last_use = vec![0usize; graph.len()];
    for (id, node) in graph.nodes() {
        for a in &node.args {
            last_use[a.index()] = id.index();
        }
    }
    for o in graph.outputs() {
        last_use[o.node.index()] = usize::MAX;
    }
    let mut values: Vec<Option<Arc<Tensor>>> = vec![None; graph.len()];
    for (id, node) in graph.nodes() {
        let shape = concrete_shape(node, id, &bindings)?;
        let args: Vec<Arc<Tensor>> = node
            .args
            .iter()
            .map(|a| values[a.index()].clone().expect("operands precede users"))
            .collect();
        let value = match &node.op {
            Op::Input(name) => Arc::new(inputs[name].clone()),
            Op::Weight(name) => {
                let ty = TensorType::new(
                    node.ty.dtype,
                    shape.iter().map(|&d| (d as i64).into()).collect(),
                );
                let w = weights
                    .load(name, &ty)
                    .map_err(|message| InterpError::Weight {
                        name: name.clone(),
                        message,
                    })?;
                if w.shape != shape || w.dtype != node.ty.dtype {
                    return Err(InterpError::Weight {
                        name: name.clone(),
                        message: format!(
                            "expected {} {:?}, got {} {:?}",
                            node.ty.dtype, shape, w.dtype, w.shape
                        ),
                    });
                }
                w
            }
            _ => {
                let arg_refs: Vec<&Tensor> = args.iter().map(|a| a.as_ref()).collect();
                let out = eval_op(node, &arg_refs, &shape, &bindings).map_err(|message| {
                    InterpError::Op {
                        node: id,
                        op: node.op.name(),
                        message,
                    }
                })?;
                debug_assert_eq!(out.shape, shape, "node {id} ({})", node.op.name());
                Arc::new(out)
            }
        };
        values[id.index()] = Some(value);
        for a in &node.args {
            if last_use[a.index()] == id.index() {
                values[a.index()] = None;
            }
        }
    }
    let mut out = BTreeMap::new();
    for o in graph.outputs() {
        let v = values[o.node.index()].as_ref().expect("outputs are kept");
        out.insert(o.name.clone(), v.as_ref().clone());
    }
    Ok(out)
}

/// Binds each symbol to a size from the inputs' shapes and checks every input against its
/// declaration.
fn bind_symbols(
    graph: &Graph,
    inputs: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, i64>, InterpError> {
    let mut bindings = BTreeMap::new();
    let declared: Vec<_> = graph.inputs().collect();
    for (_, name, ty) in &declared {
        let t = inputs
            .get(*name)
            .ok_or_else(|| InterpError::MissingInput(name.to_string()))?;
        let mismatch = || InterpError::InputType {
            name: name.to_string(),
            expected: ty.to_string(),
            found: format!("{}{:?}", t.dtype, t.shape),
        };
        if t.dtype != ty.dtype || t.shape.len() != ty.rank() {
            return Err(mismatch());
        }
        for (d, &n) in ty.shape.iter().zip(&t.shape) {
            let mut syms = d.symbols();
            if let (Some(s), None) = (syms.next(), syms.next()) {
                if *d == crate::dim::Dim::sym(s) {
                    match bindings.get(s) {
                        Some(&v) if v != n as i64 => return Err(mismatch()),
                        _ => {
                            bindings.insert(s.to_string(), n as i64);
                        }
                    }
                }
            }
        }
    }
    for (_, name, ty) in &declared {
        let t = &inputs[*name];
        for (d, &n) in ty.shape.iter().zip(&t.shape) {
            if d.eval(&bindings) != Some(n as i64) {
                return Err(InterpError::InputType {
                    name: name.to_string(),
                    expected: ty.to_string(),
                    found: format!("{}{:?}", t.dtype, t.shape),
                });
            }
        }
    }
    if let Some(extra) = inputs
        .keys()
        .find(|k| !declared.iter().any(|(_, n, _)| n == k))
    {
        return Err(InterpError::UnknownInput(extra.clone()));
    }
    Ok(bindings)
}

fn concrete_shape(
    node: &Node,
    id: NodeId,
    bindings: &BTreeMap<String, i64>,
) -> Result<Vec<usize>, InterpError> {
    node.ty
        .shape
        .iter()
        .map(|d| match d.eval(bindings) {
            Some(v) if v >= 0 => Ok(v as usize),
            _ => Err(InterpError::Op {
                node: id,
                op: node.op.name(),
                message: format!(
                    "shape {} has no non-negative value for {bindings:?}",
                    shape_to_string(&node.ty.shape)
                ),
            }),
        })
        .collect()
}

fn floats(t: &Tensor) -> &[f32] {
    t.as_f32().expect("typing guarantees a float tensor")
}

fn ints(t: &Tensor) -> &[i64] {
    t.as_i64().expect("typing guarantees an integer tensor")
}

/// A float result: rounded to the node's dtype.
fn float_out(node: &Node, shape: &[usize], values: Vec<f32>) -> Tensor {
    Tensor::float(node.ty.dtype, shape.to_vec(), values)
}

fn same_storage(node: &Node, shape: &[usize], data: Data) -> Tensor {
    Tensor {
        dtype: node.ty.dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// Applies `copy_view` to either storage.
fn view(t: &Tensor, node: &Node, shape: &[usize], view_strides: &[usize], offset: usize) -> Tensor {
    let data = match &t.data {
        Data::Float(v) => Data::Float(copy_view(v, shape, view_strides, offset)),
        Data::Int(v) => Data::Int(copy_view(v, shape, view_strides, offset)),
    };
    same_storage(node, shape, data)
}

/// One node's value from its operands' (`shape` its concrete shape, `bindings` the symbols').
fn eval_op(
    node: &Node,
    args: &[&Tensor],
    shape: &[usize],
    bindings: &BTreeMap<String, i64>,
) -> Result<Tensor, String> {
    Ok(match &node.op {
        Op::Input(_) | Op::Weight(_) => unreachable!("handled by evaluate"),
        kernel_ops!() => return eval_kernel(node, args),
        Op::Scalar(v) => match node.ty.dtype.is_float() {
            true => float_out(node, shape, vec![*v as f32]),
            false => Tensor::int(node.ty.dtype, vec![], vec![*v as i64]),
        },
        Op::Unary(u) => unary(node, args[0], *u, shape),
        Op::Binary(b) => binary(node, args[0], args[1], *b, shape)?,
        Op::Where => select(node, args, shape),
        Op::Cast(to) => args[0].cast(*to),
        Op::Reduce { op, axis } => reduce(node, args[0], *op, *axis, shape),
        Op::MatMul => matmul(node, args[0], args[1], shape),
        Op::Reshape(_) => same_storage(node, shape, args[0].data.clone()),
        Op::Permute(perm) => {
            let src = strides(&args[0].shape);
            let view_strides: Vec<usize> = perm.iter().map(|&p| src[p]).collect();
            view(args[0], node, shape, &view_strides, 0)
        }
        Op::Broadcast(_) => broadcast(node, args[0], shape),
        Op::Slice { axis, start, .. } => {
            let x = args[0];
            let start = slice_start(start, *axis, x, shape, bindings)?;
            let src = strides(&x.shape);
            view(x, node, shape, &src, start * src[*axis])
        }
        Op::Concat(axis) => concat_op(node, args, *axis, shape),
        Op::Gather => gather(node, args[0], ints(args[1]), shape)?,
        Op::CausalMask { window, dtype, .. } => causal_mask(node, *window, *dtype, shape),
        Op::PaddingMask(dtype) => {
            let neg = mask_value(*dtype);
            let m = ints(args[0]);
            float_out(
                node,
                shape,
                m.iter().map(|&v| if v != 0 { 0.0 } else { neg }).collect(),
            )
        }
        Op::Rope { theta, scaling } => rope(node, args[0], args[1], *theta, scaling, shape),
        Op::PositionMask { window, dtype, .. } => {
            position_mask(node, ints(args[0]), *window, *dtype, shape)
        }
        Op::CacheWrite => cache_write(node, args, shape)?,
        Op::Dropout { p, stream } => dropout(node, args[0], args[1], *p, *stream, shape)?,
    })
}

/// `Unary` elementwise: floats in f64, integers negated (the only integer unary op).
fn unary(node: &Node, x: &Tensor, u: UnaryOp, shape: &[usize]) -> Tensor {
    match &x.data {
        Data::Float(x) => {
            let f: fn(f64) -> f64 = match u {
                UnaryOp::Neg => |v| -v,
                UnaryOp::Exp => f64::exp,
                UnaryOp::Tanh => f64::tanh,
                UnaryOp::Erf => libm::erf,
                UnaryOp::Rsqrt => |v| 1.0 / v.sqrt(),
            };
            float_out(
                node,
                shape,
                x.iter().map(|&v| f(f64::from(v)) as f32).collect(),
            )
        }
        Data::Int(x) => Tensor::int(
            node.ty.dtype,
            shape.to_vec(),
            x.iter().map(|v| -v).collect(),
        ),
    }
}

/// `Binary` elementwise: floats in f64, integers wrapping (a division by zero is an error).
fn binary(
    node: &Node,
    x: &Tensor,
    y: &Tensor,
    b: BinaryOp,
    shape: &[usize],
) -> Result<Tensor, String> {
    Ok(match (&x.data, &y.data) {
        (Data::Float(x), Data::Float(y)) => {
            let f: fn(f64, f64) -> f64 = match b {
                BinaryOp::Add => |a, b| a + b,
                BinaryOp::Sub => |a, b| a - b,
                BinaryOp::Mul => |a, b| a * b,
                BinaryOp::Div => |a, b| a / b,
                BinaryOp::Max => f64::max,
            };
            let v = x
                .iter()
                .zip(y)
                .map(|(&a, &c)| f(f64::from(a), f64::from(c)) as f32)
                .collect();
            float_out(node, shape, v)
        }
        (Data::Int(x), Data::Int(y)) => {
            let mut v = Vec::with_capacity(x.len());
            for (&a, &c) in x.iter().zip(y) {
                v.push(match b {
                    BinaryOp::Add => a.wrapping_add(c),
                    BinaryOp::Sub => a.wrapping_sub(c),
                    BinaryOp::Mul => a.wrapping_mul(c),
                    BinaryOp::Div => a.checked_div(c).ok_or("integer division by zero")?,
                    BinaryOp::Max => a.max(c),
                });
            }
            Tensor::int(node.ty.dtype, shape.to_vec(), v)
        }
        _ => unreachable!("typing guarantees equal dtypes"),
    })
}

/// `Where`: `args[1]` where the condition `args[0]` is true, else `args[2]`.
fn select(node: &Node, args: &[&Tensor], shape: &[usize]) -> Tensor {
    let c = ints(args[0]);
    let data = match (&args[1].data, &args[2].data) {
        (Data::Float(a), Data::Float(b)) => Data::Float(choose(c, a, b)),
        (Data::Int(a), Data::Int(b)) => Data::Int(choose(c, a, b)),
        _ => unreachable!("typing guarantees equal dtypes"),
    };
    same_storage(node, shape, data)
}

/// `a`'s element where `c`'s is nonzero, else `b`'s.
fn choose<T: Copy>(c: &[i64], a: &[T], b: &[T]) -> Vec<T> {
    c.iter()
        .zip(a.iter().zip(b))
        .map(|(&c, (&a, &b))| if c != 0 { a } else { b })
        .collect()
}

/// `Broadcast`: a view of `x` with stride 0 on the axes it gains and on its axes of size 1.
fn broadcast(node: &Node, x: &Tensor, shape: &[usize]) -> Tensor {
    let src = strides(&x.shape);
    let offset = shape.len() - x.shape.len();
    let view_strides: Vec<usize> = (0..shape.len())
        .map(|i| match i.checked_sub(offset) {
            Some(j) if x.shape[j] != 1 => src[j],
            _ => 0,
        })
        .collect();
    view(x, node, shape, &view_strides, 0)
}

/// A `Slice`'s start on `axis` of `x`, bound, once the slice of `shape` is known to fit.
fn slice_start(
    start: &Dim,
    axis: usize,
    x: &Tensor,
    shape: &[usize],
    bindings: &BTreeMap<String, i64>,
) -> Result<usize, String> {
    let at = start
        .eval(bindings)
        .filter(|&s| s >= 0 && s as usize + shape[axis] <= x.shape[axis])
        .ok_or_else(|| {
            format!(
                "slice start {start} is out of range for axis {axis} of {:?}",
                x.shape
            )
        })?;
    Ok(at as usize)
}

/// `Concat` of `args` on `axis`, in either storage.
fn concat_op(node: &Node, args: &[&Tensor], axis: usize, shape: &[usize]) -> Tensor {
    let outer: usize = shape[..axis].iter().product();
    let data = match &args[0].data {
        Data::Float(_) => {
            let parts: Vec<&[f32]> = args.iter().map(|a| floats(a)).collect();
            Data::Float(concat(&parts, args, axis, outer))
        }
        Data::Int(_) => {
            let parts: Vec<&[i64]> = args.iter().map(|a| ints(a)).collect();
            Data::Int(concat(&parts, args, axis, outer))
        }
    };
    same_storage(node, shape, data)
}

/// `Gather`: the rows of `table` that `ids` name (an id outside the table is an error).
fn gather(node: &Node, table: &Tensor, ids: &[i64], shape: &[usize]) -> Result<Tensor, String> {
    let rows = table.shape[0];
    let row_len: usize = table.shape[1..].iter().product();
    let t = floats(table);
    let mut out = Vec::with_capacity(ids.len() * row_len);
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= rows {
            return Err(format!(
                "id {id} at flat position {i} is out of range for a table of {rows} rows"
            ));
        }
        let r = id as usize;
        out.extend_from_slice(&t[r * row_len..(r + 1) * row_len]);
    }
    Ok(float_out(node, shape, out))
}

/// `CausalMask`: 0 where row `i` (the last rows of the columns) sees column `j`, else the
/// dtype's mask value.
fn causal_mask(node: &Node, window: Option<i64>, dtype: DType, shape: &[usize]) -> Tensor {
    let neg = mask_value(dtype);
    let (rows, cols) = (shape[0] as i64, shape[1] as i64);
    let shift = cols - rows;
    let mut out = Vec::with_capacity((rows * cols) as usize);
    for i in 0..rows {
        for j in 0..cols {
            let q = i + shift;
            let visible = j <= q && window.is_none_or(|w| q - j < w);
            out.push(if visible { 0.0 } else { neg });
        }
    }
    float_out(node, shape, out)
}

/// `PositionMask`: 0 where a row at position `p` sees column `j`, else the dtype's mask value.
fn position_mask(
    node: &Node,
    pos: &[i64],
    window: Option<i64>,
    dtype: DType,
    shape: &[usize],
) -> Tensor {
    let neg = mask_value(dtype);
    let cols = shape[3] as i64;
    let mut out = Vec::with_capacity(pos.len() * cols as usize);
    for &p in pos {
        for j in 0..cols {
            let visible = j <= p && window.is_none_or(|w| p - j < w);
            out.push(if visible { 0.0 } else { neg });
        }
    }
    float_out(node, shape, out)
}

/// A kernel node means its decomposition: build it over the operands and evaluate it.
fn eval_kernel(node: &Node, args: &[&Tensor]) -> Result<Tensor, String> {
    let mut g = Graph::new();
    let mut inputs = BTreeMap::new();
    let mut ids = Vec::with_capacity(args.len());
    for (i, t) in args.iter().enumerate() {
        let name = format!("arg{i}");
        let shape = t.shape.iter().map(|&d| Dim::from(d)).collect();
        ids.push(g.input(&name, t.dtype, shape).map_err(|e| e.to_string())?);
        inputs.insert(name, (*t).clone());
    }
    let out = node.op.decompose(&mut g, &ids).map_err(|e| e.to_string())?;
    g.set_output("out", out).map_err(|e| e.to_string())?;
    let mut result = evaluate(&g, &inputs, &BTreeMap::<String, Arc<Tensor>>::new())
        .map_err(|e| format!("in its decomposition: {e}"))?;
    Ok(result.remove("out").expect("the decomposition's output"))
}

fn cache_write(node: &Node, args: &[&Tensor], shape: &[usize]) -> Result<Tensor, String> {
    let (b, h, t, d) = (shape[0], shape[1], shape[2], shape[3]);
    let s = args[1].shape[2];
    let mut out = floats(args[0]).to_vec();
    let new = floats(args[1]);
    let (pos, mask) = (ints(args[2]), ints(args[3]));
    for bi in 0..b {
        for si in 0..s {
            if mask[bi * s + si] == 0 {
                continue;
            }
            let p = pos[bi * s + si];
            if p < 0 || p as usize >= t {
                return Err(format!(
                    "position {p} of row {bi} is outside the cache of {t} entries"
                ));
            }
            for hi in 0..h {
                let dst = ((bi * h + hi) * t + p as usize) * d;
                let src = ((bi * h + hi) * s + si) * d;
                out[dst..dst + d].copy_from_slice(&new[src..src + d]);
            }
        }
    }
    Ok(float_out(node, shape, out))
}

fn concat<T: Copy>(parts: &[&[T]], args: &[&Tensor], axis: usize, outer: usize) -> Vec<T> {
    let chunk: Vec<usize> = args
        .iter()
        .map(|a| a.shape[axis..].iter().product())
        .collect();
    let mut out = Vec::with_capacity(chunk.iter().sum::<usize>() * outer);
    for o in 0..outer {
        for (p, &c) in parts.iter().zip(&chunk) {
            out.extend_from_slice(&p[o * c..(o + 1) * c]);
        }
    }
    out
}

fn reduce(node: &Node, x: &Tensor, op: ReduceOp, axis: usize, shape: &[usize]) -> Tensor {
    let outer: usize = x.shape[..axis].iter().product();
    let n = x.shape[axis];
    let inner: usize = x.shape[axis + 1..].iter().product();
    match &x.data {
        Data::Float(v) => {
            let mut out = Vec::with_capacity(outer * inner);
            for o in 0..outer {
                for i in 0..inner {
                    let items = (0..n).map(|k| f64::from(v[(o * n + k) * inner + i]));
                    let r = match op {
                        ReduceOp::Sum => items.sum::<f64>(),
                        ReduceOp::Mean => items.sum::<f64>() / n as f64,
                        ReduceOp::Max => items.fold(f64::NEG_INFINITY, f64::max),
                    };
                    out.push(r as f32);
                }
            }
            float_out(node, shape, out)
        }
        Data::Int(v) => {
            let mut out = Vec::with_capacity(outer * inner);
            for o in 0..outer {
                for i in 0..inner {
                    let m = (0..n).map(|k| v[(o * n + k) * inner + i]).max();
                    out.push(m.unwrap_or(i64::MIN));
                }
            }
            Tensor::int(node.ty.dtype, shape.to_vec(), out)
        }
    }
}

fn matmul(node: &Node, a: &Tensor, b: &Tensor, shape: &[usize]) -> Tensor {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let n = b.shape[rb - 1];
    let batch: usize = a.shape[..ra - 2].iter().product();
    let shared_rhs = rb == 2;
    let (av, bv) = (floats(a), floats(b));
    let mut out = vec![0f32; batch * m * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(row, out_row)| {
            let bi = row / m.max(1);
            let a_row = &av[row * k..(row + 1) * k];
            let b_mat = if shared_rhs {
                bv
            } else {
                &bv[bi * k * n..(bi + 1) * k * n]
            };
            let mut acc = vec![0f64; n];
            for (kk, &x) in a_row.iter().enumerate() {
                let x = f64::from(x);
                for (acc, &y) in acc.iter_mut().zip(&b_mat[kk * n..(kk + 1) * n]) {
                    *acc += x * f64::from(y);
                }
            }
            for (o, a) in out_row.iter_mut().zip(acc) {
                *o = a as f32;
            }
        });
    round_to_dtype(node.ty.dtype, &mut out);
    float_out(node, shape, out)
}

fn rope(
    node: &Node,
    x: &Tensor,
    pos: &Tensor,
    theta: f64,
    scaling: &crate::rope::RopeScaling,
    shape: &[usize],
) -> Tensor {
    let (b, h, l, d) = (shape[0], shape[1], shape[2], shape[3]);
    let half = d / 2;
    let inv_freq = scaling.inv_freq(theta, d);
    let (xv, pv) = (floats(x), ints(pos));
    let mut out = vec![0f32; xv.len()];
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let p = pv[bi * l + li] as f64;
                let base = ((bi * h + hi) * l + li) * d;
                for c in 0..half {
                    let (sin, cos) = scaling.sin_cos(p, inv_freq[c]);
                    let x1 = f64::from(xv[base + c]);
                    let x2 = f64::from(xv[base + c + half]);
                    out[base + c] = (x1 * cos - x2 * sin) as f32;
                    out[base + c + half] = (x2 * cos + x1 * sin) as f32;
                }
            }
        }
    }
    float_out(node, shape, out)
}

fn dropout(
    node: &Node,
    x: &Tensor,
    seed: &Tensor,
    p: f64,
    stream: u32,
    shape: &[usize],
) -> Result<Tensor, String> {
    let key = seed_key(ints(seed)[0]);
    let threshold = dropout_threshold(p);
    let scale = dropout_scale(p);
    let rank = shape.len();
    let cols = if rank >= 1 { shape[rank - 1] } else { 1 };
    let rows = if rank >= 2 { shape[rank - 2] } else { 1 };
    let planes: usize = shape[..rank.saturating_sub(2)].iter().product();
    if [cols, rows, planes].iter().any(|&v| v > u32::MAX as usize) {
        return Err(format!("dropout coordinates of {shape:?} exceed 32 bits"));
    }
    let xv = floats(x);
    let mut out = Vec::with_capacity(xv.len());
    for plane in 0..planes {
        for row in 0..rows {
            for col in 0..cols {
                let v = xv[(plane * rows + row) * cols + col];
                let keep =
                    dropout_keep(key, stream, plane as u32, row as u32, col as u32, threshold);
                out.push(if keep { v * scale } else { 0.0 });
            }
        }
    }
    Ok(float_out(node, shape, out))
}
