//! Shared helpers for kiln's end-to-end tests: where the fixtures are, the real MiniLM checkpoint,
//! running the `kiln` CLI in-process, and the error measures the fixtures' README defines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use clap::Parser;
use kiln_compiler::cli::{run, Cli};
use kiln_ir::Tensor;

/// The fixtures folder: `$KILN_FIXTURES`, else `../shared/fixtures` beside the checkout.
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("KILN_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join("../shared/fixtures"),
    }
}

/// The repository root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The folder of fixture `name` (`gpt2-tiny`, ...).
pub fn fixture(name: &str) -> PathBuf {
    let dir = fixtures_dir().join(name);
    assert!(
        dir.is_dir(),
        "fixture {} is missing (set KILN_FIXTURES)",
        dir.display()
    );
    dir
}

/// The tensors of a fixture's `reference.safetensors`.
pub fn reference(name: &str) -> BTreeMap<String, Tensor> {
    kiln_compiler::tensor_io::read_tensors(&fixture(name).join("reference.safetensors"))
        .expect("reference.safetensors is readable")
}

/// The real all-MiniLM-L6-v2 model folder, downloaded once by `scripts/fetch-minilm`.
pub fn minilm_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = workspace_root().join("scripts/fetch-minilm");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .expect("bash runs scripts/fetch-minilm");
        assert!(
            out.status.success(),
            "scripts/fetch-minilm failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// Runs `kiln ARGS...` in-process; returns what it printed, or the error as one line.
pub fn kiln(args: &[&str]) -> Result<String, String> {
    let cli = Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    run(&cli, &mut out).map_err(|e| format!("{e:#}"))?;
    Ok(String::from_utf8(out).expect("kiln prints UTF-8"))
}

/// The float values of a tensor.
pub fn floats(t: &Tensor) -> &[f32] {
    t.as_f32().expect("a float tensor")
}

/// `max |a - b| / max |reference|`, the fixtures' relative error.
pub fn rel_err(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len(), "length mismatch");
    let diff = actual
        .iter()
        .zip(reference)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
        .fold(0.0, f64::max);
    let scale = reference
        .iter()
        .map(|b| f64::from(*b).abs())
        .fold(0.0, f64::max);
    diff / scale
}

/// Cosine similarity.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Index of the largest value.
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |acc, (i, &x)| if x > acc.1 { (i, x) } else { acc },
        )
        .0
}
