//! LayerNorm / RMSNorm over rows of `cols` f32 values, optionally of `x + residual`, the CPU
//! side of [`crate::norm`]: per row, the input (summed into the output row first when there is a
//! residual) is reduced four lanes at a time for the mean and then the centred variance (so a
//! large mean does not cancel), and written back scaled. Columns past the last multiple of four
//! take a scalar tail. Parameters: `x, [residual], weight, [bias], out`; the parallel axis is rows.

use cranelift_codegen::ir::InstBuilder;
use cranelift_frontend::FunctionBuilder;
use kiln_ir::kernel::NormKind;

use super::module::{
    f32_addr, f32_const, for_range, lanes, load, splat, store, sum_lanes, Args, CpuError,
    CpuModule, KernelParams, VECTOR,
};
use crate::norm::NormConfig;

/// The function's name for `cfg` (everything its code depends on).
pub fn name(cfg: &NormConfig) -> String {
    format!(
        "cpu_{}{}_f32_c{}_eps{:08x}",
        if cfg.kind == NormKind::LayerNorm {
            "layer_norm"
        } else {
            "rms_norm"
        },
        if cfg.residual { "_residual" } else { "" },
        cfg.cols,
        cfg.eps.to_bits()
    )
}

/// Generates the norm of `cfg` (f32) into `module`; returns its name.
pub fn norm(module: &mut CpuModule, cfg: &NormConfig) -> Result<String, CpuError> {
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| body(b, p, &cfg))?;
    Ok(name)
}

fn body(b: &mut FunctionBuilder, p: KernelParams, cfg: &NormConfig) {
    let layer = cfg.kind == NormKind::LayerNorm;
    let mut args = Args::new(p);
    let x = args.next(b);
    let residual = cfg.residual.then(|| args.next(b));
    let weight = args.next(b);
    let bias = layer.then(|| args.next(b));
    let out = args.next(b);
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
                lanes(b, cols, sum);
                out
            }
            None => x,
        };
        // Mean (LayerNorm), then the sum of squares about it.
        let mean = if layer {
            let total = sum_lanes(b, cols, |b, c, ty| {
                let a = row_addr(b, src, c);
                load(b, ty, a)
            });
            let k = f32_const(b, inv_cols);
            b.ins().fmul(total, k)
        } else {
            f32_const(b, 0.0)
        };
        let mean_x4 = splat(b, mean);
        let total = sum_lanes(b, cols, |b, c, ty| {
            let a = row_addr(b, src, c);
            let v = load(b, ty, a);
            let m = if ty == VECTOR { mean_x4 } else { mean };
            let d = b.ins().fsub(v, m);
            b.ins().fmul(d, d)
        });
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
        lanes(b, cols, |b, c, ty| {
            if ty == VECTOR {
                write(b, c, ty, mean_x4, scale_x4)
            } else {
                write(b, c, ty, mean, scale)
            }
        });
    });
}
