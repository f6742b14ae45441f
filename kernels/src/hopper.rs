//! The PTX of Hopper's asynchronous machinery, for the sm_90a kernels: mbarriers with
//! transaction counts and phase parity, TMA tile copies (`cp.async.bulk.tensor`), wgmma
//! shared-memory descriptors and the warpgroup MMA itself, and warpgroup register reallocation.
//!
//! Shared-memory addresses are 32-bit registers (`.shared::cta` window); tensor maps are the
//! generic addresses [`Kernel::param_tensor_map`] returns.

use crate::ptx::{Elem, Kernel, Operand, Reg, RegClass};

/// Bytes of one mbarrier.
pub const MBARRIER_BYTES: u32 = 8;

/// The 128-byte swizzle span: a K-major tile row of 64 halves, and the unit TMA and wgmma agree
/// on (8 rows of it, 1024 bytes, repeat the swizzle pattern).
pub const SWIZZLE_BYTES: u32 = 128;

/// Shared memory a block may take on an H100 / H200 (227 KB), static and dynamic together.
pub const MAX_SHARED: u32 = 227 * 1024;

/// `mbarrier.init` of the barrier at `bar` for `count` arrivals.
pub fn mbarrier_init(k: &mut Kernel, bar: &dyn Operand, count: u32) {
    k.emit(format!(
        "mbarrier.init.shared::cta.b64 [{}], {count}",
        bar.text()
    ));
}

/// Makes barrier initialisation visible to the other threads and to the asynchronous proxy (TMA
/// completing transactions); a `bar.sync` must follow before any use.
pub fn mbarrier_init_fence(k: &mut Kernel) {
    k.emit("fence.mbarrier_init.release.cluster");
    k.emit("fence.proxy.async.shared::cta");
}

/// One arrival on `bar`, by the threads where `when` holds (all with `None`).
pub fn mbarrier_arrive(k: &mut Kernel, bar: &dyn Operand, when: Option<Reg>) {
    k.emit(format!(
        "{}mbarrier.arrive.shared::cta.b64 _, [{}]",
        guard(when.as_ref()),
        bar.text()
    ));
}

/// One arrival on `bar` that also expects `bytes` of asynchronous copies to complete on it.
pub fn mbarrier_arrive_expect_tx(k: &mut Kernel, bar: &dyn Operand, bytes: u32) {
    mbarrier_arrive_expect_tx_when(k, None, bar, bytes);
}

/// [`mbarrier_arrive_expect_tx`] by the threads where `when` holds (all with `None`).
pub fn mbarrier_arrive_expect_tx_when(
    k: &mut Kernel,
    when: Option<&Reg>,
    bar: &dyn Operand,
    bytes: u32,
) {
    k.emit(format!(
        "{}mbarrier.arrive.expect_tx.shared::cta.b64 _, [{}], {bytes}",
        guard(when),
        bar.text()
    ));
}

/// The guard prefix of an instruction run where `when` holds.
fn guard(when: Option<&Reg>) -> String {
    when.map(|p| format!("@{p} ")).unwrap_or_default()
}

/// One arrival, by the threads where `when` holds, on the barrier at `bar`'s offset in the
/// shared memory of the cluster's block `rank` (this block's own included).
pub fn mbarrier_arrive_in(k: &mut Kernel, bar: &Reg, rank: u32, when: &Reg) {
    let remote = k.reg(RegClass::B32);
    k.emit(format!("mapa.shared::cluster.u32 {remote}, {bar}, {rank}"));
    k.emit(format!(
        "@{when} mbarrier.arrive.shared::cluster.b64 _, [{remote}]"
    ));
}

/// Waits until every thread of every block of the cluster that has not exited arrived here:
/// after barrier initialisation ([`mbarrier_init_fence`]), before any block's copies or
/// arrivals reach another's.
pub fn cluster_sync(k: &mut Kernel) {
    k.emit("barrier.cluster.arrive.release");
    k.emit("barrier.cluster.wait.acquire");
}

/// Waits until the phase of `bar` with parity `parity` (0 or 1) has completed.
pub fn mbarrier_wait(k: &mut Kernel, bar: &dyn Operand, parity: &dyn Operand) {
    let again = k.label("mbarrier_wait");
    let done = k.reg(RegClass::Pred);
    k.place(&again);
    k.emit(format!(
        "mbarrier.try_wait.parity.shared::cta.b64 {done}, [{}], {}",
        bar.text(),
        parity.text()
    ));
    k.bra(Some((done, false)), &again);
}

/// Waits, where the `used`-th use of a ring of `stages` buffers (counted from 0) refills one
/// (from the ring's second round on), until the buffer's readers have released it: the phase of
/// `empty` before the use's round's `parity`. `what` names the label of the first round's way
/// past the wait.
pub fn wait_released(
    k: &mut Kernel,
    (used, stages): (&Reg, u32),
    (empty, parity): (&Reg, &Reg),
    what: &str,
) {
    let refill = k.setp("ge.u32", used, &stages);
    let fresh = k.label(what);
    k.bra(Some((refill, false)), &fresh);
    let released = k.op2("xor.b32", RegClass::B32, parity, &1u32);
    mbarrier_wait(k, empty, &released);
    k.place(&fresh);
}

/// Prefetches the tensor map at generic address `map` into the TMA unit's descriptor cache.
pub fn prefetch_tensor_map(k: &mut Kernel, map: &Reg) {
    k.emit(format!("prefetch.tensormap [{map}]"));
}

/// Copies the box at `coords` (innermost first; missing outer ones are 0) of the tensor `map`
/// describes (4 dimensions, [`crate::TensorMapSpec`]) to shared memory at `dst`, completing
/// `bar`'s transaction bytes; elements outside the tensor arrive as zeros.
pub fn tma_load(
    k: &mut Kernel,
    dst: &dyn Operand,
    map: &Reg,
    coords: &[&dyn Operand],
    bar: &dyn Operand,
) {
    tma_load_when(k, None, dst, map, coords, bar);
}

/// [`tma_load`] by the threads where `when` holds (all with `None`).
pub fn tma_load_when(
    k: &mut Kernel,
    when: Option<&Reg>,
    dst: &dyn Operand,
    map: &Reg,
    coords: &[&dyn Operand],
    bar: &dyn Operand,
) {
    tma_load_to(k, when, (dst, bar), map, coords, None);
}

/// [`tma_load_when`]; with `multicast`, into the same shared-memory offset `dst` of every
/// block of the cluster whose rank is set in it, completing bytes on the barrier at `bar`'s
/// offset in each.
pub fn tma_load_to(
    k: &mut Kernel,
    when: Option<&Reg>,
    (dst, bar): (&dyn Operand, &dyn Operand),
    map: &Reg,
    coords: &[&dyn Operand],
    multicast: Option<u16>,
) {
    let mut c: Vec<String> = coords.iter().map(|c| c.text()).collect();
    c.resize(4, "0".into());
    let (qualifier, ctas) = match multicast {
        Some(ctas) => (".multicast::cluster", format!(", {ctas}")),
        None => ("", String::new()),
    };
    k.emit(format!(
        "{}cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes{qualifier} [{}], [{map}, {{{}}}], [{}]{ctas}",
        guard(when),
        dst.text(),
        c.join(", "),
        bar.text()
    ));
}

/// Copies the box at `coords` of the tensor `map` describes from shared memory at `src` (laid
/// out as [`tma_load`] writes it) to global memory, in the thread's current bulk group; elements
/// outside the tensor are not written. The shared-memory writes it reads must be ordered before
/// it ([`fence_proxy_async`] by each writer, then a barrier).
pub fn tma_store(k: &mut Kernel, map: &Reg, coords: &[&dyn Operand], src: &dyn Operand) {
    let mut c: Vec<String> = coords.iter().map(|c| c.text()).collect();
    c.resize(4, "0".into());
    k.emit(format!(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [{map}, {{{}}}], [{}]",
        c.join(", "),
        src.text()
    ));
}

/// Closes the bulk copies this thread issued since the last commit into one group.
pub fn bulk_commit(k: &mut Kernel) {
    k.emit("cp.async.bulk.commit_group");
}

/// Waits until at most `pending` of this thread's bulk groups are still reading shared memory
/// (`read`), or still running at all.
pub fn bulk_wait(k: &mut Kernel, pending: u32, read: bool) {
    bulk_wait_when(k, None, pending, read);
}

/// [`bulk_wait`] by the threads where `when` holds (all with `None`).
pub fn bulk_wait_when(k: &mut Kernel, when: Option<&Reg>, pending: u32, read: bool) {
    let read = if read { ".read" } else { "" };
    k.emit(format!(
        "{}cp.async.bulk.wait_group{read} {pending}",
        guard(when)
    ));
}

/// Orders this thread's earlier shared-memory writes before later asynchronous-proxy accesses
/// (TMA stores reading them).
pub fn fence_proxy_async(k: &mut Kernel) {
    k.emit("fence.proxy.async.shared::cta");
}

/// `stmatrix` of four 8 x 8 matrices of halves: register `i` of each thread holds its two
/// halves of row `lane / 4` of matrix `i`, and lane `8 i + r` gives the shared address of row `r`
/// of matrix `i`.
pub fn stmatrix_x4(k: &mut Kernel, addr: &Reg, words: [Reg; 4]) {
    k.emit(format!(
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [{addr}], {{{}, {}, {}, {}}}",
        words[0], words[1], words[2], words[3]
    ));
}

/// The wgmma descriptor of a tile at shared address `addr` laid out as TMA writes boxes with
/// 128-byte swizzle (1024-byte aligned groups of 8 rows of [`SWIZZLE_BYTES`]): layout "128-byte
/// swizzle", `leading` and `stride` byte offsets. For a K-major operand (K contiguous) the
/// leading offset is unused and the stride is 1024 (8 rows); adding `n` to the descriptor moves
/// its start `16 n` bytes along K. For an MN-major one (N contiguous, [`WgmmaB::transposed`]) the
/// leading offset is the distance between 64-element column blocks and the stride 1024 (8 rows
/// of K).
pub fn wgmma_descriptor(k: &mut Kernel, addr: &Reg, leading: u32, stride: u32) -> Reg {
    let fixed: u64 =
        (1 << 62) | ((u64::from(stride) >> 4) << 32) | (u64::from(leading.max(16)) >> 4) << 16;
    let wide = k.reg(RegClass::B64);
    k.emit(format!("cvt.u64.u32 {wide}, {addr}"));
    let start = k.op2("shr.u64", RegClass::B64, &wide, &4u32);
    let start = k.op2("and.b64", RegClass::B64, &start, &0x3FFFu64);
    k.op2("or.b64", RegClass::B64, &start, &fixed)
}

/// The A operand of a wgmma: a shared-memory descriptor (K-major), or four registers per thread
/// holding the 64 x 16 tile in the `mma.sync` A-fragment layout of each warp's 16 rows.
pub enum WgmmaA<'a> {
    /// From shared memory.
    Shared(&'a Reg),
    /// From registers (f16x2 / bf16x2).
    Registers(&'a [Reg]),
}

/// The B operand of a wgmma: a shared-memory descriptor, K-major unless `transposed`.
pub struct WgmmaB<'a> {
    /// The descriptor.
    pub desc: &'a Reg,
    /// N is the contiguous dimension (MN-major).
    pub transposed: bool,
}

/// `wgmma.fence`: orders register accesses to the accumulators before the next wgmma.
pub fn wgmma_fence(k: &mut Kernel) {
    k.emit("wgmma.fence.sync.aligned");
}

/// Closes the wgmma operations issued since the last commit into one group.
pub fn wgmma_commit(k: &mut Kernel) {
    k.emit("wgmma.commit_group.sync.aligned");
}

/// Waits until at most `pending` committed wgmma groups are still running.
pub fn wgmma_wait(k: &mut Kernel, pending: u32) {
    k.emit(format!("wgmma.wait_group.sync.aligned {pending}"));
}

/// `acc (+)= A B` for one k16 step of a warpgroup: A 64 x 16, B 16 x `n` (`n / 2` f32
/// accumulators per thread in `acc`); `accumulate: false` overwrites `acc`.
pub fn wgmma(k: &mut Kernel, elem: Elem, acc: &[Reg], a: WgmmaA, b: WgmmaB, accumulate: bool) {
    let n = acc.len() * 2;
    let ty = elem.name();
    let list = |regs: &[Reg]| {
        regs.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let scale_d = u32::from(accumulate);
    let trans_b = u32::from(b.transposed);
    let a = match a {
        WgmmaA::Shared(desc) => format!("{desc}"),
        WgmmaA::Registers(regs) => format!("{{{}}}", list(regs)),
    };
    let trans_a = if a.starts_with('{') { "" } else { "0, " };
    k.emit(format!(
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{}}}, {a}, {}, {scale_d}, 1, 1, {trans_a}{trans_b}",
        list(acc),
        b.desc
    ));
}

/// `v`, which every lane of the warp holds alike, through a warp reduction (the maximum of equal
/// values) so that ptxas knows it warp-uniform: branches on values it cannot prove uniform are
/// divergent paths to it, and a wgmma whose registers live across one is serialized (C7520).
/// Every lane of the warp must run it.
pub fn warp_uniform(k: &mut Kernel, v: &Reg) -> Reg {
    let r = k.reg(RegClass::B32);
    k.emit(format!("redux.sync.max.u32 {r}, {v}, -1"));
    r
}

/// A thread's place in its warpgroup: its index there (0..128), lane and warp (0..4).
pub struct WarpgroupThread {
    pub thread: Reg,
    pub lane: Reg,
    pub warp: Reg,
}

impl WarpgroupThread {
    /// The place of the thread `tid` of the block.
    pub fn of(k: &mut Kernel, tid: &Reg) -> WarpgroupThread {
        let thread = k.op2("and.b32", RegClass::B32, tid, &127u32);
        let lane = k.op2("and.b32", RegClass::B32, tid, &31u32);
        let warp = k.op2("shr.u32", RegClass::B32, &thread, &5u32);
        WarpgroupThread { thread, lane, warp }
    }
}

/// The address of the dynamic shared memory `name` rounded up to 1024 bytes, the 128-byte
/// swizzle's alignment (a launch asks for 1 KB more than its tiles take).
pub fn aligned_base(k: &mut Kernel, name: &str) -> Reg {
    let raw = k.shared_base(name);
    let padded = k.add_u32(&raw, &1023u32);
    k.op2("and.b32", RegClass::B32, &padded, &!1023u32)
}

/// A thread's registers at launch in a block of `threads` (its `.maxntid`): ptxas shares the
/// SM's 64K out over the block in multiples of 8. `setmaxnreg` only moves these between
/// warpgroups: a request for more than the others gave up waits forever.
pub const fn launch_regs(threads: u32) -> u32 {
    65536 / threads / 8 * 8
}

/// Raises (`grow`) or lowers this warpgroup's register budget to `count` per thread.
pub fn setmaxnreg(k: &mut Kernel, grow: bool, count: u32) {
    let dir = if grow { "inc" } else { "dec" };
    k.emit(format!("setmaxnreg.{dir}.sync.aligned.u32 {count}"));
}

/// Runs `body` for each of `count` work items this block takes on a persistent grid (`ctaid.x`,
/// then every `nctaid.x`-th), with the item's index; `what` names the loop's labels.
pub fn for_each_block_item(
    k: &mut Kernel,
    what: &str,
    count: u32,
    mut body: impl FnMut(&mut Kernel, &Reg),
) {
    let item = k.special("ctaid.x");
    let step = k.special("nctaid.x");
    let top = k.label(what);
    let done = k.label(&format!("{what}s_done"));
    k.place(&top);
    let past = k.setp("ge.u32", &item, &count);
    k.bra(Some((past, true)), &done);
    body(k, &item);
    k.emit(format!("add.u32 {item}, {item}, {step}"));
    k.bra(None, &top);
    k.place(&done);
}
