//! Hugging Face checkpoint importers: a folder with `config.json` and safetensors weights becomes an
//! unfused kiln IR graph whose weight nodes are named by the checkpoint's own keys.
//!
//! One module per family: [`gpt2`], [`llama`] (Llama, Mistral, Qwen2), [`bert`] (with
//! sentence-transformers pooling). [`layers`] holds what the families share; [`inputs`] turns token
//! ids into the graph's inputs.

pub mod bert;
pub mod checkpoint;
pub mod config;
pub mod gpt2;
pub mod inputs;
pub mod layers;
pub mod llama;

use std::path::{Path, PathBuf};

use kiln_ir::{Graph, IrError};

pub use checkpoint::Checkpoint;
use config::Config;
pub use layers::ImportOptions;
use layers::ModelBuilder;

/// Errors importing a checkpoint or preparing its inputs.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model path is not a folder.
    #[error("model folder {0} does not exist or is not a folder")]
    NotAFolder(PathBuf),
    /// A file could not be read.
    #[error("cannot read {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error (in the message itself, not as a source, so a printed chain says it once).
        error: std::io::Error,
    },
    /// A JSON file is malformed.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Neither `model.safetensors` nor `model.safetensors.index.json` is in the folder.
    #[error("{0} has no model.safetensors or model.safetensors.index.json")]
    NoWeights(PathBuf),
    /// A safetensors file is malformed.
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A config field is missing, malformed or unsupported.
    #[error("config.json: `{field}` {message}")]
    Config {
        /// The field (dotted for nested ones).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor the architecture needs is missing.
    #[error("tensor `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// Checkpoint key.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
    /// A tensor has a dtype kiln does not read.
    #[error("tensor `{name}` has dtype {dtype}; kiln reads F32, F16 and BF16 weights")]
    TensorDtype {
        /// Checkpoint key.
        name: String,
        /// The stored dtype.
        dtype: String,
    },
    /// A model input is invalid (wrong dtype or rank, id out of range, ...).
    #[error("{0}")]
    Input(String),
    /// Building the graph failed (an importer bug, or a config the IR rejects).
    #[error("graph construction: {0}")]
    Ir(#[from] IrError),
}

/// What a model computes, which decides its inputs and outputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// A causal language model: output `logits`.
    Decoder {
        /// Vocabulary size.
        vocab_size: usize,
        /// Length of the learned position table, if the model has one.
        max_positions: Option<usize>,
    },
    /// An encoder: output `last_hidden_state` (and `sentence_embedding`).
    Encoder {
        /// Vocabulary size.
        vocab_size: usize,
        /// Length of the learned position table.
        max_positions: usize,
        /// Size of the token type table (`token_type_ids` are below it).
        type_vocab_size: usize,
        /// Whether the graph also outputs `sentence_embedding`.
        sentence_embedding: bool,
    },
}

/// An imported model: the graph, what kind of model it is, and the checkpoint for its weights.
pub struct Model {
    /// The unfused graph, symbolic in batch `B` and sequence `S`.
    pub graph: Graph,
    /// Decoder or encoder, with the sizes input validation needs.
    pub kind: ModelKind,
    /// The architecture name from `config.json`.
    pub architecture: String,
    /// The weights.
    pub checkpoint: Checkpoint,
}

/// The architectures kiln imports.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "BertModel",
];

/// Imports the checkpoint folder `dir` as an f32 inference graph.
pub fn import(dir: &Path) -> Result<Model, ModelError> {
    import_with(dir, &ImportOptions::default())
}

/// Imports the checkpoint folder `dir` with `options` (dtype, dropout).
pub fn import_with(dir: &Path, options: &ImportOptions) -> Result<Model, ModelError> {
    import_checkpoint(Checkpoint::open(dir)?, options)
}

/// Builds the graph from `dir/config.json` alone (plan-only compilation; nothing can be evaluated).
pub fn import_config_only(dir: &Path, options: &ImportOptions) -> Result<Model, ModelError> {
    import_checkpoint(Checkpoint::open_config_only(dir)?, options)
}

fn import_checkpoint(checkpoint: Checkpoint, options: &ImportOptions) -> Result<Model, ModelError> {
    let config = Config::new(checkpoint.config());
    let architecture = match config.get("architectures").and_then(|a| a.get(0)) {
        Some(a) => a.as_str().unwrap_or_default().to_string(),
        None => match config.opt_str("model_type")? {
            Some("gpt2") => "GPT2LMHeadModel".into(),
            Some("llama") => "LlamaForCausalLM".into(),
            Some("mistral") => "MistralForCausalLM".into(),
            Some("qwen2") => "Qwen2ForCausalLM".into(),
            Some("bert") => "BertModel".into(),
            _ => return Err(config.unsupported("model_type", "no `architectures` either")),
        },
    };
    let mut mb = ModelBuilder::new(&checkpoint, options);
    let kind = match architecture.as_str() {
        "GPT2LMHeadModel" => gpt2::build(&mut mb, &gpt2::Gpt2Config::from_config(&config)?)?,
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            let flavor = match architecture.as_str() {
                "LlamaForCausalLM" => llama::LlamaFlavor::Llama,
                "MistralForCausalLM" => llama::LlamaFlavor::Mistral,
                _ => llama::LlamaFlavor::Qwen2,
            };
            llama::build(&mut mb, &llama::LlamaConfig::from_config(&config, flavor)?)?
        }
        "BertModel" => bert::build(&mut mb, &bert::BertConfig::from_config(&config)?)?,
        other => {
            return Err(ModelError::Config {
                field: "architectures".into(),
                message: format!(
                    "= \"{other}\" is not supported (kiln imports {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            })
        }
    };
    let graph = mb.g;
    Ok(Model {
        graph,
        kind,
        architecture,
        checkpoint,
    })
}
