//! Writes a random-weight checkpoint of any supported `config.json` in the Hugging Face layout:
//! `model.safetensors`, or shards of at most `--shard-size` bytes with
//! `model.safetensors.index.json`, the tensors in module order as `save_pretrained` writes them.
//! The tensors are the ones kiln's importer reads (their HF names and shapes), norm weights are
//! ones, biases zeros, everything else uniform in ±0.03: real shapes for measuring compile, load
//! and kernel speed without downloading a model.
//!
//! `random-checkpoint CONFIG_DIR OUT_DIR [--dtype bf16] [--shard-size 5000000000] [--seed 1]`

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use kiln_ir::DType;
use rayon::prelude::*;

#[derive(Parser)]
struct Args {
    /// Folder with the `config.json` to follow.
    config_dir: PathBuf,
    /// Folder to create (must not exist, or be empty).
    out_dir: PathBuf,
    /// Weight dtype: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Largest shard in bytes (Hugging Face's default is 5 GB); one file if everything fits.
    #[arg(long, default_value_t = 5_000_000_000)]
    shard_size: u64,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

struct Entry {
    name: String,
    shape: Vec<usize>,
    bytes: u64,
}

fn main() {
    if let Err(e) = run(&Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<()> {
    let dtype = DType::parse(&args.dtype)
        .filter(|d| d.is_float())
        .with_context(|| format!("--dtype {} is not f32, f16 or bf16", args.dtype))?;
    let options = kiln_models::ImportOptions {
        dtype,
        ..Default::default()
    };
    let model = kiln_models::import_config_only(&args.config_dir, &options)?;
    let entries: Vec<Entry> = model
        .graph
        .weights()
        .map(|(_, name, ty)| {
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| d.as_const().expect("weights have static shapes") as usize)
                .collect();
            let bytes = (shape.iter().product::<usize>() * dtype.size_bytes()) as u64;
            Entry {
                name: name.to_string(),
                shape,
                bytes,
            }
        })
        .collect();
    if args.out_dir.exists() && args.out_dir.read_dir()?.next().is_some() {
        bail!("{} exists and is not empty", args.out_dir.display());
    }
    std::fs::create_dir_all(&args.out_dir)?;
    std::fs::copy(
        args.config_dir.join("config.json"),
        args.out_dir.join("config.json"),
    )?;
    let shards = shard(&entries, args.shard_size);
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let file = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        write_shard(&args.out_dir.join(&file), shard, dtype, args.seed)?;
        for e in shard {
            weight_map.insert(e.name.clone(), file.clone().into());
            total += e.bytes;
        }
    }
    if count > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        std::fs::write(
            args.out_dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    println!(
        "{}: {} tensors, {:.2} GB in {count} file(s)",
        args.out_dir.display(),
        entries.len(),
        total as f64 / 1e9
    );
    Ok(())
}

/// Splits `entries` (in order) into shards of at most `limit` bytes, as `save_pretrained` does:
/// a tensor larger than the limit gets a shard of its own.
fn shard(entries: &[Entry], limit: u64) -> Vec<Vec<&Entry>> {
    let mut shards: Vec<Vec<&Entry>> = vec![Vec::new()];
    let mut size = 0u64;
    for e in entries {
        let current = shards.last_mut().expect("one shard");
        if !current.is_empty() && size + e.bytes > limit {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard").push(e);
        size += e.bytes;
    }
    shards
}

/// Writes one safetensors file holding `entries` (data in name order, as safetensors sorts it).
fn write_shard(path: &Path, entries: &[&Entry], dtype: DType, seed: u64) -> Result<()> {
    let mut sorted: Vec<&Entry> = entries.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let st_dtype = match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        _ => "BF16",
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for e in &sorted {
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": st_dtype, "shape": e.shape, "data_offsets": [offset, offset + e.bytes]}),
        );
        offset += e.bytes;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let file = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    out.write_all(&(json.len() as u64).to_le_bytes())?;
    out.write_all(&json)?;
    for e in &sorted {
        let kind = Kind::of(&e.name);
        let n = e.bytes as usize / dtype.size_bytes();
        // 1 Mi elements per piece, generated in parallel, written in order.
        const PIECE: usize = 1 << 20;
        let pieces: Vec<usize> = (0..n.div_ceil(PIECE)).collect();
        for group in pieces.chunks(64) {
            let bytes: Vec<Vec<u8>> = group
                .par_iter()
                .map(|&p| {
                    let len = PIECE.min(n - p * PIECE);
                    let stream = seed ^ fnv(&e.name) ^ (p as u64).wrapping_mul(0x9e37_79b9);
                    encode(kind, len, stream, dtype)
                })
                .collect();
            for b in bytes {
                out.write_all(&b)?;
            }
        }
    }
    out.flush()?;
    Ok(())
}

#[derive(Clone, Copy)]
enum Kind {
    Ones,
    Zeros,
    Uniform,
}

impl Kind {
    fn of(name: &str) -> Kind {
        let norm = ["norm", "ln_", "LayerNorm"]
            .iter()
            .any(|k| name.contains(k));
        match (norm, name.ends_with("bias")) {
            (_, true) => Kind::Zeros,
            (true, false) => Kind::Ones,
            _ => Kind::Uniform,
        }
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// `len` values of `kind` in `dtype`'s little-endian bytes (xorshift64* for the uniform ones).
fn encode(kind: Kind, len: usize, stream: u64, dtype: DType) -> Vec<u8> {
    let mut state = stream | 1;
    let mut out = Vec::with_capacity(len * dtype.size_bytes());
    for _ in 0..len {
        let v = match kind {
            Kind::Ones => 1.0,
            Kind::Zeros => 0.0,
            Kind::Uniform => {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
                (r as f32 / (1u64 << 24) as f32 - 0.5) * 0.06
            }
        };
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}
