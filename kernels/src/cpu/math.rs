//! Transcendentals for the CPU kernels, in Cranelift IR for `f32` and `f32x4` alike (the same
//! instructions; constants are splatted for vectors): `exp` by Cody-Waite range reduction and a
//! degree-6 polynomial (relative error about 2e-7 over the whole range), and `1 + erf(z)` by
//! Abramowitz and Stegun 7.1.26 computed without cancellation in the negative tail (the strided
//! `erf`; GELU(erf) has its own form, [`crate::elementwise::GELU_LOG2_PHI`]).

use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::types::{F32X4, I32, I32X4};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::FunctionBuilder;

/// The constant `v` as `ty` (`F32`, or `F32X4` with `v` in every lane).
pub fn constant(b: &mut FunctionBuilder, ty: Type, v: f32) -> Value {
    let s = b.ins().f32const(v);
    if ty == F32X4 {
        b.ins().splat(F32X4, s)
    } else {
        s
    }
}

/// `e^x`; 0 below -87.3 (flushes instead of going subnormal) and `+inf` above 88.7.
pub fn exp(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let int_ty = if ty == F32X4 { I32X4 } else { I32 };
    let hi = constant(b, ty, 88.72);
    let lo = constant(b, ty, -87.33);
    let clamped = b.ins().fmin(x, hi);
    let clamped = b.ins().fmax(clamped, lo);
    // x = n ln 2 + r, |r| <= ln 2 / 2; ln 2 split in two so that n ln2_hi is exact.
    let log2e = constant(b, ty, std::f32::consts::LOG2_E);
    let scaled = b.ins().fmul(clamped, log2e);
    let n = b.ins().nearest(scaled);
    let ln2_hi = constant(b, ty, -0.693_145_75);
    let ln2_lo = constant(b, ty, -1.428_606_8e-6);
    let r = b.ins().fma(n, ln2_hi, clamped);
    let r = b.ins().fma(n, ln2_lo, r);
    // e^r by its Taylor series to r^6 (Horner).
    let coeffs = [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let mut p = constant(b, ty, coeffs[0]);
    for c in &coeffs[1..] {
        let c = constant(b, ty, *c);
        p = b.ins().fma(p, r, c);
    }
    // 2^n from its exponent bits; n >= -126 keeps it normal (the clamp above ensures that).
    let ni = b.ins().fcvt_to_sint_sat(int_ty, n);
    let bias = b.ins().iconst(I32, 127);
    let bias = if ty == F32X4 {
        b.ins().splat(I32X4, bias)
    } else {
        bias
    };
    let biased = b.ins().iadd(ni, bias);
    let shift = b.ins().iconst(I32, 23);
    let bits = b.ins().ishl(biased, shift);
    let two_n = b.ins().bitcast(ty, MemFlagsData::new(), bits);
    b.ins().fmul(p, two_n)
}

/// Abramowitz and Stegun 7.1.26: `erfc(z) ~ t (a1 + t (a2 + ..)) e^(-z^2)`, `t = 1 / (1 + p z)`
/// for `z >= 0` (absolute error of erf below 1.5e-7).
const ERF_P: f32 = 0.327_591_1;
/// The coefficients `a1..a5` of [`ERF_P`]'s approximation.
const ERF_A: [f32; 5] = [
    0.254_829_6,
    -0.284_496_74,
    1.421_413_8,
    -1.453_152,
    1.061_405_4,
];

/// `1 + erf(z)`: with `tail = erfc(|z|)`, `tail` for negative `z` and `2 - tail` otherwise.
pub fn one_plus_erf(b: &mut FunctionBuilder, ty: Type, z: Value) -> Value {
    let az = b.ins().fabs(z);
    let p = constant(b, ty, ERF_P);
    let one = constant(b, ty, 1.0);
    let d = b.ins().fma(az, p, one);
    let t = b.ins().fdiv(one, d);
    let mut poly = constant(b, ty, ERF_A[4]);
    for a in ERF_A[..4].iter().rev() {
        let a = constant(b, ty, *a);
        poly = b.ins().fma(poly, t, a);
    }
    poly = b.ins().fmul(poly, t);
    let sq = b.ins().fmul(az, az);
    let neg = b.ins().fneg(sq);
    let e = exp(b, ty, neg);
    let tail = b.ins().fmul(poly, e);
    let two = constant(b, ty, 2.0);
    let upper = b.ins().fsub(two, tail);
    let zero = constant(b, ty, 0.0);
    let negative = b.ins().fcmp(FloatCC::LessThan, z, zero);
    if ty == F32X4 {
        // Lane masks (all ones where negative) pick between the two forms bitwise.
        let mask = b.ins().bitcast(F32X4, MemFlagsData::new(), negative);
        b.ins().bitselect(mask, tail, upper)
    } else {
        b.ins().select(negative, tail, upper)
    }
}

/// RoPE's rotate-half: `(lo, hi) -> (lo cos - hi sin, hi cos + lo sin)`.
pub fn rotated(
    b: &mut FunctionBuilder,
    lo: Value,
    hi: Value,
    cos: Value,
    sin: Value,
) -> (Value, Value) {
    let lc = b.ins().fmul(lo, cos);
    let hs = b.ins().fmul(hi, sin);
    let out_lo = b.ins().fsub(lc, hs);
    let hc = b.ins().fmul(hi, cos);
    let out_hi = b.ins().fma(lo, sin, hc);
    (out_lo, out_hi)
}
