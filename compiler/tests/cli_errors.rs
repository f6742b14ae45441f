//! Bad input to the `kiln` binary: each case prints one line naming the problem, exits with code 2,
//! does not panic and writes no output file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_compiler::tensor_io::write_tensors;
use kiln_ir::{DType, Tensor};

fn fixtures() -> PathBuf {
    std::env::var_os("KILN_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"))
}

fn gpt2() -> String {
    fixtures().join("gpt2-tiny").to_str().unwrap().to_string()
}

/// Runs `kiln eval MODEL --input IN --output OUT` and checks the failure; returns stderr.
fn eval_fails(model: &str, input: &Path, expected: &str) {
    let out_dir = tempfile::tempdir().unwrap();
    let output = out_dir.path().join("out.safetensors");
    let args = [
        "eval",
        model,
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    fails(&args, expected);
    assert!(!output.exists(), "no output may be written on error");
    assert_eq!(
        std::fs::read_dir(out_dir.path()).unwrap().count(),
        0,
        "no temporary file is left"
    );
}

fn fails(args: &[&str], expected: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(expected),
        "{args:?}: expected {expected:?} in {stderr}"
    );
}

fn input_file(dir: &Path, tensors: Vec<(&str, Tensor)>) -> PathBuf {
    let path = dir.join("in.safetensors");
    let map: BTreeMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    write_tensors(&path, &map).unwrap();
    path
}

#[test]
fn missing_model_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![2], vec![1, 2]))],
    );
    eval_fails(
        "/nonexistent/model",
        &input,
        "model folder /nonexistent/model does not exist",
    );
    fails(&["ir", "/nonexistent/model"], "does not exist");
}

#[test]
fn missing_input_file() {
    eval_fails(
        &gpt2(),
        Path::new("/nonexistent/in.safetensors"),
        "cannot read /nonexistent/in.safetensors",
    );
}

#[test]
fn corrupt_input_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("in.safetensors");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    eval_fails(&gpt2(), &path, "is not a valid safetensors file");
}

#[test]
fn wrong_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::f32(vec![2], vec![1.0, 2.0]))],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`input_ids` must have dtype i64, found f32",
    );
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::int(DType::I32, vec![2], vec![1, 2]))],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`input_ids` must have dtype i64, found i32",
    );
}

#[test]
fn wrong_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![1, 1, 2], vec![1, 2]))],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`input_ids` must have shape [L] or [B, L], found [1, 1, 2]",
    );
}

#[test]
fn id_out_of_range() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![1, 3], vec![1, 512, 2]))],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`input_ids`[0, 1] = 512 is out of range for vocab size 512",
    );
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![2], vec![-1, 2]))],
    );
    eval_fails(&gpt2(), &input, "= -1 is out of range");
}

#[test]
fn mask_problems() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = Tensor::i64(vec![1, 3], vec![1, 2, 3]);
    let input = input_file(
        tmp.path(),
        vec![
            ("input_ids", ids.clone()),
            ("attention_mask", Tensor::i64(vec![1, 2], vec![1, 1])),
        ],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`attention_mask` has shape [1, 2] but `input_ids` has [1, 3]",
    );
    let input = input_file(
        tmp.path(),
        vec![
            ("input_ids", ids.clone()),
            ("attention_mask", Tensor::i64(vec![1, 3], vec![1, 2, 0])),
        ],
    );
    eval_fails(&gpt2(), &input, "`attention_mask`[0, 1] = 2 must be 0 or 1");
    let input = input_file(
        tmp.path(),
        vec![("attention_mask", Tensor::i64(vec![1, 3], vec![1; 3]))],
    );
    eval_fails(&gpt2(), &input, "has no `input_ids` tensor");
    let input = input_file(
        tmp.path(),
        vec![
            ("input_ids", ids),
            ("token_type_ids", Tensor::i64(vec![1, 3], vec![0; 3])),
        ],
    );
    eval_fails(
        &gpt2(),
        &input,
        "`token_type_ids` is not an input of this model",
    );
}

#[test]
fn sequence_longer_than_position_table() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![257], vec![1; 257]))],
    );
    eval_fails(
        &gpt2(),
        &input,
        "sequence needs position 256, but the model has 256 positions",
    );
}

#[test]
fn output_folder_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![2], vec![1, 2]))],
    );
    fails(
        &[
            "eval",
            &gpt2(),
            "--input",
            input.to_str().unwrap(),
            "--output",
            "/nonexistent/out.safetensors",
        ],
        "folder /nonexistent does not exist",
    );
}

#[test]
fn unsupported_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let src = fixtures().join("gpt2-tiny");
    std::fs::copy(
        src.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("GPT2LMHeadModel", "GPTNeoXForCausalLM");
    std::fs::write(model.join("config.json"), config).unwrap();
    let input = input_file(
        tmp.path(),
        vec![("input_ids", Tensor::i64(vec![2], vec![1, 2]))],
    );
    eval_fails(
        model.to_str().unwrap(),
        &input,
        "config.json: `architectures` = \"GPTNeoXForCausalLM\" is not supported",
    );
}

#[test]
fn text_without_tokenizer() {
    fails(
        &["eval", &gpt2(), "--text", "hello"],
        "has no tokenizer.json; --text needs one",
    );
}

#[test]
fn zero_sequence_length() {
    fails(
        &["ir", &gpt2(), "--seq-len", "0"],
        "--seq-len must be at least 1",
    );
}
