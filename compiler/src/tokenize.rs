//! Text to token ids with the checkpoint's own `tokenizer.json` (Hugging Face `tokenizers`).

use std::path::Path;

use anyhow::{bail, Result};
use kiln_models::inputs::TokenBatch;
use tokenizers::Tokenizer;

/// Tokenises `texts` (special tokens included, the file's truncation applied) and right-pads them
/// into one batch.
pub fn tokenize(model_dir: &Path, texts: &[String]) -> Result<TokenBatch> {
    let path = model_dir.join("tokenizer.json");
    if !path.is_file() {
        bail!(
            "{} has no tokenizer.json; --text needs one",
            model_dir.display()
        );
    }
    let mut tokenizer = Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))?;
    // kiln pads the batch itself (to its longest text); the file's own padding (often a fixed
    // length) would only add masked work. Its pad id is kept.
    let pad = tokenizer
        .get_padding()
        .map(|p| i64::from(p.pad_id))
        .unwrap_or(0);
    tokenizer.with_padding(None);
    let mut rows = Vec::with_capacity(texts.len());
    for text in texts {
        let enc = tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| anyhow::anyhow!("cannot tokenise {text:?}: {e}"))?;
        if enc.get_ids().is_empty() {
            bail!("text {text:?} gives no tokens");
        }
        rows.push(enc.get_ids().iter().map(|&i| i64::from(i)).collect());
    }
    Ok(TokenBatch::padded(&rows, pad))
}
