//! A forward request: validated against the model's input contract, padded to the smallest
//! prefill bucket that holds it (extra batch rows are one-token dummies), run, and cut back to the
//! request's own rows and tokens. Padding never changes a result (the compiler's tests show it).
//!
//! A decoder's single sequence that is longer than its largest logits chunk, or that no prefill
//! bucket holds, runs through the logits chunks instead ([`logits_chunks`]): chunk after chunk
//! through the KV cache's row 0, every token's logits kept; on CUDA each chunk's logits go to the
//! host while the next chunk computes ([`crate::cuda::CudaExecutor::replay_logits_chunks`]).

use std::collections::BTreeMap;

use kiln_ir::artifact::{BucketEntry, LOGITS};
use kiln_ir::inputs::{check_batch, padded_model_inputs, TokenBatch};
use kiln_ir::{DType, Data, Tensor};

use crate::batcher::{largest_step, step_inputs, Row, Session};
use crate::blocks::BlockPool;
use crate::cuda::CudaExecutor;
use crate::{Artifact, Executor, RuntimeError};

/// Runs `batch` through the artifact's prefill buckets (or its logits chunks) on `exec`.
pub fn forward(
    art: &Artifact,
    exec: &mut Executor,
    batch: &TokenBatch,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    if let Some(chunks) = logits_chunks(art, batch, exec.last_logits_chunk())? {
        let logits = run_chunks(art, exec, &batch.ids[0], &chunks)?;
        return Ok(BTreeMap::from([(LOGITS.to_string(), logits)]));
    }
    let (bucket, inputs) = prepare(art, batch)?;
    let (b, l) = (batch.ids.len(), batch.ids[0].len());
    let outputs = exec.run_rows(art, bucket, &inputs, b)?;
    Ok(outputs
        .into_iter()
        .map(|(name, t)| (name, cut(&t, b, l, bucket.seq)))
        .collect())
}

/// Validates `batch`, picks the smallest prefill bucket that holds it and pads it to that
/// bucket: the bucket and its graph's inputs by name.
pub fn prepare<'a>(
    art: &'a Artifact,
    batch: &TokenBatch,
) -> Result<(&'a BucketEntry, BTreeMap<String, Tensor>), RuntimeError> {
    let contract = art.manifest.model.contract();
    // Validate the request as it is, before padding.
    let checked = check_batch(&contract, batch).map_err(RuntimeError::Request)?;
    let (b, l) = (batch.ids.len(), batch.ids[0].len());
    let bucket = prefill_bucket(art, b, l)?;
    let mut inputs = padded_model_inputs(&contract, checked, [bucket.batch, bucket.seq])
        .map_err(RuntimeError::Request)?;
    let graph = &art.graphs[&bucket.graph];
    let inputs: BTreeMap<String, Tensor> = graph
        .inputs()
        .filter_map(|(_, name, _)| inputs.remove_entry(name))
        .collect();
    Ok((bucket, inputs))
}

/// The smallest prefill bucket (by sequence, then batch) that holds `b` rows of `l` tokens.
pub fn prefill_bucket(art: &Artifact, b: usize, l: usize) -> Result<&BucketEntry, RuntimeError> {
    art.manifest
        .prefill
        .iter()
        .filter(|e| e.batch >= b && e.seq >= l)
        .min_by_key(|e| (e.seq, e.batch))
        .ok_or_else(|| {
            RuntimeError::Request(format!(
                "no bucket holds {b} x {l} tokens (sequence buckets {:?}, batch buckets {:?})",
                art.manifest.seq_buckets, art.manifest.batch_buckets
            ))
        })
}

/// Keeps the first `b` rows (and, for `[B, S, ..]` tensors, the first `l` tokens).
fn cut(t: &Tensor, b: usize, l: usize, seq: usize) -> Tensor {
    let per_row: usize = t.shape[1..].iter().product();
    let per_token = if t.shape.len() >= 3 && t.shape[1] == seq {
        per_row / seq
    } else {
        0
    };
    let mut keep = Vec::new();
    for r in 0..b {
        let row = r * per_row;
        if per_token > 0 {
            keep.push((row, l * per_token));
        } else {
            keep.push((row, per_row));
        }
    }
    let pick = |v: &[f32]| -> Vec<f32> {
        keep.iter()
            .flat_map(|&(s, n)| v[s..s + n].to_vec())
            .collect()
    };
    let mut shape = t.shape.clone();
    shape[0] = b;
    if per_token > 0 {
        shape[1] = l;
    }
    match &t.data {
        Data::Float(v) => Tensor::f32(shape, pick(v)).cast(t.dtype),
        Data::Int(v) => Tensor::int(
            t.dtype,
            shape,
            keep.iter()
                .flat_map(|&(s, n)| v[s..s + n].to_vec())
                .collect(),
        ),
    }
}

/// One chunk of a sequence run through the logits chunks: the chunk bucket, and the tokens
/// `start..start + len` of the sequence it takes.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    /// The logits chunk bucket.
    pub entry: &'a BucketEntry,
    /// The chunk's first token.
    pub start: usize,
    /// Its tokens (at most `entry.seq`).
    pub len: usize,
}

/// How `batch` runs through the artifact's logits chunks, or `None` when it takes a prefill
/// bucket: only a decoder's single unpadded sequence, no longer than the KV cache, that is longer
/// than the largest logits chunk or that no prefill bucket holds, takes them, validated (a
/// request that takes a bucket is validated when it is padded to it, [`prepare`]). The chunks
/// are [`chunk_sizes`]'s, `last` the executor's choice of a last chunk
/// ([`Executor::last_logits_chunk`]).
pub fn logits_chunks<'a>(
    art: &'a Artifact,
    batch: &TokenBatch,
    last: Option<usize>,
) -> Result<Option<Vec<Chunk<'a>>>, RuntimeError> {
    let m = &art.manifest;
    let (Some(largest), Some(context)) =
        (m.logits_chunks.iter().map(|e| e.seq).max(), m.max_context)
    else {
        return Ok(None);
    };
    let padded = |mask: &Vec<Vec<i64>>| mask.iter().flatten().any(|&v| v != 1);
    if batch.ids.len() != 1 || batch.mask.as_ref().is_some_and(padded) {
        return Ok(None);
    }
    let len = batch.ids[0].len();
    let bucket = prefill_bucket(art, 1, len).is_ok();
    if len > context && !bucket {
        return Err(RuntimeError::Request(format!(
            "{len} tokens exceed the KV cache ({context} entries) the logits chunks run through, \
             and every prefill bucket (the longest takes {})",
            art.longest_prefill()
        )));
    }
    if len > context || (len <= largest && bucket) {
        return Ok(None);
    }
    check_batch(&m.model.contract(), batch).map_err(RuntimeError::Request)?;
    Ok(Some(chunks_of(art, len, last)))
}

/// `len` tokens as chunks of `art`'s logits chunk buckets ([`chunk_sizes`]).
fn chunks_of(art: &Artifact, len: usize, last: Option<usize>) -> Vec<Chunk<'_>> {
    let entries = &art.manifest.logits_chunks;
    let sizes: Vec<usize> = entries.iter().map(|e| e.seq).collect();
    let mut start = 0;
    chunk_sizes(&sizes, len, last)
        .into_iter()
        .map(|(seq, take)| {
            let entry = entries.iter().find(|e| e.seq == seq).expect("one of sizes");
            let chunk = Chunk {
                entry,
                start,
                len: take,
            };
            start += take;
            chunk
        })
        .collect()
}

/// How `len` tokens split over chunks of `sizes` (not empty): each chunk's size and the tokens it
/// takes. Chunks of the largest size, then the smallest that holds the rest; when `last` is one
/// of the sizes, smaller than `len`, and `len` is more than the largest size, the last `last`
/// tokens take a chunk of their own and the tokens before them split by the same rule. Where
/// the copies to the host outlast the compute, a prompt ends with its last chunk's compute and
/// copy, which a smaller last chunk shortens.
pub fn chunk_sizes(sizes: &[usize], len: usize, last: Option<usize>) -> Vec<(usize, usize)> {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let tail = last.filter(|a| sizes.contains(a) && *a < len && len > largest);
    let mut chunks = Vec::new();
    let mut left = len - tail.unwrap_or(0);
    while left > 0 {
        let seq = sizes
            .iter()
            .copied()
            .filter(|&s| s >= left)
            .min()
            .unwrap_or(largest);
        let take = left.min(seq);
        chunks.push((seq, take));
        left -= take;
    }
    chunks.extend(tail.map(|a| (a, a)));
    chunks
}

/// Runs `tokens` through `chunks` (from [`logits_chunks`]) on `exec` and returns their logits,
/// `[1, tokens, vocab]`.
pub fn run_chunks(
    art: &Artifact,
    exec: &mut Executor,
    tokens: &[i64],
    chunks: &[Chunk],
) -> Result<Tensor, RuntimeError> {
    let vocab = art.manifest.model.vocab_size;
    if let (true, Executor::Cuda(cuda)) = (streams(exec, chunks), &mut *exec) {
        let (bytes, dtype) = stream_chunks(art, cuda, tokens, chunks)?;
        return Ok(crate::cuda::decode(
            bytes,
            dtype,
            vec![1, tokens.len(), vocab],
        ));
    }
    if let Some(table) = row_blocks(art, tokens.len())? {
        exec.write_block_table(&table)?;
    }
    let step = largest_step(art)?;
    let mut session = Session::new(art, exec, step)?;
    let mut logits = Vec::with_capacity(tokens.len() * vocab);
    for c in chunks {
        let inputs = session.inputs(c.entry, &[chunk_row(tokens, c)]);
        let out = session.run(c.entry, &inputs)?;
        let values = match out.get(LOGITS).map(|t| &t.data) {
            Some(Data::Float(values)) => values.get(..c.len * vocab),
            _ => None,
        };
        let Some(values) = values else {
            return Err(RuntimeError::Request(format!(
                "logits chunk {} has no float logits of {} tokens",
                c.entry.graph, c.len
            )));
        };
        logits.extend_from_slice(values);
    }
    Ok(Tensor::f32(vec![1, tokens.len(), vocab], logits).cast(art.manifest.dtype))
}

/// Runs `tokens` through `chunks` on the CUDA executor, each chunk's logits copied to the host
/// while the next computes, and returns the logits as the device holds them (what a server
/// hands on) and their type.
pub fn stream_chunks<'e>(
    art: &Artifact,
    cuda: &'e mut CudaExecutor,
    tokens: &[i64],
    chunks: &[Chunk],
) -> Result<(&'e [u8], DType), RuntimeError> {
    if let Some(table) = row_blocks(art, tokens.len())? {
        cuda.write_block_table(&table)?;
    }
    let context = largest_step(art)?.context.unwrap_or(0);
    let runs: Vec<(&str, BTreeMap<String, Tensor>, usize)> = chunks
        .iter()
        .map(|c| {
            let inputs = step_inputs(c.entry, &[chunk_row(tokens, c)], context);
            (c.entry.graph.as_str(), inputs, c.len)
        })
        .collect();
    cuda.replay_logits_chunks(&runs)
}

/// The last logits chunk that ends a long prompt soonest on `cuda` ([`chunk_sizes`]'s `last`),
/// timed: a prompt of the whole context (at most four of the largest chunks, and what a paged
/// cache holds) streamed with each smaller size last and with none (`time_interleaved`), the
/// fastest by `LAST_CHUNK_GAIN` kept (`fastest`). `None` when
/// the artifact has one chunk size, or its chunks do not stream or did not load.
pub fn time_last_chunk(
    art: &Artifact,
    cuda: &mut CudaExecutor,
) -> Result<Option<usize>, RuntimeError> {
    let m = &art.manifest;
    let mut sizes: Vec<usize> = m.logits_chunks.iter().map(|e| e.seq).collect();
    sizes.sort_unstable();
    let (Some(&largest), Some(context)) = (sizes.last(), m.max_context) else {
        return Ok(None);
    };
    // As long as a paged cache can hold (fewer blocks than a context's may be compiled).
    let held = m
        .memory
        .paging
        .map_or(context, |p| p.blocks.saturating_sub(1) * p.block_tokens);
    let len = context.min(4 * largest).min(held);
    let on_device = |e: &BucketEntry| cuda.has(&e.graph) && whole_on_device(e);
    if sizes.len() < 2 || len <= largest || !m.logits_chunks.iter().all(on_device) {
        return Ok(None);
    }
    let tokens = vec![0; len];
    let candidates: Vec<Option<usize>> = std::iter::once(None)
        .chain(sizes[..sizes.len() - 1].iter().map(|&a| Some(a)))
        .collect();
    let schedules: Vec<Vec<Chunk>> = candidates.iter().map(|&l| chunks_of(art, len, l)).collect();
    let fastest_of = time_interleaved(schedules.len(), |i| {
        stream_chunks(art, cuda, &tokens, &schedules[i]).map(|_| ())
    })?;
    Ok(fastest(
        candidates.into_iter().zip(fastest_of),
        LAST_CHUNK_GAIN,
    ))
}

/// Rounds of [`time_interleaved`] after its warm-up.
const TIMING_ROUNDS: usize = 5;

/// A smaller last chunk must be this much faster than none to be taken: less than the
/// 1.4-2% it saves where the copies outlast the compute (Llama-3.2-1B, 4096 tokens), more than
/// the spread of the fastest of [`TIMING_ROUNDS`] streams.
const LAST_CHUNK_GAIN: f64 = 0.005;

/// The seconds of `candidates` ways to run the same work, each the fastest of [`TIMING_ROUNDS`]
/// interleaved rounds after one to warm up, so that a clock that drifts during load drifts under
/// every candidate alike. `run(i)` runs candidate `i` and waits for it.
pub(crate) fn time_interleaved(
    candidates: usize,
    mut run: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<Vec<f64>, RuntimeError> {
    let mut fastest = vec![f64::INFINITY; candidates];
    for round in 0..=TIMING_ROUNDS {
        for (i, best) in fastest.iter_mut().enumerate() {
            let start = std::time::Instant::now();
            run(i)?;
            if round > 0 {
                *best = best.min(start.elapsed().as_secs_f64());
            }
        }
    }
    Ok(fastest)
}

/// The candidate of `timed` (each one's seconds, `None` the way without it) that is fastest,
/// taken only when it beats `None`'s time by the fraction `gain`.
pub(crate) fn fastest<T>(
    timed: impl IntoIterator<Item = (Option<T>, f64)> + Clone,
    gain: f64,
) -> Option<T> {
    let none = timed.clone().into_iter().find(|(c, _)| c.is_none())?.1;
    timed
        .into_iter()
        .filter(|(c, t)| c.is_some() && *t < none * (1.0 - gain))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .and_then(|(c, _)| c)
}

/// Whether `exec` streams `chunks` ([`stream_chunks`]): the CUDA executor, and no chunk runs
/// part of its graph on the host.
pub fn streams(exec: &Executor, chunks: &[Chunk]) -> bool {
    matches!(exec, Executor::Cuda(_)) && chunks.iter().all(|c| whole_on_device(c.entry))
}

/// Whether bucket `entry`'s plan runs all of its graph on the device (no host tail).
fn whole_on_device(entry: &BucketEntry) -> bool {
    entry.plan.as_ref().is_some_and(|p| p.host_tail.is_none())
}

/// Chunk `c` of `tokens` as row 0 of its bucket.
fn chunk_row<'t>(tokens: &'t [i64], c: &Chunk) -> Row<'t> {
    Row::new(&tokens[c.start..c.start + c.len], c.start)
}

/// For a paged cache, the block table that hands row 0 the blocks of `tokens` keys (nothing
/// else runs while a forward request does); `None` for a dense one.
fn row_blocks(art: &Artifact, tokens: usize) -> Result<Option<Vec<u32>>, RuntimeError> {
    let Some(paging) = art.manifest.memory.paging else {
        return Ok(None);
    };
    let mut pool = BlockPool::new(paging);
    let need = pool.blocks_for(tokens);
    if !pool.promise(0, need) {
        return Err(RuntimeError::Request(format!(
            "{tokens} tokens need {need} blocks of the KV cache; it has {}",
            pool.capacity()
        )));
    }
    pool.ensure(0, tokens)?;
    Ok(pool.take_table().map(<[u32]>::to_vec))
}

#[cfg(test)]
mod tests {
    use super::{chunk_sizes, fastest, time_interleaved, LAST_CHUNK_GAIN, TIMING_ROUNDS};

    #[test]
    fn the_fastest_last_chunk_wins_by_half_a_percent() {
        let fastest_last =
            |times: &[(Option<usize>, f64)]| fastest(times.iter().copied(), LAST_CHUNK_GAIN);
        let times = [(None, 23.6), (Some(256), 23.3), (Some(512), 23.4)];
        assert_eq!(fastest_last(&times), Some(256));
        // 0.4% faster is within the timing's spread: none.
        assert_eq!(fastest_last(&[(None, 23.6), (Some(256), 23.51)]), None);
        assert_eq!(fastest_last(&[(None, 23.6), (Some(256), 23.8)]), None);
        // Nothing to compare against.
        assert_eq!(fastest_last(&[(Some(256), 1.0)]), None);
    }

    #[test]
    fn candidates_are_timed_in_turn_after_a_warm_up_round() {
        let mut order = Vec::new();
        let times = time_interleaved(3, |i| {
            order.push(i);
            Ok(())
        })
        .unwrap();
        assert_eq!(order.len(), 3 * (TIMING_ROUNDS + 1));
        assert!(order.chunks(3).all(|round| round == [0, 1, 2]));
        assert!(times.iter().all(|t| t.is_finite()));
        let failed = time_interleaved(2, |i| match i {
            1 => Err(crate::RuntimeError::Device("a kernel failed".into())),
            _ => Ok(()),
        });
        assert!(failed.is_err());
    }

    #[test]
    fn chunks_take_the_largest_then_the_smallest_that_holds_the_rest() {
        let sizes = [256, 1024];
        assert_eq!(chunk_sizes(&sizes, 4096, None), vec![(1024, 1024); 4]);
        let rest = [(1024, 1024), (1024, 1024), (1024, 1024), (256, 200)];
        assert_eq!(chunk_sizes(&sizes, 3272, None), rest);
        assert_eq!(chunk_sizes(&sizes, 300, None), vec![(1024, 300)]);
    }

    #[test]
    fn a_last_chunk_takes_the_prompts_last_tokens() {
        let sizes = [256, 768, 1024];
        let want = [
            (1024, 1024),
            (1024, 1024),
            (1024, 1024),
            (768, 768),
            (256, 256),
        ];
        assert_eq!(chunk_sizes(&sizes, 4096, Some(256)), want);
        let ragged = [(1024, 1024), (1024, 1000), (256, 256)];
        assert_eq!(chunk_sizes(&sizes, 2280, Some(256)), ragged);
    }

    #[test]
    fn a_last_chunk_is_not_taken_where_it_cannot_help() {
        let sizes = [256, 768, 1024];
        // One chunk holds the prompt: nothing streams ahead of it.
        assert_eq!(chunk_sizes(&sizes, 1000, Some(768)), vec![(1024, 1000)]);
        // Not a size of the artifact.
        assert_eq!(chunk_sizes(&sizes, 2048, Some(512)), vec![(1024, 1024); 2]);
        // No smaller than the prompt.
        assert_eq!(
            chunk_sizes(&[1024, 2048], 2048, Some(2048)),
            vec![(2048, 2048)]
        );
    }
}
