//! The Cranelift CPU kernels against the reference interpreter on random inputs at odd shapes:
//! each kind is generated into one object, linked into a shared library, loaded and called
//! through the kernel signature, over row ranges split as an executor would split them.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use kiln_ir::kernel::{
    Activation, AttentionSpec, DecodeAttentionSpec, EmbeddingSpec, GemmSpec, NormKind, NormSpec,
};
use kiln_ir::Op;
use kiln_kernels::attention::{AttentionConfig, KeyRule};
use kiln_kernels::cpu::{
    attention, elementwise, embedding, epilogue, kv_cache, link_shared, norm, sampling, strided,
    CpuModule,
};
use kiln_kernels::embedding::EmbeddingConfig;
use kiln_kernels::gemm::GemmConfig;
use kiln_kernels::kv_cache::KvWriteConfig;
use kiln_kernels::norm::NormConfig;
use kiln_kernels::Elem;
use rand::{Rng, SeedableRng};

use common::{
    cache_write_reference, check, dropout_mask_reference, dropout_probe, mask_mismatches,
    reference, reference_with_seed, rope_tables, PagedCache,
};

type KernelFn = unsafe extern "C" fn(*const u64, u64, u64);

/// The linked library of `module`'s functions.
fn load(module: CpuModule, dir: &Path) -> libloading::Library {
    let lib = dir.join("kernels.so");
    link_shared(&module.finish().unwrap(), &lib).unwrap();
    // SAFETY: a library kiln just linked from its own object file; it has no initialisers.
    unsafe { libloading::Library::new(&lib) }.unwrap()
}

fn values(rng: &mut rand::rngs::StdRng, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|_| offset + scale * rng.random_range(-1.0f32..1.0))
        .collect()
}

#[test]
fn norms_match_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let dir = tempfile::tempdir().unwrap();
    let shapes = [(1u32, 1u32), (3, 7), (5, 64), (4, 385), (2, 4097)];
    let mut module = CpuModule::new().unwrap();
    let mut cases = Vec::new();
    for (kind, residual) in [
        (NormKind::LayerNorm, false),
        (NormKind::RmsNorm, false),
        (NormKind::LayerNorm, true),
        (NormKind::RmsNorm, true),
    ] {
        for (rows, cols) in shapes {
            let cfg = NormConfig {
                kind,
                residual,
                elem: Elem::F32,
                rows,
                cols,
                eps: 1e-5,
            };
            let name = norm::norm(&mut module, &cfg).unwrap();
            cases.push((cfg, name));
        }
    }
    let lib = load(module, dir.path());
    for (cfg, name) in cases {
        let (rows, cols) = (cfg.rows as usize, cfg.cols as usize);
        // An offset mean, so that a one-pass variance would show its cancellation.
        let x = values(&mut rng, rows * cols, 2.0, 3.0);
        let r = values(&mut rng, rows * cols, 1.0, 0.0);
        let w = values(&mut rng, cols, 1.5, 0.0);
        let b = values(&mut rng, cols, 0.5, 0.0);
        let mut out = vec![f32::NAN; rows * cols];
        let layer = cfg.kind == NormKind::LayerNorm;
        let mut args = vec![x.as_ptr() as u64];
        if cfg.residual {
            args.push(r.as_ptr() as u64);
        }
        args.push(w.as_ptr() as u64);
        if layer {
            args.push(b.as_ptr() as u64);
        }
        args.push(out.as_mut_ptr() as u64);
        // SAFETY: the symbol was generated with the kernel signature.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        // Two calls over a split of the rows, as a parallel executor makes them.
        let mid = (rows / 2) as u64;
        // SAFETY: every pointer covers `rows x cols` (or `cols`) f32 values, as the kernel reads.
        unsafe {
            f(args.as_ptr(), 0, mid);
            f(args.as_ptr(), mid, rows as u64);
        }
        let mut inputs = vec![(vec![rows, cols], x)];
        if cfg.residual {
            inputs.push((vec![rows, cols], r));
        }
        inputs.push((vec![cols], w));
        if layer {
            inputs.push((vec![cols], b));
        }
        let spec = NormSpec {
            kind: cfg.kind,
            eps: f64::from(cfg.eps),
            residual: cfg.residual,
        };
        let want = reference(Op::Norm(spec), inputs, &[]);
        check(
            &format!("{name} rows {rows}"),
            Elem::F32,
            &out,
            want.as_f32().unwrap(),
        );
    }
}

#[test]
fn activations_match_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let dir = tempfile::tempdir().unwrap();
    let acts = [
        Activation::Relu,
        Activation::Silu,
        Activation::GeluTanh,
        Activation::GeluErf,
    ];
    let mut module = CpuModule::new().unwrap();
    let names: Vec<String> = acts
        .iter()
        .map(|a| elementwise::activation_kernel(&mut module, *a).unwrap())
        .collect();
    let lib = load(module, dir.path());
    for (act, name) in acts.iter().zip(&names) {
        for n in [1usize, 7, 1001] {
            // Values over the tails too, where the GELU forms must not cancel.
            let mut x = values(&mut rng, n, 12.0, 0.0);
            x[0] = -30.0;
            let mut out = vec![f32::NAN; n];
            let args = [x.as_ptr() as u64, out.as_mut_ptr() as u64, n as u64];
            // SAFETY: the symbol was generated with the kernel signature.
            let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
            // An odd split, so that vector loops start at unaligned elements.
            let mid = (n / 3) as u64;
            // SAFETY: `x` and `out` hold `n` f32 values, the range the calls cover.
            unsafe {
                f(args.as_ptr(), 0, mid);
                f(args.as_ptr(), mid, n as u64);
            }
            let want = reference(Op::Activation(*act), vec![(vec![n], x.clone())], &[]);
            let want = want.as_f32().unwrap();
            check(&format!("{name} n {n}"), Elem::F32, &out, want);
        }
    }
}

#[test]
fn embeddings_match_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let dir = tempfile::tempdir().unwrap();
    let shapes = [(1u32, 1u32), (5, 7), (17, 64), (3, 385)];
    let mut module = CpuModule::new().unwrap();
    let mut cases = Vec::new();
    for (tokens, hidden) in shapes {
        let cfg = EmbeddingConfig {
            table_rows: vec![50, 9],
            hidden,
            tokens,
            elem: Elem::F32,
        };
        let name = embedding::embedding(&mut module, &cfg).unwrap();
        cases.push((cfg, name));
    }
    let lib = load(module, dir.path());
    for (cfg, name) in cases {
        let (tokens, hidden) = (cfg.tokens as usize, cfg.hidden as usize);
        let t0 = values(&mut rng, 50 * hidden, 1.0, 0.0);
        let t1 = values(&mut rng, 9 * hidden, 1.0, 0.0);
        let ids0: Vec<i64> = (0..tokens).map(|_| rng.random_range(0..50)).collect();
        let ids1: Vec<i64> = (0..tokens).map(|_| rng.random_range(0..9)).collect();
        let mut out = vec![f32::NAN; tokens * hidden];
        let args = [
            t0.as_ptr() as u64,
            ids0.as_ptr() as u64,
            t1.as_ptr() as u64,
            ids1.as_ptr() as u64,
            out.as_mut_ptr() as u64,
        ];
        // SAFETY: the symbol was generated with the kernel signature.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        let mid = (tokens / 2) as u64;
        // SAFETY: tables, ids and output are sized for `tokens` tokens of `hidden` columns.
        unsafe {
            f(args.as_ptr(), 0, mid);
            f(args.as_ptr(), mid, tokens as u64);
        }
        let as_f = |v: &[i64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let inputs = vec![
            (vec![50, hidden], t0),
            (vec![tokens], as_f(&ids0)),
            (vec![9, hidden], t1),
            (vec![tokens], as_f(&ids1)),
        ];
        let want = reference(Op::Embedding(EmbeddingSpec { tables: 2 }), inputs, &[1, 3]);
        check(
            &format!("{name} tokens {tokens}"),
            Elem::F32,
            &out,
            want.as_f32().unwrap(),
        );
    }
}

#[test]
fn kv_cache_writes_match_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let dir = tempfile::tempdir().unwrap();
    let (b, kvh) = (2usize, 3usize);
    let cases = [
        (1u32, 40u32, 64u32, true),
        (5, 30, 6, false),
        (7, 64, 10, true),
    ];
    let mut module = CpuModule::new().unwrap();
    let mut built = Vec::new();
    for (new_len, capacity, head_dim, rope) in cases {
        let (s, d) = (new_len as usize, head_dim as usize);
        let cfg = KvWriteConfig {
            batch: b as u32,
            kv_heads: kvh as u32,
            new_len,
            capacity,
            head_dim,
            new_strides: [(kvh * s * d) as u32, (s * d) as u32, d as u32],
            rope,
            elem: Elem::F32,
            paging: None,
        };
        built.push((kv_cache::kv_write(&mut module, &cfg).unwrap(), cfg));
    }
    let lib = load(module, dir.path());
    for (name, cfg) in built {
        let (s, t, d) = (
            cfg.new_len as usize,
            cfg.capacity as usize,
            cfg.head_dim as usize,
        );
        let mut cache = values(&mut rng, b * kvh * t * d, 1.0, 0.0);
        let before = cache.clone();
        let new = values(&mut rng, b * kvh * s * d, 1.0, 0.0);
        let positions: Vec<i64> = (0..b)
            .flat_map(|_| {
                let first = rng.random_range(0..(t - s + 1) as i64);
                (0..s as i64).map(move |x| first + x)
            })
            .collect();
        let mask: Vec<i64> = (0..b * s).map(|i| i64::from(i % 3 != 1)).collect();
        let (cos, sin) = rope_tables(10000.0, d, t + 1);
        let args = [
            cache.as_mut_ptr() as u64,
            new.as_ptr() as u64,
            positions.as_ptr() as u64,
            mask.as_ptr() as u64,
            cos.as_ptr() as u64,
            sin.as_ptr() as u64,
        ];
        // SAFETY: the symbol was generated with the kernel signature.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        let tokens = (b * s) as u64;
        // SAFETY: every buffer is sized for the configuration; positions lie inside the cache.
        unsafe {
            f(args.as_ptr(), 0, tokens / 2);
            f(args.as_ptr(), tokens / 2, tokens);
        }
        let want = cache_write_reference(
            &before,
            &new,
            &positions,
            &mask,
            [b, kvh, s, t, d],
            cfg.rope,
        );
        check(&name, Elem::F32, &cache, &want);
    }
}

/// Writes into a paged cache and attention over one store exactly what they store and read in a
/// dense cache, the rows found through a shuffled block table (blocks of 8 keys, a capacity that
/// is not a multiple of them).
#[test]
fn paged_caches_match_dense_ones() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let dir = tempfile::tempdir().unwrap();
    let (b, kvh, t, d) = (2usize, 2usize, 44usize, 16usize);
    let paged = PagedCache::new(&mut rng, [b, kvh, t, d], 8);
    let write = |s: u32, paging| KvWriteConfig {
        batch: b as u32,
        kv_heads: kvh as u32,
        new_len: s,
        capacity: t as u32,
        head_dim: d as u32,
        new_strides: [(kvh * s as usize * d) as u32, s * d as u32, d as u32],
        rope: true,
        elem: Elem::F32,
        paging,
    };
    let reads: Vec<AttentionConfig> = [(1, None), (5, Some(6))]
        .into_iter()
        .map(|(s, window)| {
            attention_case(
                (4, 2, s, t as u32, 16),
                KeyRule::Position { window },
                false,
                true,
            )
            .cfg
        })
        .collect();
    let mut module = CpuModule::new().unwrap();
    let mut pairs = Vec::new();
    for s in [1u32, 5] {
        let dense = kv_cache::kv_write(&mut module, &write(s, None)).unwrap();
        let on_pages = kv_cache::kv_write(&mut module, &write(s, Some(paged.paging))).unwrap();
        pairs.push((dense, on_pages, s as usize, None));
    }
    for cfg in &reads {
        let mut p = cfg.clone();
        p.take_paging(paged.paging);
        let dense = attention::attention(&mut module, cfg).unwrap();
        let on_pages = attention::attention(&mut module, &p).unwrap();
        pairs.push((
            dense,
            on_pages,
            cfg.q_len as usize,
            Some(cfg.heads as usize),
        ));
    }
    let lib = load(module, dir.path());
    let (cos, sin) = rope_tables(10000.0, d, t + 1);
    for (dense_name, paged_name, s, heads) in pairs {
        let positions: Vec<i64> = (0..b)
            .flat_map(|row| (0..s as i64).map(move |x| (t - s - 3 * row) as i64 + x))
            .collect();
        let mask = vec![1i64; b * s];
        // SAFETY: both symbols were generated with the kernel signature.
        let dense_fn: libloading::Symbol<KernelFn> =
            unsafe { lib.get(dense_name.as_bytes()) }.unwrap();
        // SAFETY: as above.
        let paged_fn: libloading::Symbol<KernelFn> =
            unsafe { lib.get(paged_name.as_bytes()) }.unwrap();
        let table = paged.table.as_ptr() as u64;
        let (cos, sin, pos) = (
            cos.as_ptr() as u64,
            sin.as_ptr() as u64,
            positions.as_ptr() as u64,
        );
        match heads {
            None => {
                let mut cache = values(&mut rng, b * kvh * t * d, 1.0, 0.0);
                let mut pool = paged.scatter(&cache, f32::NAN);
                let new = values(&mut rng, b * kvh * s * d, 1.0, 0.0);
                let (new, mask) = (new.as_ptr() as u64, mask.as_ptr() as u64);
                let args = [cache.as_mut_ptr() as u64, new, pos, mask, cos, sin];
                let args_paged = [pool.as_mut_ptr() as u64, new, pos, mask, cos, sin, table];
                let tokens = (b * s) as u64;
                // SAFETY: buffers sized for the configurations; positions inside the cache.
                unsafe {
                    dense_fn(args.as_ptr(), 0, tokens);
                    paged_fn(args_paged.as_ptr(), 0, tokens);
                }
                assert_eq!(paged.gather(&pool), cache, "{paged_name}");
            }
            Some(h) => {
                let k = values(&mut rng, b * kvh * t * d, 1.0, 0.0);
                let v = values(&mut rng, b * kvh * t * d, 1.0, 0.0);
                let q = values(&mut rng, b * h * s * d, 1.0, 0.0);
                let (kp, vp) = (paged.scatter(&k, f32::NAN), paged.scatter(&v, f32::NAN));
                let mut out = vec![f32::NAN; b * h * s * d];
                let mut out_paged = out.clone();
                let q = q.as_ptr() as u64;
                let args = [
                    q,
                    k.as_ptr() as u64,
                    v.as_ptr() as u64,
                    out.as_mut_ptr() as u64,
                    pos,
                    cos,
                    sin,
                ];
                let args_paged = [
                    q,
                    kp.as_ptr() as u64,
                    vp.as_ptr() as u64,
                    out_paged.as_mut_ptr() as u64,
                    pos,
                    cos,
                    sin,
                    table,
                ];
                let rows = (b * h * s) as u64;
                // SAFETY: as above.
                unsafe {
                    dense_fn(args.as_ptr(), 0, rows);
                    paged_fn(args_paged.as_ptr(), 0, rows);
                }
                assert!(out.iter().all(|x| x.is_finite()), "{dense_name}");
                assert_eq!(out_paged, out, "{paged_name}");
            }
        }
    }
}

/// The epilogue after a product computed here (as the executor's GEMM library would): the whole
/// equals the interpreter's fused GEMM.
#[test]
fn gemm_epilogues_match_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    let dir = tempfile::tempdir().unwrap();
    let variants: [(bool, Option<Activation>, bool, bool); 5] = [
        (true, None, false, false),
        (true, Some(Activation::GeluTanh), false, false),
        (false, Some(Activation::GeluErf), false, true),
        (false, None, true, false),
        (true, None, true, true),
    ];
    let (k, n) = (7usize, 14usize);
    let mut module = CpuModule::new().unwrap();
    let mut built = Vec::new();
    for (bias, activation, swiglu, residual) in variants {
        let cfg = GemmConfig {
            m: 5,
            k: k as u32,
            n: n as u32,
            transpose_b: true,
            bias,
            activation,
            swiglu,
            residual,
            elem: Elem::F32,
            row_norm: None,
        };
        assert!(epilogue::needed(&cfg));
        built.push((epilogue::epilogue(&mut module, &cfg).unwrap(), cfg));
    }
    let lib = load(module, dir.path());
    for (name, cfg) in built {
        for m in [1usize, 5] {
            let n_out = cfg.n_out() as usize;
            let x = values(&mut rng, m * k, 1.0, 0.0);
            let w = values(&mut rng, n * k, 0.5, 0.0);
            let bias = values(&mut rng, n, 0.5, 0.0);
            let res = values(&mut rng, m * n_out, 1.0, 0.0);
            let y: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    (0..k)
                        .map(|j| f64::from(x[r * k + j]) * f64::from(w[c * k + j]))
                        .sum::<f64>() as f32
                })
                .collect();
            let mut out = vec![f32::NAN; m * n_out];
            let mut args = vec![y.as_ptr() as u64];
            if cfg.bias {
                args.push(bias.as_ptr() as u64);
            }
            if cfg.residual {
                args.push(res.as_ptr() as u64);
            }
            args.push(out.as_mut_ptr() as u64);
            // SAFETY: the symbol was generated with the kernel signature.
            let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
            // SAFETY: y is `m x n`, bias `n`, residual and out `m x n_out`.
            unsafe { f(args.as_ptr(), 0, m as u64) };
            let mut inputs = vec![(vec![m, k], x), (vec![n, k], w)];
            if cfg.bias {
                inputs.push((vec![n], bias));
            }
            if cfg.residual {
                inputs.push((vec![m, n_out], res));
            }
            let spec = GemmSpec {
                transpose_b: true,
                bias: cfg.bias,
                activation: cfg.activation,
                swiglu: cfg.swiglu,
                residual: cfg.residual,
                prologue: None,
            };
            let want = reference(Op::Gemm(spec), inputs, &[]);
            check(
                &format!("{name} m {m}"),
                Elem::F32,
                &out,
                want.as_f32().unwrap(),
            );
        }
    }
}

/// One attention case: the kernel configuration and the IR op it must agree with.
struct AttentionCase {
    cfg: AttentionConfig,
    op: Op,
}

fn attention_case(
    (heads, kv_heads, q_len, kv_len, head_dim): (u32, u32, u32, u32, u32),
    keys: KeyRule,
    padding: bool,
    rope: bool,
) -> AttentionCase {
    attention_case_with_dropout(
        (heads, kv_heads, q_len, kv_len, head_dim),
        keys,
        padding,
        rope,
        None,
    )
}

fn attention_case_with_dropout(
    (heads, kv_heads, q_len, kv_len, head_dim): (u32, u32, u32, u32, u32),
    keys: KeyRule,
    padding: bool,
    rope: bool,
    dropout: Option<(f64, u32)>,
) -> AttentionCase {
    let scale = 1.0 / (head_dim as f32).sqrt();
    let rope_spec = rope.then_some((10000.0, kiln_ir::RopeScaling::Default));
    let decode = matches!(keys, KeyRule::Position { .. });
    let mut cfg = AttentionConfig {
        batch: 2,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        scale,
        keys,
        padding,
        rope,
        rope_k: rope && !decode,
        dropout: dropout.map(|(p, stream)| kiln_kernels::attention::Dropout::new(p, stream)),
        elem: Elem::F32,
        strides: [[0; 3]; 4],
        splits: 1,
        paging: None,
    };
    cfg.strides = cfg.contiguous_strides();
    let op = match keys {
        KeyRule::Position { window } => Op::DecodeAttention(DecodeAttentionSpec {
            scale: f64::from(scale),
            window: window.map(i64::from),
            rope: rope_spec,
        }),
        KeyRule::Causal { window } => Op::Attention(AttentionSpec {
            scale: f64::from(scale),
            causal: true,
            window: window.map(i64::from),
            padding,
            rope: rope_spec,
            dropout,
        }),
        KeyRule::All => Op::Attention(AttentionSpec {
            scale: f64::from(scale),
            causal: false,
            window: None,
            padding,
            rope: rope_spec,
            dropout,
        }),
    };
    AttentionCase { cfg, op }
}

#[test]
fn attention_matches_the_interpreter() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // Encoder: every key, padding, head dim with a scalar tail.
        attention_case((4, 4, 7, 7, 6), KeyRule::All, true, false),
        // Decoder prefill: causal, padding, RoPE on q and k, GQA.
        attention_case(
            (4, 2, 9, 9, 8),
            KeyRule::Causal { window: None },
            true,
            true,
        ),
        // Sliding window, MQA.
        attention_case(
            (3, 1, 11, 11, 10),
            KeyRule::Causal { window: Some(4) },
            false,
            true,
        ),
        // Decode over a cache: one and three new tokens, RoPE on q, GQA.
        attention_case(
            (4, 2, 1, 20, 16),
            KeyRule::Position { window: None },
            false,
            true,
        ),
        attention_case(
            (4, 2, 3, 20, 16),
            KeyRule::Position { window: Some(5) },
            false,
            false,
        ),
        // More keys than one block of scores: the running max and sum carry across blocks.
        attention_case(
            (4, 2, 2, 300, 16),
            KeyRule::Position { window: None },
            false,
            true,
        ),
        attention_case(
            (2, 2, 150, 150, 8),
            KeyRule::Causal { window: None },
            true,
            true,
        ),
        attention_case((2, 1, 5, 260, 12), KeyRule::All, true, false),
        // An odd head dimension (no RoPE): vector columns, then a scalar tail.
        attention_case(
            (3, 3, 9, 9, 7),
            KeyRule::Causal { window: None },
            true,
            false,
        ),
        // Dropout: any mask bit drawn differently from the IR's moves a row far past 1e-4.
        attention_case_with_dropout(
            (4, 2, 140, 140, 8),
            KeyRule::Causal { window: None },
            true,
            true,
            Some((0.5, 3)),
        ),
        attention_case_with_dropout((2, 2, 6, 6, 4), KeyRule::All, false, false, Some((0.1, 0))),
    ];
    let mut module = CpuModule::new().unwrap();
    let names: Vec<String> = cases
        .iter()
        .map(|c| attention::attention(&mut module, &c.cfg).unwrap())
        .collect();
    let lib = load(module, dir.path());
    for (case, name) in cases.iter().zip(&names) {
        let t = case.cfg.kv_len as usize;
        // Right padding (every query sees key 0).
        let lens = [t, t - 2];
        let mask: Vec<i64> = (0..2 * t).map(|x| i64::from(x % t < lens[x / t])).collect();
        run_attention_case(&lib, name, case, &mut rng, &mask);
    }
}

/// The CPU attention's dropout mask is the interpreter's, bit for bit, at p 0.1, 0.3 and 0.5 (the
/// IR's f64 p; a threshold derived from p rounded to f32 differs at 0.1).
#[test]
fn dropout_masks_match_the_interpreter_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (b, h, s, t) = (2usize, 3usize, 37usize, 64usize);
    let ps = [0.1, 0.3, 0.5];
    let cfgs: Vec<AttentionConfig> = ps
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let mut cfg = AttentionConfig {
                batch: b as u32,
                heads: h as u32,
                kv_heads: h as u32,
                q_len: s as u32,
                kv_len: t as u32,
                head_dim: t as u32,
                scale: 1.0,
                keys: KeyRule::All,
                padding: false,
                rope: false,
                rope_k: false,
                dropout: Some(kiln_kernels::attention::Dropout::new(p, i as u32 + 2)),
                elem: Elem::F32,
                strides: [[0; 3]; 4],
                splits: 1,
                paging: None,
            };
            cfg.strides = cfg.contiguous_strides();
            cfg
        })
        .collect();
    let mut module = CpuModule::new().unwrap();
    let names: Vec<String> = cfgs
        .iter()
        .map(|c| attention::attention(&mut module, c).unwrap())
        .collect();
    let lib = load(module, dir.path());
    let (q, k, v) = dropout_probe(b, h, s, t);
    for ((cfg, name), p) in cfgs.iter().zip(&names).zip(ps) {
        // At this seed one word of plane < 6, row < 37, col < 64 of stream 2 lies between the
        // thresholds of p = 0.1 as f64 and as f32 (429496730 and 429496736): a mask drawn from a
        // rounded p differs there.
        let seed = 0x5eed_0000_0001_4e40_i64;
        let mut out = vec![f32::NAN; b * h * s * t];
        let args = [
            q.as_ptr() as u64,
            k.as_ptr() as u64,
            v.as_ptr() as u64,
            out.as_mut_ptr() as u64,
            &seed as *const i64 as u64,
        ];
        // SAFETY: the symbol was generated with the kernel signature; buffers fit the shapes.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        unsafe { f(args.as_ptr(), 0, (b * h * s) as u64) };
        let stream = cfg.dropout.unwrap().stream;
        let want = dropout_mask_reference(p, stream, seed, [b, h, s, t]);
        let kept = want.iter().filter(|x| **x).count() as f64 / want.len() as f64;
        assert!((kept - (1.0 - p)).abs() < 0.03, "p {p}: kept {kept}");
        assert_eq!(mask_mismatches(&out, &want), 0, "p {p}: masks differ");
    }
}

/// A query that sees no key stores zeros, in the CPU kernel as in the interpreter (and the GPU
/// kernels): a batch row of padding only, and the padding queries of a left-padded row under a
/// causal mask, whose keys are all padding.
#[test]
fn attention_of_a_query_that_sees_no_key_is_zero() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        attention_case((2, 2, 6, 6, 4), KeyRule::All, true, false),
        attention_case(
            (4, 2, 9, 9, 8),
            KeyRule::Causal { window: None },
            true,
            true,
        ),
        attention_case(
            (2, 1, 140, 140, 8),
            KeyRule::Causal { window: Some(64) },
            true,
            false,
        ),
    ];
    let mut module = CpuModule::new().unwrap();
    let names: Vec<String> = cases
        .iter()
        .map(|c| attention::attention(&mut module, &c.cfg).unwrap())
        .collect();
    let lib = load(module, dir.path());
    for (case, name) in cases.iter().zip(&names) {
        let cfg = &case.cfg;
        let (t, d) = (cfg.kv_len as usize, cfg.head_dim as usize);
        let (rows, unseen): (Vec<i64>, usize) = match cfg.keys {
            // Row 0 is real, row 1 all padding: every query of row 1 sees no key.
            KeyRule::All => ((0..2 * t).map(|x| i64::from(x < t)).collect(), t),
            // Row 1 left-padded by 3: its first 3 queries see only padding keys.
            _ => (
                (0..2 * t).map(|x| i64::from(x < t || x % t >= 3)).collect(),
                3,
            ),
        };
        let out = run_attention_case(&lib, name, case, &mut rng, &rows);
        let (h, s) = (cfg.heads as usize, cfg.q_len as usize);
        for head in 0..h {
            for i in 0..s {
                let at = ((h + head) * s + i) * d;
                let row = &out[at..at + d];
                if i < unseen {
                    assert!(
                        row.iter().all(|v| *v == 0.0),
                        "{name} head {head} query {i}: {row:?}"
                    );
                } else {
                    assert!(
                        row.iter().any(|v| *v != 0.0),
                        "{name} head {head} query {i}"
                    );
                }
            }
        }
    }
}

/// Runs the generated attention `name` of `case` on random q, k, v with the padding `mask`
/// (`[2, T]`; positions per the key rule), checks it against the interpreter and returns its
/// output.
fn run_attention_case(
    lib: &libloading::Library,
    name: &str,
    case: &AttentionCase,
    rng: &mut rand::rngs::StdRng,
    mask: &[i64],
) -> Vec<f32> {
    let cfg = &case.cfg;
    let (b, h, kvh) = (2usize, cfg.heads as usize, cfg.kv_heads as usize);
    let (s, t, d) = (
        cfg.q_len as usize,
        cfg.kv_len as usize,
        cfg.head_dim as usize,
    );
    let q = values(rng, b * h * s * d, 1.0, 0.0);
    let k = values(rng, b * kvh * t * d, 1.0, 0.0);
    let v = values(rng, b * kvh * t * d, 1.0, 0.0);
    let decode = matches!(cfg.keys, KeyRule::Position { .. });
    let positions: Vec<i64> = (0..b)
        .flat_map(|row| {
            let first = if decode { (t - s - row) as i64 } else { 0 };
            (0..s as i64).map(move |x| first + x)
        })
        .collect();
    let (cos, sin) = rope_tables(10000.0, d, t + 1);
    let mut out = vec![f32::NAN; b * h * s * d];
    let mut args = vec![
        q.as_ptr() as u64,
        k.as_ptr() as u64,
        v.as_ptr() as u64,
        out.as_mut_ptr() as u64,
    ];
    if cfg.padding {
        args.push(mask.as_ptr() as u64);
    }
    if cfg.rope || decode {
        args.push(positions.as_ptr() as u64);
    }
    if cfg.rope {
        args.extend([cos.as_ptr() as u64, sin.as_ptr() as u64]);
    }
    let seed: i64 = rng.random();
    if cfg.dropout.is_some() {
        args.push(&seed as *const i64 as u64);
    }
    // SAFETY: the symbol was generated with the kernel signature.
    let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
    let rows = (b * h * s) as u64;
    // SAFETY: every buffer is sized for the configuration; positions lie inside the tables.
    unsafe {
        f(args.as_ptr(), 0, rows / 3);
        f(args.as_ptr(), rows / 3, rows);
    }
    let mut inputs = vec![
        (vec![b, h, s, d], q),
        (vec![b, kvh, t, d], k),
        (vec![b, kvh, t, d], v),
    ];
    let mut ints = Vec::new();
    let as_f = |x: &[i64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    if cfg.padding {
        ints.push(inputs.len());
        inputs.push((vec![b, t], as_f(mask)));
    }
    if cfg.rope || decode {
        ints.push(inputs.len());
        inputs.push((vec![b, s], as_f(&positions)));
    }
    if cfg.dropout.is_some() {
        ints.push(inputs.len());
        inputs.push((vec![], vec![]));
    }
    let want = reference_with_seed(case.op.clone(), inputs, &ints, Some(seed));
    check(name, Elem::F32, &out, &want);
    out
}

/// One strided case: the graph (inputs `a0`, `a1`, ... then the op under test on views of them),
/// the generated kernel's configuration reading those inputs in place, and the input values.
struct StridedCase {
    what: String,
    graph: kiln_ir::Graph,
    config: strided::StridedConfig,
    inputs: Vec<kiln_ir::Tensor>,
}

/// A graph over inputs of `shapes` (i64 where flagged; floats in `low - 2..low + 2`), with the
/// rest built by `build`.
fn strided_case(
    rng: &mut rand::rngs::StdRng,
    what: &str,
    low: f32,
    shapes: &[(Vec<usize>, bool)],
    config: strided::StridedConfig,
    build: impl FnOnce(&mut kiln_ir::Graph, &[kiln_ir::NodeId]) -> kiln_ir::NodeId,
) -> StridedCase {
    use kiln_ir::{DType, Dim, Graph, Tensor};
    let mut graph = Graph::new();
    let mut ids = Vec::new();
    let mut inputs = Vec::new();
    for (i, (shape, int)) in shapes.iter().enumerate() {
        let dims = shape.iter().map(|&d| Dim::from(d)).collect();
        let n = shape.iter().product();
        let dtype = if *int { DType::I64 } else { DType::F32 };
        ids.push(graph.input(&format!("a{i}"), dtype, dims).unwrap());
        inputs.push(if *int {
            Tensor::i64(
                shape.clone(),
                (0..n).map(|_| rng.random_range(-3..4)).collect(),
            )
        } else {
            Tensor::f32(shape.clone(), values(rng, n, 2.0, low))
        });
    }
    let out = build(&mut graph, &ids);
    graph.set_output("out", out).unwrap();
    StridedCase {
        what: what.to_string(),
        graph,
        config,
        inputs,
    }
}

#[test]
fn strided_ops_match_the_interpreter() {
    use kiln_ir::{BinaryOp, DType, ReduceOp, UnaryOp};
    use strided::{Source, StridedConfig, StridedOp};
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let dir = tempfile::tempdir().unwrap();
    let mem = |offset: i64, strides: &[i64]| Source::Memory {
        int: false,
        offset,
        strides: strides.to_vec(),
    };
    let config = |op, shape: &[u32], sources| StridedConfig {
        op,
        shape: shape.to_vec(),
        sources,
        out_offset: 0,
        out_strides: {
            let mut s = vec![1i64; shape.len()];
            for d in (0..shape.len().saturating_sub(1)).rev() {
                s[d] = s[d + 1] * i64::from(shape[d + 1]);
            }
            s
        },
    };
    let mut cases = Vec::new();
    // Unary ops over a permuted view: [5, 7, 3] read as [3, 5, 7].
    for u in [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Erf,
        UnaryOp::Rsqrt,
    ] {
        let c = config(StridedOp::Unary(u), &[3, 5, 7], vec![mem(0, &[1, 21, 3])]);
        cases.push(strided_case(
            &mut rng,
            &format!("{u:?} of a permuted view"),
            // Rsqrt of positive values only.
            if u == UnaryOp::Rsqrt { 3.0 } else { 0.3 },
            &[(vec![5, 7, 3], false)],
            c,
            |g, x| {
                let p = g.permute(x[0], vec![2, 0, 1]).unwrap();
                g.unary(u, p).unwrap()
            },
        ));
    }
    // Binary ops against a broadcast [5, 1] and against a constant.
    for b in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
    ] {
        let c = config(
            StridedOp::Binary(b),
            &[3, 5, 7],
            vec![mem(0, &[35, 7, 1]), mem(0, &[0, 1, 0])],
        );
        cases.push(strided_case(
            &mut rng,
            &format!("{b:?} with a broadcast operand"),
            0.3,
            &[(vec![3, 5, 7], false), (vec![5, 1], false)],
            c,
            |g, x| g.binary(b, x[0], x[1]).unwrap(),
        ));
        let c = config(
            StridedOp::Binary(b),
            &[4, 9],
            vec![mem(0, &[9, 1]), Source::Constant(1.75)],
        );
        cases.push(strided_case(
            &mut rng,
            &format!("{b:?} with a constant"),
            0.3,
            &[(vec![4, 9], false)],
            c,
            |g, x| {
                let k = g.scalar(1.75, DType::F32);
                g.binary(b, x[0], k).unwrap()
            },
        ));
    }
    // Reductions along every axis of [3, 5, 7].
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
        for axis in 0..3 {
            let mut shape = [3u32, 5, 7];
            let len = shape[axis];
            shape[axis] = 1;
            let c = config(
                StridedOp::Reduce { op, axis, len },
                &shape,
                vec![mem(0, &[35, 7, 1])],
            );
            cases.push(strided_case(
                &mut rng,
                &format!("{op:?} over axis {axis}"),
                0.3,
                &[(vec![3, 5, 7], false)],
                c,
                |g, x| g.reduce(op, x[0], axis as isize).unwrap(),
            ));
        }
    }
    // An i64 slice cast to f32: columns 2..7 of [4, 9].
    let c = config(
        StridedOp::Copy,
        &[4, 5],
        vec![Source::Memory {
            int: true,
            offset: 2,
            strides: vec![9, 1],
        }],
    );
    cases.push(strided_case(
        &mut rng,
        "cast of an i64 slice",
        0.3,
        &[(vec![4, 9], true)],
        c,
        |g, x| {
            let s = g.slice(x[0], 1, 2usize.into(), 7usize.into()).unwrap();
            g.cast(s, DType::F32).unwrap()
        },
    ));
    let lib_cases = cases;
    let mut module = CpuModule::new().unwrap();
    let names: Vec<String> = lib_cases
        .iter()
        .map(|c| strided::strided(&mut module, &c.config).unwrap())
        .collect();
    // A concatenation: two parts copied into their slabs of one [3, 6, 7] output.
    let part = |width: u32, offset: i64| StridedConfig {
        op: StridedOp::Copy,
        shape: vec![3, width, 7],
        sources: vec![mem(0, &[i64::from(width) * 7, 7, 1])],
        out_offset: offset,
        out_strides: vec![42, 7, 1],
    };
    let concat = [part(2, 0), part(4, 14)];
    let concat_names: Vec<String> = concat
        .iter()
        .map(|c| strided::strided(&mut module, c).unwrap())
        .collect();
    let lib = load(module, dir.path());
    let call = |name: &str, args: &[u64], rows: u64| {
        // SAFETY: the symbol was generated with the kernel signature.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        // Rows split unevenly, as an executor's threads would take them.
        let mid = rows / 3;
        // SAFETY: the arguments hold every element the configuration reads and writes.
        unsafe {
            f(args.as_ptr(), 0, mid);
            f(args.as_ptr(), mid, rows);
        }
    };
    for (case, name) in lib_cases.iter().zip(&names) {
        let n: usize = case.config.shape.iter().map(|&d| d as usize).product();
        let mut out = vec![f32::NAN; n];
        let mut args: Vec<u64> = case
            .inputs
            .iter()
            .map(|t| match &t.data {
                kiln_ir::Data::Float(v) => v.as_ptr() as u64,
                kiln_ir::Data::Int(v) => v.as_ptr() as u64,
            })
            .collect();
        args.push(out.as_mut_ptr() as u64);
        call(name, &args, case.config.rows());
        let values: BTreeMap<String, kiln_ir::Tensor> = case
            .inputs
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("a{i}"), t.clone()))
            .collect();
        let weights = BTreeMap::<String, std::sync::Arc<kiln_ir::Tensor>>::new();
        let want = kiln_ir::evaluate(&case.graph, &values, &weights).unwrap();
        check(&case.what, Elem::F32, &out, want["out"].as_f32().unwrap());
    }
    let a = values(&mut rng, 3 * 2 * 7, 1.0, 0.0);
    let b = values(&mut rng, 3 * 4 * 7, 1.0, 0.0);
    let mut out = vec![f32::NAN; 3 * 6 * 7];
    for ((name, src), c) in concat_names.iter().zip([&a, &b]).zip(&concat) {
        call(
            name,
            &[src.as_ptr() as u64, out.as_mut_ptr() as u64],
            c.rows(),
        );
    }
    let want = reference(
        Op::Concat(1),
        vec![(vec![3, 2, 7], a.clone()), (vec![3, 4, 7], b.clone())],
        &[],
    );
    check(
        "concat of two parts",
        Elem::F32,
        &out,
        want.as_f32().unwrap(),
    );
}

/// Token choice: greedy rows pick the first largest logit; sampled rows, for a sweep of uniform
/// words over one row of logits, pick exactly the runtime's token (`generate::choose_with_word`).
#[test]
fn sampling_follows_the_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (17u32, 1.0f32, 0u64, 1.0f32),
        (4097, 0.7, 50, 1.0),
        (4097, 1.3, 0, 0.9),
        (50257, 1.0, 40, 0.95),
        (127, 0.5, 1, 1.0),
        (127, 0.0, 0, 1.0),
    ];
    let mut module = CpuModule::new().unwrap();
    let mut vocabs: Vec<u32> = cases.iter().map(|c| c.0).collect();
    vocabs.sort_unstable();
    vocabs.dedup();
    for v in vocabs {
        sampling::sample(&mut module, v).unwrap();
    }
    let names: Vec<String> = cases.iter().map(|c| sampling::name(c.0)).collect();
    let lib = load(module, dir.path());
    for ((vocab, temperature, top_k, top_p), name) in cases.into_iter().zip(&names) {
        // SAFETY: the symbol was generated with the kernel signature.
        let f: libloading::Symbol<KernelFn> = unsafe { lib.get(name.as_bytes()) }.unwrap();
        let mut row = values(&mut rng, vocab as usize, 6.0, 0.0);
        // A tie for the largest logit: greedy takes the first.
        let top = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) + 1.0;
        row[vocab as usize / 2] = top;
        row[vocab as usize - 1] = top;
        let mut scratch = vec![0u8; sampling::scratch_bytes(vocab) as usize];
        let rows = 256;
        let words: Vec<u32> = (0..rows)
            .map(|i| ((i as f64 + 0.5) / rows as f64 * 4_294_967_296.0) as u32)
            .collect();
        let mut got = Vec::new();
        for word in &words {
            let mut out = -1i64;
            let args = [
                row.as_ptr() as u64,
                &mut out as *mut i64 as u64,
                scratch.as_mut_ptr() as u64,
                u64::from(temperature.to_bits()),
                top_k,
                u64::from(top_p.to_bits()),
                u64::from(*word),
            ];
            // SAFETY: one row of `vocab` logits, one i64 out, the scratch the row needs.
            unsafe { f(args.as_ptr(), 0, 1) };
            got.push(out);
        }
        let what = format!("{name} T={temperature} k={top_k} p={top_p}");
        if temperature == 0.0 {
            assert!(
                got.iter().all(|&t| t == i64::from(vocab / 2)),
                "{what}: greedy picks the first largest logit"
            );
            println!("ok  {what}: greedy");
            continue;
        }
        // The runtime's definition, bit for bit.
        let mode = kiln_runtime::generate::Sampling {
            temperature,
            top_k: top_k as usize,
            top_p,
            seed: 0,
        };
        let want: Vec<i64> = words
            .iter()
            .map(|w| kiln_runtime::generate::choose_with_word(&row, &mode, *w) as i64)
            .collect();
        assert_eq!(got, want, "{what}");
        println!("ok  {what}: {rows}/{rows} exact");
    }
}
