//! A forward request: validated against the model's input contract, padded to the smallest
//! prefill bucket that holds it (extra batch rows are one-token dummies), run, and cut back to the
//! request's own rows and tokens. Padding never changes a result (the compiler's tests show it).

use std::collections::BTreeMap;

use kiln_ir::artifact::BucketEntry;
use kiln_ir::inputs::{model_inputs, TokenBatch};
use kiln_ir::{Data, Tensor};

use crate::{Artifact, Executor, RuntimeError};

/// Runs `batch` through the artifact's prefill buckets on `exec`.
pub fn forward(
    art: &Artifact,
    exec: &mut Executor,
    batch: &TokenBatch,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
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
