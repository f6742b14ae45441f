//! Compile -> artifact -> runtime, through the reference interpreter (the artifact's bucket
//! graphs, padding, plans and checks; `runtime_native_cpu.rs` runs the generated CPU kernels): a
//! verified artifact reproduces the fixtures through its padded buckets, and corrupt or
//! mismatched artifacts are refused with the file named.

use std::path::Path;

use kiln_ir::inputs::TokenBatch;
use kiln_runtime::{forward::forward, Artifact, Executor};
use kiln_tests::{
    assert_embeddings_close, assert_greedy_tokens, compile_artifact as compile, fixture, floats,
    kiln, masked_rel_err, minilm_dir, minilm_sentences, reference, rel_err, reseal_checksums,
    sentence_transformers_copy,
};

#[test]
fn decoder_artifact_reproduces_reference_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gpt2.kiln");
    compile(
        &fixture("gpt2-tiny"),
        &out,
        &["--buckets", "16,64,128", "--batch-buckets", "1,4"],
    );
    let art = Artifact::open(&out).unwrap();
    let summary = kiln(&["inspect", out.to_str().unwrap()]).unwrap();
    for needle in [
        "GPT2LMHeadModel (decoder)",
        "prefill b4 s128: 12 kernels",
        "memory plan:",
        "decode b1 s1 (context 128)",
    ] {
        assert!(summary.contains(needle), "{needle} in {summary}");
    }
    let reference = reference("gpt2-tiny");
    for l in [1usize, 33, 100] {
        let ids = reference[&format!("input_ids_{l}")]
            .as_i64()
            .unwrap()
            .to_vec();
        let out = forward(
            &art,
            &mut Executor::Interpreter,
            &TokenBatch::unmasked(vec![ids]),
        )
        .unwrap();
        assert_eq!(out["logits"].shape, vec![1, l, 512]);
        let err = rel_err(
            floats(&out["logits"]),
            floats(&reference[&format!("logits_{l}")]),
        );
        assert!(err < 1e-4, "L={l}: relative error {err:e}");
    }
    // Two prompts of different lengths in a batch bucket of 4 (two dummy rows).
    let a = reference["batch_a"].as_i64().unwrap().to_vec();
    let b = reference["batch_b"].as_i64().unwrap().to_vec();
    let out = forward(
        &art,
        &mut Executor::Interpreter,
        &TokenBatch::padded(&[a.clone(), b.clone()], 0),
    )
    .unwrap();
    let logits = floats(&out["logits"]);
    for (row, (len, key)) in [
        (a.len(), "batch_a_last_logits"),
        (b.len(), "batch_b_last_logits"),
    ]
    .into_iter()
    .enumerate()
    {
        let at = (row * a.len() + len - 1) * 512;
        let err = rel_err(&logits[at..at + 512], floats(&reference[key]));
        assert!(err < 1e-4, "{key}: relative error {err:e}");
    }
    let err = forward(
        &art,
        &mut Executor::Interpreter,
        &TokenBatch::unmasked(vec![vec![1; 129]]),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("no bucket holds 1 x 129 tokens"), "{err}");
}

#[test]
fn encoder_artifacts_reproduce_references() {
    let tmp = tempfile::tempdir().unwrap();
    for (dir, name) in [
        (fixture("bert-tiny"), "bert-tiny"),
        (minilm_dir(), "minilm-reference"),
    ] {
        let out = tmp.path().join(format!("{name}.kiln"));
        compile(&dir, &out, &["--buckets", "32", "--batch-buckets", "4"]);
        let art = Artifact::open(&out).unwrap();
        let reference = reference(name);
        let (batch, _) =
            TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
                .unwrap();
        let out = forward(&art, &mut Executor::Interpreter, &batch).unwrap();
        let (got, want) = (&out["last_hidden_state"], &reference["last_hidden_state"]);
        let err = masked_rel_err(got, want, &reference["attention_mask"]);
        assert!(err < 1e-4, "{name}: relative error {:e}", err);
        if let Some(want) = reference.get("sentence_embedding") {
            assert_embeddings_close(&out["sentence_embedding"], want, want.shape[0], name);
        }
    }
}

#[test]
fn corrupt_artifacts_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.kiln");
    compile(&fixture("llama-tiny"), &good, &["--buckets", "16"]);
    let copy = |name: &str| {
        let dst = tmp.path().join(name);
        std::fs::create_dir_all(dst.join("buckets")).unwrap();
        for entry in walk(&good) {
            let rel = entry.strip_prefix(&good).unwrap();
            std::fs::copy(&entry, dst.join(rel)).unwrap();
        }
        dst
    };
    let refuse = |dir: &Path, needle: &str| {
        let err = Artifact::open(dir).err().expect("refused").to_string();
        assert!(err.contains(needle), "expected {needle:?} in {err:?}");
    };

    let flipped = copy("flipped.kiln");
    let weights = flipped.join("weights.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&weights, bytes).unwrap();
    refuse(&flipped, "weights.safetensors: does not match its checksum");

    let short = copy("short-weights.kiln");
    let weights = short.join("weights.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 4096]).unwrap();
    refuse(&short, "weights.safetensors: does not match its checksum");

    let truncated = copy("truncated.kiln");
    let graph = truncated.join("buckets/prefill-b1-s16.ron");
    let text = std::fs::read(&graph).unwrap();
    std::fs::write(&graph, &text[..text.len() / 2]).unwrap();
    refuse(
        &truncated,
        "prefill-b1-s16.ron: does not match its checksum",
    );

    let missing = copy("missing.kiln");
    std::fs::remove_file(missing.join("kernels.ptx")).unwrap();
    refuse(&missing, "kernels.ptx: cannot be read");

    // Another format version, with the checksums updated so that only the version differs.
    let version = copy("version.kiln");
    let manifest = version.join("manifest.ron");
    let text = std::fs::read_to_string(&manifest).unwrap().replacen(
        &format!("format_version: {}", kiln_ir::artifact::FORMAT_VERSION),
        "format_version: 99",
        1,
    );
    std::fs::write(&manifest, text).unwrap();
    reseal_checksums(&version);
    refuse(
        &version,
        &format!(
            "manifest.ron: has format version 99; this runtime reads version {}",
            kiln_ir::artifact::FORMAT_VERSION
        ),
    );

    // A damaged checksum list is named as itself, not as the file whose hash it garbled: one
    // flipped bit in the weights' hash, and a list without its own line.
    let sums_flipped = copy("sums-flipped.kiln");
    let sums = sums_flipped.join("checksums");
    let text = std::fs::read_to_string(&sums).unwrap();
    let at = text.find("  weights.safetensors").unwrap() - 1;
    let mut bytes = text.clone().into_bytes();
    bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
    std::fs::write(&sums, bytes).unwrap();
    refuse(
        &sums_flipped,
        "checksums: does not match its own checksum line: the checksums file itself is corrupt",
    );
    let unsealed = copy("unsealed.kiln");
    let own = text
        .rfind('\n')
        .and_then(|end| text[..end].rfind('\n'))
        .unwrap();
    std::fs::write(unsealed.join("checksums"), &text[..=own]).unwrap();
    refuse(
        &unsealed,
        "checksums: does not end with its own checksum line",
    );

    let no_sums = copy("nosums.kiln");
    std::fs::remove_file(no_sums.join("checksums")).unwrap();
    refuse(&no_sums, "checksums: cannot be read");

    assert!(
        Artifact::open(&good).is_ok(),
        "the untouched artifact still opens"
    );
}

/// Every bucket's GPU plan passes the loader's checks (a known kernel per step, one argument of
/// the declared kind per parameter, every pointer inside its region, inputs and outputs inside the
/// arena); a kernel shared by buckets of different sizes is launched with each bucket's own grid;
/// the weights file is laid out exactly as the memory plan says.
#[test]
fn plans_are_consistent_with_the_kernel_table_and_the_allocation() {
    use kiln_ir::artifact::{Arg, Region};
    use kiln_runtime::cuda::check_plan;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("gpt2.kiln");
    compile(
        &fixture("gpt2-tiny"),
        &dir,
        &[
            "--buckets",
            "16,64",
            "--batch-buckets",
            "1,4",
            "--max-context",
            "64",
        ],
    );
    let art = Artifact::open(&dir).unwrap();
    let m = &art.manifest;
    let table = m
        .kernel_table
        .iter()
        .map(|k| (k.name.as_str(), k))
        .collect();
    let mut grids: std::collections::BTreeMap<&str, std::collections::BTreeSet<[u32; 3]>> =
        Default::default();
    for e in m.buckets() {
        let plan = e.plan.as_ref().expect("every gpt2 bucket has a GPU plan");
        check_plan(&art, e, plan, &table).unwrap();
        assert!(plan.arena_bytes <= m.memory.arena_bytes);
        for step in &plan.steps {
            grids
                .entry(&step.kernel)
                .or_default()
                .insert(step.launch.grid);
        }
    }
    // Decode steps end with the greedy choice into `tokens` (one i64 per row), which also
    // advances the step's inputs for the next step; prefill buckets and the prompt chunk choose
    // none.
    for e in m.buckets() {
        let plan = e.plan.as_ref().unwrap();
        let decode_step = m.decode.contains(e) && e.seq == 1;
        assert_eq!(plan.tokens.is_some(), decode_step, "{}", e.graph);
        let Some(tokens) = &plan.tokens else { continue };
        assert_eq!(
            (tokens.dtype, tokens.shape.clone()),
            (kiln_ir::DType::I64, vec![e.batch])
        );
        let logits = plan.outputs.iter().find(|s| s.name == "logits").unwrap();
        let last = plan.steps.last().unwrap();
        assert!(plan.advances, "{}", e.graph);
        let input = |name: &str| plan.inputs.iter().find(|s| s.name == name).unwrap();
        let (ids, positions, mask) = (
            input("input_ids"),
            input("position_ids"),
            input("attention_mask"),
        );
        let written = [tokens.offset, ids.offset, positions.offset, mask.offset]
            .map(|at| Arg::Ptr(Region::Arena, at));
        // An LM head on the one-row kernel (this f32 build's) leaves each row's choice as a
        // key in the counters region, which a one-block kernel reads; otherwise the argmax
        // reads the logits.
        let head = &plan.steps[plan.steps.len() - 2];
        if head.kernel.ends_with("_gemv_choosing") {
            assert!(
                last.kernel.starts_with("choose_advance_from_keys"),
                "{}",
                last.kernel
            );
            assert_eq!(head.args.last(), Some(&Arg::Ptr(Region::Counters, 0)));
            assert_eq!(last.args[0], Arg::Ptr(Region::Counters, 0));
            assert_eq!(last.args[1..], written);
            assert_eq!(last.launch.grid, [1, 1, 1]);
            assert!(m.memory.counter_bytes >= 8 * e.batch as u64);
        } else {
            assert!(last.kernel.starts_with("argmax_advance"), "{}", last.kernel);
            assert_eq!(last.args[0], Arg::Ptr(Region::Arena, logits.offset));
            assert_eq!(last.args[1..], written);
            assert_eq!(last.launch.grid, [e.batch as u32, 1, 1]);
        }
        // What the last step reads and writes overlaps nothing else it touches, so the inputs it
        // leaves are the next replay's.
        let spans: Vec<(u64, u64)> = [logits, tokens, ids, positions, mask]
            .iter()
            .map(|s| (s.offset, s.offset + s.bytes()))
            .collect();
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                assert!(a.1 <= b.0 || b.1 <= a.0, "{}: {a:?} and {b:?}", e.graph);
            }
        }
        // The sampler a step at temperature > 0 launches after the replay: over the same logits,
        // from a parameter slot (four words per row) that overlaps none of them.
        let sampler = plan.sampler.as_ref().expect("a decode step has a sampler");
        assert!(
            sampler.step.kernel.starts_with("sample_top_k_top_p"),
            "{}",
            e.graph
        );
        let params = &sampler.params;
        assert_eq!(
            (params.dtype, params.shape.clone()),
            (kiln_ir::DType::I32, vec![e.batch, 4])
        );
        assert_eq!(
            sampler.step.args,
            [logits.offset, params.offset, tokens.offset].map(|at| Arg::Ptr(Region::Arena, at))
        );
        for s in [logits, tokens, ids, positions, mask] {
            let apart =
                params.offset + params.bytes() <= s.offset || s.offset + s.bytes() <= params.offset;
            assert!(apart, "{}: the parameters overlap {}", e.graph, s.name);
        }
        let mut bad = plan.clone();
        bad.sampler.as_mut().unwrap().params.shape = vec![e.batch, 3];
        let err = check_plan(&art, e, &bad, &table).unwrap_err().to_string();
        assert!(err.contains("sampler"), "{err}");
        // A token slot of another shape is refused before anything runs, and so is an advancing
        // plan without one of the inputs it advances.
        let mut bad = plan.clone();
        bad.tokens.as_mut().unwrap().shape = vec![e.batch + 1];
        let err = check_plan(&art, e, &bad, &table).unwrap_err().to_string();
        assert!(err.contains("token slot"), "{err}");
        let mut bad = plan.clone();
        bad.inputs.retain(|s| s.name != "position_ids");
        let err = check_plan(&art, e, &bad, &table).unwrap_err().to_string();
        assert!(err.contains("`position_ids`"), "{err}");
    }
    // Kernels whose code does not depend on the rows (the embedding's; a LayerNorm's, a warp to
    // a row, which takes the rows as a parameter) serve every bucket, with the grid of each launch.
    for prefix in ["embedding", "layer_norm"] {
        let (name, kernel_grids) = grids
            .iter()
            .find(|(k, _)| k.starts_with(prefix))
            .unwrap_or_else(|| panic!("a {prefix} kernel"));
        assert!(
            kernel_grids.len() >= 3,
            "{name}: one grid per row count: {kernel_grids:?}"
        );
    }
    let region = art.weights.as_ref().unwrap().region(&m.memory).unwrap();
    assert_eq!(region.len() as u64, m.memory.weights_bytes);
    assert!(m
        .memory
        .weights
        .iter()
        .all(|w| w.offset % kiln_ir::artifact::ALIGN == 0));
}

/// A sentence-transformers encoder's pooling has no GPU kernel (or, for CLS, is a strided view
/// of the hidden states), so its buckets end in a host tail: the GPU values it reads come back as `kiln.value.N` and the tail graph computes the
/// embeddings from them. Evaluating the bucket up to those values and then the tail gives what
/// the whole bucket gives.
#[test]
fn pooling_runs_as_a_host_tail_after_the_gpu_plan() {
    use std::collections::BTreeMap;
    let tmp = tempfile::tempdir().unwrap();
    for (pooling, normalize) in [
        ("pooling_mode_mean_tokens", true),
        ("pooling_mode_cls_token", false),
    ] {
        let st = tmp.path().join(format!("st-{pooling}"));
        sentence_transformers_copy(&fixture("bert-tiny"), &st, &[pooling], normalize);
        let dir = tmp.path().join(format!("{pooling}.kiln"));
        compile(&st, &dir, &["--buckets", "32", "--batch-buckets", "4"]);
        let art = Artifact::open(&dir).unwrap();
        let entry = &art.manifest.prefill[0];
        // Mean pooling has no GPU kernel; CLS pooling is a strided view of the hidden states,
        // gathered on the host.
        assert_eq!(!entry.no_gpu.is_empty(), normalize, "{:?}", entry.no_gpu);
        let plan = entry.plan.as_ref().expect("a GPU plan with a host tail");
        let tail = plan.host_tail.as_ref().expect("a host tail");
        assert_eq!(
            tail.outputs()
                .iter()
                .map(|o| o.name.as_str())
                .collect::<Vec<_>>(),
            ["sentence_embedding"]
        );
        assert!(plan.outputs.iter().any(|o| o.name == "last_hidden_state"));

        let reference = reference("bert-tiny");
        let (batch, _) =
            TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
                .unwrap();
        let (bucket, inputs) = kiln_runtime::forward::prepare(&art, &batch).unwrap();
        let weights = art.weights.as_ref().unwrap();
        let mut graph = art.graphs[&bucket.graph].clone();
        let values: Vec<String> = plan
            .outputs
            .iter()
            .filter(|o| o.name.starts_with("kiln.value."))
            .map(|o| o.name.clone())
            .collect();
        assert!(!values.is_empty());
        for name in &values {
            let id: u32 = name["kiln.value.".len()..].parse().unwrap();
            graph.set_output(name, kiln_ir::NodeId(id)).unwrap();
        }
        let whole = kiln_ir::evaluate(&graph, &inputs, weights).unwrap();
        let mut tail_inputs = BTreeMap::new();
        for (_, name, _) in tail.inputs() {
            let t = whole.get(name).or_else(|| inputs.get(name)).unwrap();
            tail_inputs.insert(name.to_string(), t.clone());
        }
        let host = kiln_ir::evaluate(tail, &tail_inputs, weights).unwrap();
        assert_eq!(
            host["sentence_embedding"], whole["sentence_embedding"],
            "{pooling}: the tail computes the bucket's embeddings exactly"
        );
    }
}

/// A cubin for another SM is refused before anything is loaded, naming the file; so is a cubin
/// whose ELF header contradicts the manifest's targets (checksums updated, so only the SM differs).
#[test]
fn a_cubin_for_another_sm_is_refused() {
    use kiln_runtime::cuda::choose_image;
    let Some(ptxas) = kiln_compiler::writer::find_ptxas() else {
        println!("SKIPPED: no ptxas (set KILN_PTXAS or put ptxas on PATH) to assemble cubins");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama.kiln");
    compile(&fixture("llama-tiny"), &dir, &["--buckets", "16"]);
    let art = Artifact::open(&dir).unwrap();
    assert_eq!(art.manifest.targets, [90]);
    assert!(
        choose_image(&art, 90).is_ok(),
        "the sm_90 cubin serves sm_90"
    );
    let err = choose_image(&art, 80).err().expect("refused").to_string();
    assert!(
        err.contains("kernels.sm_90.cubin: is built for sm_90; this GPU is sm_80"),
        "{err}"
    );

    // Swap in an sm_100 cubin (the same PTX retargeted: its kernels need sm_90 or later, and
    // sm_100 needs PTX ISA 8.6) under the same name and fix its checksum.
    let cubin = dir.join("kernels.sm_90.cubin");
    let ptx = std::fs::read_to_string(dir.join("kernels.ptx")).unwrap();
    let sm100 = tmp.path().join("kernels.sm_100.ptx");
    let retargeted: Vec<&str> = ptx
        .lines()
        .map(|line| match line {
            ".target sm_90" => ".target sm_100",
            l if l.starts_with(".version ") => ".version 8.8",
            l => l,
        })
        .collect();
    let retargeted = retargeted.join("\n");
    std::fs::write(&sm100, retargeted).unwrap();
    let status = std::process::Command::new(ptxas)
        .arg("-arch=sm_100")
        .arg(&sm100)
        .arg("-o")
        .arg(&cubin)
        .status()
        .unwrap();
    assert!(status.success());
    reseal_checksums(&dir);
    let art = Artifact::open(&dir).unwrap();
    let err = choose_image(&art, 90).err().expect("refused").to_string();
    assert!(
        err.contains(
            "kernels.sm_90.cubin: is built for sm_100, but the manifest lists targets [90]"
        ),
        "{err}"
    );
}

/// A kernel PTX file that is not text is refused with the same error by both image choices,
/// naming the file (the sm_80 module's and the Hopper module's PTX, where no cubin replaces them).
#[test]
fn kernel_ptx_that_is_not_text_is_refused_naming_it() {
    use kiln_runtime::cuda::{choose_image, choose_sm90a_image};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama.kiln");
    let art = compile(
        &fixture("llama-tiny"),
        &dir,
        &["--buckets", "16", "--dtype", "bf16"],
    );
    let m = &art.manifest;
    assert!(
        m.kernels_sm90a_ptx.is_some(),
        "bf16 products take Hopper kernels"
    );
    // Each choice's PTX file, where no cubin is read instead.
    let ptx = [
        m.kernels_ptx.clone().filter(|_| m.kernels_cubin.is_none()),
        m.kernels_sm90a_ptx
            .clone()
            .filter(|_| m.kernels_sm90a_cubin.is_none()),
    ];
    for file in ptx.iter().flatten() {
        std::fs::write(dir.join(file), [0xff, 0xfe, 0x00]).unwrap();
    }
    reseal_checksums(&dir);
    let art = Artifact::open(&dir).unwrap();
    let errors = [
        choose_image(&art, 90).err().map(|e| e.to_string()),
        choose_sm90a_image(&art, 90).err().map(|e| e.to_string()),
    ];
    for (file, err) in ptx.iter().zip(errors) {
        let Some(file) = file else { continue };
        let err = err.expect("refused");
        assert!(
            err.contains(&format!(
                "{file}: cannot be read: stream did not contain valid UTF-8"
            )),
            "{err}"
        );
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Greedy generation through the artifact's decode graph and KV cache reproduces the reference
/// continuation; sampling is deterministic for a seed; a context past the compiled capacity is
/// refused before anything runs.
#[test]
fn generate_reproduces_greedy_tokens() {
    use kiln_runtime::generate::{generate, Sampling};
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-tiny", "llama-tiny"] {
        let out = tmp.path().join(format!("{name}.kiln"));
        compile(
            &fixture(name),
            &out,
            &["--buckets", "16", "--max-context", "64"],
        );
        let art = Artifact::open(&out).unwrap();
        let reference = reference(name);
        let prompt = reference["greedy_prompt"].as_i64().unwrap().to_vec();
        assert_greedy_tokens(
            &art,
            &mut Executor::Interpreter,
            name,
            "through the interpreter",
        );
        let sampling = Sampling {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            seed: 7,
        };
        let a = generate(&art, &mut Executor::Interpreter, &prompt, 8, &sampling).unwrap();
        assert_eq!(
            a,
            generate(&art, &mut Executor::Interpreter, &prompt, 8, &sampling).unwrap(),
            "{name}: same seed, same tokens"
        );
        let err = generate(
            &art,
            &mut Executor::Interpreter,
            &prompt,
            60,
            &Sampling::greedy(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("exceed the compiled context of 64"), "{err}");

        // The 10-token prompt through chunks of 3 (the last one masked past its first token),
        // through chunks of 4 then one of 2 (its last part, 1 token, takes the smaller chunk),
        // and one token per step: the same continuation.
        for chunk in ["3", "4,2", "1"] {
            let dir = tmp.path().join(format!("{name}-chunk{chunk}.kiln"));
            compile(
                &fixture(name),
                &dir,
                &[
                    "--buckets",
                    "16",
                    "--max-context",
                    "64",
                    "--prefill-chunk",
                    chunk,
                ],
            );
            let art = Artifact::open(&dir).unwrap();
            let chunks: Vec<usize> = art.manifest.decode.iter().map(|e| e.seq).collect();
            let want = match chunk {
                "3" => vec![3, 1],
                "4,2" => vec![4, 2, 1],
                _ => vec![1],
            };
            assert_eq!(chunks, want);
            let what = format!("through prompt chunks of {chunk}");
            assert_greedy_tokens(&art, &mut Executor::Interpreter, name, &what);
        }
    }
}

/// The artifact's own tokenizer gives the reference's ids for the reference sentences, and the
/// embeddings of those texts (the `kiln-run embed` path) match the reference; an artifact without
/// a tokenizer says so.
#[test]
fn artifact_tokenizer_embeds_texts_like_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("minilm.kiln");
    compile(
        &minilm_dir(),
        &out,
        &["--buckets", "32", "--batch-buckets", "4"],
    );
    let art = Artifact::open(&out).unwrap();
    let sentences = minilm_sentences();
    let reference = reference("minilm-reference");
    let batch = art
        .tokenizer()
        .unwrap()
        .encode_batch(&sentences, &[])
        .unwrap();
    let len = reference["input_ids"].shape[1];
    assert_eq!(batch.ids[0].len(), len);
    let flat: Vec<i64> = batch.ids.concat();
    assert_eq!(flat, reference["input_ids"].as_i64().unwrap());
    let got = forward(&art, &mut Executor::Interpreter, &batch).unwrap();
    let want = &reference["sentence_embedding"];
    assert_embeddings_close(
        &got["sentence_embedding"],
        want,
        want.shape[0],
        "minilm artifact",
    );

    let gpt2 = tmp.path().join("gpt2.kiln");
    compile(&fixture("gpt2-tiny"), &gpt2, &["--buckets", "16"]);
    let err = Artifact::open(&gpt2)
        .unwrap()
        .tokenizer()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("has no tokenizer.json"), "{err}");
}

/// `bench` serves every request through the bucket that holds it: the replays per bucket add up to
/// the requests, the percentiles are ordered, the padding waste is what the lengths imply, and
/// lengths past the largest bucket are refused before anything runs.
#[test]
fn bench_accounts_for_every_request() {
    use kiln_runtime::bench::{bench, BenchOptions};
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gpt2.kiln");
    compile(
        &fixture("gpt2-tiny"),
        &out,
        &["--buckets", "8,32", "--max-context", "32"],
    );
    let art = Artifact::open(&out).unwrap();
    let opts = BenchOptions {
        batch: 1,
        requests: 40,
        min_len: 1,
        max_len: 32,
        decode_tokens: 4,
        seed: 3,
    };
    let report = bench(&art, &mut Executor::Interpreter, &opts).unwrap();
    assert_eq!(report.overall.count, 40);
    assert_eq!(report.replays.values().sum::<u64>(), 40);
    for (bucket, latency) in &report.per_bucket {
        assert_eq!(report.replays[bucket], latency.count as u64, "{bucket}");
        assert!(latency.p50_ms <= latency.p95_ms && latency.p95_ms <= latency.p99_ms);
    }
    assert!(report
        .per_bucket
        .keys()
        .all(|k| k == "b1-s8" || k == "b1-s32"));
    // Every request fills at least 1 of at most 32 slots, and lengths 1..32 leave some padding.
    assert!(report.padding_waste > 0.0 && report.padding_waste < 1.0);
    assert!(report.decode_ms_per_token.is_some_and(|ms| ms > 0.0));
    let again = bench(&art, &mut Executor::Interpreter, &opts).unwrap();
    assert_eq!(again.replays, report.replays, "the seed fixes the lengths");
    let err = bench(
        &art,
        &mut Executor::Interpreter,
        &BenchOptions {
            max_len: 33,
            ..opts.clone()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("exceed the longest request the artifact takes (32 tokens)"),
        "{err}"
    );
}

#[test]
fn released_weight_pages_read_back_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let art = compile(
        &fixture("llama-tiny"),
        &dir.path().join("a.kiln"),
        &["--buckets", "8"],
    );
    let before = art.weights_region().unwrap().to_vec();
    // What the CUDA upload does chunk by chunk: advice that drops the mapped pages.
    art.release_weights(0, before.len() / 2);
    art.release_weights(before.len() / 2, before.len());
    assert!(art.weights_region().unwrap() == before.as_slice());
}

/// A manifest's logits chunk is checked when the artifact is opened: one that takes no tokens is
/// refused, naming it.
#[test]
fn logits_chunks_are_checked_when_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("chunks.kiln");
    let flags = [
        "--buckets",
        "16",
        "--max-context",
        "64",
        "--logits-chunk",
        "8",
    ];
    compile(&fixture("llama-tiny"), &dir, &flags);
    assert_eq!(
        Artifact::open(&dir).unwrap().manifest.logits_chunks.len(),
        1
    );
    let manifest = dir.join("manifest.ron");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let (head, tail) = text.split_at(text.find("logits_chunks:").unwrap());
    let tail = tail.replacen("seq: 8,", "seq: 0,", 1);
    std::fs::write(&manifest, format!("{head}{tail}")).unwrap();
    reseal_checksums(&dir);
    let err = Artifact::open(&dir).err().expect("refused").to_string();
    let want = "logits chunk buckets/logits-b1-s8.ron takes 1 sequences of 0 tokens";
    assert!(err.contains(want), "{err}");
}

/// A logits chunk's logits share their bytes with no other value: the CUDA executor writes them
/// straight into a ring buffer by moving every address inside their slot
/// (`Addresses::moved`), so a value that began inside the slot would move with them, and one
/// that ran past its end would overrun the buffer. Only the LM head's launches (the nodes that
/// write the slot) point into it.
#[test]
fn logits_chunks_share_their_logits_bytes_with_no_other_value() {
    use kiln_ir::artifact::{Arg, Region};
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama-tiny", "gpt2-tiny"] {
        for dtype in ["f32", "bf16"] {
            let dir = tmp.path().join(format!("{name}-{dtype}.kiln"));
            let flags = [
                "--buckets",
                "16",
                "--max-context",
                "256",
                "--logits-chunk",
                "200,64,8",
                "--dtype",
                dtype,
            ];
            compile(&fixture(name), &dir, &flags);
            let art = Artifact::open(&dir).unwrap();
            for e in &art.manifest.logits_chunks {
                let plan = e.plan.as_ref().unwrap();
                let logits = plan.outputs.iter().find(|s| s.name == "logits").unwrap();
                let slot = logits.offset..logits.offset + logits.bytes();
                let arena = |a: &Arg| match *a {
                    Arg::Ptr(Region::Arena, o) | Arg::TensorMap(Region::Arena, o) => Some(o),
                    _ => None,
                };
                let writers: Vec<&str> = plan
                    .steps
                    .iter()
                    .filter(|s| s.args.iter().any(|a| arena(a) == Some(logits.offset)))
                    .map(|s| s.node.as_str())
                    .collect();
                for s in plan
                    .steps
                    .iter()
                    .filter(|s| !writers.contains(&s.node.as_str()))
                {
                    for o in s.args.iter().filter_map(arena) {
                        assert!(
                            !slot.contains(&o),
                            "{name} {dtype} {}: {} ({}) points at {o}, inside the logits {slot:?}",
                            e.graph,
                            s.node,
                            s.kernel
                        );
                    }
                }
            }
        }
    }
}
