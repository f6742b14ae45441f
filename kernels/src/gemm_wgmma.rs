//! The Hopper GEMM (sm_90a) for f16 / bf16 with weights stored `[N, K]`: warp-specialised, TMA
//! feeding `wgmma.mma_async` through an mbarrier pipeline.
//!
//! The grid is persistent (at most one block per SM of an H100/H200, each taking every
//! `gridDim`-th tile), and each block of three warpgroups computes 128-row output tiles 256, 192,
//! 128 or 64 weight rows wide (half as many output columns with SwiGLU): the widest unless a
//! narrower one spreads a product of few tiles over more SMs, or the consumers take turns
//! ([`tiling`]):
//! - warpgroup 0, the producer, gives up registers (`setmaxnreg`) and one of its threads copies
//!   the x and w tiles of each 64-wide K step into a stage of shared memory with TMA (128-byte
//!   swizzle, zeros past the matrix edges), up to `STAGES` deep: it waits on the stage's `empty`
//!   barrier, then arms its `full` barrier with the stage's bytes;
//! - warpgroups 1 and 2, the consumers, take the registers and each multiplies 64 rows of the
//!   tile: per stage, four `m64nWk16` wgmmas (W the tile's width) straight from shared memory,
//!   one group kept in flight while the next stage is awaited; a stage is released (each warp
//!   arrives on `empty`) once the group that read it has retired. The epilogue (bias,
//!   activation, SwiGLU, residual) runs on the accumulators; staged (`Tiling::staged`, wherever
//!   output rows are 16-byte multiples and tiles whole 64-column boxes), each consumer writes its
//!   finished rows into its region of shared memory with `stmatrix` (128-byte swizzle, so that
//!   the rows' writes fall in distinct banks) and one of its threads copies them out with TMA
//!   stores, which run on under the next tile's products; otherwise every thread stores its
//!   element pairs, without branches (predicated stores, clamped loads) so that its loads are
//!   all in flight at once. Meanwhile the producer already fills the stages with the block's
//!   next tile (a staged 256-wide tile without SwiGLU leaves room for three stages).
//!
//! With SwiGLU the B stage holds W/2 gate rows and the matching W/2 up rows (`[gate; up]` weight
//! rows), so a thread's accumulators for gate column `c` and up column `c` are W/4 registers apart.
//! Tiles are visited in groups of 8 tile rows, so that a wave of blocks shares its weight tiles
//! in L2.
//!
//! Where even the narrowest tiles leave most SMs idle (a decode step's products of 32-64 rows),
//! K is split in parts (`Tiling::splits`), each part of a tile a work item of its own, adjacent
//! in the grid: a consumer stores its part's f32 sums in the `partials` scratch (register by
//! register, the warpgroup's threads side by side) and counts the part done on its tile's
//! counter (`counters`, zero before the launch); the consumer of the tile's last part to finish
//! adds every part's sums in part order, so the result does not depend on which part that is,
//! sets the counter back to zero and runs the epilogue. A consumer whose 64 rows are all past M
//! neither stores nor adds.

use crate::gemm::{apply, Addends, EpiloguePtrs, GemmConfig, RowNorm};
use crate::hopper::{
    aligned_base, bulk_commit, bulk_wait, bulk_wait_when, fence_proxy_async, for_each_block_item,
    mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_arrive_expect_tx_when, mbarrier_init,
    mbarrier_init_fence, mbarrier_wait, prefetch_tensor_map, setmaxnreg, stmatrix_x4, tma_load,
    tma_load_when, tma_store, wait_released, wgmma, wgmma_commit, wgmma_descriptor, wgmma_fence,
    wgmma_wait, WarpgroupThread, WgmmaA, WgmmaB, MAX_SHARED, MBARRIER_BYTES,
};
use crate::ptx::{Elem, Kernel, Label, Reg, RegClass, F32};
use crate::{GeneratedKernel, Image, KernelPath, Launch, TensorMapSpec};

/// Output rows per block (64 per consumer warpgroup).
const BM: u32 = 128;
/// How a block's consumer warpgroups share its tiles, how wide the tiles are, and in how many
/// parts their K is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Weight rows per stage: output columns, or half gate and half up rows with SwiGLU.
    pub width: u32,
    /// Each consumer multiplies whole tiles (all 128 rows), the two taking turns, so that one's
    /// epilogue runs while the other multiplies; otherwise both multiply every tile, 64 rows
    /// each, and finish it together.
    pub ping_pong: bool,
    /// Parts of K, each a work item of its own (consumers together only): each item leaves its
    /// partial sums in the `partials` scratch, and the last of a tile's items to finish (counted
    /// on `counters`) adds them up in split order, so the result does not depend on which one
    /// that is, and runs the epilogue. 1: no split.
    pub splits: u32,
    /// The epilogue writes each consumer's finished tile into shared memory (`stmatrix`) and
    /// one thread copies it out with TMA stores, instead of every thread storing its pairs
    /// ([`staged_fits`]).
    pub staged: bool,
}

/// The tilings the kernel comes in, each with its speed per K step relative to the widest in
/// percent (a narrower tile loads x's rows for fewer columns): the staged ones first, taken
/// wherever they fit (their epilogue costs the least), then the same widths storing from
/// registers and the ping-pong one for the products they do not fit (output rows that are not
/// 16-byte multiples, such as GPT-2's vocabulary, SwiGLU tiles of 96 or 32 columns). The together tilings' speeds are set below the H200's (BENCHMARKS.md,
/// 2026-12-02: 93-101% at 128, 55-89% at 64), so that a narrower tile is taken only where it
/// also fills more SMs; the ping-pong one's is the 93% measured on products of many tiles. 192
/// wide fills the SMs where 256 leaves a quarter idle and 128 takes two rounds (1024 rows of
/// Llama-3.2-1B's QKV, 3072 columns: 96, 128 and 192 tiles).
pub const TILINGS: [(Tiling, u64); 9] = [
    (Tiling::together(256).staged(), 100),
    (Tiling::together(192).staged(), 90),
    (Tiling::together(128).staged(), 80),
    (Tiling::together(64).staged(), 60),
    (Tiling::together(256), 100),
    (Tiling::together(192), 90),
    (Tiling::together(128), 80),
    (Tiling::together(64), 60),
    (Tiling::ping_pong(128), 93),
];

/// The most parts [`tiling`] splits K into.
pub const MAX_SPLITS: u32 = 16;
/// The fewest K steps of a split part.
const MIN_SPLIT_STEPS: u32 = 2;
/// The widest tiles that split K: at 256 wide a consumer thread's 128 accumulators leave too few
/// registers to add the parts' sums without spilling (and on the H200 no product measured
/// faster split 256 wide than 128 wide).
const SPLIT_WIDEST: u32 = 128;
/// A split is for the SMs an unsplit tiling leaves idle: [`tiling`] takes one only where its
/// parts are one wave of the grid (H100 and H200, 2026-12-03 to 12-06: every split measured
/// that took a second wave lost, such as Llama-3.1-8B's down product at 384 rows in 4 parts,
/// 0.107 ms against 0.084 unsplit, or Llama-3.2-1B's at 1024 rows in 2, 66 us against 60).
const SPLIT_WAVE: u32 = GRID;
/// The speed of a 64-wide tile with K split, against [`TILINGS`]' 60 for one whole: fitted with
/// [`split_steps`]' row factor to 50 products of 16-768 rows measured in every tiling (H100,
/// 2026-12-06; Llama, Qwen2 and GPT-2 shapes where the model before them picked otherwise).
/// With both, it picks the fastest tiling or one within 4% on 46 of them (before: 17), at worst
/// 16% off (before: 68%); on two a tiling 1.5-1.8% slower than the one it took before. Most
/// products of few rows then take 64-wide tiles whole or 128-wide ones in parts, not 64-wide parts.
const SPLIT_NARROW_SPEED: u64 = 50;

/// K steps of a tile's epilogue and the next tile's first loads that the consumers wait out
/// unless they take turns: fitted to the H200 (2026-12-02), where taking turns wins on
/// products of K up to 2048 and loses on K from 3072.
const EPILOGUE_STEPS: u64 = 4;
/// The same for a staged epilogue, which only writes shared memory before the next tile's
/// products (fitted to the H200, 2026-12-03: with it the together tilings beat taking turns on
/// every product measured).
const STAGED_EPILOGUE_STEPS: u64 = 1;

/// Tiles per block below which taking turns does not pay: with one or two, a consumer has no
/// other's products to hide its epilogue under (measured 15% slower at two).
const PING_PONG_MIN_TILES: u64 = 3;

impl Tiling {
    pub const fn together(width: u32) -> Tiling {
        Tiling {
            width,
            ping_pong: false,
            splits: 1,
            staged: false,
        }
    }

    /// Tiles `width` wide, the consumers taking turns.
    pub const fn ping_pong(width: u32) -> Tiling {
        Tiling {
            ping_pong: true,
            ..Tiling::together(width)
        }
    }

    /// This tiling with K in `splits` parts.
    pub const fn split(self, splits: u32) -> Tiling {
        Tiling { splits, ..self }
    }

    /// This tiling with its epilogue through shared memory and TMA stores.
    pub const fn staged(self) -> Tiling {
        Tiling {
            staged: true,
            ..self
        }
    }

    /// A short name: `w256`, `pp128` taking turns, `w128k8` with K in 8 parts, `w256s` staged.
    pub fn label(self) -> String {
        let kind = if self.ping_pong { "pp" } else { "w" };
        let split = if self.splits > 1 {
            format!("k{}", self.splits)
        } else {
            String::new()
        };
        let staged = if self.staged { "s" } else { "" };
        format!("{kind}{}{split}{staged}", self.width)
    }
}
/// K per stage: one 128-byte swizzle row of halves.
const BK: u32 = 64;
/// Pipeline depth (the most: a staged epilogue's tiles may leave room for fewer).
pub const STAGES: u32 = 4;
/// Static shared memory: the stages' barriers (room for the most stages), a split's flags and
/// the staged residual tiles' barriers.
const STATIC_SHARED: u32 =
    2 * STAGES * MBARRIER_BYTES + 4 * CONSUMERS as u32 + CONSUMERS as u32 * MBARRIER_BYTES;
/// Output columns of a staged epilogue's TMA store box: 128 bytes, the swizzle span.
const STORE_COLUMNS: u32 = 64;
/// Output rows of a staged epilogue's TMA store box: a consumer's 64.
const STORE_ROWS: u32 = 64;
const THREADS: u32 = 384;
/// Tile rows per group of the L2-friendly tile order.
const GROUP_M: u32 = 8;
/// Blocks of the persistent grid: the SMs of an H100 / H200 SXM (fewer SMs only means more
/// tiles per block).
const GRID: u32 = 132;
const A_BYTES: u32 = BM * BK * 2;
/// Registers per thread the block holds at launch ([`crate::hopper::launch_regs`]).
const LAUNCH_REGS: u32 = crate::hopper::launch_regs(THREADS);

/// Registers per thread after reallocation, the producer's and the consumers' (up to 128
/// accumulators each), which together fill the block's `LAUNCH_REGS` x `THREADS`: a staged
/// tile's producer keeps 56 (ptxas spilled GPT-2's staged 256-wide bias + GELU(tanh) product at
/// 40 and 48, and its staged epilogue leaves the consumers room at 224), the others 40 (a
/// ping-pong tile's consumers spill at 224).
fn registers(tile: Tiling) -> (u32, u32) {
    let producer = if tile.staged { 56 } else { 40 };
    (producer, (LAUNCH_REGS * THREADS - 128 * producer) / 256)
}

/// Whether `cfg` can use the Hopper kernel: f16/bf16, `[N, K]` weights, rows of 16-byte
/// multiples for TMA (K % 8 == 0), an even N with SwiGLU.
pub fn supports(cfg: &GemmConfig) -> bool {
    let (m, n, k) = (u64::from(cfg.m), u64::from(cfg.n), u64::from(cfg.k));
    cfg.elem != Elem::F32
        && cfg.transpose_b
        && cfg.m > 0
        && cfg.n > 0
        && (!cfg.swiglu || cfg.n.is_multiple_of(2))
        && cfg.k.is_multiple_of(8)
        && crate::check_index_range(&[m * n, m * k, n * k])
}

/// The tiling [`gemm_wgmma`] takes for `cfg`: the one with the least modelled time, work items
/// per block of the persistent grid times each item's K steps at its tiling's speed, plus the
/// epilogues the consumers wait out and a split item's partial sums (`split_steps`; the first
/// of [`TILINGS`] on a tie). A product of few tiles (few rows, or few columns such as GPT-2's
/// 768) takes a narrower tile and more SMs, or its K in parts where that is modelled faster and
/// the parts are one wave (`SPLIT_WAVE`): a decode step's products, and those of a few
/// hundred rows over long K (a wide tile in two parts instead of a narrow one whole); one of
/// many tiles takes a staged epilogue where it fits, else with short K (whose epilogues weigh)
/// the consumers take turns. They take turns only where no staged tiling fits: on every product
/// measured where both fit, the best staged tiling was the faster (H200, 2026-12-03: twelve,
/// from 512 x 3072 x 2048 to 8192^3; H100, 2026-12-06: fifteen that this model had taken turns
/// on, 3-40% faster staged, such as Llama-3.1-8B's QKV at 1024 rows, 0.0667 ms 192 wide against
/// 0.0840, and GPT-2's products over 8192 rows).
pub fn tiling(cfg: &GemmConfig) -> Tiling {
    let k_steps = cfg.k.div_ceil(BK);
    let staging = TILINGS.iter().any(|&(t, _)| t.staged && fits(cfg, t));
    let cost = |tiling: Tiling, speed: u64| {
        let tile = Tile::new(cfg, tiling);
        let per_block = u64::from(tile.items(cfg).div_ceil(GRID));
        let steps = u64::from(tile.part_steps(k_steps));
        let width = u64::from(tiling.width) * 100 / speed;
        let epilogue = if tiling.staged {
            STAGED_EPILOGUE_STEPS
        } else {
            EPILOGUE_STEPS
        };
        if tiling.splits > 1 {
            per_block * (steps + epilogue + split_steps(cfg, tiling)) * width
        } else if !tiling.ping_pong {
            per_block * (steps + epilogue) * width
        } else if per_block >= PING_PONG_MIN_TILES && !staging {
            // Every epilogue but the block's last runs under the other consumer's products.
            (per_block * steps + EPILOGUE_STEPS) * width
        } else {
            u64::MAX
        }
    };
    let cheapest = |candidates: &mut dyn Iterator<Item = (Tiling, u64)>| {
        candidates.fold((TILINGS[0].0, u64::MAX), |best, (tiling, speed)| {
            let c = cost(tiling, speed);
            if c < best.1 {
                (tiling, c)
            } else {
                best
            }
        })
    };
    let unsplit = cheapest(&mut TILINGS.iter().copied().filter(|&(t, _)| fits(cfg, t)));
    let split = cheapest(&mut TILINGS.iter().flat_map(|&(tiling, speed)| {
        let speed = if tiling.width == 64 {
            SPLIT_NARROW_SPEED
        } else {
            speed
        };
        (2..=MAX_SPLITS)
            .map(move |splits| (tiling.split(splits), speed))
            .filter(|&(t, _)| splits_fit(cfg, t) && Tile::new(cfg, t).items(cfg) <= SPLIT_WAVE)
    }));
    if split.1 < unsplit.1 {
        split.0
    } else {
        unsplit.0
    }
}

/// K steps a split item's partial sums take: its own stored and, for the tile's last part, every
/// part's loaded (the tile's rows the product has, as f32), against the bytes a K step loads,
/// times the tile's blocks of 64 rows. That factor is fitted, not derived (with
/// [`SPLIT_NARROW_SPEED`]): parts of 128-row tiles measured 12-22 K steps dearer than their
/// share of K, parts of 64-row tiles 3-5 (H100, 2026-12-06).
fn split_steps(cfg: &GemmConfig, tiling: Tiling) -> u64 {
    let rows = u64::from(cfg.m.min(BM).next_multiple_of(64));
    let sums = rows * u64::from(tiling.width) * 4;
    let step = u64::from((BM + tiling.width) * BK * 2);
    (u64::from(tiling.splits + 1) * sums).div_ceil(step) * (rows / 64)
}

/// The kernel with K split, in the tilings that fit `cfg` of: 128 wide in two parts and in as many
/// as fit, 64 wide in three; each named `name` with its tiling's label. For the tests.
pub fn split_tilings(cfg: &GemmConfig, name: &str) -> Vec<GeneratedKernel> {
    let most = (2..=MAX_SPLITS)
        .rev()
        .find(|&s| splits_fit(cfg, Tiling::together(128).split(s)))
        .unwrap_or(1);
    [
        Tiling::together(128).split(2),
        Tiling::together(128).split(most),
        Tiling::together(64).split(3),
    ]
    .into_iter()
    .filter(|&t| t.splits > 1 && splits_fit(cfg, t))
    .map(|t| gemm_wgmma_tiled(cfg, t, format!("{name}_{}", t.label())))
    .collect()
}

/// Whether the kernel comes in `tiling` for `cfg`: K split where [`splits_fit`], an epilogue
/// through shared memory where [`staged_fits`].
pub fn fits(cfg: &GemmConfig, tiling: Tiling) -> bool {
    (tiling.splits == 1 || splits_fit(cfg, tiling)) && (!tiling.staged || staged_fits(cfg, tiling))
}

/// Whether `tiling` can store `cfg`'s tiles through shared memory: consumers together (taking
/// turns, a consumer's 128 accumulators leave too few registers for the staging and spill),
/// unsplit, output rows of 16-byte multiples (TMA), tiles of whole 64-column boxes.
pub fn staged_fits(cfg: &GemmConfig, tiling: Tiling) -> bool {
    let tile = Tile::new(cfg, tiling);
    !tiling.ping_pong
        && tiling.splits == 1
        && cfg.n_out().is_multiple_of(8)
        && tile.columns().is_multiple_of(STORE_COLUMNS)
}

/// Whether `tiling` can split `cfg`'s K in its parts: consumers together, tiles at most
/// `SPLIT_WIDEST` wide, every part at least `MIN_SPLIT_STEPS` K steps (equal parts but the
/// last), the partial sums' indices in 32 bits.
pub fn splits_fit(cfg: &GemmConfig, tiling: Tiling) -> bool {
    let k_steps = cfg.k.div_ceil(BK);
    let per_part = k_steps.div_ceil(tiling.splits);
    !tiling.ping_pong
        && !tiling.staged
        && tiling.width <= SPLIT_WIDEST
        && per_part >= MIN_SPLIT_STEPS
        && k_steps.div_ceil(per_part) == tiling.splits
        && crate::check_index_range(&[split_scratch(cfg, tiling).0 / 4])
}

/// The sums of squares per row that `cfg` writes in `tiling` with [`RowNorm::Sums`]: one per
/// tile of columns.
pub fn row_sum_parts(cfg: &GemmConfig, tiling: Tiling) -> u32 {
    cfg.n_out().div_ceil(Tile::new(cfg, tiling).columns())
}

/// The scratch a launch of `cfg` in `tiling` binds besides its operands: bytes of the f32
/// `partials` and of the u32 `counters` (zero before the launch, and left zero); none unsplit.
pub fn split_scratch(cfg: &GemmConfig, tiling: Tiling) -> (u64, u64) {
    if tiling.splits <= 1 {
        return (0, 0);
    }
    let tiles = u64::from(Tile::new(cfg, tiling).count(cfg));
    let per_tile = u64::from(BM * tiling.width) * 4;
    (
        tiles * u64::from(tiling.splits) * per_tile,
        tiles * CONSUMERS * 4,
    )
}

/// Consumer warpgroups per block.
const CONSUMERS: u64 = 2;

/// A block's tile: [`BM`] output rows by `width` weight rows per stage.
#[derive(Clone, Copy)]
struct Tile {
    tiling: Tiling,
    swiglu: bool,
}

impl Tile {
    fn new(cfg: &GemmConfig, tiling: Tiling) -> Tile {
        Tile {
            tiling,
            swiglu: cfg.swiglu,
        }
    }

    fn width(self) -> u32 {
        self.tiling.width
    }

    fn ping_pong(self) -> bool {
        self.tiling.ping_pong
    }

    /// Row halves of 64 a consumer multiplies per tile: both, taking turns, or its own.
    fn halves(self) -> u32 {
        if self.ping_pong() {
            2
        } else {
            1
        }
    }

    /// Accumulators per consumer thread: 64 or 128 rows of the tile over 128 threads.
    fn accumulators(self) -> u32 {
        if self.ping_pong() {
            self.width()
        } else {
            self.width() / 2
        }
    }

    /// Consumer warps that release each stage: the one consumer's four, or both consumers'.
    fn releasing_warps(self) -> u32 {
        if self.ping_pong() {
            4
        } else {
            8
        }
    }

    /// Output columns per tile.
    fn columns(self) -> u32 {
        if self.swiglu {
            self.width() / 2
        } else {
            self.width()
        }
    }

    /// Bytes of a consumer's finished 64 rows in shared memory, staged ([`STORE_COLUMNS`]-wide
    /// boxes, 128-byte swizzled); none otherwise.
    fn staging_bytes(self) -> u32 {
        if self.tiling.staged {
            STORE_ROWS * self.columns() * 2
        } else {
            0
        }
    }

    /// Pipeline stages: [`STAGES`], or as many as fit beside the staged tiles, the static
    /// shared memory and the alignment slack (at least two: the widest staged tile keeps three).
    fn stages(self) -> u32 {
        let taken = 1024 + STATIC_SHARED + CONSUMERS as u32 * self.staging_bytes();
        let stages = (MAX_SHARED.saturating_sub(taken) / self.stage_bytes()).min(STAGES);
        assert!(
            stages >= 2,
            "a Hopper GEMM tile leaves room for {stages} stages"
        );
        stages
    }

    /// Dynamic shared memory: the stages, the staged tiles, 1 KB to align them.
    fn shared_bytes(self) -> u32 {
        self.stages() * self.stage_bytes() + CONSUMERS as u32 * self.staging_bytes() + 1024
    }

    /// Bytes of a stage's weight tile.
    fn b_bytes(self) -> u32 {
        self.width() * BK * 2
    }

    /// Bytes of a stage: x's tile, then the weights'.
    fn stage_bytes(self) -> u32 {
        A_BYTES + self.b_bytes()
    }

    /// Tiles of the output.
    fn count(self, cfg: &GemmConfig) -> u32 {
        cfg.m.div_ceil(BM) * cfg.n_out().div_ceil(self.columns())
    }

    /// Work items: each tile once per part of K.
    fn items(self, cfg: &GemmConfig) -> u32 {
        self.count(cfg) * self.tiling.splits
    }

    /// K steps of a part of K (all of them unsplit; the last part may have fewer).
    fn part_steps(self, k_steps: u32) -> u32 {
        k_steps.div_ceil(self.tiling.splits)
    }
}

/// The tensor maps' element type for `elem` (f16 or bf16).
fn tensor_dtype(elem: Elem) -> kiln_ir::DType {
    match elem {
        Elem::F16 => kiln_ir::DType::F16,
        _ => kiln_ir::DType::BF16,
    }
}

/// The tensor maps of x (`[M, K]`) and w (`[N, K]`).
fn tensor_maps(cfg: &GemmConfig, tile: Tile) -> (TensorMapSpec, TensorMapSpec) {
    let dtype = tensor_dtype(cfg.elem);
    let map = |rows: u32, box_rows: u32| {
        TensorMapSpec::matrix(dtype, [rows.into(), cfg.k.into()], [box_rows, BK])
            .swizzled(crate::hopper::SWIZZLE_BYTES)
    };
    (map(cfg.m, BM), map(cfg.n, tile.columns()))
}

/// Generates the kernel in [`tiling`]'s tiling. Parameters: `x` and `w` (tensor maps),
/// `[bias], [residual], out` (a tensor map too when staged).
pub fn gemm_wgmma(cfg: &GemmConfig, name: String) -> GeneratedKernel {
    gemm_wgmma_tiled(cfg, tiling(cfg), name)
}

/// The kernel in every tiling of [`TILINGS`] but the one [`tiling`] picks, each named `name`
/// (the picked kernel's) with its tiling's label: for the tests, the catalog and benchmarks.
pub fn other_tilings(cfg: &GemmConfig, name: &str) -> Vec<GeneratedKernel> {
    let picked = tiling(cfg);
    TILINGS
        .into_iter()
        .filter(|&(t, _)| t != picked && fits(cfg, t))
        .map(|(t, _)| gemm_wgmma_tiled(cfg, t, format!("{name}_{}", t.label())))
        .collect()
}

/// [`gemm_wgmma`] in `tiling`, one of [`TILINGS`].
pub fn gemm_wgmma_tiled(cfg: &GemmConfig, tiling: Tiling, name: String) -> GeneratedKernel {
    assert!(
        supports(cfg),
        "the Hopper GEMM needs f16/bf16, [N, K] weights, K % 8 == 0 (N even with SwiGLU)"
    );
    assert!(
        TILINGS.iter().any(|&(t, _)| t == tiling.split(1)) && fits(cfg, tiling),
        "the Hopper GEMM's tilings are those of TILINGS, K split and the epilogue staged where \
         they fit"
    );
    let tile = Tile::new(cfg, tiling);
    let mut k = Kernel::new(&name);
    k.directive(format!(".maxntid {THREADS}, 1, 1"));
    k.directive(".minnctapersm 1");
    let Params {
        maps,
        epilogue,
        split,
        norm,
        residual,
    } = Params::declare(&mut k, cfg, tile);
    let tid = k.special("tid.x");
    let (stages, full, empty) = shared_setup(&mut k, tile, &tid, residual.as_ref());

    let warpgroup = k.op2("shr.u32", RegClass::B32, &tid, &7u32);
    let consumers = k.label("consumers");
    let is_producer = k.setp("eq.u32", &warpgroup, &0u32);
    k.bra(Some((is_producer, false)), &consumers);
    let pipe = Pipeline {
        tile,
        stages,
        full,
        empty,
        k_tiles: cfg.k.div_ceil(BK),
        count: tile.stages(),
    };
    producer(&mut k, cfg, &pipe, &tid, maps);
    k.place(&consumers);
    consumer(
        &mut k,
        cfg,
        &pipe,
        (&epilogue, split.as_ref(), residual.as_ref(), norm),
        &tid,
        &warpgroup,
    );

    GeneratedKernel::new(
        k,
        Launch {
            grid: [tile.items(cfg).min(GRID), 1, 1],
            block: [THREADS, 1, 1],
            shared_bytes: tile.shared_bytes(),
        },
    )
    .on(KernelPath::Wgmma)
    .in_image(Image::Sm90a)
}

/// The kernel's parameters (`x, w` tensor maps, the epilogue's, K split's and the row norm's),
/// declared with the kernel's shared memory: the stages and barriers ([`shared_setup`] sets
/// them up), the split's flags and the residual tiles' barriers.
struct Params {
    maps: [Reg; 2],
    epilogue: EpiloguePtrs,
    split: Option<Split>,
    norm: Option<NormParam>,
    residual: Option<ResidualLoads>,
}

impl Params {
    fn declare(k: &mut Kernel, cfg: &GemmConfig, tile: Tile) -> Params {
        let tiling = tile.tiling;
        let (x_spec, w_spec) = tensor_maps(cfg, tile);
        let maps = [
            k.param_tensor_map("x", x_spec),
            k.param_tensor_map("w", w_spec),
        ];
        let out_map = tiling.staged.then(|| {
            let dims = [cfg.m.into(), cfg.n_out().into()];
            TensorMapSpec::matrix(tensor_dtype(cfg.elem), dims, [STORE_ROWS, STORE_COLUMNS])
                .swizzled(crate::hopper::SWIZZLE_BYTES)
        });
        let copied = copies_residual(cfg, tiling);
        let epilogue = EpiloguePtrs::declare_with(k, cfg, out_map, copied);
        let split = (tiling.splits > 1).then(|| Split {
            partials: k.param_scratch("partials"),
            counters: k.param_scratch("counters"),
            flags: k.shared("split_last", 4 * CONSUMERS as u32),
            splits: tiling.splits,
        });
        let norm = NormParam::declare(k, cfg, tile);
        k.dynamic_shared_aligned(STAGES_MEMORY, 1024);
        // Room for the most stages' barriers, whatever this tile's count.
        k.shared(BARRIERS, 2 * STAGES * MBARRIER_BYTES);
        let residual = copied.then(|| {
            k.shared("gemm_residual_barriers", CONSUMERS as u32 * MBARRIER_BYTES);
            ResidualLoads {
                bars: k.shared_base("gemm_residual_barriers"),
                tiles: k.mov(RegClass::B32, &0u32),
            }
        });
        Params {
            maps,
            epilogue,
            split,
            norm,
            residual,
        }
    }
}

/// The stages' shared memory: dynamic, aligned at run time to 1024 bytes ([`aligned_base`]).
const STAGES_MEMORY: &str = "gemm_stages";
/// The stages' full and empty barriers.
const BARRIERS: &str = "gemm_barriers";

/// After [`Params::declare`]: the stages' 1024-aligned base and their full and empty barriers,
/// which thread 0 initialises (the residual tiles' too).
fn shared_setup(
    k: &mut Kernel,
    tile: Tile,
    tid: &Reg,
    residual: Option<&ResidualLoads>,
) -> (Reg, Reg, Reg) {
    let stages = aligned_base(k, STAGES_MEMORY);
    let full = k.shared_base(BARRIERS);
    let empty = k.add_u32(&full, &(STAGES * MBARRIER_BYTES));
    k.comment(
        "barriers: full (one arrival plus the stage's bytes), empty (one per releasing warp)",
    );
    let first = k.setp("eq.u32", tid, &0u32);
    let init_done = k.label("init_done");
    k.bra(Some((first, false)), &init_done);
    for s in 0..tile.stages() {
        let f = k.add_u32(&full, &(s * MBARRIER_BYTES));
        mbarrier_init(k, &f, 1);
        let e = k.add_u32(&empty, &(s * MBARRIER_BYTES));
        mbarrier_init(k, &e, tile.releasing_warps());
    }
    if let Some(residual) = residual {
        residual.init(k);
    }
    mbarrier_init_fence(k);
    k.place(&init_done);
    k.barrier();
    (stages, full, empty)
}

/// A block's work item: a tile (its index and first output row and column) and the part of K
/// it multiplies (the part's index, its first K step and its K steps).
struct Item {
    tile: Reg,
    m0: Reg,
    n0: Reg,
    part: Reg,
    first: Reg,
    steps: Reg,
}

/// Runs `body` for each work item of this block (`ctaid.x`, then every `nctaid.x`-th): the
/// parts of a tile's K are adjacent items.
fn for_each_item(
    k: &mut Kernel,
    cfg: &GemmConfig,
    pipe: &Pipeline,
    mut body: impl FnMut(&mut Kernel, &Item),
) {
    let (shape, k_tiles) = (pipe.tile, pipe.k_tiles);
    let splits = shape.tiling.splits;
    for_each_block_item(k, "item", shape.items(cfg), |k, item| {
        let (tile, part) = if splits > 1 {
            let tile = k.op2("div.u32", RegClass::B32, item, &splits);
            (tile, k.op2("rem.u32", RegClass::B32, item, &splits))
        } else {
            (*item, k.mov(RegClass::B32, &0u32))
        };
        let (m0, n0) = tile_origin(k, cfg, shape, &tile);
        let per_part = shape.part_steps(k_tiles);
        let first = k.mul_u32(&part, &per_part);
        let left = k.sub_u32(&k_tiles, &first);
        let steps = k.op2("min.u32", RegClass::B32, &left, &per_part);
        let item = Item {
            tile,
            m0,
            n0,
            part,
            first,
            steps,
        };
        body(k, &item);
    });
}

/// The block's first output row and column, visiting tiles in groups of [`GROUP_M`] tile rows
/// (column by column within a group).
fn tile_origin(k: &mut Kernel, cfg: &GemmConfig, tile: Tile, pid: &Reg) -> (Reg, Reg) {
    let tiles_m = cfg.m.div_ceil(BM);
    let tiles_n = cfg.n_out().div_ceil(tile.columns());
    let span = GROUP_M * tiles_n;
    let group = k.op2("div.u32", RegClass::B32, pid, &span);
    let first_m = k.mul_u32(&group, &GROUP_M);
    let left = k.sub_u32(&tiles_m, &first_m);
    let rows = k.op2("min.u32", RegClass::B32, &left, &GROUP_M);
    let within = k.op2("rem.u32", RegClass::B32, pid, &span);
    let dm = k.op2("rem.u32", RegClass::B32, &within, &rows);
    let tm = k.add_u32(&first_m, &dm);
    let tn = k.op2("div.u32", RegClass::B32, &within, &rows);
    (k.mul_u32(&tm, &BM), k.mul_u32(&tn, &tile.columns()))
}

/// Shared-memory stages and their barriers.
struct Pipeline {
    tile: Tile,
    stages: Reg,
    full: Reg,
    empty: Reg,
    k_tiles: u32,
    /// Stages (at most [`STAGES`]).
    count: u32,
}

impl Pipeline {
    /// Stage `s`'s A tile, B tile, full and empty barriers for K step `kt`, and the parity of
    /// the step's round through the stages.
    fn at(&self, k: &mut Kernel, kt: &Reg) -> StageRefs {
        let s = k.op2("rem.u32", RegClass::B32, kt, &self.count);
        let round = k.op2("div.u32", RegClass::B32, kt, &self.count);
        let parity = k.op2("and.b32", RegClass::B32, &round, &1u32);
        let a = k.mad_u32(&s, &self.tile.stage_bytes(), &self.stages);
        let b = k.add_u32(&a, &A_BYTES);
        let full = k.mad_u32(&s, &MBARRIER_BYTES, &self.full);
        let empty = k.mad_u32(&s, &MBARRIER_BYTES, &self.empty);
        StageRefs {
            a,
            b,
            full,
            empty,
            parity,
        }
    }
}

struct StageRefs {
    a: Reg,
    b: Reg,
    full: Reg,
    empty: Reg,
    parity: Reg,
}

/// Warpgroup 0: gives up registers; thread 0 streams the K steps of the block's tiles into the
/// stages (`step` counts them across tiles), then the warpgroup leaves.
fn producer(k: &mut Kernel, cfg: &GemmConfig, pipe: &Pipeline, tid: &Reg, [x, w]: [Reg; 2]) {
    setmaxnreg(k, false, registers(pipe.tile.tiling).0);
    let exit = k.label("producer_done");
    let first = k.setp("eq.u32", tid, &0u32);
    k.bra(Some((first, false)), &exit);
    prefetch_tensor_map(k, &x);
    prefetch_tensor_map(k, &w);
    let step = k.mov(RegClass::B32, &0u32);
    for_each_item(k, cfg, pipe, |k, item| {
        let (m0, n0) = (item.m0, item.n0);
        let kt = k.mov(RegClass::B32, &0u32);
        let top = k.label("produce");
        k.place(&top);
        let st = pipe.at(k, &step);
        k.comment("wait until the consumers released the stage (from the second round on)");
        wait_released(
            k,
            (&step, pipe.count),
            (&st.empty, &st.parity),
            "fresh_stage",
        );
        mbarrier_arrive_expect_tx(k, &st.full, pipe.tile.stage_bytes());
        let at = k.add_u32(&item.first, &kt);
        let k0 = k.mul_u32(&at, &BK);
        tma_load(k, &st.a, &x, &[&k0, &m0], &st.full);
        tma_load(k, &st.b, &w, &[&k0, &n0], &st.full);
        if cfg.swiglu {
            let up = k.add_u32(&n0, &cfg.n_out());
            let b_up = k.add_u32(&st.b, &(pipe.tile.b_bytes() / 2));
            tma_load(k, &b_up, &w, &[&k0, &up], &st.full);
        }
        k.emit(format!("add.u32 {step}, {step}, 1"));
        k.emit(format!("add.u32 {kt}, {kt}, 1"));
        let more = k.setp("lt.u32", &kt, &item.steps);
        k.bra(Some((more, true)), &top);
    });
    k.place(&exit);
    k.emit("ret");
}

/// Warpgroups 1 and 2: take the registers; for each of their work items, multiply their rows of
/// every stage (`step` counts stages across the block's items, as the producer's does), then
/// run the epilogue ([`Consumer::epilogue`]).
/// Together, each multiplies its 64 rows of every tile; taking turns, each multiplies all 128
/// rows of every other tile (two row halves of accumulators), skipping the other's ([`Turns`]).
fn consumer(
    k: &mut Kernel,
    cfg: &GemmConfig,
    pipe: &Pipeline,
    (epilogue, split, residual, norm): (
        &EpiloguePtrs,
        Option<&Split>,
        Option<&ResidualLoads>,
        Option<NormParam>,
    ),
    tid: &Reg,
    warpgroup: &Reg,
) {
    setmaxnreg(k, true, registers(pipe.tile.tiling).1);
    let tile = pipe.tile;
    let acc: Vec<Reg> = (0..tile.accumulators())
        .map(|_| k.reg(RegClass::F32))
        .collect();
    let index = k.sub_u32(warpgroup, &1u32);
    // The A rows each half of the accumulators multiplies: this warpgroup's 64 rows (64 rows of
    // 128 bytes further per consumer), or both halves of the tile.
    let halves: Vec<Reg> = if tile.ping_pong() {
        vec![
            k.mov(RegClass::B32, &0u32),
            k.mov(RegClass::B32, &(64 * BK * 2)),
        ]
    } else {
        vec![k.mul_u32(&index, &(64 * BK * 2))]
    };
    let lane = k.op2("and.b32", RegClass::B32, tid, &31u32);
    let lane0 = k.setp("eq.u32", &lane, &0u32);
    let step = k.mov(RegClass::B32, &0u32);
    let turns = tile.ping_pong().then(|| Turns::new(k, cfg, tile, &index));
    let mac = Products {
        cfg,
        pipe,
        acc: &acc,
        halves: &halves,
        step,
        lane0,
    };
    let this = Consumer {
        cfg,
        tile,
        epilogue,
        split,
        residual,
        norm,
        staging: tile
            .tiling
            .staged
            .then(|| Staging::new(pipe, residual.is_some())),
        tid: *tid,
        index,
    };
    for_each_item(k, cfg, pipe, |k, item| {
        let skip = k.label("other_tile");
        // Taking turns: whether the other consumer has a tile after this one.
        let hand_over = turns.as_ref().map(|t| t.take(k, &index, &mac, &skip));
        let loads = |k: &mut Kernel, mid: &Reg| this.load_residual(k, item, mid);
        let mid_step: Option<&StepHook<'_>> = residual.map(|_| &loads as _);
        // The rows' sums of squares, loaded ahead of the products they scale.
        let norms = NormParam::loads(norm, k, cfg, tid, tile.halves(), |k, half| {
            this.half_rows(k, item, half)
        });
        mac.multiply(k, &item.steps, mid_step);
        if let (Some(t), Some(next)) = (&turns, hand_over) {
            t.hand_over(k, next);
        }
        mac.release_last(k);
        this.epilogue(k, item, &acc, norms, &skip);
        k.place(&skip);
    });
    if let Some(staging) = &this.staging {
        staging.finish(k, tid);
    }
}

/// What a consumer warpgroup's epilogues share: the product's parts and the consumer's place.
struct Consumer<'a> {
    cfg: &'a GemmConfig,
    tile: Tile,
    epilogue: &'a EpiloguePtrs,
    split: Option<&'a Split>,
    residual: Option<&'a ResidualLoads>,
    norm: Option<NormParam>,
    staging: Option<Staging>,
    tid: Reg,
    /// The warpgroup less one (warpgroup 0 is the producer).
    index: Reg,
}

impl Consumer<'_> {
    /// The first row of accumulator half `half`: this warpgroup's 64 rows, or, taking turns,
    /// either half of the tile.
    fn half_rows(&self, k: &mut Kernel, item: &Item, half: u32) -> Reg {
        if self.tile.ping_pong() {
            k.add_u32(&item.m0, &(64 * half))
        } else {
            self.own_rows(k, item)
        }
    }

    /// The first of this warpgroup's 64 rows of the tile.
    fn own_rows(&self, k: &mut Kernel, item: &Item) -> Reg {
        k.mad_u32(&self.index, &64u32, &item.m0)
    }

    /// Issues the residual tile's loads in the middle K step (`mid` its predicate).
    fn load_residual(&self, k: &mut Kernel, item: &Item, mid: &Reg) {
        if let (Some(residual), Some(staging)) = (self.residual, &self.staging) {
            let rows = self.own_rows(k, item);
            let place = [rows, item.n0];
            residual.issue(
                k,
                (staging, self.epilogue),
                mid,
                [&self.tid, &self.index],
                place,
            );
        }
    }

    /// The epilogue of a tile's products in `acc`: rows scaled by their norms (`norms`), K's
    /// parts added up (only the tile's last part goes on, the others to `skip`), then stored
    /// staged or from registers.
    fn epilogue(
        &self,
        k: &mut Kernel,
        item: &Item,
        acc: &[Reg],
        norms: Vec<RowSumLoads>,
        skip: &Label,
    ) {
        let (cfg, tid) = (self.cfg, &self.tid);
        let per_half = acc.len() / self.tile.halves() as usize;
        for (acc, loads) in acc.chunks(per_half).zip(norms) {
            let scales = loads.scales(k, cfg);
            scale_rows(k, acc, &scales);
        }
        let sums_out = NormParam::sums_out(self.norm);
        if let Some(split) = self.split {
            // A consumer whose 64 rows are all past M (a decode step's 64 rows) has nothing to
            // add up or store.
            let rows = self.own_rows(k, item);
            let outside = k.setp("ge.u32", &rows, &cfg.m);
            k.bra(Some((outside, true)), skip);
            let last = split.add_parts(k, acc, item, [*tid, self.index]);
            k.bra(Some((last, false)), skip);
        }
        if let Some(staging) = &self.staging {
            // Consumers together: one half of 64 rows.
            let regs = match self.residual {
                Some(residual) => residual.wait(k, staging, tid, &self.index),
                None => staging.begin(k, tid, &self.index),
            };
            let rows = self.own_rows(k, item);
            let frag = Fragment::of(k, acc, tid, rows, item.n0);
            let mut sums = sums_out.map(|out| RowSums::new(k, out));
            staging.write(&regs, k, cfg, self.epilogue, &frag, sums.as_mut());
            staging.flush(&regs, k, self.epilogue.out_map(), [rows, item.n0]);
            // After the stores are issued: the sums' shuffles do not hold them up.
            if let Some(sums) = sums {
                sums.store(k, (cfg, self.tile), &frag, (tid, &item.n0));
            }
            return;
        }
        for (half, acc) in (0u32..).zip(acc.chunks(per_half)) {
            let rows = self.half_rows(k, item, half);
            let place = [rows, item.n0];
            store(
                k,
                (cfg, self.tile),
                (self.epilogue, sums_out),
                acc,
                tid,
                place,
            );
        }
    }
}

/// A consumer's staged epilogue ([`Tiling::staged`], consumers together): its finished 64 rows
/// go into its region of shared memory after the stages ([`STORE_COLUMNS`]-wide boxes, each row
/// 128 bytes with the 128-byte swizzle TMA expects), and its first thread copies the boxes out
/// with TMA stores, which run on while the consumer multiplies its next tile. The registers are
/// derived for each tile's epilogue ([`Staging::begin`]), so that none stay live through the
/// products.
struct Staging {
    /// The consumer's region: the stages' base and the bytes from it.
    base: Reg,
    offset: u32,
    /// The tile's output columns.
    columns: u32,
    /// The region holds the tile's residual when the epilogue starts ([`ResidualLoads`]).
    residual: bool,
}

/// [`Staging`]'s registers for one tile's epilogue.
struct StagingRegs {
    /// The consumer's region.
    buf: Reg,
    /// Thread 0 of the consumer, which issues and waits for the stores.
    issuer: Reg,
    /// The consumer's named barrier.
    barrier: Reg,
    /// Per lane: the row of the region its `stmatrix` addresses start at (as an address), its
    /// row within 8 (the swizzle), and which of a pair of chunks it addresses.
    row_base: Reg,
    swizzle: Reg,
    odd_chunk: Reg,
}

/// Named barriers of the staged epilogue: this plus the consumer (0 is the whole block's, 1 and
/// 2 order consumers taking turns, 3 and 4 a split's sums).
const STAGING_BARRIER: u32 = 5;

impl Staging {
    fn new(pipe: &Pipeline, residual: bool) -> Staging {
        let tile = pipe.tile;
        Staging {
            base: pipe.stages,
            offset: pipe.count * tile.stage_bytes(),
            columns: tile.columns(),
            residual,
        }
    }

    /// Whether the thread at `place` is its consumer's first (which issues and waits for the
    /// stores).
    fn issuer(k: &mut Kernel, place: &WarpgroupThread) -> Reg {
        k.setp("eq.u32", &place.thread, &0u32)
    }

    /// Consumer `consumer`'s region.
    fn region(&self, k: &mut Kernel, consumer: &Reg) -> Reg {
        let bytes = STORE_ROWS * self.columns * 2;
        let region = k.mad_u32(consumer, &bytes, &self.base);
        k.add_u32(&region, &self.offset)
    }

    /// Runs `copy` for each [`STORE_COLUMNS`]-wide box of the region at `buf` (64 rows of 128
    /// bytes each), with the box's first output column (from `n0`) and its shared address.
    fn for_each_box(
        &self,
        k: &mut Kernel,
        buf: &Reg,
        n0: &Reg,
        mut copy: impl FnMut(&mut Kernel, &Reg, &Reg),
    ) {
        for b in 0..self.columns / STORE_COLUMNS {
            let col = k.add_u32(n0, &(b * STORE_COLUMNS));
            let at = k.add_u32(buf, &(b * STORE_ROWS * 128));
            copy(k, &col, &at);
        }
    }

    /// The registers of consumer `consumer`'s thread `tid`.
    fn regs(&self, k: &mut Kernel, tid: &Reg, consumer: &Reg) -> StagingRegs {
        let buf = self.region(k, consumer);
        let place = WarpgroupThread::of(k, tid);
        let issuer = Staging::issuer(k, &place);
        let barrier = k.add_u32(consumer, &STAGING_BARRIER);
        // Lane 8 q + r addresses row r of matrix q: rows 8 (q & 1) on of its warp's 16, chunk
        // q / 2 of the pair.
        let WarpgroupThread { lane, warp, .. } = place;
        let swizzle = k.op2("and.b32", RegClass::B32, &lane, &7u32);
        let q = k.op2("shr.u32", RegClass::B32, &lane, &3u32);
        let lower = k.op2("and.b32", RegClass::B32, &q, &1u32);
        let odd_chunk = k.op2("shr.u32", RegClass::B32, &q, &1u32);
        let row = k.mad_u32(&lower, &8u32, &swizzle);
        let row = k.mad_u32(&warp, &16u32, &row);
        let row_base = k.mad_u32(&row, &128u32, &buf);
        StagingRegs {
            buf,
            issuer,
            barrier,
            row_base,
            swizzle,
            odd_chunk,
        }
    }

    /// Waits until the region's previous stores have read it.
    fn begin(&self, k: &mut Kernel, tid: &Reg, consumer: &Reg) -> StagingRegs {
        k.comment("staged epilogue: the region's previous stores have read it");
        let regs = self.regs(k, tid, consumer);
        let ready = k.label("staging_free");
        k.bra(Some((regs.issuer, false)), &ready);
        bulk_wait(k, 0, true);
        k.place(&ready);
        k.emit(format!("bar.sync {}, 128", regs.barrier));
        regs
    }

    /// Finishes `frag`'s 64 rows and writes them into the region, two chunks a `stmatrix`.
    fn write(
        &self,
        regs: &StagingRegs,
        k: &mut Kernel,
        cfg: &GemmConfig,
        epilogue: &EpiloguePtrs,
        frag: &Fragment,
        mut sums: Option<&mut RowSums>,
    ) {
        let no_operands = PairOperands::words(cfg) == 0;
        let rows: Vec<(Reg, Reg)> = if no_operands {
            Vec::new()
        } else {
            (0..2u32)
                .map(|h| {
                    let row = k.add_u32(&frag.row0, &(8 * h));
                    let ok = k.setp("lt.u32", &row, &cfg.m);
                    (ok, k.mul_u32(&row, &cfg.n_out()))
                })
                .collect()
        };
        let chunks = frag.chunks(cfg);
        for j in (0..chunks).step_by(2) {
            // Chunk j + odd_chunk's 16-byte unit of its 128-byte row, swizzled.
            let address = |k: &mut Kernel| {
                let block = (j / 8) * STORE_ROWS * 128;
                let unit = k.add_u32(&regs.odd_chunk, &(j % 8));
                let unit = k.op2("xor.b32", RegClass::B32, &unit, &regs.swizzle);
                let at = k.add_u32(&regs.row_base, &block);
                k.mad_u32(&unit, &16u32, &at)
            };
            // The residual's pairs where the finished ones go: the region holds the residual
            // tile ([`ResidualLoads`]), and `ldmatrix` reads what `stmatrix` writes.
            let resident = self.residual.then(|| {
                let addr = address(k);
                (addr, k.ldmatrix_x4("", addr, 0))
            });
            let words: Vec<[Reg; 2]> = [j, j + 1]
                .map(|j| {
                    let operands = if no_operands {
                        PairOperands::none()
                    } else {
                        let place = PairPlace::of(k, cfg, frag, &rows, j);
                        let pair = resident.as_ref().map(|(_, r)| {
                            let i = 2 * (j % 2) as usize;
                            vec![r[i], r[i + 1]]
                        });
                        PairOperands::load(k, cfg, epilogue, &place, pair)
                    };
                    let words = finish_chunk(k, cfg, frag, j, &operands);
                    if let Some(sums) = sums.as_deref_mut() {
                        sums.add(k, cfg, frag, j, &words);
                    }
                    words
                })
                .to_vec();
            let addr = match resident {
                Some((addr, _)) => addr,
                None => address(k),
            };
            stmatrix_x4(
                k,
                &addr,
                [words[0][0], words[0][1], words[1][0], words[1][1]],
            );
        }
    }

    /// Copies the region out to rows from `rows0`, columns from `n0` (after every thread's
    /// writes: fence, barrier), one box per [`STORE_COLUMNS`] columns.
    fn flush(&self, regs: &StagingRegs, k: &mut Kernel, out_map: Reg, [rows0, n0]: [Reg; 2]) {
        fence_proxy_async(k);
        k.emit(format!("bar.sync {}, 128", regs.barrier));
        let done = k.label("staging_stored");
        k.bra(Some((regs.issuer, false)), &done);
        self.for_each_box(k, &regs.buf, &n0, |k, col, src| {
            tma_store(k, &out_map, &[col, &rows0], src);
        });
        bulk_commit(k);
        k.place(&done);
    }

    /// Waits for the consumer's last stores before it leaves.
    fn finish(&self, k: &mut Kernel, tid: &Reg) {
        let place = WarpgroupThread::of(k, tid);
        let issuer = Staging::issuer(k, &place);
        let done = k.label("staging_done");
        k.bra(Some((issuer, false)), &done);
        bulk_wait(k, 0, false);
        k.place(&done);
    }
}

/// K steps up to which a staged epilogue's residual tile is copied in ([`ResidualLoads`]): on the
/// H200 (2026-12-04) BERT-base's O product + bias + residual (12 steps) took 0.0384-0.0398 ms
/// against 0.0433-0.0441 loading it in the epilogue, its down product (48 steps) 0.1231-0.1266
/// against 0.1139-0.1166 at 256 wide: over long K the epilogue's loads weigh little, and the
/// guarded copy in every step's issue does not pay.
const RESIDUAL_COPY_MAX_STEPS: u32 = 16;

/// Whether `tiling`'s epilogue takes its residual tile copied in ([`ResidualLoads`]): staged,
/// with a residual, over at most [`RESIDUAL_COPY_MAX_STEPS`] K steps.
fn copies_residual(cfg: &GemmConfig, tiling: Tiling) -> bool {
    tiling.staged && cfg.residual && cfg.k.div_ceil(BK) <= RESIDUAL_COPY_MAX_STEPS
}

/// A staged epilogue's residual tile, copied with TMA into the consumer's region while the
/// consumer multiplies, so that the epilogue reads it from shared memory (`ldmatrix` where its
/// finished pairs go) instead of waiting on global loads: once the tile's middle K step is
/// issued (the previous tile's stores have long read the region by then: at the first step,
/// waiting for them held the warpgroup), the consumer's first thread waits for them and copies
/// the residual's boxes in, completing on the consumer's barrier, which the epilogue waits for
/// (its phase is the consumer's tile count). The residual is then a tensor map like `out` (rows
/// of 16-byte multiples, as [`staged_fits`] asks of `out`).
struct ResidualLoads {
    /// One barrier per consumer, `MBARRIER_BYTES` apart.
    bars: Reg,
    /// The consumer's staged tiles so far.
    tiles: Reg,
}

impl ResidualLoads {
    /// One arrival (with the boxes' bytes) completes each phase.
    fn init(&self, k: &mut Kernel) {
        for c in 0..CONSUMERS as u32 {
            let bar = k.add_u32(&self.bars, &(c * MBARRIER_BYTES));
            mbarrier_init(k, &bar, 1);
        }
    }

    fn bar(&self, k: &mut Kernel, consumer: &Reg) -> Reg {
        k.mad_u32(consumer, &MBARRIER_BYTES, &self.bars)
    }

    /// Where `when` holds on the consumer's first thread: the region freed by the previous
    /// stores, then the residual's boxes at rows from `rows0`, columns from `n0` copied in.
    fn issue(
        &self,
        k: &mut Kernel,
        (staging, epilogue): (&Staging, &EpiloguePtrs),
        at_step: &Reg,
        [tid, consumer]: [&Reg; 2],
        [rows0, n0]: [Reg; 2],
    ) {
        let map = epilogue
            .residual_map()
            .expect("a staged residual tile has a residual");
        let place = WarpgroupThread::of(k, tid);
        let issuer = Staging::issuer(k, &place);
        let when = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {when}, {at_step}, {issuer}"));
        k.comment("the residual tile into the region once the previous stores have read it");
        bulk_wait_when(k, Some(&when), 0, true);
        let bar = self.bar(k, consumer);
        let region = staging.region(k, consumer);
        mbarrier_arrive_expect_tx_when(k, Some(&when), &bar, STORE_ROWS * staging.columns * 2);
        staging.for_each_box(k, &region, &n0, |k, col, dst| {
            tma_load_when(k, Some(&when), dst, &map, &[col, &rows0], &bar);
        });
    }

    /// The consumer's staging registers once its residual tile has landed in the region.
    fn wait(&self, k: &mut Kernel, staging: &Staging, tid: &Reg, consumer: &Reg) -> StagingRegs {
        k.comment("staged epilogue: the residual tile in the region");
        let bar = self.bar(k, consumer);
        let parity = k.op2("and.b32", RegClass::B32, &self.tiles, &1u32);
        mbarrier_wait(k, &bar, &parity);
        let tiles = self.tiles;
        k.emit(format!("add.u32 {tiles}, {tiles}, 1"));
        staging.regs(k, tid, consumer)
    }
}

/// The consumers taking turns: the block's tiles so far (`ordinal`), how many it has, and the
/// named barriers on which this consumer waits for its turn (`mine`) and hands the other its
/// own (`other`). A consumer starts a tile's products only once the other has issued those of
/// the tile before, so that it never waits on a stage more than one fill ahead of it, which an
/// mbarrier's phase parity could not tell from the fill before.
struct Turns {
    ordinal: Reg,
    count: Reg,
    mine: Reg,
    other: Reg,
}

impl Turns {
    fn new(k: &mut Kernel, cfg: &GemmConfig, tile: Tile, consumer: &Reg) -> Turns {
        let ordinal = k.mov(RegClass::B32, &0u32);
        let block = k.special("ctaid.x");
        let grid = k.special("nctaid.x");
        let left = k.sub_u32(&tile.count(cfg), &block);
        let spread = k.add_u32(&left, &grid);
        let spread = k.sub_u32(&spread, &1u32);
        let count = k.op2("div.u32", RegClass::B32, &spread, &grid);
        let mine = k.add_u32(consumer, &1u32);
        let other = k.sub_u32(&2u32, consumer);
        Turns {
            ordinal,
            count,
            mine,
            other,
        }
    }

    /// Passes over the other consumer's tile (its stages counted, to `skip`), or waits for this
    /// consumer's turn (from its second tile on); returns whether a tile follows this one.
    fn take(&self, k: &mut Kernel, consumer: &Reg, mac: &Products, skip: &Label) -> Reg {
        let ordinal = self.ordinal;
        k.comment("every other tile is the other consumer's: pass over its stages");
        let turn = k.op2("and.b32", RegClass::B32, &ordinal, &1u32);
        let theirs = k.setp("ne.u32", &turn, consumer);
        let first = k.setp("eq.u32", &ordinal, &0u32);
        k.emit(format!("add.u32 {ordinal}, {ordinal}, 1"));
        let past = k.add_u32(&mac.step, &mac.pipe.k_tiles);
        k.emit(format!("@{theirs} mov.u32 {}, {past}", mac.step));
        k.bra(Some((theirs, true)), skip);
        k.comment("wait until the other consumer has issued the tile before's products");
        let waited = k.label("turn_taken");
        k.bra(Some((first, true)), &waited);
        k.emit(format!("bar.sync {}, 256", self.mine));
        k.place(&waited);
        k.setp("lt.u32", &ordinal, &self.count)
    }

    /// The other consumer's turn, if it has a tile after this one (`next`).
    fn hand_over(&self, k: &mut Kernel, next: Reg) {
        k.comment("the other consumer's turn, if it has a tile after this one");
        let no_next = k.label("no_next_tile");
        k.bra(Some((next, false)), &no_next);
        k.emit(format!("bar.arrive {}, 256", self.other));
        k.place(&no_next);
    }
}

/// Code a consumer emits into its K-step loop, given the predicate of the step it is for.
type StepHook<'a> = dyn Fn(&mut Kernel, &Reg) + 'a;

/// A consumer's products of one tile: its accumulators (one half per A row block in `halves`)
/// over the K steps, stage by stage (`step` counts stages across the block's tiles).
struct Products<'a> {
    cfg: &'a GemmConfig,
    pipe: &'a Pipeline,
    acc: &'a [Reg],
    halves: &'a [Reg],
    step: Reg,
    lane0: Reg,
}

impl Products<'_> {
    /// Zeroes the accumulators and issues the item's `steps` K steps, releasing each stage once
    /// the group that read it has retired (all but the last); `mid_step` runs after each step's
    /// products are issued, its instructions guarded by the predicate it is given (the middle
    /// step, `steps / 2`), without branches: a divergent path while products are in flight
    /// would serialize them.
    fn multiply(&self, k: &mut Kernel, steps: &Reg, mid_step: Option<&StepHook<'_>>) {
        let (pipe, step) = (self.pipe, self.step);
        let per_half = self.acc.len() / self.halves.len();
        for a in self.acc {
            k.set(*a, &F32(0.0));
        }
        let kt = k.mov(RegClass::B32, &0u32);
        let top = k.label("consume");
        k.place(&top);
        let st = pipe.at(k, &step);
        mbarrier_wait(k, &st.full, &st.parity);
        wgmma_fence(k);
        let b_desc = wgmma_descriptor(k, &st.b, 16, 1024);
        let a_descs: Vec<Reg> = self
            .halves
            .iter()
            .map(|rows| {
                let a_tile = k.add_u32(&st.a, rows);
                wgmma_descriptor(k, &a_tile, 16, 1024)
            })
            .collect();
        for kk in 0..BK / 16 {
            // Each k16 step is 32 bytes further along the swizzled rows: 2 descriptor units.
            let further = |k: &mut Kernel, desc: Reg| {
                if kk == 0 {
                    desc
                } else {
                    k.op2("add.u64", RegClass::B64, &desc, &(2 * u64::from(kk)))
                }
            };
            let b = further(k, b_desc);
            for (half, a_desc) in a_descs.iter().enumerate() {
                let a = further(k, *a_desc);
                let b = WgmmaB {
                    desc: &b,
                    transposed: false,
                };
                let acc = &self.acc[half * per_half..(half + 1) * per_half];
                wgmma(k, self.cfg.elem, acc, WgmmaA::Shared(&a), b, true);
            }
        }
        wgmma_commit(k);
        if let Some(mid_step) = mid_step {
            let half = k.op2("shr.u32", RegClass::B32, steps, &1u32);
            let mid = k.setp("eq.u32", &kt, &half);
            mid_step(k, &mid);
        }
        k.comment("the previous step's group has retired: release its stage");
        wgmma_wait(k, 1);
        let had_previous = k.setp("ne.u32", &kt, &0u32);
        let release = k.reg(RegClass::Pred);
        k.emit(format!(
            "and.pred {release}, {had_previous}, {}",
            self.lane0
        ));
        self.release(k, release);
        k.emit(format!("add.u32 {step}, {step}, 1"));
        k.emit(format!("add.u32 {kt}, {kt}, 1"));
        let more = k.setp("lt.u32", &kt, steps);
        k.bra(Some((more, true)), &top);
    }

    /// Waits for the tile's last group and releases its stage.
    fn release_last(&self, k: &mut Kernel) {
        k.comment("the tile's last group: wait for it and release its stage");
        wgmma_wait(k, 0);
        self.release(k, self.lane0);
    }

    /// Arrives (where `when`) on the empty barrier of the stage before `step`.
    fn release(&self, k: &mut Kernel, when: Reg) {
        let count = self.pipe.count;
        let prev = k.add_u32(&self.step, &(count - 1));
        let prev = k.op2("rem.u32", RegClass::B32, &prev, &count);
        let empty = k.mad_u32(&prev, &MBARRIER_BYTES, &self.pipe.empty);
        mbarrier_arrive(k, &empty, Some(when));
    }
}

/// A kernel splitting K: its parameters, the shared flags on which each consumer learns whether
/// its item finished the tile, and the parts.
struct Split {
    partials: Reg,
    counters: Reg,
    flags: String,
    splits: u32,
}

/// Named barrier of a consumer's split sums: this plus the consumer (0 is the whole block's; 1
/// and 2 order consumers taking turns, which never split K).
const SPLIT_BARRIER: u32 = 3;
/// Accumulators whose sums of every part a consumer thread adds up before the next ones (bounds
/// the registers the loads in flight may take).
const SUMS_AT_ONCE: usize = 64;

impl Split {
    /// Stores the consumer's sums of `item` into its part's partials (register by register, the
    /// warpgroup's 128 threads side by side) and counts the part done on the tile's counter of
    /// this consumer. Returns whether this part finished the tile; its accumulators then hold
    /// the sum of every part's, added in part order.
    fn add_parts(
        &self,
        k: &mut Kernel,
        acc: &[Reg],
        item: &Item,
        [tid, consumer]: [Reg; 2],
    ) -> Reg {
        k.comment(
            "K split: this part's sums into the partials; the tile's last part adds them all",
        );
        let thread = k.op2("and.b32", RegClass::B32, &tid, &127u32);
        let part_sums = |k: &mut Kernel, part: &Reg| {
            let index = k.mad_u32(&item.tile, &self.splits, part);
            let index = k.mad_u32(&index, &(CONSUMERS as u32), &consumer);
            let first = k.mul_u32(&index, &(acc.len() as u32 * 128));
            let first = k.add_u32(&first, &thread);
            k.address(self.partials, &first, 4)
        };
        let mine = part_sums(k, &item.part);
        crate::reduce::store_side_by_side(k, &mine, acc);
        let counter = k.mad_u32(&item.tile, &(CONSUMERS as u32), &consumer);
        let counter = k.address(self.counters, &counter, 4);
        let leader = k.setp("eq.u32", &thread, &0u32);
        let flag = k.shared_base(&self.flags);
        let flag = k.mad_u32(&consumer, &4u32, &flag);
        let barrier = k.add_u32(&consumer, &SPLIT_BARRIER);
        let last = crate::reduce::last_arrival(
            k,
            [counter, leader],
            &self.splits,
            &format!("bar.sync {barrier}, 128"),
            &flag.to_string(),
        );
        let done = k.label("parts_added");
        k.bra(Some((last, false)), &done);
        // Part by part, each part's sums all loaded before any is added (a loop: unrolled, the
        // loads of later parts were hoisted until the registers spilled).
        let first = {
            let zero = k.mov(RegClass::B32, &0u32);
            part_sums(k, &zero)
        };
        let part_bytes = CONSUMERS as u32 * acc.len() as u32 * crate::reduce::SIDE_BY_SIDE;
        for a in acc {
            k.set(*a, &F32(0.0));
        }
        let part = k.mov(RegClass::B32, &0u32);
        let top = k.label("add_part");
        k.place(&top);
        let sums = k.address(first, &part, part_bytes);
        for (c, chunk) in acc.chunks(SUMS_AT_ONCE).enumerate() {
            let loaded: Vec<Reg> = (0..chunk.len())
                .map(|j| crate::reduce::load_side_by_side(k, &sums, (c * SUMS_AT_ONCE + j) as u32))
                .collect();
            for (a, v) in chunk.iter().zip(&loaded) {
                k.emit(format!("add.f32 {a}, {a}, {v}"));
            }
        }
        k.emit(format!("add.u32 {part}, {part}, 1"));
        let more = k.setp("lt.u32", &part, &self.splits);
        k.bra(Some((more, true)), &top);
        k.place(&done);
        last
    }
}

/// The epilogue of 64 rows from `rows0`: thread `t` of a consumer warpgroup holds, for each
/// 8-column chunk `j`, the columns `8 j + 2 (t % 4) + {0, 1}` of rows
/// `16 (t / 32 % 4) + (t % 32) / 4 + {0, 8}` (registers `4 j + {0, 1}` and `4 j + {2, 3}`).
/// The epilogue from registers of a row half's accumulators (its 64 rows from `rows0`): pairs
/// finished and stored (with the rows' sums of squares where the product writes them), or over
/// an odd N element by element.
fn store(
    k: &mut Kernel,
    (cfg, tile): (&GemmConfig, Tile),
    (epilogue, sums_out): (&EpiloguePtrs, Option<Reg>),
    acc: &[Reg],
    tid: &Reg,
    [rows0, n0]: [Reg; 2],
) {
    k.comment("epilogue on the accumulators");
    let frag = Fragment::of(k, acc, tid, rows0, n0);
    if cfg.n_out().is_multiple_of(2) {
        let mut sums = sums_out.map(|out| RowSums::new(k, out));
        store_pairs(k, cfg, epilogue, &frag, sums.as_mut());
        if let Some(sums) = sums {
            sums.store(k, (cfg, tile), &frag, (tid, &n0));
        }
    } else {
        store_elements(k, cfg, epilogue, &frag);
    }
}

/// The first of a consumer thread's two fragment rows (the second is 8 further) among the 64
/// rows from `rows0`: `rows0 + 16 warp + quad`, `quad` being its lane's quarter (`lane / 4`).
fn fragment_row(k: &mut Kernel, place: &WarpgroupThread, quad: &Reg, rows0: &Reg) -> Reg {
    let first = k.mad_u32(&place.warp, &16u32, rows0);
    k.add_u32(&first, quad)
}

/// A thread's accumulators and the output row and column of its first one.
struct Fragment<'a> {
    acc: &'a [Reg],
    row0: Reg,
    col0: Reg,
}

impl<'a> Fragment<'a> {
    /// The fragment of thread `tid` of a consumer warpgroup over the 64 rows from `rows0`.
    fn of(k: &mut Kernel, acc: &'a [Reg], tid: &Reg, rows0: Reg, n0: Reg) -> Self {
        let place = WarpgroupThread::of(k, tid);
        let quad = k.op2("shr.u32", RegClass::B32, &place.lane, &2u32);
        let pair = k.op2("and.b32", RegClass::B32, &place.lane, &3u32);
        let row0 = fragment_row(k, &place, &quad, &rows0);
        let col0 = k.mad_u32(&pair, &2u32, &n0);
        Fragment { acc, row0, col0 }
    }

    /// Chunks of 8 output columns per tile: four accumulators each, the up half's four more
    /// with SwiGLU.
    fn chunks(&self, cfg: &GemmConfig) -> u32 {
        let per_chunk = if cfg.swiglu { 8 } else { 4 };
        self.acc.len() as u32 / per_chunk
    }

    /// The accumulator of chunk `j`, row half `h`, column `c` (0, 1), and with SwiGLU the
    /// matching up column's (half the accumulators further).
    fn at(&self, cfg: &GemmConfig, j: u32, h: u32, c: u32) -> (Reg, Option<Reg>) {
        let i = (4 * j + 2 * h + c) as usize;
        (
            self.acc[i],
            cfg.swiglu.then(|| self.acc[i + self.acc.len() / 2]),
        )
    }
}

/// The most sums per row a product scales its rows by ([`RowNorm::Scale`]): each consumer
/// thread holds its rows' sums through its products, loaded ahead of them, and more spill
/// beside a wide tile's accumulators (ptxas, 2026-12-06: Llama-3.1-8B's 64 a row, from a
/// 64-wide residual product over 4096 columns, and Qwen2-7B's 28 and 56).
pub const MAX_ROW_SUM_PARTS: u32 = 16;

/// A product's [`RowNorm`] parameter: where it writes its rows' sums of squares (`row_sums`),
/// or reads those it scales its rows by (`norm_sums`).
#[derive(Clone, Copy)]
enum NormParam {
    Sums(Reg),
    Scale { sums: Reg, parts: u32, eps: f32 },
}

impl NormParam {
    /// Where a product that scales its rows loads each row half's sums ([`RowSumLoads`]; the
    /// halves' first rows from `half_rows`); none for other products.
    fn loads(
        norm: Option<NormParam>,
        k: &mut Kernel,
        cfg: &GemmConfig,
        tid: &Reg,
        halves: u32,
        half_rows: impl Fn(&mut Kernel, u32) -> Reg,
    ) -> Vec<RowSumLoads> {
        let Some(NormParam::Scale { sums, parts, eps }) = norm else {
            return Vec::new();
        };
        (0..halves)
            .map(|half| {
                let rows0 = half_rows(k, half);
                RowSumLoads::issue(k, cfg, (sums, parts, eps), tid, &rows0)
            })
            .collect()
    }

    /// Where a product that writes its rows' sums stores them.
    fn sums_out(norm: Option<NormParam>) -> Option<Reg> {
        match norm {
            Some(NormParam::Sums(out)) => Some(out),
            _ => None,
        }
    }

    /// The parameter `cfg`'s row norm takes, if any (declared after the epilogue's and the
    /// split's).
    fn declare(k: &mut Kernel, cfg: &GemmConfig, tile: Tile) -> Option<NormParam> {
        let norm = cfg.row_norm?;
        Some(match norm {
            RowNorm::Sums => {
                assert!(
                    !tile.swiglu && cfg.n.is_multiple_of(2),
                    "row sums are written over an even N without SwiGLU"
                );
                NormParam::Sums(k.param_ptr("row_sums"))
            }
            RowNorm::Scale { parts, eps } if parts <= MAX_ROW_SUM_PARTS => NormParam::Scale {
                sums: k.param_ptr("norm_sums"),
                parts,
                eps,
            },
            RowNorm::Scale { parts, .. } => {
                panic!("{parts} row sums a row, more than {MAX_ROW_SUM_PARTS}")
            }
        })
    }
}

/// A thread's two fragment rows' sums of squares (of the 64 rows from `rows0`), the `parts`
/// a row that the product before wrote, loaded ahead of the products and added up after them
/// ([`RowSumLoads::scales`]), so that no consumer waits for them before its first wgmma; a
/// row past M reads row 0's and is never stored.
struct RowSumLoads {
    rows: [Vec<Reg>; 2],
    eps: f32,
}

impl RowSumLoads {
    fn issue(
        k: &mut Kernel,
        cfg: &GemmConfig,
        (sums, parts, eps): (Reg, u32, f32),
        tid: &Reg,
        rows0: &Reg,
    ) -> Self {
        let place = WarpgroupThread::of(k, tid);
        let quad = k.op2("shr.u32", RegClass::B32, &place.lane, &2u32);
        let row0 = fragment_row(k, &place, &quad, rows0);
        let rows = [0u32, 1].map(|h| {
            let row = k.add_u32(&row0, &(8 * h));
            let inside = k.setp("lt.u32", &row, &cfg.m);
            let row = k.selp(RegClass::B32, "u32", &row, &0u32, inside);
            let at = k.mul_u32(&row, &parts);
            let base = k.address(sums, &at, 4);
            (0..parts)
                .map(|p| {
                    let v = k.reg(RegClass::F32);
                    k.emit(format!("ld.global.f32 {v}, [{base}+{}]", 4 * p));
                    v
                })
                .collect()
        });
        RowSumLoads { rows, eps }
    }

    /// Each row's `1/rms`: `1 / sqrt(sum / K + eps)`.
    fn scales(self, k: &mut Kernel, cfg: &GemmConfig) -> [Reg; 2] {
        let eps = self.eps;
        self.rows.map(|values| {
            let total = values
                .into_iter()
                .reduce(|a, b| k.add_f32(&a, &b))
                .expect("a row has at least one part");
            let mean = k.fma_f32(&total, &F32(1.0 / cfg.k as f32), &F32(eps));
            k.rsqrt_f32(&mean)
        })
    }
}

/// Scales a thread's accumulators by their rows' factors: of chunk `j`'s four, the first two are
/// its fragment's first row and the last two its second, 8 rows further ([`Fragment::at`]),
/// SwiGLU's up half alike.
fn scale_rows(k: &mut Kernel, acc: &[Reg], scales: &[Reg; 2]) {
    for (i, a) in acc.iter().enumerate() {
        let s = scales[(i % 4) / 2];
        k.emit(format!("mul.rn.f32 {a}, {a}, {s}"));
    }
}

/// A thread's running sums of squares of its two fragment rows' finished outputs over one tile
/// ([`RowNorm::Sums`]), from the rounded values the tile stores, and where they go (`row_sums`).
struct RowSums {
    sums: [Reg; 2],
    out: Reg,
}

impl RowSums {
    fn new(k: &mut Kernel, out: Reg) -> RowSums {
        RowSums {
            sums: [0, 1].map(|_| k.mov(RegClass::F32, &F32(0.0))),
            out,
        }
    }

    /// Adds chunk `j`'s finished words (one per row half); columns past N count nothing.
    fn add(&mut self, k: &mut Kernel, cfg: &GemmConfig, frag: &Fragment, j: u32, words: &[Reg; 2]) {
        let col = k.add_u32(&frag.col0, &(8 * j));
        let inside = k.setp("lt.u32", &col, &cfg.n_out());
        for (sum, &word) in self.sums.iter_mut().zip(words) {
            let [a, b] = pair(k, cfg.elem, word);
            let s = k.fma_f32(&a, &a, sum);
            let s = k.fma_f32(&b, &b, &s);
            *sum = k.selp(RegClass::F32, "f32", &s, sum, inside);
        }
    }

    /// Adds up each row's sums over the four lanes that hold it and stores them at the row's
    /// place for the tile's columns (`n0`), for rows inside M.
    fn store(
        self,
        k: &mut Kernel,
        (cfg, tile): (&GemmConfig, Tile),
        frag: &Fragment,
        (tid, n0): (&Reg, &Reg),
    ) {
        let parts = cfg.n_out().div_ceil(tile.columns());
        let part = k.op2("div.u32", RegClass::B32, n0, &tile.columns());
        let lane = k.op2("and.b32", RegClass::B32, tid, &3u32);
        let leader = k.setp("eq.u32", &lane, &0u32);
        for (h, sum) in (0u32..).zip(self.sums) {
            let mut total = sum;
            for offset in [1u32, 2] {
                let other = k.reg(RegClass::F32);
                k.emit(format!(
                    "shfl.sync.bfly.b32 {other}, {total}, {offset}, 31, -1"
                ));
                total = k.add_f32(&total, &other);
            }
            let row = k.add_u32(&frag.row0, &(8 * h));
            let inside = k.setp("lt.u32", &row, &cfg.m);
            let ok = k.reg(RegClass::Pred);
            k.emit(format!("and.pred {ok}, {inside}, {leader}"));
            let at = k.mad_u32(&row, &parts, &part);
            let addr = k.address(self.out, &at, 4);
            k.emit(format!("@{ok} st.global.f32 [{addr}], {total}"));
        }
    }
}

/// Words of bias and residual a consumer thread loads before storing any: the epilogue loads
/// the operands of a group of chunks at once, then finishes and stores them, since a load
/// issued after a store to `out` (which may be the residual's buffer) would wait for it.
const EPILOGUE_WORDS: u32 = 48;

/// The epilogue for an even N: each pair of columns is finished and stored as one 32-bit word,
/// its bias and residual read as words too; out-of-range places load from element 0 and store
/// nothing, so there are no branches and a group's loads are all in flight at once.
fn store_pairs(
    k: &mut Kernel,
    cfg: &GemmConfig,
    epilogue: &EpiloguePtrs,
    frag: &Fragment,
    mut sums: Option<&mut RowSums>,
) {
    let n_out = cfg.n_out();
    let rows: Vec<(Reg, Reg)> = (0..2u32)
        .map(|h| {
            let row = k.add_u32(&frag.row0, &(8 * h));
            let ok = k.setp("lt.u32", &row, &cfg.m);
            (ok, k.mul_u32(&row, &n_out))
        })
        .collect();
    let chunks = frag.chunks(cfg);
    let group = EPILOGUE_WORDS
        .checked_div(PairOperands::words(cfg))
        .unwrap_or(chunks)
        .clamp(1, chunks);
    for first in (0..chunks).step_by(group as usize) {
        let group: Vec<u32> = (first..chunks.min(first + group)).collect();
        let loaded: Vec<PairOperands> = group
            .iter()
            .map(|&j| {
                let place = PairPlace::of(k, cfg, frag, &rows, j);
                PairOperands::load(k, cfg, epilogue, &place, None)
            })
            .collect();
        for (&j, operands) in group.iter().zip(&loaded) {
            // The place again rather than held since the loads: fewer live registers.
            let place = PairPlace::of(k, cfg, frag, &rows, j);
            let words = store_chunk(k, cfg, epilogue, frag, j, &place, operands);
            if let Some(sums) = sums.as_deref_mut() {
                sums.add(k, cfg, frag, j, &words);
            }
        }
    }
}

/// Where a thread's pairs of chunk `j` go: the column, and per row half whether the pair is
/// inside the output and its element index (0 when outside, so that loads stay in bounds).
struct PairPlace {
    safe_col: Reg,
    rows: Vec<(Reg, Reg)>,
}

impl PairPlace {
    fn of(k: &mut Kernel, cfg: &GemmConfig, frag: &Fragment, rows: &[(Reg, Reg)], j: u32) -> Self {
        let col = k.add_u32(&frag.col0, &(8 * j));
        let col_ok = k.setp("lt.u32", &col, &cfg.n_out());
        let safe_col = k.selp(RegClass::B32, "u32", &col, &0u32, col_ok);
        let rows = rows
            .iter()
            .map(|(row_ok, row_start)| {
                let ok = k.reg(RegClass::Pred);
                k.emit(format!("and.pred {ok}, {row_ok}, {col_ok}"));
                let oi = k.add_u32(row_start, &col);
                (ok, k.selp(RegClass::B32, "u32", &oi, &0u32, ok))
            })
            .collect();
        PairPlace { safe_col, rows }
    }
}

/// A chunk's epilogue operands as loaded words (two halves each): bias, up bias, residual per
/// row half.
struct PairOperands {
    bias: Option<Reg>,
    bias_up: Option<Reg>,
    residual: Vec<Reg>,
}

impl PairOperands {
    /// A chunk without operands (no bias, no residual).
    fn none() -> Self {
        PairOperands {
            bias: None,
            bias_up: None,
            residual: Vec::new(),
        }
    }

    /// Words a chunk's operands take: its bias (and up bias), its residual of both row halves.
    fn words(cfg: &GemmConfig) -> u32 {
        u32::from(cfg.bias) * (1 + u32::from(cfg.swiglu)) + 2 * u32::from(cfg.residual)
    }

    /// The chunk's operands at `place`: the residual's words as `resident` holds them (both row
    /// halves, read from shared memory) or loaded.
    fn load(
        k: &mut Kernel,
        cfg: &GemmConfig,
        epilogue: &EpiloguePtrs,
        place: &PairPlace,
        resident: Option<Vec<Reg>>,
    ) -> Self {
        let bias = epilogue.bias().map(|b| load_word(k, b, &place.safe_col));
        let bias_up = match (epilogue.bias(), cfg.swiglu) {
            (Some(b), true) => {
                let up = k.add_u32(&place.safe_col, &cfg.n_out());
                Some(load_word(k, b, &up))
            }
            _ => None,
        };
        let residual = match resident {
            Some(words) => words,
            None => match epilogue.residual() {
                Some(r) => place
                    .rows
                    .iter()
                    .map(|(_, oi)| load_word(k, r, oi))
                    .collect(),
                None => Vec::new(),
            },
        };
        PairOperands {
            bias,
            bias_up,
            residual,
        }
    }
}

/// Finishes chunk `j`'s pairs with their loaded operands, stores those inside the output and
/// returns them (both row halves' words).
fn store_chunk(
    k: &mut Kernel,
    cfg: &GemmConfig,
    epilogue: &EpiloguePtrs,
    frag: &Fragment,
    j: u32,
    place: &PairPlace,
    operands: &PairOperands,
) -> [Reg; 2] {
    let words = finish_chunk(k, cfg, frag, j, operands);
    for ((ok, oi), word) in place.rows.iter().zip(words) {
        let addr = k.address(epilogue.out(), oi, 2);
        k.emit(format!("@{ok} st.global.b32 [{addr}], {word}"));
    }
    words
}

/// Chunk `j`'s pairs of both row halves finished with their loaded operands, as words.
fn finish_chunk(
    k: &mut Kernel,
    cfg: &GemmConfig,
    frag: &Fragment,
    j: u32,
    operands: &PairOperands,
) -> [Reg; 2] {
    let bias = operands.bias.map(|w| pair(k, cfg.elem, w));
    let bias_up = operands.bias_up.map(|w| pair(k, cfg.elem, w));
    [0u32, 1].map(|h| {
        let residual = operands
            .residual
            .get(h as usize)
            .map(|&w| pair(k, cfg.elem, w));
        let v: Vec<Reg> = (0..2)
            .map(|c| {
                let (v, up) = frag.at(cfg, j, h, c);
                let addends = Addends {
                    bias: bias.map(|p| p[c as usize]),
                    bias_up: bias_up.map(|p| p[c as usize]),
                    residual: residual.map(|p| p[c as usize]),
                };
                apply(k, cfg, v, up, &addends)
            })
            .collect();
        let word = k.reg(RegClass::B32);
        // The first operand goes to the upper half.
        k.emit(format!(
            "cvt.rn.{}x2.f32 {word}, {}, {}",
            cfg.elem.name(),
            v[1],
            v[0]
        ));
        word
    })
}

/// A word's two halves as f32, the lower first.
fn pair(k: &mut Kernel, elem: Elem, word: Reg) -> [Reg; 2] {
    let halves = k.unpack_halves(elem, &[word]);
    [halves[0], halves[1]]
}

/// The 32-bit word of two adjacent halves at element `i` (even) of `base`.
fn load_word(k: &mut Kernel, base: Reg, i: &Reg) -> Reg {
    let addr = k.address(base, i, 2);
    let word = k.reg(RegClass::B32);
    k.emit(format!("ld.global.b32 {word}, [{addr}]"));
    word
}

/// The epilogue for an odd N (rows are not 4-byte aligned): element by element, each finished
/// and stored by [`EpiloguePtrs::finish`] when inside the matrix.
fn store_elements(k: &mut Kernel, cfg: &GemmConfig, epilogue: &EpiloguePtrs, frag: &Fragment) {
    let n_out = cfg.n_out();
    for h in 0..2u32 {
        let skip_rows = k.label("rows_done");
        let row = k.add_u32(&frag.row0, &(8 * h));
        let out_row = k.setp("ge.u32", &row, &cfg.m);
        k.bra(Some((out_row, true)), &skip_rows);
        for j in 0..frag.chunks(cfg) {
            for c in 0..2u32 {
                let skip = k.label("element_done");
                let col = k.add_u32(&frag.col0, &(8 * j + c));
                let out_col = k.setp("ge.u32", &col, &n_out);
                k.bra(Some((out_col, true)), &skip);
                let (v, up) = frag.at(cfg, j, h, c);
                epilogue.finish(k, cfg, v, up, &col, |k| k.mad_u32(&row, &n_out, &col));
                k.place(&skip);
            }
        }
        k.place(&skip_rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tilings_producer_and_consumers_share_the_registers_held_at_launch() {
        for (tiling, _) in TILINGS {
            let (producer, consumers) = registers(tiling);
            // `setmaxnreg.inc` waits forever for registers the block does not hold.
            assert_eq!(128 * producer + 256 * consumers, LAUNCH_REGS * THREADS);
            assert!(producer >= 24 && producer % 8 == 0 && consumers % 8 == 0);
        }
        assert_eq!(LAUNCH_REGS, 168);
    }

    fn product(m: u32, n: u32, k: u32, swiglu: bool) -> GemmConfig {
        GemmConfig {
            swiglu,
            ..GemmConfig::plain(m, n, k, Elem::BF16)
        }
    }

    #[test]
    fn products_of_many_tiles_keep_the_widest_staged() {
        // Llama-3.2-1B's down product at 4096 tokens (K = 8192), the square products, BERT-base's
        // products at 128 x 128 tokens (K = 768 and 3072), Llama-3.2-1B's QKV, O, SwiGLU gate/up
        // and LM head at 4096 tokens (K = 2048).
        for (m, n, k, swiglu) in [
            (4096, 2048, 8192, false),
            (4096, 4096, 4096, false),
            (8192, 8192, 8192, false),
            (16384, 768, 3072, false),
            (16384, 2304, 768, false),
            (16384, 768, 768, false),
            (16384, 3072, 768, false),
            (4096, 3072, 2048, false),
            (4096, 2048, 2048, false),
            (4096, 16384, 2048, true),
            (4096, 128256, 2048, false),
        ] {
            let t = tiling(&product(m, n, k, swiglu));
            assert_eq!(t, Tiling::together(256).staged(), "{m}x{n}x{k}");
        }
    }

    #[test]
    fn products_staging_does_not_fit_store_from_registers() {
        // GPT-2's LM head (an odd N: rows of 50257 halves are not 16-byte multiples) at 1024
        // tokens takes turns over its many tiles of short K; SwiGLU tiles 192 wide have 96 output
        // columns, not whole 64-column boxes.
        let odd = product(1024, 50257, 768, false);
        assert_eq!(tiling(&odd), Tiling::ping_pong(128));
        assert!(!staged_fits(&odd, Tiling::together(256).staged()));
        let swiglu = product(4096, 16384, 2048, true);
        assert!(!staged_fits(&swiglu, Tiling::together(192).staged()));
        assert!(staged_fits(&swiglu, Tiling::together(128).staged()));
        // Near miss: an even N of 16-byte rows fits.
        assert!(staged_fits(
            &product(1024, 50264, 768, false),
            Tiling::together(256).staged()
        ));
    }

    #[test]
    fn consumers_take_turns_only_where_no_staged_tiling_fits() {
        // Llama-3.1-8B's QKV at 1024 rows (192 tiles 256 wide, 384 of 128) and GPT-2's QKV over
        // 2048 rows (K = 768), which the model had them take turns on: staged 192 wide.
        let wide = Tiling::together(192).staged();
        assert_eq!(tiling(&product(1024, 6144, 4096, false)), wide);
        assert_eq!(tiling(&product(2048, 2304, 768, false)), wide);
        // Near miss: GPT-2's LM head (an odd N) stages nowhere and still takes turns.
        let odd = product(2048, 50257, 768, false);
        assert!(TILINGS.iter().all(|&(t, _)| !t.staged || !fits(&odd, t)));
        assert_eq!(tiling(&odd), Tiling::ping_pong(128));
    }

    #[test]
    fn products_of_few_tiles_spread_over_more_sms() {
        // GPT-2 small at 1024 tokens: 24 tiles of 768 columns become 96.
        assert_eq!(tiling(&product(1024, 768, 3072, false)).width, 64);
        // 16 rows: 12 tiles become 48, K whole (64 rows of it measured 5.7 us so, 7.6 in two
        // parts of K).
        assert_eq!(
            tiling(&product(16, 3072, 768, false)),
            Tiling::together(64).staged()
        );
        // Llama-3.2-1B's QKV at 512 tokens: 48 tiles, 96 at 128 wide still one wave.
        assert_eq!(
            tiling(&product(512, 3072, 2048, false)),
            Tiling::together(128).staged()
        );
    }

    #[test]
    fn products_a_quarter_short_at_256_wide_take_192() {
        // Llama-3.2-1B's QKV at 1024 tokens: 96 tiles at 256 wide, 128 at 192; GPT-2's at 1024
        // tokens (2304 columns, K = 768): 72 and 96.
        let wide = Tiling::together(192).staged();
        assert_eq!(tiling(&product(1024, 3072, 2048, false)), wide);
        assert_eq!(tiling(&product(1024, 2304, 768, false)), wide);
        // Near misses: where 256 wide already fills the SMs, or 192 wide needs a round more.
        assert_ne!(tiling(&product(1024, 4096, 4096, false)), wide);
        assert_ne!(tiling(&product(1024, 16384, 2048, true)), wide);
        assert_ne!(tiling(&product(1024, 128256, 2048, false)), wide);
        assert_ne!(tiling(&product(4096, 3072, 2048, false)), wide);
    }

    #[test]
    fn products_leaving_most_sms_idle_split_k() {
        // Llama-3.2-1B's decode step at 32 and 64 sequences: the down (K = 8192), O and QKV
        // products, 32 to 48 tiles unsplit, become one wave of parts.
        for m in [32, 64] {
            for (n, k) in [(2048, 8192), (2048, 2048), (3072, 2048)] {
                let cfg = product(m, n, k, false);
                let t = tiling(&cfg);
                let items = Tile::new(&cfg, t).items(&cfg);
                assert!(t.splits > 1, "{m}x{n}x{k}: {}", t.label());
                assert!(
                    (GRID / 2..=SPLIT_WAVE).contains(&items),
                    "{m}x{n}x{k}: {items}"
                );
            }
        }
        // A split product's partials and counters are its scratch, not the node's operands;
        // an unsplit one has none.
        let split = gemm_wgmma(&product(32, 2048, 8192, false), "s".into());
        assert_eq!(split.scratch, ["partials", "counters"]);
        let params: Vec<&str> = split.signature.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(params, ["x", "w", "out", "partials", "counters"]);
        let operands: Vec<&str> = split.operand_params().collect();
        assert_eq!(operands, ["x", "w", "out"]);
        let whole = gemm_wgmma(&product(4096, 2048, 8192, false), "w".into());
        assert!(whole.scratch.is_empty());
    }

    #[test]
    fn long_k_takes_a_wide_tile_in_two_parts_over_a_narrow_one_whole() {
        // Measured 11-40% faster (H100, 2026-12-06): Llama-3.2-1B's down product at 320-512
        // rows, Llama-3.1-8B's and Qwen2-7B's at 192 and 256, Llama-3.1-8B's QKV at 16-64.
        for (m, n, k) in [
            (512, 2048, 8192),
            (320, 2048, 8192),
            (256, 4096, 14336),
            (192, 3584, 18944),
            (64, 6144, 4096),
            (16, 6144, 4096),
        ] {
            let cfg = product(m, n, k, false);
            assert_eq!(tiling(&cfg), Tiling::together(128).split(2), "{m}x{n}x{k}");
        }
    }

    #[test]
    fn splits_that_need_a_second_wave_or_lose_stay_unsplit() {
        // A second wave: the down product at 1024 rows (2 parts of 128 tiles), Llama-3.1-8B's at
        // 384 (measured 28% slower in 4 parts), the decode step's gate/up with SwiGLU, GPT-2's
        // FFN down at 1024 rows. Measured 11-31% slower split: Llama-3.1-8B's QKV at 128 rows and
        // O at 256, GPT-2's QKV at 64.
        for cfg in [
            product(64, 2304, 768, false),
            product(1024, 2048, 8192, false),
            product(384, 4096, 14336, false),
            product(64, 16384, 2048, true),
            product(1024, 768, 3072, false),
            product(128, 6144, 4096, false),
            product(256, 4096, 4096, false),
        ] {
            assert_eq!(tiling(&cfg).splits, 1, "{cfg:?}");
        }
    }

    #[test]
    fn split_parts_cover_k() {
        // Every part that fits has at least MIN_SPLIT_STEPS steps and the last is not empty;
        // products of one K step do not split.
        for k in [64, 128, 200, 776, 2048, 4104, 8192, 8200] {
            let cfg = product(64, 2048, k, false);
            let steps = k.div_ceil(BK);
            for (tiling, _) in TILINGS {
                for splits in 2..=MAX_SPLITS {
                    let t = tiling.split(splits);
                    if !splits_fit(&cfg, t) {
                        continue;
                    }
                    let per_part = Tile::new(&cfg, t).part_steps(steps);
                    assert!(
                        !t.ping_pong && per_part >= MIN_SPLIT_STEPS,
                        "{k}: {}",
                        t.label()
                    );
                    assert!((splits - 1) * per_part < steps, "{k}: {}", t.label());
                }
            }
            assert!(k > BK || tiling(&cfg).splits == 1);
        }
    }

    #[test]
    fn every_tiling_fits_the_shared_memory() {
        // The widest staged tile without SwiGLU gives up a stage for its staging regions; every
        // other tiling keeps all four; none passes the 227 KB a block may take.
        for swiglu in [false, true] {
            let cfg = product(4096, 4096, 4096, swiglu);
            for (t, _) in TILINGS.iter().filter(|(t, _)| fits(&cfg, *t)) {
                let tile = Tile::new(&cfg, *t);
                let want = if t.staged && t.width == 256 && !swiglu {
                    3
                } else {
                    STAGES
                };
                assert_eq!(tile.stages(), want, "{} swiglu {swiglu}", t.label());
                assert!(
                    tile.shared_bytes() + STATIC_SHARED <= MAX_SHARED,
                    "{}",
                    t.label()
                );
            }
        }
    }

    #[test]
    fn a_staged_residual_tile_is_copied_in_while_the_consumers_multiply() {
        // BERT-base's O product (+ bias + residual): staged, the residual is a tensor map whose
        // tile one thread per consumer copies in at the middle K step (guarded, no branch while
        // products are in flight), read back with `ldmatrix` where the finished pairs go.
        let cfg = GemmConfig {
            bias: true,
            residual: true,
            ..product(16384, 768, 768, false)
        };
        let param = |kernel: &GeneratedKernel| {
            kernel
                .signature
                .iter()
                .find(|(name, _)| name == "residual")
                .map(|(_, ty)| *ty)
        };
        let staged = gemm_wgmma_tiled(&cfg, Tiling::together(256).staged(), "s".into());
        assert!(matches!(
            param(&staged),
            Some(kiln_ir::artifact::ParamType::TensorMap(_))
        ));
        assert!(staged.ptx.contains("ldmatrix"));
        let loads = staged
            .ptx
            .lines()
            .filter(|l| l.contains("cp.async.bulk.tensor") && l.contains("shared::cluster.global"));
        // x, w and the residual's four 64-column boxes, each its own line.
        assert_eq!(loads.count(), 2 + 4);
        assert!(staged.ptx.contains("cp.async.bulk.wait_group.read 0;"));
        // Near misses: stored from registers, over long K (the down product's 3072), or without
        // a residual, nothing is copied in.
        let unstaged = gemm_wgmma_tiled(&cfg, Tiling::together(256), "u".into());
        assert_eq!(param(&unstaged), Some(kiln_ir::artifact::ParamType::Ptr));
        assert!(!unstaged.ptx.contains("ldmatrix"));
        let down = GemmConfig {
            k: 3072,
            ..cfg.clone()
        };
        let long = gemm_wgmma_tiled(&down, Tiling::together(256).staged(), "l".into());
        assert_eq!(param(&long), Some(kiln_ir::artifact::ParamType::Ptr));
        assert!(!copies_residual(&down, Tiling::together(256).staged()));
        let plain = GemmConfig {
            residual: false,
            ..cfg
        };
        let plain = gemm_wgmma_tiled(&plain, Tiling::together(256).staged(), "p".into());
        assert!(!plain.ptx.contains("ldmatrix") && param(&plain).is_none());
    }

    #[test]
    fn a_narrower_tile_that_needs_more_waves_loses() {
        // GPT-2's QKV at 1024 tokens: 96 tiles at 192 wide in one wave; 128 or 64 wide take two
        // or three, and taking turns over two tiles a block does not pay.
        let picked = tiling(&product(1024, 2304, 768, false));
        assert_eq!(picked, Tiling::together(192).staged());
        assert!(TILINGS
            .iter()
            .filter(|(t, _)| t.width < 192)
            .all(|(t, _)| *t != picked));
    }
}
