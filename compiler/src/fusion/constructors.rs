//! The named guards and builders the rule files refer to. A guard checks the attributes a
//! pattern matched (axes, constants, shapes) and binds computed attributes; a builder constructs
//! fused nodes by looking into the matched e-classes. Every node is type-checked before it is added,
//! so a rule can decline a match but never corrupt the e-graph.

use egg::{Id, Subst};
use kiln_ir::kernel::{
    Activation, AttentionSpec, DecodeAttentionSpec, EmbeddingSpec, GemmSpec, NormKind, NormSpec,
    GELU_CUBIC,
};
use kiln_ir::{Dim, Op, ReduceOp, TensorType};

use super::analysis::{KilnGraph, TypeAnalysis};
use super::lang::{has_attr, Attr, ENode};
use super::rules::{var, Bindings};

/// Checks a match and returns attribute bindings for the right-hand side, or `None` to decline.
pub type Guard = fn(&KilnGraph, &Subst) -> Option<Bindings>;

/// How a builder adds its work.
#[derive(Clone, Copy)]
pub enum BuilderKind {
    /// Returns fused alternatives of the matched class (each is unioned with it).
    Alternatives(fn(&mut KilnGraph, &Subst) -> Vec<Id>),
    /// Fused alternatives of other classes (the matched class's consumers), as `(class, node)`
    /// pairs for the applier to union.
    Unions(fn(&mut KilnGraph, Id, &Subst) -> Vec<(Id, Id)>),
}

/// A named builder.
pub type Builder = BuilderKind;

/// The guard named `name` in a rule file.
pub fn guard(name: &str) -> Option<Guard> {
    Some(match name {
        "softmax_last_axis" => softmax_last_axis,
        "softmax_dropout" => softmax_dropout,
        "gelu_tanh" => gelu_tanh,
        "gelu_erf" => gelu_erf,
        "silu" => silu,
        "relu" => relu,
        "layer_norm" => layer_norm,
        "rms_norm" => rms_norm,
        "repeat_kv" => repeat_kv,
        _ => return None,
    })
}

/// The builder named `name` in a rule file.
pub fn builder(name: &str) -> Option<Builder> {
    if name == "gemm_norm_prologue" {
        return Some(BuilderKind::Unions(gemm_norm_prologue));
    }
    let f: fn(&mut KilnGraph, &Subst) -> Vec<Id> = match name {
        "attention" => attention,
        "decode_attention" => decode_attention,
        "gemm" => |g, s| gemm(g, s, false),
        "gemm_transposed" => |g, s| gemm(g, s, true),
        "gemm_bias" => gemm_bias,
        "gemm_activation" => gemm_activation,
        "gemm_swiglu" => gemm_swiglu,
        "gemm_residual" => gemm_residual,
        "norm_residual" => norm_residual,
        "embedding" => embedding,
        "embedding_sum" => embedding_sum,
        _ => return None,
    };
    Some(BuilderKind::Alternatives(f))
}

// ----- e-graph queries -----

fn get(subst: &Subst, name: &str) -> Option<Id> {
    subst.get(var(name)).copied()
}

fn at(subst: &Subst, name: &str) -> Id {
    get(subst, name).unwrap_or_else(|| panic!("the pattern binds {name}"))
}

fn ty(eg: &KilnGraph, id: Id) -> Option<&TensorType> {
    eg[id].data.ty.as_ref()
}

fn attr_op(eg: &KilnGraph, id: Id) -> Option<&Op> {
    eg[id].data.attr.as_ref().map(|a| &a.op)
}

fn constant(eg: &KilnGraph, id: Id) -> Option<f64> {
    eg[id].data.constant
}

/// Whether class `id` is the constant `want`, exactly: importers and decompositions compute their
/// constants with the same expressions (`kiln_ir::kernel`), and anything else is a different op
/// (`max(x, 1e-9)` is not a ReLU).
fn is_const(eg: &KilnGraph, id: Id, want: f64) -> bool {
    constant(eg, id) == Some(want)
}

fn rank(eg: &KilnGraph, id: Id) -> Option<usize> {
    ty(eg, id).map(TensorType::rank)
}

/// The op nodes named `name` in class `id`: their ops and operand classes.
fn nodes_named(eg: &KilnGraph, id: Id, name: &str) -> Vec<(Op, Vec<Id>)> {
    eg[id]
        .nodes
        .iter()
        .filter(|n| matches!(n, ENode::Op(op, _) if *op == name))
        .filter_map(|n| TypeAnalysis::op_and_args(eg, n))
        .collect()
}

/// Adds `op(args)` if it type-checks; returns its class.
fn add_op(eg: &mut KilnGraph, op: Op, args: &[Id]) -> Option<Id> {
    let types: Vec<&TensorType> = args.iter().map(|a| ty(eg, *a)).collect::<Option<_>>()?;
    op.infer(&types).ok()?;
    let name = super::lang::static_name(op.name())?;
    let mut children = Vec::with_capacity(args.len() + 1);
    if has_attr(name) {
        children.push(eg.add(ENode::Leaf(Attr::of(op))));
    }
    children.extend_from_slice(args);
    Some(eg.add(ENode::Op(name, children)))
}

fn is_last_axis_reduce(eg: &KilnGraph, attr: Id, x: Id, want: ReduceOp) -> bool {
    matches!(attr_op(eg, attr), Some(Op::Reduce { op, axis }) if *op == want && Some(axis + 1) == rank(eg, x))
}

fn bind(name: &'static str, op: Op) -> Option<Bindings> {
    Some(vec![(name, Attr::of(op))])
}

// ----- guards -----

fn softmax_last_axis(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let x = at(s, "?x");
    (is_last_axis_reduce(eg, at(s, "?r1"), x, ReduceOp::Max)
        && is_last_axis_reduce(eg, at(s, "?r2"), x, ReduceOp::Sum))
    .then(Vec::new)
}

fn softmax_dropout(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    match attr_op(eg, at(s, "?d"))? {
        Op::Dropout { p, stream } => bind(
            "?sd",
            Op::SoftmaxDropout {
                p: *p,
                stream: *stream,
            },
        ),
        _ => None,
    }
}

fn gelu_tanh(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let ok = is_const(eg, at(s, "?half"), 0.5)
        && is_const(eg, at(s, "?cubic"), GELU_CUBIC)
        && is_const(eg, at(s, "?root"), (2.0 / std::f64::consts::PI).sqrt())
        && is_const(eg, at(s, "?one"), 1.0);
    ok.then(|| bind("?act", Op::Activation(Activation::GeluTanh)))?
}

fn gelu_erf(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let ok = is_const(eg, at(s, "?half"), 0.5)
        && is_const(eg, at(s, "?root"), std::f64::consts::FRAC_1_SQRT_2)
        && is_const(eg, at(s, "?one"), 1.0);
    ok.then(|| bind("?act", Op::Activation(Activation::GeluErf)))?
}

fn silu(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    is_const(eg, at(s, "?one"), 1.0).then(|| bind("?act", Op::Activation(Activation::Silu)))?
}

fn relu(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    is_const(eg, at(s, "?zero"), 0.0).then(|| bind("?act", Op::Activation(Activation::Relu)))?
}

/// A per-channel parameter: rank 1 with the size of `x`'s last axis.
fn is_channel_param(eg: &KilnGraph, p: Id, x: Id) -> bool {
    match (ty(eg, p), ty(eg, x)) {
        (Some(p), Some(x)) => p.rank() == 1 && x.shape.last() == Some(&p.shape[0]),
        _ => false,
    }
}

fn layer_norm(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let x = at(s, "?x");
    let eps = constant(eg, at(s, "?eps"))?;
    let ok = is_last_axis_reduce(eg, at(s, "?r"), x, ReduceOp::Mean)
        && is_channel_param(eg, at(s, "?w"), x)
        && is_channel_param(eg, at(s, "?bias"), x);
    let spec = NormSpec {
        kind: NormKind::LayerNorm,
        eps,
        residual: false,
    };
    ok.then(|| bind("?spec", Op::Norm(spec)))?
}

fn rms_norm(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let x = at(s, "?x");
    let eps = constant(eg, at(s, "?eps"))?;
    let ok = is_last_axis_reduce(eg, at(s, "?r"), x, ReduceOp::Mean)
        && is_channel_param(eg, at(s, "?w"), x);
    let spec = NormSpec {
        kind: NormKind::RmsNorm,
        eps,
        residual: false,
    };
    ok.then(|| bind("?spec", Op::Norm(spec)))?
}

fn repeat_kv(eg: &KilnGraph, s: &Subst) -> Option<Bindings> {
    let x = ty(eg, at(s, "?x"))?;
    let (Some(Op::Reshape(s1)), Some(Op::Broadcast(s2)), Some(Op::Reshape(s3))) = (
        attr_op(eg, at(s, "?s1")),
        attr_op(eg, at(s, "?s2")),
        attr_op(eg, at(s, "?s3")),
    ) else {
        return None;
    };
    if x.rank() != 4 || s3.len() != 5 || s2.len() != 5 || s1.len() != 4 {
        return None;
    }
    let (b, kvh, t, d) = (&x.shape[0], &x.shape[1], &x.shape[2], &x.shape[3]);
    let groups = s2[2].as_const()?;
    let one = Dim::constant(1);
    let ok = s3 == &[b.clone(), kvh.clone(), one, t.clone(), d.clone()]
        && s2 == &[b.clone(), kvh.clone(), s2[2].clone(), t.clone(), d.clone()]
        && s1 == &[b.clone(), kvh.clone() * s2[2].clone(), t.clone(), d.clone()]
        && groups > 1;
    ok.then(|| {
        bind(
            "?g",
            Op::RepeatKv {
                groups: groups as usize,
            },
        )
    })?
}

// ----- builders -----

/// The K/V operand behind a possibly repeated class: `(inner, groups)`.
fn unrepeat(eg: &KilnGraph, id: Id) -> Vec<(Id, usize)> {
    let mut out = vec![(id, 1)];
    for (op, args) in nodes_named(eg, id, "repeat_kv") {
        if let Op::RepeatKv { groups } = op {
            out.push((args[0], groups));
        }
    }
    out
}

/// What an additive attention mask is made of: `(padding mask operand, causal mask attributes)`.
fn mask_parts(eg: &KilnGraph, mask: Id) -> Vec<(Option<Id>, Option<Op>)> {
    let mut out = Vec::new();
    let padding_of = |id: Id| -> Vec<Id> {
        let mut ids: Vec<Id> = nodes_named(eg, id, "padding_mask")
            .into_iter()
            .map(|(_, a)| a[0])
            .collect();
        for (_, b) in nodes_named(eg, id, "broadcast") {
            ids.extend(
                nodes_named(eg, b[0], "padding_mask")
                    .into_iter()
                    .map(|(_, a)| a[0]),
            );
        }
        ids
    };
    let causal_of = |id: Id| -> Vec<Op> {
        let mut ops: Vec<Op> = nodes_named(eg, id, "causal_mask")
            .into_iter()
            .map(|(op, _)| op)
            .collect();
        for (_, b) in nodes_named(eg, id, "broadcast") {
            ops.extend(
                nodes_named(eg, b[0], "causal_mask")
                    .into_iter()
                    .map(|(op, _)| op),
            );
        }
        ops
    };
    for m in padding_of(mask) {
        out.push((Some(m), None));
    }
    for c in causal_of(mask) {
        out.push((None, Some(c)));
    }
    for (_, args) in nodes_named(eg, mask, "add") {
        for m in padding_of(args[0]) {
            for c in causal_of(args[1]) {
                out.push((Some(m), Some(c)));
            }
        }
    }
    out
}

/// Whether a masked match's factor `exp(reduce_max ?r ?mask)` takes its maximum over the mask's
/// last (key) axis, as `kiln_ir::kernel::visible` does: only then is it 0 exactly for the queries
/// that see no key. Unmasked matches have no factor.
fn zeroes_unseen_queries(eg: &KilnGraph, s: &Subst) -> bool {
    match get(s, "?mask") {
        Some(mask) => is_last_axis_reduce(eg, at(s, "?r"), mask, ReduceOp::Max),
        None => true,
    }
}

fn attention(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    if !zeroes_unseen_queries(eg, s) {
        return vec![];
    }
    let (q, k, v) = (at(s, "?q"), at(s, "?k"), at(s, "?v"));
    let Some(scale) = constant(eg, at(s, "?scale")) else {
        return vec![];
    };
    let swaps_last_two =
        matches!(attr_op(eg, at(s, "?p")), Some(Op::Permute(p)) if *p == [0, 1, 3, 2]);
    let (Some(qt), Some(kt)) = (ty(eg, q).cloned(), ty(eg, k).cloned()) else {
        return vec![];
    };
    if !swaps_last_two || qt.rank() != 4 || kt.rank() != 4 {
        return vec![];
    }
    let dropout = get(s, "?d").and_then(|d| match attr_op(eg, d) {
        Some(Op::SoftmaxDropout { p, stream }) => Some((*p, *stream)),
        _ => None,
    });
    if get(s, "?d").is_some() && dropout.is_none() {
        return vec![];
    }
    let masks = match get(s, "?mask") {
        Some(m) => mask_parts(eg, m),
        None => vec![(None, None)],
    };
    let mut built = Vec::new();
    for (k_in, kg) in unrepeat(eg, k) {
        for (v_in, vg) in unrepeat(eg, v) {
            if kg != vg {
                continue;
            }
            for (padding, causal) in &masks {
                let (causal_flag, window) = match causal {
                    Some(Op::CausalMask {
                        rows, cols, window, ..
                    }) => {
                        if *rows != qt.shape[2] || *cols != kt.shape[2] {
                            continue;
                        }
                        (true, *window)
                    }
                    _ => (false, None),
                };
                let spec = AttentionSpec {
                    scale,
                    causal: causal_flag,
                    window,
                    padding: padding.is_some(),
                    rope: None,
                    dropout,
                };
                let mut variants = vec![(spec.clone(), q, k_in, None)];
                // RoPE on both Q and K (same frequencies and positions) becomes a prologue.
                for (rq, qa) in nodes_named(eg, q, "rope") {
                    for (rk, ka) in nodes_named(eg, k_in, "rope") {
                        if let (Op::Rope { theta, scaling }, true) =
                            (&rq, rq == rk && qa[1] == ka[1])
                        {
                            let mut roped = spec.clone();
                            roped.rope = Some((*theta, scaling.clone()));
                            variants.push((roped, qa[0], ka[0], Some(qa[1])));
                        }
                    }
                }
                for (spec, q_op, k_op, positions) in variants {
                    let mut args = vec![q_op, k_op, v_in];
                    args.extend(padding.iter().copied());
                    args.extend(positions);
                    args.extend(get(s, "?seed"));
                    if let Some(id) = add_op(eg, Op::Attention(spec), &args) {
                        built.push(id);
                    }
                }
            }
        }
    }
    built
}

fn decode_attention(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    if !zeroes_unseen_queries(eg, s) {
        return vec![];
    }
    let (q, k, v, mask) = (at(s, "?q"), at(s, "?k"), at(s, "?v"), at(s, "?mask"));
    let Some(scale) = constant(eg, at(s, "?scale")) else {
        return vec![];
    };
    if !matches!(attr_op(eg, at(s, "?p")), Some(Op::Permute(p)) if *p == [0, 1, 3, 2]) {
        return vec![];
    }
    let mut masks = nodes_named(eg, mask, "position_mask");
    for (_, b) in nodes_named(eg, mask, "broadcast") {
        masks.extend(nodes_named(eg, b[0], "position_mask"));
    }
    let mut built = Vec::new();
    for (mask_op, mask_args) in masks {
        let Op::PositionMask { window, .. } = mask_op else {
            continue;
        };
        let positions = mask_args[0];
        for (k_in, kg) in unrepeat(eg, k) {
            for (v_in, vg) in unrepeat(eg, v) {
                if kg != vg {
                    continue;
                }
                let plain = DecodeAttentionSpec {
                    scale,
                    window,
                    rope: None,
                };
                let mut variants = vec![(plain.clone(), q)];
                for (rope, args) in nodes_named(eg, q, "rope") {
                    if let (Op::Rope { theta, scaling }, true) = (rope, args[1] == positions) {
                        let mut roped = plain.clone();
                        roped.rope = Some((theta, scaling));
                        variants.push((roped, args[0]));
                    }
                }
                for (spec, q_op) in variants {
                    let args = [q_op, k_in, v_in, positions];
                    built.extend(add_op(eg, Op::DecodeAttention(spec), &args));
                }
            }
        }
    }
    built
}

fn is_weight_matrix(eg: &KilnGraph, w: Id) -> bool {
    eg[w].data.weight_only && rank(eg, w) == Some(2)
}

/// Whether class `w` is a transposed weight matrix, which `gemm-linear` reads in place.
fn is_transposed_weight(eg: &KilnGraph, w: Id) -> bool {
    nodes_named(eg, w, "permute")
        .iter()
        .any(|(op, args)| *op == Op::Permute(vec![1, 0]) && is_weight_matrix(eg, args[0]))
}

fn gemm(eg: &mut KilnGraph, s: &Subst, transposed: bool) -> Vec<Id> {
    let (x, w) = (at(s, "?x"), at(s, "?w"));
    // A plain product over a transposed weight would make the folder store a transposed copy
    // of the weight (a tied embedding: the whole table again); `gemm-linear` reads it in place.
    if !is_weight_matrix(eg, w) || (!transposed && is_transposed_weight(eg, w)) {
        return vec![];
    }
    if transposed && !matches!(attr_op(eg, at(s, "?p")), Some(Op::Permute(p)) if *p == [1, 0]) {
        return vec![];
    }
    add_op(eg, Op::Gemm(GemmSpec::plain(transposed)), &[x, w])
        .into_iter()
        .collect()
}

/// The GEMM nodes of class `y` that `accepts` can still extend.
fn gemms(eg: &KilnGraph, y: Id, accepts: impl Fn(&GemmSpec) -> bool) -> Vec<(GemmSpec, Vec<Id>)> {
    nodes_named(eg, y, "gemm")
        .into_iter()
        .filter_map(|(op, args)| match op {
            Op::Gemm(spec) if spec.prologue.is_none() && accepts(&spec) => Some((spec, args)),
            _ => None,
        })
        .collect()
}

/// Every GEMM that reads the norm class `eclass` as its `x` gets a variant that computes the norm
/// in its prologue (reading the norm's input instead), for the GEMM's own class.
fn gemm_norm_prologue(eg: &mut KilnGraph, eclass: Id, s: &Subst) -> Vec<(Id, Id)> {
    let Some(Op::Norm(norm)) = attr_op(eg, at(s, "?n")).cloned() else {
        return vec![];
    };
    let expected_args = if norm.kind == NormKind::LayerNorm {
        3
    } else {
        2
    };
    if norm.residual || get(s, "?bias").is_some() != (expected_args == 3) {
        return vec![];
    }
    let mut params = vec![at(s, "?w")];
    params.extend(get(s, "?bias"));
    let x = at(s, "?x");
    let eclass = eg.find(eclass);
    let mut consumers: Vec<Id> = eg[eclass].parents().map(|p| eg.find(p)).collect();
    consumers.sort();
    consumers.dedup();
    // Only when every consumer is a GEMM reading the norm as its input and nowhere else: a norm
    // that is also needed elsewhere (a post-norm residual, even of the same GEMM) is computed
    // anyway, and recomputing it in a prologue would only add work.
    let feeds_gemm = |c: Id| {
        nodes_named(eg, c, "gemm")
            .iter()
            .any(|(_, args)| reads_only_as_input(eg, args, eclass))
    };
    if !consumers.iter().all(|c| feeds_gemm(*c)) {
        return vec![];
    }
    let mut built = Vec::new();
    for consumer in consumers {
        let consumer = eg.find(consumer);
        for (op, args) in nodes_named(eg, consumer, "gemm") {
            let Op::Gemm(mut spec) = op else { continue };
            if spec.prologue.is_some() || !reads_only_as_input(eg, &args, eclass) {
                continue;
            }
            spec.prologue = Some(norm.clone());
            let mut fused_args = args.clone();
            fused_args[0] = x;
            fused_args.extend(&params);
            if let Some(id) = add_op(eg, Op::Gemm(spec), &fused_args) {
                built.push((consumer, id));
            }
        }
    }
    built
}

/// Whether a GEMM with operand classes `args` reads `class` as its input `x` and as nothing else.
fn reads_only_as_input(eg: &KilnGraph, args: &[Id], class: Id) -> bool {
    eg.find(args[0]) == class && args[1..].iter().all(|a| eg.find(*a) != class)
}

fn no_epilogue(g: &GemmSpec) -> bool {
    !g.bias && g.activation.is_none() && !g.swiglu && !g.residual
}

fn gemm_bias(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let (y, b) = (at(s, "?y"), at(s, "?b"));
    if !is_channel_param(eg, b, y) {
        return vec![];
    }
    let mut built = Vec::new();
    for (mut spec, mut args) in gemms(eg, y, no_epilogue) {
        spec.bias = true;
        args.push(b);
        built.extend(add_op(eg, Op::Gemm(spec), &args));
    }
    built
}

fn gemm_activation(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let Some(Op::Activation(act)) = attr_op(eg, at(s, "?a")).cloned() else {
        return vec![];
    };
    let mut built = Vec::new();
    for (mut spec, args) in gemms(eg, at(s, "?y"), |g| {
        g.activation.is_none() && !g.swiglu && !g.residual
    }) {
        spec.activation = Some(act);
        built.extend(add_op(eg, Op::Gemm(spec), &args));
    }
    built
}

fn gemm_swiglu(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let y = at(s, "?y");
    let is_silu = matches!(
        attr_op(eg, at(s, "?a")),
        Some(Op::Activation(Activation::Silu))
    );
    let Some(n) = ty(eg, y).and_then(|t| t.shape.last()?.as_const()) else {
        return vec![];
    };
    let last = rank(eg, y).unwrap_or(0).saturating_sub(1);
    let half = |attr: Id, start: i64, end: i64| {
        matches!(attr_op(eg, attr), Some(Op::Slice { axis, start: a, end: b })
            if *axis == last && a.as_const() == Some(start) && b.as_const() == Some(end))
    };
    if !is_silu || n % 2 != 0 || !half(at(s, "?s1"), 0, n / 2) || !half(at(s, "?s2"), n / 2, n) {
        return vec![];
    }
    let mut built = Vec::new();
    for (mut spec, args) in gemms(eg, y, |g| {
        g.activation.is_none() && !g.swiglu && !g.residual
    }) {
        spec.swiglu = true;
        built.extend(add_op(eg, Op::Gemm(spec), &args));
    }
    built
}

fn gemm_residual(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let (a, b) = (at(s, "?a"), at(s, "?b"));
    let mut built = Vec::new();
    for (y, r) in [(a, b), (b, a)] {
        if ty(eg, y) != ty(eg, r) {
            continue;
        }
        for (mut spec, mut args) in gemms(eg, y, |g| !g.residual) {
            spec.residual = true;
            args.push(r);
            built.extend(add_op(eg, Op::Gemm(spec), &args));
        }
    }
    built
}

fn norm_residual(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let Some(Op::Norm(mut spec)) = attr_op(eg, at(s, "?n")).cloned() else {
        return vec![];
    };
    if spec.residual {
        return vec![];
    }
    spec.residual = true;
    let mut args = vec![at(s, "?a"), at(s, "?r"), at(s, "?w")];
    args.extend(get(s, "?bias"));
    add_op(eg, Op::Norm(spec), &args).into_iter().collect()
}

fn embedding(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let (t, i) = (at(s, "?t"), at(s, "?i"));
    if !eg[t].data.weight_only {
        return vec![];
    }
    add_op(eg, Op::Embedding(EmbeddingSpec { tables: 1 }), &[t, i])
        .into_iter()
        .collect()
}

fn embedding_sum(eg: &mut KilnGraph, s: &Subst) -> Vec<Id> {
    let (a, b) = (at(s, "?a"), at(s, "?b"));
    let (ea, eb) = (
        nodes_named(eg, a, "embedding"),
        nodes_named(eg, b, "embedding"),
    );
    let mut built = Vec::new();
    for (oa, aa) in &ea {
        for (ob, ab) in &eb {
            if let (Op::Embedding(x), Op::Embedding(y)) = (oa, ob) {
                let spec = EmbeddingSpec {
                    tables: x.tables + y.tables,
                };
                let args: Vec<Id> = aa.iter().chain(ab).copied().collect();
                built.extend(add_op(eg, Op::Embedding(spec), &args));
            }
        }
    }
    built
}
