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

/// Checks a `[b, l]` batch's mask: 0s and 1s, at least one token per row.
fn check_mask(batch: &TokenBatch, b: usize, l: usize) -> Result<(), String> {
    let Some(m) = &batch.mask else {
        return Ok(());
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
    Ok(())
}

/// Checks a `[b, l]` batch's token types against the model's token type table (a model without
/// one takes none).
fn check_types(
    contract: &InputContract,
    batch: &TokenBatch,
    b: usize,
    l: usize,
) -> Result<(), String> {
    let Some(n) = contract.type_vocab_size else {
        return match batch.types {
            Some(_) => Err(
                "`token_type_ids` is not an input of this model (only BERT-family encoders take token types)"
                    .into(),
            ),
            None => Ok(()),
        };
    };
    let Some(rows) = &batch.types else {
        return Ok(());
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
    Ok(())
}

/// Position ids of a flat `[rows, seq]` mask: for decoders the number of real tokens before each
/// token (left or right padding give each prompt the positions it has alone), for encoders the
/// index.
fn positions(mask: &[i64], seq: usize, decoder: bool) -> Vec<i64> {
    let mut out = Vec::with_capacity(mask.len());
    for row in mask.chunks(seq) {
        let mut seen = -1i64;
        for (j, &m) in row.iter().enumerate() {
            seen += m;
            out.push(if decoder { seen.max(0) } else { j as i64 });
        }
    }
    out
}

/// A batch [`check_batch`] has validated against a contract, which [`padded_model_inputs`] builds
/// inputs from without checking it again.
#[derive(Clone, Copy, Debug)]
pub struct CheckedBatch<'a>(&'a TokenBatch);

/// Validates `batch` against `contract`: ids in range in rows of one length, the mask and token
/// types of the ids' shape and in range, its positions inside the model's position table.
pub fn check_batch<'a>(
    contract: &InputContract,
    batch: &'a TokenBatch,
) -> Result<CheckedBatch<'a>, String> {
    let b = batch.ids.len();
    let l = batch.ids.first().map_or(0, Vec::len);
    let vocab = contract.vocab_size;
    if b == 0 || l == 0 {
        return Err("`input_ids` is empty".into());
    }
    check_mask(batch, b, l)?;
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
    check_types(contract, batch, b, l)?;
    // A decoder's last position is its longest row's real tokens less one, an encoder's l - 1.
    let top = match (&batch.mask, contract.decoder) {
        (Some(mask), true) => {
            mask.iter()
                .map(|r| r.iter().sum::<i64>())
                .max()
                .unwrap_or(1)
                - 1
        }
        _ => l as i64 - 1,
    };
    check_positions(contract, top)?;
    Ok(CheckedBatch(batch))
}

/// Checks that the model's position table (if it has one) holds position `top`.
fn check_positions(contract: &InputContract, top: i64) -> Result<(), String> {
    match contract.max_positions {
        Some(max) if top as usize >= max => Err(format!(
            "sequence needs position {top}, but the model has {max} positions"
        )),
        _ => Ok(()),
    }
}

/// Validates `batch` against `contract` and builds a model graph's named inputs.
pub fn model_inputs(
    contract: &InputContract,
    batch: &TokenBatch,
) -> Result<BTreeMap<String, Tensor>, String> {
    let checked = check_batch(contract, batch)?;
    padded_model_inputs(contract, checked, [batch.ids.len(), batch.ids[0].len()])
}

/// [`model_inputs`] of a checked batch padded to `[rows, seq]`: each row right-padded (id 0,
/// mask 0, type 0), then dummy rows of one token (id 0, mask 1 then 0s), so that no row's softmax
/// is over nothing. Built flat in one pass (a request of 128 x 128 tokens is 65,536 values), the
/// batch checked once, before its bucket is chosen.
pub fn padded_model_inputs(
    contract: &InputContract,
    CheckedBatch(batch): CheckedBatch,
    [rows, seq]: [usize; 2],
) -> Result<BTreeMap<String, Tensor>, String> {
    let (b, l) = (batch.ids.len(), batch.ids[0].len());
    if rows < b || seq < l {
        return Err(format!(
            "a batch of {b} x {l} tokens does not fit a padded shape of {rows} x {seq}"
        ));
    }
    // Row `i` of `given` (or `fill` for a row the batch lacks: a dummy row of `dummy`), padded.
    let padded = |given: Option<&[Vec<i64>]>, fill: i64, dummy: i64| -> Vec<i64> {
        let mut out = Vec::with_capacity(rows * seq);
        for i in 0..rows {
            let start = out.len();
            match given {
                Some(given) if i < b => out.extend_from_slice(&given[i]),
                None if i < b => out.resize(start + l, fill),
                _ => out.push(dummy),
            }
            out.resize(start + seq, 0);
        }
        out
    };
    let ids = padded(Some(&batch.ids), 0, 0);
    let mask = padded(batch.mask.as_deref(), 1, 1);
    // A decoder's positions count real tokens, which `check_batch` has checked; an encoder's are
    // the index, up to the padded length.
    if !contract.decoder {
        check_positions(contract, seq as i64 - 1)?;
    }
    let positions = positions(&mask, seq, contract.decoder);
    let shape = vec![rows, seq];
    let mut out = BTreeMap::new();
    if contract.type_vocab_size.is_some() {
        let types = padded(batch.types.as_deref(), 0, 0);
        out.insert("token_type_ids".into(), Tensor::i64(shape.clone(), types));
    }
    out.insert("input_ids".into(), Tensor::i64(shape.clone(), ids));
    out.insert("attention_mask".into(), Tensor::i64(shape.clone(), mask));
    out.insert("position_ids".into(), Tensor::i64(shape, positions));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Data;

    fn ints(inputs: &BTreeMap<String, Tensor>, name: &str) -> Vec<i64> {
        match &inputs[name].data {
            Data::Int(v) => v.clone(),
            Data::Float(_) => panic!("{name} is not an integer tensor"),
        }
    }

    /// The batch checked, then padded to `shape`.
    fn padded(
        contract: &InputContract,
        batch: &TokenBatch,
        shape: [usize; 2],
    ) -> Result<BTreeMap<String, Tensor>, String> {
        padded_model_inputs(contract, check_batch(contract, batch)?, shape)
    }

    const BERT: InputContract = InputContract {
        decoder: false,
        vocab_size: 100,
        max_positions: Some(8),
        type_vocab_size: Some(2),
    };

    #[test]
    fn padding_right_pads_rows_and_adds_one_token_dummies() {
        let batch =
            TokenBatch::padded(&[vec![5, 6, 7], vec![8]], 0).with_types(&[vec![0, 1, 1], vec![1]]);
        let inputs = padded(&BERT, &batch, [3, 4]).unwrap();
        assert_eq!(inputs["input_ids"].shape, vec![3, 4]);
        assert_eq!(
            ints(&inputs, "input_ids"),
            [5, 6, 7, 0, 8, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            ints(&inputs, "attention_mask"),
            [1, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0]
        );
        assert_eq!(
            ints(&inputs, "token_type_ids"),
            [0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0]
        );
        // An encoder's positions are the index, a decoder's the real tokens before.
        assert_eq!(ints(&inputs, "position_ids"), [0, 1, 2, 3].repeat(3));
        let gpt = InputContract {
            decoder: true,
            type_vocab_size: None,
            ..BERT
        };
        let left = TokenBatch {
            ids: vec![vec![0, 5, 6]],
            mask: Some(vec![vec![0, 1, 1]]),
            types: None,
        };
        let inputs = padded(&gpt, &left, [2, 4]).unwrap();
        assert_eq!(ints(&inputs, "position_ids"), [0, 0, 1, 1, 0, 0, 0, 0]);
        assert!(!inputs.contains_key("token_type_ids"));
        // Unpadded, the same as `model_inputs`.
        assert_eq!(
            padded(&gpt, &left, [1, 3]).unwrap(),
            model_inputs(&gpt, &left).unwrap()
        );
    }

    #[test]
    fn padding_checks_the_batch_as_given_first() {
        let ragged = TokenBatch::unmasked(vec![vec![1, 2], vec![3]]);
        let err = padded(&BERT, &ragged, [2, 4]).unwrap_err();
        assert_eq!(err, "`input_ids` rows differ in length");
        let long = TokenBatch::unmasked(vec![vec![1; 9]]);
        let err = padded(&BERT, &long, [1, 16]).unwrap_err();
        assert_eq!(
            err,
            "sequence needs position 8, but the model has 8 positions"
        );
        let batch = TokenBatch::unmasked(vec![vec![1, 2, 3]; 2]);
        let err = padded(&BERT, &batch, [1, 4]).unwrap_err();
        assert_eq!(
            err,
            "a batch of 2 x 3 tokens does not fit a padded shape of 1 x 4"
        );
        assert!(check_batch(&BERT, &batch).is_ok());
    }
}
