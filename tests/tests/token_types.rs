//! BERT token types (`token_type_ids`, segment ids) against transformers references made by
//! `tests/data/make_token_types.py`: a right-padded bert-tiny batch mixing segments 0 and 1
//! through `kiln eval` and a compiled artifact (`kiln-run forward`, CPU kernels and interpreter),
//! and MiniLM sentence pairs tokenised by the artifact's tokenizer (`kiln-run embed --pair`,
//! `kiln eval --pair`). Within 1e-4 of transformers, as the fixtures' README asks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_ir::Tensor;
use kiln_tests::{
    assert_embeddings_close, fixture, floats, kiln, kiln_run, kiln_run_forward, masked_rel_err,
    minilm_dir, workspace_root,
};

/// A reference of `tests/data`.
fn data(name: &str) -> BTreeMap<String, Tensor> {
    let path = workspace_root().join("tests/data").join(name);
    kiln_ir::io::read_tensors(&path).expect("tests/data reference is readable")
}

/// The bert-tiny reference's inputs: ids, mask and, with `types`, the token types.
fn bert_inputs(reference: &BTreeMap<String, Tensor>, types: bool) -> BTreeMap<String, Tensor> {
    let names: &[&str] = if types {
        &["input_ids", "attention_mask", "token_type_ids"]
    } else {
        &["input_ids", "attention_mask"]
    };
    names
        .iter()
        .map(|k| (k.to_string(), reference[*k].clone()))
        .collect()
}

/// `kiln eval MODEL --input IN --output OUT` over `inputs`; the outputs.
fn kiln_eval(
    model: &Path,
    dir: &Path,
    inputs: &BTreeMap<String, Tensor>,
) -> BTreeMap<String, Tensor> {
    let (input, output) = (
        dir.join("eval-in.safetensors"),
        dir.join("eval-out.safetensors"),
    );
    kiln_ir::io::write_tensors(&input, inputs).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    kiln(&[
        "eval",
        &s(model),
        "--input",
        &s(&input),
        "--output",
        &s(&output),
    ])
    .unwrap();
    kiln_ir::io::read_tensors(&output).unwrap()
}

/// `kiln compile MODEL -o DIR/NAME --target cpu ARGS..`; the artifact folder.
fn compile_cpu(model: &Path, dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let art = dir.join(name);
    let mut all = vec![
        "compile",
        model.to_str().unwrap(),
        "-o",
        art.to_str().unwrap(),
    ];
    all.extend_from_slice(&["--target", "cpu"]);
    all.extend_from_slice(args);
    kiln(&all).unwrap();
    art
}

/// Relative error of `out`'s hidden states against the bert-tiny reference's, on real tokens.
fn bert_err(out: &BTreeMap<String, Tensor>, reference: &BTreeMap<String, Tensor>) -> f64 {
    masked_rel_err(
        &out["last_hidden_state"],
        &reference["last_hidden_state"],
        &reference["attention_mask"],
    )
}

#[test]
fn kiln_eval_takes_token_types_like_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = data("bert_tiny_token_types.safetensors");
    let model = fixture("bert-tiny");
    let out = kiln_eval(&model, tmp.path(), &bert_inputs(&reference, true));
    let err = bert_err(&out, &reference);
    assert!(
        err < 1e-4,
        "kiln eval with token types: relative error {err:e}"
    );
    // The reference needs them: without, segment 1 is far off.
    let without = kiln_eval(&model, tmp.path(), &bert_inputs(&reference, false));
    let err = bert_err(&without, &reference);
    assert!(err > 0.1, "token types matter to this reference: {err:e}");
}

#[test]
fn compiled_bert_takes_token_types_through_padded_buckets() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = data("bert_tiny_token_types.safetensors");
    // 3 x 13 tokens run in the 4 x 16 bucket: token types are padded like the ids.
    let art = compile_cpu(
        &fixture("bert-tiny"),
        tmp.path(),
        "bert.kiln",
        &["--buckets", "16", "--batch-buckets", "4"],
    );
    for device in ["cpu", "interpreter"] {
        let out = kiln_run_forward(&art, bert_inputs(&reference, true), device);
        let err = bert_err(&out, &reference);
        assert!(
            err < 1e-4,
            "kiln-run forward --device {device}: relative error {err:e}"
        );
    }
}

#[test]
fn token_types_are_checked_against_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = data("bert_tiny_token_types.safetensors");
    let input = tmp.path().join("in.safetensors");
    let out = tmp.path().join("out.safetensors");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    let bert = fixture("bert-tiny");
    let mut inputs = bert_inputs(&reference, true);
    let mut types = reference["token_type_ids"].as_i64().unwrap().to_vec();
    types[4] = 2;
    inputs.insert(
        "token_type_ids".into(),
        Tensor::i64(reference["token_type_ids"].shape.clone(), types),
    );
    kiln_ir::io::write_tensors(&input, &inputs).unwrap();
    let err = kiln(&["eval", bert.to_str().unwrap(), "--input", i, "--output", o]).unwrap_err();
    assert!(
        err.contains("`token_type_ids`[0, 4] = 2 is out of range for 2 token types"),
        "{err}"
    );
    inputs.insert(
        "token_type_ids".into(),
        Tensor::i64(vec![3, 12], vec![0; 36]),
    );
    kiln_ir::io::write_tensors(&input, &inputs).unwrap();
    let err = kiln(&["eval", bert.to_str().unwrap(), "--input", i, "--output", o]).unwrap_err();
    assert!(
        err.contains("`token_type_ids` has shape [3, 12] but `input_ids` has [3, 13]"),
        "{err}"
    );
    // A decoder takes no token types, through the compiler and through an artifact.
    let gpt2 = fixture("gpt2-tiny");
    let art = compile_cpu(&gpt2, tmp.path(), "gpt2.kiln", &["--buckets", "16"]);
    let ids = Tensor::i64(vec![1, 3], vec![1, 2, 3]);
    let types = Tensor::i64(vec![1, 3], vec![0, 0, 1]);
    let request = BTreeMap::from([
        ("input_ids".to_string(), ids),
        ("token_type_ids".to_string(), types),
    ]);
    kiln_ir::io::write_tensors(&input, &request).unwrap();
    let eval = kiln(&["eval", gpt2.to_str().unwrap(), "--input", i, "--output", o]);
    let a = art.to_str().unwrap();
    let run = kiln_run(&["forward", a, "--input", i, "--output", o, "--device", "cpu"]);
    for err in [eval.unwrap_err(), run.unwrap_err()] {
        assert!(
            err.contains("`token_type_ids` is not an input of this model"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
    }
    assert!(!out.exists(), "no output written");
}

/// The `--text A --pair B` arguments of the MiniLM pair reference's sentences.
fn pair_args() -> Vec<String> {
    [
        "--text",
        "Where is the compiler's output written?",
        "--pair",
        "Into an artifact folder beside the destination.",
        "--text",
        "short",
        "--pair",
        "A second segment that is a good deal longer than the first one.",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn sentence_pairs_embed_like_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = data("minilm_pairs.safetensors");
    let want = &reference["sentence_embedding"];
    let model = minilm_dir();
    let art = compile_cpu(
        &model,
        tmp.path(),
        "minilm.kiln",
        &["--buckets", "32", "--batch-buckets", "2"],
    );
    // The artifact's tokenizer gives the reference's ids and token types for the pairs.
    let opened = kiln_runtime::Artifact::open(&art).unwrap();
    let args = pair_args();
    let texts: Vec<String> = args.iter().skip(1).step_by(4).cloned().collect();
    let pairs: Vec<String> = args.iter().skip(3).step_by(4).cloned().collect();
    let batch = opened
        .tokenizer()
        .unwrap()
        .encode_batch(&texts, &pairs)
        .unwrap();
    assert_eq!(batch.ids.concat(), reference["input_ids"].as_i64().unwrap());
    let types = batch.types.expect("pairs carry token types");
    assert_eq!(
        types.concat(),
        reference["token_type_ids"].as_i64().unwrap()
    );

    let mut embed = vec!["embed".to_string(), art.to_str().unwrap().to_string()];
    embed.extend(pair_args());
    embed.extend(["--json", "--device", "cpu"].map(String::from));
    let embed: Vec<&str> = embed.iter().map(String::as_str).collect();
    let json: serde_json::Value = serde_json::from_str(&kiln_run(&embed).unwrap()).unwrap();
    let values: Vec<f32> = json["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let got = Tensor::f32(want.shape.clone(), values);
    assert_embeddings_close(&got, want, 2, "kiln-run embed --pair");
    let err = kiln_tests::rel_err(floats(&got), floats(want));
    assert!(err < 1e-4, "kiln-run embed --pair: relative error {err:e}");

    // `kiln eval --text .. --pair ..` tokenises the same way.
    let output = tmp.path().join("eval.safetensors");
    let mut eval = vec!["eval".to_string(), model.to_str().unwrap().to_string()];
    eval.extend(pair_args());
    eval.extend(["--output".to_string(), output.to_str().unwrap().to_string()]);
    let eval: Vec<&str> = eval.iter().map(String::as_str).collect();
    kiln(&eval).unwrap();
    let out = kiln_ir::io::read_tensors(&output).unwrap();
    let err = kiln_tests::rel_err(floats(&out["sentence_embedding"]), floats(want));
    assert!(err < 1e-4, "kiln eval --pair: relative error {err:e}");

    // One pair per text, or none.
    let a = art.to_str().unwrap();
    let err = kiln_run(&["embed", a, "--text", "x", "--text", "y", "--pair", "z"]).unwrap_err();
    assert!(err.contains("1 pairs for 2 texts"), "{err}");
}
