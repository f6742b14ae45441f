//! Decode attention over a KV cache (one query row per sequence, f16/bf16): one warp per (key
//! range, K/V head, sequence) serves the head's whole query group from one read of its K/V
//! rows, on tensor cores (`mma.sync` m16n8k16, the group's heads rows 0..group of A's 16), a tile
//! of `tile_keys` keys at a time:
//! 1. loads: thread `t` takes keys `8j + t / 4` of the tile and the quarter `t % 4` of their K
//!    and V rows (16-byte loads). The head dimension is permuted so that these contiguous words
//!    are the B fragments of `q K^T` as they stand (and q's A fragments take the same
//!    permutation);
//! 2. scores per 8 keys, then a base-2 online softmax per head across the 4 threads of its row;
//! 3. values: the weights, rounded, are the A fragments of `P V` as they stand (as in
//!    FlashAttention-2), and each 8x8 block of V's words is transposed in registers
//!    (`movmatrix`) into a B fragment; the output's columns come back in a permuted order that
//!    leaves each thread a contiguous quarter of its head's row.
//!
//! After the last tile the accumulators go through shared memory into the layout the stores and
//! merges below share with the SIMT kernels: each lane a slice of every head's dimensions.
//! With several key ranges (`splits`, flash-decoding) each warp writes its heads' partial
//! results, which `attention::attention_combine` merges, exactly as for the SIMT kernel: the same
//! `partial_acc` / `partial_ml` layout, running maxima in base 2. A kernel that merges them itself
//! ([`Extras::combine`]) splits each row's keys over only the blocks they need, `BLOCK_KEYS`
//! each (the rest exit): a row whose keys one block takes merges its warps' ranges in shared
//! memory, and only longer rows count their blocks and merge through memory. Where the SIMT kernel
//! (`crate::attention`) gives each query head its own warp, a K/V head with a group of 4
//! (Llama's 32 heads over 8) is read 4 times; here it is read once.

use crate::attention::{
    combine_row, keys_in, reciprocal_or_zero, rotated_element, share_of_keys, store_max_and_sum,
    window_range, AttentionConfig, KeyRule, Splits,
};
use crate::kv_cache::write_row;
use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Label, Reg, RegClass, F32};
use crate::{GeneratedKernel, KernelPath, Launch};

/// Key ranges (warps) per block.
const WARPS: u32 = 8;
// A row's counted key ranges (whole blocks of `WARPS`) are merged by `combine_row` 8 at a time.
const _: () = assert!(
    WARPS.is_multiple_of(8),
    "combine_row adds counted ranges in eights"
);
/// The largest query group one warp serves: rows 0..8 of the products' 16 (rows 8..16 are zero).
const MAX_GROUP: u32 = 8;

/// The keys a warp takes at a time: 8 per n-block of the score product, as many as keep a
/// thread's K words, and its V words, at 32 registers (32 keys at D = 64, 16 at D = 128).
fn tile_keys(cfg: &AttentionConfig) -> u32 {
    2048 / cfg.head_dim
}

/// Whether `cfg` is a decode step this kernel serves: one query row over a cache (position
/// keys, RoPE on q only), no padding mask or dropout, f16/bf16, a head dimension of 64 or 128
/// (2 or 4 elements per lane), a query group of at most `MAX_GROUP`, and strides that keep
/// each lane's elements aligned.
pub fn supports(cfg: &AttentionConfig) -> bool {
    matches!(cfg.keys, KeyRule::Position { .. })
        && cfg.q_len == 1
        && !cfg.padding
        && !cfg.rope_k
        && cfg.dropout.is_none()
        && cfg.elem != Elem::F32
        && matches!(cfg.head_dim, 64 | 128)
        && cfg.heads.is_multiple_of(cfg.kv_heads)
        && cfg.heads / cfg.kv_heads <= MAX_GROUP
        && cfg.strides.iter().all(|s| s.iter().all(|v| v % 8 == 0))
}

/// The step's new key and value, which the kernel writes into the caches itself (in place of
/// two `kv_write` launches before it): `cache[b, kvh, pos[b], :] = new[b, kvh, 0, :]` where
/// `mask[b]` is 1 and `pos[b]` is within the cache, the key rotated with q's RoPE tables when
/// `cfg.rope`. The warp whose key range holds `pos[b]` writes both rows, then reads them back
/// as any other key; no other warp reads them, so no block waits for another.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEntries {
    /// `[batch, head, row]` strides (elements) of the new keys and of the new values: head
    /// views of the QKV product.
    pub strides: [[u32; 3]; 2],
}

/// What the kernel does besides the attention: write the step's [`NewEntries`], and with
/// several key ranges merge them itself (`combine`, in place of an `attention_combine` launch
/// after it: in shared memory when one block takes a row's keys, else the last of the row's
/// blocks to finish merges its query heads).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extras {
    /// The step's new key and value, written into the caches.
    pub new: Option<NewEntries>,
    /// Merge the key ranges (`cfg.splits` a multiple of the block's `WARPS` ranges).
    pub combine: bool,
}

/// Whether the kernel can merge `cfg`'s key ranges itself ([`Extras::combine`]): several ranges,
/// every block's warps all taking one.
pub fn combines(cfg: &AttentionConfig) -> bool {
    cfg.splits > 1 && cfg.splits.is_multiple_of(WARPS)
}

/// The kernel doing `extras` too (`{attention name}[_writes][_combined]_decode`). Parameters:
/// [`attention_decode`]'s, then `k_new, v_new, mask` with the writes, `counters, out` when it
/// combines (`counters`: a u32 per sequence and K/V head, zero before the launch and left zero).
pub fn attention_decode_with(cfg: &AttentionConfig, extras: &Extras) -> GeneratedKernel {
    let mut name = cfg.name();
    if extras.new.is_some() {
        name.push_str("_writes");
    }
    if extras.combine {
        assert!(combines(cfg), "merging needs whole blocks of key ranges");
        name.push_str("_combined");
    }
    kernel(cfg, extras, format!("{name}_decode"))
}

/// The counters [`Extras::combine`] needs, bytes.
pub fn counter_bytes(cfg: &AttentionConfig) -> u64 {
    u64::from(cfg.batch * cfg.kv_heads) * 4
}

/// Generates the kernel. Parameters: `q, k, v, out` (or `partial_acc, partial_ml` with
/// several key ranges), `positions, [cos, sin]`, as the SIMT kernel names them.
pub fn attention_decode(cfg: &AttentionConfig, name: String) -> GeneratedKernel {
    kernel(cfg, &Extras::default(), name)
}

fn kernel(cfg: &AttentionConfig, extras: &Extras, name: String) -> GeneratedKernel {
    assert!(supports(cfg), "not a decode step this kernel serves");
    let mut k = Kernel::new(&name);
    let params = Params::declare(&mut k, cfg, extras);
    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let bx = k.special("ctaid.x");
    let split = k.mad_u32(&bx, &WARPS, &warp);
    let kvh = k.special("ctaid.y");
    let b = k.special("ctaid.z");
    let exit = k.label("exit");
    let past = k.setp("ge.u32", &split, &cfg.splits);
    k.bra(Some((past, true)), &exit);

    let per_lane = cfg.head_dim / 32;
    let first = k.mul_u32(&lane, &per_lane);
    // Positions are the step's inputs and the cache rows before them earlier steps' writes: no
    // kernel of this step writes either before this one, so they are read before the wait.
    let pa = k.address(params.positions, &b, 8);
    let wide = k.ld_global_i64(pa);
    let pos = k.op1("cvt.u32.u64", RegClass::B32, &wide);
    let range = key_window(&mut k, cfg, pos);
    let taken = params
        .combine
        .map(|_| Taken::count(&mut k, cfg, range, bx, &exit));
    let splits = taken
        .as_ref()
        .map_or(Splits::Fixed(cfg.splits), |t| Splits::Counted(t.splits));
    let (from, to) = share_of_keys(&mut k, range, splits, split);
    prefetch(&mut k, cfg, &params, [b, kvh, lane, pos, from, to]);
    k.wait_for_inputs();
    let group = cfg.heads / cfg.kv_heads;
    let shared = Shared::declare(&mut k, cfg, warp);
    k.comment("q of each head of the group, rotated");
    for g in 0..group {
        let h = k.mad_u32(&kvh, &group, &g);
        let q = load_q(&mut k, cfg, &params, [b, h, first, pos]);
        for (c, v) in q.iter().enumerate() {
            let col = k.add_u32(&first, &(c as u32));
            let at = shared.q_at(&mut k, cfg, g, col);
            k.emit(format!("st.shared.f32 [{at}], {v}"));
        }
    }
    k.emit("bar.warp.sync -1");
    if let Some(new) = &extras.new {
        write_new_entries(&mut k, cfg, &params, new, [b, kvh, lane, pos, from, to]);
    }
    let tiles = Tiles {
        cfg,
        params: &params,
        shared: &shared,
    };
    let state = tiles.run(&mut k, [b, kvh, lane, first, from, to]);
    // The heads' indices again for the stores, rather than held in registers across the tiles.
    let heads: Vec<Reg> = (0..group).map(|g| k.mad_u32(&kvh, &group, &g)).collect();
    let in_block = k.label("merge_in_block");
    if let Some(t) = &taken {
        k.bra(Some((t.one_block, true)), &in_block);
    }
    store(
        &mut k,
        cfg,
        &params,
        &state,
        &heads,
        [b, split, lane, first],
    );
    if let (Some(targets), Some(t)) = (params.combine, &taken) {
        merge_when_last(&mut k, cfg, &params, targets, t, [b, kvh, tid, warp, lane]);
        k.bra(None, &exit);
        k.place(&in_block);
        let out = targets[1];
        merge_in_block(
            &mut k,
            cfg,
            (&shared, &state),
            out,
            [b, kvh, warp, lane, first],
        );
    }
    k.place(&exit);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.splits.div_ceil(WARPS), cfg.kv_heads, cfg.batch],
            block: [32 * WARPS, 1, 1],
            shared_bytes: 0,
        },
    )
    .on(KernelPath::Simt)
}

/// The kernel's pointer parameters.
struct Params {
    q: Reg,
    k: Reg,
    v: Reg,
    /// `out`, or `partial_acc` with several key ranges.
    out: Reg,
    partial_ml: Option<Reg>,
    positions: Reg,
    tables: Option<(Reg, Reg)>,
    /// `k_new, v_new, mask` when the kernel writes the step's [`NewEntries`].
    writes: Option<[Reg; 3]>,
    /// `counters, out` when it merges its key ranges.
    combine: Option<[Reg; 2]>,
    /// The block table of a paged cache, and its layout.
    table: Option<(Reg, Paging)>,
}

impl Params {
    /// Where sequence `b`'s rows of K/V head `kvh` are in the `k` (`which` 1) or `v` (2) cache.
    fn cache_rows(
        &self,
        k: &mut Kernel,
        cfg: &AttentionConfig,
        which: usize,
        b_kvh: [Reg; 2],
    ) -> KeyRows {
        KeyRows::new(k, cfg.strides[which], b_kvh, self.table)
    }
}

impl Params {
    fn declare(k: &mut Kernel, cfg: &AttentionConfig, extras: &Extras) -> Params {
        let q = k.param_ptr("q");
        let kp = k.param_ptr("k");
        let v = k.param_ptr("v");
        let (out, partial_ml) = if cfg.splits > 1 {
            (k.param_ptr("partial_acc"), Some(k.param_ptr("partial_ml")))
        } else {
            (k.param_ptr("out"), None)
        };
        let positions = k.param_ptr("positions");
        let tables = cfg.rope.then(|| (k.param_ptr("cos"), k.param_ptr("sin")));
        let writes = extras
            .new
            .as_ref()
            .map(|_| ["k_new", "v_new", "mask"].map(|p| k.param_ptr(p)));
        let combine = extras
            .combine
            .then(|| [k.param_scratch("counters"), k.param_ptr("out")]);
        let table = cfg.paging.map(|p| (k.param_ptr("table"), p));
        Params {
            q,
            k: kp,
            v,
            out,
            partial_ml,
            positions,
            tables,
            writes,
            combine,
            table,
        }
    }
}

/// The lane's elements `first..first + per_lane` of q's row for head `h`, rotated (RoPE at
/// `pos`, `rotate_half`'s pairing as the IR defines it); the scale is applied to the scores.
fn load_q(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    [b, h, first, pos]: [Reg; 4],
) -> Vec<Reg> {
    let e = cfg.elem;
    let [qs, ..] = cfg.strides;
    let t0 = k.mul_u32(&b, &qs[0]);
    let row = k.mad_u32(&h, &qs[1], &t0);
    let half = cfg.head_dim / 2;
    (0..cfg.head_dim / 32)
        .map(|c| {
            let col = k.add_u32(&first, &c);
            let idx = k.add_u32(&row, &col);
            let a = k.address(params.q, &idx, e.bytes());
            let x = k.ld_global(e, a);
            match params.tables {
                None => x,
                Some(tables) => rotated_element(k, e, [params.q, row, col, pos], x, half, tables),
            }
        })
        .collect()
}

/// The keys a warp sends towards L2 before the wait: the first of its range, a key per lane at a
/// time.
const PREFETCH_KEYS: u32 = 64;

/// Sends the K and V rows of the warp's first [`PREFETCH_KEYS`] keys of `[from, to)` and the
/// RoPE tables' row at `pos` towards L2 while the kernel before runs, so that the loads after
/// the wait find them there.
fn prefetch(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    [b, kvh, lane, pos, from, to]: [Reg; 6],
) {
    k.comment("the first tiles' K and V rows and the RoPE row towards L2 before the wait");
    let e = cfg.elem;
    let row_bytes = cfg.head_dim * e.bytes();
    for (which, cache) in [(1, params.k), (2, params.v)] {
        let rows = params.cache_rows(k, cfg, which, [b, kvh]);
        for t in 0..PREFETCH_KEYS / 32 {
            let j0 = k.add_u32(&from, &(t * 32));
            let j = k.add_u32(&j0, &lane);
            let inside = k.setp("lt.u32", &j, &to);
            let row = rows.row(k, &j);
            let a = k.address(cache, &row, e.bytes());
            for line in (0..row_bytes).step_by(128) {
                k.emit(format!("@{inside} prefetch.global.L2 [{a}+{line}]"));
            }
        }
    }
    if let Some((cos, sin)) = params.tables {
        let half = cfg.head_dim / 2;
        let lines = (half * 4).div_ceil(128);
        let in_table = k.setp("lt.u32", &pos, &cfg.kv_len);
        let line_lane = k.setp("lt.u32", &lane, &lines);
        let first_lanes = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {first_lanes}, {in_table}, {line_lane}"));
        let t = k.mul_u32(&pos, &half);
        let at = k.mad_u32(&lane, &32u32, &t);
        for table in [cos, sin] {
            let a = k.address(table, &at, 4);
            k.emit(format!("@{first_lanes} prefetch.global.L2 [{a}]"));
        }
    }
}

/// The first element of sequence `b`'s K/V head `kvh` in a tensor of batch and head strides
/// `[batch, head]` (a cache, or the step's new keys and values).
fn head_start(k: &mut Kernel, [b, kvh]: [Reg; 2], [batch, head]: [u32; 2]) -> Reg {
    let c0 = k.mul_u32(&b, &batch);
    k.mad_u32(&kvh, &head, &c0)
}

/// The keys `[start, end)` the query at `pos` sees.
fn key_window(k: &mut Kernel, cfg: &AttentionConfig, pos: Reg) -> (Reg, Reg) {
    let KeyRule::Position { window } = cfg.keys else {
        unreachable!("supports() admits position keys only")
    };
    window_range(k, pos, window, cfg.kv_len)
}

/// The most keys a block takes when the kernel merges its key ranges: 64 per warp. A
/// row's keys take as many blocks as they need at this many each (at most the grid's), so
/// that a short context runs in one block, which merges its warps' ranges in shared memory
/// without the count of finished blocks and the reads back through L2 that blocks merging
/// across the grid need.
const BLOCK_KEYS: u32 = 2 * WARPS * 32;

/// The blocks (and key ranges, [`WARPS`] per block) a row's keys take when the kernel merges
/// them ([`BLOCK_KEYS`] each); the other blocks of the row exit at once.
struct Taken {
    blocks: Reg,
    splits: Reg,
    /// Whether one block takes them all.
    one_block: Reg,
}

impl Taken {
    fn count(
        k: &mut Kernel,
        cfg: &AttentionConfig,
        range: (Reg, Reg),
        bx: Reg,
        exit: &Label,
    ) -> Taken {
        k.comment("the blocks this row's keys take; the rest exit");
        let len = keys_in(k, range);
        let more = k.add_u32(&len, &(BLOCK_KEYS - 1));
        let needed = k.op2("div.u32", RegClass::B32, &more, &BLOCK_KEYS);
        let at_least_one = k.op2("max.u32", RegClass::B32, &needed, &1u32);
        let blocks = k.op2(
            "min.u32",
            RegClass::B32,
            &at_least_one,
            &(cfg.splits / WARPS),
        );
        let idle = k.setp("ge.u32", &bx, &blocks);
        k.bra(Some((idle, true)), exit);
        Taken {
            blocks,
            splits: k.mul_u32(&blocks, &WARPS),
            one_block: k.setp("eq.u32", &blocks, &1u32),
        }
    }
}

/// The step's new key (rotated) and value written into the caches at `pos` by the warp whose key
/// range `[from, to)` holds it (`to` is within the cache), when the row's mask is set; the
/// warp's barrier then orders those stores before its own loads of the rows.
fn write_new_entries(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    new: &NewEntries,
    [b, kvh, lane, pos, from, to]: [Reg; 6],
) {
    let [k_new, v_new, mask] = params.writes.expect("declared with the writes");
    k.comment("the step's new key and value into the caches");
    let done = k.label("written");
    let ma = k.address(mask, &b, 8);
    let present = k.ld_global_i64(ma);
    let absent = k.setp("eq.s64", &present, &0u64);
    k.bra(Some((absent, true)), &done);
    let before = k.setp("lt.u32", &pos, &from);
    k.bra(Some((before, true)), &done);
    let after = k.setp("ge.u32", &pos, &to);
    k.bra(Some((after, true)), &done);
    let rows = [
        (k_new, params.k, new.strides[0]),
        (v_new, params.v, new.strides[1]),
    ];
    for (i, (src, cache, [sb, sh, _])) in rows.into_iter().enumerate() {
        let src_row = head_start(k, [b, kvh], [sb, sh]);
        let dst_row = params.cache_rows(k, cfg, i + 1, [b, kvh]).row(k, &pos);
        let rope = params.tables.filter(|_| i == 0).map(|t| (t, pos));
        write_row(
            k,
            cfg.elem,
            cfg.head_dim,
            lane,
            [src, src_row],
            [cache, dst_row],
            rope,
        );
    }
    k.emit("bar.warp.sync -1");
    k.place(&done);
}

/// Each head's running max (base 2, the same in every lane), this lane's share of the running
/// sum (its keys' weights) and accumulators (the lane's elements of the head dimension): the
/// layout the stores and merges take.
struct State {
    m: Vec<Reg>,
    l: Vec<Reg>,
    acc: Vec<Vec<Reg>>,
}

/// The warp's shared memory: every head's q (`[group, D]` f32; then each thread's A-fragment
/// words at the start of its quarter; at the end the accumulators) and each head's running max
/// and sum (`[group, 2]` f32), at this warp's offset.
struct Shared {
    q: Reg,
    ml: Reg,
    /// Where the block's q array starts (warp 0's).
    q_block: Reg,
}

impl Shared {
    fn declare(k: &mut Kernel, cfg: &AttentionConfig, warp: Reg) -> Shared {
        let group = cfg.heads / cfg.kv_heads;
        let q_bytes = group * cfg.head_dim * 4;
        let ml_bytes = group * 8;
        let q_name = k.shared("q_group", WARPS * q_bytes);
        let ml_name = k.shared("head_ml", WARPS * ml_bytes);
        let q_block = k.shared_base(&q_name);
        let ml_block = k.shared_base(&ml_name);
        Shared {
            q: k.mad_u32(&warp, &q_bytes, &q_block),
            ml: k.mad_u32(&warp, &ml_bytes, &ml_block),
            q_block,
        }
    }

    /// The address of head `g`'s q element `col`.
    fn q_at(&self, k: &mut Kernel, cfg: &AttentionConfig, g: u32, col: Reg) -> Reg {
        let i = k.add_u32(&col, &(g * cfg.head_dim));
        k.mad_u32(&i, &4u32, &self.q)
    }
}

/// A thread's place in the products' fragments: row (query head) `g = lane / 4`, real when
/// below the group, and quarter `q4 = lane % 4` (of a row's 8 key columns, pairs
/// `2 q4, 2 q4 + 1`; of K, V and the output's elements, the contiguous `q4 * D/4 ..`).
struct Quad {
    g: Reg,
    q4: Reg,
    real: Reg,
    /// `q4 * D / 4`: the thread's first element of a K or V row.
    col: Reg,
}

impl Quad {
    fn new(k: &mut Kernel, cfg: &AttentionConfig, lane: Reg) -> Quad {
        let g = k.op2("shr.u32", RegClass::B32, &lane, &2u32);
        let q4 = k.op2("and.b32", RegClass::B32, &lane, &3u32);
        Quad {
            real: k.setp("lt.u32", &g, &(cfg.heads / cfg.kv_heads)),
            col: k.mul_u32(&q4, &(cfg.head_dim / 4)),
            g,
            q4,
        }
    }
}

/// The thread's row of the products (head `g`): its running max (base 2, the same in the
/// quad), its share of the running sum, and its quarter of the accumulators, an `[o0, o1]`
/// pair of output elements per n-block of 8 columns.
struct Running {
    m: Reg,
    l: Reg,
    o: Vec<[Reg; 2]>,
}

impl Running {
    fn new(k: &mut Kernel, cfg: &AttentionConfig) -> Running {
        Running {
            m: k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)),
            l: k.mov(RegClass::F32, &F32(0.0)),
            o: (0..cfg.head_dim / 8)
                .map(|_| [0; 2].map(|_| k.mov(RegClass::F32, &F32(0.0))))
                .collect(),
        }
    }
}

/// `d[0..2] = a b + c` with `mma.sync.aligned.m16n8k16` on `ty` operands: rows 8..16 of A are
/// zero here (`zero`), so the results' rows 8..16 are dropped and read as zero.
fn mma_upper(k: &mut Kernel, ty: &str, d: [Reg; 2], a: [Reg; 2], b: [Reg; 2], c: [Reg; 2]) {
    let zero = k.mov(RegClass::B32, &0u32);
    let fzero = k.mov(RegClass::F32, &F32(0.0));
    let dropped = [k.reg(RegClass::F32), k.reg(RegClass::F32)];
    k.emit(format!(
        "mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{}, {}, {}, {}}}, {{{}, {zero}, {}, {zero}}}, {{{}, {}}}, {{{}, {}, {fzero}, {fzero}}}",
        d[0], d[1], dropped[0], dropped[1], a[0], a[1], b[0], b[1], c[0], c[1]
    ));
}

/// Whether a tile's V words are loaded with its K words (in flight together), rather than
/// once the scores have taken K's. At D = 64 both fit in two blocks' registers a
/// multiprocessor; at D = 128 (one block either way) loading them together measured slower.
fn values_ahead(cfg: &AttentionConfig) -> bool {
    cfg.head_dim == 64
}

/// The tile loop's inputs.
struct Tiles<'a> {
    cfg: &'a AttentionConfig,
    params: &'a Params,
    shared: &'a Shared,
}

impl Tiles<'_> {
    /// The keys `[from, to)`, [`tile_keys`] at a time; every head's state in the lanes' layout.
    fn run(&self, k: &mut Kernel, [b, kvh, lane, first, from, to]: [Reg; 6]) -> State {
        let cfg = self.cfg;
        let quad = Quad::new(k, cfg, lane);
        let q = self.q_words(k, &quad);
        let k_rows = self.params.cache_rows(k, cfg, 1, [b, kvh]);
        let v_rows = self.params.cache_rows(k, cfg, 2, [b, kvh]);
        let run = Running::new(k, cfg);
        let t0 = k.mov(RegClass::B32, &from);
        let top = k.label("tiles");
        let done = k.label("tiles_done");
        k.place(&top);
        let finished = k.setp("ge.u32", &t0, &to);
        k.bra(Some((finished, true)), &done);
        let base = k.add_u32(&t0, &quad.g);
        let rows: Vec<(Reg, [Reg; 2])> = (0..tile_keys(cfg) / 8)
            .map(|j| {
                let key = k.add_u32(&base, &(8 * j));
                let inside = k.setp("lt.u32", &key, &to);
                let k_row = k_rows.row(k, &key);
                // K and V share their rows' offsets when they share strides (a paged pool, or
                // the two halves of one cache layout).
                let v_row = if cfg.strides[1] == cfg.strides[2] {
                    k_row
                } else {
                    v_rows.row(k, &key)
                };
                (inside, [k_row, v_row])
            })
            .collect();
        // Operand `i` (0: K, 1: V) of each of the thread's keys.
        let load = |k: &mut Kernel, cache: Reg, i: usize, zeroed: bool| -> Vec<Vec<Reg>> {
            rows.iter()
                .map(|(inside, row)| self.quarter_row(k, cache, row[i], &quad, (*inside, zeroed)))
                .collect()
        };
        let k_words = load(k, self.params.k, 0, false);
        // V's words in flight with K's where registers allow (D = 64); at D = 128 they are
        // loaded once the scores have taken K's.
        let ahead = values_ahead(cfg);
        let v_ahead = ahead.then(|| load(k, self.params.v, 1, true));
        let s = self.scores(k, q, &k_words);
        let v_words = v_ahead.unwrap_or_else(|| load(k, self.params.v, 1, true));
        let p = self.softmax(k, &run, s, [t0, quad.q4, to]);
        self.add_values(k, &run, &p, &v_words);
        k.emit(format!("add.u32 {t0}, {t0}, {}", tile_keys(cfg)));
        k.bra(None, &top);
        k.place(&done);
        self.to_lanes(k, run, &quad, [lane, first])
    }

    /// Head `g`'s q (rotated, in shared memory) at the thread's quarter, rounded into the b32
    /// words of the A fragments and left at the start of that quarter (each thread's own);
    /// returns their address. Rows past the group read row `group - 1`'s and write nothing:
    /// their rows of the products are never stored.
    fn q_words(&self, k: &mut Kernel, quad: &Quad) -> Reg {
        let cfg = self.cfg;
        k.comment("q's A fragments: the thread's quarter of its head's row, rounded");
        let last = cfg.heads / cfg.kv_heads - 1;
        let g = k.op2("min.u32", RegClass::B32, &quad.g, &last);
        let i = k.mad_u32(&g, &cfg.head_dim, &quad.col);
        let at = k.mad_u32(&i, &4u32, &self.shared.q);
        let values: Vec<Reg> = (0..cfg.head_dim / 4)
            .map(|_| k.reg(RegClass::F32))
            .collect();
        for (c, four) in values.chunks(4).enumerate() {
            k.emit(format!(
                "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{at}+{}]",
                four[0],
                four[1],
                four[2],
                four[3],
                c * 16
            ));
        }
        let words = k.pack_halves(cfg.elem, &values);
        k.emit("bar.warp.sync -1");
        for (c, w) in words.chunks(4).enumerate() {
            k.emit(format!(
                "@{} st.shared.v4.b32 [{at}+{}], {{{}, {}, {}, {}}}",
                quad.real,
                c * 16,
                w[0],
                w[1],
                w[2],
                w[3]
            ));
        }
        k.emit("bar.warp.sync -1");
        at
    }

    /// The thread's quarter of cache row `row` of `base` (`D / 8` b32 words), loaded when
    /// `inside`; with `zeroed`, zeros otherwise (V's: a weight of 0 times a stale word could be
    /// NaN), else whatever the registers held (K's: the score is set to -inf).
    fn quarter_row(
        &self,
        k: &mut Kernel,
        base: Reg,
        row: Reg,
        quad: &Quad,
        (inside, zeroed): (Reg, bool),
    ) -> Vec<Reg> {
        let cfg = self.cfg;
        let col = k.add_u32(&row, &quad.col);
        let a = k.address(base, &col, cfg.elem.bytes());
        let words: Vec<Reg> = (0..cfg.head_dim / 8)
            .map(|_| {
                if zeroed {
                    k.mov(RegClass::B32, &0u32)
                } else {
                    k.reg(RegClass::B32)
                }
            })
            .collect();
        for (c, w) in words.chunks(4).enumerate() {
            k.emit(format!(
                "@{inside} ld.global.v4.b32 {{{}, {}, {}, {}}}, [{a}+{}]",
                w[0],
                w[1],
                w[2],
                w[3],
                c * 16
            ));
        }
        words
    }

    /// Each n-block's scores `q K^T` (the thread's two keys `2 q4, 2 q4 + 1` of the block's 8):
    /// k-block `kb` takes words `2 kb, 2 kb + 1` of q (at `q_at`) and of each key, which hold the
    /// elements the fragments want at `q4 * D/4 + 4 kb ..`, the same permutation for both.
    fn scores(&self, k: &mut Kernel, q_at: Reg, keys: &[Vec<Reg>]) -> Vec<[Reg; 2]> {
        k.comment("scores: q K^T per 8 keys, q's words from shared memory a k-block at a time");
        let ty = self.cfg.elem.name();
        let zero = k.mov(RegClass::F32, &F32(0.0));
        let s: Vec<[Reg; 2]> = keys
            .iter()
            .map(|_| [k.reg(RegClass::F32), k.reg(RegClass::F32)])
            .collect();
        for kb in 0..self.cfg.head_dim / 16 {
            let a = [k.reg(RegClass::B32), k.reg(RegClass::B32)];
            k.emit(format!(
                "ld.shared.v2.b32 {{{}, {}}}, [{q_at}+{}]",
                a[0],
                a[1],
                kb * 8
            ));
            for (words, s) in keys.iter().zip(&s) {
                let c = if kb == 0 { [zero, zero] } else { *s };
                let b = [words[2 * kb as usize], words[2 * kb as usize + 1]];
                mma_upper(k, ty, *s, a, b, c);
            }
        }
        s
    }

    /// The tile's scores scaled to base 2 (keys past `to` at -inf), the head's running max
    /// across the quad, the weights (returned), the running sum and the accumulators rescaled.
    fn softmax(
        &self,
        k: &mut Kernel,
        run: &Running,
        scores: Vec<[Reg; 2]>,
        [t0, q4, to]: [Reg; 3],
    ) -> Vec<[Reg; 2]> {
        k.comment("softmax: the tile's max per head across its quad, the weights");
        let scale = F32(self.cfg.scale * std::f32::consts::LOG2_E);
        let first = k.mad_u32(&q4, &2u32, &t0);
        let minus_inf = F32(f32::NEG_INFINITY);
        let scaled: Vec<[Reg; 2]> = scores
            .iter()
            .enumerate()
            .map(|(nb, pair)| {
                [0, 1].map(|c| {
                    let key = k.add_u32(&first, &(8 * nb as u32 + c as u32));
                    let inside = k.setp("lt.u32", &key, &to);
                    let x = k.mul_f32(&pair[c], &scale);
                    k.selp(RegClass::F32, "f32", &x, &minus_inf, inside)
                })
            })
            .collect();
        let mut max = scaled[0][0];
        for x in scaled.iter().flatten().skip(1) {
            max = k.max_f32(&max, x);
        }
        for offset in [1u32, 2] {
            let o = k.reg(RegClass::F32);
            k.emit(format!("shfl.sync.bfly.b32 {o}, {max}, {offset}, 31, -1"));
            max = k.max_f32(&max, &o);
        }
        let m_new = k.max_f32(&run.m, &max);
        let dm = k.sub_f32(&run.m, &m_new);
        let corr = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
        k.emit(format!("mov.f32 {}, {m_new}", run.m));
        let weights: Vec<[Reg; 2]> = scaled
            .iter()
            .map(|pair| {
                pair.map(|x| {
                    let d = k.sub_f32(&x, &m_new);
                    k.op1("ex2.approx.ftz.f32", RegClass::F32, &d)
                })
            })
            .collect();
        let mut sum = k.add_f32(&weights[0][0], &weights[0][1]);
        for pair in &weights[1..] {
            for p in pair {
                sum = k.add_f32(&sum, p);
            }
        }
        k.emit(format!("fma.rn.f32 {}, {}, {corr}, {sum}", run.l, run.l));
        for a in run.o.iter().flatten() {
            k.emit(format!("mul.rn.f32 {a}, {a}, {corr}"));
        }
        weights
    }

    /// `P V` into the accumulators: the weights of n-blocks `2 kk, 2 kk + 1`, rounded, are the
    /// A fragment of k-block `kk` (16 keys); V's words of keys `16 kk + g` and `16 kk + 8 + g`,
    /// each 8x8 block transposed, its B fragments. Output n-block `nd` holds elements
    /// `q4 * D/4 + 2 nd, + 1` of the thread's head.
    fn add_values(&self, k: &mut Kernel, run: &Running, p: &[[Reg; 2]], values: &[Vec<Reg>]) {
        k.comment("values: P V, V's 8x8 blocks transposed in registers");
        let e = self.cfg.elem;
        for kk in 0..p.len() / 2 {
            let lo = k.pack_halves(e, &p[2 * kk]);
            let hi = k.pack_halves(e, &p[2 * kk + 1]);
            for (nd, o) in run.o.iter().enumerate() {
                let b = [&values[2 * kk], &values[2 * kk + 1]].map(|v| {
                    let t = k.reg(RegClass::B32);
                    k.emit(format!(
                        "movmatrix.sync.aligned.m8n8.trans.b16 {t}, {}",
                        v[nd]
                    ));
                    t
                });
                mma_upper(k, e.name(), *o, [lo[0], hi[0]], b, *o);
            }
        }
    }

    /// The quads' rows (head `g`'s running max, its sum over the quad, the accumulators)
    /// through shared memory into the lanes' layout: every lane the max and elements
    /// `first..` of every head, lane 0 the whole sum (the others 0).
    fn to_lanes(
        &self,
        k: &mut Kernel,
        run: Running,
        quad: &Quad,
        [lane, first]: [Reg; 2],
    ) -> State {
        let cfg = self.cfg;
        let group = cfg.heads / cfg.kv_heads;
        k.comment("the heads' rows into the lanes' layout");
        let mut l = run.l;
        for offset in [1u32, 2] {
            let o = k.reg(RegClass::F32);
            k.emit(format!("shfl.sync.bfly.b32 {o}, {l}, {offset}, 31, -1"));
            l = k.add_f32(&l, &o);
        }
        let i = k.mad_u32(&quad.g, &cfg.head_dim, &quad.col);
        let at = k.mad_u32(&i, &4u32, &self.shared.q);
        // The rows go where q's words were: every lane has read its last words (the scores)
        // before any overwrites them (racecheck: a write-after-read hazard within the warp).
        k.emit("bar.warp.sync -1");
        for (nd, o) in run.o.iter().enumerate() {
            k.emit(format!(
                "@{} st.shared.v2.f32 [{at}+{}], {{{}, {}}}",
                quad.real,
                nd * 8,
                o[0],
                o[1]
            ));
        }
        let first_of_quad = k.setp("eq.u32", &quad.q4, &0u32);
        let writes = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {writes}, {first_of_quad}, {}", quad.real));
        let ml = k.mad_u32(&quad.g, &8u32, &self.shared.ml);
        k.emit(format!(
            "@{writes} st.shared.v2.f32 [{ml}], {{{}, {l}}}",
            run.m
        ));
        k.emit("bar.warp.sync -1");
        let lane0 = k.setp("eq.u32", &lane, &0u32);
        let mut state = State {
            m: Vec::new(),
            l: Vec::new(),
            acc: Vec::new(),
        };
        for g in 0..group {
            let [m, sum] = [k.reg(RegClass::F32), k.reg(RegClass::F32)];
            k.emit(format!(
                "ld.shared.v2.f32 {{{m}, {sum}}}, [{}+{}]",
                self.shared.ml,
                g * 8
            ));
            state.m.push(m);
            state
                .l
                .push(k.selp(RegClass::F32, "f32", &sum, &F32(0.0), lane0));
            state.acc.push(
                (0..cfg.head_dim / 32)
                    .map(|c| {
                        let col = k.add_u32(&first, &c);
                        let a = self.shared.q_at(k, cfg, g, col);
                        k.op1("ld.shared.f32", RegClass::F32, &crate::ptx::Bracket(a))
                    })
                    .collect(),
            );
        }
        k.emit("bar.warp.sync -1");
        state
    }
}

/// With several key ranges merged in the kernel: once the block's partial results are stored,
/// it counts itself done on its (sequence, K/V head) counter; the last of the row's blocks
/// resets the counter and merges each query head of the group (a warp per head) into `out`.
/// The fences make every block's stores visible to the block that merges them.
fn merge_when_last(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    [counters, out]: [Reg; 2],
    taken: &Taken,
    [b, kvh, tid, warp, lane]: [Reg; 5],
) {
    k.comment("the last block of the sequence's K/V head merges the key ranges");
    let flag = k.shared("last_block", 4);
    let ci = k.mad_u32(&b, &cfg.kv_heads, &kvh);
    let ca = k.address(counters, &ci, 4);
    let leader = k.setp("eq.u32", &tid, &0u32);
    let last = crate::reduce::last_arrival(k, [ca, leader], &taken.blocks, "bar.sync 0", &flag);
    let done = k.label("merged");
    k.bra(Some((last, false)), &done);
    let [acc, ml] = [params.out, params.partial_ml.expect("several key ranges")];
    let group = cfg.heads / cfg.kv_heads;
    let zero = k.mov(RegClass::B32, &0u32);
    for g in 0..group {
        let other = k.label("other_head");
        let mine = k.setp("eq.u32", &warp, &(g % WARPS));
        k.bra(Some((mine, false)), &other);
        let h = k.mad_u32(&kvh, &group, &g);
        combine_row(
            k,
            cfg,
            [acc, ml, out],
            [b, h, zero, lane],
            Some(taken.splits),
        );
        k.place(&other);
    }
    k.place(&done);
}

/// With all of a row's keys in one block ([`Taken::one_block`]): every warp leaves each head's
/// running max, sum and accumulators in shared memory ([`leave_ranges`]), and after the barrier
/// warp `g % WARPS` merges head `g` of the group into `out` ([`merge_head`]).
fn merge_in_block(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    (shared, state): (&Shared, &State),
    out: Reg,
    [b, kvh, warp, lane, first]: [Reg; 5],
) {
    k.comment("one block took every key: its warps' ranges merge in shared memory");
    let ml = leave_ranges(k, cfg, (shared, state), [warp, lane, first]);
    k.emit("bar.sync 0");
    let t0 = k.mul_u32(&b, &cfg.strides[3][0]);
    for g in 0..cfg.heads / cfg.kv_heads {
        let other = k.label("other_head");
        let merger = k.setp("eq.u32", &warp, &(g % WARPS));
        k.bra(Some((merger, false)), &other);
        merge_head(k, cfg, (shared, ml), out, g, [kvh, first, t0]);
        k.place(&other);
    }
}

/// The warp's range of every head into shared memory: its running max and sum (summed over the
/// lanes) at `range_ml[warp][g]`, which this returns, and its accumulators where its q was.
fn leave_ranges(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    (shared, state): (&Shared, &State),
    [warp, lane, first]: [Reg; 3],
) -> Reg {
    let group = cfg.heads / cfg.kv_heads;
    let ml_name = k.shared("range_ml", WARPS * group * 8);
    let ml = k.shared_base(&ml_name);
    let mine = k.mad_u32(&warp, &(group * 8), &ml);
    let lane0 = k.setp("eq.u32", &lane, &0u32);
    k.emit("bar.warp.sync -1");
    for g in 0..group as usize {
        let l = k.warp_sum(state.l[g]);
        let at = g as u32 * 8;
        k.emit(format!(
            "@{lane0} st.shared.f32 [{mine}+{at}], {}",
            state.m[g]
        ));
        k.emit(format!("@{lane0} st.shared.f32 [{mine}+{}], {l}", at + 4));
        for (c, a) in state.acc[g].iter().enumerate() {
            let col = k.add_u32(&first, &(c as u32));
            let qa = shared.q_at(k, cfg, g as u32, col);
            k.emit(format!("st.shared.f32 [{qa}], {a}"));
        }
    }
    ml
}

/// Head `g`'s output from every warp's range ([`leave_ranges`]), each rescaled to the largest
/// max as [`combine_row`] does (a largest max of -inf, no key seen, taken as 0: no NaN), into
/// `out` at the lane's elements from `first`; `t0` is the sequence's offset in `out`.
fn merge_head(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    (shared, ml): (&Shared, Reg),
    out: Reg,
    g: u32,
    [kvh, first, t0]: [Reg; 3],
) {
    let group = cfg.heads / cfg.kv_heads;
    let ranges: Vec<(Reg, Reg)> = (0..WARPS)
        .map(|w| {
            let at = (w * group + g) * 8;
            let [m, l] = [k.reg(RegClass::F32), k.reg(RegClass::F32)];
            k.emit(format!("ld.shared.f32 {m}, [{ml}+{at}]"));
            k.emit(format!("ld.shared.f32 {l}, [{ml}+{}]", at + 4));
            (m, l)
        })
        .collect();
    let mut top = ranges[0].0;
    for (m, _) in &ranges[1..] {
        top = k.max_f32(&top, m);
    }
    let none = k.setp("eq.f32", &top, &F32(f32::NEG_INFINITY));
    let top = k.selp(RegClass::F32, "f32", &F32(0.0), &top, none);
    let total = k.mov(RegClass::F32, &F32(0.0));
    let sums: Vec<Reg> = (0..cfg.head_dim / 32)
        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
        .collect();
    for (w, (m, l)) in ranges.iter().enumerate() {
        let dm = k.sub_f32(m, &top);
        let scale = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
        k.fma_into(total, &scale, l);
        for (c, sum) in sums.iter().enumerate() {
            let col = k.add_u32(&first, &(c as u32));
            let i = k.add_u32(&col, &((w as u32 * group + g) * cfg.head_dim));
            let a = k.mad_u32(&i, &4u32, &shared.q_block);
            let v = k.reg(RegClass::F32);
            k.emit(format!("ld.shared.f32 {v}, [{a}]"));
            k.fma_into(*sum, &scale, &v);
        }
    }
    let inv = reciprocal_or_zero(k, total);
    let h = k.mad_u32(&kvh, &group, &g);
    let row = k.mad_u32(&h, &cfg.strides[3][1], &t0);
    for (c, sum) in sums.iter().enumerate() {
        let y = k.mul_f32(sum, &inv);
        let col = k.add_u32(&first, &(c as u32));
        let idx = k.add_u32(&row, &col);
        let oa = k.address(out, &idx, cfg.elem.bytes());
        k.st_global(cfg.elem, oa, y);
    }
}

/// Each head's result: normalised into `out` (zeros for a query that saw no key), or with
/// several key ranges its partial accumulators, running max and sum.
fn store(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    state: &State,
    heads: &[Reg],
    [b, split, lane, first]: [Reg; 4],
) {
    let e = cfg.elem;
    let d = cfg.head_dim;
    let sums: Vec<Reg> = state.l.iter().map(|l| k.warp_sum(*l)).collect();
    for (g, h) in heads.iter().enumerate() {
        let acc = &state.acc[g];
        match params.partial_ml {
            Some(ml) => {
                let row = k.mad_u32(&b, &cfg.heads, h);
                let p = k.mad_u32(&row, &cfg.splits, &split);
                let base = k.mad_u32(&p, &d, &first);
                for (c, a) in acc.iter().enumerate() {
                    let idx = k.add_u32(&base, &(c as u32));
                    let pa = k.address(params.out, &idx, 4);
                    k.st_global(Elem::F32, pa, *a);
                }
                store_max_and_sum(k, ml, p, (state.m[g], sums[g]), lane);
            }
            None => {
                let os = cfg.strides[3];
                let t0 = k.mul_u32(&b, &os[0]);
                let row = k.mad_u32(h, &os[1], &t0);
                let inv = reciprocal_or_zero(k, sums[g]);
                for (c, a) in acc.iter().enumerate() {
                    let y = k.mul_f32(a, &inv);
                    let col = k.add_u32(&first, &(c as u32));
                    let idx = k.add_u32(&row, &col);
                    let oa = k.address(params.out, &idx, e.bytes());
                    k.st_global(e, oa, y);
                }
            }
        }
    }
}
