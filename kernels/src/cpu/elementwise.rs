//! Activations over a flat f32 tensor, the CPU side of [`crate::elementwise`]: four elements
//! at a time, then a scalar tail, with the GPU kernels' formulas (GELU tails without
//! cancellation). Parameters: `x, out, n`; the parallel axis is elements.

use cranelift_codegen::ir::{InstBuilder, Type, Value};
use cranelift_frontend::FunctionBuilder;
use kiln_ir::kernel::{Activation, GELU_CUBIC};

use super::math::{constant, exp};
use super::module::{arg, f32_addr, for_range, load, store, CpuError, CpuModule, SCALAR, VECTOR};

/// `act(x)` for `x` of type `ty` (`F32` or `F32X4`).
pub fn activation(b: &mut FunctionBuilder, ty: Type, x: Value, act: Activation) -> Value {
    match act {
        Activation::Relu => {
            let zero = constant(b, ty, 0.0);
            b.ins().fmax(x, zero)
        }
        Activation::Silu => {
            let neg = b.ins().fneg(x);
            let e = exp(b, ty, neg);
            let one = constant(b, ty, 1.0);
            let d = b.ins().fadd(e, one);
            b.ins().fdiv(x, d)
        }
        Activation::GeluTanh => {
            // x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): no cancellation as u -> -inf.
            let x2 = b.ins().fmul(x, x);
            let x3 = b.ins().fmul(x2, x);
            let c = constant(b, ty, GELU_CUBIC as f32);
            let inner = b.ins().fma(x3, c, x);
            let k = constant(b, ty, (-2.0 * (2.0 / std::f64::consts::PI).sqrt()) as f32);
            let minus_2u = b.ins().fmul(inner, k);
            let e = exp(b, ty, minus_2u);
            let one = constant(b, ty, 1.0);
            let d = b.ins().fadd(e, one);
            b.ins().fdiv(x, d)
        }
        Activation::GeluErf => {
            // max(x, 0) - 0.5 |x| erfc(|x| / sqrt 2), as the PTX kernels compute it.
            use crate::elementwise::{GELU_ERF_A as A, GELU_ERF_P as P};
            let ax = b.ins().fabs(x);
            let top = constant(b, ty, f32::MAX);
            let ax = b.ins().fmin(ax, top);
            let p = constant(b, ty, P);
            let one = constant(b, ty, 1.0);
            let d = b.ins().fma(ax, p, one);
            let t = b.ins().fdiv(one, d);
            let mut poly = constant(b, ty, A[4]);
            for a in A[..4].iter().rev() {
                let a = constant(b, ty, *a);
                poly = b.ins().fma(poly, t, a);
            }
            poly = b.ins().fmul(poly, t);
            let sq = b.ins().fmul(x, x);
            let minus_half = constant(b, ty, -0.5);
            let arg = b.ins().fmul(sq, minus_half);
            let e = exp(b, ty, arg);
            let minus_half_tail = b.ins().fmul(poly, e);
            let zero = constant(b, ty, 0.0);
            let relu = b.ins().fmax(x, zero);
            b.ins().fma(ax, minus_half_tail, relu)
        }
    }
}

/// The function's name for `act`.
pub fn name(act: Activation) -> String {
    format!("cpu_{}_f32", format!("{act:?}").to_lowercase())
}

/// Generates `out[i] = act(x[i])` for `i` in `begin..end` into `module`; returns its name.
pub fn activation_kernel(module: &mut CpuModule, act: Activation) -> Result<String, CpuError> {
    let name = name(act);
    module.define(&name, |b, p| {
        let x = arg(b, p, 0);
        let out = arg(b, p, 1);
        // Whole vectors from `begin`, then the scalar tail up to `end`.
        let len = b.ins().isub(p.end, p.begin);
        let whole = b.ins().band_imm_s(len, !3i64);
        let split = b.ins().iadd(p.begin, whole);
        let apply = |b: &mut FunctionBuilder, i: Value, ty: Type| {
            let xa = f32_addr(b, x, i);
            let v = load(b, ty, xa);
            let y = activation(b, ty, v, act);
            let oa = f32_addr(b, out, i);
            store(b, y, oa);
        };
        for_range(b, p.begin, split, 4, |b, i| apply(b, i, VECTOR));
        for_range(b, split, p.end, 1, |b, i| apply(b, i, SCALAR));
    })?;
    Ok(name)
}
