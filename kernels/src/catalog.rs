//! A catalog of kernel configurations covering every kernel kind, dtype and epilogue: what the
//! snapshot and assembler tests (and the GPU suite) run over.

use kiln_ir::kernel::{Activation, NormKind};

use crate::attention::{attention, AttentionConfig, Dropout, KeyRule};
use crate::elementwise::activation_kernel;
use crate::embedding::{embedding, EmbeddingConfig};
use crate::gemm::{gemm, gemm_base, GemmConfig, RowNorm};
use crate::norm::{norm, NormConfig};
use crate::paging::Paging;
use crate::ptx::Elem;
use crate::sampling::{argmax, top_k_top_p};
use crate::{GeneratedKernel, Image};

/// Every configuration the tests assemble: `(kind, kernel)`.
pub fn catalog() -> Vec<(&'static str, GeneratedKernel)> {
    let mut out = Vec::new();
    for elem in [Elem::F32, Elem::F16, Elem::BF16] {
        row_kernels(elem, &mut out);
        cache_kernels(elem, &mut out);
        attention_kernels(elem, &mut out);
        gemm_kernels(elem, &mut out);
    }
    out
}

/// The catalog's list of kernels, each with its kind.
type Catalog = Vec<(&'static str, GeneratedKernel)>;

/// Norms, activations, embeddings and sampling.
fn row_kernels(elem: Elem, out: &mut Catalog) {
    for (kind, residual) in [
        (NormKind::LayerNorm, false),
        (NormKind::RmsNorm, false),
        (NormKind::LayerNorm, true),
        (NormKind::RmsNorm, true),
    ] {
        // 768 and 2048: a warp per row (the widest such row at 16-bit types); 4096 and up:
        // a block per row, rows read again past 8192.
        for cols in [768, 2048, 4096, 8192, 8193] {
            let cfg = NormConfig {
                kind,
                residual,
                elem,
                rows: 17,
                cols,
                eps: 1e-5,
            };
            out.push(("norm", norm(&cfg)));
        }
    }
    for act in [
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Silu,
        Activation::Relu,
    ] {
        out.push(("elementwise", activation_kernel(act, elem, 4097)));
    }
    for tables in [1usize, 2, 3] {
        let cfg = EmbeddingConfig {
            table_rows: vec![512; tables],
            hidden: 768,
            tokens: 127,
            elem,
        };
        out.push(("embedding", embedding(&cfg)));
    }
    for advance in [false, true] {
        out.push(("sampling", argmax(elem, 4, 50257, advance)));
    }
    for advance in [false, true] {
        out.push(("sampling", crate::sampling::choose_from_keys(4, advance)));
    }
    // Single-element loads (an odd vocabulary) and 16-byte loads.
    for vocab in [50257, 128256] {
        out.push(("sampling", top_k_top_p(elem, 4, vocab)));
    }
}

/// KV-cache writes, RoPE ahead of attention and a prompt chunk's entries.
fn cache_kernels(elem: Elem, out: &mut Catalog) {
    // Dense caches, and a paged one (16-key blocks).
    for (rope, paging) in [
        (false, None),
        (true, None),
        (true, Paging::new(16, 4096, 513)),
    ] {
        let cfg = crate::kv_cache::KvWriteConfig {
            batch: 2,
            kv_heads: 8,
            new_len: 1,
            capacity: 4096,
            head_dim: 128,
            new_strides: [6144, 128, 6144],
            rope,
            elem,
            paging,
        };
        out.push(("kv_cache", crate::kv_cache::kv_write(&cfg)));
    }
    // RoPE ahead of the Hopper attention: q of a fused QKV product (Llama-1B rows), ragged.
    let rotation = crate::rope::RotateConfig {
        batch: 2,
        heads: 32,
        len: 127,
        head_dim: 64,
        strides: [127 * 3072, 64, 3072],
        elem,
    };
    out.push(("rope", crate::rope::rotate(&rotation)));
    // A prompt chunk's entries in one launch: the same q, keys and values of that product.
    let keys = crate::kv_cache::KvWriteConfig {
        batch: 2,
        kv_heads: 8,
        new_len: 127,
        capacity: 4096,
        head_dim: 64,
        new_strides: rotation.strides,
        rope: true,
        elem,
        paging: None,
    };
    let entries = crate::kv_cache::ChunkEntriesConfig {
        keys,
        value_strides: rotation.strides,
        query: rotation,
        aligned: false,
    };
    out.push(("kv_cache", crate::kv_cache::chunk_entries(&entries)));
    // The same with rows 16-byte aligned: a few lanes a token.
    let aligned = crate::kv_cache::ChunkEntriesConfig {
        aligned: true,
        ..entries
    };
    out.push(("kv_cache", crate::kv_cache::chunk_entries(&aligned)));
}

/// The catalog's attention cases: head dim, key rule, padding, RoPE, dropout, query and key
/// lengths.
type AttentionCase = (u32, KeyRule, bool, bool, Option<Dropout>, u32, u32);

/// Every key rule, with padding, RoPE, dropout and windows, on each path (`mma.sync`, the Hopper
/// kernel, decode steps, prompt chunks over a cache).
fn attention_cases() -> [AttentionCase; 14] {
    [
        (
            64,
            KeyRule::Causal { window: None },
            true,
            false,
            None,
            127,
            127,
        ),
        (
            128,
            KeyRule::Causal { window: Some(64) },
            false,
            true,
            Some(Dropout::new(0.1, 3)),
            128,
            128,
        ),
        (128, KeyRule::All, true, false, None, 17, 17),
        // Dropout at head dim 64 (two m16 tiles a warp on `mma.sync`).
        (
            64,
            KeyRule::All,
            false,
            false,
            Some(Dropout::new(0.1, 2)),
            256,
            256,
        ),
        // Dropout on the Hopper kernel: causal, padding, ragged rows.
        (
            128,
            KeyRule::Causal { window: None },
            true,
            false,
            Some(Dropout::new(0.1, 1)),
            300,
            300,
        ),
        (
            64,
            KeyRule::Position { window: None },
            false,
            true,
            None,
            1,
            4097,
        ),
        // A decode step with head dim 128 (a query group of 4, or 8 below).
        (
            128,
            KeyRule::Position { window: None },
            false,
            true,
            None,
            1,
            2048,
        ),
        // Head dim 64 on the Hopper kernel in blocks of 192 rows (three consumers).
        (
            64,
            KeyRule::Causal { window: None },
            true,
            false,
            None,
            384,
            384,
        ),
        // A prompt chunk over a dense cache on the Hopper kernel (q rotated ahead), ragged.
        (
            64,
            KeyRule::Position { window: None },
            false,
            false,
            None,
            300,
            4097,
        ),
        // The same at head dim 128 (two consumers, whose 240 registers leave the producer,
        // paged below, 24).
        (
            128,
            KeyRule::Position { window: None },
            false,
            false,
            None,
            512,
            4608,
        ),
        // Sliding windows on the Hopper kernel: causal at head dim 128 (items whose windows
        // start mid-tile), a prompt chunk over a cache at 64 (paged below too).
        (
            128,
            KeyRule::Causal { window: Some(300) },
            true,
            false,
            None,
            1000,
            1000,
        ),
        (
            64,
            KeyRule::Position { window: Some(700) },
            false,
            false,
            None,
            300,
            4097,
        ),
        // An encoder's items over every key, more than the grid has blocks (padding, ragged
        // rows and keys): the Hopper kernel persistent, and on a stream grid among its shapes.
        (128, KeyRule::All, true, false, None, 1200, 1200),
        // A prompt chunk over a cache (tensor cores), head dim 96, with a window.
        (
            96,
            KeyRule::Position { window: Some(1000) },
            false,
            true,
            None,
            128,
            4096,
        ),
    ]
}

/// Attention over every key rule, with padding, RoPE, dropout, windows and paged caches, and
/// every shape of the Hopper kernel.
fn attention_kernels(elem: Elem, out: &mut Catalog) {
    for (head_dim, keys, padding, rope, dropout, q_len, kv_len) in attention_cases() {
        let mut cfg = AttentionConfig {
            batch: 2,
            heads: 16,
            kv_heads: 4,
            q_len,
            kv_len,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            keys,
            padding,
            rope,
            rope_k: rope && !matches!(keys, KeyRule::Position { .. }),
            dropout,
            elem,
            strides: [[0; 3]; 4],
            splits: 1,
            paging: None,
        };
        cfg.strides = cfg.contiguous_strides();
        attention_variants(cfg, out);
    }
}

/// `cfg`'s kernel (on the Hopper kernel, its base-image twin and its other shapes too); with
/// position keys over a paged cache as well; for a decode step split, its combine, the decode
/// kernel with its extras, and the largest query group.
fn attention_variants(mut cfg: AttentionConfig, out: &mut Catalog) {
    let position = matches!(cfg.keys, KeyRule::Position { .. });
    if position {
        // The same attention over a paged cache of 16-key blocks.
        let mut paged = cfg.clone();
        paged.take_paging(pool(16, cfg.kv_len, cfg.batch));
        let kernel = attention(&paged);
        if kernel.image == Image::Sm90a {
            out.push(("attention", crate::attention::attention_base(&paged)));
        }
        out.push(("attention", kernel));
    }
    let kernel = attention(&cfg);
    if kernel.image == Image::Sm90a {
        out.push(("attention", crate::attention::attention_base(&cfg)));
        // The Hopper kernel's other shapes.
        for other in crate::attention_wgmma::other_shapes(&cfg, &kernel.name) {
            out.push(("attention", other));
        }
    }
    out.push(("attention", kernel));
    if position && cfg.q_len == 1 {
        cfg.splits = crate::attention::decode_splits(cfg.kv_len, cfg.batch, cfg.heads);
        out.push(("attention", attention(&cfg)));
        out.push(("attention", crate::attention::attention_combine(&cfg)));
        if crate::attention_decode::supports(&cfg) {
            // Writing the step's key and value, from head views of a QKV product, and
            // merging the key ranges.
            use crate::attention_decode::{attention_decode_with, combines, Extras};
            let row = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim;
            let new = crate::attention_decode::NewEntries {
                strides: [[row, cfg.head_dim, row]; 2],
            };
            let extras = Extras {
                new: Some(new),
                combine: combines(&cfg),
            };
            out.push(("attention", attention_decode_with(&cfg, &extras)));
            let mut paged = cfg.clone();
            paged.take_paging(pool(16, cfg.kv_len, cfg.batch));
            out.push(("attention", attention_decode_with(&paged, &extras)));
        }
        // The largest query group the decode kernel serves (8 heads per K/V head).
        cfg.kv_heads = cfg.heads / 8;
        cfg.strides = cfg.contiguous_strides();
        out.push(("attention", attention(&cfg)));
    }
}

/// Products: every epilogue on the tiled and matrix-vector kernels (every Hopper tiling), the
/// folded and normed matrix-vector kernels and an odd column count.
fn gemm_kernels(elem: Elem, out: &mut Catalog) {
    epilogue_products(elem, out);
    if elem != Elem::F32 {
        normed_products(elem, out);
    }
    one_row_products(elem, out);
    out.push(("gemm", gemm(&odd_columns(elem))));
    if elem != Elem::F32 {
        carried_norms(elem, out);
    }
}

/// Every epilogue on 127 rows (the tiled kernels, every Hopper tiling and K split) and on 1 and
/// 5 rows (the matrix-vector kernel).
fn epilogue_products(elem: Elem, out: &mut Catalog) {
    for (transpose_b, bias, act, swiglu, residual) in [
        (true, false, None, false, false),
        (false, true, Some(Activation::GeluTanh), false, false),
        (true, true, None, false, true),
        (true, false, None, true, false),
        (true, true, None, true, true),
        (true, true, Some(Activation::GeluErf), false, true),
    ] {
        // 127 rows: the tiled kernels; 1 and 5 rows: the matrix-vector kernel (decode).
        for m in [127, 1, 5] {
            let cfg = GemmConfig {
                m,
                k: 768,
                n: 2304,
                transpose_b,
                bias,
                activation: act,
                swiglu,
                residual,
                elem,
                row_norm: None,
            };
            let kernel = gemm(&cfg);
            if kernel.image == Image::Sm90a {
                out.push(("gemm", gemm_base(&cfg)));
                // The Hopper kernel's other tilings, and with K split.
                for other in crate::gemm_wgmma::other_tilings(&cfg, &kernel.name) {
                    out.push(("gemm", other));
                }
                for split in crate::gemm_wgmma::split_tilings(&cfg, &kernel.name) {
                    out.push(("gemm", split));
                }
            }
            out.push(("gemm", kernel));
        }
    }
}

/// A product of an odd number of output columns (GPT-2's vocabulary is 50257): element stores.
fn odd_columns(elem: Elem) -> GemmConfig {
    GemmConfig {
        m: 127,
        k: 768,
        n: 1001,
        transpose_b: true,
        bias: true,
        activation: None,
        swiglu: false,
        residual: false,
        elem,
        row_norm: None,
    }
}

/// Decode products of 8 rows that normalise x in their prologue (tensor-core GEMV only): an
/// RMSNorm before a SwiGLU gate/up, a LayerNorm before a residual product.
fn normed_products(elem: Elem, out: &mut Catalog) {
    for (kind, swiglu) in [(NormKind::RmsNorm, true), (NormKind::LayerNorm, false)] {
        let cfg = GemmConfig {
            m: 8,
            k: 2048,
            n: 4096,
            transpose_b: true,
            bias: !swiglu,
            activation: None,
            swiglu,
            residual: !swiglu,
            elem,
            row_norm: None,
        };
        let norm = NormConfig {
            kind,
            residual: false,
            elem,
            rows: 8,
            cols: 2048,
            eps: 1e-5,
        };
        // RMSNorm's weight is ones where the compiler moved it into the product's.
        let weighted = kind == NormKind::LayerNorm;
        out.push(("gemm", crate::gemv::gemv_normed(&(cfg, norm, weighted))));
    }
}

/// A one-row LM head folding the greedy choice into its keys; on tensor cores, one-row products
/// with x's RMSNorm folded in too.
fn one_row_products(elem: Elem, out: &mut Catalog) {
    let head = GemmConfig::plain(1, 50257, 768, elem);
    out.push(("gemm", crate::gemv::gemv_choosing(&head)));
    if elem != Elem::F32 {
        // One-row products with the RMSNorm of x folded in: a SwiGLU gate/up of K = 8192
        // (several warps per column) and a choosing LM head.
        let rms = |rows, cols| NormConfig {
            kind: NormKind::RmsNorm,
            residual: false,
            elem,
            rows,
            cols,
            eps: 1e-5,
        };
        let gate_up = GemmConfig {
            m: 1,
            k: 8192,
            n: 512,
            transpose_b: true,
            bias: false,
            activation: None,
            swiglu: true,
            residual: false,
            elem,
            row_norm: None,
        };
        let norm = rms(1, gate_up.k);
        out.push(("gemm", crate::gemv::gemv_folded(&(gate_up, norm, false))));
        // A choosing LM head of a vocabulary the fold takes (32000, Llama-2's).
        let small_head = GemmConfig { n: 32000, ..head };
        let norm = rms(1, small_head.k);
        out.push(("gemm", crate::gemv::gemv_folded(&(small_head, norm, true))));
    }
}

/// An RMSNorm carried between two products, in every Hopper tiling: a residual product writing
/// its rows' sums of squares, a SwiGLU one scaling its rows by their 1/rms (8 sums a row, and
/// the most it takes).
fn carried_norms(elem: Elem, out: &mut Catalog) {
    let sums = GemmConfig {
        residual: true,
        row_norm: Some(RowNorm::Sums),
        ..GemmConfig::plain(1000, 2048, 2048, elem)
    };
    let scaled = GemmConfig {
        swiglu: true,
        row_norm: Some(RowNorm::Scale {
            parts: 8,
            eps: 1e-5,
        }),
        ..GemmConfig::plain(1000, 4096, 2048, elem)
    };
    let most = GemmConfig {
        row_norm: Some(RowNorm::Scale {
            parts: crate::gemm_wgmma::MAX_ROW_SUM_PARTS,
            eps: 1e-5,
        }),
        ..scaled.clone()
    };
    for cfg in [sums, scaled, most] {
        let kernel = gemm(&cfg);
        out.extend(
            (crate::gemm_wgmma::other_tilings(&cfg, &kernel.name).into_iter())
                .chain(crate::gemm_wgmma::split_tilings(&cfg, &kernel.name))
                .map(|k| ("gemm", k)),
        );
        out.push(("gemm", kernel));
    }
}

/// Paging of `block`-key blocks over `rows` sequences of `capacity` keys in the default pool.
fn pool(block: u32, capacity: u32, rows: u32) -> Paging {
    let entries = capacity.div_ceil(block) as usize;
    let blocks = crate::paging::whole_rows_pool(rows as usize, entries) as u32;
    Paging::new(block, capacity, blocks).expect("a power of two")
}
