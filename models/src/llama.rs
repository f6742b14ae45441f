//! The Llama family: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`. RMSNorm, RoPE
//! (with `rope_theta` and the default / linear / llama3 / yarn scalings), grouped-query attention
//! (GQA and MQA: K/V heads broadcast to their query groups), SwiGLU MLP, optional Q/K/V bias,
//! tied or untied embeddings, sliding windows (Mistral's on every layer, Qwen2's on the layers it
//! names). Weight names mirror the Hugging Face keys (`model.layers.{i}.self_attn.q_proj`).

use kiln_ir::kernel::{self, Activation};
use kiln_ir::{Op, RopeScaling};
use serde_json::Value;

use crate::config::Config;
use crate::layers::{activation_from_config, ModelBuilder};
use crate::{ModelError, ModelKind};

/// Which member of the family a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaFlavor {
    /// `LlamaForCausalLM`
    Llama,
    /// `MistralForCausalLM`
    Mistral,
    /// `Qwen2ForCausalLM`
    Qwen2,
}

/// Llama-family hyper-parameters from `config.json`.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    /// The family member.
    pub flavor: LlamaFlavor,
    /// `vocab_size`
    pub vocab_size: usize,
    /// `hidden_size`
    pub hidden: usize,
    /// `intermediate_size`
    pub intermediate: usize,
    /// `num_hidden_layers`
    pub layers: usize,
    /// `num_attention_heads`
    pub heads: usize,
    /// `num_key_value_heads` (default: `num_attention_heads`)
    pub kv_heads: usize,
    /// `head_dim` (default: `hidden_size / num_attention_heads`)
    pub head_dim: usize,
    /// `rms_norm_eps`
    pub eps: f64,
    /// `rope_theta` (or `rope_parameters.rope_theta`)
    pub rope_theta: f64,
    /// `rope_scaling` / `rope_parameters.rope_type`
    pub rope_scaling: RopeScaling,
    /// Bias on the Q/K/V projections (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama with `attention_bias`).
    pub o_bias: bool,
    /// `mlp_bias` (Llama)
    pub mlp_bias: bool,
    /// `tie_word_embeddings`
    pub tied: bool,
    /// Each layer's sliding window (`None`: the layer attends to every earlier token).
    pub windows: Vec<Option<i64>>,
    /// `attention_dropout`
    pub attention_dropout: f64,
}

impl LlamaConfig {
    /// Reads and validates the fields the family uses.
    pub fn from_config(c: &Config, flavor: LlamaFlavor) -> Result<LlamaConfig, ModelError> {
        let hidden = c.usize("hidden_size")?;
        let heads = c.usize("num_attention_heads")?;
        let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(ModelError::Config {
                field: "num_key_value_heads".into(),
                message: format!("= {kv_heads} does not divide num_attention_heads {heads}"),
            });
        }
        let head_dim = match c.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(ModelError::Config {
                    field: "num_attention_heads".into(),
                    message: format!("= {heads} does not divide hidden_size {hidden}"),
                })
            }
        };
        if head_dim % 2 != 0 {
            return Err(ModelError::Config {
                field: "head_dim".into(),
                message: format!("= {head_dim} is odd; rotary embeddings need an even head dim"),
            });
        }
        if activation_from_config(c, "hidden_act")? != Activation::Silu {
            return Err(c.unsupported("hidden_act", "the Llama family's MLP is SwiGLU with silu"));
        }
        if c.f64_or("partial_rotary_factor", 1.0)? != 1.0 {
            return Err(c.unsupported("partial_rotary_factor", "only full rotary embeddings"));
        }
        let (rope_theta, rope_scaling) = rope(c)?;
        let attention_bias = c.bool_or("attention_bias", false)?;
        let layers = c.usize("num_hidden_layers")?;
        Ok(LlamaConfig {
            flavor,
            vocab_size: c.usize("vocab_size")?,
            hidden,
            intermediate: c.usize("intermediate_size")?,
            layers,
            heads,
            kv_heads,
            head_dim,
            eps: c.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            qkv_bias: flavor == LlamaFlavor::Qwen2 || attention_bias,
            o_bias: flavor == LlamaFlavor::Llama && attention_bias,
            mlp_bias: flavor == LlamaFlavor::Llama && c.bool_or("mlp_bias", false)?,
            tied: c.bool_or("tie_word_embeddings", false)?,
            windows: windows(c, flavor, layers)?,
            attention_dropout: c.f64_or("attention_dropout", 0.0)?,
        })
    }
}

/// Each layer's sliding window, as transformers assigns them: Llama has none; Mistral puts
/// `sliding_window` on every layer; Qwen2 puts it (when `use_sliding_window`) on the layers that
/// `layer_types` calls `sliding_attention`, or without `layer_types` on layers from
/// `max_window_layers` on. Both families take 4096 for a missing `sliding_window` and none for
/// a null one.
fn windows(c: &Config, flavor: LlamaFlavor, layers: usize) -> Result<Vec<Option<i64>>, ModelError> {
    let window = || -> Result<Option<i64>, ModelError> {
        Ok(c.usize_or_null("sliding_window", 4096)?.map(|w| w as i64))
    };
    match flavor {
        LlamaFlavor::Llama => Ok(vec![None; layers]),
        LlamaFlavor::Mistral => Ok(vec![window()?; layers]),
        LlamaFlavor::Qwen2 => {
            let w = match c.bool_or("use_sliding_window", false)? {
                true => window()?,
                false => None,
            };
            let sliding = match c.get("layer_types") {
                Some(types) => layer_types(types, layers)?,
                None => {
                    let first = c.count_or("max_window_layers", 28)?;
                    (0..layers).map(|i| w.is_some() && i >= first).collect()
                }
            };
            sliding
                .into_iter()
                .map(|s| match (s, w) {
                    (false, _) => Ok(None),
                    (true, Some(w)) => Ok(Some(w)),
                    (true, None) => Err(ModelError::Config {
                        field: "layer_types".into(),
                        message: "names sliding_attention layers, but use_sliding_window is \
                                  false or sliding_window is null"
                            .into(),
                    }),
                })
                .collect()
        }
    }
}

/// Reads `layer_types`: for each layer, whether it is `sliding_attention` (or `full_attention`).
fn layer_types(types: &Value, layers: usize) -> Result<Vec<bool>, ModelError> {
    let bad = |message: String| ModelError::Config {
        field: "layer_types".into(),
        message,
    };
    let types = types
        .as_array()
        .ok_or_else(|| bad("is not a list".into()))?;
    if types.len() != layers {
        return Err(bad(format!(
            "has {} entries for {layers} layers",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(bad(format!(
                "holds {t}, expected full_attention or sliding_attention"
            ))),
        })
        .collect()
}

/// Reads the rotary base and scaling from `rope_parameters` (transformers 5) or
/// `rope_theta` + `rope_scaling` (earlier versions).
fn rope(c: &Config) -> Result<(f64, RopeScaling), ModelError> {
    let (field, params) = match (c.get("rope_parameters"), c.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(p)) => ("rope_scaling", Some(p)),
        (None, None) => ("rope_scaling", None),
    };
    let num = |key: &str| -> Result<Option<f64>, ModelError> {
        match params.and_then(|p| p.get(key)) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| ModelError::Config {
                field: format!("{field}.{key}"),
                message: format!("is {v}, expected a number"),
            }),
        }
    };
    let need = |key: &str| -> Result<f64, ModelError> {
        num(key)?.ok_or_else(|| ModelError::Config {
            field: format!("{field}.{key}"),
            message: "is missing".into(),
        })
    };
    let theta = match num("rope_theta")? {
        Some(t) => t,
        None => c.f64_or("rope_theta", 10000.0)?,
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(ModelError::Config {
            field: "rope_theta".into(),
            message: format!("= {theta} must be positive"),
        });
    }
    let kind = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        },
        "yarn" => yarn(c, (field, params), &num)?,
        other => {
            return Err(ModelError::Config {
                field: format!("{field}.rope_type"),
                message: format!("= \"{other}\" is not supported (default, linear, llama3, yarn)"),
            })
        }
    };
    scaling.validate().map_err(|message| ModelError::Config {
        field: field.into(),
        message,
    })?;
    Ok((theta, scaling))
}

/// YaRN's parameters as transformers reads them: the original context from the rope parameters,
/// else the config's `original_max_position_embeddings`, else `max_position_embeddings`; the
/// factor, when absent, the ratio of `max_position_embeddings` to it.
fn yarn(
    c: &Config,
    (field, params): (&str, Option<&Value>),
    num: &dyn Fn(&str) -> Result<Option<f64>, ModelError>,
) -> Result<RopeScaling, ModelError> {
    let max_positions = c.opt_f64("max_position_embeddings")?;
    let original = num("original_max_position_embeddings")?
        .or(c.opt_f64("original_max_position_embeddings")?)
        .or(max_positions)
        .ok_or_else(|| ModelError::Config {
            field: format!("{field}.original_max_position_embeddings"),
            message: "is missing (and so is max_position_embeddings)".into(),
        })?;
    let factor = match (num("factor")?, max_positions) {
        (Some(f), _) => f,
        (None, Some(m)) => m / original,
        (None, None) => {
            return Err(ModelError::Config {
                field: format!("{field}.factor"),
                message: "is missing".into(),
            })
        }
    };
    let attention_factor = match num("attention_factor")? {
        Some(a) => a,
        None => RopeScaling::yarn_attention_factor(factor, num("mscale")?, num("mscale_all_dim")?),
    };
    let truncate = match params.and_then(|p| p.get("truncate")) {
        None | Some(Value::Null) => true,
        Some(v) => v.as_bool().ok_or_else(|| ModelError::Config {
            field: format!("{field}.truncate"),
            message: format!("is {v}, expected true or false"),
        })?,
    };
    // transformers takes 0 (as `or` does) for the defaults too.
    let beta = |key: &str, default: f64| -> Result<f64, ModelError> {
        Ok(num(key)?.filter(|b| *b != 0.0).unwrap_or(default))
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        attention_factor,
        truncate,
    })
}

/// Builds the graph: inputs `input_ids`, `attention_mask`, `position_ids` `[B, S]`, output
/// `logits` `[B, S, vocab]`.
pub fn build(mb: &mut ModelBuilder, cfg: &LlamaConfig) -> Result<ModelKind, ModelError> {
    let (e, v, d) = (cfg.hidden, cfg.vocab_size, cfg.head_dim);
    let (h, kvh) = (cfg.heads, cfg.kv_heads);
    let (ids, _, pos) = mb.decoder_inputs()?;
    let embed = mb.weight("model.embed_tokens.weight", &[v, e])?;
    let mut x = mb.g.add(Op::Gather, &[embed, ids])?;
    let rope_op = Op::Rope {
        theta: cfg.rope_theta,
        scaling: cfg.rope_scaling.clone(),
    };
    for i in 0..cfg.layers {
        let p = format!("model.layers.{i}");
        let n = mb.rms_norm(x, &format!("{p}.input_layernorm.weight"), e, cfg.eps)?;
        let qkv = mb.fused_linear(
            n,
            &[
                (&format!("{p}.self_attn.q_proj"), h * d),
                (&format!("{p}.self_attn.k_proj"), kvh * d),
                (&format!("{p}.self_attn.v_proj"), kvh * d),
            ],
            e,
            cfg.qkv_bias,
        )?;
        let [q, k, vv] = mb.split_last(qkv, &[h * d, kvh * d, kvh * d])?[..] else {
            unreachable!("three parts")
        };
        let q = mb.split_heads(q, h, d)?;
        let k = mb.split_heads(k, kvh, d)?;
        let vv = mb.split_heads(vv, kvh, d)?;
        let q = mb.g.add(rope_op.clone(), &[q, pos])?;
        let k = mb.g.add(rope_op.clone(), &[k, pos])?;
        let ctx = mb.causal_self_attention(
            i,
            q,
            k,
            vv,
            1.0 / (d as f64).sqrt(),
            cfg.windows[i],
            cfg.attention_dropout,
        )?;
        let merged = mb.merge_heads(ctx, h, d)?;
        let o = mb.linear(
            merged,
            &format!("{p}.self_attn.o_proj"),
            h * d,
            e,
            cfg.o_bias,
        )?;
        x = mb.g.add_(x, o)?;
        let n = mb.rms_norm(
            x,
            &format!("{p}.post_attention_layernorm.weight"),
            e,
            cfg.eps,
        )?;
        let m = cfg.intermediate;
        let gate_up = mb.fused_linear(
            n,
            &[
                (&format!("{p}.mlp.gate_proj"), m),
                (&format!("{p}.mlp.up_proj"), m),
            ],
            e,
            cfg.mlp_bias,
        )?;
        let gated = kernel::swiglu(&mut mb.g, gate_up)?;
        let down = mb.linear(gated, &format!("{p}.mlp.down_proj"), m, e, cfg.mlp_bias)?;
        x = mb.g.add_(x, down)?;
    }
    let n = mb.rms_norm(x, "model.norm.weight", e, cfg.eps)?;
    let head = if cfg.tied {
        embed
    } else {
        mb.weight("lm_head.weight", &[v, e])?
    };
    let head_t = mb.g.transpose_last(head)?;
    let logits = mb.g.matmul(n, head_t)?;
    mb.g.set_output("logits", logits)?;
    Ok(ModelKind::Decoder {
        vocab_size: v,
        max_positions: None,
    })
}
