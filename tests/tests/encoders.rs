//! BERT fixtures and the real all-MiniLM-L6-v2 checkpoint through the reference interpreter.

use std::collections::BTreeMap;

use kiln_compiler::tensor_io::{read_tensors, write_tensors};
use kiln_ir::Tensor;
use kiln_tests::{
    assert_embeddings_close, fixture, floats, kiln, minilm_dir, minilm_sentences, reference,
};

/// `max |a - b| / max |ref|` over the rows the mask keeps (padded rows carry no meaning).
fn masked_rel_err(actual: &Tensor, reference: &Tensor, mask: &Tensor) -> f64 {
    let hidden = *reference.shape.last().unwrap();
    let mask = mask.as_i64().unwrap();
    let (a, r) = (floats(actual), floats(reference));
    let (mut diff, mut scale) = (0f64, 0f64);
    for (row, &m) in mask.iter().enumerate() {
        if m == 0 {
            continue;
        }
        for j in row * hidden..(row + 1) * hidden {
            diff = diff.max((f64::from(a[j]) - f64::from(r[j])).abs());
            scale = scale.max(f64::from(r[j]).abs());
        }
    }
    diff / scale
}

/// Runs `kiln eval` on `input_ids` + `attention_mask` and returns its outputs.
fn eval(model: &std::path::Path, reference: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.safetensors");
    let output = tmp.path().join("out.safetensors");
    let tensors = BTreeMap::from([
        ("input_ids".to_string(), reference["input_ids"].clone()),
        (
            "attention_mask".to_string(),
            reference["attention_mask"].clone(),
        ),
    ]);
    write_tensors(&input, &tensors).unwrap();
    kiln(&[
        "eval",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ])
    .unwrap();
    read_tensors(&output).unwrap()
}

#[test]
fn bert_tiny_last_hidden_state_matches_reference() {
    let reference = reference("bert-tiny");
    let out = eval(&fixture("bert-tiny"), &reference);
    let got = &out["last_hidden_state"];
    assert_eq!(got.shape, reference["last_hidden_state"].shape);
    assert!(
        !out.contains_key("sentence_embedding"),
        "bert-tiny has no modules.json"
    );
    let err = masked_rel_err(
        got,
        &reference["last_hidden_state"],
        &reference["attention_mask"],
    );
    assert!(err < 1e-4, "relative error {err:e}");
}

#[test]
fn minilm_embeddings_match_sentence_transformers() {
    let reference = reference("minilm-reference");
    let out = eval(&minilm_dir(), &reference);
    let err = masked_rel_err(
        &out["last_hidden_state"],
        &reference["last_hidden_state"],
        &reference["attention_mask"],
    );
    assert!(err < 1e-4, "last_hidden_state relative error {err:e}");
    let (got, want) = (&out["sentence_embedding"], &reference["sentence_embedding"]);
    assert_eq!(got.shape, want.shape);
    assert_embeddings_close(got, want, want.shape[0], "minilm");
}

#[test]
fn minilm_text_is_tokenised_like_the_reference() {
    let dir = minilm_dir();
    let sentences = minilm_sentences();
    let batch = kiln_compiler::tokenize::tokenize(&dir, &sentences, &[]).unwrap();
    let reference = reference("minilm-reference");
    let flat: Vec<i64> = batch.ids.iter().flatten().copied().collect();
    let mask: Vec<i64> = batch.mask.unwrap().iter().flatten().copied().collect();
    assert_eq!(flat, reference["input_ids"].as_i64().unwrap());
    assert_eq!(mask, reference["attention_mask"].as_i64().unwrap());

    // The main job: `kiln eval --text` prints one unit-norm embedding per sentence.
    let mut args = vec!["eval".to_string(), dir.to_str().unwrap().to_string()];
    for s in &sentences {
        args.push("--text".into());
        args.push(s.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let printed = kiln(&args).unwrap();
    assert_eq!(
        printed
            .matches("sentence_embedding: dim 384, norm 1.000000")
            .count(),
        4,
        "{printed}"
    );
}
