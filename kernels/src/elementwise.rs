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

/// GELU(erf)'s normal tail: `log2 Phi(-a) ~ c0 + c1 a + .. + c6 a^6` for `0 <= a <=`
/// [`GELU_ERF_CLAMP`], a minimax fit weighted by what an error costs `x Phi(x)` (`a Phi(-a) ln 2`
/// per unit of `log2`), with `c0` and `c1` fixed by `Phi(0) = 1/2` and its slope there, so that
/// small `x` keep their relative precision. One `ex2` an element where Abramowitz and Stegun's
/// form takes an `ex2` and a reciprocal; absolute error of `x Phi(x)` below 4e-7 in f32 (their
/// `0.5 x (1 + erf)` gave 4.2e-7).
pub const GELU_LOG2_PHI: [f32; 7] = [
    -1.0,
    -1.151_104_1,
    -0.459_103_23,
    -0.052_950_706,
    0.007_779_5,
    -6.776_469_5e-4,
    2.269_520_9e-5,
];
/// Where [`GELU_LOG2_PHI`]'s fit ends: past `|x| = 6`, `log2 Phi(-|x|)` goes on falling from
/// its value at 6 at [`GELU_TAIL_SLOPE`] a unit, and the tail's factor stays 6 (`x = inf` would
/// otherwise give `inf * 0`).
pub const GELU_ERF_CLAMP: f32 = 6.0;
/// The slope of `log2 Phi(-a)` at 6, rounded: `-(a + 1/a) / ln 2`.
pub const GELU_TAIL_SLOPE: f32 = -9.0;

/// `x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))` in one form for both signs (the CPU kernels' too):
/// `max(x, 0) - |x| Phi(-|x|)`, which is `x Phi(x)` below zero (no cancellation in the negative
/// tail) and `x - x Phi(-x)` above, `Phi(-|x|)` by [`GELU_LOG2_PHI`] up to 6 and
/// [`GELU_TAIL_SLOPE`] past it. The maximum propagates NaN (`|x|`'s minimum would drop
/// it). 14 instructions, one of them MUFU.
fn gelu_erf(k: &mut Kernel, x: Reg) -> Reg {
    let ax = k.op1("abs.f32", RegClass::F32, &x);
    let a = k.op2("min.f32", RegClass::F32, &ax, &F32(GELU_ERF_CLAMP));
    let c = GELU_LOG2_PHI;
    let mut log2_tail = k.fma_f32(&a, &F32(c[6]), &F32(c[5]));
    for ck in c[..5].iter().rev() {
        log2_tail = k.fma_f32(&log2_tail, &a, &F32(*ck));
    }
    let past = k.sub_f32(&ax, &a);
    let log2_tail = k.fma_f32(&past, &F32(GELU_TAIL_SLOPE), &log2_tail);
    let tail = k.op1("ex2.approx.ftz.f32", RegClass::F32, &log2_tail);
    let minus_a = k.op1("neg.f32", RegClass::F32, &a);
    let relu = k.op2("max.NaN.f32", RegClass::F32, &x, &F32(0.0));
    k.fma_f32(&minus_a, &tail, &relu)
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
