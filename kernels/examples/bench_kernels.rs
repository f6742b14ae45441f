//! Times kiln's generated kernels on the GPU (a benchmark, not a test): LayerNorm / RMSNorm bf16
//! [16384, 4096] against the copy bandwidth, and the bf16 GEMM 4096^3 against its FLOPs. Prints one
//! JSON object per line; run `shared/gpu/peers.py` in the same script for the peers.
//!
//! `cargo run --release -p kiln-kernels --example bench_kernels`
//!
//! With `--emit DIR` it times nothing and writes the benchmark cases (`cases.json`: each kernel,
//! its launch and the tensors it takes, and the peer that does the same work; one PTX module per
//! kernel) for `scripts/bench-kernels.py`, which runs them and their PyTorch peers in one process;
//! `--emit DIR --gemm MxNxK,..` writes only those plain products, in every tiling.

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kiln_ir::kernel::{Activation, NormKind};
use kiln_kernels::attention::{attention, AttentionConfig, KeyRule};
use kiln_kernels::attention_wgmma::{attention_wgmma_shaped, scratch, stream_scratch, Shape};
use kiln_kernels::gemm::{gemm, gemm_base, GemmConfig};
use kiln_kernels::gemm_wgmma::{
    fits, gemm_wgmma_tiled, split_scratch, splits_fit, tiling, Tiling, TILINGS,
};
use kiln_kernels::norm::{norm, norm_with, NormConfig, RowThreads};
use kiln_kernels::{Elem, GeneratedKernel, ParamType};
use kiln_runtime::cuda::{encode_tensor_map, TensorMap};

/// The median of 20 launches of `run` (after 3 warm-ups), each timed with CUDA events around it
/// on `stream`, as the PyTorch peers are timed.
fn time_ms(stream: &CudaStream, mut run: impl FnMut()) -> f64 {
    for _ in 0..3 {
        run();
    }
    stream.synchronize().unwrap();
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::new();
    for _ in 0..20 {
        let start = stream.record_event(timing).unwrap();
        run();
        let end = stream.record_event(timing).unwrap();
        end.synchronize().unwrap();
        times.push(f64::from(start.elapsed_ms(&end).unwrap()));
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn launch(
    stream: &std::sync::Arc<CudaStream>,
    ctx: &std::sync::Arc<CudaContext>,
    k: &GeneratedKernel,
    bufs: &[&CudaSlice<u16>],
) -> impl FnMut() {
    let module = ctx.load_module(Ptx::from_src(k.module())).unwrap();
    let f = module.load_function(&k.name).unwrap();
    if k.launch.shared_bytes > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            k.launch.shared_bytes as i32,
        )
        .unwrap();
    }
    let l = k.launch;
    let cfg = LaunchConfig {
        grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
        block_dim: (l.block[0], l.block[1], l.block[2]),
        shared_mem_bytes: l.shared_bytes,
    };
    let bufs: Vec<CudaSlice<u16>> = bufs.iter().map(|b| (*b).clone()).collect();
    // Tensor maps over the buffers bound to them, in parameter order (encoded once, as at load).
    let maps: Vec<Option<TensorMap>> = k
        .signature
        .iter()
        .zip(&bufs)
        .map(|((_, ty), b)| match ty {
            ParamType::TensorMap(spec) => {
                Some(encode_tensor_map(spec, b.device_ptr(stream).0).unwrap())
            }
            _ => None,
        })
        .collect();
    let stream = stream.clone();
    move || {
        let mut b = stream.launch_builder(&f);
        for (buf, map) in bufs.iter().zip(&maps) {
            match map {
                Some(m) => b.arg(m),
                None => b.arg(buf),
            };
        }
        // SAFETY: the buffers are sized for the kernel's shapes and passed in signature order.
        unsafe { b.launch(cfg) }.unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, dir, rest @ ..] = &args[..] {
        let usage = "usage: bench_kernels [--emit DIR [--gemm MxNxK[,MxNxK..]]]";
        assert_eq!(flag, "--emit", "{usage}");
        let only = match rest {
            [] => Vec::new(),
            [gemm, shapes] if gemm == "--gemm" => shapes.split(',').map(product_shape).collect(),
            _ => panic!("{usage}"),
        };
        emit_cases(std::path::Path::new(dir), &only);
        return;
    }
    // SAFETY: only probes whether libcuda can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("no GPU driver: nothing to time");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let random = |n: usize, seed: u64| -> Vec<u16> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                half::bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits()
            })
            .collect()
    };

    let (rows, cols) = (16384u32, 4096u32);
    let n = (rows * cols) as usize;
    let x = stream.clone_htod(&random(n, 1)).unwrap();
    let w = stream.clone_htod(&random(cols as usize, 2)).unwrap();
    let b = stream.clone_htod(&random(cols as usize, 3)).unwrap();
    let out = stream.clone_htod(&vec![0u16; n]).unwrap();
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        let k = norm(&NormConfig {
            kind,
            residual: false,
            elem: Elem::BF16,
            rows,
            cols,
            eps: 1e-5,
        });
        let bufs: Vec<&CudaSlice<u16>> = if kind == NormKind::LayerNorm {
            vec![&x, &w, &b, &out]
        } else {
            vec![&x, &w, &out]
        };
        let ms = time_ms(&stream, launch(&stream, &ctx, &k, &bufs));
        let bytes = 2.0 * n as f64 * 2.0;
        println!(
            "{{\"kernel\": \"{}\", \"rows\": {rows}, \"cols\": {cols}, \"ms\": {ms:.4}, \"TBps\": {:.3}}}",
            k.name,
            bytes / ms / 1e9
        );
    }

    gemms(&stream, &ctx, &random);

    // Attention bf16, head dim 128, seq 4096, causal, 16 heads, batch 4 (the point).
    let (b, h, sq, d) = (4u32, 16u32, 4096u32, 128u32);
    let mut cfg = AttentionConfig::plain([b, h, h, sq, sq, d], Elem::BF16);
    cfg.scale = 1.0 / (d as f32).sqrt();
    cfg.keys = KeyRule::Causal { window: None };
    let n = (b * h * sq * d) as usize;
    let (q, kk, v) = (
        stream.clone_htod(&random(n, 6)).unwrap(),
        stream.clone_htod(&random(n, 7)).unwrap(),
        stream.clone_htod(&random(n, 8)).unwrap(),
    );
    let o = stream.clone_htod(&vec![0u16; n]).unwrap();
    let k = attention(&cfg);
    let ms = time_ms(&stream, launch(&stream, &ctx, &k, &[&q, &kk, &v, &o]));
    let flops = 4.0 * f64::from(b * h) * f64::from(sq).powi(2) * f64::from(d) / 2.0;
    println!(
        "{{\"kernel\": \"{}\", \"b\": {b}, \"h\": {h}, \"s\": {sq}, \"d\": {d}, \"causal\": true, \"ms\": {ms:.3}, \"TFLOPs\": {:.2}}}",
        k.name,
        flops / ms / 1e9
    );

    // Llama-3.2-1B-shaped prefill attention (32 heads, 8 KV heads, d 64, 4096 tokens, batch 1):
    // the plain causal kernel, then with the padding mask, RoPE on q and k, and both (the
    // compiled model's form), and a prompt chunk of 512 rows over a 4096-entry cache.
    attention_variants(&stream, &ctx, &random);
    swiglu_gemms(&stream, &ctx, &random);

    // Decode attention over a 4096-entry bf16 KV cache (Llama-3-8B shape: 32 heads, 8 KV heads,
    // d 128, batch 1), one launch without splits, and 32 fixed key ranges plus the combine.
    let (heads, kv_heads, t, d) = (32u32, 8u32, 4096u32, 128u32);
    let q = stream.clone_htod(&random((heads * d) as usize, 9)).unwrap();
    let kc = stream
        .clone_htod(&random((kv_heads * t * d) as usize, 10))
        .unwrap();
    let vc = stream
        .clone_htod(&random((kv_heads * t * d) as usize, 11))
        .unwrap();
    let o = stream
        .clone_htod(&vec![0u16; (heads * d) as usize])
        .unwrap();
    // positions: one i64 (t - 1), passed as four u16 words.
    let last = (t - 1) as u64;
    let pos: Vec<u16> = (0..4).map(|w| (last >> (16 * w)) as u16).collect();
    let positions = stream.clone_htod(&pos).unwrap();
    let cache_bytes = 2.0 * f64::from(kv_heads * t * d) * 2.0;
    for splits in [1u32, 32] {
        let mut cfg = AttentionConfig {
            batch: 1,
            heads,
            kv_heads,
            q_len: 1,
            kv_len: t,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            keys: KeyRule::Position { window: None },
            padding: false,
            rope: false,
            rope_k: false,
            dropout: None,
            elem: Elem::BF16,
            strides: [[0; 3]; 4],
            splits,
            paging: None,
        };
        cfg.strides = cfg.contiguous_strides();
        let ms = if splits == 1 {
            let k = attention(&cfg);
            time_ms(
                &stream,
                launch(&stream, &ctx, &k, &[&q, &kc, &vc, &o, &positions]),
            )
        } else {
            let rows = (heads * splits) as usize;
            let pacc = stream
                .clone_htod(&vec![0u16; rows * d as usize * 2])
                .unwrap();
            let pml = stream.clone_htod(&vec![0u16; rows * 4]).unwrap();
            let mut part = launch(
                &stream,
                &ctx,
                &attention(&cfg),
                &[&q, &kc, &vc, &pacc, &pml, &positions],
            );
            let combine = kiln_kernels::attention::attention_combine(&cfg);
            let mut comb = launch(&stream, &ctx, &combine, &[&pacc, &pml, &o]);
            time_ms(&stream, || {
                part();
                comb();
            })
        };
        println!(
            "{{\"kernel\": \"decode_attention_bf16\", \"heads\": {heads}, \"kv_heads\": {kv_heads}, \"context\": {t}, \"splits\": {splits}, \"ms\": {ms:.4}, \"cache_TBps\": {:.3}}}",
            cache_bytes / ms / 1e9
        );
    }
}

/// u16 words holding `values` as little-endian i64s (the bench passes every buffer as u16).
fn i64_words(values: impl Iterator<Item = i64>) -> Vec<u16> {
    values
        .flat_map(|v| (0..4).map(move |w| (v >> (16 * w)) as u16))
        .collect()
}

/// u16 words holding `values` as f32s.
fn f32_words(values: impl Iterator<Item = f32>) -> Vec<u16> {
    values
        .flat_map(|v| {
            let b = v.to_bits();
            [b as u16, (b >> 16) as u16]
        })
        .collect()
}

fn attention_variants(
    stream: &std::sync::Arc<CudaStream>,
    ctx: &std::sync::Arc<CudaContext>,
    random: &dyn Fn(usize, u64) -> Vec<u16>,
) {
    let (h, kvh) = (32u32, 8u32);
    let causal = KeyRule::Causal { window: None };
    for (d, q_len, kv_len, keys, padding, rope) in [
        (64u32, 4096u32, 4096u32, causal, false, false),
        (64, 4096, 4096, causal, true, false),
        (64, 4096, 4096, causal, false, true),
        (64, 4096, 4096, causal, true, true),
        (
            64,
            512,
            4096,
            KeyRule::Position { window: None },
            false,
            true,
        ),
        // Llama-3.1-8B-shaped heads (d 128).
        (128, 4096, 4096, causal, true, false),
        (128, 4096, 4096, causal, true, true),
    ] {
        let cached = matches!(keys, KeyRule::Position { .. });
        let mut cfg = AttentionConfig {
            batch: 1,
            heads: h,
            kv_heads: kvh,
            q_len,
            kv_len,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            keys,
            padding,
            rope,
            rope_k: rope && !cached,
            dropout: None,
            elem: Elem::BF16,
            strides: [[0; 3]; 4],
            splits: 1,
            paging: None,
        };
        cfg.strides = cfg.contiguous_strides();
        let q = stream
            .clone_htod(&random((h * q_len * d) as usize, 21))
            .unwrap();
        let kk = stream
            .clone_htod(&random((kvh * kv_len * d) as usize, 22))
            .unwrap();
        let v = stream
            .clone_htod(&random((kvh * kv_len * d) as usize, 23))
            .unwrap();
        let o = stream
            .clone_htod(&vec![0u16; (h * q_len * d) as usize])
            .unwrap();
        let mask = stream
            .clone_htod(&i64_words((0..kv_len).map(|_| 1)))
            .unwrap();
        // Prefill rows sit at their index; a chunk's rows at the end of the cache.
        let first = if cached { i64::from(kv_len - q_len) } else { 0 };
        let pos = stream
            .clone_htod(&i64_words((0..i64::from(q_len)).map(|i| first + i)))
            .unwrap();
        let angles = (kv_len * d / 2) as usize;
        let cos = stream
            .clone_htod(&f32_words((0..angles).map(|i| (i as f32 * 0.01).cos())))
            .unwrap();
        let sin = stream
            .clone_htod(&f32_words((0..angles).map(|i| (i as f32 * 0.01).sin())))
            .unwrap();
        let mut bufs = vec![&q, &kk, &v, &o];
        if padding {
            bufs.push(&mask);
        }
        if rope || cached {
            bufs.push(&pos);
        }
        if rope {
            bufs.extend([&cos, &sin]);
        }
        let k = attention(&cfg);
        let ms = time_ms(stream, launch(stream, ctx, &k, &bufs));
        // Visible (query, key) pairs: the causal triangle, or each chunk row's prefix of the cache.
        let pairs = if cached {
            (0..q_len)
                .map(|i| f64::from(kv_len - q_len + i + 1))
                .sum::<f64>()
        } else {
            f64::from(q_len) * f64::from(q_len + 1) / 2.0
        };
        let flops = 4.0 * f64::from(h) * pairs * f64::from(d);
        println!(
            "{{\"kernel\": \"{}\", \"ms\": {ms:.4}, \"TFLOPs\": {:.2}}}",
            k.name,
            flops / ms / 1e9
        );
    }
}

fn swiglu_gemms(
    stream: &std::sync::Arc<CudaStream>,
    ctx: &std::sync::Arc<CudaContext>,
    random: &dyn Fn(usize, u64) -> Vec<u16>,
) {
    // Llama-3.2-1B's gate/up product at 4096 tokens, with and without the SwiGLU epilogue.
    let (m, n, kd) = (4096u32, 16384u32, 2048u32);
    let x = stream.clone_htod(&random((m * kd) as usize, 31)).unwrap();
    let w = stream.clone_htod(&random((n * kd) as usize, 32)).unwrap();
    let out = stream.clone_htod(&vec![0u16; (m * n) as usize]).unwrap();
    for swiglu in [false, true] {
        let k = gemm(&GemmConfig {
            m,
            k: kd,
            n,
            transpose_b: true,
            bias: false,
            activation: None,
            swiglu,
            residual: false,
            elem: Elem::BF16,
            row_norm: None,
        });
        let ms = time_ms(stream, launch(stream, ctx, &k, &[&x, &w, &out]));
        println!(
            "{{\"kernel\": \"{}\", \"ms\": {ms:.4}, \"TFLOPs\": {:.2}}}",
            k.name,
            2.0 * f64::from(m) * f64::from(n) * f64::from(kd) / ms / 1e9
        );
    }
}

/// bf16 GEMMs `[M, K] x [N, K]^T`: 4096^3 and 8192^3 plain, 4096^3 with bias + GELU(tanh), each on
/// the kernel lowering picks (wgmma on sm_90a) and on its base-image fallback (mma.sync).
fn gemms(
    stream: &std::sync::Arc<CudaStream>,
    ctx: &std::sync::Arc<CudaContext>,
    random: &dyn Fn(usize, u64) -> Vec<u16>,
) {
    for (s, bias, activation) in [
        (4096u32, false, None),
        (8192, false, None),
        (4096, true, Some(Activation::GeluTanh)),
    ] {
        let n = (s as usize) * (s as usize);
        let a = stream.clone_htod(&random(n, 4)).unwrap();
        let w = stream.clone_htod(&random(n, 5)).unwrap();
        let b = stream.clone_htod(&random(s as usize, 6)).unwrap();
        let c = stream.clone_htod(&vec![0u16; n]).unwrap();
        let cfg = GemmConfig {
            m: s,
            k: s,
            n: s,
            transpose_b: true,
            bias,
            activation,
            swiglu: false,
            residual: false,
            elem: Elem::BF16,
            row_norm: None,
        };
        for k in [gemm(&cfg), gemm_base(&cfg)] {
            let bufs: Vec<&CudaSlice<u16>> = if bias {
                vec![&a, &w, &b, &c]
            } else {
                vec![&a, &w, &c]
            };
            let ms = time_ms(stream, launch(stream, ctx, &k, &bufs));
            println!(
                "{{\"kernel\": \"{}\", \"path\": \"{}\", \"m\": {s}, \"n\": {s}, \"k\": {s}, \"ms\": {ms:.4}, \"TFLOPs\": {:.2}}}",
                k.name,
                k.path.name(),
                2.0 * f64::from(s).powi(3) / ms / 1e9
            );
        }
    }
}

/// One tensor a benchmark case binds: shape, dtype name, and the scale of its uniform values.
type Buffer = (Vec<usize>, &'static str, f64);

/// Writes the cases `scripts/bench-kernels.py` runs against PyTorch (`cases.json` and each
/// kernel's module): with `only`, those products in every tiling; else the square GEMMs, the
/// models' products, norms and attention ([`square_gemm_cases`] to [`window_attention_cases`]).
fn emit_cases(dir: &std::path::Path, only: &[(usize, usize, usize)]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut cases = Cases {
        dir,
        cases: Vec::new(),
    };
    if !only.is_empty() {
        let shapes: Vec<_> = only.iter().map(|&(m, n, k)| (m, n, k, "")).collect();
        product_cases(&mut cases, &shapes);
        return finish(dir, &cases.cases);
    }
    square_gemm_cases(&mut cases);
    product_cases(&mut cases, MODEL_PRODUCTS);
    norm_cases(&mut cases);
    attention_cases(&mut cases);
    model_attention_cases(&mut cases);
    window_attention_cases(&mut cases);
    finish(dir, &cases.cases);
}

/// The cases written so far, each kernel's module already in `dir`.
struct Cases<'d> {
    dir: &'d std::path::Path,
    cases: Vec<serde_json::Value>,
}

impl Cases<'_> {
    /// A case: its kernel, the tensors it takes, its u32 parameters, its peer and its FLOPs.
    fn add(
        &mut self,
        case: String,
        kernel: GeneratedKernel,
        buffers: Vec<(&str, Buffer)>,
        scalars: &[(&str, u32)],
        peer: serde_json::Value,
        flops: f64,
    ) {
        let module = format!("{}.ptx", kernel.name);
        std::fs::write(self.dir.join(&module), kernel.module()).unwrap();
        let buffers: serde_json::Map<String, serde_json::Value> = buffers
            .into_iter()
            .map(|(n, b)| (n.to_string(), serde_json::json!(b)))
            .collect();
        let scalars: serde_json::Map<String, serde_json::Value> = scalars
            .iter()
            .map(|&(n, v)| (n.to_string(), serde_json::json!(v)))
            .collect();
        self.cases.push(serde_json::json!({
            "case": case, "kernel": kernel, "module": module, "buffers": buffers,
            "scalars": scalars, "peer": peer, "flops": flops,
        }));
    }
}

/// bf16 GEMMs of 4096^3 and 8192^3, and 4096^3 with bias + GELU(tanh), as lowering picks them.
fn square_gemm_cases(cases: &mut Cases) {
    let squares = [(4096usize, false), (8192, false), (4096, true)];
    for (s, bias_gelu) in squares {
        let cfg = GemmConfig {
            bias: bias_gelu,
            activation: bias_gelu.then_some(Activation::GeluTanh),
            ..GemmConfig::plain(s as u32, s as u32, s as u32, Elem::BF16)
        };
        let mut buffers = vec![
            ("x", (vec![s, s], "bf16", 1.0)),
            ("w", (vec![s, s], "bf16", 1.0 / (s as f64).sqrt())),
            ("out", (vec![s, s], "bf16", 0.0)),
        ];
        if bias_gelu {
            buffers.push(("bias", (vec![s], "bf16", 0.5)));
        }
        let epilogue = if bias_gelu { "bias_gelu" } else { "none" };
        let peer = serde_json::json!({"kind": "matmul", "epilogue": epilogue});
        let name = format!(
            "gemm bf16 {s}^3{}",
            if bias_gelu { " bias+gelu" } else { "" }
        );
        cases.add(
            name,
            gemm(&cfg),
            buffers,
            &[],
            peer,
            2.0 * (s as f64).powi(3),
        );
    }
}

/// Products of the models' prefills (GPT-2 small at 16 and 1024 tokens, Llama-3.2-1B at 512
/// (a server's prompt chunks), 1024 and 4096, Llama-3.1-8B's QKV at 1024, BERT-base at 128 x
/// 128), of Llama-3.2-1B's decode step at 64 sequences, and the square ones in every tiling of
/// the Hopper kernel (and the split one it picks, and the GEMV where lowering takes it),
/// BERT's with their epilogues too: the one picked should be the fastest.
const MODEL_PRODUCTS: &[(usize, usize, usize, &str)] = &[
    (64, 2048, 8192, ""),
    (64, 2048, 2048, ""),
    (64, 3072, 2048, ""),
    (64, 16384, 2048, "swiglu"),
    (32, 2048, 8192, ""),
    (32, 2048, 2048, ""),
    (16, 2048, 8192, ""),
    (1024, 2048, 8192, ""),
    (1024, 3072, 2048, ""),
    (1024, 2048, 2048, ""),
    (1024, 768, 3072, ""),
    (1024, 768, 768, ""),
    (1024, 2304, 768, ""),
    (1024, 16384, 2048, "swiglu"),
    (1024, 128256, 2048, ""),
    (1024, 6144, 4096, ""),
    (16, 3072, 768, ""),
    (512, 2048, 8192, ""),
    (512, 3072, 2048, ""),
    (512, 2048, 2048, ""),
    (512, 16384, 2048, "swiglu"),
    (4096, 3072, 2048, ""),
    (4096, 2048, 2048, ""),
    (4096, 16384, 2048, "swiglu"),
    (4096, 128256, 2048, ""),
    (4096, 4096, 4096, ""),
    (8192, 8192, 8192, ""),
    // BERT-base at 128 x 128 tokens: QKV, O, FFN up, FFN down.
    (16384, 2304, 768, ""),
    (16384, 768, 768, ""),
    (16384, 3072, 768, ""),
    (16384, 768, 3072, ""),
    (16384, 2304, 768, "bias"),
    (16384, 768, 768, "bias_residual"),
    (16384, 3072, 768, "bias_gelu_erf"),
    (16384, 768, 3072, "bias_residual"),
];

/// Each product `(m, n, k, epilogue)` of `shapes` (epilogue `""`, `bias`, `bias_residual`,
/// `bias_gelu_erf` or `swiglu`) in every Hopper tiling that fits it ([`tilings_of`]), and as
/// lowering's other path where it picks one.
fn product_cases(cases: &mut Cases, shapes: &[(usize, usize, usize, &str)]) {
    for &(m, n, k, epilogue) in shapes {
        let swiglu = epilogue == "swiglu";
        let cfg = GemmConfig {
            bias: !epilogue.is_empty() && !swiglu,
            swiglu,
            residual: epilogue == "bias_residual",
            activation: (epilogue == "bias_gelu_erf").then_some(Activation::GeluErf),
            ..GemmConfig::plain(m as u32, n as u32, k as u32, Elem::BF16)
        };
        let chosen = tiling(&cfg);
        let tilings = tilings_of(&cfg, chosen);
        let lowered = gemm(&cfg);
        for t in tilings.into_iter().map(Some).chain([None]) {
            let mut buffers = vec![
                ("x", (vec![m, k], "bf16", 1.0)),
                ("w", (vec![n, k], "bf16", 1.0 / (k as f64).sqrt())),
            ];
            if cfg.bias {
                buffers.push(("bias", (vec![n], "bf16", 0.5)));
            }
            if cfg.residual {
                buffers.push(("residual", (vec![m, n], "bf16", 1.0)));
            }
            buffers.push(("out", (vec![m, cfg.n_out() as usize], "bf16", 0.0)));
            let (partials, counters) = t.map_or((0, 0), |t| split_scratch(&cfg, t));
            if partials > 0 {
                buffers.push(("partials", (vec![partials as usize / 4], "f32", 0.0)));
                buffers.push(("counters", (vec![counters as usize / 4], "i32", 0.0)));
            }
            // A bias alone is cuBLAS's own epilogue: the peer is then F.linear's.
            let peer = serde_json::json!({"kind": "matmul", "epilogue": epilogue});
            let picked = lowered.path == kiln_kernels::KernelPath::Wgmma;
            let (label, mark) = match t {
                Some(t) => (
                    t.label(),
                    if picked && t == chosen {
                        " (picked)"
                    } else {
                        ""
                    },
                ),
                None if !picked => (lowered.path.name().to_string(), " (picked)"),
                None => continue,
            };
            let plus = if epilogue.is_empty() {
                String::new()
            } else {
                format!(" {epilogue}")
            };
            let name = format!("gemm bf16 {m}x{n}x{k}{plus} {label}{mark}");
            let tag = if epilogue.is_empty() {
                String::new()
            } else {
                format!("_{epilogue}")
            };
            let kernel_name = format!("gemm_{m}x{n}x{k}{tag}_{label}");
            let kernel = match t {
                Some(t) => gemm_wgmma_tiled(&cfg, t, kernel_name),
                None => lowered.clone(),
            };
            cases.add(name, kernel, buffers, &[], peer, 2.0 * (m * n * k) as f64);
        }
    }
}

/// The Hopper tilings a product is timed in: every one that fits it, K split in parts in
/// several for products of few row tiles, and `chosen` (what lowering picks) when it splits.
fn tilings_of(cfg: &GemmConfig, chosen: Tiling) -> Vec<Tiling> {
    let mut tilings: Vec<Tiling> = TILINGS
        .iter()
        .map(|&(t, _)| t)
        .filter(|&t| fits(cfg, t))
        .collect();
    // Products of few row tiles (a decode step's, a server prompt chunk's of 512 rows): K
    // split in parts, in several tilings.
    let splits = [
        (64, 2),
        (64, 3),
        (64, 4),
        (64, 5),
        (64, 7),
        (64, 8),
        (128, 2),
        (128, 3),
        (128, 4),
        (128, 8),
        (128, 16),
    ];
    for (width, parts) in splits.into_iter().filter(|_| cfg.m <= 512) {
        let t = Tiling::together(width).split(parts);
        if splits_fit(cfg, t) && t != chosen {
            tilings.push(t);
        }
    }
    if chosen.splits > 1 {
        tilings.push(chosen);
    }
    tilings
}

/// The models' norms (BERT-base's LayerNorm at 128 x 128 tokens, GPT-2's at 1024,
/// Llama-3.2-1B's RMSNorm at 4096 tokens and in its prefill's chunks of 1024, an 8B-class
/// RMSNorm), a warp or a block to a row.
fn norm_cases(cases: &mut Cases) {
    for (kind, rows, cols) in [
        (NormKind::LayerNorm, 16384usize, 768usize),
        (NormKind::LayerNorm, 1024, 768),
        (NormKind::RmsNorm, 4096, 2048),
        (NormKind::RmsNorm, 1024, 2048),
        (NormKind::LayerNorm, 4096, 2048),
        (NormKind::RmsNorm, 4096, 4096),
    ] {
        let cfg = NormConfig {
            kind,
            residual: false,
            elem: Elem::BF16,
            rows: rows as u32,
            cols: cols as u32,
            eps: 1e-5,
        };
        let chosen = RowThreads::of(&cfg);
        let forms = if chosen == RowThreads::Warp {
            vec![RowThreads::Warp, RowThreads::Block]
        } else {
            vec![RowThreads::Block]
        };
        for threads in forms {
            let layer = kind == NormKind::LayerNorm;
            let mut buffers = vec![
                ("x", (vec![rows, cols], "bf16", 1.0)),
                ("weight", (vec![cols], "bf16", 1.0)),
            ];
            if layer {
                buffers.push(("bias", (vec![cols], "bf16", 0.5)));
            }
            buffers.push(("out", (vec![rows, cols], "bf16", 0.0)));
            let peer = serde_json::json!({"kind": if layer { "layer_norm" } else { "rms_norm" }, "eps": 1e-5});
            let mark = if threads == chosen { " (picked)" } else { "" };
            let form = format!("{threads:?}").to_lowercase();
            let what = if layer { "layer_norm" } else { "rms_norm" };
            let name = format!("{what} bf16 {rows}x{cols} {form}{mark}");
            // Forms and row counts share modules by name: the text depends on neither's rows.
            let scalars = [("rows", rows as u32)];
            cases.add(name, norm_with(&cfg, threads), buffers, &scalars, peer, 0.0);
        }
    }
}

/// Attention bf16 at head dims 128 and 64 over 4096 tokens (batch 4, 16 heads), causal or not,
/// and with dropout 0.1 at 128, as lowering picks it.
fn attention_cases(cases: &mut Cases) {
    for (d, causal, dropout) in [
        (128u32, true, None),
        (128, false, None),
        (64, true, None),
        (64, false, None),
        (128, false, Some(0.1f64)),
    ] {
        let (b, h, sq) = (4u32, 16u32, 4096u32);
        let mut cfg = AttentionConfig::plain([b, h, h, sq, sq, d], Elem::BF16);
        cfg.scale = 1.0 / (d as f32).sqrt();
        if causal {
            cfg.keys = KeyRule::Causal { window: None };
        }
        cfg.dropout = dropout.map(|p| kiln_kernels::attention::Dropout::new(p, 0));
        let shape = vec![b as usize, h as usize, sq as usize, d as usize];
        let mut buffers: Vec<(&str, Buffer)> = ["q", "k", "v"]
            .into_iter()
            .map(|n| (n, (shape.clone(), "bf16", 1.0)))
            .collect();
        buffers.push(("out", (shape, "bf16", 0.0)));
        if dropout.is_some() {
            buffers.push(("seed", (vec![1], "i64", 0.0)));
        }
        stream_buffers(&mut buffers, scratch(&cfg));
        let peer = serde_json::json!({
            "kind": "sdpa", "causal": causal, "dropout": dropout.unwrap_or(0.0),
            "scale": cfg.scale,
        });
        let flops = attention_flops([b, h, sq, d], causal);
        let name = format!(
            "attention bf16 d{d} s{sq}{}{}",
            if causal { " causal" } else { "" },
            if dropout.is_some() {
                " dropout 0.1"
            } else {
                ""
            }
        );
        cases.add(name, attention(&cfg), buffers, &[], peer, flops);
    }
}

/// Attention of the models' prefills in every shape that fits (consumers, Q buffers, K and V
/// stages, one item a block, a persistent or a stream grid):
/// BERT-base at 128 x 128 tokens (all keys), GPT-2 at 1024 tokens and Llama-3.2-1B at 4096
/// (causal, GQA 4:1); the benchmark shapes above (4 x 16 heads, 4096 tokens, dropout
/// 0.1 at head dim 128), whose blocks of 32 key tiles start and finish 2048 items on 132 SMs;
/// BERT-base at 32 x 512 tokens (1536 items of four key tiles); and 2048 items of 8 and 16
/// key tiles at head dim 128, between the persistent grid's items and the stream grid's.
fn model_attention_cases(cases: &mut Cases) {
    for (b, h, kv, s, d, causal, dropout) in [
        (128u32, 12u32, 12u32, 128u32, 64u32, false, false),
        (1, 12, 12, 1024, 64, true, false),
        (1, 32, 8, 4096, 64, true, false),
        (4, 16, 16, 4096, 128, false, false),
        (4, 16, 16, 4096, 128, true, false),
        (4, 16, 16, 4096, 64, false, false),
        (4, 16, 16, 4096, 128, false, true),
        (32, 12, 12, 512, 64, false, false),
        (16, 16, 16, 1024, 128, false, false),
        (8, 16, 16, 2048, 128, false, false),
    ] {
        let mut cfg = AttentionConfig::plain([b, h, kv, s, s, d], Elem::BF16);
        cfg.scale = 1.0 / (d as f32).sqrt();
        if causal {
            cfg.keys = KeyRule::Causal { window: None };
        }
        let p = if dropout { 0.1 } else { 0.0 };
        cfg.dropout = dropout.then(|| kiln_kernels::attention::Dropout::new(p, 0));
        let picked = Shape::of(&cfg);
        for shape in Shape::space(&cfg) {
            let mut buffers = attention_buffers([b, h, kv, s, d]);
            if dropout {
                buffers.push(("seed", (vec![1], "i64", 0.0)));
            }
            stream_buffers(&mut buffers, stream_scratch(&cfg, shape));
            let peer = serde_json::json!({
                "kind": "sdpa", "causal": causal, "dropout": p, "scale": cfg.scale,
                "gqa": h != kv,
            });
            let flops = attention_flops([b, h, s, d], causal);
            let form = shape.to_string();
            let mark = if shape == picked { " (picked)" } else { "" };
            let rule = match (causal, dropout) {
                (true, _) => " causal",
                (false, true) => " dropout 0.1",
                (false, false) => "",
            };
            let name = format!("attention bf16 b{b} h{h}/{kv} s{s} d{d}{rule} {form}{mark}");
            let kernel_name = format!(
                "attention_b{b}_h{h}_{kv}_s{s}_d{d}{}_{}",
                rule.replace([' ', '.'], "_"),
                form.replace(' ', "_")
            );
            let kernel = attention_wgmma_shaped(&cfg, shape, kernel_name);
            cases.add(name, kernel, buffers, &[], peer, flops);
        }
    }
}

/// Mistral-7B's sliding window (4096 keys) over 8192 tokens (32 / 8 heads, d 128): the
/// Hopper kernel, and the mma kernel it replaces there; the peers take the window as a mask.
fn window_attention_cases(cases: &mut Cases) {
    let (h, kv, s, d, w) = (32u32, 8u32, 8192u32, 128u32, 4096u32);
    let mut cfg = AttentionConfig::plain([1, h, kv, s, s, d], Elem::BF16);
    cfg.scale = 1.0 / (d as f32).sqrt();
    cfg.keys = KeyRule::Causal { window: Some(w) };
    // Row i sees min(i + 1, w) keys.
    let seen: f64 = (0..s).map(|i| f64::from((i + 1).min(w))).sum();
    let flops = 4.0 * f64::from(h) * f64::from(d) * seen;
    for (form, kernel) in [
        ("wgmma (picked)", attention(&cfg)),
        ("mma", kiln_kernels::attention::attention_base(&cfg)),
    ] {
        let buffers = attention_buffers([1, h, kv, s, d]);
        let peer = serde_json::json!({
            "kind": "sdpa", "causal": true, "dropout": 0.0, "scale": cfg.scale,
            "gqa": true, "window": w,
        });
        let name = format!("attention bf16 h{h}/{kv} s{s} d{d} causal window {w} {form}");
        cases.add(name, kernel, buffers, &[], peer, flops);
    }
}

/// A stream grid's scratch (`partials`, `counters` zero before the launch), if any.
fn stream_buffers(buffers: &mut Vec<(&'static str, Buffer)>, (partials, counters): (u64, u64)) {
    if partials > 0 {
        buffers.push(("partials", (vec![partials as usize / 4], "f32", 0.0)));
        buffers.push(("counters", (vec![counters as usize / 4], "i32", 0.0)));
    }
}

/// The FLOPs of attention over `b` sequences of `s` tokens, `h` heads of `d`: two products of
/// every query with every key it sees (half of them, causal).
fn attention_flops([b, h, s, d]: [u32; 4], causal: bool) -> f64 {
    4.0 * f64::from(b * h) * f64::from(s).powi(2) * f64::from(d) / if causal { 2.0 } else { 1.0 }
}

/// The bf16 tensors of an attention over `b` sequences of `s` tokens, `h` query and `kv` K/V
/// heads of `d`: q, k, v and the output.
fn attention_buffers([b, h, kv, s, d]: [u32; 5]) -> Vec<(&'static str, Buffer)> {
    let shape = |heads: u32| [b, heads, s, d].map(|x| x as usize).to_vec();
    vec![
        ("q", (shape(h), "bf16", 1.0)),
        ("k", (shape(kv), "bf16", 1.0)),
        ("v", (shape(kv), "bf16", 1.0)),
        ("out", (shape(h), "bf16", 0.0)),
    ]
}

/// `MxNxK` as numbers.
fn product_shape(text: &str) -> (usize, usize, usize) {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| d.parse().unwrap_or_else(|_| panic!("{text}: not MxNxK")))
        .collect();
    match dims[..] {
        [m, n, k] => (m, n, k),
        _ => panic!("{text}: not MxNxK"),
    }
}

/// Writes `cases.json`.
fn finish(dir: &std::path::Path, cases: &[serde_json::Value]) {
    let text = serde_json::to_string_pretty(cases).unwrap();
    std::fs::write(dir.join("cases.json"), text).unwrap();
    println!("{} cases in {}", cases.len(), dir.display());
}
