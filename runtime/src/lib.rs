//! kiln's runtime (filled by the artifact/runtime issue): it will load and verify a compiled
//! artifact, allocate one device arena, capture one CUDA graph per bucket at load and replay them,
//! and provide the `kiln-run` binary.
//!
//! Invariant, kept from the first commit: this crate depends on `kiln-ir` (for the artifact schema)
//! and never on the compiler, egg or cranelift, so that a deployment links the runtime alone.
