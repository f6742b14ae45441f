//! GPT-2 (`GPT2LMHeadModel`, `GPT2Model`): learned positions, pre-LayerNorm blocks, fused QKV
//! `Conv1D`, tied LM head. Weight names mirror the Hugging Face keys (`transformer.h.{i}.attn.c_attn`).

use kiln_ir::{Dim, NodeId};

use crate::config::Config;
use kiln_ir::kernel::Activation;

use crate::layers::{activation_from_config, ModelBuilder};
use crate::{ModelError, ModelKind};

/// GPT-2 hyper-parameters from `config.json`.
#[derive(Clone, Debug)]
pub struct Gpt2Config {
    /// `vocab_size`
    pub vocab_size: usize,
    /// `n_embd`
    pub hidden: usize,
    /// `n_head`
    pub heads: usize,
    /// `n_layer`
    pub layers: usize,
    /// `n_positions`
    pub max_positions: usize,
    /// `n_inner` (default `4 * n_embd`)
    pub inner: usize,
    /// `activation_function`
    pub activation: Activation,
    /// `layer_norm_epsilon`
    pub eps: f64,
    /// `scale_attn_weights`
    pub scale_attn_weights: bool,
    /// `scale_attn_by_inverse_layer_idx`
    pub scale_by_layer: bool,
    /// `tie_word_embeddings`
    pub tied: bool,
    /// `attn_pdrop`
    pub attn_pdrop: f64,
}

impl Gpt2Config {
    /// Reads and validates the fields GPT-2 uses.
    pub fn from_config(c: &Config) -> Result<Gpt2Config, ModelError> {
        let hidden = c.usize("n_embd")?;
        let heads = c.usize("n_head")?;
        if hidden % heads != 0 {
            return Err(ModelError::Config {
                field: "n_head".into(),
                message: format!("= {heads} does not divide n_embd {hidden}"),
            });
        }
        Ok(Gpt2Config {
            vocab_size: c.usize("vocab_size")?,
            hidden,
            heads,
            layers: c.usize("n_layer")?,
            max_positions: c.usize("n_positions")?,
            inner: c.opt_usize("n_inner")?.unwrap_or(4 * hidden),
            activation: activation_from_config(c, "activation_function")?,
            eps: c.f64_or("layer_norm_epsilon", 1e-5)?,
            scale_attn_weights: c.bool_or("scale_attn_weights", true)?,
            scale_by_layer: c.bool_or("scale_attn_by_inverse_layer_idx", false)?,
            tied: c.bool_or("tie_word_embeddings", true)?,
            attn_pdrop: c.f64_or("attn_pdrop", 0.1)?,
        })
    }
}

/// Builds the GPT-2 graph: inputs `input_ids`, `attention_mask`, `position_ids` `[B, S]`,
/// output `logits` `[B, S, vocab]`.
pub fn build(mb: &mut ModelBuilder, cfg: &Gpt2Config) -> Result<ModelKind, ModelError> {
    let ckpt = mb.checkpoint();
    let root = if !ckpt.has_weights() || ckpt.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let (e, v) = (cfg.hidden, cfg.vocab_size);
    let d = e / cfg.heads;
    let (ids, _, pos) = mb.decoder_inputs()?;
    let wte = mb.weight(&format!("{root}wte.weight"), &[v, e])?;
    let wpe = mb.weight(&format!("{root}wpe.weight"), &[cfg.max_positions, e])?;
    let tok = mb.g.add(kiln_ir::Op::Gather, &[wte, ids])?;
    let posv = mb.g.add(kiln_ir::Op::Gather, &[wpe, pos])?;
    let mut h = mb.g.add_(tok, posv)?;
    for i in 0..cfg.layers {
        let p = format!("{root}h.{i}");
        let x = mb.layer_norm(
            h,
            &format!("{p}.ln_1.weight"),
            &format!("{p}.ln_1.bias"),
            e,
            cfg.eps,
        )?;
        let qkv = mb.conv1d(x, &format!("{p}.attn.c_attn"), e, 3 * e)?;
        let part = |mb: &mut ModelBuilder, k: usize| -> Result<NodeId, ModelError> {
            let s =
                mb.g.slice(qkv, -1, Dim::from(k * e), Dim::from((k + 1) * e))?;
            mb.split_heads(s, cfg.heads, d)
        };
        let q = part(mb, 0)?;
        let k = part(mb, 1)?;
        let vv = part(mb, 2)?;
        let mut scale = 1.0;
        if cfg.scale_attn_weights {
            scale /= (d as f64).sqrt();
        }
        if cfg.scale_by_layer {
            scale /= (i + 1) as f64;
        }
        let ctx = mb.causal_self_attention(i, q, k, vv, scale, None, cfg.attn_pdrop)?;
        let merged = mb.merge_heads(ctx, cfg.heads, d)?;
        let proj = mb.conv1d(merged, &format!("{p}.attn.c_proj"), e, e)?;
        h = mb.g.add_(h, proj)?;
        let x = mb.layer_norm(
            h,
            &format!("{p}.ln_2.weight"),
            &format!("{p}.ln_2.bias"),
            e,
            cfg.eps,
        )?;
        let up = mb.conv1d(x, &format!("{p}.mlp.c_fc"), e, cfg.inner)?;
        let act = mb.activation(up, cfg.activation)?;
        let down = mb.conv1d(act, &format!("{p}.mlp.c_proj"), cfg.inner, e)?;
        h = mb.g.add_(h, down)?;
    }
    let x = mb.layer_norm(
        h,
        &format!("{root}ln_f.weight"),
        &format!("{root}ln_f.bias"),
        e,
        cfg.eps,
    )?;
    let head = if cfg.tied {
        wte
    } else {
        mb.weight("lm_head.weight", &[v, e])?
    };
    let head_t = mb.g.transpose_last(head)?;
    let logits = mb.g.matmul(x, head_t)?;
    mb.g.set_output("logits", logits)?;
    Ok(ModelKind::Decoder {
        vocab_size: v,
        max_positions: Some(cfg.max_positions),
    })
}
