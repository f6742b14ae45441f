//! Writing a chunk of keys or values into a KV cache, in place: `cache[b, h, pos[b, s], :] =
//! new[b, h, s, :]` for every token whose mask is 1, with RoPE applied on the way when the IR
//! rotates the keys just before the write. One warp per (token, head), lanes over the head dim,
//! up to `WARPS` tokens of a head per block (a block of one warp each would leave most of a
//! long chunk's time to block scheduling); a prompt chunk's entries whose rows start 16-byte
//! aligned take a few lanes per token instead, 16 bytes of each half of the row a lane
//! (`RowLanes`), so that a launch over a long chunk runs in one wave of short warps rather
//! than several of long ones. A paged cache's row is found through its block table
//! (`crate::paging`).

use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Label, Reg, RegClass};
use crate::rope::{load, rotated, store, RotateConfig};
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
    let WarpToken {
        lane,
        y,
        b,
        s,
        exit,
    } = WarpToken::new(&mut k, cfg.new_len, RowLanes::WARP);
    let entry = Entry {
        at: [b, y, s, lane],
        positions,
        mask,
        lanes: RowLanes::WARP,
    };
    entry.write(&mut k, cfg, [cache, new], tables, paged, &exit);
    k.place(&exit);
    let launch = WarpToken::launch(cfg.new_len, cfg.kv_heads, cfg.batch, RowLanes::WARP);
    GeneratedKernel::new(k, launch)
}

/// How a token's row spreads over a warp: `lanes` lanes (a power of two up to 32) each taking
/// `width` adjacent column pairs `(i, i + D/2)`, 16 bytes of each half of the row where every
/// access stays 16-byte aligned; otherwise (width 1) a warp per token, a pair a lane, round the
/// row.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RowLanes {
    lanes: u32,
    width: u32,
}

impl RowLanes {
    const WARP: RowLanes = RowLanes {
        lanes: 32,
        width: 1,
    };

    /// A prompt chunk's: 16-byte pairs where its configuration keeps them aligned.
    fn of(cfg: &ChunkEntriesConfig) -> RowLanes {
        let keys = &cfg.keys;
        let width = 16 / keys.elem.bytes();
        let half = keys.head_dim / 2;
        let lanes = half / width;
        let strides = [
            keys.new_strides,
            cfg.value_strides,
            keys.cache_strides(),
            cfg.query.strides,
            cfg.query.out_strides(),
        ];
        let aligned = cfg.aligned
            && half.is_multiple_of(width)
            && strides.iter().flatten().all(|s| s.is_multiple_of(width));
        if aligned && lanes.is_power_of_two() && lanes <= 32 {
            RowLanes { lanes, width }
        } else {
            RowLanes::WARP
        }
    }

    fn tokens_per_warp(self) -> u32 {
        32 / self.lanes
    }
}

/// A thread's token of the chunk: its lane among the token's, the block's `y` (a head) and row
/// `b`, the token `s` (warps of a block, and a warp's groups of lanes, take consecutive tokens),
/// and the label the kernel ends at, to which a thread past the chunk's tokens has jumped
/// already.
struct WarpToken {
    lane: Reg,
    y: Reg,
    b: Reg,
    s: Reg,
    exit: Label,
}

impl WarpToken {
    fn new(k: &mut Kernel, new_len: u32, lanes: RowLanes) -> WarpToken {
        let per_warp = lanes.tokens_per_warp();
        let warps = Self::warps(new_len, lanes);
        let mut lane = k.special("tid.x");
        let warp = k.special("tid.y");
        let first = k.special("ctaid.x");
        let y = k.special("ctaid.y");
        let b = k.special("ctaid.z");
        let exit = k.label("exit");
        let mut s = k.mad_u32(&first, &warps, &warp);
        if per_warp > 1 {
            let group = k.op2(
                "shr.u32",
                RegClass::B32,
                &lane,
                &lanes.lanes.trailing_zeros(),
            );
            s = k.mad_u32(&s, &per_warp, &group);
            lane = k.op2("and.b32", RegClass::B32, &lane, &(lanes.lanes - 1));
        }
        let past = k.setp("ge.u32", &s, &new_len);
        k.bra(Some((past, true)), &exit);
        WarpToken {
            lane,
            y,
            b,
            s,
            exit,
        }
    }

    /// Warps per block: up to [`WARPS`], as many as the tokens need.
    fn warps(new_len: u32, lanes: RowLanes) -> u32 {
        new_len.div_ceil(lanes.tokens_per_warp()).min(WARPS)
    }

    /// The launch of `heads` blocks over `y` for each of `batch` rows.
    fn launch(new_len: u32, heads: u32, batch: u32, lanes: RowLanes) -> Launch {
        let warps = Self::warps(new_len, lanes);
        let per_block = warps * lanes.tokens_per_warp();
        Launch {
            grid: [new_len.div_ceil(per_block), heads, batch],
            block: [32, warps, 1],
            shared_bytes: 0,
        }
    }
}

/// A prompt chunk's new entries in one launch ([`chunk_entries`]): its keys and values written
/// into their caches as [`kv_write`] writes each, and q rotated as [`crate::rope::rotate`]
/// rotates it, for the attention that reads all three.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkEntriesConfig {
    /// The keys' write (rotated where the IR rotates the keys).
    pub keys: KvWriteConfig,
    /// `[batch, head, row]` strides of the new values.
    pub value_strides: [u32; 3],
    /// q's rotation into a contiguous `[B, H, S, D]` buffer (its batch, length, head dim and
    /// element type those of `keys`).
    pub query: RotateConfig,
    /// Whether q, the new keys and the new values start 16 bytes into their buffers' alignment
    /// (views at element offsets of whole 16 bytes): then, with strides of whole 16 bytes, every
    /// row does, and lanes take 16 bytes at a time (`RowLanes`).
    pub aligned: bool,
}

impl ChunkEntriesConfig {
    /// The values' write.
    pub fn values(&self) -> KvWriteConfig {
        KvWriteConfig {
            new_strides: self.value_strides,
            rope: false,
            ..self.keys.clone()
        }
    }
}

/// Generates the kernel. Parameters: `k_cache, v_cache, k_new, v_new, positions, mask, cos, sin,
/// q, q_out, [table]`. Blocks over `y` take q's heads, then the keys', then the values'; each
/// warp one token of one head, as [`kv_write`] does, or several (`RowLanes`; the rotation the
/// same multiply and fused multiply-add, so every output is the three kernels' bit for bit).
pub fn chunk_entries(cfg: &ChunkEntriesConfig) -> GeneratedKernel {
    let keys = &cfg.keys;
    let q = &cfg.query;
    assert!(
        q.batch == keys.batch
            && q.len == keys.new_len
            && q.head_dim == keys.head_dim
            && q.elem == keys.elem,
        "q's rotation and the cache writes cover the same tokens"
    );
    let lanes = RowLanes::of(cfg);
    let mut k = Kernel::new(&chunk_entries_name(cfg, lanes));
    let caches = [k.param_ptr("k_cache"), k.param_ptr("v_cache")];
    let news = [k.param_ptr("k_new"), k.param_ptr("v_new")];
    let positions = k.param_ptr("positions");
    let mask = k.param_ptr("mask");
    let tables = (k.param_ptr("cos"), k.param_ptr("sin"));
    let (q_in, q_out) = (k.param_ptr("q"), k.param_ptr("q_out"));
    let paged = keys.paging.map(|p| (k.param_ptr("table"), p));
    let WarpToken {
        lane,
        y,
        b,
        s,
        exit,
    } = WarpToken::new(&mut k, keys.new_len, lanes);
    let cache_rows = k.label("cache_rows");
    let is_q = k.setp("lt.u32", &y, &q.heads);
    k.bra(Some((is_q, false)), &cache_rows);
    k.comment("q's heads: every token rotated into q_out, whatever its mask");
    let entry = Entry {
        at: [b, y, s, lane],
        positions,
        mask,
        lanes,
    };
    let pos = entry.position(&mut k, keys.new_len);
    let src_row = strided_row(&mut k, q.strides, [b, y, s]);
    let dst_row = strided_row(&mut k, q.out_strides(), [b, y, s]);
    let rope = Some((tables, pos));
    write_row_by(
        &mut k,
        (q.elem, q.head_dim, lanes, lane),
        [q_in, src_row],
        [q_out, dst_row],
        rope,
    );
    k.bra(None, &exit);
    k.place(&cache_rows);
    let h = k.sub_u32(&y, &q.heads);
    let value_rows = k.label("value_rows");
    let is_value = k.setp("ge.u32", &h, &keys.kv_heads);
    k.bra(Some((is_value, true)), &value_rows);
    k.comment("the keys' heads");
    let entry = Entry {
        at: [b, h, s, lane],
        ..entry
    };
    entry.write(
        &mut k,
        keys,
        [caches[0], news[0]],
        Some(tables),
        paged,
        &exit,
    );
    k.bra(None, &exit);
    k.place(&value_rows);
    k.comment("the values' heads");
    let h = k.sub_u32(&h, &keys.kv_heads);
    let entry = Entry {
        at: [b, h, s, lane],
        ..entry
    };
    entry.write(
        &mut k,
        &cfg.values(),
        [caches[1], news[1]],
        None,
        paged,
        &exit,
    );
    k.place(&exit);
    let heads = q.heads + 2 * keys.kv_heads;
    GeneratedKernel::new(k, WarpToken::launch(keys.new_len, heads, keys.batch, lanes))
}

/// [`chunk_entries`]' kernel name: types, heads, sizes, q's strides, RoPE, paging and lanes.
fn chunk_entries_name(cfg: &ChunkEntriesConfig, lanes: RowLanes) -> String {
    let (keys, q) = (&cfg.keys, &cfg.query);
    let [qb, qh, qs] = q.strides;
    format!(
        "chunk_entries_{}_h{}_kv{}_d{}_s{}_t{}_st{qb}x{qh}x{qs}{}{}{}",
        keys.elem.name(),
        q.heads,
        keys.kv_heads,
        keys.head_dim,
        keys.new_len,
        keys.capacity,
        if keys.rope { "_rope" } else { "" },
        Paging::suffix(keys.paging),
        if lanes == RowLanes::WARP {
            String::new()
        } else {
            format!("_l{}", lanes.lanes)
        }
    )
}

/// One token of one head: row `b`, head `h`, token `s` of the chunk, the warp's `lane`; where
/// its position is found and whether it is written.
struct Entry {
    at: [Reg; 4],
    positions: Reg,
    mask: Reg,
    lanes: RowLanes,
}

impl Entry {
    /// The token's position, as a u32 (read from the `positions` input).
    fn position(&self, k: &mut Kernel, new_len: u32) -> Reg {
        let [b, _, s, _] = self.at;
        let token = k.mad_u32(&b, &new_len, &s);
        let pa = k.address(self.positions, &token, 8);
        let pos64 = k.ld_global_i64(pa);
        k.op1("cvt.u32.u64", RegClass::B32, &pos64)
    }

    /// Writes the entry of `new` into its row of `cache` as `cfg` says (rotated with `tables`
    /// when `cfg.rope`), or jumps to `exit` where its mask is 0 or its position is past the cache.
    fn write(
        &self,
        k: &mut Kernel,
        cfg: &KvWriteConfig,
        [cache, new]: [Reg; 2],
        tables: Option<(Reg, Reg)>,
        paged: Option<(Reg, Paging)>,
        exit: &Label,
    ) {
        let [b, h, s, lane] = self.at;
        let token = k.mad_u32(&b, &cfg.new_len, &s);
        let ma = k.address(self.mask, &token, 8);
        let present = k.ld_global_i64(ma);
        let absent = k.setp("eq.s64", &present, &0u64);
        k.bra(Some((absent, true)), exit);
        let pa = k.address(self.positions, &token, 8);
        let pos64 = k.ld_global_i64(pa);
        let outside = k.setp("ge.u64", &pos64, &u64::from(cfg.capacity));
        k.bra(Some((outside, true)), exit);
        let pos = k.op1("cvt.u32.u64", RegClass::B32, &pos64);
        let src_row = strided_row(k, cfg.new_strides, [b, h, s]);
        let rows = KeyRows::new(k, cfg.cache_strides(), [b, h], paged);
        let dst_row = rows.row(k, &pos);
        let rope = tables.filter(|_| cfg.rope).map(|t| (t, pos));
        write_row_by(
            k,
            (cfg.elem, cfg.head_dim, self.lanes, lane),
            [new, src_row],
            [cache, dst_row],
            rope,
        );
    }
}

/// The element index of row `[b, h, s]` under `[batch, head, row]` strides.
fn strided_row(k: &mut Kernel, [sb, sh, ss]: [u32; 3], [b, h, s]: [Reg; 3]) -> Reg {
    let n0 = k.mul_u32(&b, &sb);
    let n1 = k.mad_u32(&h, &sh, &n0);
    k.mad_u32(&s, &ss, &n1)
}

/// [`write_row`] by the row's `lanes` (`lane` among them): a warp's, or [`write_pairs`].
fn write_row_by(
    k: &mut Kernel,
    (e, d, lanes, lane): (Elem, u32, RowLanes, Reg),
    src: [Reg; 2],
    dst: [Reg; 2],
    rope: Option<((Reg, Reg), Reg)>,
) {
    if lanes == RowLanes::WARP {
        write_row(k, e, d, lane, src, dst, rope);
    } else {
        write_pairs(k, (e, d, lanes.width, lane), src, dst, rope);
    }
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

/// [`write_row`] where each of the row's `d / 2 / w` lanes takes `w` adjacent column pairs: 16
/// bytes of each half, their `cos`/`sin` in 16-byte loads, rotated as one pair is.
fn write_pairs(
    k: &mut Kernel,
    (e, d, w, lane): (Elem, u32, u32, Reg),
    [new, src_row]: [Reg; 2],
    [cache, dst_row]: [Reg; 2],
    rope: Option<((Reg, Reg), Reg)>,
) {
    let half = d / 2;
    let pair = u64::from(half * e.bytes());
    let col = k.mul_u32(&lane, &w);
    let si = k.add_u32(&src_row, &col);
    let lo_a = k.address(new, &si, e.bytes());
    let hi_a = k.op2("add.u64", RegClass::B64, &lo_a, &pair);
    let (mut lo, mut hi) = (load(k, e, lo_a, w), load(k, e, hi_a, w));
    if let Some(((cos, sin), pos)) = rope {
        let t = k.mad_u32(&pos, &half, &col);
        let ca = k.address(cos, &t, 4);
        let sa = k.address(sin, &t, 4);
        let (c, sn) = (load(k, Elem::F32, ca, w), load(k, Elem::F32, sa, w));
        for i in 0..w as usize {
            (lo[i], hi[i]) = rotated(k, lo[i], hi[i], c[i], sn[i]);
        }
    }
    let di = k.add_u32(&dst_row, &col);
    let da = k.address(cache, &di, e.bytes());
    let dh = k.op2("add.u64", RegClass::B64, &da, &pair);
    store(k, e, da, &lo);
    store(k, e, dh, &hi);
}
