//! Reading and writing tensors as safetensors files (model inputs and outputs, the compiler's and
//! the runtime's alike), and the write-beside-then-rename discipline every output follows.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::{DType, Data, Tensor};

/// An I/O failure, as one line naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct IoError(String);

type Result<T> = std::result::Result<T, IoError>;

macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(IoError(format!($($arg)*)))
    };
}

/// Reads every tensor of a safetensors file into host tensors.
pub fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes =
        std::fs::read(path).map_err(|e| IoError(format!("cannot read {}: {e}", path.display())))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        IoError(format!(
            "{} is not a valid safetensors file: {e}",
            path.display()
        ))
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let t = view_to_tensor(&name, &view)
            .map_err(|e| IoError(format!("{}: {e}", path.display())))?;
        out.insert(name, t);
    }
    Ok(out)
}

fn le_chunks<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(|c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        a
    })
}

/// Writes tensors into a safetensors file, each in its own dtype. The file is
/// written beside its destination and renamed into place, so a failure leaves nothing half-written.
pub fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, bytes): (Dtype, Vec<u8>) = match (&t.data, t.dtype) {
                (Data::Float(v), DType::F16) => (
                    Dtype::F16,
                    v.iter()
                        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                        .collect(),
                ),
                (Data::Float(v), DType::BF16) => (
                    Dtype::BF16,
                    v.iter()
                        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                        .collect(),
                ),
                (Data::Float(v), _) => {
                    (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
                }
                (Data::Int(v), DType::I32) => (
                    Dtype::I32,
                    v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
                ),
                (Data::Int(v), DType::Bool) => {
                    (Dtype::BOOL, v.iter().map(|x| u8::from(*x != 0)).collect())
                }
                (Data::Int(v), _) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            };
            (name.clone(), dtype, t.shape.clone(), bytes)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| IoError(format!("cannot encode `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| IoError(format!("cannot encode {}: {e}", path.display())))?;
    write_atomically(path, &bytes)
}

/// The existing folder `path` will be written in (an error naming both if it is missing).
pub fn parent_folder(path: &Path) -> Result<&Path> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "cannot write {}: folder {} does not exist",
            path.display(),
            dir.display()
        );
    }
    Ok(dir)
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent_folder(path)?;
    let Some(file_name) = path.file_name() else {
        bail!("{} is not a file path", path.display());
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        bail!("cannot write {}: {e}", path.display());
    }
    Ok(())
}

/// One safetensors tensor as a host tensor (f32/f16/bf16 as floats; i64/i32/bool as integers).
pub fn view_to_tensor(name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<Tensor> {
    let shape = view.shape().to_vec();
    let data = view.data();
    let t = match view.dtype() {
        Dtype::F32 => Tensor::f32(
            shape,
            le_chunks::<4>(data).map(f32::from_le_bytes).collect(),
        ),
        Dtype::F16 => Tensor::float(
            DType::F16,
            shape,
            le_chunks::<2>(data)
                .map(|b| half::f16::from_le_bytes(b).to_f32())
                .collect(),
        ),
        Dtype::BF16 => Tensor::float(
            DType::BF16,
            shape,
            le_chunks::<2>(data)
                .map(|b| half::bf16::from_le_bytes(b).to_f32())
                .collect(),
        ),
        Dtype::I64 => Tensor::i64(
            shape,
            le_chunks::<8>(data).map(i64::from_le_bytes).collect(),
        ),
        Dtype::I32 => Tensor::int(
            DType::I32,
            shape,
            le_chunks::<4>(data)
                .map(|b| i64::from(i32::from_le_bytes(b)))
                .collect(),
        ),
        Dtype::BOOL => Tensor::int(
            DType::Bool,
            shape,
            data.iter().map(|&b| i64::from(b != 0)).collect(),
        ),
        other => bail!("tensor `{name}` has dtype {other:?}, which kiln does not read"),
    };
    Ok(t)
}
