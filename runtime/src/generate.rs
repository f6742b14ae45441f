//! Token generation through the artifact's KV-cached graphs: the prompt but its last token enters
//! the cache chunk by chunk through the chunk bucket (batch 1, `--prefill-chunk` tokens, the last
//! chunk's tail masked; it computes no logits), or one token per step when the artifact has none;
//! the last prompt token goes through a decode step, whose logits choose the first new token, and
//! each further decode step appends the chosen token. The context can never exceed the compiled capacity; asking for more is an error
//! before anything runs.

use std::collections::BTreeMap;

use kiln_ir::artifact::BucketEntry;
use kiln_ir::philox::{philox4x32_10, seed_key};
use kiln_ir::{Data, Graph, Tensor};

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
    /// `Err` naming the parameter when `temperature` is negative or NaN, or `top_p` is outside
    /// `(0, 1]`.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        if self.temperature.is_nan() || self.temperature < 0.0 {
            return Err(RuntimeError::Request(format!(
                "temperature {} must be >= 0",
                self.temperature
            )));
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(RuntimeError::Request(format!(
                "top-p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }

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
    Ok(generate_timed(art, exec, prompt, max_new, sampling)?.0)
}

/// [`generate`], also returning the seconds spent in decode steps (every new token after the
/// first, which comes from the prompt's run).
pub fn generate_timed(
    art: &Artifact,
    exec: &mut Executor,
    prompt: &[i64],
    max_new: usize,
    sampling: &Sampling,
) -> Result<(Vec<i64>, f64), RuntimeError> {
    sampling.validate()?;
    let m = &art.manifest;
    if !m.model.decoder {
        return Err(RuntimeError::Request(format!(
            "{} is an encoder; generate needs a decoder",
            m.architecture
        )));
    }
    // Decode steps run the one-token bucket of the smallest batch; a prompt enters through the
    // chunk bucket (batch 1, several tokens) when the artifact has one.
    let bucket = m
        .decode
        .iter()
        .filter(|e| e.seq == 1)
        .min_by_key(|e| e.batch)
        .ok_or_else(|| RuntimeError::Request("the artifact has no decode bucket".into()))?;
    let chunk = m
        .decode
        .iter()
        .filter(|e| e.seq > 1 && e.batch == 1)
        .max_by_key(|e| e.seq);
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
    if max_new == 0 {
        return Ok((Vec::new(), 0.0));
    }
    // The executor keeps its own cache (on the device), or the cache is passed along here.
    exec.reset_cache()?;
    let mut run = Session {
        art,
        exec,
        caches: BTreeMap::new(),
        vocab: m.model.vocab_size,
        context,
    };
    if !run.exec.keeps_cache() {
        let graph: &Graph = &art.graphs[&bucket.graph];
        run.caches = graph
            .inputs()
            .filter(|(_, n, _)| n.starts_with("past_"))
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
    }
    // The prompt but its last token fills the cache, chunk by chunk or one token per step (no
    // logits: the chunk bucket has none); the last token goes through a decode step, whose logits
    // (one row through the LM head) choose the first new token.
    let started = std::time::Instant::now();
    let (head, last) = prompt.split_at(prompt.len() - 1);
    match chunk {
        Some(c) => {
            for (i, part) in head.chunks(c.seq).enumerate() {
                run.fill(c, part, i * c.seq)?;
            }
        }
        None => {
            for (pos, &t) in head.iter().enumerate() {
                run.fill(bucket, &[t], pos)?;
            }
        }
    }
    let mut logits = run.step(bucket, last, head.len())?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        tokens = prompt.len(),
        "prompt in the cache, first logits"
    );
    let mut out = Vec::with_capacity(max_new);
    let mut decode_seconds = 0.0;
    for i in 0..max_new {
        let next = run.exec.choose(&logits, sampling, i as u32)? as i64;
        out.push(next);
        if i + 1 < max_new {
            let start = std::time::Instant::now();
            logits = run.step(bucket, &[next], prompt.len() + i)?;
            decode_seconds += start.elapsed().as_secs_f64();
        }
    }
    tracing::info!(
        seconds = decode_seconds,
        steps = max_new.saturating_sub(1),
        "decode steps"
    );
    Ok((out, decode_seconds))
}

/// One generation's state: the executor and (for the interpreter) the KV cache tensors.
struct Session<'a> {
    art: &'a Artifact,
    exec: &'a mut Executor,
    caches: BTreeMap<String, Tensor>,
    vocab: usize,
    context: usize,
}

impl Session<'_> {
    /// Runs `tokens` (at positions `start..`) through the KV-cached bucket `entry` and returns
    /// the logits of the last token.
    fn step(
        &mut self,
        entry: &BucketEntry,
        tokens: &[i64],
        start: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        let outputs = self.fill(entry, tokens, start)?;
        let logits = outputs
            .get("logits")
            .and_then(|t| t.as_f32())
            .ok_or_else(|| RuntimeError::Request("the decode graph has no logits".into()))?;
        let at = (tokens.len() - 1) * self.vocab;
        Ok(logits[at..at + self.vocab].to_vec())
    }

    /// Runs `tokens` (at positions `start..`) through the KV-cached bucket `entry` in row 0 (the
    /// bucket's other rows repeat it, their results unused), so that their keys and values enter
    /// the cache; the tail of a chunk is masked, so nothing of it reaches the cache. Returns the
    /// bucket's other outputs.
    fn fill(
        &mut self,
        entry: &BucketEntry,
        tokens: &[i64],
        start: usize,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let (b, s) = (entry.batch, entry.seq);
        let row = |f: &dyn Fn(usize) -> i64| -> Vec<i64> {
            let one: Vec<i64> = (0..s).map(f).collect();
            one.repeat(b)
        };
        let last = self.context.saturating_sub(1);
        let mut inputs = BTreeMap::from([
            (
                "input_ids".to_string(),
                Tensor::i64(vec![b, s], row(&|i| tokens.get(i).copied().unwrap_or(0))),
            ),
            (
                "attention_mask".to_string(),
                Tensor::i64(vec![b, s], row(&|i| i64::from(i < tokens.len()))),
            ),
            (
                "position_ids".to_string(),
                Tensor::i64(vec![b, s], row(&|i| (start + i).min(last) as i64)),
            ),
        ]);
        // Caches are kept for the decode bucket's batch; a bucket of fewer rows (the prompt chunk's
        // batch 1) reads and updates the leading ones, as the executors' cache regions do.
        let rows = |t: &Tensor| t.numel() / t.shape[0].max(1) * b;
        for (name, cache) in &self.caches {
            let mut part = cache.clone();
            if let Data::Float(v) = &mut part.data {
                v.truncate(rows(cache));
            }
            part.shape[0] = b;
            inputs.insert(name.clone(), part);
        }
        let mut outputs = self.exec.run(self.art, entry, &inputs)?;
        for (name, cache) in self.caches.iter_mut() {
            let present = outputs
                .remove(&name.replacen("past_", "present_", 1))
                .ok_or_else(|| {
                    RuntimeError::Request(format!("the decode graph lacks an output for {name}"))
                })?;
            let n = rows(cache);
            if let (Data::Float(all), Data::Float(new)) = (&mut cache.data, &present.data) {
                all[..n].copy_from_slice(&new[..n]);
            }
        }
        Ok(outputs)
    }
}

/// Step `step`'s uniform in `[0, 1)`: the first word of Philox-4x32-10 at counter
/// `(step, 0, 0, 0)` under the seed's key, over 2^32.
pub fn uniform(sampling: &Sampling, step: u32) -> f64 {
    let word = philox4x32_10([step, 0, 0, 0], seed_key(sampling.seed))[0];
    f64::from(word) / 4_294_967_296.0
}

/// The token for `logits` under `sampling` (the semantics of the GPU sampling kernel and of the
/// generated CPU sampler, `kiln_kernels::cpu::sampling`; executors with a generated sampler use
/// it through [`Executor::choose`]).
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
    let target = uniform(sampling, step) * z;
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
