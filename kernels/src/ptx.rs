//! A small typed PTX builder: registers by class, typed loads and stores, predicates, labels and
//! `.shared` arrays, so that kernel generators read like the algorithm.
//!
//! Every register is declared with its class (`%p` predicates, `%h` 16-bit, `%r` 32-bit integers,
//! `%rd` 64-bit integers, `%f` f32); instruction helpers take typed [`Reg`]s and immediates. The
//! emitted text targets PTX ISA 8.5 (`.target sm_90`), which the CUDA 13.0 driver and ptxas accept.
//!
//! Every kernel takes part in programmatic dependent launch: it lets the next kernel of its
//! stream launch as soon as all its blocks run (`griddepcontrol.launch_dependents`, first in its
//! body), and waits for the kernel before it to complete (`griddepcontrol.wait`) before it reads
//! anything: at the top of the body, or where the generator puts [`Kernel::wait_for_inputs`]
//! after work that reads only what no kernel writes (weights heading for L2). Launched with the
//! driver's programmatic-serialization attribute, a kernel's launch and prologue overlap its
//! predecessor's tail; launched without it, both instructions do nothing.

use std::fmt::{self, Write};

use kiln_ir::DType;

/// The PTX ISA version kiln emits.
pub const PTX_VERSION: &str = "8.5";
/// The GPU kiln targets (Hopper and later: `griddepcontrol` needs sm_90).
pub const TARGET: &str = "sm_90";

/// A register class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegClass {
    /// `.pred`
    Pred,
    /// `.b16` (f16 / bf16 bits)
    B16,
    /// `.b32` (u32 / s32)
    B32,
    /// `.b64` (u64 / s64 / addresses)
    B64,
    /// `.f32`
    F32,
}

impl RegClass {
    const ALL: [RegClass; 5] = [
        RegClass::Pred,
        RegClass::B16,
        RegClass::B32,
        RegClass::B64,
        RegClass::F32,
    ];

    fn prefix(self) -> &'static str {
        match self {
            RegClass::Pred => "p",
            RegClass::B16 => "h",
            RegClass::B32 => "r",
            RegClass::B64 => "rd",
            RegClass::F32 => "f",
        }
    }

    fn decl(self) -> &'static str {
        match self {
            RegClass::Pred => ".pred",
            RegClass::B16 => ".b16",
            RegClass::B32 => ".b32",
            RegClass::B64 => ".b64",
            RegClass::F32 => ".f32",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A virtual register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg {
    class: RegClass,
    id: u32,
}

impl Reg {
    /// Its class.
    pub fn class(self) -> RegClass {
        self.class
    }
}

impl fmt::Display for Reg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}{}", self.class.prefix(), self.id)
    }
}

/// An instruction operand: a register or an immediate.
pub trait Operand {
    /// The operand's PTX text.
    fn text(&self) -> String;
}

impl Operand for Reg {
    fn text(&self) -> String {
        self.to_string()
    }
}

impl Operand for u32 {
    fn text(&self) -> String {
        self.to_string()
    }
}

impl Operand for i32 {
    fn text(&self) -> String {
        self.to_string()
    }
}

impl Operand for u64 {
    fn text(&self) -> String {
        self.to_string()
    }
}

/// An f32 immediate, written as its exact bit pattern (`0f3F800000`).
#[derive(Clone, Copy, Debug)]
pub struct F32(pub f32);

impl Operand for F32 {
    fn text(&self) -> String {
        format!("0f{:08X}", self.0.to_bits())
    }
}

/// A code label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label(String);

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a kernel parameter is passed (the artifact's schema owns the type).
pub use kiln_ir::artifact::ParamType;

/// The element storage of a tensor in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Elem {
    /// f32
    F32,
    /// f16
    F16,
    /// bf16
    BF16,
}

impl Elem {
    /// The element type of a float `DType`.
    pub fn of(dtype: DType) -> Option<Elem> {
        match dtype {
            DType::F32 => Some(Elem::F32),
            DType::F16 => Some(Elem::F16),
            DType::BF16 => Some(Elem::BF16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::BF16 => 2,
        }
    }

    /// `f32`, `f16`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
        }
    }
}

/// One `.entry` under construction.
pub struct Kernel {
    name: String,
    params: Vec<(String, ParamType)>,
    scratch: Vec<String>,
    counts: [u32; 5],
    shared: Vec<String>,
    preamble: Vec<String>,
    directives: Vec<String>,
    body: String,
    labels: u32,
    waited: bool,
    cluster: u32,
}

impl Kernel {
    /// Starts the kernel `name`.
    pub fn new(name: &str) -> Kernel {
        Kernel {
            name: name.to_string(),
            params: Vec::new(),
            scratch: Vec::new(),
            counts: [0; 5],
            shared: Vec::new(),
            preamble: Vec::new(),
            directives: Vec::new(),
            body: String::new(),
            labels: 0,
            waited: false,
            cluster: 1,
        }
    }

    /// The entry name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The kernel's parameters, in order.
    pub fn params(&self) -> &[(String, ParamType)] {
        &self.params
    }

    /// The parameters that point at the kernel's own working memory ([`Self::param_scratch`]).
    pub fn scratch_params(&self) -> &[String] {
        &self.scratch
    }

    /// A fresh register of `class`.
    pub fn reg(&mut self, class: RegClass) -> Reg {
        let id = self.counts[class.index()];
        self.counts[class.index()] += 1;
        Reg { class, id }
    }

    /// A fresh label.
    pub fn label(&mut self, what: &str) -> Label {
        self.labels += 1;
        Label(format!("$L_{what}_{}", self.labels))
    }

    /// Places `label` here.
    pub fn place(&mut self, label: &Label) {
        writeln!(self.body, "{label}:").expect("writing to a String");
    }

    /// Emits one instruction (`;` added).
    pub fn emit(&mut self, instruction: impl AsRef<str>) {
        writeln!(self.body, "\t{};", instruction.as_ref()).expect("writing to a String");
    }

    /// Waits for the kernels before this one in the stream to complete and their writes to be
    /// visible (`griddepcontrol.wait`). What the kernel emits before this must read only what no
    /// kernel writes (weights, parameters); a kernel that never calls it waits at its top.
    pub fn wait_for_inputs(&mut self) {
        assert!(!self.waited, "`{}` waits for its inputs twice", self.name);
        self.emit("griddepcontrol.wait");
        self.waited = true;
    }

    /// Emits a comment line.
    pub fn comment(&mut self, text: &str) {
        writeln!(self.body, "\t// {text}").expect("writing to a String");
    }

    /// Declares a `.shared` array of `bytes` bytes, aligned to 16; returns its name.
    pub fn shared(&mut self, name: &str, bytes: u32) -> String {
        self.shared
            .push(format!("\t.shared .align 16 .b8 {name}[{bytes}];"));
        name.to_string()
    }

    /// Declares the dynamic shared memory (sized at launch, `Launch::shared_bytes`) under `name`;
    /// returns the name. Launches over 48 KB need the function's dynamic-shared-memory limit raised.
    pub fn dynamic_shared(&mut self, name: &str) -> String {
        self.preamble
            .push(format!(".extern .shared .align 16 .b8 {name}[];"));
        name.to_string()
    }

    /// Adds a performance directive after the parameter list (`.maxntid 384, 1, 1`).
    pub fn directive(&mut self, text: impl Into<String>) {
        self.directives.push(text.into());
    }

    /// Launches the kernel in clusters of `blocks` blocks along x (`.reqnctapercluster`): its
    /// grid must be whole clusters.
    pub fn cluster(&mut self, blocks: u32) {
        self.directive(format!(".reqnctapercluster {blocks}, 1, 1"));
        self.cluster = blocks;
    }

    /// Blocks per cluster along x (1 without [`Kernel::cluster`]).
    pub fn cluster_blocks(&self) -> u32 {
        self.cluster
    }

    /// Declares the dynamic shared memory aligned to `align` bytes (sized at launch); returns the
    /// name.
    pub fn dynamic_shared_aligned(&mut self, name: &str, align: u32) -> String {
        self.preamble
            .push(format!(".extern .shared .align {align} .b8 {name}[];"));
        name.to_string()
    }

    /// A tensor-map parameter passed by value (128 bytes); returns its generic address, as
    /// `cp.async.bulk.tensor` takes it.
    pub fn param_tensor_map(&mut self, name: &str, spec: crate::TensorMapSpec) -> Reg {
        self.params
            .push((name.to_string(), ParamType::TensorMap(spec)));
        let param = self.reg(RegClass::B64);
        self.emit(format!("mov.b64 {param}, {name}"));
        let generic = self.reg(RegClass::B64);
        self.emit(format!("cvta.param.u64 {generic}, {param}"));
        generic
    }

    /// A pointer parameter to the kernel's own working memory (a split's partial sums, its
    /// arrival counters), loaded as [`Self::param_ptr`] does: bound by the lowering to scratch it
    /// sizes from the kernel's configuration, never to one of the node's operands.
    pub fn param_scratch(&mut self, name: &str) -> Reg {
        self.scratch.push(name.to_string());
        self.param_ptr(name)
    }

    /// A pointer parameter, loaded and converted to a global address.
    pub fn param_ptr(&mut self, name: &str) -> Reg {
        self.params.push((name.to_string(), ParamType::Ptr));
        let generic = self.reg(RegClass::B64);
        self.emit(format!("ld.param.u64 {generic}, [{name}]"));
        let global = self.reg(RegClass::B64);
        self.emit(format!("cvta.to.global.u64 {global}, {generic}"));
        global
    }

    /// A u32 parameter.
    pub fn param_u32(&mut self, name: &str) -> Reg {
        self.params.push((name.to_string(), ParamType::U32));
        let r = self.reg(RegClass::B32);
        self.emit(format!("ld.param.u32 {r}, [{name}]"));
        r
    }

    /// An f32 parameter.
    pub fn param_f32(&mut self, name: &str) -> Reg {
        self.params.push((name.to_string(), ParamType::F32));
        let r = self.reg(RegClass::F32);
        self.emit(format!("ld.param.f32 {r}, [{name}]"));
        r
    }

    /// The shared-memory address of the array `name` (declared with [`Kernel::shared`]).
    pub fn shared_base(&mut self, name: &str) -> Reg {
        let r = self.reg(RegClass::B32);
        self.emit(format!("mov.u32 {r}, {name}"));
        r
    }

    /// A special register (`%tid.x`, `%ctaid.y`, `%ntid.x`, ...) as u32.
    pub fn special(&mut self, name: &str) -> Reg {
        let r = self.reg(RegClass::B32);
        self.emit(format!("mov.u32 {r}, %{name}"));
        r
    }

    /// `d = op(a, b)` with a typed opcode (`add.u32`, `mul.f32`, ...), into a fresh register.
    pub fn op2(&mut self, opcode: &str, class: RegClass, a: &dyn Operand, b: &dyn Operand) -> Reg {
        let d = self.reg(class);
        self.emit(format!("{opcode} {d}, {}, {}", a.text(), b.text()));
        d
    }

    /// `d = op(a)` into a fresh register.
    pub fn op1(&mut self, opcode: &str, class: RegClass, a: &dyn Operand) -> Reg {
        let d = self.reg(class);
        self.emit(format!("{opcode} {d}, {}", a.text()));
        d
    }

    /// `d = a` (u32 / f32 / u64 by the register's class).
    pub fn mov(&mut self, class: RegClass, a: &dyn Operand) -> Reg {
        let opcode = match class {
            RegClass::B32 => "mov.u32",
            RegClass::B64 => "mov.u64",
            RegClass::F32 => "mov.f32",
            RegClass::B16 => "mov.b16",
            RegClass::Pred => "mov.pred",
        };
        self.op1(opcode, class, a)
    }

    /// Overwrites `d` with `a`.
    pub fn set(&mut self, d: Reg, a: &dyn Operand) {
        let opcode = match d.class {
            RegClass::B32 => "mov.u32",
            RegClass::B64 => "mov.u64",
            RegClass::F32 => "mov.f32",
            RegClass::B16 => "mov.b16",
            RegClass::Pred => "mov.pred",
        };
        self.emit(format!("{opcode} {d}, {}", a.text()));
    }

    /// `d = a + b` (u32).
    pub fn add_u32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("add.u32", RegClass::B32, a, b)
    }

    /// `d = a - b` (u32, wrapping).
    pub fn sub_u32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("sub.u32", RegClass::B32, a, b)
    }

    /// `d = a * b` (u32, low half).
    pub fn mul_u32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("mul.lo.u32", RegClass::B32, a, b)
    }

    /// `d = a * b + c` (u32, low half).
    pub fn mad_u32(&mut self, a: &dyn Operand, b: &dyn Operand, c: &dyn Operand) -> Reg {
        let d = self.reg(RegClass::B32);
        self.emit(format!(
            "mad.lo.u32 {d}, {}, {}, {}",
            a.text(),
            b.text(),
            c.text()
        ));
        d
    }

    /// `base + index * scale` as a 64-bit address.
    pub fn address(&mut self, base: Reg, index: &dyn Operand, scale: u32) -> Reg {
        let offset = self.reg(RegClass::B64);
        self.emit(format!("mul.wide.u32 {offset}, {}, {scale}", index.text()));
        self.op2("add.u64", RegClass::B64, &base, &offset)
    }

    /// `d = a + b` (f32).
    pub fn add_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("add.f32", RegClass::F32, a, b)
    }

    /// `d = a - b` (f32).
    pub fn sub_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("sub.f32", RegClass::F32, a, b)
    }

    /// `d = a * b` (f32, round to nearest).
    pub fn mul_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("mul.rn.f32", RegClass::F32, a, b)
    }

    /// `d = a * b + c` (f32, fused).
    pub fn fma_f32(&mut self, a: &dyn Operand, b: &dyn Operand, c: &dyn Operand) -> Reg {
        let d = self.reg(RegClass::F32);
        self.emit(format!(
            "fma.rn.f32 {d}, {}, {}, {}",
            a.text(),
            b.text(),
            c.text()
        ));
        d
    }

    /// `acc += a * b` in place (f32, fused).
    pub fn fma_into(&mut self, acc: Reg, a: &dyn Operand, b: &dyn Operand) {
        self.emit(format!(
            "fma.rn.f32 {acc}, {}, {}, {acc}",
            a.text(),
            b.text()
        ));
    }

    /// `d = max(a, b)` (f32).
    pub fn max_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("max.f32", RegClass::F32, a, b)
    }

    /// `d = 1 / a` (f32, IEEE round to nearest).
    pub fn rcp_f32(&mut self, a: &dyn Operand) -> Reg {
        self.op1("rcp.rn.f32", RegClass::F32, a)
    }

    /// `d = 1 / a` (f32, within 1 ulp; one MUFU instruction where `rcp.rn` adds Newton steps
    /// and a special-case branch).
    pub fn rcp_approx_f32(&mut self, a: &dyn Operand) -> Reg {
        self.op1("rcp.approx.ftz.f32", RegClass::F32, a)
    }

    /// `d = a / b` (f32, IEEE round to nearest).
    pub fn div_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("div.rn.f32", RegClass::F32, a, b)
    }

    /// `d = a / b` (f32, full range, at most 2 ulp, no slow path): for divisors that are never
    /// subnormal, where the IEEE division's branchy sequence is not worth it.
    pub fn div_full_f32(&mut self, a: &dyn Operand, b: &dyn Operand) -> Reg {
        self.op2("div.full.f32", RegClass::F32, a, b)
    }

    /// `d = 1 / sqrt(a)` (f32, IEEE sqrt then IEEE division).
    pub fn rsqrt_f32(&mut self, a: &dyn Operand) -> Reg {
        let s = self.op1("sqrt.rn.f32", RegClass::F32, a);
        self.rcp_f32(&s)
    }

    /// `d = e^a` (f32) as `2^(a * log2 e)` with the hardware `ex2` (about 2 ulp).
    pub fn exp_f32(&mut self, a: &dyn Operand) -> Reg {
        let scaled = self.mul_f32(a, &F32(std::f32::consts::LOG2_E));
        self.op1("ex2.approx.ftz.f32", RegClass::F32, &scaled)
    }

    /// A predicate `a CMP b` (`cmp` like `lt.u32`, `ge.f32`).
    pub fn setp(&mut self, cmp: &str, a: &dyn Operand, b: &dyn Operand) -> Reg {
        let p = self.reg(RegClass::Pred);
        self.emit(format!("setp.{cmp} {p}, {}, {}", a.text(), b.text()));
        p
    }

    /// `d = p ? a : b`.
    pub fn selp(
        &mut self,
        class: RegClass,
        ty: &str,
        a: &dyn Operand,
        b: &dyn Operand,
        p: Reg,
    ) -> Reg {
        let d = self.reg(class);
        self.emit(format!("selp.{ty} {d}, {}, {}, {p}", a.text(), b.text()));
        d
    }

    /// Branches to `target` when `p` holds (`true`) or fails (`false`), or unconditionally. A
    /// conditional branch may diverge, so it is a plain `bra`; the unconditional one is uniform.
    pub fn bra(&mut self, p: Option<(Reg, bool)>, target: &Label) {
        match p {
            Some((p, true)) => self.emit(format!("@{p} bra {target}")),
            Some((p, false)) => self.emit(format!("@!{p} bra {target}")),
            None => self.emit(format!("bra.uni {target}")),
        }
    }

    /// `bar.sync 0`.
    pub fn barrier(&mut self) {
        self.emit("bar.sync 0");
    }

    /// Loads one element of `elem` from global `addr` as f32.
    pub fn ld_global(&mut self, elem: Elem, addr: Reg) -> Reg {
        match elem {
            Elem::F32 => self.op1("ld.global.f32", RegClass::F32, &Bracket(addr)),
            Elem::F16 | Elem::BF16 => {
                let h = self.op1("ld.global.b16", RegClass::B16, &Bracket(addr));
                self.op1(&format!("cvt.f32.{}", elem.name()), RegClass::F32, &h)
            }
        }
    }

    /// f32 `value` rounded to `elem` (nearest even) and back: what a store of it leaves.
    pub fn rounded(&mut self, elem: Elem, value: Reg) -> Reg {
        match elem {
            Elem::F32 => value,
            Elem::F16 | Elem::BF16 => {
                let h = self.op1(
                    &format!("cvt.rn.{}.f32", elem.name()),
                    RegClass::B16,
                    &value,
                );
                self.op1(&format!("cvt.f32.{}", elem.name()), RegClass::F32, &h)
            }
        }
    }

    /// Stores f32 `value` to global `addr` as `elem` (round to nearest even).
    pub fn st_global(&mut self, elem: Elem, addr: Reg, value: Reg) {
        match elem {
            Elem::F32 => self.emit(format!("st.global.f32 [{addr}], {value}")),
            Elem::F16 | Elem::BF16 => {
                let h = self.op1(
                    &format!("cvt.rn.{}.f32", elem.name()),
                    RegClass::B16,
                    &value,
                );
                self.emit(format!("st.global.b16 [{addr}], {h}"));
            }
        }
    }

    /// Loads the 16 bytes at global `addr` (16-byte aligned) as `16 / elem.bytes()` f32 values.
    pub fn ld_global_vec16(&mut self, elem: Elem, addr: Reg) -> Vec<Reg> {
        match elem {
            Elem::F32 => {
                let r: Vec<Reg> = (0..4).map(|_| self.reg(RegClass::F32)).collect();
                self.emit(format!(
                    "ld.global.v4.f32 {{{}, {}, {}, {}}}, [{addr}]",
                    r[0], r[1], r[2], r[3]
                ));
                r
            }
            Elem::F16 | Elem::BF16 => {
                let w = self.ld_global_words(addr);
                self.unpack_halves(elem, &w)
            }
        }
    }

    /// The four b32 words of 16 bytes at `addr` (16-byte aligned), as stored: for f16/bf16, to
    /// hold packed until used ([`Kernel::unpack_halves`]), in half the registers.
    pub fn ld_global_words(&mut self, addr: Reg) -> Vec<Reg> {
        let w: Vec<Reg> = (0..4).map(|_| self.reg(RegClass::B32)).collect();
        self.emit(format!(
            "ld.global.v4.b32 {{{}, {}, {}, {}}}, [{addr}]",
            w[0], w[1], w[2], w[3]
        ));
        w
    }

    /// b32 words of packed f16/bf16 pairs (`elem`) as f32 values, in memory order (the lower
    /// half first).
    pub fn unpack_halves(&mut self, elem: Elem, words: &[Reg]) -> Vec<Reg> {
        let mut out = Vec::with_capacity(2 * words.len());
        for word in words {
            let (lo, hi) = (self.reg(RegClass::B16), self.reg(RegClass::B16));
            self.emit(format!("mov.b32 {{{lo}, {hi}}}, {word}"));
            for h in [lo, hi] {
                out.push(self.op1(&format!("cvt.f32.{}", elem.name()), RegClass::F32, &h));
            }
        }
        out
    }

    /// f32 values rounded (to nearest even) to f16/bf16 (`elem`) and packed in pairs into b32
    /// words, in memory order: the inverse of [`Kernel::unpack_halves`].
    pub fn pack_halves(&mut self, elem: Elem, values: &[Reg]) -> Vec<Reg> {
        values
            .chunks(2)
            .map(|pair| {
                let w = self.reg(RegClass::B32);
                // The first operand goes to the upper half.
                self.emit(format!(
                    "cvt.rn.{}x2.f32 {w}, {}, {}",
                    elem.name(),
                    pair[1],
                    pair[0]
                ));
                w
            })
            .collect()
    }

    /// Stores `16 / elem.bytes()` f32 values to global `addr` (16-byte aligned) as `elem`.
    pub fn st_global_vec16(&mut self, elem: Elem, addr: Reg, values: &[Reg]) {
        match elem {
            Elem::F32 => self.emit(format!(
                "st.global.v4.f32 [{addr}], {{{}, {}, {}, {}}}",
                values[0], values[1], values[2], values[3]
            )),
            Elem::F16 | Elem::BF16 => {
                let words = self.pack_halves(elem, values);
                self.emit(format!(
                    "st.global.v4.b32 [{addr}], {{{}, {}, {}, {}}}",
                    words[0], words[1], words[2], words[3]
                ));
            }
        }
    }

    /// Loads an i64 from global `addr`.
    pub fn ld_global_i64(&mut self, addr: Reg) -> Reg {
        self.op1("ld.global.s64", RegClass::B64, &Bracket(addr))
    }

    /// The 16 bytes at shared address `addr` as four b32 words.
    pub fn ld_shared_words(&mut self, addr: Reg) -> [Reg; 4] {
        let w: [Reg; 4] = std::array::from_fn(|_| self.reg(RegClass::B32));
        self.emit(format!(
            "ld.shared.v4.b32 {{{}, {}, {}, {}}}, [{addr}]",
            w[0], w[1], w[2], w[3]
        ));
        w
    }

    /// Stores four b32 words as the 16 bytes at shared address `addr`.
    pub fn st_shared_words(&mut self, addr: Reg, w: &[Reg; 4]) {
        self.emit(format!(
            "st.shared.v4.b32 [{addr}], {{{}, {}, {}, {}}}",
            w[0], w[1], w[2], w[3]
        ));
    }

    /// `c += a b` with `mma.sync.aligned.m16n8k16` on `ty` (f16/bf16) operands and f32
    /// accumulators: `a` the four A-fragment registers, `b` the two B-fragment ones.
    pub fn mma_m16n8k16(&mut self, ty: &str, c: &[Reg], a: &[Reg], b: &[Reg; 2]) {
        self.emit(format!(
            "mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{}, {}, {}, {}}}, {{{}, {}, {}, {}}}, {{{}, {}}}, {{{}, {}, {}, {}}}",
            c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]
        ));
    }

    /// `ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16` at `[addr + offset]` (`trans`: `""` or
    /// `".trans"`): four 8x8 matrices of 16-bit values, a register of each per thread.
    pub fn ldmatrix_x4(&mut self, trans: &str, addr: Reg, offset: u32) -> Vec<Reg> {
        let r: Vec<Reg> = (0..4).map(|_| self.reg(RegClass::B32)).collect();
        self.emit(format!(
            "ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{{}, {}, {}, {}}}, [{addr}+{offset}]",
            r[0], r[1], r[2], r[3]
        ));
        r
    }

    /// Adds `value` across a warp (butterfly shuffles); every lane gets the sum.
    pub fn warp_sum(&mut self, value: Reg) -> Reg {
        self.warp_reduce(value, "add.f32", RegClass::F32)
    }

    /// Reduces the 32-bit `value` across a warp with the binary op `op` (`max.f32`, `add.f32`,
    /// ...) of registers of `class` (butterfly shuffles); every lane gets the result.
    pub fn warp_reduce(&mut self, value: Reg, op: &str, class: RegClass) -> Reg {
        let mut acc = value;
        for offset in [16u32, 8, 4, 2, 1] {
            let other = self.reg(class);
            self.emit(format!(
                "shfl.sync.bfly.b32 {other}, {acc}, {offset}, 31, -1"
            ));
            acc = self.op2(op, class, &acc, &other);
        }
        acc
    }

    /// The kernel's text.
    pub fn finish(self) -> String {
        let mut out = String::new();
        for line in &self.preamble {
            writeln!(out, "{line}").expect("writing to a String");
        }
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(n, t)| match t {
                ParamType::Ptr => format!("\t.param .u64 {n}"),
                ParamType::U32 => format!("\t.param .u32 {n}"),
                ParamType::F32 => format!("\t.param .f32 {n}"),
                ParamType::TensorMap(_) => format!("\t.param .align 64 .b8 {n}[128]"),
            })
            .collect();
        writeln!(
            out,
            ".visible .entry {}(\n{}\n)",
            self.name,
            params.join(",\n")
        )
        .expect("writing to a String");
        for d in &self.directives {
            writeln!(out, "{d}").expect("writing to a String");
        }
        out.push_str("{\n");
        for class in RegClass::ALL {
            let n = self.counts[class.index()];
            if n > 0 {
                writeln!(out, "\t.reg {} %{}<{n}>;", class.decl(), class.prefix())
                    .expect("writing to a String");
            }
        }
        for s in &self.shared {
            writeln!(out, "{s}").expect("writing to a String");
        }
        out.push_str("\tgriddepcontrol.launch_dependents;\n");
        if !self.waited {
            out.push_str("\tgriddepcontrol.wait;\n");
        }
        out.push_str(&self.body);
        out.push_str("\tret;\n}\n");
        out
    }
}

/// `[reg]`: a register used as an address.
pub struct Bracket(pub Reg);

impl Operand for Bracket {
    fn text(&self) -> String {
        format!("[{}]", self.0)
    }
}

/// A PTX module: the header and its kernels.
pub fn module(kernels: &[String]) -> String {
    module_for(TARGET, kernels)
}

/// A PTX module for `target`: `sm_90` for the base image's kernels (Ampere's `cp.async`,
/// `ldmatrix` and `mma.sync`, and Hopper's `griddepcontrol`), `sm_90a` for the
/// [`crate::Image::Sm90a`] kernels (wgmma, setmaxnreg).
pub fn module_for(target: &str, kernels: &[String]) -> String {
    let mut out = format!(".version {PTX_VERSION}\n.target {target}\n.address_size 64\n\n");
    for k in kernels {
        out.push_str(k);
        out.push('\n');
    }
    out
}
