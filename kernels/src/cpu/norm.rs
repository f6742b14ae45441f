//! LayerNorm / RMSNorm over rows of `cols` f32 values, optionally of `x + residual`, the CPU
//! side of [`crate::norm`]: per row, the input (summed into the output row first when there is a
//! residual) is reduced four lanes at a time for the mean and then the centred variance (so a
//! large mean does not cancel), and written back scaled. Columns past the last multiple of four
//! take a scalar tail. Parameters: `x, [residual], weight, [bias], out`; the parallel axis is rows.

use cranelift_codegen::ir::InstBuilder;
use cranelift_frontend::FunctionBuilder;
use kiln_ir::kernel::NormKind;

use super::module::{
    arg, f32_addr, f32_const, for_range, lane_sum, load, splat, store, zero_x4, CpuError,
    CpuModule, KernelParams, SCALAR, VECTOR,
};
use crate::norm::NormConfig;

/// The function's name for `cfg`.
pub fn name(cfg: &NormConfig) -> String {
    format!(
        "cpu_{}{}_f32_c{}",
        if cfg.kind == NormKind::LayerNorm {
            "layer_norm"
        } else {
            "rms_norm"
        },
        if cfg.residual { "_residual" } else { "" },
        cfg.cols
    )
}

/// Generates the norm of `cfg` (f32) into `module`; returns its name.
pub fn norm(module: &mut CpuModule, cfg: &NormConfig) -> Result<String, CpuError> {
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| body(b, p, &cfg))?;
    Ok(name)
}

/// Applies `scalar` to every column index below `cols` not covered by whole vectors, and
/// `vector` to every multiple of four below.
fn columns(
    b: &mut FunctionBuilder,
    cols: u32,
    mut vector: impl FnMut(&mut FunctionBuilder, cranelift_codegen::ir::Value),
    mut scalar: impl FnMut(&mut FunctionBuilder, cranelift_codegen::ir::Value),
) {
    let whole = i64::from(cols / 4 * 4);
    let zero = b.ins().iconst(cranelift_codegen::ir::types::I64, 0);
    let split = b.ins().iconst(cranelift_codegen::ir::types::I64, whole);
    let end = b
        .ins()
        .iconst(cranelift_codegen::ir::types::I64, i64::from(cols));
    for_range(b, zero, split, 4, &mut vector);
    for_range(b, split, end, 1, &mut scalar);
}

fn body(b: &mut FunctionBuilder, p: KernelParams, cfg: &NormConfig) {
    let layer = cfg.kind == NormKind::LayerNorm;
    let mut next = 0;
    let mut take = |b: &mut FunctionBuilder| {
        next += 1;
        arg(b, p, next - 1)
    };
    let x = take(b);
    let residual = cfg.residual.then(|| take(b));
    let weight = take(b);
    let bias = layer.then(|| take(b));
    let out = take(b);
    let cols = cfg.cols;
    let inv_cols = 1.0 / cols as f32;

    for_range(b, p.begin, p.end, 1, |b, row| {
        let first = b.ins().imul_imm_s(row, i64::from(cols));
        let row_addr = |b: &mut FunctionBuilder, base, col| {
            let i = b.ins().iadd(first, col);
            f32_addr(b, base, i)
        };
        // The row to normalise: x, or x + residual written to the output row.
        let src = match residual {
            Some(r) => {
                let sum = |b: &mut FunctionBuilder, c, ty| {
                    let xa = row_addr(b, x, c);
                    let ra = row_addr(b, r, c);
                    let xv = load(b, ty, xa);
                    let rv = load(b, ty, ra);
                    let s = b.ins().fadd(xv, rv);
                    let oa = row_addr(b, out, c);
                    store(b, s, oa);
                };
                columns(b, cols, |b, c| sum(b, c, VECTOR), |b, c| sum(b, c, SCALAR));
                out
            }
            None => x,
        };
        // Mean (LayerNorm), then the sum of squares about it.
        let mean = if layer {
            let acc = b.declare_var(VECTOR);
            let tail = b.declare_var(SCALAR);
            let z = zero_x4(b);
            b.def_var(acc, z);
            let z = f32_const(b, 0.0);
            b.def_var(tail, z);
            columns(
                b,
                cols,
                |b, c| {
                    let a = row_addr(b, src, c);
                    let v = load(b, VECTOR, a);
                    let cur = b.use_var(acc);
                    let s = b.ins().fadd(cur, v);
                    b.def_var(acc, s);
                },
                |b, c| {
                    let a = row_addr(b, src, c);
                    let v = load(b, SCALAR, a);
                    let cur = b.use_var(tail);
                    let s = b.ins().fadd(cur, v);
                    b.def_var(tail, s);
                },
            );
            let v = b.use_var(acc);
            let lanes = lane_sum(b, v);
            let t = b.use_var(tail);
            let total = b.ins().fadd(lanes, t);
            let k = f32_const(b, inv_cols);
            b.ins().fmul(total, k)
        } else {
            f32_const(b, 0.0)
        };
        let mean_x4 = splat(b, mean);
        let acc = b.declare_var(VECTOR);
        let tail = b.declare_var(SCALAR);
        let z = zero_x4(b);
        b.def_var(acc, z);
        let z = f32_const(b, 0.0);
        b.def_var(tail, z);
        columns(
            b,
            cols,
            |b, c| {
                let a = row_addr(b, src, c);
                let v = load(b, VECTOR, a);
                let d = b.ins().fsub(v, mean_x4);
                let cur = b.use_var(acc);
                let s = b.ins().fma(d, d, cur);
                b.def_var(acc, s);
            },
            |b, c| {
                let a = row_addr(b, src, c);
                let v = load(b, SCALAR, a);
                let d = b.ins().fsub(v, mean);
                let cur = b.use_var(tail);
                let s = b.ins().fma(d, d, cur);
                b.def_var(tail, s);
            },
        );
        let v = b.use_var(acc);
        let lanes = lane_sum(b, v);
        let t = b.use_var(tail);
        let total = b.ins().fadd(lanes, t);
        let k = f32_const(b, inv_cols);
        let var = b.ins().fmul(total, k);
        let eps = f32_const(b, cfg.eps);
        let var_eps = b.ins().fadd(var, eps);
        let root = b.ins().sqrt(var_eps);
        let one = f32_const(b, 1.0);
        let scale = b.ins().fdiv(one, root);
        let scale_x4 = splat(b, scale);
        let write = |b: &mut FunctionBuilder, c, ty, m, s| {
            let a = row_addr(b, src, c);
            let v = load(b, ty, a);
            let d = b.ins().fsub(v, m);
            let n = b.ins().fmul(d, s);
            let wa = f32_addr(b, weight, c);
            let w = load(b, ty, wa);
            let mut y = b.ins().fmul(n, w);
            if let Some(bias) = bias {
                let ba = f32_addr(b, bias, c);
                let bv = load(b, ty, ba);
                y = b.ins().fadd(y, bv);
            }
            let oa = row_addr(b, out, c);
            store(b, y, oa);
        };
        columns(
            b,
            cols,
            |b, c| write(b, c, VECTOR, mean_x4, scale_x4),
            |b, c| write(b, c, SCALAR, mean, scale),
        );
    });
}
