//! The e-graph language: kiln IR ops with their attributes as leaf children (as TENSAT does), so
//! that rewrite patterns can match an op whatever its attributes and check them in Rust.
//!
//! An op with attributes (`broadcast`, `reduce_sum`, `gemm`, ...) has an [`Attr`] leaf as child 0
//! holding the whole `Op`; attribute-free ops (`add`, `exp`, `matmul`, ...) have operands only.
//! Graph leaves (inputs, weights, scalars) are [`Attr`] leaves that also carry their type.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

use egg::{Id, Language};
use kiln_ir::{BinaryOp, Op, TensorType, UnaryOp};

/// An op (with its attributes) or a graph leaf, compared by its RON text.
#[derive(Clone, Debug)]
pub struct Attr {
    text: String,
    /// The op this leaf describes.
    pub op: Op,
    /// The declared type, for graph leaves (`Input`, `Weight`, `Scalar`).
    pub ty: Option<TensorType>,
}

impl Attr {
    /// The attribute leaf of an op.
    pub fn of(op: Op) -> Attr {
        let text = ron::to_string(&op).expect("ops serialise");
        Attr { text, op, ty: None }
    }

    /// A graph leaf (input, weight, scalar) of type `ty`.
    pub fn leaf(op: Op, ty: TensorType) -> Attr {
        let text = format!("{}:{ty}", ron::to_string(&op).expect("ops serialise"));
        Attr {
            text,
            op,
            ty: Some(ty),
        }
    }
}

impl PartialEq for Attr {
    fn eq(&self, other: &Attr) -> bool {
        self.text == other.text
    }
}
impl Eq for Attr {}
impl PartialOrd for Attr {
    fn partial_cmp(&self, other: &Attr) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Attr {
    fn cmp(&self, other: &Attr) -> Ordering {
        self.text.cmp(&other.text)
    }
}
impl Hash for Attr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.hash(state)
    }
}

/// An e-node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ENode {
    /// An attribute or a graph leaf.
    Leaf(Attr),
    /// An op by name (`Op::name`) and its children (the attribute leaf first, if it has one).
    Op(&'static str, Vec<Id>),
}

/// Op names whose ops have no attributes, with the op they stand for.
/// Makes the op an attribute-free name stands for.
type MakeOp = fn() -> Op;

const ATTRIBUTE_FREE: &[(&str, MakeOp)] = &[
    ("neg", || Op::Unary(UnaryOp::Neg)),
    ("exp", || Op::Unary(UnaryOp::Exp)),
    ("tanh", || Op::Unary(UnaryOp::Tanh)),
    ("erf", || Op::Unary(UnaryOp::Erf)),
    ("rsqrt", || Op::Unary(UnaryOp::Rsqrt)),
    ("add", || Op::Binary(BinaryOp::Add)),
    ("sub", || Op::Binary(BinaryOp::Sub)),
    ("mul", || Op::Binary(BinaryOp::Mul)),
    ("div", || Op::Binary(BinaryOp::Div)),
    ("max", || Op::Binary(BinaryOp::Max)),
    ("where", || Op::Where),
    ("matmul", || Op::MatMul),
    ("gather", || Op::Gather),
    ("softmax", || Op::Softmax),
    ("cache_write", || Op::CacheWrite),
];

/// Op names whose ops carry attributes (child 0 is their [`Attr`] leaf).
const ATTRIBUTED: &[&str] = &[
    "cast",
    "reduce_sum",
    "reduce_max",
    "reduce_mean",
    "reshape",
    "permute",
    "broadcast",
    "slice",
    "concat",
    "causal_mask",
    "padding_mask",
    "position_mask",
    "decode_attention",
    "rope",
    "dropout",
    "softmax_dropout",
    "activation",
    "repeat_kv",
    "norm",
    "gemm",
    "attention",
    "embedding",
];

/// True when ops named `name` carry an attribute leaf.
pub fn has_attr(name: &str) -> bool {
    ATTRIBUTED.contains(&name)
}

/// The interned `&'static str` of an op name.
pub fn static_name(name: &str) -> Option<&'static str> {
    ATTRIBUTE_FREE
        .iter()
        .map(|(n, _)| *n)
        .chain(ATTRIBUTED.iter().copied())
        .find(|n| *n == name)
}

/// Rebuilds the IR op of an e-node named `name` whose attribute (if any) is `attr`.
pub fn op_of(name: &str, attr: Option<&Attr>) -> Op {
    match attr {
        Some(a) => a.op.clone(),
        None => ATTRIBUTE_FREE
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f())
            .unwrap_or_else(|| panic!("op `{name}` needs an attribute")),
    }
}

impl Language for ENode {
    type Discriminant = (Option<&'static str>, usize);

    fn discriminant(&self) -> Self::Discriminant {
        match self {
            ENode::Leaf(_) => (None, 0),
            ENode::Op(name, c) => (Some(name), c.len()),
        }
    }

    fn matches(&self, other: &Self) -> bool {
        match (self, other) {
            (ENode::Leaf(a), ENode::Leaf(b)) => a == b,
            (ENode::Op(a, ca), ENode::Op(b, cb)) => a == b && ca.len() == cb.len(),
            _ => false,
        }
    }

    fn children(&self) -> &[Id] {
        match self {
            ENode::Leaf(_) => &[],
            ENode::Op(_, c) => c,
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            ENode::Leaf(_) => &mut [],
            ENode::Op(_, c) => c,
        }
    }
}

impl fmt::Display for ENode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ENode::Leaf(a) => f.write_str(&a.text),
            ENode::Op(name, _) => f.write_str(name),
        }
    }
}

/// Patterns name ops only; leaves are always pattern variables.
impl egg::FromOp for ENode {
    type Error = String;

    fn from_op(op: &str, children: Vec<Id>) -> Result<ENode, String> {
        static_name(op)
            .map(|name| ENode::Op(name, children))
            .ok_or_else(|| format!("unknown op `{op}` in a pattern"))
    }
}
