//! Matrix products `x [M, K] @ w` with the epilogues the compiler fuses (bias, activation, SwiGLU,
//! residual), f32 accumulation for every operand type.
//!
//! This is the portable SIMT path: 64 x 64 output tiles, K in steps of 16 staged through shared
//! memory (A transposed so that both operands are read as 16-byte vectors), 256 threads each
//! holding a 4 x 4 block of accumulators (two with SwiGLU: gate and up), for f32 and whatever
//! the tensor-core kernel (`crate::gemm_tc`) and the matrix-vector kernel (`crate::gemv`) do not
//! take; [`path`] says which of the three a configuration gets.

use kiln_ir::kernel::Activation;

use crate::elementwise::activation;
use crate::gemv::Rows;
use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, KernelPath, Launch};

const BM: u32 = 64;
const BN: u32 = 64;
const BK: u32 = 16;
const THREADS: u32 = 256;

/// A GEMM kernel's static configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmConfig {
    /// Rows of x (all leading axes flattened).
    pub m: u32,
    /// The contraction size.
    pub k: u32,
    /// Columns of the product (before SwiGLU halves them).
    pub n: u32,
    /// The weight is stored `[N, K]`.
    pub transpose_b: bool,
    /// Add a bias `[N]`.
    pub bias: bool,
    /// Apply an activation.
    pub activation: Option<Activation>,
    /// `silu(y[:, :N/2]) * y[:, N/2:]`.
    pub swiglu: bool,
    /// Add a residual `[M, N_out]`.
    pub residual: bool,
    /// Element type of every operand and the output.
    pub elem: Elem,
    /// RMSNorm statistics carried from one product to the next (Hopper kernel only).
    pub row_norm: Option<RowNorm>,
}

/// An RMSNorm between two products, carried by them instead of launched: the product that
/// finishes the rows (a residual product of a pre-norm model) writes their sums of squares, and
/// the product that reads them normalised scales each row of its sums by the row's `1/rms`
/// before its epilogue (the norm's weight folded into its own weight, `fold::scales_by_norm`),
/// `rms = sqrt(sum of squares / K + eps)`: row scaling commutes with the product.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowNorm {
    /// Writes `row_sums [M, parts]` (f32): each row's sum of squares of its finished (rounded)
    /// outputs over each tile's columns, [`row_sum_parts`] of them.
    Sums,
    /// Scales each row of the product by `1 / sqrt(sum(norm_sums[row, ..parts]) / K + eps)`.
    Scale {
        /// Sums per row, as the product that wrote them has ([`row_sum_parts`]).
        parts: u32,
        /// The norm's epsilon.
        eps: f32,
    },
}

impl GemmConfig {
    /// `x [M, K]` times weights stored `[N, K]`, without an epilogue.
    pub fn plain(m: u32, n: u32, k: u32, elem: Elem) -> GemmConfig {
        GemmConfig {
            m,
            k,
            n,
            transpose_b: true,
            bias: false,
            activation: None,
            swiglu: false,
            residual: false,
            elem,
            row_norm: None,
        }
    }

    /// Columns of the output.
    pub fn n_out(&self) -> u32 {
        if self.swiglu {
            self.n / 2
        } else {
            self.n
        }
    }

    pub(crate) fn name(&self) -> String {
        let mut name = format!("gemm_{}_{}x{}x{}", self.elem.name(), self.m, self.n, self.k);
        if self.transpose_b {
            name.push_str("_bt");
        }
        name + &self.epilogue_suffix()
    }

    /// `_bias`, `_{activation}`, `_swiglu`, `_residual` for the epilogue's parts, in order.
    pub fn epilogue_suffix(&self) -> String {
        let mut suffix = String::new();
        if self.bias {
            suffix.push_str("_bias");
        }
        if let Some(a) = self.activation {
            suffix.push_str(&format!("_{}", format!("{a:?}").to_lowercase()));
        }
        if self.swiglu {
            suffix.push_str("_swiglu");
        }
        if self.residual {
            suffix.push_str("_residual");
        }
        match self.row_norm {
            Some(RowNorm::Sums) => suffix.push_str("_rowsums"),
            Some(RowNorm::Scale { parts, .. }) => suffix.push_str(&format!("_rms{parts}")),
            None => {}
        }
        suffix
    }
}

/// The path [`gemm`] takes for `cfg`: the matrix-vector kernel (`crate::gemv`) for at most 8 rows
/// against `[N, K]` weights (up to 16 rows in row groups when few columns would leave the GEMM's
/// tiles few, `gemv::narrow_grouped`), the Hopper kernel (`crate::gemm_wgmma`) where it applies (f16/bf16,
/// `[N, K]` weights, K a multiple of 8; its launches carry [`gemm_base`]'s kernel for GPUs
/// without sm_90a), the SIMT kernel otherwise. The compiler's cost model asks the same question,
/// so extraction prices the kernel lowering will pick.
pub fn path(cfg: &GemmConfig) -> KernelPath {
    if crate::gemv::supports(cfg) || crate::gemv::narrow_grouped(cfg) {
        KernelPath::Gemv
    } else if crate::gemm_wgmma::supports(cfg) {
        KernelPath::Wgmma
    } else if crate::gemm_tc::supports(cfg) {
        KernelPath::Mma
    } else {
        KernelPath::Simt
    }
}

/// Generates the kernel on [`path`]'s choice. Parameters: `x, w, [bias], [residual], out`.
pub fn gemm(cfg: &GemmConfig) -> GeneratedKernel {
    gemm_for(cfg, Rows::Fastest)
}

/// [`gemm`], with the matrix-vector kernel chosen under `rows` (batch invariance or not).
pub fn gemm_for(cfg: &GemmConfig, rows: Rows) -> GeneratedKernel {
    if crate::gemv::supports_grouped(cfg, rows) {
        // Batch-invariant decode of 9 to 16 sequences: the GEMV's kernel, in row groups.
        return crate::gemv::gemv_for(cfg, format!("{}_gemv", cfg.name()), rows);
    }
    match path(cfg) {
        KernelPath::Gemv => crate::gemv::gemv_for(cfg, format!("{}_gemv", cfg.name()), rows),
        KernelPath::Wgmma => crate::gemm_wgmma::gemm_wgmma(cfg, format!("{}_wgmma", cfg.name())),
        KernelPath::Mma => crate::gemm_tc::gemm_tc(cfg, format!("{}_tc", cfg.name())),
        _ => gemm_simt(cfg),
    }
}

/// The scratch [`gemm_for`]'s kernel binds besides the product's operands: bytes of its f32
/// `partials` and of its u32 `counters` (zero before the launch, left zero), where the Hopper
/// kernel splits K (`crate::gemm_wgmma::Tiling::splits`); `(0, 0)` for every other kernel.
pub fn split_scratch(cfg: &GemmConfig, rows: Rows) -> (u64, u64) {
    if crate::gemv::supports_grouped(cfg, rows) || path(cfg) != KernelPath::Wgmma {
        return (0, 0);
    }
    crate::gemm_wgmma::split_scratch(cfg, crate::gemm_wgmma::tiling(cfg))
}

/// The sums of squares per row that [`gemm_for`]'s kernel writes with [`RowNorm::Sums`] (one
/// per tile of columns), where it can: the Hopper kernel over an even N without SwiGLU, in a
/// tiling of at most [`crate::gemm_wgmma::MAX_ROW_SUM_PARTS`] tiles of columns (what a product
/// scaling its rows by them holds).
pub fn row_sum_parts(cfg: &GemmConfig, rows: Rows) -> Option<u32> {
    (carries_row_norm(cfg, rows) && !cfg.swiglu && cfg.n.is_multiple_of(2))
        .then(|| crate::gemm_wgmma::row_sum_parts(cfg, crate::gemm_wgmma::tiling(cfg)))
        .filter(|&parts| parts <= crate::gemm_wgmma::MAX_ROW_SUM_PARTS)
}

/// Whether [`gemm_for`]'s kernel can carry a [`RowNorm`]: the Hopper kernel's.
pub fn carries_row_norm(cfg: &GemmConfig, rows: Rows) -> bool {
    !crate::gemv::supports_grouped(cfg, rows) && path(cfg) == KernelPath::Wgmma
}

/// The kernel [`gemm`] picks where sm_90a is not available: the same work under the same
/// parameter names (pointers where the Hopper kernel takes tensor maps), in the base image.
pub fn gemm_base(cfg: &GemmConfig) -> GeneratedKernel {
    match path(cfg) {
        KernelPath::Wgmma => crate::gemm_tc::gemm_tc(cfg, format!("{}_tc", cfg.name())),
        _ => gemm(cfg),
    }
}

/// The SIMT kernel, for every configuration: 16 x 16 threads a block, each a 4 x 4 block of
/// outputs (and of SwiGLU's up columns), K in steps of `BK` staged through shared memory as f32.
pub fn gemm_simt(cfg: &GemmConfig) -> GeneratedKernel {
    assert!(
        !cfg.swiglu || cfg.n.is_multiple_of(2),
        "SwiGLU needs an even N"
    );
    assert!(
        cfg.row_norm.is_none(),
        "only the Hopper GEMM carries a row norm"
    );
    let mut k = Kernel::new(&cfg.name());
    let x = k.param_ptr("x");
    let w = k.param_ptr("w");
    let epilogue = EpiloguePtrs::declare(&mut k, cfg);
    let block = SimtBlock::start(&mut k, cfg, [x, w]);
    let zero = F32(0.0);
    let acc: Vec<Reg> = (0..16).map(|_| k.mov(RegClass::F32, &zero)).collect();
    let acc_up: Vec<Reg> = if cfg.swiglu {
        (0..16).map(|_| k.mov(RegClass::F32, &zero)).collect()
    } else {
        Vec::new()
    };
    let k0 = k.mov(RegClass::B32, &0u32);
    let top = k.label("k_loop");
    let done = k.label("k_done");
    k.place(&top);
    let past = k.setp("ge.u32", &k0, &cfg.k);
    k.bra(Some((past, true)), &done);
    block.stage_a(&mut k, &k0);
    k.comment("stage B[k0.., n0..] into b_tile[kk][col]");
    block.stage_b(&mut k, &k0, block.b_base, 0);
    if let Some(up) = block.b_up_base {
        k.comment("SwiGLU: the matching up columns into b_up_tile");
        block.stage_b(&mut k, &k0, up, cfg.n_out());
    }
    k.barrier();
    block.rank_one_updates(&mut k, &acc, &acc_up);
    k.barrier();
    k.emit(format!("add.u32 {k0}, {k0}, {BK}"));
    k.bra(None, &top);
    k.place(&done);
    block.epilogue(&mut k, &epilogue, &acc, &acc_up);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.n_out().div_ceil(BN), cfg.m.div_ceil(BM), 1],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
    .on(KernelPath::Simt)
}

/// The SIMT product's block: its thread (`tx`, `ty` of 16 x 16), first output row and column,
/// the shared tiles of A (transposed), B and SwiGLU's up columns, and the operands `x`, `w`.
struct SimtBlock<'a> {
    cfg: &'a GemmConfig,
    tid: Reg,
    tx: Reg,
    ty: Reg,
    m0: Reg,
    n0: Reg,
    a_base: Reg,
    b_base: Reg,
    b_up_base: Option<Reg>,
    operands: [Reg; 2],
}

impl<'a> SimtBlock<'a> {
    fn start(k: &mut Kernel, cfg: &'a GemmConfig, operands: [Reg; 2]) -> SimtBlock<'a> {
        let a_tile = k.shared("a_tile", BK * BM * 4);
        let b_tile = k.shared("b_tile", BK * BN * 4);
        let b_up_tile = cfg.swiglu.then(|| k.shared("b_up_tile", BK * BN * 4));
        let tid = k.special("tid.x");
        let tx = k.op2("and.b32", RegClass::B32, &tid, &15u32);
        let ty = k.op2("shr.u32", RegClass::B32, &tid, &4u32);
        let bx = k.special("ctaid.x");
        let by = k.special("ctaid.y");
        let m0 = k.mul_u32(&by, &BM);
        let n0 = k.mul_u32(&bx, &BN);
        let a_base = k.shared_base(&a_tile);
        let b_base = k.shared_base(&b_tile);
        let b_up_base = b_up_tile.map(|t| k.shared_base(&t));
        SimtBlock {
            cfg,
            tid,
            tx,
            ty,
            m0,
            n0,
            a_base,
            b_base,
            b_up_base,
            operands,
        }
    }

    fn stage_a(&self, k: &mut Kernel, k0: &Reg) {
        let cfg = self.cfg;
        k.comment("stage A[m0.., k0..] transposed into a_tile[kk][row]");
        for r in 0..(BM * BK / THREADS) {
            let e_idx = k.add_u32(&self.tid, &(r * THREADS));
            let row = k.op2("shr.u32", RegClass::B32, &e_idx, &4u32);
            let kk = k.op2("and.b32", RegClass::B32, &e_idx, &(BK - 1));
            let gr = k.add_u32(&self.m0, &row);
            let gk = k.add_u32(k0, &kk);
            let x = self.operands[0];
            let v = load_bounded(k, x, cfg.elem, &gr, cfg.m, &gk, cfg.k, cfg.k);
            let slot = k.mad_u32(&kk, &BM, &row);
            let addr = k.mad_u32(&slot, &4u32, &self.a_base);
            k.emit(format!("st.shared.f32 [{addr}], {v}"));
        }
    }

    /// B's `[k0.., n0 + col_offset..]` into the tile at `base` (columns past `col_offset +
    /// n_out`, this half of a SwiGLU product, read zeros), coalesced along the weight's
    /// contiguous axis.
    fn stage_b(&self, k: &mut Kernel, k0: &Reg, base: Reg, col_offset: u32) {
        let cfg = self.cfg;
        let (w, e) = (self.operands[1], cfg.elem);
        for r in 0..(BN * BK / THREADS) {
            let e_idx = k.add_u32(&self.tid, &(r * THREADS));
            let (kk, col) = if cfg.transpose_b {
                let col = k.op2("shr.u32", RegClass::B32, &e_idx, &4u32);
                let kk = k.op2("and.b32", RegClass::B32, &e_idx, &(BK - 1));
                (kk, col)
            } else {
                let kk = k.op2("shr.u32", RegClass::B32, &e_idx, &6u32);
                let col = k.op2("and.b32", RegClass::B32, &e_idx, &(BN - 1));
                (kk, col)
            };
            let gk = k.add_u32(k0, &kk);
            let gc0 = k.add_u32(&self.n0, &col);
            let gc = k.add_u32(&gc0, &col_offset);
            let limit = col_offset + cfg.n_out();
            let v = if cfg.transpose_b {
                load_bounded(k, w, e, &gc, limit, &gk, cfg.k, cfg.k)
            } else {
                load_bounded(k, w, e, &gk, cfg.k, &gc, limit, cfg.n)
            };
            let slot = k.mad_u32(&kk, &BN, &col);
            let addr = k.mad_u32(&slot, &4u32, &base);
            k.emit(format!("st.shared.f32 [{addr}], {v}"));
        }
    }

    /// The staged step's `BK` rank-1 updates of the thread's 4 x 4 accumulators (and of the up
    /// columns').
    fn rank_one_updates(&self, k: &mut Kernel, acc: &[Reg], acc_up: &[Reg]) {
        k.comment("16 rank-1 updates of the 4 x 4 accumulator block");
        let a_off = k.mul_u32(&self.ty, &16u32);
        let a_ptr = k.add_u32(&self.a_base, &a_off);
        let b_off = k.mul_u32(&self.tx, &16u32);
        let b_ptr = k.add_u32(&self.b_base, &b_off);
        let b_up_ptr = self.b_up_base.map(|u| k.add_u32(&u, &b_off));
        for kk in 0..BK {
            let a = load_v4(k, a_ptr, kk * BM * 4);
            let b = load_v4(k, b_ptr, kk * BN * 4);
            for i in 0..4 {
                for j in 0..4 {
                    k.fma_into(acc[i * 4 + j], &a[i], &b[j]);
                }
            }
            if let Some(p) = b_up_ptr {
                let bu = load_v4(k, p, kk * BN * 4);
                for i in 0..4 {
                    for j in 0..4 {
                        k.fma_into(acc_up[i * 4 + j], &a[i], &bu[j]);
                    }
                }
            }
        }
    }

    fn epilogue(&self, k: &mut Kernel, epilogue: &EpiloguePtrs, acc: &[Reg], acc_up: &[Reg]) {
        let (cfg, n_out) = (self.cfg, self.cfg.n_out());
        k.comment("epilogue");
        for i in 0..4u32 {
            for j in 0..4u32 {
                let skip = k.label("skip");
                let r0 = k.mad_u32(&self.ty, &4u32, &self.m0);
                let row = k.add_u32(&r0, &i);
                let c0 = k.mad_u32(&self.tx, &4u32, &self.n0);
                let col = k.add_u32(&c0, &j);
                let out_row = k.setp("ge.u32", &row, &cfg.m);
                k.bra(Some((out_row, true)), &skip);
                let out_col = k.setp("ge.u32", &col, &n_out);
                k.bra(Some((out_col, true)), &skip);
                let idx = (i * 4 + j) as usize;
                let up = acc_up.get(idx).copied();
                epilogue.finish(k, cfg, acc[idx], up, &col, |k| {
                    k.mad_u32(&row, &n_out, &col)
                });
                k.place(&skip);
            }
        }
    }
}

/// The parameters of a product's epilogue, declared after `x` and `w`: `[bias], [residual],
/// out`, pointers but for `out` as a tensor map (a staged Hopper epilogue's TMA stores).
pub(crate) struct EpiloguePtrs {
    bias: Option<Reg>,
    residual: Option<Reg>,
    out: Reg,
    out_is_map: bool,
    residual_is_map: bool,
}

impl EpiloguePtrs {
    /// Declares the parameters `cfg` needs.
    pub(crate) fn declare(k: &mut Kernel, cfg: &GemmConfig) -> EpiloguePtrs {
        EpiloguePtrs::declare_with(k, cfg, None, false)
    }

    /// [`EpiloguePtrs::declare`], `out` as a tensor map of `spec` where given (for TMA stores),
    /// and `residual` too where `residual_map` (for TMA loads); [`EpiloguePtrs::out_map`] and
    /// [`EpiloguePtrs::residual_map`] are then the maps' addresses.
    pub(crate) fn declare_with(
        k: &mut Kernel,
        cfg: &GemmConfig,
        out_map: Option<crate::TensorMapSpec>,
        residual_map: bool,
    ) -> EpiloguePtrs {
        EpiloguePtrs {
            bias: cfg.bias.then(|| k.param_ptr("bias")),
            residual: cfg.residual.then(|| match (&out_map, residual_map) {
                (Some(spec), true) => k.param_tensor_map("residual", *spec),
                _ => k.param_ptr("residual"),
            }),
            residual_is_map: out_map.is_some() && residual_map,
            out_is_map: out_map.is_some(),
            out: match out_map {
                Some(spec) => k.param_tensor_map("out", spec),
                None => k.param_ptr("out"),
            },
        }
    }

    /// Finishes the product element `v` of output column `col` (`up`: the matching SwiGLU up
    /// column's sum) and stores it at element `out_index(k)` of `out`. Every product kernel but
    /// the Hopper one (which stores pairs) ends this way.
    pub(crate) fn finish(
        &self,
        k: &mut Kernel,
        cfg: &GemmConfig,
        v: Reg,
        up: Option<Reg>,
        col: &Reg,
        out_index: impl FnOnce(&mut Kernel) -> Reg,
    ) {
        let oi = out_index(k);
        let v = self.value(k, cfg, v, up, col, &oi);
        let oa = k.address(self.out, &oi, cfg.elem.bytes());
        k.st_global(cfg.elem, oa, v);
    }

    /// The finished value of product element `v` at output column `col`, element `oi` of the
    /// output: bias, activation or SwiGLU, then the residual.
    pub(crate) fn value(
        &self,
        k: &mut Kernel,
        cfg: &GemmConfig,
        v: Reg,
        up: Option<Reg>,
        col: &Reg,
        oi: &Reg,
    ) -> Reg {
        let mut addends = self.load_bias(k, cfg, col, up.is_some());
        addends.residual = self.load_residual(k, cfg, oi);
        apply(k, cfg, v, up, &addends)
    }

    /// The bias of output column `col`, and with `up` of its SwiGLU up column, when `cfg` has
    /// one (weights: a kernel may load them before waiting for the one before it).
    pub(crate) fn load_bias(
        &self,
        k: &mut Kernel,
        cfg: &GemmConfig,
        col: &Reg,
        up: bool,
    ) -> Addends {
        let e = cfg.elem;
        let mut addends = Addends::default();
        if let Some(b) = self.bias {
            let ba = k.address(b, col, e.bytes());
            addends.bias = Some(k.ld_global(e, ba));
            if up {
                let uc = k.add_u32(col, &cfg.n_out());
                let ua = k.address(b, &uc, e.bytes());
                addends.bias_up = Some(k.ld_global(e, ua));
            }
        }
        addends
    }

    /// The residual at output element `oi`, when `cfg` has one.
    pub(crate) fn load_residual(&self, k: &mut Kernel, cfg: &GemmConfig, oi: &Reg) -> Option<Reg> {
        let r = self.residual?;
        let ra = k.address(r, oi, cfg.elem.bytes());
        Some(k.ld_global(cfg.elem, ra))
    }

    /// The bias pointer, when `cfg` has one.
    pub(crate) fn bias(&self) -> Option<Reg> {
        self.bias
    }

    /// The residual pointer, when `cfg` has one.
    pub(crate) fn residual(&self) -> Option<Reg> {
        assert!(
            !self.residual_is_map,
            "`residual` is a tensor map here: see `residual_map`"
        );
        self.residual
    }

    /// The residual's tensor map (its generic address), when `cfg` has one, declared by
    /// `declare_with` as a map.
    pub(crate) fn residual_map(&self) -> Option<Reg> {
        assert!(
            self.residual_is_map,
            "`residual` is a pointer here: see `residual`"
        );
        self.residual
    }

    /// The output pointer.
    pub(crate) fn out(&self) -> Reg {
        assert!(
            !self.out_is_map,
            "`out` is a tensor map here: see `out_map`"
        );
        self.out
    }

    /// The output's tensor map (its generic address), declared by `declare_with`.
    pub(crate) fn out_map(&self) -> Reg {
        assert!(self.out_is_map, "`out` is a pointer here: see `out`");
        self.out
    }
}

/// The loaded operands of one output element's epilogue, as f32.
#[derive(Default)]
pub(crate) struct Addends {
    /// The bias of its column.
    pub bias: Option<Reg>,
    /// With SwiGLU, the bias of the matching up column.
    pub bias_up: Option<Reg>,
    /// The residual at its place.
    pub residual: Option<Reg>,
}

/// The epilogue's arithmetic on product element `v` (`up`: the SwiGLU up column's sum): bias,
/// activation or SwiGLU, then the residual, with the operands `cfg` needs already loaded.
pub(crate) fn apply(
    k: &mut Kernel,
    cfg: &GemmConfig,
    mut v: Reg,
    mut up: Option<Reg>,
    addends: &Addends,
) -> Reg {
    if let Some(b) = addends.bias {
        v = k.add_f32(&v, &b);
    }
    if let (Some(u), Some(b)) = (up, addends.bias_up) {
        up = Some(k.add_f32(&u, &b));
    }
    if let Some(a) = cfg.activation {
        v = activation(k, v, a);
    }
    if let Some(u) = up {
        let g = activation(k, v, Activation::Silu);
        v = k.mul_f32(&g, &u);
    }
    if let Some(r) = addends.residual {
        v = k.add_f32(&v, &r);
    }
    v
}

/// `base[r * stride + c]` as f32 when `r < rows` and `c < cols`, else 0.
#[allow(clippy::too_many_arguments)]
fn load_bounded(
    k: &mut Kernel,
    base: Reg,
    elem: Elem,
    r: &Reg,
    rows: u32,
    c: &Reg,
    cols: u32,
    stride: u32,
) -> Reg {
    let v = k.mov(RegClass::F32, &F32(0.0));
    let skip = k.label("oob");
    let r_out = k.setp("ge.u32", r, &rows);
    k.bra(Some((r_out, true)), &skip);
    let c_out = k.setp("ge.u32", c, &cols);
    k.bra(Some((c_out, true)), &skip);
    let idx = k.mad_u32(r, &stride, c);
    let addr = k.address(base, &idx, elem.bytes());
    let loaded = k.ld_global(elem, addr);
    k.emit(format!("mov.f32 {v}, {loaded}"));
    k.place(&skip);
    v
}

/// Four consecutive f32 from shared memory at `ptr + offset` (16-byte aligned).
fn load_v4(k: &mut Kernel, ptr: Reg, offset: u32) -> [Reg; 4] {
    let r = [
        k.reg(RegClass::F32),
        k.reg(RegClass::F32),
        k.reg(RegClass::F32),
        k.reg(RegClass::F32),
    ];
    k.emit(format!(
        "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{ptr}+{offset}]",
        r[0], r[1], r[2], r[3]
    ));
    r
}
