//! Model inputs from token ids, the contract the interpreter, the compiled buckets and the runtime
//! share: validation (dtype, rank, id range, lengths) and the derived inputs (`position_ids`,
//! `token_type_ids` of zeros when absent, a default `attention_mask`). Errors are one-line
//! messages naming the tensor.

use std::collections::BTreeMap;

use crate::{DType, Tensor};

/// What a model's inputs are checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputContract {
    /// A causal LM: a token's position counts the real tokens before it; encoders use the index.
    pub decoder: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Length of a learned position table, if any.
    pub max_positions: Option<usize>,
    /// Size of the token type table of a model with a `token_type_ids` input (BERT); `None` for
    /// a model without one.
    pub type_vocab_size: Option<usize>,
}

/// Token inputs as a user supplies them.
#[derive(Clone, Debug)]
pub struct TokenBatch {
    /// `[B, L]` token ids.
    pub ids: Vec<Vec<i64>>,
    /// `[B, L]` mask (1 = token, 0 = padding); all ones when absent.
    pub mask: Option<Vec<Vec<i64>>>,
    /// `[B, L]` token types (segments: 0 for the first text of a pair, 1 for the second); all
    /// zeros when absent.
    pub types: Option<Vec<Vec<i64>>>,
}

/// The tensors a request file may hold.
pub const REQUEST_TENSORS: [&str; 3] = ["input_ids", "attention_mask", "token_type_ids"];

/// The rows of an i64 `[L]` (one row) or `[B, L]` tensor named `name`.
fn int_rows(name: &str, t: &Tensor) -> Result<Vec<Vec<i64>>, String> {
    let values = match (t.dtype, t.as_i64()) {
        (DType::I64, Some(v)) => v,
        _ => return Err(format!("`{name}` must have dtype i64, found {}", t.dtype)),
    };
    let (b, l) = match t.shape.as_slice() {
        [l] => (1, *l),
        [b, l] => (*b, *l),
        other => {
            return Err(format!(
                "`{name}` must have shape [L] or [B, L], found {other:?}"
            ))
        }
    };
    if b == 0 || l == 0 {
        return Err(format!("`{name}` is empty ({:?})", t.shape));
    }
    Ok(values.chunks(l).map(<[i64]>::to_vec).collect())
}

/// Checks that `rows` of tensor `name` have the ids' shape `[b, l]`.
fn check_shape(name: &str, rows: &[Vec<i64>], b: usize, l: usize) -> Result<(), String> {
    if rows.len() != b || rows.iter().any(|r| r.len() != l) {
        return Err(format!(
            "`{name}` must have shape [{b}, {l}] like `input_ids`, found [{}, {}]",
            rows.len(),
            rows.first().map_or(0, Vec::len)
        ));
    }
    Ok(())
}

/// Flattens `[B, L]` rows.
fn flat(rows: &[Vec<i64>]) -> Vec<i64> {
    rows.iter().flatten().copied().collect()
}

impl TokenBatch {
    /// Reads `input_ids` (i64 `[L]` or `[B, L]`) and the optional `attention_mask` (i64, the ids'
    /// shape) from tensors. Returns the batch and whether the ids were given without a batch axis.
    pub fn from_tensors(ids: &Tensor, mask: Option<&Tensor>) -> Result<(TokenBatch, bool), String> {
        let batch = TokenBatch {
            ids: int_rows("input_ids", ids)?,
            mask: mask.map(|m| int_rows("attention_mask", m)).transpose()?,
            types: None,
        };
        Ok((batch, ids.shape.len() == 1))
    }

    /// Reads a request's tensors by name: `input_ids` (i64 `[L]` or `[B, L]`) and, optionally,
    /// `attention_mask` and `token_type_ids` of the same shape; any other tensor is an error.
    /// Returns the batch and whether the ids were given without a batch axis.
    pub fn from_request(tensors: &BTreeMap<String, Tensor>) -> Result<(TokenBatch, bool), String> {
        if let Some(extra) = tensors
            .keys()
            .find(|k| !REQUEST_TENSORS.contains(&k.as_str()))
        {
            return Err(format!(
                "unexpected tensor `{extra}` (a request holds `{}`)",
                REQUEST_TENSORS.join("`, `")
            ));
        }
        let Some(ids) = tensors.get("input_ids") else {
            return Err("the file has no `input_ids` tensor".into());
        };
        for name in &REQUEST_TENSORS[1..] {
            match tensors.get(*name) {
                Some(t) if t.shape != ids.shape => {
                    return Err(format!(
                        "`{name}` has shape {:?} but `input_ids` has {:?}",
                        t.shape, ids.shape
                    ))
                }
                _ => {}
            }
        }
        let (mut batch, unbatched) = TokenBatch::from_tensors(ids, tensors.get("attention_mask"))?;
        batch.types = tensors
            .get("token_type_ids")
            .map(|t| int_rows("token_type_ids", t))
            .transpose()?;
        Ok((batch, unbatched))
    }

    /// Rows of equal length whose every token is real: no mask, no token types.
    pub fn unmasked(ids: Vec<Vec<i64>>) -> TokenBatch {
        TokenBatch {
            ids,
            mask: None,
            types: None,
        }
    }

    /// Right-pads rows of different lengths with `pad` and builds the mask (no token types).
    pub fn padded(rows: &[Vec<i64>], pad: i64) -> TokenBatch {
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let ones: Vec<Vec<i64>> = rows.iter().map(|r| vec![1; r.len()]).collect();
        TokenBatch {
            ids: right_pad(rows, len, pad),
            mask: Some(right_pad(&ones, len, 0)),
            types: None,
        }
    }

    /// Sets the token types, one row per row of ids, right-padded with 0 to the ids' length.
    pub fn with_types(mut self, types: &[Vec<i64>]) -> TokenBatch {
        let len = self.ids.first().map_or(0, Vec::len);
        self.types = Some(right_pad(types, len, 0));
        self
    }
}

/// `rows`, each right-padded with `fill` to `len`.
fn right_pad(rows: &[Vec<i64>], len: usize, fill: i64) -> Vec<Vec<i64>> {
    rows.iter()
        .map(|r| {
            let mut r = r.clone();
            r.resize(len, fill);
            r
        })
        .collect()
}

/// The mask of a `[b, l]` batch, checked: 0s and 1s, at least one token per row.
fn checked_mask(batch: &TokenBatch, b: usize, l: usize) -> Result<Vec<Vec<i64>>, String> {
    let Some(m) = &batch.mask else {
        return Ok(vec![vec![1; l]; b]);
    };
    check_shape("attention_mask", m, b, l)?;
    for (i, row) in m.iter().enumerate() {
        if let Some(j) = row.iter().position(|&v| v != 0 && v != 1) {
            return Err(format!(
                "`attention_mask`[{i}, {j}] = {} must be 0 or 1",
                row[j]
            ));
        }
        if row.iter().all(|&v| v == 0) {
            return Err(format!("`attention_mask` row {i} has no token"));
        }
    }
    Ok(m.clone())
}

/// The flat token types of a `[b, l]` batch for a model that takes them (zeros when the batch
/// has none), checked against the model's token type table; `None` for a model without them.
fn checked_types(
    contract: &InputContract,
    batch: &TokenBatch,
    b: usize,
    l: usize,
) -> Result<Option<Vec<i64>>, String> {
    let Some(n) = contract.type_vocab_size else {
        return match batch.types {
            Some(_) => Err(
                "`token_type_ids` is not an input of this model (only BERT-family encoders take token types)"
                    .into(),
            ),
            None => Ok(None),
        };
    };
    let Some(rows) = &batch.types else {
        return Ok(Some(vec![0; b * l]));
    };
    check_shape("token_type_ids", rows, b, l)?;
    for (i, row) in rows.iter().enumerate() {
        if let Some(j) = row.iter().position(|&t| t < 0 || t as usize >= n) {
            return Err(format!(
                "`token_type_ids`[{i}, {j}] = {} is out of range for {n} token types",
                row[j]
            ));
        }
    }
    Ok(Some(flat(rows)))
}

/// Position ids: for decoders the number of real tokens before each token (left or right padding
/// give each prompt the positions it has alone), for encoders the index.
fn positions(mask: &[Vec<i64>], decoder: bool) -> Vec<i64> {
    mask.iter()
        .flat_map(|row| {
            let mut seen = -1i64;
            row.iter()
                .enumerate()
                .map(|(j, &m)| {
                    seen += m;
                    if decoder {
                        seen.max(0)
                    } else {
                        j as i64
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Validates `batch` against `contract` and builds a model graph's named inputs.
pub fn model_inputs(
    contract: &InputContract,
    batch: &TokenBatch,
) -> Result<BTreeMap<String, Tensor>, String> {
    let b = batch.ids.len();
    let l = batch.ids.first().map_or(0, Vec::len);
    let vocab = contract.vocab_size;
    if b == 0 || l == 0 {
        return Err("`input_ids` is empty".into());
    }
    let mask = checked_mask(batch, b, l)?;
    for (i, row) in batch.ids.iter().enumerate() {
        if row.len() != l {
            return Err("`input_ids` rows differ in length".into());
        }
        // Padding positions may hold any id the table has; real tokens must be in range.
        if let Some(j) = row.iter().position(|&id| id < 0 || id as usize >= vocab) {
            return Err(format!(
                "`input_ids`[{i}, {j}] = {} is out of range for vocab size {vocab}",
                row[j]
            ));
        }
    }
    let types = checked_types(contract, batch, b, l)?;
    let positions = positions(&mask, contract.decoder);
    if let Some(max) = contract.max_positions {
        let top = positions.iter().copied().max().unwrap_or(0);
        if top as usize >= max {
            return Err(format!(
                "sequence needs position {top}, but the model has {max} positions"
            ));
        }
    }
    let shape = vec![b, l];
    let mut out = BTreeMap::new();
    out.insert(
        "input_ids".into(),
        Tensor::i64(shape.clone(), flat(&batch.ids)),
    );
    out.insert(
        "attention_mask".into(),
        Tensor::i64(shape.clone(), flat(&mask)),
    );
    out.insert("position_ids".into(), Tensor::i64(shape.clone(), positions));
    if let Some(types) = types {
        out.insert("token_type_ids".into(), Tensor::i64(shape, types));
    }
    Ok(out)
}
