//! The compiled artifact's schema, shared by the compiler (which writes it) and the runtime
//! (which reads it, and links nothing of the compiler's).
//!
//! An artifact is a folder: `manifest.ron` (this module's [`Manifest`]), the static graph of every
//! bucket (`buckets/*.ron`), `kernels.ptx` (and `kernels.sm_90.cubin` when ptxas was found),
//! `weights.safetensors` in the compiled dtype with the checkpoint's names, `tokenizer.json` when
//! the checkpoint had one, and `checksums`: one `sha256  path` line per file, verified before
//! anything runs.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::DType;

/// The artifact format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.ron";
/// The checksum list's file name.
pub const CHECKSUMS: &str = "checksums";

/// What an artifact holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `FORMAT_VERSION` of the compiler that wrote it.
    pub format_version: u32,
    /// The compiler's version.
    pub compiler_version: String,
    /// The checkpoint's architecture (`GPT2LMHeadModel`, ...).
    pub architecture: String,
    /// What the runtime needs to know about the model's inputs and outputs.
    pub model: ModelSummary,
    /// The compiled float type.
    pub dtype: DType,
    /// The weights file, absent for plan-only artifacts.
    pub weights: Option<String>,
    /// `tokenizer.json`, when the checkpoint had one.
    pub tokenizer: Option<String>,
    /// The PTX module of every kernel.
    pub kernels_ptx: String,
    /// The sm_90 cubin assembled from it, when ptxas was found.
    pub kernels_cubin: Option<String>,
    /// Sequence buckets, ascending.
    pub seq_buckets: Vec<usize>,
    /// Batch buckets, ascending.
    pub batch_buckets: Vec<usize>,
    /// KV-cache capacity of the decode graphs (decoders).
    pub max_context: Option<usize>,
    /// Prefill / encode buckets, largest first.
    pub prefill: Vec<BucketEntry>,
    /// Decode buckets, largest batch first.
    pub decode: Vec<BucketEntry>,
}

/// The model facts inputs are validated and outputs shaped by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// A causal LM (`logits`) rather than an encoder.
    pub decoder: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Length of a learned position table, if any.
    pub max_positions: Option<usize>,
    /// The graph outputs, by name.
    pub outputs: Vec<String>,
}

/// One compiled bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketEntry {
    /// Batch size.
    pub batch: usize,
    /// Sequence length (1 for decode).
    pub seq: usize,
    /// KV-cache capacity (decode buckets).
    pub context: Option<usize>,
    /// The static graph's file, relative to the artifact.
    pub graph: String,
    /// Its kernels, in execution order.
    pub kernels: Vec<String>,
}

/// The SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `checksums` text for `files` (paths relative to `dir`).
pub fn checksums(dir: &Path, files: &[String]) -> std::io::Result<String> {
    let mut out = String::new();
    for f in files {
        let bytes = std::fs::read(dir.join(f))?;
        out.push_str(&format!("{}  {f}\n", sha256_hex(&bytes)));
    }
    Ok(out)
}

/// Parses a `checksums` text into `(sha256, path)` pairs; `None` if a line is malformed.
pub fn parse_checksums(text: &str) -> Option<Vec<(String, String)>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (hash, path) = l.split_once("  ")?;
            let ok = hash.len() == 64 && hash.bytes().all(|c| c.is_ascii_hexdigit());
            let safe =
                !path.is_empty() && !path.starts_with('/') && !path.split('/').any(|p| p == "..");
            (ok && safe).then(|| (hash.to_string(), path.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_known_answer() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn checksum_lines_are_validated() {
        let good = format!("{}  buckets/a.ron\n", "0".repeat(64));
        assert_eq!(parse_checksums(&good).unwrap()[0].1, "buckets/a.ron");
        assert!(parse_checksums("xyz  a").is_none());
        assert!(parse_checksums(&format!("{}  ../etc/passwd", "0".repeat(64))).is_none());
    }
}
