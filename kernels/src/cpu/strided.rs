//! Primitive tensor ops over strided operands, the CPU side of what no fused kernel covers (the
//! sentence-transformers head: mask casts, broadcast products, reductions over tokens,
//! normalisation, concatenated pooling modes, CLS slices). Each operand is read at
//! `offset + sum(index[d] * strides[d])` elements, so broadcasts, slices and permutations are read
//! in place; every shape, stride and constant is baked into the code. Parameters: one pointer per
//! [`Source::Memory`] operand in order, then `out`; the parallel axis is the output's rows (every
//! axis but the last), the last axis a loop inside.
//!
//! Semantics are the interpreter's: float arithmetic in f32 (the interpreter's f64 result
//! rounded to f32 is the same value for `+ - * /`), reductions accumulated in f64, `Cast` of i64
//! to f32 by rounding.

use cranelift_codegen::ir::types::{F32, F64, I64};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value};
use cranelift_frontend::FunctionBuilder;
use kiln_ir::{BinaryOp, ReduceOp, UnaryOp};

use super::math::{constant, exp, one_plus_erf};
use super::module::{for_range, Args, CpuError, CpuModule};

/// Where an operand's elements come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A tensor in memory: i64 elements (converted to f32 on load) when `int`, else f32.
    Memory {
        /// i64 elements rather than f32.
        int: bool,
        /// Element offset of index 0.
        offset: i64,
        /// Element stride of each output axis (0 for broadcast axes).
        strides: Vec<i64>,
    },
    /// The same value everywhere (a scalar constant of the graph).
    Constant(f32),
}

/// What each output element is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StridedOp {
    /// The one operand (a copy, a materialised view, a cast to f32 or a concatenation's part).
    Copy,
    /// `op(a)`.
    Unary(UnaryOp),
    /// `op(a, b)`.
    Binary(BinaryOp),
    /// `op` over `len` elements of the one operand along `axis` (whose output extent is 1); the
    /// operand's stride on `axis` steps through them.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// The reduced axis.
        axis: usize,
        /// Elements reduced.
        len: u32,
    },
}

/// One strided op: what it computes, over which shape, from which operands, to where.
#[derive(Clone, Debug, PartialEq)]
pub struct StridedConfig {
    /// The computation.
    pub op: StridedOp,
    /// The iteration shape (the output's; a reduced axis has extent 1).
    pub shape: Vec<u32>,
    /// The operands.
    pub sources: Vec<Source>,
    /// Element offset of the output's index 0 (a concatenation's part starts inside it).
    pub out_offset: i64,
    /// Element strides of the output.
    pub out_strides: Vec<i64>,
}

impl StridedConfig {
    /// Rows of the parallel axis: the product of every extent but the last (1 for a scalar).
    pub fn rows(&self) -> u64 {
        let n = self.shape.len().saturating_sub(1);
        self.shape[..n].iter().map(|&d| u64::from(d)).product()
    }
}

/// The function's name: the op and a digest of the whole configuration (shapes and strides are
/// baked in, so configurations differ in code).
pub fn name(c: &StridedConfig) -> String {
    let op = match c.op {
        StridedOp::Copy => "copy".to_string(),
        StridedOp::Unary(u) => format!("{u:?}").to_lowercase(),
        StridedOp::Binary(b) => format!("{b:?}").to_lowercase(),
        StridedOp::Reduce { op, .. } => format!("reduce_{op:?}").to_lowercase(),
    };
    // FNV-1a over the configuration's debug form: stable across runs and platforms.
    let digest = format!("{c:?}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("cpu_strided_{op}_{digest:016x}")
}

/// Generates `c` into `module`; returns its name.
pub fn strided(module: &mut CpuModule, c: &StridedConfig) -> Result<String, CpuError> {
    check(c)?;
    let name = name(c);
    let rank = c.shape.len();
    let shape: Vec<i64> = if rank == 0 {
        vec![1]
    } else {
        c.shape.iter().map(|&d| i64::from(d)).collect()
    };
    let out_strides = padded(rank, &c.out_strides);
    module.define(&name, |b, p| {
        let mut args = Args::new(p);
        let bases: Vec<Option<Value>> = c
            .sources
            .iter()
            .map(|s| matches!(s, Source::Memory { .. }).then(|| args.next(b)))
            .collect();
        let out = args.next(b);
        let last = shape.len() - 1;
        for_range(b, p.begin, p.end, 1, |b, row| {
            let index = row_index(b, row, &shape[..last]);
            let starts = c
                .sources
                .iter()
                .map(|s| match s {
                    Source::Memory {
                        offset, strides, ..
                    } => Some(row_offset(b, &index, *offset, &padded(rank, strides))),
                    Source::Constant(_) => None,
                })
                .collect();
            let operands = Operands {
                c,
                bases: &bases,
                starts,
                last,
            };
            let out_start = row_offset(b, &index, c.out_offset, &out_strides);
            let zero = b.ins().iconst(I64, 0);
            let width = b.ins().iconst(I64, shape[last]);
            for_range(b, zero, width, 1, |b, j| {
                let y = operands.value(b, j);
                let off = b.ins().imul_imm_s(j, out_strides[last]);
                let at = b.ins().iadd(out_start, off);
                let bytes = b.ins().imul_imm_s(at, 4);
                let addr = b.ins().iadd(out, bytes);
                b.ins().store(MemFlagsData::new().with_notrap(), y, addr, 0);
            });
        });
    })?;
    Ok(name)
}

/// `Err` naming `c` when its operands, strides or reduced axis do not fit its shape and op.
fn check(c: &StridedConfig) -> Result<(), CpuError> {
    let rank = c.shape.len();
    let arity = match c.op {
        StridedOp::Binary(_) => 2,
        _ => 1,
    };
    if c.sources.len() != arity
        || c.out_strides.len() != rank
        || c.sources
            .iter()
            .any(|s| matches!(s, Source::Memory { strides, .. } if strides.len() != rank))
    {
        return Err(CpuError(format!("inconsistent strided op {c:?}")));
    }
    if let StridedOp::Reduce { axis, .. } = c.op {
        if axis >= rank || c.shape[axis] != 1 {
            return Err(CpuError(format!("reduced axis of {c:?}")));
        }
    }
    Ok(())
}

/// `strides` of a tensor of `rank` axes, a scalar's as one axis of stride 0.
fn padded(rank: usize, strides: &[i64]) -> Vec<i64> {
    if rank == 0 {
        vec![0]
    } else {
        strides.to_vec()
    }
}

/// Row `row`'s index on each of the outer axes `outer` (computed innermost first).
fn row_index(b: &mut FunctionBuilder, row: Value, outer: &[i64]) -> Vec<Value> {
    let mut index = vec![None; outer.len()];
    let mut rest = row;
    for d in (0..outer.len()).rev() {
        index[d] = Some(b.ins().urem_imm_s(rest, outer[d]));
        rest = b.ins().udiv_imm_s(rest, outer[d]);
    }
    index.into_iter().map(|i| i.expect("every axis")).collect()
}

/// Element offset of a row's first element: `offset + sum(index[d] * strides[d])`.
fn row_offset(b: &mut FunctionBuilder, index: &[Value], offset: i64, strides: &[i64]) -> Value {
    let mut at = b.ins().iconst(I64, offset);
    for (d, &i) in index.iter().enumerate() {
        if strides[d] != 0 {
            let step = b.ins().imul_imm_s(i, strides[d]);
            at = b.ins().iadd(at, step);
        }
    }
    at
}

/// A row's operands: each memory source's base pointer and the element offset its row starts
/// at; `last` is the innermost axis.
struct Operands<'a> {
    c: &'a StridedConfig,
    bases: &'a [Option<Value>],
    starts: Vec<Option<Value>>,
    last: usize,
}

impl Operands<'_> {
    /// The op's result at element `j` of the row.
    fn value(&self, b: &mut FunctionBuilder, j: Value) -> Value {
        match self.c.op {
            StridedOp::Copy => self.read(b, 0, j, None),
            StridedOp::Unary(u) => {
                let x = self.read(b, 0, j, None);
                unary(b, u, x)
            }
            StridedOp::Binary(op) => {
                let (x, y) = (self.read(b, 0, j, None), self.read(b, 1, j, None));
                match op {
                    BinaryOp::Add => b.ins().fadd(x, y),
                    BinaryOp::Sub => b.ins().fsub(x, y),
                    BinaryOp::Mul => b.ins().fmul(x, y),
                    BinaryOp::Div => b.ins().fdiv(x, y),
                    BinaryOp::Max => b.ins().fmax(x, y),
                }
            }
            StridedOp::Reduce { op, axis, len } => {
                let stride = match &self.c.sources[0] {
                    Source::Memory { strides, .. } => strides[axis],
                    Source::Constant(_) => 0,
                };
                reduce(b, op, len, |b, k| self.read(b, 0, j, Some((k, stride))))
            }
        }
    }

    /// Operand `s` at element `j` of the row, `k` further along a reduced axis of `stride`.
    fn read(&self, b: &mut FunctionBuilder, s: usize, j: Value, k: Option<(Value, i64)>) -> Value {
        match &self.c.sources[s] {
            Source::Constant(v) => constant(b, F32, *v),
            Source::Memory { int, strides, .. } => {
                let mut at = self.starts[s].expect("a memory source's row start");
                let step = padded(self.c.shape.len(), strides)[self.last];
                if step != 0 {
                    let off = b.ins().imul_imm_s(j, step);
                    at = b.ins().iadd(at, off);
                }
                if let Some((k, stride)) = k {
                    let off = b.ins().imul_imm_s(k, stride);
                    at = b.ins().iadd(at, off);
                }
                let bytes = b.ins().imul_imm_s(at, if *int { 8 } else { 4 });
                let base = self.bases[s].expect("a memory source's base");
                let addr = b.ins().iadd(base, bytes);
                let flags = MemFlagsData::new().with_notrap();
                if *int {
                    let v = b.ins().load(I64, flags, addr, 0);
                    b.ins().fcvt_from_sint(F32, v)
                } else {
                    b.ins().load(F32, flags, addr, 0)
                }
            }
        }
    }
}

/// `op(x)` in f32.
fn unary(b: &mut FunctionBuilder, op: UnaryOp, x: Value) -> Value {
    match op {
        UnaryOp::Neg => b.ins().fneg(x),
        UnaryOp::Exp => exp(b, F32, x),
        UnaryOp::Tanh => {
            // 1 - 2 / (e^(2x) + 1): exact limits at both ends (e^(2x) -> 0 or +inf).
            let two = constant(b, F32, 2.0);
            let x2 = b.ins().fmul(x, two);
            let e = exp(b, F32, x2);
            let one = constant(b, F32, 1.0);
            let d = b.ins().fadd(e, one);
            let q = b.ins().fdiv(two, d);
            b.ins().fsub(one, q)
        }
        UnaryOp::Erf => {
            let one = constant(b, F32, 1.0);
            let e = one_plus_erf(b, F32, x);
            b.ins().fsub(e, one)
        }
        UnaryOp::Rsqrt => {
            let one = constant(b, F32, 1.0);
            let s = b.ins().sqrt(x);
            b.ins().fdiv(one, s)
        }
    }
}

/// `op` over `read(k)` for `k` in `0..len`: sums in f64, the maximum in f32 (from -inf).
fn reduce(
    b: &mut FunctionBuilder,
    op: ReduceOp,
    len: u32,
    mut read: impl FnMut(&mut FunctionBuilder, Value) -> Value,
) -> Value {
    let sum = !matches!(op, ReduceOp::Max);
    let ty = if sum { F64 } else { F32 };
    let acc = b.declare_var(ty);
    let init = if sum {
        b.ins().f64const(0.0)
    } else {
        b.ins().f32const(f32::NEG_INFINITY)
    };
    b.def_var(acc, init);
    let zero = b.ins().iconst(I64, 0);
    let n = b.ins().iconst(I64, i64::from(len));
    for_range(b, zero, n, 1, |b, k| {
        let v = read(b, k);
        let a = b.use_var(acc);
        let next = if sum {
            let w = b.ins().fpromote(F64, v);
            b.ins().fadd(a, w)
        } else {
            b.ins().fmax(a, v)
        };
        b.def_var(acc, next);
    });
    let a = b.use_var(acc);
    match op {
        ReduceOp::Max => a,
        ReduceOp::Sum => b.ins().fdemote(F32, a),
        ReduceOp::Mean => {
            let n = b.ins().f64const(f64::from(len));
            let m = b.ins().fdiv(a, n);
            b.ins().fdemote(F32, m)
        }
    }
}
