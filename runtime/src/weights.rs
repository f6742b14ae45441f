//! The artifact's `weights.safetensors`, memory-mapped and read by name into host tensors.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kiln_ir::artifact::MemoryPlan;
use kiln_ir::{Tensor, TensorType, WeightSource};
use memmap2::Mmap;
use safetensors::SafeTensors;

/// Memory-mapped weights.
pub struct WeightStore {
    mmap: Mmap,
    cache: Mutex<BTreeMap<String, Arc<Tensor>>>,
}

impl WeightStore {
    /// Checks that the mapped weights file `mmap` (whose checksum the caller verified) parses as
    /// safetensors.
    pub fn from_map(mmap: Mmap) -> Result<WeightStore, String> {
        SafeTensors::deserialize(&mmap).map_err(|e| format!("is not valid safetensors: {e}"))?;
        Ok(WeightStore {
            mmap,
            cache: Mutex::new(BTreeMap::new()),
        })
    }

    /// The data section, after checking that every tensor of the memory plan's weights region is
    /// in it at its planned offset with its planned type: the bytes a GPU executor uploads as the
    /// weights region, as they are.
    pub fn region(&self, plan: &MemoryPlan) -> Result<&[u8], String> {
        let st = SafeTensors::deserialize(&self.mmap).map_err(|e| e.to_string())?;
        let header = u64::from_le_bytes(self.mmap[..8].try_into().map_err(|_| "is truncated")?);
        let data = &self.mmap[8 + header as usize..];
        if data.len() as u64 != plan.weights_bytes {
            return Err(format!(
                "holds {} bytes of tensors; the memory plan expects {}",
                data.len(),
                plan.weights_bytes
            ));
        }
        for slot in &plan.weights {
            let view = st
                .tensor(&slot.name)
                .map_err(|_| format!("lacks the planned weight `{}`", slot.name))?;
            let offset = view.data().as_ptr() as usize - data.as_ptr() as usize;
            let dtype = kiln_ir::io::view_dtype(view.dtype());
            if offset as u64 != slot.offset
                || view.shape() != slot.shape.as_slice()
                || dtype != Some(slot.dtype)
            {
                return Err(format!(
                    "holds `{}` as {:?} {:?} at byte {offset}; the memory plan expects {} {:?} at byte {}",
                    slot.name,
                    view.dtype(),
                    view.shape(),
                    slot.dtype,
                    slot.shape,
                    slot.offset
                ));
            }
        }
        Ok(data)
    }
}

impl WeightStore {
    /// Drops the mapped pages of bytes `at..at + len` of the data section (see
    /// [`crate::Artifact::release_weights`]); advice the system may ignore.
    pub fn release(&self, at: usize, len: usize) {
        let Some(header) = self.mmap.get(..8) else {
            return;
        };
        let start = 8 + u64::from_le_bytes(header.try_into().expect("8 bytes")) as usize + at;
        let len = len.min(self.mmap.len().saturating_sub(start));
        // SAFETY: the mapping is read-only and backed by the file, so dropping its pages loses
        // nothing: a later read of them faults the same bytes in again from the file (which
        // artifacts never modify). memmap2 aligns the range to whole pages.
        let _ = unsafe {
            self.mmap
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
        };
    }

    /// A weights region laid out by `plan` whose f32 slots hold the file's tensors of the same
    /// names widened to f32 (the CPU plans of f16/bf16 builds), as 8-byte words.
    pub fn widened(&self, plan: &MemoryPlan) -> Result<Vec<u64>, String> {
        let st = SafeTensors::deserialize(&self.mmap).map_err(|e| e.to_string())?;
        let mut region = vec![0u64; plan.weights_bytes.div_ceil(8) as usize];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut region);
        for slot in &plan.weights {
            let view = st
                .tensor(&slot.name)
                .map_err(|_| format!("lacks the planned weight `{}`", slot.name))?;
            let t = kiln_ir::io::view_to_tensor(&slot.name, &view).map_err(|e| e.to_string())?;
            let values = t
                .as_f32()
                .filter(|_| slot.dtype == kiln_ir::DType::F32 && t.shape == slot.shape);
            let Some(values) = values else {
                return Err(format!(
                    "holds `{}` as {} {:?}; the CPU memory plan widens it to {} {:?}",
                    slot.name, t.dtype, t.shape, slot.dtype, slot.shape
                ));
            };
            let at = slot.offset as usize;
            let dst = bytes.get_mut(at..at + 4 * values.len()).ok_or_else(|| {
                format!(
                    "`{}` lies past the CPU memory plan's weights region",
                    slot.name
                )
            })?;
            for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(region)
    }
}

impl WeightSource for WeightStore {
    fn load(&self, name: &str, ty: &TensorType) -> Result<Arc<Tensor>, String> {
        if let Some(t) = self.cache.lock().map_err(|e| e.to_string())?.get(name) {
            return Ok(t.clone());
        }
        let st = SafeTensors::deserialize(&self.mmap).map_err(|e| e.to_string())?;
        let view = st
            .tensor(name)
            .map_err(|_| format!("no weight `{name}` in the artifact"))?;
        let values = kiln_ir::io::view_to_tensor(name, &view).map_err(|e| e.to_string())?;
        if values.dtype != ty.dtype {
            return Err(format!(
                "`{name}` is {} in the artifact, the graph reads {}",
                values.dtype, ty.dtype
            ));
        }
        let t = Arc::new(values);
        self.cache
            .lock()
            .map_err(|e| e.to_string())?
            .insert(name.to_string(), t.clone());
        Ok(t)
    }
}
