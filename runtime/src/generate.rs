//! Token generation through the artifact's KV-cached graphs ([`crate::batcher`] runs the steps):
//! each prompt but its last token enters the cache chunk by chunk through the chunk bucket (batch
//! 1, `--prefill-chunk` tokens, the last chunk's tail masked; it computes no logits), or one token
//! per step when the artifact has none; the last prompt token goes through a decode step, whose
//! logits choose the first new token, and each further decode step appends the chosen token. The
//! context can never exceed the compiled capacity; asking for more is an error before anything
//! runs. Token choice ([`choose`]) has one definition, which the generated samplers follow.

use kiln_ir::philox::{philox4x32_10, seed_key};

use crate::batcher::{Batcher, Job, SeqId};
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

/// Generates `max_new` tokens after each of `prompts`, decoded together (a [`Batcher`] over the
/// artifact's decode buckets; at most the largest decode batch of prompts): each sequence gets
/// what it gets alone, the same tokens under the same sampling. Also returns the seconds spent in
/// decode steps in which every sequence was past its prompt.
pub fn generate_batch(
    art: &Artifact,
    exec: &mut Executor,
    prompts: &[Vec<i64>],
    max_new: usize,
    sampling: &Sampling,
) -> Result<(Vec<Vec<i64>>, f64), RuntimeError> {
    sampling.validate()?;
    if prompts.is_empty() {
        return Err(RuntimeError::Request("no prompt to generate from".into()));
    }
    let mut batcher = Batcher::new(art, exec)?.with_steps_ahead(steps_ahead());
    if prompts.len() > batcher.capacity() {
        return Err(RuntimeError::Request(format!(
            "{} prompts exceed the largest decode batch, {}",
            prompts.len(),
            batcher.capacity()
        )));
    }
    let context = batcher.context();
    for (i, prompt) in prompts.iter().enumerate() {
        check_prompt(prompt, max_new, context, art.manifest.model.vocab_size)
            .map_err(|e| prompt_error(e, i, prompts.len()))?;
    }
    let mut out = vec![Vec::with_capacity(max_new); prompts.len()];
    if max_new == 0 {
        return Ok((out, 0.0));
    }
    let started = std::time::Instant::now();
    let mut waiting = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let job = Job {
                prompt: p.clone(),
                max_new,
                sampling: *sampling,
            };
            (i as SeqId, job)
        })
        .peekable();
    loop {
        while let Some((id, job)) = waiting.next_if(|(_, job)| batcher.can_admit(job)) {
            batcher.admit(id, job)?;
        }
        if batcher.is_idle() && waiting.peek().is_none() {
            break;
        }
        for e in batcher.step()? {
            out[e.id as usize].push(e.token);
        }
    }
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        decode_seconds = batcher.decode_seconds,
        sequences = prompts.len(),
        "generated"
    );
    Ok((out, batcher.decode_seconds))
}

/// Decode steps generation chains on the device between looks at the tokens
/// ([`Batcher::with_steps_ahead`]): [`crate::cuda::MAX_STEPS`], or `KILN_STEPS_AHEAD` (1 looks at
/// every step's tokens, to measure what chaining saves).
fn steps_ahead() -> usize {
    std::env::var("KILN_STEPS_AHEAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(crate::cuda::MAX_STEPS)
}

/// `Err` naming what is wrong with `prompt`: empty, a token outside the vocabulary, or too long
/// for the compiled context with `max_new` tokens after it.
pub(crate) fn check_prompt(
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

/// The first `n` of the token ids a decode step chose on the device, checked against the
/// vocabulary.
pub(crate) fn chosen(tokens: &[i64], n: usize, vocab: usize) -> Result<Vec<usize>, RuntimeError> {
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

/// Step `step`'s uniform 32-bit word: the first word of Philox-4x32-10 at counter
/// `(step, 0, 0, 0)` under the seed's key.
pub fn uniform_word(sampling: &Sampling, step: u32) -> u32 {
    philox4x32_10([step, 0, 0, 0], seed_key(sampling.seed))[0]
}

/// A row's four 32-bit words for the device's sampler (`ExecPlan::sampler`) at step `step`:
/// temperature as f32 bits, top-k (saturated), top-p as f32 bits, and the step's uniform word.
pub fn sampler_words(sampling: &Sampling, step: u32) -> [u32; 4] {
    [
        sampling.temperature.to_bits(),
        u32::try_from(sampling.top_k).unwrap_or(u32::MAX),
        sampling.top_p.to_bits(),
        uniform_word(sampling, step),
    ]
}

/// The token for `logits` under `sampling` (the definition the generated CPU sampler,
/// `kiln_kernels::cpu::sampling`, follows bit for bit; executors with a generated sampler use it
/// through [`Executor::choose`]). Temperature 0 takes the first largest logit (NaN never wins; a
/// row without a value above -inf takes 0). Otherwise each logit weighs the integer
/// [`kiln_ir::sampling::weight`]; top-k keeps every logit `>=` the k-th largest (ties kept; 0
/// keeps all); top-p then keeps the logits `>= t` for the largest logit `t` whose kept mass
/// reaches `top_p` of the top-k mass ([`kiln_ir::sampling::reaches`]), logits ordered as their
/// keys ([`kiln_ir::sampling::ordered_key`]: float order, NaN outside it); the token is the first
/// kept index whose running mass exceeds the step's target
/// ([`kiln_ir::sampling::target`] of its Philox word), or the last kept index when no mass is
/// left. Masses are integers, so the order of the sums does not matter.
pub fn choose(logits: &[f32], sampling: &Sampling, step: u32) -> usize {
    choose_with_word(logits, sampling, uniform_word(sampling, step))
}

/// [`choose`] with the step's uniform 32-bit `word` given (what a sampler kernel is passed).
pub fn choose_with_word(logits: &[f32], sampling: &Sampling, word: u32) -> usize {
    use kiln_ir::sampling::{ordered_key, reaches, target, top_p_fixed, weight};
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
    let w: Vec<u64> = logits
        .iter()
        .map(|&x| u64::from(weight(x, m, sampling.temperature)))
        .collect();
    // Thresholds are keys (`ordered_key`): 0 keeps every logit.
    let keys: Vec<u32> = logits.iter().map(|&x| ordered_key(x)).collect();
    let mut sorted: Vec<(u32, u64)> = keys.iter().copied().zip(w.iter().copied()).collect();
    sorted.sort_unstable_by_key(|&(key, _)| std::cmp::Reverse(key));
    let k = sampling.top_k;
    let t_k = if k == 0 || k >= logits.len() {
        0
    } else {
        sorted[k - 1].0
    };
    let mass = |t: u32| -> u64 {
        keys.iter()
            .zip(&w)
            .filter(|(key, _)| **key >= t)
            .map(|(_, w)| w)
            .sum()
    };
    let z_k = mass(t_k);
    let mut t = t_k;
    if sampling.top_p < 1.0 {
        // The kept mass at each key, largest first: a running sum over the sorted logits,
        // checked where a run of equal keys ends.
        let p = top_p_fixed(sampling.top_p);
        let mut kept = 0u64;
        for (i, &(key, wi)) in sorted
            .iter()
            .enumerate()
            .take_while(|(_, (key, _))| *key >= t_k)
        {
            kept += wi;
            let run_ends = sorted.get(i + 1).is_none_or(|next| next.0 != key);
            if run_ends && reaches(kept, p, z_k) {
                t = key;
                break;
            }
        }
    }
    let z = mass(t);
    let goal = target(word, z);
    let mut running = 0u64;
    let mut last = 0;
    for (i, (key, wi)) in keys.iter().zip(&w).enumerate() {
        if *key < t {
            continue;
        }
        running += wi;
        last = i;
        if running > goal {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(temperature: f32, top_k: usize, top_p: f32) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 11,
        }
    }

    /// The integer weights draw in softmax proportions: logits 0, ln 2, ln 4 at temperature 1
    /// are picked about 1/7, 2/7 and 4/7 of the time.
    #[test]
    fn draws_follow_the_softmax() {
        let logits = [0.0, 2f32.ln(), 4f32.ln()];
        let mut counts = [0usize; 3];
        let steps = 70_000;
        for step in 0..steps {
            counts[choose(&logits, &sampling(1.0, 0, 1.0), step)] += 1;
        }
        for (i, want) in [1.0, 2.0, 4.0].iter().enumerate() {
            let share = counts[i] as f64 / f64::from(steps);
            assert!((share - want / 7.0).abs() < 0.01, "{counts:?}");
        }
    }

    /// Top-k of 1, or a top-p no mass reaches short of the largest logit, leaves the largest;
    /// top-k of 2 never picks the third; NaN logits weigh nothing.
    #[test]
    fn filters_keep_what_they_say() {
        let logits = [0.5, 3.0, f32::NAN, 2.9, -1.0];
        for step in 0..200 {
            assert_eq!(choose(&logits, &sampling(1.0, 1, 1.0), step), 1);
            assert_eq!(choose(&logits, &sampling(1.0, 0, 1e-6), step), 1);
            let two = choose(&logits, &sampling(1.0, 2, 1.0), step);
            assert!(two == 1 || two == 3, "step {step}: {two}");
            assert_ne!(choose(&logits, &sampling(0.7, 0, 0.99), step), 2);
        }
    }
}
