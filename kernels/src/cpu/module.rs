//! The object module every CPU kernel of an artifact is generated into, the helpers the
//! generators share (argument loads, counted loops, f32x4 sums), and linking the object into a
//! shared library.
//!
//! Code is generated for a fixed level of the host's architecture, not for the compiling
//! machine's extensions: x86-64-v3 (AVX2, FMA) on x86-64, the base ISA (NEON, FMA) on aarch64;
//! the library's name says which, and the runtime checks the CPU before loading it.

use std::path::Path;

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::{F32, F32X4, I64};
use cranelift_codegen::ir::{AbiParam, InstBuilder, MemFlagsData, Value};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_module::{default_libcall_names, Linkage, Module};
use cranelift_object::{ObjectBuilder, ObjectModule};

/// Why CPU code could not be generated or linked, as one line.
#[derive(Debug, thiserror::Error)]
#[error("CPU code generation: {0}")]
pub struct CpuError(pub String);

fn err(e: impl std::fmt::Display) -> CpuError {
    CpuError(e.to_string())
}

/// An object file under construction: functions of the kernel signature
/// `fn(args: *const u64, begin: u64, end: u64)`.
pub struct CpuModule {
    module: ObjectModule,
    ctx: cranelift_codegen::Context,
    fctx: FunctionBuilderContext,
}

/// The three parameters every kernel receives.
#[derive(Clone, Copy)]
pub struct KernelParams {
    /// Address of the argument array.
    pub args: Value,
    /// First index of the parallel axis this call does.
    pub begin: Value,
    /// One past the last.
    pub end: Value,
}

impl CpuModule {
    /// A module for the host architecture's baseline, optimised for speed, position independent.
    pub fn new() -> Result<CpuModule, CpuError> {
        let mut flags = settings::builder();
        flags.set("opt_level", "speed").map_err(err)?;
        flags.set("is_pic", "true").map_err(err)?;
        let mut isa =
            cranelift_codegen::isa::lookup_by_name(std::env::consts::ARCH).map_err(err)?;
        if std::env::consts::ARCH == "x86_64" {
            // x86-64-v3 (AVX2, FMA, BMI; every x86 server since 2013): without it `fma` and
            // `nearest` become library calls. The runtime checks the CPU before loading.
            isa.enable("x86-64-v3").map_err(err)?;
            // The preset leaves `has_avx` (which AVX2 implies) off, and the VEX forms need it.
            isa.enable("has_avx").map_err(err)?;
        }
        let isa = isa.finish(settings::Flags::new(flags)).map_err(err)?;
        let builder =
            ObjectBuilder::new(isa, "kiln_cpu_kernels", default_libcall_names()).map_err(err)?;
        Ok(CpuModule {
            module: ObjectModule::new(builder),
            ctx: cranelift_codegen::Context::new(),
            fctx: FunctionBuilderContext::new(),
        })
    }

    /// Defines the exported function `name` with the kernel signature; `body` emits its code
    /// from the entry block (the return is added after it).
    pub fn define(
        &mut self,
        name: &str,
        body: impl FnOnce(&mut FunctionBuilder, KernelParams),
    ) -> Result<(), CpuError> {
        let mut sig = self.module.make_signature();
        for _ in 0..3 {
            sig.params.push(AbiParam::new(I64));
        }
        let id = self
            .module
            .declare_function(name, Linkage::Export, &sig)
            .map_err(err)?;
        self.ctx.func.signature = sig;
        let frontend = self.module.isa().frontend_config();
        {
            let mut b = FunctionBuilder::new(&mut self.ctx.func, &mut self.fctx);
            let entry = b.create_block();
            b.append_block_params_for_function_params(entry);
            b.switch_to_block(entry);
            b.seal_block(entry);
            let p = b.block_params(entry).to_vec();
            body(
                &mut b,
                KernelParams {
                    args: p[0],
                    begin: p[1],
                    end: p[2],
                },
            );
            b.ins().return_(&[]);
            b.finalize(frontend);
        }
        self.module
            .define_function(id, &mut self.ctx)
            .map_err(|e| CpuError(format!("{name}: {e:?}")))?;
        self.module.clear_context(&mut self.ctx);
        Ok(())
    }

    /// The object file's bytes.
    pub fn finish(self) -> Result<Vec<u8>, CpuError> {
        self.module.finish().emit().map_err(err)
    }
}

/// Links `object` into the shared library `out` with `$CC` (default `cc`).
pub fn link_shared(object: &[u8], out: &Path) -> Result<(), CpuError> {
    let obj = out.with_extension("o");
    std::fs::write(&obj, object).map_err(|e| CpuError(format!("{}: {e}", obj.display())))?;
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let status = std::process::Command::new(&cc)
        .arg("-shared")
        .arg("-o")
        .arg(out)
        .arg(&obj)
        .output()
        .map_err(|e| {
            CpuError(format!(
                "cannot run the C compiler `{}` that links the CPU kernels (set CC, install one, or compile with --target cuda): {e}",
                cc.to_string_lossy()
            ))
        })?;
    let _ = std::fs::remove_file(&obj);
    if !status.status.success() {
        let first = String::from_utf8_lossy(&status.stderr)
            .lines()
            .next()
            .unwrap_or("no message")
            .to_string();
        return Err(CpuError(format!(
            "linking {} failed: {first}",
            out.display()
        )));
    }
    Ok(())
}

/// The `i`-th argument (an address or a widened integer).
pub fn arg(b: &mut FunctionBuilder, p: KernelParams, i: u32) -> Value {
    b.ins()
        .load(I64, MemFlagsData::trusted(), p.args, (i * 8) as i32)
}

/// The kernel's arguments, read in parameter order.
pub struct Args {
    params: KernelParams,
    next: u32,
}

impl Args {
    /// Reads from the first parameter on.
    pub fn new(params: KernelParams) -> Args {
        Args { params, next: 0 }
    }

    /// The next parameter's value.
    pub fn next(&mut self, b: &mut FunctionBuilder) -> Value {
        self.next += 1;
        arg(b, self.params, self.next - 1)
    }
}

/// `for i in (start..end).step_by(step) { body(i) }`, `i` an `i64`.
pub fn for_range(
    b: &mut FunctionBuilder,
    start: Value,
    end: Value,
    step: i64,
    mut body: impl FnMut(&mut FunctionBuilder, Value),
) {
    let header = b.create_block();
    let block = b.create_block();
    let exit = b.create_block();
    b.append_block_param(header, I64);
    b.ins().jump(header, &[start.into()]);
    b.switch_to_block(header);
    let i = b.block_params(header)[0];
    let more = b.ins().icmp(IntCC::UnsignedLessThan, i, end);
    b.ins().brif(more, block, &[], exit, &[]);
    b.switch_to_block(block);
    b.seal_block(block);
    body(b, i);
    let next = b.ins().iadd_imm_s(i, step);
    b.ins().jump(header, &[next.into()]);
    b.seal_block(header);
    b.switch_to_block(exit);
    b.seal_block(exit);
}

/// The sum of an f32x4's lanes.
pub fn lane_sum(b: &mut FunctionBuilder, v: Value) -> Value {
    let lanes: Vec<Value> = (0..4).map(|l| b.ins().extractlane(v, l)).collect();
    let a = b.ins().fadd(lanes[0], lanes[1]);
    let c = b.ins().fadd(lanes[2], lanes[3]);
    b.ins().fadd(a, c)
}

/// `base + index * 4` (an f32 element's address).
pub fn f32_addr(b: &mut FunctionBuilder, base: Value, index: Value) -> Value {
    let offset = b.ins().imul_imm_s(index, 4);
    b.ins().iadd(base, offset)
}

/// An f32x4 of `x` in every lane.
pub fn splat(b: &mut FunctionBuilder, x: Value) -> Value {
    b.ins().splat(F32X4, x)
}

/// The f32 constant `v`.
pub fn f32_const(b: &mut FunctionBuilder, v: f32) -> Value {
    b.ins().f32const(v)
}

/// The f32 zero vector.
pub fn zero_x4(b: &mut FunctionBuilder) -> Value {
    let z = b.ins().f32const(0.0);
    b.ins().splat(F32X4, z)
}

/// Loads (`F32` or `F32X4`) at `addr`; unaligned accesses are allowed.
pub fn load(b: &mut FunctionBuilder, ty: cranelift_codegen::ir::Type, addr: Value) -> Value {
    b.ins().load(ty, UNALIGNED, addr, 0)
}

/// Stores `v` at `addr`.
pub fn store(b: &mut FunctionBuilder, v: Value, addr: Value) {
    b.ins().store(UNALIGNED, v, addr, 0);
}

/// Tensor accesses: possibly unaligned (rows of odd lengths), never trapping (kernels only touch
/// memory the executor handed them).
const UNALIGNED: MemFlagsData = MemFlagsData::new().with_notrap();

/// Scalar f32 type, for callers.
pub const SCALAR: cranelift_codegen::ir::Type = F32;
/// Four-lane f32 vector type, for callers.
pub const VECTOR: cranelift_codegen::ir::Type = F32X4;

/// `if cond != 0 { then(..) }`.
pub fn if_then(b: &mut FunctionBuilder, cond: Value, then: impl FnOnce(&mut FunctionBuilder)) {
    let block = b.create_block();
    let merge = b.create_block();
    b.ins().brif(cond, block, &[], merge, &[]);
    b.switch_to_block(block);
    b.seal_block(block);
    then(b);
    b.ins().jump(merge, &[]);
    b.switch_to_block(merge);
    b.seal_block(merge);
}

/// The i64 at `base + index * 8` (token ids, masks, positions).
pub fn load_i64(b: &mut FunctionBuilder, base: Value, index: Value) -> Value {
    let offset = b.ins().imul_imm_s(index, 8);
    let addr = b.ins().iadd(base, offset);
    b.ins().load(I64, MemFlagsData::trusted(), addr, 0)
}

/// `f(i, F32X4)` for the multiples of four below `n`, then `f(i, F32)` for the rest.
pub fn lanes(
    b: &mut FunctionBuilder,
    n: u32,
    mut f: impl FnMut(&mut FunctionBuilder, Value, cranelift_codegen::ir::Type),
) {
    let zero = b.ins().iconst(I64, 0);
    let split = b.ins().iconst(I64, i64::from(n / 4 * 4));
    let end = b.ins().iconst(I64, i64::from(n));
    for_range(b, zero, split, 4, |b, i| f(b, i, VECTOR));
    for_range(b, split, end, 1, |b, i| f(b, i, SCALAR));
}

/// The sum over `i < n` of `term(i, type)`, evaluated four lanes at a time (`F32X4`) and then for
/// the scalar tail (`F32`).
pub fn sum_lanes(
    b: &mut FunctionBuilder,
    n: u32,
    mut term: impl FnMut(&mut FunctionBuilder, Value, cranelift_codegen::ir::Type) -> Value,
) -> Value {
    let acc = b.declare_var(VECTOR);
    let tail = b.declare_var(SCALAR);
    let z = zero_x4(b);
    b.def_var(acc, z);
    let z = f32_const(b, 0.0);
    b.def_var(tail, z);
    lanes(b, n, |b, i, ty| {
        let t = term(b, i, ty);
        let var = if ty == VECTOR { acc } else { tail };
        let cur = b.use_var(var);
        let s = b.ins().fadd(cur, t);
        b.def_var(var, s);
    });
    let v = b.use_var(acc);
    let lanes_total = lane_sum(b, v);
    let t = b.use_var(tail);
    b.ins().fadd(lanes_total, t)
}

/// Like [`lanes`], unrolled: `f(i, F32X4)` for each multiple of four below `n` and `f(i, F32)`
/// for the tail, as straight-line code (for short static lengths such as a head dimension).
pub fn lanes_unrolled(
    b: &mut FunctionBuilder,
    n: u32,
    mut f: impl FnMut(&mut FunctionBuilder, Value, cranelift_codegen::ir::Type),
) {
    for i in (0..n / 4 * 4).step_by(4) {
        let c = b.ins().iconst(I64, i64::from(i));
        f(b, c, VECTOR);
    }
    for i in n / 4 * 4..n {
        let c = b.ins().iconst(I64, i64::from(i));
        f(b, c, SCALAR);
    }
}

/// Like [`sum_lanes`], unrolled (see [`lanes_unrolled`]); the vector terms are added in a tree.
pub fn sum_lanes_unrolled(
    b: &mut FunctionBuilder,
    n: u32,
    mut term: impl FnMut(&mut FunctionBuilder, Value, cranelift_codegen::ir::Type) -> Value,
) -> Value {
    let mut vectors = Vec::new();
    let mut scalars = Vec::new();
    lanes_unrolled(b, n, |b, c, ty| {
        let t = term(b, c, ty);
        if ty == VECTOR {
            vectors.push(t);
        } else {
            scalars.push(t);
        }
    });
    while vectors.len() > 1 {
        let mut next = Vec::with_capacity(vectors.len().div_ceil(2));
        for pair in vectors.chunks(2) {
            next.push(match pair {
                [a, c] => b.ins().fadd(*a, *c),
                [a] => *a,
                _ => unreachable!("chunks of two"),
            });
        }
        vectors = next;
    }
    let mut total = match vectors.first() {
        Some(v) => lane_sum(b, *v),
        None => f32_const(b, 0.0),
    };
    for s in scalars {
        total = b.ins().fadd(total, s);
    }
    total
}

/// Folds `step(i, type, accumulator)` over `i < n` (a run-time count): four lanes at a time into
/// the vector accumulator (starting at `init_vector`), then the tail into the scalar one
/// (starting at `init_scalar`); returns both.
pub fn fold_lanes(
    b: &mut FunctionBuilder,
    n: Value,
    init_vector: Value,
    init_scalar: Value,
    mut step: impl FnMut(&mut FunctionBuilder, Value, cranelift_codegen::ir::Type, Value) -> Value,
) -> (Value, Value) {
    let vector = b.declare_var(VECTOR);
    let scalar = b.declare_var(SCALAR);
    b.def_var(vector, init_vector);
    b.def_var(scalar, init_scalar);
    let zero = b.ins().iconst(I64, 0);
    let whole = b.ins().band_imm_s(n, !3i64);
    for_range(b, zero, whole, 4, |b, i| {
        let acc = b.use_var(vector);
        let next = step(b, i, VECTOR, acc);
        b.def_var(vector, next);
    });
    for_range(b, whole, n, 1, |b, i| {
        let acc = b.use_var(scalar);
        let next = step(b, i, SCALAR, acc);
        b.def_var(scalar, next);
    });
    (b.use_var(vector), b.use_var(scalar))
}
