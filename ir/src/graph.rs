//! The tensor graph: SSA nodes in a petgraph `DiGraph`, appended in topological order.
//!
//! Every node carries its op, its ordered operands and its inferred `TensorType`. The graph is
//! append-only and `Graph::add` checks each op's typing rule, so a `Graph` is always well typed and
//! its node order is a topological order. Edges (operand -> user) mirror the operand lists for
//! petgraph's analyses; the operand order lives in the node.

use std::collections::BTreeMap;
use std::fmt;

use petgraph::graph::{DiGraph, NodeIndex};
use serde::{Deserialize, Serialize};

use crate::dim::{Dim, Shape};
use crate::dtype::{DType, TensorType};
use crate::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::IrError;

/// The id of a node: its position in the graph's topological order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The id as an index into node order.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One SSA value: an op applied to earlier nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Operands, in the order the op defines.
    pub args: Vec<NodeId>,
    /// The output type.
    pub ty: TensorType,
}

/// A named graph output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// The output's name (`logits`, `last_hidden_state`, ...).
    pub name: String,
    /// The node that produces it.
    pub node: NodeId,
}

/// A typed tensor graph with named outputs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(try_from = "GraphText", into = "GraphText")]
pub struct Graph {
    graph: DiGraph<Node, u32>,
    outputs: Vec<Output>,
}

impl PartialEq for Graph {
    fn eq(&self, other: &Graph) -> bool {
        self.outputs == other.outputs
            && self.len() == other.len()
            && self.nodes().zip(other.nodes()).all(|(a, b)| a.1 == b.1)
    }
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.graph.node_count()
    }

    /// True when the graph has no node.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[NodeIndex::new(id.index())]
    }

    /// The type of node `id`.
    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.node(id).ty
    }

    /// All nodes in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.graph
            .node_indices()
            .map(|i| (NodeId(i.index() as u32), &self.graph[i]))
    }

    /// The petgraph view, for analyses (dominators, DOT export, ...).
    pub fn petgraph(&self) -> &DiGraph<Node, u32> {
        &self.graph
    }

    /// The named outputs.
    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    /// The inputs, in node order: `(id, name, type)`.
    pub fn inputs(&self) -> impl Iterator<Item = (NodeId, &str, &TensorType)> {
        self.nodes().filter_map(|(id, n)| match &n.op {
            Op::Input(name) => Some((id, name.as_str(), &n.ty)),
            _ => None,
        })
    }

    /// The weights, in node order: `(id, checkpoint key, type)`.
    pub fn weights(&self) -> impl Iterator<Item = (NodeId, &str, &TensorType)> {
        self.nodes().filter_map(|(id, n)| match &n.op {
            Op::Weight(name) => Some((id, name.as_str(), &n.ty)),
            _ => None,
        })
    }

    /// Marks `node` as the output `name`.
    pub fn set_output(&mut self, name: &str, node: NodeId) -> Result<(), IrError> {
        self.check_id(node)?;
        if self.outputs.iter().any(|o| o.name == name) {
            return Err(IrError::DuplicateOutput(name.to_string()));
        }
        self.outputs.push(Output {
            name: name.to_string(),
            node,
        });
        Ok(())
    }

    fn check_id(&self, id: NodeId) -> Result<(), IrError> {
        if id.index() < self.len() {
            Ok(())
        } else {
            Err(IrError::UnknownNode(id))
        }
    }

    /// Appends `op` applied to `args`, inferring and checking its type.
    pub fn add(&mut self, op: Op, args: &[NodeId]) -> Result<NodeId, IrError> {
        for &a in args {
            self.check_id(a)?;
        }
        let arg_types: Vec<&TensorType> = args.iter().map(|&a| self.ty(a)).collect();
        let ty = op.infer(&arg_types).map_err(|message| IrError::Type {
            node: NodeId(self.len() as u32),
            op: op.name(),
            message,
        })?;
        Ok(self.push(op, args.to_vec(), ty))
    }

    fn push(&mut self, op: Op, args: Vec<NodeId>, ty: TensorType) -> NodeId {
        let idx = self.graph.add_node(Node {
            op,
            args: args.clone(),
            ty,
        });
        for (pos, a) in args.iter().enumerate() {
            self.graph
                .add_edge(NodeIndex::new(a.index()), idx, pos as u32);
        }
        NodeId(idx.index() as u32)
    }

    /// Declares a run-time input.
    pub fn input(&mut self, name: &str, dtype: DType, shape: Shape) -> Result<NodeId, IrError> {
        if self.inputs().any(|(_, n, _)| n == name) {
            return Err(IrError::DuplicateInput(name.to_string()));
        }
        Ok(self.push(
            Op::Input(name.to_string()),
            vec![],
            TensorType::new(dtype, shape),
        ))
    }

    /// Declares a weight by its checkpoint key; the same key twice gives the same node.
    pub fn weight(&mut self, name: &str, dtype: DType, shape: Shape) -> Result<NodeId, IrError> {
        let ty = TensorType::new(dtype, shape);
        if let Some((id, _, existing)) = self.weights().find(|(_, n, _)| *n == name) {
            if *existing != ty {
                return Err(IrError::Type {
                    node: id,
                    op: "weight",
                    message: format!("`{name}` declared as {existing} and as {ty}"),
                });
            }
            return Ok(id);
        }
        Ok(self.push(Op::Weight(name.to_string()), vec![], ty))
    }

    /// A scalar constant of dtype `dtype`.
    pub fn scalar(&mut self, value: f64, dtype: DType) -> NodeId {
        self.push(Op::Scalar(value), vec![], TensorType::new(dtype, vec![]))
    }

    // ----- Convenience constructors (each one op, or explicit broadcasts + one op) -----

    /// `op(x)` for a unary op.
    pub fn unary(&mut self, op: UnaryOp, x: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::Unary(op), &[x])
    }

    /// `op(a, b)` with NumPy broadcasting: explicit `Broadcast` nodes are inserted for operands
    /// whose shape differs from the common shape.
    pub fn binary(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        let shape = self.broadcast_shape(a, b)?;
        let a = self.broadcast_to(a, &shape)?;
        let b = self.broadcast_to(b, &shape)?;
        self.add(Op::Binary(op), &[a, b])
    }

    /// `a + b` with broadcasting.
    pub fn add_(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a - b` with broadcasting.
    pub fn sub(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.binary(BinaryOp::Sub, a, b)
    }

    /// `a * b` with broadcasting.
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// `a / b` with broadcasting.
    pub fn div(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.binary(BinaryOp::Div, a, b)
    }

    /// `x * c` for a constant `c` of `x`'s dtype.
    pub fn mul_const(&mut self, x: NodeId, c: f64) -> Result<NodeId, IrError> {
        let s = self.scalar(c, self.ty(x).dtype);
        self.mul(x, s)
    }

    /// `x + c` for a constant `c` of `x`'s dtype.
    pub fn add_const(&mut self, x: NodeId, c: f64) -> Result<NodeId, IrError> {
        let s = self.scalar(c, self.ty(x).dtype);
        self.add_(x, s)
    }

    /// Reduction over `axis` (negative counts from the end), keeping the axis.
    pub fn reduce(&mut self, op: ReduceOp, x: NodeId, axis: isize) -> Result<NodeId, IrError> {
        let axis = self.axis(x, axis)?;
        self.add(Op::Reduce { op, axis }, &[x])
    }

    /// Matrix product.
    pub fn matmul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::MatMul, &[a, b])
    }

    /// Reshape to `shape`.
    pub fn reshape(&mut self, x: NodeId, shape: Shape) -> Result<NodeId, IrError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.add(Op::Reshape(shape), &[x])
    }

    /// Axis permutation.
    pub fn permute(&mut self, x: NodeId, perm: Vec<usize>) -> Result<NodeId, IrError> {
        self.add(Op::Permute(perm), &[x])
    }

    /// Swaps the last two axes.
    pub fn transpose_last(&mut self, x: NodeId) -> Result<NodeId, IrError> {
        let r = self.ty(x).rank();
        if r < 2 {
            return Err(IrError::Type {
                node: x,
                op: "permute",
                message: "transpose needs rank >= 2".into(),
            });
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 1, r - 2);
        self.permute(x, perm)
    }

    /// Broadcast to `shape` (no node when the shape already matches).
    pub fn broadcast_to(&mut self, x: NodeId, shape: &[Dim]) -> Result<NodeId, IrError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.add(Op::Broadcast(shape.to_vec()), &[x])
    }

    /// Type conversion (no node when the dtype already matches).
    pub fn cast(&mut self, x: NodeId, to: DType) -> Result<NodeId, IrError> {
        if self.ty(x).dtype == to {
            return Ok(x);
        }
        self.add(Op::Cast(to), &[x])
    }

    /// Slice `start..end` of `axis` (negative counts from the end).
    pub fn slice(
        &mut self,
        x: NodeId,
        axis: isize,
        start: Dim,
        end: Dim,
    ) -> Result<NodeId, IrError> {
        let axis = self.axis(x, axis)?;
        self.add(Op::Slice { axis, start, end }, &[x])
    }

    /// Resolves a possibly negative axis of node `x`.
    pub fn axis(&self, x: NodeId, axis: isize) -> Result<usize, IrError> {
        let rank = self.ty(x).rank() as isize;
        let a = if axis < 0 { rank + axis } else { axis };
        if a < 0 || a >= rank {
            return Err(IrError::Type {
                node: x,
                op: "axis",
                message: format!("axis {axis} out of range for rank {rank}"),
            });
        }
        Ok(a as usize)
    }

    /// The NumPy broadcast of two nodes' shapes.
    fn broadcast_shape(&self, a: NodeId, b: NodeId) -> Result<Shape, IrError> {
        let (sa, sb) = (&self.ty(a).shape, &self.ty(b).shape);
        let rank = sa.len().max(sb.len());
        let one = Dim::constant(1);
        let mut out = Vec::with_capacity(rank);
        for i in 0..rank {
            let da = (i + sa.len()).checked_sub(rank).map_or(&one, |j| &sa[j]);
            let db = (i + sb.len()).checked_sub(rank).map_or(&one, |j| &sb[j]);
            let d = if da == db || db == &one {
                da
            } else if da == &one {
                db
            } else {
                return Err(IrError::Type {
                    node: a,
                    op: "broadcast",
                    message: format!(
                        "shapes of {a} {} and {b} {} do not broadcast",
                        self.ty(a),
                        self.ty(b)
                    ),
                });
            };
            out.push(d.clone());
        }
        Ok(out)
    }

    /// Substitutes symbols by constants (a bucket) in every shape and dim attribute, re-checking
    /// every node's type.
    pub fn specialize(&self, bindings: &BTreeMap<String, i64>) -> Result<Graph, IrError> {
        let sub = |d: &Dim| d.substitute(bindings);
        let sub_shape = |s: &Shape| s.iter().map(sub).collect::<Shape>();
        let map_op = |op: &Op| Ok(op.map_attributes(sub, |d| d));
        self.rebuild(map_op, |ty| TensorType::new(ty.dtype, sub_shape(&ty.shape)))
    }

    /// The same graph with every op replaced by `map_op`'s and every leaf's type by
    /// `map_leaf`'s; the other nodes' types are inferred again (and checked). Node ids and
    /// outputs are kept.
    pub fn rebuild(
        &self,
        mut map_op: impl FnMut(&Op) -> Result<Op, IrError>,
        mut map_leaf: impl FnMut(&TensorType) -> TensorType,
    ) -> Result<Graph, IrError> {
        let mut out = Graph::new();
        for (_, node) in self.nodes() {
            let op = map_op(&node.op)?;
            if op.is_leaf() {
                out.push(op, vec![], map_leaf(&node.ty));
            } else {
                out.add(op, &node.args)?;
            }
        }
        out.outputs = self.outputs.clone();
        Ok(out)
    }

    /// Parses the RON text form.
    pub fn from_ron(text: &str) -> Result<Graph, IrError> {
        ron::from_str(text).map_err(|e| IrError::Text(e.to_string()))
    }

    /// Writes the RON text form (pretty, one node per few lines).
    pub fn to_ron(&self) -> String {
        let config = ron::ser::PrettyConfig::new()
            .depth_limit(2)
            .indentor("  ".to_string())
            .separate_tuple_members(false);
        ron::ser::to_string_pretty(self, config).expect("graphs always serialise")
    }
}

/// The serialised form of a `Graph`: nodes with explicit ids, then outputs. Deserialising re-adds
/// every node through `Graph::add`, so a text graph is type-checked as it is read.
#[derive(Serialize, Deserialize)]
struct GraphText {
    nodes: Vec<NodeText>,
    outputs: Vec<Output>,
}

#[derive(Serialize, Deserialize)]
struct NodeText {
    id: NodeId,
    op: Op,
    args: Vec<NodeId>,
    ty: TensorType,
}

impl From<Graph> for GraphText {
    fn from(g: Graph) -> GraphText {
        let nodes = g
            .nodes()
            .map(|(id, n)| NodeText {
                id,
                op: n.op.clone(),
                args: n.args.clone(),
                ty: n.ty.clone(),
            })
            .collect();
        GraphText {
            nodes,
            outputs: g.outputs,
        }
    }
}

impl TryFrom<GraphText> for Graph {
    type Error = IrError;
    fn try_from(text: GraphText) -> Result<Graph, IrError> {
        let mut g = Graph::new();
        for (pos, n) in text.nodes.into_iter().enumerate() {
            if n.id.index() != pos {
                return Err(IrError::Text(format!(
                    "node {} is listed at position {pos}",
                    n.id
                )));
            }
            let id = if n.op.is_leaf() {
                if !n.args.is_empty() {
                    return Err(IrError::Text(format!("leaf node {} has operands", n.id)));
                }
                g.push(n.op, vec![], n.ty.clone())
            } else {
                g.add(n.op, &n.args)?
            };
            if g.ty(id) != &n.ty {
                return Err(IrError::Text(format!(
                    "node {id} is declared {} but its op gives {}",
                    n.ty,
                    g.ty(id)
                )));
            }
        }
        for o in text.outputs {
            g.set_output(&o.name, o.node)?;
        }
        Ok(g)
    }
}
