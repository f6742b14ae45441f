//! The user's path on a machine without a GPU, through the command lines: `kiln compile` an f32
//! artifact, then `kiln-run forward`, `generate` and `embed --device cpu` (the generated CPU
//! kernels) reproduce every fixture's references: logits and hidden states within 1e-4,
//! `greedy_tokens` exactly, MiniLM's sentence embeddings from its text.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_ir::Tensor;
use kiln_tests::{
    assert_embeddings_close, fixture, floats, kiln, kiln_run, kiln_run_forward, kiln_run_greedy,
    masked_rel_err, minilm_dir, minilm_sentences, reference, rel_err,
};

/// `kiln compile MODEL -o DIR ARGS..` (f32, CPU code only).
fn compile(model: &Path, dir: &Path, args: &[&str]) {
    let mut all = vec![
        "compile",
        model.to_str().unwrap(),
        "-o",
        dir.to_str().unwrap(),
        "--target",
        "cpu",
    ];
    all.extend_from_slice(args);
    kiln(&all).unwrap();
}

#[test]
fn decoders_through_kiln_run_forward_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-tiny", "llama-tiny"] {
        let art = tmp.path().join(format!("{name}.kiln"));
        compile(
            &fixture(name),
            &art,
            &["--buckets", "16,64,128", "--max-context", "64"],
        );
        let reference = reference(name);
        for l in [1usize, 7, 16, 33, 100] {
            let ids = reference[&format!("input_ids_{l}")].clone();
            let out = kiln_run_forward(
                &art,
                BTreeMap::from([("input_ids".to_string(), ids)]),
                "cpu",
            );
            let logits = &out["logits"];
            assert_eq!(logits.shape, vec![l, 512], "{name} L={l}: unbatched logits");
            let err = rel_err(floats(logits), floats(&reference[&format!("logits_{l}")]));
            assert!(err < 1e-4, "{name} L={l}: relative error {err:e}");
        }
        let prompt = reference["greedy_prompt"].as_i64().unwrap();
        let want = reference["greedy_tokens"].as_i64().unwrap().to_vec();
        let got = kiln_run_greedy(&art, prompt, want.len(), "cpu");
        assert_eq!(
            got, want,
            "{name}: kiln-run generate reproduces greedy_tokens"
        );
    }
}

/// A prompt longer than the largest logits chunk, or than every prefill bucket, runs through the
/// logits chunks (the KV cache's row 0, chunk after chunk, the last the smallest that holds the
/// rest) and gives the reference's logits: paged and dense caches, the generated CPU kernels and
/// the interpreter. One past the cache is a one-line error naming both lengths.
#[test]
fn long_prompts_through_logits_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-tiny", "llama-tiny"] {
        let reference = reference(name);
        for cache in ["16", "0"] {
            let art = tmp.path().join(format!("{name}-{cache}.kiln"));
            let args = [
                "--buckets",
                "16",
                "--max-context",
                "128",
                "--logits-chunk",
                "32,8",
            ];
            compile(
                &fixture(name),
                &art,
                &[&args[..], &["--kv-block-size", cache]].concat(),
            );
            for (device, lengths) in [("interpreter", &[33usize][..]), ("cpu", &[7, 33, 100])] {
                for &l in lengths {
                    let ids = reference[&format!("input_ids_{l}")].clone();
                    let out = kiln_run_forward(
                        &art,
                        BTreeMap::from([("input_ids".to_string(), ids)]),
                        device,
                    );
                    let logits = &out["logits"];
                    let want = &reference[&format!("logits_{l}")];
                    assert_eq!(logits.shape, vec![l, 512], "{name} L={l}");
                    let err = rel_err(floats(logits), floats(want));
                    assert!(
                        err < 1e-4,
                        "{name} block {cache} {device} L={l}: error {err:e}"
                    );
                }
            }
        }
        let art = tmp.path().join(format!("{name}-0.kiln"));
        // `bench` takes single sequences up to the cache's length through them.
        let p = |p: &Path| p.to_str().unwrap().to_string();
        let args = [
            "--requests",
            "3",
            "--lengths",
            "100..128",
            "--device",
            "cpu",
            "--json",
        ];
        let report = kiln_run(&[&["bench", &p(&art)][..], &args].concat()).unwrap();
        let report: serde_json::Value = serde_json::from_str(&report).unwrap();
        assert_eq!(report["replays"]["b1-logits-chunks"], 3, "{report}");
        let (input, output) = (tmp.path().join("long.safetensors"), tmp.path().join("o"));
        let ids = Tensor::i64(vec![129], vec![1; 129]);
        kiln_ir::io::write_tensors(&input, &BTreeMap::from([("input_ids".to_string(), ids)]))
            .unwrap();
        let err = kiln_run(&[
            "forward",
            &p(&art),
            "--input",
            &p(&input),
            "--output",
            &p(&output),
            "--device",
            "cpu",
        ])
        .unwrap_err();
        assert!(err.contains("129") && err.contains("128"), "{name}: {err}");
        assert!(!err.contains('\n') && !output.exists(), "{name}: {err}");
    }
}

#[test]
fn encoders_through_kiln_run_forward_and_embed() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, name) in [
        (fixture("bert-tiny"), "bert-tiny"),
        (minilm_dir(), "minilm-reference"),
    ] {
        let art = tmp.path().join(format!("{name}.kiln"));
        compile(&model, &art, &["--buckets", "32", "--batch-buckets", "4"]);
        let reference = reference(name);
        let inputs = ["input_ids", "attention_mask"]
            .map(|k| (k.to_string(), reference[k].clone()))
            .into();
        let out = kiln_run_forward(&art, inputs, "cpu");
        let err = masked_rel_err(
            &out["last_hidden_state"],
            &reference["last_hidden_state"],
            &reference["attention_mask"],
        );
        assert!(err < 1e-4, "{name}: relative error {err:e}");
        let Some(want) = reference.get("sentence_embedding") else {
            continue;
        };
        assert_embeddings_close(&out["sentence_embedding"], want, want.shape[0], name);
        // From text: the artifact's tokenizer, then the same embeddings.
        let mut args = vec!["embed".to_string(), art.to_str().unwrap().to_string()];
        for s in minilm_sentences() {
            args.extend(["--text".to_string(), s]);
        }
        args.extend(["--json", "--device", "cpu"].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let json: serde_json::Value = serde_json::from_str(&kiln_run(&args).unwrap()).unwrap();
        let rows = json["embeddings"].as_array().unwrap();
        let values: Vec<f32> = rows
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter())
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let got = Tensor::f32(vec![rows.len(), want.shape[1]], values);
        assert_eq!(rows.len(), want.shape[0], "one embedding per text");
        assert_embeddings_close(&got, want, want.shape[0], "kiln-run embed");
    }
}

/// Bad input through the command line: one line naming the problem, nothing written.
#[test]
fn kiln_run_refuses_bad_input_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("gpt2.kiln");
    compile(&fixture("gpt2-tiny"), &art, &["--buckets", "16"]);
    let a = art.to_str().unwrap();
    let out = tmp.path().join("out.safetensors");
    let input = tmp.path().join("in.safetensors");
    let ids = Tensor::i64(vec![3], vec![1, 2, 100_000]);
    kiln_ir::io::write_tensors(&input, &BTreeMap::from([("input_ids".to_string(), ids)])).unwrap();
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    let err =
        kiln_run(&["forward", a, "--input", i, "--output", o, "--device", "cpu"]).unwrap_err();
    assert!(err.contains("100000"), "names the id: {err}");
    assert!(!err.contains('\n'), "one line: {err}");
    assert!(!out.exists(), "no output written");
    let err = kiln_run(&[
        "generate",
        a,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "500",
        "--device",
        "cpu",
    ])
    .unwrap_err();
    assert!(err.contains("context"), "names the context: {err}");
    let missing = tmp.path().join("missing.kiln");
    let err = kiln_run(&["embed", missing.to_str().unwrap(), "--text", "x"]).unwrap_err();
    assert!(err.contains("missing.kiln"), "names the artifact: {err}");
}

/// Several prompts decoded together: `kiln-run generate` with `--prompt-ids` repeated runs them
/// through the smallest decode batch bucket that holds them (batch 4 for three prompts) and prints
/// one line per sequence, in order, each what that prompt gets alone, greedy and sampled, with
/// prompts entering through the chunk bucket (then copied to their rows; or three rows of chunks
/// of 4 tokens side by side, `--prefill-batch 3`) or one token per batched step, in f32 and in bf16
/// builds (whose CPU plans run over a memory plan of their own), over paged caches (blocks of 16
/// keys, the default, or of 4 in a pool that holds one sequence of the context: sequences wait
/// for blocks) and a dense one; the interpreter, whose cache the caller holds, agrees; five
/// prompts are refused.
#[test]
fn several_prompts_decode_together_as_each_alone() {
    use kiln_runtime::generate::{generate_batch, Sampling};
    let tmp = tempfile::tempdir().unwrap();
    let ids = |t: &Tensor| -> Vec<i64> { t.as_i64().unwrap().to_vec() };
    let joined = |p: &[i64]| p.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    for name in ["gpt2-tiny", "llama-tiny"] {
        let r = reference(name);
        let prompts = [
            ids(&r["batch_a"]),
            ids(&r["batch_b"]),
            ids(&r["greedy_prompt"]),
        ];
        let paged: [&[&str]; 3] = [
            &[],
            &["--kv-block-size", "4", "--kv-blocks", "17"],
            &["--kv-block-size", "0"],
        ];
        for (chunk, rows, dtype, cache) in [
            ("16", "1", "f32", paged[0]),
            ("1", "1", "f32", paged[0]),
            ("16", "1", "bf16", paged[0]),
            ("4", "3", "f32", paged[0]),
            ("4", "3", "f32", paged[1]),
            ("16", "1", "f32", paged[2]),
        ] {
            let art = tmp.path().join(format!(
                "{name}-{chunk}x{rows}-{dtype}-{}.kiln",
                cache.len()
            ));
            let buckets = ["--buckets", "16,64", "--batch-buckets", "1,4"];
            let rest = [
                "--max-context",
                "64",
                "--prefill-chunk",
                chunk,
                "--prefill-batch",
                rows,
                "--dtype",
                dtype,
            ];
            compile(
                &fixture(name),
                &art,
                &[&buckets[..], &rest[..], cache].concat(),
            );
            let a = art.to_str().unwrap();
            let sampled = ["--temperature", "0.8", "--top-k", "20", "--seed", "7"];
            for sampling in [&[][..], &sampled[..]] {
                let run = |which: &[&Vec<i64>]| -> Vec<String> {
                    let lists: Vec<String> = which.iter().map(|p| joined(p)).collect();
                    let mut args = vec!["generate", a, "--max-new-tokens", "12"];
                    for list in &lists {
                        args.extend(["--prompt-ids", list.as_str()]);
                    }
                    args.extend(["--device", "cpu"]);
                    args.extend(sampling);
                    let out = kiln_run(&args).unwrap();
                    out.lines().map(str::to_string).collect()
                };
                let together = run(&prompts.iter().collect::<Vec<_>>());
                assert_eq!(together.len(), 3, "{name}: one line per sequence");
                for (i, p) in prompts.iter().enumerate() {
                    let alone = run(&[p]);
                    assert_eq!(
                        together[i], alone[0],
                        "{name} chunk {chunk}x{rows} {dtype} {cache:?} {sampling:?}: sequence {i} decoded together"
                    );
                }
                if sampling.is_empty() && dtype == "f32" {
                    let want: Vec<String> = ids(&r["greedy_tokens"])[..12]
                        .iter()
                        .map(i64::to_string)
                        .collect();
                    assert_eq!(together[2], want.join(" "), "{name}: greedy_tokens");
                    let artifact = kiln_runtime::Artifact::open(&art).unwrap();
                    let mut interp = kiln_runtime::Executor::Interpreter;
                    let (seqs, _) =
                        generate_batch(&artifact, &mut interp, &prompts, 12, &Sampling::greedy())
                            .unwrap();
                    let printed: Vec<String> = seqs
                        .iter()
                        .map(|s| s.iter().map(i64::to_string).collect::<Vec<_>>().join(" "))
                        .collect();
                    assert_eq!(
                        printed, together,
                        "{name} chunk {chunk}x{rows}: the interpreter"
                    );
                }
            }
            // --json: one object per line, per sequence, in order.
            let (pa, pb) = (joined(&prompts[0]), joined(&prompts[1]));
            let args = ["generate", a, "--prompt-ids", &pa, "--prompt-ids", &pb];
            let tail = ["--max-new-tokens", "5", "--device", "cpu", "--json"];
            let printed = kiln_run(&[&args[..], &tail[..]].concat()).unwrap();
            let lines: Vec<serde_json::Value> = printed
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_eq!(lines.len(), 2, "{printed}");
            for (line, p) in lines.iter().zip(&prompts) {
                let alone = kiln_run_greedy(&art, p, 5, "cpu");
                let tokens: Vec<i64> = line["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_i64().unwrap())
                    .collect();
                assert_eq!(tokens, alone, "{name} {dtype}: --json");
            }
            let five: Vec<String> = (0..5).map(|i| i.to_string()).collect();
            let mut args = vec!["generate", a, "--max-new-tokens", "2", "--device", "cpu"];
            for p in &five {
                args.extend(["--prompt-ids", p.as_str()]);
            }
            let err = kiln_run(&args).unwrap_err();
            assert!(err.contains("5 prompts") && err.contains('4'), "{err}");
            let err = kiln_run(&[
                "generate",
                a,
                "--prompt-ids",
                "1,x",
                "--max-new-tokens",
                "2",
            ])
            .unwrap_err();
            assert!(err.contains("`x`"), "names the bad id: {err}");
        }
    }
}
