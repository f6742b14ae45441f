//! Family variants no fixture covers, built from the tiny fixtures with edited configs and random
//! extra tensors (Qwen2 with Q/K/V bias and tied embeddings, sliding windows on every layer
//! (Mistral) or on some (Qwen2), Llama with llama3 or YaRN RoPE scaling and attention/MLP biases,
//! GPT-2 with ReLU and per-layer attention scaling): each imports, its fused bucket graph computes
//! exactly what its unfused graph computes, and its compiled artifact runs on the CPU executor
//! (generated kernels, KV-cached decoding) with the same results.

use kiln_models::inputs::TokenBatch;
use kiln_tests::{
    compile_fixture, fixture, floats, pad_to, rel_err, rewrite_checkpoint, TensorMap,
};
use safetensors::Dtype;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

fn add_bias(t: &mut TensorMap, key: &str, n: usize, seed: u64) {
    t.insert(key.to_string(), (vec![n], random(n, seed)));
}

/// Runs the unfused and the fused (bucket 16, batch 2) graphs on a padded batch and compares the
/// logits of the real tokens.
fn fused_equals_unfused(dir: &std::path::Path, what: &str) {
    let (model, report, buckets) = compile_fixture(dir, &[16], &[2]);
    let layers = model.checkpoint.config()["num_hidden_layers"]
        .as_u64()
        .or(model.checkpoint.config()["n_layer"].as_u64())
        .unwrap() as usize;
    let attention = report.buckets[0]
        .kernels
        .iter()
        .filter(|k| k.kind == kiln_compiler::fusion::cost::KernelKind::Attention)
        .count();
    assert_eq!(attention, layers, "{what}: one attention kernel per layer");
    let rows = vec![
        (0..13).map(|i| (i * 31 + 7) % 500).collect::<Vec<i64>>(),
        vec![3, 1, 4, 1, 5, 9],
    ];
    let batch = TokenBatch::padded(&rows, 0);
    let unfused = model.evaluate(&batch).unwrap();
    let inputs = model.inputs(&pad_to(&batch, 16)).unwrap();
    let fused = kiln_ir::evaluate(&buckets[0].graph, &inputs, &model.checkpoint).unwrap();
    let vocab = 512;
    let (u, f) = (floats(&unfused["logits"]), floats(&fused["logits"]));
    for (r, row) in rows.iter().enumerate() {
        for t in 0..row.len() {
            let a = &u[(r * 13 + t) * vocab..(r * 13 + t + 1) * vocab];
            let b = &f[(r * 16 + t) * vocab..(r * 16 + t + 1) * vocab];
            let err = rel_err(b, a);
            assert!(
                err < 1e-5,
                "{what}: row {r} token {t}: relative error {err:e}"
            );
        }
    }
}

/// The model compiled (f32) and run by the CPU executor: a padded batch's logits are the unfused
/// graph's, and greedy generation through the executor's KV cache gives the interpreter's tokens.
fn cpu_executor_agrees(dir: &std::path::Path, what: &str) {
    use kiln_runtime::generate::{generate, Sampling};
    use kiln_runtime::{forward::forward, Device, Executor};
    let tmp = tempfile::tempdir().unwrap();
    let art = kiln_tests::compile_artifact(
        dir,
        &tmp.path().join("model.kiln"),
        &[
            "--buckets",
            "16",
            "--batch-buckets",
            "2",
            "--max-context",
            "48",
        ],
    );
    let mut exec = Executor::open(&art, Device::Cpu).unwrap();
    assert!(
        matches!(exec, Executor::Cpu(_)),
        "{what}: generated kernels"
    );
    let model = kiln_models::import(dir).unwrap();
    let rows = vec![
        (0..13).map(|i| (i * 31 + 7) % 500).collect::<Vec<i64>>(),
        vec![3, 1, 4, 1, 5, 9],
    ];
    let batch = TokenBatch::padded(&rows, 0);
    let want = model.evaluate(&batch).unwrap();
    let got = forward(&art, &mut exec, &batch).unwrap();
    let vocab = 512;
    let (w, g) = (floats(&want["logits"]), floats(&got["logits"]));
    for (r, row) in rows.iter().enumerate() {
        let (a, b) = (r * 13 * vocab, (r * 13 + row.len()) * vocab);
        let err = rel_err(&g[a..b], &w[a..b]);
        assert!(err < 1e-4, "{what}: row {r} on the CPU executor: {err:e}");
    }
    let greedy = Sampling::greedy();
    let tokens = generate(&art, &mut exec, &rows[0], 24, &greedy).unwrap();
    let reference = generate(&art, &mut Executor::Interpreter, &rows[0], 24, &greedy).unwrap();
    assert_eq!(
        tokens, reference,
        "{what}: greedy tokens on the CPU executor"
    );
}

/// Makes the tiny Llama a Qwen2 (Q/K/V biases on both layers) with `edit`'s changes on top.
fn qwen2(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value, &mut TensorMap)) {
    rewrite_checkpoint(&fixture("llama-tiny"), dir, Dtype::F32, 1, |c, t| {
        c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        c["model_type"] = "qwen2".into();
        for l in 0..2 {
            for (proj, n, seed) in [("q_proj", 64, 11), ("k_proj", 32, 21), ("v_proj", 32, 31)] {
                let key = format!("model.layers.{l}.self_attn.{proj}.bias");
                add_bias(t, &key, n, seed + l);
            }
        }
        edit(c, t);
    });
}

/// The sliding windows of the graph's causal masks, one per mask.
fn mask_windows(dir: &std::path::Path) -> Vec<Option<i64>> {
    let model = kiln_models::import(dir).unwrap();
    let mut windows: Vec<_> = model
        .graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            kiln_ir::Op::CausalMask { window, .. } => Some(*window),
            _ => None,
        })
        .collect();
    windows.sort();
    windows
}

#[test]
fn qwen2_with_qkv_bias_and_tied_embeddings() {
    let tmp = tempfile::tempdir().unwrap();
    qwen2(tmp.path(), |c, t| {
        c["tie_word_embeddings"] = true.into();
        c["use_sliding_window"] = false.into();
        t.remove("lm_head.weight");
    });
    fused_equals_unfused(tmp.path(), "qwen2");
    cpu_executor_agrees(tmp.path(), "qwen2");
}

#[test]
fn qwen2_with_sliding_window_layers() {
    // transformers' rule: with `use_sliding_window`, the layers from `max_window_layers` on slide.
    let tmp = tempfile::tempdir().unwrap();
    qwen2(tmp.path(), |c, _| {
        c["use_sliding_window"] = true.into();
        c["sliding_window"] = 5.into();
        c["max_window_layers"] = 1.into();
    });
    assert_eq!(mask_windows(tmp.path()), [None, Some(5)]);
    fused_equals_unfused(tmp.path(), "qwen2 sliding");
    cpu_executor_agrees(tmp.path(), "qwen2 sliding");
    // `layer_types`, where given, names the sliding layers instead.
    let listed = tempfile::tempdir().unwrap();
    qwen2(listed.path(), |c, _| {
        c["use_sliding_window"] = true.into();
        c["sliding_window"] = 5.into();
        c["max_window_layers"] = 1.into();
        c["layer_types"] = serde_json::json!(["sliding_attention", "sliding_attention"]);
    });
    assert_eq!(mask_windows(listed.path()), [Some(5)]);
    // Near miss: without `use_sliding_window`, `sliding_window` and `max_window_layers` do nothing.
    let off = tempfile::tempdir().unwrap();
    qwen2(off.path(), |c, _| {
        c["sliding_window"] = 5.into();
        c["max_window_layers"] = 0.into();
    });
    assert_eq!(mask_windows(off.path()), [None]);
}

#[test]
fn windows_default_as_transformers_reads_them() {
    // A missing `sliding_window` is 4096 to Mistral and Qwen2; a null one is none.
    let mistral = |dir: &std::path::Path, window: Option<serde_json::Value>| {
        rewrite_checkpoint(&fixture("llama-tiny"), dir, Dtype::F32, 1, |c, _| {
            c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
            c["model_type"] = "mistral".into();
            match window {
                Some(w) => c["sliding_window"] = w,
                None => {
                    c.as_object_mut().unwrap().remove("sliding_window");
                }
            }
        })
    };
    let tmp = tempfile::tempdir().unwrap();
    mistral(tmp.path(), None);
    assert_eq!(mask_windows(tmp.path()), [Some(4096)]);
    mistral(tmp.path(), Some(serde_json::Value::Null));
    assert_eq!(mask_windows(tmp.path()), [None]);
    qwen2(tmp.path(), |c, _| {
        c["use_sliding_window"] = true.into();
        c["max_window_layers"] = 1.into();
    });
    assert_eq!(mask_windows(tmp.path()), [None, Some(4096)]);
}

#[test]
fn mistral_with_a_sliding_window() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("llama-tiny"), tmp.path(), Dtype::F32, 1, |c, _| {
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["model_type"] = "mistral".into();
        c["sliding_window"] = 5.into();
    });
    fused_equals_unfused(tmp.path(), "mistral");
    cpu_executor_agrees(tmp.path(), "mistral");
    // The window reaches the fused attention kernel.
    assert!(mask_windows(tmp.path()).contains(&Some(5)));
}

#[test]
fn llama_with_llama3_rope_and_biases() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("llama-tiny"), tmp.path(), Dtype::F32, 1, |c, t| {
        c["rope_parameters"] = serde_json::json!({
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64
        });
        c["attention_bias"] = true.into();
        c["mlp_bias"] = true.into();
        for l in 0..2u64 {
            for (name, n) in [
                ("self_attn.q_proj", 64),
                ("self_attn.k_proj", 32),
                ("self_attn.v_proj", 32),
                ("self_attn.o_proj", 64),
                ("mlp.gate_proj", 160),
                ("mlp.up_proj", 160),
                ("mlp.down_proj", 64),
            ] {
                add_bias(
                    t,
                    &format!("model.layers.{l}.{name}.bias"),
                    n,
                    100 + l * 10 + n as u64,
                );
            }
        }
    });
    fused_equals_unfused(tmp.path(), "llama3 + biases");
    cpu_executor_agrees(tmp.path(), "llama3 + biases");
}

#[test]
fn llama_with_yarn_rope() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("llama-tiny"), tmp.path(), Dtype::F32, 1, |c, _| {
        c["rope_parameters"] = serde_json::json!({
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 8, "mscale": 1.1,
            "mscale_all_dim": 0.9
        });
    });
    fused_equals_unfused(tmp.path(), "yarn");
    cpu_executor_agrees(tmp.path(), "yarn");
}

#[test]
fn gpt2_with_relu_and_layer_scaled_attention() {
    let tmp = tempfile::tempdir().unwrap();
    rewrite_checkpoint(&fixture("gpt2-tiny"), tmp.path(), Dtype::F32, 1, |c, _| {
        c["activation_function"] = "relu".into();
        c["scale_attn_by_inverse_layer_idx"] = true.into();
    });
    fused_equals_unfused(tmp.path(), "gpt2 relu");
    cpu_executor_agrees(tmp.path(), "gpt2 relu");
}
