//! Artifact checksums: the BLAKE3 digest of every file (what `b3sum` prints for it), listed in the
//! artifact's `checksums` file, which ends with its own line.
//!
//! BLAKE3 is a tree hash, so one file's digest is computed on every core; files are read through
//! mapped windows of [`WINDOW`] bytes, each hashed and unmapped before the next, so verifying an
//! artifact of any size takes a constant amount of memory. The compiler hashes the weights as it
//! writes them ([`Digester`]), without reading them back.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use memmap2::MmapOptions;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

/// The checksum list's file name.
pub const CHECKSUMS: &str = "checksums";

/// Bytes of a file mapped at once while it is hashed.
pub const WINDOW: usize = 64 << 20;

/// Below this many bytes an update is hashed on the calling thread.
const PARALLEL_FROM: usize = 1 << 20;

/// An incremental digest, fed in order.
#[derive(Default)]
pub struct Digester(blake3::Hasher);

impl Digester {
    /// An empty digest.
    pub fn new() -> Digester {
        Digester::default()
    }

    /// Adds `bytes`, hashing a large update on every core.
    pub fn update(&mut self, bytes: &[u8]) {
        if bytes.len() >= PARALLEL_FROM {
            self.0.update_rayon(bytes);
        } else {
            self.0.update(bytes);
        }
    }

    /// The digest, lowercase hex.
    pub fn finish(&self) -> String {
        self.0.finalize().to_hex().to_string()
    }
}

impl Write for Digester {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The digest of `bytes`, lowercase hex.
pub fn digest(bytes: &[u8]) -> String {
    let mut d = Digester::new();
    d.update(bytes);
    d.finish()
}

/// The digest of the file at `path`, read through mapped windows (constant memory).
pub fn digest_file(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut d = Digester::new();
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(WINDOW as u64) as usize;
        // SAFETY: a read-only, private mapping of `n` bytes inside the file, dropped (unmapped)
        // before the next window. A file truncated by another process while it is hashed would
        // fault; artifact files are written once, beside their final place, and never modified.
        let window = unsafe { MmapOptions::new().offset(at).len(n).populate().map(&file)? };
        d.update(&window);
        at += n as u64;
    }
    Ok(d.finish())
}

/// `(digest, path)` of each of `files` (relative to `dir`), hashed in parallel, in their order.
pub fn digest_files(dir: &Path, files: &[String]) -> io::Result<Vec<(String, String)>> {
    files
        .par_iter()
        .map(|f| {
            let d = digest_file(&dir.join(f))
                .map_err(|e| io::Error::new(e.kind(), format!("{f}: {e}")))?;
            Ok((d, f.clone()))
        })
        .collect()
}

/// The `checksums` text of `(digest, path)` pairs: one `digest  path` line each, then the file's
/// own line, `digest  checksums`, the digest of the lines above it, so that a damaged list is named
/// as itself rather than as the file whose line it garbled.
pub fn render_checksums(sums: &[(String, String)]) -> String {
    let mut out: String = sums.iter().map(|(h, f)| format!("{h}  {f}\n")).collect();
    let own = digest(out.as_bytes());
    out.push_str(&format!("{own}  {CHECKSUMS}\n"));
    out
}

/// Why a `checksums` text was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChecksumsError {
    /// The last line is not the list's own checksum.
    #[error("does not end with its own checksum line (`<digest>  checksums`); the artifact was written by an older kiln or the list was edited")]
    Unsealed,
    /// The list is sealed with SHA-256, as kiln wrote artifacts before format 6.
    #[error("holds SHA-256 checksums: the artifact was written by an older kiln (format 5 or earlier); compile it again")]
    Sha256,
    /// The lines above the list's own line do not hash to it.
    #[error("does not match its own checksum line: the checksums file itself is corrupt (the files it lists were not checked)")]
    Corrupt,
    /// A line is not `digest  relative/path`.
    #[error("line {0} is malformed")]
    Malformed(usize),
}

/// Parses a `checksums` text into `(digest, path)` pairs, after checking the list's own line.
pub fn parse_checksums(text: &str) -> Result<Vec<(String, String)>, ChecksumsError> {
    let body_end = text.trim_end_matches('\n').rfind('\n').map_or(0, |i| i + 1);
    let (body, own) = text.split_at(body_end);
    let own_hash = own
        .trim_end_matches('\n')
        .strip_suffix(&format!("  {CHECKSUMS}"))
        .ok_or(ChecksumsError::Unsealed)?;
    if own_hash != digest(body.as_bytes()) {
        let sha256: String = Sha256::digest(body.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        return Err(if own_hash == sha256 {
            ChecksumsError::Sha256
        } else {
            ChecksumsError::Corrupt
        });
    }
    body.lines()
        .enumerate()
        .map(|(i, l)| parse_line(l).ok_or(ChecksumsError::Malformed(i + 1)))
        .collect()
}

/// One `digest  path` line; `None` unless the digest is 64 hex digits and the path relative.
fn parse_line(line: &str) -> Option<(String, String)> {
    let (hash, path) = line.split_once("  ")?;
    let ok = hash.len() == 64 && hash.bytes().all(|c| c.is_ascii_hexdigit());
    let safe = !path.is_empty()
        && path != CHECKSUMS
        && !path.starts_with('/')
        && !path.split('/').any(|p| p == "..");
    (ok && safe).then(|| (hash.to_string(), path.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blake3_known_answer() {
        // `printf abc | b3sum`
        assert_eq!(
            digest(b"abc"),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
        assert_eq!(digest(b""), Digester::new().finish());
    }

    #[test]
    fn incremental_file_and_whole_digests_agree() {
        // Across a window boundary and the parallel threshold, in uneven pieces.
        let bytes: Vec<u8> = (0..WINDOW + 3 * PARALLEL_FROM + 7)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let whole = digest(&bytes);
        let mut d = Digester::new();
        for piece in bytes.chunks(PARALLEL_FROM * 3 / 2 + 1) {
            d.update(piece);
        }
        assert_eq!(d.finish(), whole);
        let dir = std::env::temp_dir().join(format!("kiln-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f"), &bytes).unwrap();
        std::fs::write(dir.join("empty"), b"").unwrap();
        let sums = digest_files(&dir, &["f".into(), "empty".into()]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(sums[0].0, whole);
        assert_eq!(sums[1].0, digest(b""));
    }

    #[test]
    fn checksum_lines_are_validated() {
        let line = |path: &str| vec![("0".repeat(64), path.to_string())];
        let good = render_checksums(&line("buckets/a.ron"));
        assert_eq!(parse_checksums(&good).unwrap()[0].1, "buckets/a.ron");
        let bad = |text: &str| parse_checksums(text).err();
        assert_eq!(
            bad(&render_checksums(&line("../etc/passwd"))),
            Some(ChecksumsError::Malformed(1))
        );
        assert_eq!(
            bad(&render_checksums(&line(CHECKSUMS))),
            Some(ChecksumsError::Malformed(1))
        );
        let xyz = render_checksums(&[("xyz".into(), "a".into())]);
        assert_eq!(bad(&xyz), Some(ChecksumsError::Malformed(1)));
        // Without its own line, or with nothing at all.
        assert_eq!(
            bad(&good[..good.find(CHECKSUMS).unwrap() - 66]),
            Some(ChecksumsError::Unsealed)
        );
        assert_eq!(bad(""), Some(ChecksumsError::Unsealed));
    }

    #[test]
    fn a_list_sealed_with_sha256_is_named_as_older() {
        let body = format!("{}  manifest.ron\n", "0".repeat(64));
        let sha: String = Sha256::digest(body.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let text = format!("{body}{sha}  {CHECKSUMS}\n");
        assert_eq!(parse_checksums(&text), Err(ChecksumsError::Sha256));
    }

    #[test]
    fn a_damaged_checksums_file_names_itself() {
        let sums = vec![
            (digest(b"weights"), "weights.safetensors".to_string()),
            (digest(b"manifest"), "manifest.ron".to_string()),
        ];
        let text = render_checksums(&sums);
        assert_eq!(parse_checksums(&text).unwrap(), sums);
        // Any one flipped bit, in a listed hash, a path or the list's own line, is the list's
        // own corruption (or, in the own line's path, a missing own line).
        for at in 0..text.len() {
            for bit in 0..8 {
                let mut bytes = text.clone().into_bytes();
                bytes[at] ^= 1 << bit;
                let Ok(flipped) = String::from_utf8(bytes) else {
                    continue;
                };
                let err = parse_checksums(&flipped).expect_err("a flipped bit is detected");
                assert!(
                    matches!(err, ChecksumsError::Corrupt | ChecksumsError::Unsealed),
                    "byte {at} bit {bit}: {err:?}"
                );
            }
        }
    }
}
