//! Shared helpers for kiln's end-to-end tests: where the fixtures are, the real MiniLM checkpoint,
//! running the `kiln` CLI in-process, and the error measures the fixtures' README defines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use clap::Parser;
use kiln_compiler::cli::{run, Cli};
use kiln_ir::Tensor;

/// The fixtures folder: `$KILN_FIXTURES`, else `../shared/fixtures` beside the checkout.
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("KILN_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join("../shared/fixtures"),
    }
}

/// The repository root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The folder of fixture `name` (`gpt2-tiny`, ...).
pub fn fixture(name: &str) -> PathBuf {
    let dir = fixtures_dir().join(name);
    assert!(
        dir.is_dir(),
        "fixture {} is missing (set KILN_FIXTURES)",
        dir.display()
    );
    dir
}

/// The tensors of a fixture's `reference.safetensors`.
pub fn reference(name: &str) -> BTreeMap<String, Tensor> {
    kiln_compiler::tensor_io::read_tensors(&fixture(name).join("reference.safetensors"))
        .expect("reference.safetensors is readable")
}

/// The real all-MiniLM-L6-v2 model folder, downloaded once by `scripts/fetch-minilm`.
pub fn minilm_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = workspace_root().join("scripts/fetch-minilm");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .expect("bash runs scripts/fetch-minilm");
        assert!(
            out.status.success(),
            "scripts/fetch-minilm failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// Runs `kiln ARGS...` in-process; returns what it printed, or the error as one line.
pub fn kiln(args: &[&str]) -> Result<String, String> {
    let cli = Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    run(&cli, &mut out).map_err(|e| format!("{e:#}"))?;
    Ok(String::from_utf8(out).expect("kiln prints UTF-8"))
}

/// Runs `kiln-run ARGS...` in-process (the binary's own entry point); returns what it printed, or
/// the error as one line.
pub fn kiln_run(args: &[&str]) -> Result<String, String> {
    use kiln_runtime::cli;
    let cli = cli::Cli::try_parse_from(std::iter::once("kiln-run").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    cli::run(cli, &mut out).map_err(|e| format!("{e:#}"))?;
    Ok(String::from_utf8(out).expect("kiln-run prints UTF-8"))
}

/// `kiln-run forward ART --input IN --output OUT --device DEVICE` over `inputs` (files beside
/// the artifact); the outputs it wrote.
pub fn kiln_run_forward(
    art: &Path,
    inputs: BTreeMap<String, Tensor>,
    device: &str,
) -> BTreeMap<String, Tensor> {
    let dir = art.parent().unwrap();
    let (input, output) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    kiln_ir::io::write_tensors(&input, &inputs).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let printed = kiln_run(&[
        "forward",
        &s(art),
        "--input",
        &s(&input),
        "--output",
        &s(&output),
        "--device",
        device,
    ])
    .unwrap();
    assert!(printed.is_empty(), "forward prints nothing: {printed}");
    kiln_ir::io::read_tensors(&output).unwrap()
}

/// `kiln-run generate ART --prompt-ids .. --max-new-tokens N --json --device DEVICE` (greedy);
/// the tokens it printed.
pub fn kiln_run_greedy(art: &Path, prompt: &[i64], n: usize, device: &str) -> Vec<i64> {
    let ids: Vec<String> = prompt.iter().map(i64::to_string).collect();
    let printed = kiln_run(&[
        "generate",
        art.to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--max-new-tokens",
        &n.to_string(),
        "--json",
        "--device",
        device,
    ])
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&printed).unwrap();
    json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

/// The float values of a tensor.
pub fn floats(t: &Tensor) -> &[f32] {
    t.as_f32().expect("a float tensor")
}

/// `max |a - b| / max |reference|`, the fixtures' relative error.
pub fn rel_err(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len(), "length mismatch");
    let diff = actual
        .iter()
        .zip(reference)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
        .fold(0.0, f64::max);
    let scale = reference
        .iter()
        .map(|b| f64::from(*b).abs())
        .fold(0.0, f64::max);
    diff / scale
}

/// Cosine similarity.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Asserts that the first `rows` sentence embeddings of `got` point where the reference's do:
/// cosine similarity at least 0.99999 (the fixtures' README tolerance). `what` names the case.
pub fn assert_embeddings_close(got: &Tensor, want: &Tensor, rows: usize, what: &str) {
    let dim = want.shape[1];
    assert_eq!(got.shape[1], dim, "{what}: embedding width");
    for i in 0..rows {
        let c = cosine(
            &floats(got)[i * dim..(i + 1) * dim],
            &floats(want)[i * dim..(i + 1) * dim],
        );
        assert!(c >= 0.99999, "{what} sentence {i}: cosine {c}");
    }
}

/// The sentences of the MiniLM reference (`minilm-reference/reference.json`), in order.
pub fn minilm_sentences() -> Vec<String> {
    let path = fixture("minilm-reference").join("reference.json");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    meta["sentences"]
        .as_array()
        .expect("reference.json lists sentences")
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Index of the largest value.
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |acc, (i, &x)| if x > acc.1 { (i, x) } else { acc },
        )
        .0
}

/// A checkpoint's tensors as `(shape, f32 values)`, by key.
pub type TensorMap = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Copies checkpoint `src` into `dst`, letting `edit` change its config and tensors, and writes the
/// tensors as `dtype` (`F32`, `F16` or `BF16`) into `shards` files (an index file when > 1).
pub fn rewrite_checkpoint(
    src: &Path,
    dst: &Path,
    dtype: safetensors::Dtype,
    shards: usize,
    edit: impl FnOnce(&mut serde_json::Value, &mut TensorMap),
) {
    let ckpt = kiln_models::Checkpoint::open(src).expect("source checkpoint opens");
    let mut config = ckpt.config().clone();
    let names: Vec<String> = {
        let text = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&text).unwrap();
        st.names().into_iter().map(str::to_string).collect()
    };
    let mut tensors: TensorMap = names
        .into_iter()
        .filter(|n| ckpt.read_f32(n).is_ok())
        .map(|n| {
            let shape = ckpt.shape(&n).unwrap().to_vec();
            let values = ckpt.read_f32(&n).unwrap();
            (n, (shape, values))
        })
        .collect();
    edit(&mut config, &mut tensors);
    std::fs::create_dir_all(dst).unwrap();
    std::fs::write(
        dst.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    let encode = |values: &[f32]| -> Vec<u8> {
        match dtype {
            safetensors::Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            safetensors::Dtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            safetensors::Dtype::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            other => panic!("rewrite_checkpoint writes floats, not {other:?}"),
        }
    };
    let keys: Vec<&String> = tensors.keys().collect();
    let per_shard = keys.len().div_ceil(shards.max(1));
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in keys.chunks(per_shard).enumerate() {
        let file = if shards > 1 {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        } else {
            "model.safetensors".to_string()
        };
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|k| ((*k).clone(), tensors[*k].0.clone(), encode(&tensors[*k].1)))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(k, shape, b)| {
                (
                    k.clone(),
                    safetensors::tensor::TensorView::new(dtype, shape.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dst.join(&file)).unwrap();
        for k in chunk {
            weight_map.insert((*k).clone(), serde_json::Value::String(file.clone()));
        }
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

/// Decoder fixture `name`'s checkpoint (f32) at `dst` with room for 1024 positions, so that
/// logits chunks may take more rows than an LM-head piece (256): llama-tiny's config says so;
/// gpt2-tiny's position table is repeated to 1024 rows as well.
pub fn long_decoder(name: &str, dst: &Path) {
    rewrite_checkpoint(
        &fixture(name),
        dst,
        safetensors::Dtype::F32,
        1,
        |config, tensors| {
            let key = if config.get("n_positions").is_some() {
                "n_positions"
            } else {
                "max_position_embeddings"
            };
            config[key] = 1024.into();
            for (name, (shape, values)) in tensors.iter_mut() {
                if name.ends_with("wpe.weight") {
                    *values = values.repeat(1024 / shape[0]);
                    shape[0] = 1024;
                }
            }
        },
    );
}

/// `kiln compile` flags for [`long_decoder`]: a prefill bucket of 16 tokens, a context of
/// 600 and logits chunks of 520 (LM-head pieces of 256, 256 and 8 rows) and 256 (one piece).
pub const LONG_CHUNKS: [&str; 6] = [
    "--buckets",
    "16",
    "--max-context",
    "600",
    "--logits-chunk",
    "520,256",
];

/// Compiles `dir` for the given sequence and batch buckets (default limits and cost model).
pub fn compile_fixture(
    dir: &Path,
    seq: &[usize],
    batch: &[usize],
) -> (
    kiln_models::Model,
    kiln_compiler::compile::CompileReport,
    Vec<kiln_compiler::compile::CompiledBucket>,
) {
    use kiln_compiler::bucket::BucketPlan;
    use kiln_compiler::compile::{compile, CompileOptions};
    let model = kiln_models::import(dir).expect("fixture imports");
    let opts = CompileOptions::prefill(BucketPlan::new(seq.to_vec(), batch.to_vec()).unwrap());
    let (report, compiled) = compile(&model.graph, None, &opts).expect("fixture compiles");
    (model, report, compiled.prefill)
}

/// Right-pads every row of `batch` to `seq` tokens (id 0, mask 0, token type 0).
pub fn pad_to(
    batch: &kiln_models::inputs::TokenBatch,
    seq: usize,
) -> kiln_models::inputs::TokenBatch {
    let mask = batch
        .mask
        .clone()
        .unwrap_or_else(|| batch.ids.iter().map(|r| vec![1; r.len()]).collect());
    let pad = |rows: &[Vec<i64>]| -> Vec<Vec<i64>> {
        rows.iter()
            .map(|r| {
                let mut r = r.clone();
                r.resize(seq, 0);
                r
            })
            .collect()
    };
    kiln_models::inputs::TokenBatch {
        ids: pad(&batch.ids),
        mask: Some(pad(&mask)),
        types: batch.types.as_deref().map(pad),
    }
}

/// The half-precision tolerance of the fixtures' README: relative error below 2e-2 and the same
/// argmax wherever the reference's top-1/top-2 margin exceeds 0.05.
pub fn assert_half_precision_close(got: &[f32], want: &[f32], vocab: usize, what: &str) {
    let err = rel_err(got, want);
    assert!(err < 2e-2, "{what}: relative error {err:e}");
    for (row, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 0.05 {
            assert_eq!(argmax(g), argmax(w), "{what}: argmax of row {row}");
        }
    }
}

/// max |got - want| / max |want| over the rows of `[B, L, H]` hidden states whose attention mask
/// (`[B, L]`) is 1: padded rows carry no meaning.
pub fn masked_rel_err(got: &Tensor, want: &Tensor, mask: &Tensor) -> f64 {
    assert_eq!(got.shape, want.shape);
    let mask = mask.as_i64().expect("an i64 mask");
    let hidden = want.shape[2];
    let (mut diff, mut scale) = (0f64, 0f64);
    for (i, &m) in mask.iter().enumerate() {
        if m == 1 {
            for j in i * hidden..(i + 1) * hidden {
                diff = diff.max(f64::from((floats(got)[j] - floats(want)[j]).abs()));
                scale = scale.max(f64::from(floats(want)[j].abs()));
            }
        }
    }
    diff / scale
}

/// A sentence-transformers folder made from a checkpoint folder: its files plus `modules.json`
/// (Transformer, Pooling with the modes `pooling` turns on, and Normalize when `normalize`) and
/// `1_Pooling/config.json`.
pub fn sentence_transformers_copy(src: &Path, dst: &Path, pooling: &[&str], normalize: bool) {
    std::fs::create_dir_all(dst.join("1_Pooling")).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    let mut modules = vec![
        serde_json::json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
        serde_json::json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}),
    ];
    if normalize {
        modules.push(serde_json::json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    std::fs::write(
        dst.join("modules.json"),
        serde_json::Value::Array(modules).to_string(),
    )
    .unwrap();
    std::fs::write(
        dst.join("1_Pooling/config.json"),
        serde_json::Value::Object(
            pooling
                .iter()
                .map(|m| (m.to_string(), serde_json::Value::Bool(true)))
                .collect(),
        )
        .to_string(),
    )
    .unwrap();
}

/// The fixtures README's tolerance for a build of `dtype`: f32 below 1e-4 relative; f16/bf16
/// below 2e-2 with the argmax kept where the reference's margin exceeds 0.05.
pub fn assert_close_for(dtype: &str, got: &[f32], want: &[f32], vocab: usize, what: &str) {
    if dtype == "f32" {
        let err = rel_err(got, want);
        assert!(err < 1e-4, "{what}: relative error {err:e}");
    } else {
        assert_half_precision_close(got, want, vocab, what);
    }
}

/// Runs decoder fixture `name`'s logits references through `exec` on `art` — every length alone,
/// then `batch_a` and `batch_b` as one padded batch — and checks them for a `dtype` build.
pub fn assert_decoder_references(
    art: &kiln_runtime::Artifact,
    exec: &mut kiln_runtime::Executor,
    name: &str,
    dtype: &str,
) {
    use kiln_ir::inputs::TokenBatch;
    use kiln_runtime::forward::forward;
    let reference = reference(name);
    let vocab = art.manifest.model.vocab_size;
    for l in [1usize, 7, 16, 33, 100] {
        let ids = reference[&format!("input_ids_{l}")]
            .as_i64()
            .unwrap()
            .to_vec();
        let batch = TokenBatch::unmasked(vec![ids]);
        let out = forward(art, exec, &batch).unwrap();
        assert_eq!(out["logits"].shape, vec![1, l, vocab]);
        let what = format!("{name} {dtype} L={l}");
        let want = floats(&reference[&format!("logits_{l}")]);
        assert_close_for(dtype, floats(&out["logits"]), want, vocab, &what);
    }
    let a = reference["batch_a"].as_i64().unwrap().to_vec();
    let b = reference["batch_b"].as_i64().unwrap().to_vec();
    let out = forward(art, exec, &TokenBatch::padded(&[a.clone(), b.clone()], 0)).unwrap();
    let logits = floats(&out["logits"]);
    let width = a.len().max(b.len());
    for (row, (len, key)) in [
        (a.len(), "batch_a_last_logits"),
        (b.len(), "batch_b_last_logits"),
    ]
    .into_iter()
    .enumerate()
    {
        let at = (row * width + len - 1) * vocab;
        let what = format!("{name} {dtype} {key}");
        assert_close_for(
            dtype,
            &logits[at..at + vocab],
            floats(&reference[key]),
            vocab,
            &what,
        );
    }
}

/// Greedy generation after decoder fixture `name`'s `greedy_prompt`, through `exec` on `art`,
/// reproduces its `greedy_tokens` (`what` says where, in the failure message).
pub fn assert_greedy_tokens(
    art: &kiln_runtime::Artifact,
    exec: &mut kiln_runtime::Executor,
    name: &str,
    what: &str,
) {
    use kiln_runtime::generate::{generate, Sampling};
    let reference = reference(name);
    let prompt = reference["greedy_prompt"].as_i64().unwrap().to_vec();
    let want = reference["greedy_tokens"].as_i64().unwrap().to_vec();
    let got = generate(art, exec, &prompt, want.len(), &Sampling::greedy()).unwrap();
    assert_eq!(got, want, "{name}: greedy tokens {what}");
}

/// `kiln compile MODEL -o OUT EXTRA..` in-process, and the artifact opened (verified).
pub fn compile_artifact(model: &Path, out: &Path, extra: &[&str]) -> kiln_runtime::Artifact {
    let mut args = vec![
        "compile",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    kiln(&args).unwrap();
    kiln_runtime::Artifact::open(out).unwrap()
}

/// Rewrites `dir`'s `checksums` after a test edited the artifact on purpose: every listed file
/// that still exists gets its current hash, deleted files lose their line, and the list gets its
/// own line again, so that only the edit itself differs from what `kiln compile` writes.
pub fn reseal_checksums(dir: &Path) {
    use kiln_ir::checksum::{digest_file, parse_checksums, render_checksums, CHECKSUMS};
    let text = std::fs::read_to_string(dir.join(CHECKSUMS)).unwrap();
    let sums: Vec<(String, String)> = parse_checksums(&text)
        .unwrap()
        .into_iter()
        .filter_map(|(_, file)| Some((digest_file(&dir.join(&file)).ok()?, file)))
        .collect();
    std::fs::write(dir.join(CHECKSUMS), render_checksums(&sums)).unwrap();
}

/// Makes `dir` an artifact without its cubin, as `kiln compile` writes one where no ptxas is
/// found: the cubin deleted, the manifest's `kernels_cubin` and `targets` emptied, the checksums
/// resealed. The runtime then loads the PTX, which the driver JIT-compiles.
pub fn strip_cubin(dir: &Path) {
    use kiln_ir::artifact::{Manifest, MANIFEST};
    let path = dir.join(MANIFEST);
    let mut manifest: Manifest = ron::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    if let Some(cubin) = manifest.kernels_cubin.take() {
        std::fs::remove_file(dir.join(cubin)).unwrap();
    }
    manifest.targets.clear();
    let text = ron::ser::to_string_pretty(&manifest, ron::ser::PrettyConfig::new()).unwrap();
    std::fs::write(&path, text).unwrap();
    reseal_checksums(dir);
}

/// `kiln compile` flags of an artifact [`assert_chained_steps_match`] and
/// [`assert_paced_chunks_keep_tokens`] take: decode batches of 1 and 4, prompt chunks of 16 and
/// 4 tokens, a context of 128.
pub const BATCHER_ARTIFACT: [&str; 8] = [
    "--buckets",
    "16",
    "--batch-buckets",
    "1,4",
    "--max-context",
    "128",
    "--prefill-chunk",
    "16,4",
];

/// Greedy decode steps chained by `exec` (`Batcher::with_steps_ahead`) give the tokens of steps
/// the caller sees one at a time, for sequences decoded together that want different numbers of
/// tokens (so sequences leave between chains and prompts join as the chunk bucket frees up), in
/// as many runs of each bucket and with fewer calls. `art` is compiled with
/// [`BATCHER_ARTIFACT`].
pub fn assert_chained_steps_match(
    art: &kiln_runtime::Artifact,
    exec: &mut kiln_runtime::Executor,
    name: &str,
) {
    use kiln_runtime::batcher::{Batcher, Job};
    use kiln_runtime::generate::Sampling;
    let jobs = [
        (vec![1i64, 2, 3], 40usize),
        (vec![7], 25),
        (vec![9, 8, 7, 6, 5, 4, 3, 2, 1], 33),
        (vec![11, 12], 70),
    ];
    let (mut runs, mut tokens, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for ahead in [1, 64] {
        let mut batcher = Batcher::new(art, exec).unwrap().with_steps_ahead(ahead);
        let mut waiting = jobs
            .iter()
            .enumerate()
            .map(|(id, (prompt, max_new))| {
                let job = Job {
                    prompt: prompt.clone(),
                    max_new: *max_new,
                    sampling: Sampling::greedy(),
                };
                (id as u64, job)
            })
            .peekable();
        let mut out = vec![Vec::new(); jobs.len()];
        let mut steps = 0;
        loop {
            // Prompts join as the chunk bucket's rows free up, as in `generate_batch`.
            while let Some((id, job)) = waiting.next_if(|(_, job)| batcher.can_admit(job)) {
                batcher.admit(id, job).unwrap();
            }
            if batcher.is_idle() && waiting.peek().is_none() {
                break;
            }
            steps += 1;
            for e in batcher.step().unwrap() {
                out[e.id as usize].push(e.token);
            }
        }
        runs.push(batcher.runs.clone());
        tokens.push(out);
        calls.push(steps);
    }
    for (i, (_, max_new)) in jobs.iter().enumerate() {
        assert_eq!(tokens[0][i].len(), *max_new, "{name}: sequence {i}");
        assert_eq!(tokens[1][i], tokens[0][i], "{name}: sequence {i}, chained");
    }
    assert_eq!(runs[1], runs[0], "{name}: runs per bucket");
    // The caller saw the tokens after fewer calls: steps were chained.
    assert!(calls[1] < calls[0] / 4, "{name}: {calls:?} calls");
    println!(
        "ok: {name}: chained steps give the single steps' tokens ({:?}; {calls:?} calls)",
        runs[0]
    );
}

/// A chunk budget ([`kiln_runtime::batcher::Batcher::with_chunk_budget`]) too small for any
/// chunk makes prompts fill through the smallest chunk bucket once a decode step has been timed,
/// and every sequence gets the tokens it gets without one. Sequence 0 (a 3-token prompt)
/// decodes alone first, so decode-only steps set the pace; three longer prompts then join.
/// `art` is compiled with [`BATCHER_ARTIFACT`].
pub fn assert_paced_chunks_keep_tokens(
    art: &kiln_runtime::Artifact,
    exec: &mut kiln_runtime::Executor,
    name: &str,
) {
    use kiln_runtime::batcher::{Batcher, Job};
    use kiln_runtime::generate::Sampling;
    let jobs: Vec<Job> = [(3, 40), (37, 12), (45, 12), (29, 12)]
        .iter()
        .enumerate()
        .map(|(i, &(len, max_new))| Job {
            prompt: (0..len)
                .map(|t| (t * 31 + i as i64 * 97) % 200 + 1)
                .collect(),
            max_new,
            sampling: Sampling::greedy(),
        })
        .collect();
    let chunk = |seq: usize| {
        let entry = art.manifest.decode.iter().find(|e| e.seq == seq);
        entry
            .expect("a chunk bucket of BATCHER_ARTIFACT")
            .graph
            .clone()
    };
    let (large, small) = (chunk(16), chunk(4));
    let (mut tokens, mut runs) = (Vec::new(), Vec::new());
    for budget in [None, Some(1e-9)] {
        let mut b = Batcher::new(art, exec).unwrap();
        if let Some(fraction) = budget {
            b = b.with_chunk_budget(fraction);
        }
        b.admit(0, jobs[0].clone()).unwrap();
        let (mut out, mut next) = (vec![Vec::new(); jobs.len()], 1);
        while !b.is_idle() || next < jobs.len() {
            while next < jobs.len() && out[0].len() >= 4 && b.can_admit(&jobs[next]) {
                b.admit(next as u64, jobs[next].clone()).unwrap();
                next += 1;
            }
            for e in b.step().unwrap() {
                out[e.id as usize].push(e.token);
            }
        }
        tokens.push(out);
        runs.push(b.runs.clone());
    }
    let count = |r: &std::collections::BTreeMap<String, u64>, g: &str| r.get(g).copied();
    let (free, paced) = (&runs[0], &runs[1]);
    assert!(
        count(paced, &small).unwrap_or(0) > count(free, &small).unwrap_or(0) + 10
            && count(paced, &large) < count(free, &large),
        "{name}: the paced prompts take the small chunk: {free:?} against {paced:?}"
    );
    for (i, job) in jobs.iter().enumerate() {
        assert_eq!(tokens[0][i].len(), job.max_new, "{name}: sequence {i}");
        assert_eq!(tokens[1][i], tokens[0][i], "{name}: sequence {i}, paced");
    }
    println!("ok: {name}: paced chunks keep the tokens ({free:?} against {paced:?})");
}

/// `kiln compile` flags of an artifact [`assert_sequences_wait_for_blocks`] takes: decode
/// batches of 1 and 4, a context of 64, a paged cache of 17 blocks of 4 keys (16 usable).
pub const SMALL_POOL_ARTIFACT: [&str; 12] = [
    "--buckets",
    "16",
    "--batch-buckets",
    "1,4",
    "--max-context",
    "64",
    "--prefill-chunk",
    "8",
    "--kv-block-size",
    "4",
    "--kv-blocks",
    "17",
];

/// Over a paged cache smaller than every row at full context (`art` compiled with
/// [`SMALL_POOL_ARTIFACT`]; a sequence of 12 prompt and 12 new tokens needs 6 of its 16 blocks):
/// with rows free, a sequence that cannot be promised its blocks waits and joins when one
/// leaves; the blocks held never exceed the pool and all come back; each sequence gets the
/// tokens it gets alone, but sequence 1, retired after its 5th token, which gets no more. With
/// `launch_ahead` ([`kiln_runtime::batcher::Batcher::with_launch_ahead`]) the same, and
/// returns how many steps were launched ahead.
pub fn assert_sequences_wait_for_blocks(
    art: &kiln_runtime::Artifact,
    exec: &mut kiln_runtime::Executor,
    launch_ahead: bool,
) -> u64 {
    use kiln_runtime::batcher::{Batcher, Job};
    use kiln_runtime::generate::{generate, Sampling};
    let p = art.manifest.memory.paging.expect("a paged cache");
    assert_eq!(
        (p.block_tokens, p.blocks, p.rows, p.entries),
        (4, 17, 4, 16)
    );
    let prompts: Vec<Vec<i64>> = (0..4)
        .map(|i| (0..12).map(|t| (t * 37 + i * 101) % 500 + 1).collect())
        .collect();
    let alone: Vec<Vec<i64>> = prompts
        .iter()
        .map(|p| generate(art, exec, p, 12, &Sampling::greedy()).unwrap())
        .collect();
    let job = |i: usize| Job {
        prompt: prompts[i].clone(),
        max_new: 12,
        sampling: Sampling::greedy(),
    };
    let mut b = Batcher::new(art, exec)
        .unwrap()
        .with_launch_ahead(launch_ahead);
    assert_eq!(b.kv_blocks(), Some((0, 16)));
    let (mut out, mut next, mut most, mut waited) = (vec![Vec::new(); 4], 0, 0, false);
    while !b.is_idle() || next < 4 {
        while next < 4 && b.can_admit(&job(next)) {
            b.admit(next as u64, job(next)).unwrap();
            next += 1;
        }
        waited |= next < 4 && b.active() < b.capacity();
        for e in b.step().unwrap() {
            out[e.id as usize].push(e.token);
            if e.id == 1 && out[1].len() == 5 {
                assert!(b.retire(1).unwrap(), "sequence 1 is running");
            }
        }
        assert!(b.kv_blocks().unwrap().0 <= 16);
        most = most.max(b.active());
    }
    assert!(waited, "a sequence waited for blocks with rows free");
    assert_eq!(most, 2, "two sequences of 6 blocks fit 16 blocks");
    assert_eq!(b.kv_blocks(), Some((0, 16)), "every block came back");
    let launched = b.launched_ahead;
    assert_eq!(
        out[1],
        alone[1][..5],
        "sequence 1 gets nothing after it left"
    );
    out[1] = alone[1].clone();
    assert_eq!(out, alone);
    launched
}

/// Gives every row of `art`'s paged cache blocks of its own for the whole context (the default
/// pool holds them) in `exec`'s block table, for a caller that runs decode buckets itself rather
/// than through a `Batcher` (which hands blocks out); nothing for a dense cache.
pub fn give_rows_whole_contexts(art: &kiln_runtime::Artifact, exec: &mut kiln_runtime::Executor) {
    let Some(p) = art.manifest.memory.paging else {
        return;
    };
    assert!(
        p.blocks > p.rows * p.entries,
        "the pool holds every row's context"
    );
    let table: Vec<u32> = (0..p.rows * p.entries).map(|i| i as u32 + 1).collect();
    exec.write_block_table(&table).unwrap();
}
