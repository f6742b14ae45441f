//! The reference interpreter's semantics, op by op, on small hand-checked cases; dropout's
//! bucket-independence; and typing errors that name the node.

use std::collections::BTreeMap;

use kiln_ir::interp::evaluate;
use kiln_ir::{BinaryOp, DType, Dim, Graph, Op, ReduceOp, RopeScaling, Tensor, UnaryOp, MASK_NEG};

fn run(g: &Graph, inputs: Vec<(&str, Tensor)>) -> Result<Tensor, String> {
    let inputs: BTreeMap<String, Tensor> = inputs.into_iter().map(|(k, v)| (k.into(), v)).collect();
    let weights = BTreeMap::new();
    let mut out = evaluate(g, &inputs, &weights).map_err(|e| e.to_string())?;
    Ok(out.remove("out").expect("graph has an `out` output"))
}

fn dims(v: &[i64]) -> Vec<Dim> {
    v.iter().map(|&d| Dim::constant(d)).collect()
}

fn sym(names: &[&str]) -> Vec<Dim> {
    names.iter().map(|n| Dim::parse(n).unwrap()).collect()
}

#[test]
fn elementwise_reduce_and_broadcast() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, sym(&["R", "C"])).unwrap();
    let m = g.reduce(ReduceOp::Max, x, -1).unwrap();
    let s = g.sub(x, m).unwrap();
    let e = g.unary(UnaryOp::Exp, s).unwrap();
    let sum = g.reduce(ReduceOp::Sum, e, 1).unwrap();
    let p = g.div(e, sum).unwrap();
    g.set_output("out", p).unwrap();
    let t = run(
        &g,
        vec![(
            "x",
            Tensor::f32(vec![2, 3], vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0]),
        )],
    )
    .unwrap();
    let v = t.as_f32().unwrap();
    let z = 1.0 + (-1f64).exp() + (-2f64).exp();
    assert!((f64::from(v[2]) - 1.0 / z).abs() < 1e-7);
    assert!((f64::from(v[4]) - 1.0 / 3.0).abs() < 1e-7);
}

#[test]
fn matmul_batched_and_shared_rhs() {
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, dims(&[2, 1, 2])).unwrap();
    let b = g.input("b", DType::F32, dims(&[2, 2])).unwrap();
    let y = g.matmul(a, b).unwrap();
    g.set_output("out", y).unwrap();
    let t = run(
        &g,
        vec![
            ("a", Tensor::f32(vec![2, 1, 2], vec![1.0, 2.0, 3.0, 4.0])),
            ("b", Tensor::f32(vec![2, 2], vec![1.0, 10.0, 100.0, 1000.0])),
        ],
    )
    .unwrap();
    assert_eq!(t.shape, vec![2, 1, 2]);
    assert_eq!(t.as_f32().unwrap(), &[201.0, 2010.0, 403.0, 4030.0]);
}

#[test]
fn layout_ops() {
    let mut g = Graph::new();
    let x = g.input("x", DType::I64, dims(&[2, 3])).unwrap();
    let t = g.permute(x, vec![1, 0]).unwrap();
    let s = g.slice(t, 0, Dim::constant(1), Dim::constant(3)).unwrap();
    let r = g.reshape(s, dims(&[4])).unwrap();
    let c = g.add(Op::Concat(0), &[r, r]).unwrap();
    g.set_output("out", c).unwrap();
    let out = run(
        &g,
        vec![("x", Tensor::i64(vec![2, 3], vec![0, 1, 2, 3, 4, 5]))],
    )
    .unwrap();
    assert_eq!(out.as_i64().unwrap(), &[1, 4, 2, 5, 1, 4, 2, 5]);
}

#[test]
fn symbolic_slice_of_the_last_row() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, sym(&["S", "2"])).unwrap();
    let s = Dim::sym("S");
    let last = g.slice(x, 0, s.clone() - Dim::constant(1), s).unwrap();
    g.set_output("out", last).unwrap();
    let out = run(
        &g,
        vec![("x", Tensor::f32(vec![3, 2], vec![0., 1., 2., 3., 4., 5.]))],
    )
    .unwrap();
    assert_eq!(out.as_f32().unwrap(), &[4.0, 5.0]);
}

#[test]
fn cast_where_and_max() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, dims(&[4])).unwrap();
    let c = g.cast(x, DType::Bool).unwrap();
    let z = g.scalar(-7.0, DType::F32);
    let zb = g.broadcast_to(z, &dims(&[4])).unwrap();
    let w = g.add(Op::Where, &[c, x, zb]).unwrap();
    let m = g.binary(BinaryOp::Max, w, x).unwrap();
    let h = g.cast(m, DType::BF16).unwrap();
    g.set_output("out", h).unwrap();
    let out = run(
        &g,
        vec![("x", Tensor::f32(vec![4], vec![0.0, -1.5, 3.0, 1.0 / 3.0]))],
    )
    .unwrap();
    assert_eq!(out.dtype, DType::BF16);
    assert_eq!(
        out.as_f32().unwrap(),
        &[0.0, -1.5, 3.0, half::bf16::from_f32(1.0 / 3.0).to_f32()]
    );
}

#[test]
fn gather_checks_ids() {
    let mut g = Graph::new();
    let table = g.input("table", DType::F32, dims(&[3, 2])).unwrap();
    let ids = g.input("ids", DType::I64, dims(&[2])).unwrap();
    let y = g.add(Op::Gather, &[table, ids]).unwrap();
    g.set_output("out", y).unwrap();
    let tab = Tensor::f32(vec![3, 2], vec![0., 1., 2., 3., 4., 5.]);
    let out = run(
        &g,
        vec![
            ("table", tab.clone()),
            ("ids", Tensor::i64(vec![2], vec![2, 0])),
        ],
    )
    .unwrap();
    assert_eq!(out.as_f32().unwrap(), &[4., 5., 0., 1.]);
    let err = run(
        &g,
        vec![("table", tab), ("ids", Tensor::i64(vec![2], vec![3, 0]))],
    )
    .unwrap_err();
    assert_eq!(
        err,
        "node %2 (gather): id 3 at flat position 0 is out of range for a table of 3 rows"
    );
}

#[test]
fn causal_mask_with_offset_and_window() {
    let mut g = Graph::new();
    let m = g
        .add(
            Op::CausalMask {
                rows: Dim::constant(2),
                cols: Dim::constant(4),
                window: Some(2),
                dtype: DType::F32,
            },
            &[],
        )
        .unwrap();
    g.set_output("out", m).unwrap();
    let out = run(&g, vec![]).unwrap();
    let n = MASK_NEG;
    // Query 0 is at absolute position 2, query 1 at 3; each sees itself and one key before.
    assert_eq!(out.as_f32().unwrap(), &[n, 0.0, 0.0, n, n, n, 0.0, 0.0]);
}

#[test]
fn padding_mask_shape_and_values() {
    let mut g = Graph::new();
    let mask = g.input("mask", DType::I64, sym(&["B", "S"])).unwrap();
    let p = g.add(Op::PaddingMask(DType::F32), &[mask]).unwrap();
    g.set_output("out", p).unwrap();
    let out = run(
        &g,
        vec![("mask", Tensor::i64(vec![2, 2], vec![1, 0, 1, 1]))],
    )
    .unwrap();
    assert_eq!(out.shape, vec![2, 1, 1, 2]);
    assert_eq!(out.as_f32().unwrap(), &[0.0, MASK_NEG, 0.0, 0.0]);
}

#[test]
fn rope_rotates_pairs_half_apart() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, dims(&[1, 1, 2, 4])).unwrap();
    let pos = g.input("pos", DType::I64, dims(&[1, 2])).unwrap();
    let r = g
        .add(
            Op::Rope {
                theta: 100.0,
                scaling: RopeScaling::Default,
            },
            &[x, pos],
        )
        .unwrap();
    g.set_output("out", r).unwrap();
    let xs = vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
    let out = run(
        &g,
        vec![
            ("x", Tensor::f32(vec![1, 1, 2, 4], xs)),
            ("pos", Tensor::i64(vec![1, 2], vec![0, 5])),
        ],
    )
    .unwrap();
    let v = out.as_f32().unwrap();
    assert_eq!(&v[..4], &[1.0, 2.0, 3.0, 4.0], "position 0 is the identity");
    // Column 1 pairs with column 3 at frequency 100^(-2/4) = 0.1; angle 0.5 at position 5.
    let (s, c) = 0.5f64.sin_cos();
    assert!((f64::from(v[5]) - (2.0 * c - 4.0 * s)).abs() < 1e-6);
    assert!((f64::from(v[7]) - (4.0 * c + 2.0 * s)).abs() < 1e-6);
}

fn dropout_graph(shape: Vec<Dim>) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, shape).unwrap();
    let seed = g.input("seed", DType::I64, vec![]).unwrap();
    let d = g
        .add(Op::Dropout { p: 0.25, stream: 3 }, &[x, seed])
        .unwrap();
    g.set_output("out", d).unwrap();
    g
}

/// The mask depends on coordinates, not flat indices: padding a tensor to a larger bucket leaves
/// the mask of the original elements unchanged; the seed changes it; kept values are scaled.
#[test]
fn dropout_mask_is_bucket_independent() {
    let g = dropout_graph(sym(&["P", "R", "C"]));
    let ones = |p: usize, r: usize, c: usize| Tensor::f32(vec![p, r, c], vec![1.0; p * r * c]);
    let seed = |s: i64| Tensor::i64(vec![], vec![s]);
    let small = run(&g, vec![("x", ones(2, 5, 7)), ("seed", seed(9))]).unwrap();
    let big = run(&g, vec![("x", ones(2, 8, 16)), ("seed", seed(9))]).unwrap();
    let (sv, bv) = (small.as_f32().unwrap(), big.as_f32().unwrap());
    for p in 0..2 {
        for r in 0..5 {
            for c in 0..7 {
                assert_eq!(
                    sv[(p * 5 + r) * 7 + c],
                    bv[(p * 8 + r) * 16 + c],
                    "({p}, {r}, {c})"
                );
            }
        }
    }
    let scale = 1.0f32 / (1.0f32 - 0.25f32);
    assert!(bv.iter().all(|&v| v == 0.0 || v == scale));
    let kept = bv.iter().filter(|&&v| v != 0.0).count() as f64 / bv.len() as f64;
    assert!((kept - 0.75).abs() < 0.1, "keep rate {kept}");
    let other = run(&g, vec![("x", ones(2, 8, 16)), ("seed", seed(10))]).unwrap();
    assert_ne!(other.as_f32().unwrap(), bv);
}

/// One element recomputed by hand from the definition in DESIGN.md section 2.
#[test]
fn dropout_matches_the_written_definition() {
    use kiln_ir::philox::{dropout_threshold, philox4x32_10};
    let g = dropout_graph(dims(&[2, 3, 6]));
    let seed: i64 = 0x0123_4567_89ab_cdef;
    let out = run(
        &g,
        vec![
            ("x", Tensor::f32(vec![2, 3, 6], vec![2.0; 36])),
            ("seed", Tensor::i64(vec![], vec![seed])),
        ],
    )
    .unwrap();
    let key = [(seed as u64) as u32, ((seed as u64) >> 32) as u32];
    let t = dropout_threshold(0.25);
    for (i, &v) in out.as_f32().unwrap().iter().enumerate() {
        let (plane, row, col) = ((i / 18) as u32, ((i / 6) % 3) as u32, (i % 6) as u32);
        let word = philox4x32_10([col >> 2, row, plane, 3], key)[(col & 3) as usize];
        let want = if word >= t { 2.0 / 0.75f32 } else { 0.0 };
        assert_eq!(v, want, "element {i}");
    }
}

#[test]
fn typing_errors_name_the_node() {
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, dims(&[2, 3])).unwrap();
    let b = g.input("b", DType::F32, dims(&[4, 5])).unwrap();
    let err = g.matmul(a, b).unwrap_err().to_string();
    assert_eq!(
        err,
        "node %2 (matmul): contraction dims differ: f32[2, 3] x f32[4, 5]"
    );
    let err = g.reshape(a, dims(&[7])).unwrap_err().to_string();
    assert_eq!(
        err,
        "node %2 (reshape): cannot reshape f32[2, 3] to [7]: element counts differ"
    );
    let err = g
        .add(Op::Binary(BinaryOp::Add), &[a, b])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "node %2 (add): operands differ: f32[2, 3] vs f32[4, 5]"
    );
}

#[test]
fn inputs_are_checked_against_declarations() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, sym(&["B", "S"])).unwrap();
    let y = g.input("y", DType::F32, sym(&["S"])).unwrap();
    let yb = g.broadcast_to(y, &sym(&["B", "S"])).unwrap();
    let s = g.add_(x, yb).unwrap();
    g.set_output("out", s).unwrap();
    let err = run(
        &g,
        vec![
            ("x", Tensor::f32(vec![2, 3], vec![0.0; 6])),
            ("y", Tensor::f32(vec![4], vec![0.0; 4])),
        ],
    )
    .unwrap_err();
    assert_eq!(err, "input `y` must be f32[S], found f32[4]");
    let err = run(&g, vec![("x", Tensor::f32(vec![2, 3], vec![0.0; 6]))]).unwrap_err();
    assert_eq!(err, "missing input `y`");
}

/// Attention over `[2, 1, 3, 2]` q, k, v with padding `mask` (`[2, 3]`), causal or not, built
/// as importers build it (`kernel::sdpa` over primitives) or as the fused kernel op; returns
/// the output.
fn masked_attention(dtype: DType, fused: bool, causal: bool, mask: Vec<i64>) -> Vec<f32> {
    use kiln_ir::kernel::{self, AttentionSpec};
    let mut g = Graph::new();
    let shape = dims(&[2, 1, 3, 2]);
    let q = g.input("q", dtype, shape.clone()).unwrap();
    let k = g.input("k", dtype, shape.clone()).unwrap();
    let v = g.input("v", dtype, shape).unwrap();
    let m = g.input("mask", DType::I64, dims(&[2, 3])).unwrap();
    let out = if fused {
        let spec = AttentionSpec {
            scale: 0.5,
            causal,
            window: None,
            padding: true,
            rope: None,
            dropout: None,
        };
        g.add(Op::Attention(spec), &[q, k, v, m]).unwrap()
    } else {
        let three = Dim::constant(3);
        let rule = causal.then(|| (three.clone(), three, None));
        let add = kernel::attention_mask(&mut g, dtype, Some(m), rule).unwrap();
        kernel::sdpa(&mut g, q, k, v, add, 0.5, None).unwrap()
    };
    g.set_output("out", out).unwrap();
    let values = |seed: f32| {
        let v = (0..12).map(|i| seed + i as f32 * 0.25).collect();
        Tensor::float(dtype, vec![2, 1, 3, 2], v)
    };
    let t = run(
        &g,
        vec![
            ("q", values(0.1)),
            ("k", values(-0.7)),
            ("v", values(1.0)),
            ("mask", Tensor::i64(vec![2, 3], mask)),
        ],
    )
    .unwrap();
    t.as_f32().unwrap().to_vec()
}

/// A query that sees no key gets zeros (the GPU and CPU kernels' convention), not the mean of the
/// values a finite mask would give; queries that see keys are unchanged. In f32 and f16 (whose
/// mask value is -32752), through the primitives importers build and through the kernel op.
#[test]
fn a_query_that_sees_no_key_gets_zeros() {
    for dtype in [DType::F32, DType::F16] {
        for fused in [false, true] {
            // Encoder: batch row 1 is all padding.
            let out = masked_attention(dtype, fused, false, vec![1, 1, 0, 0, 0, 0]);
            assert!(
                out[6..].iter().all(|v| *v == 0.0),
                "{dtype:?} {fused}: {out:?}"
            );
            assert!(
                out[..6].iter().all(|v| *v > 0.0),
                "{dtype:?} {fused}: {out:?}"
            );
            // Decoder: row 1 left-padded by 2; its queries 0 and 1 see only padding keys, query
            // 2 sees key 2 alone and gets its value exactly.
            let out = masked_attention(dtype, fused, true, vec![1, 1, 1, 0, 0, 1]);
            assert!(
                out[6..10].iter().all(|v| *v == 0.0),
                "{dtype:?} {fused}: {out:?}"
            );
            assert_eq!(&out[10..12], &[1.0 + 10.0 * 0.25, 1.0 + 11.0 * 0.25]);
            // Row 0's query 0 sees key 0 alone.
            assert_eq!(&out[0..2], &[1.0, 1.25]);
        }
    }
}
