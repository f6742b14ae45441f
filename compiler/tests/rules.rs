//! Soundness of every fusion rule: for each rule, a small graph in the form importers produce is
//! saturated, the rule must fire, the extracted graph must contain the fused op, and both graphs,
//! run by the interpreter on fresh random inputs at several sequence lengths (odd ones included),
//! must agree; dropout masks must be bit-identical. Every alternative in every class is run too,
//! not only the one extraction picks. Near misses (softmax over another axis, a causal mask of
//! another size, masks added in the other order, a norm that also feeds a non-GEMM) must not
//! fuse, and a wrongly typed alternative is declined naming its rule.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::fusion::cost::CostModel;
use kiln_compiler::fusion::{rules, saturate, Limits};
use kiln_ir::kernel::{self, Activation};
use kiln_ir::{BinaryOp, DType, Dim, Graph, NodeId, Op, ReduceOp, RopeScaling, Tensor, UnaryOp};

/// A deterministic xorshift generator for test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }
    fn below(&mut self, n: u64) -> i64 {
        (self.next() % n) as i64
    }
}

const TABLE_ROWS: u64 = 11;

fn s() -> Dim {
    Dim::sym("S")
}

fn b() -> Dim {
    Dim::sym("B")
}

fn d(v: usize) -> Dim {
    Dim::from(v)
}

/// Random values for a graph's inputs, by name: `ids*` index a table, `mask*` are padding masks
/// (row `r` keeps its first tokens, at least one), `pos*` are positions, `seed` a seed.
fn inputs(g: &Graph, rng: &mut Rng, bindings: &BTreeMap<String, i64>) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for (_, name, ty) in g.inputs() {
        let shape: Vec<usize> = ty
            .shape
            .iter()
            .map(|d| d.eval(bindings).unwrap() as usize)
            .collect();
        let n: usize = shape.iter().product();
        let t = match ty.dtype {
            DType::F32 => Tensor::f32(shape, (0..n).map(|_| rng.uniform()).collect()),
            _ if name == "seed" => Tensor::i64(shape, vec![rng.next() as i64]),
            _ if name.starts_with("mask") => {
                let cols = *shape.last().unwrap();
                let mut v = Vec::with_capacity(n);
                for _ in 0..n / cols {
                    let keep = 1 + rng.below(cols as u64) as usize;
                    v.extend((0..cols).map(|c| i64::from(c < keep)));
                }
                Tensor::i64(shape, v)
            }
            _ if name.starts_with("pos") => {
                Tensor::i64(shape, (0..n).map(|_| rng.below(40)).collect())
            }
            _ => Tensor::i64(shape, (0..n).map(|_| rng.below(TABLE_ROWS)).collect()),
        };
        out.insert(name.to_string(), t);
    }
    out
}

fn weights(g: &Graph, rng: &mut Rng) -> BTreeMap<String, Arc<Tensor>> {
    g.weights()
        .map(|(_, name, ty)| {
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| d.as_const().unwrap() as usize)
                .collect();
            let n = shape.iter().product();
            (
                name.to_string(),
                Arc::new(Tensor::f32(shape, (0..n).map(|_| rng.uniform()).collect())),
            )
        })
        .collect()
}

/// Saturates `g`, checks that `rule` fired and that the extraction at every length holds an op
/// `fused` accepts, and compares both graphs on random inputs.
fn check(rule: &str, g: &Graph, fused: impl Fn(&Op) -> bool, dropout: bool) {
    let sat = saturate(g, &Limits::default()).unwrap();
    assert!(
        sat.rule_counts[rule] > 0,
        "rule {rule} did not fire: {:?}",
        sat.rule_counts
    );
    assert!(sat.declined.is_empty(), "{:?}", sat.declined);
    for (len, extracted) in extractions_agree(rule, g, &sat, dropout) {
        assert!(
            extracted.nodes().any(|(_, n)| fused(&n.op)),
            "{rule}: the extraction at S={len} lacks the fused op:\n{}",
            extracted.to_ron()
        );
    }
    let checked = alternatives_agree(rule, g, &sat, dropout);
    assert!(
        checked.iter().any(&fused),
        "{rule}: no alternative with the fused op was evaluated: {checked:?}"
    );
}

/// Every op alternative of every class of `g`'s nodes, whether extraction picks it or not,
/// computes what `g` computes at that node (at S = 5); returns the ops evaluated.
fn alternatives_agree(
    rule: &str,
    g: &Graph,
    sat: &kiln_compiler::fusion::Saturated,
    dropout: bool,
) -> Vec<Op> {
    let bindings = BTreeMap::from([
        ("S".to_string(), 5),
        ("B".to_string(), 2),
        ("T".to_string(), 23),
    ]);
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut checked = Vec::new();
    for (id, node) in g.nodes() {
        if node.op.is_leaf() {
            continue;
        }
        let mut probe = g.clone();
        probe.set_output("probe", id).unwrap();
        let alternatives = sat
            .alternatives(id, &bindings, &CostModel::default())
            .unwrap();
        for (op, alternative) in alternatives {
            let what = format!(
                "{rule}: {} for node {} ({})",
                op.name(),
                id.index(),
                node.op.name()
            );
            assert_agree(
                &what,
                (&probe, "probe"),
                (&alternative, "out"),
                &bindings,
                &mut rng,
                dropout,
            );
            checked.push(op);
        }
    }
    checked
}

/// Output `before.1` of graph `before.0` and output `after.1` of `after.0`, evaluated at
/// `bindings` on the same random inputs and weights, agree (with `dropout`, zeros bit for bit).
fn assert_agree(
    what: &str,
    before: (&Graph, &str),
    after: (&Graph, &str),
    bindings: &BTreeMap<String, i64>,
    rng: &mut Rng,
    dropout: bool,
) {
    let (b, a) = (
        before.0.specialize(bindings).unwrap(),
        after.0.specialize(bindings).unwrap(),
    );
    let w = weights(before.0, rng);
    let all = inputs(before.0, rng, bindings);
    let pick = |graph: &Graph| -> BTreeMap<String, Tensor> {
        graph
            .inputs()
            .map(|(_, n, _)| (n.to_string(), all[n].clone()))
            .collect()
    };
    let want = kiln_ir::evaluate(&b, &pick(&b), &w).unwrap();
    let got = kiln_ir::evaluate(&a, &pick(&a), &w).unwrap();
    let (e, x) = (
        want[before.1].as_f32().unwrap(),
        got[after.1].as_f32().unwrap(),
    );
    let scale = e.iter().fold(1f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in x.iter().zip(e).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: {x} vs {y}");
        if dropout {
            assert_eq!(*x == 0.0, *y == 0.0, "{what}: dropout masks differ at {i}");
        }
    }
}

/// A near miss of `rule`: `g` saturates without an extraction holding an op `fused` accepts, and
/// what is extracted still computes what `g` computes.
fn near_miss(rule: &str, g: &Graph, fused: impl Fn(&Op) -> bool) {
    let sat = saturate(g, &Limits::default()).unwrap();
    assert!(sat.declined.is_empty(), "{:?}", sat.declined);
    for (len, extracted) in extractions_agree(rule, g, &sat, false) {
        assert!(
            !extracted.nodes().any(|(_, n)| fused(&n.op)),
            "{rule} fused a near miss at S={len}:\n{}",
            extracted.to_ron()
        );
    }
}

/// Extracts `sat` at several lengths (odd ones included) and compares each extraction with `g`
/// on random inputs (with `dropout`, the masks bit for bit); returns the extractions.
fn extractions_agree(
    rule: &str,
    g: &Graph,
    sat: &kiln_compiler::fusion::Saturated,
    dropout: bool,
) -> Vec<(i64, Graph)> {
    let mut extractions = Vec::new();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for len in [1i64, 5, 17] {
        let bindings = BTreeMap::from([
            ("S".to_string(), len),
            ("B".to_string(), 2),
            ("T".to_string(), 23),
        ]);
        let (extracted, _) = sat.extract(&bindings, &CostModel::default()).unwrap();
        for output in g.outputs() {
            let name = output.name.as_str();
            let what = format!("{rule} S={len} {name}");
            assert_agree(
                &what,
                (g, name),
                (&extracted, name),
                &bindings,
                &mut rng,
                dropout,
            );
        }
        extractions.push((len, extracted));
    }
    extractions
}

fn output(mut g: Graph, out: NodeId) -> Graph {
    g.set_output("out", out).unwrap();
    g
}

fn input(g: &mut Graph, name: &str, shape: Vec<Dim>) -> NodeId {
    g.input(name, DType::F32, shape).unwrap()
}

fn is(name: &'static str) -> impl Fn(&Op) -> bool {
    move |op| op.name() == name
}

/// Every rule in the rule files has a soundness test below.
#[test]
fn every_rule_is_tested() {
    let tested = [
        "softmax",
        "softmax-dropout",
        "gelu-tanh",
        "gelu-erf",
        "silu",
        "relu",
        "layer-norm",
        "rms-norm",
        "layer-norm-residual",
        "rms-norm-residual",
        "norm-prologue",
        "layer-norm-prologue",
        "repeat-kv",
        "attention-masked",
        "attention-masked-dropout",
        "decode-attention",
        "attention",
        "attention-dropout",
        "gemm-linear",
        "gemm",
        "gemm-bias",
        "gemm-activation",
        "gemm-swiglu",
        "gemm-residual",
        "embedding",
        "embedding-sum",
    ];
    for rule in rules().unwrap() {
        assert!(
            tested.contains(&rule.spec.name.as_str()),
            "rule {} has no test",
            rule.spec.name
        );
        assert!(
            !rule.spec.doc.is_empty(),
            "rule {} has no doc line",
            rule.spec.name
        );
    }
}

#[test]
fn softmax() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(7)]);
    let y = kernel::softmax(&mut g, x).unwrap();
    check("softmax", &output(g, y), is("softmax"), false);
}

#[test]
fn softmax_dropout() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![b(), s(), d(9)]);
    let seed = g.input("seed", DType::I64, vec![]).unwrap();
    let sm = kernel::softmax(&mut g, x).unwrap();
    let y = g
        .add(Op::Dropout { p: 0.3, stream: 1 }, &[sm, seed])
        .unwrap();
    check(
        "softmax-dropout",
        &output(g, y),
        is("softmax_dropout"),
        true,
    );
}

fn activation_probe(rule: &str, a: Activation) {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(6)]);
    let y = kernel::activation(&mut g, x, a).unwrap();
    check(
        rule,
        &output(g, y),
        move |op| *op == Op::Activation(a),
        false,
    );
}

#[test]
fn activations() {
    activation_probe("gelu-tanh", Activation::GeluTanh);
    activation_probe("gelu-erf", Activation::GeluErf);
    activation_probe("silu", Activation::Silu);
    activation_probe("relu", Activation::Relu);
}

/// `max(x, eps)` is not a ReLU: constants are matched exactly.
#[test]
fn relu_needs_an_exact_zero() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(3)]);
    let eps = g.scalar(1e-9, DType::F32);
    let y = g.binary(BinaryOp::Max, x, eps).unwrap();
    let sat = saturate(&output(g, y), &Limits::default()).unwrap();
    assert_eq!(sat.rule_counts["relu"], 0);
}

fn norm_probe(rule: &str, layer: bool, residual: bool) {
    let mut g = Graph::new();
    let mut x = input(&mut g, "x", vec![s(), d(8)]);
    if residual {
        let r = input(&mut g, "r", vec![s(), d(8)]);
        x = g.add_(x, r).unwrap();
    }
    let w = input(&mut g, "w", vec![d(8)]);
    let y = if layer {
        let bias = input(&mut g, "bias", vec![d(8)]);
        kernel::layer_norm(&mut g, x, w, bias, 1e-5).unwrap()
    } else {
        kernel::rms_norm(&mut g, x, w, 1e-6).unwrap()
    };
    check(
        rule,
        &output(g, y),
        move |op| matches!(op, Op::Norm(n) if n.residual == residual),
        false,
    );
}

#[test]
fn norms() {
    norm_probe("layer-norm", true, false);
    norm_probe("rms-norm", false, false);
    norm_probe("layer-norm-residual", true, true);
    norm_probe("rms-norm-residual", false, true);
}

/// A norm whose only consumer is a GEMM moves into the GEMM's prologue (with the GEMM's own
/// epilogues kept).
#[test]
fn norm_prologues() {
    for layer in [false, true] {
        let mut g = Graph::new();
        let x = input(&mut g, "x", vec![b(), s(), d(8)]);
        let w = input(&mut g, "w", vec![d(8)]);
        let n = if layer {
            let bias = input(&mut g, "bias", vec![d(8)]);
            kernel::layer_norm(&mut g, x, w, bias, 1e-5).unwrap()
        } else {
            kernel::rms_norm(&mut g, x, w, 1e-6).unwrap()
        };
        let wm = weight(&mut g, "proj", &[6, 8]);
        let wt = g.transpose_last(wm).unwrap();
        let y = g.matmul(n, wt).unwrap();
        let r = input(&mut g, "r", vec![b(), s(), d(6)]);
        let y = g.add_(y, r).unwrap();
        let rule = if layer {
            "layer-norm-prologue"
        } else {
            "norm-prologue"
        };
        check(
            rule,
            &output(g, y),
            gemm_has(|s| s.prologue.is_some() && s.residual),
            false,
        );
    }
}

#[test]
fn repeat_kv() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![b(), d(2), s(), d(4)]);
    let y = kernel::repeat_kv(&mut g, x, 3).unwrap();
    check("repeat-kv", &output(g, y), |_| true, false);
}

/// An attention block as the Llama importer builds it: RoPE on Q and K, K/V heads repeated for
/// their query groups, padding + causal (optionally windowed) mask, optional dropout.
fn attention_graph(
    heads: usize,
    kv_heads: usize,
    padding: bool,
    causal: Option<Option<i64>>,
    rope: bool,
    dropout: bool,
) -> Graph {
    let mut g = Graph::new();
    let mut q = input(&mut g, "q", vec![b(), d(heads), s(), d(8)]);
    let mut k = input(&mut g, "k", vec![b(), d(kv_heads), s(), d(8)]);
    let v = input(&mut g, "v", vec![b(), d(kv_heads), s(), d(8)]);
    let mask = padding.then(|| g.input("mask", DType::I64, vec![b(), s()]).unwrap());
    if rope {
        let pos = g.input("pos", DType::I64, vec![b(), s()]).unwrap();
        let op = Op::Rope {
            theta: 500.0,
            scaling: RopeScaling::Default,
        };
        q = g.add(op.clone(), &[q, pos]).unwrap();
        k = g.add(op, &[k, pos]).unwrap();
    }
    let k = kernel::repeat_kv(&mut g, k, heads / kv_heads).unwrap();
    let v = kernel::repeat_kv(&mut g, v, heads / kv_heads).unwrap();
    let m =
        kernel::attention_mask(&mut g, DType::F32, mask, causal.map(|w| (s(), s(), w))).unwrap();
    let drop = dropout.then(|| (0.2, 4, g.input("seed", DType::I64, vec![]).unwrap()));
    let y = kernel::sdpa(&mut g, q, k, v, m, 0.35, drop).unwrap();
    output(g, y)
}

fn attention_has(padding: bool, causal: bool, rope: bool, dropout: bool) -> impl Fn(&Op) -> bool {
    move |op| {
        matches!(op, Op::Attention(a) if a.padding == padding && a.causal == causal
            && a.rope.is_some() == rope && a.dropout.is_some() == dropout)
    }
}

#[test]
fn attention_decoder_gqa_rope() {
    let g = attention_graph(4, 2, true, Some(None), true, false);
    check(
        "attention-masked",
        &g,
        attention_has(true, true, true, false),
        false,
    );
    let g = attention_graph(6, 1, true, Some(Some(3)), true, false);
    check(
        "attention-masked",
        &g,
        attention_has(true, true, true, false),
        false,
    );
}

#[test]
fn attention_encoder_and_causal_only() {
    let g = attention_graph(3, 3, true, None, false, false);
    check(
        "attention-masked",
        &g,
        attention_has(true, false, false, false),
        false,
    );
    let g = attention_graph(2, 2, false, Some(None), false, false);
    check(
        "attention-masked",
        &g,
        attention_has(false, true, false, false),
        false,
    );
}

#[test]
fn attention_without_mask() {
    let g = attention_graph(2, 1, false, None, false, false);
    check(
        "attention",
        &g,
        attention_has(false, false, false, false),
        false,
    );
}

#[test]
fn attention_with_dropout() {
    let g = attention_graph(2, 2, false, None, false, true);
    check(
        "attention-dropout",
        &g,
        attention_has(false, false, false, true),
        false,
    );
    let g = attention_graph(4, 2, true, Some(None), true, true);
    check(
        "attention-masked-dropout",
        &g,
        attention_has(true, true, true, true),
        false,
    );
}

/// Attention of a query chunk over a KV cache, as the cached decoder graphs build it: q rotated at
/// its positions, the cache's K/V heads repeated, the position mask (optionally windowed).
#[test]
fn decode_attention() {
    for window in [None, Some(5)] {
        let mut g = Graph::new();
        let q = input(&mut g, "q", vec![b(), d(4), s(), d(8)]);
        let k = input(&mut g, "k", vec![b(), d(2), Dim::sym("T"), d(8)]);
        let v = input(&mut g, "v", vec![b(), d(2), Dim::sym("T"), d(8)]);
        let pos = g.input("pos", DType::I64, vec![b(), s()]).unwrap();
        let rope = Op::Rope {
            theta: 1e4,
            scaling: RopeScaling::Default,
        };
        let q = g.add(rope, &[q, pos]).unwrap();
        let k = kernel::repeat_kv(&mut g, k, 2).unwrap();
        let v = kernel::repeat_kv(&mut g, v, 2).unwrap();
        let m = kernel::position_mask(&mut g, pos, Dim::sym("T"), window, DType::F32).unwrap();
        let y = kernel::sdpa(&mut g, q, k, v, Some(m), 0.3, None).unwrap();
        check(
            "decode-attention",
            &output(g, y),
            move |op| matches!(op, Op::DecodeAttention(a) if a.rope.is_some() && a.window == window),
            false,
        );
    }
}

fn weight(g: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
    g.weight(name, DType::F32, shape.iter().map(|&v| d(v)).collect())
        .unwrap()
}

fn gemm_has(f: impl Fn(&kernel::GemmSpec) -> bool) -> impl Fn(&Op) -> bool {
    move |op| matches!(op, Op::Gemm(spec) if f(spec))
}

#[test]
fn gemm_plain() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![b(), s(), d(5)]);
    let w = weight(&mut g, "w", &[7, 5]);
    let wt = g.transpose_last(w).unwrap();
    let y = g.matmul(x, wt).unwrap();
    check(
        "gemm-linear",
        &output(g, y),
        gemm_has(|s| s.transpose_b),
        false,
    );
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(5)]);
    let w = weight(&mut g, "w", &[5, 7]);
    let y = g.matmul(x, w).unwrap();
    check("gemm", &output(g, y), gemm_has(|s| !s.transpose_b), false);
}

#[test]
fn gemm_epilogues() {
    // bias + tanh GELU (GPT-2's MLP up projection).
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(5)]);
    let w = weight(&mut g, "w", &[5, 7]);
    let bias = weight(&mut g, "b", &[7]);
    let y = g.matmul(x, w).unwrap();
    let y = g.add_(y, bias).unwrap();
    let y = kernel::activation(&mut g, y, Activation::GeluTanh).unwrap();
    let g2 = output(g, y);
    check(
        "gemm-bias",
        &g2,
        gemm_has(|s| s.bias && s.activation == Some(Activation::GeluTanh)),
        false,
    );
    check(
        "gemm-activation",
        &g2,
        gemm_has(|s| s.activation.is_some()),
        false,
    );

    // SwiGLU over [gate | up] weights (the Llama MLP).
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![b(), s(), d(5)]);
    let w = weight(&mut g, "w", &[12, 5]);
    let wt = g.transpose_last(w).unwrap();
    let y = g.matmul(x, wt).unwrap();
    let y = kernel::swiglu(&mut g, y).unwrap();
    check("gemm-swiglu", &output(g, y), gemm_has(|s| s.swiglu), false);

    // Residual, in both operand orders.
    for residual_first in [false, true] {
        let mut g = Graph::new();
        let x = input(&mut g, "x", vec![s(), d(5)]);
        let r = input(&mut g, "r", vec![s(), d(7)]);
        let w = weight(&mut g, "w", &[7, 5]);
        let wt = g.transpose_last(w).unwrap();
        let y = g.matmul(x, wt).unwrap();
        let y = if residual_first {
            g.add_(r, y)
        } else {
            g.add_(y, r)
        }
        .unwrap();
        check(
            "gemm-residual",
            &output(g, y),
            gemm_has(|s| s.residual),
            false,
        );
    }
}

#[test]
fn embeddings() {
    let mut g = Graph::new();
    let t = weight(&mut g, "tok", &[TABLE_ROWS as usize, 4]);
    let ids = g.input("ids", DType::I64, vec![b(), s()]).unwrap();
    let y = g.add(Op::Gather, &[t, ids]).unwrap();
    check("embedding", &output(g, y), is("embedding"), false);

    let mut g = Graph::new();
    let t = weight(&mut g, "tok", &[TABLE_ROWS as usize, 4]);
    let p = weight(&mut g, "pos_table", &[40, 4]);
    let ids = g.input("ids", DType::I64, vec![b(), s()]).unwrap();
    let pos = g.input("pos", DType::I64, vec![b(), s()]).unwrap();
    let a = g.add(Op::Gather, &[t, ids]).unwrap();
    let c = g.add(Op::Gather, &[p, pos]).unwrap();
    let y = g.add_(a, c).unwrap();
    check(
        "embedding-sum",
        &output(g, y),
        |op| matches!(op, Op::Embedding(e) if e.tables == 2),
        false,
    );
}

/// Softmax over an axis other than the last is not the softmax kernel.
#[test]
fn softmax_over_the_wrong_axis_is_not_fused() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(7)]);
    let m = g.reduce(ReduceOp::Max, x, 0).unwrap();
    let shifted = g.sub(x, m).unwrap();
    let e = g.unary(UnaryOp::Exp, shifted).unwrap();
    let sum = g.reduce(ReduceOp::Sum, e, 0).unwrap();
    let y = g.div(e, sum).unwrap();
    near_miss("softmax", &output(g, y), is("softmax"));
}

/// Attention whose mask is padding plus a causal mask of another size than the scores (one row,
/// broadcast over the queries), or plus causal in the other order than importers write, is not
/// the attention kernel.
#[test]
fn attention_with_a_near_miss_mask_is_not_fused() {
    let build = |causal_rows: Dim, padding_first: bool| {
        let mut g = Graph::new();
        let q = input(&mut g, "q", vec![b(), d(2), s(), d(4)]);
        let k = input(&mut g, "k", vec![b(), d(2), s(), d(4)]);
        let v = input(&mut g, "v", vec![b(), d(2), s(), d(4)]);
        let mask = g.input("mask", DType::I64, vec![b(), s()]).unwrap();
        let pad = g.add(Op::PaddingMask(DType::F32), &[mask]).unwrap();
        let causal = Op::CausalMask {
            rows: causal_rows,
            cols: s(),
            window: None,
            dtype: DType::F32,
        };
        let causal = g.add(causal, &[]).unwrap();
        let m = if padding_first {
            g.add_(pad, causal)
        } else {
            g.add_(causal, pad)
        }
        .unwrap();
        let y = kernel::sdpa(&mut g, q, k, v, Some(m), 0.5, None).unwrap();
        output(g, y)
    };
    let attention = |op: &Op| matches!(op, Op::Attention(a) if a.causal);
    near_miss("attention-masked", &build(d(1), true), attention);
    near_miss("attention-masked", &build(s(), false), attention);
    // The canonical form of the same graph fuses (so the near misses above test the guards).
    check("attention-masked", &build(s(), true), attention, false);
}

/// A norm that also feeds a residual add is computed once, not moved into the GEMM's prologue.
#[test]
fn a_norm_with_a_consumer_that_is_not_a_gemm_stays_a_norm() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![b(), s(), d(8)]);
    let w = input(&mut g, "w", vec![d(8)]);
    let n = kernel::rms_norm(&mut g, x, w, 1e-6).unwrap();
    let wm = weight(&mut g, "proj", &[8, 8]);
    let wt = g.transpose_last(wm).unwrap();
    let y = g.matmul(n, wt).unwrap();
    let y = g.add_(y, n).unwrap();
    let g = output(g, y);
    let prologue = gemm_has(|s| s.prologue.is_some());
    near_miss("norm-prologue", &g, &prologue);
    // Not even as an alternative extraction passes over.
    let sat = saturate(&g, &Limits::default()).unwrap();
    let ops = alternatives_agree("norm-prologue", &g, &sat, false);
    assert!(ops.iter().any(|op| matches!(op, Op::Gemm(_))), "{ops:?}");
    assert!(!ops.iter().any(prologue), "{ops:?}");
}

/// A builder's node of another type than the matched class is declined with an error naming the
/// rule; the e-graph keeps the class as it was instead of the analysis panicking.
#[test]
fn a_wrongly_typed_alternative_is_declined_naming_the_rule() {
    use kiln_compiler::fusion::lang::{Attr, ENode};
    use kiln_compiler::fusion::rules::union_checked;
    use kiln_compiler::fusion::to_egraph;
    let mut g = Graph::new();
    let x = input(&mut g, "x", vec![s(), d(7)]);
    let y = kernel::softmax(&mut g, x).unwrap();
    let other = input(&mut g, "other", vec![s(), d(3)]);
    let (mut eg, ids) = to_egraph(&output(g, y)).unwrap();
    let class = ids[y.index()];
    let leaf = Attr::leaf(
        Op::Input("other".into()),
        kiln_ir::TensorType::new(DType::F32, vec![s(), d(3)]),
    );
    let wrong = eg.add(ENode::Leaf(leaf));
    assert_eq!(wrong, ids[other.index()]);
    assert!(!union_checked(&mut eg, class, wrong, "softmax"));
    assert_eq!(eg.analysis.declined.len(), 1);
    let message = &eg.analysis.declined[0];
    assert!(
        message.contains("rule `softmax` built f32[S, 3]"),
        "{message}"
    );
    assert_ne!(eg.find(class), eg.find(wrong));
}
