//! Fused bucket graphs against the fixtures: every bucket's static graph, run by the interpreter,
//! reproduces the reference outputs; padding never changes a result; the kernel structure is what
//! the fusion issue promises (one attention kernel per block, at most 7 kernels per layer, no
//! standalone softmax, dropout, mask or scale).

use kiln_compiler::compile::{CompiledBucket, KernelReport};
use kiln_compiler::fusion::cost::KernelKind;
use kiln_ir::Tensor;
use kiln_models::inputs::TokenBatch;
use kiln_tests::{compile_fixture, fixture, floats, minilm_dir, pad_to, reference, rel_err};

fn run(
    bucket: &CompiledBucket,
    model: &kiln_models::Model,
    batch: &TokenBatch,
) -> std::collections::BTreeMap<String, Tensor> {
    let inputs = model.inputs(&pad_to(batch, bucket.bucket.seq)).unwrap();
    kiln_ir::evaluate(&bucket.graph, &inputs, &model.checkpoint).unwrap()
}

fn bucket_for(buckets: &[CompiledBucket], batch: usize, len: usize) -> &CompiledBucket {
    buckets
        .iter()
        .filter(|b| b.bucket.batch == batch && b.bucket.seq >= len)
        .min_by_key(|b| b.bucket.seq)
        .expect("a bucket holds the request")
}

#[test]
fn fused_decoder_buckets_reproduce_reference_logits() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let reference = reference(name);
        let (model, _, buckets) = compile_fixture(&fixture(name), &[16, 64, 128], &[1]);
        for l in [1usize, 7, 16, 33, 100] {
            let ids = reference[&format!("input_ids_{l}")]
                .as_i64()
                .unwrap()
                .to_vec();
            let bucket = bucket_for(&buckets, 1, l);
            let out = run(bucket, &model, &TokenBatch::unmasked(vec![ids]));
            let vocab = 512;
            let got = &floats(&out["logits"])[..l * vocab];
            let err = rel_err(got, floats(&reference[&format!("logits_{l}")]));
            assert!(
                err < 1e-4,
                "{name} L={l} in bucket {}: relative error {err:e}",
                bucket.bucket.seq
            );
        }
    }
}

fn masked_rows_err(
    got: &Tensor,
    want: &Tensor,
    mask: &[i64],
    seq_got: usize,
    seq_want: usize,
) -> f64 {
    let hidden = *want.shape.last().unwrap();
    let rows = mask.len() / seq_want;
    let (g, w) = (floats(got), floats(want));
    let (mut diff, mut scale) = (0f64, 0f64);
    for b in 0..rows {
        for t in 0..seq_want {
            if mask[b * seq_want + t] == 0 {
                continue;
            }
            for h in 0..hidden {
                let (x, y) = (
                    g[(b * seq_got + t) * hidden + h],
                    w[(b * seq_want + t) * hidden + h],
                );
                diff = diff.max((f64::from(x) - f64::from(y)).abs());
                scale = scale.max(f64::from(y).abs());
            }
        }
    }
    diff / scale
}

#[test]
fn fused_encoder_buckets_reproduce_references() {
    for (dir, name, rows) in [
        (fixture("bert-tiny"), "bert-tiny", 3),
        (minilm_dir(), "minilm-reference", 4),
    ] {
        let reference = reference(name);
        let (model, _, buckets) = compile_fixture(&dir, &[32, 64], &[rows]);
        let len = reference["input_ids"].shape[1];
        let (batch, _) =
            TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
                .unwrap();
        for bucket in &buckets {
            let out = run(bucket, &model, &batch);
            let mask = reference["attention_mask"].as_i64().unwrap();
            let err = masked_rows_err(
                &out["last_hidden_state"],
                &reference["last_hidden_state"],
                mask,
                bucket.bucket.seq,
                len,
            );
            assert!(
                err < 1e-4,
                "{name} bucket {}: relative error {err:e}",
                bucket.bucket.seq
            );
            if let Some(want) = reference.get("sentence_embedding") {
                kiln_tests::assert_embeddings_close(
                    &out["sentence_embedding"],
                    want,
                    rows,
                    &format!("{name} bucket {}", bucket.bucket.seq),
                );
            }
        }
    }
}

/// The same request padded to two different buckets gives bit-identical results on its tokens.
#[test]
fn padding_never_changes_a_result() {
    let reference = reference("gpt2-tiny");
    let (model, _, buckets) = compile_fixture(&fixture("gpt2-tiny"), &[16, 64], &[2]);
    let a = reference["batch_a"].as_i64().unwrap().to_vec();
    let b = reference["batch_b"].as_i64().unwrap().to_vec();
    let batch = TokenBatch::padded(&[a.clone(), b], 0);
    let small = run(&buckets[1], &model, &batch);
    let large = run(&buckets[0], &model, &batch);
    assert_eq!((buckets[1].bucket.seq, buckets[0].bucket.seq), (16, 64));
    let vocab = 512;
    for row in 0..2 {
        let len = if row == 0 { a.len() } else { 4 };
        for t in 0..len {
            let s = &floats(&small["logits"])[(row * 16 + t) * vocab..(row * 16 + t + 1) * vocab];
            let l = &floats(&large["logits"])[(row * 64 + t) * vocab..(row * 64 + t + 1) * vocab];
            assert_eq!(s, l, "row {row} token {t}");
        }
    }
}

fn layers(model: &kiln_models::Model) -> usize {
    let c = model.checkpoint.config();
    ["n_layer", "num_hidden_layers"]
        .iter()
        .find_map(|k| c.get(*k).and_then(|v| v.as_u64()))
        .unwrap() as usize
}

fn assert_kernel_structure(name: &str, kernels: &[KernelReport], layers: usize, pooling: bool) {
    let attention = kernels
        .iter()
        .filter(|k| k.kind == KernelKind::Attention)
        .count();
    assert_eq!(attention, layers, "{name}: one attention kernel per block");
    for k in kernels {
        for forbidden in [
            "softmax",
            "dropout",
            "causal_mask",
            "padding_mask",
            "softmax_dropout",
        ] {
            assert!(
                !k.name.starts_with(&format!("{forbidden}_")),
                "{name}: standalone {}",
                k.name
            );
        }
        if !pooling {
            assert!(
                matches!(
                    k.kind,
                    KernelKind::Attention
                        | KernelKind::Gemm
                        | KernelKind::Norm
                        | KernelKind::Embedding
                ),
                "{name}: unfused kernel {} ({:?})",
                k.name,
                k.kind
            );
        }
    }
    // Per layer: norm, QKV GEMM, attention, output GEMM (+residual), norm, MLP GEMM (+activation
    // or SwiGLU), down GEMM (+residual): 7. Outside the layers: the embedding, one norm and the LM head.
    let core = kernels
        .iter()
        .filter(|k| {
            matches!(
                k.kind,
                KernelKind::Attention | KernelKind::Gemm | KernelKind::Norm | KernelKind::Embedding
            )
        })
        .count();
    assert!(
        core <= 7 * layers + 3,
        "{name}: {core} kernels for {layers} layers"
    );
}

#[test]
fn every_fixture_fuses_to_at_most_seven_kernels_per_layer() {
    for (dir, name) in [
        (fixture("gpt2-tiny"), "gpt2-tiny"),
        (fixture("llama-tiny"), "llama-tiny"),
        (fixture("bert-tiny"), "bert-tiny"),
        (minilm_dir(), "minilm"),
    ] {
        let (model, report, _) = compile_fixture(&dir, &[16, 128], &[1, 4]);
        assert_eq!(report.buckets.len(), 4);
        for b in &report.buckets {
            assert_kernel_structure(name, &b.kernels, layers(&model), name == "minilm");
            if matches!(name, "gpt2-tiny" | "llama-tiny") {
                // Pre-norm decoders: each norm moves into the following GEMM's prologue, so a
                // layer is 5 kernels (QKV GEMM, attention, output GEMM, MLP GEMM, down GEMM), plus
                // the embedding and the LM head (with the final norm in its prologue).
                assert_eq!(b.kernels.len(), 5 * layers(&model) + 2, "{name}");
            }
        }
    }
}

#[test]
fn fused_graph_snapshots() {
    for (dir, name) in [
        (fixture("gpt2-tiny"), "gpt2-tiny"),
        (fixture("llama-tiny"), "llama-tiny"),
        (fixture("bert-tiny"), "bert-tiny"),
        (minilm_dir(), "minilm"),
    ] {
        let text =
            kiln_tests::kiln(&["ir", dir.to_str().unwrap(), "--fused", "--bucket", "16"]).unwrap();
        insta::assert_snapshot!(format!("fused_{name}_s16"), text);
    }
}

fn compile_with(
    dir: &std::path::Path,
    options: &kiln_models::ImportOptions,
    seq: usize,
) -> (kiln_models::Model, CompiledBucket) {
    use kiln_compiler::bucket::BucketPlan;
    use kiln_compiler::compile::{compile, CompileOptions};
    let model = kiln_models::import_with(dir, options).unwrap();
    let opts = CompileOptions::prefill(BucketPlan::new(vec![seq], vec![1]).unwrap());
    let (_, mut compiled) = compile(&model.graph, None, &opts).unwrap();
    (model, compiled.prefill.remove(0))
}

/// `--dropout` keeps attention dropout: the fused attention kernels draw exactly the unfused
/// graph's masks (same seed, same logits); another seed draws other masks.
#[test]
fn dropout_plans_draw_the_unfused_masks() {
    let options = kiln_models::ImportOptions {
        dtype: kiln_ir::DType::F32,
        dropout: true,
        kv_cache: false,
    };
    let (model, bucket) = compile_with(&fixture("gpt2-tiny"), &options, 16);
    let attention: Vec<_> = bucket
        .graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            kiln_ir::Op::Attention(a) => Some(a.dropout),
            _ => None,
        })
        .collect();
    assert_eq!(attention, vec![Some((0.1, 0)), Some((0.1, 1))]);
    let ids: Vec<i64> = (0..16).map(|i| (i * 37 + 5) % 512).collect();
    let run_with = |graph: &kiln_ir::Graph, seed: i64| {
        let mut inputs = model
            .inputs(&TokenBatch::unmasked(vec![ids.clone()]))
            .unwrap();
        inputs.insert("seed".into(), Tensor::i64(vec![], vec![seed]));
        let fixed = graph.specialize(&bucket.bucket.bindings()).unwrap();
        floats(&kiln_ir::evaluate(&fixed, &inputs, &model.checkpoint).unwrap()["logits"]).to_vec()
    };
    let fused = run_with(&bucket.graph, 7);
    let unfused = run_with(&model.graph, 7);
    assert!(rel_err(&fused, &unfused) < 1e-5);
    let other = run_with(&bucket.graph, 8);
    assert!(
        rel_err(&other, &unfused) > 1e-3,
        "another seed draws other masks"
    );
}

/// bf16 plans (weights and activations in bf16) stay within the fixtures' half-precision
/// tolerance of the f32 reference.
#[test]
fn bf16_plans_match_the_reference_within_half_precision_tolerance() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let options = kiln_models::ImportOptions {
            dtype: kiln_ir::DType::BF16,
            dropout: false,
            kv_cache: false,
        };
        let (model, bucket) = compile_with(&fixture(name), &options, 64);
        let reference = reference(name);
        let ids = reference["input_ids_33"].as_i64().unwrap().to_vec();
        let out = run(&bucket, &model, &TokenBatch::unmasked(vec![ids]));
        let vocab = 512;
        let got = &floats(&out["logits"])[..33 * vocab];
        let want = floats(&reference["logits_33"]);
        kiln_tests::assert_half_precision_close(got, want, vocab, &format!("{name} bf16"));
    }
}

/// Kernel-aware extraction: for every family (the fixtures, and the real shapes of
/// `../shared/configs` without weights), in f32 and bf16, at short and long buckets and in the
/// KV-cached graph (decode steps and prompt chunks), the extracted graph is modelled no slower
/// than the unfused graph it came from, its modelled cost is what the cost model gives it, and it
/// leaves nothing to the host.
#[test]
fn extraction_is_never_modelled_slower_than_the_unfused_graph() {
    use kiln_compiler::fusion::cost::{graph_seconds, graph_work, CostModel, Runs};
    use kiln_compiler::fusion::{saturate, Limits};
    use kiln_ir::dim::{BATCH, CONTEXT, SEQ};
    let configs = kiln_tests::workspace_root().join("../shared/configs");
    let mut models: Vec<(std::path::PathBuf, bool)> = ["gpt2-tiny", "llama-tiny", "bert-tiny"]
        .iter()
        .map(|n| (fixture(n), true))
        .collect();
    let mut shapes: Vec<_> = std::fs::read_dir(&configs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    shapes.sort();
    assert!(shapes.len() >= 5, "configs in {}", configs.display());
    models.extend(shapes.into_iter().map(|p| (p, false)));
    let cost = CostModel::default();
    for (dir, weights) in &models {
        for dtype in [kiln_ir::DType::F32, kiln_ir::DType::BF16] {
            for kv_cache in [false, true] {
                let options = kiln_models::ImportOptions {
                    dtype,
                    dropout: false,
                    kv_cache,
                };
                let model = if *weights {
                    kiln_models::import_with(dir, &options)
                } else {
                    kiln_models::import_config_only(dir, &options)
                }
                .unwrap();
                let buckets: &[(i64, i64)] = match (kv_cache, &model.kind) {
                    (true, kiln_models::ModelKind::Encoder { .. }) => continue,
                    (true, _) => &[(1, 1), (4, 1), (1, 128)],
                    (false, _) => &[(1, 1), (4, 16), (1, 512), (1, 2048)],
                };
                let sat = saturate(&model.graph, &Limits::default()).unwrap();
                for &(batch, seq) in buckets {
                    let bindings = std::collections::BTreeMap::from([
                        (BATCH.to_string(), batch),
                        (SEQ.to_string(), seq),
                        (CONTEXT.to_string(), 2048),
                    ]);
                    let (fused, modelled) = sat.extract(&bindings, &cost).unwrap();
                    let unfused = graph_seconds(&model.graph, &bindings, &cost);
                    let what = format!(
                        "{} {dtype} b{batch} s{seq}{}",
                        dir.display(),
                        if kv_cache { " (KV cache)" } else { "" }
                    );
                    assert!(
                        modelled <= unfused * (1.0 + 1e-9),
                        "{what}: extracted {modelled:e} s > unfused {unfused:e} s"
                    );
                    // Nothing is left to the host (which would cost the bucket its GPU plan),
                    // however slow a kernel's fallback is.
                    let host: Vec<_> = graph_work(&fused, &bindings)
                        .into_iter()
                        .filter(|(_, w)| w.runs == Runs::Host)
                        .map(|(id, _)| fused.node(id).op.name())
                        .collect();
                    assert!(host.is_empty(), "{what}: host ops {host:?}");
                    let again = graph_seconds(&fused, &bindings, &cost);
                    assert!(
                        (again - modelled).abs() <= 1e-9 * modelled,
                        "{what}: {again:e} vs {modelled:e}"
                    );
                }
            }
        }
    }
}
