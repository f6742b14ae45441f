//! The safetensors input/output `kiln eval` exchanges with its users lives in `kiln_ir::io`, shared
//! with the runtime; re-exported here for the compiler's callers.

pub use kiln_ir::io::{parent_folder, read_tensors, write_atomically, write_tensors};
