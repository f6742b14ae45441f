//! Greedy token choice: the index of the largest logit of each row (the first one on ties), as
//! i64. One block per row; each thread scans a strided slice, then a butterfly over the warp and a
//! pass over the warps' winners.

use crate::ptx::{Elem, Kernel, RegClass, F32};
use crate::reduce::WARPS;
use crate::{GeneratedKernel, Launch, ROW_THREADS};

/// Generates `out[row] = argmax(logits[row, :])`. Parameters: `logits, out`.
pub fn argmax(elem: Elem, rows: u32, vocab: u32) -> GeneratedKernel {
    let name = format!("argmax_{}_v{vocab}", elem.name());
    let mut k = Kernel::new(&name);
    let logits = k.param_ptr("logits");
    let out = k.param_ptr("out");
    let vals = k.shared("best_val", WARPS * 4);
    let idxs = k.shared("best_idx", WARPS * 4);
    let tid = k.special("tid.x");
    let row = k.special("ctaid.x");
    let base = k.mul_u32(&row, &vocab);
    let best = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
    let best_i = k.mov(RegClass::B32, &u32::MAX);
    let col = k.mov(RegClass::B32, &tid);
    let top = k.label("scan");
    let done = k.label("scan_done");
    k.place(&top);
    let past = k.setp("ge.u32", &col, &vocab);
    k.bra(Some((past, true)), &done);
    let i = k.add_u32(&base, &col);
    let a = k.address(logits, &i, elem.bytes());
    let v = k.ld_global(elem, a);
    // Strictly greater (or the first value seen, so a row of NaN/-inf still picks an index).
    let greater = k.setp("gt.f32", &v, &best);
    let unset = k.setp("eq.u32", &best_i, &u32::MAX);
    let take = k.reg(RegClass::Pred);
    k.emit(format!("or.pred {take}, {greater}, {unset}"));
    k.emit(format!("@{take} mov.f32 {best}, {v}"));
    k.emit(format!("@{take} mov.u32 {best_i}, {col}"));
    k.emit(format!("add.u32 {col}, {col}, {ROW_THREADS}"));
    k.bra(None, &top);
    k.place(&done);
    // Combine (value, index) pairs: larger value wins, the smaller index on ties.
    let combine = |k: &mut Kernel, other_v, other_i| {
        let gt = k.setp("gt.f32", &other_v, &best);
        let eq = k.setp("eq.f32", &other_v, &best);
        let lower = k.setp("lt.u32", &other_i, &best_i);
        let tie = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {tie}, {eq}, {lower}"));
        let unset = k.setp("eq.u32", &best_i, &u32::MAX);
        let valid = k.setp("ne.u32", &other_i, &u32::MAX);
        let take = k.reg(RegClass::Pred);
        k.emit(format!("or.pred {take}, {gt}, {tie}"));
        k.emit(format!("or.pred {take}, {take}, {unset}"));
        k.emit(format!("and.pred {take}, {take}, {valid}"));
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
    for w in 1..WARPS {
        let ov = k.reg(RegClass::F32);
        let oi = k.reg(RegClass::B32);
        k.emit(format!("ld.shared.f32 {ov}, [{vbase}+{}]", w * 4));
        k.emit(format!("ld.shared.u32 {oi}, [{ibase}+{}]", w * 4));
        combine(&mut k, ov, oi);
    }
    let wide = k.op1("cvt.u64.u32", RegClass::B64, &best_i);
    let oa = k.address(out, &row, 8);
    k.emit(format!("st.global.u64 [{oa}], {wide}"));
    k.place(&end);
    let signature = k.params().to_vec();
    GeneratedKernel {
        name,
        ptx: k.finish(),
        signature,
        launch: Launch {
            grid: [rows, 1, 1],
            block: [ROW_THREADS, 1, 1],
            shared_bytes: 0,
        },
    }
}
