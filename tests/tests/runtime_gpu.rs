//! Compile -> artifact -> `--device cuda`: every fixture model, compiled for f32 and bf16, runs
//! through the CUDA executor (one allocation, graphs captured at load, replayed per request) and
//! matches the references within the fixtures' tolerances; greedy generation through the
//! device-resident KV cache reproduces `greedy_tokens`; nothing is captured or compiled after
//! load. Skips, saying why, on a machine without a GPU.

use kiln_ir::inputs::TokenBatch;
use kiln_runtime::forward::{forward, logits_chunks, prepare, run_chunks};
use std::path::{Path, PathBuf};

use kiln_runtime::cuda::{Counters, CudaExecutor};
use kiln_runtime::{Artifact, Device, Executor};
use kiln_tests::{
    assert_chained_steps_match, assert_close_for, assert_decoder_references,
    assert_embeddings_close, assert_greedy_tokens, assert_paced_chunks_keep_tokens,
    compile_artifact, fixture, floats, kiln_run_forward, kiln_run_greedy, masked_rel_err,
    minilm_dir, reference, rel_err, strip_cubin, BATCHER_ARTIFACT, LONG_CHUNKS,
};

/// A scratch folder for a GPU test's artifacts, or `None` after saying why the test passes
/// without a GPU.
fn gpu_scratch() -> Option<tempfile::TempDir> {
    match kiln_runtime::cuda::probe() {
        Ok(()) => Some(tempfile::tempdir().unwrap()),
        Err(e) => {
            println!("SKIPPED: {e}");
            None
        }
    }
}

fn cuda(art: &Artifact) -> Executor {
    let exec = Executor::open(art, Device::Cuda).unwrap();
    assert!(matches!(exec, Executor::Cuda(_)));
    exec
}

/// The CUDA executor `exec` is.
fn cuda_of(exec: &mut Executor) -> &mut CudaExecutor {
    match exec {
        Executor::Cuda(c) => c,
        _ => panic!("not the CUDA executor"),
    }
}

/// A sentence-transformers copy of bert-tiny in `dir`, with mean pooling and normalisation.
fn mean_pooling_copy(dir: &Path) -> PathBuf {
    let st = dir.join("st");
    kiln_tests::sentence_transformers_copy(
        &fixture("bert-tiny"),
        &st,
        &["pooling_mode_mean_tokens"],
        true,
    );
    st
}

#[test]
fn decoders_match_references_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    for name in ["gpt2-tiny", "llama-tiny"] {
        for dtype in ["f32", "bf16"] {
            let dir = tmp.path().join(format!("{name}-{dtype}.kiln"));
            let art = compile_artifact(
                &fixture(name),
                &dir,
                &[
                    "--buckets",
                    "16,64,128",
                    "--batch-buckets",
                    "1,4",
                    "--max-context",
                    "128",
                    "--dtype",
                    dtype,
                ],
            );
            let mut exec = cuda(&art);
            assert_decoder_references(&art, &mut exec, name, dtype);
            println!("ok: {name} {dtype} logits");
            if dtype == "f32" {
                assert_greedy_tokens(&art, &mut exec, name, "on the GPU");
                // A second generation starts from an empty cache and gives the same tokens.
                assert_greedy_tokens(&art, &mut exec, name, "on the GPU, second generation");
                // Prompt chunks of 3 (the default chunk here is 16: the whole prompt at once).
                let dir = tmp.path().join(format!("{name}-chunk3.kiln"));
                let chunked = compile_artifact(
                    &fixture(name),
                    &dir,
                    &[
                        "--buckets",
                        "16",
                        "--max-context",
                        "64",
                        "--prefill-chunk",
                        "3",
                    ],
                );
                let mut chunked_exec = cuda(&chunked);
                assert_greedy_tokens(
                    &chunked,
                    &mut chunked_exec,
                    name,
                    "through prompt chunks of 3",
                );
                println!("ok: {name} greedy_tokens");
            }
            let Executor::Cuda(c) = &exec else {
                unreachable!()
            };
            let counters = c.counters();
            assert!(counters.after_load.is_zero(), "{}", counters.after_load);
            println!(
                "ok: {name} {dtype}: load {:.3} s, replays {:?}",
                c.load_seconds, counters.replays
            );
        }
    }
}

/// Prompts longer than the largest logits chunk (33 and 100 tokens; chunks of 32, the last of 8)
/// stream through the logits chunks, each chunk's logits copied to the host while the next
/// computes, and match the references (the shorter ones and the padded batch take the prefill
/// bucket); paged and dense caches, f32 and bf16; nothing captured or allocated after load.
#[test]
fn long_prompts_stream_through_logits_chunks_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    for name in ["gpt2-tiny", "llama-tiny"] {
        for (dtype, block) in [("f32", "16"), ("bf16", "16"), ("bf16", "0")] {
            let dir = tmp.path().join(format!("{name}-{dtype}-{block}.kiln"));
            let art = compile_artifact(
                &fixture(name),
                &dir,
                &[
                    "--buckets",
                    "16",
                    "--batch-buckets",
                    "1,2",
                    "--max-context",
                    "128",
                    "--logits-chunk",
                    "32,8",
                    "--kv-block-size",
                    block,
                    "--dtype",
                    dtype,
                ],
            );
            let mut exec = cuda(&art);
            assert_decoder_references(&art, &mut exec, name, dtype);
            let Executor::Cuda(c) = &exec else {
                unreachable!()
            };
            let counters = c.counters();
            assert!(counters.after_load.is_zero(), "{}", counters.after_load);
            let chunked: u64 = counters
                .replays
                .iter()
                .filter(|(g, _)| g.contains("logits-"))
                .map(|(_, n)| n)
                .sum();
            // 33 tokens: 32 + 8; 100: 3 x 32 + 8.
            assert_eq!(chunked, 6, "{name} {dtype} {block}: {:?}", counters.replays);
            println!("ok: {name} {dtype} block {block}: logits chunks");
        }
    }
}

/// A logits chunk of more rows than an LM-head piece copies each piece's rows to the host once
/// they are written: prompts of 400 tokens (one chunk of 520 whose pieces end at rows 256 and
/// 520, the second partly past the prompt) and 530 (520, then 10 of a chunk of
/// 256) give the logits the CPU executor computes from the same artifact, and so does 530 as
/// 274 of the 520, then a last chunk of 256 (the schedule load may pick where the copies
/// outlast the compute); GPT-2 and Llama, f32 paged and bf16 dense.
#[test]
fn logits_chunks_stream_their_lm_head_pieces_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = tmp.path().join(format!("{name}-long"));
        kiln_tests::long_decoder(name, &model);
        for (dtype, block) in [("f32", "16"), ("bf16", "0")] {
            let dir = tmp.path().join(format!("{name}-long-{dtype}-{block}.kiln"));
            let paging = ["--kv-block-size", block, "--dtype", dtype];
            let art = compile_artifact(&model, &dir, &[&LONG_CHUNKS[..], &paging].concat());
            let what = format!("{name} {dtype} block {block}");
            assert_pieces_stream(&art, &what);
        }
    }
}

/// [`logits_chunks_stream_their_lm_head_pieces_on_the_gpu`] on one artifact.
fn assert_pieces_stream(art: &Artifact, what: &str) {
    let chunk = art.manifest.logits_chunks.iter().find(|e| e.seq == 520);
    let pieces = &chunk.unwrap().plan.as_ref().unwrap().logits_pieces;
    assert_eq!(pieces.len(), 2, "{what}");
    let vocab = art.manifest.model.vocab_size;
    let (mut gpu_exec, mut cpu_exec) = (cuda(art), Executor::open(art, Device::Cpu).unwrap());
    for len in [400usize, 530] {
        let ids = (0..len).map(|i| (i * 7919 % vocab) as i64).collect();
        let batch = TokenBatch::unmasked(vec![ids]);
        let got = forward(art, &mut gpu_exec, &batch).unwrap();
        let want = forward(art, &mut cpu_exec, &batch).unwrap();
        assert_eq!(got["logits"].shape, vec![1, len, vocab]);
        let what = format!("{what}, {len} tokens");
        let dtype = art.manifest.dtype.to_string();
        let (got, want) = (floats(&got["logits"]), floats(&want["logits"]));
        assert_close_for(&dtype, got, want, vocab, &what);
        println!("ok: {what}: logits in pieces");
        if len == 530 {
            assert_last_chunk_keeps_logits(art, &mut gpu_exec, &batch, want, &what);
        }
    }
    let Executor::Cuda(c) = &gpu_exec else {
        unreachable!()
    };
    let after_load = c.counters().after_load;
    assert!(after_load.is_zero(), "{what}: {after_load}");
}

/// `batch` (530 tokens) ending in a chunk of 256 on `exec` gives `want`'s logits.
fn assert_last_chunk_keeps_logits(
    art: &Artifact,
    exec: &mut Executor,
    batch: &TokenBatch,
    want: &[f32],
    what: &str,
) {
    let chunks = logits_chunks(art, batch, Some(256)).unwrap().unwrap();
    let sizes: Vec<(usize, usize)> = chunks.iter().map(|c| (c.entry.seq, c.len)).collect();
    assert_eq!(sizes, [(520, 274), (256, 256)], "{what}");
    let got = run_chunks(art, exec, &batch.ids[0], &chunks).unwrap();
    let dtype = art.manifest.dtype.to_string();
    let vocab = art.manifest.model.vocab_size;
    assert_close_for(&dtype, floats(&got), want, vocab, what);
    println!("ok: {what}: a last chunk of 256");
}

/// Greedy decode steps chained on the device (each step's token choice leaves the next step's
/// ids and positions in place, the host reading the tokens after the last) give the tokens of
/// steps the host runs one at a time ([`assert_chained_steps_match`]), and prompt chunks paced
/// against the decode steps those of unpaced ones ([`assert_paced_chunks_keep_tokens`]).
#[test]
fn chained_steps_and_paced_chunks_keep_the_tokens_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    for name in ["gpt2-tiny", "llama-tiny"] {
        let dir = tmp.path().join(format!("{name}.kiln"));
        let args = [&BATCHER_ARTIFACT[..], &["--dtype", "bf16"]].concat();
        let art = compile_artifact(&fixture(name), &dir, &args);
        assert_chained_steps_match(&art, &mut cuda(&art), name);
        assert_paced_chunks_keep_tokens(&art, &mut cuda(&art), name);
    }
}

/// A decode step samples on the device exactly what `generate::choose` picks from the same
/// step's logits: four rows under different samplings (top-k, top-p, a hot temperature, greedy),
/// one of them masked, over 40 steps of random tokens; only token ids come back.
#[test]
fn device_sampling_picks_the_reference_token() {
    use kiln_ir::Tensor;
    use kiln_runtime::generate::{choose, sampler_words, Sampling};
    let Some(tmp) = gpu_scratch() else { return };
    for name in ["gpt2-tiny", "llama-tiny"] {
        let dir = tmp.path().join(format!("{name}.kiln"));
        let args = [&BATCHER_ARTIFACT[..], &["--dtype", "bf16"]].concat();
        let art = compile_artifact(&fixture(name), &dir, &args);
        let mut exec = cuda(&art);
        kiln_tests::give_rows_whole_contexts(&art, &mut exec);
        let entry = art
            .manifest
            .decode
            .iter()
            .find(|e| (e.batch, e.seq) == (4, 1))
            .unwrap()
            .clone();
        let vocab = art.manifest.model.vocab_size;
        let modes = [
            Sampling {
                temperature: 0.8,
                top_k: 20,
                top_p: 1.0,
                seed: 3,
            },
            Sampling {
                temperature: 0.7,
                top_k: 0,
                top_p: 0.9,
                seed: 4,
            },
            Sampling {
                temperature: 1.5,
                top_k: 0,
                top_p: 1.0,
                seed: 5,
            },
            Sampling::greedy(),
        ];
        let mut exact = 0;
        for step in 0..40u32 {
            let ids: Vec<i64> = (0..4)
                .map(|r| i64::from((step * 37 + r * 11) % vocab as u32))
                .collect();
            let mask: Vec<i64> = (0..4).map(|r| i64::from(r != 2 || step % 2 == 0)).collect();
            let positions: Vec<i64> = (0..4).map(|_| i64::from(step)).collect();
            let inputs = std::collections::BTreeMap::from([
                ("input_ids".to_string(), Tensor::i64(vec![4, 1], ids)),
                (
                    "attention_mask".to_string(),
                    Tensor::i64(vec![4, 1], mask.clone()),
                ),
                (
                    "position_ids".to_string(),
                    Tensor::i64(vec![4, 1], positions),
                ),
            ]);
            let logits = exec.run(&art, &entry, &inputs).unwrap()["logits"].clone();
            let logits = logits.as_f32().unwrap().to_vec();
            let params: Vec<[u32; 4]> = modes.iter().map(|s| sampler_words(s, step)).collect();
            let got = exec.run_sampled(&entry, &inputs, &params).unwrap().unwrap();
            for (r, mode) in modes.iter().enumerate() {
                if mask[r] == 0 {
                    continue;
                }
                let want = choose(&logits[r * vocab..(r + 1) * vocab], mode, step);
                assert_eq!(got[r], want as i64, "{name} step {step} row {r} {mode:?}");
                exact += 1;
            }
        }
        println!("ok: {name}: {exact} device samples equal the reference's");
    }
}

/// bert-tiny and the real all-MiniLM-L6-v2 (its mean pooling and normalisation run as the GPU
/// plan's host tail), f32 and bf16: `last_hidden_state` and the sentence embeddings within the
/// fixtures' tolerances.
/// The counters count: an artifact without its cubin has its PTX JIT-compiled once at load (one
/// module load, one JIT, two captures per bucket, dependent and plain launches, or one where
/// `KILN_PDL` fixes the way; two allocations), and after 1,000 bench requests and a generation
/// nothing more was loaded, compiled, captured or allocated. With its cubin, the same load
/// compiles nothing.
#[test]
fn driver_work_is_counted_at_load_and_none_after() {
    use kiln_runtime::bench::{bench, BenchOptions};
    use kiln_runtime::cuda::DriverCounts;
    let Some(tmp) = gpu_scratch() else { return };
    let dir = tmp.path().join("llama.kiln");
    let art = compile_artifact(
        &fixture("llama-tiny"),
        &dir,
        &["--buckets", "16,64", "--max-context", "64"],
    );
    let ways = if std::env::var_os("KILN_PDL").is_some() {
        1
    } else {
        2
    };
    let buckets = art.manifest.buckets().filter(|e| e.plan.is_some()).count() as u64;
    let captures = ways * buckets;
    let at_load = |ptx_jits| DriverCounts {
        module_loads: 1,
        ptx_jits,
        captures,
        allocations: 2,
    };
    if art.manifest.kernels_cubin.is_some() {
        let Executor::Cuda(c) = cuda(&art) else {
            unreachable!()
        };
        assert_eq!(c.counters().at_load, at_load(0), "loading the cubin");
    } else {
        println!("note: compiled without ptxas, so the cubin load is not checked");
    }
    strip_cubin(&dir);
    let art = Artifact::open(&dir).unwrap();
    assert!(art.manifest.kernels_cubin.is_none());
    let mut exec = cuda(&art);
    let opts = BenchOptions {
        requests: 1000,
        batch: 1,
        min_len: 1,
        max_len: 64,
        decode_tokens: 8,
        seed: 12,
    };
    let report = bench(&art, &mut exec, &opts).unwrap();
    assert_eq!(report.replays.values().sum::<u64>(), 1000);
    let counters = report.counters.expect("CUDA counters");
    assert_eq!(counters.at_load, at_load(1), "loading the PTX");
    assert!(
        counters.after_load.is_zero(),
        "after load: {}",
        counters.after_load
    );
    println!(
        "ok: at load {}; after 1,000 requests {}",
        counters.at_load, counters.after_load
    );
}

#[test]
fn encoders_match_references_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    // The real MiniLM is fetched only when its turn comes, so that bert-tiny runs even where the
    // fetch cannot (a GPU machine without the network).
    for name in ["bert-tiny", "minilm-reference"] {
        let dir = match name {
            "bert-tiny" => fixture(name),
            _ => minilm_dir(),
        };
        for dtype in ["f32", "bf16"] {
            let art = compile_artifact(
                &dir,
                &tmp.path().join(format!("{name}-{dtype}.kiln")),
                &["--buckets", "32", "--batch-buckets", "4", "--dtype", dtype],
            );
            let mut exec = cuda(&art);
            let reference = reference(name);
            let (batch, _) = TokenBatch::from_tensors(
                &reference["input_ids"],
                Some(&reference["attention_mask"]),
            )
            .unwrap();
            let out = forward(&art, &mut exec, &batch).unwrap();
            let (got, want) = (&out["last_hidden_state"], &reference["last_hidden_state"]);
            let err = masked_rel_err(got, want, &reference["attention_mask"]);
            let tol = if dtype == "f32" { 1e-4 } else { 2e-2 };
            assert!(err < tol, "{name} {dtype}: relative error {:e}", err);
            println!(
                "ok: {name} {dtype}: last_hidden_state relative error {:e}",
                err
            );
            if let Some(want) = reference.get("sentence_embedding") {
                let got = &out["sentence_embedding"];
                let err = rel_err(floats(got), floats(want));
                assert!(err < tol, "{name} {dtype}: sentence embeddings {err:e}");
                if dtype == "f32" {
                    assert_embeddings_close(got, want, want.shape[0], name);
                }
                println!("ok: {name} {dtype}: sentence_embedding relative error {err:e}");
            }
        }
    }
}

/// Batch groups: a bucket of 64 rows run as groups of the 16-row bucket, each group's outputs
/// copied to the host while the next computes, gives what one replay of it gives (and, for a
/// sentence-transformers copy, what its host tail pools from them), f32 and bf16: 60 rows in
/// four groups, and 20 rows in the two groups that hold them (the other two are padding alone
/// and not replayed). The part's graph is what replays; the requests capture and allocate
/// nothing, and load leaves the copy ring as large as the grouping it kept needs.
#[test]
fn batch_groups_give_what_one_replay_gives_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    let st = mean_pooling_copy(tmp.path());
    // 60 rows of 90-128 tokens: the bucket's last four rows are dummies.
    let rows: Vec<Vec<i64>> = (0..60)
        .map(|r| {
            (0..90 + (r * 7) % 39)
                .map(|t| (r * 31 + t * 17) % 512)
                .collect()
        })
        .collect();
    // Other tokens in every row of the 64-row bucket, run first as one replay so that the
    // staging buffer holds other rows wherever a group's copy went astray.
    let other: Vec<Vec<i64>> = (0..64)
        .map(|r| (0..128).map(|t| (r * 13 + t * 7 + 5) % 512).collect())
        .collect();
    let other = TokenBatch::padded(&other, 0);
    for (name, dir) in [("bert-tiny", fixture("bert-tiny")), ("bert-tiny st", st)] {
        for dtype in ["f32", "bf16"] {
            let art = compile_artifact(
                &dir,
                &tmp.path()
                    .join(format!("{}-{dtype}.kiln", name.replace(' ', "-"))),
                &[
                    "--buckets",
                    "128",
                    "--batch-buckets",
                    "16,64",
                    "--dtype",
                    dtype,
                ],
            );
            let bucket = |b: usize| {
                let e = art.manifest.prefill.iter().find(|e| e.batch == b).unwrap();
                e.graph.clone()
            };
            let (whole, part) = (bucket(64), bucket(16));
            let mut exec = cuda(&art);
            let chosen = cuda_of(&mut exec).batch_groups().get(&whole).cloned();
            let group_bytes: u64 = art
                .manifest
                .prefill
                .iter()
                .find(|e| e.graph == part)
                .and_then(|e| e.plan.as_ref())
                .map(|p| p.outputs.iter().map(|s| s.bytes()).sum())
                .unwrap();
            // The ring holds what the groupings some request takes need, or nothing.
            let grouped_rows: Vec<usize> = (1..=64)
                .filter(|&rows| cuda_of(&mut exec).grouping_for(&whole, rows).is_some())
                .collect();
            let kept = if grouped_rows.is_empty() {
                0
            } else {
                2 * group_bytes
            };
            let ring = cuda_of(&mut exec).copy_ring_bytes();
            assert_eq!(ring, kept, "{name} {dtype}: the copy ring after load");
            assert_eq!(chosen.is_some(), grouped_rows.contains(&64));
            let case = format!("{name} {dtype}");
            for (batch_rows, groups) in [(60, 4), (20, 2)] {
                let batch = TokenBatch::padded(&rows[..batch_rows], 0);
                let case = format!("{case}, {batch_rows} rows");
                let buckets = (whole.as_str(), part.as_str());
                grouped_as_one(&art, &mut exec, [&batch, &other], buckets, groups, &case);
            }
            let chosen = chosen.map(|g| g.part);
            println!(
                "ok: {name} {dtype}: load chose {chosen:?} for {whole} when full, groups for {} of its 64 row counts",
                grouped_rows.len()
            );
            assert!(cuda_of(&mut exec)
                .group_bucket(&part, Some(&whole))
                .is_err());
        }
    }
}

/// `batch` through bucket `whole` as `groups` replays of bucket `part` and as one replay: the
/// same outputs, within what a product of fewer rows may round otherwise, after `other` went
/// through the whole bucket; the rows of groups not run come back as zeros.
fn grouped_as_one(
    art: &Artifact,
    exec: &mut Executor,
    [batch, other]: [&TokenBatch; 2],
    (whole, part): (&str, &str),
    groups: u64,
    case: &str,
) {
    cuda_of(exec).group_bucket(whole, None).unwrap();
    forward(art, exec, other).unwrap();
    // Setting the grouping by hand may allocate the ring that load freed; the grouped
    // request itself captures and allocates nothing.
    cuda_of(exec).group_bucket(whole, Some(part)).unwrap();
    let before = cuda_of(exec).counters();
    let grouped = forward(art, exec, batch).unwrap();
    let after = cuda_of(exec).counters();
    let replays = |c: &Counters, g: &str| c.replays.get(g).copied().unwrap_or(0);
    assert_eq!(
        replays(&after, part),
        replays(&before, part) + groups,
        "{case}"
    );
    assert_eq!(replays(&after, whole), replays(&before, whole), "{case}");
    assert_eq!(
        after.after_load, before.after_load,
        "{case}: during the request"
    );
    assert_eq!(after.after_load.captures, 0, "{case}");
    // The bucket's rows past the groups run are zeros, whatever the staging buffer held.
    let (bucket, inputs) = prepare(art, batch).unwrap();
    let outputs = cuda_of(exec)
        .run(&bucket.graph, &inputs, batch.ids.len())
        .unwrap();
    let part_rows = art.manifest.prefill.iter().find(|e| e.graph == part);
    let computed = groups as usize * part_rows.unwrap().batch;
    for (output, t) in &outputs {
        let past = computed * t.shape[1..].iter().product::<usize>();
        let zeros = match &t.data {
            kiln_ir::Data::Float(v) => v[past..].iter().all(|&x| x == 0.0),
            kiln_ir::Data::Int(v) => v[past..].iter().all(|&x| x == 0),
        };
        assert!(zeros, "{case} {output}: rows past the groups");
    }
    cuda_of(exec).group_bucket(whole, None).unwrap();
    let one = forward(art, exec, batch).unwrap();
    assert_eq!(
        one.keys().collect::<Vec<_>>(),
        grouped.keys().collect::<Vec<_>>()
    );
    let f32s = art.manifest.dtype == kiln_ir::DType::F32;
    for (output, want) in &one {
        let got = &grouped[output];
        assert_eq!(got.shape, want.shape, "{case} {output}");
        // The two buckets' products may split K differently (fewer rows, fewer tiles).
        let tol = if f32s { 1e-5 } else { 4e-3 };
        let err = rel_err(floats(got), floats(want));
        assert!(err < tol, "{case} {output}: {err:e} from one replay");
        println!("ok: {case} {output} in {groups} groups: {err:e} from one replay");
    }
}

/// A sentence-transformers encoder (bert-tiny with mean pooling and normalisation added): the
/// transformer runs as the GPU plan, the pooling as its host tail; `--device cuda` gives what the
/// interpreter gives on the same artifact.
#[test]
fn sentence_embeddings_on_the_gpu_match_the_interpreter() {
    let Some(tmp) = gpu_scratch() else { return };
    let st = mean_pooling_copy(tmp.path());
    let art = compile_artifact(
        &st,
        &tmp.path().join("st.kiln"),
        &["--buckets", "32", "--batch-buckets", "4"],
    );
    let reference = reference("bert-tiny");
    let (batch, _) =
        TokenBatch::from_tensors(&reference["input_ids"], Some(&reference["attention_mask"]))
            .unwrap();
    let want = forward(&art, &mut Executor::Interpreter, &batch).unwrap();
    let got = forward(&art, &mut cuda(&art), &batch).unwrap();
    let rows = want["sentence_embedding"].shape[0];
    kiln_tests::assert_embeddings_close(
        &got["sentence_embedding"],
        &want["sentence_embedding"],
        rows,
        "bert-tiny st",
    );
    let err = masked_rel_err(
        &got["last_hidden_state"],
        &want["last_hidden_state"],
        &reference["attention_mask"],
    );
    assert!(err < 1e-4, "last_hidden_state: relative error {err:e}");
    println!(
        "ok: sentence-transformers bert-tiny on the GPU, host-tail pooling; relative error {err:e}"
    );
}

/// The command line on the GPU: `kiln-run forward --device cuda` gives every fixture's references
/// in f32 and bf16, and `kiln-run generate --device cuda` the f32 builds' greedy tokens.
#[test]
fn kiln_run_forward_and_generate_on_the_gpu() {
    use std::collections::BTreeMap;
    let Some(tmp) = gpu_scratch() else { return };
    for dtype in ["f32", "bf16"] {
        for name in ["gpt2-tiny", "llama-tiny"] {
            let art = tmp.path().join(format!("{name}-{dtype}.kiln"));
            compile_artifact(
                &fixture(name),
                &art,
                &[
                    "--buckets",
                    "16,64,128",
                    "--max-context",
                    "128",
                    "--dtype",
                    dtype,
                    "--target",
                    "cuda",
                ],
            );
            let reference = reference(name);
            for l in [1usize, 7, 16, 33, 100] {
                let ids = reference[&format!("input_ids_{l}")].clone();
                let out =
                    kiln_run_forward(&art, BTreeMap::from([("input_ids".into(), ids)]), "cuda");
                let want = floats(&reference[&format!("logits_{l}")]);
                let what = format!("kiln-run forward --device cuda {name} {dtype} L={l}");
                assert_close_for(dtype, floats(&out["logits"]), want, 512, &what);
            }
            if dtype == "f32" {
                let prompt = reference["greedy_prompt"].as_i64().unwrap();
                let want = reference["greedy_tokens"].as_i64().unwrap().to_vec();
                let got = kiln_run_greedy(&art, prompt, want.len(), "cuda");
                assert_eq!(got, want, "kiln-run generate --device cuda {name}");
            }
            println!("ok: kiln-run on the GPU: {name} {dtype}");
        }
        let art = tmp.path().join(format!("bert-{dtype}.kiln"));
        compile_artifact(
            &fixture("bert-tiny"),
            &art,
            &[
                "--buckets",
                "32",
                "--batch-buckets",
                "4",
                "--dtype",
                dtype,
                "--target",
                "cuda",
            ],
        );
        let reference = reference("bert-tiny");
        let inputs = ["input_ids", "attention_mask"]
            .map(|k| (k.to_string(), reference[k].clone()))
            .into();
        let out = kiln_run_forward(&art, inputs, "cuda");
        let err = masked_rel_err(
            &out["last_hidden_state"],
            &reference["last_hidden_state"],
            &reference["attention_mask"],
        );
        let tol = if dtype == "f32" { 1e-4 } else { 2e-2 };
        assert!(
            err < tol,
            "kiln-run forward --device cuda bert-tiny {dtype}: {err:e}"
        );
        println!("ok: kiln-run on the GPU: bert-tiny {dtype}, relative error {err:e}");
    }
}

/// Sequences wait for the blocks of a small paged cache and get their own tokens, on the GPU
/// ([`kiln_tests::assert_sequences_wait_for_blocks`]).
#[test]
fn sequences_wait_for_kv_blocks_on_the_gpu() {
    let Some(tmp) = gpu_scratch() else { return };
    for dtype in ["f32", "bf16"] {
        let dir = tmp.path().join(format!("llama-{dtype}.kiln"));
        let flags = [&kiln_tests::SMALL_POOL_ARTIFACT[..], &["--dtype", dtype]].concat();
        let art = compile_artifact(&fixture("llama-tiny"), &dir, &flags);
        let mut exec = cuda(&art);
        assert_eq!(
            kiln_tests::assert_sequences_wait_for_blocks(&art, &mut exec, false),
            0
        );
        let ahead = kiln_tests::assert_sequences_wait_for_blocks(&art, &mut exec, true);
        assert!(ahead > 0, "decode steps were launched ahead");
        println!("ok: llama-tiny {dtype}: sequences wait for KV blocks ({ahead} steps ahead)");
    }
}
