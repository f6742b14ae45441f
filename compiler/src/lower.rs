//! Lowering a bucket's static fused graph to generated kernels (`kiln-kernels`): each kernel node
//! becomes the generator configuration its shapes, dtypes and operand layouts call for. Operands
//! that are views are read in place: attention's q/k/v are head-split views of the fused QKV
//! product (strides and an element offset), and attention writes its output in the `[B, S, H, D]`
//! layout that the following head merge reads as a contiguous matrix.
//!
//! What has no generator yet (sentence-transformers pooling, a RoPE that is not part of a KV-cache
//! write) is listed, not guessed at. The launch plan that binds buffers to these kernels is the runtime
//! issue's; this module decides which kernels a bucket needs.

use std::collections::BTreeMap;

use kiln_ir::kernel::{AttentionSpec, DecodeAttentionSpec};
use kiln_ir::{Graph, NodeId, Op, TensorType};
use kiln_kernels::attention::{
    attention, attention_combine, attention_simt, AttentionConfig, KeyRule,
};
use kiln_kernels::elementwise::activation_kernel;
use kiln_kernels::embedding::{embedding, EmbeddingConfig};
use kiln_kernels::gemm::{gemm, GemmConfig};
use kiln_kernels::kv_cache::{kv_write, KvWriteConfig};
use kiln_kernels::norm::{norm, NormConfig};
use kiln_kernels::{Elem, GeneratedKernel};

use crate::fusion::cost::is_view;

/// Key ranges of a decode attention over a cache of at least this many entries.
const SPLIT_CONTEXT: u32 = 1024;
/// Fixed key ranges (flash-decoding) for long caches.
const DECODE_SPLITS: u32 = 16;

/// The kernels a graph needs, and the ops that have no generator yet.
#[derive(Default)]
pub struct Lowered {
    /// Kernels by entry name (deduplicated).
    pub kernels: BTreeMap<String, GeneratedKernel>,
    /// `{op}_{node}` of every op left without a kernel.
    pub unsupported: Vec<String>,
}

impl Lowered {
    /// Adds `kernel`, once; another kernel under the same name is kept under a new name.
    pub fn add(&mut self, kernel: GeneratedKernel) {
        let mut name = kernel.name.clone();
        let mut n = 1;
        // Same name, other code (for example other strides): keep both under distinct names.
        while let Some(existing) = self.kernels.get(&name) {
            if existing.ptx == kernel.ptx {
                return;
            }
            n += 1;
            name = format!("{}_v{n}", kernel.name);
        }
        let mut kernel = kernel;
        if name != kernel.name {
            kernel.ptx = kernel.ptx.replacen(&kernel.name, &name, 1);
            kernel.name = name.clone();
        }
        self.kernels.insert(name, kernel);
    }
}

fn dims(t: &TensorType) -> Option<Vec<u32>> {
    t.shape
        .iter()
        .map(|d| d.as_const().and_then(|v| u32::try_from(v).ok()))
        .collect()
}

fn numel(t: &TensorType) -> Option<u32> {
    dims(t)?.iter().try_fold(1u32, |a, d| a.checked_mul(*d))
}

/// The `[batch, head, row]` strides (elements) and element offset of a `[B, H, S, D]` operand:
/// contiguous, or the head split `permute([0, 2, 1, 3], reshape([B, S, H, D], x))` of a
/// `[B, S, N]` tensor `x`, itself possibly a slice of the last axis of a wider product.
fn head_strides(g: &Graph, id: NodeId) -> Option<([u32; 3], u32)> {
    let node = g.node(id);
    let shape = dims(&node.ty)?;
    let [_, h, s, d] = shape[..] else { return None };
    match &node.op {
        Op::Permute(p) if p == &[0, 2, 1, 3] => {
            let reshape = g.node(node.args[0]);
            let Op::Reshape(_) = reshape.op else {
                return None;
            };
            let src = g.node(reshape.args[0]);
            match &src.op {
                Op::Slice { axis, start, .. } if *axis == src.ty.rank() - 1 => {
                    let wide = dims(&g.node(src.args[0]).ty)?;
                    let n = *wide.last()?;
                    let offset = u32::try_from(start.as_const()?).ok()?;
                    Some(([s * n, d, n], offset))
                }
                _ if !is_view(&src.op) => Some(([s * h * d, d, h * d], 0)),
                _ => None,
            }
        }
        op if !is_view(op) => Some(([h * s * d, s * d, d], 0)),
        _ => None,
    }
}

/// Lowers every kernel node of the static graph `g`.
pub fn lower(g: &Graph) -> Lowered {
    let mut out = Lowered::default();
    // A RoPE whose only consumers are KV-cache writes is done by the writes themselves.
    let mut users: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for (id, node) in g.nodes() {
        for a in &node.args {
            users.entry(*a).or_default().push(id);
        }
    }
    let rope_in_write = |id: NodeId| {
        matches!(g.node(id).op, Op::Rope { .. })
            && users.get(&id).is_some_and(|u| {
                u.iter()
                    .all(|c| matches!(g.node(*c).op, Op::CacheWrite) && g.node(*c).args[1] == id)
            })
    };
    let mut weight_only = vec![false; g.len()];
    for (id, node) in g.nodes() {
        weight_only[id.index()] = match &node.op {
            Op::Weight(_) | Op::Scalar(_) => true,
            Op::Input(_) => false,
            _ => node.args.iter().all(|a| weight_only[a.index()]),
        };
        if weight_only[id.index()] || node.op.is_leaf() || is_view(&node.op) || rope_in_write(id) {
            continue;
        }
        if lower_node(g, id, &mut out).is_none() {
            out.unsupported.push(format!("{}_{}", node.op.name(), id.0));
        }
    }
    out
}

fn lower_node(g: &Graph, id: NodeId, out: &mut Lowered) -> Option<()> {
    let node = g.node(id);
    let elem = Elem::of(node.ty.dtype)?;
    let arg = |i: usize| g.ty(node.args[i]);
    match &node.op {
        Op::Embedding(spec) => {
            let hidden = *dims(&node.ty)?.last()?;
            let table_rows = (0..spec.tables)
                .map(|i| dims(arg(2 * i)).map(|d| d[0]))
                .collect::<Option<Vec<u32>>>()?;
            let tokens = numel(arg(1))?;
            out.add(embedding(&EmbeddingConfig {
                table_rows,
                hidden,
                tokens,
                elem,
            }));
        }
        Op::Norm(spec) => {
            let cols = *dims(&node.ty)?.last()?;
            let rows = numel(&node.ty)? / cols;
            let eps = spec.eps as f32;
            out.add(norm(&NormConfig {
                kind: spec.kind,
                residual: spec.residual,
                elem,
                rows,
                cols,
                eps,
            }));
        }
        Op::Gemm(spec) => {
            let x = dims(arg(0))?;
            let k = *x.last()?;
            let m = x.iter().product::<u32>() / k;
            let w = dims(arg(1))?;
            let n = if spec.transpose_b { w[0] } else { w[1] };
            if spec.swiglu && n % 2 != 0 {
                return None;
            }
            if let Some(p) = &spec.prologue {
                // The tensor-core prologue is future work: the norm runs as its own kernel.
                let cfg = NormConfig {
                    kind: p.kind,
                    residual: false,
                    elem,
                    rows: m,
                    cols: k,
                    eps: p.eps as f32,
                };
                out.add(norm(&cfg));
            }
            out.add(gemm(&GemmConfig {
                m,
                k,
                n,
                transpose_b: spec.transpose_b,
                bias: spec.bias,
                activation: spec.activation,
                swiglu: spec.swiglu,
                residual: spec.residual,
                elem,
            }));
        }
        Op::Attention(spec) => out.add(lower_attention(g, id, spec, elem)?),
        Op::DecodeAttention(spec) => {
            let (cfg, combine) = lower_decode(g, id, spec, elem)?;
            out.add(attention(&cfg));
            if combine {
                out.add(attention_combine(&cfg));
            }
        }
        Op::Activation(a) => out.add(activation_kernel(*a, elem, numel(&node.ty)?)),
        Op::CacheWrite => {
            let cache = dims(&node.ty)?;
            let new_id = node.args[1];
            let (values, rope) = match g.node(new_id).op {
                Op::Rope { .. } => (g.node(new_id).args[0], true),
                _ => (new_id, false),
            };
            let (new_strides, _) = head_strides(g, values)?;
            out.add(kv_write(&KvWriteConfig {
                batch: cache[0],
                kv_heads: cache[1],
                new_len: dims(arg(1))?[2],
                capacity: cache[2],
                head_dim: cache[3],
                new_strides,
                rope,
                elem,
            }));
        }
        _ => return None,
    }
    Some(())
}

/// The configuration every attention kernel of node `id` shares: shapes, the q/k/v layouts read
/// in place, the `[B, S, H, D]` output layout, and the q/k/v element offsets. The caller sets the
/// key rule and the features.
fn base_config(
    g: &Graph,
    id: NodeId,
    scale: f64,
    elem: Elem,
) -> Option<(AttentionConfig, [u32; 3])> {
    let node = g.node(id);
    let q = dims(g.ty(node.args[0]))?;
    let k = dims(g.ty(node.args[1]))?;
    let (batch, heads, kv_heads, q_len, kv_len, head_dim) = (q[0], q[1], k[1], q[2], k[2], q[3]);
    let (qs, qo) = head_strides(g, node.args[0])?;
    let (ks, ko) = head_strides(g, node.args[1])?;
    let (vs, vo) = head_strides(g, node.args[2])?;
    let cfg = AttentionConfig {
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        scale: scale as f32,
        keys: KeyRule::All,
        padding: false,
        rope: false,
        rope_k: false,
        dropout: None,
        elem,
        strides: [
            qs,
            ks,
            vs,
            [q_len * heads * head_dim, head_dim, heads * head_dim],
        ],
        splits: 1,
    };
    Some((cfg, [qo, ko, vo]))
}

fn lower_attention(
    g: &Graph,
    id: NodeId,
    spec: &AttentionSpec,
    elem: Elem,
) -> Option<GeneratedKernel> {
    let (mut cfg, offsets) = base_config(g, id, spec.scale, elem)?;
    if spec.causal {
        cfg.keys = KeyRule::Causal {
            window: spec.window.map(|w| w as u32),
        };
    }
    cfg.padding = spec.padding;
    cfg.rope = spec.rope.is_some();
    cfg.rope_k = spec.rope.is_some();
    cfg.dropout = spec.dropout.map(|(p, s)| (p as f32, s));
    // The element offsets are applied to the pointers at launch; the tensor-core kernel's 16-byte
    // copies need them to be multiples of 8 elements.
    if offsets.iter().all(|o| o % 8 == 0) {
        Some(attention(&cfg))
    } else {
        Some(attention_simt(&cfg))
    }
}

fn lower_decode(
    g: &Graph,
    id: NodeId,
    spec: &DecodeAttentionSpec,
    elem: Elem,
) -> Option<(AttentionConfig, bool)> {
    let (mut cfg, _) = base_config(g, id, spec.scale, elem)?;
    cfg.keys = KeyRule::Position {
        window: spec.window.map(|w| w as u32),
    };
    cfg.rope = spec.rope.is_some();
    cfg.splits = if cfg.kv_len >= SPLIT_CONTEXT {
        DECODE_SPLITS
    } else {
        1
    };
    Some((cfg.clone(), cfg.splits > 1))
}
