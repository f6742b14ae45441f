//! Model inputs from token ids: the contract lives in `kiln_ir::inputs` (shared with the runtime);
//! here a `Model` supplies its side of it.

use std::collections::BTreeMap;

pub use kiln_ir::inputs::{model_inputs, InputContract, TokenBatch};
use kiln_ir::Tensor;

use crate::{Model, ModelError, ModelKind};

impl Model {
    /// The input contract of this model.
    pub fn contract(&self) -> InputContract {
        match &self.kind {
            ModelKind::Decoder {
                vocab_size,
                max_positions,
            } => InputContract {
                decoder: true,
                vocab_size: *vocab_size,
                max_positions: *max_positions,
                type_vocab_size: None,
            },
            ModelKind::Encoder {
                vocab_size,
                max_positions,
                type_vocab_size,
                ..
            } => InputContract {
                decoder: false,
                vocab_size: *vocab_size,
                max_positions: Some(*max_positions),
                type_vocab_size: Some(*type_vocab_size),
            },
        }
    }

    /// Validates `batch` against the model and builds the graph's named inputs.
    pub fn inputs(&self, batch: &TokenBatch) -> Result<BTreeMap<String, Tensor>, ModelError> {
        model_inputs(&self.contract(), batch).map_err(ModelError::Input)
    }

    /// Runs the reference interpreter on `batch`.
    pub fn evaluate(&self, batch: &TokenBatch) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let inputs = self.inputs(batch)?;
        kiln_ir::evaluate(&self.graph, &inputs, &self.checkpoint)
            .map_err(|e| ModelError::Input(format!("evaluation failed: {e}")))
    }
}
