//! The building blocks every family shares, expressed as IR primitives: linear layers, norms,
//! activations, softmax and multi-head attention. Weights are declared through the checkpoint, which
//! checks that each key exists with the expected shape.

use kiln_ir::dim::{BATCH, SEQ};
use kiln_ir::{BinaryOp, DType, Dim, Graph, NodeId, Op, ReduceOp, UnaryOp};

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::ModelError;

/// The element type of activations in imported graphs (weights are converted to it on load).
pub const COMPUTE: DType = DType::F32;

/// A graph under construction together with the checkpoint its weights come from.
pub struct ModelBuilder<'a> {
    /// The graph being built.
    pub g: Graph,
    ckpt: &'a Checkpoint,
}

/// The activation functions Hugging Face configs name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `gelu`: exact, `0.5 x (1 + erf(x / sqrt 2))`.
    GeluErf,
    /// `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `relu`.
    Relu,
    /// `silu` / `swish`: `x * sigmoid(x)`.
    Silu,
}

impl Activation {
    /// Reads the activation named by config field `field`.
    pub fn from_config(config: &Config, field: &str) -> Result<Activation, ModelError> {
        match config.opt_str(field)? {
            Some("gelu") => Ok(Activation::GeluErf),
            Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => Ok(Activation::GeluTanh),
            Some("relu") => Ok(Activation::Relu),
            Some("silu" | "swish") => Ok(Activation::Silu),
            _ => Err(config.unsupported(
                field,
                "kiln knows gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, silu",
            )),
        }
    }
}

impl<'a> ModelBuilder<'a> {
    /// Starts an empty graph over `ckpt`.
    pub fn new(ckpt: &'a Checkpoint) -> ModelBuilder<'a> {
        ModelBuilder {
            g: Graph::new(),
            ckpt,
        }
    }

    /// The checkpoint.
    pub fn checkpoint(&self) -> &'a Checkpoint {
        self.ckpt
    }

    /// Declares weight `name`, which must exist with shape `shape`.
    pub fn weight(&mut self, name: &str, shape: &[usize]) -> Result<NodeId, ModelError> {
        self.ckpt.expect(name, shape)?;
        let dims = shape.iter().map(|&d| Dim::from(d)).collect();
        Ok(self.g.weight(name, COMPUTE, dims)?)
    }

    /// The symbolic `[B, S]` shape of token inputs.
    pub fn token_shape() -> Vec<Dim> {
        vec![Dim::sym(BATCH), Dim::sym(SEQ)]
    }

    /// `x @ W^T (+ b)` for a Hugging Face `Linear` with weight `[out, in]` at `{prefix}.weight`.
    pub fn linear(
        &mut self,
        x: NodeId,
        prefix: &str,
        inputs: usize,
        outputs: usize,
        bias: bool,
    ) -> Result<NodeId, ModelError> {
        let w = self.weight(&format!("{prefix}.weight"), &[outputs, inputs])?;
        let wt = self.g.transpose_last(w)?;
        let y = self.g.matmul(x, wt)?;
        self.maybe_bias(y, prefix, outputs, bias)
    }

    /// `x @ W + b` for a GPT-2 `Conv1D` with weight `[in, out]` at `{prefix}.weight`.
    pub fn conv1d(
        &mut self,
        x: NodeId,
        prefix: &str,
        inputs: usize,
        outputs: usize,
    ) -> Result<NodeId, ModelError> {
        let w = self.weight(&format!("{prefix}.weight"), &[inputs, outputs])?;
        let y = self.g.matmul(x, w)?;
        self.maybe_bias(y, prefix, outputs, true)
    }

    fn maybe_bias(
        &mut self,
        y: NodeId,
        prefix: &str,
        outputs: usize,
        bias: bool,
    ) -> Result<NodeId, ModelError> {
        if !bias {
            return Ok(y);
        }
        let b = self.weight(&format!("{prefix}.bias"), &[outputs])?;
        Ok(self.g.add_(y, b)?)
    }

    /// LayerNorm over the last axis: `(x - mean) * rsqrt(var + eps) * weight + bias`, with the
    /// affine parameters at `{weight_key}` / `{bias_key}`.
    pub fn layer_norm(
        &mut self,
        x: NodeId,
        weight_key: &str,
        bias_key: &str,
        size: usize,
        eps: f64,
    ) -> Result<NodeId, ModelError> {
        let g = &mut self.g;
        let mean = g.reduce(ReduceOp::Mean, x, -1)?;
        let centered = g.sub(x, mean)?;
        let sq = g.mul(centered, centered)?;
        let var = g.reduce(ReduceOp::Mean, sq, -1)?;
        let var_eps = g.add_const(var, eps)?;
        let inv = g.unary(UnaryOp::Rsqrt, var_eps)?;
        let normed = g.mul(centered, inv)?;
        let w = self.weight(weight_key, &[size])?;
        let b = self.weight(bias_key, &[size])?;
        let scaled = self.g.mul(normed, w)?;
        Ok(self.g.add_(scaled, b)?)
    }

    /// RMSNorm over the last axis: `x * rsqrt(mean(x^2) + eps) * weight`.
    pub fn rms_norm(
        &mut self,
        x: NodeId,
        weight_key: &str,
        size: usize,
        eps: f64,
    ) -> Result<NodeId, ModelError> {
        let g = &mut self.g;
        let sq = g.mul(x, x)?;
        let ms = g.reduce(ReduceOp::Mean, sq, -1)?;
        let ms_eps = g.add_const(ms, eps)?;
        let inv = g.unary(UnaryOp::Rsqrt, ms_eps)?;
        let normed = g.mul(x, inv)?;
        let w = self.weight(weight_key, &[size])?;
        Ok(self.g.mul(normed, w)?)
    }

    /// The activation `act` applied elementwise.
    pub fn activation(&mut self, x: NodeId, act: Activation) -> Result<NodeId, ModelError> {
        let g = &mut self.g;
        Ok(match act {
            Activation::GeluErf => {
                let scaled = g.mul_const(x, std::f64::consts::FRAC_1_SQRT_2)?;
                let erf = g.unary(UnaryOp::Erf, scaled)?;
                let one_plus = g.add_const(erf, 1.0)?;
                let half_x = g.mul_const(x, 0.5)?;
                g.mul(half_x, one_plus)?
            }
            Activation::GeluTanh => {
                let x2 = g.mul(x, x)?;
                let x3 = g.mul(x2, x)?;
                let cubic = g.mul_const(x3, 0.044715)?;
                let inner = g.add_(x, cubic)?;
                let scaled = g.mul_const(inner, (2.0 / std::f64::consts::PI).sqrt())?;
                let t = g.unary(UnaryOp::Tanh, scaled)?;
                let one_plus = g.add_const(t, 1.0)?;
                let half_x = g.mul_const(x, 0.5)?;
                g.mul(half_x, one_plus)?
            }
            Activation::Relu => {
                let zero = g.scalar(0.0, g.ty(x).dtype);
                g.binary(BinaryOp::Max, x, zero)?
            }
            Activation::Silu => {
                let neg = g.unary(UnaryOp::Neg, x)?;
                let e = g.unary(UnaryOp::Exp, neg)?;
                let denom = g.add_const(e, 1.0)?;
                g.div(x, denom)?
            }
        })
    }

    /// Softmax over the last axis, max-subtracted: `exp(x - max) / sum(exp(x - max))`.
    pub fn softmax(&mut self, x: NodeId) -> Result<NodeId, ModelError> {
        let g = &mut self.g;
        let m = g.reduce(ReduceOp::Max, x, -1)?;
        let shifted = g.sub(x, m)?;
        let e = g.unary(UnaryOp::Exp, shifted)?;
        let s = g.reduce(ReduceOp::Sum, e, -1)?;
        Ok(g.div(e, s)?)
    }

    /// `[B, S, heads * head_dim]` -> `[B, heads, S, head_dim]`.
    pub fn split_heads(
        &mut self,
        x: NodeId,
        heads: usize,
        head_dim: usize,
    ) -> Result<NodeId, ModelError> {
        let (b, s) = (Dim::sym(BATCH), Dim::sym(SEQ));
        let r = self
            .g
            .reshape(x, vec![b, s, heads.into(), head_dim.into()])?;
        Ok(self.g.permute(r, vec![0, 2, 1, 3])?)
    }

    /// `[B, heads, S, head_dim]` -> `[B, S, heads * head_dim]`.
    pub fn merge_heads(
        &mut self,
        x: NodeId,
        heads: usize,
        head_dim: usize,
    ) -> Result<NodeId, ModelError> {
        let (b, s) = (Dim::sym(BATCH), Dim::sym(SEQ));
        let p = self.g.permute(x, vec![0, 2, 1, 3])?;
        Ok(self.g.reshape(p, vec![b, s, (heads * head_dim).into()])?)
    }

    /// Repeats each of `kv_heads` K/V heads for its group of `heads / kv_heads` query heads
    /// (`[B, KVH, S, D]` -> `[B, H, S, D]` via reshape + broadcast + reshape).
    pub fn repeat_kv(
        &mut self,
        x: NodeId,
        kv_heads: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<NodeId, ModelError> {
        if kv_heads == heads {
            return Ok(x);
        }
        let (b, s) = (Dim::sym(BATCH), Dim::sym(SEQ));
        let group = heads / kv_heads;
        let g = &mut self.g;
        let r = g.reshape(
            x,
            vec![
                b.clone(),
                kv_heads.into(),
                1usize.into(),
                s.clone(),
                head_dim.into(),
            ],
        )?;
        let bc = g.broadcast_to(
            r,
            &[
                b.clone(),
                kv_heads.into(),
                group.into(),
                s.clone(),
                head_dim.into(),
            ],
        )?;
        Ok(g.reshape(bc, vec![b, heads.into(), s, head_dim.into()])?)
    }

    /// Scaled dot-product attention over `[B, H, S, D]` tensors with an additive `mask` that
    /// broadcasts to `[B, H, S, S]`: `softmax(q k^T * scale + mask) v`.
    pub fn attention(
        &mut self,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        mask: NodeId,
        scale: f64,
    ) -> Result<NodeId, ModelError> {
        let kt = self.g.transpose_last(k)?;
        let scores = self.g.matmul(q, kt)?;
        let scaled = self.g.mul_const(scores, scale)?;
        let masked = self.g.add_(scaled, mask)?;
        let probs = self.softmax(masked)?;
        Ok(self.g.matmul(probs, v)?)
    }

    /// The additive mask of a decoder: causal (optionally windowed) plus padding, `[B, 1, S, S]`.
    pub fn decoder_mask(
        &mut self,
        attention_mask: NodeId,
        window: Option<i64>,
    ) -> Result<NodeId, ModelError> {
        let s = Dim::sym(SEQ);
        let causal = self.g.add(
            Op::CausalMask {
                rows: s.clone(),
                cols: s,
                window,
            },
            &[],
        )?;
        let padding = self.g.add(Op::PaddingMask, &[attention_mask])?;
        Ok(self.g.add_(padding, causal)?)
    }

    /// The inputs every decoder takes: `input_ids`, `attention_mask`, `position_ids`, all `[B, S]`.
    pub fn decoder_inputs(&mut self) -> Result<(NodeId, NodeId, NodeId), ModelError> {
        let ids = self.g.input("input_ids", DType::I64, Self::token_shape())?;
        let mask = self
            .g
            .input("attention_mask", DType::I64, Self::token_shape())?;
        let pos = self
            .g
            .input("position_ids", DType::I64, Self::token_shape())?;
        Ok((ids, mask, pos))
    }
}
