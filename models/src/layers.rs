//! The building blocks every family shares, expressed as IR primitives: linear layers, norms,
//! activations, softmax and multi-head attention. Weights are declared through the checkpoint, which
//! checks that each key exists with the expected shape.

use kiln_ir::dim::CONTEXT;
use kiln_ir::dim::{BATCH, SEQ};
use kiln_ir::kernel::{self, Activation};
use kiln_ir::{DType, Dim, Graph, NodeId, Op};

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::ModelError;

/// How to import a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportOptions {
    /// The float type of weights and activations (weights are converted to it on load).
    pub dtype: DType,
    /// Keep attention dropout (a training-mode forward): an i64 `seed` input drives it.
    pub dropout: bool,
    /// Build the KV-cached form of a decoder (`past_*` inputs, `present_*` outputs; queries at
    /// `position_ids` see the cache up to their position): the decode step and chunked prefill.
    pub kv_cache: bool,
}

impl Default for ImportOptions {
    fn default() -> ImportOptions {
        ImportOptions {
            dtype: DType::F32,
            dropout: false,
            kv_cache: false,
        }
    }
}

/// A graph under construction together with the checkpoint its weights come from.
pub struct ModelBuilder<'a> {
    /// The graph being built.
    pub g: Graph,
    /// The float type of weights and activations.
    pub dtype: DType,
    ckpt: &'a Checkpoint,
    dropout: bool,
    seed: Option<NodeId>,
    streams: u32,
    kv_cache: bool,
    /// `(attention_mask, position_ids)` of a decoder, once declared.
    decoder: Option<(NodeId, NodeId)>,
    /// The attention masks the layers share, one per sliding window, once built.
    shared_masks: Vec<(Option<i64>, NodeId)>,
}

/// Reads the activation named by config field `field`.
pub fn activation_from_config(config: &Config, field: &str) -> Result<Activation, ModelError> {
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

impl<'a> ModelBuilder<'a> {
    /// Starts an empty graph over `ckpt`.
    pub fn new(ckpt: &'a Checkpoint, options: &ImportOptions) -> ModelBuilder<'a> {
        ModelBuilder {
            g: Graph::new(),
            dtype: options.dtype,
            ckpt,
            dropout: options.dropout,
            seed: None,
            streams: 0,
            kv_cache: options.kv_cache,
            decoder: None,
            shared_masks: Vec::new(),
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
        Ok(self.g.weight(name, self.dtype, dims)?)
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

    /// LayerNorm over the last axis with the affine parameters at `weight_key` / `bias_key`.
    pub fn layer_norm(
        &mut self,
        x: NodeId,
        weight_key: &str,
        bias_key: &str,
        size: usize,
        eps: f64,
    ) -> Result<NodeId, ModelError> {
        let w = self.weight(weight_key, &[size])?;
        let b = self.weight(bias_key, &[size])?;
        Ok(kernel::layer_norm(&mut self.g, x, w, b, eps)?)
    }

    /// RMSNorm over the last axis with the weight at `weight_key`.
    pub fn rms_norm(
        &mut self,
        x: NodeId,
        weight_key: &str,
        size: usize,
        eps: f64,
    ) -> Result<NodeId, ModelError> {
        let w = self.weight(weight_key, &[size])?;
        Ok(kernel::rms_norm(&mut self.g, x, w, eps)?)
    }

    /// The activation `act` applied elementwise.
    pub fn activation(&mut self, x: NodeId, act: Activation) -> Result<NodeId, ModelError> {
        Ok(kernel::activation(&mut self.g, x, act)?)
    }

    /// Several Hugging Face `Linear`s of the same input as ONE product: their `[out_i, in]`
    /// weights are concatenated into `[sum out_i, in]` (and their biases likewise), which is how
    /// kiln canonicalises Q/K/V and gate/up projections at import. Returns `[.., sum out_i]`;
    /// `split_last` takes the parts apart.
    pub fn fused_linear(
        &mut self,
        x: NodeId,
        parts: &[(&str, usize)],
        inputs: usize,
        bias: bool,
    ) -> Result<NodeId, ModelError> {
        if let [(prefix, outputs)] = parts {
            return self.linear(x, prefix, inputs, *outputs, bias);
        }
        let mut ws = Vec::new();
        let mut bs = Vec::new();
        for (prefix, outputs) in parts {
            ws.push(self.weight(&format!("{prefix}.weight"), &[*outputs, inputs])?);
            if bias {
                bs.push(self.weight(&format!("{prefix}.bias"), &[*outputs])?);
            }
        }
        let w = self.g.add(Op::Concat(0), &ws)?;
        let wt = self.g.transpose_last(w)?;
        let y = self.g.matmul(x, wt)?;
        if !bias {
            return Ok(y);
        }
        let b = self.g.add(Op::Concat(0), &bs)?;
        Ok(self.g.add_(y, b)?)
    }

    /// Splits the last axis of `y` into consecutive parts of the given sizes.
    pub fn split_last(&mut self, y: NodeId, sizes: &[usize]) -> Result<Vec<NodeId>, ModelError> {
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        for &n in sizes {
            out.push(self.g.slice(y, -1, start.into(), (start + n).into())?);
            start += n;
        }
        Ok(out)
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

    /// Repeats each of `kv_heads` K/V heads for its group of `heads / kv_heads` query heads.
    pub fn repeat_kv(
        &mut self,
        x: NodeId,
        kv_heads: usize,
        heads: usize,
    ) -> Result<NodeId, ModelError> {
        Ok(kernel::repeat_kv(&mut self.g, x, heads / kv_heads)?)
    }

    /// Scaled dot-product attention over `[B, H, S, D]` tensors with an additive `mask` that
    /// broadcasts to `[B, H, S, S]`: `softmax(q k^T * scale + mask) v`. With dropout kept and
    /// `dropout_p > 0`, the probabilities go through dropout (stream = attention blocks so far).
    pub fn attention(
        &mut self,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        mask: NodeId,
        scale: f64,
        dropout_p: f64,
    ) -> Result<NodeId, ModelError> {
        let dropout = if self.dropout && dropout_p > 0.0 {
            let seed = match self.seed {
                Some(s) => s,
                None => {
                    let s = self.g.input("seed", DType::I64, vec![])?;
                    self.seed = Some(s);
                    s
                }
            };
            self.streams += 1;
            Some((dropout_p, self.streams - 1, seed))
        } else {
            None
        };
        Ok(kernel::sdpa(
            &mut self.g,
            q,
            k,
            v,
            Some(mask),
            scale,
            dropout,
        )?)
    }

    /// The mask that every layer with sliding window `window` shares, built by `build` for the
    /// first of them.
    fn shared_mask(
        &mut self,
        window: Option<i64>,
        build: impl FnOnce(&mut Self) -> Result<NodeId, ModelError>,
    ) -> Result<NodeId, ModelError> {
        if let Some(&(_, m)) = self.shared_masks.iter().find(|(w, _)| *w == window) {
            return Ok(m);
        }
        let m = build(self)?;
        self.shared_masks.push((window, m));
        Ok(m)
    }

    /// The additive mask of a decoder: padding plus causal (optionally windowed), `[B, 1, S, S]`.
    pub fn decoder_mask(
        &mut self,
        attention_mask: NodeId,
        window: Option<i64>,
    ) -> Result<NodeId, ModelError> {
        let s = Dim::sym(SEQ);
        let mask = kernel::attention_mask(
            &mut self.g,
            self.dtype,
            Some(attention_mask),
            Some((s.clone(), s, window)),
        )?;
        Ok(mask.expect("a padding mask was given"))
    }

    /// The additive padding mask of an encoder, `[B, 1, 1, S]`.
    pub fn padding_mask(&mut self, attention_mask: NodeId) -> Result<NodeId, ModelError> {
        let mask = kernel::attention_mask(&mut self.g, self.dtype, Some(attention_mask), None)?;
        Ok(mask.expect("a padding mask was given"))
    }

    /// Causal self-attention of decoder layer `layer` over `[B, H, S, D]` q and `[B, KVH, S, D]`
    /// k, v (K/V heads repeated for their query groups).
    ///
    /// Without a KV cache, the keys are this chunk's, under the padding + causal mask. With one,
    /// k and v are written into the `past_key.{layer}` / `past_value.{layer}` inputs
    /// (`[B, KVH, T, D]`) at their positions (padding tokens are not written), the updated caches
    /// are the `present_key.{layer}` / `present_value.{layer}` outputs, and each query sees the
    /// cache entries up to its position.
    #[allow(clippy::too_many_arguments)]
    pub fn causal_self_attention(
        &mut self,
        layer: usize,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        scale: f64,
        window: Option<i64>,
        dropout_p: f64,
    ) -> Result<NodeId, ModelError> {
        let (mask, positions) = self
            .decoder
            .expect("decoder_inputs() is called before the layers");
        let heads = self.g.ty(q).shape[1].as_const().unwrap_or(1) as usize;
        let kt = self.g.ty(k).clone();
        let kv_heads = kt.shape[1].as_const().unwrap_or(1) as usize;
        if !self.kv_cache {
            let attn_mask = self.shared_mask(window, |mb| mb.decoder_mask(mask, window))?;
            let k = self.repeat_kv(k, kv_heads, heads)?;
            let v = self.repeat_kv(v, kv_heads, heads)?;
            return self.attention(q, k, v, attn_mask, scale, dropout_p);
        }
        let context = Dim::sym(CONTEXT);
        let cache_shape = vec![
            kt.shape[0].clone(),
            kt.shape[1].clone(),
            context.clone(),
            kt.shape[3].clone(),
        ];
        let mut written = Vec::with_capacity(2);
        for (name, new) in [("key", k), ("value", v)] {
            let past = self.g.input(
                &format!("past_{name}.{layer}"),
                self.dtype,
                cache_shape.clone(),
            )?;
            let present = self.g.add(Op::CacheWrite, &[past, new, positions, mask])?;
            self.g
                .set_output(&format!("present_{name}.{layer}"), present)?;
            written.push(self.repeat_kv(present, kv_heads, heads)?);
        }
        let cache_mask = self.shared_mask(window, |mb| {
            Ok(kernel::position_mask(
                &mut mb.g, positions, context, window, mb.dtype,
            )?)
        })?;
        Ok(kernel::sdpa(
            &mut self.g,
            q,
            written[0],
            written[1],
            Some(cache_mask),
            scale,
            None,
        )?)
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
        self.decoder = Some((mask, pos));
        Ok((ids, mask, pos))
    }
}
