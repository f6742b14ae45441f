//! Text to token ids for `kiln eval --text`, with the checkpoint's own `tokenizer.json` through the
//! runtime's [`TextTokenizer`], so that `kiln eval` and `kiln-run` give a text the same ids.

use std::path::Path;

use anyhow::{bail, Result};
use kiln_models::inputs::TokenBatch;
use kiln_runtime::tokenizer::TextTokenizer;

/// Tokenises `texts`, each with its pair when `pairs` is not empty (special tokens included, the
/// file's truncation applied), and right-pads them into one batch.
pub fn tokenize(model_dir: &Path, texts: &[String], pairs: &[String]) -> Result<TokenBatch> {
    let path = model_dir.join("tokenizer.json");
    if !path.is_file() {
        bail!(
            "{} has no tokenizer.json; --text needs one",
            model_dir.display()
        );
    }
    Ok(TextTokenizer::from_file(&path)?.encode_batch(texts, pairs)?)
}
