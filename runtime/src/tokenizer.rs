//! Text to token ids and back, with a checkpoint's own `tokenizer.json` (Hugging Face
//! `tokenizers`). `kiln eval --text` and `kiln-run` share it, so a text gives the same ids through
//! the compiler and through an artifact.

use std::path::Path;

use kiln_ir::inputs::TokenBatch;
use tokenizers::{EncodeInput, Encoding, Tokenizer};

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

    /// The encoding of `text` (with `pair` as its second segment, if any), special tokens
    /// included and the file's truncation applied; a text that gives no tokens is an error.
    fn encoding(&self, text: &str, pair: Option<&str>) -> Result<Encoding, RuntimeError> {
        self.encoding_with(text, pair, true)
    }

    /// [`TextTokenizer::encoding`], with or without the special tokens the file adds.
    fn encoding_with(
        &self,
        text: &str,
        pair: Option<&str>,
        special: bool,
    ) -> Result<Encoding, RuntimeError> {
        let input: EncodeInput = match pair {
            Some(p) => (text, p).into(),
            None => text.into(),
        };
        let enc = self.inner.encode(input, special).map_err(|e| {
            RuntimeError::Request(format!("cannot tokenise {text:?} (pair {pair:?}): {e}"))
        })?;
        if enc.get_ids().is_empty() {
            return Err(RuntimeError::Request(format!(
                "text {text:?} gives no tokens"
            )));
        }
        Ok(enc)
    }

    /// The ids of `text`, special tokens included and the file's truncation applied; a text that
    /// gives no tokens is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, RuntimeError> {
        Ok(widen(self.encoding(text, None)?.get_ids()))
    }

    /// The ids of `text` without the special tokens the file adds (a rendered chat template
    /// holds its own).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<i64>, RuntimeError> {
        Ok(widen(self.encoding_with(text, None, false)?.get_ids()))
    }

    /// Tokenises `texts`, each with its pair when `pairs` is not empty (then one per text), and
    /// right-pads them into one batch (mask 0 on the padding). Token types are the tokenizer's
    /// (0 for a text, 1 for its pair with BERT's tokenizers), padded with 0; a batch whose types
    /// are all 0 carries none, which means the same.
    pub fn encode_batch(
        &self,
        texts: &[String],
        pairs: &[String],
    ) -> Result<TokenBatch, RuntimeError> {
        if !pairs.is_empty() && pairs.len() != texts.len() {
            return Err(RuntimeError::Request(format!(
                "{} pairs for {} texts: give one pair per text, or none",
                pairs.len(),
                texts.len()
            )));
        }
        let encodings = texts
            .iter()
            .enumerate()
            .map(|(i, t)| self.encoding(t, pairs.get(i).map(String::as_str)))
            .collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<Vec<i64>> = encodings.iter().map(|e| widen(e.get_ids())).collect();
        let types: Vec<Vec<i64>> = encodings.iter().map(|e| widen(e.get_type_ids())).collect();
        let batch = TokenBatch::padded(&ids, self.pad_id);
        Ok(if types.iter().flatten().any(|&t| t != 0) {
            batch.with_types(&types)
        } else {
            batch
        })
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

/// Token ids or types as the i64 the model inputs hold.
fn widen(values: &[u32]) -> Vec<i64> {
    values.iter().map(|&v| i64::from(v)).collect()
}
