//! Decode attention over a KV cache (one query row per sequence, f16/bf16): one warp per (key
//! range, K/V head, sequence) serves the head's whole query group from one read of its K/V
//! rows, 32 keys at a time:
//! 1. scores: each lane takes one key, streams its whole K row (16-byte loads) and takes its dot
//!    product with every head's q (in shared memory, read by all lanes at once): no reduction
//!    across lanes per key;
//! 2. softmax: per head, the tile's max across the warp, each lane's weight and its share of the
//!    running sum (summed across the warp once, at the end), the weights into shared memory;
//! 3. values: the lanes switch to the head dimension (contiguous elements each), and every key's
//!    V row (loaded before the scores, so its latency is hidden) is added with each head's weight.
//!
//! With several key ranges (`splits`, flash-decoding) each warp writes its heads' partial
//! results, which `attention::attention_combine` merges, exactly as for the SIMT kernel: the same
//! `partial_acc` / `partial_ml` layout, running maxima in base 2. A kernel that merges them itself
//! ([`Extras::combine`]) splits each row's keys over only the blocks they need, `BLOCK_KEYS`
//! each (the rest exit): a row whose keys one block takes merges its warps' ranges in shared
//! memory, and only longer rows count their blocks and merge through memory. Where the SIMT kernel
//! (`crate::attention`) gives each query head its own warp, walking keys one per warp step with a
//! shuffle reduction each, a K/V head with a group of 4 (Llama's 32 heads over 8) is read 4
//! times; here it is read once.

use crate::attention::{
    combine_row, keys_in, online_softmax_step, reciprocal_or_zero, rotated_element, share_of_keys,
    store_max_and_sum, window_range, AttentionConfig, KeyRule, Splits,
};
use crate::kv_cache::write_row;
use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Label, Reg, RegClass, F32};
use crate::{GeneratedKernel, KernelPath, Launch};

/// Key ranges (warps) per block.
const WARPS: u32 = 8;
/// Keys a warp takes at a time: one per lane.
const TILE: u32 = 32;
/// The largest query group one warp serves (its accumulators are registers).
const MAX_GROUP: u32 = 8;

/// Whether `cfg` is a decode step this kernel serves: one query row over a cache (position
/// keys, RoPE on q only), no padding mask or dropout, f16/bf16, a head dimension of 64 or 128
/// (2 or 4 elements per lane), a query group of at most [`MAX_GROUP`], and strides that keep
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
    /// Merge the key ranges (`cfg.splits` a multiple of the block's [`WARPS`] ranges).
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
    let heads: Vec<Reg> = (0..group).map(|g| k.mad_u32(&kvh, &group, &g)).collect();
    let shared = Shared::declare(&mut k, cfg, warp);
    k.comment("q of each head of the group, rotated and pre-scaled by scale * log2(e)");
    for (g, h) in heads.iter().enumerate() {
        let q = load_q(&mut k, cfg, &params, [b, *h, first, pos]);
        for (c, v) in q.iter().enumerate() {
            let col = k.add_u32(&first, &(c as u32));
            let at = shared.q_at(&mut k, cfg, g as u32, col);
            k.emit(format!("st.shared.f32 [{at}], {v}"));
        }
    }
    k.emit("bar.warp.sync -1");
    if let Some(new) = &extras.new {
        write_new_entries(&mut k, cfg, &params, new, [b, kvh, lane, pos, from, to]);
    }
    let state = State::new(&mut k, group, per_lane);
    let tiles = Tiles {
        cfg,
        params: &params,
        shared: &shared,
        state: &state,
    };
    tiles.run(&mut k, [b, kvh, lane, first, from, to]);
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
            .then(|| ["counters", "out"].map(|p| k.param_ptr(p)));
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
/// `pos`, `rotate_half`'s pairing as the IR defines it) and scaled.
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
    let scale = F32(cfg.scale * std::f32::consts::LOG2_E);
    (0..cfg.head_dim / 32)
        .map(|c| {
            let col = k.add_u32(&first, &c);
            let idx = k.add_u32(&row, &col);
            let a = k.address(params.q, &idx, e.bytes());
            let x = k.ld_global(e, a);
            let value = match params.tables {
                None => x,
                Some(tables) => rotated_element(k, e, [params.q, row, col, pos], x, half, tables),
            };
            k.mul_f32(&value, &scale)
        })
        .collect()
}

/// The tiles a warp takes first ([`TILE`] keys each) that it sends towards L2 before the wait.
const PREFETCH_TILES: u32 = 2;

/// Sends the K and V rows of the warp's first [`PREFETCH_TILES`] tiles of `[from, to)` (a key
/// per lane and tile) and the RoPE tables' row at `pos` towards L2 while the kernel before
/// runs, so that the loads after the wait find them there.
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
        for t in 0..PREFETCH_TILES {
            let j0 = k.add_u32(&from, &(t * TILE));
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

/// The most keys a block takes when the kernel merges its key ranges: two tiles per warp. A
/// row's keys take as many blocks as they need at this many each (at most the grid's), so
/// that a short context runs in one block, which merges its warps' ranges in shared memory
/// without the count of finished blocks and the reads back through L2 that blocks merging
/// across the grid need.
const BLOCK_KEYS: u32 = 2 * WARPS * TILE;

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
/// sum (its keys' weights) and accumulators (the lane's elements of the head dimension).
struct State {
    m: Vec<Reg>,
    l: Vec<Reg>,
    acc: Vec<Vec<Reg>>,
}

impl State {
    fn new(k: &mut Kernel, group: u32, per_lane: u32) -> State {
        let heads = 0..group;
        State {
            m: heads
                .clone()
                .map(|_| k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)))
                .collect(),
            l: heads
                .clone()
                .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                .collect(),
            acc: heads
                .map(|_| {
                    (0..per_lane)
                        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                        .collect()
                })
                .collect(),
        }
    }
}

/// The warp's shared memory: every head's q (`[group, D]` f32) and the tile's weights
/// (`[group, TILE]` f32), at this warp's offset.
struct Shared {
    q: Reg,
    p: Reg,
    /// Where the block's q array starts (warp 0's).
    q_block: Reg,
}

impl Shared {
    fn declare(k: &mut Kernel, cfg: &AttentionConfig, warp: Reg) -> Shared {
        let group = cfg.heads / cfg.kv_heads;
        let q_bytes = group * cfg.head_dim * 4;
        let p_bytes = group * TILE * 4;
        let q_name = k.shared("q_group", WARPS * q_bytes);
        let p_name = k.shared("tile_weights", WARPS * p_bytes);
        let base = |k: &mut Kernel, name: &str| {
            let base = k.reg(RegClass::B32);
            k.emit(format!("mov.u32 {base}, {name}"));
            base
        };
        let q_block = base(k, &q_name);
        let p_block = base(k, &p_name);
        Shared {
            q: k.mad_u32(&warp, &q_bytes, &q_block),
            p: k.mad_u32(&warp, &p_bytes, &p_block),
            q_block,
        }
    }

    /// The address of head `g`'s q element `col`.
    fn q_at(&self, k: &mut Kernel, cfg: &AttentionConfig, g: u32, col: Reg) -> Reg {
        let i = k.add_u32(&col, &(g * cfg.head_dim));
        k.mad_u32(&i, &4u32, &self.q)
    }
}

/// The tile loop's inputs.
struct Tiles<'a> {
    cfg: &'a AttentionConfig,
    params: &'a Params,
    shared: &'a Shared,
    state: &'a State,
}

impl Tiles<'_> {
    /// The keys `[from, to)`, [`TILE`] at a time.
    fn run(&self, k: &mut Kernel, [b, kvh, lane, first, from, to]: [Reg; 6]) {
        let k_rows = self.params.cache_rows(k, self.cfg, 1, [b, kvh]);
        let v_rows = self.params.cache_rows(k, self.cfg, 2, [b, kvh]);
        let v_dense = v_rows
            .dense()
            .map(|(head, stride)| (k.add_u32(&head, &first), stride));
        let t0 = k.mov(RegClass::B32, &from);
        let top = k.label("tiles");
        let done = k.label("tiles_done");
        k.place(&top);
        let finished = k.setp("ge.u32", &t0, &to);
        k.bra(Some((finished, true)), &done);
        let j = k.add_u32(&t0, &lane);
        let mine = k.setp("lt.u32", &j, &to);
        // Paged, each lane finds its own key's V row, and the values step takes every key's
        // from its lane.
        let v_lane = v_rows.paged().then(|| v_rows.row(k, &j));
        k.comment("every key's V elements of this lane, for the values step");
        let values: Vec<Vec<Reg>> = (0..TILE)
            .map(|u| {
                let ju = k.add_u32(&t0, &u);
                let used = k.setp("lt.u32", &ju, &to);
                let row = match (v_lane, v_dense) {
                    (Some(v), _) => {
                        let r = k.reg(RegClass::B32);
                        k.emit(format!("shfl.sync.idx.b32 {r}, {v}, {u}, 31, -1"));
                        k.add_u32(&r, &first)
                    }
                    (None, Some((head, stride))) => k.mad_u32(&ju, &stride, &head),
                    (None, None) => unreachable!("rows are paged or dense"),
                };
                load_words(
                    k,
                    self.cfg.elem,
                    self.params.v,
                    row,
                    self.cfg.head_dim / 64,
                    used,
                )
            })
            .collect();
        let row = k_rows.row(k, &j);
        let scores = self.scores(k, row, mine);
        self.softmax(k, &scores, lane);
        self.add_values(k, &values);
        k.emit(format!("add.u32 {t0}, {t0}, {TILE}"));
        k.bra(None, &top);
        k.place(&done);
    }

    /// This lane's key (row `row` of the cache, when `mine`): its scores for every head, -inf
    /// for a key past the range.
    fn scores(&self, k: &mut Kernel, row: Reg, mine: Reg) -> Vec<Reg> {
        let cfg = self.cfg;
        let e = cfg.elem;
        k.comment("scores: this lane's key against every head's q");
        let chunks = cfg.head_dim / 8;
        let words: Vec<Vec<Reg>> = (0..chunks)
            .map(|c| {
                let w: Vec<Reg> = (0..4).map(|_| k.mov(RegClass::B32, &0u32)).collect();
                let i = k.add_u32(&row, &(c * 8));
                let a = k.address(self.params.k, &i, e.bytes());
                k.emit(format!(
                    "@{mine} ld.global.v4.b32 {{{}, {}, {}, {}}}, [{a}]",
                    w[0], w[1], w[2], w[3]
                ));
                w
            })
            .collect();
        let group = cfg.heads / cfg.kv_heads;
        let sums: Vec<Reg> = (0..group)
            .map(|_| k.mov(RegClass::F32, &F32(0.0)))
            .collect();
        for (c, w) in words.iter().enumerate() {
            let key = k.unpack_halves(e, w);
            for (g, sum) in sums.iter().enumerate() {
                for half in 0..2u32 {
                    let off = (g as u32 * cfg.head_dim + c as u32 * 8 + half * 4) * 4;
                    let q: Vec<Reg> = (0..4).map(|_| k.reg(RegClass::F32)).collect();
                    k.emit(format!(
                        "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{}+{off}]",
                        q[0], q[1], q[2], q[3], self.shared.q
                    ));
                    for (qe, ke) in q.iter().zip(&key[half as usize * 4..]) {
                        k.fma_into(*sum, qe, ke);
                    }
                }
            }
        }
        let minus_inf = F32(f32::NEG_INFINITY);
        sums.iter()
            .map(|s| k.selp(RegClass::F32, "f32", s, &minus_inf, mine))
            .collect()
    }

    /// Per head: the tile's max across the warp, the running max, this lane's weight into
    /// shared memory and its share of the running sum, the accumulators rescaled.
    fn softmax(&self, k: &mut Kernel, scores: &[Reg], lane: Reg) {
        k.comment("softmax: the tile's max per head, each lane's weight");
        for (g, s) in scores.iter().enumerate() {
            let mut max = *s;
            for offset in [16u32, 8, 4, 2, 1] {
                let o = k.reg(RegClass::F32);
                k.emit(format!("shfl.sync.bfly.b32 {o}, {max}, {offset}, 31, -1"));
                max = k.max_f32(&max, &o);
            }
            let running = (self.state.m[g], self.state.l[g]);
            let (corr, p) = online_softmax_step(k, running, *s, max);
            for a in &self.state.acc[g] {
                k.emit(format!("mul.rn.f32 {a}, {a}, {corr}"));
            }
            let i = k.add_u32(&lane, &(g as u32 * TILE));
            let at = k.mad_u32(&i, &4u32, &self.shared.p);
            k.emit(format!("st.shared.f32 [{at}], {p}"));
        }
        k.emit("bar.warp.sync -1");
    }

    /// Every key of the tile (`values`: the words of this lane's elements of its V row) added to
    /// each head's accumulators with the head's weight; keys past the range have weight 0 and
    /// zeros loaded.
    fn add_values(&self, k: &mut Kernel, values: &[Vec<Reg>]) {
        k.comment("values: lanes over the head dimension, every key of the tile");
        let group = self.cfg.heads / self.cfg.kv_heads;
        for (u, words) in values.iter().enumerate() {
            let v = k.unpack_halves(self.cfg.elem, words);
            for g in 0..group {
                let off = (g * TILE + u as u32) * 4;
                let p = k.reg(RegClass::F32);
                k.emit(format!("ld.shared.f32 {p}, [{}+{off}]", self.shared.p));
                for (a, ve) in self.state.acc[g as usize].iter().zip(&v) {
                    k.fma_into(*a, &p, ve);
                }
            }
        }
        k.emit("bar.warp.sync -1");
    }
}

/// `n` words (2 elements each) of row `row` (elements) of `base`, loaded only when `when`
/// (zeros otherwise).
fn load_words(k: &mut Kernel, e: Elem, base: Reg, row: Reg, n: u32, when: Reg) -> Vec<Reg> {
    let words: Vec<Reg> = (0..n).map(|_| k.mov(RegClass::B32, &0u32)).collect();
    let a = k.address(base, &row, e.bytes());
    let dst = match words.as_slice() {
        [w] => format!("ld.global.b32 {w}"),
        [w0, w1] => format!("ld.global.v2.b32 {{{w0}, {w1}}}"),
        _ => unreachable!("2 or 4 elements per lane"),
    };
    k.emit(format!("@{when} {dst}, [{a}]"));
    words
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
    let ml = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {ml}, {ml_name}"));
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
