//! Weight folding: every value computed from weights alone (the concatenated Q/K/V or gate/up
//! weights that let a layer be one product) becomes a weight of its own, computed once when the
//! artifact is written, so no executor ever computes it at load or per request.
//!
//! A folded weight is named after what it computes (`Concat(0)[a,b,c]`), so buckets that fold the
//! same value share one tensor; its definition is kept as a small graph with one output,
//! `value`, that the artifact writer evaluates with the reference interpreter.
//!
//! Weights are also stored the way the kernels read them best: a product's weight stored `[K, N]`
//! (GPT-2's `Conv1D`) is transposed once, here, to `[N, K]`, which is the layout the tensor-core
//! GEMM and the decode GEMV take (rows contiguous along the contraction).

use std::collections::BTreeMap;

use kiln_ir::{Graph, IrError, NodeId, Op};

/// The output name of a folded weight's definition graph.
pub const VALUE: &str = "value";

/// A graph with its weight-only values folded, and the definition of each folded weight.
pub struct Folded {
    /// The graph, reading folded values as weights; unused weights are gone.
    pub graph: Graph,
    /// Folded weight name -> a graph computing it (output [`VALUE`]) from checkpoint weights.
    pub definitions: BTreeMap<String, Graph>,
}

/// Folds the weight-only values of `g` that a run-time value (or an output) reads, after storing
/// every product's weight `[N, K]`.
pub fn fold_weights(g: &Graph) -> Result<Folded, IrError> {
    let g = &weights_n_by_k(g)?.0;
    let n = g.len();
    let mut weight_only = vec![false; n];
    for (id, node) in g.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
    }
    // A weight-only value is needed as such when something computed at run time reads it.
    let mut needed = vec![false; n];
    for (_, node) in g.nodes().filter(|(id, _)| !weight_only[id.index()]) {
        for a in &node.args {
            needed[a.index()] = true;
        }
    }
    for o in g.outputs() {
        needed[o.node.index()] = true;
    }
    let mut out = Graph::new();
    let mut definitions = BTreeMap::new();
    let mut map: Vec<Option<NodeId>> = vec![None; n];
    for (id, node) in g.nodes() {
        let i = id.index();
        if weight_only[i] && !needed[i] {
            continue;
        }
        let new = if weight_only[i] && !node.op.is_leaf() {
            let name = describe(g, id);
            if !definitions.contains_key(&name) {
                let mut def = Graph::new();
                let value = copy_subgraph(g, id, &mut def, &mut BTreeMap::new())?;
                def.set_output(VALUE, value)?;
                definitions.insert(name.clone(), def);
            }
            out.weight(&name, node.ty.dtype, node.ty.shape.clone())?
        } else if node.op.is_leaf() {
            copy_leaf(&node.op, &node.ty, &mut out)?
        } else {
            let args: Vec<NodeId> = node
                .args
                .iter()
                .map(|a| map[a.index()].expect("operands of run-time values are kept"))
                .collect();
            out.add(node.op.clone(), &args)?
        };
        map[i] = Some(new);
    }
    for o in g.outputs() {
        out.set_output(&o.name, map[o.node.index()].expect("outputs are kept"))?;
    }
    Ok(Folded {
        graph: out,
        definitions,
    })
}

/// `g` with its products' weights stored as the kernels read them: every product whose weight
/// (a weight-only `[K, N]` matrix) is not transposed rewritten to read `permute([1, 0], w)` with
/// `transpose_b`, and every product with an RMSNorm prologue whose weight matrix nothing else
/// reads taking the norm's weight into its columns ([`scales_by_norm`]): the same products.
/// Also returns where each node of `g` went.
pub(crate) fn weights_n_by_k(g: &Graph) -> Result<(Graph, Vec<NodeId>), IrError> {
    let mut weight_only = vec![false; g.len()];
    let mut consumers: Vec<Vec<NodeId>> = vec![Vec::new(); g.len()];
    for (id, node) in g.nodes() {
        for a in &node.args {
            consumers[a.index()].push(id);
        }
    }
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    for (id, node) in g.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
        let new = if node.op.is_leaf() {
            copy_leaf(&node.op, &node.ty, &mut out)?
        } else {
            let mut args: Vec<NodeId> = node.args.iter().map(|a| map[a.index()]).collect();
            let mut op = node.op.clone();
            if let Op::Gemm(spec) = &mut op {
                let w = node.args[1];
                if !spec.transpose_b && weight_only[w.index()] && g.ty(w).rank() == 2 {
                    args[1] = out.add(Op::Permute(vec![1, 0]), &[args[1]])?;
                    spec.transpose_b = true;
                }
                if scales_by_norm(g, id, &weight_only, &consumers) {
                    let gamma = args.len() - 1;
                    args[1] = out.mul(args[1], args[gamma])?;
                    let one = out.scalar(1.0, out.ty(args[gamma]).dtype);
                    args[gamma] = out.broadcast_to(one, &out.ty(args[gamma]).shape.clone())?;
                }
            }
            out.add(op, &args)?
        };
        map.push(new);
    }
    for o in g.outputs() {
        out.set_output(&o.name, map[o.node.index()])?;
    }
    Ok((out, map))
}

/// Whether the product `gemm` of `g` takes its RMSNorm prologue's weight `gamma` into its own
/// weight `w`, stored `[N, K]` (`w * gamma` along K, computed when the artifact is written), reading a
/// weight of ones in its place: `w (x * r * gamma) = (w * gamma) (x * r)`, so that a kernel that
/// folds the norm (`gemv::folds_norm`) only scales its sums by `r`. Only where nothing else reads
/// `w` or the weights it is computed from (a tied LM head keeps the embedding table it shares),
/// so that no weight is stored twice; a product already reading ones is left as it is.
fn scales_by_norm(
    g: &Graph,
    gemm: NodeId,
    weight_only: &[bool],
    consumers: &[Vec<NodeId>],
) -> bool {
    let node = g.node(gemm);
    let Op::Gemm(spec) = &node.op else {
        return false;
    };
    let rms = spec
        .prologue
        .as_ref()
        .is_some_and(|p| p.kind == kiln_ir::kernel::NormKind::RmsNorm && !p.residual);
    let (w, gamma) = (node.args[1], node.args[node.args.len() - 1]);
    if !rms || !weight_only[w.index()] || g.ty(w).rank() != 2 || is_ones(g, gamma) {
        return false;
    }
    // Every value `w` is computed from is read only on the way to `w`, and `w` only by `gemm`.
    let mut from = vec![w];
    let mut inside = std::collections::BTreeSet::from([w]);
    while let Some(v) = from.pop() {
        for a in &g.node(v).args {
            if inside.insert(*a) {
                from.push(*a);
            }
        }
    }
    inside.iter().all(|v| {
        consumers[v.index()]
            .iter()
            .all(|c| inside.contains(c) || (*v == w && *c == gemm))
    })
}

/// Whether `id` of `g` is a weight of ones ([`scales_by_norm`]'s): the broadcast constant, or
/// the weight [`fold_weights`] makes of it.
pub(crate) fn is_ones(g: &Graph, id: NodeId) -> bool {
    let node = g.node(id);
    match &node.op {
        Op::Broadcast(_) => matches!(g.node(node.args[0]).op, Op::Scalar(v) if v == 1.0),
        Op::Weight(name) => {
            let mut def = Graph::new();
            let one = def.scalar(1.0, node.ty.dtype);
            def.broadcast_to(one, &node.ty.shape)
                .is_ok_and(|ones| *name == describe(&def, ones))
        }
        _ => false,
    }
}

/// A leaf of another graph, added to `out`.
fn copy_leaf(op: &Op, ty: &kiln_ir::TensorType, out: &mut Graph) -> Result<NodeId, IrError> {
    match op {
        Op::Input(name) => out.input(name, ty.dtype, ty.shape.clone()),
        Op::Weight(name) => out.weight(name, ty.dtype, ty.shape.clone()),
        Op::Scalar(v) => Ok(out.scalar(*v, ty.dtype)),
        other => out.add(other.clone(), &[]),
    }
}

/// Copies the subgraph computing `id` into `out`.
fn copy_subgraph(
    g: &Graph,
    id: NodeId,
    out: &mut Graph,
    done: &mut BTreeMap<NodeId, NodeId>,
) -> Result<NodeId, IrError> {
    if let Some(&d) = done.get(&id) {
        return Ok(d);
    }
    let node = g.node(id);
    let new = if node.op.is_leaf() {
        copy_leaf(&node.op, &node.ty, out)?
    } else {
        let args = node
            .args
            .iter()
            .map(|a| copy_subgraph(g, *a, out, done))
            .collect::<Result<Vec<_>, _>>()?;
        out.add(node.op.clone(), &args)?
    };
    done.insert(id, new);
    Ok(new)
}

/// The name of a weight-only value: its op and, in brackets, its operands' names.
fn describe(g: &Graph, id: NodeId) -> String {
    let node = g.node(id);
    match &node.op {
        Op::Weight(name) => name.clone(),
        Op::Scalar(v) => format!("{v}"),
        op => {
            let args: Vec<String> = node.args.iter().map(|a| describe(g, *a)).collect();
            format!("{op:?}[{}]", args.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::{DType, Dim};

    #[test]
    fn k_by_n_product_weights_are_stored_transposed() {
        let mut g = Graph::new();
        let x = g
            .input("x", DType::F32, vec![Dim::from(2i64), Dim::from(4i64)])
            .unwrap();
        let w = g
            .weight("w", DType::F32, vec![Dim::from(4i64), Dim::from(3i64)])
            .unwrap();
        let y = g
            .add(Op::Gemm(kiln_ir::kernel::GemmSpec::plain(false)), &[x, w])
            .unwrap();
        g.set_output("y", y).unwrap();
        let folded = fold_weights(&g).unwrap();
        let names: Vec<&str> = folded.graph.weights().map(|(_, n, _)| n).collect();
        assert_eq!(names, ["Permute([1, 0])[w]"]);
        let (_, gemm) = folded.graph.nodes().last().unwrap();
        assert!(matches!(&gemm.op, Op::Gemm(s) if s.transpose_b));
        // The same product: the interpreter agrees before and after.
        let x_val = kiln_ir::Tensor::f32(vec![2, 4], (0..8).map(|v| v as f32 - 3.0).collect());
        let w_val = kiln_ir::Tensor::f32(vec![4, 3], (0..12).map(|v| v as f32 * 0.5).collect());
        let weights = BTreeMap::from([("w".to_string(), std::sync::Arc::new(w_val))]);
        let inputs = BTreeMap::from([("x".to_string(), x_val)]);
        let want = kiln_ir::evaluate(&g, &inputs, &weights).unwrap();
        let mut folded_weights = weights.clone();
        let t = kiln_ir::evaluate(&folded.definitions[names[0]], &BTreeMap::new(), &weights)
            .unwrap()
            .remove(VALUE)
            .unwrap();
        folded_weights.insert(names[0].to_string(), std::sync::Arc::new(t));
        let got = kiln_ir::evaluate(&folded.graph, &inputs, &folded_weights).unwrap();
        assert_eq!(got["y"], want["y"]);
    }

    /// A product with an RMSNorm prologue: `x [2, 4]` normalised by `gamma`, times `w [3, 4]`
    /// (stored `[N, K]`); `tied` also reads `w` elsewhere (an LM head sharing the embedding).
    fn normed_product(tied: bool) -> Graph {
        let mut g = Graph::new();
        let dim = |v: i64| Dim::from(v);
        let x = g.input("x", DType::F32, vec![dim(2), dim(4)]).unwrap();
        let w = g.weight("w", DType::F32, vec![dim(3), dim(4)]).unwrap();
        let gamma = g.weight("gamma", DType::F32, vec![dim(4)]).unwrap();
        let spec = kiln_ir::kernel::GemmSpec {
            prologue: Some(kiln_ir::kernel::NormSpec {
                kind: kiln_ir::kernel::NormKind::RmsNorm,
                eps: 1e-5,
                residual: false,
            }),
            ..kiln_ir::kernel::GemmSpec::plain(true)
        };
        let y = g.add(Op::Gemm(spec), &[x, w, gamma]).unwrap();
        g.set_output("y", y).unwrap();
        if tied {
            let e = g.add(Op::Unary(kiln_ir::UnaryOp::Neg), &[w]).unwrap();
            g.set_output("e", e).unwrap();
        }
        g
    }

    /// Evaluates `g` and its folded form on the same input and weights.
    fn before_and_after(g: &Graph) -> (Folded, [kiln_ir::Tensor; 2]) {
        use std::sync::Arc;
        let folded = fold_weights(g).unwrap();
        let w = kiln_ir::Tensor::f32(vec![3, 4], (0..12).map(|v| v as f32 * 0.25 - 1.0).collect());
        let gamma = kiln_ir::Tensor::f32(vec![4], vec![0.5, 2.0, -1.0, 3.0]);
        let x = kiln_ir::Tensor::f32(vec![2, 4], (0..8).map(|v| v as f32 - 3.0).collect());
        let mut weights = BTreeMap::from([
            ("w".to_string(), Arc::new(w)),
            ("gamma".to_string(), Arc::new(gamma)),
        ]);
        let inputs = BTreeMap::from([("x".to_string(), x)]);
        let want = kiln_ir::evaluate(g, &inputs, &weights).unwrap().remove("y");
        for (name, def) in &folded.definitions {
            let t = kiln_ir::evaluate(def, &BTreeMap::new(), &weights).unwrap();
            weights.insert(name.clone(), Arc::new(t[VALUE].clone()));
        }
        let got = kiln_ir::evaluate(&folded.graph, &inputs, &weights)
            .unwrap()
            .remove("y");
        (folded, [want.unwrap(), got.unwrap()])
    }

    #[test]
    fn rms_norm_weights_move_into_their_products() {
        let (folded, [want, got]) = before_and_after(&normed_product(false));
        let names: Vec<&str> = folded.graph.weights().map(|(_, n, _)| n).collect();
        assert_eq!(
            names,
            [
                "Binary(Mul)[w,Broadcast([3, 4])[gamma]]",
                "Broadcast([4])[1]"
            ]
        );
        let (_, gemm) = folded.graph.nodes().last().unwrap();
        assert!(is_ones(&folded.graph, *gemm.args.last().unwrap()));
        // Folding again changes nothing (the artifact writer folds graphs folded before).
        let again = fold_weights(&folded.graph).unwrap();
        let renamed: Vec<&str> = again.graph.weights().map(|(_, n, _)| n).collect();
        assert_eq!(renamed, names);
        let (a, b) = (want.as_f32().unwrap(), got.as_f32().unwrap());
        let close = a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-5);
        assert!(close, "{want:?} against {got:?}");
    }

    #[test]
    fn a_shared_product_weight_keeps_its_norm_weight() {
        let (folded, [want, got]) = before_and_after(&normed_product(true));
        let names: Vec<&str> = folded.graph.weights().map(|(_, n, _)| n).collect();
        assert_eq!(names, ["w", "gamma", "Unary(Neg)[w]"]);
        assert_eq!(want, got);
    }

    #[test]
    fn concatenated_weights_become_one_weight_and_the_parts_disappear() {
        let mut g = Graph::new();
        let x = g
            .input("x", DType::F32, vec![Dim::from(2i64), Dim::from(4i64)])
            .unwrap();
        let a = g
            .weight("a", DType::F32, vec![Dim::from(3i64), Dim::from(4i64)])
            .unwrap();
        let b = g
            .weight("b", DType::F32, vec![Dim::from(5i64), Dim::from(4i64)])
            .unwrap();
        let w = g.add(Op::Concat(0), &[a, b]).unwrap();
        let wt = g.transpose_last(w).unwrap();
        let y = g.matmul(x, wt).unwrap();
        g.set_output("y", y).unwrap();
        let folded = fold_weights(&g).unwrap();
        let names: Vec<&str> = folded.graph.weights().map(|(_, n, _)| n).collect();
        assert_eq!(names, ["Permute([1, 0])[Concat(0)[a,b]]"]);
        let def = &folded.definitions[names[0]];
        let parts: Vec<&str> = def.weights().map(|(_, n, _)| n).collect();
        assert_eq!(parts, ["a", "b"]);
        assert_eq!(def.outputs()[0].name, VALUE);
    }
}
