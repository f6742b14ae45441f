//! `kiln-run`: runs compiled kiln artifacts.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kiln_ir::inputs::TokenBatch;
use kiln_runtime::generate::{generate, Sampling};
use kiln_runtime::{forward::forward, Artifact};

/// kiln-run: runs an artifact compiled by `kiln compile`.
#[derive(Parser)]
#[command(name = "kiln-run", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where requests run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The CPU, through the reference interpreter until the CPU backend lands.
    Cpu,
    /// The GPU (the CUDA executor is not in this build yet).
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// One forward pass: IN holds `input_ids` (i64 [L] or [B, L]) and optionally
    /// `attention_mask` (i64 [B, L]); OUT gets the model's outputs (`logits`, or
    /// `last_hidden_state` and `sentence_embedding`).
    Forward {
        /// The artifact folder.
        artifact: PathBuf,
        /// Input safetensors file.
        #[arg(long)]
        input: PathBuf,
        /// Output safetensors file.
        #[arg(long)]
        output: PathBuf,
        /// Where to run (cpu runs the reference interpreter until the CPU backend lands).
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
    },
    /// Generate tokens after a prompt through the decode graph and its KV cache (batch 1).
    Generate {
        /// The artifact folder.
        artifact: PathBuf,
        /// The prompt's token ids, comma-separated.
        #[arg(
            long,
            value_delimiter = ',',
            conflicts_with = "prompt",
            required_unless_present = "prompt"
        )]
        prompt_ids: Vec<i64>,
        /// The prompt as text, tokenised with the artifact's tokenizer.json; the output then
        /// also has the generated text.
        #[arg(long)]
        prompt: Option<String>,
        /// How many tokens to generate.
        #[arg(long)]
        max_new_tokens: usize,
        /// 0 (the default) is greedy; otherwise logits are divided by it before sampling.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Keep the k largest logits (0 keeps all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Keep the smallest set of largest logits with this much of the mass (1 keeps all).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Seed of the sampling stream.
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Print JSON (`{"tokens": [...]}`, with `"text"` for a text prompt) instead of
        /// space-separated ids.
        #[arg(long)]
        json: bool,
        /// Where to run (cpu runs the reference interpreter until the CPU backend lands).
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
    },
    /// Sentence embeddings of texts (encoders compiled from a sentence-transformers folder),
    /// one line of numbers per text.
    Embed {
        /// The artifact folder.
        artifact: PathBuf,
        /// A text to embed (repeat for a batch).
        #[arg(long, required = true)]
        text: Vec<String>,
        /// Print JSON (`{"embeddings": [[...], ...]}`).
        #[arg(long)]
        json: bool,
        /// Where to run (cpu runs the reference interpreter until the CPU backend lands).
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
    },
}

/// The one error `--device cuda` gives until the CUDA executor lands.
fn require_cpu(device: Device) -> Result<()> {
    if device == Device::Cuda {
        bail!("--device cuda: this build has no CUDA executor yet; use --device cpu");
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Forward {
            artifact,
            input,
            output,
            device,
        } => {
            require_cpu(device)?;
            kiln_ir::io::parent_folder(&output)?;
            let art = Artifact::open(&artifact)?;
            let tensors = kiln_ir::io::read_tensors(&input)?;
            if let Some(extra) = tensors
                .keys()
                .find(|k| *k != "input_ids" && *k != "attention_mask")
            {
                bail!(
                    "{}: unexpected tensor `{extra}` (expected `input_ids`, `attention_mask`)",
                    input.display()
                );
            }
            let Some(ids) = tensors.get("input_ids") else {
                bail!("{} has no `input_ids` tensor", input.display());
            };
            let (batch, unbatched) = TokenBatch::from_tensors(ids, tensors.get("attention_mask"))
                .map_err(anyhow::Error::msg)?;
            let mut outputs = forward(&art, &batch)?;
            if unbatched {
                for t in outputs.values_mut() {
                    t.shape.remove(0);
                }
            }
            kiln_ir::io::write_tensors(&output, &outputs)?;
        }
        Command::Generate {
            artifact,
            prompt_ids,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            json,
            device,
        } => {
            require_cpu(device)?;
            if temperature.is_nan()
                || temperature < 0.0
                || top_p.is_nan()
                || top_p <= 0.0
                || top_p > 1.0
            {
                bail!("--temperature must be >= 0 and --top-p in (0, 1]");
            }
            let art = Artifact::open(&artifact)?;
            let sampling = Sampling {
                temperature,
                top_k,
                top_p,
                seed,
            };
            let tokenizer = prompt.as_ref().map(|_| art.tokenizer()).transpose()?;
            let prompt_ids = match (&tokenizer, &prompt) {
                (Some(t), Some(text)) => t.encode(text)?,
                _ => prompt_ids,
            };
            let tokens = generate(&art, &prompt_ids, max_new_tokens, &sampling)?;
            let text = tokenizer.map(|t| t.decode(&tokens)).transpose()?;
            let ids: Vec<String> = tokens.iter().map(i64::to_string).collect();
            match (json, text) {
                (true, Some(text)) => println!(
                    "{{\"tokens\": [{}], \"text\": {}}}",
                    ids.join(", "),
                    serde_json::to_string(&text)?
                ),
                (true, None) => println!("{{\"tokens\": [{}]}}", ids.join(", ")),
                (false, Some(text)) => println!("{}\n{text}", ids.join(" ")),
                (false, None) => println!("{}", ids.join(" ")),
            }
        }
        Command::Embed {
            artifact,
            text,
            json,
            device,
        } => {
            require_cpu(device)?;
            let art = Artifact::open(&artifact)?;
            if art.manifest.model.decoder {
                bail!(
                    "{} is a decoder; embed needs an encoder",
                    art.manifest.architecture
                );
            }
            if !art
                .manifest
                .model
                .outputs
                .iter()
                .any(|o| o == "sentence_embedding")
            {
                bail!(
                    "{} has no sentence_embedding output (compile a sentence-transformers folder)",
                    artifact.display()
                );
            }
            let batch = art.tokenizer()?.encode_batch(&text)?;
            let outputs = forward(&art, &batch)?;
            let emb = &outputs["sentence_embedding"];
            let Some(values) = emb.as_f32() else {
                bail!("sentence_embedding is not a float tensor");
            };
            let rows: Vec<Vec<f32>> = values
                .chunks(emb.shape[1].max(1))
                .map(<[f32]>::to_vec)
                .collect();
            if json {
                println!("{}", serde_json::json!({ "embeddings": rows }));
            } else {
                for row in rows {
                    let nums: Vec<String> = row.iter().map(f32::to_string).collect();
                    println!("{}", nums.join(" "));
                }
            }
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
        std::process::exit(2);
    }
}
