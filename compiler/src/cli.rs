//! The `kiln` command line: `kiln ir` and `kiln eval`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use kiln_ir::dim::{BATCH, SEQ};
use kiln_ir::Tensor;
use kiln_models::inputs::TokenBatch;
use kiln_models::ModelKind;

use crate::tensor_io::{read_tensors, write_tensors};
use crate::tokenize::tokenize;

/// kiln: an ahead-of-time compiler from transformer checkpoints to fused GPU kernels.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print a Hugging Face checkpoint's IR graph as RON (symbolic in batch B and sequence S).
    Ir {
        /// Checkpoint folder (config.json + safetensors).
        model_dir: PathBuf,
        /// Fix the sequence length S.
        #[arg(long)]
        seq_len: Option<usize>,
        /// Fix the batch size B.
        #[arg(long)]
        batch: Option<usize>,
    },
    /// Run a checkpoint with the reference interpreter (f32 storage, f64 accumulation).
    Eval {
        /// Checkpoint folder (config.json + safetensors).
        model_dir: PathBuf,
        /// safetensors file with `input_ids` (i64 [L] or [B, L]) and optionally
        /// `attention_mask` (i64 [B, L]).
        #[arg(long, conflicts_with = "text", required_unless_present = "text")]
        input: Option<PathBuf>,
        /// A text to tokenise with the folder's tokenizer.json (repeat for a batch).
        #[arg(long)]
        text: Vec<String>,
        /// Where to write the outputs (`logits`, or `last_hidden_state` and
        /// `sentence_embedding`) as safetensors; without it a summary is printed.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

/// Runs one command, writing its report to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    match &cli.command {
        Command::Ir {
            model_dir,
            seq_len,
            batch,
        } => {
            let model = kiln_models::import(model_dir)?;
            let mut bindings = BTreeMap::new();
            if let Some(s) = seq_len {
                bindings.insert(SEQ.to_string(), positive(*s, "--seq-len")?);
            }
            if let Some(b) = batch {
                bindings.insert(BATCH.to_string(), positive(*b, "--batch")?);
            }
            let graph = if bindings.is_empty() {
                model.graph
            } else {
                model.graph.specialize(&bindings)?
            };
            writeln!(out, "{}", graph.to_ron())?;
        }
        Command::Eval {
            model_dir,
            input,
            text,
            output,
        } => {
            if let Some(path) = output {
                check_writable(path)?;
            }
            let model = kiln_models::import(model_dir)?;
            let (batch, unbatched) = match input {
                Some(path) => read_token_batch(path)?,
                None => (tokenize(model_dir, text)?, false),
            };
            let mut outputs = model.evaluate(&batch)?;
            if unbatched {
                for t in outputs.values_mut() {
                    t.shape.remove(0);
                }
            }
            match output {
                Some(path) => write_tensors(path, &outputs)?,
                None => print_summary(out, &model.kind, text, &batch, &outputs)?,
            }
        }
    }
    Ok(())
}

fn positive(v: usize, flag: &str) -> Result<i64> {
    if v == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(v as i64)
}

fn check_writable(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "cannot write {}: folder {} does not exist",
            path.display(),
            dir.display()
        );
    }
    if path.is_dir() {
        bail!("cannot write {}: it is a folder", path.display());
    }
    Ok(())
}

/// Reads `input_ids` and the optional `attention_mask` from an input file.
fn read_token_batch(path: &Path) -> Result<(TokenBatch, bool)> {
    let tensors = read_tensors(path)?;
    if let Some(extra) = tensors
        .keys()
        .find(|k| *k != "input_ids" && *k != "attention_mask")
    {
        bail!(
            "{}: unexpected tensor `{extra}` (kiln eval reads `input_ids` and `attention_mask`)",
            path.display()
        );
    }
    let Some(ids) = tensors.get("input_ids") else {
        bail!("{} has no `input_ids` tensor", path.display());
    };
    let mask = tensors.get("attention_mask");
    if let Some(m) = mask {
        if ids.shape.len() == 1 {
            bail!("`attention_mask` needs batched `input_ids` of shape [B, L]");
        }
        if m.shape != ids.shape {
            bail!(
                "`attention_mask` has shape {:?} but `input_ids` has {:?}",
                m.shape,
                ids.shape
            );
        }
    }
    Ok(TokenBatch::from_tensors(ids, mask)?)
}

fn print_summary(
    out: &mut dyn Write,
    kind: &ModelKind,
    texts: &[String],
    batch: &TokenBatch,
    outputs: &BTreeMap<String, Tensor>,
) -> Result<()> {
    for (i, row) in batch.ids.iter().enumerate() {
        let len = batch
            .mask
            .as_ref()
            .map_or(row.len(), |m| m[i].iter().filter(|&&v| v != 0).count());
        let label = texts
            .get(i)
            .map_or(format!("row {i}"), |t| format!("{t:?}"));
        writeln!(out, "[{i}] {label} ({len} tokens)")?;
        match kind {
            ModelKind::Encoder { .. } => {
                let (name, t) = match outputs.get("sentence_embedding") {
                    Some(t) => ("sentence_embedding", t),
                    None => ("last_hidden_state[0]", &outputs["last_hidden_state"]),
                };
                let dim = *t.shape.last().unwrap_or(&0);
                let values = t.as_f32().unwrap_or_default();
                let stride = values.len() / batch.ids.len();
                let v = &values[i * stride..i * stride + dim];
                let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let head: Vec<String> = v.iter().take(8).map(|x| format!("{x:+.5}")).collect();
                writeln!(
                    out,
                    "    {name}: dim {dim}, norm {norm:.6}, [{}, ...]",
                    head.join(", ")
                )?;
            }
            ModelKind::Decoder { vocab_size, .. } => {
                let logits = outputs["logits"].as_f32().unwrap_or_default();
                let l = row.len();
                let start = (i * l + len - 1) * vocab_size;
                let last = &logits[start..start + vocab_size];
                let (best, value) =
                    last.iter()
                        .enumerate()
                        .fold(
                            (0, f32::NEG_INFINITY),
                            |acc, (j, &x)| if x > acc.1 { (j, x) } else { acc },
                        );
                writeln!(out, "    next token (argmax): {best} (logit {value:.4})")?;
            }
        }
    }
    Ok(())
}
