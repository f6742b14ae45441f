//! The e-class analysis: every class's tensor type (symbolic), plus the facts rules ask about
//! (the attribute a leaf class holds, a constant value, whether it depends on weights only).

use egg::{merge_option, Analysis, DidMerge, EGraph, Id};
use kiln_ir::{Op, TensorType};

use super::lang::{has_attr, op_of, Attr, ENode};

/// The e-graph kiln rewrites.
pub type KilnGraph = EGraph<ENode, TypeAnalysis>;

/// What is known about an e-class.
#[derive(Clone, Debug)]
pub struct ClassData {
    /// The tensor type of the class (`None` for attribute leaves).
    pub ty: Option<TensorType>,
    /// The attribute or graph leaf the class holds, if it is a leaf class.
    pub attr: Option<Attr>,
    /// The value of every element, when it is a known constant (a scalar or its broadcast).
    pub constant: Option<f64>,
    /// Whether the value depends on weights and constants only (computed once, at compile time).
    pub weight_only: bool,
}

/// The analysis that computes [`ClassData`], and the matches rules declined because what their
/// builders made disagrees with the matched class's type (one line each, naming the rule).
#[derive(Default)]
pub struct TypeAnalysis {
    /// The declined matches (each a bug in the named rule's builder).
    pub declined: Vec<String>,
}

impl TypeAnalysis {
    /// The IR op and operand classes of an op e-node (`None` for leaves).
    pub fn op_and_args(egraph: &KilnGraph, node: &ENode) -> Option<(Op, Vec<Id>)> {
        match node {
            ENode::Leaf(_) => None,
            ENode::Op(name, children) => {
                let (attr, args) = if has_attr(name) {
                    (egraph[children[0]].data.attr.as_ref(), &children[1..])
                } else {
                    (None, &children[..])
                };
                Some((op_of(name, attr), args.to_vec()))
            }
        }
    }
}

impl Analysis<ENode> for TypeAnalysis {
    type Data = ClassData;

    fn make(egraph: &mut KilnGraph, enode: &ENode, _id: Id) -> ClassData {
        match enode {
            ENode::Leaf(a) => ClassData {
                ty: a.ty.clone(),
                constant: match a.op {
                    Op::Scalar(v) => Some(v),
                    _ => None,
                },
                weight_only: matches!(a.op, Op::Weight(_) | Op::Scalar(_)),
                attr: Some(a.clone()),
            },
            node => {
                let (op, args) = TypeAnalysis::op_and_args(egraph, node).expect("an op node");
                let types: Vec<&TensorType> = args
                    .iter()
                    .map(|a| egraph[*a].data.ty.as_ref().expect("operands are tensors"))
                    .collect();
                let ty = op
                    .infer(&types)
                    .unwrap_or_else(|e| panic!("a rewrite built an ill-typed {}: {e}", op.name()));
                let constant = match op {
                    Op::Broadcast(_) | Op::Reshape(_) | Op::Cast(_) => {
                        egraph[args[0]].data.constant
                    }
                    _ => None,
                };
                let weight_only = args.iter().all(|a| egraph[*a].data.weight_only);
                ClassData {
                    ty: Some(ty),
                    attr: None,
                    constant,
                    weight_only,
                }
            }
        }
    }

    fn merge(&mut self, a: &mut ClassData, b: ClassData) -> DidMerge {
        assert_eq!(
            a.ty, b.ty,
            "merged e-classes disagree on their type: a rewrite is unsound"
        );
        let mut did = merge_option(&mut a.constant, b.constant, |x, y| {
            debug_assert_eq!(*x, y);
            DidMerge(false, false)
        });
        if b.weight_only && !a.weight_only {
            a.weight_only = true;
            did = did | DidMerge(true, false);
        } else if a.weight_only && !b.weight_only {
            did = did | DidMerge(false, true);
        }
        if a.attr.is_none() && b.attr.is_some() {
            a.attr = b.attr;
            did = did | DidMerge(true, false);
        }
        did
    }
}
