//! The kiln compiler driver.
//!
//! Today it imports checkpoints (through `kiln-models`), prints their IR and evaluates them with the
//! reference interpreter; e-graph fusion, buckets and code generation land here next. The
//! command-line interface lives in [`cli`] so that tests can drive it in-process.

pub mod cli;
pub mod tensor_io;
pub mod tokenize;
