//! Token choice from a row of logits on the CPU, bit for bit the runtime's reference
//! (`kiln_runtime::generate::choose`):
//!
//! - temperature <= 0: the index of the largest logit (the first on ties);
//! - otherwise each logit weighs the integer `kiln_ir::sampling::weight` (f32 operations in the
//!   reference's order, so the same bits); top-k keeps every logit whose key is `>=` the k-th
//!   largest (ties kept; 0 keeps all), top-p then keeps the logits `>= t` for the largest key `t`
//!   whose kept mass reaches `top_p` of the top-k mass (`kiln_ir::sampling::reaches`, in 128
//!   bits), and the token is the first index whose running kept mass (integer) exceeds the
//!   step's target (`kiln_ir::sampling::target`), or the last kept index when no mass is left.
//!
//! Thresholds are found by bisection over the logits' ordered keys (32 passes over the row), so
//! they are logits' keys and no sort is needed.
//!
//! Parameters: `logits` (f32 `[rows, vocab]`), `out` (i64 `[rows]`), `scratch` (8 bytes per
//! logit: the weights and the ordered keys), then `temperature` (f32 bits), `top_k`, `top_p` (f32
//! bits) and the step's uniform 32-bit word; the parallel axis is rows.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, I32, I64};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value};
use cranelift_frontend::{FunctionBuilder, Variable};

use super::module::{for_range, if_then, Args, CpuError, CpuModule};

/// Bisection steps: one per bit of a key.
const KEY_BITS: i64 = 32;

/// The function's name for rows of `vocab` logits.
pub fn name(vocab: u32) -> String {
    kiln_ir::artifact::cpu_sampler_name(vocab as usize)
}

/// Scratch bytes per row of `vocab` logits.
pub fn scratch_bytes(vocab: u32) -> u64 {
    u64::from(vocab) * 8
}

/// Generates the sampler for rows of `vocab` logits into `module`; returns its name.
pub fn sample(module: &mut CpuModule, vocab: u32) -> Result<String, CpuError> {
    if vocab == 0 {
        return Err(CpuError("a sampler over an empty vocabulary".into()));
    }
    let name = name(vocab);
    let v = i64::from(vocab);
    module.define(&name, |b, p| {
        let mut args = Args::new(p);
        let logits = args.next(b);
        let out = args.next(b);
        let scratch = args.next(b);
        let bits = args.next(b);
        let params = Params {
            temperature: f32_arg(b, bits),
            top_k: args.next(b),
            top_p: {
                let bits = args.next(b);
                f32_arg(b, bits)
            },
            word: args.next(b),
        };
        for_range(b, p.begin, p.end, 1, |b, row| {
            let x = b.ins().imul_imm_s(row, v * 4);
            let w = b.ins().imul_imm_s(row, v * 8);
            let w = b.ins().iadd(scratch, w);
            let r = Row {
                x: b.ins().iadd(logits, x),
                w,
                keys: b.ins().iadd_imm_s(w, v * 4),
                n: b.ins().iconst(I64, v),
            };
            let token = r.choose(b, &params, v);
            let at = b.ins().imul_imm_s(row, 8);
            let at = b.ins().iadd(out, at);
            b.ins()
                .store(MemFlagsData::new().with_notrap(), token, at, 0);
        });
    })?;
    Ok(name)
}

/// A step's sampling parameters, as the function's arguments give them.
struct Params {
    /// f32.
    temperature: Value,
    top_k: Value,
    /// f32.
    top_p: Value,
    /// The step's uniform 32-bit word.
    word: Value,
}

/// One row: its `n` logits `x`, and in its scratch the weights `w` and the ordered `keys`.
struct Row {
    x: Value,
    w: Value,
    keys: Value,
    n: Value,
}

impl Row {
    /// The row's token: the first largest logit, or at a temperature above 0 the draw among
    /// the logits top-k and top-p keep.
    fn choose(&self, b: &mut FunctionBuilder, params: &Params, v: i64) -> Value {
        let (best, best_i) = self.argmax(b);
        let chosen = b.declare_var(I64);
        b.def_var(chosen, best_i);
        let zero_f = b.ins().f32const(0.0);
        let sampling = b
            .ins()
            .fcmp(FloatCC::GreaterThan, params.temperature, zero_f);
        if_then(b, sampling, |b| {
            self.weigh(b, best, params.temperature);
            let t = self.threshold(b, params, v);
            let token = self.draw(b, t, params.word);
            b.def_var(chosen, token);
        });
        b.use_var(chosen)
    }

    /// Address of f32 (or u32) element `i` from `base`.
    fn elem(b: &mut FunctionBuilder, base: Value, i: Value) -> Value {
        let off = b.ins().imul_imm_s(i, 4);
        b.ins().iadd(base, off)
    }

    /// The largest logit and its first index.
    fn argmax(&self, b: &mut FunctionBuilder) -> (Value, Value) {
        let flags = MemFlagsData::new().with_notrap();
        let best = b.declare_var(F32);
        let best_i = b.declare_var(I64);
        let neg_inf = b.ins().f32const(f32::NEG_INFINITY);
        let zero = b.ins().iconst(I64, 0);
        b.def_var(best, neg_inf);
        b.def_var(best_i, zero);
        for_range(b, zero, self.n, 1, |b, i| {
            let a = Self::elem(b, self.x, i);
            let xi = b.ins().load(F32, flags, a, 0);
            let top = b.use_var(best);
            let top_i = b.use_var(best_i);
            let gt = b.ins().fcmp(FloatCC::GreaterThan, xi, top);
            let nb = b.ins().select(gt, xi, top);
            let ni = b.ins().select(gt, i, top_i);
            b.def_var(best, nb);
            b.def_var(best_i, ni);
        });
        (b.use_var(best), b.use_var(best_i))
    }

    /// Each logit's weight (against the largest, `m`, at `temperature`) and ordered key, into
    /// the scratch.
    fn weigh(&self, b: &mut FunctionBuilder, m: Value, temperature: Value) {
        let flags = MemFlagsData::new().with_notrap();
        let zero = b.ins().iconst(I64, 0);
        for_range(b, zero, self.n, 1, |b, i| {
            let a = Self::elem(b, self.x, i);
            let xi = b.ins().load(F32, flags, a, 0);
            let wi = weight(b, xi, m, temperature);
            let a = Self::elem(b, self.w, i);
            b.ins().store(flags, wi, a, 0);
            let key = ordered_key(b, xi);
            let a = Self::elem(b, self.keys, i);
            b.ins().store(flags, key, a, 0);
        });
    }

    /// The smallest key kept: top-k's (the largest key with at least k logits at or above it;
    /// 0 keeps all), then top-p's (the largest key at or above it keeping `top_p` of its mass).
    fn threshold(&self, b: &mut FunctionBuilder, params: &Params, v: i64) -> Value {
        let (keys, n, w) = (self.keys, self.n, self.w);
        let zero = b.ins().iconst(I64, 0);
        let threshold = b.declare_var(I64);
        b.def_var(threshold, zero);
        let top_k = params.top_k;
        let some = b.ins().icmp_imm_s(IntCC::NotEqual, top_k, 0);
        let fewer = b.ins().icmp_imm_s(IntCC::UnsignedLessThan, top_k, v);
        let limited = b.ins().band(some, fewer);
        if_then(b, limited, |b| {
            let found = bisect(b, zero, |b, mid| {
                let c = count_at_least(b, keys, n, mid);
                b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, c, top_k)
            });
            b.def_var(threshold, found);
        });
        let t_k = b.use_var(threshold);
        let z_k = mass_at_least(b, w, keys, n, t_k);
        let one = b.ins().f32const(1.0);
        let partial = b.ins().fcmp(FloatCC::LessThan, params.top_p, one);
        if_then(b, partial, |b| {
            let scale = b.ins().f32const(kiln_ir::sampling::power_of_two(32));
            let p = b.ins().fmul(params.top_p, scale);
            let p = b.ins().fcvt_to_uint_sat(I64, p);
            let found = bisect(b, t_k, |b, mid| {
                let mass = mass_at_least(b, w, keys, n, mid);
                reaches(b, mass, p, z_k)
            });
            b.def_var(threshold, found);
        });
        b.use_var(threshold)
    }

    /// The draw among the logits whose keys are at least `t`: the first index whose running
    /// kept mass passes `floor(word * kept mass / 2^32)`, else the last kept index.
    fn draw(&self, b: &mut FunctionBuilder, t: Value, word: Value) -> Value {
        let (keys, n, w) = (self.keys, self.n, self.w);
        let z = mass_at_least(b, w, keys, n, t);
        // floor(word * z / 2^32), the product in 128 bits.
        let hi = b.ins().umulhi(word, z);
        let lo = b.ins().imul(word, z);
        let hi = b.ins().ishl_imm_s(hi, 32);
        let lo = b.ins().ushr_imm_s(lo, 32);
        let target = b.ins().bor(hi, lo);
        let running = b.declare_var(I64);
        let last = b.declare_var(I64);
        let hit = b.declare_var(I64);
        let zero = b.ins().iconst(I64, 0);
        let none = b.ins().iconst(I64, -1);
        b.def_var(running, zero);
        b.def_var(last, zero);
        b.def_var(hit, none);
        for_range(b, zero, n, 1, |b, i| {
            let (kept, add) = kept_weight(b, w, keys, i, t);
            let r = add_to(b, running, add);
            let l = b.use_var(last);
            let l = b.ins().select(kept, i, l);
            b.def_var(last, l);
            let h = b.use_var(hit);
            let past = b.ins().icmp(IntCC::UnsignedGreaterThan, r, target);
            let unset = b.ins().icmp_imm_s(IntCC::SignedLessThan, h, 0);
            let first = b.ins().band(past, unset);
            let first = b.ins().band(first, kept);
            let h = b.ins().select(first, i, h);
            b.def_var(hit, h);
        });
        let h = b.use_var(hit);
        let l = b.use_var(last);
        let found = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, h, 0);
        b.ins().select(found, h, l)
    }
}

/// The f32 whose bits are the low half of argument `bits`.
fn f32_arg(b: &mut FunctionBuilder, bits: Value) -> Value {
    let low = b.ins().ireduce(I32, bits);
    b.ins().bitcast(F32, MemFlagsData::new(), low)
}

/// `kiln_ir::sampling::ordered_key(x)`: `x`'s bits mapped so that unsigned order is float order
/// (negative values flipped entirely, positive ones with the sign bit set), NaN to 0.
fn ordered_key(b: &mut FunctionBuilder, x: Value) -> Value {
    let bits = b.ins().bitcast(I32, MemFlagsData::new(), x);
    let sign = b.ins().sshr_imm_s(bits, 31);
    let flip = b.ins().bor_imm_s(sign, i64::from(i32::MIN));
    let key = b.ins().bxor(bits, flip);
    let nan = b.ins().fcmp(FloatCC::Unordered, x, x);
    let zero = b.ins().iconst(I32, 0);
    b.ins().select(nan, zero, key)
}

/// Whether key `i` (zero-extended) is at least `t`.
fn kept(b: &mut FunctionBuilder, keys: Value, i: Value, t: Value) -> Value {
    let off = b.ins().imul_imm_s(i, 4);
    let a = b.ins().iadd(keys, off);
    let key = b.ins().load(I32, MemFlagsData::new().with_notrap(), a, 0);
    let key = b.ins().uextend(I64, key);
    b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, key, t)
}

/// How many of the `n` keys are at least `t`.
fn count_at_least(b: &mut FunctionBuilder, keys: Value, n: Value, t: Value) -> Value {
    let count = b.declare_var(I64);
    let zero = b.ins().iconst(I64, 0);
    b.def_var(count, zero);
    for_range(b, zero, n, 1, |b, i| {
        let k = kept(b, keys, i, t);
        let k = b.ins().uextend(I64, k);
        add_to(b, count, k);
    });
    b.use_var(count)
}

/// The sum of the weights whose keys are at least `t` (an integer: any order gives it).
fn mass_at_least(b: &mut FunctionBuilder, w: Value, keys: Value, n: Value, t: Value) -> Value {
    let mass = b.declare_var(I64);
    let zero = b.ins().iconst(I64, 0);
    b.def_var(mass, zero);
    for_range(b, zero, n, 1, |b, i| {
        let (_, add) = kept_weight(b, w, keys, i, t);
        add_to(b, mass, add);
    });
    b.use_var(mass)
}

/// Whether key `i` is at least `t`, and weight `i` (widened) if so, else 0.
fn kept_weight(
    b: &mut FunctionBuilder,
    w: Value,
    keys: Value,
    i: Value,
    t: Value,
) -> (Value, Value) {
    let k = kept(b, keys, i, t);
    let wi = load_weight(b, w, i);
    let zero = b.ins().iconst(I64, 0);
    (k, b.ins().select(k, wi, zero))
}

/// Adds `v` to variable `var`; its new value.
fn add_to(b: &mut FunctionBuilder, var: Variable, v: Value) -> Value {
    let sum = b.use_var(var);
    let sum = b.ins().iadd(sum, v);
    b.def_var(var, sum);
    sum
}

/// Weight `i` (a u32), widened.
fn load_weight(b: &mut FunctionBuilder, w: Value, i: Value) -> Value {
    let off = b.ins().imul_imm_s(i, 4);
    let a = b.ins().iadd(w, off);
    let wi = b.ins().load(I32, MemFlagsData::new().with_notrap(), a, 0);
    b.ins().uextend(I64, wi)
}

/// `kiln_ir::sampling::weight(x, m, t)` as a u32, in the same f32 operations.
fn weight(b: &mut FunctionBuilder, x: Value, m: Value, t: Value) -> Value {
    use kiln_ir::sampling::{EXP2, SCALE};
    let d = b.ins().fsub(x, m);
    let d = b.ins().fdiv(d, t);
    let log2e = b.ins().f32const(std::f32::consts::LOG2_E);
    let y = b.ins().fmul(d, log2e);
    // y >= -SCALE, false for NaN; below it (or NaN) y becomes -SCALE - 1 and weighs 0.
    let low = b.ins().f32const(-(SCALE as f32));
    let inside = b.ins().fcmp(FloatCC::GreaterThanOrEqual, y, low);
    let n = b.ins().floor(y);
    let f = b.ins().fsub(y, n);
    let mut p = b.ins().f32const(EXP2[0]);
    for c in &EXP2[1..] {
        let c = b.ins().f32const(*c);
        p = b.ins().fma(p, f, c);
    }
    // 2^(n + SCALE) from its exponent bits, n in [-SCALE, 0] where it counts.
    let n = b.ins().fcvt_to_sint_sat(I32, n);
    let e = b.ins().iadd_imm_s(n, i64::from(SCALE + 127));
    let e = b.ins().ishl_imm_s(e, 23);
    let scale = b.ins().bitcast(F32, MemFlagsData::new(), e);
    let v = b.ins().fmul(p, scale);
    let v = b.ins().fcvt_to_uint_sat(I32, v);
    let zero = b.ins().iconst(I32, 0);
    b.ins().select(inside, v, zero)
}

/// Whether `mass` reaches `p` (`top_p` times 2^32) of `total`: `mass * 2^32 >= p * total` in 128
/// bits (high words compared, then low words).
fn reaches(b: &mut FunctionBuilder, mass: Value, p: Value, total: Value) -> Value {
    let l_hi = b.ins().ushr_imm_s(mass, 32);
    let l_lo = b.ins().ishl_imm_s(mass, 32);
    let r_hi = b.ins().umulhi(p, total);
    let r_lo = b.ins().imul(p, total);
    let above = b.ins().icmp(IntCC::UnsignedGreaterThan, l_hi, r_hi);
    let level = b.ins().icmp(IntCC::Equal, l_hi, r_hi);
    let enough = b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, l_lo, r_lo);
    let tie = b.ins().band(level, enough);
    b.ins().bor(above, tie)
}

/// The largest key in `low..=u32::MAX` for which `holds` (true at `low`, monotone: once false,
/// false for every larger key), by bisection.
fn bisect(
    b: &mut FunctionBuilder,
    low: Value,
    mut holds: impl FnMut(&mut FunctionBuilder, Value) -> Value,
) -> Value {
    let lo = b.declare_var(I64);
    let hi = b.declare_var(I64);
    b.def_var(lo, low);
    let top = b.ins().iconst(I64, i64::from(u32::MAX));
    b.def_var(hi, top);
    let zero = b.ins().iconst(I64, 0);
    let steps = b.ins().iconst(I64, KEY_BITS);
    for_range(b, zero, steps, 1, |b, _| {
        let l = b.use_var(lo);
        let h = b.use_var(hi);
        let span = b.ins().isub(h, l);
        let span = b.ins().iadd_imm_s(span, 1);
        let half = b.ins().ushr_imm_s(span, 1);
        let mid = b.ins().iadd(l, half);
        let ok = holds(b, mid);
        let below = b.ins().iadd_imm_s(mid, -1);
        let l2 = b.ins().select(ok, mid, l);
        let h2 = b.ins().select(ok, h, below);
        b.def_var(lo, l2);
        b.def_var(hi, h2);
    });
    b.use_var(lo)
}
