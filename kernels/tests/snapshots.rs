//! Snapshots of the emitted PTX for a small, reviewable set of configurations: a change to a
//! kernel generator shows up as a diff to review (`cargo insta review`), never accepted blindly.

use kiln_ir::kernel::{Activation, NormKind};
use kiln_kernels::elementwise::activation_kernel;
use kiln_kernels::embedding::{embedding, EmbeddingConfig};
use kiln_kernels::gemm::{gemm, gemm_base, GemmConfig};
use kiln_kernels::norm::{norm, NormConfig};
use kiln_kernels::sampling::argmax;
use kiln_kernels::Elem;

#[test]
fn rms_norm_residual_bf16() {
    let k = norm(&NormConfig {
        kind: NormKind::RmsNorm,
        residual: true,
        elem: Elem::BF16,
        rows: 16,
        cols: 64,
        eps: 1e-6,
    });
    insta::assert_snapshot!(k.module());
}

#[test]
fn layer_norm_f32() {
    let k = norm(&NormConfig {
        kind: NormKind::LayerNorm,
        residual: false,
        elem: Elem::F32,
        rows: 16,
        cols: 64,
        eps: 1e-5,
    });
    insta::assert_snapshot!(k.module());
}

#[test]
fn gelu_erf_f16() {
    insta::assert_snapshot!(activation_kernel(Activation::GeluErf, Elem::F16, 1000).module());
}

#[test]
fn embedding_two_tables_f32() {
    let k = embedding(&EmbeddingConfig {
        table_rows: vec![512, 256],
        hidden: 64,
        tokens: 16,
        elem: Elem::F32,
    });
    insta::assert_snapshot!(k.module());
}

#[test]
fn argmax_bf16() {
    insta::assert_snapshot!(argmax(Elem::BF16, 2, 512, false).module());
}

#[test]
fn argmax_advancing_bf16() {
    insta::assert_snapshot!(argmax(Elem::BF16, 2, 512, true).module());
}

#[test]
fn rope_of_fused_qkv_bf16() {
    let k = kiln_kernels::rope::rotate(&kiln_kernels::rope::RotateConfig {
        batch: 1,
        heads: 4,
        len: 16,
        head_dim: 64,
        strides: [16 * 384, 64, 384],
        elem: Elem::BF16,
    });
    insta::assert_snapshot!(k.module());
}

fn swiglu_bf16(m: u32, bias: bool) -> GemmConfig {
    GemmConfig {
        m,
        k: 64,
        n: 320,
        transpose_b: true,
        bias,
        activation: None,
        swiglu: true,
        residual: false,
        elem: Elem::BF16,
        row_norm: None,
    }
}

/// The Hopper kernel (sm_90a: TMA, wgmma, warp specialisation) lowering picks for a prefill.
#[test]
fn gemm_swiglu_bf16() {
    let k = gemm(&swiglu_bf16(16, false));
    assert!(k.name.ends_with("_wgmma"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// Its fallback for GPUs without sm_90a: `mma.sync` from `cp.async` stages.
#[test]
fn gemm_swiglu_bf16_base_image() {
    let k = gemm_base(&swiglu_bf16(16, false));
    assert!(k.name.ends_with("_tc"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// A GEMM with a bias and GELU on the Hopper kernel, over an odd number of columns: the
/// element-by-element epilogue.
#[test]
fn gemm_bias_gelu_odd_columns_bf16() {
    let k = gemm(&GemmConfig {
        m: 130,
        k: 64,
        n: 1001,
        transpose_b: true,
        bias: true,
        activation: Some(Activation::GeluTanh),
        swiglu: false,
        residual: false,
        elem: Elem::BF16,
        row_norm: None,
    });
    insta::assert_snapshot!(k.module());
}

/// BERT-base's O product at 128 x 128 tokens, with its bias and the residual.
fn bert_o_bias_residual() -> GemmConfig {
    GemmConfig {
        bias: true,
        residual: true,
        ..GemmConfig::plain(16384, 768, 768, Elem::BF16)
    }
}

/// The Hopper kernel with its consumers taking turns on whole tiles (BERT-base's O product at
/// 128 x 128 tokens, bias and residual, in the tiling lowering takes where staging does not
/// fit): the epilogue's loads ahead of its stores.
#[test]
fn gemm_taking_turns_bias_residual_bf16() {
    let cfg = bert_o_bias_residual();
    let tiling = kiln_kernels::gemm_wgmma::Tiling::ping_pong(128);
    let k = kiln_kernels::gemm_wgmma::gemm_wgmma_tiled(&cfg, tiling, "gemm_turns".into());
    insta::assert_snapshot!(k.module());
}

/// The Hopper kernel lowering picks for the same product: the staged epilogue (bias and
/// residual in registers, `stmatrix` into shared memory, TMA stores).
#[test]
fn gemm_staged_bias_residual_bf16() {
    let cfg = bert_o_bias_residual();
    assert!(kiln_kernels::gemm_wgmma::tiling(&cfg).staged);
    let k = gemm(&cfg);
    assert!(k.name.ends_with("_wgmma"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// The Hopper kernel with K split in parts (a decode step's down product of 64 rows, residual
/// added): each part's sums into the partials, the tile's last part adding them all in order.
#[test]
fn gemm_split_k_residual_bf16() {
    let cfg = GemmConfig {
        residual: true,
        ..GemmConfig::plain(64, 2048, 8192, Elem::BF16)
    };
    let tiling = kiln_kernels::gemm_wgmma::tiling(&cfg);
    assert_eq!(tiling.label(), "w128k8");
    let k = kiln_kernels::gemm_wgmma::gemm_wgmma(&cfg, "gemm_split".into());
    insta::assert_snapshot!(k.module());
}

/// One decode row against `[N, K]` gate/up weights: the one-column-per-warp matrix-vector
/// kernel.
#[test]
fn gemv_swiglu_bias_bf16_decode() {
    let k = gemm(&swiglu_bf16(1, true));
    assert!(k.name.ends_with("_gemv"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// A decode product whose weight rows (K = 8192, bf16) are split over 4 warps per column, their
/// sums met in shared memory, then the residual; 32 blocks, so each warp loads its whole share
/// of the weights before the wait.
#[test]
fn gemv_split_k_residual_bf16_decode() {
    let k = gemm(&GemmConfig {
        m: 1,
        k: 8192,
        n: 64,
        transpose_b: true,
        bias: false,
        activation: None,
        swiglu: false,
        residual: true,
        elem: Elem::BF16,
        row_norm: None,
    });
    assert!(k.name.ends_with("_gemv"), "{}", k.name);
    assert_eq!(k.launch.grid, [32, 1, 1], "two columns per block");
    insta::assert_snapshot!(k.module());
}

/// Decode rows normalised in the GEMV's prologue (RMSNorm into shared memory), then gate/up.
#[test]
fn gemv_rms_norm_prologue_swiglu_bf16_decode() {
    use kiln_ir::kernel::NormKind;
    use kiln_kernels::norm::NormConfig;
    let cfg = swiglu_bf16(4, false);
    let norm = NormConfig {
        kind: NormKind::RmsNorm,
        residual: false,
        elem: Elem::BF16,
        rows: 4,
        cols: 64,
        eps: 1e-5,
    };
    let k = kiln_kernels::gemv::gemv_normed(&(cfg, norm, true));
    assert!(k.name.starts_with("rms_norm_") && k.name.ends_with("_gemv_tc"));
    insta::assert_snapshot!(k.module());
}

/// One decode row's RMSNorm folded into its gate/up product: x scaled by the norm's weight as it
/// is multiplied, its squares summed beside, the sums scaled by 1/rms before SwiGLU.
#[test]
fn gemv_rms_norm_folded_swiglu_bf16_one_row() {
    use kiln_ir::kernel::NormKind;
    use kiln_kernels::norm::NormConfig;
    let cfg = swiglu_bf16(1, false);
    let norm = NormConfig {
        kind: NormKind::RmsNorm,
        residual: false,
        elem: Elem::BF16,
        rows: 1,
        cols: 64,
        eps: 1e-5,
    };
    let k = kiln_kernels::gemv::gemv_folded(&(cfg, norm, false));
    assert!(
        k.name.starts_with("rms_norm_") && k.name.ends_with("_gemv"),
        "{}",
        k.name
    );
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention (sm_90a: TMA, wgmma, P from registers): GQA, causal, padding, d 128.
#[test]
fn attention_gqa_causal_padded_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig::plain([2, 8, 2, 300, 300, 128], Elem::BF16);
    cfg.keys = KeyRule::Causal { window: None };
    cfg.padding = true;
    cfg.scale = 0.125;
    let k = attention(&cfg);
    assert!(k.name.ends_with("_wgmma"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention with three consumer warpgroups taking turns (d 64, 192-row blocks), causal.
#[test]
fn attention_three_consumers_causal_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig::plain([1, 4, 2, 384, 384, 64], Elem::BF16);
    cfg.keys = KeyRule::Causal { window: None };
    cfg.scale = 0.125;
    let k = attention(&cfg);
    assert!(k.name.ends_with("_wgmma"), "{}", k.name);
    assert_eq!(k.launch.block, [512, 1, 1]);
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention over a dense cache with position keys (a prompt chunk, q rotated ahead):
/// each warpgroup's search for an item's smallest and largest position, per-row last keys.
#[test]
fn attention_chunk_over_a_dense_cache_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig::plain([1, 32, 8, 512, 4608, 64], Elem::BF16);
    cfg.keys = KeyRule::Position { window: None };
    cfg.scale = 0.125;
    let k = attention(&cfg);
    assert!(k.name.ends_with("_wgmma"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention under Mistral's sliding window (4096 keys of 8192, GQA 4:1, head dim
/// 128): tiles from the item's earliest window on, masked per element where they cross a row's
/// first key.
#[test]
fn attention_sliding_window_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig::plain([1, 32, 8, 8192, 8192, 128], Elem::BF16);
    cfg.keys = KeyRule::Causal { window: Some(4096) };
    cfg.scale = 128f32.powf(-0.5);
    let k = attention(&cfg);
    assert!(k.name.ends_with("_w4096_wgmma"), "{}", k.name);
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention on a stream grid (an encoder's 12 heads over 2 x 4096 tokens, padding:
/// 528 items of 32 key tiles): the last waves' key tiles shared out in equal ranges, an item
/// that two ranges share finished by the later of its parts.
#[test]
fn attention_stream_grid_padded_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig};
    let mut cfg = AttentionConfig::plain([2, 12, 12, 4096, 4096, 64], Elem::BF16);
    cfg.padding = true;
    cfg.scale = 0.125;
    let k = attention(&cfg);
    let params: Vec<&str> = k.signature.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        params,
        ["q", "k", "v", "out", "mask", "partials", "counters"]
    );
    insta::assert_snapshot!(k.module());
}

/// The Hopper attention with dropout: each consumer thread draws the Philox blocks of one of its
/// two rows (round 1's row product once, first products stepped by adds) and swaps halves with
/// its quad neighbour.
#[test]
fn attention_dropout_bf16_wgmma() {
    use kiln_kernels::attention::{attention, AttentionConfig};
    let mut cfg = AttentionConfig::plain([1, 2, 2, 256, 256, 128], Elem::BF16);
    cfg.dropout = Some(kiln_kernels::attention::Dropout::new(0.1, 0));
    let k = attention(&cfg);
    let params: Vec<&str> = k.signature.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(params, ["q", "k", "v", "out", "seed"]);
    insta::assert_snapshot!(k.module());
}

#[test]
fn attention_gqa_causal_rope_dropout_bf16() {
    use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig {
        batch: 1,
        heads: 4,
        kv_heads: 2,
        q_len: 16,
        kv_len: 16,
        head_dim: 16,
        scale: 0.25,
        keys: KeyRule::Causal { window: None },
        padding: true,
        rope: true,
        rope_k: true,
        dropout: Some(kiln_kernels::attention::Dropout::new(0.1, 0)),
        elem: Elem::BF16,
        strides: [[0; 3]; 4],
        splits: 1,
        paging: None,
    };
    cfg.strides = cfg.contiguous_strides();
    insta::assert_snapshot!(attention(&cfg).module());
}

/// A decode step's attention over a cache of 2048 entries (positions from device memory, RoPE on
/// q, GQA 4:1), 32 key ranges of the query's keys: in bf16 a warp per (range, K/V head) serves
/// the head's 4 query heads from one read of its K/V; in f32 the SIMT kernel, a warp per (range,
/// query head). Both load four keys' rows at a time.
fn decode_config(elem: Elem) -> kiln_kernels::attention::AttentionConfig {
    use kiln_kernels::attention::{decode_splits, AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig {
        batch: 1,
        heads: 8,
        kv_heads: 2,
        q_len: 1,
        kv_len: 2048,
        head_dim: 64,
        scale: 0.125,
        keys: KeyRule::Position { window: None },
        padding: false,
        rope: true,
        rope_k: false,
        dropout: None,
        elem,
        strides: [[0; 3]; 4],
        splits: decode_splits(2048, 1, 8),
        paging: None,
    };
    cfg.strides = cfg.contiguous_strides();
    cfg
}

#[test]
fn attention_decode_query_group_bf16() {
    let k = kiln_kernels::attention::attention(&decode_config(Elem::BF16));
    assert!(k.name.ends_with("_decode"), "{}", k.name);
    assert_eq!(
        k.launch.grid,
        [4, 2, 1],
        "32 ranges, 8 per block, per K/V head"
    );
    // A 32-key tile on tensor cores: 16 score products (4 n-blocks of 8 keys, 4 k-blocks of
    // the head dimension) and 16 value products (2 k-blocks of 16 keys, 8 n-blocks), each of
    // V's 32 words transposed once, K and V loaded 16 bytes at a time (4 keys, 2 loads each).
    let module = k.module();
    let count = |what: &str| module.matches(what).count();
    assert_eq!(count("mma.sync.aligned.m16n8k16"), 32);
    assert_eq!(count("movmatrix.sync.aligned.m8n8.trans.b16"), 32);
    assert_eq!(count("ld.global.v4.b32"), 16);
    insta::assert_snapshot!(module);
}

/// The same step writing its new key (rotated) and value into the caches itself, read from head
/// views of a QKV product of 8 + 2 + 2 heads, and merging its key ranges itself: in shared memory
/// when one block takes all of a row's keys, else across the blocks its keys take.
#[test]
fn attention_decode_writing_the_step_and_merging_bf16() {
    use kiln_kernels::attention_decode::{attention_decode_with, combines, Extras, NewEntries};
    let row = 12 * 64;
    let new = NewEntries {
        strides: [[row, 64, row]; 2],
    };
    let cfg = decode_config(Elem::BF16);
    assert!(combines(&cfg));
    let extras = Extras {
        new: Some(new),
        combine: true,
    };
    let k = attention_decode_with(&cfg, &extras);
    assert!(k.name.ends_with("_writes_combined_decode"), "{}", k.name);
    assert_eq!(
        k.launch.grid,
        [4, 2, 1],
        "the grid of the kernel without writes"
    );
    insta::assert_snapshot!(k.module());
}

#[test]
fn attention_decode_key_ranges_f32() {
    let k = kiln_kernels::attention::attention(&decode_config(Elem::F32));
    assert_eq!(
        k.launch.grid,
        [8, 8, 1],
        "32 ranges, 4 per block, per query head"
    );
    insta::assert_snapshot!(k.module());
}

#[test]
fn attention_tensor_cores_bf16_d64_causal() {
    use kiln_kernels::attention::{AttentionConfig, KeyRule};
    let mut cfg = AttentionConfig {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        q_len: 64,
        kv_len: 64,
        head_dim: 64,
        scale: 0.125,
        keys: KeyRule::Causal { window: None },
        padding: false,
        rope: false,
        rope_k: false,
        dropout: None,
        elem: Elem::BF16,
        strides: [[0; 3]; 4],
        splits: 1,
        paging: None,
    };
    cfg.strides = cfg.contiguous_strides();
    // The base image's kernel (the Hopper one is `attention_gqa_causal_padded_bf16_wgmma`).
    let k = kiln_kernels::attention::attention_base(&cfg);
    assert!(k.name.ends_with("_tc"), "the tensor-core path: {}", k.name);
    insta::assert_snapshot!(k.module());
}
