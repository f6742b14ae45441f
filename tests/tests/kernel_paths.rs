//! Issue 11's contract, read off `kiln compile --report`: in f16/bf16 builds every attention
//! kernel and every product of more than 8 rows in prefill buckets and prompt chunks runs on
//! tensor cores (`path` `mma` or `wgmma`), with and without `--dropout`; decode steps' products
//! take the GEMV; an f32 build says `simt` rather than hiding it. Over the fixtures (head dim 16)
//! and the real shapes of `../shared/configs` (plan only).

use std::path::{Path, PathBuf};

use kiln_tests::{fixture, kiln, workspace_root};
use serde_json::Value;

fn configs_dir() -> PathBuf {
    workspace_root().join("../shared/configs")
}

/// The report of compiling `model` with `extra` flags (a small bucket set, GPU code only; a cache
/// and prompt chunk for decoders).
fn report(model: &Path, extra: &[&str]) -> Value {
    let encoder = std::fs::read_to_string(model.join("config.json"))
        .unwrap()
        .contains("BertModel");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let report = tmp.path().join("report.json");
    let mut args = vec![
        "compile",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--buckets",
        "16,64",
        "--batch-buckets",
        "1,4",
        "--target",
        "cuda",
        "--report",
        report.to_str().unwrap(),
    ];
    if !encoder {
        args.extend(["--max-context", "256", "--prefill-chunk", "32"]);
    }
    args.extend(extra);
    kiln(&args).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

/// Every bucket of `r` with its rows (batch x sequence) and kernels.
fn buckets(r: &Value) -> Vec<(u64, u64, &Vec<Value>)> {
    ["buckets", "decode_buckets"]
        .iter()
        .flat_map(|list| r[*list].as_array().into_iter().flatten())
        .map(|b| {
            let (batch, seq) = (b["batch"].as_u64().unwrap(), b["seq"].as_u64().unwrap());
            (batch, seq, b["kernels"].as_array().unwrap())
        })
        .collect()
}

/// The path every attention and product of `r` must take in a half-precision build; returns
/// how many kernels it checked.
fn assert_tensor_cores(r: &Value, what: &str) -> usize {
    let mut checked = 0;
    for (batch, seq, kernels) in buckets(r) {
        for k in kernels {
            let (kind, path) = (k["kind"].as_str().unwrap(), k["path"].as_str().unwrap());
            let want: &[&str] = match kind {
                "attention" | "decode_attention" if seq > 1 => &["mma", "wgmma"],
                "gemm" if batch * seq > 64 => &["mma", "wgmma"],
                // Up to 64 rows, the tensor-core GEMV in row groups where the GEMM's tiles
                // would be few.
                "gemm" if batch * seq > 8 => &["mma", "wgmma", "gemv"],
                "gemm" => &["gemv"],
                _ => continue,
            };
            assert!(
                want.contains(&path),
                "{what}: {} (bucket b{batch} s{seq}) runs on {path}, not {want:?}",
                k["name"]
            );
            let last = k["launches"].as_array().and_then(|l| l.last());
            let tensor_cores = last
                .and_then(Value::as_str)
                .is_some_and(|l| l.ends_with("_tc"));
            assert!(
                path != "gemv" || batch * seq <= 8 || tensor_cores,
                "{what}: {} (bucket b{batch} s{seq}) takes a GEMV off tensor cores: {k}",
                k["name"]
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn fixtures_run_prefill_and_prompt_chunks_on_tensor_cores() {
    for name in ["gpt2-tiny", "llama-tiny", "bert-tiny"] {
        for dtype in ["bf16", "f16"] {
            for dropout in [false, true] {
                let mut extra = vec!["--dtype", dtype];
                if dropout {
                    extra.push("--dropout");
                }
                let r = report(&fixture(name), &extra);
                let what = format!("{name} {dtype} dropout={dropout}");
                let checked = assert_tensor_cores(&r, &what);
                assert!(checked > 4, "{what}: only {checked} kernels checked");
            }
        }
    }
}

#[test]
fn real_shapes_run_prefill_and_prompt_chunks_on_tensor_cores() {
    for name in [
        "llama-3.1-8b",
        "mistral-7b",
        "qwen2-7b",
        "gpt2-small",
        "bert-base",
    ] {
        for dropout in [false, true] {
            let mut extra = vec!["--no-weights", "--dtype", "bf16"];
            if dropout {
                extra.push("--dropout");
            }
            let r = report(&configs_dir().join(name), &extra);
            let what = format!("{name} dropout={dropout}");
            let checked = assert_tensor_cores(&r, &what);
            assert!(checked > 4, "{what}: only {checked} kernels checked");
        }
    }
}

#[test]
fn f32_builds_name_their_simt_kernels() {
    let r = report(&fixture("llama-tiny"), &["--dtype", "f32"]);
    let (mut attention, mut gemm) = (0, 0);
    for (batch, seq, kernels) in buckets(&r) {
        for k in kernels {
            match (k["kind"].as_str().unwrap(), k["path"].as_str().unwrap()) {
                ("attention", path) => {
                    assert_eq!(path, "simt", "{}", k["name"]);
                    attention += 1;
                }
                ("gemm", path) if batch * seq > 8 => {
                    assert_eq!(path, "simt", "{}", k["name"]);
                    gemm += 1;
                }
                _ => {}
            }
        }
    }
    assert!(
        attention > 0 && gemm > 0,
        "{attention} attention, {gemm} gemm"
    );
}

/// RoPE is applied ahead of the Hopper kernel (`kiln_kernels::attention::prerotated`), so the
/// prefill attention of Llama-, Mistral- and Qwen2-shaped bf16 builds (RoPE, GQA, causal, head
/// dim 128; Mistral's window covers these buckets) runs on wgmma.
#[test]
fn rope_prefill_attention_runs_on_wgmma() {
    for name in ["llama-3.1-8b", "mistral-7b", "qwen2-7b"] {
        let r = report(
            &configs_dir().join(name),
            &["--no-weights", "--dtype", "bf16"],
        );
        let mut checked = 0;
        for bucket in r["buckets"].as_array().unwrap() {
            for k in bucket["kernels"].as_array().unwrap() {
                if k["kind"] == "attention" {
                    assert_eq!(k["path"], "wgmma", "{name}: {}", k["name"]);
                    checked += 1;
                }
            }
        }
        assert!(checked >= 2, "{name}: {checked} attention kernels checked");
    }
}

/// A sliding window narrower than the keys (Mistral-7B's shape with a 32-key window) keeps the
/// Hopper kernel: the prefill attention of 64-token buckets and the prompt chunks' attention over
/// a dense or paged cache of 256 positions are `wgmma` launches whose names carry the window.
#[test]
fn sliding_windows_run_on_wgmma() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("mistral-w32");
    std::fs::create_dir(&model).unwrap();
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(configs_dir().join("mistral-7b/config.json")).unwrap(),
    )
    .unwrap();
    config["sliding_window"] = 32.into();
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    for block in ["0", "16"] {
        let r = report(
            &model,
            &["--no-weights", "--dtype", "bf16", "--kv-block-size", block],
        );
        // Windowed attentions of the prefill buckets, then of the prompt chunks.
        let mut windowed = [0, 0];
        for (list, count) in ["buckets", "decode_buckets"].iter().zip(&mut windowed) {
            for b in r[*list].as_array().unwrap() {
                if b["seq"].as_u64() == Some(1) {
                    continue;
                }
                for k in b["kernels"].as_array().unwrap() {
                    let names = k["launches"].as_array().unwrap();
                    if names.iter().any(|l| l.as_str().unwrap().contains("_w32_")) {
                        assert_eq!(k["path"], "wgmma", "blocks of {block}: {k}");
                        *count += 1;
                    }
                }
            }
        }
        assert!(
            windowed.iter().all(|&n| n > 0),
            "blocks of {block}: {windowed:?} windowed attentions (prefill, prompt chunks)"
        );
    }
}

/// A prompt chunk's attention over a KV cache runs on wgmma, q rotated ahead of it and each
/// row's keys bounded by its position, in one launch with the chunk's cache writes (no `rope`
/// launch, and `kv_write` launches only where no attention reads the writes): over a dense cache
/// (`--kv-block-size 0`) and over a paged one of 16-key blocks; blocks of 4 keys (less than a
/// swizzle group) keep the mma kernel and the writes their launches.
#[test]
fn prompt_chunks_over_a_kv_cache_run_on_wgmma() {
    for (block, path, fused) in [
        ("0", "wgmma", true),
        ("16", "wgmma", true),
        ("4", "mma", false),
    ] {
        let r = report(
            &configs_dir().join("llama-3.1-8b"),
            &["--no-weights", "--dtype", "bf16", "--kv-block-size", block],
        );
        let mut checked = 0;
        for b in r["decode_buckets"].as_array().unwrap() {
            if b["seq"].as_u64() == Some(1) {
                continue;
            }
            let launches: Vec<&str> = b["kernels"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|k| k["launches"].as_array().unwrap())
                .map(|l| l.as_str().unwrap())
                .collect();
            let count = |p: &str| launches.iter().filter(|l| l.starts_with(p)).count();
            // A prompt chunk's last layer only fills the cache (nothing reads its attention).
            assert_eq!(
                count("kv_write") <= 2,
                fused,
                "blocks of {block}: {launches:?}"
            );
            assert_eq!(count("rope_"), 0, "blocks of {block}: {launches:?}");
            for k in b["kernels"].as_array().unwrap() {
                if k["kind"] == "decode_attention" {
                    assert_eq!(k["path"], path, "blocks of {block}: {k}");
                    let first = k["launches"][0].as_str().unwrap();
                    assert_eq!(first.starts_with("chunk_entries"), fused, "{k}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 0, "blocks of {block}: no prompt chunk attention");
    }
}

/// Decode steps of f16/bf16 builds that decode several sequences together take the tensor-core
/// GEMV at every batch size (batch-invariant: a sequence decodes as it does alone), which
/// normalises x in its prologue: no norm launch before a product (Llama's RMSNorms, GPT-2's
/// LayerNorms). An artifact that decodes one sequence at a time keeps the one-row kernel, which
/// folds an RMSNorm in (its weight moved into the product's; `rms_norm_..._gemv`) and keeps
/// LayerNorm's launches; prompt chunks of more than 16 rows, batch-1 builds' prompt chunks and
/// f32 builds keep the norm kernels.
#[test]
fn decode_products_normalise_their_rows_themselves() {
    use kiln_runtime::Artifact;
    for (name, norm) in [("llama-tiny", "rms_norm"), ("gpt2-tiny", "layer_norm")] {
        for (dtype, batches) in [("bf16", "1,4"), ("bf16", "1"), ("f32", "1,4")] {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().join("out");
            let report = tmp.path().join("report.json");
            kiln(&[
                "compile",
                fixture(name).to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--report",
                report.to_str().unwrap(),
                "--buckets",
                "16",
                "--batch-buckets",
                batches,
                "--max-context",
                "64",
                "--prefill-chunk",
                "16",
                "--dtype",
                dtype,
                "--target",
                "cuda",
            ])
            .unwrap();
            let art = Artifact::open(&out).unwrap();
            // The report says which it is, and names every launch of a decode product.
            let r: Value =
                serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
            assert_eq!(
                r["batch_invariant_decode"],
                batches != "1",
                "{name} {dtype} {batches}"
            );
            for b in r["decode_buckets"].as_array().unwrap() {
                let rows = b["batch"].as_u64().unwrap() * b["seq"].as_u64().unwrap();
                for k in b["kernels"].as_array().unwrap() {
                    let launches: Vec<&str> = k["launches"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|l| l.as_str().unwrap())
                        .collect();
                    if k["path"] == "gemv" {
                        // Tensor cores in batch-invariant builds, and for more rows than
                        // the one-row kernel takes (a prompt chunk's narrow products).
                        let tc = dtype == "bf16" && (batches != "1" || rows > 8);
                        let last = launches.last().unwrap();
                        assert_eq!(
                            last.ends_with("_gemv_tc"),
                            tc,
                            "{name} {dtype} {batches}: {k}"
                        );
                    }
                }
            }
            for e in &art.manifest.decode {
                let steps = &e.plan.as_ref().unwrap().steps;
                let kernels: Vec<&str> = steps.iter().map(|s| s.kernel.as_str()).collect();
                let what = format!("{name} {dtype} batches {batches}, {}: {kernels:?}", e.graph);
                let norms = |fused: bool| {
                    kernels
                        .iter()
                        .filter(|k| k.starts_with(norm) && k.contains("_gemv") == fused)
                        .count()
                };
                let gemvs = kernels.iter().filter(|k| k.contains("_gemv"));
                // Batch-invariant builds: decode steps, and prompt chunks of at most 16 rows,
                // on the tensor-core GEMV with its norm prologue.
                if dtype == "bf16" && e.batch * e.seq <= 16 && batches != "1" {
                    assert_eq!(norms(false), 0, "{what}");
                    assert!(norms(true) > 0, "{what}");
                    assert!(gemvs.clone().all(|k| k.ends_with("_gemv_tc")), "{what}");
                } else if dtype == "bf16" && e.seq == 1 && norm == "rms_norm" {
                    assert_eq!(norms(false), 0, "{what}");
                    assert!(norms(true) > 0, "{what}");
                    assert!(gemvs.clone().all(|k| !k.ends_with("_gemv_tc")), "{what}");
                    assert!(kernels.last().unwrap().starts_with("choose_"), "{what}");
                } else {
                    assert_eq!(norms(true), 0, "{what}");
                    assert!(norms(false) > 0, "{what}");
                    // The one-row kernel, but for more rows than it takes (a bf16 prompt
                    // chunk's narrow products, on tensor cores in row groups).
                    let suffix = if dtype == "bf16" && e.batch * e.seq > 8 {
                        "_gemv_tc"
                    } else {
                        "_gemv"
                    };
                    // A decode step's LM head on the one-row kernel folds the greedy choice in,
                    // and a small kernel reads it back instead of a pass over the logits.
                    let chooses = suffix == "_gemv" && e.seq == 1;
                    let choosing = gemvs.clone().filter(|k| k.ends_with("_gemv_choosing"));
                    assert_eq!(choosing.count(), usize::from(chooses), "{what}");
                    let others = gemvs.clone().filter(|k| !k.ends_with("_gemv_choosing"));
                    assert!(others.into_iter().all(|k| k.ends_with(suffix)), "{what}");
                    let choice = kernels.last().unwrap();
                    assert_eq!(choice.starts_with("choose_"), chooses, "{what}");
                    assert_eq!(
                        choice.starts_with("argmax_"),
                        !chooses && e.seq == 1,
                        "{what}"
                    );
                }
            }
        }
    }
}

/// A pre-norm model's RMSNorms ride on its Hopper products (`RowNorm`): in bf16 prefill
/// buckets, prompt chunks and logits chunks of 1024 rows of the real Llama, Mistral and Qwen2
/// shapes, the norms before every layer's QKV and up products but the first layer's are
/// base-only steps (launched only where the sm_90a steps fall back), each followed by the
/// product that scales its rows itself (`_rms<parts>`, reading the sums that its input's
/// product writes, `_rowsums`, with as many parts, at most `MAX_ROW_SUM_PARTS`), as is the LM
/// head's in prefill buckets (the 7B-8B heads' weights are their own, so the norm's folds into
/// them); the first layer's (after the embedding) and a logits chunk's LM head's (in row
/// pieces) are launched. Near misses: at 256 rows those residual products take tiles narrow
/// enough to write more sums a row than a product holds, an f32 build has no Hopper kernel,
/// and GPT-2's norms are LayerNorms: they keep every norm.
#[test]
fn prefill_products_carry_their_rms_norms() {
    for (name, dtype, carried) in [
        ("llama-3.1-8b", "bf16", true),
        ("mistral-7b", "bf16", true),
        ("qwen2-7b", "bf16", true),
        ("llama-3.1-8b", "f32", false),
        ("gpt2-small", "bf16", false),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let model = configs_dir().join(name);
        let flags = "--no-weights --buckets 256,1024 --max-context 1024 --prefill-chunk 1024 \
                     --logits-chunk 1024 --target cuda -q --dtype";
        let flags: Vec<&str> = flags.split_whitespace().chain([dtype]).collect();
        let art = kiln_tests::compile_artifact(&model, &tmp.path().join("out"), &flags);
        let m = &art.manifest;
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap())
                .unwrap();
        let number = |a: &str, b: &str| config[a].as_u64().or(config[b].as_u64()).unwrap();
        let layers = number("num_hidden_layers", "n_layer") as usize;
        let hidden = number("hidden_size", "n_embd") as u32;
        let chunks = m.decode.iter().filter(|e| e.seq > 1);
        let entries = m.prefill.iter().chain(chunks).chain(&m.logits_chunks);
        for e in entries {
            let steps = &e.plan.as_ref().unwrap().steps;
            let what = format!("{name} {dtype} {}", e.graph);
            let base_only: Vec<usize> = (0..steps.len()).filter(|&i| steps[i].base_only).collect();
            if !carried || e.batch * e.seq < 1024 {
                assert!(base_only.is_empty(), "{what}");
                assert!(steps.iter().all(|s| !s.kernel.contains("_rms")), "{what}");
                assert!(
                    steps.iter().all(|s| !s.kernel.contains("_rowsums")),
                    "{what}"
                );
                continue;
            }
            // All but the first layer's first (and the LM head's where its weight stays its
            // own or it runs in row pieces) ride on products: at most two are launched.
            let norms = steps.iter().filter(|s| s.kernel.starts_with("rms_norm"));
            let launched = norms.clone().filter(|s| !s.base_only).count();
            assert!(launched <= 2, "{what}: {launched} launched");
            assert!(norms.count() >= 2 * layers - 1, "{what}");
            let writers: Vec<&str> = (steps.iter())
                .map(|s| s.kernel.as_str())
                .filter(|k| k.contains("_rowsums"))
                .collect();
            for i in base_only {
                let norm = &steps[i];
                assert!(
                    norm.kernel.starts_with("rms_norm") && norm.fallback.is_none(),
                    "{what}"
                );
                let product = &steps[i + 1];
                let fallback = product.fallback.as_ref().expect("an sm_90a product");
                assert!(
                    !fallback.kernel.contains("_rms"),
                    "{what}: {}",
                    fallback.kernel
                );
                // The parts it reads: those of the last product before it that wrote sums.
                let parts = product.kernel.split("_rms").nth(1).unwrap();
                let parts: u32 = parts.split('_').next().unwrap().parse().unwrap();
                assert!(
                    parts <= kiln_kernels::gemm_wgmma::MAX_ROW_SUM_PARTS,
                    "{what}"
                );
                let writer = (steps[..i].iter().rev())
                    .find(|s| s.kernel.contains("_rowsums"))
                    .expect("a product that wrote the sums");
                assert!(writers.contains(&writer.kernel.as_str()));
                let cols = kiln_kernels::gemm_wgmma::TILINGS
                    .iter()
                    .map(|(t, _)| t.width)
                    .filter(|w| hidden.div_ceil(*w) == parts);
                assert!(
                    cols.count() > 0,
                    "{what}: {parts} parts of {hidden} columns"
                );
            }
        }
    }
}

/// Issue 15's kernel count, read off `--report`: a bf16 decode step of the real Llama, Mistral,
/// Qwen2 and GPT-2 shapes is five kernels per layer (the QKV product with its norm, the
/// attention, which writes the step's key and value into the caches itself, the output
/// product, the up product with its norm, the down product), plus the embedding and the LM
/// head. An f32 build's SIMT attention does not write the caches: its two cache writes stay.
#[test]
fn decode_steps_are_five_kernels_per_layer() {
    for (name, dtype) in [
        ("llama-3.1-8b", "bf16"),
        ("mistral-7b", "f16"),
        ("qwen2-7b", "bf16"),
        ("gpt2-small", "bf16"),
        ("llama-3.1-8b", "f32"),
    ] {
        let dir = configs_dir().join(name);
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let layers = config["num_hidden_layers"]
            .as_u64()
            .or(config["n_layer"].as_u64())
            .unwrap();
        let r = report(&dir, &["--no-weights", "--dtype", dtype]);
        let per_layer = if dtype == "f32" { 7 } else { 5 };
        let steps: Vec<_> = buckets(&r)
            .into_iter()
            .filter(|(_, seq, kernels)| {
                *seq == 1 && kernels.iter().any(|k| k["kind"] == "decode_attention")
            })
            .collect();
        assert_eq!(
            steps.len(),
            2,
            "{name} {dtype}: decode steps of batch 1 and 4"
        );
        for (batch, _, kernels) in steps {
            let what = format!("{name} {dtype} decode b{batch}");
            let names: Vec<&str> = kernels
                .iter()
                .map(|k| k["name"].as_str().unwrap())
                .collect();
            assert_eq!(
                kernels.len() as u64,
                per_layer * layers + 2,
                "{what}: {names:?}"
            );
            let writes = names
                .iter()
                .filter(|n| n.starts_with("cache_write"))
                .count() as u64;
            assert_eq!(writes, (per_layer - 5) * layers, "{what}: {names:?}");
            for k in kernels.iter().filter(|k| k["kind"] == "decode_attention") {
                let launch = k["launches"][0].as_str().unwrap();
                assert_eq!(launch.contains("_writes_"), dtype != "f32", "{what}: {k}");
            }
        }
    }
}

/// The bytes of the counters region the artifact at `out` plans.
fn counter_bytes(out: &Path) -> u64 {
    let manifest: kiln_ir::artifact::Manifest =
        ron::from_str(&std::fs::read_to_string(out.join("manifest.ron")).unwrap()).unwrap();
    manifest.memory.counter_bytes
}

/// The counters the Llama-3.1-8B shape's products of 64 rows take where they split K: QKV, O,
/// gate/up with SwiGLU, down (16 rows take the same tiles).
fn split_k_counters() -> u64 {
    use kiln_kernels::gemm::{split_scratch, GemmConfig};
    [
        (6144, 4096, false),
        (4096, 4096, false),
        (28672, 4096, true),
        (4096, 14336, false),
    ]
    .into_iter()
    .map(|(n, k, swiglu)| {
        let cfg = GemmConfig {
            swiglu,
            ..GemmConfig::plain(64, n, k, kiln_kernels::Elem::BF16)
        };
        split_scratch(&cfg, kiln_kernels::gemv::Rows::BatchInvariant).1
    })
    .max()
    .unwrap_or(0)
}

/// Over a cache long enough for several key ranges (2048 entries: 32 per query), a bf16 decode
/// step's attention merges them itself (no combine launch after it), counting its blocks in
/// the counters region, sized for the largest decode batch (a u32 per sequence and K/V head);
/// f32's SIMT attention keeps its combine launch.
#[test]
fn decode_attention_merges_its_key_ranges() {
    let dir = configs_dir().join("llama-3.1-8b");
    for dtype in ["bf16", "f32"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let report = tmp.path().join("report.json");
        kiln(&[
            "compile",
            dir.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
            "--no-weights",
            "--dtype",
            dtype,
            "--buckets",
            "16",
            "--batch-buckets",
            "1,4",
            "--max-context",
            "2048",
            "--target",
            "cuda",
        ])
        .unwrap();
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let steps = r["decode_buckets"].as_array().unwrap().iter();
        let steps: Vec<&Value> = steps.filter(|b| b["seq"] == 1).collect();
        assert_eq!(steps.len(), 2, "{dtype}");
        for b in steps {
            for k in b["kernels"].as_array().unwrap() {
                if k["kind"] != "decode_attention" {
                    continue;
                }
                let launches = k["launches"].as_array().unwrap();
                let merged = dtype == "bf16";
                assert_eq!(launches.len(), if merged { 1 } else { 2 }, "{dtype}: {k}");
                let first = launches[0].as_str().unwrap();
                assert!(first.contains("_split32"), "{dtype}: {k}");
                assert_eq!(first.ends_with("_combined_decode"), merged, "{dtype}: {k}");
            }
        }
        // f32: the decode steps' LM heads (one-row kernel) keep a u64 per sequence for the greedy
        // choice; bf16: the attention's u32 per sequence and K/V head, or more where the prefill
        // bucket's products (16 tokens of 1 and 4 sequences) split K and count their tiles.
        let counters = if dtype == "bf16" {
            split_k_counters().max(4 * 8 * 4)
        } else {
            4 * 8
        };
        assert_eq!(counter_bytes(&out), counters, "{dtype}");
    }
}

/// Encoder attention over every key takes a persistent grid where it has more items than the
/// GPU has SMs (BERT-base at 32 x 512 tokens: 1536 items of four key tiles), and a stream grid
/// where those items are long (the BERT-base shape with 4096 positions, 2 x 4096 tokens: 528
/// items of 32 tiles): in bf16 the stream's split items count in the counters region (a u32 per
/// SM and consumer warpgroup) and leave their state in scratch; f32's SIMT attention, and the
/// persistent grid, count nothing.
#[test]
fn long_encoder_attention_takes_a_stream_grid() {
    use kiln_kernels::attention::AttentionConfig;
    let base = configs_dir().join("bert-base");
    let long = tempfile::tempdir().unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = 4096.into();
    std::fs::write(long.path().join("config.json"), config.to_string()).unwrap();
    let mut cfg = AttentionConfig::plain([2, 12, 12, 4096, 4096, 64], kiln_kernels::Elem::BF16);
    cfg.padding = true;
    let (partials, counters) = kiln_kernels::attention_wgmma::scratch(&cfg);
    assert!(partials > 0 && counters > 0);
    let cases = [
        (base.as_path(), "512", "32", "bf16", 0),
        (long.path(), "4096", "2", "bf16", counters),
        (long.path(), "4096", "2", "f32", 0),
    ];
    for (dir, len, batch, dtype, want) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        kiln(&[
            "compile",
            dir.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--no-weights",
            "--dtype",
            dtype,
            "--buckets",
            len,
            "--batch-buckets",
            batch,
            "--target",
            "cuda",
        ])
        .unwrap();
        assert_eq!(counter_bytes(&out), want, "{len} x {batch} {dtype}");
    }
}
