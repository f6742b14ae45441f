//! Host tensors for the reference interpreter: f32 storage for float types (values rounded to the
//! declared precision), i64 storage for integers and booleans.

use half::{bf16, f16};

use crate::dtype::DType;

/// Element storage.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// Float tensors (f32, f16, bf16), rounded to their dtype.
    Float(Vec<f32>),
    /// Integer and boolean tensors.
    Int(Vec<i64>),
}

/// A dense row-major host tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Declared element type.
    pub dtype: DType,
    /// Concrete shape.
    pub shape: Vec<usize>,
    /// Elements, row-major.
    pub data: Data,
}

impl Tensor {
    /// A float tensor of dtype `dtype`; values are rounded to that precision.
    pub fn float(dtype: DType, shape: Vec<usize>, mut values: Vec<f32>) -> Tensor {
        assert!(dtype.is_float(), "Tensor::float with {dtype}");
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "shape/data mismatch"
        );
        round_to_dtype(dtype, &mut values);
        Tensor {
            dtype,
            shape,
            data: Data::Float(values),
        }
    }

    /// An f32 tensor.
    pub fn f32(shape: Vec<usize>, values: Vec<f32>) -> Tensor {
        Tensor::float(DType::F32, shape, values)
    }

    /// An integer or boolean tensor.
    pub fn int(dtype: DType, shape: Vec<usize>, values: Vec<i64>) -> Tensor {
        assert!(!dtype.is_float(), "Tensor::int with {dtype}");
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "shape/data mismatch"
        );
        Tensor {
            dtype,
            shape,
            data: Data::Int(values),
        }
    }

    /// An i64 tensor.
    pub fn i64(shape: Vec<usize>, values: Vec<i64>) -> Tensor {
        Tensor::int(DType::I64, shape, values)
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The float elements, if this is a float tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::Float(v) => Some(v),
            Data::Int(_) => None,
        }
    }

    /// The integer elements, if this is an integer or boolean tensor.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            Data::Int(v) => Some(v),
            Data::Float(_) => None,
        }
    }

    /// Rows `range` of the leading dimension.
    ///
    /// # Panics
    /// For a scalar, and when `range` is not within the leading dimension.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Tensor {
        let (&n, rest) = self.shape.split_first().expect("rows of a scalar");
        assert!(
            range.start <= range.end && range.end <= n,
            "rows {range:?} of {n}"
        );
        let per_row: usize = rest.iter().product();
        let span = range.start * per_row..range.end * per_row;
        let mut shape = self.shape.clone();
        shape[0] = range.len();
        let data = match &self.data {
            Data::Float(v) => Data::Float(v[span].to_vec()),
            Data::Int(v) => Data::Int(v[span].to_vec()),
        };
        Tensor {
            dtype: self.dtype,
            shape,
            data,
        }
    }

    /// Converts to `dtype` (floats round; float to integer truncates toward zero; to bool is `!= 0`).
    pub fn cast(&self, dtype: DType) -> Tensor {
        let data = match (&self.data, dtype.is_float()) {
            (Data::Float(v), true) => {
                let mut v = v.clone();
                round_to_dtype(dtype, &mut v);
                Data::Float(v)
            }
            (Data::Float(v), false) => Data::Int(
                v.iter()
                    .map(|&x| {
                        if dtype == DType::Bool {
                            i64::from(x != 0.0)
                        } else {
                            x as i64
                        }
                    })
                    .collect(),
            ),
            (Data::Int(v), true) => {
                let mut f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                round_to_dtype(dtype, &mut f);
                Data::Float(f)
            }
            (Data::Int(v), false) => Data::Int(
                v.iter()
                    .map(|&x| match dtype {
                        DType::Bool => i64::from(x != 0),
                        DType::I32 => i64::from(x as i32),
                        _ => x,
                    })
                    .collect(),
            ),
        };
        Tensor {
            dtype,
            shape: self.shape.clone(),
            data,
        }
    }
}

/// Rounds f32 values to the precision of `dtype` (no-op for f32).
pub fn round_to_dtype(dtype: DType, values: &mut [f32]) {
    match dtype {
        DType::F16 => values
            .iter_mut()
            .for_each(|v| *v = f16::from_f32(*v).to_f32()),
        DType::BF16 => values
            .iter_mut()
            .for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Reads a strided view of `src` into a new row-major vector of shape `out_shape`: element at
/// index `i` comes from `src[offset + sum(i[k] * view_strides[k])]`. Permutes, broadcasts (stride 0)
/// and slices are all such views.
pub fn copy_view<T: Copy>(
    src: &[T],
    out_shape: &[usize],
    view_strides: &[usize],
    offset: usize,
) -> Vec<T> {
    let n: usize = out_shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let rank = out_shape.len();
    let mut idx = vec![0usize; rank];
    let mut pos = offset;
    for _ in 0..n {
        out.push(src[pos]);
        // Increment the multi-index, innermost first, adjusting the source position.
        for k in (0..rank).rev() {
            idx[k] += 1;
            pos += view_strides[k];
            if idx[k] < out_shape[k] {
                break;
            }
            pos -= view_strides[k] * out_shape[k];
            idx[k] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_view_transposes_and_broadcasts() {
        let src = [1, 2, 3, 4, 5, 6]; // [2, 3]
        assert_eq!(copy_view(&src, &[3, 2], &[1, 3], 0), vec![1, 4, 2, 5, 3, 6]);
        assert_eq!(
            copy_view(&src[..3], &[2, 3], &[0, 1], 0),
            vec![1, 2, 3, 1, 2, 3]
        );
        assert_eq!(copy_view(&src, &[2, 2], &[3, 1], 1), vec![2, 3, 5, 6]);
    }

    #[test]
    fn casts_round_and_truncate() {
        let t = Tensor::f32(vec![3], vec![1.0 + 1.0 / 1024.0 + 1e-4, -2.7, 0.0]);
        assert_eq!(t.cast(DType::I64).as_i64().unwrap(), &[1, -2, 0]);
        assert_eq!(t.cast(DType::Bool).as_i64().unwrap(), &[1, 1, 0]);
        let h = t.cast(DType::F16);
        assert_eq!(h.as_f32().unwrap()[0], 1.0 + 1.0 / 1024.0);
    }

    #[test]
    fn rows_slice_the_leading_dimension() {
        let t = Tensor::i64(vec![3, 2], vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(t.rows(1..3), Tensor::i64(vec![2, 2], vec![3, 4, 5, 6]));
        assert_eq!(t.rows(0..0).shape, vec![0, 2]);
        let f = Tensor::float(DType::BF16, vec![2, 1, 2], vec![0.5, 1.0, 1.5, 2.0]);
        let second = f.rows(1..2);
        assert_eq!(
            (second.dtype, second.shape.clone()),
            (DType::BF16, vec![1, 1, 2])
        );
        assert_eq!(second.as_f32().unwrap(), &[1.5, 2.0]);
    }
}
