//! Model inputs from token ids, the contract the interpreter, the compiled buckets and the runtime
//! share: validation (dtype, rank, id range, lengths) and the derived inputs (`position_ids`,
//! `token_type_ids`, a default `attention_mask`). Errors are one-line messages naming the tensor.

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
}

/// Token inputs as a user supplies them.
#[derive(Clone, Debug)]
pub struct TokenBatch {
    /// `[B, L]` token ids.
    pub ids: Vec<Vec<i64>>,
    /// `[B, L]` mask (1 = token, 0 = padding); all ones when absent.
    pub mask: Option<Vec<Vec<i64>>>,
}

impl TokenBatch {
    /// Reads `input_ids` (i64 `[L]` or `[B, L]`) and the optional `attention_mask` (i64 `[B, L]`)
    /// from tensors. Returns the batch and whether the ids were given without a batch axis.
    pub fn from_tensors(ids: &Tensor, mask: Option<&Tensor>) -> Result<(TokenBatch, bool), String> {
        let unbatched = ids.shape.len() == 1;
        let rows = |name: &str, t: &Tensor| -> Result<Vec<Vec<i64>>, String> {
            let values = match (t.dtype, t.as_i64()) {
                (DType::I64, Some(v)) => v,
                _ => return Err(format!("`{name}` must have dtype i64, found {}", t.dtype)),
            };
            let (b, l) = match t.shape.as_slice() {
                [l] if name == "input_ids" => (1, *l),
                [b, l] => (*b, *l),
                other => {
                    return Err(format!(
                        "`{name}` must have shape {}, found {other:?}",
                        if name == "input_ids" {
                            "[L] or [B, L]"
                        } else {
                            "[B, L]"
                        }
                    ))
                }
            };
            if b == 0 || l == 0 {
                return Err(format!("`{name}` is empty ({:?})", t.shape));
            }
            Ok(values.chunks(l).map(<[i64]>::to_vec).collect())
        };
        let ids_rows = rows("input_ids", ids)?;
        let mask_rows = mask.map(|m| rows("attention_mask", m)).transpose()?;
        Ok((
            TokenBatch {
                ids: ids_rows,
                mask: mask_rows,
            },
            unbatched,
        ))
    }

    /// Right-pads rows of different lengths with `pad` and builds the mask.
    pub fn padded(rows: &[Vec<i64>], pad: i64) -> TokenBatch {
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let ids = rows
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.resize(len, pad);
                r
            })
            .collect();
        let mask = rows
            .iter()
            .map(|r| (0..len).map(|i| i64::from(i < r.len())).collect())
            .collect();
        TokenBatch {
            ids,
            mask: Some(mask),
        }
    }
}

/// Validates `batch` against `contract` and builds a model graph's named inputs.
pub fn model_inputs(
    contract: &InputContract,
    batch: &TokenBatch,
) -> Result<BTreeMap<String, Tensor>, String> {
    {
        let b = batch.ids.len();
        let l = batch.ids.first().map_or(0, Vec::len);
        let (vocab, max_pos) = (contract.vocab_size, contract.max_positions);
        if b == 0 || l == 0 {
            return Err("`input_ids` is empty".into());
        }
        let mask: Vec<Vec<i64>> = match &batch.mask {
            Some(m) => {
                if m.len() != b || m.iter().any(|r| r.len() != l) {
                    return Err(format!(
                        "`attention_mask` must have shape [{b}, {l}] like `input_ids`, found [{}, {}]",
                        m.len(),
                        m.first().map_or(0, Vec::len)
                    ));
                }
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
                m.clone()
            }
            None => vec![vec![1; l]; b],
        };
        for (i, row) in batch.ids.iter().enumerate() {
            if row.len() != l {
                return Err("`input_ids` rows differ in length".into());
            }
            for (j, &id) in row.iter().enumerate() {
                // Padding positions may hold any id the table has; real tokens must be in range.
                if id < 0 || id as usize >= vocab {
                    return Err(format!(
                        "`input_ids`[{i}, {j}] = {id} is out of range for vocab size {vocab}"
                    ));
                }
            }
        }
        let decoder = contract.decoder;
        // Decoders: a token's position is the number of real tokens before it (left or right
        // padding give each prompt the positions it has alone). Encoders: the index.
        let positions: Vec<i64> = mask
            .iter()
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
            .collect();
        if let Some(max) = max_pos {
            let top = positions.iter().copied().max().unwrap_or(0);
            if top as usize >= max {
                return Err(format!(
                    "sequence needs position {top}, but the model has {max} positions"
                ));
            }
        }
        let shape = vec![b, l];
        let flat = |rows: &[Vec<i64>]| rows.iter().flatten().copied().collect::<Vec<_>>();
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
        if !decoder {
            out.insert("token_type_ids".into(), Tensor::i64(shape, vec![0; b * l]));
        }
        Ok(out)
    }
}
