//! Fused attention, prefill and decode: `softmax(q k^T * scale + masks) v` with online softmax in
//! f32 registers (exp2 with log2(e) folded into the scale), never an S x T matrix in memory.
//!
//! This is the portable SIMT form: one warp per query row, the head dimension spread over the
//! lanes, keys visited one by one with a warp-wide dot product. It covers every feature the
//! compiler fuses: GQA/MQA (a K/V head serves its query group, read in place), causal and
//! sliding-window masks, padding masks and positions read from device memory, RoPE as a prologue
//! (cos/sin tables in device memory), and Philox-4x32-10 dropout with exactly the IR's mask.
//! [`attention`] takes the tensor-core kernel (`crate::attention_tc`) for the same features in
//! f16/bf16, and for f16/bf16 decode steps the kernel that serves a query group from one read of
//! its K/V (`crate::attention_decode`); this one stays for f32, head dimensions the MMA shapes
//! cannot take, and the decode steps that one does not serve (flash-decoding: `splits` key
//! ranges per query and [`attention_combine`]).
//!
//! A query that sees no key at all (a padding query of a left-padded batch, or a row of padding
//! only) stores zeros, as the IR's attention defines it (`kiln_ir::kernel::visible`).

use crate::paging::{KeyRows, Paging};
use crate::ptx::{Elem, Kernel, Label, Operand, Reg, RegClass, F32};
use crate::rope::RotateConfig;
use crate::{GeneratedKernel, KernelPath, Launch};

/// Query rows (warps) per block.
const WARPS: u32 = 4;
/// Keys whose K/V rows a warp loads before it uses the first of them (their latencies overlap).
const KEY_UNROLL: u32 = 4;

/// Which keys a query sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRule {
    /// Every key.
    All,
    /// Prefill: query `i` sees keys `j <= i + (T - S)` (within the window).
    Causal {
        /// Sliding window, if any.
        window: Option<u32>,
    },
    /// Over a KV cache: the query at position `p = positions[b, i]` sees keys `j <= p` (within the
    /// window).
    Position {
        /// Sliding window, if any.
        window: Option<u32>,
    },
}

impl KeyRule {
    /// The sliding window, if any.
    pub fn window(self) -> Option<u32> {
        match self {
            KeyRule::All => None,
            KeyRule::Causal { window } | KeyRule::Position { window } => window,
        }
    }
}

/// Dropout on attention probabilities as every kernel applies it: the keep threshold and scale
/// the IR's own mask uses, derived once from the op's f64 `p` (never from a rounded copy, whose
/// threshold can differ: 0.1 as f32 gives 429496736, as f64 429496730), and the Philox stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Elements whose Philox word is at least this are kept.
    pub threshold: u32,
    /// Kept elements are multiplied by this.
    pub keep_scale: f32,
    /// The op's stream id.
    pub stream: u32,
}

impl Dropout {
    /// The dropout of an IR op with drop probability `p` and stream `stream`.
    pub fn new(p: f64, stream: u32) -> Dropout {
        Dropout {
            threshold: kiln_ir::philox::dropout_threshold(p),
            keep_scale: kiln_ir::philox::dropout_scale(p),
            stream,
        }
    }
}

/// An attention kernel's static configuration. Tensors are indexed with element strides
/// `[batch, head, row]` (the head dimension is contiguous), so q, k and v can be read in place
/// from a fused QKV product or a KV cache.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Batch size.
    pub batch: u32,
    /// Query heads.
    pub heads: u32,
    /// K/V heads (dividing `heads`).
    pub kv_heads: u32,
    /// Query rows per sequence (S).
    pub q_len: u32,
    /// Keys per sequence (T).
    pub kv_len: u32,
    /// Head dimension (D).
    pub head_dim: u32,
    /// Multiplies the scores.
    pub scale: f32,
    /// Which keys each query sees.
    pub keys: KeyRule,
    /// A padding mask operand `[B, T]` (i64, 1 = key present).
    pub padding: bool,
    /// RoPE on q (and on k when `rope_k`) from `cos`/`sin` tables `[P, D/2]` (f32) at the
    /// `positions` operand `[B, S]` (i64).
    pub rope: bool,
    /// Rotate k too (prefill; a KV cache already holds rotated keys).
    pub rope_k: bool,
    /// Dropout on the probabilities, with a `seed` operand (i64 `[1]`).
    pub dropout: Option<Dropout>,
    /// Element type of q, k, v and the output.
    pub elem: Elem,
    /// Strides of q, k, v and out, in elements: `[batch, head, row]`.
    pub strides: [[u32; 3]; 4],
    /// Split the keys into this many fixed ranges (flash-decoding): each block writes partial
    /// results (`partial_acc`, `partial_ml`) that `attention_combine` merges. 1 writes `out`
    /// directly. The grid depends only on the configuration, never on a request's length.
    pub splits: u32,
    /// k and v are a paged KV cache (`strides[1..3]` the pool's, a `table` parameter; see
    /// `crate::paging`).
    pub paging: Option<Paging>,
}

impl AttentionConfig {
    /// A configuration of these shapes and element type with no features (every key, no masks,
    /// RoPE or dropout, scale 1), contiguous layouts and one key range: what lowering and the
    /// cost model start from before taking an op's features.
    pub fn plain(
        [batch, heads, kv_heads, q_len, kv_len, head_dim]: [u32; 6],
        elem: Elem,
    ) -> AttentionConfig {
        let mut cfg = AttentionConfig {
            batch,
            heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
            scale: 1.0,
            keys: KeyRule::All,
            padding: false,
            rope: false,
            rope_k: false,
            dropout: None,
            elem,
            strides: [[0; 3]; 4],
            splits: 1,
            paging: None,
        };
        cfg.strides = cfg.contiguous_strides();
        cfg
    }

    /// Takes the scale, key rule, padding, RoPE and dropout of the IR's prefill attention `spec`
    /// (q and k rotated), leaving shapes, layouts and splits as they are.
    pub fn take_attention(&mut self, spec: &kiln_ir::kernel::AttentionSpec) {
        self.scale = spec.scale as f32;
        self.keys = if spec.causal {
            KeyRule::Causal {
                window: self.window(spec.window),
            }
        } else {
            KeyRule::All
        };
        self.padding = spec.padding;
        self.rope = spec.rope.is_some();
        self.rope_k = spec.rope.is_some();
        self.dropout = spec.dropout.map(|(p, s)| Dropout::new(p, s));
    }

    /// A sliding window of `window` keys, or none when it covers every key (a query at most
    /// `kv_len - 1` positions past a key sees it): Mistral's 4096-key window in buckets of up to
    /// 4096 keys is no window, and its kernels mask no tile's first keys.
    fn window(&self, window: Option<i64>) -> Option<u32> {
        window
            .filter(|&w| w < i64::from(self.kv_len))
            .map(|w| w as u32)
    }

    /// Takes the scale, position key rule and RoPE (of q only: the cache holds rotated keys) of
    /// the IR's attention over a KV cache `spec`.
    pub fn take_decode(&mut self, spec: &kiln_ir::kernel::DecodeAttentionSpec) {
        self.scale = spec.scale as f32;
        self.keys = KeyRule::Position {
            window: self.window(spec.window),
        };
        self.rope = spec.rope.is_some();
        self.rope_k = false;
    }

    /// Contiguous `[B, H, S, D]` / `[B, KVH, T, D]` strides.
    pub fn contiguous_strides(&self) -> [[u32; 3]; 4] {
        let (h, kvh, s, t, d) = (
            self.heads,
            self.kv_heads,
            self.q_len,
            self.kv_len,
            self.head_dim,
        );
        let q = [h * s * d, s * d, d];
        let kv = [kvh * t * d, t * d, d];
        [q, kv, kv, q]
    }

    pub(crate) fn name(&self) -> String {
        let mut n = format!(
            "attention_{}_h{}kv{}_d{}_s{}_t{}",
            self.elem.name(),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.q_len,
            self.kv_len
        );
        match self.keys {
            KeyRule::All => {}
            KeyRule::Causal { window } => {
                n.push_str("_causal");
                if let Some(w) = window {
                    n.push_str(&format!("_w{w}"));
                }
            }
            KeyRule::Position { window } => {
                n.push_str("_cached");
                if let Some(w) = window {
                    n.push_str(&format!("_w{w}"));
                }
            }
        }
        if self.padding {
            n.push_str("_padded");
        }
        if self.rope {
            n.push_str(if self.rope_k { "_rope" } else { "_rope_q" });
        }
        if self.dropout.is_some() {
            n.push_str("_dropout");
        }
        if self.splits > 1 {
            n.push_str(&format!("_split{}", self.splits));
        }
        n.push_str(&Paging::suffix(self.paging));
        n
    }

    /// Takes a paged cache as k and v: `paging`'s pool strides and the `table` parameter.
    pub fn take_paging(&mut self, paging: Paging) {
        let s = paging.strides(self.kv_heads, self.head_dim);
        self.strides[1] = s;
        self.strides[2] = s;
        self.paging = Some(paging);
    }
}

/// The path [`attention`] takes for `cfg`: the Hopper kernel where `crate::attention_wgmma`
/// applies (its launches carry [`attention_base`]'s kernel for GPUs without sm_90a), or applies
/// once [`prerotated`] has taken RoPE out of the kernel; tensor cores where `crate::attention_tc`
/// applies; the SIMT kernel otherwise. The compiler's cost model asks the same question.
pub fn path(cfg: &AttentionConfig) -> KernelPath {
    if crate::attention_wgmma::supports(cfg) || prerotated(cfg).is_some() {
        KernelPath::Wgmma
    } else if crate::attention_tc::supports(cfg) {
        KernelPath::Mma
    } else {
        KernelPath::Simt
    }
}

/// What runs on the Hopper kernel after [`crate::rope::rotate`] has rotated q (and k, when
/// `rope_k`) into contiguous `[B, H, S, D]` buffers: `cfg` without RoPE, reading those buffers,
/// when that configuration takes the Hopper path (`None` otherwise, and without RoPE). The
/// rotations (the two [`RotateConfig`]s) read the `positions` operand `[B, S]`.
pub fn prerotated(cfg: &AttentionConfig) -> Option<AttentionConfig> {
    if !cfg.rope || (cfg.rope_k && cfg.kv_len != cfg.q_len) {
        return None;
    }
    let mut plain = cfg.clone();
    plain.rope = false;
    plain.rope_k = false;
    let [Some(q), k] = rotations(cfg) else {
        return None;
    };
    plain.strides[0] = q.out_strides();
    if let Some(k) = k {
        plain.strides[1] = k.out_strides();
    }
    crate::attention_wgmma::supports(&plain).then_some(plain)
}

/// The rotations of q, and of k when `cfg.rope_k`, that [`prerotated`] runs first.
pub fn rotations(cfg: &AttentionConfig) -> [Option<RotateConfig>; 2] {
    let rotation = |heads, len, strides| RotateConfig {
        batch: cfg.batch,
        heads,
        len,
        head_dim: cfg.head_dim,
        strides,
        elem: cfg.elem,
    };
    [
        cfg.rope
            .then(|| rotation(cfg.heads, cfg.q_len, cfg.strides[0])),
        (cfg.rope && cfg.rope_k).then(|| rotation(cfg.kv_heads, cfg.kv_len, cfg.strides[1])),
    ]
}

/// Generates the kernel on [`path`]'s choice (a configuration with RoPE gets [`attention_base`]'s
/// kernel: lowering runs [`prerotated`]'s instead). Parameters: `q, k, v, out` (or `partial_acc,
/// partial_ml` when split), `[mask], [positions], [cos, sin], [seed], [table]` (`table` when
/// the k/v caches are paged).
pub fn attention(cfg: &AttentionConfig) -> GeneratedKernel {
    if crate::attention_wgmma::supports(cfg) {
        let pool = Paging::pool_suffix(cfg.paging);
        crate::attention_wgmma::attention_wgmma(cfg, format!("{}{pool}_wgmma", cfg.name()))
    } else {
        attention_base(cfg)
    }
}

/// The kernel [`attention`] picks where sm_90a is not available: the same work under the same
/// parameter names (pointers where the Hopper kernel takes tensor maps), in the base image.
pub fn attention_base(cfg: &AttentionConfig) -> GeneratedKernel {
    if crate::attention_decode::supports(cfg) {
        crate::attention_decode::attention_decode(cfg, format!("{}_decode", cfg.name()))
    } else if crate::attention_tc::supports(cfg) {
        crate::attention_tc::attention_tc(cfg, format!("{}_tc", cfg.name()))
    } else {
        attention_simt(cfg)
    }
}

/// The SIMT kernel, for every configuration: a warp per query row (`WARPS` rows a block),
/// its lanes over the head dimension, keys `KEY_UNROLL` at a time (every load first, then
/// each key's online-softmax update in order); with key ranges split, each writes unnormalised
/// partial results for `attention_combine`.
pub fn attention_simt(cfg: &AttentionConfig) -> GeneratedKernel {
    assert!(cfg.splits >= 1, "at least one key range");
    assert!(
        cfg.heads.is_multiple_of(cfg.kv_heads),
        "K/V heads must divide the heads"
    );
    let mut k = Kernel::new(&cfg.name());
    let p = SimtParams::declare(&mut k, cfg);
    let row = QueryRow::start(&mut k, cfg);
    let [qs, ks, vs, os] = cfg.strides;
    let q_row = row.base(&mut k, qs, row.h, row.i);
    let o_row = row.base(&mut k, os, row.h, row.i);
    let k_rows = KeyRows::new(&mut k, ks, [row.b, row.kvh], p.opt.paged);
    let v_rows = KeyRows::new(&mut k, vs, [row.b, row.kvh], p.opt.paged);
    let lanes = LaneCols::new(&mut k, cfg.head_dim, row.lane);
    let pos_i = p.opt.positions.map(|positions| {
        let idx = k.mad_u32(&row.b, &cfg.q_len, &row.i);
        let a = k.address(positions, &idx, 8);
        let wide = k.ld_global_i64(a);
        k.op1("cvt.u32.u64", RegClass::B32, &wide)
    });
    k.comment("q, rotated and pre-scaled by scale * log2(e)");
    let q_scale = F32(cfg.scale * std::f32::consts::LOG2_E);
    let q_pos = if cfg.rope { pos_i } else { None };
    let mut qv = Vec::new();
    for (c, ok) in lanes.cols.iter().zip(&lanes.valid) {
        let x = p.element(&mut k, cfg, [p.q, q_row, *c], *ok, q_pos);
        qv.push(k.mul_f32(&x, &q_scale));
    }
    let keys = row.keys(&mut k, cfg, pos_i);
    let state = Online::new(&mut k, cfg, &p, &row, lanes.cols.len());
    let loop_ = KeyLoop {
        cfg,
        p: &p,
        row: &row,
        lanes: &lanes,
        rows: [&k_rows, &v_rows],
    };
    loop_.emit(&mut k, &qv, keys, &state);
    let grid_x = if let Some(ml) = p.partial_ml {
        k.comment("partial results: unnormalised accumulators, running max (base 2) and sum");
        let split = row.split.expect("split");
        let row_id = k.mad_u32(&row.b, &cfg.heads, &row.h);
        let q_row_id = k.mad_u32(&row_id, &cfg.q_len, &row.i);
        let at = k.mad_u32(&q_row_id, &cfg.splits, &split);
        let base = k.mul_u32(&at, &cfg.head_dim);
        let values = lanes.cols.iter().zip(&lanes.valid).zip(&state.acc);
        for ((c, ok), a) in values {
            let skip = k.label("skip_partial");
            k.bra(Some((*ok, false)), &skip);
            let idx = k.add_u32(&base, c);
            let pa = k.address(p.out, &idx, 4);
            k.st_global(Elem::F32, pa, *a);
            k.place(&skip);
        }
        store_max_and_sum(&mut k, ml, at, (state.m, state.l), row.lane);
        if row.warp_ranges {
            cfg.splits.div_ceil(WARPS)
        } else {
            cfg.q_len.div_ceil(WARPS) * cfg.splits
        }
    } else {
        k.comment("normalise once and store (a row that sees no key stores zeros)");
        let inv = reciprocal_or_zero(&mut k, state.l);
        let values = [&lanes.cols[..], &lanes.valid, &state.acc];
        store_scaled_row(&mut k, (cfg.elem, p.out, &o_row), values, &inv);
        cfg.q_len.div_ceil(WARPS)
    };
    k.place(&row.exit);
    let launch = Launch {
        grid: [grid_x, cfg.heads, cfg.batch],
        block: [32 * WARPS, 1, 1],
        shared_bytes: 0,
    };
    GeneratedKernel::new(k, launch).on(KernelPath::Simt)
}

/// The SIMT kernel's parameters: `q, k, v`, then `out` (or, with key ranges split,
/// `partial_acc, partial_ml`), and as the configuration asks `mask, positions, cos, sin, seed,
/// table`.
struct SimtParams {
    q: Reg,
    k: Reg,
    v: Reg,
    out: Reg,
    partial_ml: Option<Reg>,
    opt: OptionalParams,
}

/// The parameters an attention kernel takes after its operands and outputs as its
/// configuration asks: `mask` (padding), `positions` (RoPE or the position rule), `cos, sin`,
/// `seed` (dropout), `table` (a paged cache).
pub(crate) struct OptionalParams {
    pub(crate) mask: Option<Reg>,
    pub(crate) positions: Option<Reg>,
    pub(crate) tables: Option<(Reg, Reg)>,
    pub(crate) seed: Option<Reg>,
    pub(crate) paged: Option<(Reg, Paging)>,
}

impl OptionalParams {
    pub(crate) fn declare(k: &mut Kernel, cfg: &AttentionConfig) -> OptionalParams {
        let mask = cfg.padding.then(|| k.param_ptr("mask"));
        let needs_positions = cfg.rope || matches!(cfg.keys, KeyRule::Position { .. });
        let positions = needs_positions.then(|| k.param_ptr("positions"));
        let tables = cfg.rope.then(|| (k.param_ptr("cos"), k.param_ptr("sin")));
        let seed = cfg.dropout.map(|_| k.param_ptr("seed"));
        let paged = cfg.paging.map(|p| (k.param_ptr("table"), p));
        OptionalParams {
            mask,
            positions,
            tables,
            seed,
            paged,
        }
    }
}

impl SimtParams {
    fn declare(k: &mut Kernel, cfg: &AttentionConfig) -> SimtParams {
        let (q, kp, v) = (k.param_ptr("q"), k.param_ptr("k"), k.param_ptr("v"));
        let (out, partial_ml) = if cfg.splits > 1 {
            (k.param_ptr("partial_acc"), Some(k.param_ptr("partial_ml")))
        } else {
            (k.param_ptr("out"), None)
        };
        SimtParams {
            q,
            k: kp,
            v,
            out,
            partial_ml,
            opt: OptionalParams::declare(k, cfg),
        }
    }

    /// Element `col` of the row at element `row` of `base` (zero where `ok` fails), RoPE-rotated
    /// at `pos` when given.
    fn element(
        &self,
        k: &mut Kernel,
        cfg: &AttentionConfig,
        [base, row, col]: [Reg; 3],
        ok: Reg,
        pos: Option<Reg>,
    ) -> Reg {
        let e = cfg.elem;
        let value = k.mov(RegClass::F32, &F32(0.0));
        let skip = k.label("skip_elem");
        k.bra(Some((ok, false)), &skip);
        let idx = k.add_u32(&row, &col);
        let a = k.address(base, &idx, e.bytes());
        let x = k.ld_global(e, a);
        match (pos, self.opt.tables) {
            (Some(p), Some(tables)) => {
                let half = cfg.head_dim / 2;
                let r = rotated_element(k, e, [base, row, col, p], x, half, tables);
                k.emit(format!("mov.f32 {value}, {r}"));
            }
            _ => k.emit(format!("mov.f32 {value}, {x}")),
        }
        k.place(&skip);
        value
    }
}

/// A warp's query row: its lane, the row `i` of head `h` of sequence `b` (K/V head `kvh`), with
/// key ranges split the warp's range `split` (a decode step's one row gives each warp a range of
/// its own, `warp_ranges`; otherwise block x enumerates (query block, key range) pairs), and the
/// label the kernel ends at, to which a warp past the rows or ranges has jumped already.
struct QueryRow {
    lane: Reg,
    i: Reg,
    split: Option<Reg>,
    warp_ranges: bool,
    h: Reg,
    b: Reg,
    kvh: Reg,
    exit: Label,
}

impl QueryRow {
    fn start(k: &mut Kernel, cfg: &AttentionConfig) -> QueryRow {
        let tid = k.special("tid.x");
        let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
        let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
        let bx = k.special("ctaid.x");
        let split = cfg.splits > 1;
        let warp_ranges = split && cfg.q_len == 1;
        let (i, split) = if warp_ranges {
            let r = k.mad_u32(&bx, &WARPS, &warp);
            (k.mov(RegClass::B32, &0u32), Some(r))
        } else if split {
            let q = k.op2("div.u32", RegClass::B32, &bx, &cfg.splits);
            let r = k.op2("rem.u32", RegClass::B32, &bx, &cfg.splits);
            (k.mad_u32(&q, &WARPS, &warp), Some(r))
        } else {
            (k.mad_u32(&bx, &WARPS, &warp), None)
        };
        let h = k.special("ctaid.y");
        let b = k.special("ctaid.z");
        let exit = k.label("exit");
        let past = k.setp("ge.u32", &i, &cfg.q_len);
        k.bra(Some((past, true)), &exit);
        if let Some(r) = split.filter(|_| warp_ranges) {
            let past = k.setp("ge.u32", &r, &cfg.splits);
            k.bra(Some((past, true)), &exit);
        }
        let kvh = k.op2("div.u32", RegClass::B32, &h, &(cfg.heads / cfg.kv_heads));
        QueryRow {
            lane,
            i,
            split,
            warp_ranges,
            h,
            b,
            kvh,
            exit,
        }
    }

    /// The first element of `row` of `head` of this sequence in a tensor of `strides`.
    fn base(&self, k: &mut Kernel, strides: [u32; 3], head: Reg, row: Reg) -> Reg {
        let t0 = k.mul_u32(&self.b, &strides[0]);
        let t1 = k.mad_u32(&head, &strides[1], &t0);
        k.mad_u32(&row, &strides[2], &t1)
    }

    /// The keys this query sees, `[start, end)`: by the key rule (the position rule at `pos`),
    /// and with key ranges split, this range's even share of them (a range fixed by the
    /// capacity would leave all but the first few blocks idle at short contexts).
    fn keys(&self, k: &mut Kernel, cfg: &AttentionConfig, pos: Option<Reg>) -> (Reg, Reg) {
        k.comment("the keys this query sees: [start, end)");
        let range = match cfg.keys {
            KeyRule::All => (
                k.mov(RegClass::B32, &0u32),
                k.mov(RegClass::B32, &cfg.kv_len),
            ),
            KeyRule::Causal { window } => {
                let last = k.add_u32(&self.i, &(cfg.kv_len - cfg.q_len));
                window_range(k, last, window, cfg.kv_len)
            }
            KeyRule::Position { window } => {
                let last = pos.expect("positions are loaded for the position rule");
                window_range(k, last, window, cfg.kv_len)
            }
        };
        match self.split {
            Some(split) => {
                k.comment("this block's share of the query's keys");
                share_of_keys(k, range, Splits::Fixed(cfg.splits), split)
            }
            None => range,
        }
    }
}

/// A lane's columns of the head dimension (lane, lane + 32, ..) and whether each is one.
struct LaneCols {
    cols: Vec<Reg>,
    valid: Vec<Reg>,
}

impl LaneCols {
    fn new(k: &mut Kernel, d: u32, lane: Reg) -> LaneCols {
        let cols: Vec<Reg> = (0..d.div_ceil(32))
            .map(|c| k.add_u32(&lane, &(c * 32)))
            .collect();
        let valid = cols.iter().map(|c| k.setp("lt.u32", c, &d)).collect();
        LaneCols { cols, valid }
    }
}

/// A row's online softmax: running maximum (base 2) and sum, the lane's accumulators, and
/// dropout's Philox key and plane.
struct Online {
    m: Reg,
    l: Reg,
    acc: Vec<Reg>,
    dropout: Option<([Reg; 2], Reg, Dropout)>,
}

impl Online {
    fn new(
        k: &mut Kernel,
        cfg: &AttentionConfig,
        p: &SimtParams,
        row: &QueryRow,
        per_lane: usize,
    ) -> Online {
        let m = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
        let l = k.mov(RegClass::F32, &F32(0.0));
        let acc = (0..per_lane)
            .map(|_| k.mov(RegClass::F32, &F32(0.0)))
            .collect();
        let dropout = cfg.dropout.map(|dropout| {
            let key = philox_key(k, p.opt.seed.expect("a seed operand"));
            let plane = k.mad_u32(&row.b, &cfg.heads, &row.h);
            (key, plane, dropout)
        });
        Online { m, l, acc, dropout }
    }
}

/// One key's loads: its index, whether the row uses it (in range, not padding), and the lane's
/// elements of its K (rotated) and V rows.
struct KeyLoads {
    index: Reg,
    used: Reg,
    k_vals: Vec<Reg>,
    v_vals: Vec<Reg>,
}

/// The loop over a query row's keys.
struct KeyLoop<'a> {
    cfg: &'a AttentionConfig,
    p: &'a SimtParams,
    row: &'a QueryRow,
    lanes: &'a LaneCols,
    rows: [&'a KeyRows; 2],
}

impl KeyLoop<'_> {
    fn emit(&self, k: &mut Kernel, qv: &[Reg], (start, end): (Reg, Reg), state: &Online) {
        k.comment("keys KEY_UNROLL at a time: every load first, then each key's update in order");
        let j = k.mov(RegClass::B32, &start);
        let top = k.label("keys");
        let done = k.label("keys_done");
        k.place(&top);
        let finished = k.setp("ge.u32", &j, &end);
        k.bra(Some((finished, true)), &done);
        let loads: Vec<KeyLoads> = (0..KEY_UNROLL).map(|u| self.load(k, &j, u, &end)).collect();
        for key in &loads {
            self.update(k, qv, key, state);
        }
        k.emit(format!("add.u32 {j}, {j}, {KEY_UNROLL}"));
        k.bra(None, &top);
        k.place(&done);
    }

    /// Key `j + u`'s loads.
    fn load(&self, k: &mut Kernel, j: &Reg, u: u32, end: &Reg) -> KeyLoads {
        let (cfg, p, b) = (self.cfg, self.p, self.row.b);
        let ju = k.add_u32(j, &u);
        let used = k.setp("lt.u32", &ju, end);
        if let Some(mk) = p.opt.mask {
            let skip = k.label("skip_mask");
            k.bra(Some((used, false)), &skip);
            let idx = k.mad_u32(&b, &cfg.kv_len, &ju);
            let a = k.address(mk, &idx, 8);
            let present = k.ld_global_i64(a);
            let kept = k.setp("ne.s64", &present, &0u64);
            k.emit(format!("and.pred {used}, {used}, {kept}"));
            k.place(&skip);
        }
        let k_row = self.rows[0].row(k, &ju);
        let v_row = self.rows[1].row(k, &ju);
        let pos_j = match (cfg.rope && cfg.rope_k, p.opt.positions) {
            (true, Some(positions)) => {
                let wide = k.mov(RegClass::B64, &0u64);
                let skip = k.label("skip_position");
                k.bra(Some((used, false)), &skip);
                let idx = k.mad_u32(&b, &cfg.kv_len, &ju);
                let a = k.address(positions, &idx, 8);
                k.emit(format!("ld.global.u64 {wide}, [{a}]"));
                k.place(&skip);
                Some(k.op1("cvt.u32.u64", RegClass::B32, &wide))
            }
            _ => None,
        };
        let oks: Vec<Reg> = self
            .lanes
            .valid
            .iter()
            .map(|ok| {
                let both = k.reg(RegClass::Pred);
                k.emit(format!("and.pred {both}, {ok}, {used}"));
                both
            })
            .collect();
        let cols = &self.lanes.cols;
        let v_vals = cols
            .iter()
            .zip(&oks)
            .map(|(c, ok)| p.element(k, cfg, [p.v, v_row, *c], *ok, None))
            .collect();
        let k_vals = cols
            .iter()
            .zip(&oks)
            .map(|(c, ok)| p.element(k, cfg, [p.k, k_row, *c], *ok, pos_j))
            .collect();
        KeyLoads {
            index: ju,
            used,
            k_vals,
            v_vals,
        }
    }

    /// The row's online-softmax update by `key` (skipped where unused): its score, the
    /// rescale, its weight (dropped or scaled under dropout) into the accumulators.
    fn update(&self, k: &mut Kernel, qv: &[Reg], key: &KeyLoads, state: &Online) {
        let next = k.label("next_key");
        k.bra(Some((key.used, false)), &next);
        let partial = k.mov(RegClass::F32, &F32(0.0));
        for (qe, kv) in qv.iter().zip(&key.k_vals) {
            k.fma_into(partial, qe, kv);
        }
        let s = k.warp_sum(partial);
        let (corr, p) = online_softmax_step(k, (state.m, state.l), s, s);
        let weight = match state.dropout {
            None => p,
            Some((pk, plane, d)) => {
                let (i, col) = (self.row.i, key.index);
                let keep = philox_keep(k, pk, d.stream, plane, i, col, d.threshold);
                let scaled = k.mul_f32(&p, &F32(d.keep_scale));
                k.selp(RegClass::F32, "f32", &scaled, &F32(0.0), keep)
            }
        };
        for (a, vv) in state.acc.iter().zip(&key.v_vals) {
            k.emit(format!("mul.rn.f32 {a}, {a}, {corr}"));
            k.fma_into(*a, &weight, vv);
        }
        k.place(&next);
    }
}

/// Key ranges per query row for a decode step of `batch` sequences of `heads` query heads over a
/// cache of `kv_len` entries: none below 1024 entries, then one per 64 entries of capacity,
/// between 16 and 128 and a multiple of 8 (the combine's groups). Each range is one warp walking
/// its keys in order, so the ranges must be short for the steps to stay fast late in a long
/// generation. Past [`crate::gemv::MAX_GROUPED_ROWS`] sequences (the batches whose products are
/// not batch-invariant anyway) the count is halved, to at least 8, while all rows' ranges would
/// be more than [`DECODE_WARPS`], so that a large batch does not pay each warp's fixed cost many
/// times over (H200, Llama-1B shape, 64 sequences, capacity 4608: 72 ranges per row made the
/// decode step 5.4 ms against 2.6 at capacity 1024 for the same short contexts); up to there it
/// does not depend on the batch, so a sequence's attention sums in the same order in every
/// batch-invariant bucket. The lowering and the tests share this rule.
pub fn decode_splits(kv_len: u32, batch: u32, heads: u32) -> u32 {
    if kv_len < 1024 {
        return 1;
    }
    let mut splits = (kv_len / 64).clamp(16, 128) & !7;
    if batch > crate::gemv::MAX_GROUPED_ROWS {
        let rows = batch.saturating_mul(heads);
        while splits > 8 && rows.saturating_mul(splits) > DECODE_WARPS {
            splits = (splits / 2) & !7;
        }
    }
    splits
}

/// The most key-range warps a decode step's attention launches over all its rows before
/// [`decode_splits`] gives each row fewer: four waves of 64 warps on 132 SMs.
pub const DECODE_WARPS: u32 = 4 * 64 * 132;

/// Merges the partial results of a split attention (`cfg.splits > 1`): one warp per (batch, head,
/// query row), lanes over the head dimension, one pass over the splits in groups whose loads are
/// all in flight before any is used (a loop of one dependent load per split walked 128 splits at
/// the memory latency each), the running max and sums rescaled per group as the online softmax
/// does. Parameters: `partial_acc, partial_ml, out`.
pub fn attention_combine(cfg: &AttentionConfig) -> GeneratedKernel {
    let name = format!("{}_combine", cfg.name());
    let mut k = Kernel::new(&name);
    let acc = k.param_ptr("partial_acc");
    let ml = k.param_ptr("partial_ml");
    let out = k.param_ptr("out");
    let lane = k.special("tid.x");
    let i = k.special("ctaid.x");
    let h = k.special("ctaid.y");
    let b = k.special("ctaid.z");
    combine_row(&mut k, cfg, [acc, ml, out], [b, h, i, lane], None);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.q_len, cfg.heads, cfg.batch],
            block: [32, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// Merges the `cfg.splits` partial results (`partial_acc`, `partial_ml`) of query row `i` of head
/// `h` of sequence `b` into `out`, the warp's lanes (`lane`) over the head dimension; only the
/// first `count` of them when given (a multiple of 8 that the row's keys took).
pub(crate) fn combine_row(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    [acc, ml, out]: [Reg; 3],
    [b, h, i, lane]: [Reg; 4],
    count: Option<Reg>,
) {
    let e = cfg.elem;
    let d = cfg.head_dim;
    let row_id = k.mad_u32(&b, &cfg.heads, &h);
    let q_row_id = k.mad_u32(&row_id, &cfg.q_len, &i);
    let p0 = k.mul_u32(&q_row_id, &cfg.splits);
    let per_lane = d.div_ceil(32);
    let cols: Vec<Reg> = (0..per_lane).map(|c| k.add_u32(&lane, &(c * 32))).collect();
    let valid: Vec<Reg> = cols.iter().map(|c| k.setp("lt.u32", c, &d)).collect();
    let neg_inf = F32(f32::NEG_INFINITY);
    // Running max (base 2) of the splits seen, their rescaled sum and accumulators.
    let m_run = k.mov(RegClass::F32, &neg_inf);
    let total = k.mov(RegClass::F32, &F32(0.0));
    let sums: Vec<Reg> = (0..per_lane)
        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
        .collect();
    let group = [8u32, 4, 2, 1]
        .into_iter()
        .find(|g| cfg.splits.is_multiple_of(*g))
        .expect("1 divides");
    assert!(
        count.is_none() || group == 8,
        "a count of whole groups of 8"
    );
    let s_i = k.mov(RegClass::B32, &0u32);
    let top = k.label("split_groups");
    k.place(&top);
    k.comment("a group of splits: every load first");
    let mut loaded = Vec::new();
    for u in 0..group {
        let p0u = k.add_u32(&p0, &s_i);
        let p = k.add_u32(&p0u, &u);
        let mi = k.mul_u32(&p, &2u32);
        let ma = k.address(ml, &mi, 4);
        let m = k.ld_global(Elem::F32, ma);
        let la = k.op2("add.u64", RegClass::B64, &ma, &4u64);
        let l = k.ld_global(Elem::F32, la);
        let pb = k.mul_u32(&p, &d);
        let vals: Vec<Reg> = cols
            .iter()
            .zip(&valid)
            .map(|(col, ok)| {
                let idx = k.add_u32(&pb, col);
                // Columns past the head dimension read column 0 (in bounds) and are not stored.
                let safe = k.selp(RegClass::B32, "u32", &idx, &pb, *ok);
                let a = k.address(acc, &safe, 4);
                k.ld_global(Elem::F32, a)
            })
            .collect();
        loaded.push((m, l, vals));
    }
    k.comment("rescale to the group's max and add its splits");
    let mut m_new = m_run;
    for (m, _, _) in &loaded {
        m_new = k.max_f32(&m_new, m);
    }
    // Splits that saw no key have m = -inf; while every split so far has, use 0 (no NaN).
    let none = k.setp("eq.f32", &m_new, &neg_inf);
    let m_use = k.selp(RegClass::F32, "f32", &F32(0.0), &m_new, none);
    let dm = k.sub_f32(&m_run, &m_use);
    let corr = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
    k.emit(format!("mul.rn.f32 {total}, {total}, {corr}"));
    for sum in &sums {
        k.emit(format!("mul.rn.f32 {sum}, {sum}, {corr}"));
    }
    for (m, l, vals) in &loaded {
        let ds = k.sub_f32(m, &m_use);
        let scale = k.op1("ex2.approx.ftz.f32", RegClass::F32, &ds);
        k.fma_into(total, &scale, l);
        for (sum, v) in sums.iter().zip(vals) {
            k.fma_into(*sum, &scale, v);
        }
    }
    k.emit(format!("mov.f32 {m_run}, {m_new}"));
    k.emit(format!("add.u32 {s_i}, {s_i}, {group}"));
    let more = match count {
        Some(n) => k.setp("lt.u32", &s_i, &n),
        None => k.setp("lt.u32", &s_i, &cfg.splits),
    };
    k.bra(Some((more, true)), &top);
    // If no split saw a key, the row stores zeros.
    let inv = reciprocal_or_zero(k, total);
    let o_stride = cfg.strides[3];
    let t0 = k.mul_u32(&b, &o_stride[0]);
    let t1 = k.mad_u32(&h, &o_stride[1], &t0);
    let o_row = k.mad_u32(&i, &o_stride[2], &t1);
    store_scaled_row(k, (e, out, &o_row), [&cols, &valid, &sums], &inv);
}

/// Stores `values[j] * scale` at column `cols[j]` of the row starting at element `row` of `out`
/// (of `elem`), for each `j` whose `valid[j]` holds.
fn store_scaled_row(
    k: &mut Kernel,
    (elem, out, row): (Elem, Reg, &Reg),
    [cols, valid, values]: [&[Reg]; 3],
    scale: &Reg,
) {
    for ((col, ok), value) in cols.iter().zip(valid).zip(values) {
        let skip = k.label("skip_out");
        k.bra(Some((*ok, false)), &skip);
        let y = k.mul_f32(value, scale);
        let idx = k.add_u32(row, col);
        let addr = k.address(out, &idx, elem.bytes());
        k.st_global(elem, addr, y);
        k.place(&skip);
    }
}

/// Element `col` (loaded as `x`) of the row starting at element `row` of `base`, rotated by RoPE
/// at position `pos` (`rotate_half`'s pairing: `x * cos - partner * sin` in the lower half, `x *
/// cos + partner * sin` in the upper, `tables` `[P, D/2]` f32).
pub(crate) fn rotated_element(
    k: &mut Kernel,
    e: Elem,
    [base, row, col, pos]: [Reg; 4],
    x: Reg,
    half: u32,
    (cos, sin): (Reg, Reg),
) -> Reg {
    let upper = k.setp("ge.u32", &col, &half);
    let c_low = k.sub_u32(&col, &half);
    let c = k.selp(RegClass::B32, "u32", &c_low, &col, upper);
    let partner_hi = k.add_u32(&col, &half);
    let partner = k.selp(RegClass::B32, "u32", &c_low, &partner_hi, upper);
    let pidx = k.add_u32(&row, &partner);
    let pa = k.address(base, &pidx, e.bytes());
    let px = k.ld_global(e, pa);
    let t = k.mad_u32(&pos, &half, &c);
    let ca = k.address(cos, &t, 4);
    let sa = k.address(sin, &t, 4);
    let cv = k.ld_global(Elem::F32, ca);
    let sv = k.ld_global(Elem::F32, sa);
    // rotate_half: [-x2, x1]
    let neg = k.op1("neg.f32", RegClass::F32, &px);
    let signed = k.selp(RegClass::F32, "f32", &px, &neg, upper);
    let xc = k.mul_f32(&x, &cv);
    k.fma_f32(&signed, &sv, &xc)
}

/// How many ranges a row's keys are split into: fixed when the kernel is generated, or counted
/// per row in the kernel.
#[derive(Clone, Copy)]
pub(crate) enum Splits {
    Fixed(u32),
    Counted(Reg),
}

/// The number of keys in `[start, end)` (0 when `end < start`).
pub(crate) fn keys_in(k: &mut Kernel, (start, end): (Reg, Reg)) -> Reg {
    let top = k.op2("max.u32", RegClass::B32, &end, &start);
    k.sub_u32(&top, &start)
}

/// Key range `split` of `splits` even shares of `[start, end)` (the last ones empty when the
/// range is short).
pub(crate) fn share_of_keys(
    k: &mut Kernel,
    (start, end): (Reg, Reg),
    splits: Splits,
    split: Reg,
) -> (Reg, Reg) {
    let len = keys_in(k, (start, end));
    let (rounded, n): (Reg, &dyn Operand) = match &splits {
        Splits::Fixed(n) => (k.add_u32(&len, &(n - 1)), n),
        Splits::Counted(n) => {
            let more = k.add_u32(&len, n);
            (k.sub_u32(&more, &1u32), n)
        }
    };
    let chunk = k.op2("div.u32", RegClass::B32, &rounded, n);
    let from = k.mad_u32(&split, &chunk, &start);
    let s1 = k.add_u32(&from, &chunk);
    let to = k.op2("min.u32", RegClass::B32, &end, &s1);
    (from, to)
}

/// The online-softmax update in base 2 of a running max `m` and sum `l` by score `s`, where
/// `seen` is the largest score of the keys taken together (`s` itself for one key at a time);
/// returns the accumulators' correction and the key's weight.
pub(crate) fn online_softmax_step(
    k: &mut Kernel,
    (m, l): (Reg, Reg),
    s: Reg,
    seen: Reg,
) -> (Reg, Reg) {
    k.comment("online softmax in base 2");
    let m_new = k.max_f32(&m, &seen);
    let dm = k.sub_f32(&m, &m_new);
    let corr = k.op1("ex2.approx.ftz.f32", RegClass::F32, &dm);
    let ds = k.sub_f32(&s, &m_new);
    let p = k.op1("ex2.approx.ftz.f32", RegClass::F32, &ds);
    k.emit(format!("fma.rn.f32 {l}, {l}, {corr}, {p}"));
    k.emit(format!("mov.f32 {m}, {m_new}"));
    (corr, p)
}

/// A key range's partial running max `m` (base 2) and sum `l` at partial row `p` of `ml`
/// (`[rows, 2]` f32), stored by lane 0.
pub(crate) fn store_max_and_sum(k: &mut Kernel, ml: Reg, p: Reg, (m, l): (Reg, Reg), lane: Reg) {
    let first_lane = k.setp("eq.u32", &lane, &0u32);
    let skip = k.label("skip_ml");
    k.bra(Some((first_lane, false)), &skip);
    let mi = k.mul_u32(&p, &2u32);
    let ma = k.address(ml, &mi, 4);
    k.st_global(Elem::F32, ma, m);
    let la = k.op2("add.u64", RegClass::B64, &ma, &4u64);
    k.st_global(Elem::F32, la, l);
    k.place(&skip);
}

/// `1 / l`, or 0 when `l` is 0 (a query that saw no key stores zeros).
pub(crate) fn reciprocal_or_zero(k: &mut Kernel, l: Reg) -> Reg {
    let none = k.setp("eq.f32", &l, &F32(0.0));
    let inv = k.rcp_f32(&l);
    k.selp(RegClass::F32, "f32", &F32(0.0), &inv, none)
}

/// `[start, end)` for a query whose last visible key is `last`: `end = min(last + 1, T)`, and with
/// a window `w`, `start = max(last + 1 - w, 0)`.
pub(crate) fn window_range(
    k: &mut Kernel,
    last: Reg,
    window: Option<u32>,
    kv_len: u32,
) -> (Reg, Reg) {
    let after = k.add_u32(&last, &1u32);
    let end = k.op2("min.u32", RegClass::B32, &after, &kv_len);
    let start = match window {
        None => k.mov(RegClass::B32, &0u32),
        Some(w) => window_start(k, last, w),
    };
    (start, end)
}

/// `max(last + 1 - w, 0)`: the first key a row whose last key is `last` sees in a window of `w`.
pub(crate) fn window_start(k: &mut Kernel, last: Reg, w: u32) -> Reg {
    let after = k.add_u32(&last, &1u32);
    let before = k.setp("lt.u32", &after, &w);
    let from = k.sub_u32(&after, &w);
    k.selp(RegClass::B32, "u32", &0u32, &from, before)
}

/// Whether Philox-4x32-10 keeps element `(plane, row, col)` of stream `stream` (DESIGN.md section
/// 2): word `col & 3` of [`philox_words`] at `col`, kept when `>= threshold`.
#[allow(clippy::too_many_arguments)]
fn philox_keep(
    k: &mut Kernel,
    key: [Reg; 2],
    stream: u32,
    plane: Reg,
    row: Reg,
    col: Reg,
    threshold: u32,
) -> Reg {
    let c = philox_words(k, key, stream, plane, row, col);
    let which = k.op2("and.b32", RegClass::B32, &col, &3u32);
    let is1 = k.setp("eq.u32", &which, &1u32);
    let is2 = k.setp("eq.u32", &which, &2u32);
    let is3 = k.setp("eq.u32", &which, &3u32);
    let w01 = k.selp(RegClass::B32, "b32", &c[1], &c[0], is1);
    let w012 = k.selp(RegClass::B32, "b32", &c[2], &w01, is2);
    let word = k.selp(RegClass::B32, "b32", &c[3], &w012, is3);
    k.setp("ge.u32", &word, &threshold)
}

/// The four Philox-4x32-10 words of counter `(col >> 2, row, plane, stream)` under `key`: the
/// random words of columns `col & !3 .. (col & !3) + 4` of row `row` (DESIGN.md section 2).
pub(crate) fn philox_words(
    k: &mut Kernel,
    key: [Reg; 2],
    stream: u32,
    plane: Reg,
    row: Reg,
    col: Reg,
) -> [Reg; 4] {
    let c0 = k.op2("shr.u32", RegClass::B32, &col, &2u32);
    PhiloxRow::new(k, key, stream, &plane, &row).words(k, &c0)
}

/// The Philox key of a kernel's dropout: the i64 seed at `seed` as (low, high) words.
pub(crate) fn philox_key(k: &mut Kernel, seed: Reg) -> [Reg; 2] {
    let s = k.ld_global_i64(seed);
    let lo = k.op1("cvt.u32.u64", RegClass::B32, &s);
    let shifted = k.op2("shr.u64", RegClass::B64, &s, &32u32);
    [lo, k.op1("cvt.u32.u64", RegClass::B32, &shifted)]
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox-4x32-10 over the counters `(c0, row, plane, stream)` of one row of one plane. Only `c0`
/// varies along the row; round 0's `plane M1` and round 1's `c[0] M0` do not depend on it, and
/// are done once in [`PhiloxRow::new`] with what is xored beside them (the keys of rounds 2 to 9
/// too after [`PhiloxRow::scheduled`]), so a block takes 18 wide products; 15 where the words
/// that depend on `c0` alone are drawn once for every row ([`PhiloxRow::column`]). Rounds are
/// counted from 0, as [`key_word`] counts them.
pub(crate) struct PhiloxRow {
    key: [Reg; 2],
    /// The key words that rounds 2 to 9 take (see [`PhiloxRow::key_index`]), when held in
    /// registers.
    schedule: Option<Vec<Reg>>,
    /// `stream ^ key1`: round 0's new `c[2]` is `hi(c0 M0) ^ stream_key`.
    stream_key: Reg,
    /// Round 1's constants. Its `c[0]` is round 0's `hi(plane M1) ^ row ^ key0`,
    /// so its product `(hi, lo) = c[0] M0` is one: `x0 = lo(plane M1) ^ key0(1)` joins the new
    /// `c[0]` and `x2 = hi ^ key1(1)` the new `c[2]`; its new `c[3]` is `lo`.
    second: [Reg; 2],
    /// `lo ^ key1(2)`: round 1's new `c[3]` with round 2's key1, which round 2's new `c[2]`
    /// takes.
    third: Reg,
}

impl PhiloxRow {
    pub(crate) fn new(
        k: &mut Kernel,
        key: [Reg; 2],
        stream: u32,
        plane: &dyn Operand,
        row: &dyn Operand,
    ) -> PhiloxRow {
        let plane = k.mov(RegClass::B32, plane);
        let (hi1, lo1) = mul_wide(k, &plane, PHILOX_M1);
        let x = k.op2("xor.b32", RegClass::B32, &hi1, row);
        let c0 = k.op2("xor.b32", RegClass::B32, &x, &key[0]);
        let stream_key = k.op2("xor.b32", RegClass::B32, &key[1], &stream);
        let (hi, lo) = mul_wide(k, &c0, PHILOX_M0);
        let k0 = key_word(k, &key, 1, 0);
        let k1 = key_word(k, &key, 1, 1);
        let second = [
            k.op2("xor.b32", RegClass::B32, &lo1, &k0),
            k.op2("xor.b32", RegClass::B32, &hi, &k1),
        ];
        let k1 = key_word(k, &key, 2, 1);
        let third = k.op2("xor.b32", RegClass::B32, &lo, &k1);
        PhiloxRow {
            key,
            schedule: None,
            stream_key,
            second,
            third,
        }
    }

    /// The same generator with the key words of rounds 2 to 9 computed once, here (15 registers
    /// held: round 2's key1 is folded into `third`).
    pub(crate) fn scheduled(mut self, k: &mut Kernel) -> PhiloxRow {
        let words =
            std::iter::once((2, 0)).chain((3..10).flat_map(|round| [(round, 0), (round, 1)]));
        let schedule = words
            .map(|(round, w)| key_word(k, &self.key, round, w))
            .collect();
        self.schedule = Some(schedule);
        self
    }

    /// Where key word `w` of round `round` (2 to 9; word 0 only in round 2) is in the schedule.
    fn key_index(round: u32, w: usize) -> usize {
        match round {
            2 => 0,
            _ => 1 + 2 * (round as usize - 3) + w,
        }
    }

    fn key_word(&self, k: &mut Kernel, round: u32, w: usize) -> Reg {
        match &self.schedule {
            Some(words) => words[Self::key_index(round, w)],
            None => key_word(k, &self.key, round, w),
        }
    }

    /// The four words of counter `(c0, row, plane, stream)`.
    pub(crate) fn words(&self, k: &mut Kernel, c0: &Reg) -> [Reg; 4] {
        self.words_of(k, std::slice::from_ref(c0))[0]
    }

    /// The four words of each counter `(c0, row, plane, stream)` of `c0s`, drawn round by round
    /// (each round of every block before the next round), so that the blocks' independent
    /// products and xors interleave.
    pub(crate) fn words_of(&self, k: &mut Kernel, c0s: &[Reg]) -> Vec<[Reg; 4]> {
        let mut blocks: Vec<[Reg; 4]> = c0s.iter().map(|c0| self.second_round(k, c0)).collect();
        let k0 = self.key_word(k, 2, 0);
        for c in &mut blocks {
            *c = round(k, *c, (&k0, None));
        }
        self.last_rounds(k, blocks)
    }

    /// The words of a counter `(c0, ., plane, stream)` that do not depend on its row:
    /// `lo(c0 M0)`, which round 1's new `c[2]` xors with the row's, round 1's new
    /// `c[1]` with round 2's key0, and round 2's product `(hi, lo)` of its `c[0]`, round 1's new
    /// `c[0]`, which is the column's alone. A row's block then takes 15 wide products
    /// ([`PhiloxRow::words_of_columns`]).
    pub(crate) fn column(&self, k: &mut Kernel, c0: &Reg) -> [Reg; 4] {
        let [c0, lo1, lo0] = self.column_rounds(k, c0);
        let k0 = self.key_word(k, 2, 0);
        let c1 = k.op2("xor.b32", RegClass::B32, &lo1, &k0);
        let (hi2, lo2) = mul_wide(k, &c0, PHILOX_M0);
        [lo0, c1, hi2, lo2]
    }

    /// The four words of each counter of this row whose column words ([`PhiloxRow::column`])
    /// are in `columns`, drawn round by round.
    pub(crate) fn words_of_columns(&self, k: &mut Kernel, columns: &[[Reg; 4]]) -> Vec<[Reg; 4]> {
        let blocks = columns
            .iter()
            .map(|[lo0, c1, hi2, lo2]| {
                // Round 2 on (round 1's new c[0] of the column, c1, c2, the row's c[3]).
                let c2 = k.op2("xor.b32", RegClass::B32, lo0, &self.second[1]);
                let (hi, lo) = mul_wide(k, &c2, PHILOX_M1);
                [
                    k.op2("xor.b32", RegClass::B32, &hi, c1),
                    lo,
                    k.op2("xor.b32", RegClass::B32, hi2, &self.third),
                    *lo2,
                ]
            })
            .collect();
        self.last_rounds(k, blocks)
    }

    /// Rounds 3 to 9 on each of `blocks`, round by round.
    fn last_rounds(&self, k: &mut Kernel, mut blocks: Vec<[Reg; 4]>) -> Vec<[Reg; 4]> {
        for r in 3..10u32 {
            let (k0, k1) = (self.key_word(k, r, 0), self.key_word(k, r, 1));
            for c in &mut blocks {
                *c = round(k, *c, (&k0, Some(&k1)));
            }
        }
        blocks
    }

    /// Counter `(c0, row, plane, stream)` after rounds 0 and 1.
    fn second_round(&self, k: &mut Kernel, c0: &Reg) -> [Reg; 4] {
        let [n0, n1, lo0] = self.column_rounds(k, c0);
        // Round 1's new c[3] is the row's `lo`, which round 2 takes folded into `third` with
        // its key1.
        [
            n0,
            n1,
            k.op2("xor.b32", RegClass::B32, &lo0, &self.second[1]),
            self.third,
        ]
    }

    /// What rounds 0 and 1 make of `c0` alone: round 1's new `c[0]` and `c[1]`, and round 0's
    /// `lo(c0 M0)`, which round 1's new `c[2]` xors with the row's.
    fn column_rounds(&self, k: &mut Kernel, c0: &Reg) -> [Reg; 3] {
        let (hi0, lo0) = mul_wide(k, c0, PHILOX_M0);
        let n2 = k.op2("xor.b32", RegClass::B32, &hi0, &self.stream_key);
        let (hi1, lo1) = mul_wide(k, &n2, PHILOX_M1);
        [
            k.op2("xor.b32", RegClass::B32, &hi1, &self.second[0]),
            lo1,
            lo0,
        ]
    }
}

/// One Philox round on `c` under keys `(k0, k1)`; without `k1`, `c[3]` holds it already.
fn round(k: &mut Kernel, c: [Reg; 4], (k0, k1): (&Reg, Option<&Reg>)) -> [Reg; 4] {
    let (hi0, lo0) = mul_wide(k, &c[0], PHILOX_M0);
    let (hi1, lo1) = mul_wide(k, &c[2], PHILOX_M1);
    let x0 = k.op2("xor.b32", RegClass::B32, &hi1, &c[1]);
    let n0 = k.op2("xor.b32", RegClass::B32, &x0, k0);
    let x2 = k.op2("xor.b32", RegClass::B32, &hi0, &c[3]);
    let n2 = match k1 {
        Some(k1) => k.op2("xor.b32", RegClass::B32, &x2, k1),
        None => x2,
    };
    [n0, lo1, n2, lo0]
}

/// Word `w` of round `round`'s key: `key[w] + round W[w]`.
fn key_word(k: &mut Kernel, key: &[Reg; 2], round: u32, w: usize) -> Reg {
    let step = [PHILOX_W0, PHILOX_W1][w].wrapping_mul(round);
    k.add_u32(&key[w], &step)
}

/// `(hi, lo)` of the 64-bit product `a * m`.
fn mul_wide(k: &mut Kernel, a: &Reg, m: u32) -> (Reg, Reg) {
    let wide = k.op2("mul.wide.u32", RegClass::B64, a, &m);
    split_wide(k, &wide)
}

/// `(hi, lo)` of a 64-bit register.
fn split_wide(k: &mut Kernel, wide: &Reg) -> (Reg, Reg) {
    let (lo, hi) = (k.reg(RegClass::B32), k.reg(RegClass::B32));
    k.emit(format!("mov.b64 {{{lo}, {hi}}}, {wide}"));
    (hi, lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::kernel::AttentionSpec;

    /// Runs the straight-line integer PTX that [`PhiloxRow`] emits (the few opcodes it uses),
    /// registers as u64; returns the values of `outputs`.
    fn run_philox_ptx(k: Kernel, outputs: &[Reg]) -> Vec<u64> {
        use std::collections::HashMap;
        let text = k.finish();
        let mut regs: HashMap<String, u64> = HashMap::new();
        let value = |regs: &HashMap<String, u64>, a: &str| match a.parse::<u64>() {
            Ok(v) => v,
            Err(_) => regs[a],
        };
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| l.ends_with(';') && !l.starts_with('.'))
        {
            let line = line.trim_end_matches(';');
            // Instructions without operands (`ret`, `griddepcontrol.*`) compute nothing.
            let Some((op, rest)) = line.split_once(' ') else {
                continue;
            };
            if op == "mov.b64" {
                // mov.b64 {lo, hi}, wide
                let (pair, wide) = rest.rsplit_once(", ").expect("mov.b64 {lo, hi}, wide");
                let (lo, hi) = pair
                    .trim_matches(|c| c == '{' || c == '}')
                    .split_once(", ")
                    .expect("a pair");
                let w = regs[wide];
                regs.insert(lo.into(), w & 0xffff_ffff);
                regs.insert(hi.into(), w >> 32);
                continue;
            }
            let args: Vec<&str> = rest.split(", ").collect();
            let a = |i: usize| value(&regs, args[i]);
            let v = match op {
                "mov.u32" => a(1),
                "xor.b32" => a(1) ^ a(2),
                "add.u32" => (a(1) + a(2)) & 0xffff_ffff,
                "add.u64" => a(1).wrapping_add(a(2)),
                "mul.wide.u32" => a(1) * a(2),
                _ => panic!("an opcode the Philox PTX does not use: {line}"),
            };
            regs.insert(args[0].into(), v);
        }
        outputs.iter().map(|r| regs[&r.to_string()]).collect()
    }

    /// The PTX of [`PhiloxRow`] (held or computed round keys; column words first; two blocks
    /// round by round) draws the IR's Philox-4x32-10 words: Random123's known answers and random
    /// counters.
    #[test]
    fn philox_rows_draw_the_irs_words() {
        let mut cases = vec![
            ([0u32; 4], [0u32; 2]),
            ([u32::MAX; 4], [u32::MAX; 2]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
            ),
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u32
        };
        for _ in 0..50 {
            cases.push(([next(), next(), next(), next()], [next(), next()]));
        }
        for (counter, key) in cases {
            let want = kiln_ir::philox::philox4x32_10(counter, key);
            for draw in Draw::ALL {
                let mut k = Kernel::new("philox");
                let key_regs = [k.mov(RegClass::B32, &key[0]), k.mov(RegClass::B32, &key[1])];
                let [c0, row, plane, stream] = counter;
                let mut philox = PhiloxRow::new(&mut k, key_regs, stream, &plane, &row);
                if draw != Draw::Plain {
                    philox = philox.scheduled(&mut k);
                }
                // Grouped draws take a neighbouring counter first, round by round with this one.
                let c0s: &[u32] = match draw {
                    Draw::Grouped | Draw::GroupedColumns => &[c0 ^ 1, c0],
                    _ => &[c0],
                };
                let c0s: Vec<Reg> = c0s.iter().map(|c| k.mov(RegClass::B32, c)).collect();
                let words = match draw {
                    Draw::Columns | Draw::GroupedColumns => {
                        let columns: Vec<_> =
                            c0s.iter().map(|c| philox.column(&mut k, c)).collect();
                        philox.words_of_columns(&mut k, &columns)
                    }
                    _ => philox.words_of(&mut k, &c0s),
                };
                let got = run_philox_ptx(k, words.last().expect("a block"));
                let want: Vec<u64> = want.iter().map(|&w| u64::from(w)).collect();
                assert_eq!(got, want, "counter {counter:x?} key {key:x?} {draw:?}");
            }
        }
    }

    /// How [`philox_rows_draw_the_irs_words`] draws a block.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Draw {
        /// Round keys computed where used.
        Plain,
        /// Round keys held ([`PhiloxRow::scheduled`]), as every draw below.
        Scheduled,
        /// Column words first ([`PhiloxRow::column`]).
        Columns,
        /// Two blocks round by round ([`PhiloxRow::words_of`]).
        Grouped,
        /// Two blocks' column words, then both round by round.
        GroupedColumns,
    }

    impl Draw {
        const ALL: [Draw; 5] = [
            Draw::Plain,
            Draw::Scheduled,
            Draw::Columns,
            Draw::Grouped,
            Draw::GroupedColumns,
        ];
    }

    /// Batches up to the batch-invariant limit split a row's keys alike; larger ones split them
    /// less when all their ranges would be many waves of warps.
    #[test]
    fn decode_splits_depend_on_the_batch_only_past_the_invariant_batches() {
        assert_eq!(decode_splits(1023, 1, 32), 1);
        assert_eq!(decode_splits(1024, 1, 32), 16);
        for batch in 1..=crate::gemv::MAX_GROUPED_ROWS {
            assert_eq!(decode_splits(4608, batch, 32), 72, "batch {batch}");
        }
        assert_eq!(decode_splits(4608, 64, 32), 16);
        assert_eq!(decode_splits(131072, 256, 64), 8);
        assert!(decode_splits(4608, 17, 32) * 17 * 32 <= DECODE_WARPS);
    }

    /// Llama-3.2-1B's prefill attention at 512 tokens: bf16, 32/8 heads, d 64, causal, padding,
    /// RoPE on q and k read in place from the fused QKV product (`[B, S, 3072]`).
    fn llama(elem: Elem, window: Option<i64>, dropout: Option<(f64, u32)>) -> AttentionConfig {
        let mut cfg = AttentionConfig::plain([1, 32, 8, 512, 512, 64], elem);
        let row = 3072;
        cfg.strides[0] = [512 * row, 64, row];
        cfg.strides[1] = [512 * row, 64, row];
        cfg.take_attention(&AttentionSpec {
            scale: 0.125,
            causal: true,
            window,
            padding: true,
            rope: Some((500000.0, kiln_ir::RopeScaling::Default)),
            dropout,
        });
        cfg
    }

    #[test]
    fn rope_moves_ahead_of_the_hopper_kernel() {
        let cfg = llama(Elem::BF16, None, None);
        assert!(
            !crate::attention_wgmma::supports(&cfg),
            "RoPE is not in the kernel"
        );
        let plain = prerotated(&cfg).expect("the plain form takes the Hopper kernel");
        assert!(!plain.rope && !plain.rope_k && plain.padding);
        assert_eq!(plain.strides[0], [32 * 512 * 64, 512 * 64, 64]);
        assert_eq!(plain.strides[1], [8 * 512 * 64, 512 * 64, 64]);
        assert_eq!(plain.strides[2], cfg.strides[2], "v is read in place");
        assert_eq!(path(&cfg), KernelPath::Wgmma);
        let [q, k] = rotations(&cfg);
        let (q, k) = (q.unwrap(), k.unwrap());
        assert_eq!((q.heads, q.len, q.strides), (32, 512, cfg.strides[0]));
        assert_eq!((k.heads, k.len, k.strides), (8, 512, cfg.strides[1]));
    }

    #[test]
    fn near_misses_keep_rope_in_the_mma_kernel_and_windows_and_dropout_do_not() {
        let f32 = llama(Elem::F32, None, None);
        assert_eq!(prerotated(&f32), None, "f32");
        assert_ne!(path(&f32), KernelPath::Wgmma, "f32");
        let dropout = llama(Elem::BF16, None, Some((0.1, 0)));
        assert!(prerotated(&dropout).is_some_and(|plain| plain.dropout == dropout.dropout));
        assert_eq!(path(&dropout), KernelPath::Wgmma, "dropout");
        let windowed = llama(Elem::BF16, Some(256), None);
        assert!(prerotated(&windowed).is_some_and(|plain| plain.keys == windowed.keys));
        assert_eq!(
            path(&windowed),
            KernelPath::Wgmma,
            "a window inside the keys"
        );
        // A prompt chunk over a KV cache, dense or paged, with a window or without, rotates q
        // alone ahead of the Hopper kernel.
        let mut over_cache = llama(Elem::BF16, None, None);
        over_cache.rope_k = false;
        over_cache.keys = KeyRule::Position { window: None };
        let plain = prerotated(&over_cache).expect("a chunk over a dense cache");
        assert_eq!(plain.keys, over_cache.keys);
        assert!(matches!(rotations(&over_cache), [Some(_), None]));
        let mut paged = over_cache.clone();
        paged.take_paging(crate::paging::Paging::new(16, 512, 33).expect("a power of two"));
        let plain = prerotated(&paged).expect("a chunk over a paged cache");
        assert_eq!(
            (plain.paging, plain.strides[1]),
            (paged.paging, paged.strides[1])
        );
        let mut small = paged.clone();
        small.take_paging(crate::paging::Paging::new(4, 512, 129).expect("a power of two"));
        assert_eq!(
            prerotated(&small),
            None,
            "blocks of fewer keys than a swizzle group"
        );
        let mut windowed = over_cache.clone();
        windowed.keys = KeyRule::Position { window: Some(256) };
        assert!(
            prerotated(&windowed).is_some(),
            "position keys with a window"
        );
        assert_eq!(
            prerotated(&AttentionConfig::plain([1, 2, 2, 8, 8, 64], Elem::BF16)),
            None
        );
    }

    #[test]
    fn windows_that_cover_every_key_are_no_window() {
        for (window, kept) in [
            (Some(512), None),
            (Some(4096), None),
            (Some(511), Some(511)),
        ] {
            let cfg = llama(Elem::BF16, window, None);
            assert_eq!(cfg.keys, KeyRule::Causal { window: kept }, "{window:?}");
        }
    }
}
