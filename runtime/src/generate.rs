//! Token generation through the artifact's decode graph and its KV cache: the prompt enters the
//! cache one token per step (chunked prefill with a chunk of one, through the same captured-size
//! graph), then each step appends the chosen token. The context can never exceed the compiled
//! capacity; asking for more is an error before anything runs.

use std::collections::BTreeMap;

use kiln_ir::philox::{philox4x32_10, seed_key};
use kiln_ir::{Graph, Tensor};

use crate::{Artifact, Executor, RuntimeError};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 picks the largest logit (greedy); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties kept); 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of largest logits whose mass reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Seed of the Philox stream the uniforms come from (step `i` uses counter `(i, 0, 0, 0)`).
    pub seed: i64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Generates `max_new` tokens after `prompt` (batch 1) on `exec`.
pub fn generate(
    art: &Artifact,
    exec: &mut Executor,
    prompt: &[i64],
    max_new: usize,
    sampling: &Sampling,
) -> Result<Vec<i64>, RuntimeError> {
    let m = &art.manifest;
    if !m.model.decoder {
        return Err(RuntimeError::Request(format!(
            "{} is an encoder; generate needs a decoder",
            m.architecture
        )));
    }
    let bucket = m
        .decode
        .iter()
        .min_by_key(|e| e.batch)
        .ok_or_else(|| RuntimeError::Request("the artifact has no decode bucket".into()))?;
    let context = bucket.context.unwrap_or(0);
    if prompt.is_empty() {
        return Err(RuntimeError::Request("the prompt is empty".into()));
    }
    if prompt.len() + max_new > context {
        return Err(RuntimeError::Request(format!(
            "prompt ({}) plus new tokens ({max_new}) exceed the compiled context of {context}",
            prompt.len()
        )));
    }
    if let Some(&bad) = prompt
        .iter()
        .find(|&&t| t < 0 || t as usize >= m.model.vocab_size)
    {
        return Err(RuntimeError::Request(format!(
            "prompt token {bad} is out of range for vocab size {}",
            m.model.vocab_size
        )));
    }
    let graph: &Graph = &art.graphs[&bucket.graph];
    let b = bucket.batch;
    // The executor keeps its own cache (on the device), or the cache is passed along here.
    exec.reset_cache()?;
    let keep = exec.keeps_cache();
    let mut caches: BTreeMap<String, Tensor> = graph
        .inputs()
        .filter(|(_, n, _)| n.starts_with("past_") && !keep)
        .map(|(_, n, ty)| {
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| d.as_const().unwrap_or(0) as usize)
                .collect();
            let n_el = shape.iter().product();
            (
                n.to_string(),
                Tensor::f32(shape, vec![0.0; n_el]).cast(ty.dtype),
            )
        })
        .collect();
    let mut out = Vec::with_capacity(max_new);
    let mut next = prompt[0];
    for step in 0..prompt.len() + max_new - 1 {
        // Row 0 carries the sequence; other rows of the bucket repeat it (their results are unused).
        let mut inputs = BTreeMap::from([
            (
                "input_ids".to_string(),
                Tensor::i64(vec![b, 1], vec![next; b]),
            ),
            (
                "attention_mask".to_string(),
                Tensor::i64(vec![b, 1], vec![1; b]),
            ),
            (
                "position_ids".to_string(),
                Tensor::i64(vec![b, 1], vec![step as i64; b]),
            ),
        ]);
        inputs.extend(caches.clone());
        let mut outputs = exec.run(art, bucket, &inputs)?;
        for (name, cache) in caches.iter_mut() {
            *cache = outputs
                .remove(&name.replacen("past_", "present_", 1))
                .ok_or_else(|| {
                    RuntimeError::Request(format!("the decode graph lacks an output for {name}"))
                })?;
        }
        if step + 1 < prompt.len() {
            next = prompt[step + 1];
            continue;
        }
        let logits = outputs["logits"].as_f32().unwrap_or_default();
        let row = &logits[..m.model.vocab_size];
        next = choose(row, sampling, out.len() as u32) as i64;
        out.push(next);
    }
    Ok(out)
}

/// The token for `logits` under `sampling` (the semantics of the GPU sampling kernel).
pub fn choose(logits: &[f32], sampling: &Sampling, step: u32) -> usize {
    if sampling.temperature <= 0.0 {
        return logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0;
    }
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - f64::from(m)) / f64::from(sampling.temperature)).exp())
        .collect();
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = sampling.top_k;
    let t_k = if k == 0 || k >= logits.len() {
        f32::NEG_INFINITY
    } else {
        sorted[k - 1]
    };
    let mass = |t: f32| -> f64 {
        logits
            .iter()
            .zip(&w)
            .filter(|(x, _)| **x >= t)
            .map(|(_, w)| w)
            .sum()
    };
    let z_k = mass(t_k);
    let mut t = t_k;
    if sampling.top_p < 1.0 {
        for &cand in sorted.iter().filter(|c| **c >= t_k) {
            if mass(cand) >= f64::from(sampling.top_p) * z_k {
                t = cand;
                break;
            }
        }
    }
    let z = mass(t);
    let word = philox4x32_10([step, 0, 0, 0], seed_key(sampling.seed))[0];
    let target = f64::from(word) / 4_294_967_296.0 * z;
    let mut running = 0.0;
    let mut last = 0;
    for (i, (x, wi)) in logits.iter().zip(&w).enumerate() {
        if *x < t {
            continue;
        }
        running += wi;
        last = i;
        if running > target {
            return i;
        }
    }
    last
}
