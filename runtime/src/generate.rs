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
    let (mut out, seconds) = generate_batch(art, exec, &[prompt.to_vec()], max_new, sampling)?;
    Ok((out.pop().unwrap_or_default(), seconds))
}

/// Generates `max_new` tokens after each of `prompts`, decoded together through the smallest
/// decode bucket whose batch holds them all (row `i` is sequence `i`; rows beyond them are
/// masked, so they write nothing). Each prompt enters the cache alone (through the batch-1 chunk
/// bucket into row 0, then copied to its row; one token per batched step without a chunk
/// bucket), so each sequence gets what it gets alone: the same tokens under the same sampling.
/// Also returns the seconds spent in batched decode steps.
pub fn generate_batch(
    art: &Artifact,
    exec: &mut Executor,
    prompts: &[Vec<i64>],
    max_new: usize,
    sampling: &Sampling,
) -> Result<(Vec<Vec<i64>>, f64), RuntimeError> {
    sampling.validate()?;
    let m = &art.manifest;
    if !m.model.decoder {
        return Err(RuntimeError::Request(format!(
            "{} is an encoder; generate needs a decoder",
            m.architecture
        )));
    }
    if prompts.is_empty() {
        return Err(RuntimeError::Request("no prompt to generate from".into()));
    }
    // Decode steps run the one-token bucket of the smallest batch that holds every sequence; a
    // prompt enters through the chunk bucket (batch 1, several tokens) when the artifact has one.
    let steps = m.decode.iter().filter(|e| e.seq == 1);
    let largest = steps
        .clone()
        .map(|e| e.batch)
        .max()
        .ok_or_else(|| RuntimeError::Request("the artifact has no decode bucket".into()))?;
    let bucket = steps
        .filter(|e| e.batch >= prompts.len())
        .min_by_key(|e| e.batch)
        .ok_or_else(|| {
            RuntimeError::Request(format!(
                "{} prompts exceed the largest decode batch, {largest}",
                prompts.len()
            ))
        })?;
    let chunk = m
        .decode
        .iter()
        .filter(|e| e.seq > 1 && e.batch == 1)
        .max_by_key(|e| e.seq);
    let context = bucket.context.unwrap_or(0);
    for (i, prompt) in prompts.iter().enumerate() {
        check_prompt(prompt, max_new, context, m.model.vocab_size)
            .map_err(|e| prompt_error(e, i, prompts.len()))?;
    }
    if max_new == 0 {
        return Ok((vec![Vec::new(); prompts.len()], 0.0));
    }
    let mut run = Session::new(art, exec, bucket, context)?;
    // Each prompt but its last token fills the cache, chunk by chunk or one token per step (no
    // logits: the chunk bucket has none); the last tokens go through one decode step, whose
    // logits (one row each through the LM head) choose the first new tokens.
    let started = std::time::Instant::now();
    let heads: Vec<&[i64]> = prompts.iter().map(|p| &p[..p.len() - 1]).collect();
    match chunk {
        Some(c) => {
            // Row 0 takes each prompt in turn and hands it to its row; sequence 0 stays there.
            for (row, head) in heads.iter().enumerate().rev() {
                for (i, part) in head.chunks(c.seq).enumerate() {
                    run.fill(c, &[Row::new(part, i * c.seq)])?;
                }
                if row > 0 {
                    run.copy_row(0, row)?;
                }
            }
        }
        None => {
            let longest = heads.iter().map(|h| h.len()).max().unwrap_or(0);
            for pos in 0..longest {
                let rows: Vec<Row> = heads
                    .iter()
                    .map(|h| Row::new(h.get(pos..=pos).unwrap_or(&[]), pos))
                    .collect();
                run.fill(bucket, &rows)?;
            }
        }
    }
    let lasts: Vec<Row> = prompts
        .iter()
        .map(|p| Row::new(&p[p.len() - 1..], p.len() - 1))
        .collect();
    let mut next = run.next(bucket, &lasts, sampling, 0)?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        sequences = prompts.len(),
        "prompts in the cache, first tokens"
    );
    let mut out = vec![Vec::with_capacity(max_new); prompts.len()];
    let mut decode_seconds = 0.0;
    for i in 0..max_new {
        for (tokens, token) in out.iter_mut().zip(&next) {
            tokens.push(*token as i64);
        }
        if i + 1 < max_new {
            let start = std::time::Instant::now();
            let rows: Vec<Row> = out
                .iter()
                .zip(prompts)
                .map(|(t, p)| Row::new(&t[i..=i], p.len() + i))
                .collect();
            next = run.next(bucket, &rows, sampling, i as u32 + 1)?;
            decode_seconds += start.elapsed().as_secs_f64();
        }
    }
    tracing::info!(
        seconds = decode_seconds,
        steps = max_new.saturating_sub(1),
        sequences = prompts.len(),
        "decode steps"
    );
    Ok((out, decode_seconds))
}

/// `Err` naming what is wrong with `prompt`: empty, a token outside the vocabulary, or too long
/// for the compiled context with `max_new` tokens after it.
fn check_prompt(
    prompt: &[i64],
    max_new: usize,
    context: usize,
    vocab: usize,
) -> Result<(), String> {
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    if prompt.len() + max_new > context {
        return Err(format!(
            "prompt ({}) plus new tokens ({max_new}) exceed the compiled context of {context}",
            prompt.len()
        ));
    }
    match prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        Some(bad) => Err(format!(
            "prompt token {bad} is out of range for vocab size {vocab}"
        )),
        None => Ok(()),
    }
}

/// A request error for prompt `i` of `n` (named when there are several).
fn prompt_error(message: String, i: usize, n: usize) -> RuntimeError {
    if n > 1 {
        RuntimeError::Request(format!("prompt {}: {message}", i + 1))
    } else {
        RuntimeError::Request(message)
    }
}

/// One batch row of a cached step: its tokens, from position `start` on.
struct Row<'t> {
    tokens: &'t [i64],
    start: usize,
}

impl<'t> Row<'t> {
    fn new(tokens: &'t [i64], start: usize) -> Row<'t> {
        Row { tokens, start }
    }
}

/// A step's logits: the bucket's whole output, and where each sequence's row starts in it.
struct Logits {
    values: Vec<f32>,
    starts: Vec<usize>,
    vocab: usize,
}

impl Logits {
    /// Sequence `i`'s row.
    fn row(&self, i: usize) -> &[f32] {
        &self.values[self.starts[i]..self.starts[i] + self.vocab]
    }
}

/// One generation's state: the executor and (for the interpreter) the KV cache tensors.
struct Session<'a> {
    art: &'a Artifact,
    exec: &'a mut Executor,
    caches: BTreeMap<String, Tensor>,
    vocab: usize,
    context: usize,
}

impl<'a> Session<'a> {
    /// An empty cache for the decode bucket `bucket`'s graphs: the executor's own, or tensors
    /// passed along (the interpreter).
    fn new(
        art: &'a Artifact,
        exec: &'a mut Executor,
        bucket: &BucketEntry,
        context: usize,
    ) -> Result<Session<'a>, RuntimeError> {
        exec.reset_cache()?;
        let mut caches = BTreeMap::new();
        if !exec.keeps_cache() {
            // The largest decode batch's cache, as the executors' cache regions hold it.
            let rows = art
                .manifest
                .decode
                .iter()
                .map(|e| e.batch)
                .max()
                .unwrap_or(1);
            let graph: &Graph = &art.graphs[&bucket.graph];
            caches = graph
                .inputs()
                .filter(|(_, n, _)| n.starts_with("past_"))
                .map(|(_, n, ty)| {
                    let mut shape: Vec<usize> = ty
                        .shape
                        .iter()
                        .map(|d| d.as_const().unwrap_or(0) as usize)
                        .collect();
                    shape[0] = rows;
                    let n_el = shape.iter().product();
                    (
                        n.to_string(),
                        Tensor::f32(shape, vec![0.0; n_el]).cast(ty.dtype),
                    )
                })
                .collect();
        }
        Ok(Session {
            art,
            exec,
            caches,
            vocab: art.manifest.model.vocab_size,
            context,
        })
    }

    /// Runs `rows` through the KV-cached bucket `entry` and returns the token `sampling` picks
    /// after each row's last one at generation step `step`: greedy tokens chosen on the device
    /// where the executor does (only their ids come back), else chosen from the logits.
    fn next(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
        sampling: &Sampling,
        step: u32,
    ) -> Result<Vec<usize>, RuntimeError> {
        let inputs = self.inputs(entry, rows);
        if sampling.temperature <= 0.0 && rows.iter().all(|r| r.tokens.len() == 1) {
            if let Some(tokens) = self.exec.run_greedy(entry, &inputs)? {
                return chosen(&tokens, rows.len(), self.vocab);
            }
        }
        let logits = self.step(entry, rows, inputs)?;
        (0..rows.len())
            .map(|r| self.exec.choose(logits.row(r), sampling, step))
            .collect()
    }

    /// Runs `inputs` (of `rows`, see [`Session::inputs`]) through the KV-cached bucket `entry`
    /// and returns the logits of each row's last token.
    fn step(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
        inputs: BTreeMap<String, Tensor>,
    ) -> Result<Logits, RuntimeError> {
        let mut outputs = self.run(entry, &inputs)?;
        let Some(Data::Float(values)) = outputs.remove("logits").map(|t| t.data) else {
            return Err(RuntimeError::Request(
                "the decode graph has no float logits".into(),
            ));
        };
        let starts = rows
            .iter()
            .enumerate()
            .map(|(r, row)| (r * entry.seq + row.tokens.len() - 1) * self.vocab)
            .collect();
        Ok(Logits {
            values,
            starts,
            vocab: self.vocab,
        })
    }

    /// Runs `rows` (row `r` of the bucket: its tokens at positions `start..`) through the
    /// KV-cached bucket `entry`, so that their keys and values enter the cache; a row's tail
    /// past its tokens, and the bucket's rows past `rows`, are masked, so nothing of them reaches
    /// the cache. Returns the bucket's other outputs.
    fn fill(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let inputs = self.inputs(entry, rows);
        self.run(entry, &inputs)
    }

    /// Runs `inputs` through the KV-cached bucket `entry`, keeps the updated caches the caller
    /// keeps, and returns the bucket's other outputs.
    fn run(
        &mut self,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let mut outputs = self.exec.run(self.art, entry, inputs)?;
        let b = entry.batch;
        for (name, cache) in self.caches.iter_mut() {
            let present = outputs
                .remove(&name.replacen("past_", "present_", 1))
                .ok_or_else(|| {
                    RuntimeError::Request(format!("the decode graph lacks an output for {name}"))
                })?;
            let n = leading_rows(cache, b);
            if let (Data::Float(all), Data::Float(new)) = (&mut cache.data, &present.data) {
                all[..n].copy_from_slice(&new[..n]);
            }
        }
        Ok(outputs)
    }

    /// The inputs of the KV-cached bucket `entry` for `rows` (see [`Session::fill`]): token ids,
    /// the mask of each row's tokens, positions, and the caches the caller keeps.
    fn inputs(&self, entry: &BucketEntry, rows: &[Row]) -> BTreeMap<String, Tensor> {
        let (b, s) = (entry.batch, entry.seq);
        let last = self.context.saturating_sub(1);
        let grid = |f: &dyn Fn(&Row, usize) -> i64| -> Vec<i64> {
            let empty = Row::new(&[], 0);
            (0..b)
                .flat_map(|r| {
                    let row = rows.get(r).unwrap_or(&empty);
                    (0..s).map(move |i| f(row, i)).collect::<Vec<_>>()
                })
                .collect()
        };
        let mut inputs = BTreeMap::from([
            (
                "input_ids".to_string(),
                Tensor::i64(
                    vec![b, s],
                    grid(&|row, i| row.tokens.get(i).copied().unwrap_or(0)),
                ),
            ),
            (
                "attention_mask".to_string(),
                Tensor::i64(vec![b, s], grid(&|row, i| i64::from(i < row.tokens.len()))),
            ),
            (
                "position_ids".to_string(),
                Tensor::i64(vec![b, s], grid(&|row, i| (row.start + i).min(last) as i64)),
            ),
        ]);
        for (name, cache) in &self.caches {
            let mut part = cache.clone();
            if let Data::Float(v) = &mut part.data {
                v.truncate(leading_rows(cache, b));
            }
            part.shape[0] = b;
            inputs.insert(name.clone(), part);
        }
        inputs
    }

    /// Copies cache row `from` to row `to`.
    fn copy_row(&mut self, from: usize, to: usize) -> Result<(), RuntimeError> {
        if self.exec.keeps_cache() {
            return self.exec.copy_cache_row(from, to);
        }
        for cache in self.caches.values_mut() {
            let row = cache.numel() / cache.shape[0].max(1);
            if let Data::Float(v) = &mut cache.data {
                v.copy_within(from * row..(from + 1) * row, to * row);
            }
        }
        Ok(())
    }
}

/// The first `n` of the token ids a decode step chose on the device, checked against the
/// vocabulary.
fn chosen(tokens: &[i64], n: usize, vocab: usize) -> Result<Vec<usize>, RuntimeError> {
    let tokens = tokens.get(..n).ok_or_else(|| {
        RuntimeError::Device(format!(
            "the decode step chose {} tokens for {n} sequences",
            tokens.len()
        ))
    })?;
    tokens
        .iter()
        .map(|&t| {
            usize::try_from(t)
                .ok()
                .filter(|&t| t < vocab)
                .ok_or_else(|| {
                    RuntimeError::Device(format!(
                        "the device chose token {t}, outside the vocabulary"
                    ))
                })
        })
        .collect()
}

/// Elements of `cache`'s leading `rows` rows: caches are kept for the largest decode batch, and
/// a bucket of fewer rows reads and updates the leading ones, as the executors' cache regions do.
fn leading_rows(cache: &Tensor, rows: usize) -> usize {
    cache.numel() / cache.shape[0].max(1) * rows
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
