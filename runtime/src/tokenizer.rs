//! Text to token ids and back, with a checkpoint's own `tokenizer.json` (Hugging Face
//! `tokenizers`). `kiln eval --text` and `kiln-run` share it, so a text gives the same ids through
//! the compiler and through an artifact.

use std::path::Path;

use kiln_ir::inputs::TokenBatch;
use tokenizers::Tokenizer;

use crate::RuntimeError;

/// A loaded `tokenizer.json` with its padding turned off (kiln pads batches itself).
pub struct TextTokenizer {
    inner: Tokenizer,
    pad_id: i64,
}

impl TextTokenizer {
    /// Loads `path`; the error names the file.
    pub fn from_file(path: &Path) -> Result<TextTokenizer, RuntimeError> {
        let mut inner = Tokenizer::from_file(path).map_err(|e| RuntimeError::Artifact {
            file: path.display().to_string(),
            message: format!("is not a usable tokenizer: {e}"),
        })?;
        // The file's own padding (often to a fixed length) would only add masked work; its pad
        // id is kept for the batch padding.
        let pad_id = inner
            .get_padding()
            .map(|p| i64::from(p.pad_id))
            .unwrap_or(0);
        inner.with_padding(None);
        Ok(TextTokenizer { inner, pad_id })
    }

    /// The ids of `text`, special tokens included and the file's truncation applied; a text that
    /// gives no tokens is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, RuntimeError> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| RuntimeError::Request(format!("cannot tokenise {text:?}: {e}")))?;
        if enc.get_ids().is_empty() {
            return Err(RuntimeError::Request(format!(
                "text {text:?} gives no tokens"
            )));
        }
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Tokenises `texts` and right-pads them into one batch (mask 0 on the padding).
    pub fn encode_batch(&self, texts: &[String]) -> Result<TokenBatch, RuntimeError> {
        let rows = texts
            .iter()
            .map(|t| self.encode(t))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TokenBatch::padded(&rows, self.pad_id))
    }

    /// The text of `ids` (special tokens skipped); an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[i64]) -> Result<String, RuntimeError> {
        let ids = ids
            .iter()
            .map(|&i| u32::try_from(i))
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| RuntimeError::Request("a negative token id cannot be decoded".into()))?;
        self.inner
            .decode(&ids, true)
            .map_err(|e| RuntimeError::Request(format!("cannot decode tokens: {e}")))
    }
}
