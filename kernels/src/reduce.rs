//! Block-wide and warp-wide reductions for kernels that give one row to one block of
//! `ROW_THREADS` threads, or to one warp.

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
    block_reduce_over(k, [value, tid], op, class, scratch, WARPS)
}

/// [`block_reduce`] for a block of `warps` warps (`scratch` holds `warps` 32-bit slots).
pub fn block_reduce_over(
    k: &mut Kernel,
    [value, tid]: [Reg; 2],
    op: &str,
    class: RegClass,
    scratch: &str,
    warps: u32,
) -> Reg {
    let acc = k.warp_reduce(value, op, class);
    let (base, slot, is_first) = warp_slot(k, scratch, tid, 4);
    k.emit(format!("@{is_first} st.shared.b32 [{slot}], {acc}"));
    k.barrier();
    let total = k.reg(class);
    k.emit(format!("ld.shared.b32 {total}, [{base}]"));
    for w in 1..warps {
        let v = k.reg(class);
        k.emit(format!("ld.shared.b32 {v}, [{base}+{}]", w * 4));
        k.emit(format!("{op} {total}, {total}, {v}"));
    }
    k.barrier();
    total
}

/// Declares a `[warps]` u64 scratch array for [`block_sum_u64`] and [`block_scan_u64`].
pub fn scratch_u64(k: &mut Kernel, warps: u32) -> String {
    k.shared("red64", warps * 8)
}

/// The u64 `value` of lane `lane ^ offset` (`bfly`), `lane + offset` (`down`), `lane - offset`
/// (`up`) or `offset` (`idx`); a lane past the warp's ends gets its own value.
pub fn shfl_u64(k: &mut Kernel, mode: &str, value: Reg, offset: u32) -> Reg {
    let clamp = if mode == "up" { 0 } else { 31 };
    let (lo, hi) = (k.reg(RegClass::B32), k.reg(RegClass::B32));
    k.emit(format!("mov.b64 {{{lo}, {hi}}}, {value}"));
    k.emit(format!(
        "shfl.sync.{mode}.b32 {lo}, {lo}, {offset}, {clamp}, -1"
    ));
    k.emit(format!(
        "shfl.sync.{mode}.b32 {hi}, {hi}, {offset}, {clamp}, -1"
    ));
    let other = k.reg(RegClass::B64);
    k.emit(format!("mov.b64 {other}, {{{lo}, {hi}}}"));
    other
}

/// Sums the u64 `value` over a block of `warps` warps (exactly: integer sums do not depend on
/// their order); every thread gets the total. `scratch` is from [`scratch_u64`]. Ends with a
/// barrier.
pub fn block_sum_u64(k: &mut Kernel, [value, tid]: [Reg; 2], scratch: &str, warps: u32) -> Reg {
    let mut acc = value;
    for offset in [16u32, 8, 4, 2, 1] {
        let other = shfl_u64(k, "bfly", acc, offset);
        acc = k.op2("add.u64", RegClass::B64, &acc, &other);
    }
    let (base, slot, is_first) = warp_slot(k, scratch, tid, 8);
    k.emit(format!("@{is_first} st.shared.u64 [{slot}], {acc}"));
    k.barrier();
    let total = k.reg(RegClass::B64);
    k.emit(format!("ld.shared.u64 {total}, [{base}]"));
    for w in 1..warps {
        let v = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {v}, [{base}+{}]", w * 8));
        k.emit(format!("add.u64 {total}, {total}, {v}"));
    }
    k.barrier();
    total
}

/// The inclusive sum of the u64 `value` over lanes `0..=lane` of the warp.
pub fn warp_scan_u64(k: &mut Kernel, value: Reg, lane: Reg) -> Reg {
    let acc = k.mov(RegClass::B64, &value);
    for offset in [1u32, 2, 4, 8, 16] {
        let other = shfl_u64(k, "up", acc, offset);
        let has = k.setp("ge.u32", &lane, &offset);
        k.emit(format!("@{has} add.u64 {acc}, {acc}, {other}"));
    }
    acc
}

/// The exclusive sum of the u64 `value` over threads `0..tid` of a block of `warps` warps, in
/// thread order. `scratch` is from [`scratch_u64`]. Ends with a barrier.
pub fn block_scan_u64(k: &mut Kernel, [value, tid]: [Reg; 2], scratch: &str, warps: u32) -> Reg {
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let inclusive = warp_scan_u64(k, value, lane);
    let (base, slot, _) = warp_slot(k, scratch, tid, 8);
    let last = k.setp("eq.u32", &lane, &31u32);
    k.emit(format!("@{last} st.shared.u64 [{slot}], {inclusive}"));
    k.barrier();
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let before = k.op2("sub.u64", RegClass::B64, &inclusive, &value);
    for w in 0..warps - 1 {
        let v = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {v}, [{base}+{}]", w * 8));
        let earlier = k.setp("gt.u32", &warp, &w);
        k.emit(format!("@{earlier} add.u64 {before}, {before}, {v}"));
    }
    k.barrier();
    before
}

/// The scratch's base, this warp's slot of `bytes` in it, and whether this thread is lane 0.
fn warp_slot(k: &mut Kernel, scratch: &str, tid: Reg, bytes: u32) -> (Reg, Reg, Reg) {
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let is_first = k.setp("eq.u32", &lane, &0u32);
    let base = k.shared_base(scratch);
    let slot = k.mad_u32(&warp, &bytes, &base);
    (base, slot, is_first)
}

/// Counts this block done on the u32 counter at `counter` and returns, in every thread taking
/// part, whether it was the last of `total` blocks to be; the last sets the counter back to 0.
/// `leader` (a predicate true in one thread) counts between two executions of `barrier` (the
/// `bar.sync` of the threads taking part), and hands the answer on through the shared u32 at
/// `[flag]`. The fences make every block's stores before the call visible to the last block's
/// loads after it.
pub fn last_arrival(
    k: &mut Kernel,
    [counter, leader]: [Reg; 2],
    total: &dyn crate::ptx::Operand,
    barrier: &str,
    flag: &str,
) -> Reg {
    k.emit("fence.acq_rel.gpu");
    k.emit(barrier);
    let counted = k.label("counted");
    k.bra(Some((leader, false)), &counted);
    let before = k.reg(RegClass::B32);
    k.emit(format!(
        "atom.acq_rel.gpu.global.add.u32 {before}, [{counter}], 1"
    ));
    let last_one = k.sub_u32(total, &1u32);
    let last = k.setp("eq.u32", &before, &last_one);
    let is_last = k.selp(RegClass::B32, "u32", &1u32, &0u32, last);
    k.emit(format!("st.shared.u32 [{flag}], {is_last}"));
    k.emit(format!("@{last} st.global.u32 [{counter}], 0"));
    k.place(&counted);
    k.emit(barrier);
    let seen = k.reg(RegClass::B32);
    k.emit(format!("ld.shared.u32 {seen}, [{flag}]"));
    let last = k.setp("ne.u32", &seen, &0u32);
    k.emit("fence.acq_rel.gpu");
    last
}

/// Bytes between a thread's consecutive values in a warpgroup's partials, its 128 threads side
/// by side ([`store_side_by_side`]).
pub const SIDE_BY_SIDE: u32 = 128 * 4;

/// Stores `values` from this thread's `at` on, register by register, a warpgroup's 128 threads
/// side by side (a split product's or a split attention item's partials).
pub fn store_side_by_side(k: &mut Kernel, at: &Reg, values: &[Reg]) {
    for (i, v) in (0u32..).zip(values) {
        k.emit(format!("st.global.f32 [{at}+{}], {v}", i * SIDE_BY_SIDE));
    }
}

/// Value `i` of what [`store_side_by_side`] stored from `at` (another block's: read past L1).
pub fn load_side_by_side(k: &mut Kernel, at: &Reg, i: u32) -> Reg {
    let v = k.reg(RegClass::F32);
    k.emit(format!("ld.global.cg.f32 {v}, [{at}+{}]", i * SIDE_BY_SIDE));
    v
}
