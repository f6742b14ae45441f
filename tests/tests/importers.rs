//! Importers beyond the fixtures as saved: other dtypes, sharding, GQA against MHA, the RON text
//! form, and the errors a bad checkpoint gets.

use std::collections::BTreeMap;

use kiln_ir::{Graph, Tensor};
use kiln_models::inputs::TokenBatch;
use kiln_tests::{
    assert_half_precision_close, fixture, floats, kiln, minilm_dir, reference, rewrite_checkpoint,
};
use safetensors::Dtype;

fn logits_for(dir: &std::path::Path, ids: &Tensor) -> Vec<f32> {
    let model = kiln_models::import(dir).unwrap();
    let batch = TokenBatch::unmasked(vec![ids.as_i64().unwrap().to_vec()]);
    floats(&model.evaluate(&batch).unwrap()["logits"]).to_vec()
}

#[test]
fn bf16_sharded_llama_matches_reference() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(
        &fixture("llama-tiny"),
        tmp.path(),
        Dtype::BF16,
        3,
        |_, _| {},
    );
    assert!(tmp.path().join("model.safetensors.index.json").is_file());
    let reference = reference("llama-tiny");
    let got = logits_for(tmp.path(), &reference["input_ids_33"]);
    assert_half_precision_close(
        &got,
        floats(&reference["logits_33"]),
        512,
        "llama bf16 x3 shards",
    );
}

#[test]
fn f16_gpt2_matches_reference() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("gpt2-tiny"), tmp.path(), Dtype::F16, 1, |_, _| {});
    let reference = reference("gpt2-tiny");
    let got = logits_for(tmp.path(), &reference["input_ids_100"]);
    assert_half_precision_close(&got, floats(&reference["logits_100"]), 512, "gpt2 f16");
}

/// GQA semantics: a KV head serves its group of query heads. Repeating each K/V head's weights
/// for its group and declaring as many KV heads as query heads must give identical logits.
#[test]
fn gqa_equals_mha_with_repeated_kv_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (heads, kv_heads, head_dim) = (4usize, 2usize, 16usize);
    rewrite_checkpoint(
        &fixture("llama-tiny"),
        tmp.path(),
        Dtype::F32,
        1,
        |config, tensors| {
            config["num_key_value_heads"] = heads.into();
            for (key, (shape, values)) in tensors.iter_mut() {
                if key.ends_with("k_proj.weight") || key.ends_with("v_proj.weight") {
                    assert_eq!(shape[0], kv_heads * head_dim);
                    let cols = shape[1];
                    let mut repeated = Vec::new();
                    for h in 0..heads {
                        let kv = h / (heads / kv_heads);
                        repeated.extend_from_slice(
                            &values[kv * head_dim * cols..(kv + 1) * head_dim * cols],
                        );
                    }
                    *values = repeated;
                    shape[0] = heads * head_dim;
                }
            }
        },
    );
    let reference = reference("llama-tiny");
    let mha = logits_for(tmp.path(), &reference["input_ids_16"]);
    let gqa = logits_for(&fixture("llama-tiny"), &reference["input_ids_16"]);
    assert_eq!(mha, gqa);
}

#[test]
fn ron_form_round_trips_for_every_model() {
    let dirs = [
        fixture("gpt2-tiny"),
        fixture("llama-tiny"),
        fixture("bert-tiny"),
        minilm_dir(),
    ];
    for dir in dirs {
        let model = kiln_models::import(&dir).unwrap();
        let text = model.graph.to_ron();
        let back = Graph::from_ron(&text).unwrap();
        assert_eq!(back, model.graph, "{}", dir.display());
        assert_eq!(back.to_ron(), text, "{}", dir.display());
        let bucket = BTreeMap::from([("B".to_string(), 2), ("S".to_string(), 9)]);
        let fixed = model.graph.specialize(&bucket).unwrap();
        assert_eq!(Graph::from_ron(&fixed.to_ron()).unwrap(), fixed);
    }
}

#[test]
fn llama_tiny_ir_snapshot() {
    let text = kiln(&["ir", fixture("llama-tiny").to_str().unwrap()]).unwrap();
    insta::assert_snapshot!(text);
}

#[test]
fn ron_reader_rejects_inconsistent_graphs() {
    let text = kiln(&[
        "ir",
        fixture("gpt2-tiny").to_str().unwrap(),
        "--seq-len",
        "4",
    ])
    .unwrap();
    // A node declared with a type its op does not produce.
    let bad = text.replacen("shape: [\"B\", 4, 64]", "shape: [\"B\", 5, 64]", 1);
    assert_ne!(bad, text);
    let err = Graph::from_ron(&bad).unwrap_err().to_string();
    assert!(err.contains("is declared"), "{err}");
}

fn import_error(edit: impl FnOnce(&mut serde_json::Value, &mut kiln_tests::TensorMap)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("llama-tiny"), tmp.path(), Dtype::F32, 1, edit);
    match kiln_models::import(tmp.path()) {
        Ok(_) => panic!("import should fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_configs_name_the_field_and_value() {
    let err =
        import_error(|c, _| c["architectures"] = serde_json::json!(["T5ForConditionalGeneration"]));
    assert!(
        err.contains("`architectures`") && err.contains("T5ForConditionalGeneration"),
        "{err}"
    );
    let err = import_error(|c, _| c["hidden_act"] = "gelu".into());
    assert!(
        err.contains("`hidden_act`") && err.contains("gelu"),
        "{err}"
    );
    let err = import_error(|c, _| c["rope_parameters"]["rope_type"] = "dynamic".into());
    assert!(
        err.contains("rope_type") && err.contains("dynamic"),
        "{err}"
    );
    let qwen2 = |c: &mut serde_json::Value, layer_types: serde_json::Value| {
        c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        c["layer_types"] = layer_types;
    };
    for (types, says) in [
        (
            serde_json::json!(["full_attention"]),
            "has 1 entries for 2 layers",
        ),
        (
            serde_json::json!(["full_attention", "chunked_attention"]),
            "\"chunked_attention\"",
        ),
        (
            serde_json::json!(["full_attention", "sliding_attention"]),
            "use_sliding_window is false",
        ),
    ] {
        let err = import_error(|c, _| qwen2(c, types));
        assert!(err.contains("`layer_types`") && err.contains(says), "{err}");
    }
    let err = import_error(|c, _| c["num_key_value_heads"] = 3.into());
    assert!(
        err.contains("`num_key_value_heads`") && err.contains('3'),
        "{err}"
    );
    let err = import_error(|c, _| c["num_hidden_layers"] = "two".into());
    assert!(
        err.contains("`num_hidden_layers`") && err.contains("\"two\""),
        "{err}"
    );
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let err = import_error(|_, t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    assert_eq!(
        err,
        "tensor `model.layers.1.mlp.up_proj.weight` is missing from the checkpoint"
    );
    let err = import_error(|_, t| {
        let (shape, values) = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
        shape[0] -= 1;
        values.truncate(shape[0] * shape[1]);
    });
    assert_eq!(
        err,
        "tensor `model.layers.0.self_attn.k_proj.weight` has shape [31, 64], expected [32, 64]"
    );
}
