//! Products with few rows (decode: M = batch <= 8) against `[N, K]` weights: a matrix-vector
//! kernel. A GEMM tile of 64 or 128 columns leaves most SMs idle when M is 1 (GPT-2's
//! 768-column products are 12 blocks), and its time is bound by reading the weights once, so
//! here each warp owns one output column: its lanes stream that weight row along K with 16-byte
//! loads (coalesced, the row is contiguous; four chunks in flight at once), multiply it by every
//! x row, and reduce with
//! shuffles; lane 0 applies the epilogue (bias, activation or SwiGLU, residual) in the GEMM's
//! order. With SwiGLU the warp also streams the matching up row `n + N/2`.

use crate::gemm::{EpiloguePtrs, GemmConfig};
use crate::ptx::{Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

/// The most rows the kernel takes (its accumulators are registers).
pub const MAX_ROWS: u32 = 8;
/// Warps (output columns) per block.
const WARPS: u32 = 8;
/// Chunks of K (32 lanes x 16 bytes each) a lane loads before multiplying, while all are inside K.
const UNROLL: u32 = 4;

/// Whether `cfg` is a product this kernel serves: `[N, K]` weights and at most [`MAX_ROWS`] rows.
pub fn supports(cfg: &GemmConfig) -> bool {
    cfg.transpose_b
        && cfg.m <= MAX_ROWS
        && crate::check_index_range(&[
            u64::from(cfg.n) * u64::from(cfg.k),
            u64::from(cfg.m) * u64::from(cfg.n),
        ])
}

/// Generates the kernel. Parameters: `x, w, [bias], [residual], out`, as the GEMM's.
pub fn gemv(cfg: &GemmConfig, name: String) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "the GEMV kernel needs [N, K] weights and M <= 8"
    );
    let mut k = Kernel::new(&name);
    let x = k.param_ptr("x");
    let w = k.param_ptr("w");
    let epilogue = EpiloguePtrs::declare(&mut k, cfg);
    let e = cfg.elem;
    let n_out = cfg.n_out();
    // 16-byte loads when every row starts 16-byte aligned (buffers are 256-byte aligned).
    let per_load = 16 / e.bytes();
    let vector = (cfg.k * e.bytes()).is_multiple_of(16);
    let step = if vector { per_load } else { 1 };

    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let block = k.special("ctaid.x");
    let col = k.mad_u32(&block, &WARPS, &warp);
    let exit = k.label("exit");
    let outside = k.setp("ge.u32", &col, &n_out);
    k.bra(Some((outside, true)), &exit);

    let zero = F32(0.0);
    let rows = cfg.m as usize;
    let acc: Vec<Reg> = (0..rows).map(|_| k.mov(RegClass::F32, &zero)).collect();
    let acc_up: Vec<Reg> = if cfg.swiglu {
        (0..rows).map(|_| k.mov(RegClass::F32, &zero)).collect()
    } else {
        Vec::new()
    };
    let w_row = k.mul_u32(&col, &cfg.k);
    let up_col = k.add_u32(&col, &n_out);
    let w_up_row = k.mul_u32(&up_col, &cfg.k);

    let load = |k: &mut Kernel, base: Reg, index: &Reg| -> Vec<Reg> {
        let addr = k.address(base, index, e.bytes());
        if vector {
            k.ld_global_vec16(e, addr)
        } else {
            vec![k.ld_global(e, addr)]
        }
    };
    // One pass over `UNROLL` consecutive chunks of the lane's K range starting at `kk`: every
    // weight load is issued before the first multiply, so they are in flight together.
    let chunks = |k: &mut Kernel, kk: &Reg, count: u32| {
        let at: Vec<Reg> = (0..count)
            .map(|u| match u {
                0 => *kk,
                _ => k.add_u32(kk, &(u * 32 * step)),
            })
            .collect();
        let wv: Vec<Vec<Reg>> = at
            .iter()
            .map(|a| {
                let wi = k.add_u32(&w_row, a);
                load(k, w, &wi)
            })
            .collect();
        let wu: Vec<Vec<Reg>> = if cfg.swiglu {
            at.iter()
                .map(|a| {
                    let ui = k.add_u32(&w_up_row, a);
                    load(k, w, &ui)
                })
                .collect()
        } else {
            Vec::new()
        };
        for r in 0..rows {
            for (u, a) in at.iter().enumerate() {
                let xi = k.add_u32(a, &(r as u32 * cfg.k));
                let xv = load(k, x, &xi);
                for (j, xe) in xv.iter().enumerate() {
                    k.fma_into(acc[r], xe, &wv[u][j]);
                    if cfg.swiglu {
                        k.fma_into(acc_up[r], xe, &wu[u][j]);
                    }
                }
            }
        }
    };

    k.comment("lanes stride along K");
    let kk = k.mul_u32(&lane, &step);
    if cfg.k >= UNROLL * 32 * step {
        k.comment("UNROLL chunks at a time while all are inside K");
        let wide = k.label("k_unrolled");
        let rest = k.label("k_rest");
        k.place(&wide);
        let last = k.add_u32(&kk, &((UNROLL - 1) * 32 * step));
        let short = k.setp("ge.u32", &last, &cfg.k);
        k.bra(Some((short, true)), &rest);
        chunks(&mut k, &kk, UNROLL);
        k.emit(format!("add.u32 {kk}, {kk}, {}", UNROLL * 32 * step));
        k.bra(None, &wide);
        k.place(&rest);
        k.comment("the rest one chunk at a time");
    }
    let top = k.label("k_loop");
    let done = k.label("k_done");
    k.place(&top);
    let past = k.setp("ge.u32", &kk, &cfg.k);
    k.bra(Some((past, true)), &done);
    chunks(&mut k, &kk, 1);
    k.emit(format!("add.u32 {kk}, {kk}, {}", 32 * step));
    k.bra(None, &top);
    k.place(&done);

    k.comment("reduce across the warp; lane 0 finishes each row");
    let sums: Vec<Reg> = acc.iter().map(|a| k.warp_sum(*a)).collect();
    let ups: Vec<Reg> = acc_up.iter().map(|a| k.warp_sum(*a)).collect();
    let not_first = k.setp("ne.u32", &lane, &0u32);
    k.bra(Some((not_first, true)), &exit);
    for (r, &sum) in sums.iter().enumerate() {
        let up = ups.get(r).copied();
        epilogue.finish(&mut k, cfg, sum, up, &col, |k| {
            k.add_u32(&col, &(r as u32 * n_out))
        });
    }
    k.place(&exit);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [n_out.div_ceil(WARPS), 1, 1],
            block: [WARPS * 32, 1, 1],
            shared_bytes: 0,
        },
    )
    .on(crate::KernelPath::Gemv)
}
