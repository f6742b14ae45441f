//! CPU code generation with Cranelift, ahead of time: `kiln compile` builds every CPU kernel of
//! an artifact into one object file (`cranelift-object`) and links it into a shared library
//! with the system C compiler (`cc -shared`); the runtime loads that library and never links
//! Cranelift. JIT compilation at load was ruled out for that reason: a deployment links the
//! runtime alone, and nothing is compiled after `kiln compile`.
//!
//! Every generated function has one signature, so an executor can call any of them the same way
//! and split its work across threads:
//!
//! ```text
//! extern "C" fn kernel(args: *const u64, begin: u64, end: u64)
//! ```
//!
//! `args` holds the kernel's parameters in order (pointers as addresses, integers widened);
//! `begin..end` is the slice of the kernel's parallel axis (rows for row kernels) this call does.
//!
//! - [`module`] — the object module, the function builder helpers, linking;
//! - [`attention`] — fused attention per query row (online softmax), prefill and decode;
//! - [`math`] — `exp` and `1 + erf` for `f32` and `f32x4`;
//! - [`elementwise`] — activations, f32x4;
//! - [`epilogue`] — a product's bias / activation / SwiGLU / residual tail (the product itself
//!   is computed by a CPU GEMM library the executor calls), f32x4;
//! - [`embedding`] — summed embedding lookups, f32x4;
//! - [`kv_cache`] — writes into a KV cache in place, RoPE on the way, f32x4;
//! - `paging` — rows of a dense or paged KV cache;
//! - [`norm`] — LayerNorm / RMSNorm rows (with the residual add), f32x4;
//! - [`sampling`] — token choice (greedy, temperature, top-k, top-p) by bisection, scalar;
//! - [`strided`] — primitive ops over strided operands (what no fused kernel covers: pooling heads),
//!   scalar.

pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod epilogue;
pub mod kv_cache;
pub mod math;
pub mod module;
pub mod norm;
pub(crate) mod paging;
pub mod sampling;
pub mod strided;

pub use module::{link_shared, CpuError, CpuModule};
