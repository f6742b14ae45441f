//! `--report` names only rules that exist: every name `fusion::cost::fusions` gives a kernel op
//! (the report's `rules` per kernel) is the name of a rule in `compiler/rules/*.ron`.

use kiln_compiler::fusion::cost::fusions;
use kiln_compiler::fusion::rules;
use kiln_ir::kernel::{
    Activation, AttentionSpec, DecodeAttentionSpec, EmbeddingSpec, GemmSpec, NormKind, NormSpec,
};
use kiln_ir::{Op, RopeScaling};

/// Every kernel op, with every flag a report distinguishes set and unset.
fn kernel_ops() -> Vec<Op> {
    let mut ops = vec![Op::Softmax, Op::SoftmaxDropout { p: 0.1, stream: 0 }];
    ops.extend([Activation::GeluErf, Activation::Relu].map(Op::Activation));
    let rope = Some((1e4, RopeScaling::Default));
    for bits in 0..16u32 {
        let flag = |i: u32| bits & (1 << i) != 0;
        ops.push(Op::Attention(AttentionSpec {
            scale: 0.5,
            causal: flag(0),
            window: None,
            padding: flag(1),
            rope: flag(2).then(|| rope.clone().unwrap()),
            dropout: flag(3).then_some((0.1, 0)),
        }));
    }
    for r in [None, rope] {
        ops.push(Op::DecodeAttention(DecodeAttentionSpec {
            scale: 0.5,
            window: None,
            rope: r,
        }));
    }
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for residual in [false, true] {
            let norm = NormSpec {
                kind,
                eps: 1e-5,
                residual,
            };
            ops.push(Op::Norm(norm.clone()));
            if !residual {
                let mut gemm = GemmSpec::plain(true);
                gemm.prologue = Some(norm);
                ops.push(Op::Gemm(gemm));
            }
        }
    }
    for bits in 0..32u32 {
        let flag = |i: u32| bits & (1 << i) != 0;
        ops.push(Op::Gemm(GemmSpec {
            transpose_b: flag(0),
            bias: flag(1),
            activation: flag(2).then_some(Activation::Silu),
            swiglu: flag(3),
            residual: flag(4),
            prologue: None,
        }));
    }
    ops.extend([1, 2].map(|tables| Op::Embedding(EmbeddingSpec { tables })));
    ops
}

#[test]
fn reports_name_only_rules_that_exist() {
    let names: Vec<&str> = rules()
        .unwrap()
        .iter()
        .map(|r| r.spec.name.as_str())
        .collect();
    let mut unknown: Vec<(String, &str)> = Vec::new();
    for op in kernel_ops() {
        for name in fusions(&op) {
            if !names.contains(&name) {
                unknown.push((format!("{op:?}"), name));
            }
        }
    }
    unknown.sort_by(|a, b| a.1.cmp(b.1));
    unknown.dedup_by(|a, b| a.1 == b.1);
    assert!(
        unknown.is_empty(),
        "report names that are not rules (name, first op that gets it): {:#?}",
        unknown
            .iter()
            .map(|(op, name)| format!("{name}: {op}"))
            .collect::<Vec<_>>()
    );
}
