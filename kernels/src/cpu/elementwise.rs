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
            // max(x, 0) - |x| Phi(-|x|), as the PTX kernels compute it.
            use crate::elementwise::{GELU_ERF_CLAMP, GELU_LOG2_PHI as C, GELU_TAIL_SLOPE};
            let ax = b.ins().fabs(x);
            let top = constant(b, ty, GELU_ERF_CLAMP);
            let a = b.ins().fmin(ax, top);
            let mut log2_tail = constant(b, ty, C[6]);
            for c in C[..6].iter().rev() {
                let c = constant(b, ty, *c);
                log2_tail = b.ins().fma(log2_tail, a, c);
            }
            let past = b.ins().fsub(ax, a);
            let slope = constant(b, ty, GELU_TAIL_SLOPE);
            let log2_tail = b.ins().fma(past, slope, log2_tail);
            let ln2 = constant(b, ty, std::f32::consts::LN_2);
            let ln_tail = b.ins().fmul(log2_tail, ln2);
            let tail = exp(b, ty, ln_tail);
            let minus_a = b.ins().fneg(a);
            let zero = constant(b, ty, 0.0);
            let relu = b.ins().fmax(x, zero);
            b.ins().fma(minus_a, tail, relu)
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
