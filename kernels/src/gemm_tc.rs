//! The tensor-core GEMM for f16 / bf16 with weights stored `[N, K]` (a `Linear`; the compiler can
//! store any other weight transposed, weights being constants): `mma.sync.m16n8k16` with f32
//! accumulators, operands staged through dynamic shared memory by `cp.async` (`STAGES` deep,
//! 16-byte chunks, zero-filled past the matrix edges) and read with `ldmatrix`, rows padded by 16
//! bytes so that `ldmatrix` is free of bank conflicts.
//!
//! Block tile 128 x 128 x 64, 8 warps as 2 x 4, each warp 64 x 32 (4 x 4 m16n8 tiles). The
//! epilogue (bias, activation, SwiGLU, residual) runs on the accumulators in registers. With
//! SwiGLU (`[gate; up]` weight rows), a block computes 64 output columns: it stages gate and up
//! rows interleaved (`gate c, up c, gate c + 1, ...`), so each thread's accumulator pair
//! (columns `2t`, `2t + 1` of an n8 tile) holds the gate and up sums of one output column.

use crate::gemm::{EpiloguePtrs, GemmConfig};
use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

const BM: u32 = 128;
const BN: u32 = 128;
const BK: u32 = 64;
const THREADS: u32 = 256;
/// Bytes per staged row: BK halves plus 16 bytes of padding.
const ROW_BYTES: u32 = BK * 2 + 16;
const TILE_BYTES: u32 = BM * ROW_BYTES;
/// Pipeline depth: tiles in flight while one is multiplied.
pub const STAGES: u32 = 3;

/// Whether `cfg` can use the tensor-core kernel.
pub fn supports(cfg: &GemmConfig) -> bool {
    let (m, n, k) = (u64::from(cfg.m), u64::from(cfg.n), u64::from(cfg.k));
    cfg.elem != Elem::F32
        && cfg.transpose_b
        && (!cfg.swiglu || cfg.n.is_multiple_of(2))
        && cfg.k.is_multiple_of(8)
        && crate::check_index_range(&[m * n, m * k, n * k])
}

/// Generates the kernel. Parameters: `x, w, [bias], [residual], out`.
pub fn gemm_tc(cfg: &GemmConfig, name: String) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "the tensor-core GEMM needs f16/bf16, [N, K] weights, K % 8 == 0 (N even with SwiGLU)"
    );
    assert!(
        cfg.row_norm.is_none(),
        "only the Hopper GEMM carries a row norm"
    );
    let mut k = Kernel::new(&name);
    let x = k.param_ptr("x");
    let w = k.param_ptr("w");
    let epilogue = EpiloguePtrs::declare(&mut k, cfg);
    let smem = k.dynamic_shared("gemm_tiles");
    let block = TcBlock::start(&mut k, cfg, &smem, [x, w]);
    let zero = F32(0.0);
    // acc[i][j][r]: m-tile i (of 4), n-tile j (of 4), register r (of 4).
    let acc: Vec<Reg> = (0..64).map(|_| k.mov(RegClass::F32, &zero)).collect();
    block.prologue(&mut k);
    let lanes = block.fragment_lanes(&mut k);
    block.main_loop(&mut k, lanes, &acc);
    block.epilogue(&mut k, &epilogue, &acc);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.n_out().div_ceil(block.bn_out), cfg.m.div_ceil(BM), 1],
            block: [THREADS, 1, 1],
            shared_bytes: STAGES * 2 * TILE_BYTES,
        },
    )
    .on(crate::KernelPath::Mma)
}

/// Chunks of 8 halves (16 bytes) in a staged row.
const CHUNKS_PER_ROW: u32 = BK / 8;

/// A block's place: its thread, lane and warp (2 x 4 warps: `wm`, `wn`), its first output row
/// and column (`bn_out` columns, half the tile's with SwiGLU), the stages' shared base, and the
/// operands `x` and `w`.
struct TcBlock<'a> {
    cfg: &'a GemmConfig,
    tid: Reg,
    lane: Reg,
    wm: Reg,
    wn: Reg,
    m0: Reg,
    n0: Reg,
    base: Reg,
    bn_out: u32,
    operands: [Reg; 2],
}

impl<'a> TcBlock<'a> {
    fn start(k: &mut Kernel, cfg: &'a GemmConfig, smem: &str, operands: [Reg; 2]) -> TcBlock<'a> {
        let tid = k.special("tid.x");
        let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
        let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
        let wm = k.op2("shr.u32", RegClass::B32, &warp, &2u32); // 0..2
        let wn = k.op2("and.b32", RegClass::B32, &warp, &3u32); // 0..4
        let bx = k.special("ctaid.x");
        let by = k.special("ctaid.y");
        let m0 = k.mul_u32(&by, &BM);
        // Output columns per block: BN, or BN / 2 with SwiGLU (gate and up rows interleaved).
        let bn_out = if cfg.swiglu { BN / 2 } else { BN };
        let n0 = k.mul_u32(&bx, &bn_out);
        let base = k.shared_base(smem);
        TcBlock {
            cfg,
            tid,
            lane,
            wm,
            wn,
            m0,
            n0,
            base,
            bn_out,
            operands,
        }
    }

    /// Copies one BM x BK tile of rows (`rows_total` rows of K halves at `src`, starting at row
    /// `r0`, column `k0`) into shared memory at `dst`, in 16-byte chunks of 8 halves. With
    /// `interleave`, tile row `2c + u` is row `r0 + c` of the gate half (u = 0) or the up half
    /// (u = 1, `rows_total` rows further).
    fn stage(
        &self,
        k: &mut Kernel,
        (src, r0, rows_total): (Reg, Reg, u32),
        (k0, dst): (&Reg, Reg),
        interleave: bool,
    ) {
        let cfg = self.cfg;
        for c in 0..(BM * CHUNKS_PER_ROW / THREADS) {
            let chunk = k.add_u32(&self.tid, &(c * THREADS));
            let row = k.op2(
                "shr.u32",
                RegClass::B32,
                &chunk,
                &CHUNKS_PER_ROW.trailing_zeros(),
            );
            let kc = k.op2("and.b32", RegClass::B32, &chunk, &(CHUNKS_PER_ROW - 1));
            let (grow, in_rows) = if interleave {
                let pair = k.op2("shr.u32", RegClass::B32, &row, &1u32);
                let up = k.op2("and.b32", RegClass::B32, &row, &1u32);
                let c = k.add_u32(&r0, &pair);
                let in_rows = k.setp("lt.u32", &c, &rows_total);
                (k.mad_u32(&up, &rows_total, &c), in_rows)
            } else {
                let grow = k.add_u32(&r0, &row);
                let in_rows = k.setp("lt.u32", &grow, &rows_total);
                (grow, in_rows)
            };
            let kofs = k.mul_u32(&kc, &8u32);
            let gk = k.add_u32(k0, &kofs);
            let k_ok = k.setp("lt.u32", &gk, &cfg.k);
            let ok = k.reg(RegClass::Pred);
            k.emit(format!("and.pred {ok}, {in_rows}, {k_ok}"));
            let bytes = k.selp(RegClass::B32, "u32", &16u32, &0u32, ok);
            // Out-of-range chunks read nothing (zero-filled) from a clamped, valid address.
            let safe_row = k.selp(RegClass::B32, "u32", &grow, &0u32, ok);
            let safe_k = k.selp(RegClass::B32, "u32", &gk, &0u32, ok);
            let idx = k.mad_u32(&safe_row, &cfg.k, &safe_k);
            let gaddr = k.address(src, &idx, 2);
            let srow = k.mul_u32(&row, &ROW_BYTES);
            let scol = k.mul_u32(&kc, &16u32);
            let s0 = k.add_u32(&dst, &srow);
            let saddr = k.add_u32(&s0, &scol);
            k.emit(format!(
                "cp.async.cg.shared.global [{saddr}], [{gaddr}], 16, {bytes}"
            ));
        }
    }

    /// Stage `s`'s A and B tiles in shared memory.
    fn stage_tiles(&self, k: &mut Kernel, s: &Reg) -> (Reg, Reg) {
        let off = k.mul_u32(s, &(2 * TILE_BYTES));
        let a = k.add_u32(&self.base, &off);
        let b = k.add_u32(&a, &TILE_BYTES);
        (a, b)
    }

    /// Copies K tile `k0(k)` of x's and w's rows into stage `s`.
    fn load(&self, k: &mut Kernel, s: &Reg, k0: impl FnOnce(&mut Kernel) -> Reg) {
        let [x, w] = self.operands;
        let (a, b) = self.stage_tiles(k, s);
        let k0 = k0(k);
        let cfg = self.cfg;
        self.stage(k, (x, self.m0, cfg.m), (&k0, a), false);
        self.stage(k, (w, self.n0, cfg.n_out()), (&k0, b), cfg.swiglu);
    }

    fn prologue(&self, k: &mut Kernel) {
        k.comment("prologue: stage the first STAGES - 1 tiles (empty groups past the end)");
        for s in 0..STAGES - 1 {
            let idx = k.mov(RegClass::B32, &s);
            if s < self.cfg.k.div_ceil(BK) {
                self.load(k, &idx, |k| k.mov(RegClass::B32, &(s * BK)));
            }
            k.emit("cp.async.commit_group");
        }
    }

    /// This lane's `ldmatrix` addresses relative to a stage's A and B tiles.
    fn fragment_lanes(&self, k: &mut Kernel) -> (Reg, Reg) {
        let lane = &self.lane;
        let l15 = k.op2("and.b32", RegClass::B32, lane, &15u32);
        let lhi = k.op2("shr.u32", RegClass::B32, lane, &4u32);
        let a_row = k.mad_u32(&self.wm, &64u32, &l15);
        let a_lane_row = k.mul_u32(&a_row, &ROW_BYTES);
        let a_lane_k = k.mul_u32(&lhi, &16u32);
        let a_lane = k.add_u32(&a_lane_row, &a_lane_k);
        let l7 = k.op2("and.b32", RegClass::B32, lane, &7u32);
        let l3 = k.op2("shr.u32", RegClass::B32, lane, &3u32);
        let l3b = k.op2("and.b32", RegClass::B32, &l3, &1u32);
        let b_n = k.mad_u32(&lhi, &8u32, &l7);
        let b_row = k.mad_u32(&self.wn, &32u32, &b_n);
        let b_lane_row = k.mul_u32(&b_row, &ROW_BYTES);
        let b_lane_k = k.mul_u32(&l3b, &16u32);
        let b_lane = k.add_u32(&b_lane_row, &b_lane_k);
        (a_lane, b_lane)
    }

    /// The K tiles: each turn stages tile `kt + STAGES - 1`, waits for tile `kt` and multiplies
    /// it into the accumulators.
    fn main_loop(&self, k: &mut Kernel, (a_lane, b_lane): (Reg, Reg), acc: &[Reg]) {
        let k_tiles = self.cfg.k.div_ceil(BK);
        let kt = k.mov(RegClass::B32, &0u32);
        let top = k.label("k_tiles");
        let done = k.label("k_tiles_done");
        k.place(&top);
        let past = k.setp("ge.u32", &kt, &k_tiles);
        k.bra(Some((past, true)), &done);
        k.comment(
            "stage tile kt + STAGES - 1 (an empty group past the end), then wait for tile kt",
        );
        let next = k.add_u32(&kt, &(STAGES - 1));
        let has_next = k.setp("lt.u32", &next, &k_tiles);
        let skip_stage = k.label("skip_stage");
        k.bra(Some((has_next, false)), &skip_stage);
        let nstage = k.op2("rem.u32", RegClass::B32, &next, &STAGES);
        self.load(k, &nstage, |k| k.mul_u32(&next, &BK));
        k.place(&skip_stage);
        k.emit("cp.async.commit_group");
        k.emit(format!("cp.async.wait_group {}", STAGES - 1));
        k.barrier();
        let cur = k.op2("rem.u32", RegClass::B32, &kt, &STAGES);
        let (ac, bc) = self.stage_tiles(k, &cur);
        let a_base = k.add_u32(&ac, &a_lane);
        let b_base = k.add_u32(&bc, &b_lane);
        for kk in 0..BK / 16 {
            self.multiply(k, [a_base, b_base], kk, acc);
        }
        k.barrier();
        k.emit(format!("add.u32 {kt}, {kt}, 1"));
        k.bra(None, &top);
        k.place(&done);
        k.emit("cp.async.wait_group 0");
    }

    /// The 16-wide K step `kk` of a staged tile: fragments by `ldmatrix`, then the warp's 4 x 4
    /// `mma`s.
    fn multiply(&self, k: &mut Kernel, [a_base, b_base]: [Reg; 2], kk: u32, acc: &[Reg]) {
        let mut a_frag = Vec::new();
        for i in 0..4u32 {
            a_frag.push(k.ldmatrix_x4("", a_base, i * 16 * ROW_BYTES + kk * 32));
        }
        let mut b_frag = Vec::new();
        for jj in 0..2u32 {
            let r = k.ldmatrix_x4("", b_base, jj * 16 * ROW_BYTES + kk * 32);
            // n-tile 2jj: (r0, r1); n-tile 2jj+1: (r2, r3).
            b_frag.push([r[0], r[1]]);
            b_frag.push([r[2], r[3]]);
        }
        let ty = self.cfg.elem.name();
        for (i, a) in a_frag.iter().enumerate() {
            for (j, b) in b_frag.iter().enumerate() {
                let c = &acc[(i * 4 + j) * 4..(i * 4 + j) * 4 + 4];
                k.mma_m16n8k16(ty, c, a, b);
            }
        }
    }

    /// The epilogue on the accumulators, each element inside the output stored.
    fn epilogue(&self, k: &mut Kernel, epilogue: &EpiloguePtrs, acc: &[Reg]) {
        let cfg = self.cfg;
        let n_out = cfg.n_out();
        k.comment("epilogue on the accumulators");
        let g = k.op2("shr.u32", RegClass::B32, &self.lane, &2u32);
        let t = k.op2("and.b32", RegClass::B32, &self.lane, &3u32);
        let wrow = k.mad_u32(&self.wm, &64u32, &self.m0);
        let row_base = k.add_u32(&wrow, &g);
        // The thread's first column: 2t of its n8 tile, or its output column t with SwiGLU.
        let (warp_cols, per_tile, lane_col) = if cfg.swiglu {
            (16u32, 4u32, t)
        } else {
            (32, 8, k.mul_u32(&t, &2u32))
        };
        let wcol = k.mad_u32(&self.wn, &warp_cols, &self.n0);
        let col_base = k.add_u32(&wcol, &lane_col);
        for i in 0..4u32 {
            for j in 0..4u32 {
                for r in 0..4u32 {
                    // With SwiGLU the pair (r, r + 1) is (gate, up) of one column.
                    if cfg.swiglu && r % 2 == 1 {
                        continue;
                    }
                    let skip = k.label("skip");
                    let row = k.add_u32(&row_base, &(i * 16 + (r / 2) * 8));
                    let col_off = j * per_tile + if cfg.swiglu { 0 } else { r % 2 };
                    let col = k.add_u32(&col_base, &col_off);
                    let out_row = k.setp("ge.u32", &row, &cfg.m);
                    k.bra(Some((out_row, true)), &skip);
                    let out_col = k.setp("ge.u32", &col, &n_out);
                    k.bra(Some((out_col, true)), &skip);
                    let at = ((i * 4 + j) * 4 + r) as usize;
                    let up = cfg.swiglu.then(|| acc[at + 1]);
                    epilogue.finish(k, cfg, acc[at], up, &col, |k| k.mad_u32(&row, &n_out, &col));
                    k.place(&skip);
                }
            }
        }
    }
}
