//! Writing a chunk of keys or values into a KV cache, in place: `cache[b, h, pos[b, s], :] =
//! new[b, h, s, :]` for every token whose mask is 1, with RoPE applied on the way when the IR
//! rotates the keys just before the write. One warp per (token, head), lanes over the head dim,
//! up to [`WARPS`] tokens of a head per block (a block of one warp each would leave most of a
//! long chunk's time to block scheduling). A paged cache's row is found through its block table
//! (`crate::paging`).

use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Reg, RegClass};
use crate::rope::rotated;
use crate::{GeneratedKernel, Launch};

/// Tokens (warps) per block.
const WARPS: u32 = 8;

/// A cache-write kernel's static configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct KvWriteConfig {
    /// Batch size.
    pub batch: u32,
    /// K/V heads.
    pub kv_heads: u32,
    /// New tokens per row (S).
    pub new_len: u32,
    /// Cache capacity (T).
    pub capacity: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// `[batch, head, row]` strides of the new values (elements; the head dim is contiguous).
    pub new_strides: [u32; 3],
    /// Rotate the new values (RoPE) with `cos`/`sin` tables `[P, D/2]` at their positions.
    pub rope: bool,
    /// Element type of cache and values.
    pub elem: Elem,
    /// A paged cache (`batch` rows of the block table), or `None` for `[batch, KVH, T, D]`.
    pub paging: Option<Paging>,
}

impl KvWriteConfig {
    /// The cache's `[batch, head, row]` strides (the pool's when paged).
    pub fn cache_strides(&self) -> [u32; 3] {
        match self.paging {
            Some(p) => p.strides(self.kv_heads, self.head_dim),
            None => {
                let d = self.head_dim;
                [self.kv_heads * self.capacity * d, self.capacity * d, d]
            }
        }
    }
}

/// Generates the kernel. Parameters: `cache, new, positions, mask, [cos, sin], [table]`.
pub fn kv_write(cfg: &KvWriteConfig) -> GeneratedKernel {
    let name = format!(
        "kv_write_{}_kv{}_d{}_s{}_t{}{}{}",
        cfg.elem.name(),
        cfg.kv_heads,
        cfg.head_dim,
        cfg.new_len,
        cfg.capacity,
        if cfg.rope { "_rope" } else { "" },
        Paging::suffix(cfg.paging)
    );
    let mut k = Kernel::new(&name);
    let cache = k.param_ptr("cache");
    let new = k.param_ptr("new");
    let positions = k.param_ptr("positions");
    let mask = k.param_ptr("mask");
    let tables = cfg.rope.then(|| (k.param_ptr("cos"), k.param_ptr("sin")));
    let paged = cfg.paging.map(|p| (k.param_ptr("table"), p));
    let e = cfg.elem;
    let d = cfg.head_dim;
    let warps = cfg.new_len.min(WARPS);
    let lane = k.special("tid.x");
    let warp = k.special("tid.y");
    let first = k.special("ctaid.x");
    let h = k.special("ctaid.y");
    let b = k.special("ctaid.z");
    let exit = k.label("exit");
    let s = k.mad_u32(&first, &warps, &warp);
    let past = k.setp("ge.u32", &s, &cfg.new_len);
    k.bra(Some((past, true)), &exit);
    let token = k.mad_u32(&b, &cfg.new_len, &s);
    let ma = k.address(mask, &token, 8);
    let present = k.ld_global_i64(ma);
    let absent = k.setp("eq.s64", &present, &0u64);
    k.bra(Some((absent, true)), &exit);
    let pa = k.address(positions, &token, 8);
    let pos64 = k.ld_global_i64(pa);
    let outside = k.setp("ge.u64", &pos64, &u64::from(cfg.capacity));
    k.bra(Some((outside, true)), &exit);
    let pos = k.op1("cvt.u32.u64", RegClass::B32, &pos64);
    let [sb, sh, ss] = cfg.new_strides;
    let n0 = k.mul_u32(&b, &sb);
    let n1 = k.mad_u32(&h, &sh, &n0);
    let src_row = k.mad_u32(&s, &ss, &n1);
    let rows = KeyRows::new(&mut k, cfg.cache_strides(), [b, h], paged);
    let dst_row = rows.row(&mut k, &pos);
    let rope = tables.map(|t| (t, pos));
    write_row(&mut k, e, d, lane, [new, src_row], [cache, dst_row], rope);
    k.place(&exit);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.new_len.div_ceil(warps), cfg.kv_heads, cfg.batch],
            block: [32, warps, 1],
            shared_bytes: 0,
        },
    )
}

/// Copies the `d` elements at element `src_row` of `new` to element `dst_row` of `cache`, the
/// warp's 32 lanes (`lane`) over the columns, each column pair `(i, i + d/2)` rotated by RoPE at
/// position `pos` on the way when `rope` gives the `cos`/`sin` tables and `pos`.
pub(crate) fn write_row(
    k: &mut Kernel,
    e: Elem,
    d: u32,
    lane: Reg,
    [new, src_row]: [Reg; 2],
    [cache, dst_row]: [Reg; 2],
    rope: Option<((Reg, Reg), Reg)>,
) {
    match rope {
        None => {
            for c in 0..d.div_ceil(32) {
                let col = k.add_u32(&lane, &(c * 32));
                let skip = k.label("skip_col");
                let past = k.setp("ge.u32", &col, &d);
                k.bra(Some((past, true)), &skip);
                let si = k.add_u32(&src_row, &col);
                let sa = k.address(new, &si, e.bytes());
                let x = k.ld_global(e, sa);
                let di = k.add_u32(&dst_row, &col);
                let da = k.address(cache, &di, e.bytes());
                k.st_global(e, da, x);
                k.place(&skip);
            }
        }
        Some(((cos, sin), pos)) => {
            let half = d / 2;
            let pair = u64::from(half * e.bytes());
            for c in 0..half.div_ceil(32) {
                let col = k.add_u32(&lane, &(c * 32));
                let skip = k.label("skip_pair");
                let past = k.setp("ge.u32", &col, &half);
                k.bra(Some((past, true)), &skip);
                let si = k.add_u32(&src_row, &col);
                let lo_a = k.address(new, &si, e.bytes());
                let hi_a = k.op2("add.u64", RegClass::B64, &lo_a, &pair);
                let lo = k.ld_global(e, lo_a);
                let hi = k.ld_global(e, hi_a);
                let t = k.mad_u32(&pos, &half, &col);
                let ca = k.address(cos, &t, 4);
                let sa = k.address(sin, &t, 4);
                let c = k.ld_global(Elem::F32, ca);
                let sn = k.ld_global(Elem::F32, sa);
                let (rlo, rhi) = rotated(k, lo, hi, c, sn);
                let di = k.add_u32(&dst_row, &col);
                let da = k.address(cache, &di, e.bytes());
                let dh = k.op2("add.u64", RegClass::B64, &da, &pair);
                k.st_global(e, da, rlo);
                k.st_global(e, dh, rhi);
                k.place(&skip);
            }
        }
    }
}
