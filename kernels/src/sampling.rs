//! Greedy token choice: the index of the largest logit of each row (the first one on ties), as
//! i64, with the semantics of `kiln_runtime::generate::choose` at temperature 0: NaN never wins,
//! and a row without a value above -inf picks 0. One block of 1024 threads per row (a decode
//! step has one row per sequence, and a vocabulary of 128256 bf16 is 250 KB): each thread scans
//! 16-byte chunks, four in flight (single elements when rows are not 16-byte aligned), then a
//! butterfly over the warp and a pass over the warps' winners. The advancing form also leaves the
//! next decode step's inputs in place, so that decode steps can follow each other on the device
//! without the host between them.

use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch, ROW_THREADS};

/// Threads of the argmax block.
const ARGMAX_THREADS: u32 = 1024;
/// Chunks a thread loads before comparing them.
const ARGMAX_UNROLL: u32 = 4;

/// Generates `out[row] = argmax(logits[row, :])`. Parameters: `logits, out`, and when
/// `advance`, the decode step's i64 `[rows, 1]` inputs `ids, positions, mask`: each row whose
/// mask is not 0 gets its chosen token as its next id and its position one further (what the host
/// would upload for the next step); a masked row keeps its inputs.
pub fn argmax(elem: Elem, rows: u32, vocab: u32, advance: bool) -> GeneratedKernel {
    let form = if advance { "_advance" } else { "" };
    let name = format!("argmax{form}_{}_v{vocab}", elem.name());
    let mut k = Kernel::new(&name);
    k.directive(format!(".maxntid {ARGMAX_THREADS}, 1, 1"));
    let logits = k.param_ptr("logits");
    let out = k.param_ptr("out");
    let next = advance.then(|| {
        let ids = k.param_ptr("ids");
        let positions = k.param_ptr("positions");
        let mask = k.param_ptr("mask");
        [ids, positions, mask]
    });
    let warps = ARGMAX_THREADS / 32;
    let vals = k.shared("best_val", warps * 4);
    let idxs = k.shared("best_idx", warps * 4);
    let tid = k.special("tid.x");
    let row = k.special("ctaid.x");
    let base = k.mul_u32(&row, &vocab);
    let best = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
    let best_i = k.mov(RegClass::B32, &u32::MAX);
    // Elements per chunk: 16 bytes when every row starts 16-byte aligned.
    let per = match 16 / elem.bytes() {
        wide if vocab.is_multiple_of(wide) => wide,
        _ => 1,
    };
    let chunk = k.mov(RegClass::B32, &tid);
    let top = k.label("scan");
    let done = k.label("scan_done");
    k.place(&top);
    let first = k.mul_u32(&chunk, &per);
    let past = k.setp("ge.u32", &first, &vocab);
    k.bra(Some((past, true)), &done);
    let mut loaded = Vec::new();
    for u in 0..ARGMAX_UNROLL {
        let at = k.add_u32(&first, &(u * ARGMAX_THREADS * per));
        let inside = k.setp("lt.u32", &at, &vocab);
        let i = k.add_u32(&base, &at);
        let addr = k.address(logits, &i, elem.bytes());
        loaded.push((at, inside, load_chunk(&mut k, elem, addr, inside, per)));
    }
    // In index order, strictly greater: NaN and -inf never win; a thread that saw neither keeps
    // index MAX.
    for (at, inside, values) in loaded {
        for (j, v) in values.iter().enumerate() {
            let take = k.setp("gt.f32", v, &best);
            k.emit(format!("and.pred {take}, {take}, {inside}"));
            k.emit(format!("@{take} mov.f32 {best}, {v}"));
            k.emit(format!("@{take} add.u32 {best_i}, {at}, {j}"));
        }
    }
    k.emit(format!(
        "add.u32 {chunk}, {chunk}, {}",
        ARGMAX_UNROLL * ARGMAX_THREADS
    ));
    k.bra(None, &top);
    k.place(&done);
    // Combine (value, index) pairs: larger value wins, the smaller index on ties.
    let combine = |k: &mut Kernel, other_v, other_i| {
        let gt = k.setp("gt.f32", &other_v, &best);
        let eq = k.setp("eq.f32", &other_v, &best);
        let lower = k.setp("lt.u32", &other_i, &best_i);
        let tie = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {tie}, {eq}, {lower}"));
        let take = k.reg(RegClass::Pred);
        k.emit(format!("or.pred {take}, {gt}, {tie}"));
        k.emit(format!("@{take} mov.f32 {best}, {other_v}"));
        k.emit(format!("@{take} mov.u32 {best_i}, {other_i}"));
    };
    for offset in [16u32, 8, 4, 2, 1] {
        let ov = k.reg(RegClass::F32);
        let oi = k.reg(RegClass::B32);
        k.emit(format!("shfl.sync.bfly.b32 {ov}, {best}, {offset}, 31, -1"));
        k.emit(format!(
            "shfl.sync.bfly.b32 {oi}, {best_i}, {offset}, 31, -1"
        ));
        combine(&mut k, ov, oi);
    }
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let first = k.setp("eq.u32", &lane, &0u32);
    let vbase = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {vbase}, {vals}"));
    let ibase = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {ibase}, {idxs}"));
    let vslot = k.mad_u32(&warp, &4u32, &vbase);
    let islot = k.mad_u32(&warp, &4u32, &ibase);
    k.emit(format!("@{first} st.shared.f32 [{vslot}], {best}"));
    k.emit(format!("@{first} st.shared.u32 [{islot}], {best_i}"));
    k.barrier();
    let leader = k.setp("eq.u32", &tid, &0u32);
    let end = k.label("end");
    k.bra(Some((leader, false)), &end);
    for w in 1..warps {
        let ov = k.reg(RegClass::F32);
        let oi = k.reg(RegClass::B32);
        k.emit(format!("ld.shared.f32 {ov}, [{vbase}+{}]", w * 4));
        k.emit(format!("ld.shared.u32 {oi}, [{ibase}+{}]", w * 4));
        combine(&mut k, ov, oi);
    }
    k.comment("no value above -inf: index 0");
    let none = k.setp("eq.u32", &best_i, &u32::MAX);
    k.emit(format!("@{none} mov.u32 {best_i}, 0"));
    let wide = k.op1("cvt.u64.u32", RegClass::B64, &best_i);
    let oa = k.address(out, &row, 8);
    k.emit(format!("st.global.u64 [{oa}], {wide}"));
    if let Some([ids, positions, mask]) = next {
        k.comment("the next step's inputs: this token at the next position, unless masked");
        let ma = k.address(mask, &row, 8);
        let m = k.ld_global_i64(ma);
        let live = k.setp("ne.s64", &m, &0u64);
        let ia = k.address(ids, &row, 8);
        k.emit(format!("@{live} st.global.u64 [{ia}], {wide}"));
        let pa = k.address(positions, &row, 8);
        let p = k.ld_global_i64(pa);
        let p1 = k.op2("add.s64", RegClass::B64, &p, &1u64);
        k.emit(format!("@{live} st.global.u64 [{pa}], {p1}"));
    }
    k.place(&end);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [rows, 1, 1],
            block: [ARGMAX_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// The `per` elements at global `addr` as f32 (one 16-byte load, or one element), zeros unless
/// `when` holds.
fn load_chunk(k: &mut Kernel, elem: Elem, addr: Reg, when: Reg, per: u32) -> Vec<Reg> {
    match (elem, per) {
        (Elem::F32, 1) => {
            let v = k.mov(RegClass::F32, &F32(0.0));
            k.emit(format!("@{when} ld.global.f32 {v}, [{addr}]"));
            vec![v]
        }
        (Elem::F32, _) => {
            let v: Vec<Reg> = (0..4).map(|_| k.mov(RegClass::F32, &F32(0.0))).collect();
            k.emit(format!(
                "@{when} ld.global.v4.f32 {{{}, {}, {}, {}}}, [{addr}]",
                v[0], v[1], v[2], v[3]
            ));
            v
        }
        (_, 1) => {
            let h = k.reg(RegClass::B16);
            k.emit(format!("mov.b16 {h}, 0"));
            k.emit(format!("@{when} ld.global.b16 {h}, [{addr}]"));
            vec![k.op1(&format!("cvt.f32.{}", elem.name()), RegClass::F32, &h)]
        }
        _ => {
            let words: Vec<Reg> = (0..4).map(|_| k.mov(RegClass::B32, &0u32)).collect();
            k.emit(format!(
                "@{when} ld.global.v4.b32 {{{}, {}, {}, {}}}, [{addr}]",
                words[0], words[1], words[2], words[3]
            ));
            k.unpack_halves(elem, &words)
        }
    }
}

/// Generates top-k / top-p sampling with temperature: one block per row, bit for bit
/// `kiln_runtime::generate::choose` (the integer weights of `kiln_ir::sampling`, in the same f32
/// operations; integer masses, so the block's order of summing does not matter). Parameters:
/// `logits [rows, vocab]`, `params [rows, 4]` (32-bit words: temperature as f32 bits, top_k,
/// top_p as f32 bits, the step's uniform word), `out [rows]` (i64). Per-request values live in
/// device memory, so one captured graph serves every request. A temperature of 0 or less takes
/// the first largest logit.
///
/// Thresholds are found by bisection over the logits' ordered keys (NaN below every number), so
/// they are logits' keys; the draw is the first kept index whose running mass exceeds
/// `floor(word * z / 2^32)`, found by an exclusive scan over threads' contiguous chunks.
pub fn top_k_top_p(elem: Elem, rows: u32, vocab: u32) -> GeneratedKernel {
    use crate::reduce::{block_reduce, block_sum_u64, scratch, scratch_u64};
    let name = format!("sample_top_k_top_p_{}_v{vocab}", elem.name());
    let mut k = Kernel::new(&name);
    let logits = k.param_ptr("logits");
    let params = k.param_ptr("params");
    let out = k.param_ptr("out");
    let red = scratch(&mut k);
    let red64 = scratch_u64(&mut k);
    let prefix = k.shared("prefix", ROW_THREADS * 8);
    let tid = k.special("tid.x");
    let row = k.special("ctaid.x");
    let base = k.mul_u32(&row, &vocab);
    let pi = k.mul_u32(&row, &4u32);
    let pa = k.address(params, &pi, 4);
    let word_at = |k: &mut Kernel, i: u64| {
        let a = k.op2("add.u64", RegClass::B64, &pa, &(4 * i));
        let v = k.reg(RegClass::B32);
        k.emit(format!("ld.global.b32 {v}, [{a}]"));
        v
    };
    let t_bits = word_at(&mut k, 0);
    let top_k = word_at(&mut k, 1);
    let p_bits = word_at(&mut k, 2);
    let word = word_at(&mut k, 3);
    let temperature = k.reg(RegClass::F32);
    k.emit(format!("mov.b32 {temperature}, {t_bits}"));
    let top_p = k.reg(RegClass::F32);
    k.emit(format!("mov.b32 {top_p}, {p_bits}"));
    let chunk = vocab.div_ceil(ROW_THREADS);

    // for col in tid..vocab step ROW_THREADS { body(col, x, key) }
    let strided = |k: &mut Kernel, what: &str, body: &mut dyn FnMut(&mut Kernel, Reg, Reg, Reg)| {
        let col = k.mov(RegClass::B32, &tid);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &col, &vocab);
        k.bra(Some((past, true)), &done);
        let i = k.add_u32(&base, &col);
        let a = k.address(logits, &i, elem.bytes());
        let x = k.ld_global(elem, a);
        let key = ordered_key(k, x);
        body(k, col, x, key);
        k.emit(format!("add.u32 {col}, {col}, {ROW_THREADS}"));
        k.bra(None, &top);
        k.place(&done);
    };

    k.comment("the row's largest logit, and the first index holding it");
    let best = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
    let best_i = k.mov(RegClass::B32, &u32::MAX);
    strided(&mut k, "max", &mut |k, col, x, _| {
        let gt = k.setp("gt.f32", &x, &best);
        k.emit(format!("@{gt} mov.f32 {best}, {x}"));
        k.emit(format!("@{gt} mov.u32 {best_i}, {col}"));
    });
    let m = block_reduce(&mut k, best, "max.f32", RegClass::F32, &red, tid);
    // The first index of the largest value: threads holding another value offer MAX.
    let holds = k.setp("eq.f32", &best, &m);
    let offer = k.selp(RegClass::B32, "u32", &best_i, &u32::MAX, holds);
    let first_best = block_reduce(&mut k, offer, "min.u32", RegClass::B32, &red, tid);
    let none = k.setp("eq.u32", &first_best, &u32::MAX);
    let greedy_token = k.selp(RegClass::B32, "u32", &0u32, &first_best, none);
    let store = |k: &mut Kernel, token: &Reg| {
        let write = k.setp("eq.u32", &tid, &0u32);
        let skip = k.label("skip_write");
        k.bra(Some((write, false)), &skip);
        let wide = k.op1("cvt.u64.u32", RegClass::B64, token);
        let oa = k.address(out, &row, 8);
        k.emit(format!("st.global.u64 [{oa}], {wide}"));
        k.place(&skip);
    };
    let sampled = k.label("sampled");
    let hot = k.setp("gt.f32", &temperature, &F32(0.0));
    k.bra(Some((hot, true)), &sampled);
    k.comment("temperature 0: the first largest logit");
    store(&mut k, &greedy_token);
    k.emit("ret");
    k.place(&sampled);

    // The kept mass (u64) at key threshold `t`.
    let mass = |k: &mut Kernel, what: &str, t: Reg| -> Reg {
        let local = k.mov(RegClass::B64, &0u64);
        strided(k, what, &mut |k, _, x, key| {
            let kept = k.setp("ge.u32", &key, &t);
            let w = weight(k, x, m, temperature);
            let wide = k.op1("cvt.u64.u32", RegClass::B64, &w);
            k.emit(format!("@{kept} add.u64 {local}, {local}, {wide}"));
        });
        block_sum_u64(k, local, &red64, tid)
    };
    // The largest key t in [lo, 2^32 - 1] for which `holds(t)` (true at lo, monotone).
    let bisect = |k: &mut Kernel,
                  what: &str,
                  lo_init: Reg,
                  holds: &mut dyn FnMut(&mut Kernel, Reg) -> Reg|
     -> Reg {
        let lo = k.mov(RegClass::B32, &lo_init);
        let hi = k.mov(RegClass::B32, &u32::MAX);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let converged = k.setp("ge.u32", &lo, &hi);
        k.bra(Some((converged, true)), &done);
        let span = k.sub_u32(&hi, &lo);
        let half = k.op2("shr.u32", RegClass::B32, &span, &1u32);
        let step = k.add_u32(&half, &1u32);
        let mid = k.add_u32(&lo, &step);
        let ok = holds(k, mid);
        let below = k.sub_u32(&mid, &1u32);
        k.emit(format!("@{ok} mov.u32 {lo}, {mid}"));
        k.emit(format!("@!{ok} mov.u32 {hi}, {below}"));
        k.bra(None, &top);
        k.place(&done);
        lo
    };

    k.comment("top-k threshold: the largest key with at least top_k logits at or above it");
    let zero = k.mov(RegClass::B32, &0u32);
    let some = k.setp("ne.u32", &top_k, &0u32);
    let fewer = k.setp("lt.u32", &top_k, &vocab);
    let use_k = k.reg(RegClass::Pred);
    k.emit(format!("and.pred {use_k}, {some}, {fewer}"));
    let t_k_found = bisect(&mut k, "top_k", zero, &mut |k, mid| {
        let local = k.mov(RegClass::B32, &0u32);
        strided(k, "top_k_count", &mut |k, _, _, key| {
            let kept = k.setp("ge.u32", &key, &mid);
            k.emit(format!("@{kept} add.u32 {local}, {local}, 1"));
        });
        let count = block_reduce(k, local, "add.u32", RegClass::B32, &red, tid);
        k.setp("ge.u32", &count, &top_k)
    });
    let t_k = k.selp(RegClass::B32, "u32", &t_k_found, &0u32, use_k);

    k.comment("top-p threshold within the top-k set: mass * 2^32 >= P * z_k in 128 bits");
    let z_k = mass(&mut k, "mass_k", t_k);
    let scaled = k.mul_f32(&top_p, &F32(kiln_ir::sampling::power_of_two(32)));
    let p = k.op1("cvt.rzi.u64.f32", RegClass::B64, &scaled);
    let use_p = k.setp("lt.f32", &top_p, &F32(1.0));
    let t_p_found = bisect(&mut k, "top_p", t_k, &mut |k, mid| {
        let kept = mass(k, "top_p_mass", mid);
        reaches(k, kept, p, z_k)
    });
    let t = k.selp(RegClass::B32, "u32", &t_p_found, &t_k, use_p);
    let z = mass(&mut k, "mass_p", t);

    k.comment("the last kept index (the answer when no mass is left)");
    let last = k.mov(RegClass::B32, &0u32);
    strided(&mut k, "last", &mut |k, col, _, key| {
        let kept = k.setp("ge.u32", &key, &t);
        k.emit(format!("@{kept} max.u32 {last}, {last}, {col}"));
    });
    let last_kept = block_reduce(&mut k, last, "max.u32", RegClass::B32, &red, tid);

    k.comment("kept mass of this thread's contiguous chunk, then an exclusive scan over threads");
    let first = k.mul_u32(&tid, &chunk);
    let chunk_end = k.add_u32(&first, &chunk);
    let end = k.op2("min.u32", RegClass::B32, &chunk_end, &vocab);
    let walk = |k: &mut Kernel, what: &str, body: &mut dyn FnMut(&mut Kernel, Reg, Reg)| {
        let col = k.mov(RegClass::B32, &first);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &col, &end);
        k.bra(Some((past, true)), &done);
        let i = k.add_u32(&base, &col);
        let a = k.address(logits, &i, elem.bytes());
        let x = k.ld_global(elem, a);
        let key = ordered_key(k, x);
        let kept = k.setp("ge.u32", &key, &t);
        let w = weight(k, x, m, temperature);
        let w = k.selp(RegClass::B32, "u32", &w, &0u32, kept);
        let wide = k.op1("cvt.u64.u32", RegClass::B64, &w);
        body(k, col, wide);
        k.emit(format!("add.u32 {col}, {col}, 1"));
        k.bra(None, &top);
        k.place(&done);
    };
    let mine = k.mov(RegClass::B64, &0u64);
    walk(&mut k, "chunk_mass", &mut |k, _, w| {
        k.emit(format!("add.u64 {mine}, {mine}, {w}"));
    });
    let pbase = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {pbase}, {prefix}"));
    let slot = k.mad_u32(&tid, &8u32, &pbase);
    k.emit(format!("st.shared.u64 [{slot}], {mine}"));
    k.barrier();
    let leader = k.setp("eq.u32", &tid, &0u32);
    let no_scan = k.label("no_scan");
    k.bra(Some((leader, false)), &no_scan);
    let running = k.mov(RegClass::B64, &0u64);
    for t_i in 0..ROW_THREADS {
        let v = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {v}, [{pbase}+{}]", t_i * 8));
        k.emit(format!("st.shared.u64 [{pbase}+{}], {running}", t_i * 8));
        k.emit(format!("add.u64 {running}, {running}, {v}"));
    }
    k.place(&no_scan);
    k.barrier();
    let before = k.reg(RegClass::B64);
    k.emit(format!("ld.shared.u64 {before}, [{slot}]"));
    k.comment("the target: floor(word * z / 2^32)");
    let wide_word = k.op1("cvt.u64.u32", RegClass::B64, &word);
    let hi = k.op2("mul.hi.u64", RegClass::B64, &wide_word, &z);
    let lo = k.op2("mul.lo.u64", RegClass::B64, &wide_word, &z);
    let hi = k.op2("shl.b64", RegClass::B64, &hi, &32u32);
    let lo = k.op2("shr.u64", RegClass::B64, &lo, &32u32);
    let target = k.op2("or.b64", RegClass::B64, &hi, &lo);
    k.comment("the thread whose chunk holds the target walks it");
    let choice = k.mov(RegClass::B32, &u32::MAX);
    let after = k.op2("add.u64", RegClass::B64, &before, &mine);
    let starts_before = k.setp("le.u64", &before, &target);
    let ends_after = k.setp("gt.u64", &after, &target);
    let owner = k.reg(RegClass::Pred);
    k.emit(format!("and.pred {owner}, {starts_before}, {ends_after}"));
    let not_owner = k.label("not_owner");
    k.bra(Some((owner, false)), &not_owner);
    let acc = k.mov(RegClass::B64, &before);
    walk(&mut k, "find", &mut |k, col, w| {
        k.emit(format!("add.u64 {acc}, {acc}, {w}"));
        let crossed = k.setp("gt.u64", &acc, &target);
        let unset = k.setp("eq.u32", &choice, &u32::MAX);
        let take = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {take}, {crossed}, {unset}"));
        k.emit(format!("@{take} mov.u32 {choice}, {col}"));
    });
    k.place(&not_owner);
    let picked = block_reduce(&mut k, choice, "min.u32", RegClass::B32, &red, tid);
    let none = k.setp("eq.u32", &picked, &u32::MAX);
    let token = k.selp(RegClass::B32, "u32", &last_kept, &picked, none);
    store(&mut k, &token);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [rows, 1, 1],
            block: [ROW_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// Whether `mass * 2^32 >= p * total` (u64 operands, compared in 128 bits: high words, then low).
fn reaches(k: &mut Kernel, mass: Reg, p: Reg, total: Reg) -> Reg {
    let l_hi = k.op2("shr.u64", RegClass::B64, &mass, &32u32);
    let l_lo = k.op2("shl.b64", RegClass::B64, &mass, &32u32);
    let r_hi = k.op2("mul.hi.u64", RegClass::B64, &p, &total);
    let r_lo = k.op2("mul.lo.u64", RegClass::B64, &p, &total);
    let above = k.setp("gt.u64", &l_hi, &r_hi);
    let level = k.setp("eq.u64", &l_hi, &r_hi);
    let enough = k.setp("ge.u64", &l_lo, &r_lo);
    let out = k.reg(RegClass::Pred);
    k.emit(format!("and.pred {out}, {level}, {enough}"));
    k.emit(format!("or.pred {out}, {out}, {above}"));
    out
}

/// `kiln_ir::sampling::ordered_key`: an order-preserving u32 key of an f32 (larger floats get
/// larger keys), NaN 0.
fn ordered_key(k: &mut Kernel, x: Reg) -> Reg {
    let bits = k.reg(RegClass::B32);
    k.emit(format!("mov.b32 {bits}, {x}"));
    let negative = k.setp("lt.s32", &bits, &0i32);
    let flipped = k.op1("not.b32", RegClass::B32, &bits);
    let marked = k.op2("or.b32", RegClass::B32, &bits, &0x8000_0000u32);
    let key = k.selp(RegClass::B32, "b32", &flipped, &marked, negative);
    let nan = k.setp("nan.f32", &x, &x);
    k.selp(RegClass::B32, "b32", &0u32, &key, nan)
}

/// `kiln_ir::sampling::weight(x, m, t)` as a u32, in the same f32 operations (none contracted).
fn weight(k: &mut Kernel, x: Reg, m: Reg, t: Reg) -> Reg {
    use kiln_ir::sampling::{EXP2, SCALE};
    let d = k.op2("sub.rn.f32", RegClass::F32, &x, &m);
    let d = k.div_f32(&d, &t);
    let y = k.mul_f32(&d, &F32(std::f32::consts::LOG2_E));
    // y >= -SCALE is false for NaN, which weighs 0 like the far tail.
    let inside = k.setp("ge.f32", &y, &F32(-(SCALE as f32)));
    let n = k.op1("cvt.rmi.f32.f32", RegClass::F32, &y);
    let f = k.op2("sub.rn.f32", RegClass::F32, &y, &n);
    let mut p = k.mov(RegClass::F32, &F32(EXP2[0]));
    for c in &EXP2[1..] {
        p = k.fma_f32(&p, &f, &F32(*c));
    }
    // 2^(n + SCALE) from its exponent bits.
    let ni = k.op1("cvt.rzi.sat.s32.f32", RegClass::B32, &n);
    let e = k.add_u32(&ni, &((SCALE + 127) as u32));
    let e = k.op2("shl.b32", RegClass::B32, &e, &23u32);
    let scale = k.reg(RegClass::F32);
    k.emit(format!("mov.b32 {scale}, {e}"));
    let v = k.mul_f32(&p, &scale);
    let w = k.op1("cvt.rzi.sat.u32.f32", RegClass::B32, &v);
    k.selp(RegClass::B32, "u32", &w, &0u32, inside)
}
