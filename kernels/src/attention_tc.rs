//! FlashAttention-2 style attention on tensor cores, f16 / bf16, for every variant fusion
//! produces: GQA/MQA, all / causal / position key rules with sliding windows, padding masks, RoPE
//! on q (and on k in prefill) and Philox dropout with exactly the IR's mask.
//!
//! A block of 4 warps takes 64 or 128 query rows of one head (one m16 tile per warp, or two for
//! head dimensions up to 64, so that each K/V fragment read from shared memory feeds two MMAs) and
//! walks the keys in tiles of 64: `S = Q K^T` and `O += P V` are `mma.sync.m16n8k16` with f32
//! accumulators, Q/K/V tiles staged by `cp.async` and read with `ldmatrix` (`.trans` for V; K/V
//! double-buffered), the online softmax kept in registers (base 2, the scale folded into the
//! exponent's FMA, quad shuffles for the row max), P re-packed from the score accumulators as the
//! A operand of the second product. The generator is written as parts that
//! a different main loop can reuse:
//! - **Q/K prologue** (`Attn::rotate_tile`, `Attn::rotate_keys`): RoPE applied to a staged
//!   tile in shared memory (once per block for Q, once per key tile for prefill K), rounded to the
//!   element type as the IR's `Rope` op rounds; a key tile's angle rows are prefetched into shared
//!   memory during the previous tile (positions loaded with its K/V, angles `cp.async`'d after the
//!   score MMAs) where two blocks per SM still fit, and read from global memory otherwise;
//! - **key rule and mask** (`Attn::key_rule`, `Attn::mask_scores`): the block's key range
//!   (tiles outside every row's range are never visited), per-element range masks on edge tiles
//!   only, and padding as an additive mask staged per key tile;
//! - **dropout** (`Attn::dropout`): one Philox-4x32-10 block per (row, pair of columns), the
//!   row sums taken before dropping, as in the IR's `softmax` then `dropout`;
//! - **epilogue** (`Attn::store`): rows normalised once and stored; a row that sees no key
//!   stores zeros, like the SIMT kernel.
//!
//! Decode steps (one query row per sequence over a cache) take the SIMT flash-decoding kernel.

use crate::attention::{
    philox_key, philox_words, reciprocal_or_zero, window_start, AttentionConfig, KeyRule,
    OptionalParams,
};
use crate::paging::KeyRows;
use crate::ptx::{Elem, Kernel, Label, Operand, Reg, RegClass, F32};
use crate::{GeneratedKernel, KernelPath, Launch};

const BKV: u32 = 64;
const WARPS: u32 = 4;
/// Shared memory per SM on sm_90 (bytes), and the blocks per SM the layout keeps room for
/// (registers allow two).
const SHARED_PER_SM: u32 = 228 * 1024;
const BLOCKS_PER_SM: u32 = 2;
const THREADS: u32 = 32 * WARPS;

/// Whether `cfg` can use the tensor-core kernel.
pub fn supports(cfg: &AttentionConfig) -> bool {
    let decode_step = matches!(cfg.keys, KeyRule::Position { .. }) && cfg.q_len == 1;
    cfg.elem != Elem::F32
        && cfg.head_dim.is_multiple_of(16)
        && cfg.head_dim <= 128
        && cfg.splits == 1
        && cfg.scale > 0.0
        && !decode_step
        && cfg.heads.is_multiple_of(cfg.kv_heads)
        && cfg.strides.iter().all(|s| s.iter().all(|v| v % 8 == 0))
}

/// m16 tiles of query rows per warp: two for head dimensions up to 64 without dropout, where
/// the accumulators leave room for them, so that each K/V fragment read from shared memory
/// feeds two MMAs (with dropout's Philox state beside them, ptxas spilled at 255 registers).
fn m_tiles(cfg: &AttentionConfig) -> u32 {
    if cfg.head_dim <= 64 && cfg.dropout.is_none() {
        2
    } else {
        1
    }
}

/// Generates the kernel. Parameters: `q, k, v, out, [mask], [positions], [cos, sin], [seed]`.
pub fn attention_tc(cfg: &AttentionConfig, name: String) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "configuration needs the SIMT attention kernel"
    );
    let mut a = Attn::new(cfg, &name);
    let rule = a.key_rule();
    let q_frag = a.q_fragments();
    let state = a.main_loop(&rule, &q_frag);
    a.store(&state);
    let shared_bytes = a.layout.total;
    let bq = a.bq();
    GeneratedKernel::new(
        a.k,
        Launch {
            grid: [cfg.q_len.div_ceil(bq), cfg.heads, cfg.batch],
            block: [THREADS, 1, 1],
            shared_bytes,
        },
    )
    .on(KernelPath::Mma)
}

/// Byte offsets in dynamic shared memory.
struct Layout {
    /// Bytes per staged row: the head dimension plus 16 bytes of padding (no `ldmatrix` bank
    /// conflicts).
    row_bytes: u32,
    /// One K or V tile.
    tile_bytes: u32,
    /// The two K/V buffers (K then V in each), after the Q tile.
    kv: u32,
    /// Two additive padding-mask rows of `BKV` f32.
    mask: u32,
    /// Two u32: the smallest and largest last visible key of the block's rows.
    range: u32,
    /// With RoPE on keys: the next key tile's angles, per row `D / 2` cos then `D / 2` sin (f32).
    angles: u32,
    total: u32,
}

impl Layout {
    /// The layout; the angle slot only when `rope_k` and it leaves room for [`BLOCKS_PER_SM`]
    /// blocks (else key tiles read their angles from global memory as they rotate).
    fn new(head_dim: u32, bq: u32, rope_k: bool) -> Layout {
        let row_bytes = head_dim * 2 + 16;
        let tile_bytes = BKV * row_bytes;
        let kv = bq * row_bytes;
        let mask = kv + 4 * tile_bytes;
        let range = mask + 2 * BKV * 4;
        let angles = range + 16;
        let slot = BKV * head_dim * 4;
        let fits = angles + slot <= SHARED_PER_SM / BLOCKS_PER_SM - 1024;
        let angle_bytes = if rope_k && fits { slot } else { 0 };
        Layout {
            row_bytes,
            tile_bytes,
            kv,
            mask,
            range,
            angles,
            total: angles + angle_bytes,
        }
    }
}

/// Where a rotation reads its angles: the tables in global memory at a position, or a row the
/// key-tile prefetch staged in shared memory.
#[derive(Clone, Copy)]
enum Angles {
    Global(Reg),
    Shared(Reg),
}

/// The block's keys: tiles from `start` (a multiple of `BKV`) to `end`; a tile needs per-element
/// range masks unless it lies in `[interior_from, interior_to)`.
struct BlockKeys {
    start: Reg,
    end: Reg,
    interior_from: Reg,
    interior_to: Reg,
    /// Per m16 tile, for the thread's rows `g` and `g + 8`: the last visible key (`None`: every
    /// key).
    last: Option<Vec<[Reg; 2]>>,
    /// And the first (sliding window).
    first: Option<Vec<[Reg; 2]>>,
}

/// Per thread and m16 tile (or, on Hopper, wgmma m64 accumulator): the online-softmax state of
/// its two rows (running max in base 2, scaled; running sum) and its output accumulators.
pub(crate) struct RowState {
    pub(crate) m: [Reg; 2],
    pub(crate) l: [Reg; 2],
    pub(crate) o: Vec<Reg>,
}

impl RowState {
    /// Maxima -inf, sums 0 and `head_dim / 2` zeroed accumulators (the thread's two columns of
    /// each 8-column group, for both rows).
    pub(crate) fn new(k: &mut Kernel, head_dim: u32) -> RowState {
        let neg_inf = F32(f32::NEG_INFINITY);
        RowState {
            m: [
                k.mov(RegClass::F32, &neg_inf),
                k.mov(RegClass::F32, &neg_inf),
            ],
            l: [
                k.mov(RegClass::F32, &F32(0.0)),
                k.mov(RegClass::F32, &F32(0.0)),
            ],
            o: (0..head_dim / 2)
                .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                .collect(),
        }
    }
}

/// Dropout's per-block constants: the Philox key, the (batch, head) plane.
struct DropoutKey {
    key: [Reg; 2],
    plane: Reg,
    stream: u32,
    threshold: u32,
    keep_scale: f32,
}

struct Attn<'a> {
    cfg: &'a AttentionConfig,
    k: Kernel,
    layout: Layout,
    q: Reg,
    kp: Reg,
    v: Reg,
    out: Reg,
    mask: Option<Reg>,
    positions: Option<Reg>,
    tables: Option<(Reg, Reg)>,
    seed: Option<Reg>,
    tid: Reg,
    lane: Reg,
    warp: Reg,
    b: Reg,
    h: Reg,
    q0: Reg,
    smem: Reg,
    /// Element offset of this block's out head.
    o_head: Reg,
    /// Where q's, k's and v's rows are (k's and v's through the block table when paged).
    operand_rows: [KeyRows; 3],
    /// m16 tiles per warp.
    m_tiles: u32,
    /// The thread's two query rows (`g` and `g + 8`) of each of its warp's m16 tiles.
    rows: Vec<[Reg; 2]>,
    /// Its column pair within an n8 tile: `2t`.
    t2: Reg,
}

impl<'a> Attn<'a> {
    fn new(cfg: &'a AttentionConfig, name: &str) -> Attn<'a> {
        let mut k = Kernel::new(name);
        let m_tiles = m_tiles(cfg);
        let bq = 16 * WARPS * m_tiles;
        let q = k.param_ptr("q");
        let kp = k.param_ptr("k");
        let v = k.param_ptr("v");
        let out = k.param_ptr("out");
        let OptionalParams {
            mask,
            positions,
            tables,
            seed,
            paged,
        } = OptionalParams::declare(&mut k, cfg);
        let shared = k.dynamic_shared("attention_tiles");
        let smem = k.shared_base(&shared);

        let tid = k.special("tid.x");
        let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
        let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
        // The longest causal rows first: block x counts down the query blocks.
        let bx = k.special("ctaid.x");
        let last_block = cfg.q_len.div_ceil(bq) - 1;
        let qb = k.sub_u32(&last_block, &bx);
        let h = k.special("ctaid.y");
        let b = k.special("ctaid.z");
        let q0 = k.mul_u32(&qb, &bq);
        let kvh = k.op2("div.u32", RegClass::B32, &h, &(cfg.heads / cfg.kv_heads));
        let [qs, ks, vs, os] = cfg.strides;
        let o0 = k.mul_u32(&b, &os[0]);
        let o_head = k.mad_u32(&h, &os[1], &o0);
        let operand_rows = [
            KeyRows::new(&mut k, qs, [b, h], None),
            KeyRows::new(&mut k, ks, [b, kvh], paged),
            KeyRows::new(&mut k, vs, [b, kvh], paged),
        ];
        let g = k.op2("shr.u32", RegClass::B32, &lane, &2u32);
        let t = k.op2("and.b32", RegClass::B32, &lane, &3u32);
        let t2 = k.mul_u32(&t, &2u32);
        let wrow = k.mad_u32(&warp, &(16 * m_tiles), &q0);
        let first = k.add_u32(&wrow, &g);
        let rows = (0..m_tiles)
            .map(|mt| {
                let row0 = k.add_u32(&first, &(16 * mt));
                [row0, k.add_u32(&row0, &8u32)]
            })
            .collect();
        Attn {
            cfg,
            k,
            layout: Layout::new(cfg.head_dim, bq, cfg.rope && cfg.rope_k),
            q,
            kp,
            v,
            out,
            mask,
            positions,
            tables,
            seed,
            tid,
            lane,
            warp,
            b,
            h,
            q0,
            smem,
            o_head,
            operand_rows,
            m_tiles,
            rows,
            t2,
        }
    }

    /// Query rows per block.
    fn bq(&self) -> u32 {
        16 * WARPS * self.m_tiles
    }

    /// Queues `cp.async` copies of rows `r0 .. r0 + tile_rows` (of `rows` valid) of operand
    /// `which` (0 q, 1 k, 2 v; at `src`) into the tile at shared address `dst`; rows past the end
    /// are zero-filled.
    fn stage(&mut self, src: Reg, which: usize, r0: Reg, rows: u32, dst: Reg, tile_rows: u32) {
        let k = &mut self.k;
        let operand_rows = &self.operand_rows[which];
        let chunks_per_row = self.cfg.head_dim / 8;
        let total = tile_rows * chunks_per_row;
        for c in 0..total.div_ceil(THREADS) {
            let chunk = k.add_u32(&self.tid, &(c * THREADS));
            let skip = k.label("skip_chunk");
            if !total.is_multiple_of(THREADS) {
                let in_tile = k.setp("lt.u32", &chunk, &total);
                k.bra(Some((in_tile, false)), &skip);
            }
            let row = k.op2("div.u32", RegClass::B32, &chunk, &chunks_per_row);
            let kc = k.op2("rem.u32", RegClass::B32, &chunk, &chunks_per_row);
            let grow = k.add_u32(&r0, &row);
            let ok = k.setp("lt.u32", &grow, &rows);
            let bytes = k.selp(RegClass::B32, "u32", &16u32, &0u32, ok);
            let safe = k.selp(RegClass::B32, "u32", &grow, &0u32, ok);
            let r_off = operand_rows.row(k, &safe);
            let idx = k.mad_u32(&kc, &8u32, &r_off);
            let g = k.address(src, &idx, 2);
            let s_row = k.mad_u32(&row, &self.layout.row_bytes, &dst);
            let s = k.mad_u32(&kc, &16u32, &s_row);
            k.emit(format!(
                "cp.async.cg.shared.global [{s}], [{g}], 16, {bytes}"
            ));
            k.place(&skip);
        }
    }

    /// The position of row `row` (an index into the `positions` operand, whose rows hold `len`
    /// entries).
    fn position(&mut self, row: Reg, len: u32) -> Reg {
        let positions = self.positions.expect("positions are a parameter");
        let k = &mut self.k;
        let idx = k.mad_u32(&self.b, &len, &row);
        let a = k.address(positions, &idx, 8);
        let wide = k.ld_global_i64(a);
        k.op1("cvt.u32.u64", RegClass::B32, &wide)
    }

    /// Two f32 from a word of two halves (low half first).
    fn unpack(&mut self, word: Reg) -> [Reg; 2] {
        let e = self.cfg.elem.name();
        let k = &mut self.k;
        let (lo, hi) = (k.reg(RegClass::B16), k.reg(RegClass::B16));
        k.emit(format!("mov.b32 {{{lo}, {hi}}}, {word}"));
        [
            k.op1(&format!("cvt.f32.{e}"), RegClass::F32, &lo),
            k.op1(&format!("cvt.f32.{e}"), RegClass::F32, &hi),
        ]
    }

    /// A word of two halves from f32 `lo` and `hi`, rounded to nearest even.
    fn pack(&mut self, lo: Reg, hi: Reg) -> Reg {
        let e = self.cfg.elem.name();
        let w = self.k.reg(RegClass::B32);
        // The first source goes to the upper half.
        self.k.emit(format!("cvt.rn.{e}x2.f32 {w}, {hi}, {lo}"));
        w
    }

    /// Q/K prologue: RoPE applied in place to the staged tile of `tile_rows` rows at `tile`, whose
    /// row `r` is row `r0 + r` of a sequence of `rows` (`positions` rows of `rows` entries),
    /// rounded back to the element type as the IR's `Rope` op rounds. Each thread rotates 8
    /// column pairs `(c, c + D/2)` at a time.
    fn rotate_tile(&mut self, tile: Reg, r0: Reg, rows: u32, tile_rows: u32) {
        let half = self.cfg.head_dim / 2;
        let chunks = half / 8;
        let total = tile_rows * chunks;
        for c in 0..total.div_ceil(THREADS) {
            let skip = self.k.label("skip_rotate");
            let chunk = self.k.add_u32(&self.tid, &(c * THREADS));
            if !total.is_multiple_of(THREADS) {
                let in_tile = self.k.setp("lt.u32", &chunk, &total);
                self.k.bra(Some((in_tile, false)), &skip);
            }
            let row = self.k.op2("div.u32", RegClass::B32, &chunk, &chunks);
            let kc = self.k.op2("rem.u32", RegClass::B32, &chunk, &chunks);
            let grow = self.k.add_u32(&r0, &row);
            let past = self.k.setp("ge.u32", &grow, &rows);
            self.k.bra(Some((past, true)), &skip);
            let pos = self.position(grow, rows);
            let s_row = self.k.mad_u32(&row, &self.layout.row_bytes, &tile);
            let lo_addr = self.k.mad_u32(&kc, &16u32, &s_row);
            self.rotate_chunk(lo_addr, Angles::Global(pos), kc);
            self.k.place(&skip);
        }
    }

    /// The rotation chunks (8 column pairs of one row) of a key tile that this thread takes,
    /// chunks `tid + c * THREADS`: `(row, kc)`, with a row past the tile (`BKV`, whose keys count
    /// as past the end) when the tile has fewer chunks than threads.
    fn key_chunks(&mut self) -> Vec<(Reg, Reg)> {
        let chunks = self.cfg.head_dim / 16;
        let total = BKV * chunks;
        (0..total.div_ceil(THREADS))
            .map(|c| {
                let k = &mut self.k;
                let chunk = k.add_u32(&self.tid, &(c * THREADS));
                let row0 = k.op2("div.u32", RegClass::B32, &chunk, &chunks);
                let row = k.op2("min.u32", RegClass::B32, &row0, &BKV);
                let kc = k.op2("rem.u32", RegClass::B32, &chunk, &chunks);
                (row, kc)
            })
            .collect()
    }

    /// Whether chunk row `row` of the key tile at `j` holds a key.
    fn key_in_range(&mut self, j: Reg, row: Reg) -> Reg {
        let k = &mut self.k;
        let key = k.add_u32(&j, &row);
        let in_keys = k.setp("lt.u32", &key, &self.cfg.kv_len);
        let in_tile = k.setp("lt.u32", &row, &BKV);
        let ok = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {ok}, {in_keys}, {in_tile}"));
        ok
    }

    /// Key-tile prefetch, first half: the positions of this thread's rotation rows of the tile
    /// at key `j` (loads in flight while the current tile is multiplied).
    fn key_positions(&mut self, chunks: &[(Reg, Reg)], j: Reg) -> Vec<Reg> {
        let t_len = self.cfg.kv_len;
        chunks
            .iter()
            .map(|(row, _)| {
                let ok = self.key_in_range(j, *row);
                let key = self.k.add_u32(&j, row);
                let safe = self.k.selp(RegClass::B32, "u32", &key, &0u32, ok);
                self.position(safe, t_len)
            })
            .collect()
    }

    /// Key-tile prefetch, second half: `cp.async` of the angle rows at `positions` into the
    /// shared angle slot (rows past the keys zero-filled).
    fn key_angles(&mut self, chunks: &[(Reg, Reg)], j: Reg, positions: &[Reg]) {
        let (cos, sin) = self.tables.expect("RoPE tables are parameters");
        let half = self.cfg.head_dim / 2;
        let slot = self.k.add_u32(&self.smem, &self.layout.angles);
        for ((row, kc), pos) in chunks.iter().zip(positions) {
            let k = &mut self.k;
            // A chunk past the tile copies nothing; a row past the keys gets zeros.
            let skip = k.label("skip_angle_row");
            let in_tile = k.setp("lt.u32", row, &BKV);
            k.bra(Some((in_tile, false)), &skip);
            let key = k.add_u32(&j, row);
            let in_keys = k.setp("lt.u32", &key, &self.cfg.kv_len);
            let bytes = k.selp(RegClass::B32, "u32", &16u32, &0u32, in_keys);
            let t0 = k.mul_u32(kc, &8u32);
            let ti = k.mad_u32(pos, &half, &t0);
            let row_addr = k.mad_u32(row, &(half * 8), &slot);
            for (i, table) in [cos, sin].into_iter().enumerate() {
                let src = k.address(table, &ti, 4);
                let dst0 = k.add_u32(&row_addr, &(i as u32 * half * 4));
                let dst = k.mad_u32(kc, &32u32, &dst0);
                for part in 0..2u32 {
                    k.emit(format!(
                        "cp.async.ca.shared.global [{dst}+{}], [{src}+{}], 16, {bytes}",
                        part * 16,
                        part * 16
                    ));
                }
            }
            k.place(&skip);
        }
    }

    /// K prologue: RoPE on the landed key tile at `tile` (key `j` first), angles from the slot the
    /// prefetch filled.
    fn rotate_keys(&mut self, chunks: &[(Reg, Reg)], tile: Reg, j: Reg) {
        let half = self.cfg.head_dim / 2;
        let slot = self.k.add_u32(&self.smem, &self.layout.angles);
        for (row, kc) in chunks {
            let skip = self.k.label("skip_rotate");
            let ok = self.key_in_range(j, *row);
            self.k.bra(Some((ok, false)), &skip);
            let s_row = self.k.mad_u32(row, &self.layout.row_bytes, &tile);
            let lo_addr = self.k.mad_u32(kc, &16u32, &s_row);
            let angle_row = self.k.mad_u32(row, &(half * 8), &slot);
            self.rotate_chunk(lo_addr, Angles::Shared(angle_row), *kc);
            self.k.place(&skip);
        }
    }

    /// Rotates the 8 pairs at shared `lo_addr` (columns `8 kc ..`) and `lo_addr + D` (bytes) by
    /// their angles: `[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`.
    fn rotate_chunk(&mut self, lo_addr: Reg, source: Angles, kc: Reg) {
        let (cos, sin) = self.tables.expect("RoPE tables are parameters");
        let half = self.cfg.head_dim / 2;
        let k = &mut self.k;
        let hi_addr = k.add_u32(&lo_addr, &(half * 2));
        let lo_w = k.ld_shared_words(lo_addr);
        let hi_w = k.ld_shared_words(hi_addr);
        let t0 = k.mul_u32(&kc, &8u32);
        let mut angles = Vec::new();
        for (i, table) in [cos, sin].into_iter().enumerate() {
            let v = match source {
                Angles::Global(pos) => {
                    let ti = k.mad_u32(&pos, &half, &t0);
                    let a = k.address(table, &ti, 4);
                    let mut v = k.ld_global_vec16(Elem::F32, a);
                    let a2 = k.op2("add.u64", RegClass::B64, &a, &16u64);
                    v.extend(k.ld_global_vec16(Elem::F32, a2));
                    v
                }
                Angles::Shared(row) => {
                    let a0 = k.add_u32(&row, &(i as u32 * half * 4));
                    let a = k.mad_u32(&t0, &4u32, &a0);
                    let mut v = ld_shared_v4_f32(k, a, 0);
                    v.extend(ld_shared_v4_f32(k, a, 16));
                    v
                }
            };
            angles.push(v);
        }
        let (mut new_lo, mut new_hi) = (Vec::new(), Vec::new());
        for w in 0..4 {
            let x1 = self.unpack(lo_w[w]);
            let x2 = self.unpack(hi_w[w]);
            let (mut lo, mut hi) = (Vec::new(), Vec::new());
            for e in 0..2 {
                let (c, s) = (angles[0][w * 2 + e], angles[1][w * 2 + e]);
                let k = &mut self.k;
                let x1c = k.mul_f32(&x1[e], &c);
                let neg = k.op1("neg.f32", RegClass::F32, &x2[e]);
                lo.push(k.fma_f32(&neg, &s, &x1c));
                let x2c = k.mul_f32(&x2[e], &c);
                hi.push(k.fma_f32(&x1[e], &s, &x2c));
            }
            new_lo.push(self.pack(lo[0], lo[1]));
            new_hi.push(self.pack(hi[0], hi[1]));
        }
        let words = |w: Vec<Reg>| -> [Reg; 4] { w.try_into().expect("four words") };
        self.k.st_shared_words(lo_addr, &words(new_lo));
        self.k.st_shared_words(hi_addr, &words(new_hi));
    }

    /// Key rule: the block's key tiles and each thread's per-row limits.
    fn key_rule(&mut self) -> BlockKeys {
        let cfg = self.cfg;
        let (s_len, t_len) = (cfg.q_len, cfg.kv_len);
        let rows = self.rows.clone();
        let (window, min_last, max_last, last): (_, _, _, Vec<[Reg; 2]>) = match cfg.keys {
            KeyRule::All => {
                let k = &mut self.k;
                let zero = k.mov(RegClass::B32, &0u32);
                let end = k.mov(RegClass::B32, &t_len);
                return BlockKeys {
                    start: zero,
                    end,
                    interior_from: zero,
                    interior_to: end,
                    last: None,
                    first: None,
                };
            }
            KeyRule::Causal { window } => {
                // Query i sees keys j <= i + (T - S).
                let shift = t_len - s_len;
                let k = &mut self.k;
                let min_last = k.add_u32(&self.q0, &shift);
                let top0 = k.add_u32(&self.q0, &(16 * WARPS * self.m_tiles - 1));
                let top = k.op2("min.u32", RegClass::B32, &top0, &(s_len - 1));
                let max_last = k.add_u32(&top, &shift);
                let last = rows
                    .iter()
                    .map(|r| r.map(|row| k.add_u32(&row, &shift)))
                    .collect();
                (window, min_last, max_last, last)
            }
            KeyRule::Position { window } => {
                let (min_last, max_last) = self.position_range();
                let last = rows
                    .iter()
                    .map(|r| {
                        r.map(|row| {
                            let ok = self.k.setp("lt.u32", &row, &s_len);
                            let safe = self.k.selp(RegClass::B32, "u32", &row, &0u32, ok);
                            self.position(safe, s_len)
                        })
                    })
                    .collect();
                (window, min_last, max_last, last)
            }
        };
        let k = &mut self.k;
        let after = k.add_u32(&max_last, &1u32);
        let end = k.op2("min.u32", RegClass::B32, &after, &t_len);
        let min_after = k.add_u32(&min_last, &1u32);
        let interior_to = k.op2("min.u32", RegClass::B32, &min_after, &t_len);
        let zero = k.mov(RegClass::B32, &0u32);
        let (start, interior_from, first) = match window {
            None => (zero, zero, None),
            Some(w) => {
                let start_key = window_start(k, min_last, w);
                let start = k.op2("and.b32", RegClass::B32, &start_key, &!(BKV - 1));
                let interior_from = window_start(k, max_last, w);
                let first = last
                    .iter()
                    .map(|l| l.map(|x| window_start(k, x, w)))
                    .collect();
                (start, interior_from, Some(first))
            }
        };
        BlockKeys {
            start,
            end,
            interior_from,
            interior_to,
            last: Some(last),
            first,
        }
    }

    /// The smallest and largest position of the block's rows (a shared-memory reduction).
    fn position_range(&mut self) -> (Reg, Reg) {
        let bq = self.bq();
        let k = &mut self.k;
        let words = k.add_u32(&self.smem, &self.layout.range);
        let first = k.setp("eq.u32", &self.tid, &0u32);
        let skip_init = k.label("skip_range_init");
        k.bra(Some((first, false)), &skip_init);
        k.emit(format!("st.shared.u32 [{words}], {}", u32::MAX));
        k.emit(format!("st.shared.u32 [{words}+4], 0"));
        k.place(&skip_init);
        k.barrier();
        let row = k.add_u32(&self.q0, &self.tid);
        let in_block = k.setp("lt.u32", &self.tid, &bq);
        let in_seq = k.setp("lt.u32", &row, &self.cfg.q_len);
        let ok = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {ok}, {in_block}, {in_seq}"));
        let skip = k.label("skip_range");
        k.bra(Some((ok, false)), &skip);
        let pos = self.position(row, self.cfg.q_len);
        let k = &mut self.k;
        k.emit(format!("red.shared.min.u32 [{words}], {pos}"));
        k.emit(format!("red.shared.max.u32 [{words}+4], {pos}"));
        k.place(&skip);
        k.barrier();
        let lo = k.reg(RegClass::B32);
        let hi = k.reg(RegClass::B32);
        k.emit(format!("ld.shared.u32 {lo}, [{words}]"));
        k.emit(format!("ld.shared.u32 {hi}, [{words}+4]"));
        (lo, hi)
    }

    /// Stages the Q tile (rotated when asked) and loads the warp's A fragments: per m16 tile, per
    /// 16 columns of the head dimension.
    fn q_fragments(&mut self) -> Vec<Vec<Vec<Reg>>> {
        let cfg = self.cfg;
        let bq = self.bq();
        self.k
            .comment("Q tile -> shared (RoPE) -> A fragments (16 rows per m16 tile)");
        let q_tile = self.smem;
        let (q, q0) = (self.q, self.q0);
        self.stage(q, 0, q0, cfg.q_len, q_tile, bq);
        self.k.emit("cp.async.commit_group");
        self.k.emit("cp.async.wait_group 0");
        self.k.barrier();
        if cfg.rope {
            self.rotate_tile(q_tile, self.q0, cfg.q_len, bq);
            self.k.barrier();
        }
        let k = &mut self.k;
        let l15 = k.op2("and.b32", RegClass::B32, &self.lane, &15u32);
        let lhi = k.op2("shr.u32", RegClass::B32, &self.lane, &4u32);
        let w_row = k.mul_u32(&self.warp, &(16 * self.m_tiles));
        let a_row = k.add_u32(&w_row, &l15);
        let a_addr0 = k.mad_u32(&a_row, &self.layout.row_bytes, &q_tile);
        let a_addr = k.mad_u32(&lhi, &16u32, &a_addr0);
        let rb = self.layout.row_bytes;
        (0..self.m_tiles)
            .map(|mt| {
                (0..cfg.head_dim / 16)
                    .map(|kk| k.ldmatrix_x4("", a_addr, mt * 16 * rb + kk * 32))
                    .collect()
            })
            .collect()
    }

    /// The K and V tiles of buffer `index` (shared addresses).
    fn buffer(&mut self, index: &dyn Operand) -> (Reg, Reg) {
        let k = &mut self.k;
        let kv = k.add_u32(&self.smem, &self.layout.kv);
        let kt = k.mad_u32(index, &(2 * self.layout.tile_bytes), &kv);
        let vt = k.add_u32(&kt, &self.layout.tile_bytes);
        (kt, vt)
    }

    /// Queues the K/V tile at key `j` into buffer `index`, and writes its additive padding mask.
    fn stage_kv(&mut self, j: Reg, index: Reg) {
        let cfg = self.cfg;
        let (kt, vt) = self.buffer(&index);
        let (kp, v) = (self.kp, self.v);
        self.stage(kp, 1, j, cfg.kv_len, kt, BKV);
        self.stage(v, 2, j, cfg.kv_len, vt, BKV);
        let Some(mask) = self.mask else { return };
        let k = &mut self.k;
        let skip = k.label("skip_mask_stage");
        let writer = k.setp("lt.u32", &self.tid, &BKV);
        k.bra(Some((writer, false)), &skip);
        let key = k.add_u32(&j, &self.tid);
        let value = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
        let past = k.setp("ge.u32", &key, &cfg.kv_len);
        let absent = k.label("mask_absent");
        k.bra(Some((past, true)), &absent);
        let mi = k.mad_u32(&self.b, &cfg.kv_len, &key);
        let ma = k.address(mask, &mi, 8);
        let present = k.ld_global_i64(ma);
        let keep = k.setp("ne.s64", &present, &0u64);
        k.emit(format!("@{keep} mov.f32 {value}, 0f00000000"));
        k.place(&absent);
        let slot = k.mad_u32(&index, &BKV, &self.tid);
        let m0 = k.add_u32(&self.smem, &self.layout.mask);
        let addr = k.mad_u32(&slot, &4u32, &m0);
        k.emit(format!("st.shared.f32 [{addr}], {value}"));
        k.place(&skip);
    }

    /// The main loop over the block's key tiles.
    fn main_loop(&mut self, keys: &BlockKeys, q_frag: &[Vec<Vec<Reg>>]) -> Vec<RowState> {
        let cfg = self.cfg;
        let k = &mut self.k;
        let mut state: Vec<RowState> = (0..self.m_tiles)
            .map(|_| RowState::new(k, cfg.head_dim))
            .collect();
        let dropout = self.dropout_key();
        let (k_lane, v_lane) = self.lane_offsets();
        let k = &mut self.k;
        let j0 = k.mov(RegClass::B32, &keys.start);
        let it = k.mov(RegClass::B32, &0u32);
        let done = k.label("kv_tiles_done");
        let nothing = k.setp("ge.u32", &j0, &keys.end);
        k.bra(Some((nothing, true)), &done);
        k.comment("prologue: the first K/V tile into buffer 0");
        let zero = k.mov(RegClass::B32, &0u32);
        let rope_k = cfg.rope && cfg.rope_k;
        // Angles prefetched into shared memory when the layout has the slot.
        let prefetch = rope_k && self.layout.total > self.layout.angles;
        let chunks = if prefetch {
            self.key_chunks()
        } else {
            Vec::new()
        };
        self.stage_kv(j0, zero);
        if prefetch {
            let positions = self.key_positions(&chunks, j0);
            self.key_angles(&chunks, j0, &positions);
        }
        self.k.emit("cp.async.commit_group");
        let top = self.k.label("kv_tiles");
        self.k.place(&top);
        let (cur, next) = self.next_tile(keys, j0, it, &chunks);
        let (k_tile, v_tile) = self.buffer(&cur);
        if prefetch {
            self.k
                .comment("K prologue: RoPE on the landed key tile, angles prefetched");
            self.rotate_keys(&chunks, k_tile, j0);
            self.k.barrier();
        } else if rope_k {
            self.k
                .comment("K prologue: RoPE on the landed key tile, angles from global memory");
            self.rotate_tile(k_tile, j0, cfg.kv_len, BKV);
            self.k.barrier();
        }
        let k_addr = self.k.add_u32(&k_tile, &k_lane);
        let v_addr = self.k.add_u32(&v_tile, &v_lane);
        let mut s = self.scores(q_frag, k_addr);
        if let Some((has_next, j_next, positions)) = next {
            self.k
                .comment("prefetch the next key tile's angles (its positions have landed)");
            let skip = self.k.label("skip_angles");
            self.k.bra(Some((has_next, false)), &skip);
            self.key_angles(&chunks, j_next, &positions);
            self.k.place(&skip);
            self.k.emit("cp.async.commit_group");
        }
        self.mask_scores(keys, &mut s, j0, cur);
        let mut p = Vec::new();
        for (mt, (st, s)) in state.iter_mut().zip(&s).enumerate() {
            let probs = self.softmax(st, s);
            p.push(match &dropout {
                Some(key) => self.dropout(key, &probs, j0, mt),
                None => probs,
            });
        }
        self.pv(&mut state, &p, v_addr);
        let k = &mut self.k;
        k.barrier();
        k.emit(format!("add.u32 {j0}, {j0}, {BKV}"));
        k.emit(format!("add.u32 {it}, {it}, 1"));
        let more = k.setp("lt.u32", &j0, &keys.end);
        k.bra(Some((more, true)), &top);
        k.place(&done);
        k.emit("cp.async.wait_group 0");
        state
    }

    /// `ldmatrix` lane offsets within a tile for K (as B, non-transposed) and V (transposed).
    fn lane_offsets(&mut self) -> (Reg, Reg) {
        let rb = self.layout.row_bytes;
        let k = &mut self.k;
        let l15 = k.op2("and.b32", RegClass::B32, &self.lane, &15u32);
        let lhi = k.op2("shr.u32", RegClass::B32, &self.lane, &4u32);
        let l7 = k.op2("and.b32", RegClass::B32, &self.lane, &7u32);
        let l3 = k.op2("shr.u32", RegClass::B32, &self.lane, &3u32);
        let l3b = k.op2("and.b32", RegClass::B32, &l3, &1u32);
        let kn = k.mad_u32(&lhi, &8u32, &l7);
        let k_lane0 = k.mul_u32(&kn, &rb);
        let k_lane = k.mad_u32(&l3b, &16u32, &k_lane0);
        let v_lane0 = k.mul_u32(&l15, &rb);
        let v_lane = k.mad_u32(&lhi, &16u32, &v_lane0);
        (k_lane, v_lane)
    }

    /// Streams the tile after `j0` into the other buffer (an empty group past the end), starts
    /// loading its rotation positions when keys take RoPE (`chunks` not empty), waits for tile
    /// `j0`, and returns its buffer index and, with RoPE, (whether there is a next tile, its first
    /// key, its positions).
    #[allow(clippy::type_complexity)]
    fn next_tile(
        &mut self,
        keys: &BlockKeys,
        j0: Reg,
        it: Reg,
        chunks: &[(Reg, Reg)],
    ) -> (Reg, Option<(Reg, Reg, Vec<Reg>)>) {
        let j_next = self.k.add_u32(&j0, &BKV);
        let has_next = self.k.setp("lt.u32", &j_next, &keys.end);
        let skip_next = self.k.label("skip_next");
        let positions: Vec<Reg> = chunks.iter().map(|_| self.k.reg(RegClass::B32)).collect();
        self.k.bra(Some((has_next, false)), &skip_next);
        let it_next = self.k.add_u32(&it, &1u32);
        let next_buf = self.k.op2("and.b32", RegClass::B32, &it_next, &1u32);
        self.stage_kv(j_next, next_buf);
        for (slot, pos) in positions.iter().zip(self.key_positions(chunks, j_next)) {
            self.k.emit(format!("mov.u32 {slot}, {pos}"));
        }
        self.k.place(&skip_next);
        self.k.emit("cp.async.commit_group");
        self.k.emit("cp.async.wait_group 1");
        self.k.barrier();
        let cur = self.k.op2("and.b32", RegClass::B32, &it, &1u32);
        let next = (!chunks.is_empty()).then_some((has_next, j_next, positions));
        (cur, next)
    }

    /// `S = Q K^T` for each of the warp's m16 tiles against the tile's 64 keys (unscaled: the
    /// softmax folds the scale into its exponent).
    fn scores(&mut self, q_frag: &[Vec<Vec<Reg>>], k_addr: Reg) -> Vec<Vec<Reg>> {
        let ty = self.cfg.elem.name();
        let k = &mut self.k;
        k.comment("S = Q K^T (16 x 64 per m16 tile; each K fragment feeds every m16 tile)");
        let s: Vec<Vec<Reg>> = (0..self.m_tiles)
            .map(|_| {
                (0..(BKV / 8) * 4)
                    .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                    .collect()
            })
            .collect();
        for kk in 0..self.cfg.head_dim / 16 {
            for jj in 0..BKV / 16 {
                let off = jj * 16 * self.layout.row_bytes + kk * 32;
                let r = k.ldmatrix_x4("", k_addr, off);
                for (half, bf) in [[r[0], r[1]], [r[2], r[3]]].iter().enumerate() {
                    let n = (jj as usize * 2 + half) * 4;
                    for (a, s) in q_frag.iter().zip(&s) {
                        k.mma_m16n8k16(ty, &s[n..n + 4], &a[kk as usize], bf);
                    }
                }
            }
        }
        s
    }

    /// Key rule and mask: the additive padding mask of the tile, then, on edge tiles only, keys
    /// past the end, after each row's last key or before its window.
    fn mask_scores(&mut self, keys: &BlockKeys, s: &mut [Vec<Reg>], j0: Reg, cur: Reg) {
        let cfg = self.cfg;
        let k = &mut self.k;
        if self.mask.is_some() {
            k.comment("padding: the tile's additive mask");
            let m0 = k.add_u32(&self.smem, &self.layout.mask);
            let row = k.mad_u32(&cur, &(BKV * 4), &m0);
            let base = k.mad_u32(&self.t2, &4u32, &row);
            for nt in 0..BKV / 8 {
                let (a, b) = (k.reg(RegClass::F32), k.reg(RegClass::F32));
                k.emit(format!(
                    "ld.shared.v2.f32 {{{a}, {b}}}, [{base}+{}]",
                    nt * 32
                ));
                for s in s.iter() {
                    for (r, add) in [a, b, a, b].iter().enumerate() {
                        let reg = s[(nt * 4) as usize + r];
                        k.emit(format!("add.f32 {reg}, {reg}, {add}"));
                    }
                }
            }
        }
        k.comment("edge tiles: keys past the end, past each row's last key, before its window");
        let interior = k.label("interior_tile");
        let tile_end = k.add_u32(&j0, &BKV);
        let inside_to = k.setp("le.u32", &tile_end, &keys.interior_to);
        let inside_from = k.setp("ge.u32", &j0, &keys.interior_from);
        let inside = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {inside}, {inside_to}, {inside_from}"));
        k.bra(Some((inside, true)), &interior);
        let neg_inf = F32(f32::NEG_INFINITY).text();
        let col_base = k.add_u32(&j0, &self.t2);
        for nt in 0..BKV / 8 {
            for c in 0..2u32 {
                let col = k.add_u32(&col_base, &(nt * 8 + c));
                let past_end = k.setp("ge.u32", &col, &cfg.kv_len);
                for (mt, s) in s.iter().enumerate() {
                    for half in 0..2usize {
                        let reg = s[(nt * 4 + half as u32 * 2 + c) as usize];
                        let out = k.reg(RegClass::Pred);
                        k.emit(format!("mov.pred {out}, {past_end}"));
                        if let Some(last) = &keys.last {
                            let after = k.setp("gt.u32", &col, &last[mt][half]);
                            k.emit(format!("or.pred {out}, {out}, {after}"));
                        }
                        if let Some(first) = &keys.first {
                            let before = k.setp("lt.u32", &col, &first[mt][half]);
                            k.emit(format!("or.pred {out}, {out}, {before}"));
                        }
                        k.emit(format!("@{out} mov.f32 {reg}, {neg_inf}"));
                    }
                }
            }
        }
        k.place(&interior);
    }

    /// Online softmax of one m16 tile: the row max over the quad, rescale, exponentiate with the
    /// scale folded in (`2^(s * scale * log2 e - m)`); returns P (f32) in the score accumulators'
    /// layout. Row sums are taken before any dropout.
    fn softmax(&mut self, st: &mut RowState, s: &[Reg]) -> Vec<Reg> {
        let k = &mut self.k;
        k.comment("online softmax: row max over the quad, rescale, exponentiate");
        let neg_inf = F32(f32::NEG_INFINITY);
        let scale = F32(self.cfg.scale * std::f32::consts::LOG2_E);
        let mut p_regs = s.to_vec();
        for half in 0..2u32 {
            let (mi, li) = (st.m[half as usize], st.l[half as usize]);
            let mut mx = k.mov(RegClass::F32, &neg_inf);
            for nt in 0..BKV / 8 {
                for c in 0..2 {
                    mx = k.max_f32(&mx, &s[(nt * 4 + half * 2 + c) as usize]);
                }
            }
            for off in [1u32, 2] {
                let other = k.reg(RegClass::F32);
                k.emit(format!("shfl.sync.bfly.b32 {other}, {mx}, {off}, 31, -1"));
                mx = k.max_f32(&mx, &other);
            }
            // The scale is positive (`supports`), so the max commutes with it.
            let scaled = k.mul_f32(&mx, &scale);
            let m_new = k.max_f32(&mi, &scaled);
            // A row that has seen no key yet keeps m = -inf; use 0 so that exp2 gives 0, not NaN.
            let none = k.setp("eq.f32", &m_new, &neg_inf);
            let m_use = k.selp(RegClass::F32, "f32", &F32(0.0), &m_new, none);
            let dm = k.sub_f32(&mi, &m_use);
            let corr = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
            k.emit(format!("mov.f32 {mi}, {m_new}"));
            let neg_m = k.op1("neg.f32", RegClass::F32, &m_use);
            let row_sum = k.mov(RegClass::F32, &F32(0.0));
            for nt in 0..BKV / 8 {
                for c in 0..2 {
                    let idx = (nt * 4 + half * 2 + c) as usize;
                    let e = k.fma_f32(&s[idx], &scale, &neg_m);
                    let p = k.op1("ex2.approx.ftz.f32", RegClass::F32, &e);
                    k.emit(format!("add.f32 {row_sum}, {row_sum}, {p}"));
                    p_regs[idx] = p;
                }
            }
            k.emit(format!("fma.rn.f32 {li}, {li}, {corr}, {row_sum}"));
            for dt in 0..self.cfg.head_dim / 8 {
                for c in 0..2 {
                    let reg = st.o[(dt * 4 + half * 2 + c) as usize];
                    k.emit(format!("mul.rn.f32 {reg}, {reg}, {corr}"));
                }
            }
        }
        p_regs
    }

    /// The Philox key and plane of this block, when training-mode dropout is on.
    fn dropout_key(&mut self) -> Option<DropoutKey> {
        let dropout = self.cfg.dropout?;
        let k = &mut self.k;
        let key = philox_key(k, self.seed.expect("a seed operand"));
        let plane = k.mad_u32(&self.b, &self.cfg.heads, &self.h);
        Some(DropoutKey {
            key,
            plane,
            stream: dropout.stream,
            threshold: dropout.threshold,
            keep_scale: dropout.keep_scale,
        })
    }

    /// Dropout on P of m16 tile `mt`: element (row, col) is kept when Philox word `col & 3` of
    /// counter `(col >> 2, row, plane, stream)` is at least the threshold, and scaled by
    /// `1 / (1 - p)`. A thread's column pair `(2t, 2t + 1)` shares one counter.
    fn dropout(&mut self, key: &DropoutKey, p: &[Reg], j0: Reg, mt: usize) -> Vec<Reg> {
        let k = &mut self.k;
        k.comment("dropout: one Philox block per (row, column pair)");
        let mut out = p.to_vec();
        let col_base = k.add_u32(&j0, &self.t2);
        for nt in 0..BKV / 8 {
            let col = k.add_u32(&col_base, &(nt * 8));
            let upper = k.op2("and.b32", RegClass::B32, &col, &2u32);
            let second = k.setp("ne.u32", &upper, &0u32);
            for half in 0..2u32 {
                let row = self.rows[mt][half as usize];
                let w = philox_words(k, key.key, key.stream, key.plane, row, col);
                for c in 0..2usize {
                    let word = k.selp(RegClass::B32, "b32", &w[2 + c], &w[c], second);
                    let keep = k.setp("ge.u32", &word, &key.threshold);
                    let idx = (nt * 4 + half * 2) as usize + c;
                    let scaled = k.mul_f32(&p[idx], &F32(key.keep_scale));
                    out[idx] = k.selp(RegClass::F32, "f32", &scaled, &F32(0.0), keep);
                }
            }
        }
        out
    }

    /// `O += P V`: P re-packed from the score accumulators as A fragments; each V fragment feeds
    /// every m16 tile.
    fn pv(&mut self, st: &mut [RowState], p: &[Vec<Reg>], v_addr: Reg) {
        let ty = self.cfg.elem.name();
        self.k
            .comment("O += P V: P re-packed from the score accumulators as A fragments");
        for kb in 0..BKV / 16 {
            let t0 = (kb * 2 * 4) as usize;
            let t1 = ((kb * 2 + 1) * 4) as usize;
            let a: Vec<[Reg; 4]> = p
                .iter()
                .map(|p| {
                    [
                        self.pack(p[t0], p[t0 + 1]),
                        self.pack(p[t0 + 2], p[t0 + 3]),
                        self.pack(p[t1], p[t1 + 1]),
                        self.pack(p[t1 + 2], p[t1 + 3]),
                    ]
                })
                .collect();
            let k = &mut self.k;
            for dd in 0..self.cfg.head_dim / 16 {
                let off = kb * 16 * self.layout.row_bytes + dd * 32;
                let r = k.ldmatrix_x4(".trans", v_addr, off);
                for (half, bf) in [[r[0], r[1]], [r[2], r[3]]].iter().enumerate() {
                    let n = ((dd * 2) as usize + half) * 4;
                    for (a, st) in a.iter().zip(st.iter()) {
                        k.mma_m16n8k16(ty, &st.o[n..n + 4], a, bf);
                    }
                }
            }
        }
    }

    /// Epilogue: normalise by the quad-summed row sums (zeros for a row that saw no key) and store.
    fn store(&mut self, state: &[RowState]) {
        let cfg = self.cfg;
        let k = &mut self.k;
        k.comment("normalise by the quad-summed row sums and store");
        for (st, rows) in state.iter().zip(&self.rows) {
            for (half, li) in st.l.iter().enumerate() {
                let mut total = *li;
                for off in [1u32, 2] {
                    let other = k.reg(RegClass::F32);
                    k.emit(format!(
                        "shfl.sync.bfly.b32 {other}, {total}, {off}, 31, -1"
                    ));
                    total = k.add_f32(&total, &other);
                }
                let inv = reciprocal_or_zero(k, total);
                let row = rows[half];
                let skip: Label = k.label("skip_row");
                let past = k.setp("ge.u32", &row, &cfg.q_len);
                k.bra(Some((past, true)), &skip);
                let o_row = k.mad_u32(&row, &cfg.strides[3][2], &self.o_head);
                let col0 = k.add_u32(&o_row, &self.t2);
                for dt in 0..cfg.head_dim / 8 {
                    let lo = k.mul_f32(&st.o[(dt * 4) as usize + half * 2], &inv);
                    let hi = k.mul_f32(&st.o[(dt * 4) as usize + half * 2 + 1], &inv);
                    let idx = k.add_u32(&col0, &(dt * 8));
                    let addr = k.address(self.out, &idx, 2);
                    let w = k.reg(RegClass::B32);
                    k.emit(format!("cvt.rn.{}x2.f32 {w}, {hi}, {lo}", cfg.elem.name()));
                    k.emit(format!("st.global.b32 [{addr}], {w}"));
                }
                k.place(&skip);
            }
        }
    }
}

fn ld_shared_v4_f32(k: &mut Kernel, addr: Reg, offset: u32) -> Vec<Reg> {
    let v: Vec<Reg> = (0..4).map(|_| k.reg(RegClass::F32)).collect();
    k.emit(format!(
        "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{addr}+{offset}]",
        v[0], v[1], v[2], v[3]
    ));
    v
}
