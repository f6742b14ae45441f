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

use kiln_ir::{DType, Dim, Graph, IrError, Op, TensorType};

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

/// `g` with every half-precision dtype made f32 (node ids and outputs kept).
pub fn widen(g: &Graph) -> Result<Graph, IrError> {
    let map_op = |op: &Op| Ok(op.map_attributes(Dim::clone, wide));
    g.rebuild(map_op, |ty| {
        TensorType::new(wide(ty.dtype), ty.shape.clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::UnaryOp;

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
        assert_eq!(wide.ty(ids).dtype, DType::I64);
        assert_eq!(wide.ty(y).dtype, DType::F32);
        assert_eq!(wide.node(c).op, Op::Cast(DType::F32));
        assert_eq!(wide.outputs()[0].node, y);
    }
}
