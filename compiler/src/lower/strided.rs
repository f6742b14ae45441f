//! Lowering primitives that no fused kernel covers (the sentence-transformers head) to the CPU's
//! strided kernels (`kiln_kernels::cpu::strided`): each operand is resolved through its chain of
//! views (reshape of a contiguous value, permute, broadcast, slice) to the value that holds it,
//! an element offset and a stride per axis, so nothing is copied before the op reads it. These
//! ops have no GPU kernel: on the GPU they stay the plan's host tail.

use kiln_ir::{DType, Graph, NodeId, Op};
use kiln_kernels::cpu::strided::{Source, StridedConfig, StridedOp};

use super::{dims, CpuKernel, CpuLaunch, Operand};

/// How a value is read in place: from the storage of `root` (or a constant everywhere), at an
/// element offset, with a stride per axis of the value's own shape.
struct View {
    /// The value that holds the elements, or the constant.
    root: Result<NodeId, f32>,
    offset: i64,
    strides: Vec<i64>,
}

/// Row-major strides of `shape` (`kiln_ir::tensor::strides`, as the strided kernels' i64).
fn contiguous(shape: &[u32]) -> Vec<i64> {
    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    kiln_ir::tensor::strides(&shape)
        .into_iter()
        .map(|s| s as i64)
        .collect()
}

/// The strides of `to` reading the same elements in the same row-major order as `from` laid out
/// with `strides`, when that needs no copy: the axes of extent above 1 on both sides fall into
/// groups of equal product, and each group of `from` is contiguous within itself. Axes of extent
/// 1 get stride 0.
fn reshaped(from: &[u32], strides: &[i64], to: &[u32]) -> Option<Vec<i64>> {
    let old: Vec<(i64, i64)> = from
        .iter()
        .zip(strides)
        .filter(|(&n, _)| n != 1)
        .map(|(&n, &s)| (i64::from(n), s))
        .collect();
    let new: Vec<usize> = (0..to.len()).filter(|&d| to[d] != 1).collect();
    let mut out = vec![0i64; to.len()];
    let (mut i, mut j) = (0, 0);
    while i < old.len() && j < new.len() {
        let (i0, j0) = (i, j);
        let (mut have, mut want) = (old[i].0, i64::from(to[new[j]]));
        while have != want {
            if have < want {
                i += 1;
                have *= old.get(i)?.0;
            } else {
                j += 1;
                want *= i64::from(to[*new.get(j)?]);
            }
        }
        if (i0..i).any(|k| old[k].1 != old[k + 1].1 * old[k + 1].0) {
            return None;
        }
        let mut stride = old[i].1;
        for &d in new[j0..=j].iter().rev() {
            out[d] = stride;
            stride *= i64::from(to[d]);
        }
        i += 1;
        j += 1;
    }
    (i == old.len() && j == new.len()).then_some(out)
}

/// `id` read in place, or `None` when its layout is not a strided view of one value.
fn view(g: &Graph, id: NodeId) -> Option<View> {
    let node = g.node(id);
    let shape = dims(&node.ty)?;
    let src = |i: usize| view(g, node.args[i]);
    Some(match &node.op {
        Op::Scalar(v) => View {
            root: Err(*v as f32),
            offset: 0,
            strides: vec![0; shape.len()],
        },
        Op::Reshape(_) => {
            let v = src(0)?;
            let from = dims(g.ty(node.args[0]))?;
            View {
                strides: reshaped(&from, &v.strides, &shape)?,
                ..v
            }
        }
        Op::Permute(perm) => {
            let v = src(0)?;
            View {
                strides: perm.iter().map(|&p| v.strides[p]).collect(),
                ..v
            }
        }
        Op::Broadcast(_) => {
            let v = src(0)?;
            let from = dims(g.ty(node.args[0]))?;
            let lead = shape.len() - from.len();
            View {
                strides: (0..shape.len())
                    .map(|d| match d.checked_sub(lead) {
                        Some(j) if from[j] != 1 => v.strides[j],
                        _ => 0,
                    })
                    .collect(),
                ..v
            }
        }
        Op::Slice { axis, start, .. } => {
            let v = src(0)?;
            let start = start.as_const()?;
            View {
                offset: v.offset + start * v.strides[*axis],
                ..v
            }
        }
        Op::RepeatKv { .. } | Op::CacheWrite => return None,
        _ => View {
            root: Ok(id),
            offset: 0,
            strides: contiguous(&shape),
        },
    })
}

/// The strided source of `id` and the operand holding its elements (none for a constant).
fn source(g: &Graph, id: NodeId) -> Option<(Source, Option<Operand>)> {
    let v = view(g, id)?;
    Some(match v.root {
        Err(c) => (Source::Constant(c), None),
        Ok(root) => {
            let int = match g.ty(root).dtype {
                DType::F32 => false,
                DType::I64 => true,
                _ => return None,
            };
            let src = Source::Memory {
                int,
                offset: v.offset,
                strides: v.strides,
            };
            (src, Some(Operand::Value(root)))
        }
    })
}

/// One strided launch computing `op` over `shape` from `operands` into `out` (at `out_offset`,
/// with `out_strides`).
fn launch(
    g: &Graph,
    op: StridedOp,
    shape: Vec<u32>,
    operands: &[NodeId],
    out: Operand,
    out_offset: i64,
    out_strides: Vec<i64>,
) -> Option<CpuLaunch> {
    let mut sources = Vec::new();
    let mut args = Vec::new();
    for &a in operands {
        let (s, operand) = source(g, a)?;
        sources.push(s);
        args.extend(operand);
    }
    args.push(out);
    let config = StridedConfig {
        op,
        shape,
        sources,
        out_offset,
        out_strides,
    };
    Some(CpuLaunch {
        extent: config.rows(),
        kernel: CpuKernel::Strided(config),
        args,
    })
}

/// The CPU launches of primitive node `id` (f32 results of unary, binary, cast, reduce and
/// concat ops), or `None` when it is none of those.
pub fn lower_primitive(g: &Graph, id: NodeId) -> Option<Vec<CpuLaunch>> {
    let node = g.node(id);
    if node.ty.dtype != DType::F32 {
        return None;
    }
    let shape = dims(&node.ty)?;
    let out = Operand::Value(id);
    let whole = |op: StridedOp, operands: &[NodeId]| {
        let strides = contiguous(&shape);
        launch(g, op, shape.clone(), operands, out.clone(), 0, strides).map(|l| vec![l])
    };
    match &node.op {
        Op::Unary(u) => whole(StridedOp::Unary(*u), &node.args),
        Op::Binary(b) => whole(StridedOp::Binary(*b), &node.args),
        Op::Cast(DType::F32) => whole(StridedOp::Copy, &node.args),
        Op::Reduce { op, axis } => {
            let len = dims(g.ty(node.args[0]))?[*axis];
            let op = StridedOp::Reduce {
                op: *op,
                axis: *axis,
                len,
            };
            whole(op, &node.args)
        }
        Op::Concat(axis) => {
            // Each part copied into its slab of the output.
            let strides = contiguous(&shape);
            let mut start = 0i64;
            let mut launches = Vec::new();
            for &part in &node.args {
                let part_shape = dims(g.ty(part))?;
                let offset = start * strides[*axis];
                start += i64::from(part_shape[*axis]);
                launches.push(launch(
                    g,
                    StridedOp::Copy,
                    part_shape,
                    &[part],
                    out.clone(),
                    offset,
                    strides.clone(),
                )?);
            }
            Some(launches)
        }
        _ => None,
    }
}

/// A copy of view `id` (a graph output that is a strided view, such as a CLS slice) into the
/// contiguous buffer `out`.
pub fn materialize(g: &Graph, id: NodeId, out: Operand) -> Option<CpuLaunch> {
    let shape = dims(g.ty(id))?;
    if g.ty(id).dtype != DType::F32 {
        return None;
    }
    let strides = contiguous(&shape);
    launch(g, StridedOp::Copy, shape, &[id], out, 0, strides)
}

#[cfg(test)]
mod tests {
    use super::reshaped;

    #[test]
    fn reshapes_of_contiguous_values_stay_contiguous() {
        assert_eq!(reshaped(&[2, 3, 4], &[12, 4, 1], &[6, 4]), Some(vec![4, 1]));
        assert_eq!(
            reshaped(&[6, 4], &[4, 1], &[2, 3, 2, 2]),
            Some(vec![12, 4, 2, 1])
        );
    }

    #[test]
    fn axes_of_extent_one_come_and_go_on_any_view() {
        // The CLS slice `[B, 1, E]` of `[B, S, E]` (row stride S * E) reshaped to `[B, E]`.
        assert_eq!(
            reshaped(&[4, 1, 8], &[40, 8, 1], &[4, 8]),
            Some(vec![40, 1])
        );
        assert_eq!(reshaped(&[4, 8], &[0, 1], &[4, 1, 8]), Some(vec![0, 0, 1]));
    }

    #[test]
    fn merging_axes_that_are_not_adjacent_in_memory_needs_a_copy() {
        // A transpose flattened.
        assert_eq!(reshaped(&[3, 4], &[1, 3], &[12]), None);
        // Rows of a slice merged with the sliced axis.
        assert_eq!(reshaped(&[4, 5], &[9, 1], &[20]), None);
        // ... but splitting a strided axis is fine.
        assert_eq!(reshaped(&[4, 6], &[9, 1], &[4, 2, 3]), Some(vec![9, 3, 1]));
    }
}
