//! kiln's tensor IR.
//!
//! - [`dim`]: symbolic dimensions (`B`, `S`, `T` and polynomials over them);
//! - [`dtype`]: element and tensor types;
//! - [`op`]: the primitive ops and their typing rules;
//! - [`graph`]: the SSA graph (petgraph), its builder and its RON text form;
//! - [`kernel`]: the kernel ops the compiler extracts, each defined by its decomposition;
//! - [`interp`]: the reference interpreter, the definition of every op;
//! - [`philox`]: Philox-4x32-10 and the dropout mask every backend shares;
//! - [`rope`]: rotary embedding frequencies;
//! - [`inputs`]: model inputs from token ids (validation, positions), shared by every executor;
//! - [`artifact`]: the compiled artifact's schema (manifest, checksums);
//! - [`io`]: tensors to and from safetensors files, written beside their destination and renamed.
//!
//! This crate depends on nothing else of kiln's.

pub mod artifact;
pub mod checksum;
pub mod dim;
pub mod dtype;
pub mod graph;
mod infer;
pub mod inputs;
pub mod interp;
pub mod io;
pub mod kernel;
pub mod op;
pub mod philox;
pub mod rope;
pub mod sampling;
pub mod tensor;

pub use dim::{Dim, Shape};
pub use dtype::{DType, TensorType};
pub use graph::{Graph, Node, NodeId, Output};
pub use interp::{evaluate, WeightSource};
pub use op::{BinaryOp, Op, ReduceOp, UnaryOp, MASK_NEG};
pub use rope::RopeScaling;
pub use tensor::{Data, Tensor};

/// Errors building or reading a graph.
#[derive(Debug, thiserror::Error)]
pub enum IrError {
    /// An op's operands violate its typing rule.
    #[error("node {node} ({op}): {message}")]
    Type {
        /// The node being added.
        node: NodeId,
        /// The op's name.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// An operand refers to a node that does not exist.
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
    /// Two inputs share a name.
    #[error("duplicate input `{0}`")]
    DuplicateInput(String),
    /// Two outputs share a name.
    #[error("duplicate output `{0}`")]
    DuplicateOutput(String),
    /// The RON text is malformed or inconsistent.
    #[error("graph text: {0}")]
    Text(String),
}

/// Errors evaluating a graph.
#[derive(Debug, thiserror::Error)]
pub enum InterpError {
    /// A declared input was not supplied.
    #[error("missing input `{0}`")]
    MissingInput(String),
    /// A supplied input is not declared by the graph.
    #[error("unknown input `{0}`")]
    UnknownInput(String),
    /// An input's dtype or shape does not fit its declaration.
    #[error("input `{name}` must be {expected}, found {found}")]
    InputType {
        /// Input name.
        name: String,
        /// Declared type.
        expected: String,
        /// Supplied dtype and shape.
        found: String,
    },
    /// A weight could not be loaded.
    #[error("weight `{name}`: {message}")]
    Weight {
        /// Checkpoint key.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// An op failed on its values (id out of range, bad slice, ...).
    #[error("node {node} ({op}): {message}")]
    Op {
        /// The node.
        node: NodeId,
        /// The op's name.
        op: &'static str,
        /// What went wrong.
        message: String,
    },
}
