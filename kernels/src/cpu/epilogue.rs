//! A product's epilogue, the CPU side of the GEMM kernels' fused tail: the CPU executor computes
//! `y = x w` with a CPU GEMM library into a scratch buffer, and this generated function finishes
//! each row in the GEMM's order — bias, then the activation or SwiGLU (`silu(gate) * up` over the
//! halves `[gate | up]` of `y`'s columns), then the residual. Parameters: `y, [bias], [residual],
//! out`; the parallel axis is rows.

use cranelift_codegen::ir::{InstBuilder, Type, Value};
use cranelift_frontend::FunctionBuilder;
use kiln_ir::kernel::Activation;

use super::elementwise::activation;
use super::module::{f32_addr, for_range, lanes, load, store, Args, CpuError, CpuModule};
use crate::gemm::GemmConfig;

/// The function's name for `cfg` (everything its code depends on).
pub fn name(cfg: &GemmConfig) -> String {
    format!("cpu_epilogue_f32_n{}{}", cfg.n, cfg.epilogue_suffix())
}

/// Whether `cfg` has anything for an epilogue to do (a plain product needs none).
pub fn needed(cfg: &GemmConfig) -> bool {
    cfg.bias || cfg.activation.is_some() || cfg.swiglu || cfg.residual
}

/// Generates the epilogue of `cfg` (f32) into `module`; returns its name.
pub fn epilogue(module: &mut CpuModule, cfg: &GemmConfig) -> Result<String, CpuError> {
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| {
        let mut args = Args::new(p);
        let y = args.next(b);
        let bias = cfg.bias.then(|| args.next(b));
        let residual = cfg.residual.then(|| args.next(b));
        let out = args.next(b);
        let (n, n_out) = (i64::from(cfg.n), i64::from(cfg.n_out()));
        for_range(b, p.begin, p.end, 1, |b, row| {
            let y_row = b.ins().imul_imm_s(row, n);
            let out_row = b.ins().imul_imm_s(row, n_out);
            lanes(b, cfg.n_out(), |b, c, ty| {
                let column = |b: &mut FunctionBuilder, c: Value, ty: Type| {
                    let i = b.ins().iadd(y_row, c);
                    let a = f32_addr(b, y, i);
                    let mut v = load(b, ty, a);
                    if let Some(bias) = bias {
                        let ba = f32_addr(b, bias, c);
                        let bv = load(b, ty, ba);
                        v = b.ins().fadd(v, bv);
                    }
                    v
                };
                let mut v = column(b, c, ty);
                if let Some(act) = cfg.activation {
                    v = activation(b, ty, v, act);
                }
                if cfg.swiglu {
                    let uc = b.ins().iadd_imm_s(c, n_out);
                    let up = column(b, uc, ty);
                    let gate = activation(b, ty, v, Activation::Silu);
                    v = b.ins().fmul(gate, up);
                }
                let oi = b.ins().iadd(out_row, c);
                if let Some(r) = residual {
                    let ra = f32_addr(b, r, oi);
                    let rv = load(b, ty, ra);
                    v = b.ins().fadd(v, rv);
                }
                let oa = f32_addr(b, out, oi);
                store(b, v, oa);
            });
        });
    })?;
    Ok(name)
}
