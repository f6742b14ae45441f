//! `kiln compile` end to end: the plan folder, the JSON report, bucket policies, and the errors
//! bad arguments get.

use kiln_tests::{fixture, kiln};

fn compile(args: &[&str]) -> Result<String, String> {
    let mut all = vec!["compile"];
    all.extend_from_slice(args);
    kiln(&all)
}

#[test]
fn compile_writes_plan_buckets_and_report() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gpt2.kiln");
    let report = tmp.path().join("report.json");
    let histogram = tmp.path().join("lengths.txt");
    std::fs::write(&histogram, "# length count\n5 10\n20 3\n100 1\n300 2\n").unwrap();
    let model = fixture("gpt2-tiny");
    let printed = compile(&[
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--buckets",
        "16,64,128",
        "--batch-buckets",
        "1,2",
        "--max-context",
        "200",
        "--report",
        report.to_str().unwrap(),
        "--length-histogram",
        histogram.to_str().unwrap(),
    ])
    .unwrap();
    assert!(
        printed.contains("6 prefill + 2 decode buckets + 1 prompt chunk"),
        "{printed}"
    );
    // Every kernel node of every bucket lowers to a generated kernel, and kernels.ptx holds them
    // (assembled to kernels.sm_90.cubin when a ptxas is found).
    let ptx = std::fs::read_to_string(out.join("kernels.ptx")).unwrap();
    assert!(ptx.starts_with(".version") && ptx.matches(".visible .entry").count() > 10);
    if kiln_compiler::writer::find_ptxas().is_some() {
        assert!(out.join("kernels.sm_90.cubin").is_file());
    }
    let plan = std::fs::read_to_string(out.join("manifest.ron")).unwrap();
    for needle in [
        "architecture: \"GPT2LMHeadModel\"",
        "max_context: Some(200)",
        // Paged by default: blocks of 16 keys, 13 per row of 200 keys, 2 rows of them and block 0.
        "block_tokens: 16",
        "blocks: 27",
        "entries: 13",
        "graph: \"buckets/prefill-b2-s128.ron\"",
        "graph: \"buckets/decode-b1-s1.ron\"",
    ] {
        assert!(plan.contains(needle), "{needle} in {plan}");
    }
    for file in [
        "prefill-b2-s128",
        "prefill-b1-s16",
        "decode-b2-s1",
        "decode-b1-s1",
    ] {
        let text = std::fs::read_to_string(out.join(format!("buckets/{file}.ron"))).unwrap();
        let graph = kiln_ir::Graph::from_ron(&text).unwrap();
        assert!(
            graph
                .nodes()
                .all(|(_, n)| n.ty.shape.iter().all(|d| d.is_const())),
            "{file} is static"
        );
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["buckets"].as_array().unwrap().len(), 6);
    // The prompt chunk (batch 1, 128 tokens: the largest bucket) and one step per batch bucket.
    let decode: Vec<(u64, u64)> = r["decode_buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["batch"].as_u64().unwrap(), b["seq"].as_u64().unwrap()))
        .collect();
    assert_eq!(decode, [(1, 128), (2, 1), (1, 1)]);
    let kernel = &r["buckets"][0]["kernels"][1];
    for field in ["name", "kind", "rules", "flops", "bytes"] {
        assert!(!kernel[field].is_null(), "kernel field {field}: {kernel}");
    }
    assert!(r["rules"]["attention-masked"].as_u64().unwrap() > 0);
    assert!(r["ptx_kernels"].as_u64().unwrap() > 10);
    for b in r["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .chain(r["decode_buckets"].as_array().unwrap())
    {
        assert_eq!(b["no_ptx"].as_array().unwrap().len(), 0, "{b}");
    }
    assert!(r["egraph"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["nodes"].as_u64().unwrap() > 0));
    for stage in ["import", "saturate", "extract", "write", "total"] {
        assert!(
            r["stage_seconds"][stage].as_f64().is_some(),
            "stage {stage}"
        );
    }
    // 300 does not fit in 128: counted as too long; the rest pads 5->16, 20->64, 100->128.
    let padded = 10.0 * 11.0 + 3.0 * 44.0 + 28.0;
    let total = 10.0 * 16.0 + 3.0 * 64.0 + 128.0;
    assert_eq!(r["padding"]["too_long"], 2);
    assert!((r["padding"]["waste"].as_f64().unwrap() - padded / total).abs() < 1e-12);

    // Compiling again replaces the earlier output.
    compile(&[
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--buckets",
        "32",
    ])
    .unwrap();
    assert!(out.join("buckets/prefill-b1-s32.ron").is_file());
    assert!(!out.join("buckets/prefill-b1-s16.ron").exists());
}

#[test]
fn histogram_policy_chooses_buckets() {
    let tmp = tempfile::tempdir().unwrap();
    let histogram = tmp.path().join("lengths.txt");
    std::fs::write(&histogram, "10\n11\n12\n12\n90\n95\n").unwrap();
    let out = tmp.path().join("bert.kiln");
    let printed = compile(&[
        fixture("bert-tiny").to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--bucket-policy",
        "histogram",
        "--num-buckets",
        "2",
        "--length-histogram",
        histogram.to_str().unwrap(),
    ])
    .unwrap();
    assert!(
        printed.contains("b1-s12") && printed.contains("b1-s95"),
        "{printed}"
    );
    assert!(
        printed.contains("2 prefill + 0 decode buckets"),
        "{printed}"
    );
}

#[test]
fn bad_compile_arguments_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.kiln");
    let o = out.to_str().unwrap();
    let gpt2 = fixture("gpt2-tiny");
    let g = gpt2.to_str().unwrap();
    let bert = fixture("bert-tiny");
    let cases: Vec<(Vec<&str>, &str)> =
        vec![
        (vec![g, "-o", o], "--bucket-policy pow2 needs --max-seq"),
        (
            vec![g, "-o", o, "--buckets", "0,16"],
            "a sequence bucket of 0",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--batch-buckets", "0"],
            "a batch bucket of 0",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--dtype", "q8"],
            "--dtype must be f32, f16 or bf16",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--max-context", "300"],
            "--max-context 300 exceeds the model's 256 positions",
        ),
        (
            vec![
                bert.to_str().unwrap(),
                "-o",
                o,
                "--buckets",
                "16",
                "--max-context",
                "64",
            ],
            "apply to decoders",
        ),
        (
            vec![
                g,
                "-o",
                o,
                "--buckets",
                "16",
                "--batch-buckets",
                "1,4",
                "--prefill-batch",
                "5",
            ],
            "--prefill-batch 5 must be between 1 and the largest batch bucket (4)",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--prefill-chunk", "8,0"],
            "--prefill-chunk 0 must be between 1 and the context (16)",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--prefill-chunk", "8,1"],
            "--prefill-chunk 1 enters prompts one token per step; it takes no other chunk sizes",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--logits-chunk", "8,1"],
            "--logits-chunk 1 must be between 2 and the context (16)",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--logits-chunk", "32"],
            "--logits-chunk 32 must be between 2 and the context (16)",
        ),
        (
            vec![bert.to_str().unwrap(), "-o", o, "--buckets", "16", "--logits-chunk", "8"],
            "--logits-chunk, --kv-block-size and --kv-blocks apply to decoders",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--kv-block-size", "12"],
            "--kv-block-size 12 must be a power of two (or 0 for a dense cache)",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--kv-block-size", "32"],
            "--kv-block-size 32 exceeds the context (16 keys)",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--kv-blocks", "1"],
            "1 blocks hold no sequence of the context: 16 keys need 1 blocks beside block 0",
        ),
        (
            vec![g, "-o", o, "--buckets", "16", "--kv-block-size", "0", "--kv-blocks", "9"],
            "--kv-blocks sizes a paged cache; --kv-block-size 0 asks for a dense one",
        ),
        (
            vec![bert.to_str().unwrap(), "-o", o, "--buckets", "16", "--kv-block-size", "16"],
            "--kv-block-size and --kv-blocks apply to decoders",
        ),
        (
            vec![g, "-o", o, "--bucket-policy", "histogram"],
            "needs --length-histogram",
        ),
        (
            vec!["/nonexistent/model", "-o", o, "--buckets", "16"],
            "does not exist",
        ),
        (
            vec![g, "-o", "/nonexistent/dir/x.kiln", "--buckets", "16"],
            "folder /nonexistent/dir does not exist",
        ),
    ];
    for (args, expected) in cases {
        let err = compile(&args).unwrap_err();
        assert!(
            err.contains(expected),
            "{args:?}: expected {expected:?} in {err:?}"
        );
        assert!(!out.exists(), "{args:?} left output behind");
    }
    let histogram = tmp.path().join("bad.txt");
    std::fs::write(&histogram, "12 x\n").unwrap();
    let err = compile(&[
        g,
        "-o",
        o,
        "--buckets",
        "16",
        "--length-histogram",
        histogram.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(
        err.contains("bad.txt:1: expected `LENGTH [COUNT]`"),
        "{err}"
    );
    // A folder that is not a kiln output is never replaced.
    let other = tmp.path().join("precious");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("keep.txt"), "data").unwrap();
    let err = compile(&[g, "-o", other.to_str().unwrap(), "--buckets", "16"]).unwrap_err();
    assert!(err.contains("is not a kiln output folder"), "{err}");
    assert!(other.join("keep.txt").is_file());
}

/// Plan-only compilation of a GPT-2-small-sized model (12 layers, hidden 768, 12 heads, vocab
/// 50257) with 8 buckets: the structure the fusion issue asks for at that size.
#[test]
fn gpt2_small_plan_only() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("gpt2-small");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 12, "n_layer": 12,
            "n_positions": 2048, "vocab_size": 50257, "activation_function": "gelu_new"}"#,
    )
    .unwrap();
    let report = tmp.path().join("report.json");
    let printed = compile(&[
        model.to_str().unwrap(),
        "--no-weights",
        "-o",
        tmp.path().join("out").to_str().unwrap(),
        "--bucket-policy",
        "pow2",
        "--max-seq",
        "2048",
        "--report",
        report.to_str().unwrap(),
    ])
    .unwrap();
    assert!(
        printed.contains("8 prefill + 1 decode buckets + 1 prompt chunk"),
        "{printed}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    for b in r["buckets"].as_array().unwrap() {
        let kernels = b["kernels"].as_array().unwrap();
        assert_eq!(kernels.len(), 12 * 5 + 2, "bucket {}", b["seq"]);
        let attention = kernels.iter().filter(|k| k["kind"] == "attention").count();
        assert_eq!(attention, 12);
    }
}

/// Every kernel of the report names the path lowering generated it on (a SIMT fallback is never
/// silent; `kiln inspect` counts them per bucket): f32 products and attention of prefill buckets
/// are SIMT, decode products the GEMV. The prompt chunk only fills the KV cache: no logits, so no
/// LM-head product.
#[test]
fn report_and_inspect_name_each_kernels_path() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f32", "bf16"] {
        let out = tmp.path().join(format!("llama-{dtype}.kiln"));
        let report = tmp.path().join(format!("llama-{dtype}.json"));
        compile(&[
            fixture("llama-tiny").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--buckets",
            "16,64",
            "--max-context",
            "64",
            "--prefill-chunk",
            "16",
            "--logits-chunk",
            "32",
            "--dtype",
            dtype,
            "--report",
            report.to_str().unwrap(),
        ])
        .unwrap();
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let buckets = r["buckets"].as_array().unwrap();
        let decode = r["decode_buckets"].as_array().unwrap();
        let path_of = |k: &serde_json::Value| k["path"].as_str().unwrap().to_string();
        for b in buckets.iter().chain(decode) {
            for k in b["kernels"].as_array().unwrap() {
                let path = path_of(k);
                assert!(
                    ["wgmma", "mma", "gemv", "simt", "other"].contains(&path.as_str()),
                    "{dtype}: {k}"
                );
                let product = k["kind"] == "gemm";
                let attention = k["kind"] == "attention";
                if b["seq"].as_u64().unwrap() > 8 && (product || attention) {
                    let tensor_cores = ["mma", "wgmma"].contains(&path.as_str());
                    if dtype == "f32" {
                        assert_eq!(path, "simt", "{k}");
                    } else if product && k["rules"].as_array().unwrap().len() == 1 {
                        assert!(tensor_cores, "a plain bf16 product: {k}");
                    }
                }
                if b["seq"] == 1 && b["batch"] == 1 && product {
                    assert_eq!(path, "gemv", "{k}");
                }
            }
        }
        let products = |b: &serde_json::Value| {
            b["kernels"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|k| k["kind"] == "gemm")
                .count()
        };
        assert_eq!(decode[0]["seq"], 16, "the prompt chunk");
        // Without logits, the LM head goes, and with it the last layer's attention and MLP (only
        // its keys and values reach the cache).
        assert!(products(&decode[0]) < products(&decode[1]) - 1, "{dtype}");
        let chunk = std::fs::read_to_string(out.join("buckets/decode-b1-s16.ron")).unwrap();
        let chunk = kiln_ir::Graph::from_ron(&chunk).unwrap();
        assert!(chunk.outputs().iter().all(|o| o.name != "logits"));
        // A logits chunk keeps them, and every layer with them.
        let logits_chunk = &r["logits_chunks"][0];
        assert_eq!(
            (&logits_chunk["batch"], &logits_chunk["seq"]),
            (&1.into(), &32.into())
        );
        assert_eq!(products(logits_chunk), products(&decode[1]), "{dtype}");
        let chunk = std::fs::read_to_string(out.join("buckets/logits-b1-s32.ron")).unwrap();
        let chunk = kiln_ir::Graph::from_ron(&chunk).unwrap();
        assert!(chunk.outputs().iter().any(|o| o.name == "logits"));
        let summary = kiln_tests::kiln(&["inspect", out.to_str().unwrap()]).unwrap();
        assert!(summary.contains("    paths: "), "{summary}");
        let paged = "KV cache paged: 5 blocks of 16 keys (block 0 unused), a block table of 1 rows x 4 entries";
        assert!(summary.contains(paged), "{summary}");
        assert!(
            summary.contains("  logits chunk b1 s32 (context 64): "),
            "{summary}"
        );
        if dtype == "f32" {
            assert!(summary.contains("; on simt: gemm_"), "{summary}");
            assert!(summary.contains(" attention_"), "{summary}");
        } else {
            assert!(summary.contains("mma "), "{summary}");
        }
    }
}

/// A logits chunk of more rows than an LM-head piece (256) computes its LM head a piece at a
/// time (256 rows, then the rest), each its own launch over its own rows of the normed hidden states and of the logits,
/// and its plan says after which step each piece's rows are final; a chunk of one piece, the
/// prefill bucket and the decode steps keep one product.
#[test]
fn a_long_logits_chunk_takes_its_lm_head_in_row_pieces() {
    use kiln_ir::artifact::{Arg, LogitsPiece};
    let tmp = tempfile::tempdir().unwrap();
    for (name, dtype) in [
        ("gpt2-tiny", "f32"),
        ("gpt2-tiny", "bf16"),
        ("llama-tiny", "f32"),
        ("llama-tiny", "bf16"),
    ] {
        let model = tmp.path().join(format!("{name}-long"));
        if !model.exists() {
            kiln_tests::long_decoder(name, &model);
        }
        let out = tmp.path().join(format!("{name}-long-{dtype}.kiln"));
        let flags = [&kiln_tests::LONG_CHUNKS[..], &["--dtype", dtype]].concat();
        let art = kiln_tests::compile_artifact(&model, &out, &flags);
        let m = &art.manifest;
        let chunk = |seq| m.logits_chunks.iter().find(|e| e.seq == seq).unwrap();
        let plan = chunk(520).plan.as_ref().unwrap();
        let pieces = &plan.logits_pieces;
        let rows: Vec<usize> = pieces.iter().map(|p| p.rows).collect();
        assert_eq!(rows, [256, 520], "{dtype}: 256 rows, then the rest");
        let last = pieces[0].steps - 1;
        assert_eq!(pieces[1].steps, last + 2, "{dtype}: {pieces:?}");
        assert_eq!(
            pieces[1].steps,
            plan.steps.len(),
            "{dtype}: the LM head ends the plan"
        );
        // The two launches are one node's, the second 256 rows further into its operands.
        let steps = &plan.steps[last..last + 2];
        assert!(steps.iter().all(|s| s.node == steps[0].node), "{dtype}");
        let at = |s: &kiln_ir::artifact::Step| -> Vec<u64> {
            s.args
                .iter()
                .filter_map(|a| match a {
                    Arg::Ptr(_, at) | Arg::TensorMap(_, at) => Some(*at),
                    _ => None,
                })
                .collect()
        };
        let (first, second) = (at(&steps[0]), at(&steps[1]));
        let elem = if dtype == "f32" { 4 } else { 2 };
        let vocab = m.model.vocab_size as u64;
        let moved: Vec<u64> = first.iter().zip(&second).map(|(a, b)| b - a).collect();
        assert!(
            moved.contains(&(256 * 64 * elem)),
            "{dtype}: x moves 256 rows: {moved:?}"
        );
        assert!(
            moved.contains(&(256 * vocab * elem)),
            "{dtype}: out moves 256 rows: {moved:?}"
        );
        assert!(moved.contains(&0), "{dtype}: the weight stays: {moved:?}");
        // One piece: nothing to say.
        assert_eq!(
            chunk(256).plan.as_ref().unwrap().logits_pieces,
            Vec::<LogitsPiece>::new()
        );
        for e in m.prefill.iter().chain(&m.decode) {
            assert!(
                e.plan.as_ref().unwrap().logits_pieces.is_empty(),
                "{}",
                e.graph
            );
        }
    }
}
