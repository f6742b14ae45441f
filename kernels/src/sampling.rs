//! Greedy token choice: the index of the largest logit of each row (the first one on ties), as
//! i64, with the semantics of `kiln_runtime::generate::choose` at temperature 0: NaN never wins,
//! and a row without a value above -inf picks 0. One block of 1024 threads per row (a decode
//! step has one row per sequence, and a vocabulary of 128256 bf16 is 250 KB): each thread scans
//! 16-byte chunks, four in flight (single elements when rows are not 16-byte aligned), then a
//! butterfly over the warp and a pass over the warps' winners. The advancing form also leaves the
//! next decode step's inputs in place, so that decode steps can follow each other on the device
//! without the host between them.

use crate::ptx::{Bracket, Elem, Kernel, Label, Reg, RegClass, F32};
use crate::{GeneratedKernel, Launch};

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
    let best = Best {
        v: k.mov(RegClass::F32, &F32(f32::NEG_INFINITY)),
        i: k.mov(RegClass::B32, &u32::MAX),
    };
    best.scan(&mut k, elem, vocab, [logits, base, tid]);
    for offset in [16u32, 8, 4, 2, 1] {
        let ov = k.reg(RegClass::F32);
        let oi = k.reg(RegClass::B32);
        k.emit(format!(
            "shfl.sync.bfly.b32 {ov}, {}, {offset}, 31, -1",
            best.v
        ));
        k.emit(format!(
            "shfl.sync.bfly.b32 {oi}, {}, {offset}, 31, -1",
            best.i
        ));
        best.combine(&mut k, ov, oi);
    }
    let end = best.over_warps(&mut k, [&vals, &idxs], tid);
    write_choice(&mut k, [out, row, best.i], next);
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

/// A thread's best logit so far and its index (`u32::MAX` while it has seen none above -inf).
struct Best {
    v: Reg,
    i: Reg,
}

impl Best {
    /// The thread's own best over the row: its 16-byte chunks (single elements when rows are
    /// not 16-byte aligned) `tid`, `tid + threads`, ..., [`ARGMAX_UNROLL`] in flight, from the
    /// row's first element `base` of `logits`.
    fn scan(&self, k: &mut Kernel, elem: Elem, vocab: u32, [logits, base, tid]: [Reg; 3]) {
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
            loaded.push((at, inside, load_chunk(k, elem, addr, inside, per)));
        }
        // In index order, strictly greater: NaN and -inf never win; a thread that saw neither
        // keeps index MAX.
        let (best, best_i) = (&self.v, &self.i);
        for (at, inside, values) in loaded {
            for (j, v) in values.iter().enumerate() {
                let take = k.setp("gt.f32", v, best);
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
    }

    /// Takes the pair (`other_v`, `other_i`) where its value is larger, or equal with a
    /// smaller index.
    fn combine(&self, k: &mut Kernel, other_v: Reg, other_i: Reg) {
        let (best, best_i) = (&self.v, &self.i);
        let gt = k.setp("gt.f32", &other_v, best);
        let eq = k.setp("eq.f32", &other_v, best);
        let lower = k.setp("lt.u32", &other_i, best_i);
        let tie = k.reg(RegClass::Pred);
        k.emit(format!("and.pred {tie}, {eq}, {lower}"));
        let take = k.reg(RegClass::Pred);
        k.emit(format!("or.pred {take}, {gt}, {tie}"));
        k.emit(format!("@{take} mov.f32 {best}, {other_v}"));
        k.emit(format!("@{take} mov.u32 {best_i}, {other_i}"));
    }

    /// Each warp's best (in its lane 0, after the butterfly) through shared `vals` and `idxs`
    /// to thread 0, which combines them in warp order and, with none above -inf, takes index
    /// 0; the other threads branch to the returned label, to be placed after the choice is
    /// written.
    fn over_warps(&self, k: &mut Kernel, [vals, idxs]: [&str; 2], tid: Reg) -> Label {
        let (best, best_i) = (&self.v, &self.i);
        let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
        let warp = k.op2("shr.u32", RegClass::B32, &tid, &5u32);
        let first = k.setp("eq.u32", &lane, &0u32);
        let vbase = k.shared_base(vals);
        let ibase = k.shared_base(idxs);
        let vslot = k.mad_u32(&warp, &4u32, &vbase);
        let islot = k.mad_u32(&warp, &4u32, &ibase);
        k.emit(format!("@{first} st.shared.f32 [{vslot}], {best}"));
        k.emit(format!("@{first} st.shared.u32 [{islot}], {best_i}"));
        k.barrier();
        let leader = k.setp("eq.u32", &tid, &0u32);
        let end = k.label("end");
        k.bra(Some((leader, false)), &end);
        for w in 1..ARGMAX_THREADS / 32 {
            let ov = k.reg(RegClass::F32);
            let oi = k.reg(RegClass::B32);
            k.emit(format!("ld.shared.f32 {ov}, [{vbase}+{}]", w * 4));
            k.emit(format!("ld.shared.u32 {oi}, [{ibase}+{}]", w * 4));
            self.combine(k, ov, oi);
        }
        k.comment("no value above -inf: index 0");
        let none = k.setp("eq.u32", best_i, &u32::MAX);
        k.emit(format!("@{none} mov.u32 {best_i}, 0"));
        end
    }
}

/// Row `row`'s chosen `token` (u32) into `out` as i64, and with the decode step's inputs
/// `next` (`ids, positions, mask`) the row's next id and position, unless its mask is 0.
fn write_choice(k: &mut Kernel, [out, row, token]: [Reg; 3], next: Option<[Reg; 3]>) {
    let wide = k.op1("cvt.u64.u32", RegClass::B64, &token);
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
}

/// The greedy choice as one 64-bit key per candidate, so that a product can fold its columns
/// into a row's best with `atom.max.u64` as it computes them ([`choose_from_keys`] reads it):
/// the value's order-preserving bits above `-inf`'s in the high word (at least 1 for a value
/// above `-inf`), `u32::MAX - col` in the low word (the first column wins a tie); 0 for NaN and
/// `-inf`, which never win, as [`argmax`] has it. `value` is the logit as stored (rounded to
/// the logits' type).
pub fn choice_key(k: &mut Kernel, value: Reg, col: Reg) -> Reg {
    // -0 + 0 = +0: the two zeros tie, as `gt.f32` has them.
    let value = k.add_f32(&value, &F32(0.0));
    let bits = k.reg(RegClass::B32);
    k.emit(format!("mov.b32 {bits}, {value}"));
    let sign = k.op2("shr.s32", RegClass::B32, &bits, &31u32);
    let flip = k.op2("or.b32", RegClass::B32, &sign, &0x8000_0000u32);
    let ordered = k.op2("xor.b32", RegClass::B32, &bits, &flip);
    // -inf's ordered bits: !0xff80_0000.
    let above = k.sub_u32(&ordered, &0x007f_ffffu32);
    let low = k.op1("not.b32", RegClass::B32, &col);
    let key = k.reg(RegClass::B64);
    k.emit(format!("mov.b64 {key}, {{{low}, {above}}}"));
    let number = k.setp("num.f32", &value, &value);
    let nan = k.reg(RegClass::Pred);
    k.emit(format!("not.pred {nan}, {number}"));
    let ninf = k.setp("eq.f32", &value, &F32(f32::NEG_INFINITY));
    k.emit(format!("or.pred {nan}, {nan}, {ninf}"));
    k.emit(format!("@{nan} mov.b64 {key}, 0"));
    key
}

/// Generates the kernel that takes each row's greedy token from the key a product left in
/// `best` ([`choice_key`]; 0: no value above `-inf`, index 0) and resets the key to 0 for the
/// next launch, writing the token as [`argmax`] does. Parameters: `best, out`, and when
/// `advance`, `ids, positions, mask`.
pub fn choose_from_keys(rows: u32, advance: bool) -> GeneratedKernel {
    let form = if advance { "_advance" } else { "" };
    let mut k = Kernel::new(&format!("choose{form}_from_keys_r{rows}"));
    let best = k.param_ptr("best");
    let out = k.param_ptr("out");
    let next = advance.then(|| ["ids", "positions", "mask"].map(|p| k.param_ptr(p)));
    let row = k.special("tid.x");
    let end = k.label("end");
    let past = k.setp("ge.u32", &row, &rows);
    k.bra(Some((past, true)), &end);
    let ba = k.address(best, &row, 8);
    let key = k.op1("ld.global.u64", RegClass::B64, &Bracket(ba));
    k.emit(format!("st.global.u64 [{ba}], 0"));
    let (low, high) = (k.reg(RegClass::B32), k.reg(RegClass::B32));
    k.emit(format!("mov.b64 {{{low}, {high}}}, {key}"));
    let token = k.op1("not.b32", RegClass::B32, &low);
    let none = k.setp("eq.u32", &high, &0u32);
    k.emit(format!("@{none} mov.u32 {token}, 0"));
    write_choice(&mut k, [out, row, token], next);
    k.place(&end);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [1, 1, 1],
            block: [rows.next_multiple_of(32), 1, 1],
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

/// Threads of a sampler block (one row per block).
const SAMPLE_THREADS: u32 = 1024;
/// Warps of a sampler block.
const SAMPLE_WARPS: u32 = SAMPLE_THREADS / 32;
/// Bits of a digit of the threshold searches.
const DIGIT_BITS: u32 = 8;
/// Bins of a digit's histogram.
const BINS: u32 = 1 << DIGIT_BITS;

/// Generates top-k / top-p sampling with temperature: one block per row, bit for bit
/// `kiln_runtime::generate::choose` (the integer weights of `kiln_ir::sampling`, in the same f32
/// operations; integer masses, so the block's order of summing does not matter). Parameters:
/// `logits [rows, vocab]`, `params [rows, 4]` (32-bit words: temperature as f32 bits, top_k,
/// top_p as f32 bits, the step's uniform word), `out [rows]` (i64). Per-request values live in
/// device memory, so one captured graph serves every request. A temperature of 0 or less takes
/// the first largest logit.
///
/// A threshold is the largest key (`ordered_key`, NaN below every number) at which the count of
/// keys at or above it (top-k), or their mass (top-p), still suffices. It is found 8 bits at a
/// time from the top: one pass over the row per digit builds the histogram of that digit over
/// the keys that share the digits found so far (lanes of a warp with the same digit add
/// together, one shared atomic per digit and warp), and a suffix sum over the bins picks the
/// largest digit that suffices (the top-p search takes the top-k set's mass from its first
/// histogram). The draw is the first kept index whose running mass exceeds `floor(word * z /
/// 2^32)`, `z` the kept mass: each thread sums the kept mass of its contiguous chunk, an exclusive
/// scan over the threads finds the chunk holding the target, and one warp walks it.
pub fn top_k_top_p(elem: Elem, rows: u32, vocab: u32) -> GeneratedKernel {
    let name = format!("sample_top_k_top_p_{}_v{vocab}", elem.name());
    let mut k = Kernel::new(&name);
    k.directive(format!(".maxntid {SAMPLE_THREADS}, 1, 1"));
    let logits = k.param_ptr("logits");
    let params = k.param_ptr("params");
    let out = k.param_ptr("out");
    let s = Sampler::declare(&mut k, elem, vocab, logits);
    let p = Params::load(&mut k, params, s.row);
    let (m, greedy) = s.largest(&mut k);
    let sampled = k.label("sampled");
    let hot = k.setp("gt.f32", &p.temperature, &F32(0.0));
    k.bra(Some((hot, true)), &sampled);
    k.comment("temperature 0: the first largest logit");
    s.store(&mut k, out, greedy);
    k.emit("ret");
    k.place(&sampled);
    let weigh = Weighing {
        m,
        t: p.temperature,
    };
    let t_k = s.top_k_threshold(&mut k, &p);
    let t = s.top_p_threshold(&mut k, &p, t_k, weigh);
    let token = s.draw(&mut k, [t, p.word], weigh);
    s.store(&mut k, out, token);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [rows, 1, 1],
            block: [SAMPLE_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// A row's sampling parameters (the four words of its `params` row).
struct Params {
    temperature: Reg,
    top_k: Reg,
    top_p: Reg,
    word: Reg,
}

impl Params {
    fn load(k: &mut Kernel, params: Reg, row: Reg) -> Params {
        let pi = k.mul_u32(&row, &4u32);
        let pa = k.address(params, &pi, 4);
        let mut words = (0..4u64).map(|i| {
            let a = k.op2("add.u64", RegClass::B64, &pa, &(4 * i));
            k.op1("ld.global.b32", RegClass::B32, &Bracket(a))
        });
        let mut next = || words.next().expect("four words");
        let (t_bits, top_k, p_bits, word) = (next(), next(), next(), next());
        let temperature = k.op1("mov.b32", RegClass::F32, &t_bits);
        let top_p = k.op1("mov.b32", RegClass::F32, &p_bits);
        Params {
            temperature,
            top_k,
            top_p,
            word,
        }
    }
}

/// What a threshold search sums over the keys at or above a candidate.
enum Amount {
    /// How many there are (top-k).
    Count,
    /// Their integer weights (top-p).
    Weight(Weighing),
}

/// How logits weigh: in a row whose largest logit is `m`, at temperature `t`.
#[derive(Clone, Copy)]
struct Weighing {
    m: Reg,
    t: Reg,
}

/// One element of a pass over the row: its index, value and whether it is inside the row.
struct Element {
    index: Reg,
    x: Reg,
    inside: Reg,
}

/// A sampler block's view of its row, and the shared arrays its passes use.
struct Sampler {
    elem: Elem,
    vocab: u32,
    logits: Reg,
    /// The row's first element.
    base: Reg,
    row: Reg,
    tid: Reg,
    lane: Reg,
    /// Elements per load: 16 bytes when every row starts 16-byte aligned.
    per: u32,
    red: String,
    red64: String,
    /// `[BINS]` u64: the digit histogram.
    bins: String,
    /// `[BINS + 1]` u64: the bins' suffix sums (the last 0).
    suffix: String,
    /// The draw's chunk: its thread (u32) and the kept mass before it (u64).
    owner: String,
}

impl Sampler {
    fn declare(k: &mut Kernel, elem: Elem, vocab: u32, logits: Reg) -> Sampler {
        use crate::reduce::scratch_u64;
        let tid = k.special("tid.x");
        let row = k.special("ctaid.x");
        let base = k.mul_u32(&row, &vocab);
        let lane = k.op2("and.b32", RegClass::B32, &tid, &31u32);
        let per = match 16 / elem.bytes() {
            wide if vocab.is_multiple_of(wide) => wide,
            _ => 1,
        };
        Sampler {
            elem,
            vocab,
            logits,
            base,
            row,
            tid,
            lane,
            per,
            red: k.shared("red", SAMPLE_WARPS * 4),
            red64: scratch_u64(k, SAMPLE_WARPS),
            bins: k.shared("bins", BINS * 8),
            suffix: k.shared("suffix", (BINS + 1) * 8),
            owner: k.shared("owner", 16),
        }
    }

    /// Runs `body` on every element of the row: a thread takes `per` contiguous elements per
    /// load, several loads in flight, in rising index order; every thread runs the same number
    /// of rounds, so warp-wide instructions in `body` see whole warps.
    fn each(&self, k: &mut Kernel, what: &str, body: &mut dyn FnMut(&mut Kernel, &Element)) {
        let loads = self.loads_in_flight();
        let stride = SAMPLE_THREADS * self.per;
        let round = stride * loads;
        let end = self.vocab.div_ceil(round) * round;
        let first = k.mul_u32(&self.tid, &self.per);
        let start = k.mov(RegClass::B32, &0u32);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &start, &end);
        k.bra(Some((past, true)), &done);
        let from = k.add_u32(&start, &first);
        let chunks: Vec<_> = (0..loads)
            .map(|u| {
                let at = k.add_u32(&from, &(u * stride));
                self.load(k, at, self.vocab)
            })
            .collect();
        for elements in chunks {
            for e in &elements {
                body(k, e);
            }
        }
        k.emit(format!("add.u32 {start}, {start}, {round}"));
        k.bra(None, &top);
        k.place(&done);
    }

    /// Runs `body` on the elements `first..end` (a thread's own chunk), in index order.
    fn walk(
        &self,
        k: &mut Kernel,
        what: &str,
        [first, end]: [Reg; 2],
        body: &mut dyn FnMut(&mut Kernel, &Element),
    ) {
        let loads = self.loads_in_flight();
        let at = k.mov(RegClass::B32, &first);
        let top = k.label(what);
        let done = k.label(&format!("{what}_done"));
        k.place(&top);
        let past = k.setp("ge.u32", &at, &end);
        k.bra(Some((past, true)), &done);
        let chunks: Vec<_> = (0..loads)
            .map(|u| {
                let from = k.add_u32(&at, &(u * self.per));
                self.load_until(k, from, end)
            })
            .collect();
        for elements in chunks {
            for e in &elements {
                body(k, e);
            }
        }
        k.emit(format!("add.u32 {at}, {at}, {}", loads * self.per));
        k.bra(None, &top);
        k.place(&done);
    }

    fn loads_in_flight(&self) -> u32 {
        if self.per > 1 {
            2
        } else {
            8
        }
    }

    /// The `per` elements from index `at` (all inside or none: `end` and `at` are multiples of
    /// `per`, or `per` is 1).
    fn load(&self, k: &mut Kernel, at: Reg, end: u32) -> Vec<Element> {
        let end = k.mov(RegClass::B32, &end);
        self.load_until(k, at, end)
    }

    fn load_until(&self, k: &mut Kernel, at: Reg, end: Reg) -> Vec<Element> {
        let inside = k.setp("lt.u32", &at, &end);
        let i = k.add_u32(&self.base, &at);
        let addr = k.address(self.logits, &i, self.elem.bytes());
        let values = load_chunk(k, self.elem, addr, inside, self.per);
        values
            .into_iter()
            .enumerate()
            .map(|(j, x)| Element {
                index: k.add_u32(&at, &(j as u32)),
                x,
                inside,
            })
            .collect()
    }

    /// The row's largest logit, and the first index holding it (0 when no value is above -inf).
    fn largest(&self, k: &mut Kernel) -> (Reg, Reg) {
        let best = k.mov(RegClass::F32, &F32(f32::NEG_INFINITY));
        let best_i = k.mov(RegClass::B32, &u32::MAX);
        self.each(k, "max", &mut |k, e| {
            let gt = k.setp("gt.f32", &e.x, &best);
            k.emit(format!("and.pred {gt}, {gt}, {}", e.inside));
            k.emit(format!("@{gt} mov.f32 {best}, {}", e.x));
            k.emit(format!("@{gt} mov.u32 {best_i}, {}", e.index));
        });
        let m = self.reduce(k, best, "max.f32", RegClass::F32);
        // Threads holding another value offer MAX.
        let holds = k.setp("eq.f32", &best, &m);
        let offer = k.selp(RegClass::B32, "u32", &best_i, &u32::MAX, holds);
        let first = self.reduce(k, offer, "min.u32", RegClass::B32);
        let none = k.setp("eq.u32", &first, &u32::MAX);
        (m, k.selp(RegClass::B32, "u32", &0u32, &first, none))
    }

    fn reduce(&self, k: &mut Kernel, value: Reg, op: &str, class: RegClass) -> Reg {
        let pair = [value, self.tid];
        crate::reduce::block_reduce_over(k, pair, op, class, &self.red, SAMPLE_WARPS)
    }

    /// The top-k threshold: the largest key with at least `top_k` keys at or above it (0 when
    /// top_k is 0 or not below the vocabulary).
    fn top_k_threshold(&self, k: &mut Kernel, p: &Params) -> Reg {
        let t_k = k.mov(RegClass::B32, &0u32);
        let some = k.setp("ne.u32", &p.top_k, &0u32);
        let fewer = k.setp("lt.u32", &p.top_k, &self.vocab);
        k.emit(format!("and.pred {some}, {some}, {fewer}"));
        let skip = k.label("top_k_done");
        k.bra(Some((some, false)), &skip);
        let wanted = k.op1("cvt.u64.u32", RegClass::B64, &p.top_k);
        let floor = k.mov(RegClass::B32, &0u32);
        let search = ("top_k", floor);
        let found = self.radix_search(k, search, &Amount::Count, &mut |k, count, _| {
            k.setp("ge.u64", &count, &wanted)
        });
        k.set(t_k, &found);
        k.place(&skip);
        t_k
    }

    /// The top-p threshold within the top-k set: the largest key whose kept mass reaches `top_p`
    /// of the set's mass `z_k` (`mass * 2^32 >= P * z_k` in 128 bits); `t_k` itself when top_p is
    /// not below 1.
    fn top_p_threshold(&self, k: &mut Kernel, p: &Params, t_k: Reg, weigh: Weighing) -> Reg {
        let t = k.mov(RegClass::B32, &t_k);
        let scaled = k.mul_f32(&p.top_p, &F32(kiln_ir::sampling::power_of_two(32)));
        let fixed = k.op1("cvt.rzi.u64.f32", RegClass::B64, &scaled);
        let use_p = k.setp("lt.f32", &p.top_p, &F32(1.0));
        let skip = k.label("top_p_done");
        k.bra(Some((use_p, false)), &skip);
        // The top-k set's mass z_k reaches (P < 2^32), so the largest key that reaches is at
        // least t_k, and the mass at it counts only keys inside the top-k set.
        let amount = Amount::Weight(weigh);
        let found = self.radix_search(k, ("top_p", t_k), &amount, &mut |k, mass, z_k| {
            reaches(k, mass, fixed, z_k)
        });
        k.set(t, &found);
        k.place(&skip);
        t
    }

    /// The largest key `t` for which `holds(mass(t), total)`, where `mass(t)` sums `amount` over
    /// the keys at or above `t` and `total` over every key at or above `floor` (`holds` is
    /// monotone and holds at `floor`). Keys below `floor` are left out of the sums: that changes
    /// no decision, since `holds` is true for every candidate at or below `floor` either way.
    fn radix_search(
        &self,
        k: &mut Kernel,
        (what, floor): (&str, Reg),
        amount: &Amount,
        holds: &mut dyn FnMut(&mut Kernel, Reg, Reg) -> Reg,
    ) -> Reg {
        let prefix = k.mov(RegClass::B32, &0u32);
        let above = k.mov(RegClass::B64, &0u64);
        let total = k.mov(RegClass::B64, &0u64);
        for pass in 0..32 / DIGIT_BITS {
            let shift = 32 - DIGIT_BITS * (pass + 1);
            k.comment(&format!("{what}: the digit at bit {shift}"));
            self.histogram(k, &format!("{what}_{pass}"), [prefix, floor], shift, amount);
            let suffix = self.suffix_sums(k);
            if pass == 0 {
                k.comment("the first digit's bins hold every counted key");
                k.barrier();
                let zero = k.mov(RegClass::B32, &0u32);
                let all = self.suffix_at(k, zero);
                k.set(total, &all);
            }
            let mass = k.op2("add.u64", RegClass::B64, &above, &suffix);
            let ok = holds(k, mass, total);
            let bin = k.setp("lt.u32", &self.tid, &BINS);
            k.emit(format!("and.pred {ok}, {ok}, {bin}"));
            let offer = k.selp(RegClass::B32, "u32", &self.tid, &0u32, ok);
            let digit = self.reduce(k, offer, "max.u32", RegClass::B32);
            let next = k.add_u32(&digit, &1u32);
            let after = self.suffix_at(k, next);
            k.emit(format!("add.u64 {above}, {above}, {after}"));
            let placed = k.op2("shl.b32", RegClass::B32, &digit, &shift);
            k.emit(format!("or.b32 {prefix}, {prefix}, {placed}"));
        }
        prefix
    }

    /// The histogram of the key digit at `shift` over the keys at or above `floor` whose higher
    /// digits equal `prefix`'s, in `bins`. A warp none of whose elements counts skips the bins.
    fn histogram(
        &self,
        k: &mut Kernel,
        what: &str,
        [prefix, floor]: [Reg; 2],
        shift: u32,
        amount: &Amount,
    ) {
        let bins = k.shared_base(&self.bins);
        let bin = k.setp("lt.u32", &self.tid, &BINS);
        let slot = k.mad_u32(&self.tid, &8u32, &bins);
        k.emit(format!("@{bin} st.shared.u64 [{slot}], 0"));
        k.barrier();
        let higher = shift + DIGIT_BITS;
        let wanted = k.op2("shr.b32", RegClass::B32, &prefix, &higher);
        self.each(k, what, &mut |k, e| {
            let key = ordered_key(k, e.x);
            let high = k.op2("shr.b32", RegClass::B32, &key, &higher);
            let same = k.setp("eq.u32", &high, &wanted);
            k.emit(format!("and.pred {same}, {same}, {}", e.inside));
            let above_floor = k.setp("ge.u32", &key, &floor);
            k.emit(format!("and.pred {same}, {same}, {above_floor}"));
            let skip = k.label(&format!("{what}_skip"));
            let warp_has = k.reg(RegClass::Pred);
            k.emit(format!("vote.sync.any.pred {warp_has}, {same}, -1"));
            k.bra(Some((warp_has, false)), &skip);
            let digit = k.op2("shr.b32", RegClass::B32, &key, &shift);
            let digit = k.op2("and.b32", RegClass::B32, &digit, &(BINS - 1));
            // Elements outside the prefix join the bin past the last, which is not stored.
            let digit = k.selp(RegClass::B32, "u32", &digit, &BINS, same);
            let value = match amount {
                Amount::Count => None,
                Amount::Weight(weigh) => Some(weight_if(k, same, e.x, *weigh)),
            };
            self.bin_add(k, [digit, bins], value);
            k.place(&skip);
        });
        k.barrier();
    }

    /// Adds to bin `digit` (when below BINS) the warp's lanes with that digit: their count, or
    /// the sum of their `value`s (u32, summed in 16-bit halves so that 32 of them fit).
    fn bin_add(&self, k: &mut Kernel, [digit, bins]: [Reg; 2], value: Option<Reg>) {
        let peers = k.reg(RegClass::B32);
        k.emit(format!("match.any.sync.b32 {peers}, {digit}, -1"));
        let amount = match value {
            None => {
                let n = k.op1("popc.b32", RegClass::B32, &peers);
                k.op1("cvt.u64.u32", RegClass::B64, &n)
            }
            Some(v) => {
                let lo = k.op2("and.b32", RegClass::B32, &v, &0xffffu32);
                let hi = k.op2("shr.u32", RegClass::B32, &v, &16u32);
                let [lo, hi] = [lo, hi].map(|h| {
                    let sum = k.reg(RegClass::B32);
                    k.emit(format!("redux.sync.add.u32 {sum}, {h}, {peers}"));
                    k.op1("cvt.u64.u32", RegClass::B64, &sum)
                });
                let hi = k.op2("shl.b64", RegClass::B64, &hi, &16u32);
                k.op2("add.u64", RegClass::B64, &hi, &lo)
            }
        };
        let earlier = k.special("lanemask_lt");
        let before = k.op2("and.b32", RegClass::B32, &peers, &earlier);
        let leader = k.setp("eq.u32", &before, &0u32);
        let stored = k.setp("lt.u32", &digit, &BINS);
        k.emit(format!("and.pred {leader}, {leader}, {stored}"));
        let slot = k.mad_u32(&digit, &8u32, &bins);
        k.emit(format!("@{leader} red.shared.add.u64 [{slot}], {amount}"));
    }

    /// Each bin's suffix sum (the bin and every bin above it), stored in `suffix` and returned
    /// to thread `d` for bin `d` (0 to threads past the bins); `suffix[BINS]` is 0.
    fn suffix_sums(&self, k: &mut Kernel) -> Reg {
        let bin = k.setp("lt.u32", &self.tid, &BINS);
        let bins = k.shared_base(&self.bins);
        let slot = k.mad_u32(&self.tid, &8u32, &bins);
        let acc = k.mov(RegClass::B64, &0u64);
        k.emit(format!("@{bin} ld.shared.u64 {acc}, [{slot}]"));
        for offset in [1u32, 2, 4, 8, 16] {
            let other = crate::reduce::shfl_u64(k, "down", acc, offset);
            let has = k.setp("lt.u32", &self.lane, &(32 - offset));
            k.emit(format!("@{has} add.u64 {acc}, {acc}, {other}"));
        }
        k.comment("warp totals, then the totals of the warps above");
        let totals = k.shared_base(&self.red64);
        let warp = k.op2("shr.u32", RegClass::B32, &self.tid, &5u32);
        let first = k.setp("eq.u32", &self.lane, &0u32);
        k.emit(format!("and.pred {first}, {first}, {bin}"));
        let total_slot = k.mad_u32(&warp, &8u32, &totals);
        k.emit(format!("@{first} st.shared.u64 [{total_slot}], {acc}"));
        k.barrier();
        for w in 1..BINS / 32 {
            let v = k.reg(RegClass::B64);
            k.emit(format!("ld.shared.u64 {v}, [{totals}+{}]", w * 8));
            let later = k.setp("lt.u32", &warp, &w);
            k.emit(format!("@{later} add.u64 {acc}, {acc}, {v}"));
        }
        let suffix = k.shared_base(&self.suffix);
        let out = k.mad_u32(&self.tid, &8u32, &suffix);
        k.emit(format!("@{bin} st.shared.u64 [{out}], {acc}"));
        let zero = k.setp("eq.u32", &self.tid, &0u32);
        k.emit(format!("@{zero} st.shared.u64 [{suffix}+{}], 0", BINS * 8));
        k.emit(format!("@!{bin} mov.u64 {acc}, 0"));
        acc
    }

    /// `suffix[digit]` (after a barrier that follows [`Sampler::suffix_sums`]).
    fn suffix_at(&self, k: &mut Kernel, digit: Reg) -> Reg {
        let suffix = k.shared_base(&self.suffix);
        let at = k.mad_u32(&digit, &8u32, &suffix);
        k.op1("ld.shared.u64", RegClass::B64, &Bracket(at))
    }

    /// The token: the first index at or above threshold `t` whose running kept mass exceeds
    /// `floor(word * z / 2^32)`, `z` the kept mass, or the last kept index when none is kept.
    fn draw(&self, k: &mut Kernel, [t, word]: [Reg; 2], weigh: Weighing) -> Reg {
        use crate::reduce::{block_scan_u64, block_sum_u64};
        let chunk = self
            .vocab
            .div_ceil(SAMPLE_THREADS)
            .next_multiple_of(self.per);
        let first = k.mul_u32(&self.tid, &chunk);
        let end = self.chunk_end(k, first, chunk);
        k.comment("the kept mass of this thread's chunk, and its last kept index");
        let mine = k.mov(RegClass::B64, &0u64);
        let last = k.mov(RegClass::B32, &0u32);
        self.walk(k, "chunk_mass", [first, end], &mut |k, e| {
            let (kept, w) = kept_weight(k, e, t, weigh);
            k.emit(format!("@{kept} add.u64 {mine}, {mine}, {w}"));
            k.emit(format!("@{kept} max.u32 {last}, {last}, {}", e.index));
        });
        let last_kept = self.reduce(k, last, "max.u32", RegClass::B32);
        let owner = k.shared_base(&self.owner);
        let leader = k.setp("eq.u32", &self.tid, &0u32);
        k.emit(format!("@{leader} st.shared.u32 [{owner}], -1"));
        let before = block_scan_u64(k, [mine, self.tid], &self.red64, SAMPLE_WARPS);
        let z = block_sum_u64(k, [mine, self.tid], &self.red64, SAMPLE_WARPS);
        let target = draw_target(k, word, z);
        k.comment("the thread whose chunk holds the target names itself");
        let after = k.op2("add.u64", RegClass::B64, &before, &mine);
        let starts = k.setp("le.u64", &before, &target);
        let ends = k.setp("gt.u64", &after, &target);
        k.emit(format!("and.pred {starts}, {starts}, {ends}"));
        k.emit(format!("@{starts} st.shared.u32 [{owner}], {}", self.tid));
        k.emit(format!("@{starts} st.shared.u64 [{owner}+8], {before}"));
        k.barrier();
        let holder = k.op1("ld.shared.u32", RegClass::B32, &Bracket(owner));
        let mass_before = k.reg(RegClass::B64);
        k.emit(format!("ld.shared.u64 {mass_before}, [{owner}+8]"));
        let token = k.mov(RegClass::B32, &last_kept);
        let done = k.label("drawn");
        let other_warp = k.setp("ge.u32", &self.tid, &32u32);
        let nobody = k.setp("eq.u32", &holder, &u32::MAX);
        k.emit(format!("or.pred {other_warp}, {other_warp}, {nobody}"));
        k.bra(Some((other_warp, true)), &done);
        let from = k.mul_u32(&holder, &chunk);
        let to = self.chunk_end(k, from, chunk);
        let found = self.find(k, [from, to], [t, target], mass_before, weigh);
        let missed = k.setp("eq.u32", &found, &u32::MAX);
        k.emit(format!("@!{missed} mov.u32 {token}, {found}"));
        k.place(&done);
        token
    }

    fn chunk_end(&self, k: &mut Kernel, first: Reg, chunk: u32) -> Reg {
        let end = k.add_u32(&first, &chunk);
        k.op2("min.u32", RegClass::B32, &end, &self.vocab)
    }

    /// Warp 0 walks the chunk `from..to` 32 elements at a time: the first index whose running
    /// kept mass (from `mass`) exceeds `target`, or MAX.
    fn find(
        &self,
        k: &mut Kernel,
        [from, to]: [Reg; 2],
        [t, target]: [Reg; 2],
        mass: Reg,
        weigh: Weighing,
    ) -> Reg {
        use crate::reduce::{shfl_u64, warp_scan_u64};
        let found = k.mov(RegClass::B32, &u32::MAX);
        let acc = k.mov(RegClass::B64, &mass);
        let at = k.mov(RegClass::B32, &from);
        let top = k.label("find");
        let done = k.label("find_done");
        k.place(&top);
        let past = k.setp("ge.u32", &at, &to);
        k.bra(Some((past, true)), &done);
        let index = k.add_u32(&at, &self.lane);
        let inside = k.setp("lt.u32", &index, &to);
        let i = k.add_u32(&self.base, &index);
        let addr = k.address(self.logits, &i, self.elem.bytes());
        let x = load_chunk(k, self.elem, addr, inside, 1)[0];
        let e = Element { index, x, inside };
        let (_, w) = kept_weight(k, &e, t, weigh);
        let running = warp_scan_u64(k, w, self.lane);
        let total = k.op2("add.u64", RegClass::B64, &acc, &running);
        let crossed = k.setp("gt.u64", &total, &target);
        let ballot = k.reg(RegClass::B32);
        k.emit(format!("vote.sync.ballot.b32 {ballot}, {crossed}, -1"));
        let any = k.setp("ne.u32", &ballot, &0u32);
        k.comment("the lowest lane that crossed");
        let negated = k.op1("neg.s32", RegClass::B32, &ballot);
        let lowest = k.op2("and.b32", RegClass::B32, &ballot, &negated);
        let below = k.sub_u32(&lowest, &1u32);
        let lane = k.op1("popc.b32", RegClass::B32, &below);
        let hit = k.add_u32(&at, &lane);
        k.emit(format!("@{any} mov.u32 {found}, {hit}"));
        k.bra(Some((any, true)), &done);
        let warp_total = shfl_u64(k, "idx", running, 31);
        k.emit(format!("add.u64 {acc}, {acc}, {warp_total}"));
        k.emit(format!("add.u32 {at}, {at}, 32"));
        k.bra(None, &top);
        k.place(&done);
        found
    }

    /// Thread 0 writes `token` as the row's i64.
    fn store(&self, k: &mut Kernel, out: Reg, token: Reg) {
        let write = k.setp("eq.u32", &self.tid, &0u32);
        let skip = k.label("skip_write");
        k.bra(Some((write, false)), &skip);
        let wide = k.op1("cvt.u64.u32", RegClass::B64, &token);
        let oa = k.address(out, &self.row, 8);
        k.emit(format!("st.global.u64 [{oa}], {wide}"));
        k.place(&skip);
    }
}

/// Whether element `e` is kept at threshold `t` (inside the row, key at or above `t`), and its
/// weight as u64.
fn kept_weight(k: &mut Kernel, e: &Element, t: Reg, weigh: Weighing) -> (Reg, Reg) {
    let key = ordered_key(k, e.x);
    let kept = k.setp("ge.u32", &key, &t);
    k.emit(format!("and.pred {kept}, {kept}, {}", e.inside));
    let w = weight_if(k, kept, e.x, weigh);
    (kept, k.op1("cvt.u64.u32", RegClass::B64, &w))
}

/// [`weight`] where `when` holds, 0 elsewhere (computed only where it holds).
fn weight_if(k: &mut Kernel, when: Reg, x: Reg, Weighing { m, t }: Weighing) -> Reg {
    let w = k.mov(RegClass::B32, &0u32);
    let skip = k.label("weighed");
    k.bra(Some((when, false)), &skip);
    let value = weight(k, x, m, t);
    k.set(w, &value);
    k.place(&skip);
    w
}

/// The draw's target in a kept mass of `z`: `floor(word * z / 2^32)`.
fn draw_target(k: &mut Kernel, word: Reg, z: Reg) -> Reg {
    let wide_word = k.op1("cvt.u64.u32", RegClass::B64, &word);
    let hi = k.op2("mul.hi.u64", RegClass::B64, &wide_word, &z);
    let lo = k.op2("mul.lo.u64", RegClass::B64, &wide_word, &z);
    let hi = k.op2("shl.b64", RegClass::B64, &hi, &32u32);
    let lo = k.op2("shr.u64", RegClass::B64, &lo, &32u32);
    k.op2("or.b64", RegClass::B64, &hi, &lo)
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
