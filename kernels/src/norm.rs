//! LayerNorm / RMSNorm over the last axis, optionally of `x + residual`: f32 statistics (the
//! variance from centred values, so a large mean does not cancel), output in the tensor's dtype.
//! Rows of up to `CACHED_COLS` columns are read once and kept in registers (one read and one write
//! of the row); longer rows are read again for each statistic. A row of whole 16-byte chunks, at
//! most `32 * WARP_CHUNKS` of them, takes one warp (eight rows per block, sums by shuffles alone,
//! no barrier); other rows take a block of `ROW_THREADS` threads.

use kiln_ir::kernel::NormKind;

use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::reduce::{block_sum, scratch};
use crate::{GeneratedKernel, Launch, ROW_THREADS};

/// A norm kernel's static configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct NormConfig {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Whether a residual operand is added to `x` first.
    pub residual: bool,
    /// Element type of x, residual, weight, bias and output.
    pub elem: Elem,
    /// Rows (tokens of the bucket).
    pub rows: u32,
    /// Columns (hidden size).
    pub cols: u32,
    /// Epsilon.
    pub eps: f32,
}

/// The longest row kept in registers (32 values per thread).
pub const CACHED_COLS: u32 = 32 * ROW_THREADS;

/// The most 16-byte chunks of a row one lane holds when a warp takes the row (64 values of a
/// 16-bit type, 32 of f32).
const WARP_CHUNKS: u32 = 8;

/// The threads that normalise one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowThreads {
    /// The block's `ROW_THREADS` threads.
    Block,
    /// One warp of the block's `ROW_THREADS / 32`.
    Warp,
}

impl RowThreads {
    /// The threads [`norm`] gives a row of `cfg`: a warp for rows of whole 16-byte chunks, at
    /// most `32 * WARP_CHUNKS` of them; a block otherwise.
    pub fn of(cfg: &NormConfig) -> RowThreads {
        let lanes = 16 / cfg.elem.bytes();
        let chunks = cfg.cols / lanes;
        if cfg.cols.is_multiple_of(lanes) && chunks <= 32 * WARP_CHUNKS {
            RowThreads::Warp
        } else {
            RowThreads::Block
        }
    }

    fn count(self) -> u32 {
        match self {
            RowThreads::Block => ROW_THREADS,
            RowThreads::Warp => 32,
        }
    }

    fn rows_per_block(self) -> u32 {
        ROW_THREADS / self.count()
    }
}

/// The threads of one row: which, and this thread's index among them (`tid` in the block).
struct RowGroup {
    threads: RowThreads,
    index: Reg,
    tid: Reg,
}

impl RowGroup {
    /// This thread's group and row; a warp past the last of `rows` stops here.
    fn start(k: &mut Kernel, threads: RowThreads, rows: Option<Reg>) -> (RowGroup, Reg) {
        let tid = k.special("tid.x");
        let block = k.special("ctaid.x");
        match threads {
            RowThreads::Block => {
                let group = RowGroup {
                    threads,
                    index: tid,
                    tid,
                };
                (group, block)
            }
            RowThreads::Warp => {
                let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
                let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
                let row = k.mad_u32(&block, &threads.rows_per_block(), &warp);
                let rows = rows.expect("a warp to a row takes the rows as a parameter");
                let past = k.setp("ge.u32", &row, &rows);
                k.emit(format!("@{past} ret"));
                let group = RowGroup {
                    threads,
                    index: lane,
                    tid,
                };
                (group, row)
            }
        }
    }

    /// `value` summed over the row's threads; every one of them gets the total. `red` is the
    /// block's scratch ([`scratch`]), which a warp's sum does not use.
    fn sum(&self, k: &mut Kernel, value: Reg, red: &str) -> Reg {
        match self.threads {
            RowThreads::Block => block_sum(k, value, red, self.tid),
            RowThreads::Warp => k.warp_sum(value),
        }
    }
}

/// Generates the kernel. Parameters: `x, [residual], weight, [bias], out`, then `rows` (u32)
/// when a warp takes each row.
pub fn norm(cfg: &NormConfig) -> GeneratedKernel {
    norm_with(cfg, RowThreads::of(cfg))
}

/// [`norm`] with `threads` to a row (a warp only for rows [`RowThreads::of`] gives one).
pub fn norm_with(cfg: &NormConfig, threads: RowThreads) -> GeneratedKernel {
    assert!(
        threads == RowThreads::Block || RowThreads::of(cfg) == RowThreads::Warp,
        "a warp takes rows of at most {WARP_CHUNKS} whole 16-byte chunks per lane"
    );
    let layer = cfg.kind == NormKind::LayerNorm;
    let name = format!(
        "{}{}_{}_c{}{}",
        if layer { "layer_norm" } else { "rms_norm" },
        if cfg.residual { "_residual" } else { "" },
        cfg.elem.name(),
        cfg.cols,
        if threads == RowThreads::Warp {
            "_w"
        } else {
            ""
        }
    );
    let mut k = Kernel::new(&name);
    let row = NormRow::start(&mut k, cfg, threads);
    let (cols, lanes) = (cfg.cols, 16 / cfg.elem.bytes());
    let outputs = (row.weight, row.bias, row.out);
    if cols <= CACHED_COLS && cols.is_multiple_of(lanes) {
        let inputs = (row.x, row.residual);
        vector_row(
            &mut k,
            cfg,
            &row.red,
            &row.group,
            inputs,
            row.row_base,
            outputs,
        );
    } else if cols <= CACHED_COLS {
        let load = |k: &mut Kernel, col: Reg| row.load(k, col);
        cached_row(
            &mut k,
            cfg,
            &row.red,
            &row.group,
            &load,
            row.row_base,
            outputs,
        );
    } else {
        row.passes(&mut k);
    }
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.rows.div_ceil(threads.rows_per_block()), 1, 1],
            block: [ROW_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// A norm kernel's row: its parameters (`x, [residual], weight, [bias], out`, then `rows` when
/// a warp takes each row), the block's scratch for sums, the row's threads and first element.
struct NormRow<'a> {
    cfg: &'a NormConfig,
    x: Reg,
    residual: Option<Reg>,
    weight: Reg,
    bias: Option<Reg>,
    out: Reg,
    red: String,
    group: RowGroup,
    row_base: Reg,
}

impl<'a> NormRow<'a> {
    fn start(k: &mut Kernel, cfg: &'a NormConfig, threads: RowThreads) -> NormRow<'a> {
        let x = k.param_ptr("x");
        let residual = cfg.residual.then(|| k.param_ptr("residual"));
        let weight = k.param_ptr("weight");
        let bias = (cfg.kind == NormKind::LayerNorm).then(|| k.param_ptr("bias"));
        let out = k.param_ptr("out");
        // Warps past the last row stop: the rows come as a parameter, so that one kernel serves
        // every bucket's rows (its grid changes with them, its text does not).
        let rows = (threads == RowThreads::Warp).then(|| k.param_u32("rows"));
        // A warp's sums need no shared memory.
        let red = match threads {
            RowThreads::Block => scratch(k),
            RowThreads::Warp => String::new(),
        };
        let (group, row) = RowGroup::start(k, threads, rows);
        let row_base = k.mul_u32(&row, &cfg.cols);
        debug_assert!(
            threads == RowThreads::Block || cfg.cols <= CACHED_COLS,
            "a warp takes rows held in registers only"
        );
        NormRow {
            cfg,
            x,
            residual,
            weight,
            bias,
            out,
            red,
            group,
            row_base,
        }
    }

    /// The value of column `col` of this row: x (+ residual), as f32.
    fn load(&self, k: &mut Kernel, col: Reg) -> Reg {
        let elem = self.cfg.elem;
        let idx = k.add_u32(&self.row_base, &col);
        let addr = k.address(self.x, &idx, elem.bytes());
        let v = k.ld_global(elem, addr);
        match self.residual {
            Some(r) => {
                let ra = k.address(r, &idx, elem.bytes());
                let rv = k.ld_global(elem, ra);
                k.add_f32(&v, &rv)
            }
            None => v,
        }
    }

    /// `for col in index..cols step ROW_THREADS { body(col) }`: rows this long take a block.
    fn strided(&self, k: &mut Kernel, what: &str, body: &mut dyn FnMut(&mut Kernel, Reg)) {
        let col = k.mov(RegClass::B32, &self.group.index);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &col, &self.cfg.cols);
        k.bra(Some((past, true)), &done);
        body(k, col);
        k.emit(format!("add.u32 {col}, {col}, {ROW_THREADS}"));
        k.bra(None, &top);
        k.place(&done);
    }

    /// A row too long for registers, read again for each statistic: the mean (LayerNorm), the
    /// variance of the centred values (or the mean square), then normalised, scaled, shifted
    /// and stored.
    fn passes(&self, k: &mut Kernel) {
        let (cfg, elem) = (self.cfg, self.cfg.elem);
        let layer = cfg.kind == NormKind::LayerNorm;
        let mean = if layer {
            k.comment("pass 1: mean");
            let sum = k.mov(RegClass::F32, &F32(0.0));
            self.strided(k, "mean", &mut |k, col| {
                let v = self.load(k, col);
                k.emit(format!("add.f32 {sum}, {sum}, {v}"));
            });
            let total = self.group.sum(k, sum, &self.red);
            Some(k.mul_f32(&total, &F32(1.0 / cfg.cols as f32)))
        } else {
            None
        };
        k.comment(if layer {
            "pass 2: variance"
        } else {
            "pass 1: mean square"
        });
        let centred = |k: &mut Kernel, col: Reg| {
            let v = self.load(k, col);
            match mean {
                Some(m) => k.sub_f32(&v, &m),
                None => v,
            }
        };
        let sq = k.mov(RegClass::F32, &F32(0.0));
        self.strided(k, "var", &mut |k, col| {
            let c = centred(k, col);
            k.fma_into(sq, &c, &c);
        });
        let total = self.group.sum(k, sq, &self.red);
        let rstd = reciprocal_rms(k, &total, cfg);
        k.comment("last pass: normalise, scale, shift, store");
        self.strided(k, "write", &mut |k, col| {
            let c = centred(k, col);
            let n = k.mul_f32(&c, &rstd);
            let wa = k.address(self.weight, &col, elem.bytes());
            let w = k.ld_global(elem, wa);
            let mut y = k.mul_f32(&n, &w);
            if let Some(b) = self.bias {
                let ba = k.address(b, &col, elem.bytes());
                let bv = k.ld_global(elem, ba);
                y = k.add_f32(&y, &bv);
            }
            let idx = k.add_u32(&self.row_base, &col);
            let oa = k.address(self.out, &idx, elem.bytes());
            k.st_global(elem, oa, y);
        });
    }
}

/// The statistics of a row held in registers: the mean (LayerNorm; `sum` holds each thread's
/// partial sum of its values) and `1 / sqrt(var + eps)` of the centred values, over `groups` of
/// each thread's values, a group counting where its predicate in `valid` holds. Returns the
/// centred values, group by group, and that reciprocal.
#[allow(clippy::too_many_arguments)]
fn row_statistics(
    k: &mut Kernel,
    cfg: &NormConfig,
    red: &str,
    group: &RowGroup,
    sum: Reg,
    groups: &[Vec<Reg>],
    valid: &[Reg],
) -> (Vec<Vec<Reg>>, Reg) {
    let inv_cols = F32(1.0 / cfg.cols as f32);
    let mean = if cfg.kind == NormKind::LayerNorm {
        let total = group.sum(k, sum, red);
        Some(k.mul_f32(&total, &inv_cols))
    } else {
        None
    };
    let sq = k.mov(RegClass::F32, &F32(0.0));
    let mut centred = Vec::new();
    for (v, inside) in groups.iter().zip(valid) {
        let mut group = Vec::new();
        for value in v {
            let c = match mean {
                Some(m) => k.sub_f32(value, &m),
                None => *value,
            };
            k.emit(format!("@{inside} fma.rn.f32 {sq}, {c}, {c}, {sq}"));
            group.push(c);
        }
        centred.push(group);
    }
    let total = group.sum(k, sq, red);
    (centred, reciprocal_rms(k, &total, cfg))
}

/// `1 / sqrt(square_sum / cols + eps)`: a row's scale from the sum of its (centred) squares.
pub(crate) fn reciprocal_rms(k: &mut Kernel, square_sum: &Reg, cfg: &NormConfig) -> Reg {
    let var = k.mul_f32(square_sum, &F32(1.0 / cfg.cols as f32));
    let var_eps = k.add_f32(&var, &F32(cfg.eps));
    k.rsqrt_f32(&var_eps)
}

/// The register-cached form: each thread loads its `ceil(cols / threads)` columns once.
fn cached_row(
    k: &mut Kernel,
    cfg: &NormConfig,
    red: &str,
    group: &RowGroup,
    load: &dyn Fn(&mut Kernel, Reg) -> Reg,
    row_base: Reg,
    (weight, bias, out): (Reg, Option<Reg>, Reg),
) {
    let layer = cfg.kind == NormKind::LayerNorm;
    let stride = group.threads.count();
    let per_thread = cfg.cols.div_ceil(stride);
    let elem = cfg.elem;
    k.comment("read the row once into registers");
    let mut cols = Vec::new();
    let mut valid = Vec::new();
    let mut vals = Vec::new();
    let sum = k.mov(RegClass::F32, &F32(0.0));
    for i in 0..per_thread {
        let col = k.add_u32(&group.index, &(i * stride));
        let inside = k.setp("lt.u32", &col, &cfg.cols);
        let v = k.mov(RegClass::F32, &F32(0.0));
        let skip = k.label("skip_load");
        k.bra(Some((inside, false)), &skip);
        let loaded = load(k, col);
        k.emit(format!("mov.f32 {v}, {loaded}"));
        k.place(&skip);
        if layer {
            k.emit(format!("add.f32 {sum}, {sum}, {v}"));
        }
        cols.push(col);
        valid.push(inside);
        vals.push(v);
    }
    let groups: Vec<Vec<Reg>> = vals.iter().map(|v| vec![*v]).collect();
    let (centred, rstd) = row_statistics(k, cfg, red, group, sum, &groups, &valid);
    k.comment("normalise, scale, shift, store");
    for ((c, col), inside) in centred.iter().map(|c| &c[0]).zip(&cols).zip(&valid) {
        let skip = k.label("skip_store");
        k.bra(Some((*inside, false)), &skip);
        let n = k.mul_f32(c, &rstd);
        let wa = k.address(weight, col, elem.bytes());
        let w = k.ld_global(elem, wa);
        let mut y = k.mul_f32(&n, &w);
        if let Some(b) = bias {
            let ba = k.address(b, col, elem.bytes());
            let bv = k.ld_global(elem, ba);
            y = k.add_f32(&y, &bv);
        }
        let idx = k.add_u32(&row_base, col);
        let oa = k.address(out, &idx, elem.bytes());
        k.st_global(elem, oa, y);
        k.place(&skip);
    }
}

/// The register-cached form with 16-byte loads and stores (rows whose length is a multiple of
/// 16 bytes): each thread reads its chunks of `16 / elem.bytes()` columns once.
#[allow(clippy::too_many_arguments)]
fn vector_row(
    k: &mut Kernel,
    cfg: &NormConfig,
    red: &str,
    group: &RowGroup,
    (x, residual): (Reg, Option<Reg>),
    row_base: Reg,
    (weight, bias, out): (Reg, Option<Reg>, Reg),
) {
    let layer = cfg.kind == NormKind::LayerNorm;
    let elem = cfg.elem;
    let lanes = 16 / elem.bytes();
    let chunks = cfg.cols / lanes;
    let stride = group.threads.count();
    let per_thread = chunks.div_ceil(stride);
    let mut firsts = Vec::new();
    let mut valid = Vec::new();
    for i in 0..per_thread {
        let chunk = k.add_u32(&group.index, &(i * stride));
        valid.push(k.setp("lt.u32", &chunk, &chunks));
        firsts.push(k.mul_u32(&chunk, &lanes));
    }
    k.comment("the scale and shift of the thread's chunks, loaded while the kernel before runs");
    k.comment("(halves stay packed until used: fewer registers, more warps per SM)");
    let mut scales = Vec::new();
    for (first, inside) in firsts.iter().zip(&valid) {
        let skip = k.label("skip_scale");
        k.bra(Some((*inside, false)), &skip);
        let wa = k.address(weight, first, elem.bytes());
        let w = k.ld_global_words(wa);
        let b = bias.map(|b| {
            let ba = k.address(b, first, elem.bytes());
            k.ld_global_words(ba)
        });
        k.place(&skip);
        scales.push((w, b));
    }
    k.wait_for_inputs();
    k.comment("read the row once into registers, 16 bytes at a time");
    let mut vals: Vec<Vec<Reg>> = Vec::new();
    let sum = k.mov(RegClass::F32, &F32(0.0));
    for (first, inside) in firsts.iter().zip(&valid) {
        let (first, inside) = (*first, *inside);
        let v: Vec<Reg> = (0..lanes)
            .map(|_| k.mov(RegClass::F32, &F32(0.0)))
            .collect();
        let skip = k.label("skip_load");
        k.bra(Some((inside, false)), &skip);
        let idx = k.add_u32(&row_base, &first);
        let xa = k.address(x, &idx, elem.bytes());
        let mut loaded = k.ld_global_vec16(elem, xa);
        if let Some(r) = residual {
            let ra = k.address(r, &idx, elem.bytes());
            let rv = k.ld_global_vec16(elem, ra);
            loaded = loaded
                .iter()
                .zip(&rv)
                .map(|(a, b)| k.add_f32(a, b))
                .collect();
        }
        for (dst, src) in v.iter().zip(&loaded) {
            k.emit(format!("mov.f32 {dst}, {src}"));
        }
        k.place(&skip);
        if layer {
            for value in &v {
                k.emit(format!("add.f32 {sum}, {sum}, {value}"));
            }
        }
        vals.push(v);
    }
    let (centred, rstd) = row_statistics(k, cfg, red, group, sum, &vals, &valid);
    k.comment("normalise, scale, shift, store, 16 bytes at a time");
    for (((c, first), inside), (w, b)) in centred.iter().zip(&firsts).zip(&valid).zip(&scales) {
        let skip = k.label("skip_store");
        k.bra(Some((*inside, false)), &skip);
        let w = words_as_f32(k, elem, w);
        let b = b.as_ref().map(|b| words_as_f32(k, elem, b));
        let mut y = Vec::with_capacity(c.len());
        for (j, value) in c.iter().enumerate() {
            let n = k.mul_f32(value, &rstd);
            let mut r = k.mul_f32(&n, &w[j]);
            if let Some(b) = &b {
                r = k.add_f32(&r, &b[j]);
            }
            y.push(r);
        }
        let idx = k.add_u32(&row_base, first);
        let oa = k.address(out, &idx, elem.bytes());
        k.st_global_vec16(elem, oa, &y);
        k.place(&skip);
    }
}

/// 16 loaded bytes as f32 values: f32 words as they are, packed halves unpacked.
fn words_as_f32(k: &mut Kernel, elem: Elem, words: &[Reg]) -> Vec<Reg> {
    match elem {
        Elem::F32 => words
            .iter()
            .map(|w| k.op1("mov.b32", RegClass::F32, w))
            .collect(),
        Elem::F16 | Elem::BF16 => k.unpack_halves(elem, words),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer_norm(elem: Elem, rows: u32, cols: u32) -> GeneratedKernel {
        norm(&NormConfig {
            kind: NormKind::LayerNorm,
            residual: false,
            elem,
            rows,
            cols,
            eps: 1e-5,
        })
    }

    #[test]
    fn rows_of_up_to_256_chunks_take_a_warp() {
        // 768 and 2048 bf16 columns: 96 and 256 chunks of 8; eight rows a block, the last block
        // partly idle.
        for cols in [768, 2048] {
            let k = layer_norm(Elem::BF16, 17, cols);
            assert_eq!(k.name, format!("layer_norm_bf16_c{cols}_w"));
            assert_eq!(k.launch.grid, [3, 1, 1]);
            assert!(!k.module().contains("bar.sync"), "{}", k.name);
            assert_eq!(k.signature.last().map(|(p, _)| p.as_str()), Some("rows"));
        }
        // 1024 f32 columns: 256 chunks of 4.
        assert_eq!(layer_norm(Elem::F32, 8, 1024).launch.grid, [1, 1, 1]);
    }

    #[test]
    fn one_warp_per_row_kernel_serves_every_row_count() {
        // Buckets of 16 and 16384 tokens: the same text, grids of their rows.
        let (few, many) = (
            layer_norm(Elem::BF16, 16, 768),
            layer_norm(Elem::BF16, 16384, 768),
        );
        assert_eq!(few.ptx, many.ptx);
        assert_eq!((few.launch.grid[0], many.launch.grid[0]), (2, 2048));
    }

    #[test]
    fn longer_or_unaligned_rows_take_a_block() {
        // 2056 bf16 columns (257 chunks), 2048 f32 columns (512 chunks), 770 bf16 columns (not
        // whole chunks): a block per row, whose name does not depend on the rows.
        for (elem, cols) in [(Elem::BF16, 2056), (Elem::F32, 2048), (Elem::BF16, 770)] {
            let k = layer_norm(elem, 17, cols);
            assert_eq!(k.name, format!("layer_norm_{}_c{cols}", elem.name()));
            assert_eq!(k.launch.grid, [17, 1, 1]);
            assert!(k.module().contains("bar.sync"), "{}", k.name);
        }
    }
}
