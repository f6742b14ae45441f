//! FlashAttention-3 style prefill attention on sm_90a (f16 / bf16, head dims 64 and 128): TMA
//! feeds K/V tiles through an mbarrier pipeline to consumer warpgroups on `wgmma`.
//!
//! A block of a producer and two or three consumer warpgroups takes work items of 64 query rows
//! a consumer of one head, one item per block or, when items have few key tiles (or, over every
//! key, outnumber the SMs), the items `ctaid.x`, then every `nctaid.x`-th of a persistent grid,
//! so that the next item's tiles load
//! under this one's work; items run in groups of planes whose K/V share the L2
//! (`group_planes`); or, over every key of a dense K/V at head dim 128, in clusters of two
//! blocks that share each K/V tile, each copying half of it into both ([`Grid::Pairs`]); or,
//! over every key, persistent blocks that share out the last two waves' key tiles in equal
//! ranges, an item that two ranges share finished by the later of its two parts from both
//! parts' state in scratch ([`Grid::Stream`]). How many consumers, Q buffers and K and V
//! stages, and which grid, is the block's [`Shape`]:
//! - warpgroup 0, the producer, gives up registers; its first thread copies each item's Q tile
//!   into one of its Q buffers (refilled once every consumer released it), then the K and V
//!   tiles of 128 keys through their stages (TMA, 128-byte swizzle, zeros past the tensor's
//!   edges), each stage armed on its `full` barrier and refilled once every consumer released it
//!   on its `empty` barrier (stages are counted across the block's items). K and V have barriers of
//!   their own: a K tile is free once the scores have read it, a turn before its V tile, so
//!   that the next K tile loads under two turns of products rather than under one `P V` (a
//!   paged tile's K and V are still copied together, box by box, once both stages are free:
//!   apart, the producer's 24 registers beside two consumers spilled);
//! - the consumers each own 64 query rows: per key tile, `S = Q K^T` (wgmma, both operands
//!   from shared memory), the online softmax in registers (base 2, the scale folded into the
//!   exponent's FMA, quad shuffles for the row max; at head dim 128 O is rescaled only when a row's
//!   maximum moved by more than 2^8, `Rescale`), then `O += P V` with P taken straight from
//!   the score registers as the A operand (the accumulator layout of S is the A-fragment layout)
//!   and V read N-major (transposed) from its stage. The consumers take turns issuing (named
//!   barriers, ping-pong), so that one's softmax runs while the others' products do; at head dim
//!   64 the scores of tile `j + 1` are issued as a wgmma group ahead of `O += P V` of tile `j`,
//!   and their softmax runs under that product too, O's correction and P waiting for it
//!   (`under_own_products`); at 128 the two are one group.
//!
//! Key rules: every key, causal (query `i` sees keys `j <= i + T - S`), or position keys (query
//! `i` of sequence `b` sees keys `j <= positions[b, i]`: a prompt chunk over a KV cache, dense or
//! paged: over a paged cache the producer copies each tile block by block, a box of the pool's
//! `[blocks, KVH, block, D]` per table entry, into the rows one box of the tile would fill, so
//! the consumers see the same swizzled tile; a tile's keys past a row's own are read and weighted
//! by 0, so a cache must hold finite values there, as the runtime's do: zeroed at load and
//! written only with the model's keys and values),
//! masked per element on the tiles that cross a row's last key or the end of the keys only;
//! causal and position blocks are visited longest first. Under a sliding window of `w` keys (a
//! row sees its last `w`), an item visits the tiles from the one where its earliest row's window
//! starts, and masks per element those that cross a row's first key. With position keys each
//! warpgroup finds the smallest and largest position of an item's rows itself (`PositionKeys`),
//! so that the producer and the consumers agree on the item's tiles without waiting for one
//! another. A
//! padding mask `[B, T]` is staged per key tile in shared memory as an additive 0 / -inf row by
//! each consumer warpgroup. A row that sees no key stores zeros. GQA reads the
//! K/V head `h / (heads / kv_heads)`. RoPE takes the `mma.sync` kernel (or is rotated ahead).
//!
//! Dropout (DESIGN.md section 2) zeroes probabilities after the row sums have taken them; the
//! `1 / (1 - p)` scale joins the final normalisation. A Philox block covers four columns of one
//! row, and a thread holds two columns of each of two rows whose other two columns its quad
//! neighbour (`t ^ 1`) holds: each of the two draws the block of one of the rows and they swap
//! halves by shuffle, so every word drawn is used. What a block's rounds take from its columns
//! alone, each warp draws once a key tile into a table in shared memory, a lane a block.

use crate::attention::{
    philox_key, reciprocal_or_zero, window_start, AttentionConfig, KeyRule, PhiloxRow,
};
use crate::attention_tc::RowState;
use crate::hopper::{
    aligned_base, cluster_sync, for_each_block_item, mbarrier_arrive, mbarrier_arrive_expect_tx,
    mbarrier_arrive_in, mbarrier_init, mbarrier_init_fence, mbarrier_wait, prefetch_tensor_map,
    setmaxnreg, tma_load, tma_load_to, wait_released, warp_uniform, wgmma, wgmma_commit,
    wgmma_descriptor, wgmma_fence, wgmma_wait, WarpgroupThread, WgmmaA, WgmmaB, MAX_SHARED,
    MBARRIER_BYTES, SWIZZLE_BYTES,
};
use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Operand, Reg, RegClass, F32};
use crate::{GeneratedKernel, Image, KernelPath, Launch, TensorMapSpec};

/// Keys per tile.
const BKV: u32 = 128;
/// Philox blocks a consumer thread draws round by round (see [`PhiloxRow::words_of`]).
const DRAW_GROUP: usize = 4;
/// Elements of one 128-byte swizzle row: the head dimension is copied in blocks of this many.
const COLS: u32 = SWIZZLE_BYTES / 2;
/// The fewest registers the producer works in.
const MIN_PRODUCER_REGS: u32 = 24;
/// Blocks of a persistent grid: the SMs of an H100 / H200 SXM.
const GRID: u32 = 132;
/// Key tiles per item up to which a grid of items whose keys differ (causal, windows, position
/// keys) is persistent: below this, a block's fixed costs (barriers, the first loads, the
/// epilogue) outweigh its products. (Causal items of 8 and 32 tiles measured 5% slower
/// persistent: GPT-2 at 1024 tokens, Llama-3.2-1B at 4096.)
const PERSISTENT_MAX_TILES: u32 = 2;
/// Key tiles per item from which items over every key take a stream grid rather than a
/// persistent one: a split item's parts each load Q, fill the pipeline and leave their state,
/// which pays where items are long. Measured on the H100 (2026-12-07): 4 x 16 heads over 4096
/// keys (32 tiles) as fast as persistent at head dim 128, 4% faster with dropout; BERT-base's
/// heads over 32 x 512 tokens (4 tiles) 10% slower.
const STREAM_MIN_TILES: u32 = 32;
/// How many powers of two a row's running maximum (base 2) may trail a tile's before O and the
/// row's sum are rescaled to the tile's: probabilities stay at most `2^RESCALE_SLACK`.
const RESCALE_SLACK: f32 = 8.0;

/// How a key tile's softmax brings O and the row sums to its maxima.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rescale {
    /// An item's first tile: O and the sums are still zero, nothing to rescale.
    None,
    /// To the running maximum at every tile.
    Always,
    /// Only when a row's maximum passes the one its exponents are taken against by more than
    /// `RESCALE_SLACK`, and O only where one of the warp's rows did.
    WhenMoved,
}

impl Rescale {
    /// A later tile's rescale waits for a moved maximum at head dim 128, where it spares 64
    /// multiplies a thread; at 64 the 32 it would spare do not pay for the vote and branch
    /// (measured on the H200: 2-3% faster at 128 without a mask, 10% with dropout, 1-3%
    /// slower at 64 without a mask).
    fn of(cfg: &AttentionConfig, first: bool) -> Rescale {
        match (first, cfg.head_dim >= 128) {
            (true, _) => Rescale::None,
            (false, true) => Rescale::WhenMoved,
            (false, false) => Rescale::Always,
        }
    }
}
/// Whether a key tile's softmax runs under the warpgroup's own `O += P V` of the tile before
/// (the next tile's scores and that product issued as two wgmma groups, the softmax waiting for
/// the first only: FlashAttention-3's intra-warpgroup overlap) as well as under the other
/// consumers' products; otherwise the two are one group and the softmax waits for both.
/// Taken at head dim 64 without dropout (measured on the H200, 2026-12-04: 4-7% faster with
/// three consumers over every key, 1-8% causal, 2% at Llama-3.2-1B's shape); at 128 no faster
/// (0.95 against 0.94 ms over every key), and with dropout 11% slower.
fn under_own_products(cfg: &AttentionConfig) -> bool {
    cfg.head_dim == 64 && cfg.dropout.is_none()
}

/// Whether `cfg` can use the Hopper kernel.
pub fn supports(cfg: &AttentionConfig) -> bool {
    let keys = match cfg.keys {
        KeyRule::All => true,
        KeyRule::Causal { window } => cfg.kv_len >= cfg.q_len && window != Some(0),
        // Prompt chunks over a KV cache: each row sees the keys up to its position.
        KeyRule::Position { window } => cfg.q_len > 1 && window != Some(0),
    };
    // A paged cache's blocks are whole 1024-byte swizzle groups (8 rows) of a tile.
    let paged = cfg.paging.is_none_or(|p| {
        matches!(cfg.keys, KeyRule::Position { .. })
            && (8..=BKV).contains(&p.block)
            && BKV.is_multiple_of(p.block)
    });
    cfg.elem != Elem::F32
        && matches!(cfg.head_dim, 64 | 128)
        && keys
        && cfg.splits == 1
        && cfg.scale > 0.0
        && !cfg.rope
        && cfg.q_len > 0
        && cfg.kv_len > 0
        && cfg.heads.is_multiple_of(cfg.kv_heads)
        && cfg.strides.iter().all(|s| s.iter().all(|v| v % 8 == 0))
        && paged
}

/// How a block is built: its consumer warpgroups, Q buffers and K and V stages, and how the
/// grid takes the items. [`Shape::of`] picks one for a configuration; the others that
/// [`Shape::fits`] are the space it was picked from, built by [`attention_wgmma_shaped`] to
/// measure and test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Consumer warpgroups of 64 query rows each (2 or 3).
    pub consumers: u32,
    /// Q buffers (1 or 2): with two, the next item's Q loads under this one's key tiles.
    pub q_buffers: u32,
    /// K stages: how many key tiles ahead of the consumers the producer may copy K.
    pub k_stages: u32,
    /// V stages.
    pub v_stages: u32,
    /// How the blocks take the items.
    pub grid: Grid,
}

/// How a grid's blocks take the work items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// One item a block.
    Items,
    /// One block an SM, each taking item `ctaid.x`, then every `nctaid.x`-th.
    Persistent,
    /// One item a block, in clusters of two whose items are neighbouring query blocks of one
    /// plane: every key of it, so both visit the same K/V tiles, and each copies half of every
    /// tile's 64-column blocks into the stages of both (TMA multicast), reading half the K/V
    /// from the L2 that a block of [`Grid::Items`] does. A stage is refilled once the consumers
    /// of both blocks released it.
    Pairs,
    /// One block an SM, the work shared out by key tiles: all but the last two waves of items
    /// as on [`Grid::Persistent`], then the rest's key tiles in equal ranges, one a block, so
    /// that no SM idles through a last wave that only some blocks have items for. An item split
    /// between two blocks is finished by the later of its two parts (`StreamSplit`).
    Stream,
}

impl std::fmt::Display for Shape {
    /// `c2 q2 k2 v2 items`: consumers, Q buffers, K and V stages, grid.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let grid = match self.grid {
            Grid::Items => "items",
            Grid::Persistent => "persistent",
            Grid::Pairs => "pairs",
            Grid::Stream => "stream",
        };
        let Shape {
            consumers: c,
            q_buffers: q,
            k_stages: ks,
            v_stages: vs,
            ..
        } = self;
        write!(f, "c{c} q{q} k{ks} v{vs} {grid}")
    }
}

impl Shape {
    /// The shape `cfg` runs in. At head dim 64 one warpgroup's softmax takes about as long as
    /// its products, so three consumers take turns (two others' products hide each one's
    /// softmax) wherever blocks of 192 rows pad the query rows at most 5% more than blocks of
    /// 128 do; otherwise two. Dropout keeps two: its Philox rounds hold the ALUs, not the tensor
    /// cores, and its registers spill within three consumers' 160. Two Q buffers and two stages
    /// of K and of V, on the grid `Shape::grid_for` picks.
    pub fn of(cfg: &AttentionConfig) -> Shape {
        let padded = |rows: u32| u64::from(cfg.q_len.div_ceil(rows) * rows);
        let three = Shape {
            consumers: 3,
            ..Shape::two_deep(2)
        };
        let consumers = if three.fits(cfg) && 20 * padded(192) <= 21 * padded(128) {
            3
        } else {
            2
        };
        let shape = Shape::two_deep(consumers);
        Shape {
            grid: shape.grid_for(cfg),
            ..shape
        }
    }

    /// The grid this shape runs `cfg` on where more items than the grid has blocks would leave
    /// it a last wave that only some blocks have items for, or a block's fixed costs outweigh
    /// its products: items over every key on a persistent grid (each block loads its next item
    /// under this one: H100, 2026-12-07, BERT-base's heads over 32 x 512 tokens 17% faster
    /// than one item a block) or, from [`STREAM_MIN_TILES`] key tiles, a stream grid (the same
    /// measurement, median of seven passes at 32 tiles: 1.3% faster than one item a block at
    /// head dim 128, 1.6% at 64, 4.2% with dropout); items whose keys differ persistent only
    /// up to [`PERSISTENT_MAX_TILES`]; otherwise one item a block.
    fn grid_for(self, cfg: &AttentionConfig) -> Grid {
        let plan = Plan { cfg, shape: self };
        let stream = Shape {
            grid: Grid::Stream,
            ..self
        };
        let tiles = key_tiles(cfg);
        let many = items(&plan) > GRID;
        if tiles >= STREAM_MIN_TILES && stream.fits(cfg) {
            Grid::Stream
        } else if many && (tiles <= PERSISTENT_MAX_TILES || cfg.keys == KeyRule::All) {
            Grid::Persistent
        } else {
            Grid::Items
        }
    }

    /// Whether the kernel can be built in this shape for `cfg`: two or three consumers, one or
    /// two Q buffers, two to four stages of K and of V, all in the shared memory a block may
    /// take. Three consumers have 160 registers each: not at head dim 128, where S, O and P
    /// alone take 160 (ptxas serializes their wgmma, C7511), nor with dropout, whose registers
    /// spill there. Pairs need every item of a plane to visit every key of a dense K/V (every
    /// key, no window) and an even count of 64-column blocks to share out (head dim 128). A
    /// stream grid needs items of equal key tiles (every key of a dense K/V), at least two of
    /// them, and more items than blocks (at least a wave is left for the ranges, so that no
    /// item has more than two parts, and some item is split).
    pub fn fits(&self, cfg: &AttentionConfig) -> bool {
        let plan = Plan { cfg, shape: *self };
        let three = cfg.head_dim == 64 && cfg.dropout.is_none();
        let dense = cfg.keys == KeyRule::All && cfg.paging.is_none();
        let pairs = dense && cfg.head_dim == 128;
        let stream = dense && key_tiles(cfg) >= 2 && items(&plan) > GRID;
        (2..=3).contains(&self.consumers)
            && (1..=2).contains(&self.q_buffers)
            && (2..=4).contains(&self.k_stages)
            && (2..=4).contains(&self.v_stages)
            && (self.consumers == 2 || three)
            && (self.grid != Grid::Pairs || pairs)
            && (self.grid != Grid::Stream || stream)
            && shared_bytes(&plan) <= MAX_SHARED
    }

    /// `consumers` with two Q buffers and two stages of K and of V, one item a block.
    fn two_deep(consumers: u32) -> Shape {
        Shape {
            consumers,
            q_buffers: 2,
            k_stages: 2,
            v_stages: 2,
            grid: Grid::Items,
        }
    }

    /// The shapes that fit `cfg`: two or three consumers, each with two Q buffers and two
    /// stages of K and of V, or deeper stages of K (and V) for fewer Q buffers, on every grid.
    pub fn space(cfg: &AttentionConfig) -> Vec<Shape> {
        let mut shapes = Vec::new();
        for grid in [Grid::Items, Grid::Persistent, Grid::Pairs, Grid::Stream] {
            for consumers in [2, 3] {
                for (q_buffers, k_stages, v_stages) in [(2, 2, 2), (2, 3, 2), (1, 3, 2), (1, 3, 3)]
                {
                    let shape = Shape {
                        consumers,
                        q_buffers,
                        k_stages,
                        v_stages,
                        grid,
                    };
                    if shape.fits(cfg) {
                        shapes.push(shape);
                    }
                }
            }
        }
        shapes
    }
}

/// A configuration and the shape its kernel is built in; it reads as the configuration.
struct Plan<'a> {
    cfg: &'a AttentionConfig,
    shape: Shape,
}

impl std::ops::Deref for Plan<'_> {
    type Target = AttentionConfig;

    fn deref(&self) -> &AttentionConfig {
        self.cfg
    }
}

impl Plan<'_> {
    /// Stages of K or V.
    fn stages(&self, kv: Kv) -> u32 {
        match kv {
            Kv::K => self.shape.k_stages,
            Kv::V => self.shape.v_stages,
        }
    }

    /// The index of the first barrier of a kind, in order: Q full (from 0), K full, V full (one
    /// arrival each, the producer's), K empty, V empty, Q empty (every consumer warp's), one a
    /// buffer or stage.
    fn barrier(&self, kind: Barrier) -> u32 {
        let Shape {
            q_buffers: q,
            k_stages: ks,
            v_stages: vs,
            ..
        } = self.shape;
        match kind {
            Barrier::Full(Kv::K) => q,
            Barrier::Full(Kv::V) => q + ks,
            Barrier::Empty(Kv::K) => q + ks + vs,
            Barrier::Empty(Kv::V) => q + 2 * ks + vs,
            Barrier::QEmpty => q + 2 * ks + 2 * vs,
            Barrier::End => 2 * (q + ks + vs),
        }
    }
}

/// The kinds of the block's mbarriers after Q's full ones ([`Plan::barrier`]); `End` is their
/// count.
#[derive(Clone, Copy)]
enum Barrier {
    Full(Kv),
    Empty(Kv),
    QEmpty,
    End,
}

fn consumers(cfg: &Plan) -> u32 {
    cfg.shape.consumers
}

/// Query rows per block.
fn bm(cfg: &Plan) -> u32 {
    64 * consumers(cfg)
}

fn threads(cfg: &Plan) -> u32 {
    128 * (consumers(cfg) + 1)
}

/// A thread's registers at launch ([`crate::hopper::launch_regs`]).
fn launch_regs(cfg: &Plan) -> u32 {
    crate::hopper::launch_regs(threads(cfg))
}

/// A consumer's registers once the producer gave up its own: the block's at launch less the
/// producer's fewest, shared out in the multiples of 8 `setmaxnreg` takes, at most 240.
fn consumer_regs(cfg: &Plan) -> u32 {
    let left = launch_regs(cfg) * threads(cfg) - 128 * MIN_PRODUCER_REGS;
    (left / (128 * consumers(cfg)) / 8 * 8).min(240)
}

/// The producer's registers: what the consumers leave of the block's (24 beside two consumers,
/// 32 beside three, where the paged producer needs them).
fn producer_regs(cfg: &Plan) -> u32 {
    let consumers = 128 * consumers(cfg) * consumer_regs(cfg);
    (launch_regs(cfg) * threads(cfg) - consumers) / 128 / 8 * 8
}

/// The block's shared memory: the tiles (aligned to 1024 bytes inside a region 1024 larger),
/// the barriers, the padding mask rows, the position ranges and the split items' flags.
fn shared_bytes(cfg: &Plan) -> u32 {
    let mask = if cfg.padding {
        consumers(cfg) * 2 * BKV * 4
    } else {
        0
    };
    let ranges = match cfg.keys {
        KeyRule::Position { .. } => (consumers(cfg) + 1) * 4 * 2 * 4,
        _ => 0,
    };
    let flags = match cfg.shape.grid {
        Grid::Stream => consumers(cfg) * 4,
        _ => 0,
    };
    Layout::new(cfg).total
        + 1024
        + cfg.barrier(Barrier::End) * MBARRIER_BYTES
        + mask
        + ranges
        + flags
        + column_bytes(cfg)
}

/// The Philox column words' tables under dropout ([`Dropping`]): [`COLUMN_BYTES`] for each
/// consumer thread.
fn column_bytes(cfg: &Plan) -> u32 {
    match cfg.dropout {
        Some(_) => consumers(cfg) * 128 * COLUMN_BYTES,
        None => 0,
    }
}

/// One Philox block's column words ([`PhiloxRow::column`]).
const COLUMN_BYTES: u32 = 16;

/// The static shared array of the column words' tables.
const COLUMNS: &str = "attention_columns";

/// Named barriers: 0 the block's; [`MASK_BARRIER`] `+ c` consumer `c`'s 128 threads (mask
/// rows); [`turn_barrier`] `+ c` consumer `c`'s turn to issue; [`ranges_barrier`] `+ w`
/// warpgroup `w`'s position search.
const MASK_BARRIER: u32 = 1;

fn turn_barrier(cfg: &Plan) -> u32 {
    MASK_BARRIER + consumers(cfg)
}

fn ranges_barrier(cfg: &Plan) -> u32 {
    MASK_BARRIER + 2 * consumers(cfg)
}

/// Bytes of `rows` rows of the head dimension in shared memory: `D / 64` blocks of 128-byte rows.
fn tile_bytes(cfg: &AttentionConfig, rows: u32) -> u32 {
    rows * cfg.head_dim * 2
}

/// Shared-memory offsets from the 1024-aligned base.
struct Layout {
    /// Q buffer `i` at `q + i * q_bytes`.
    q: u32,
    q_bytes: u32,
    /// K's stage `s` at `k + s * kv_tile`, V's at `v + s * kv_tile`.
    k: u32,
    v: u32,
    kv_tile: u32,
    total: u32,
}

impl Layout {
    fn new(cfg: &Plan) -> Layout {
        let q_bytes = tile_bytes(cfg, bm(cfg));
        let kv_tile = tile_bytes(cfg, BKV);
        let k = cfg.shape.q_buffers * q_bytes;
        let v = k + cfg.shape.k_stages * kv_tile;
        Layout {
            q: 0,
            q_bytes,
            k,
            v,
            kv_tile,
            total: v + cfg.shape.v_stages * kv_tile,
        }
    }

    /// Where K's or V's stages start.
    fn stages(&self, kv: Kv) -> u32 {
        match kv {
            Kv::K => self.k,
            Kv::V => self.v,
        }
    }
}

/// The tensor map of operand `i` (q, k, v) over `[B, heads, rows, D]` with its strides, in boxes
/// of `box_rows` x 64; k and v over a paged cache: its pool `[blocks, KVH, block, D]`, in boxes
/// of a block.
fn map(cfg: &AttentionConfig, i: usize, heads: u32, rows: u32, box_rows: u32) -> TensorMapSpec {
    let dtype = match cfg.elem {
        Elem::F16 => kiln_ir::DType::F16,
        _ => kiln_ir::DType::BF16,
    };
    let [batch, head, row] = cfg.strides[i].map(|s| u64::from(s) * 2);
    let (rows, box_rows, batch_dim) = match cfg.paging.filter(|_| i > 0) {
        Some(p) => (p.block, p.block, p.blocks),
        None => (rows, box_rows, cfg.batch),
    };
    TensorMapSpec {
        dtype,
        dims: [
            cfg.head_dim.into(),
            rows.into(),
            heads.into(),
            batch_dim.into(),
        ],
        strides: [row, head, batch],
        box_dims: [COLS, box_rows, 1, 1],
        swizzle_bytes: SWIZZLE_BYTES,
    }
}

/// Blocks of a cluster: two for [`Grid::Pairs`], else one.
fn cluster(cfg: &Plan) -> u32 {
    match cfg.shape.grid {
        Grid::Pairs => 2,
        Grid::Items | Grid::Persistent | Grid::Stream => 1,
    }
}

/// Query blocks of [`bm`] rows per plane, whole clusters of them (a pair's second block may
/// start past the rows: it loads zeros and stores nothing).
fn query_blocks(cfg: &Plan) -> u32 {
    cfg.q_len.div_ceil(bm(cfg) * cluster(cfg)) * cluster(cfg)
}

/// Work items: query blocks times heads times batch.
fn items(cfg: &Plan) -> u32 {
    query_blocks(cfg) * cfg.heads * cfg.batch
}

/// Key tiles over every key.
fn key_tiles(cfg: &AttentionConfig) -> u32 {
    cfg.kv_len.div_ceil(BKV)
}

/// How [`Grid::Stream`] shares the work out: the first `whole` items as [`Grid::Persistent`]
/// takes them, then the `units` key tiles of the others (items of `tiles` each, in item order)
/// in equal ranges, one a block (the first blocks' one tile longer where they do not divide).
#[derive(Debug, PartialEq, Eq)]
struct StreamWork {
    /// Items taken whole, a wave at a time.
    whole: u32,
    /// Key tiles an item.
    tiles: u32,
    /// Key tiles of the items after those, shared out in ranges.
    units: u32,
}

impl StreamWork {
    /// All but the last two waves' items whole: at least a wave of [`GRID`] blocks' items is
    /// left, so that a block's range (of at most as many blocks) holds at least an item's
    /// tiles, and no item has more than two parts.
    fn of(cfg: &Plan) -> StreamWork {
        let items = items(cfg);
        let whole = (items / GRID).saturating_sub(1) * GRID;
        let tiles = key_tiles(cfg);
        StreamWork {
            whole,
            tiles,
            units: (items - whole) * tiles,
        }
    }

    /// Block `block_id`'s range of the units, of a grid of `blocks`: its start and end.
    fn range(&self, k: &mut Kernel, block_id: &Reg, blocks: &Reg) -> (Reg, Reg) {
        let per_block = k.op2("div.u32", RegClass::B32, &self.units, blocks);
        let longer = k.op2("rem.u32", RegClass::B32, &self.units, blocks);
        let extra = k.op2("min.u32", RegClass::B32, block_id, &longer);
        let start = k.mad_u32(block_id, &per_block, &extra);
        let end = k.add_u32(&start, &per_block);
        let one_more = k.setp("lt.u32", block_id, &longer);
        k.emit(format!("@{one_more} add.u32 {end}, {end}, 1"));
        (start, end)
    }
}

/// The scratch a launch of `cfg` in `shape` binds besides its operands: bytes of the f32
/// `partials` (each split item's two parts' state, `StreamSplit`) and of the u32 `counters`
/// (zero before the launch, and left zero); none but on a stream grid.
pub fn stream_scratch(cfg: &AttentionConfig, shape: Shape) -> (u64, u64) {
    if shape.grid != Grid::Stream {
        return (0, 0);
    }
    let consumers = u64::from(shape.consumers);
    let values = u64::from(part_values(cfg));
    let slots = u64::from(GRID - 1);
    (
        slots * 2 * consumers * values * 128 * 4,
        slots * consumers * 4,
    )
}

/// [`stream_scratch`] of the kernel [`attention_wgmma`] builds for `cfg` (none where `cfg` takes
/// another kernel).
pub fn scratch(cfg: &AttentionConfig) -> (u64, u64) {
    if supports(cfg) {
        stream_scratch(cfg, Shape::of(cfg))
    } else {
        (0, 0)
    }
}

/// Values of a consumer thread's state that a part of a split item leaves: its O accumulators,
/// then its two rows' maxima and sums.
fn part_values(cfg: &AttentionConfig) -> u32 {
    cfg.head_dim / 2 + 4
}

/// Bytes of K/V that the items of one group of planes may share through the L2 (the H200's holds
/// 50 MB, in two halves, besides the Q and output tiles passing through).
const L2_SHARE: u64 = 16 << 20;

/// Planes (heads x batch) per group of items: as many heads as keep their K/V heads within
/// [`L2_SHARE`], whole query groups of a K/V head, at least one. Items run group by group, so the
/// blocks resident at once read the K/V of a few heads from the L2 rather than each its own from
/// memory.
fn group_planes(cfg: &AttentionConfig) -> u32 {
    let kv_head_bytes = 2 * 2 * u64::from(cfg.kv_len) * u64::from(cfg.head_dim);
    let kv_heads = (L2_SHARE / kv_head_bytes).max(1);
    let planes = u64::from(cfg.heads * cfg.batch);
    (kv_heads * u64::from(cfg.heads / cfg.kv_heads)).min(planes) as u32
}

/// Generates the kernel in the shape [`Shape::of`] picks. Parameters: `q, k, v` (tensor maps),
/// `out, [mask], [positions], [seed], [table]`.
pub fn attention_wgmma(cfg: &AttentionConfig, name: String) -> GeneratedKernel {
    attention_wgmma_shaped(cfg, Shape::of(cfg), name)
}

/// The kernel in every shape of [`Shape::space`] but the one [`Shape::of`] picks, each named
/// `name` (the picked kernel's) with its shape: for the tests, the catalog and benchmarks.
pub fn other_shapes(cfg: &AttentionConfig, name: &str) -> Vec<GeneratedKernel> {
    let picked = Shape::of(cfg);
    Shape::space(cfg)
        .into_iter()
        .filter(|&shape| shape != picked)
        .map(|shape| {
            let label = shape.to_string().replace(' ', "_");
            attention_wgmma_shaped(cfg, shape, format!("{name}_{label}"))
        })
        .collect()
}

/// [`attention_wgmma`] in `shape`, which must fit `cfg` ([`Shape::fits`]).
pub fn attention_wgmma_shaped(
    cfg: &AttentionConfig,
    shape: Shape,
    name: String,
) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "configuration needs another attention kernel"
    );
    assert!(shape.fits(cfg), "{shape:?} does not fit the configuration");
    let cfg = &Plan { cfg, shape };
    let mut k = Kernel::new(&name);
    k.directive(format!(".maxntid {}, 1, 1", threads(cfg)));
    k.directive(".minnctapersm 1");
    if cluster(cfg) > 1 {
        k.cluster(cluster(cfg));
    }
    let params = Params::declare(&mut k, cfg);
    let layout = Layout::new(cfg);
    let tid = k.special("tid.x");
    let (base, bars) = shared_setup(&mut k, cfg, &tid);

    // Warp-uniform to ptxas, so that the branches on roles and turns are no divergent paths.
    let warpgroup = k.op2("shr.u32", RegClass::B32, &tid, &7u32);
    let warpgroup = warp_uniform(&mut k, &warpgroup);
    // Every warpgroup's share in finding an item's positions, before the roles part.
    let keys = params
        .positions
        .map(|p| PositionKeys::new(&mut k, cfg, p, &tid, &warpgroup));
    let consumers = k.label("consumers");
    let is_producer = k.setp("eq.u32", &warpgroup, &0u32);
    k.bra(Some((is_producer, false)), &consumers);
    producer(
        &mut k,
        cfg,
        (&layout, keys.as_ref(), params.table),
        &base,
        &bars,
        &tid,
        params.maps,
    );
    k.place(&consumers);
    let c = Consumer::new(&mut k, cfg, &tid, &warpgroup);
    let progress = Progress::new(&mut k);
    for_each_item(&mut k, cfg, keys.as_ref(), |k, block| {
        let dropping = params.seed.map(|seed| c.dropping(k, cfg, &block, seed));
        let state = c.main_loop(
            k,
            cfg,
            (&layout, keys.as_ref()),
            &block,
            &base,
            &bars,
            params.mask,
            &dropping,
            &progress,
        );
        match (&block.part, &params.split) {
            (Some(part), Some(split)) => {
                c.finish_part(k, cfg, (&block, part), &state, (split, params.out));
            }
            _ => c.store(k, cfg, &block, &state, params.out),
        }
        progress.next_item(k, &block);
    });

    GeneratedKernel::new(k, launch(cfg, &layout))
        .on(KernelPath::Wgmma)
        .in_image(Image::Sm90a)
}

/// The tiles' shared memory: dynamic, aligned at run time to 1024 bytes ([`shared_setup`]).
const TILES: &str = "attention_tiles";
/// The barriers' shared memory.
const BARRIERS: &str = "attention_barriers";

/// The kernel's parameters, `q, k, v` (tensor maps), `out, [mask], [positions], [seed],
/// [table], [partials, counters]`, declared with the kernel's shared memory: the tiles and
/// barriers ([`shared_setup`] sets them up), the positions' ranges, the staged mask and the
/// split items' flags.
struct Params {
    maps: [Reg; 3],
    out: Reg,
    mask: Option<Reg>,
    positions: Option<Reg>,
    seed: Option<Reg>,
    table: Option<(Reg, Paging)>,
    split: Option<StreamSplit>,
}

impl Params {
    fn declare(k: &mut Kernel, cfg: &Plan) -> Params {
        let maps = [
            k.param_tensor_map("q", map(cfg, 0, cfg.heads, cfg.q_len, bm(cfg))),
            k.param_tensor_map("k", map(cfg, 1, cfg.kv_heads, cfg.kv_len, BKV)),
            k.param_tensor_map("v", map(cfg, 2, cfg.kv_heads, cfg.kv_len, BKV)),
        ];
        let out = k.param_ptr("out");
        let mask = cfg.padding.then(|| k.param_ptr("mask"));
        let positions = matches!(cfg.keys, KeyRule::Position { .. }).then(|| {
            k.shared("attention_ranges", (consumers(cfg) + 1) * 4 * 2 * 4);
            k.param_ptr("positions")
        });
        let seed = cfg.dropout.map(|_| {
            k.shared(COLUMNS, column_bytes(cfg));
            k.param_ptr("seed")
        });
        let table = cfg.paging.map(|p| (k.param_ptr("table"), p));
        let split = (cfg.shape.grid == Grid::Stream).then(|| StreamSplit {
            partials: k.param_scratch("partials"),
            counters: k.param_scratch("counters"),
            flags: k.shared("attention_split_flags", consumers(cfg) * 4),
        });
        k.dynamic_shared_aligned(TILES, 1024);
        k.shared(BARRIERS, cfg.barrier(Barrier::End) * MBARRIER_BYTES);
        if cfg.padding {
            k.shared("attention_mask", consumers(cfg) * 2 * BKV * 4);
        }
        Params {
            maps,
            out,
            mask,
            positions,
            seed,
            table,
            split,
        }
    }
}

/// After [`Params::declare`]: the tiles' 1024-aligned base and the barriers' address, the
/// barriers initialised by thread 0 (in a cluster, every block's are ready before any block
/// goes on).
fn shared_setup(k: &mut Kernel, cfg: &Plan, tid: &Reg) -> (Reg, Reg) {
    let base = aligned_base(k, TILES);
    let bars = k.shared_base(BARRIERS);
    let first = k.setp("eq.u32", tid, &0u32);
    let init_done = k.label("init_done");
    k.bra(Some((first, false)), &init_done);
    for i in 0..cfg.barrier(Barrier::End) {
        // Full barriers take the producer's one arrival; empty ones every consumer warp's, K's
        // and V's those of the cluster's every block.
        let arrivals = if i < cfg.barrier(Barrier::Empty(Kv::K)) {
            1
        } else if i < cfg.barrier(Barrier::QEmpty) {
            4 * consumers(cfg) * cluster(cfg)
        } else {
            4 * consumers(cfg)
        };
        let bar = k.add_u32(&bars, &(i * MBARRIER_BYTES));
        mbarrier_init(k, &bar, arrivals);
    }
    mbarrier_init_fence(k);
    k.place(&init_done);
    k.barrier();
    if cluster(cfg) > 1 {
        // The other block's barriers are ready before this one's copies and arrivals reach them.
        cluster_sync(k);
    }
    (base, bars)
}

/// One block per item, or at most [`GRID`] going round them; the tiles' shared memory and
/// 1024 bytes to align it.
fn launch(cfg: &Plan, layout: &Layout) -> Launch {
    let items = items(cfg);
    Launch {
        grid: [
            match cfg.shape.grid {
                Grid::Persistent | Grid::Stream => items.min(GRID),
                Grid::Items | Grid::Pairs => items,
            },
            1,
            1,
        ],
        block: [threads(cfg), 1, 1],
        shared_bytes: layout.total + 1024,
    }
}

/// Runs `body` for each of this block's items (`ctaid.x`, then every `nctaid.x`-th), or on a
/// stream grid each of its items and parts of items ([`for_each_part`]); with position keys
/// every thread of the warpgroup must run it (`keys` finds the item's range).
fn for_each_item(
    k: &mut Kernel,
    cfg: &Plan,
    keys: Option<&PositionKeys>,
    mut body: impl FnMut(&mut Kernel, Block),
) {
    if cfg.shape.grid == Grid::Stream {
        return for_each_part(k, cfg, body);
    }
    for_each_block_item(k, "item", items(cfg), |k, item| {
        let block = Block::at(k, cfg, item, keys);
        body(k, block);
    });
}

/// [`Grid::Stream`]: runs `body` for this block's whole items (`ctaid.x`, then every
/// `nctaid.x`-th, up to [`StreamWork::whole`]), then for each item its range of the other
/// items' key tiles touches (whole, or the part in the range), in one loop so that `body` is
/// emitted once. Any grid of at most [`GRID`] blocks covers the work.
fn for_each_part(k: &mut Kernel, cfg: &Plan, mut body: impl FnMut(&mut Kernel, Block)) {
    let work = StreamWork::of(cfg);
    let block_id = k.special("ctaid.x");
    let blocks = k.special("nctaid.x");
    let (start, end) = work.range(k, &block_id, &blocks);
    let unit = k.mov(RegClass::B32, &start);
    let taken = k.mov(RegClass::B32, &block_id);
    let [item, first, tiles] = [(); 3].map(|_| k.reg(RegClass::B32));
    let top = k.label("part");
    let ranged = k.label("ranged_part");
    let found = k.label("part_found");
    let done = k.label("parts_done");
    k.place(&top);
    let wave = k.setp("lt.u32", &taken, &work.whole);
    k.bra(Some((wave, false)), &ranged);
    k.set(item, &taken);
    k.set(first, &0u32);
    k.set(tiles, &work.tiles);
    k.emit(format!("add.u32 {taken}, {taken}, {blocks}"));
    k.bra(None, &found);
    k.place(&ranged);
    let past = k.setp("ge.u32", &unit, &end);
    k.bra(Some((past, true)), &done);
    let index = k.op2("div.u32", RegClass::B32, &unit, &work.tiles);
    k.emit(format!("add.u32 {item}, {index}, {}", work.whole));
    k.emit(format!("rem.u32 {first}, {unit}, {}", work.tiles));
    let left = k.sub_u32(&work.tiles, &first);
    let rest = k.sub_u32(&end, &unit);
    k.emit(format!("min.u32 {tiles}, {left}, {rest}"));
    k.emit(format!("add.u32 {unit}, {unit}, {tiles}"));
    k.place(&found);
    let mut block = Block::at(k, cfg, &item, None);
    block.take_part(k, [first, tiles], &block_id, work.tiles);
    body(k, block);
    k.bra(None, &top);
    k.place(&done);
}

/// Position keys: the `positions` operand (`[B, S]`, i64), and this thread's share in its
/// warpgroup's search for an item's smallest and largest position (thread `t` of the 128 reads
/// rows `q0 + t` and, in 192-row blocks, `q0 + 128 + t` for `t < 64`; each warp's extremes meet
/// in shared memory behind named barrier [`ranges_barrier`] + the warpgroup).
struct PositionKeys {
    positions: Reg,
    wt: Reg,
    lane0: Reg,
    /// This warp's slot (smallest, largest) in the shared `attention_ranges`.
    slot: Reg,
    /// The warpgroup's first slot.
    slots: Reg,
    barrier: Reg,
}

impl PositionKeys {
    fn new(k: &mut Kernel, cfg: &Plan, positions: Reg, tid: &Reg, warpgroup: &Reg) -> PositionKeys {
        let WarpgroupThread { thread, lane, warp } = WarpgroupThread::of(k, tid);
        let lane0 = k.setp("eq.u32", &lane, &0u32);
        let base = k.shared_base("attention_ranges");
        let slots = k.mad_u32(warpgroup, &32u32, &base);
        let slot = k.mad_u32(&warp, &8u32, &slots);
        let barrier = k.add_u32(warpgroup, &ranges_barrier(cfg));
        PositionKeys {
            positions,
            wt: thread,
            lane0,
            slot,
            slots,
            barrier,
        }
    }

    /// Row `row` of sequence `b`'s position (`cfg.q_len` rows), 0 past the rows.
    fn position(&self, k: &mut Kernel, cfg: &Plan, b: &Reg, row: &Reg) -> Reg {
        let inside = k.setp("lt.u32", row, &cfg.q_len);
        let safe = k.selp(RegClass::B32, "u32", row, &0u32, inside);
        let i = k.mad_u32(b, &cfg.q_len, &safe);
        let a = k.address(self.positions, &i, 8);
        let wide = k.ld_global_i64(a);
        k.op1("cvt.u32.u64", RegClass::B32, &wide)
    }

    /// The smallest and largest position of sequence `b`'s rows `q0 .. q0 + bm` (those inside
    /// the sequence), in every thread of the warpgroup.
    fn range(&self, k: &mut Kernel, cfg: &Plan, b: &Reg, q0: &Reg) -> (Reg, Reg) {
        k.comment("position keys: the item's smallest and largest position");
        let mut lo = k.mov(RegClass::B32, &u32::MAX);
        let mut hi = k.mov(RegClass::B32, &0u32);
        for i in 0..bm(cfg).div_ceil(128) {
            let mut row = k.add_u32(q0, &self.wt);
            if i > 0 {
                row = k.add_u32(&row, &(128 * i));
            }
            let mut inside = k.setp("lt.u32", &row, &cfg.q_len);
            if 128 * (i + 1) > bm(cfg) {
                // A pass over the block's last rows: not into the next block's.
                let ours = k.setp("lt.u32", &self.wt, &(bm(cfg) - 128 * i));
                let both = k.reg(RegClass::Pred);
                k.emit(format!("and.pred {both}, {inside}, {ours}"));
                inside = both;
            }
            let pos = self.position(k, cfg, b, &row);
            let low = k.selp(RegClass::B32, "u32", &pos, &u32::MAX, inside);
            let high = k.selp(RegClass::B32, "u32", &pos, &0u32, inside);
            lo = k.op2("min.u32", RegClass::B32, &lo, &low);
            hi = k.op2("max.u32", RegClass::B32, &hi, &high);
        }
        for lanes in [16u32, 8, 4, 2, 1] {
            for (r, op) in [(&mut lo, "min"), (&mut hi, "max")] {
                let other = k.reg(RegClass::B32);
                k.emit(format!("shfl.sync.bfly.b32 {other}, {r}, {lanes}, 31, -1"));
                *r = k.op2(&format!("{op}.u32"), RegClass::B32, r, &other);
            }
        }
        k.emit(format!(
            "@{} st.shared.v2.u32 [{}], {{{lo}, {hi}}}",
            self.lane0, self.slot
        ));
        // Not `bar.sync` (aligned): the producer's thread 0 comes to it later than its warp.
        k.emit(format!("barrier.sync {}, 128", self.barrier));
        let (mut lo, mut hi) = (k.mov(RegClass::B32, &u32::MAX), k.mov(RegClass::B32, &0u32));
        for w in 0..4 {
            let (a, b) = (k.reg(RegClass::B32), k.reg(RegClass::B32));
            k.emit(format!(
                "ld.shared.v2.u32 {{{a}, {b}}}, [{}+{}]",
                self.slots,
                8 * w
            ));
            lo = k.op2("min.u32", RegClass::B32, &lo, &a);
            hi = k.op2("max.u32", RegClass::B32, &hi, &b);
        }
        // The slots are the next item's only once every thread has read them.
        k.emit(format!("barrier.sync {}, 128", self.barrier));
        // Every lane holds the same extremes, but ptxas cannot tell from loads; made
        // warp-uniform, the key tiles derived from them keep the tile loop no divergent path.
        (warp_uniform(k, &lo), warp_uniform(k, &hi))
    }
}

/// Where a warpgroup is in the block's items: how many it has taken (which Q buffer, and which
/// round of it), and how many key tiles (which K/V stage, and which round of it).
struct Progress {
    item: Reg,
    tile: Reg,
}

impl Progress {
    fn new(k: &mut Kernel) -> Progress {
        Progress {
            item: k.mov(RegClass::B32, &0u32),
            tile: k.mov(RegClass::B32, &0u32),
        }
    }

    /// This item's Q buffer offset, its full and empty barriers and the parity of its round.
    fn q_buffer(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        layout: &Layout,
        bars: &Reg,
    ) -> (Reg, Reg, Reg, Reg) {
        let (buf, parity) = stage_of(k, &self.item, cfg.shape.q_buffers);
        let offset = k.mad_u32(&buf, &layout.q_bytes, &layout.q);
        let full = k.mad_u32(&buf, &MBARRIER_BYTES, bars);
        let empty = k.add_u32(&full, &(cfg.barrier(Barrier::QEmpty) * MBARRIER_BYTES));
        (offset, full, empty, parity)
    }

    /// Key tile `j` of this item, counted across the block's items.
    fn tile(&self, k: &mut Kernel, j: &Reg) -> Reg {
        k.add_u32(&self.tile, j)
    }

    fn next_item(&self, k: &mut Kernel, block: &Block) {
        k.emit(format!("add.u32 {0}, {0}, 1", self.item));
        k.emit(format!("add.u32 {0}, {0}, {1}", self.tile, block.tiles));
    }
}

/// An item's place: batch, head, K/V head, first query row, and its key tiles.
struct Block {
    b: Reg,
    h: Reg,
    kvh: Reg,
    q0: Reg,
    /// Key tiles to visit, `j` from 0: `tiles` of them, from key tile 0 or, under a sliding
    /// window, from the one where the item's earliest window starts.
    tiles: Reg,
    /// Tiles `j` from this one on need per-element masks (they cross a row's last key or the
    /// end).
    edge_from: Reg,
    /// Under a sliding window, where the item's tiles start and which cross a row's first key.
    window: Option<Slide>,
    /// On a stream grid, the part of the item this is.
    part: Option<Part>,
}

/// A [`Grid::Stream`] block's part of an item: the whole item, or one of the two parts of an
/// item whose key tiles two blocks' ranges share.
struct Part {
    /// The item's key tile that the part's tile 0 is.
    first: Reg,
    /// Whether the part is the whole item.
    whole: Reg,
    /// Whether it is the item's later part (this block's range starts inside the item).
    later: Reg,
    /// Where the two parts meet in `partials` and `counters`: the boundary between the two
    /// blocks whose ranges share the item (block `slot` and `slot + 1`; this block's start for
    /// the later part, its end for the first), of which a grid of [`GRID`] blocks has one fewer.
    slot: Reg,
}

/// An item's key tiles under a sliding window ([`Block::slide`]).
struct Slide {
    /// The first key of tile `j = 0` (a multiple of [`BKV`]).
    start_key: Reg,
    /// Tiles `j` before this one need per-element masks too (they cross a row's first key).
    clean_from: Reg,
}

impl Block {
    /// Item `item`: groups of planes slowest ([`group_planes`]), then query blocks (longest first
    /// when causal or by position: the last has the most keys), then the group's planes (batch,
    /// then heads) fastest.
    fn at(k: &mut Kernel, cfg: &Plan, item: &Reg, keys: Option<&PositionKeys>) -> Block {
        let blocks = query_blocks(cfg);
        let (rank, plane) = if cluster(cfg) > 1 {
            // The cluster's query blocks in a row, one a block.
            let pair = k.op2("div.u32", RegClass::B32, item, &cluster(cfg));
            let (first, plane) = Self::rank_and_plane(k, cfg, &pair);
            let within = k.special("cluster_ctarank");
            (k.mad_u32(&first, &cluster(cfg), &within), plane)
        } else {
            Self::rank_and_plane(k, cfg, item)
        };
        let h = k.op2("rem.u32", RegClass::B32, &plane, &cfg.heads);
        let b = k.op2("div.u32", RegClass::B32, &plane, &cfg.heads);
        let causal = matches!(cfg.keys, KeyRule::Causal { .. });
        let qb = if causal || keys.is_some() {
            k.sub_u32(&(blocks - 1), &rank)
        } else {
            rank
        };
        let q0 = k.mul_u32(&qb, &bm(cfg));
        let kvh = k.op2("div.u32", RegClass::B32, &h, &(cfg.heads / cfg.kv_heads));
        let all = key_tiles(cfg);
        let whole = cfg.kv_len / BKV;
        // The item's rows' smallest and largest last keys as the rule gives them, and the largest
        // inside the keys, where they differ from row to row.
        let mut lasts = None;
        let (tiles, edge_from) = if let Some(keys) = keys {
            // Tiles up to the largest position's key; per-element masks from the tile that
            // crosses the smallest one's.
            let (lo, given) = keys.range(k, cfg, &b, &q0);
            // At least one tile (the consumers multiply the first unconditionally), and no
            // overflow from a position of 2^32 - 1 (a negative one's low half).
            let hi = k.op2("min.u32", RegClass::B32, &given, &(cfg.kv_len - 1));
            let needed = k.add_u32(&hi, &BKV);
            let needed = k.op2("shr.u32", RegClass::B32, &needed, &BKV.trailing_zeros());
            let tiles = k.op2("min.u32", RegClass::B32, &needed, &all);
            let lo_end = k.add_u32(&lo, &1u32);
            let clean = k.op2("shr.u32", RegClass::B32, &lo_end, &BKV.trailing_zeros());
            lasts = Some((lo, given, hi));
            (tiles, k.op2("min.u32", RegClass::B32, &clean, &whole))
        } else if causal {
            // The block's last row sees keys up to q0 + bm - 1 + T - S; its first row up to
            // q0 + T - S.
            let shift = cfg.kv_len - cfg.q_len;
            let end = k.add_u32(&q0, &(bm(cfg) + shift));
            let needed = k.add_u32(&end, &(BKV - 1));
            let needed = k.op2("shr.u32", RegClass::B32, &needed, &BKV.trailing_zeros());
            let tiles = k.op2("min.u32", RegClass::B32, &needed, &all);
            let first_last = k.add_u32(&q0, &(shift + 1));
            let clean = k.op2("shr.u32", RegClass::B32, &first_last, &BKV.trailing_zeros());
            if cfg.keys.window().is_some() {
                let lo = k.add_u32(&q0, &shift);
                let given = k.add_u32(&q0, &(bm(cfg) - 1 + shift));
                let hi = k.op2("min.u32", RegClass::B32, &given, &(cfg.kv_len - 1));
                lasts = Some((lo, given, hi));
            }
            (tiles, k.op2("min.u32", RegClass::B32, &clean, &whole))
        } else {
            (k.mov(RegClass::B32, &all), k.mov(RegClass::B32, &whole))
        };
        let mut block = Block {
            b,
            h,
            kvh,
            q0,
            tiles,
            edge_from,
            window: None,
            part: None,
        };
        if let (Some(w), Some(lasts)) = (cfg.keys.window(), lasts) {
            block.slide(k, cfg.kv_len, w, lasts);
        }
        block
    }

    /// Under a window of `w` keys, over rows whose last keys (as the rule gives them) run from
    /// `lo` to `hi`, `last` the largest inside the keys: the tiles from the one holding the
    /// first key of `lo`'s window (wholly before it, every row's weight is zero), counted from
    /// there, and the tiles before the one from which every key is inside `hi`'s window (from
    /// there on, inside every row's) masked per element. The first tile is at most `last`'s, so
    /// an item has at least one; when every row's window starts past `last` (positions past
    /// the keys), that one is masked whole.
    fn slide(&mut self, k: &mut Kernel, kv_len: u32, w: u32, (lo, hi, last): (Reg, Reg, Reg)) {
        let start = window_start(k, lo, w);
        let start = k.op2("min.u32", RegClass::B32, &start, &last);
        let start = k.op2("and.b32", RegClass::B32, &start, &!(BKV - 1));
        let skipped = k.op2("shr.u32", RegClass::B32, &start, &BKV.trailing_zeros());
        let inside = window_start(k, hi, w);
        let inside = k.op2("min.u32", RegClass::B32, &inside, &kv_len);
        let inside = k.add_u32(&inside, &(BKV - 1));
        let clean = k.op2("shr.u32", RegClass::B32, &inside, &BKV.trailing_zeros());
        self.tiles = k.sub_u32(&self.tiles, &skipped);
        // (A negative position wraps the edge's tile to 0: every tile masked, as without a
        // window.)
        let edge_from = k.op2("max.u32", RegClass::B32, &self.edge_from, &skipped);
        self.edge_from = k.sub_u32(&edge_from, &skipped);
        self.window = Some(Slide {
            start_key: start,
            clean_from: k.sub_u32(&clean, &skipped),
        });
    }

    /// The part of the item of `tiles` key tiles from its tile `first` that a stream grid's
    /// block `block_id` takes ([`for_each_part`]): `count` of them, those from `edge_from` on
    /// (counted in the item) masked per element.
    fn take_part(&mut self, k: &mut Kernel, [first, count]: [Reg; 2], block_id: &Reg, tiles: u32) {
        let edge_from = k.op2("max.u32", RegClass::B32, &self.edge_from, &first);
        self.edge_from = k.sub_u32(&edge_from, &first);
        self.tiles = count;
        let later = k.setp("ne.u32", &first, &0u32);
        let before = k.sub_u32(block_id, &1u32);
        self.part = Some(Part {
            first,
            whole: k.setp("eq.u32", &count, &tiles),
            later,
            slot: k.selp(RegClass::B32, "u32", &before, block_id, later),
        });
    }

    /// The first key of the item's key tile `j`.
    fn key0(&self, k: &mut Kernel, j: &Reg) -> Reg {
        let tile = match &self.part {
            Some(part) => k.add_u32(j, &part.first),
            None => *j,
        };
        let key0 = k.mul_u32(&tile, &BKV);
        match &self.window {
            Some(slide) => k.add_u32(&key0, &slide.start_key),
            None => key0,
        }
    }

    /// Item (or cluster) `item`'s query-block (or cluster) rank and plane (the last group of
    /// planes may be narrower).
    fn rank_and_plane(k: &mut Kernel, cfg: &Plan, item: &Reg) -> (Reg, Reg) {
        let planes = cfg.heads * cfg.batch;
        let group = group_planes(cfg);
        if group == planes {
            let rank = k.op2("div.u32", RegClass::B32, item, &planes);
            return (rank, k.op2("rem.u32", RegClass::B32, item, &planes));
        }
        let group_items = group * query_blocks(cfg) / cluster(cfg);
        let g = k.op2("div.u32", RegClass::B32, item, &group_items);
        let within = k.op2("rem.u32", RegClass::B32, item, &group_items);
        let first = k.mul_u32(&g, &group);
        let left = k.sub_u32(&planes, &first);
        let width = k.op2("min.u32", RegClass::B32, &left, &group);
        let rank = k.op2("div.u32", RegClass::B32, &within, &width);
        let offset = k.op2("rem.u32", RegClass::B32, &within, &width);
        (rank, k.add_u32(&first, &offset))
    }
}

/// Warpgroup 0: thread 0 copies each item's Q, then streams its K/V tiles; the warpgroup then
/// leaves (with position keys, once every thread has helped find each item's range).
fn producer(
    k: &mut Kernel,
    cfg: &Plan,
    (layout, keys, table): (&Layout, Option<&PositionKeys>, Option<(Reg, Paging)>),
    base: &Reg,
    bars: &Reg,
    tid: &Reg,
    [q, kk, v]: [Reg; 3],
) {
    let maps = [kk, v];
    setmaxnreg(k, false, producer_regs(cfg));
    let exit = k.label("producer_done");
    let first = k.setp("eq.u32", tid, &0u32);
    // With position keys every thread goes round the items, the first alone loading.
    let maps_done = keys.map(|_| k.label("maps_prefetched"));
    k.bra(Some((first, false)), maps_done.as_ref().unwrap_or(&exit));
    for map in [&q, &kk, &v] {
        prefetch_tensor_map(k, map);
    }
    if let Some(label) = &maps_done {
        k.place(label);
    }
    let progress = Progress::new(k);
    let share = Share::of(k, cfg);
    for_each_item(k, cfg, keys, |k, block| {
        let loaded = keys.map(|_| k.label("item_loaded"));
        if let Some(label) = &loaded {
            k.bra(Some((first, false)), label);
        }
        load_q(k, cfg, layout, base, bars, &progress, &block, &q);
        let j = k.mov(RegClass::B32, &0u32);
        let top = k.label("produce");
        let done = k.label("produced");
        k.place(&top);
        let past = k.setp("ge.u32", &j, &block.tiles);
        k.bra(Some((past, true)), &done);
        let tile = progress.tile(k, &j);
        let key0 = block.key0(k, &j);
        // A dense tile's K, then its V, each as soon as its stage is free; a paged tile's K and
        // V together, box by box, each box's block looked up just before its copies (the
        // producer has few registers to keep blocks in).
        let passes: &[&[Kv]] = match table {
            None => &[&[Kv::K], &[Kv::V]],
            Some(_) => &[&[Kv::K, Kv::V]],
        };
        for pass in passes {
            let mut armed = Vec::new();
            for &kv in *pass {
                let (s, parity) = stage_of(k, &tile, cfg.stages(kv));
                let (full, empty) = kv_barriers(k, cfg, bars, &s, kv);
                wait_released(k, (&tile, cfg.stages(kv)), (&empty, &parity), "fresh_stage");
                mbarrier_arrive_expect_tx(k, &full, layout.kv_tile);
                let dst = k.mad_u32(&s, &layout.kv_tile, &layout.stages(kv));
                armed.push((maps[kv as usize], k.add_u32(&dst, base), full));
            }
            match table {
                None => {
                    for (map, dst, full) in &armed {
                        let at = [&key0 as &dyn Operand, &block.kvh, &block.b];
                        load_tile(k, cfg, map, (dst, full), at, (0, share.as_ref()));
                    }
                }
                Some((table, p)) => {
                    let key_rows = Some((table, p));
                    let rows = KeyRows::new(k, cfg.strides[1], [block.b, block.kvh], key_rows);
                    for i in 0..BKV / p.block {
                        let key = k.add_u32(&key0, &(i * p.block));
                        let pool_block = rows.block(k, &key).expect("a paged cache");
                        let at = [&0u32 as &dyn Operand, &block.kvh, &pool_block];
                        let within = i * p.block * SWIZZLE_BYTES;
                        for (map, dst, full) in &armed {
                            load_tile(k, cfg, map, (dst, full), at, (within, None));
                        }
                    }
                }
            }
        }
        k.emit(format!("add.u32 {j}, {j}, 1"));
        k.bra(None, &top);
        k.place(&done);
        progress.next_item(k, &block);
        if let Some(label) = &loaded {
            k.place(label);
        }
    });
    k.place(&exit);
    k.emit("ret");
}

/// A pair's share of each K/V tile's copies ([`Grid::Pairs`]): block `r` of the cluster copies
/// the 64-column blocks `i` with `i % 2 == r` into both blocks' stages.
struct Share {
    /// Whether this block is the cluster's block 0, 1.
    mine: [Reg; 2],
    /// The cluster's blocks, as a multicast mask.
    ctas: u16,
}

impl Share {
    /// This block's share, in a cluster of more than one block.
    fn of(k: &mut Kernel, cfg: &Plan) -> Option<Share> {
        (cluster(cfg) > 1).then(|| {
            let rank = k.special("cluster_ctarank");
            Share {
                mine: [0u32, 1].map(|r| k.setp("eq.u32", &rank, &r)),
                ctas: (1 << cluster(cfg)) - 1,
            }
        })
    }
}

/// Copies the K or V box of `map` at coordinates `[row, head, outer]` (a dense operand's key,
/// K/V head and batch row; a paged pool's row in a block, K/V head and block) into `tile`,
/// `within` bytes in, every 64-column block of the head dimension, arriving on `full`; with a
/// [`Share`], this block's blocks of it into the stages of the cluster's every block.
fn load_tile(
    k: &mut Kernel,
    cfg: &Plan,
    map: &Reg,
    (tile, full): (&Reg, &Reg),
    [row, kvh, outer]: [&dyn Operand; 3],
    (within, share): (u32, Option<&Share>),
) {
    for i in 0..cfg.head_dim / COLS {
        let dst = k.add_u32(tile, &(i * BKV * SWIZZLE_BYTES + within));
        let at = [&(i * COLS) as &dyn Operand, row, kvh, outer];
        match share {
            None => tma_load(k, &dst, map, &at, full),
            Some(share) => {
                let mine = Some(&share.mine[(i % 2) as usize]);
                tma_load_to(k, mine, (&dst, full), map, &at, Some(share.ctas));
            }
        }
    }
}

/// Copies the item's Q tile into its buffer, once every consumer has released the buffer's
/// previous item (from the block's third item on).
#[allow(clippy::too_many_arguments)]
fn load_q(
    k: &mut Kernel,
    cfg: &Plan,
    layout: &Layout,
    base: &Reg,
    bars: &Reg,
    progress: &Progress,
    block: &Block,
    q: &Reg,
) {
    let (offset, full, empty, parity) = progress.q_buffer(k, cfg, layout, bars);
    let ring = (&progress.item, cfg.shape.q_buffers);
    wait_released(k, ring, (&empty, &parity), "fresh_q");
    mbarrier_arrive_expect_tx(k, &full, tile_bytes(cfg, bm(cfg)));
    let buffer = k.add_u32(base, &offset);
    for i in 0..cfg.head_dim / COLS {
        let dst = k.add_u32(&buffer, &(i * bm(cfg) * SWIZZLE_BYTES));
        let at = [&(i * COLS) as &dyn Operand, &block.q0, &block.h, &block.b];
        tma_load(k, &dst, q, &at, &full);
    }
}

/// The largest of `values` (at least one), taken in pairs: a chain of log2 n maxima, not n.
fn max_tree(k: &mut Kernel, mut values: Vec<Reg>) -> Reg {
    while values.len() > 1 {
        let mut next = Vec::with_capacity(values.len().div_ceil(2));
        for pair in values.chunks(2) {
            next.push(match pair {
                [a, b] => k.max_f32(a, b),
                [a] => *a,
                _ => unreachable!("chunks of two"),
            });
        }
        values = next;
    }
    values[0]
}

/// The two operands streamed through stages, each with barriers of its own.
#[derive(Clone, Copy)]
enum Kv {
    K = 0,
    V = 1,
}

/// The full and empty barriers of stage `s` of K or V.
fn kv_barriers(k: &mut Kernel, cfg: &Plan, bars: &Reg, s: &Reg, kv: Kv) -> (Reg, Reg) {
    let full = k.mad_u32(s, &MBARRIER_BYTES, bars);
    let empty = cfg.barrier(Barrier::Empty(kv)) * MBARRIER_BYTES;
    let full_at = k.add_u32(&full, &(cfg.barrier(Barrier::Full(kv)) * MBARRIER_BYTES));
    (full_at, k.add_u32(&full, &empty))
}

/// Which of `n` buffers the `j`-th use (counted from 0) takes, and the parity of its round.
fn stage_of(k: &mut Kernel, j: &Reg, n: u32) -> (Reg, Reg) {
    let (s, round) = if n.is_power_of_two() {
        (
            k.op2("and.b32", RegClass::B32, j, &(n - 1)),
            k.op2("shr.u32", RegClass::B32, j, &n.trailing_zeros()),
        )
    } else {
        (
            k.op2("rem.u32", RegClass::B32, j, &n),
            k.op2("div.u32", RegClass::B32, j, &n),
        )
    };
    (s, k.op2("and.b32", RegClass::B32, &round, &1u32))
}

/// A consumer thread's place: its consumer warpgroup `c` (from 0), thread in the warpgroup, warp,
/// quad row `g` and column pair `t`.
struct Consumer {
    c: Reg,
    wt: Reg,
    lane: Reg,
    lane0: Reg,
    /// Its two query rows in the block: `64 c + 16 warp + g` and 8 further.
    row: Reg,
    /// `2 t`: its first column in each 8-column chunk.
    t2: Reg,
}

/// The first and last key each of a consumer thread's two rows sees ([`Consumer::keys_seen`]).
struct KeysSeen {
    last: Vec<Reg>,
    /// Under a window only.
    first: Option<Vec<Reg>>,
}

/// The consumers' turns at issuing products: each waits on its own named barrier
/// ([`turn_barrier`] + its index) and, once its products are issued, arrives at the next one's,
/// round the consumers. The last consumer makes the first arrival, for the first, at the start.
struct Turns {
    mine: Reg,
    next: Reg,
    last_one: Reg,
}

impl Turns {
    fn new(k: &mut Kernel, cfg: &Plan, consumer: &Reg) -> Turns {
        let n = consumers(cfg);
        let mine = k.add_u32(consumer, &turn_barrier(cfg));
        let after = k.add_u32(consumer, &1u32);
        let after = k.op2("rem.u32", RegClass::B32, &after, &n);
        let next = k.add_u32(&after, &turn_barrier(cfg));
        let last_one = k.setp("eq.u32", consumer, &(n - 1));
        let first_goes = k.label("first_goes");
        k.bra(Some((last_one, false)), &first_goes);
        k.emit(format!("bar.arrive {}, 256", turn_barrier(cfg)));
        k.place(&first_goes);
        Turns {
            mine,
            next,
            last_one,
        }
    }

    /// Waits for this consumer's turn.
    fn wait(&self, k: &mut Kernel) {
        k.emit(format!("bar.sync {}, 256", self.mine));
    }

    /// Hands the turn to the next consumer.
    fn pass(&self, k: &mut Kernel) {
        k.emit(format!("bar.arrive {}, 256", self.next));
    }

    /// The last turn: the last consumer made the first arrival, so it makes no last one.
    fn pass_last(&self, k: &mut Kernel) {
        let no_turn = k.label("no_turn");
        k.bra(Some((self.last_one, true)), &no_turn);
        self.pass(k);
        k.place(&no_turn);
    }
}

/// A consumer's view of the stages: Q, the K/V stage of each tile, and the score and
/// probability registers the tiles reuse.
struct Tiles<'a> {
    cfg: &'a Plan<'a>,
    layout: &'a Layout,
    base: Reg,
    bars: Reg,
    /// The block's key tiles before this item's (the stages are counted across items).
    first: Reg,
    /// The item's key tiles, where the cluster's blocks share the stages ([`Grid::Pairs`]).
    shared_tiles: Option<Reg>,
    /// This warpgroup's rows of Q.
    q: Reg,
    s: Vec<Reg>,
    p: Vec<Reg>,
}

impl Tiles<'_> {
    /// The item's tile `j`'s K or V stage: its shared address, full and empty barriers, and the
    /// parity of its round.
    fn stage(&self, k: &mut Kernel, j: &Reg, kv: Kv) -> (Reg, Reg, Reg, Reg) {
        let (st, parity, full, empty) = self.barriers(k, j, kv);
        let at = k.mad_u32(&st, &self.layout.kv_tile, &self.base);
        let at = k.add_u32(&at, &self.layout.stages(kv));
        (at, full, empty, parity)
    }

    /// The item's tile `j`'s K or V stage index, the parity of its round, and its full and
    /// empty barriers.
    fn barriers(&self, k: &mut Kernel, j: &Reg, kv: Kv) -> (Reg, Reg, Reg, Reg) {
        let tile = k.add_u32(&self.first, j);
        let (st, parity) = stage_of(k, &tile, self.cfg.stages(kv));
        let (full, empty) = kv_barriers(k, self.cfg, &self.bars, &st, kv);
        (st, parity, full, empty)
    }

    /// Waits for tile `j`'s K stage and issues `S = Q K^T` into `s`.
    fn issue_scores(&self, k: &mut Kernel, j: &Reg) {
        let (k_tile, full, _, parity) = self.stage(k, j, Kv::K);
        mbarrier_wait(k, &full, &parity);
        for kk in 0..self.cfg.head_dim / 16 {
            let (blk, within) = (kk / 4, (kk % 4) * 32);
            let qa = k.add_u32(&self.q, &(blk * bm(self.cfg) * SWIZZLE_BYTES + within));
            let ka = k.add_u32(&k_tile, &(blk * BKV * SWIZZLE_BYTES + within));
            let qd = wgmma_descriptor(k, &qa, 16, 1024);
            let kd = wgmma_descriptor(k, &ka, 16, 1024);
            let b = WgmmaB {
                desc: &kd,
                transposed: false,
            };
            wgmma(k, self.cfg.elem, &self.s, WgmmaA::Shared(&qd), b, kk > 0);
        }
    }

    /// Waits for tile `j`'s V stage and issues `O += P V` (P in `p`, V read N-major).
    fn issue_pv(&self, k: &mut Kernel, j: &Reg, o: &[Reg]) {
        let (v_tile, full, _, parity) = self.stage(k, j, Kv::V);
        mbarrier_wait(k, &full, &parity);
        for kk in 0..BKV / 16 {
            let va = k.add_u32(&v_tile, &(kk * 16 * SWIZZLE_BYTES));
            let vd = wgmma_descriptor(k, &va, BKV * SWIZZLE_BYTES, 1024);
            let b = WgmmaB {
                desc: &vd,
                transposed: true,
            };
            let a = &self.p[(4 * kk) as usize..(4 * kk + 4) as usize];
            wgmma(k, self.cfg.elem, o, WgmmaA::Registers(a), b, true);
        }
    }

    /// Releases tile `j`'s K or V stage (lane 0 of each warp arrives); where the cluster's
    /// blocks share the stages, in each of them, and only a stage that a later tile refills:
    /// once the last tiles are in, the other block may have finished.
    fn release(&self, k: &mut Kernel, j: &Reg, kv: Kv, lane0: Reg) {
        let (_, _, _, empty) = self.barriers(k, j, kv);
        let Some(tiles) = &self.shared_tiles else {
            mbarrier_arrive(k, &empty, Some(lane0));
            return;
        };
        let refill = k.add_u32(j, &self.cfg.stages(kv));
        let when = k.setp("lt.u32", &refill, tiles);
        k.emit(format!("and.pred {when}, {when}, {lane0}"));
        for rank in 0..cluster(self.cfg) {
            mbarrier_arrive_in(k, &empty, rank, &when);
        }
    }
}

/// A consumer warpgroup's pass over one item's key tiles ([`Consumer::main_loop`]): tile 0's
/// scores and probabilities, then for each next tile its scores and the tile before's `P V`,
/// then the last tile's `P V`, the rows' state (`state`) carried through.
struct Pass<'a> {
    c: &'a Consumer,
    cfg: &'a Plan<'a>,
    block: &'a Block,
    mask: Option<Reg>,
    dropping: &'a Option<Dropping>,
    progress: &'a Progress,
    seen: KeysSeen,
    state: RowState,
    tiles: Tiles<'a>,
    turns: Turns,
}

impl Pass<'_> {
    /// Tile j's probabilities (dropped ones zeroed) in place of its scores, and, where a later
    /// tile's softmax runs under the warpgroup's own `P V`, the correction O waits for.
    fn probabilities(&self, k: &mut Kernel, j: &Reg, first: bool) -> Correction {
        let (c, cfg, s) = (self.c, self.cfg, &self.tiles.s);
        let in_flight = !first && under_own_products(cfg);
        if self.mask.is_some() {
            let tile = self.progress.tile(k, j);
            c.add_mask(k, s, &tile);
        }
        let key0 = self.block.key0(k, j);
        c.mask_edges(k, s, self.block, j, &key0, &self.seen);
        let correction = c.softmax(k, cfg, s, &self.state, (first, in_flight));
        if let Some(d) = self.dropping {
            d.drop(k, s, &key0);
        }
        correction
    }

    /// After each tile's softmax, once the `P V` before it is done (tile 0 has none): O
    /// corrected, the probabilities packed in pairs into P, the A operand of the tile's `P V`
    /// (4 registers per 16 keys).
    fn correct_and_pack(&self, k: &mut Kernel, correction: Correction) {
        correction.apply(k, &self.state.o);
        let cvt = format!("cvt.rn.{}x2.f32", self.cfg.elem.name());
        for (pair, w) in self.tiles.s.chunks(2).zip(&self.tiles.p) {
            // The first operand goes to the upper half.
            k.emit(format!("{cvt} {w}, {}, {}", pair[1], pair[0]));
        }
    }

    /// Stages tile `j`'s mask, if any, and waits for this consumer's turn.
    fn turn_for(&self, k: &mut Kernel, j: &Reg) {
        if let Some(mask) = self.mask {
            self.c
                .stage_mask(k, self.cfg, self.block, j, self.progress, mask);
        }
        self.turns.wait(k);
        wgmma_fence(k);
    }

    /// Tile 0's scores and probabilities.
    fn first_tile(&self, k: &mut Kernel, j: &Reg) {
        let (tiles, lane0) = (&self.tiles, self.c.lane0);
        k.comment("tile 0: its scores and probabilities");
        self.turn_for(k, j);
        tiles.issue_scores(k, j);
        wgmma_commit(k);
        self.turns.pass(k);
        wgmma_wait(k, 0);
        tiles.release(k, j, Kv::K, lane0);
        let correction = self.probabilities(k, j, true);
        self.correct_and_pack(k, correction);
    }

    /// The scores of tile `next` and `O += P V` of tile `j`.
    fn next_tile(&self, k: &mut Kernel, j: &Reg, next: &Reg) {
        let (tiles, lane0, o) = (&self.tiles, self.c.lane0, &self.state.o);
        self.turn_for(k, next);
        let correction = if under_own_products(self.cfg) {
            k.comment("the scores of tile j + 1, then O += P V of tile j: two wgmma groups");
            tiles.issue_scores(k, next);
            wgmma_commit(k);
            tiles.issue_pv(k, j, o);
            wgmma_commit(k);
            self.turns.pass(k);
            k.comment("the softmax of tile j + 1 under O += P V of tile j");
            wgmma_wait(k, 1);
            tiles.release(k, next, Kv::K, lane0);
            let correction = self.probabilities(k, next, false);
            wgmma_wait(k, 0);
            tiles.release(k, j, Kv::V, lane0);
            correction
        } else {
            k.comment("O += P V of tile j, then the scores of tile j + 1: one wgmma group");
            tiles.issue_pv(k, j, o);
            tiles.issue_scores(k, next);
            wgmma_commit(k);
            self.turns.pass(k);
            wgmma_wait(k, 0);
            tiles.release(k, j, Kv::V, lane0);
            tiles.release(k, next, Kv::K, lane0);
            self.probabilities(k, next, false)
        };
        self.correct_and_pack(k, correction);
    }

    /// The last tile's `O += P V`.
    fn last_tile(&self, k: &mut Kernel, j: &Reg) {
        k.comment("the last tile's O += P V");
        self.turns.wait(k);
        wgmma_fence(k);
        self.tiles.issue_pv(k, j, &self.state.o);
        wgmma_commit(k);
        self.turns.pass_last(k);
        wgmma_wait(k, 0);
        self.tiles.release(k, j, Kv::V, self.c.lane0);
    }
}

impl Consumer {
    fn new(k: &mut Kernel, cfg: &Plan, tid: &Reg, warpgroup: &Reg) -> Consumer {
        setmaxnreg(k, true, consumer_regs(cfg));
        let c = k.sub_u32(warpgroup, &1u32);
        let WarpgroupThread { thread, lane, warp } = WarpgroupThread::of(k, tid);
        let lane0 = k.setp("eq.u32", &lane, &0u32);
        let g = k.op2("shr.u32", RegClass::B32, &lane, &2u32);
        let t = k.op2("and.b32", RegClass::B32, &lane, &3u32);
        let r0 = k.mul_u32(&c, &64u32);
        let r1 = k.mad_u32(&warp, &16u32, &r0);
        let row = k.add_u32(&r1, &g);
        let t2 = k.mul_u32(&t, &2u32);
        Consumer {
            c,
            wt: thread,
            lane,
            lane0,
            row,
            t2,
        }
    }

    /// The key tiles: the consumers take turns issuing (named barriers from [`turn_barrier`],
    /// each waiting for the one before), so that one's softmax runs while the others' products
    /// do. Where [`under_own_products`], the scores of tile `j + 1` and then `O += P V` of tile
    /// `j` are two wgmma groups and the softmax of tile `j + 1` runs once its scores are in,
    /// under the warpgroup's own `P V` (O's correction and P wait for it); otherwise `P V` and
    /// the scores are one group, awaited whole.
    #[allow(clippy::too_many_arguments)]
    fn main_loop(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        (layout, keys): (&Layout, Option<&PositionKeys>),
        block: &Block,
        base: &Reg,
        bars: &Reg,
        mask: Option<Reg>,
        dropping: &Option<Dropping>,
        progress: &Progress,
    ) -> RowState {
        let state = RowState::new(k, cfg.head_dim);
        let seen = self.keys_seen(k, cfg, keys, block);
        // This warpgroup's 64 rows of the item's Q buffer.
        let (q_offset, q_full, q_empty, q_parity) = progress.q_buffer(k, cfg, layout, bars);
        let q_rows = k.mad_u32(&self.c, &(64 * SWIZZLE_BYTES), &q_offset);
        let tiles = Tiles {
            cfg,
            layout,
            base: *base,
            bars: *bars,
            first: progress.tile,
            shared_tiles: (cluster(cfg) > 1).then_some(block.tiles),
            q: k.add_u32(base, &q_rows),
            s: (0..BKV / 2).map(|_| k.reg(RegClass::F32)).collect(),
            p: (0..BKV / 4).map(|_| k.reg(RegClass::B32)).collect(),
        };
        let turns = Turns::new(k, cfg, &self.c);
        mbarrier_wait(k, &q_full, &q_parity);
        let j = k.mov(RegClass::B32, &0u32);
        let pass = Pass {
            c: self,
            cfg,
            block,
            mask,
            dropping,
            progress,
            seen,
            state,
            tiles,
            turns,
        };
        pass.first_tile(k, &j);
        let top = k.label("tiles");
        let done = k.label("tiles_done");
        k.place(&top);
        let next = k.add_u32(&j, &1u32);
        let past = k.setp("ge.u32", &next, &block.tiles);
        k.bra(Some((past, true)), &done);
        pass.next_tile(k, &j, &next);
        k.emit(format!("mov.u32 {j}, {next}"));
        k.bra(None, &top);
        k.place(&done);
        pass.last_tile(k, &j);
        k.comment("the item's Q buffer is free for a later item");
        mbarrier_arrive(k, &q_empty, Some(self.lane0));
        pass.state
    }

    /// The keys each of the thread's two rows sees: the last (T - 1 without a causal or position
    /// rule) clamped to the keys, and, under a window, the first, from the last as the rule gives
    /// it (a position past the keys sees fewer than the window, a negative one none).
    fn keys_seen(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        keys: Option<&PositionKeys>,
        block: &Block,
    ) -> KeysSeen {
        let (last, given): (Vec<Reg>, Vec<Reg>) = (0..2u32)
            .map(|h| {
                let row = k.add_u32(&self.row, &(8 * h));
                let row = k.add_u32(&row, &block.q0);
                let l = match (cfg.keys, keys) {
                    (KeyRule::Causal { .. }, _) => k.add_u32(&row, &(cfg.kv_len - cfg.q_len)),
                    (_, Some(keys)) => keys.position(k, cfg, &block.b, &row),
                    _ => {
                        let all = k.mov(RegClass::B32, &(cfg.kv_len - 1));
                        return (all, all);
                    }
                };
                (k.op2("min.u32", RegClass::B32, &l, &(cfg.kv_len - 1)), l)
            })
            .unzip();
        let first = cfg
            .keys
            .window()
            .map(|w| given.iter().map(|l| window_start(k, *l, w)).collect());
        KeysSeen { last, first }
    }

    /// Each warpgroup writes the item's key tile `j`'s additive padding mask (0 present, -inf
    /// absent or past the end) into its half of a double-buffered row (alternating over the
    /// block's tiles), then waits for its 128 threads.
    fn stage_mask(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        block: &Block,
        j: &Reg,
        progress: &Progress,
        mask: Reg,
    ) {
        let key0 = block.key0(k, j);
        let key = k.add_u32(&key0, &self.wt);
        let value = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
        let past = k.setp("ge.u32", &key, &cfg.kv_len);
        let absent = k.label("mask_absent");
        k.bra(Some((past, true)), &absent);
        let mi = k.mad_u32(&block.b, &cfg.kv_len, &key);
        let ma = k.address(mask, &mi, 8);
        let present = k.ld_global_i64(ma);
        let keep = k.setp("ne.s64", &present, &0u64);
        k.emit(format!("@{keep} mov.f32 {value}, 0f00000000"));
        k.place(&absent);
        let tile = progress.tile(k, j);
        let addr = self.mask_row(k, &tile);
        let at = k.mad_u32(&self.wt, &4u32, &addr);
        k.emit(format!("st.shared.f32 [{at}], {value}"));
        let id = k.add_u32(&self.c, &MASK_BARRIER);
        k.emit(format!("bar.sync {id}, 128"));
    }

    /// The shared address of this warpgroup's mask row for the block's key tile `tile`.
    fn mask_row(&self, k: &mut Kernel, tile: &Reg) -> Reg {
        let slot = k.op2("and.b32", RegClass::B32, tile, &1u32);
        let which = k.mad_u32(&self.c, &2u32, &slot);
        let start = k.shared_base("attention_mask");
        k.mad_u32(&which, &(BKV * 4), &start)
    }

    fn add_mask(&self, k: &mut Kernel, s: &[Reg], tile: &Reg) {
        k.comment("padding: the tile's additive mask");
        let row = self.mask_row(k, tile);
        let at = k.mad_u32(&self.t2, &4u32, &row);
        for chunk in 0..BKV / 8 {
            let (a, b) = (k.reg(RegClass::F32), k.reg(RegClass::F32));
            k.emit(format!(
                "ld.shared.v2.f32 {{{a}, {b}}}, [{at}+{}]",
                chunk * 32
            ));
            for (r, add) in [a, b, a, b].iter().enumerate() {
                let reg = s[(chunk * 4) as usize + r];
                k.emit(format!("add.f32 {reg}, {reg}, {add}"));
            }
        }
    }

    /// On tiles from `block.edge_from` on, scores of keys past each row's `last` are -inf;
    /// under a window, on tiles before `block.window`'s `clean_from`, those of keys before each
    /// row's `first` too.
    fn mask_edges(
        &self,
        k: &mut Kernel,
        s: &[Reg],
        block: &Block,
        j: &Reg,
        key0: &Reg,
        seen: &KeysSeen,
    ) {
        let interior = k.label("interior_tile");
        let inside = k.setp("lt.u32", j, &block.edge_from);
        k.bra(Some((inside, true)), &interior);
        k.comment("edge tile: keys past each row's last");
        self.mask_columns(k, s, key0, &seen.last, "gt.u32");
        k.place(&interior);
        if let (Some(slide), Some(first)) = (&block.window, &seen.first) {
            let clean = k.label("inside_windows");
            let past = k.setp("ge.u32", j, &slide.clean_from);
            k.bra(Some((past, true)), &clean);
            k.comment("window tile: keys before each row's first");
            self.mask_columns(k, s, key0, first, "lt.u32");
            k.place(&clean);
        }
    }

    /// Scores of the tile from `key0` whose key compares to its row's `bound` by `cmp` are -inf.
    fn mask_columns(&self, k: &mut Kernel, s: &[Reg], key0: &Reg, bound: &[Reg], cmp: &str) {
        let col0 = k.add_u32(key0, &self.t2);
        let neg_inf = F32(f32::NEG_INFINITY).text();
        for chunk in 0..BKV / 8 {
            for c in 0..2u32 {
                let col = k.add_u32(&col0, &(chunk * 8 + c));
                for (h, bound) in bound.iter().enumerate() {
                    let out = k.setp(cmp, &col, bound);
                    let reg = s[(chunk * 4 + h as u32 * 2 + c) as usize];
                    k.emit(format!("@{out} mov.f32 {reg}, {neg_inf}"));
                }
            }
        }
    }

    /// The online softmax of one tile's scores (`first`: the item's first tile): new row
    /// maxima, the correction of O and `l` ([`Rescale`]), and the probabilities in place of the
    /// scores, summed into `l`. While a product still writes O (`in_flight`), O's correction is
    /// returned, to be applied once it is done.
    fn softmax(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        s: &[Reg],
        state: &RowState,
        (first, in_flight): (bool, bool),
    ) -> Correction {
        let scale = cfg.scale * std::f32::consts::LOG2_E;
        let neg_inf = F32(f32::NEG_INFINITY);
        let rescale = Rescale::of(cfg, first);
        let mut m_use = Vec::new();
        let mut factors = Vec::new();
        let mut moved = Vec::new();
        for h in 0..2usize {
            let row = (0..(BKV / 8) as usize)
                .flat_map(|chunk| (0..2).map(move |c| chunk * 4 + h * 2 + c));
            let mut mx = max_tree(k, row.map(|i| s[i]).collect());
            for lanes in [1u32, 2] {
                let other = k.reg(RegClass::F32);
                k.emit(format!("shfl.sync.bfly.b32 {other}, {mx}, {lanes}, 31, -1"));
                mx = k.max_f32(&mx, &other);
            }
            let scaled = k.mul_f32(&mx, &F32(scale));
            let m_new = match rescale {
                Rescale::None => scaled,
                Rescale::Always => k.max_f32(&state.m[h], &scaled),
                Rescale::WhenMoved => {
                    let reach = k.add_f32(&state.m[h], &F32(RESCALE_SLACK));
                    let moves = k.setp("gt.f32", &scaled, &reach);
                    moved.push(moves);
                    k.selp(RegClass::F32, "f32", &scaled, &state.m[h], moves)
                }
            };
            // A row with no visible key so far keeps -inf: exponents are taken against 0.
            let none = k.setp("eq.f32", &m_new, &neg_inf);
            let m_safe = k.selp(RegClass::F32, "f32", &F32(0.0), &m_new, none);
            if rescale != Rescale::None {
                let diff = k.sub_f32(&state.m[h], &m_safe);
                let c = k.op1("ex2.approx.ftz.f32", RegClass::F32, &diff);
                k.emit(format!("mul.f32 {0}, {0}, {c}", state.l[h]));
                factors.push(c);
            }
            k.emit(format!("mov.f32 {}, {m_new}", state.m[h]));
            m_use.push(k.op1("neg.f32", RegClass::F32, &m_safe));
        }
        let any = (rescale == Rescale::WhenMoved).then(|| {
            let either = k.op2("or.pred", RegClass::Pred, &moved[0], &moved[1]);
            let any = k.reg(RegClass::Pred);
            k.emit(format!("vote.sync.any.pred {any}, {either}, -1"));
            any
        });
        let mut correction = Correction { factors, any };
        if !in_flight {
            std::mem::take(&mut correction).apply(k, &state.o);
        }
        for (i, v) in s.iter().enumerate() {
            let h = (i % 4) / 2;
            let e = k.fma_f32(v, &F32(scale), &m_use[h]);
            k.emit(format!("ex2.approx.ftz.f32 {v}, {e}"));
            k.emit(format!("add.f32 {0}, {0}, {v}", state.l[h]));
        }
        correction
    }

    /// This thread's dropout: it draws the Philox blocks of its first row on even `t` and of its
    /// second on odd `t` (`plane = b heads + h`).
    fn dropping(&self, k: &mut Kernel, cfg: &Plan, block: &Block, seed: Reg) -> Dropping {
        let dropout = cfg.dropout.expect("dropout");
        let t = k.op2("and.b32", RegClass::B32, &self.lane, &3u32);
        let odd_bit = k.op2("and.b32", RegClass::B32, &t, &1u32);
        let odd = k.setp("ne.u32", &odd_bit, &0u32);
        let half_t = k.op2("shr.u32", RegClass::B32, &t, &1u32);
        let row = k.mad_u32(&odd_bit, &8u32, &self.row);
        let row = k.add_u32(&row, &block.q0);
        let plane = k.mad_u32(&block.b, &cfg.heads, &block.h);
        let key = philox_key(k, seed);
        // This thread's entry of its warp's table, and the entry of the block its half draws
        // in a tile's first chunk.
        let columns = k.shared_base(COLUMNS);
        let thread = k.mad_u32(&self.c, &128u32, &self.wt);
        let store = k.mad_u32(&thread, &COLUMN_BYTES, &columns);
        let first = k.sub_u32(&thread, &self.lane);
        let first = k.add_u32(&first, &half_t);
        let read = k.mad_u32(&first, &COLUMN_BYTES, &columns);
        Dropping {
            philox: PhiloxRow::new(k, key, dropout.stream, &plane, &row).scheduled(k),
            odd,
            lane: self.lane,
            store,
            read,
            threshold: dropout.threshold,
        }
    }

    /// Rows normalised (zeros for a row that saw no key) and stored as pairs.
    fn store(&self, k: &mut Kernel, cfg: &Plan, block: &Block, state: &RowState, out: Reg) {
        k.comment("epilogue: normalise and store");
        let [ob, oh, orow] = cfg.strides[3];
        let b_off = k.mul_u32(&block.b, &ob);
        let head = k.mad_u32(&block.h, &oh, &b_off);
        for h in 0..2usize {
            let mut l = state.l[h];
            for lanes in [1u32, 2] {
                let other = k.reg(RegClass::F32);
                k.emit(format!("shfl.sync.bfly.b32 {other}, {l}, {lanes}, 31, -1"));
                l = k.add_f32(&l, &other);
            }
            let mut inv = reciprocal_or_zero(k, l);
            if let Some(d) = cfg.dropout {
                inv = k.mul_f32(&inv, &F32(d.keep_scale));
            }
            let row = k.add_u32(&self.row, &(8 * h as u32));
            let row = k.add_u32(&row, &block.q0);
            let inside = k.setp("lt.u32", &row, &cfg.q_len);
            let start = k.mad_u32(&row, &orow, &head);
            let start = k.add_u32(&start, &self.t2);
            for chunk in 0..state.o.len() / 4 {
                let v0 = k.mul_f32(&state.o[chunk * 4 + h * 2], &inv);
                let v1 = k.mul_f32(&state.o[chunk * 4 + h * 2 + 1], &inv);
                let w = k.reg(RegClass::B32);
                k.emit(format!("cvt.rn.{}x2.f32 {w}, {v1}, {v0}", cfg.elem.name()));
                let i = k.add_u32(&start, &(chunk as u32 * 8));
                let addr = k.address(out, &i, 2);
                k.emit(format!("@{inside} st.global.b32 [{addr}], {w}"));
            }
        }
    }
}

/// A stream grid's split items ([`Grid::Stream`]): each part leaves its consumer threads' state
/// ([`part_values`]: O, then the rows' maxima and sums, register by register, the warpgroup's
/// 128 threads side by side) in its half of the slot's `partials`, and counts itself done on
/// the slot's counter of its consumer (zero before the launch); the later of the two to finish
/// merges the other's state into its own, the item's first part always first, so that the
/// result does not depend on which finished later, sets the counter back to zero and stores.
struct StreamSplit {
    /// The parts' state: `[slot][part][consumer][value][thread]` f32.
    partials: Reg,
    /// A u32 per slot and consumer.
    counters: Reg,
    /// Shared: each consumer's answer, whether its part finished the item.
    flags: String,
}

impl Consumer {
    /// Stores the item `block` whole, or its part's share of it ([`StreamSplit`]).
    fn finish_part(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        (block, part): (&Block, &Part),
        state: &RowState,
        (split, out): (&StreamSplit, Reg),
    ) {
        let whole = k.label("whole_item");
        let stored = k.label("part_stored");
        k.bra(Some((part.whole, true)), &whole);
        let last = self.merge_parts(k, cfg, part, state, split);
        k.bra(Some((last, false)), &stored);
        k.place(&whole);
        self.store(k, cfg, block, state, out);
        k.place(&stored);
    }

    /// Leaves this part's state in its partials and counts it done; returns whether it finished
    /// the item, `state` then the item's (both parts' merged).
    fn merge_parts(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        part: &Part,
        state: &RowState,
        split: &StreamSplit,
    ) -> Reg {
        k.comment("a split item: this part's state into the partials; the later part merges both");
        let values: Vec<Reg> = state
            .o
            .iter()
            .chain(&state.m)
            .chain(&state.l)
            .copied()
            .collect();
        let mine = k.selp(RegClass::B32, "u32", &1u32, &0u32, part.later);
        let at = self.part_slot(k, cfg, (part, split), &mine);
        crate::reduce::store_side_by_side(k, &at, &values);
        let counter = k.mad_u32(&part.slot, &consumers(cfg), &self.c);
        let counter = k.address(split.counters, &counter, 4);
        let leader = k.setp("eq.u32", &self.wt, &0u32);
        let flag = k.shared_base(&split.flags);
        let flag = k.mad_u32(&self.c, &4u32, &flag);
        let barrier = k.add_u32(&self.c, &MASK_BARRIER);
        let last = crate::reduce::last_arrival(
            k,
            [counter, leader],
            &2u32,
            &format!("bar.sync {barrier}, 128"),
            &flag.to_string(),
        );
        let merged = k.label("parts_merged");
        k.bra(Some((last, false)), &merged);
        let theirs = k.op2("xor.b32", RegClass::B32, &mine, &1u32);
        let other = self.part_slot(k, cfg, (part, split), &theirs);
        merge_other(k, state, &other, part.later);
        k.place(&merged);
        last
    }

    /// This thread's first value in part `which` (0 the item's first, 1 its later) of the
    /// slot's partials: `[slot][part][consumer][value][thread]`.
    fn part_slot(
        &self,
        k: &mut Kernel,
        cfg: &Plan,
        (part, split): (&Part, &StreamSplit),
        which: &Reg,
    ) -> Reg {
        let index = k.mad_u32(&part.slot, &2u32, which);
        let index = k.mad_u32(&index, &consumers(cfg), &self.c);
        let first = k.mul_u32(&index, &(part_values(cfg) * 128));
        let first = k.add_u32(&first, &self.wt);
        k.address(split.partials, &first, 4)
    }
}

/// Merges the other part's state, stored from `other` on, into this thread's `state` (this
/// thread holds the later part where `later`).
fn merge_other(k: &mut Kernel, state: &RowState, other: &Reg, later: Reg) {
    let load = |k: &mut Kernel, i: usize| crate::reduce::load_side_by_side(k, other, i as u32);
    let n = state.o.len();
    let rows: Vec<Reg> = (n..n + 4).map(|i| load(k, i)).collect();
    let factors = merge_rows(k, state, &rows, later);
    for (c, chunk) in state.o.chunks(MERGED_AT_ONCE).enumerate() {
        let first = c * MERGED_AT_ONCE;
        let loaded: Vec<Reg> = (first..first + chunk.len()).map(|i| load(k, i)).collect();
        for (i, (o, theirs)) in (first..).zip(chunk.iter().zip(&loaded)) {
            // Accumulator 4 chunk + 2 h + c belongs to row h.
            merge_value(k, *o, theirs, factors[i % 4 / 2], later);
        }
    }
}

/// O accumulators a merging thread loads from the other part at once (bounds the registers the
/// loads in flight take).
const MERGED_AT_ONCE: usize = 16;

/// The first part's and the later part's values of `own` and `theirs` (this thread holds the
/// later part where `later`).
fn in_order(k: &mut Kernel, own: &Reg, theirs: &Reg, later: Reg) -> (Reg, Reg) {
    let first = k.selp(RegClass::F32, "f32", theirs, own, later);
    let second = k.selp(RegClass::F32, "f32", own, theirs, later);
    (first, second)
}

/// Merges the other part's rows' maxima and sums (`theirs`: m0, m1, l0, l1) into `state`'s, and
/// returns each row's factors for the first and the later part's O (a row that saw no key in
/// either keeps -inf and a zero sum).
fn merge_rows(k: &mut Kernel, state: &RowState, theirs: &[Reg], later: Reg) -> [(Reg, Reg); 2] {
    let neg_inf = F32(f32::NEG_INFINITY);
    [0, 1].map(|h| {
        let (m_first, m_second) = in_order(k, &state.m[h], &theirs[h], later);
        let m = k.max_f32(&m_first, &m_second);
        let none = k.setp("eq.f32", &m, &neg_inf);
        let safe = k.selp(RegClass::F32, "f32", &F32(0.0), &m, none);
        let factor = |k: &mut Kernel, m_part: &Reg| {
            let diff = k.sub_f32(m_part, &safe);
            k.op1("ex2.approx.ftz.f32", RegClass::F32, &diff)
        };
        let factors = (factor(k, &m_first), factor(k, &m_second));
        k.set(state.m[h], &m);
        let l = state.l[h];
        merge_value(k, l, &theirs[2 + h], factors, later);
        factors
    })
}

/// `own = first * factors.0 + second * factors.1`, the two parts' values of `own` and `theirs`
/// in order.
fn merge_value(
    k: &mut Kernel,
    own: Reg,
    theirs: &Reg,
    (f_first, f_second): (Reg, Reg),
    later: Reg,
) {
    let (first, second) = in_order(k, &own, theirs, later);
    let scaled = k.mul_f32(&second, &f_second);
    k.emit(format!("fma.rn.f32 {own}, {first}, {f_first}, {scaled}"));
}

/// A tile's correction of O: each of the thread's two rows' factor (none on an item's first
/// tile) and, under [`Rescale::WhenMoved`], whether any row of the warp moved (every factor 1
/// otherwise); the default corrects nothing.
#[derive(Default)]
struct Correction {
    factors: Vec<Reg>,
    any: Option<Reg>,
}

impl Correction {
    /// Multiplies each row of `o` by its factor; skipped by the whole warp when no row moved.
    fn apply(&self, k: &mut Kernel, o: &[Reg]) {
        let kept = self.any.map(|any| {
            let kept = k.label("o_kept");
            k.bra(Some((any, false)), &kept);
            kept
        });
        for (h, c) in self.factors.iter().enumerate() {
            for chunk in 0..o.len() / 4 {
                for i in 0..2 {
                    let o = o[chunk * 4 + h * 2 + i];
                    k.emit(format!("mul.f32 {o}, {o}, {c}"));
                }
            }
        }
        if let Some(kept) = kept {
            k.place(&kept);
        }
    }
}

/// A consumer thread's dropout state (see the module comment). A key tile's 32 column blocks
/// are the same for every row: lane `b` of each warp draws block `b`'s column words
/// ([`PhiloxRow::column`]) into its warp's table of 32 entries, and each thread's row blocks
/// read them from there.
struct Dropping {
    /// The Philox blocks of the row this thread draws for.
    philox: PhiloxRow,
    /// Odd `t`: this thread draws for its second row, and holds columns 2 and 3 of each block.
    odd: Reg,
    /// The thread's lane: the key tile's block whose column words it draws.
    lane: Reg,
    /// The shared address of this lane's entry in its warp's table.
    store: Reg,
    /// The entry of block `t / 2`, this thread's within each tile's first 8-column chunk.
    read: Reg,
    threshold: u32,
}

impl Dropping {
    /// Zeroes the dropped probabilities of key tile `key0` (a multiple of 4); element
    /// `s[4 chunk + 2 h + c]` is row `h`'s column `key0 + 8 chunk + 2 t + c`.
    fn drop(&self, k: &mut Kernel, s: &[Reg], key0: &Reg) {
        k.comment("dropout: one Philox block per quad pair, row and 4 columns, halves swapped");
        let block0 = k.op2("shr.u32", RegClass::B32, key0, &2u32);
        let mine = k.add_u32(&block0, &self.lane);
        let column = self.philox.column(k, &mine);
        // Every lane has read the last tile's table before any overwrites it.
        k.emit("bar.warp.sync -1");
        k.st_shared_words(self.store, &column);
        k.emit("bar.warp.sync -1");
        let chunks: Vec<u32> = (0..BKV / 8).collect();
        for group in chunks.chunks(DRAW_GROUP) {
            let columns: Vec<[Reg; 4]> = group
                .iter()
                .map(|&chunk| {
                    // Chunk `chunk`'s block is entry `t / 2 + 2 chunk`.
                    let at = k.add_u32(&self.read, &(2 * chunk * COLUMN_BYTES));
                    k.ld_shared_words(at)
                })
                .collect();
            let words = self.philox.words_of_columns(k, &columns);
            for (&chunk, w) in group.iter().zip(&words) {
                self.keep(k, s, chunk, w);
            }
        }
    }

    /// Zeroes the dropped probabilities of 8-column chunk `chunk`, whose block's words (this
    /// thread's row's) are `w`.
    fn keep(&self, k: &mut Kernel, s: &[Reg], chunk: u32, w: &[Reg; 4]) {
        for c in 0..2usize {
            // Even t keeps words 0, 1 of its first row and sends 2, 3; odd t the reverse
            // for its second row.
            let send = k.selp(RegClass::B32, "b32", &w[c], &w[2 + c], self.odd);
            let got = k.reg(RegClass::B32);
            k.emit(format!("shfl.sync.bfly.b32 {got}, {send}, 1, 31, -1"));
            let first = k.selp(RegClass::B32, "b32", &got, &w[c], self.odd);
            let second = k.selp(RegClass::B32, "b32", &w[2 + c], &got, self.odd);
            for (h, word) in [first, second].iter().enumerate() {
                let keep = k.setp("ge.u32", word, &self.threshold);
                let reg = s[chunk as usize * 4 + h * 2 + c];
                k.emit(format!("@!{keep} mov.f32 {reg}, 0f00000000"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(batch: u32, heads: u32, kv_heads: u32, len: u32, causal: bool) -> AttentionConfig {
        let mut cfg = AttentionConfig::plain([batch, heads, kv_heads, len, len, 64], Elem::BF16);
        if causal {
            cfg.keys = KeyRule::Causal { window: None };
        }
        cfg
    }

    fn persistent(cfg: &AttentionConfig) -> bool {
        Shape::of(cfg).grid == Grid::Persistent
    }

    fn consumers(cfg: &AttentionConfig) -> u32 {
        Shape::of(cfg).consumers
    }

    #[test]
    fn many_items_of_few_key_tiles_take_a_persistent_grid() {
        // BERT-base at 128 x 128 tokens: 1536 items of one key tile.
        assert!(persistent(&config(128, 12, 12, 128, false)));
        // 256 keys (two tiles), 16 sequences: 192 items.
        assert!(persistent(&config(16, 12, 12, 256, true)));
    }

    #[test]
    fn long_keys_or_few_items_take_a_block_each() {
        // GPT-2 at 1024 tokens and Llama-3.2-1B at 4096 (measured 5% slower persistent).
        assert!(!persistent(&config(1, 12, 12, 1024, true)));
        assert!(!persistent(&config(1, 32, 8, 4096, true)));
        // Short keys but no more items than blocks: nothing to load under.
        assert!(!persistent(&config(1, 12, 12, 128, false)));
    }

    #[test]
    fn items_run_in_groups_of_heads_whose_keys_and_values_share_the_l2() {
        // 2 MB of K/V a head at 4096 keys and d 128: 8 of 16 heads x 4 sequences a group.
        let mut cfg = config(4, 16, 16, 4096, true);
        cfg.head_dim = 128;
        assert_eq!(group_planes(&cfg), 8);
        // d 64, GQA 4:1: 1 MB a K/V head, 16 of them, 64 query heads: every plane of Llama-3.2-1B.
        assert_eq!(group_planes(&config(1, 32, 8, 4096, true)), 32);
        assert_eq!(group_planes(&config(4, 32, 8, 4096, true)), 64);
        // Whole query groups even when one K/V head alone passes the share.
        let mut cfg = config(2, 28, 4, 65536, true);
        cfg.head_dim = 128;
        assert_eq!(group_planes(&cfg), 7);
        // Short keys: 32 KB a head, 512 of BERT-base's 1536 planes at 128 x 128 tokens; GPT-2
        // small at 1024 tokens, every plane.
        assert_eq!(group_planes(&config(128, 12, 12, 128, false)), 512);
        assert_eq!(group_planes(&config(1, 12, 12, 1024, true)), 12);
    }

    #[test]
    fn sliding_windows_take_the_hopper_kernel() {
        // Mistral-7B's 4096-key window over 8192 tokens, and a prompt chunk over its cache.
        let mut cfg = config(1, 32, 8, 8192, true);
        cfg.head_dim = 128;
        cfg.keys = KeyRule::Causal { window: Some(4096) };
        assert!(supports(&cfg));
        let ptx = attention_wgmma(&cfg, "w".into()).module();
        assert!(ptx.contains("window tile: keys before each row's first"));
        cfg.q_len = 512;
        cfg.keys = KeyRule::Position { window: Some(4096) };
        assert!(supports(&cfg));
        // Near misses: a window of no key; one decode row (the decode kernel's).
        cfg.keys = KeyRule::Position { window: Some(0) };
        assert!(!supports(&cfg));
        cfg.keys = KeyRule::Causal { window: Some(0) };
        assert!(!supports(&cfg));
        cfg.q_len = 1;
        cfg.keys = KeyRule::Position { window: Some(16) };
        assert!(!supports(&cfg));
        // Without a window the kernel masks no tile's first keys.
        let plain = config(1, 32, 8, 8192, true);
        let ptx = attention_wgmma(&plain, "w".into()).module();
        assert!(!ptx.contains("window tile"));
    }

    #[test]
    fn three_consumers_take_head_dim_64_where_blocks_of_192_rows_pad_little() {
        // H200: d 64 at 4096 rows, 0.6447 -> 0.5679 ms (16 heads x 4) and 0.1714 -> 0.1646
        // (Llama-3.2-1B's 32 / 8 heads, causal) with three; at 1024 rows (12.5% more padded)
        // 0.0135 -> 0.0172, at 128 rows 0.0370 -> 0.0487, a 1024-row chunk over a cache 70 ->
        // 94 us.
        for (len, want) in [
            (4096, 3),
            (384, 3),
            (260, 3),
            (2048, 3),
            (1024, 2),
            (128, 2),
        ] {
            assert_eq!(consumers(&config(1, 32, 8, len, true)), want, "{len} rows");
        }
        let mut cfg = config(1, 32, 8, 4096, true);
        cfg.dropout = Some(crate::attention::Dropout::new(0.1, 0));
        assert_eq!(consumers(&cfg), 2);
        cfg.dropout = None;
        cfg.head_dim = 128;
        assert_eq!(consumers(&cfg), 2);
    }

    #[test]
    fn shapes_fit_where_shared_memory_holds_their_buffers_and_stages() {
        let mut d128 = config(4, 16, 16, 4096, false);
        d128.head_dim = 128;
        let shape = |consumers, q_buffers, k_stages, v_stages| Shape {
            consumers,
            q_buffers,
            k_stages,
            v_stages,
            grid: Grid::Items,
        };
        // Head dim 128, 32 KB a K or V tile: two Q buffers, three K stages and two V stages
        // take 224 KB of tiles, which fit only without a padding mask's rows, as do one Q buffer
        // and three stages of each; two Q buffers and three of each (256 KB) never.
        assert!(shape(2, 2, 3, 2).fits(&d128) && shape(2, 1, 3, 3).fits(&d128));
        assert!(!shape(2, 2, 3, 3).fits(&d128) && !shape(2, 2, 4, 2).fits(&d128));
        let masked = AttentionConfig {
            padding: true,
            ..d128.clone()
        };
        assert!(!shape(2, 2, 3, 2).fits(&masked) && !shape(2, 1, 3, 3).fits(&masked));
        assert!(shape(2, 2, 2, 2).fits(&masked) && shape(2, 1, 3, 2).fits(&masked));
        // Three consumers at head dim 64 (16 KB tiles) up to four stages of each; not at 128,
        // nor with dropout.
        let d64 = config(4, 16, 16, 4096, false);
        assert!(shape(3, 2, 4, 4).fits(&d64));
        assert!(!shape(3, 1, 2, 2).fits(&d128));
        let dropout = AttentionConfig {
            dropout: Some(crate::attention::Dropout::new(0.1, 0)),
            ..d64.clone()
        };
        assert!(!shape(3, 2, 2, 2).fits(&dropout) && shape(2, 2, 2, 2).fits(&dropout));
        // Near misses: one consumer, four, no Q buffer, one stage, five.
        for bad in [
            shape(1, 2, 2, 2),
            shape(4, 1, 2, 2),
            shape(2, 0, 2, 2),
            shape(2, 2, 1, 2),
            shape(2, 2, 2, 5),
        ] {
            assert!(!bad.fits(&d64), "{bad:?}");
        }
        // The picked shape is in the space, for every configuration.
        for cfg in [d128, masked, d64, dropout, config(128, 12, 12, 128, false)] {
            let picked = Shape::of(&cfg);
            assert!(picked.fits(&cfg));
            assert!(Shape::space(&cfg).contains(&picked), "{picked:?}");
        }
        // The kernel's shared memory is what `fits` counts: tiles, alignment, barriers.
        let cfg = config(4, 16, 16, 4096, true);
        let plan = Plan {
            cfg: &cfg,
            shape: shape(3, 1, 3, 2),
        };
        let kernel = attention_wgmma_shaped(&cfg, plan.shape, "s".into());
        let barriers = 2 * (1 + 3 + 2) * MBARRIER_BYTES;
        assert_eq!(kernel.launch.shared_bytes + barriers, shared_bytes(&plan));
        assert_eq!(kernel.launch.shared_bytes, (192 + 5 * 128) * 128 + 1024);
    }

    #[test]
    fn an_items_first_tile_rescales_nothing_and_head_dim_128_waits_for_a_moved_maximum() {
        let d64 = config(4, 16, 16, 4096, false);
        let mut d128 = d64.clone();
        d128.head_dim = 128;
        assert_eq!(Rescale::of(&d64, true), Rescale::None);
        assert_eq!(Rescale::of(&d128, true), Rescale::None);
        assert_eq!(Rescale::of(&d64, false), Rescale::Always);
        assert_eq!(Rescale::of(&d128, false), Rescale::WhenMoved);
        // The kernels: a vote on moved maxima at head dim 128 only, in the loop's tiles.
        let votes = |cfg: &AttentionConfig| {
            let ptx = attention_wgmma(cfg, "t".into()).ptx;
            ptx.matches("vote.sync.any.pred").count()
        };
        assert_eq!(votes(&d64), 0);
        assert_eq!(votes(&d128), 1, "one vote, in the loop's tiles");
    }

    #[test]
    fn a_row_maximum_is_a_tree_of_pairs() {
        for n in [1usize, 2, 5, 16, 32] {
            let mut k = Kernel::new("t");
            let values: Vec<Reg> = (0..n).map(|_| k.reg(RegClass::F32)).collect();
            let top = max_tree(&mut k, values.clone());
            // Each register's depth in maxima: the values 0, a maximum one more than its deeper
            // operand.
            let mut depth: std::collections::HashMap<String, u32> =
                values.iter().map(|v| (v.to_string(), 0)).collect();
            let text = k.finish();
            for line in text
                .lines()
                .filter(|l| l.trim_start().starts_with("max.f32"))
            {
                let regs: Vec<&str> = line.trim()[8..].trim_end_matches(';').split(", ").collect();
                let d = 1 + depth[regs[1]].max(depth[regs[2]]);
                depth.insert(regs[0].to_string(), d);
            }
            assert_eq!(depth.len(), 2 * n - 1, "{n} values take {} maxima", n - 1);
            assert_eq!(
                depth[&top.to_string()],
                n.next_power_of_two().trailing_zeros()
            );
        }
    }

    #[test]
    fn consumers_share_the_registers_the_producer_gives_up() {
        let d64 = config(1, 32, 8, 4096, true);
        let mut d128 = d64.clone();
        d128.head_dim = 128;
        // 168 registers a thread at launch with two consumers: 24 for the producer, 240 (the
        // most) for each consumer; 128 with three: 32 and 160.
        let plan = |cfg| Plan {
            cfg,
            shape: Shape::of(cfg),
        };
        let (d64, d128) = (plan(&d64), plan(&d128));
        let regs = |c: &Plan| (launch_regs(c), producer_regs(c), consumer_regs(c));
        assert_eq!((regs(&d128), threads(&d128)), ((168, 24, 240), 384));
        assert_eq!((regs(&d64), threads(&d64)), ((128, 32, 160), 512));
        for cfg in [d64, d128] {
            // `setmaxnreg` moves registers the block holds; it cannot add any.
            let after = 128 * (producer_regs(&cfg) + consumers(&cfg) * consumer_regs(&cfg));
            assert!(after <= launch_regs(&cfg) * threads(&cfg));
            assert!(producer_regs(&cfg) >= MIN_PRODUCER_REGS);
        }
    }

    #[test]
    fn head_dim_64_runs_its_softmax_under_its_own_products() {
        let d64 = config(4, 16, 16, 4096, false);
        let d128 = AttentionConfig {
            head_dim: 128,
            ..d64.clone()
        };
        let dropout = AttentionConfig {
            dropout: Some(crate::attention::Dropout::new(0.1, 0)),
            ..d64.clone()
        };
        assert!(under_own_products(&d64));
        assert!(!under_own_products(&d128) && !under_own_products(&dropout));
        // The softmax waits for the scores' group alone only where the rule says so.
        let waits_for_scores = |cfg: &AttentionConfig| {
            let kernel = attention_wgmma(cfg, "a".into());
            kernel.ptx.contains("wgmma.wait_group.sync.aligned 1;")
        };
        assert!(waits_for_scores(&d64));
        assert!(!waits_for_scores(&d128) && !waits_for_scores(&dropout));
    }

    #[test]
    fn pairs_share_the_tiles_of_every_key_at_head_dim_128() {
        let mut cfg = config(4, 16, 16, 4096, false);
        cfg.head_dim = 128;
        let pairs = Shape {
            grid: Grid::Pairs,
            ..Shape::two_deep(2)
        };
        let padded = AttentionConfig {
            padding: true,
            dropout: Some(crate::attention::Dropout::new(0.1, 0)),
            ..cfg.clone()
        };
        assert!(pairs.fits(&cfg) && pairs.fits(&padded));
        assert!(Shape::space(&cfg).contains(&pairs));
        // Near misses: keys that differ from block to block, a paged cache, head dim 64 (one
        // column block, nothing to share out).
        let causal = AttentionConfig {
            keys: KeyRule::Causal { window: None },
            ..cfg.clone()
        };
        let windowed = AttentionConfig {
            keys: KeyRule::Causal { window: Some(512) },
            ..cfg.clone()
        };
        let chunk = AttentionConfig {
            keys: KeyRule::Position { window: None },
            ..cfg.clone()
        };
        let mut paged = chunk.clone();
        paged.take_paging(crate::paging::Paging {
            block: 16,
            entries: 256,
            blocks: 1025,
        });
        let d64 = config(4, 16, 16, 4096, false);
        for near in [causal, windowed, chunk, paged, d64] {
            assert!(!pairs.fits(&near), "{:?}", near.keys);
        }
        // Clusters of two over whole pairs of query blocks: 300 rows take two pairs of 128.
        cfg.q_len = 300;
        let kernel = attention_wgmma_shaped(&cfg, pairs, "p".into());
        assert_eq!(kernel.launch.grid, [4 * 4 * 16, 1, 1]);
        assert_eq!(kernel.cluster, 2);
        let ptx = kernel.module();
        for needed in [
            ".reqnctapercluster 2, 1, 1",
            "barrier.cluster.wait.acquire",
            ".multicast::cluster",
            "mbarrier.arrive.shared::cluster.b64",
        ] {
            assert!(ptx.contains(needed), "{needed}");
        }
        // Each block copies one of a tile's two column blocks of K and one of V.
        assert_eq!(ptx.matches(".multicast::cluster").count(), 4);
        let alone = attention_wgmma_shaped(&cfg, Shape::two_deep(2), "a".into());
        assert_eq!(alone.cluster, 1);
        let alone = alone.module();
        assert!(!alone.contains("cluster_ctarank") && !alone.contains("multicast"));
    }

    #[test]
    fn items_over_every_key_share_out_their_last_waves_key_tiles_on_a_stream_grid() {
        // 4 x 16 heads at head dim 128 over 4096 keys: 2048 items of 32 key tiles, 14 waves
        // whole, then the last 200 items' 6400 tiles, 48 or 49 a block.
        let mut d128 = config(4, 16, 16, 4096, false);
        d128.head_dim = 128;
        let shape = Shape::of(&d128);
        assert_eq!(shape.grid, Grid::Stream);
        let plan = Plan { cfg: &d128, shape };
        let work = StreamWork::of(&plan);
        let want = StreamWork {
            whole: 1848,
            tiles: 32,
            units: 6400,
        };
        assert_eq!(work, want);
        // On any grid of at most GRID blocks, the ranges as the kernel cuts them cover the
        // tiles once, each at least an item's: no item has more than two parts.
        for blocks in 1..=GRID {
            let (per, longer) = (work.units / blocks, work.units % blocks);
            let mut next = 0;
            for b in 0..blocks {
                let start = b * per + b.min(longer);
                let end = start + per + u32::from(b < longer);
                assert_eq!(start, next);
                assert!(end - start >= work.tiles, "{blocks} blocks");
                next = end;
            }
            assert_eq!(next, work.units);
        }
        // Fewer items than two waves (10 heads x 2 sequences x 8 query blocks): none whole.
        let mut few = config(2, 10, 5, 1000, false);
        few.head_dim = 128;
        let plan = Plan {
            cfg: &few,
            shape: Shape::of(&few),
        };
        assert_eq!(StreamWork::of(&plan).whole, 0);
        // The kernel: one block an SM, the split items' partials and counters.
        let kernel = attention_wgmma(&d128, "s".into());
        assert_eq!(kernel.launch.grid, [GRID, 1, 1]);
        let params: Vec<&str> = kernel.signature.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(params, ["q", "k", "v", "out", "partials", "counters"]);
        // The partials and counters are the kernel's scratch, not operands of the node.
        assert_eq!(kernel.scratch, ["partials", "counters"]);
        let operands: Vec<&str> = kernel.operand_params().collect();
        assert_eq!(operands, ["q", "k", "v", "out"]);
        assert_eq!(scratch(&d128), (131 * 2 * 2 * 68 * 128 * 4, 131 * 2 * 4));
        let ptx = kernel.module();
        assert_eq!(ptx.matches("atom.acq_rel.gpu.global.add.u32").count(), 1);
        assert!(ptx.contains("a split item: this part's state into the partials"));
    }

    #[test]
    fn grids_follow_the_items_key_tiles_and_key_rule() {
        let grid = |cfg: &AttentionConfig| Shape::of(cfg).grid;
        // Every key, more items than blocks: persistent (BERT-base at 128 x 128 and 32 x 512
        // tokens, 31 key tiles), a stream from 32 key tiles.
        assert_eq!(grid(&config(128, 12, 12, 128, false)), Grid::Persistent);
        assert_eq!(grid(&config(32, 12, 12, 512, false)), Grid::Persistent);
        assert_eq!(grid(&config(4, 16, 16, 31 * 128, false)), Grid::Persistent);
        assert_eq!(grid(&config(4, 16, 16, 32 * 128, false)), Grid::Stream);
        // Causal items of more than two tiles, and few items, one a block.
        assert_eq!(grid(&config(16, 12, 12, 1024, true)), Grid::Items);
        assert_eq!(grid(&config(16, 12, 12, 256, true)), Grid::Persistent);
        assert_eq!(grid(&config(1, 2, 2, 8192, false)), Grid::Items);
    }

    #[test]
    fn a_stream_grid_needs_equal_items_more_than_the_grid_has_blocks() {
        let mut d128 = config(4, 16, 16, 4096, false);
        d128.head_dim = 128;
        let stream = Shape {
            grid: Grid::Stream,
            ..Shape::two_deep(2)
        };
        assert!(stream.fits(&d128));
        // Near misses: keys that differ from item to item (causal, a window, a chunk over a
        // cache), one key tile, fewer items than blocks.
        let causal = AttentionConfig {
            keys: KeyRule::Causal { window: None },
            ..d128.clone()
        };
        let windowed = AttentionConfig {
            keys: KeyRule::Causal { window: Some(512) },
            ..d128.clone()
        };
        let chunk = AttentionConfig {
            keys: KeyRule::Position { window: None },
            ..d128.clone()
        };
        let one_tile = config(128, 12, 12, 128, false);
        let few = config(1, 4, 4, 4096, false);
        for near in [&causal, &windowed, &chunk, &one_tile, &few] {
            assert!(!stream.fits(near), "{near:?}");
            assert_ne!(Shape::of(near).grid, Grid::Stream);
            assert_eq!(scratch(near), (0, 0));
            let kernel = attention_wgmma(near, "n".into());
            assert!(kernel.scratch.is_empty());
            assert!(kernel
                .signature
                .iter()
                .all(|(p, _)| p != "partials" && p != "counters"));
        }
    }

    #[test]
    fn a_persistent_grid_has_at_most_one_block_per_sm() {
        let cfg = config(128, 12, 12, 128, false);
        let kernel = attention_wgmma(&cfg, "a".into());
        assert_eq!(kernel.launch.grid, [GRID, 1, 1]);
        let items = Shape {
            grid: Grid::Items,
            ..Shape::of(&cfg)
        };
        let single = attention_wgmma_shaped(&cfg, items, "b".into());
        assert_eq!(single.launch.grid, [128 * 12, 1, 1]);
    }
}
