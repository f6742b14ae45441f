//! Products with few rows (decode: M = batch <= 8, or 16 in row groups) against `[N, K]` weights: matrix-vector
//! kernels. A GEMM tile of 64 or 128 columns leaves most SMs idle when M is 1 (GPT-2's
//! 768-column products are 12 blocks), and their time is bound by reading the weights once.
//!
//! - Tensor cores (f16/bf16, K a multiple of 8; several rows of x, or every row count when an
//!   artifact needs batch invariance, [`Rows`]): the weights are `mma.m16n8k16`'s A operand. A
//!   block owns 16 output columns (the `m16`) and all rows of x (its `n8`); its 16 warps take
//!   every 16th 32-wide step of K. A lane loads 16 bytes of each of its two weight rows (8
//!   consecutive k) and 16 bytes of its x row at the same k, and feeds them to two products
//!   unconverted: the products pair the same k of both operands whatever their order, so the
//!   fragments need no shuffling, and the cost per weight byte does not grow with the rows of x.
//!   The warps' partial sums meet in shared memory; one thread per output finishes it with the
//!   epilogue (bias, activation or SwiGLU, residual) in the GEMM's order. With SwiGLU the lanes
//!   also stream the matching up rows `n + N/2`. [`gemv_normed`] first normalises the rows of x
//!   into shared memory (a decode layer's RMSNorm or LayerNorm), saving the norm's launch. The
//!   weights of a warp's first K steps are loaded before the kernel waits for the one before it
//!   (programmatic dependent launch: no kernel writes weights), so that they stream in under
//!   that kernel's tail and under the prologue.
//! - One column per warp (f32, K not a multiple of 8, and one row of x otherwise): a warp's
//!   lanes stream its weight row along K with 16-byte loads (coalesced, four chunks in flight at
//!   once, the first four, or in a grid of one wave the warp's whole share, loaded before the
//!   wait for the kernel before, with the column's bias; the residual right after the wait),
//!   multiply it by every x row, and reduce with shuffles; lane 0 applies the epilogue.
//!   Rows longer than 8 KB are shared by up to 8 warps, whose sums meet in shared memory.

use kiln_ir::kernel::NormKind;

use crate::gemm::{apply, Addends, EpiloguePtrs, GemmConfig};
use crate::norm::NormConfig;
use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

/// The most rows the kernels take in one block (the accumulators are registers; the tensor-core
/// kernel's `n8`).
pub const MAX_ROWS: u32 = 8;
/// The most rows the tensor-core kernel takes for a batch-invariant artifact, in blocks of
/// [`MAX_ROWS`] rows each (`row_groups`). The groups of a column block re-read its weight rows
/// from L2 and each repeats the norm prologue, which stops paying past two groups (H200,
/// Llama-3.2-1B shape, bf16 decode per step: 16 rows 1.93 ms against 3.18 on the Hopper GEMM; 64
/// rows 5.73 against 3.57, the gate/up product 181 against 34 us).
pub const MAX_GROUPED_ROWS: u32 = 16;
/// Warps (output columns) per block.
const WARPS: u32 = 8;
/// Chunks of K (32 lanes x 16 bytes each) a lane loads before multiplying, while all are inside K.
const UNROLL: u32 = 4;
/// The most 16-byte weight loads a lane of the one-column-per-warp kernel holds across the wait
/// for the kernel before, where the grid is one wave: a warp whose whole share of the weights
/// fits loads it all while that kernel runs. (H200, batch-1 decode: GPT-2 small's 768-column
/// output products of K = 3072, 96 blocks holding 12 loads, made the step 0.250-0.259 ms against
/// 0.262-0.269, and Llama-1B's 2048-column output product, 256 blocks holding 8, 0.844-0.863
/// against 0.852-0.876; in grids of several waves the registers cost blocks, and Llama-1B's step
/// took 0.867-0.882 ms with 8 loads held by every product, 0.918-0.940 with 16, against 0.856.)
const EARLY_LOADS: u32 = 16;
/// Blocks a Hopper-class GPU (132 SMs) holds at once at two per SM, which the registers of 16
/// held loads allow.
const ONE_WAVE: u32 = 256;

/// Whether the weights' and the output's element indices of `cfg` fit the kernels' 32-bit
/// index arithmetic.
fn indices_fit(cfg: &GemmConfig) -> bool {
    crate::check_index_range(&[
        u64::from(cfg.n) * u64::from(cfg.k),
        u64::from(cfg.m) * u64::from(cfg.n),
    ])
}

/// Whether `cfg` is a product this kernel serves: `[N, K]` weights and at most [`MAX_ROWS`] rows.
pub fn supports(cfg: &GemmConfig) -> bool {
    cfg.transpose_b && cfg.m <= MAX_ROWS && indices_fit(cfg)
}

/// Whether `cfg` is a product of more than [`MAX_ROWS`] rows that the tensor-core kernel serves
/// under `rows`: only where decode products must be batch-invariant, so that every decode batch
/// up to [`MAX_GROUPED_ROWS`] takes the kernel a single sequence takes.
pub fn supports_grouped(cfg: &GemmConfig, rows: Rows) -> bool {
    rows == Rows::BatchInvariant
        && cfg.transpose_b
        && cfg.m > MAX_ROWS
        && cfg.m <= MAX_GROUPED_ROWS
        && tensor_cores(cfg, rows)
        && indices_fit(cfg)
}

/// Whether `cfg`, a product of 9 to 16 rows with few output columns and no SwiGLU, streams
/// faster through the tensor-core kernel in row groups than through the Hopper GEMM, whose 128 x
/// 256 tiles gave it at most 8 blocks (H200, Llama-3.2-1B shape at 64 rows: the down projection
/// 56 against 98 us, O 24 against 39; the gate/up product, many columns, 181 against 34; GPT-2
/// small prefill at 32 tokens 0.74 against 1.29 ms). With K split in parts the Hopper GEMM takes
/// more rows (H200, 2026-12-03, the down product of 2048 x 8192 in 8 parts 128 wide against
/// here: 33.9 against 41.6 us at 32 rows, 34.1 against 65.8 at 64, but 34.5 against 30.7 at
/// 16). A batch-invariant artifact's products of 9 to 16 rows take the row groups anyway
/// ([`supports_grouped`]).
pub fn narrow_grouped(cfg: &GemmConfig) -> bool {
    cfg.transpose_b
        && cfg.m > MAX_ROWS
        && cfg.m <= NARROW_ROWS
        && !cfg.swiglu
        && cfg.n_out() <= NARROW_COLUMNS
        && tensor_cores(cfg, Rows::Fastest)
        && indices_fit(cfg)
}

/// The most rows [`narrow_grouped`] takes.
const NARROW_ROWS: u32 = 16;
/// The most output columns [`narrow_grouped`] takes.
const NARROW_COLUMNS: u32 = 2048;

/// Blocks of [`MAX_ROWS`] rows of x the tensor-core kernel's grid holds for each 16 columns.
fn row_groups(cfg: &GemmConfig) -> u32 {
    cfg.m.div_ceil(MAX_ROWS).max(1)
}

/// Generates the kernel `rows` chooses for `cfg`. Parameters: `x, w, [bias], [residual],
/// out`, as the GEMM's.
pub fn gemv_for(cfg: &GemmConfig, name: String, rows: Rows) -> GeneratedKernel {
    assert!(
        supports(cfg) || supports_grouped(cfg, rows) || narrow_grouped(cfg),
        "the GEMV kernel needs [N, K] weights and M <= 8 (more on tensor cores in row groups)"
    );
    assert!(
        cfg.row_norm.is_none(),
        "only the Hopper GEMM carries a row norm"
    );
    if tensor_cores(cfg, rows) {
        gemv_tc(cfg, &name, None)
    } else {
        gemv_simt(cfg, &name, false, None)
    }
}

/// Whether [`gemv_choosing`] serves `cfg` under `rows`: a product (a decode step's LM head) on
/// the one-column-per-warp kernel.
pub fn chooses(cfg: &GemmConfig, rows: Rows) -> bool {
    supports(cfg) && !tensor_cores(cfg, rows) && !cfg.swiglu
}

/// Generates the one-column-per-warp product that also folds each row's greedy choice into the
/// u64 at `best[row]` (`sampling::choice_key` of each output as stored, the block's best by one
/// `red.max` per row; the key must be 0 before the launch, and `sampling::choose_from_keys`
/// reads it and sets it back to 0): a decode step's token without a pass over its logits.
/// Parameters: the product's, then `best`.
pub fn gemv_choosing(cfg: &GemmConfig) -> GeneratedKernel {
    assert!(
        chooses(cfg, Rows::Fastest),
        "the greedy choice needs the one-column-per-warp kernel"
    );
    gemv_simt(cfg, &format!("{}_gemv_choosing", cfg.name()), true, None)
}

/// How the kernels of products with different row counts relate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rows {
    /// Each row count gets its fastest kernel. One row streams faster through the
    /// one-column-per-warp kernel, whose warps read 512 contiguous bytes of a weight row per load
    /// where the tensor-core kernel's read 64 bytes of each of 8 rows (H200, Llama-3.2-1B shape,
    /// bf16: decode 1.08 against 1.41 ms per step); from two rows on the tensor-core kernel pays
    /// for itself (at 8 rows the other issues one x load per row and chunk).
    #[default]
    Fastest,
    /// Every row count of a product takes the same kernel (the tensor-core one where it applies,
    /// its norm prologue included), so a row's result does not depend on the rows beside it: an
    /// artifact that decodes several sequences together gives each the tokens it gets alone.
    BatchInvariant,
}

/// Whether `cfg` takes the tensor-core kernel: f16/bf16, rows of K 16-byte aligned, and (unless
/// `rows` asks for batch invariance) more than one row of x.
fn tensor_cores(cfg: &GemmConfig, rows: Rows) -> bool {
    cfg.elem != Elem::F32 && cfg.k.is_multiple_of(8) && (rows == Rows::BatchInvariant || cfg.m >= 2)
}

/// The most shared memory the normalised rows of x may take (bytes).
const PROLOGUE_BYTES: u32 = 160 * 1024;
/// The most blocks (16 columns each) that normalise x themselves: every block repeats the
/// prologue, so past this (an LM head of 128256 columns is 8016 blocks) one norm launch costs
/// less than the repeated prologues (H200, per-kernel profile at batch 8: Llama-1B's LM head
/// took 158 us normalising in every block, against 136 us and one norm launch).
const PROLOGUE_BLOCKS: u32 = 1024;

/// Whether [`gemv_normed`] serves `cfg` (under `rows`) with the norm `norm` computed in its
/// prologue: the tensor-core kernel, the rows of x normalised fit in shared memory (at any row
/// count, so the choice does not depend on it), and few enough blocks repeat the prologue. (The
/// one-row kernel does not take it: one warp normalising the row in each block made Llama-1B's
/// gate/up product 25.5 us against 20.7 + 2.7 for the norm launch and the product; every warp
/// taking the statistics itself and normalising x as it multiplies made the whole batch-1 decode
/// step slower, Llama-1B 0.870-0.876 ms against 0.847-0.867 and GPT-2 0.277-0.282 against
/// 0.265-0.271, the statistics being on each warp's path after the wait; H200.)
pub fn takes_prologue(cfg: &GemmConfig, norm: &NormConfig, rows: Rows) -> bool {
    (supports(cfg) || supports_grouped(cfg, rows))
        && tensor_cores(cfg, rows)
        && !norm.residual
        && norm.elem == cfg.elem
        && (norm.rows, norm.cols) == (cfg.m, cfg.k)
        && MAX_ROWS * cfg.k * cfg.elem.bytes() <= PROLOGUE_BYTES
        && cfg.n_out().div_ceil(TC_COLS) <= PROLOGUE_BLOCKS
}

/// Generates the tensor-core kernel that first normalises the rows of x (`norm`: RMSNorm, or
/// LayerNorm with its bias) into shared memory, one warp per row, then takes its product from
/// there; unless `weighted`, the norm's weight is ones (the compiler moved it into `w`) and the
/// prologue neither reads nor multiplies it. Parameters: `x, w, [norm_weight], [norm_bias],
/// [bias], [residual], out`.
pub fn gemv_normed((cfg, norm, weighted): &(GemmConfig, NormConfig, bool)) -> GeneratedKernel {
    assert!(
        takes_prologue(cfg, norm, Rows::BatchInvariant),
        "the GEMV prologue needs the tensor-core kernel and x in shared memory"
    );
    let norm_name = match norm.kind {
        NormKind::LayerNorm => "layer_norm",
        NormKind::RmsNorm => "rms_norm",
    };
    let ones = if *weighted { "" } else { "_unweighted" };
    let name = format!("{norm_name}{ones}_{}_gemv", cfg.name());
    gemv_tc(cfg, &name, Some((norm, *weighted)))
}

/// Whether [`gemv_folded`] serves `cfg` under `rows` with x's RMSNorm `norm`, of a weight of
/// ones, folded into the one-column-per-warp kernel (f16/bf16; the f32 products are the CPU
/// executor's, which takes the norm apart): the product's weight holds the norm's (the compiler
/// moves it there), and nothing waits for the statistics: each warp sums x's squares beside its
/// products and scales its sums by `1 / rms` once at the end. Up to `FOLD_COLUMNS` output
/// columns. (H200, Llama-3.2-1B shape, bf16, ncu: the gate/up product 19.4 us against 19.1 and
/// a 2.5 us norm launch, QKV 6.9 against 6.7; multiplying x by the norm's weight in every warp
/// instead made them 20.6 and 7.5, and the LM head 132 against 118.)
pub fn folds_norm(cfg: &GemmConfig, norm: &NormConfig, rows: Rows) -> bool {
    supports(cfg)
        && !tensor_cores(cfg, rows)
        && cfg.n_out() <= FOLD_COLUMNS
        && cfg.elem != Elem::F32
        && norm.kind == NormKind::RmsNorm
        && !norm.residual
        && norm.elem == cfg.elem
        && (norm.rows, norm.cols) == (cfg.m, cfg.k)
}

/// The most output columns of a product that folds its norm: the squares every warp sums cost
/// in proportion to the columns, the norm launch they save does not (an LM head keeps its norm).
const FOLD_COLUMNS: u32 = 32768;

/// Generates the one-column-per-warp product of x's RMSNorm `norm` ([`folds_norm`]; the norm's
/// weight is already in `w`), folding the greedy choice as [`gemv_choosing`] does when `choose`
/// is set. Parameters: `x, w, [bias], [residual], out, [best]`.
pub fn gemv_folded((cfg, norm, choose): &(GemmConfig, NormConfig, bool)) -> GeneratedKernel {
    assert!(
        folds_norm(cfg, norm, Rows::Fastest),
        "the folded RMSNorm needs the one-column-per-warp kernel, f16/bf16, and x's shape"
    );
    let what = if *choose { "gemv_choosing" } else { "gemv" };
    let name = format!("rms_norm_{}_{what}", cfg.name());
    gemv_simt(cfg, &name, *choose, Some(norm))
}

/// The bytes of its weight row one warp of the one-column-per-warp kernel streams at least: a
/// column whose row is longer is shared by up to [`WARPS`] warps ([`k_splits`]), each taking
/// every `splits`-th chunk of K, so that long rows keep enough loads in flight (H200, Llama-1B
/// shape, bf16: the down projection, K = 8192 over 2048 columns, read 2.6 TB/s with one warp
/// per column, 256 blocks).
const SPLIT_BYTES: u32 = 4096;

/// Warps per output column of the one-column-per-warp kernel: the largest power of two up to
/// [`WARPS`] that leaves each warp at least [`SPLIT_BYTES`] of the weight row. It depends on K
/// alone, so every row count of a product sums in the same order.
fn k_splits(cfg: &GemmConfig) -> u32 {
    let row_bytes = cfg.k * cfg.elem.bytes();
    let mut splits = 1;
    while splits < WARPS && row_bytes / (splits * 2) >= SPLIT_BYTES {
        splits *= 2;
    }
    splits
}

/// The one-column-per-warp kernel: `k_splits` warps per column, each streaming its chunks of the
/// weight row against every row of x, their sums met in shared memory in warp order; with
/// `norm`, x's RMSNorm (of a weight of ones) folded in ([`folds_norm`]).
fn gemv_simt(
    cfg: &GemmConfig,
    name: &str,
    choose: bool,
    norm: Option<&NormConfig>,
) -> GeneratedKernel {
    let mut k = Kernel::new(name);
    let x = k.param_ptr("x");
    let w = k.param_ptr("w");
    let epilogue = EpiloguePtrs::declare(&mut k, cfg);
    let best = choose.then(|| k.param_ptr("best"));
    let splits = k_splits(cfg);
    let n_out = cfg.n_out();
    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let block = k.special("ctaid.x");
    let column_in_block = k.op2("shr.u32", RegClass::B32, &warp, &splits.trailing_zeros());
    let col = k.mad_u32(&block, &(WARPS / splits), &column_in_block);
    let part = k.op2("and.b32", RegClass::B32, &warp, &(splits - 1));
    let exit = k.label("exit");
    let outside = k.setp("ge.u32", &col, &n_out);
    let simt = Simt::new(
        &mut k,
        cfg,
        [w, x],
        norm.is_some(),
        splits,
        [col, lane, part],
    );
    let first = simt.first_weights(&mut k, outside);
    let mut addends = early_addends(&mut k, cfg, &epilogue, col, outside);
    k.wait_for_inputs();
    let residuals = early_residuals(&mut k, cfg, &epilogue, col, outside);
    let (acc, squares) = simt.k_loop(&mut k, outside, first);
    // The products' sums, then (with a norm) the squares' sums, across the warp and its column.
    let mut sums: Vec<Reg> = acc.iter().chain(&squares).map(|a| k.warp_sum(*a)).collect();
    if splits > 1 {
        sums = meet_splits(&mut k, &sums, [warp, lane, part], splits);
    }
    let square_sums = sums.split_off(acc.len());
    let rows = cfg.m as usize;
    let keys: Vec<Reg> = match best {
        Some(_) => (0..rows).map(|_| k.mov(RegClass::B64, &0u64)).collect(),
        None => Vec::new(),
    };
    let not_first = k.setp("ne.u32", &lane, &0u32);
    k.bra(Some((not_first, true)), &exit);
    k.bra(Some((outside, true)), &exit);
    if let Some(norm) = norm {
        rescale(&mut k, norm, &mut sums, &square_sums);
    }
    for r in 0..rows {
        let up = cfg.swiglu.then(|| sums[rows + r]);
        addends.residual = residuals.get(r).copied();
        let v = apply(&mut k, cfg, sums[r], up, &addends);
        let oi = k.add_u32(&col, &(r as u32 * n_out));
        let oa = k.address(epilogue.out(), &oi, cfg.elem.bytes());
        if let Some(key) = keys.get(r) {
            let stored = k.rounded(cfg.elem, v);
            let mine = crate::sampling::choice_key(&mut k, stored, col);
            k.emit(format!("mov.b64 {key}, {mine}"));
        }
        k.st_global(cfg.elem, oa, v);
    }
    k.place(&exit);
    if let Some(best) = best {
        fold_choices(&mut k, best, &keys, [tid, warp, lane]);
    }
    GeneratedKernel::new(
        k,
        Launch {
            grid: [simt_blocks(cfg, splits), 1, 1],
            block: [WARPS * 32, 1, 1],
            shared_bytes: 0,
        },
    )
    .on(crate::KernelPath::Gemv)
}

/// Scales each row's sums (its product's, then its up product's with SwiGLU) by that row's
/// `1 / sqrt(mean square + eps)` of x (`square_sums`: x's sum of squares per row), as the norm
/// kernel computes it ([`crate::norm::reciprocal_rms`]).
fn rescale(k: &mut Kernel, norm: &NormConfig, sums: &mut [Reg], square_sums: &[Reg]) {
    k.comment("the RMSNorm's scale, applied to the sums");
    let rows = square_sums.len();
    for (r, sq) in square_sums.iter().enumerate() {
        let rstd = crate::norm::reciprocal_rms(k, sq, norm);
        for s in sums.iter_mut().skip(r).step_by(rows) {
            *s = k.mul_f32(s, &rstd);
        }
    }
}

/// Each row's best key of the block (every warp's lane 0 holds its column's, 0 outside the
/// product) into `best[row]` with one `red.max` by the block's first thread.
fn fold_choices(k: &mut Kernel, best: Reg, keys: &[Reg], [tid, warp, lane]: [Reg; 3]) {
    k.comment("the block's best choice key per row into the row's");
    let rows = keys.len() as u32;
    let slots = k.shared("choice_keys", WARPS * rows * 8);
    let base = k.shared_base(&slots);
    let mine = k.mad_u32(&warp, &(rows * 8), &base);
    let lane0 = k.setp("eq.u32", &lane, &0u32);
    for (r, key) in keys.iter().enumerate() {
        k.emit(format!("@{lane0} st.shared.u64 [{mine}+{}], {key}", r * 8));
    }
    k.barrier();
    let done = k.label("choices_folded");
    let leader = k.setp("eq.u32", &tid, &0u32);
    k.bra(Some((leader, false)), &done);
    for r in 0..rows {
        let top = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {top}, [{base}+{}]", r * 8));
        for w in 1..WARPS {
            let other = k.reg(RegClass::B64);
            k.emit(format!(
                "ld.shared.u64 {other}, [{base}+{}]",
                (w * rows + r) * 8
            ));
            k.emit(format!("max.u64 {top}, {top}, {other}"));
        }
        let some = k.setp("ne.u64", &top, &0u64);
        let at = k.op2("add.u64", RegClass::B64, &best, &u64::from(r * 8));
        k.emit(format!("@{some} red.global.max.u64 [{at}], {top}"));
    }
    k.place(&done);
}

/// The bias of the warp's column (and of its up column with SwiGLU), loaded before the wait for
/// the kernel before (no kernel writes weights), so that the epilogue does not wait for it; a
/// warp whose column is `outside` the product loads nothing.
fn early_addends(
    k: &mut Kernel,
    cfg: &GemmConfig,
    epilogue: &EpiloguePtrs,
    col: Reg,
    outside: Reg,
) -> Addends {
    if epilogue.bias().is_none() {
        return Addends::default();
    }
    let skip = k.label("bias_loaded");
    k.bra(Some((outside, true)), &skip);
    let addends = epilogue.load_bias(k, cfg, &col, cfg.swiglu);
    k.place(&skip);
    addends
}

/// The residual of the warp's column in every row, loaded as soon as the kernel before has
/// finished (it may have written it), so that it arrives during the K loop rather than after.
fn early_residuals(
    k: &mut Kernel,
    cfg: &GemmConfig,
    epilogue: &EpiloguePtrs,
    col: Reg,
    outside: Reg,
) -> Vec<Reg> {
    if epilogue.residual().is_none() {
        return Vec::new();
    }
    let skip = k.label("residual_loaded");
    k.bra(Some((outside, true)), &skip);
    let loaded = (0..cfg.m)
        .filter_map(|row| {
            let oi = k.add_u32(&col, &(row * cfg.n_out()));
            epilogue.load_residual(k, cfg, &oi)
        })
        .collect();
    k.place(&skip);
    loaded
}

/// Blocks of the one-column-per-warp kernel: [`WARPS`] warps each, `splits` per column.
fn simt_blocks(cfg: &GemmConfig, splits: u32) -> u32 {
    cfg.n_out().div_ceil(WARPS / splits)
}

/// What a warp of the one-column-per-warp kernel streams: its weight row (and the up row with
/// SwiGLU) and the chunks of K it takes.
struct Simt<'a> {
    cfg: &'a GemmConfig,
    w: Reg,
    x: Reg,
    /// Whether the lanes also sum x's squares (a folded RMSNorm, [`folds_norm`]).
    squares: bool,
    /// Start element of the weight row, and of the up row with SwiGLU.
    starts: Vec<Reg>,
    /// Elements per lane load (8 with 16-byte loads, else 1).
    step: u32,
    /// Warps per column.
    splits: u32,
    /// The lane's first element of K.
    first: Reg,
}

impl<'a> Simt<'a> {
    fn new(
        k: &mut Kernel,
        cfg: &'a GemmConfig,
        [w, x]: [Reg; 2],
        squares: bool,
        splits: u32,
        [col, lane, part]: [Reg; 3],
    ) -> Simt<'a> {
        // 16-byte loads when every row starts 16-byte aligned (buffers are 256-byte aligned).
        let vector = (cfg.k * cfg.elem.bytes()).is_multiple_of(16);
        let step = if vector { 16 / cfg.elem.bytes() } else { 1 };
        let w_row = k.mul_u32(&col, &cfg.k);
        let mut starts = vec![w_row];
        if cfg.swiglu {
            let up_col = k.add_u32(&col, &cfg.n_out());
            starts.push(k.mul_u32(&up_col, &cfg.k));
        }
        k.comment("the warp's chunks of K: lanes side by side, the column's warps interleaved");
        let chunk = k.mad_u32(&part, &32u32, &lane);
        let first = k.mul_u32(&chunk, &step);
        Simt {
            cfg,
            w,
            x,
            squares,
            starts,
            step,
            splits,
            first,
        }
    }

    /// Elements between one chunk of a lane and its next.
    fn stride(&self) -> u32 {
        self.splits * 32 * self.step
    }

    fn load(&self, k: &mut Kernel, base: Reg, index: &Reg) -> Vec<Reg> {
        let e = self.cfg.elem;
        let addr = k.address(base, index, e.bytes());
        if self.step > 1 {
            k.ld_global_vec16(e, addr)
        } else {
            vec![k.ld_global(e, addr)]
        }
    }

    /// How many chunks the warp loads before the wait: all that lie inside K for every lane when
    /// their loads (a row's, or with SwiGLU two rows') number at most [`EARLY_LOADS`] and the
    /// grid is at most [`ONE_WAVE`] blocks, else the first `UNROLL` of them.
    fn early_chunks(&self) -> u32 {
        let whole = self.cfg.k / self.stride();
        let blocks = simt_blocks(self.cfg, self.splits);
        if whole * self.starts.len() as u32 <= EARLY_LOADS && blocks <= ONE_WAVE {
            whole
        } else {
            UNROLL.min(whole)
        }
    }

    /// The weights of the warp's [`Simt::early_chunks`], loaded before the kernel waits for the
    /// one before it (no kernel writes weights), so that they stream in under its tail; a warp
    /// whose column is `outside` the product loads nothing (and multiplies nothing).
    fn first_weights(&self, k: &mut Kernel, outside: Reg) -> Chunks {
        k.comment("the first chunks' weights load while the kernel before runs");
        let skip = k.label("first_weights_done");
        k.bra(Some((outside, true)), &skip);
        let first = self.load_weights(k, &self.first, self.early_chunks());
        k.place(&skip);
        first
    }

    /// The K loop (skipped by a warp whose column is `outside` the product), from the `first`
    /// chunks on; returns the lane's sums, one per row of x, then the up product's with SwiGLU,
    /// and with a folded norm its sums of x's squares, one per row.
    fn k_loop(&self, k: &mut Kernel, outside: Reg, first: Chunks) -> (Vec<Reg>, Vec<Reg>) {
        let zeros = |k: &mut Kernel, n: usize| -> Vec<Reg> {
            (0..n).map(|_| k.mov(RegClass::F32, &F32(0.0))).collect()
        };
        let rows = self.cfg.m as usize;
        let acc = zeros(k, rows * self.starts.len());
        let squares = zeros(k, if self.squares { rows } else { 0 });
        let sums = Sums {
            acc: &acc,
            squares: &squares,
        };
        let done = k.label("k_done");
        k.bra(Some((outside, true)), &done);
        self.multiply(k, &first, &sums);
        let kk = k.add_u32(&self.first, &(first.at.len() as u32 * self.stride()));
        if self.cfg.k >= UNROLL * self.stride() {
            k.comment("UNROLL chunks at a time while all are inside K");
            let wide = k.label("k_unrolled");
            let rest = k.label("k_rest");
            k.place(&wide);
            let last = k.add_u32(&kk, &((UNROLL - 1) * self.stride()));
            let short = k.setp("ge.u32", &last, &self.cfg.k);
            k.bra(Some((short, true)), &rest);
            let chunks = self.load_weights(k, &kk, UNROLL);
            self.multiply(k, &chunks, &sums);
            k.emit(format!("add.u32 {kk}, {kk}, {}", UNROLL * self.stride()));
            k.bra(None, &wide);
            k.place(&rest);
            k.comment("the rest one chunk at a time");
        }
        let top = k.label("k_loop");
        k.place(&top);
        let past = k.setp("ge.u32", &kk, &self.cfg.k);
        k.bra(Some((past, true)), &done);
        let chunk = self.load_weights(k, &kk, 1);
        self.multiply(k, &chunk, &sums);
        k.emit(format!("add.u32 {kk}, {kk}, {}", self.stride()));
        k.bra(None, &top);
        k.place(&done);
        (acc, squares)
    }

    /// The weights of `count` chunks from `kk`, every load issued before any is used.
    fn load_weights(&self, k: &mut Kernel, kk: &Reg, count: u32) -> Chunks {
        let at: Vec<Reg> = (0..count)
            .map(|u| match u {
                0 => *kk,
                _ => k.add_u32(kk, &(u * self.stride())),
            })
            .collect();
        let weights = self
            .starts
            .iter()
            .map(|start| {
                at.iter()
                    .map(|a| {
                        let wi = k.add_u32(start, a);
                        self.load(k, self.w, &wi)
                    })
                    .collect()
            })
            .collect();
        Chunks { at, weights }
    }

    /// Multiplies loaded chunks by every row of x (whose squares it sums with a folded norm),
    /// into `sums`.
    fn multiply(&self, k: &mut Kernel, chunks: &Chunks, sums: &Sums) {
        let rows = self.cfg.m as usize;
        for r in 0..rows {
            for (u, a) in chunks.at.iter().enumerate() {
                let xi = k.add_u32(a, &(r as u32 * self.cfg.k));
                let xv = self.load(k, self.x, &xi);
                if let Some(sq) = sums.squares.get(r) {
                    for xe in &xv {
                        k.fma_into(*sq, xe, xe);
                    }
                }
                for (j, xe) in xv.iter().enumerate() {
                    for (p, wp) in chunks.weights.iter().enumerate() {
                        k.fma_into(sums.acc[p * rows + r], xe, &wp[u][j]);
                    }
                }
            }
        }
    }
}

/// A lane's running sums in the K loop: the products' (per row, then the up product's per row
/// with SwiGLU) and, with a folded norm, x's squares per row.
struct Sums<'a> {
    acc: &'a [Reg],
    squares: &'a [Reg],
}

/// Chunks of a weight row (and of the up row with SwiGLU) loaded by a lane: each chunk's first
/// element of K, and per row its values.
struct Chunks {
    at: Vec<Reg>,
    weights: Vec<Vec<Vec<Reg>>>,
}

/// The sums of a column's `splits` warps met in shared memory: lane 0 of each warp stores its
/// sums, and after the barrier every warp of the column adds them in warp order (the same order
/// at every row count), so that each warp's lane 0 holds the same totals (and stores the same
/// output: a leader-only epilogue would save the repeats).
fn meet_splits(
    k: &mut Kernel,
    sums: &[Reg],
    [warp, lane, part]: [Reg; 3],
    splits: u32,
) -> Vec<Reg> {
    let n = sums.len() as u32;
    let partials = k.shared("split_sums", WARPS * n * 4);
    let base = k.shared_base(&partials);
    let mine = k.mul_u32(&warp, &(n * 4));
    let mine = k.add_u32(&base, &mine);
    let skip = k.label("store_done");
    let not_first = k.setp("ne.u32", &lane, &0u32);
    k.bra(Some((not_first, true)), &skip);
    for (i, v) in sums.iter().enumerate() {
        k.emit(format!("st.shared.f32 [{mine}+{}], {v}", i * 4));
    }
    k.place(&skip);
    k.barrier();
    let leader = k.sub_u32(&warp, &part);
    let first = k.mul_u32(&leader, &(n * 4));
    let first = k.add_u32(&base, &first);
    (0..n)
        .map(|i| {
            let total = k.mov(RegClass::F32, &F32(0.0));
            for j in 0..splits {
                let v = k.reg(RegClass::F32);
                k.emit(format!("ld.shared.f32 {v}, [{first}+{}]", (j * n + i) * 4));
                k.emit(format!("add.f32 {total}, {total}, {v}"));
            }
            total
        })
        .collect()
}

/// Output columns per block of the tensor-core kernel (the product's `m16`).
const TC_COLS: u32 = 16;
/// Warps per block of the tensor-core kernel; warp `w` takes the 32-wide K steps `w, w + 16,
/// ...` (16 rather than 8: Llama-1B and GPT-2 decode at batch 8 took 1-6% less time on the H200,
/// the products of 2048 or 768 columns having few blocks).
const TC_WARPS: u32 = 16;
/// K steps a warp loads before their products, while the loads are in flight together.
const TC_UNROLL: u32 = 4;

/// K steps per load group of `cfg`: half as many with SwiGLU, whose lanes stream four weight
/// rows. (The first group's weights stay in registers through the prologue: four steps of four
/// rows took 98 registers, one block per SM, and Llama-1B's gate/up product 34.2 us against
/// 26.2 with two steps, H200.)
fn tc_unroll(cfg: &GemmConfig) -> u32 {
    if cfg.swiglu {
        TC_UNROLL / 2
    } else {
        TC_UNROLL
    }
}

/// The tensor-core kernel (see the module documentation).
fn gemv_tc(cfg: &GemmConfig, name: &str, normed: Option<(&NormConfig, bool)>) -> GeneratedKernel {
    let norm = normed.map(|(n, _)| n);
    let mut k = Kernel::new(&format!("{name}_tc"));
    k.directive(format!(".maxntid {}, 1, 1", TC_WARPS * 32));
    let x = k.param_ptr("x");
    let w = k.param_ptr("w");
    let norm_ptrs = normed.map(|(n, weighted)| {
        let weight = weighted.then(|| k.param_ptr("norm_weight"));
        let bias = (n.kind == NormKind::LayerNorm).then(|| k.param_ptr("norm_bias"));
        (weight, bias)
    });
    let epilogue = EpiloguePtrs::declare(&mut k, cfg);
    let partials = k.shared("partials", parts(cfg) * TC_WARPS * TC_COLS * 8 * 4);
    let n_out = cfg.n_out();
    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let g = k.op2("shr.u32", RegClass::B32, &lane, &2u32);
    let t = k.op2("and.b32", RegClass::B32, &lane, &3u32);
    let block = k.special("ctaid.x");
    // More than 8 rows of x: each group of 8 is its own block, the groups of one set of columns
    // adjacent in launch order, so that their weight rows come from L2 after the first read.
    let groups = row_groups(cfg);
    let (block, row0) = if groups > 1 {
        let columns = k.op2("div.u32", RegClass::B32, &block, &groups);
        let group = k.op2("rem.u32", RegClass::B32, &block, &groups);
        (columns, Some(k.mul_u32(&group, &MAX_ROWS)))
    } else {
        (block, None)
    };
    let n0 = k.mul_u32(&block, &TC_COLS);

    k.comment("this lane's weight rows (n0 + g, n0 + g + 8; up rows N/2 further) and x row g");
    let lo = k.add_u32(&n0, &g);
    let hi = k.add_u32(&lo, &8u32);
    let lo_ok = k.setp("lt.u32", &lo, &n_out);
    let hi_ok = k.setp("lt.u32", &hi, &n_out);
    let x_global = match row0 {
        Some(r0) => k.add_u32(&r0, &g),
        None => g,
    };
    let x_ok = k.setp("lt.u32", &x_global, &cfg.m);
    let row_start = |k: &mut Kernel, row: &Reg| k.mul_u32(row, &cfg.k);
    let mut rows = vec![
        (row_start(&mut k, &lo), lo_ok),
        (row_start(&mut k, &hi), hi_ok),
    ];
    if cfg.swiglu {
        for (r, ok) in [(lo, lo_ok), (hi, hi_ok)] {
            let up = k.add_u32(&r, &n_out);
            rows.push((row_start(&mut k, &up), ok));
        }
    }
    // With a prologue, x is read from its normalised rows (the block's group) in shared memory.
    let x_row = match norm {
        Some(_) => row_start(&mut k, &g),
        None => row_start(&mut k, &x_global),
    };
    let first = first_weights(&mut k, cfg, w, &rows, [warp, t]);
    k.wait_for_inputs();
    let x_source = match (norm, norm_ptrs) {
        (Some(n), Some(ptrs)) => {
            let normed = k.dynamic_shared("x_normed");
            prologue(&mut k, n, x, ptrs, &normed, [warp, lane], row0);
            XSource::Shared(normed)
        }
        _ => XSource::Global(x),
    };
    let operands = Operands {
        w,
        rows: &rows,
        x: &x_source,
        x_row,
        x_ok,
    };
    let acc = k_steps(&mut k, cfg, &operands, first, [warp, t]);
    finish_tc(
        &mut k,
        cfg,
        &epilogue,
        &partials,
        &acc,
        [tid, warp, g, t, n0],
        row0,
    );
    let block_rows = cfg.m.min(MAX_ROWS);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [n_out.div_ceil(TC_COLS) * groups, 1, 1],
            block: [TC_WARPS * 32, 1, 1],
            shared_bytes: norm.map_or(0, |_| block_rows * cfg.k * cfg.elem.bytes()),
        },
    )
    .on(crate::KernelPath::Gemv)
}

/// Products a tensor-core block accumulates: gate and up with SwiGLU, else one.
fn parts(cfg: &GemmConfig) -> u32 {
    if cfg.swiglu {
        2
    } else {
        1
    }
}

/// What a lane of the tensor-core kernel multiplies: its weight rows (start element, whether the
/// row exists), and its row of x (where x is read, its start element, whether it exists).
struct Operands<'a> {
    w: Reg,
    rows: &'a [(Reg, Reg)],
    x: &'a XSource,
    x_row: Reg,
    x_ok: Reg,
}

/// The weights of one group of [`tc_unroll`] K steps of a warp: per step, its first k, whether
/// it is inside K, and lane (g, t)'s 16 bytes of each of its weight rows (zeros past K or past
/// the rows).
struct StepWeights {
    at: Vec<Reg>,
    inside: Vec<Reg>,
    words: Vec<Vec<Vec<Reg>>>,
}

/// Loads the group of K steps whose first holds lane (g, t)'s k at `kk`, from `rows` (start
/// element, whether the row exists) of `w`.
fn load_steps(
    k: &mut Kernel,
    cfg: &GemmConfig,
    w: Reg,
    rows: &[(Reg, Reg)],
    kk: &Reg,
) -> StepWeights {
    let mut loaded = StepWeights {
        at: Vec::new(),
        inside: Vec::new(),
        words: Vec::new(),
    };
    for u in 0..tc_unroll(cfg) {
        let at = k.add_u32(kk, &(u * TC_WARPS * 32));
        let inside = k.setp("lt.u32", &at, &cfg.k);
        let words = rows
            .iter()
            .map(|(start, ok)| {
                let i = k.add_u32(start, &at);
                load_words(k, w, &i, cfg.elem, &[inside, *ok])
            })
            .collect();
        loaded.at.push(at);
        loaded.inside.push(inside);
        loaded.words.push(words);
    }
    loaded
}

/// The weights of the warp's first [`tc_unroll`] K steps, loaded before the kernel waits for the
/// one before it (no kernel writes weights), so that they stream in while that kernel finishes
/// and while the prologue runs.
fn first_weights(
    k: &mut Kernel,
    cfg: &GemmConfig,
    w: Reg,
    rows: &[(Reg, Reg)],
    [warp, t]: [Reg; 2],
) -> StepWeights {
    k.comment("the first K steps' weights load while the kernel before runs");
    let step = k.mul_u32(&warp, &32u32);
    let kk = k.mad_u32(&t, &8u32, &step);
    load_steps(k, cfg, w, rows, &kk)
}

/// The products of one group of K steps: x loaded at the same k, then the steps' `mma`s.
fn multiply_steps(
    k: &mut Kernel,
    cfg: &GemmConfig,
    op: &Operands,
    loaded: &StepWeights,
    acc: &[Vec<Reg>],
) {
    let ty = cfg.elem.name();
    let xs: Vec<Vec<Reg>> = loaded
        .at
        .iter()
        .zip(&loaded.inside)
        .map(|(at, inside)| {
            let xi = k.add_u32(&op.x_row, at);
            match op.x {
                XSource::Global(x) => load_words(k, *x, &xi, cfg.elem, &[*inside, op.x_ok]),
                XSource::Shared(rows) => {
                    load_shared_words(k, rows, &xi, cfg.elem, &[*inside, op.x_ok])
                }
            }
        })
        .collect();
    for (weights, xv) in loaded.words.iter().zip(&xs) {
        for (p, acc) in acc.iter().enumerate() {
            let (wl, wh) = (&weights[2 * p], &weights[2 * p + 1]);
            for half in 0..2 {
                let a = [
                    wl[2 * half],
                    wh[2 * half],
                    wl[2 * half + 1],
                    wh[2 * half + 1],
                ];
                k.mma_m16n8k16(ty, acc, &a, &[xv[2 * half], xv[2 * half + 1]]);
            }
        }
    }
}

/// The K loop of the tensor-core kernel: the warp's 32-wide steps in groups of [`tc_unroll`], each
/// group's weights loaded before its products (the first group's already are, [`first_weights`]);
/// returns the accumulators (C fragments), one set per part (gate, and up).
fn k_steps(
    k: &mut Kernel,
    cfg: &GemmConfig,
    op: &Operands,
    first: StepWeights,
    [warp, t]: [Reg; 2],
) -> Vec<Vec<Reg>> {
    let acc: Vec<Vec<Reg>> = (0..parts(cfg))
        .map(|_| (0..4).map(|_| k.mov(RegClass::F32, &F32(0.0))).collect())
        .collect();
    k.comment("K in 32-wide steps: lane (g, t) holds k = 32 s + 8 t .. + 8 of each operand;");
    k.comment("the loop runs on the warp's step (uniform: mma.sync needs the whole warp)");
    multiply_steps(k, cfg, op, &first, &acc);
    let group = tc_unroll(cfg) * TC_WARPS * 32;
    if cfg.k > group {
        let step = k.mul_u32(&warp, &32u32);
        let step = k.add_u32(&step, &group);
        let lane_k = k.mul_u32(&t, &8u32);
        let top = k.label("k_steps");
        let done = k.label("k_done");
        k.place(&top);
        let past = k.setp("ge.u32", &step, &cfg.k);
        k.bra(Some((past, true)), &done);
        let kk = k.add_u32(&step, &lane_k);
        let loaded = load_steps(k, cfg, op.w, op.rows, &kk);
        multiply_steps(k, cfg, op, &loaded, &acc);
        k.emit(format!("add.u32 {step}, {step}, {group}"));
        k.bra(None, &top);
        k.place(&done);
    }
    acc
}

/// Where the tensor-core kernel reads x.
enum XSource {
    /// The `x` parameter.
    Global(Reg),
    /// The prologue's normalised rows (`[M, K]` in shared memory, under this name).
    Shared(String),
}

/// What the prologue does with a lane's chunks: each one's first element and whether it is
/// inside the row.
type ChunkBody<'a> = dyn FnMut(&mut Kernel, &[(Reg, Reg)]) + 'a;

/// Chunks of 8 elements a lane of the prologue loads before using them.
const PROLOGUE_UNROLL: u32 = 4;

/// The prologue: warp `w < M` normalises row `w` of x into `rows` (shared, `[M, K]`), with the
/// norm kernel's arithmetic (`crate::norm`): f32 statistics, the variance of the centred values,
/// `(x - mean) * rstd * weight (+ bias)` rounded to the element type (no `* weight` without
/// one: a weight of ones moved into the product's); with row groups, warp
/// `w < 8` normalises row `row0 + w` into row `w`. Ends with a barrier.
fn prologue(
    k: &mut Kernel,
    n: &NormConfig,
    x: Reg,
    (weight, bias): (Option<Reg>, Option<Reg>),
    rows: &str,
    [warp, lane]: [Reg; 2],
    row0: Option<Reg>,
) {
    let done = k.label("prologue_done");
    let source_row = match row0 {
        Some(r0) => {
            let past_group = k.setp("ge.u32", &warp, &MAX_ROWS);
            k.bra(Some((past_group, true)), &done);
            k.add_u32(&r0, &warp)
        }
        None => warp,
    };
    let no_row = k.setp("ge.u32", &source_row, &n.rows);
    k.bra(Some((no_row, true)), &done);
    let base = k.shared_base(rows);
    let row_base = k.mul_u32(&warp, &n.cols);
    let source_base = match row0 {
        Some(_) => k.mul_u32(&source_row, &n.cols),
        None => row_base,
    };
    let row = NormRow {
        n,
        lane,
        base,
        row_base,
    };
    let total = row.copy(k, x, source_base);
    let (mean, sq_total) = if n.kind == NormKind::LayerNorm {
        let mean = k.mul_f32(&total, &F32(1.0 / n.cols as f32));
        (Some(mean), row.centred_squares(k, &mean))
    } else {
        (None, total)
    };
    let rstd = crate::norm::reciprocal_rms(k, &sq_total, n);
    row.normalise(k, (mean, rstd), (weight, bias));
    k.place(&done);
    k.barrier();
}

/// A prologue warp's row in shared memory: its lane, the shared rows' base and the row's first
/// element there.
struct NormRow<'a> {
    n: &'a NormConfig,
    lane: Reg,
    base: Reg,
    row_base: Reg,
}

impl NormRow<'_> {
    /// Runs `body` over the lane's chunks of 8 elements (`lane`, then every 32nd), `unroll`
    /// at a time: each chunk's first element and whether it is inside the row.
    fn chunked(&self, k: &mut Kernel, what: &str, unroll: u32, body: &mut ChunkBody) {
        let chunks = self.n.cols / 8;
        let chunk = k.mov(RegClass::B32, &self.lane);
        let top = k.label(what);
        let end = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &chunk, &chunks);
        k.bra(Some((past, true)), &end);
        let at: Vec<(Reg, Reg)> = (0..unroll)
            .map(|u| {
                let c = k.add_u32(&chunk, &(u * 32));
                let inside = k.setp("lt.u32", &c, &chunks);
                (k.mul_u32(&c, &8u32), inside)
            })
            .collect();
        body(k, &at);
        k.emit(format!("add.u32 {chunk}, {chunk}, {}", 32 * unroll));
        k.bra(None, &top);
        k.place(&end);
    }

    /// The shared address of the row's element `col`.
    fn shared_at(&self, k: &mut Kernel, col: &Reg) -> Reg {
        let i = k.add_u32(&self.row_base, col);
        k.mad_u32(&i, &self.n.elem.bytes(), &self.base)
    }

    /// Copies x's row from `source_base` into shared memory; returns the warp's sum of its
    /// elements (LayerNorm, for the mean) or of their squares (RMSNorm).
    fn copy(&self, k: &mut Kernel, x: Reg, source_base: Reg) -> Reg {
        let (e, layer) = (self.n.elem, self.n.kind == NormKind::LayerNorm);
        k.comment("prologue: copy the row to shared memory (sum for the mean, or squares)");
        let sum = k.mov(RegClass::F32, &F32(0.0));
        self.chunked(k, "norm_copy", PROLOGUE_UNROLL, &mut |k, at| {
            let loaded: Vec<Vec<Reg>> = at
                .iter()
                .map(|(col, inside)| {
                    let i = k.add_u32(&source_base, col);
                    load_words(k, x, &i, e, &[*inside, *inside])
                })
                .collect();
            for ((col, inside), words) in at.iter().zip(&loaded) {
                let sa = self.shared_at(k, col);
                k.emit(format!(
                    "@{inside} st.shared.v4.b32 [{sa}], {{{}, {}, {}, {}}}",
                    words[0], words[1], words[2], words[3]
                ));
                for v in k.unpack_halves(e, words) {
                    if layer {
                        k.emit(format!("add.f32 {sum}, {sum}, {v}"));
                    } else {
                        k.fma_into(sum, &v, &v);
                    }
                }
            }
        });
        k.warp_sum(sum)
    }

    /// The warp's sum of the squares of the row's elements less `mean`.
    fn centred_squares(&self, k: &mut Kernel, mean: &Reg) -> Reg {
        let e = self.n.elem;
        let sq = k.mov(RegClass::F32, &F32(0.0));
        self.chunked(k, "norm_var", 1, &mut |k, at| {
            let (col, _) = at[0];
            let sa = self.shared_at(k, &col);
            let words = k.ld_shared_words(sa);
            for v in k.unpack_halves(e, &words) {
                let c = k.sub_f32(&v, mean);
                k.fma_into(sq, &c, &c);
            }
        });
        k.warp_sum(sq)
    }

    /// The row normalised in place: `(x - mean) * rstd * weight + bias`, each part where given.
    fn normalise(
        &self,
        k: &mut Kernel,
        (mean, rstd): (Option<Reg>, Reg),
        (weight, bias): (Option<Reg>, Option<Reg>),
    ) {
        let e = self.n.elem;
        k.comment("prologue: normalise, scale, shift in place");
        self.chunked(k, "norm_write", 1, &mut |k, at| {
            let (col, _) = at[0];
            let sa = self.shared_at(k, &col);
            let words = k.ld_shared_words(sa);
            let values = k.unpack_halves(e, &words);
            let wv = weight.map(|w| {
                let wa = k.address(w, &col, e.bytes());
                k.ld_global_vec16(e, wa)
            });
            let bv = bias.map(|b| {
                let ba = k.address(b, &col, e.bytes());
                k.ld_global_vec16(e, ba)
            });
            let y: Vec<Reg> = values
                .iter()
                .enumerate()
                .map(|(j, v)| {
                    let c = match mean {
                        Some(m) => k.sub_f32(v, &m),
                        None => *v,
                    };
                    let mut y = k.mul_f32(&c, &rstd);
                    if let Some(w) = &wv {
                        y = k.mul_f32(&y, &w[j]);
                    }
                    if let Some(b) = &bv {
                        y = k.add_f32(&y, &b[j]);
                    }
                    y
                })
                .collect();
            let words = k.pack_halves(e, &y);
            k.emit(format!(
                "st.shared.v4.b32 [{sa}], {{{}, {}, {}, {}}}",
                words[0], words[1], words[2], words[3]
            ));
        });
    }
}

/// The 16 bytes at element `i` of the `[M, K]` rows in shared memory `rows` as four b32 words,
/// or zeros unless every predicate of `when` holds.
fn load_shared_words(k: &mut Kernel, rows: &str, i: &Reg, elem: Elem, when: &[Reg]) -> Vec<Reg> {
    let words: Vec<Reg> = (0..4).map(|_| k.mov(RegClass::B32, &0u32)).collect();
    let p = k.reg(RegClass::Pred);
    k.emit(format!("and.pred {p}, {}, {}", when[0], when[1]));
    let base = k.shared_base(rows);
    let addr = k.mad_u32(i, &elem.bytes(), &base);
    k.emit(format!(
        "@{p} ld.shared.v4.b32 {{{}, {}, {}, {}}}, [{addr}]",
        words[0], words[1], words[2], words[3]
    ));
    words
}

/// The 16 bytes at element `i` of `base` as four b32 words, or zeros unless every predicate of
/// `when` holds.
fn load_words(k: &mut Kernel, base: Reg, i: &Reg, elem: Elem, when: &[Reg]) -> Vec<Reg> {
    let words: Vec<Reg> = (0..4).map(|_| k.mov(RegClass::B32, &0u32)).collect();
    let p = k.reg(RegClass::Pred);
    k.emit(format!("and.pred {p}, {}, {}", when[0], when[1]));
    let addr = k.address(base, i, elem.bytes());
    k.emit(format!(
        "@{p} ld.global.v4.b32 {{{}, {}, {}, {}}}, [{addr}]",
        words[0], words[1], words[2], words[3]
    ));
    words
}

/// The warps' partial sums through shared memory, then one thread per (column, row) of the
/// block's outputs adds them and finishes with the epilogue. C fragment of lane (g, t): columns
/// g and g + 8, rows 2t and 2t + 1 of x.
fn finish_tc(
    k: &mut Kernel,
    cfg: &GemmConfig,
    epilogue: &EpiloguePtrs,
    partials: &str,
    acc: &[Vec<Reg>],
    [tid, warp, g, t, n0]: [Reg; 5],
    row0: Option<Reg>,
) {
    k.comment("partials[part][warp][column][row], f32");
    let base = k.shared_base(partials);
    let per_warp = TC_COLS * 8 * 4;
    let warp_at = k.mad_u32(&warp, &per_warp, &base);
    let col_at = k.mad_u32(&g, &32u32, &warp_at);
    let at = k.mad_u32(&t, &8u32, &col_at);
    for (p, c) in acc.iter().enumerate() {
        let off = p as u32 * TC_WARPS * per_warp;
        k.emit(format!(
            "st.shared.v2.f32 [{at}+{off}], {{{}, {}}}",
            c[0], c[1]
        ));
        k.emit(format!(
            "st.shared.v2.f32 [{at}+{}], {{{}, {}}}",
            off + 8 * 32,
            c[2],
            c[3]
        ));
    }
    k.barrier();
    let exit = k.label("exit");
    let col_local = k.op2("shr.u32", RegClass::B32, &tid, &3u32);
    let block_row = k.op2("and.b32", RegClass::B32, &tid, &7u32);
    let row = match row0 {
        Some(r0) => k.add_u32(&r0, &block_row),
        None => block_row,
    };
    let col = k.add_u32(&n0, &col_local);
    let outside = k.setp("ge.u32", &col_local, &TC_COLS);
    k.bra(Some((outside, true)), &exit);
    let no_row = k.setp("ge.u32", &row, &cfg.m);
    k.bra(Some((no_row, true)), &exit);
    let no_col = k.setp("ge.u32", &col, &cfg.n_out());
    k.bra(Some((no_col, true)), &exit);
    let mine = k.mad_u32(&tid, &4u32, &base);
    let sums: Vec<Reg> = (0..acc.len() as u32)
        .map(|p| {
            let sum = k.mov(RegClass::F32, &F32(0.0));
            for wi in 0..TC_WARPS {
                let v = k.reg(RegClass::F32);
                let off = (p * TC_WARPS + wi) * per_warp;
                k.emit(format!("ld.shared.f32 {v}, [{mine}+{off}]"));
                k.emit(format!("add.f32 {sum}, {sum}, {v}"));
            }
            sum
        })
        .collect();
    epilogue.finish(k, cfg, sums[0], sums.get(1).copied(), &col, |k| {
        k.mad_u32(&row, &cfg.n_out(), &col)
    });
    k.place(&exit);
}
