//! BERT (`BertModel` and the `bert.` trunk of task models): absolute learned positions, token
//! types, post-LayerNorm blocks. A sentence-transformers folder (`modules.json`) adds its pooling
//! (CLS / mean / max / mean-sqrt-len) and L2 normalisation. Weight names mirror the Hugging Face
//! keys (`encoder.layer.{i}.attention.self.query`).

use std::path::Path;

use kiln_ir::{DType, NodeId, Op, ReduceOp, UnaryOp};
use serde_json::Value;

use crate::checkpoint::read_json;
use crate::config::Config;
use kiln_ir::kernel::Activation;

use crate::layers::{activation_from_config, ModelBuilder};
use crate::{ModelError, ModelKind};

/// BERT hyper-parameters from `config.json`.
#[derive(Clone, Debug)]
pub struct BertConfig {
    /// `vocab_size`
    pub vocab_size: usize,
    /// `hidden_size`
    pub hidden: usize,
    /// `num_hidden_layers`
    pub layers: usize,
    /// `num_attention_heads`
    pub heads: usize,
    /// `intermediate_size`
    pub intermediate: usize,
    /// `max_position_embeddings`
    pub max_positions: usize,
    /// `type_vocab_size`
    pub type_vocab_size: usize,
    /// `hidden_act`
    pub activation: Activation,
    /// `layer_norm_eps`
    pub eps: f64,
    /// `attention_probs_dropout_prob`
    pub attention_dropout: f64,
}

impl BertConfig {
    /// Reads and validates the fields BERT uses.
    pub fn from_config(c: &Config) -> Result<BertConfig, ModelError> {
        let hidden = c.usize("hidden_size")?;
        let heads = c.usize("num_attention_heads")?;
        if hidden % heads != 0 {
            return Err(ModelError::Config {
                field: "num_attention_heads".into(),
                message: format!("= {heads} does not divide hidden_size {hidden}"),
            });
        }
        if let Some(kind) = c.opt_str("position_embedding_type")? {
            if kind != "absolute" {
                return Err(c.unsupported("position_embedding_type", "only absolute positions"));
            }
        }
        if c.bool_or("is_decoder", false)? || c.bool_or("add_cross_attention", false)? {
            return Err(c.unsupported("is_decoder", "BERT as an encoder only"));
        }
        Ok(BertConfig {
            vocab_size: c.usize("vocab_size")?,
            hidden,
            layers: c.usize("num_hidden_layers")?,
            heads,
            intermediate: c.usize("intermediate_size")?,
            max_positions: c.usize("max_position_embeddings")?,
            type_vocab_size: c.usize("type_vocab_size")?,
            activation: activation_from_config(c, "hidden_act")?,
            eps: c.f64_or("layer_norm_eps", 1e-12)?,
            attention_dropout: c.f64_or("attention_probs_dropout_prob", 0.0)?,
        })
    }
}

/// A sentence-transformers pooling mode, in the order sentence-transformers concatenates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pooling {
    Cls,
    Max,
    Mean,
    MeanSqrtLen,
}

/// The sentence-transformers head of a folder: pooling modes and whether to normalise.
struct SentenceHead {
    pooling: Vec<Pooling>,
    normalize: bool,
}

/// Reads `modules.json` (if any) and the pooling config it points to.
fn sentence_head(dir: &Path) -> Result<Option<SentenceHead>, ModelError> {
    let modules_path = dir.join("modules.json");
    if !modules_path.is_file() {
        return Ok(None);
    }
    let modules = read_json(&modules_path)?;
    let list = modules.as_array().ok_or_else(|| ModelError::Json {
        path: modules_path.clone(),
        message: "expected a list of modules".into(),
    })?;
    let mut head = SentenceHead {
        pooling: Vec::new(),
        normalize: false,
    };
    for m in list {
        let kind = m.get("type").and_then(Value::as_str).unwrap_or_default();
        let sub = m.get("path").and_then(Value::as_str).unwrap_or_default();
        match kind.rsplit('.').next().unwrap_or_default() {
            "Transformer" => {}
            "Normalize" => head.normalize = true,
            "Pooling" => {
                let path = dir.join(sub).join("config.json");
                let cfg = read_json(&path)?;
                let flag = |key: &str| cfg.get(key).and_then(Value::as_bool).unwrap_or(false);
                for key in ["pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"] {
                    if flag(key) {
                        return Err(ModelError::Config {
                            field: format!("{sub}/config.json: {key}"),
                            message: "= true is not supported".into(),
                        });
                    }
                }
                for (key, mode) in [
                    ("pooling_mode_cls_token", Pooling::Cls),
                    ("pooling_mode_max_tokens", Pooling::Max),
                    ("pooling_mode_mean_tokens", Pooling::Mean),
                    ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
                ] {
                    if flag(key) {
                        head.pooling.push(mode);
                    }
                }
                if head.pooling.is_empty() {
                    return Err(ModelError::Config {
                        field: format!("{sub}/config.json"),
                        message: "enables no pooling mode".into(),
                    });
                }
            }
            _ => {
                return Err(ModelError::Config {
                    field: "modules.json".into(),
                    message: format!("module type `{kind}` is not supported"),
                })
            }
        }
    }
    Ok(Some(head))
}

/// Builds the BERT graph: inputs `input_ids`, `attention_mask`, `token_type_ids`,
/// `position_ids` `[B, S]`; outputs `last_hidden_state` `[B, S, hidden]` and, for
/// sentence-transformers folders, `sentence_embedding` `[B, dim]`.
pub fn build(mb: &mut ModelBuilder, cfg: &BertConfig) -> Result<ModelKind, ModelError> {
    let head = sentence_head(mb.checkpoint().dir())?;
    let root = if mb
        .checkpoint()
        .contains("bert.embeddings.word_embeddings.weight")
    {
        "bert."
    } else {
        ""
    };
    let shape = ModelBuilder::token_shape();
    let ids = mb.g.input("input_ids", DType::I64, shape.clone())?;
    let mask = mb.g.input("attention_mask", DType::I64, shape.clone())?;
    let types = mb.g.input("token_type_ids", DType::I64, shape.clone())?;
    let pos = mb.g.input("position_ids", DType::I64, shape)?;
    let mut h = embeddings(mb, cfg, &format!("{root}embeddings"), [ids, types, pos])?;
    let attn_mask = mb.padding_mask(mask)?;
    for i in 0..cfg.layers {
        h = layer(mb, cfg, &format!("{root}encoder.layer.{i}"), h, attn_mask)?;
    }
    mb.g.set_output("last_hidden_state", h)?;
    let sentence = match head {
        Some(head) => {
            let emb = pool(mb, h, mask, &head, cfg.hidden)?;
            mb.g.set_output("sentence_embedding", emb)?;
            true
        }
        None => false,
    };
    Ok(ModelKind::Encoder {
        vocab_size: cfg.vocab_size,
        max_positions: cfg.max_positions,
        type_vocab_size: cfg.type_vocab_size,
        sentence_embedding: sentence,
    })
}

/// `{emb}`: the word, token type and position embeddings of `[ids, types, positions]`, summed,
/// then its LayerNorm.
fn embeddings(
    mb: &mut ModelBuilder,
    cfg: &BertConfig,
    emb: &str,
    [ids, types, pos]: [NodeId; 3],
) -> Result<NodeId, ModelError> {
    let e = cfg.hidden;
    let word = mb.weight(
        &format!("{emb}.word_embeddings.weight"),
        &[cfg.vocab_size, e],
    )?;
    let posw = mb.weight(
        &format!("{emb}.position_embeddings.weight"),
        &[cfg.max_positions, e],
    )?;
    let typw = mb.weight(
        &format!("{emb}.token_type_embeddings.weight"),
        &[cfg.type_vocab_size, e],
    )?;
    let w = mb.g.add(Op::Gather, &[word, ids])?;
    let t = mb.g.add(Op::Gather, &[typw, types])?;
    let p = mb.g.add(Op::Gather, &[posw, pos])?;
    let wt = mb.g.add_(w, t)?;
    let sum = mb.g.add_(wt, p)?;
    norm(mb, cfg, sum, &format!("{emb}.LayerNorm"))
}

/// Encoder layer `l` over `h`: self-attention under `attn_mask`, its output product, residual
/// and LayerNorm; the feed-forward products, residual and LayerNorm.
fn layer(
    mb: &mut ModelBuilder,
    cfg: &BertConfig,
    l: &str,
    h: NodeId,
    attn_mask: NodeId,
) -> Result<NodeId, ModelError> {
    let (e, heads) = (cfg.hidden, cfg.heads);
    let d = e / heads;
    let a = format!("{l}.attention.self");
    let parts = [
        (format!("{a}.query"), e),
        (format!("{a}.key"), e),
        (format!("{a}.value"), e),
    ];
    let parts: Vec<(&str, usize)> = parts.iter().map(|(n, w)| (n.as_str(), *w)).collect();
    let qkv = mb.fused_linear(h, &parts, e, true)?;
    let [q, k, v] = mb.split_last(qkv, &[e, e, e])?[..] else {
        unreachable!("three parts")
    };
    let q = mb.split_heads(q, heads, d)?;
    let k = mb.split_heads(k, heads, d)?;
    let v = mb.split_heads(v, heads, d)?;
    let scale = 1.0 / (d as f64).sqrt();
    let ctx = mb.attention(q, k, v, attn_mask, scale, cfg.attention_dropout)?;
    let merged = mb.merge_heads(ctx, heads, d)?;
    let o = mb.linear(merged, &format!("{l}.attention.output.dense"), e, e, true)?;
    let r = mb.g.add_(o, h)?;
    let h = norm(mb, cfg, r, &format!("{l}.attention.output.LayerNorm"))?;
    let inner = cfg.intermediate;
    let up = mb.linear(h, &format!("{l}.intermediate.dense"), e, inner, true)?;
    let act = mb.activation(up, cfg.activation)?;
    let down = mb.linear(act, &format!("{l}.output.dense"), inner, e, true)?;
    let r = mb.g.add_(down, h)?;
    norm(mb, cfg, r, &format!("{l}.output.LayerNorm"))
}

/// LayerNorm `{name}` (its `weight` and `bias`) over `x`.
fn norm(
    mb: &mut ModelBuilder,
    cfg: &BertConfig,
    x: NodeId,
    name: &str,
) -> Result<NodeId, ModelError> {
    let (weight, bias) = (format!("{name}.weight"), format!("{name}.bias"));
    mb.layer_norm(x, &weight, &bias, cfg.hidden, cfg.eps)
}

/// sentence-transformers pooling over the tokens the mask keeps, then optional L2 normalisation.
fn pool(
    mb: &mut ModelBuilder,
    h: NodeId,
    mask: NodeId,
    head: &SentenceHead,
    e: usize,
) -> Result<NodeId, ModelError> {
    let g = &mut mb.g;
    let (b, s) = (
        kiln_ir::Dim::sym(kiln_ir::dim::BATCH),
        kiln_ir::Dim::sym(kiln_ir::dim::SEQ),
    );
    let dtype = mb.dtype;
    let m = g.cast(mask, dtype)?;
    let m3 = g.reshape(m, vec![b.clone(), s, 1usize.into()])?;
    let mut parts = Vec::new();
    for mode in &head.pooling {
        let pooled = match mode {
            Pooling::Cls => g.slice(h, 1, 0usize.into(), 1usize.into())?,
            Pooling::Max => {
                // Padding positions become -1e9 before the max, as sentence-transformers does.
                let kept = g.mul(h, m3)?;
                let one_minus = g.add_const(m3, -1.0)?;
                let fill = g.mul_const(one_minus, 1e9)?;
                let filled = g.add_(kept, fill)?;
                g.reduce(ReduceOp::Max, filled, 1)?
            }
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let kept = g.mul(h, m3)?;
                let total = g.reduce(ReduceOp::Sum, kept, 1)?;
                let count = g.reduce(ReduceOp::Sum, m3, 1)?;
                let floor = g.scalar(1e-9, dtype);
                let count = g.binary(kiln_ir::BinaryOp::Max, count, floor)?;
                let denom = if *mode == Pooling::Mean {
                    count
                } else {
                    let inv = g.unary(UnaryOp::Rsqrt, count)?;
                    let one = g.scalar(1.0, dtype);
                    g.div(one, inv)?
                };
                g.div(total, denom)?
            }
        };
        parts.push(g.reshape(pooled, vec![b.clone(), e.into()])?);
    }
    let mut emb = if parts.len() == 1 {
        parts[0]
    } else {
        g.add(Op::Concat(1), &parts)?
    };
    if head.normalize {
        let sq = g.mul(emb, emb)?;
        let norm2 = g.reduce(ReduceOp::Sum, sq, -1)?;
        let floor = g.scalar(1e-24, dtype);
        let clamped = g.binary(kiln_ir::BinaryOp::Max, norm2, floor)?;
        let inv = g.unary(UnaryOp::Rsqrt, clamped)?;
        emb = g.mul(emb, inv)?;
    }
    Ok(emb)
}
