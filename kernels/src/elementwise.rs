//! Elementwise activations over a flat tensor (grid-stride loop, f32 arithmetic).

use kiln_ir::kernel::{Activation, GELU_CUBIC};

use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

/// Threads per block of elementwise kernels.
pub const THREADS: u32 = 256;

/// `act(x)` for f32 `x`, as PTX.
pub fn activation(k: &mut Kernel, x: Reg, act: Activation) -> Reg {
    match act {
        Activation::Relu => k.max_f32(&x, &F32(0.0)),
        Activation::Silu => {
            // x / (1 + e^-x)
            let neg = k.op1("neg.f32", RegClass::F32, &x);
            let e = k.exp_f32(&neg);
            let d = k.add_f32(&e, &F32(1.0));
            // d >= 1: the full-range division is within 2 ulp.
            k.div_full_f32(&x, &d)
        }
        Activation::GeluTanh => {
            // 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the
            // sigmoid form has no cancellation in the negative tail, where 1 + tanh(u) -> 0.
            let x2 = k.mul_f32(&x, &x);
            let x3 = k.mul_f32(&x2, &x);
            let inner = k.fma_f32(&x3, &F32(GELU_CUBIC as f32), &x);
            let minus_2u = k.mul_f32(
                &inner,
                &F32(-2.0 * (2.0 / std::f64::consts::PI).sqrt() as f32),
            );
            let e = k.exp_f32(&minus_2u);
            let d = k.add_f32(&e, &F32(1.0));
            k.div_full_f32(&x, &d)
        }
        Activation::GeluErf => gelu_erf(k, x),
    }
}

/// Abramowitz and Stegun 7.1.26: `erfc(z) ~ t (a1 + t (a2 + ..)) e^(-z^2)`, `t = 1 / (1 + p z)`
/// for `z >= 0` (absolute error of erf below 1.5e-7); the GPU and CPU kernels share it.
pub const ERF_P: f32 = 0.327_591_1;
/// The coefficients `a1..a5` of [`ERF_P`]'s approximation.
pub const ERF_A: [f32; 5] = [
    0.254_829_6,
    -0.284_496_74,
    1.421_413_8,
    -1.453_152,
    1.061_405_4,
];

/// [`ERF_P`]'s approximation as GELU(erf) takes it, over `|x|` rather than `z = |x| / sqrt 2`:
/// `t = 1 / (1 + GELU_ERF_P |x|)`, and the coefficients times -0.5 (exact), so that
/// `t (a1' + t (a2' + ..)) e^(-x^2 / 2) = -0.5 erfc(|x| / sqrt 2)`.
pub const GELU_ERF_P: f32 = ERF_P * std::f32::consts::FRAC_1_SQRT_2;
/// The coefficients of [`GELU_ERF_P`]'s approximation: [`ERF_A`] times -0.5.
pub const GELU_ERF_A: [f32; 5] = [
    -0.5 * ERF_A[0],
    -0.5 * ERF_A[1],
    -0.5 * ERF_A[2],
    -0.5 * ERF_A[3],
    -0.5 * ERF_A[4],
];

/// `x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))` in one form for both signs (the CPU kernels' too):
/// `max(x, 0) - 0.5 |x| erfc(|x| / sqrt 2)`, which is `0.5 x erfc(-x / sqrt 2)` below zero (no
/// cancellation in the negative tail) and `x - 0.5 x erfc(x / sqrt 2)` above, with erfc by
/// [`GELU_ERF_A`] (absolute error of erf below 1.5e-7). `|x|` is clamped to the largest finite
/// f32 so that `x = inf` gives `inf + f32::MAX * 0` rather than `inf * 0`. 15 instructions, two
/// of them MUFU.
fn gelu_erf(k: &mut Kernel, x: Reg) -> Reg {
    let ax = k.op1("abs.f32", RegClass::F32, &x);
    let ax = k.op2("min.f32", RegClass::F32, &ax, &F32(f32::MAX));
    let d = k.fma_f32(&ax, &F32(GELU_ERF_P), &F32(1.0));
    // d >= 1 (no subnormals, no zero): the 1-ulp reciprocal is far inside the approximation's
    // own error.
    let t = k.rcp_approx_f32(&d);
    let a = GELU_ERF_A;
    let mut poly = k.fma_f32(&t, &F32(a[4]), &F32(a[3]));
    for c in a[..3].iter().rev() {
        poly = k.fma_f32(&poly, &t, &F32(*c));
    }
    let poly = k.mul_f32(&poly, &t);
    // e^(-x^2 / 2) = 2^(-x^2 log2(e) / 2)
    let sq = k.mul_f32(&x, &x);
    let scaled = k.mul_f32(&sq, &F32(-0.5 * std::f32::consts::LOG2_E));
    let e = k.op1("ex2.approx.ftz.f32", RegClass::F32, &scaled);
    let minus_half_tail = k.mul_f32(&poly, &e);
    let relu = k.max_f32(&x, &F32(0.0));
    k.fma_f32(&ax, &minus_half_tail, &relu)
}

/// Generates `out[i] = act(x[i])` for `n` elements. Parameters: `x, out, n`.
pub fn activation_kernel(act: Activation, elem: Elem, n: u32) -> GeneratedKernel {
    let name = format!("{}_{}", format!("{act:?}").to_lowercase(), elem.name());
    let mut k = Kernel::new(&name);
    let x = k.param_ptr("x");
    let out = k.param_ptr("out");
    let count = k.param_u32("n");
    let tid = k.special("tid.x");
    let block = k.special("ctaid.x");
    let blocks = k.special("nctaid.x");
    let i = k.mad_u32(&block, &THREADS, &tid);
    let stride = k.mul_u32(&blocks, &THREADS);
    let top = k.label("loop");
    let done = k.label("done");
    k.place(&top);
    let past = k.setp("ge.u32", &i, &count);
    k.bra(Some((past, true)), &done);
    let xa = k.address(x, &i, elem.bytes());
    let v = k.ld_global(elem, xa);
    let y = activation(&mut k, v, act);
    let oa = k.address(out, &i, elem.bytes());
    k.st_global(elem, oa, y);
    k.emit(format!("add.u32 {i}, {i}, {stride}"));
    k.bra(None, &top);
    k.place(&done);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [n.div_ceil(THREADS).clamp(1, 65_535), 1, 1],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}
