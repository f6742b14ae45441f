//! The f32 twin of an f16/bf16 graph, which the CPU plans of half-precision artifacts run: every
//! half-precision value (inputs, weights, constants, results, the dtypes ops carry) becomes f32,
//! and every type is inferred again.
//!
//! Why the CPU computes half-precision builds in f32: x86 CPUs without AVX512-BF16/FP16 convert
//! half values to f32 to compute on them anyway, the CPU GEMM library (`gemm`) has no bf16
//! kernels, and one set of f32 kernels then serves every build. The weights stay half precision
//! in the artifact (the GPU's memory plan); the CPU executor widens them once at load into the
//! CPU's own memory plan, and rounds outputs to the artifact's dtype. Results are the f32
//! computation on half-precision weights: within the fixtures' half-precision tolerance of the
//! reference, and closer to it than a half-precision computation.

use kiln_ir::{DType, Graph, IrError, Op};

/// `dtype`, or f32 for a half-precision float.
fn wide(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// Whether `g` holds any half-precision value.
pub fn has_half(g: &Graph) -> bool {
    g.nodes().any(|(_, n)| wide(n.ty.dtype) != n.ty.dtype)
}

/// `g` with every half-precision dtype made f32.
pub fn widen(g: &Graph) -> Result<Graph, IrError> {
    let mut out = Graph::new();
    let mut map = Vec::with_capacity(g.len());
    for (_, node) in g.nodes() {
        let dtype = wide(node.ty.dtype);
        let new = match &node.op {
            Op::Input(name) => out.input(name, dtype, node.ty.shape.clone())?,
            Op::Weight(name) => out.weight(name, dtype, node.ty.shape.clone())?,
            Op::Scalar(v) => out.scalar(*v, dtype),
            op => {
                let op = match op {
                    Op::Cast(to) => Op::Cast(wide(*to)),
                    Op::PaddingMask(d) => Op::PaddingMask(wide(*d)),
                    Op::CausalMask {
                        rows,
                        cols,
                        window,
                        dtype,
                    } => Op::CausalMask {
                        rows: rows.clone(),
                        cols: cols.clone(),
                        window: *window,
                        dtype: wide(*dtype),
                    },
                    Op::PositionMask {
                        cols,
                        window,
                        dtype,
                    } => Op::PositionMask {
                        cols: cols.clone(),
                        window: *window,
                        dtype: wide(*dtype),
                    },
                    op => op.clone(),
                };
                let args: Vec<_> = node.args.iter().map(|a| map[a.index()]).collect();
                out.add(op, &args)?
            }
        };
        map.push(new);
    }
    for o in g.outputs() {
        out.set_output(&o.name, map[o.node.index()])?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::{Dim, UnaryOp};

    #[test]
    fn half_values_become_f32_and_the_rest_stays() {
        let mut g = Graph::new();
        let ids = g.input("ids", DType::I64, vec![Dim::from(4usize)]).unwrap();
        let w = g.weight("w", DType::BF16, vec![Dim::from(4usize)]).unwrap();
        let c = g.cast(ids, DType::BF16).unwrap();
        let e = g.unary(UnaryOp::Exp, c).unwrap();
        let y = g.mul(e, w).unwrap();
        g.set_output("y", y).unwrap();
        assert!(has_half(&g));
        let wide = widen(&g).unwrap();
        assert!(!has_half(&wide));
        let types: Vec<DType> = wide.nodes().map(|(_, n)| n.ty.dtype).collect();
        assert_eq!(types[ids.index()], DType::I64);
        assert_eq!(types[y.index()], DType::F32);
        assert_eq!(wide.node(c).op, Op::Cast(DType::F32));
        assert_eq!(wide.ty(wide.outputs()[0].node).dtype, DType::F32);
    }
}
