//! Decode attention over a KV cache (one query row per sequence, f16/bf16): one warp per (key
//! range, K/V head, sequence) serves the head's whole query group from one read of its K/V
//! rows. The lanes hold contiguous elements of the head dimension (one 4- or 8-byte load per row
//! and lane), each key's scores for the group's heads are reduced across the warp side by side,
//! and [`KEY_UNROLL`] keys' rows are loaded before the first is used. With several key ranges
//! (`splits`, flash-decoding) each warp writes its heads' partial results, which
//! `attention::attention_combine` merges, exactly as for the SIMT kernel: the same
//! `partial_acc` / `partial_ml` layout, running maxima in base 2.
//!
//! Where the SIMT kernel (`crate::attention`) gives each query head its own warp, a K/V head
//! with a group of 4 (Llama's 32 heads over 8) is read 4 times; here it is read once.

use crate::attention::{
    online_softmax_step, rotated_element, share_of_keys, window_range, AttentionConfig, KeyRule,
};
use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
use crate::{GeneratedKernel, KernelPath, Launch};

/// Key ranges (warps) per block.
const WARPS: u32 = 4;
/// Keys whose K/V rows a warp loads before it uses the first of them.
const KEY_UNROLL: u32 = 4;
/// The largest query group one warp serves (its accumulators are registers).
const MAX_GROUP: u32 = 8;

/// Whether `cfg` is a decode step this kernel serves: one query row over a cache (position
/// keys, RoPE on q only), no padding mask or dropout, f16/bf16, a head dimension of 64 or 128
/// (2 or 4 elements per lane), a query group of at most [`MAX_GROUP`], and strides that keep
/// each lane's elements aligned.
pub fn supports(cfg: &AttentionConfig) -> bool {
    matches!(cfg.keys, KeyRule::Position { .. })
        && cfg.q_len == 1
        && !cfg.padding
        && !cfg.rope_k
        && cfg.dropout.is_none()
        && cfg.elem != Elem::F32
        && matches!(cfg.head_dim, 64 | 128)
        && cfg.heads.is_multiple_of(cfg.kv_heads)
        && cfg.heads / cfg.kv_heads <= MAX_GROUP
        && cfg.strides.iter().all(|s| s.iter().all(|v| v % 8 == 0))
}

/// Generates the kernel. Parameters: `q, k, v, out` (or `partial_acc, partial_ml` with
/// several key ranges), `positions, [cos, sin]`, as the SIMT kernel names them.
pub fn attention_decode(cfg: &AttentionConfig, name: String) -> GeneratedKernel {
    assert!(supports(cfg), "not a decode step this kernel serves");
    let mut k = Kernel::new(&name);
    let params = Params::declare(&mut k, cfg);
    let tid = k.special("tid.x");
    let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
    let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
    let bx = k.special("ctaid.x");
    let split = k.mad_u32(&bx, &WARPS, &warp);
    let kvh = k.special("ctaid.y");
    let b = k.special("ctaid.z");
    let exit = k.label("exit");
    let past = k.setp("ge.u32", &split, &cfg.splits);
    k.bra(Some((past, true)), &exit);

    let per_lane = cfg.head_dim / 32;
    let first = k.mul_u32(&lane, &per_lane);
    let pa = k.address(params.positions, &b, 8);
    let wide = k.ld_global_i64(pa);
    let pos = k.op1("cvt.u32.u64", RegClass::B32, &wide);
    let group = cfg.heads / cfg.kv_heads;
    let heads: Vec<Reg> = (0..group).map(|g| k.mad_u32(&kvh, &group, &g)).collect();
    k.comment("q of each head of the group, rotated and pre-scaled by scale * log2(e)");
    let qs: Vec<Vec<Reg>> = heads
        .iter()
        .map(|h| load_q(&mut k, cfg, &params, [b, *h, first, pos]))
        .collect();
    let (from, to) = key_range(&mut k, cfg, pos, split);
    let state = State::new(&mut k, group, per_lane);
    key_loop(&mut k, cfg, &params, &qs, &state, [b, kvh, first, from, to]);
    store(
        &mut k,
        cfg,
        &params,
        &state,
        &heads,
        [b, split, lane, first],
    );
    k.place(&exit);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.splits.div_ceil(WARPS), cfg.kv_heads, cfg.batch],
            block: [32 * WARPS, 1, 1],
            shared_bytes: 0,
        },
    )
    .on(KernelPath::Simt)
}

/// The kernel's pointer parameters.
struct Params {
    q: Reg,
    k: Reg,
    v: Reg,
    /// `out`, or `partial_acc` with several key ranges.
    out: Reg,
    partial_ml: Option<Reg>,
    positions: Reg,
    tables: Option<(Reg, Reg)>,
}

impl Params {
    fn declare(k: &mut Kernel, cfg: &AttentionConfig) -> Params {
        let q = k.param_ptr("q");
        let kp = k.param_ptr("k");
        let v = k.param_ptr("v");
        let (out, partial_ml) = if cfg.splits > 1 {
            (k.param_ptr("partial_acc"), Some(k.param_ptr("partial_ml")))
        } else {
            (k.param_ptr("out"), None)
        };
        let positions = k.param_ptr("positions");
        let tables = cfg.rope.then(|| (k.param_ptr("cos"), k.param_ptr("sin")));
        Params {
            q,
            k: kp,
            v,
            out,
            partial_ml,
            positions,
            tables,
        }
    }
}

/// The lane's elements `first..first + per_lane` of q's row for head `h`, rotated (RoPE at
/// `pos`, `rotate_half`'s pairing as the IR defines it) and scaled.
fn load_q(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    [b, h, first, pos]: [Reg; 4],
) -> Vec<Reg> {
    let e = cfg.elem;
    let [qs, ..] = cfg.strides;
    let t0 = k.mul_u32(&b, &qs[0]);
    let row = k.mad_u32(&h, &qs[1], &t0);
    let half = cfg.head_dim / 2;
    let scale = F32(cfg.scale * std::f32::consts::LOG2_E);
    (0..cfg.head_dim / 32)
        .map(|c| {
            let col = k.add_u32(&first, &c);
            let idx = k.add_u32(&row, &col);
            let a = k.address(params.q, &idx, e.bytes());
            let x = k.ld_global(e, a);
            let value = match params.tables {
                None => x,
                Some(tables) => rotated_element(k, e, [params.q, row, col, pos], x, half, tables),
            };
            k.mul_f32(&value, &scale)
        })
        .collect()
}

/// The warp's share `[from, to)` of the keys the query at `pos` sees: the query's own keys split
/// evenly over the ranges.
fn key_range(k: &mut Kernel, cfg: &AttentionConfig, pos: Reg, split: Reg) -> (Reg, Reg) {
    let KeyRule::Position { window } = cfg.keys else {
        unreachable!("supports() admits position keys only")
    };
    let range = window_range(k, pos, window, cfg.kv_len);
    share_of_keys(k, range, cfg.splits, split)
}

/// Each head's running max (base 2), sum and accumulators (the lane's elements).
struct State {
    m: Vec<Reg>,
    l: Vec<Reg>,
    acc: Vec<Vec<Reg>>,
}

impl State {
    fn new(k: &mut Kernel, group: u32, per_lane: u32) -> State {
        let heads = 0..group;
        State {
            m: heads
                .clone()
                .map(|_| k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)))
                .collect(),
            l: heads
                .clone()
                .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                .collect(),
            acc: heads
                .map(|_| {
                    (0..per_lane)
                        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                        .collect()
                })
                .collect(),
        }
    }
}

/// The lane's `n` contiguous elements of row `row` (elements) of `base`, as f32, loaded only
/// when `when` (zeros otherwise).
fn load_row(k: &mut Kernel, e: Elem, base: Reg, row: Reg, n: u32, when: Reg) -> Vec<Reg> {
    let words: Vec<Reg> = (0..n / 2).map(|_| k.mov(RegClass::B32, &0u32)).collect();
    let a = k.address(base, &row, e.bytes());
    let dst = match words.as_slice() {
        [w] => format!("ld.global.b32 {w}"),
        [w0, w1] => format!("ld.global.v2.b32 {{{w0}, {w1}}}"),
        _ => unreachable!("2 or 4 elements per lane"),
    };
    k.emit(format!("@{when} {dst}, [{a}]"));
    k.unpack_halves(e, &words)
}

/// Warp sums of several values, one shuffle level for all of them at a time.
fn warp_sums(k: &mut Kernel, values: &[Reg]) -> Vec<Reg> {
    let mut acc = values.to_vec();
    for offset in [16u32, 8, 4, 2, 1] {
        let others: Vec<Reg> = acc
            .iter()
            .map(|a| {
                let o = k.reg(RegClass::F32);
                k.emit(format!("shfl.sync.bfly.b32 {o}, {a}, {offset}, 31, -1"));
                o
            })
            .collect();
        acc = acc
            .iter()
            .zip(&others)
            .map(|(a, o)| k.add_f32(a, o))
            .collect();
    }
    acc
}

/// The keys `[from, to)`, [`KEY_UNROLL`] at a time: their K/V rows loaded first, then each key's
/// scores for every head of the group and their online-softmax updates, in key order.
fn key_loop(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    qs: &[Vec<Reg>],
    state: &State,
    [b, kvh, first, from, to]: [Reg; 5],
) {
    let [_, ks, vs, _] = cfg.strides;
    let per_lane = cfg.head_dim / 32;
    let k0 = k.mul_u32(&b, &ks[0]);
    let k1 = k.mad_u32(&kvh, &ks[1], &k0);
    let k_head = k.add_u32(&k1, &first);
    let v0 = k.mul_u32(&b, &vs[0]);
    let v1 = k.mad_u32(&kvh, &vs[1], &v0);
    let v_head = k.add_u32(&v1, &first);
    let j = k.mov(RegClass::B32, &from);
    let top = k.label("keys");
    let done = k.label("keys_done");
    k.place(&top);
    let finished = k.setp("ge.u32", &j, &to);
    k.bra(Some((finished, true)), &done);
    let keys: Vec<(Reg, Vec<Reg>, Vec<Reg>)> = (0..KEY_UNROLL)
        .map(|u| {
            let ju = k.add_u32(&j, &u);
            let used = k.setp("lt.u32", &ju, &to);
            let k_row = k.mad_u32(&ju, &ks[2], &k_head);
            let v_row = k.mad_u32(&ju, &vs[2], &v_head);
            let kv = load_row(k, cfg.elem, params.k, k_row, per_lane, used);
            let vv = load_row(k, cfg.elem, params.v, v_row, per_lane, used);
            (used, kv, vv)
        })
        .collect();
    for (used, kv, vv) in &keys {
        let next = k.label("next_key");
        k.bra(Some((*used, false)), &next);
        let partials: Vec<Reg> = qs
            .iter()
            .map(|q| {
                let p = k.mul_f32(&q[0], &kv[0]);
                for (qe, ke) in q.iter().zip(kv).skip(1) {
                    k.fma_into(p, qe, ke);
                }
                p
            })
            .collect();
        let scores = warp_sums(k, &partials);
        for (g, s) in scores.iter().enumerate() {
            let (corr, p) = online_softmax_step(k, state.m[g], state.l[g], *s);
            for (a, ve) in state.acc[g].iter().zip(vv) {
                k.emit(format!("mul.rn.f32 {a}, {a}, {corr}"));
                k.fma_into(*a, &p, ve);
            }
        }
        k.place(&next);
    }
    k.emit(format!("add.u32 {j}, {j}, {KEY_UNROLL}"));
    k.bra(None, &top);
    k.place(&done);
}

/// Each head's result: normalised into `out` (zeros for a query that saw no key), or with
/// several key ranges its partial accumulators, running max and sum.
fn store(
    k: &mut Kernel,
    cfg: &AttentionConfig,
    params: &Params,
    state: &State,
    heads: &[Reg],
    [b, split, lane, first]: [Reg; 4],
) {
    let e = cfg.elem;
    let d = cfg.head_dim;
    for (g, h) in heads.iter().enumerate() {
        let acc = &state.acc[g];
        match params.partial_ml {
            Some(ml) => {
                let row = k.mad_u32(&b, &cfg.heads, h);
                let p = k.mad_u32(&row, &cfg.splits, &split);
                let base = k.mad_u32(&p, &d, &first);
                for (c, a) in acc.iter().enumerate() {
                    let idx = k.add_u32(&base, &(c as u32));
                    let pa = k.address(params.out, &idx, 4);
                    k.st_global(Elem::F32, pa, *a);
                }
                let skip = k.label("skip_ml");
                let not_first = k.setp("ne.u32", &lane, &0u32);
                k.bra(Some((not_first, true)), &skip);
                let mi = k.mul_u32(&p, &2u32);
                let ma = k.address(ml, &mi, 4);
                k.st_global(Elem::F32, ma, state.m[g]);
                let la = k.op2("add.u64", RegClass::B64, &ma, &4u64);
                k.st_global(Elem::F32, la, state.l[g]);
                k.place(&skip);
            }
            None => {
                let os = cfg.strides[3];
                let t0 = k.mul_u32(&b, &os[0]);
                let row = k.mad_u32(h, &os[1], &t0);
                let none = k.setp("eq.f32", &state.l[g], &F32(0.0));
                let inv = k.rcp_f32(&state.l[g]);
                let inv = k.selp(RegClass::F32, "f32", &F32(0.0), &inv, none);
                for (c, a) in acc.iter().enumerate() {
                    let y = k.mul_f32(a, &inv);
                    let col = k.add_u32(&first, &(c as u32));
                    let idx = k.add_u32(&row, &col);
                    let oa = k.address(params.out, &idx, e.bytes());
                    k.st_global(e, oa, y);
                }
            }
        }
    }
}
