//! The kiln compiler driver.
//!
//! It imports checkpoints (through `kiln-models`), fuses them with an e-graph ([`fusion`]), turns
//! every sequence-length bucket ([`bucket`]) into a static fused graph ([`compile`]) and evaluates
//! graphs with the reference interpreter. The command-line interface lives in [`cli`] so that
//! tests can drive it in-process.

pub mod bucket;
pub mod cli;
pub mod compile;
pub mod fold;
pub mod fusion;
pub mod lower;
pub mod memory;
pub mod plan;
pub mod progress;
pub mod staging;
pub mod tensor_io;
pub mod tokenize;
pub mod weights;
pub mod widen;
pub mod writer;
