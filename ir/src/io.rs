//! Reading and writing tensors as safetensors files (model inputs and outputs, the compiler's and
//! the runtime's alike), and the write-beside-then-rename discipline every output follows.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::artifact::TensorSlot;
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
        if name.starts_with(PAD_PREFIX) {
            continue;
        }
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

/// A tensor's safetensors dtype and little-endian bytes, in its own dtype.
fn encode(t: &Tensor) -> (Dtype, Vec<u8>) {
    let bytes = match &t.data {
        Data::Float(v) => float_bytes(v, t.dtype),
        Data::Int(v) => match t.dtype {
            DType::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
            DType::Bool => v.iter().map(|x| u8::from(*x != 0)).collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        },
    };
    (st_dtype(t.dtype), bytes)
}

/// The safetensors dtype of `dtype`.
fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
    }
}

/// The little-endian bytes of a tensor's contents: what an aligned file holds at its slot.
pub fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    encode(t).1
}

/// `values` rounded to the float `dtype` (f16 and bf16 to nearest even), as little-endian bytes.
pub fn float_bytes(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => values
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Writes tensors into a safetensors file, each in its own dtype. The file is
/// written beside its destination and renamed into place, so a failure leaves nothing half-written.
pub fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, bytes) = encode(t);
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

/// The prefix of the padding tensors an aligned file carries between real ones.
pub const PAD_PREFIX: &str = "__kiln_pad.";

/// Places `tensors` (name, dtype, shape; in the given order) at offsets that are multiples of
/// `align`, as [`write_aligned_tensors`] will write them.
pub fn aligned_layout(tensors: &[(String, DType, Vec<usize>)], align: u64) -> Vec<TensorSlot> {
    let mut offset = 0u64;
    tensors
        .iter()
        .map(|(name, dtype, shape)| {
            let slot = TensorSlot {
                name: name.clone(),
                offset,
                dtype: *dtype,
                shape: shape.clone(),
            };
            offset = (offset + slot.bytes()).div_ceil(align) * align;
            slot
        })
        .collect()
}

/// The safetensors header of an aligned file laid out by `layout` (from [`aligned_layout`]), with
/// its 8-byte length in front and spaces after the JSON (allowed by the format) so that the data
/// section starts at a multiple of `align`: every tensor at its planned offset, the gaps declared
/// as `u8` tensors named `__kiln_pad.N`.
pub fn aligned_header(layout: &[TensorSlot], align: u64) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut end = 0u64;
    for slot in layout {
        if slot.offset > end {
            header.insert(
                format!("{PAD_PREFIX}{}", header.len()),
                serde_json::json!({"dtype": "U8", "shape": [slot.offset - end], "data_offsets": [end, slot.offset]}),
            );
        }
        header.insert(
            slot.name.clone(),
            serde_json::json!({
                "dtype": format!("{:?}", st_dtype(slot.dtype)),
                "shape": slot.shape,
                "data_offsets": [slot.offset, slot.offset + slot.bytes()],
            }),
        );
        end = slot.offset + slot.bytes();
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    let start = (8 + json.len() as u64).div_ceil(align) * align;
    json.resize(start as usize - 8, b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes
}

/// Writes an aligned safetensors file in order, one tensor at a time: the header first (known
/// from the layout alone), then each slot's bytes after the zeros of the gap before it. Nothing
/// but the tensor being written is held, whatever the file's size.
pub struct AlignedWriter<'a, W: std::io::Write> {
    out: W,
    layout: &'a [TensorSlot],
    next: usize,
    /// Bytes of the data section written so far.
    end: u64,
}

impl<'a, W: std::io::Write> AlignedWriter<'a, W> {
    /// Writes the header of `layout` (whose slots ascend in offset) to `out`.
    pub fn new(mut out: W, layout: &'a [TensorSlot], align: u64) -> std::io::Result<Self> {
        out.write_all(&aligned_header(layout, align))?;
        Ok(AlignedWriter {
            out,
            layout,
            next: 0,
            end: 0,
        })
    }

    /// The slot whose bytes come next, or `None` once all are written.
    pub fn next_slot(&self) -> Option<&'a TensorSlot> {
        self.layout.get(self.next)
    }

    /// Writes the next slot's bytes (`bytes.len()` must be its size).
    pub fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(slot) = self.next_slot() else {
            bail!("every planned tensor is already written");
        };
        if bytes.len() as u64 != slot.bytes() {
            bail!(
                "`{}` is {} bytes, planned {} ({} {:?})",
                slot.name,
                bytes.len(),
                slot.bytes(),
                slot.dtype,
                slot.shape
            );
        }
        let gap = vec![0u8; (slot.offset - self.end) as usize];
        let written = self
            .out
            .write_all(&gap)
            .and_then(|()| self.out.write_all(bytes));
        written.map_err(|e| IoError(format!("cannot write `{}`: {e}", slot.name)))?;
        self.end = slot.offset + slot.bytes();
        self.next += 1;
        Ok(())
    }

    /// The writer, once every slot is written.
    pub fn finish(self) -> Result<W> {
        if let Some(slot) = self.next_slot() {
            bail!("`{}` was never written", slot.name);
        }
        Ok(self.out)
    }
}

/// Writes `tensors` at the offsets of `layout` (from [`aligned_layout`]) through an
/// [`AlignedWriter`]: a valid safetensors file whose data section starts at a multiple of `align`
/// bytes, so that memory-mapped it can be copied to the device as it is. Written beside `path` and
/// renamed into place.
pub fn write_aligned_tensors(
    path: &Path,
    layout: &[TensorSlot],
    tensors: &BTreeMap<String, Tensor>,
    align: u64,
) -> Result<()> {
    let mut w = AlignedWriter::new(Vec::new(), layout, align)
        .map_err(|e| IoError(format!("cannot write {}: {e}", path.display())))?;
    for slot in layout {
        let Some(t) = tensors.get(&slot.name) else {
            bail!("cannot write {}: no tensor `{}`", path.display(), slot.name);
        };
        if t.shape != slot.shape || t.dtype != slot.dtype {
            bail!(
                "cannot write {}: `{}` is {:?} {:?}, planned {:?} {:?}",
                path.display(),
                slot.name,
                t.dtype,
                t.shape,
                slot.dtype,
                slot.shape
            );
        }
        w.put(&tensor_bytes(t))
            .map_err(|e| IoError(format!("cannot write {}: {e}", path.display())))?;
    }
    write_atomically(path, &w.finish()?)
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

/// The kiln dtype of a safetensors dtype, if kiln reads it.
pub fn view_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_files_are_valid_safetensors_with_tensors_where_planned() {
        let dir = std::env::temp_dir().join(format!("kiln-aligned-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let tensors = BTreeMap::from([
            ("a".to_string(), Tensor::f32(vec![3], vec![1.0, 2.0, 3.0])),
            (
                "b".to_string(),
                Tensor::float(DType::BF16, vec![2, 2], vec![0.5, -1.0, 2.0, 4.0]),
            ),
        ]);
        let entries: Vec<_> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.dtype, t.shape.clone()))
            .collect();
        let layout = aligned_layout(&entries, 256);
        assert_eq!(layout[1].offset, 256);
        write_aligned_tensors(&path, &layout, &tensors, 256).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!((8 + n) % 256, 0, "the data section is aligned");
        let back = read_tensors(&path).unwrap();
        assert_eq!(back["a"], tensors["a"]);
        assert_eq!(back["b"], tensors["b"]);
        let data = &bytes[8 + n as usize..];
        assert_eq!(&data[256..258], &half::bf16::from_f32(0.5).to_le_bytes());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
