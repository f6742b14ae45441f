//! The KV-cached decoder graphs: a prefill that fills the cache followed by one-token decode steps
//! through the fused decode buckets reproduces the reference greedy continuation, and a batch of
//! rows at different lengths decodes each row as it would alone.

use std::collections::BTreeMap;

use kiln_compiler::bucket::BucketPlan;
use kiln_compiler::compile::{compile, CompileOptions, Compiled};
use kiln_compiler::fusion::cost::KernelKind;
use kiln_ir::{Graph, Tensor};
use kiln_models::inputs::TokenBatch;
use kiln_models::{ImportOptions, Model};
use kiln_tests::{argmax, fixture, floats, reference, rel_err};

const CONTEXT: usize = 64;
const VOCAB: usize = 512;

struct Decoder {
    cached: Model,
    compiled: Compiled,
    report: kiln_compiler::compile::CompileReport,
}

fn decoder(name: &str, batch: &[usize]) -> Decoder {
    let plain = kiln_models::import(&fixture(name)).unwrap();
    let options = ImportOptions {
        kv_cache: true,
        ..ImportOptions::default()
    };
    let cached = kiln_models::import_with(&fixture(name), &options).unwrap();
    let opts = CompileOptions {
        max_context: Some(CONTEXT),
        ..CompileOptions::prefill(BucketPlan::new(vec![16], batch.to_vec()).unwrap())
    };
    let (report, compiled) = compile(&plain.graph, Some(&cached.graph), &opts).unwrap();
    Decoder {
        cached,
        compiled,
        report,
    }
}

/// Empty caches for every `past_*` input of `graph` (specialised to batch `b`, context CONTEXT).
fn empty_caches(graph: &Graph, b: usize) -> BTreeMap<String, Tensor> {
    graph
        .inputs()
        .filter(|(_, n, _)| n.starts_with("past_"))
        .map(|(_, n, ty)| {
            let kvh = ty.shape[1].as_const().unwrap() as usize;
            let d = ty.shape[3].as_const().unwrap() as usize;
            (
                n.to_string(),
                Tensor::f32(vec![b, kvh, CONTEXT, d], vec![0.0; b * kvh * CONTEXT * d]),
            )
        })
        .collect()
}

/// Runs one step of a cached graph: rows of tokens (right-padded) starting at `starts`.
fn step(
    graph: &Graph,
    model: &Model,
    rows: &[Vec<i64>],
    starts: &[i64],
    caches: &mut BTreeMap<String, Tensor>,
) -> Vec<Vec<f32>> {
    let s = rows.iter().map(Vec::len).max().unwrap();
    let b = rows.len();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    let mut pos = Vec::new();
    for (row, start) in rows.iter().zip(starts) {
        for t in 0..s {
            ids.push(*row.get(t).unwrap_or(&0));
            mask.push(i64::from(t < row.len()));
            pos.push(start + t.min(row.len() - 1) as i64);
        }
    }
    let mut inputs = BTreeMap::from([
        ("input_ids".to_string(), Tensor::i64(vec![b, s], ids)),
        ("attention_mask".to_string(), Tensor::i64(vec![b, s], mask)),
        ("position_ids".to_string(), Tensor::i64(vec![b, s], pos)),
    ]);
    inputs.extend(caches.clone());
    let bindings = BTreeMap::from([
        ("B".to_string(), b as i64),
        ("S".to_string(), s as i64),
        ("T".to_string(), CONTEXT as i64),
    ]);
    let fixed = graph.specialize(&bindings).unwrap();
    let mut out = kiln_ir::evaluate(&fixed, &inputs, &model.checkpoint).unwrap();
    for (name, cache) in caches.iter_mut() {
        *cache = out
            .remove(&name.replacen("past_", "present_", 1))
            .expect("a present_* output");
    }
    let logits = floats(&out["logits"]);
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let at = (i * s + row.len() - 1) * VOCAB;
            logits[at..at + VOCAB].to_vec()
        })
        .collect()
}

#[test]
fn cached_prefill_then_fused_decode_reproduces_greedy_tokens() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let reference = reference(name);
        let d = decoder(name, &[1]);
        let prompt = reference["greedy_prompt"].as_i64().unwrap().to_vec();
        let want = reference["greedy_tokens"].as_i64().unwrap().to_vec();
        let decode = &d.compiled.decode[0].graph;
        let mut caches = empty_caches(decode, 1);
        let logits = step(
            &d.cached.graph,
            &d.cached,
            std::slice::from_ref(&prompt),
            &[0],
            &mut caches,
        );
        let mut got = vec![argmax(&logits[0]) as i64];
        let mut len = prompt.len() as i64;
        while got.len() < want.len() {
            let last = *got.last().unwrap();
            let logits = step(decode, &d.cached, &[vec![last]], &[len], &mut caches);
            got.push(argmax(&logits[0]) as i64);
            len += 1;
        }
        assert_eq!(
            got, want,
            "{name}: greedy continuation through the KV cache"
        );
    }
}

#[test]
fn batched_decode_serves_rows_of_different_lengths() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let reference = reference(name);
        let plain = kiln_models::import(&fixture(name)).unwrap();
        let d = decoder(name, &[2]);
        let a = reference["batch_a"].as_i64().unwrap().to_vec();
        let b = reference["batch_b"].as_i64().unwrap().to_vec();
        let decode = &d.compiled.decode[0].graph;
        let mut caches = empty_caches(decode, 2);
        let prefill = step(
            &d.cached.graph,
            &d.cached,
            &[a.clone(), b.clone()],
            &[0, 0],
            &mut caches,
        );
        for (logits, key) in prefill
            .iter()
            .zip(["batch_a_last_logits", "batch_b_last_logits"])
        {
            let err = rel_err(logits, floats(&reference[key]));
            assert!(err < 1e-4, "{name} {key}: relative error {err:e}");
        }
        let next: Vec<i64> = prefill.iter().map(|l| argmax(l) as i64).collect();
        let starts = [a.len() as i64, b.len() as i64];
        let decoded = step(
            decode,
            &d.cached,
            &[vec![next[0]], vec![next[1]]],
            &starts,
            &mut caches,
        );
        for (row, prompt) in [a, b].into_iter().enumerate() {
            let mut alone = prompt.clone();
            alone.push(next[row]);
            let out = plain
                .evaluate(&TokenBatch::unmasked(vec![alone.clone()]))
                .unwrap();
            let want = &floats(&out["logits"])[(alone.len() - 1) * VOCAB..];
            let err = rel_err(&decoded[row], want);
            assert!(
                err < 1e-4,
                "{name} row {row}: decode step relative error {err:e}"
            );
        }
    }
}

#[test]
fn decode_buckets_have_one_decode_attention_per_layer() {
    for (name, layers) in [("gpt2-tiny", 2), ("llama-tiny", 2)] {
        let d = decoder(name, &[1, 4]);
        assert_eq!(d.report.decode_buckets.len(), 2);
        for b in &d.report.decode_buckets {
            assert_eq!(b.context, Some(CONTEXT));
            let count = |kind| b.kernels.iter().filter(|k| k.kind == kind).count();
            assert_eq!(count(KernelKind::DecodeAttention), layers, "{name}");
            assert_eq!(count(KernelKind::Attention), 0, "{name}");
            assert!(
                b.kernels.iter().all(|k| !k.name.starts_with("softmax")),
                "{name}"
            );
        }
    }
}
