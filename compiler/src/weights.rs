//! Writing `weights.safetensors`, streamed: every weight the bucket graphs read is read from the
//! checkpoint, transformed (cast to the compiled dtype, folded definitions evaluated: the Q/K/V and
//! gate/up concatenations, transposed Conv1D weights, norm weights moved into products) and
//! written at its planned offset, one group at a time, hashed on the way out. The header is known
//! from the memory plan before any tensor is, so the file is written front to back and never
//! read back; no stage holds the whole model.
//!
//! Tensors are transformed in parallel within a group whose estimated footprint stays under
//! [`BUDGET`] (a tensor larger than that is a group of its own), so the peak is about the budget
//! or the largest transformed tensor, whichever is larger, whatever the model's size.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use kiln_ir::artifact::{TensorSlot, ALIGN};
use kiln_ir::checksum::Digester;
use kiln_ir::io::AlignedWriter;
use kiln_ir::{Graph, NodeId, Op, Tensor, TensorType, WeightSource};
use kiln_models::Checkpoint;
use rayon::prelude::*;

use crate::plan::ArtifactPlan;

/// Bytes of transformed tensors (and what transforming them takes) in flight at once.
pub const BUDGET: u64 = 768 << 20;

/// Writes the weights of `plan` read from `checkpoint` to `path`, calling `progress` with the
/// bytes of each tensor as it is written; returns the file's digest.
pub fn write_weights(
    path: &Path,
    checkpoint: &Checkpoint,
    plan: &ArtifactPlan,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<String> {
    let layout = &plan.memory.weights;
    let file = File::create(path).map_err(|e| anyhow!("cannot write {}: {e}", path.display()))?;
    let out = Hashed {
        file,
        digest: Digester::new(),
    };
    let mut writer = AlignedWriter::new(out, layout, ALIGN)?;
    for group in groups(layout, plan, checkpoint) {
        let bytes: Vec<Vec<u8>> = group
            .par_iter()
            .map(|slot| transformed(slot, plan, checkpoint))
            .collect::<Result<_>>()?;
        for b in bytes {
            writer.put(&b)?;
            progress(b.len() as u64);
        }
    }
    // No fsync: an artifact whose weights a power loss tore fails its checksum at open, and
    // waiting for the disk would double the time of a compile.
    Ok(writer.finish()?.digest.finish())
}

/// The file, and the digest of everything written to it.
struct Hashed {
    file: File,
    digest: Digester,
}

impl Write for Hashed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write_all(buf)?;
        self.digest.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// `layout` cut into runs of slots whose footprints add up to at most [`BUDGET`].
fn groups<'a>(
    layout: &'a [TensorSlot],
    plan: &ArtifactPlan,
    checkpoint: &Checkpoint,
) -> Vec<&'a [TensorSlot]> {
    cut(layout, |slot| footprint(slot, plan, checkpoint))
}

/// `layout` cut into runs whose `cost` adds up to at most [`BUDGET`] (a slot costing more than
/// that is a run of its own).
fn cut(layout: &[TensorSlot], cost: impl Fn(&TensorSlot) -> u64) -> Vec<&[TensorSlot]> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0u64);
    for (i, slot) in layout.iter().enumerate() {
        let cost = cost(slot);
        if i > start && sum + cost > BUDGET {
            out.push(&layout[start..i]);
            (start, sum) = (i, 0);
        }
        sum += cost;
    }
    if start < layout.len() {
        out.push(&layout[start..]);
    }
    out
}

/// Bytes held while `slot` is transformed: the result, plus a piece of the stored tensor when it
/// is converted or read into place (a concatenation, columns scaled), else, when it is folded,
/// the interpreter's f32 copies of inputs and result and the rounded copy of the result.
fn footprint(slot: &TensorSlot, plan: &ArtifactPlan, checkpoint: &Checkpoint) -> u64 {
    let elements = slot.shape.iter().product::<usize>() as u64;
    let bytes = slot.bytes();
    match plan.folded.get(&slot.name) {
        // Read straight into place, a piece of stored bytes at a time.
        Some(def) if leading_concat(def).is_some() || scaled_columns(def).is_some() => {
            return bytes + (16 << 20);
        }
        Some(_) => return bytes + 12 * elements,
        None if plan.tables.contains_key(&slot.name) => return bytes + 12 * elements,
        None => {}
    }
    match checkpoint.dtype(&slot.name) {
        // A conversion reads the stored tensor 16 MiB at a time.
        Some(stored) if stored != slot.dtype => {
            bytes + (elements * stored.size_bytes() as u64).min(16 << 20)
        }
        _ => bytes,
    }
}

/// The bytes of `slot`: a RoPE table, a folded weight (read in place when it concatenates
/// weights along their first axis, else evaluated from its definition), or a checkpoint tensor in
/// the compiled dtype.
fn transformed(slot: &TensorSlot, plan: &ArtifactPlan, checkpoint: &Checkpoint) -> Result<Vec<u8>> {
    let name = &slot.name;
    if let Some(parts) = plan.folded.get(name).and_then(leading_concat) {
        return concatenated(slot, &parts, None, checkpoint);
    }
    if let Some((parts, gamma)) = plan.folded.get(name).and_then(scaled_columns) {
        let scale = checkpoint
            .read_f32(gamma)
            .map_err(|e| anyhow!("folded weight `{name}`: {e}"))?;
        return concatenated(slot, &parts, Some(&scale), checkpoint);
    }
    let tensor = if let Some(t) = plan.tables.get(name) {
        t.clone()
    } else if let Some(def) = plan.folded.get(name) {
        // In f32 from the checkpoint's values, rounded once to the stored dtype (a norm's weight
        // moved into a product's is one rounding of their product, not three).
        let wide = crate::widen::widen(def).map_err(|e| anyhow!("folded weight `{name}`: {e}"))?;
        let mut out = kiln_ir::evaluate(&wide, &BTreeMap::new(), &Unkept(checkpoint))
            .map_err(|e| anyhow!("folded weight `{name}`: {e}"))?;
        out.remove(crate::fold::VALUE)
            .ok_or_else(|| anyhow!("folded weight `{name}` has no value"))?
            .cast(slot.dtype)
    } else {
        if checkpoint.shape(name) != Some(slot.shape.as_slice()) {
            bail!(
                "weight `{name}` is {:?} in the checkpoint, planned {:?}",
                checkpoint.shape(name),
                slot.shape
            );
        }
        return checkpoint
            .read_as(name, slot.dtype)
            .map_err(|e| anyhow!("weight `{name}`: {e}"));
    };
    if tensor.dtype != slot.dtype || tensor.shape != slot.shape {
        bail!(
            "`{name}` is {} {:?}, planned {} {:?}",
            tensor.dtype,
            tensor.shape,
            slot.dtype,
            slot.shape
        );
    }
    Ok(kiln_ir::io::tensor_bytes(&tensor))
}

/// The weights (name, type) a folded definition concatenates along their first axis, when that
/// is all it does: row-major, the result is their bytes one after another.
fn leading_concat(def: &Graph) -> Option<Vec<(&str, &TensorType)>> {
    let value = def
        .outputs()
        .iter()
        .find(|o| o.name == crate::fold::VALUE)?;
    let node = def.node(value.node);
    if node.op != Op::Concat(0) {
        return None;
    }
    weights(def, &node.args)
}

/// The name and type of each of `args`, when all are weights.
fn weights<'a>(def: &'a Graph, args: &[NodeId]) -> Option<Vec<(&'a str, &'a TensorType)>> {
    args.iter()
        .map(|&a| match &def.node(a).op {
            Op::Weight(w) => Some((w.as_str(), def.ty(a))),
            _ => None,
        })
        .collect()
}

/// The weights (name, type) of a folded definition that scales the columns of a weight, or of
/// weights concatenated along their first axis, by a vector weight (a norm's weight moved into
/// the product that reads the norm, `fold::scales_by_norm`), and that vector's name.
fn scaled_columns(def: &Graph) -> Option<(Vec<(&str, &TensorType)>, &str)> {
    let value = def
        .outputs()
        .iter()
        .find(|o| o.name == crate::fold::VALUE)?;
    let node = def.node(value.node);
    let (Op::Binary(kiln_ir::BinaryOp::Mul), [matrix, scale]) = (&node.op, node.args.as_slice())
    else {
        return None;
    };
    let scale = def.node(*scale);
    let Op::Broadcast(_) = scale.op else {
        return None;
    };
    let Op::Weight(gamma) = &def.node(scale.args[0]).op else {
        return None;
    };
    if def.ty(scale.args[0]).rank() != 1 {
        return None;
    }
    let parts = match &def.node(*matrix).op {
        Op::Weight(_) => weights(def, &[*matrix])?,
        Op::Concat(0) => weights(def, &def.node(*matrix).args)?,
        _ => return None,
    };
    Some((parts, gamma.as_str()))
}

/// `slot`'s bytes as `parts` read one after another straight into place, each value multiplied
/// by `scale` along the last axis first when given (in f32, rounded once).
fn concatenated(
    slot: &TensorSlot,
    parts: &[(&str, &TensorType)],
    scale: Option<&[f32]>,
    checkpoint: &Checkpoint,
) -> Result<Vec<u8>> {
    let mut out = vec![0u8; slot.bytes() as usize];
    let mut at = 0usize;
    for (name, ty) in parts {
        let shape: Vec<usize> = ty
            .shape
            .iter()
            .filter_map(|d| d.as_const())
            .map(|d| d as usize)
            .collect();
        if checkpoint.shape(name) != Some(shape.as_slice()) || ty.dtype != slot.dtype {
            bail!(
                "folded weight `{}`: `{name}` is {:?} in the checkpoint, its definition reads {ty}",
                slot.name,
                checkpoint.shape(name)
            );
        }
        let len = shape.iter().product::<usize>() * ty.dtype.size_bytes();
        let dst = out
            .get_mut(at..at + len)
            .ok_or_else(|| anyhow!("folded weight `{}` is smaller than its parts", slot.name))?;
        checkpoint
            .read_scaled_into(name, ty.dtype, scale, dst)
            .map_err(|e| anyhow!("folded weight `{}`: {e}", slot.name))?;
        at += len;
    }
    if at != out.len() {
        bail!("folded weight `{}` is larger than its parts", slot.name);
    }
    Ok(out)
}

/// The checkpoint as the interpreter's weight source, keeping nothing it reads: a folded weight's
/// inputs are read for it alone.
struct Unkept<'a>(&'a Checkpoint);

impl WeightSource for Unkept<'_> {
    fn load(&self, name: &str, ty: &TensorType) -> Result<Arc<Tensor>, String> {
        let t = self.0.read_tensor(name, ty).map_err(|e| e.to_string())?;
        Ok(Arc::new(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::DType;

    #[test]
    fn budget_groups_are_runs_of_the_layout() {
        let slot = |name: &str, mib: usize| TensorSlot {
            name: name.into(),
            offset: 0,
            dtype: DType::BF16,
            shape: vec![mib << 19],
        };
        let layout = vec![slot("a", 300), slot("b", 300), slot("c", 900), slot("d", 1)];
        let plan_groups = cut(&layout, |s| s.bytes());
        let names: Vec<Vec<&str>> = plan_groups
            .iter()
            .map(|g| g.iter().map(|s| s.name.as_str()).collect())
            .collect();
        assert_eq!(names, [vec!["a", "b"], vec!["c"], vec!["d"]]);
    }
}
