//! A Hugging Face checkpoint folder: `config.json` plus `model.safetensors` or a sharded set
//! described by `model.safetensors.index.json`. Headers are read at open; a tensor's bytes are read
//! (not mapped) when asked for, so reading a whole model one tensor at a time holds one tensor.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use kiln_ir::{DType, Tensor, TensorType, WeightSource};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use crate::ModelError;

/// Where one tensor lives: which file, and its header entry.
struct TensorLocation {
    file: usize,
    /// Start of the data section in the file (8 + header length).
    data_start: usize,
    info: TensorInfo,
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    config: Value,
    files: Vec<(PathBuf, File)>,
    tensors: BTreeMap<String, TensorLocation>,
    /// Tensors already converted for the interpreter.
    cache: Mutex<BTreeMap<String, Arc<Tensor>>>,
    /// Opened without weights (`open_config_only`): shapes are taken on trust.
    config_only: bool,
}

impl Checkpoint {
    /// Opens `dir`: parses `config.json` and the header of every safetensors file.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::NotAFolder(dir.to_path_buf()));
        }
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if single.is_file() {
            vec!["model.safetensors".to_string()]
        } else if index.is_file() {
            let idx = read_json(&index)?;
            let map = idx
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ModelError::Json {
                    path: index.clone(),
                    message: "no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            return Err(ModelError::NoWeights(dir.to_path_buf()));
        };
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        for name in shard_names {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::Json {
                    path: index.clone(),
                    message: format!("shard name `{name}` leaves the folder"),
                });
            }
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|error| ModelError::Io {
                path: path.clone(),
                error,
            })?;
            // SAFETY: the mapping is read-only, kiln never writes checkpoint files, and it lives
            // only while the header is parsed (and checked against the file's length); a file
            // truncated underneath us by another process is outside what any reader can defend.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|error| ModelError::Io {
                path: path.clone(),
                error,
            })?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            let file_idx = files.len();
            for (tname, info) in metadata.tensors() {
                tensors.insert(
                    tname,
                    TensorLocation {
                        file: file_idx,
                        data_start: 8 + header_len,
                        info: info.clone(),
                    },
                );
            }
            drop(mmap);
            files.push((path, file));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            files,
            tensors,
            cache: Mutex::new(BTreeMap::new()),
            config_only: false,
        })
    }

    /// Opens only `config.json`, for plan-only compilation: every weight the architecture needs is
    /// assumed present with the shape the config implies, and none can be read.
    pub fn open_config_only(dir: &Path) -> Result<Checkpoint, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::NotAFolder(dir.to_path_buf()));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config: read_json(&dir.join("config.json"))?,
            files: Vec::new(),
            tensors: BTreeMap::new(),
            cache: Mutex::new(BTreeMap::new()),
            config_only: true,
        })
    }

    /// True when the weights were read (not a plan-only checkpoint).
    pub fn has_weights(&self) -> bool {
        !self.config_only
    }

    /// The folder this checkpoint was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// True when the checkpoint holds a tensor named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.info.shape.as_slice())
    }

    /// The stored dtype of tensor `name`, if kiln reads it.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        match self.tensors.get(name)?.info.dtype {
            StDtype::F32 => Some(DType::F32),
            StDtype::F16 => Some(DType::F16),
            StDtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Checks that tensor `name` exists with shape `expected` and a float dtype kiln reads.
    pub fn expect(&self, name: &str, expected: &[usize]) -> Result<(), ModelError> {
        if self.config_only {
            return Ok(());
        }
        let loc = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        if loc.info.shape != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: loc.info.shape.clone(),
            });
        }
        match loc.info.dtype {
            StDtype::F32 | StDtype::F16 | StDtype::BF16 => Ok(()),
            other => Err(dtype_error(name, other)),
        }
    }

    /// Where tensor `name` is stored: its file, its dtype and its bytes' place in the file.
    fn locate(&self, name: &str) -> Result<(&PathBuf, &File, StDtype, u64, usize), ModelError> {
        let loc = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (path, file) = &self.files[loc.file];
        let (begin, end) = loc.info.data_offsets;
        Ok((
            path,
            file,
            loc.info.dtype,
            (loc.data_start + begin) as u64,
            end - begin,
        ))
    }

    /// Reads `buf.len()` bytes at `at` of `file`.
    fn read_at(path: &Path, file: &File, buf: &mut [u8], at: u64) -> Result<(), ModelError> {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, at).map_err(|error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        })
    }

    /// The stored bytes of tensor `name` and their dtype.
    fn raw(&self, name: &str) -> Result<(StDtype, Vec<u8>), ModelError> {
        let (path, file, dtype, at, len) = self.locate(name)?;
        let mut bytes = vec![0u8; len];
        Self::read_at(path, file, &mut bytes, at)?;
        Ok((dtype, bytes))
    }

    /// Reads tensor `name` as f32 values (converting f16 / bf16).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (stored, bytes) = self.raw(name)?;
        let width = float_width(name, stored)?;
        Ok(bytes
            .chunks_exact(width)
            .map(|b| stored_value(stored, b))
            .collect())
    }

    /// Tensor `name` as little-endian bytes of the float `dtype` (see [`Checkpoint::read_into`]).
    pub fn read_as(&self, name: &str, dtype: DType) -> Result<Vec<u8>, ModelError> {
        let elements: usize = self.shape(name).unwrap_or_default().iter().product();
        let mut out = vec![0u8; elements * dtype.size_bytes()];
        self.read_into(name, dtype, &mut out)?;
        Ok(out)
    }

    /// Reads tensor `name` into `out` as little-endian bytes of the float `dtype`: the stored
    /// bytes when it is stored so (straight from the file), else each value converted (rounded to
    /// nearest even) a piece at a time, without an f32 copy of the tensor; the same bits as
    /// reading it as f32 and casting. `out` must hold the tensor exactly.
    pub fn read_into(&self, name: &str, dtype: DType, out: &mut [u8]) -> Result<(), ModelError> {
        self.read_scaled_into(name, dtype, None, out)
    }

    /// [`Checkpoint::read_into`], each value first multiplied in f32 by `scale[i % scale.len()]`
    /// when `scale` is given (a row-major matrix's columns scaled, e.g. by a norm's weight), then
    /// rounded once: the same bits as reading it as f32, scaling and casting.
    pub fn read_scaled_into(
        &self,
        name: &str,
        dtype: DType,
        scale: Option<&[f32]>,
        out: &mut [u8],
    ) -> Result<(), ModelError> {
        let (path, file, stored, at, len) = self.locate(name)?;
        let width = float_width(name, stored)?;
        if out.len() != len / width * dtype.size_bytes() {
            return Err(ModelError::Input(format!(
                "tensor `{name}` is {len} bytes of {stored:?}, not {} bytes of {dtype}",
                out.len()
            )));
        }
        if scale.is_some_and(|s| s.is_empty() || len / width % s.len() != 0) {
            return Err(ModelError::Input(format!(
                "tensor `{name}` has no whole rows of {} columns to scale",
                scale.map_or(0, <[f32]>::len)
            )));
        }
        if self.dtype(name) == Some(dtype) && scale.is_none() {
            return Self::read_at(path, file, out, at);
        }
        // Converted a piece at a time: what is held besides `out` is one piece of stored bytes.
        const PIECE: usize = 16 << 20;
        let size = dtype.size_bytes();
        let per_piece = PIECE / width;
        let mut stored_bytes = vec![0u8; PIECE.min(len)];
        for (i, dst) in out.chunks_mut(per_piece * size).enumerate() {
            let src = &mut stored_bytes[..dst.len() / size * width];
            Self::read_at(path, file, src, at + (i * per_piece * width) as u64)?;
            // The column of the piece's first value, then counted along (no division per value).
            let mut col = scale.map_or(0, |s| i * per_piece % s.len());
            for (b, o) in src.chunks_exact(width).zip(dst.chunks_exact_mut(size)) {
                let v = match scale {
                    Some(s) => {
                        let v = stored_value(stored, b) * s[col];
                        col = if col + 1 == s.len() { 0 } else { col + 1 };
                        v
                    }
                    None => stored_value(stored, b),
                };
                match dtype {
                    DType::F16 => o.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                    DType::BF16 => o.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    _ => o.copy_from_slice(&v.to_le_bytes()),
                }
            }
        }
        Ok(())
    }

    /// Tensor `name` in the graph's type `ty`, read now and not kept.
    pub fn read_tensor(&self, name: &str, ty: &TensorType) -> Result<Tensor, ModelError> {
        let values = self.read_f32(name)?;
        let shape = self.shape(name).unwrap_or_default().to_vec();
        Ok(Tensor::f32(shape, values).cast(ty.dtype))
    }

    /// The dtype the checkpoint stores its float weights in (the most common one).
    pub fn weight_dtype(&self) -> DType {
        let mut counts = BTreeMap::new();
        for loc in self.tensors.values() {
            *counts
                .entry(format!("{:?}", loc.info.dtype))
                .or_insert(0usize) += 1;
        }
        let top = counts.into_iter().max_by_key(|(_, c)| *c).map(|(d, _)| d);
        match top.as_deref() {
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            _ => DType::F32,
        }
    }
}

impl WeightSource for Checkpoint {
    fn load(&self, name: &str, ty: &TensorType) -> Result<Arc<Tensor>, String> {
        if let Some(t) = self.cache.lock().map_err(|e| e.to_string())?.get(name) {
            return Ok(t.clone());
        }
        let t = Arc::new(self.read_tensor(name, ty).map_err(|e| e.to_string())?);
        self.cache
            .lock()
            .map_err(|e| e.to_string())?
            .insert(name.to_string(), t.clone());
        Ok(t)
    }
}

/// Bytes per value of a float dtype kiln reads.
fn float_width(name: &str, dtype: StDtype) -> Result<usize, ModelError> {
    match dtype {
        StDtype::F32 => Ok(4),
        StDtype::F16 | StDtype::BF16 => Ok(2),
        other => Err(dtype_error(name, other)),
    }
}

/// One stored value (`b` is its bytes, of a dtype [`float_width`] accepted) as f32.
fn stored_value(dtype: StDtype, b: &[u8]) -> f32 {
    match dtype {
        StDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        StDtype::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

fn dtype_error(name: &str, dtype: StDtype) -> ModelError {
    ModelError::TensorDtype {
        name: name.to_string(),
        dtype: format!("{dtype:?}"),
    }
}

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint in a fresh folder named after `what`, holding the f32 tensor `w` of `shape`
    /// with values from `value`; returns it, the folder and the values.
    fn f32_checkpoint(
        what: &str,
        shape: Vec<usize>,
        value: impl Fn(usize) -> f32,
    ) -> (Checkpoint, std::path::PathBuf, Vec<f32>) {
        let dir = std::env::temp_dir().join(format!("kiln-ckpt-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let values: Vec<f32> = (0..shape.iter().product()).map(value).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(StDtype::F32, shape, &bytes).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &dir.join("model.safetensors"))
            .unwrap();
        (Checkpoint::open(&dir).unwrap(), dir, values)
    }

    #[test]
    fn conversions_read_in_pieces_match_casting_every_value() {
        // More than one 16 MiB piece of f32, ending in a partial one.
        let n = (5 << 20) + 3;
        let (ck, dir, values) = f32_checkpoint("cast", vec![n], |i| (i as f32 * 0.37).sin() * 3.0);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; 2 * n];
        ck.read_into("w", DType::BF16, &mut out).unwrap();
        let want: Vec<u8> = values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        assert!(out == want, "bf16 bytes differ");
        assert_eq!(ck.read_as("w", DType::F32).unwrap(), bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn scaled_reads_multiply_each_column_then_round_once() {
        // Rows of 1000 columns over more than one piece, a piece ending inside a row.
        let (rows, cols) = (4200, 1000);
        let (ck, dir, values) =
            f32_checkpoint("scale", vec![rows, cols], |i| (i as f32 * 0.11).cos() * 2.0);
        let scale: Vec<f32> = (0..cols).map(|c| 0.5 + c as f32 / 300.0).collect();
        for dtype in [DType::BF16, DType::F32] {
            let mut out = vec![0u8; rows * cols * dtype.size_bytes()];
            ck.read_scaled_into("w", dtype, Some(&scale), &mut out)
                .unwrap();
            let scaled = values.iter().enumerate().map(|(i, v)| v * scale[i % cols]);
            let want: Vec<u8> = match dtype {
                DType::BF16 => scaled
                    .flat_map(|v| bf16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => scaled.flat_map(|v| v.to_le_bytes()).collect(),
            };
            assert!(out == want, "{dtype}: scaled bytes differ");
        }
        let mut out = vec![0u8; rows * cols * 2];
        let err = ck
            .read_scaled_into("w", DType::BF16, Some(&scale[1..]), &mut out)
            .unwrap_err();
        assert!(
            err.to_string().contains("no whole rows of 999 columns"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
