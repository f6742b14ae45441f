//! Writing new keys or values into a KV cache in place, the CPU side of [`crate::kv_cache`]:
//! `cache[b, h, pos[b, s], :] = new[b, h, s, :]` for every token whose mask is 1 and whose
//! position is inside the cache, rotated (RoPE, the rotate-half pairing of `i` and `i + D/2`)
//! on the way when the IR rotates the keys just before the write; a paged cache's row through its
//! block table (`super::paging`). Parameters: `cache, new, positions, mask, [cos, sin], [table]`;
//! the parallel axis is tokens (`b * S + s`).

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::I64;
use cranelift_codegen::ir::InstBuilder;

use super::math::rotated;
use super::module::{
    arg, f32_addr, for_range, if_then, lanes, load, load_i64, store, CpuError, CpuModule,
};
use super::paging::CacheRows;
use crate::kv_cache::KvWriteConfig;
use crate::paging::Paging;

/// The function's name for `cfg` (everything its code depends on).
pub fn name(cfg: &KvWriteConfig) -> String {
    let [sb, sh, ss] = cfg.new_strides;
    format!(
        "cpu_kv_write_f32_kv{}_d{}_s{}_t{}_n{sb}x{sh}x{ss}{}{}",
        cfg.kv_heads,
        cfg.head_dim,
        cfg.new_len,
        cfg.capacity,
        if cfg.rope { "_rope" } else { "" },
        Paging::suffix(cfg.paging)
    )
}

/// Generates the write of `cfg` (f32) into `module`; returns its name.
pub fn kv_write(module: &mut CpuModule, cfg: &KvWriteConfig) -> Result<String, CpuError> {
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| {
        let cache = arg(b, p, 0);
        let new = arg(b, p, 1);
        let positions = arg(b, p, 2);
        let mask = arg(b, p, 3);
        let tables = cfg.rope.then(|| (arg(b, p, 4), arg(b, p, 5)));
        let table_arg = if cfg.rope { 6 } else { 4 };
        let paged = cfg.paging.map(|pg| (arg(b, p, table_arg), pg));
        let strides = cfg.cache_strides().map(i64::from);
        let half = cfg.head_dim / 2;
        let [sb, sh, ss] = cfg.new_strides.map(i64::from);
        for_range(b, p.begin, p.end, 1, |b, token| {
            let present = load_i64(b, mask, token);
            let pos = load_i64(b, positions, token);
            let inside = b
                .ins()
                .icmp_imm_s(IntCC::UnsignedLessThan, pos, i64::from(cfg.capacity));
            let write = b.ins().icmp_imm_s(IntCC::NotEqual, present, 0);
            let write = b.ins().band(write, inside);
            if_then(b, write, |b| {
                let batch = b.ins().udiv_imm_s(token, i64::from(cfg.new_len));
                let s = b.ins().urem_imm_s(token, i64::from(cfg.new_len));
                let zero = b.ins().iconst(I64, 0);
                let heads = b.ins().iconst(I64, i64::from(cfg.kv_heads));
                for_range(b, zero, heads, 1, |b, h| {
                    let r0 = b.ins().imul_imm_s(batch, sb);
                    let r1 = b.ins().imul_imm_s(h, sh);
                    let r2 = b.ins().imul_imm_s(s, ss);
                    let src = b.ins().iadd(r0, r1);
                    let src = b.ins().iadd(src, r2);
                    let dst = CacheRows::new(b, strides, [batch, h], paged).row(b, pos);
                    match tables {
                        None => lanes(b, cfg.head_dim, |b, i, ty| {
                            let si = b.ins().iadd(src, i);
                            let sa = f32_addr(b, new, si);
                            let v = load(b, ty, sa);
                            let di = b.ins().iadd(dst, i);
                            let da = f32_addr(b, cache, di);
                            store(b, v, da);
                        }),
                        Some((cos, sin)) => {
                            let t0 = b.ins().imul_imm_s(pos, i64::from(half));
                            lanes(b, half, |b, i, ty| {
                                let lo_i = b.ins().iadd(src, i);
                                let hi_i = b.ins().iadd_imm_s(lo_i, i64::from(half));
                                let la = f32_addr(b, new, lo_i);
                                let ha = f32_addr(b, new, hi_i);
                                let lo = load(b, ty, la);
                                let hi = load(b, ty, ha);
                                let ti = b.ins().iadd(t0, i);
                                let ca = f32_addr(b, cos, ti);
                                let sa = f32_addr(b, sin, ti);
                                let c = load(b, ty, ca);
                                let sn = load(b, ty, sa);
                                let (out_lo, out_hi) = rotated(b, lo, hi, c, sn);
                                let di = b.ins().iadd(dst, i);
                                let da = f32_addr(b, cache, di);
                                store(b, out_lo, da);
                                let dh = b.ins().iadd_imm_s(di, i64::from(half));
                                let dha = f32_addr(b, cache, dh);
                                store(b, out_hi, dha);
                            });
                        }
                    }
                });
            });
        });
    })?;
    Ok(name)
}
