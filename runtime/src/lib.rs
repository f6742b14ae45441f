//! kiln's runtime: loads and verifies a compiled artifact and runs requests on it; the `kiln-run`
//! binary.
//!
//! - [`artifact`]: opening an artifact (checksums and format version verified first);
//! - [`weights`]: the memory-mapped weights (and, checked against the memory plan, the region a
//!   GPU executor uploads as it is);
//! - [`cpu`]: the CPU executor: the artifact's generated kernels and a GEMM library over the
//!   same plans;
//! - [`blocks`]: the blocks of a paged KV cache and its block table;
//! - [`cuda`]: the CUDA executor: one allocation, graphs captured at load, replayed per request;
//! - [`executor`]: the executor a command runs on (CUDA, or the interpreter without a GPU);
//! - [`forward`]: a request through the smallest prefill bucket that holds it;
//! - [`groups`]: a bucket of many rows run as groups of a smaller one, each group's outputs
//!   copied to the host while the next computes;
//! - [`generate`]: token generation through the decode graph and its KV cache;
//! - [`batcher`]: continuous batching over the decode buckets, and [`pacing`]: which prompt chunk
//!   a step takes, timed against the decode steps;
//! - [`bench`](mod@bench): latency percentiles, throughput and memory over a stream of requests;
//! - [`tokenizer`]: text to ids and back with the artifact's `tokenizer.json`.
//!
//! Invariant: this crate depends on `kiln-ir` (for the artifact schema, the input contract and,
//! until the CPU backend lands, the reference interpreter) and never on the compiler, egg or
//! cranelift, so that a deployment links the runtime alone.

pub mod artifact;
pub mod batcher;
pub mod bench;
pub mod blocks;
pub mod cli;
pub mod cpu;
pub mod cuda;
pub mod executor;
pub mod forward;
pub mod generate;
pub mod groups;
pub mod pacing;
pub mod serve;
pub mod tokenizer;
pub mod weights;

pub use artifact::Artifact;
pub use executor::{Device, Executor, Work};

/// Errors of the runtime, each one line.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// An artifact file is missing, corrupt, or of another format.
    #[error("{file}: {message}")]
    Artifact {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// A request does not fit the artifact.
    #[error("{0}")]
    Request(String),
    /// The GPU is missing, too small, or failed.
    #[error("{0}")]
    Device(String),
}
