//! kiln's kernel generators (filled by the PTX code-generation issue and the CPU backend issue).
//!
//! This crate will hold one module per kernel kind (attention, decode attention, GEMM with its
//! epilogues, norms, embedding, elementwise chains, sampling), each returning PTX text plus its
//! typed `KernelSignature` and launch configuration, and the Cranelift generators of the CPU
//! backend. It depends on `kiln-ir` only. Nothing is generated yet: the compiler does not extract
//! kernel ops until the fusion issue lands.
