//! Compile -> artifact -> the CPU executor (generated Cranelift kernels and the `gemm` crate, no
//! interpreter): every fixture model, compiled f32, reproduces its references within 1e-4, and
//! greedy generation through the executor's KV cache reproduces `greedy_tokens`.

use kiln_ir::inputs::TokenBatch;
use kiln_runtime::generate::{generate, Sampling};
use kiln_runtime::{forward::forward, Artifact, Device, Executor};
use kiln_tests::{
    assert_chained_steps_match, assert_decoder_references, assert_embeddings_close,
    assert_greedy_tokens, assert_paced_chunks_keep_tokens, assert_sequences_wait_for_blocks,
    compile_artifact, fixture, masked_rel_err, minilm_dir, reference, BATCHER_ARTIFACT,
    SMALL_POOL_ARTIFACT,
};

/// The CPU executor, which must be the generated kernels (not the interpreter) for an f32 build.
fn native(art: &Artifact) -> Executor {
    for e in art.manifest.buckets() {
        let plan = e.plan.as_ref().expect("a plan");
        assert!(plan.cpu.is_some(), "{} has a CPU plan", e.graph);
    }
    let exec = Executor::open(art, Device::Cpu).unwrap();
    assert!(
        matches!(exec, Executor::Cpu(_)),
        "an f32 artifact runs on the generated CPU kernels"
    );
    exec
}

#[test]
fn decoders_match_references_on_the_cpu_executor() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-tiny", "llama-tiny"] {
        let art = compile_artifact(
            &fixture(name),
            &tmp.path().join(format!("{name}.kiln")),
            &[
                "--buckets",
                "16,64,128",
                "--batch-buckets",
                "1,4",
                "--max-context",
                "64",
            ],
        );
        let mut exec = native(&art);
        assert_decoder_references(&art, &mut exec, name, "f32");
        for _ in 0..2 {
            assert_greedy_tokens(&art, &mut exec, name, "on the CPU executor");
        }
    }
}

/// Greedy decode steps chained on the CPU executor (each step's tokens become the next step's
/// ids at the next positions, as the GPU's advancing token choice leaves them) give the tokens
/// of single steps, and prompt chunks paced against the decode steps those of unpaced ones.
#[test]
fn chained_steps_and_paced_chunks_keep_the_tokens_on_the_cpu_executor() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-tiny", "llama-tiny"] {
        let art = compile_artifact(&fixture(name), &tmp.path().join(name), &BATCHER_ARTIFACT);
        assert_chained_steps_match(&art, &mut native(&art), name);
        assert_paced_chunks_keep_tokens(&art, &mut native(&art), name);
    }
}

#[test]
fn encoders_match_references_on_the_cpu_executor() {
    let tmp = tempfile::tempdir().unwrap();
    for (dir, name) in [
        (fixture("bert-tiny"), "bert-tiny"),
        (minilm_dir(), "minilm-reference"),
    ] {
        let art = compile_artifact(
            &dir,
            &tmp.path().join(format!("{name}.kiln")),
            &["--buckets", "32", "--batch-buckets", "4"],
        );
        let mut exec = native(&art);
        let reference = reference(name);
        let (batch, _) =
            TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
                .unwrap();
        let out = forward(&art, &mut exec, &batch).unwrap();
        let err = masked_rel_err(
            &out["last_hidden_state"],
            &reference["last_hidden_state"],
            &reference["attention_mask"],
        );
        assert!(err < 1e-4, "{name}: relative error {err:e}");
        if let Some(want) = reference.get("sentence_embedding") {
            assert_embeddings_close(&out["sentence_embedding"], want, want.shape[0], name);
        }
    }
}

/// f16 and bf16 builds run on the CPU executor too (their CPU plans computed in f32 over weights
/// widened at load, outputs rounded to the build's dtype): every fixture within the
/// half-precision tolerance of its reference.
#[test]
fn half_precision_builds_run_on_the_cpu_executor() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f16", "bf16"] {
        for name in ["gpt2-tiny", "llama-tiny"] {
            let art = compile_artifact(
                &fixture(name),
                &tmp.path().join(format!("{name}-{dtype}.kiln")),
                &[
                    "--buckets",
                    "16,64,128",
                    "--batch-buckets",
                    "1,4",
                    "--dtype",
                    dtype,
                ],
            );
            assert!(
                art.manifest.cpu_memory.is_some(),
                "a widened CPU memory plan"
            );
            let mut exec = native(&art);
            assert_decoder_references(&art, &mut exec, name, dtype);
            // Decoding through the widened KV cache: with f32 arithmetic over the rounded
            // weights, the fixtures' decisive logits keep every greedy token.
            assert_greedy_tokens(&art, &mut exec, name, &format!("of the {dtype} build"));
        }
        for (dir, name) in [
            (fixture("bert-tiny"), "bert-tiny"),
            (minilm_dir(), "minilm-reference"),
        ] {
            let art = compile_artifact(
                &dir,
                &tmp.path().join(format!("{name}-{dtype}.kiln")),
                &["--buckets", "32", "--batch-buckets", "4", "--dtype", dtype],
            );
            let reference = reference(name);
            let (batch, _) = TokenBatch::from_tensors(
                &reference["input_ids"],
                Some(&reference["attention_mask"]),
            )
            .unwrap();
            let out = forward(&art, &mut native(&art), &batch).unwrap();
            let hidden = &out["last_hidden_state"];
            assert_eq!(
                hidden.dtype.to_string(),
                dtype,
                "outputs in the build's dtype"
            );
            let err = masked_rel_err(
                hidden,
                &reference["last_hidden_state"],
                &reference["attention_mask"],
            );
            assert!(err < 2e-2, "{name} {dtype}: relative error {err:e}");
            if let Some(want) = reference.get("sentence_embedding") {
                let got = kiln_tests::floats(&out["sentence_embedding"]);
                let err = kiln_tests::rel_err(got, kiln_tests::floats(want));
                assert!(err < 2e-2, "{name} {dtype}: sentence embeddings {err:e}");
            }
        }
    }
}

/// Sampling on the CPU runs the artifact's generated sampler: it picks the runtime reference's
/// token (`generate::choose`, integer weights: the same bits) on random rows for every mode,
/// NaN and -inf logits among them, and a seeded top-k/top-p generation
/// through the CPU executor gives the interpreter's tokens.
#[test]
fn generated_sampler_matches_the_reference() {
    use kiln_runtime::generate::choose;
    let tmp = tempfile::tempdir().unwrap();
    let art = compile_artifact(
        &fixture("gpt2-tiny"),
        &tmp.path().join("gpt2.kiln"),
        &["--buckets", "16", "--max-context", "64"],
    );
    assert!(
        art.manifest.cpu_sampler.is_some(),
        "a decoder gets a sampler"
    );
    let mut exec = native(&art);
    let vocab = art.manifest.model.vocab_size;
    let modes = [
        Sampling::greedy(),
        Sampling {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            seed: 3,
        },
        Sampling {
            temperature: 1.2,
            top_k: 20,
            top_p: 1.0,
            seed: 4,
        },
        Sampling {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.8,
            seed: 5,
        },
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for mode in &modes {
        for step in 0..200u32 {
            let mut row: Vec<f32> = (0..vocab)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
                })
                .collect();
            if step % 8 == 0 {
                // NaN (of either sign: below every key) and -inf (no weight) among the logits.
                let s = step as usize;
                row[(s * 7) % vocab] = f32::NAN;
                row[(s * 13 + 1) % vocab] = -f32::NAN;
                row[(s * 31 + 2) % vocab] = f32::NEG_INFINITY;
            }
            let got = exec.choose(&row, mode, step).unwrap();
            assert_eq!(got, choose(&row, mode, step), "{mode:?} step {step}");
        }
    }
    // Parameters outside their ranges are refused, naming them, on every path.
    let bad = Sampling {
        top_p: 0.0,
        ..modes[1]
    };
    let row = vec![0.0f32; vocab];
    let err = exec.choose(&row, &bad, 0).unwrap_err().to_string();
    assert!(err.contains("top-p"), "{err}");
    let reference = reference("gpt2-tiny");
    let prompt = reference["greedy_prompt"].as_i64().unwrap().to_vec();
    let err = generate(&art, &mut exec, &prompt, 3, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("top-p"), "{err}");
    let mode = &modes[3];
    let got = generate(&art, &mut exec, &prompt, 30, mode).unwrap();
    let want = generate(&art, &mut Executor::Interpreter, &prompt, 30, mode).unwrap();
    assert_eq!(got, want, "seeded top-k/top-p generation");
}

/// Every sentence-transformers head (each pooling mode, several modes concatenated, with and
/// without normalisation) runs on the CPU as generated strided kernels — no host tail, no
/// interpreter — and gives the interpreter's embeddings.
#[test]
fn pooling_heads_run_as_generated_kernels() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference("bert-tiny");
    let (batch, _) =
        TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
            .unwrap();
    let heads: [(&[&str], bool); 5] = [
        (&["pooling_mode_mean_tokens"], true),
        (&["pooling_mode_cls_token"], false),
        (&["pooling_mode_max_tokens"], false),
        (&["pooling_mode_mean_sqrt_len_tokens"], true),
        (
            &[
                "pooling_mode_cls_token",
                "pooling_mode_max_tokens",
                "pooling_mode_mean_tokens",
            ],
            true,
        ),
    ];
    for (i, (modes, normalize)) in heads.into_iter().enumerate() {
        let st = tmp.path().join(format!("st-{i}"));
        kiln_tests::sentence_transformers_copy(&fixture("bert-tiny"), &st, modes, normalize);
        let art = compile_artifact(
            &st,
            &tmp.path().join(format!("st-{i}.kiln")),
            &["--buckets", "32", "--batch-buckets", "4"],
        );
        let plan = art.manifest.prefill[0].plan.as_ref().unwrap();
        let cpu = plan.cpu.as_ref().expect("a CPU plan");
        let strided = cpu
            .steps
            .iter()
            .filter(|s| {
                matches!(&s.call, kiln_ir::artifact::CpuCall::Kernel { symbol, .. }
                    if symbol.starts_with("cpu_strided_"))
            })
            .count();
        assert!(strided > 0, "{modes:?}: the head runs as strided kernels");
        let got = forward(&art, &mut native(&art), &batch).unwrap();
        let want = forward(&art, &mut Executor::Interpreter, &batch).unwrap();
        let (g, w) = (&got["sentence_embedding"], &want["sentence_embedding"]);
        assert_eq!(g.shape, w.shape, "{modes:?}");
        let err = kiln_tests::rel_err(kiln_tests::floats(g), kiln_tests::floats(w));
        assert!(
            err < 1e-5,
            "{modes:?} (normalize {normalize}): relative error {err:e}"
        );
        println!("ok: {modes:?} normalize {normalize}: {strided} strided steps, error {err:e}");
    }
}

/// A `--dropout` build (a training-mode forward): the CPU executor's generated attention draws
/// exactly the interpreter's Philox masks, so both give the same logits (p = 0.1 drops about one
/// weight in ten; one mask bit drawn differently would move a row far past 1e-4).
#[test]
fn dropout_masks_match_the_interpreter() {
    use kiln_ir::Tensor;
    let tmp = tempfile::tempdir().unwrap();
    let art = compile_artifact(
        &fixture("gpt2-tiny"),
        &tmp.path().join("dropout.kiln"),
        &["--buckets", "16", "--dropout"],
    );
    let reference = reference("gpt2-tiny");
    let ids = reference["input_ids_16"].as_i64().unwrap().to_vec();
    let batch = TokenBatch::unmasked(vec![ids]);
    let (bucket, mut inputs) = kiln_runtime::forward::prepare(&art, &batch).unwrap();
    assert!(
        art.graphs[&bucket.graph]
            .inputs()
            .any(|(_, n, _)| n == "seed"),
        "a --dropout graph reads a seed"
    );
    inputs.insert(
        "seed".to_string(),
        Tensor::i64(vec![], vec![0x1234_5678_9abc]),
    );
    let mut exec = native(&art);
    let got = exec.run(&art, bucket, &inputs).unwrap();
    let want = Executor::Interpreter.run(&art, bucket, &inputs).unwrap();
    let err = kiln_tests::rel_err(
        kiln_tests::floats(&got["logits"]),
        kiln_tests::floats(&want["logits"]),
    );
    assert!(err < 1e-4, "dropout logits: relative error {err:e}");
    // And dropout did something: another seed gives other logits.
    inputs.insert("seed".to_string(), Tensor::i64(vec![], vec![7]));
    let other = exec.run(&art, bucket, &inputs).unwrap();
    let moved = kiln_tests::rel_err(
        kiln_tests::floats(&other["logits"]),
        kiln_tests::floats(&got["logits"]),
    );
    assert!(moved > 1e-3, "another seed draws another mask ({moved:e})");
}

/// `--target cpu` writes CPU kernels and no GPU code; `--target cuda` the reverse, and such an
/// artifact is refused on the CPU, naming why (the interpreter runs it when asked for).
#[test]
fn targets_choose_the_code_generated() {
    let tmp = tempfile::tempdir().unwrap();
    let cpu = compile_artifact(
        &fixture("gpt2-tiny"),
        &tmp.path().join("cpu.kiln"),
        &[
            "--buckets",
            "16,128",
            "--batch-buckets",
            "1,4",
            "--target",
            "cpu",
        ],
    );
    assert!(cpu.manifest.kernels_ptx.is_none() && cpu.manifest.kernels_cubin.is_none());
    assert!(!cpu.dir.join("kernels.ptx").exists());
    let mut exec = native(&cpu);
    assert_decoder_references(&cpu, &mut exec, "gpt2-tiny", "f32");

    let cuda = compile_artifact(
        &fixture("gpt2-tiny"),
        &tmp.path().join("cuda.kiln"),
        &["--buckets", "16", "--target", "cuda"],
    );
    assert!(cuda.manifest.kernels_ptx.is_some() && cuda.manifest.kernels_cpu.is_none());
    let Err(e) = Executor::open(&cuda, Device::Cpu) else {
        panic!("a CUDA-only artifact has no CPU executor");
    };
    assert!(e.to_string().contains("--target cuda"), "{e}");
    let exec = Executor::open(&cuda, Device::Interpreter).unwrap();
    assert!(matches!(exec, Executor::Interpreter));
}

/// Sequences wait for the blocks of a small paged cache and get their own tokens
/// ([`assert_sequences_wait_for_blocks`]).
#[test]
fn sequences_wait_for_kv_blocks_and_get_their_own_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama.kiln");
    let art = compile_artifact(&fixture("llama-tiny"), &dir, &SMALL_POOL_ARTIFACT);
    let mut exec = native(&art);
    for launch_ahead in [false, true] {
        // The CPU executor runs no step over inputs a step left: nothing is launched ahead.
        assert_eq!(
            assert_sequences_wait_for_blocks(&art, &mut exec, launch_ahead),
            0
        );
    }
    // The kernels trust the table: the executor takes only tables of the pool's blocks, and a
    // paged cache moves no rows by copying them.
    let err = |r: Result<(), kiln_runtime::RuntimeError>| r.unwrap_err().to_string();
    let bad = err(exec.write_block_table(&[17; 64]));
    assert_eq!(bad, "block 17 in a block table of 17 blocks");
    let short = err(exec.write_block_table(&[1; 63]));
    assert_eq!(short, "a block table of 63 entries; the cache's holds 64");
    assert!(err(exec.copy_cache_row(0, 1)).contains("through its block table"));
}
