//! FlashAttention-2 style prefill attention on tensor cores, f16 / bf16: a block of 4 warps takes
//! 64 query rows (16 per warp) and walks the keys in tiles of 64; `S = Q K^T` and `O += P V` are
//! `mma.sync.m16n8k16` with f32 accumulators, Q/K/V tiles staged by `cp.async` and read with
//! `ldmatrix` (`.trans` for V; K/V double-buffered), the online softmax kept in registers (base 2, quad shuffles for
//! the row max), P re-packed from the score accumulators as the A operand of the second product,
//! and key tiles past the causal diagonal skipped.
//!
//! Covers causal / all-keys rules, padding masks and GQA with the head dimension a multiple of 16
//! (up to 128); RoPE, dropout, windows and KV caches take the SIMT kernel (`crate::attention`).

use crate::attention::{AttentionConfig, KeyRule};
use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

const BQ: u32 = 64;
const BKV: u32 = 64;
const WARPS: u32 = 4;

/// Whether `cfg` can use the tensor-core kernel.
pub fn supports(cfg: &AttentionConfig) -> bool {
    cfg.elem != Elem::F32
        && cfg.head_dim.is_multiple_of(16)
        && cfg.head_dim <= 128
        && !cfg.rope
        && cfg.dropout.is_none()
        && cfg.splits == 1
        && matches!(cfg.keys, KeyRule::All | KeyRule::Causal { window: None })
        && cfg.strides.iter().all(|s| s.iter().all(|v| v % 8 == 0))
}

/// Generates the kernel. Parameters: `q, k, v, out, [mask]`.
pub fn attention_tc(cfg: &AttentionConfig, name: String) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "configuration needs the SIMT attention kernel"
    );
    let e = cfg.elem;
    let ty = e.name();
    let d = cfg.head_dim;
    let row_bytes = d * 2 + 16;
    let tile_bytes = BKV * row_bytes;
    let mut k = Kernel::new(&name);
    let q = k.param_ptr("q");
    let kp = k.param_ptr("k");
    let v = k.param_ptr("v");
    let out = k.param_ptr("out");
    let mask = cfg.padding.then(|| k.param_ptr("mask"));
    let smem = k.dynamic_shared("attention_tiles");
    let [qs, ks, vs, os] = cfg.strides;
    let causal = matches!(cfg.keys, KeyRule::Causal { .. });

    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let qb = k.special("ctaid.x");
    let h = k.special("ctaid.y");
    let b = k.special("ctaid.z");
    let q0 = k.mul_u32(&qb, &BQ);
    let kvh = k.op2("div.u32", RegClass::B32, &h, &(cfg.heads / cfg.kv_heads));
    let base = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {base}, {smem}"));
    let q_tile = base;
    // Two K/V buffers: the next tile streams in while this one is multiplied.
    let kv_base = k.add_u32(&base, &(BQ * row_bytes));
    let buffer = |k: &mut Kernel, index: Reg| -> (Reg, Reg) {
        let kt = k.mad_u32(&index, &(2 * tile_bytes), &kv_base);
        let vt = k.add_u32(&kt, &tile_bytes);
        (kt, vt)
    };
    let k_tile = kv_base;
    let v_tile = k.add_u32(&kv_base, &tile_bytes);
    let head_base = |k: &mut Kernel, strides: [u32; 3], head: Reg| -> Reg {
        let t0 = k.mul_u32(&b, &strides[0]);
        k.mad_u32(&head, &strides[1], &t0)
    };
    let q_head = head_base(&mut k, qs, h);
    let k_head = head_base(&mut k, ks, kvh);
    let v_head = head_base(&mut k, vs, kvh);
    let o_head = head_base(&mut k, os, h);

    // Copies rows r0.. of a [rows, d] tile (row stride `stride` elements) into shared memory.
    let chunks_per_row = d / 8;
    let stage = |k: &mut Kernel, src: Reg, head: Reg, stride: u32, r0: Reg, rows: u32, dst: Reg| {
        let total = BKV * chunks_per_row;
        for c in 0..total.div_ceil(32 * WARPS) {
            let chunk = k.add_u32(&tid, &(c * 32 * WARPS));
            let in_tile = k.setp("lt.u32", &chunk, &total);
            let skip = k.label("skip_chunk");
            k.bra(Some((in_tile, false)), &skip);
            let row = k.op2("div.u32", RegClass::B32, &chunk, &chunks_per_row);
            let kc = k.op2("rem.u32", RegClass::B32, &chunk, &chunks_per_row);
            let grow = k.add_u32(&r0, &row);
            let ok = k.setp("lt.u32", &grow, &rows);
            let bytes = k.selp(RegClass::B32, "u32", &16u32, &0u32, ok);
            let safe = k.selp(RegClass::B32, "u32", &grow, &0u32, ok);
            let r_off = k.mad_u32(&safe, &stride, &head);
            let idx = k.mad_u32(&kc, &8u32, &r_off);
            let g = k.address(src, &idx, 2);
            let s_row = k.mad_u32(&row, &row_bytes, &dst);
            let s = k.mad_u32(&kc, &16u32, &s_row);
            k.emit(format!(
                "cp.async.cg.shared.global [{s}], [{g}], 16, {bytes}"
            ));
            k.place(&skip);
        }
    };

    k.comment("Q tile -> shared -> A fragments (16 rows per warp)");
    stage(&mut k, q, q_head, qs[2], q0, cfg.q_len, q_tile);
    k.emit("cp.async.commit_group");
    k.emit("cp.async.wait_group 0");
    k.barrier();
    let l15 = k.op2("and.b32", RegClass::B32, &lane, &15u32);
    let lhi = k.op2("shr.u32", RegClass::B32, &lane, &4u32);
    let a_row = k.mad_u32(&warp, &16u32, &l15);
    let a_addr0 = k.mad_u32(&a_row, &row_bytes, &q_tile);
    let a_addr = k.mad_u32(&lhi, &16u32, &a_addr0);
    let mut q_frag = Vec::new();
    for kk in 0..d / 16 {
        let r: Vec<Reg> = (0..4).map(|_| k.reg(RegClass::B32)).collect();
        k.emit(format!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{}, {}, {}, {}}}, [{a_addr}+{}]",
            r[0],
            r[1],
            r[2],
            r[3],
            kk * 32
        ));
        q_frag.push(r);
    }

    // Per thread: rows g and g + 8 of its warp's 16; columns 2t, 2t + 1 of each n8 tile.
    let g = k.op2("shr.u32", RegClass::B32, &lane, &2u32);
    let t = k.op2("and.b32", RegClass::B32, &lane, &3u32);
    let wrow = k.mad_u32(&warp, &16u32, &q0);
    let row0 = k.add_u32(&wrow, &g);
    let row1 = k.add_u32(&row0, &8u32);
    let m = [
        k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)),
        k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)),
    ];
    let l = [
        k.mov(RegClass::F32, &F32(0.0)),
        k.mov(RegClass::F32, &F32(0.0)),
    ];
    let d_tiles = d / 8;
    let o: Vec<Reg> = (0..d_tiles * 4)
        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
        .collect();

    // Keys [0, end): causal blocks stop at the block's last query row.
    let end = if causal {
        let last = k.add_u32(&q0, &(BQ - 1 + cfg.kv_len - cfg.q_len));
        let after = k.add_u32(&last, &1u32);
        k.op2("min.u32", RegClass::B32, &after, &cfg.kv_len)
    } else {
        k.mov(RegClass::B32, &cfg.kv_len)
    };
    // ldmatrix lane offsets for K (as B, non-transposed) and V (transposed).
    let l7 = k.op2("and.b32", RegClass::B32, &lane, &7u32);
    let l3 = k.op2("shr.u32", RegClass::B32, &lane, &3u32);
    let l3b = k.op2("and.b32", RegClass::B32, &l3, &1u32);
    let kn = k.mad_u32(&lhi, &8u32, &l7);
    let k_lane0 = k.mad_u32(&kn, &row_bytes, &k_tile);
    let k_lane = k.mad_u32(&l3b, &16u32, &k_lane0);
    let v_lane0 = k.mad_u32(&l15, &row_bytes, &v_tile);
    let v_lane = k.mad_u32(&lhi, &16u32, &v_lane0);
    let scale = F32(cfg.scale * std::f32::consts::LOG2_E);

    let j0 = k.mov(RegClass::B32, &0u32);
    let it = k.mov(RegClass::B32, &0u32);
    k.comment("prologue: the first K/V tile into buffer 0");
    stage(&mut k, kp, k_head, ks[2], j0, cfg.kv_len, k_tile);
    stage(&mut k, v, v_head, vs[2], j0, cfg.kv_len, v_tile);
    k.emit("cp.async.commit_group");
    let top = k.label("kv_tiles");
    let done = k.label("kv_tiles_done");
    k.place(&top);
    let finished = k.setp("ge.u32", &j0, &end);
    k.bra(Some((finished, true)), &done);
    k.comment("stream the next tile into the other buffer (an empty group past the end)");
    let j_next = k.add_u32(&j0, &BKV);
    let has_next = k.setp("lt.u32", &j_next, &end);
    let skip_next = k.label("skip_next");
    k.bra(Some((has_next, false)), &skip_next);
    let it_next = k.add_u32(&it, &1u32);
    let next_buf = k.op2("and.b32", RegClass::B32, &it_next, &1u32);
    let (kn_tile, vn_tile) = buffer(&mut k, next_buf);
    stage(&mut k, kp, k_head, ks[2], j_next, cfg.kv_len, kn_tile);
    stage(&mut k, v, v_head, vs[2], j_next, cfg.kv_len, vn_tile);
    k.place(&skip_next);
    k.emit("cp.async.commit_group");
    k.emit("cp.async.wait_group 1");
    k.barrier();
    let cur_buf = k.op2("and.b32", RegClass::B32, &it, &1u32);
    let buf_off = k.mul_u32(&cur_buf, &(2 * tile_bytes));
    let k_lane_cur = k.add_u32(&k_lane, &buf_off);
    let v_lane_cur = k.add_u32(&v_lane, &buf_off);

    k.comment("S = Q K^T (16 x 64 per warp)");
    let s: Vec<Reg> = (0..(BKV / 8) * 4)
        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
        .collect();
    for (kk, a) in q_frag.iter().enumerate() {
        for jj in 0..BKV / 16 {
            let r: Vec<Reg> = (0..4).map(|_| k.reg(RegClass::B32)).collect();
            let off = jj * 16 * row_bytes + kk as u32 * 32;
            k.emit(format!(
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{}, {}, {}, {}}}, [{k_lane_cur}+{off}]",
                r[0], r[1], r[2], r[3]
            ));
            for (half, bf) in [[r[0], r[1]], [r[2], r[3]]].iter().enumerate() {
                let n = (jj as usize * 2 + half) * 4;
                let c = &s[n..n + 4];
                k.emit(format!(
                    "mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{}, {}, {}, {}}}, {{{}, {}, {}, {}}}, {{{}, {}}}, {{{}, {}, {}, {}}}",
                    c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], bf[0], bf[1], c[0], c[1], c[2], c[3]
                ));
            }
        }
    }
    k.comment("scale to base 2; mask keys past the end, past the diagonal, or padded");
    let neg_inf = F32(f32::NEG_INFINITY);
    for nt in 0..BKV / 8 {
        for r in 0..4u32 {
            let reg = s[(nt * 4 + r) as usize];
            k.emit(format!(
                "mul.rn.f32 {reg}, {reg}, {}",
                crate::ptx::Operand::text(&scale)
            ));
            let col0 = k.mad_u32(&t, &2u32, &j0);
            let col = k.add_u32(&col0, &(nt * 8 + r % 2));
            let out_of_range = k.setp("ge.u32", &col, &cfg.kv_len);
            k.emit(format!(
                "@{out_of_range} mov.f32 {reg}, {}",
                crate::ptx::Operand::text(&neg_inf)
            ));
            if causal {
                let row = if r < 2 { row0 } else { row1 };
                let last = k.add_u32(&row, &(cfg.kv_len - cfg.q_len));
                let future = k.setp("gt.u32", &col, &last);
                k.emit(format!(
                    "@{future} mov.f32 {reg}, {}",
                    crate::ptx::Operand::text(&neg_inf)
                ));
            }
            if let Some(mk) = mask {
                let skip = k.label("skip_mask");
                k.bra(Some((out_of_range, true)), &skip);
                let mi = k.mad_u32(&b, &cfg.kv_len, &col);
                let ma = k.address(mk, &mi, 8);
                let present = k.ld_global_i64(ma);
                let absent = k.setp("eq.s64", &present, &0u64);
                k.emit(format!(
                    "@{absent} mov.f32 {reg}, {}",
                    crate::ptx::Operand::text(&neg_inf)
                ));
                k.place(&skip);
            }
        }
    }
    k.comment("online softmax: row max over the quad, rescale, exponentiate");
    let mut p_regs = s.clone();
    for (half, (mi, li)) in m.iter().zip(&l).enumerate() {
        let mut mx = k.mov(RegClass::F32, &neg_inf);
        for nt in 0..BKV / 8 {
            for c in 0..2 {
                let reg = s[(nt * 4 + half as u32 * 2 + c) as usize];
                mx = k.max_f32(&mx, &reg);
            }
        }
        for off in [1u32, 2] {
            let other = k.reg(RegClass::F32);
            k.emit(format!("shfl.sync.bfly.b32 {other}, {mx}, {off}, 31, -1"));
            mx = k.max_f32(&mx, &other);
        }
        let m_new = k.max_f32(mi, &mx);
        // A row that has seen no key yet keeps m = -inf; use 0 so that exp2 gives 0, not NaN.
        let none = k.setp("eq.f32", &m_new, &neg_inf);
        let m_use = k.selp(RegClass::F32, "f32", &F32(0.0), &m_new, none);
        let dm = k.sub_f32(mi, &m_use);
        let corr = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
        k.emit(format!("mov.f32 {mi}, {m_new}"));
        let row_sum = k.mov(RegClass::F32, &F32(0.0));
        for nt in 0..BKV / 8 {
            for c in 0..2 {
                let idx = (nt * 4 + half as u32 * 2 + c) as usize;
                let ds = k.sub_f32(&s[idx], &m_use);
                let p = k.op1("ex2.approx.ftz.f32", RegClass::F32, &ds);
                k.emit(format!("add.f32 {row_sum}, {row_sum}, {p}"));
                p_regs[idx] = p;
            }
        }
        k.emit(format!("fma.rn.f32 {li}, {li}, {corr}, {row_sum}"));
        for dt in 0..d_tiles {
            for c in 0..2 {
                let reg = o[(dt * 4 + half as u32 * 2 + c) as usize];
                k.emit(format!("mul.rn.f32 {reg}, {reg}, {corr}"));
            }
        }
    }
    k.comment("O += P V: P re-packed from the score accumulators as A fragments");
    for kb in 0..BKV / 16 {
        let pack = |k: &mut Kernel, lo: Reg, hi: Reg| -> Reg {
            let w = k.reg(RegClass::B32);
            k.emit(format!("cvt.rn.{ty}x2.f32 {w}, {hi}, {lo}"));
            w
        };
        let t0 = (kb * 2 * 4) as usize;
        let t1 = ((kb * 2 + 1) * 4) as usize;
        let a = [
            pack(&mut k, p_regs[t0], p_regs[t0 + 1]),
            pack(&mut k, p_regs[t0 + 2], p_regs[t0 + 3]),
            pack(&mut k, p_regs[t1], p_regs[t1 + 1]),
            pack(&mut k, p_regs[t1 + 2], p_regs[t1 + 3]),
        ];
        for dd in 0..d / 16 {
            let r: Vec<Reg> = (0..4).map(|_| k.reg(RegClass::B32)).collect();
            let off = kb * 16 * row_bytes + dd * 32;
            k.emit(format!(
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{}, {}, {}, {}}}, [{v_lane_cur}+{off}]",
                r[0], r[1], r[2], r[3]
            ));
            for (half, bf) in [[r[0], r[1]], [r[2], r[3]]].iter().enumerate() {
                let n = ((dd * 2) as usize + half) * 4;
                let c = &o[n..n + 4];
                k.emit(format!(
                    "mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{}, {}, {}, {}}}, {{{}, {}, {}, {}}}, {{{}, {}}}, {{{}, {}, {}, {}}}",
                    c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], bf[0], bf[1], c[0], c[1], c[2], c[3]
                ));
            }
        }
    }
    k.barrier();
    k.emit(format!("add.u32 {j0}, {j0}, {BKV}"));
    k.emit(format!("add.u32 {it}, {it}, 1"));
    k.bra(None, &top);
    k.place(&done);
    k.emit("cp.async.wait_group 0");

    k.comment("normalise by the quad-summed row sums and store");
    for (half, li) in l.iter().enumerate() {
        let mut total = *li;
        for off in [1u32, 2] {
            let other = k.reg(RegClass::F32);
            k.emit(format!(
                "shfl.sync.bfly.b32 {other}, {total}, {off}, 31, -1"
            ));
            total = k.add_f32(&total, &other);
        }
        let empty = k.setp("eq.f32", &total, &F32(0.0));
        let inv = k.rcp_f32(&total);
        let inv = k.selp(RegClass::F32, "f32", &F32(0.0), &inv, empty);
        let row = if half == 0 { row0 } else { row1 };
        let skip = k.label("skip_row");
        let past = k.setp("ge.u32", &row, &cfg.q_len);
        k.bra(Some((past, true)), &skip);
        let o_row = k.mad_u32(&row, &os[2], &o_head);
        for dt in 0..d_tiles {
            let lo = k.mul_f32(&o[(dt * 4 + half as u32 * 2) as usize], &inv);
            let hi = k.mul_f32(&o[(dt * 4 + half as u32 * 2 + 1) as usize], &inv);
            let col0 = k.mad_u32(&t, &2u32, &o_row);
            let idx = k.add_u32(&col0, &(dt * 8));
            let addr = k.address(out, &idx, 2);
            let w = k.reg(RegClass::B32);
            k.emit(format!("cvt.rn.{ty}x2.f32 {w}, {hi}, {lo}"));
            k.emit(format!("st.global.b32 [{addr}], {w}"));
        }
        k.place(&skip);
    }
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.q_len.div_ceil(BQ), cfg.heads, cfg.batch],
            block: [32 * WARPS, 1, 1],
            shared_bytes: BQ * row_bytes + 4 * tile_bytes,
        },
    )
    .on(crate::KernelPath::Mma)
}
