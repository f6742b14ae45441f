//! Block-wide reductions for kernels that give one row to one block of `ROW_THREADS` threads.

use crate::ptx::{Kernel, Reg, RegClass};
use crate::ROW_THREADS;

/// Warps per row block.
pub const WARPS: u32 = ROW_THREADS / 32;

/// Declares the `[WARPS]` f32 scratch array a block sum needs.
pub fn scratch(k: &mut Kernel) -> String {
    k.shared("red", WARPS * 4)
}

/// Sums `value` over the block: every thread gets the total. `scratch` is the array from
/// [`scratch`]; `tid` the thread index. Ends with a barrier, so the scratch can be reused.
pub fn block_sum(k: &mut Kernel, value: Reg, scratch: &str, tid: Reg) -> Reg {
    block_reduce(k, value, "add.f32", RegClass::F32, scratch, tid)
}

/// Reduces `value` over the block with the binary op `op` (`max.f32`, `max.u32`, `add.f32`, ...)
/// whose registers are of `class`; every thread gets the result. Ends with a barrier.
pub fn block_reduce(
    k: &mut Kernel,
    value: Reg,
    op: &str,
    class: RegClass,
    scratch: &str,
    tid: Reg,
) -> Reg {
    let mut acc = value;
    for offset in [16u32, 8, 4, 2, 1] {
        let other = k.reg(class);
        k.emit(format!(
            "shfl.sync.bfly.b32 {other}, {acc}, {offset}, 31, -1"
        ));
        acc = k.op2(op, class, &acc, &other);
    }
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let is_first = k.setp("eq.u32", &lane, &0u32);
    let base = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {base}, {scratch}"));
    let slot = k.mad_u32(&warp, &4u32, &base);
    k.emit(format!("@{is_first} st.shared.b32 [{slot}], {acc}"));
    k.barrier();
    let total = k.reg(class);
    k.emit(format!("ld.shared.b32 {total}, [{base}]"));
    for w in 1..WARPS {
        let v = k.reg(class);
        k.emit(format!("ld.shared.b32 {v}, [{base}+{}]", w * 4));
        k.emit(format!("{op} {total}, {total}, {v}"));
    }
    k.barrier();
    total
}

/// Declares the `[WARPS]` u64 scratch array [`block_sum_u64`] needs.
pub fn scratch_u64(k: &mut Kernel) -> String {
    k.shared("red64", WARPS * 8)
}

/// Sums the u64 `value` over the block (exactly: integer sums do not depend on their order);
/// every thread gets the total. `scratch` is the array from [`scratch_u64`]. Ends with a
/// barrier.
pub fn block_sum_u64(k: &mut Kernel, value: Reg, scratch: &str, tid: Reg) -> Reg {
    let mut acc = value;
    for offset in [16u32, 8, 4, 2, 1] {
        let (lo, hi) = (k.reg(RegClass::B32), k.reg(RegClass::B32));
        k.emit(format!("mov.b64 {{{lo}, {hi}}}, {acc}"));
        k.emit(format!("shfl.sync.bfly.b32 {lo}, {lo}, {offset}, 31, -1"));
        k.emit(format!("shfl.sync.bfly.b32 {hi}, {hi}, {offset}, 31, -1"));
        let other = k.reg(RegClass::B64);
        k.emit(format!("mov.b64 {other}, {{{lo}, {hi}}}"));
        acc = k.op2("add.u64", RegClass::B64, &acc, &other);
    }
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let is_first = k.setp("eq.u32", &lane, &0u32);
    let base = k.reg(RegClass::B32);
    k.emit(format!("mov.u32 {base}, {scratch}"));
    let slot = k.mad_u32(&warp, &8u32, &base);
    k.emit(format!("@{is_first} st.shared.u64 [{slot}], {acc}"));
    k.barrier();
    let total = k.reg(RegClass::B64);
    k.emit(format!("ld.shared.u64 {total}, [{base}]"));
    for w in 1..WARPS {
        let v = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {v}, [{base}+{}]", w * 8));
        k.emit(format!("add.u64 {total}, {total}, {v}"));
    }
    k.barrier();
    total
}
