//! A Hugging Face checkpoint folder: `config.json` plus `model.safetensors` or a sharded set
//! described by `model.safetensors.index.json`, memory-mapped and read lazily.

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

/// Where one tensor lives: which mapped file, and its header entry.
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
    files: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, TensorLocation>,
    /// Tensors already converted for the interpreter.
    cache: Mutex<BTreeMap<String, Arc<Tensor>>>,
    /// Opened without weights (`open_config_only`): shapes are taken on trust.
    config_only: bool,
}

impl Checkpoint {
    /// Opens `dir`: parses `config.json` and maps every safetensors file.
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
            // SAFETY: the mapping is read-only and kiln never writes checkpoint files; a file
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
            files.push((path, mmap));
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
            other => Err(ModelError::TensorDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// Reads tensor `name` as f32 values (converting f16 / bf16).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let loc = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (path, mmap) = &self.files[loc.file];
        let (begin, end) = loc.info.data_offsets;
        let bytes = mmap
            .get(loc.data_start + begin..loc.data_start + end)
            .ok_or_else(|| ModelError::Safetensors {
                path: path.clone(),
                message: format!("tensor `{name}` lies beyond the end of the file"),
            })?;
        Ok(match loc.info.dtype {
            StDtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StDtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::TensorDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
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
        let values = self.read_f32(name).map_err(|e| e.to_string())?;
        let shape = self.shape(name).unwrap_or_default().to_vec();
        let t = Arc::new(Tensor::f32(shape, values).cast(ty.dtype));
        self.cache
            .lock()
            .map_err(|e| e.to_string())?
            .insert(name.to_string(), t.clone());
        Ok(t)
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
