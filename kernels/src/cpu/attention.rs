//! Fused attention on the CPU, prefill and decode alike, the CPU side of [`crate::attention`]:
//! per query row, `softmax(q k^T * scale + masks) v` flash-style: keys in blocks of `BLOCK`
//! (their scores in a small stack buffer, never an S x T matrix), with a running max and sum and
//! the accumulator rescaled once per block as the max grows; the weights' `exp` runs four lanes at
//! a time, and the head dimension is unrolled. The key rules,
//! GQA/MQA, padding masks, positions and RoPE on q (and on k when the keys are not from a cache)
//! follow the GPU kernel, including its convention (and the IR's) that a query seeing no key, or
//! only keys its padding mask hides, stores zeros. The
//! dot products and the accumulator update run four lanes at a time.
//!
//! Parameters: `q, k, v, out, [mask], [positions], [cos, sin], [seed], [table]` (k and v a
//! paged cache through its block table: `super::paging`); the parallel axis is query rows
//! (`(b * heads + h) * q_len + i`). Dropout draws exactly the IR's Philox mask. Split key ranges
//! (flash-decoding) are GPU-only: a CPU call covers every key.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{I32, I64};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, StackSlotData, StackSlotKind, Type, Value};
use cranelift_frontend::{FunctionBuilder, Variable};

use super::math::{constant, exp, rotated};
use super::module::{
    f32_addr, fold_lanes, for_range, lane_sum, lanes, lanes_unrolled, load, load_i64, splat, store,
    sum_lanes_unrolled, Args, CpuError, CpuModule, VECTOR,
};
use super::paging::CacheRows;
use crate::attention::{AttentionConfig, KeyRule};
use crate::paging::Paging;

/// Keys scored per block (the score buffer on the stack holds this many).
const BLOCK: u32 = 128;

/// Accumulator columns (vectors of four, or tail columns) kept in registers at once while the
/// weighted values of a block are summed: 8 of the 16 vector registers (q's row competes for the
/// rest; a head dimension above 32 spills part of it).
const ACC_VECTORS: usize = 8;

/// The head dimension's columns as `(first column, type)`: vectors of four, then scalar tail
/// columns.
fn columns(d: u32) -> impl Iterator<Item = (i64, Type)> {
    let split = d / 4 * 4;
    (0..split)
        .step_by(4)
        .map(|c| (i64::from(c), VECTOR))
        .chain((split..d).map(|c| (i64::from(c), super::module::SCALAR)))
}

/// `q . k[row]` with q's values in registers (`q_regs`, as [`columns`] lays them out): the
/// vector products summed in a tree, then across lanes, then the tail products.
fn dot(b: &mut FunctionBuilder, q_regs: &[(Value, Type, i64)], k: Value, k_row: Value) -> Value {
    let mut vectors = Vec::new();
    let mut tail = Vec::new();
    for &(qv, ty, col) in q_regs {
        let ix = b.ins().iadd_imm_s(k_row, col);
        let ka = f32_addr(b, k, ix);
        let kv = load(b, ty, ka);
        let p = b.ins().fmul(qv, kv);
        if ty == VECTOR {
            vectors.push(p);
        } else {
            tail.push(p);
        }
    }
    while vectors.len() > 1 {
        vectors = vectors
            .chunks(2)
            .map(|pair| match pair {
                [a, c] => b.ins().fadd(*a, *c),
                [a] => *a,
                _ => unreachable!(),
            })
            .collect();
    }
    let mut total = match vectors.first() {
        Some(v) => lane_sum(b, *v),
        None => b.ins().f32const(0.0),
    };
    for t in tail {
        total = b.ins().fadd(total, t);
    }
    total
}

/// The score of an absent key: finite (as the IR's masks), so that the running max and the
/// weights of a block of only absent keys stay finite, and far enough below any real score to
/// weigh nothing beside it. A row whose max stays below half of it saw only absent keys and
/// stores zeros, as a row that saw no key does (the IR's `kernel::visible`).
const MASKED: f32 = -1e30;

/// The function's name for `cfg` (everything its code depends on).
pub fn name(cfg: &AttentionConfig) -> String {
    let keys = match cfg.keys {
        KeyRule::All => "all".to_string(),
        KeyRule::Causal { window } => format!("causal{}", window.map_or(0, |w| w)),
        KeyRule::Position { window } => format!("position{}", window.map_or(0, |w| w)),
    };
    let strides: Vec<String> = cfg
        .strides
        .iter()
        .map(|s| format!("{}x{}x{}", s[0], s[1], s[2]))
        .collect();
    format!(
        "cpu_attention_f32_h{}kv{}_d{}_s{}_t{}_{keys}{}{}{}_{}_scale{:08x}{}{}",
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.q_len,
        cfg.kv_len,
        if cfg.padding { "_padded" } else { "" },
        if cfg.rope { "_rope" } else { "" },
        if cfg.rope_k { "k" } else { "" },
        strides.join("_"),
        cfg.scale.to_bits(),
        cfg.dropout
            .map(|d| format!(
                "_drop{:08x}x{:08x}s{}",
                d.threshold,
                d.keep_scale.to_bits(),
                d.stream
            ))
            .unwrap_or_default(),
        Paging::suffix(cfg.paging)
    )
}

/// Whether the CPU attention covers `cfg`: one key range, and an even head dimension when RoPE
/// pairs its halves.
pub fn supports(cfg: &AttentionConfig) -> bool {
    cfg.splits == 1 && (!cfg.rope || cfg.head_dim.is_multiple_of(2))
}

/// Generates the attention of `cfg` (f32) into `module`; returns its name.
pub fn attention(module: &mut CpuModule, cfg: &AttentionConfig) -> Result<String, CpuError> {
    if !supports(cfg) {
        return Err(CpuError(format!(
            "{}: the CPU attention takes one key range, and an even head dimension with RoPE",
            name(cfg)
        )));
    }
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| body(b, p, &cfg))?;
    Ok(name)
}

fn body(b: &mut FunctionBuilder, p: super::module::KernelParams, cfg: &AttentionConfig) {
    let mut args = Args::new(p);
    let ops = Operands::take(b, &mut args, cfg);
    // The rotated, scaled query row and the output accumulator live on the stack, beside the
    // block's scores.
    let slot = |b: &mut FunctionBuilder, bytes: u32| {
        let data = StackSlotData::new(StackSlotKind::ExplicitSlot, bytes, 4);
        let s = b.create_sized_stack_slot(data);
        b.ins().stack_addr(I64, s, 0)
    };
    let q_buf = slot(b, cfg.head_dim * 4);
    let acc = slot(b, cfg.head_dim * 4);
    let scores = slot(b, BLOCK * 4);
    // Constants every row uses, made once.
    let scale = constant(b, VECTOR, cfg.scale);
    let scale_1 = constant(b, super::module::SCALAR, cfg.scale);
    let rows = Rows {
        cfg,
        ops: &ops,
        q_buf,
        acc,
        scores,
        scale: [scale, scale_1],
    };
    for_range(b, p.begin, p.end, 1, |b, row| rows.row(b, row));
}

/// The kernel's operands: `q, k, v, out`, and as the configuration asks the padding mask, the
/// positions, the RoPE tables, dropout's Philox key (the seed's low and high words) and the
/// paged cache's block table.
struct Operands {
    q: Value,
    k: Value,
    v: Value,
    out: Value,
    mask: Option<Value>,
    positions: Option<Value>,
    tables: Option<(Value, Value)>,
    dropout: Option<([Value; 2], crate::attention::Dropout)>,
    paged: Option<(Value, Paging)>,
}

impl Operands {
    fn take(b: &mut FunctionBuilder, args: &mut Args, cfg: &AttentionConfig) -> Operands {
        let (q, k, v, out) = (args.next(b), args.next(b), args.next(b), args.next(b));
        let mask = cfg.padding.then(|| args.next(b));
        let needs_positions = cfg.rope || matches!(cfg.keys, KeyRule::Position { .. });
        let positions = needs_positions.then(|| args.next(b));
        let tables = cfg.rope.then(|| (args.next(b), args.next(b)));
        let dropout = cfg.dropout.map(|d| {
            let seed_addr = args.next(b);
            let seed = b.ins().load(I64, MemFlagsData::trusted(), seed_addr, 0);
            let lo = b.ins().ireduce(I32, seed);
            let shifted = b.ins().ushr_imm_s(seed, 32);
            let hi = b.ins().ireduce(I32, shifted);
            ([lo, hi], d)
        });
        let paged = cfg.paging.map(|pg| (args.next(b), pg));
        Operands {
            q,
            k,
            v,
            out,
            mask,
            positions,
            tables,
            dropout,
            paged,
        }
    }
}

/// What every query row shares: the operands, the stack buffers (q's row rotated and scaled,
/// the accumulator, a block's scores) and the scale (vector, scalar).
struct Rows<'a> {
    cfg: &'a AttentionConfig,
    ops: &'a Operands,
    q_buf: Value,
    acc: Value,
    scores: Value,
    scale: [Value; 2],
}

/// One query row's place: `bh = batch * heads + h`, the row `i`, its K/V head's rows, the
/// first elements of its q and out rows, and its position where one is read.
struct Row {
    bh: Value,
    batch: Value,
    i: Value,
    q_row: Value,
    o_row: Value,
    k_rows: CacheRows,
    v_rows: CacheRows,
    pos_i: Option<Value>,
}

/// A row's running maximum and sum.
type Running = (Variable, Variable);

impl Rows<'_> {
    /// Query row `row` (`(b * heads + h) * q_len + i`) start to end.
    fn row(&self, b: &mut FunctionBuilder, row: Value) {
        let r = self.place(b, row);
        self.load_query(b, &r);
        let q_regs = self.query_registers(b);
        let (start, end) = self.keys(b, &r);
        let m = b.declare_var(super::module::SCALAR);
        let l = b.declare_var(super::module::SCALAR);
        let neg_inf = b.ins().f32const(f32::NEG_INFINITY);
        b.def_var(m, neg_inf);
        let z = b.ins().f32const(0.0);
        b.def_var(l, z);
        lanes_unrolled(b, self.cfg.head_dim, |b, c, ty| {
            let z = constant(b, ty, 0.0);
            let a = f32_addr(b, self.acc, c);
            store(b, z, a);
        });
        // Keys in blocks of BLOCK: the block's scores into a buffer, its maximum, one rescale of
        // the accumulator, the weights four at a time, then the weighted values.
        for_range(b, start, end, i64::from(BLOCK), |b, kb| {
            self.key_block(b, &r, &q_regs, (m, l), (kb, end), neg_inf);
        });
        self.store(b, &r, (m, l));
    }

    fn place(&self, b: &mut FunctionBuilder, row: Value) -> Row {
        let cfg = self.cfg;
        let [qs, ks, vs, os] = cfg.strides.map(|s| s.map(i64::from));
        let s_len = i64::from(cfg.q_len);
        let bh = b.ins().udiv_imm_s(row, s_len);
        let i = b.ins().urem_imm_s(row, s_len);
        let batch = b.ins().udiv_imm_s(bh, i64::from(cfg.heads));
        let h = b.ins().urem_imm_s(bh, i64::from(cfg.heads));
        let kvh = b.ins().udiv_imm_s(h, i64::from(cfg.heads / cfg.kv_heads));
        let base = |b: &mut FunctionBuilder, s: [i64; 3], head: Value, r: Value| {
            let t0 = b.ins().imul_imm_s(batch, s[0]);
            let t1 = b.ins().imul_imm_s(head, s[1]);
            let t2 = b.ins().imul_imm_s(r, s[2]);
            let t = b.ins().iadd(t0, t1);
            b.ins().iadd(t, t2)
        };
        let q_row = base(b, qs, h, i);
        let o_row = base(b, os, h, i);
        let k_rows = CacheRows::new(b, ks, [batch, kvh], self.ops.paged);
        let v_rows = CacheRows::new(b, vs, [batch, kvh], self.ops.paged);
        let pos_i = self.ops.positions.map(|pp| {
            let idx = b.ins().imul_imm_s(batch, s_len);
            let idx = b.ins().iadd(idx, i);
            load_i64(b, pp, idx)
        });
        Row {
            bh,
            batch,
            i,
            q_row,
            o_row,
            k_rows,
            v_rows,
            pos_i,
        }
    }

    /// q's row into the stack buffer, rotated at its position (with RoPE) and scaled.
    fn load_query(&self, b: &mut FunctionBuilder, r: &Row) {
        let (cfg, ops) = (self.cfg, self.ops);
        let [scale, scale_1] = self.scale;
        let (q, q_buf, half) = (ops.q, self.q_buf, cfg.head_dim / 2);
        match r.pos_i.filter(|_| cfg.rope) {
            Some(pos) => {
                let (cos, sin) = ops.tables.expect("tables with RoPE");
                let t0 = b.ins().imul_imm_s(pos, i64::from(half));
                lanes(b, half, |b, c, ty| {
                    let (rl, rh) = rotated_pair(b, q, r.q_row, c, half, (cos, sin, t0), ty);
                    let s = if ty == VECTOR { scale } else { scale_1 };
                    let (rl, rh) = (b.ins().fmul(rl, s), b.ins().fmul(rh, s));
                    let la = f32_addr(b, q_buf, c);
                    store(b, rl, la);
                    let hc = b.ins().iadd_imm_s(c, i64::from(half));
                    let ha = f32_addr(b, q_buf, hc);
                    store(b, rh, ha);
                });
            }
            None => lanes_unrolled(b, cfg.head_dim, |b, c, ty| {
                let ix = b.ins().iadd(r.q_row, c);
                let a = f32_addr(b, q, ix);
                let x = load(b, ty, a);
                let s = if ty == VECTOR { scale } else { scale_1 };
                let y = b.ins().fmul(x, s);
                let da = f32_addr(b, q_buf, c);
                store(b, y, da);
            }),
        }
    }

    /// q's values held in registers for the whole row (one per four columns, then the tail).
    fn query_registers(&self, b: &mut FunctionBuilder) -> Vec<(Value, Type, i64)> {
        columns(self.cfg.head_dim)
            .map(|(col, ty)| {
                let c = b.ins().iconst(I64, col);
                let a = f32_addr(b, self.q_buf, c);
                (load(b, ty, a), ty, col)
            })
            .collect()
    }

    /// The keys this query sees: `[start, end)`.
    fn keys(&self, b: &mut FunctionBuilder, r: &Row) -> (Value, Value) {
        let cfg = self.cfg;
        let (s_len, t_len) = (i64::from(cfg.q_len), i64::from(cfg.kv_len));
        let last = match cfg.keys {
            KeyRule::All => None,
            KeyRule::Causal { window } => Some((b.ins().iadd_imm_s(r.i, t_len - s_len), window)),
            KeyRule::Position { window } => Some((r.pos_i.expect("positions"), window)),
        };
        match last {
            None => (b.ins().iconst(I64, 0), b.ins().iconst(I64, t_len)),
            Some((last, window)) => {
                let after = b.ins().iadd_imm_s(last, 1);
                let cap = b.ins().iconst(I64, t_len);
                let end = b.ins().umin(after, cap);
                let start = match window {
                    None => b.ins().iconst(I64, 0),
                    Some(w) => {
                        let w = b.ins().iconst(I64, i64::from(w));
                        let from = b.ins().isub(after, w);
                        let zero = b.ins().iconst(I64, 0);
                        let before = b.ins().icmp(IntCC::UnsignedLessThan, after, w);
                        b.ins().select(before, zero, from)
                    }
                };
                (start, end)
            }
        }
    }

    /// The block of keys from `kb` (up to `end`): scores, the running maximum and sum, the
    /// accumulator rescaled and the weighted values added.
    fn key_block(
        &self,
        b: &mut FunctionBuilder,
        r: &Row,
        q_regs: &[(Value, Type, i64)],
        (m, l): Running,
        (kb, end): (Value, Value),
        neg_inf: Value,
    ) {
        let rest = b.ins().isub(end, kb);
        let block = b.ins().iconst(I64, i64::from(BLOCK));
        let count = b.ins().umin(rest, block);
        let zero = b.ins().iconst(I64, 0);
        for_range(b, zero, count, 1, |b, jj| {
            self.score(b, r, q_regs, (kb, jj), zero)
        });
        // The block's maximum, and the running one.
        let lowest = constant(b, VECTOR, f32::NEG_INFINITY);
        let (tv, tt) = fold_lanes(b, count, lowest, neg_inf, |b, jj, ty, top| {
            let sa = f32_addr(b, self.scores, jj);
            let v = load(b, ty, sa);
            b.ins().fmax(top, v)
        });
        let lanes_max: Vec<Value> = (0..4).map(|i| b.ins().extractlane(tv, i)).collect();
        let m01 = b.ins().fmax(lanes_max[0], lanes_max[1]);
        let m23 = b.ins().fmax(lanes_max[2], lanes_max[3]);
        let mb = b.ins().fmax(m01, m23);
        let mb = b.ins().fmax(mb, tt);
        let m_old = b.use_var(m);
        let m_new = b.ins().fmax(m_old, mb);
        b.def_var(m, m_new);
        // What came before is rescaled (nothing, the first time: exp(-inf) is 0 times 0)
        // as the accumulator is read back below.
        let dm = b.ins().fsub(m_old, m_new);
        let corr = exp(b, super::module::SCALAR, dm);
        let l_old = b.use_var(l);
        let l_scaled = b.ins().fmul(l_old, corr);
        let corr_x4 = splat(b, corr);
        // The weights exp(s - m), four at a time, and their sum.
        let m_x4 = splat(b, m_new);
        let zv = constant(b, VECTOR, 0.0);
        let (ws, wt) = fold_lanes(b, count, zv, l_scaled, |b, jj, ty, sum| {
            let sa = f32_addr(b, self.scores, jj);
            let v = load(b, ty, sa);
            let mm = if ty == VECTOR { m_x4 } else { m_new };
            let dv = b.ins().fsub(v, mm);
            let w = exp(b, ty, dv);
            store(b, w, sa);
            b.ins().fadd(sum, w)
        });
        let ws = lane_sum(b, ws);
        let l_new = b.ins().fadd(ws, wt);
        b.def_var(l, l_new);
        if let Some((key, d)) = self.ops.dropout {
            // Dropped weights weigh 0, kept ones 1 / (1 - p) times more (the sum above is of
            // the undropped weights, as in the IR).
            for_range(b, zero, count, 1, |b, jj| {
                let sa = f32_addr(b, self.scores, jj);
                let w = load(b, super::module::SCALAR, sa);
                let j = b.ins().iadd(kb, jj);
                let plane = b.ins().ireduce(I32, r.bh);
                let row_i = b.ins().ireduce(I32, r.i);
                let col = b.ins().ireduce(I32, j);
                let keep = philox_keep(b, key, d.stream, plane, row_i, col, d.threshold);
                let k_scale = b.ins().f32const(d.keep_scale);
                let scaled = b.ins().fmul(w, k_scale);
                let zero_w = b.ins().f32const(0.0);
                let w = b.ins().select(keep, scaled, zero_w);
                store(b, w, sa);
            });
        }
        self.weighted_values(b, r, [corr, corr_x4], (kb, zero, count));
    }

    /// Key `kb + jj`'s score into the block's buffer (keys rotated at their own positions as
    /// they are read where RoPE applies to them; an absent key scores `MASKED`).
    fn score(
        &self,
        b: &mut FunctionBuilder,
        r: &Row,
        q_regs: &[(Value, Type, i64)],
        (kb, jj): (Value, Value),
        zero: Value,
    ) {
        let (cfg, ops) = (self.cfg, self.ops);
        let (t_len, half) = (i64::from(cfg.kv_len), cfg.head_dim / 2);
        let j = b.ins().iadd(kb, jj);
        let k_row = r.k_rows.row(b, j);
        let mut score = match (cfg.rope && cfg.rope_k, ops.positions) {
            (true, Some(pp)) => {
                let (cos, sin) = ops.tables.expect("tables with RoPE");
                let idx = b.ins().imul_imm_s(r.batch, t_len);
                let idx = b.ins().iadd(idx, j);
                let pos_j = load_i64(b, pp, idx);
                let t0 = b.ins().imul_imm_s(pos_j, i64::from(half));
                sum_lanes_unrolled(b, half, |b, c, ty| {
                    let (rl, rh) = rotated_pair(b, ops.k, k_row, c, half, (cos, sin, t0), ty);
                    let (ql, qh) = load_pair(b, self.q_buf, zero, c, half, ty);
                    let t = b.ins().fmul(ql, rl);
                    b.ins().fma(qh, rh, t)
                })
            }
            _ => dot(b, q_regs, ops.k, k_row),
        };
        if let Some(mk) = ops.mask {
            // An absent key scores MASKED: its weight underflows to nothing beside a present
            // key's (and a row with none stores zeros, below).
            let idx = b.ins().imul_imm_s(r.batch, t_len);
            let idx = b.ins().iadd(idx, j);
            let present = load_i64(b, mk, idx);
            let present = b.ins().icmp_imm_s(IntCC::NotEqual, present, 0);
            let masked = b.ins().f32const(MASKED);
            score = b.ins().select(present, score, masked);
        }
        let sa = f32_addr(b, self.scores, jj);
        store(b, score, sa);
    }

    /// The weighted values, ACC_VECTORS columns (or tail columns) of the accumulator at a time
    /// held in registers over the block's keys: `acc = acc * corr + sum_j w_j v_j`.
    fn weighted_values(
        &self,
        b: &mut FunctionBuilder,
        r: &Row,
        [corr, corr_x4]: [Value; 2],
        (kb, zero, count): (Value, Value, Value),
    ) {
        let all: Vec<(i64, Type)> = columns(self.cfg.head_dim).collect();
        for part in all.chunks(ACC_VECTORS) {
            let accs: Vec<(Variable, Type, i64)> = part
                .iter()
                .map(|&(col, ty)| {
                    let var = b.declare_var(ty);
                    let c = b.ins().iconst(I64, col);
                    let aa = f32_addr(b, self.acc, c);
                    let av = load(b, ty, aa);
                    let cr = if ty == VECTOR { corr_x4 } else { corr };
                    let y = b.ins().fmul(av, cr);
                    b.def_var(var, y);
                    (var, ty, col)
                })
                .collect();
            for_range(b, zero, count, 1, |b, jj| {
                let sa = f32_addr(b, self.scores, jj);
                let w = load(b, super::module::SCALAR, sa);
                let w_x4 = splat(b, w);
                let j = b.ins().iadd(kb, jj);
                let v_row = r.v_rows.row(b, j);
                for &(var, ty, col) in &accs {
                    let wt = if ty == VECTOR { w_x4 } else { w };
                    let ix = b.ins().iadd_imm_s(v_row, col);
                    let va = f32_addr(b, self.ops.v, ix);
                    let vv = load(b, ty, va);
                    let av = b.use_var(var);
                    let y = b.ins().fma(wt, vv, av);
                    b.def_var(var, y);
                }
            });
            for &(var, _, col) in &accs {
                let c = b.ins().iconst(I64, col);
                let aa = f32_addr(b, self.acc, c);
                let y = b.use_var(var);
                store(b, y, aa);
            }
        }
    }

    /// Normalises once and stores the row (a row that saw no key, or only absent ones, stores
    /// zeros).
    fn store(&self, b: &mut FunctionBuilder, r: &Row, (m, l): Running) {
        let l_total = b.use_var(l);
        let m_total = b.use_var(m);
        let zero_f = b.ins().f32const(0.0);
        let one = b.ins().f32const(1.0);
        let half_masked = b.ins().f32const(MASKED / 2.0);
        let no_weight = b.ins().fcmp(FloatCC::Equal, l_total, zero_f);
        let only_absent = b.ins().fcmp(FloatCC::LessThan, m_total, half_masked);
        let none = b.ins().bor(no_weight, only_absent);
        let safe = b.ins().select(none, one, l_total);
        let inv = b.ins().fdiv(one, safe);
        let inv = b.ins().select(none, zero_f, inv);
        let inv_x4 = splat(b, inv);
        lanes_unrolled(b, self.cfg.head_dim, |b, c, ty| {
            let s = if ty == VECTOR { inv_x4 } else { inv };
            let aa = f32_addr(b, self.acc, c);
            let av = load(b, ty, aa);
            let y = b.ins().fmul(av, s);
            let ix = b.ins().iadd(r.o_row, c);
            let oa = f32_addr(b, self.ops.out, ix);
            store(b, y, oa);
        });
    }
}

/// Elements `c` and `c + half` of the row at `row` of `base` (`ty` lanes each).
fn load_pair(
    b: &mut FunctionBuilder,
    base: Value,
    row: Value,
    c: Value,
    half: u32,
    ty: Type,
) -> (Value, Value) {
    let li = b.ins().iadd(row, c);
    let hi = b.ins().iadd_imm_s(li, i64::from(half));
    let la = f32_addr(b, base, li);
    let ha = f32_addr(b, base, hi);
    (load(b, ty, la), load(b, ty, ha))
}

/// Elements `c` and `c + half` of the row at `row` of `base`, rotated by the RoPE tables
/// `(cos, sin)` at table row start `t0` (rotate-half pairing).
fn rotated_pair(
    b: &mut FunctionBuilder,
    base: Value,
    row: Value,
    c: Value,
    half: u32,
    (cos, sin, t0): (Value, Value, Value),
    ty: Type,
) -> (Value, Value) {
    let (lo, hi) = load_pair(b, base, row, c, half, ty);
    let ti = b.ins().iadd(t0, c);
    let ca = f32_addr(b, cos, ti);
    let sa = f32_addr(b, sin, ti);
    let (cv, sv) = (load(b, ty, ca), load(b, ty, sa));
    rotated(b, lo, hi, cv, sv)
}

/// Whether Philox-4x32-10 keeps element `(plane, row, col)` of `stream` (DESIGN.md section 2, as
/// `kiln_ir::philox::dropout_keep`): counter `(col >> 2, row, plane, stream)`, key `key`, word
/// `col & 3`, kept when `>= threshold`. Returns an `i8` condition.
fn philox_keep(
    b: &mut FunctionBuilder,
    key: [Value; 2],
    stream: u32,
    plane: Value,
    row: Value,
    col: Value,
    threshold: u32,
) -> Value {
    let c0 = b.ins().ushr_imm_s(col, 2);
    let stream = b.ins().iconst(I32, i64::from(stream));
    let mut c = [c0, row, plane, stream];
    let mut k = key;
    let m0 = b.ins().iconst(I32, i64::from(0xD251_1F53u32));
    let m1 = b.ins().iconst(I32, i64::from(0xCD9E_8D57u32));
    for round in 0..10 {
        if round > 0 {
            k[0] = b.ins().iadd_imm_s(k[0], i64::from(0x9E37_79B9u32));
            k[1] = b.ins().iadd_imm_s(k[1], i64::from(0xBB67_AE85u32));
        }
        let hi0 = b.ins().umulhi(c[0], m0);
        let lo0 = b.ins().imul(c[0], m0);
        let hi1 = b.ins().umulhi(c[2], m1);
        let lo1 = b.ins().imul(c[2], m1);
        let x0 = b.ins().bxor(hi1, c[1]);
        let n0 = b.ins().bxor(x0, k[0]);
        let x2 = b.ins().bxor(hi0, c[3]);
        let n2 = b.ins().bxor(x2, k[1]);
        c = [n0, lo1, n2, lo0];
    }
    let which = b.ins().band_imm_s(col, 3);
    let is1 = b.ins().icmp_imm_s(IntCC::Equal, which, 1);
    let is2 = b.ins().icmp_imm_s(IntCC::Equal, which, 2);
    let is3 = b.ins().icmp_imm_s(IntCC::Equal, which, 3);
    let w = b.ins().select(is1, c[1], c[0]);
    let w = b.ins().select(is2, c[2], w);
    let w = b.ins().select(is3, c[3], w);
    b.ins()
        .icmp_imm_s(IntCC::UnsignedGreaterThanOrEqual, w, i64::from(threshold))
}
