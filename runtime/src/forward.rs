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
use kiln_ir::inputs::{model_inputs, TokenBatch};
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
    if let Some(chunks) = logits_chunks(art, batch)? {
        let logits = run_chunks(art, exec, &batch.ids[0], &chunks)?;
        return Ok(BTreeMap::from([(LOGITS.to_string(), logits)]));
    }
    let (bucket, inputs) = prepare(art, batch)?;
    let outputs = exec.run(art, bucket, &inputs)?;
    let (b, l) = (batch.ids.len(), batch.ids[0].len());
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
    model_inputs(&contract, batch).map_err(RuntimeError::Request)?;
    let (b, l) = (batch.ids.len(), batch.ids[0].len());
    let bucket = prefill_bucket(art, b, l)?;
    let mask = batch.mask.clone().unwrap_or_else(|| vec![vec![1; l]; b]);
    let pad = |rows: &[Vec<i64>], fill_first: i64| -> Vec<Vec<i64>> {
        let mut out: Vec<Vec<i64>> = rows
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.resize(bucket.seq, 0);
                r
            })
            .collect();
        while out.len() < bucket.batch {
            let mut dummy = vec![0; bucket.seq];
            dummy[0] = fill_first;
            out.push(dummy);
        }
        out
    };
    let padded = TokenBatch {
        ids: pad(&batch.ids, 0),
        mask: Some(pad(&mask, 1)),
        types: batch.types.as_ref().map(|t| pad(t, 0)),
    };
    let inputs = model_inputs(&contract, &padded).map_err(RuntimeError::Request)?;
    let graph = &art.graphs[&bucket.graph];
    let inputs: BTreeMap<String, Tensor> = graph
        .inputs()
        .filter_map(|(_, name, _)| inputs.get(name).map(|t| (name.to_string(), t.clone())))
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

/// How `batch` runs through the artifact's logits chunks (chunks of the largest size, then the
/// smallest that holds the rest), or `None` when it takes a prefill bucket: only a decoder's
/// single unpadded sequence, no longer than the KV cache, that is longer than the largest logits
/// chunk or that no prefill bucket holds, takes them, validated (a request that takes a bucket is
/// validated when it is padded to it, [`prepare`]).
pub fn logits_chunks<'a>(
    art: &'a Artifact,
    batch: &TokenBatch,
) -> Result<Option<Vec<Chunk<'a>>>, RuntimeError> {
    let m = &art.manifest;
    let mut sizes: Vec<&BucketEntry> = m.logits_chunks.iter().collect();
    sizes.sort_by_key(|e| e.seq);
    let (Some(&largest), Some(context)) = (sizes.last(), m.max_context) else {
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
    if len > context || (len <= largest.seq && bucket) {
        return Ok(None);
    }
    model_inputs(&m.model.contract(), batch).map_err(RuntimeError::Request)?;
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < len {
        let left = len - start;
        let entry = *sizes.iter().find(|e| e.seq >= left).unwrap_or(&largest);
        let take = left.min(entry.seq);
        chunks.push(Chunk {
            entry,
            start,
            len: take,
        });
        start += take;
    }
    Ok(Some(chunks))
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

/// Whether `exec` streams `chunks` ([`stream_chunks`]): the CUDA executor, and no chunk runs
/// part of its graph on the host.
pub fn streams(exec: &Executor, chunks: &[Chunk]) -> bool {
    let on_device = |c: &Chunk| c.entry.plan.as_ref().is_some_and(|p| p.host_tail.is_none());
    matches!(exec, Executor::Cuda(_)) && chunks.iter().all(on_device)
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
