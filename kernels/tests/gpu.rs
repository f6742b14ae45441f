//! GPU correctness suite: every kernel kind, launched on the device, against the reference
//! interpreter on fresh random inputs at several shapes (lengths 1, 17, 127 and 4097 among them),
//! with the output poisoned (NaN) before each launch. Skips, saying why, when no GPU is present.
//!
//! Tolerances are the fixtures README's: max |a - b| / max |ref| below 1e-4 for f32, 2e-2 for
//! f16 / bf16 (whose inputs are rounded to that type before the reference sees them).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kiln_ir::kernel::{Activation, EmbeddingSpec, GemmSpec, NormKind, NormSpec};
use kiln_ir::Op;
use kiln_kernels::elementwise::activation_kernel;
use kiln_kernels::embedding::{embedding, EmbeddingConfig};
use kiln_kernels::gemm::{gemm, gemm_base, gemm_for, GemmConfig};
use kiln_kernels::gemm_wgmma::{
    gemm_wgmma, other_tilings, split_scratch, split_tilings, MAX_SPLITS, TILINGS,
};
use kiln_kernels::gemv::Rows;
use kiln_kernels::norm::{norm, NormConfig};
use kiln_kernels::sampling::argmax;
use kiln_kernels::{Elem, GeneratedKernel, Image, KernelPath, ParamType};
use kiln_runtime::cuda::{encode_tensor_map, TensorMap};

use rand::{Rng as _, SeedableRng};

use common::{
    bits_differ, cache_write_reference, check, dropout_mask_reference, dropout_probe,
    mask_mismatches, reference, reference_with_seed, rope_tables, scaled_rope_tables, PagedCache,
};

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

fn gpu() -> Option<Gpu> {
    // SAFETY: only probes whether libcuda can be opened; no driver call is made without it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("SKIPPED: libcuda is not present (no GPU driver on this machine)");
        return None;
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => {}
        other => {
            println!("SKIPPED: no CUDA device ({other:?})");
            return None;
        }
    }
    let ctx = CudaContext::new(0).expect("a context on device 0");
    let stream = ctx.default_stream();
    Some(Gpu { ctx, stream })
}

type Rng = rand::rngs::StdRng;

/// `n` uniform values in `[-scale, scale)`, rounded to `elem`.
fn values(rng: &mut Rng, n: usize, scale: f32, elem: Elem) -> Vec<f32> {
    (0..n)
        .map(|_| round(elem, scale * rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// The interpreter's `op` on `inputs`, rounded to `elem` as a kernel's output is.
fn rounded_reference(op: Op, inputs: Vec<(Vec<usize>, Vec<f32>)>, elem: Elem) -> Vec<f32> {
    reference(op, inputs, &[])
        .as_f32()
        .unwrap()
        .iter()
        .map(|v| round(elem, *v))
        .collect()
}

fn round(elem: Elem, v: f32) -> f32 {
    match elem {
        Elem::F32 => v,
        Elem::F16 => half::f16::from_f32(v).to_f32(),
        Elem::BF16 => half::bf16::from_f32(v).to_f32(),
    }
}

enum Buf {
    F32(CudaSlice<f32>),
    U16(CudaSlice<u16>),
    I64(CudaSlice<i64>),
}

enum Arg<'a> {
    Buf(&'a Buf),
    U32(u32),
}

impl Gpu {
    fn upload(&self, elem: Elem, values: &[f32]) -> Buf {
        match elem {
            Elem::F32 => Buf::F32(self.stream.clone_htod(values).unwrap()),
            Elem::F16 => Buf::U16(
                self.stream
                    .clone_htod(
                        &values
                            .iter()
                            .map(|v| half::f16::from_f32(*v).to_bits())
                            .collect::<Vec<_>>(),
                    )
                    .unwrap(),
            ),
            Elem::BF16 => Buf::U16(
                self.stream
                    .clone_htod(
                        &values
                            .iter()
                            .map(|v| half::bf16::from_f32(*v).to_bits())
                            .collect::<Vec<_>>(),
                    )
                    .unwrap(),
            ),
        }
    }

    fn upload_i64(&self, values: &[i64]) -> Buf {
        Buf::I64(self.stream.clone_htod(values).unwrap())
    }

    /// u32 words (a block table), carried as the bits of an f32 buffer.
    fn upload_u32(&self, values: &[u32]) -> Buf {
        let bits: Vec<f32> = values.iter().map(|v| f32::from_bits(*v)).collect();
        Buf::F32(self.stream.clone_htod(&bits).unwrap())
    }

    /// An output buffer filled with NaN (or -1 for integers), so unwritten elements show.
    fn poisoned(&self, elem: Elem, n: usize) -> Buf {
        self.upload(elem, &vec![f32::NAN; n])
    }

    fn download(&self, elem: Elem, buf: &Buf) -> Vec<f32> {
        self.stream.synchronize().unwrap();
        match buf {
            Buf::F32(b) => self.stream.clone_dtoh(b).unwrap(),
            Buf::U16(b) => self
                .stream
                .clone_dtoh(b)
                .unwrap()
                .into_iter()
                .map(|bits| match elem {
                    Elem::F16 => half::f16::from_bits(bits).to_f32(),
                    _ => half::bf16::from_bits(bits).to_f32(),
                })
                .collect(),
            Buf::I64(_) => panic!("not a float buffer"),
        }
    }

    fn download_i64(&self, buf: &Buf) -> Vec<i64> {
        self.stream.synchronize().unwrap();
        match buf {
            Buf::I64(b) => self.stream.clone_dtoh(b).unwrap(),
            _ => panic!("not an i64 buffer"),
        }
    }

    /// The device address of `buf`.
    fn address(&self, buf: &Buf) -> u64 {
        match buf {
            Buf::F32(b) => b.device_ptr(&self.stream).0,
            Buf::U16(b) => b.device_ptr(&self.stream).0,
            Buf::I64(b) => b.device_ptr(&self.stream).0,
        }
    }

    /// Loads the kernel's module and launches it with `args` bound by parameter name.
    fn launch(&self, kernel: &GeneratedKernel, args: &BTreeMap<&str, Arg>) {
        let module = self
            .ctx
            .load_module(Ptx::from_src(kernel.module()))
            .unwrap();
        let f = module.load_function(&kernel.name).unwrap();
        // Static and dynamic shared memory share the default 48 KB: grant every request.
        if kernel.launch.shared_bytes > 0 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernel.launch.shared_bytes as i32,
            )
            .unwrap();
        }
        // Tensor maps are encoded over the buffers bound to them, as the runtime does at load.
        let maps: Vec<Option<TensorMap>> = kernel
            .signature
            .iter()
            .map(|(name, ty)| match (args.get(name.as_str()), ty) {
                (Some(Arg::Buf(b)), ParamType::TensorMap(spec)) => {
                    Some(encode_tensor_map(spec, self.address(b)).unwrap())
                }
                _ => None,
            })
            .collect();
        let mut builder = self.stream.launch_builder(&f);
        for ((name, ty), map) in kernel.signature.iter().zip(&maps) {
            let arg = args
                .get(name.as_str())
                .unwrap_or_else(|| panic!("no argument `{name}`"));
            match (arg, ty, map) {
                (_, ParamType::TensorMap(_), Some(m)) => builder.arg(m),
                (Arg::Buf(Buf::F32(b)), ParamType::Ptr, _) => builder.arg(b),
                (Arg::Buf(Buf::U16(b)), ParamType::Ptr, _) => builder.arg(b),
                (Arg::Buf(Buf::I64(b)), ParamType::Ptr, _) => builder.arg(b),
                (Arg::U32(v), ParamType::U32, _) => builder.arg(v),
                _ => panic!("argument `{name}` does not match {ty:?}"),
            };
        }
        let l = kernel.launch;
        let cfg = LaunchConfig {
            grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
            block_dim: (l.block[0], l.block[1], l.block[2]),
            shared_mem_bytes: l.shared_bytes,
        };
        // SAFETY: the arguments follow the kernel's signature (checked above, by name and kind),
        // and every buffer is sized for the launch's shapes by the caller.
        unsafe { builder.launch(cfg) }.unwrap();
        self.stream.synchronize().unwrap();
    }
}

const ELEMS: [Elem; 3] = [Elem::F32, Elem::F16, Elem::BF16];

#[test]
fn norms_match_the_interpreter() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x1234_5678_9abc_def1);
    for elem in ELEMS {
        for (kind, residual) in [
            (NormKind::LayerNorm, false),
            (NormKind::RmsNorm, false),
            (NormKind::LayerNorm, true),
            (NormKind::RmsNorm, true),
        ] {
            // A warp per row (64 to 2048 columns of 16-bit values; 127 and 9 rows leave
            // warps of the last block without a row; 1032 leaves lanes without a last chunk),
            // a block per row (odd, and longer rows), rows read again per statistic (8193).
            for (rows, cols) in [
                (1u32, 64u32),
                (17, 4097),
                (127, 768),
                (9, 1032),
                (5, 2048),
                (2, 8193),
            ] {
                let n = (rows * cols) as usize;
                let eps = 1e-5f32;
                // An offset mean, so that a one-pass variance would show its cancellation.
                let x: Vec<f32> = values(&mut rng, n, 2.0, elem)
                    .iter()
                    .map(|v| round(elem, v + 3.0))
                    .collect();
                let r = values(&mut rng, n, 1.0, elem);
                let w = values(&mut rng, cols as usize, 1.5, elem);
                let b = values(&mut rng, cols as usize, 0.5, elem);
                let cfg = NormConfig {
                    kind,
                    residual,
                    elem,
                    rows,
                    cols,
                    eps,
                };
                let kernel = norm(&cfg);
                let (bx, br, bw, bb) = (
                    gpu.upload(elem, &x),
                    gpu.upload(elem, &r),
                    gpu.upload(elem, &w),
                    gpu.upload(elem, &b),
                );
                let out = gpu.poisoned(elem, n);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bx)),
                    ("residual", Arg::Buf(&br)),
                    ("weight", Arg::Buf(&bw)),
                    ("bias", Arg::Buf(&bb)),
                    ("out", Arg::Buf(&out)),
                    ("rows", Arg::U32(rows)),
                ]);
                gpu.launch(&kernel, &args);
                let shape = vec![rows as usize, cols as usize];
                let mut inputs = vec![(shape.clone(), x)];
                if residual {
                    inputs.push((shape.clone(), r));
                }
                inputs.push((vec![cols as usize], w));
                if kind == NormKind::LayerNorm {
                    inputs.push((vec![cols as usize], b));
                }
                let spec = NormSpec {
                    kind,
                    eps: f64::from(eps),
                    residual,
                };
                let want = rounded_reference(Op::Norm(spec), inputs, elem);
                check(
                    &format!("{} {rows}x{cols}", kernel.name),
                    elem,
                    &gpu.download(elem, &out),
                    &want,
                );
            }
        }
    }
}

#[test]
fn activations_match_the_interpreter() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0bad_cafe_1234_5678);
    for elem in ELEMS {
        for act in [
            Activation::GeluTanh,
            Activation::GeluErf,
            Activation::Silu,
            Activation::Relu,
        ] {
            for n in [1u32, 17, 127, 4097, 300_001] {
                // The metric is relative to the largest reference value; a lone element far in
                // GELU's negative tail (|value| ~ 1e-7, where the f32 oracle itself has no
                // relative precision left) would make it meaningless, so n = 1 draws from [-2, 2].
                let scale = if n == 1 { 2.0 } else { 6.0 };
                let x = values(&mut rng, n as usize, scale, elem);
                let kernel = activation_kernel(act, elem, n);
                let bx = gpu.upload(elem, &x);
                let out = gpu.poisoned(elem, n as usize);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bx)),
                    ("out", Arg::Buf(&out)),
                    ("n", Arg::U32(n)),
                ]);
                gpu.launch(&kernel, &args);
                let want: Vec<f32> =
                    reference(Op::Activation(act), vec![(vec![n as usize], x)], &[])
                        .as_f32()
                        .unwrap()
                        .iter()
                        .map(|v| round(elem, *v))
                        .collect();
                check(
                    &format!("{} n={n}", kernel.name),
                    elem,
                    &gpu.download(elem, &out),
                    &want,
                );
            }
        }
    }
}

#[test]
fn embeddings_match_the_interpreter() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5151_7777_2222_9999);
    for elem in ELEMS {
        for (tokens, hidden) in [(1u32, 64u32), (17, 768), (3, 4096), (127, 4097)] {
            let rows = [512u32, 127];
            let tables: Vec<Vec<f32>> = rows
                .iter()
                .map(|r| values(&mut rng, (r * hidden) as usize, 1.0, elem))
                .collect();
            let ids: Vec<Vec<i64>> = rows
                .iter()
                .map(|r| {
                    (0..tokens)
                        .map(|_| (rng.random::<u64>() % u64::from(*r)) as i64)
                        .collect()
                })
                .collect();
            let cfg = EmbeddingConfig {
                table_rows: rows.to_vec(),
                hidden,
                tokens,
                elem,
            };
            let kernel = embedding(&cfg);
            let (t0, t1) = (gpu.upload(elem, &tables[0]), gpu.upload(elem, &tables[1]));
            let (i0, i1) = (gpu.upload_i64(&ids[0]), gpu.upload_i64(&ids[1]));
            let out = gpu.poisoned(elem, (tokens * hidden) as usize);
            let args = BTreeMap::from([
                ("table_0", Arg::Buf(&t0)),
                ("ids_0", Arg::Buf(&i0)),
                ("table_1", Arg::Buf(&t1)),
                ("ids_1", Arg::Buf(&i1)),
                ("out", Arg::Buf(&out)),
            ]);
            gpu.launch(&kernel, &args);
            let inputs = vec![
                (vec![rows[0] as usize, hidden as usize], tables[0].clone()),
                (
                    vec![tokens as usize],
                    ids[0].iter().map(|v| *v as f32).collect(),
                ),
                (vec![rows[1] as usize, hidden as usize], tables[1].clone()),
                (
                    vec![tokens as usize],
                    ids[1].iter().map(|v| *v as f32).collect(),
                ),
            ];
            let want: Vec<f32> =
                reference(Op::Embedding(EmbeddingSpec { tables: 2 }), inputs, &[1, 3])
                    .as_f32()
                    .unwrap()
                    .iter()
                    .map(|v| round(elem, *v))
                    .collect();
            check(
                &format!("{} tokens={tokens}", kernel.name),
                elem,
                &gpu.download(elem, &out),
                &want,
            );
        }
    }
}

#[test]
fn argmax_picks_the_first_largest() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x7777_1111_3333_5555);
    for elem in ELEMS {
        // Single elements (rows not 16-byte aligned) and 16-byte chunks (Llama's 128256).
        for (rows, vocab) in [
            (1u32, 1u32),
            (3, 17),
            (4, 4097),
            (2, 50257),
            (3, 128256),
            (8, 4104),
        ] {
            let mut logits = values(&mut rng, (rows * vocab) as usize, 8.0, elem);
            if rows == 3 {
                // A NaN ahead of the largest value, and a row of -inf (index 0 for both rules).
                let v = vocab as usize;
                logits[0] = f32::NAN;
                logits[v..2 * v].fill(f32::NEG_INFINITY);
            }
            // The runtime's token choice at temperature 0, which generation on the CPU uses.
            let greedy = kiln_runtime::generate::Sampling::greedy();
            let want: Vec<i64> = logits
                .chunks(vocab as usize)
                .map(|row| kiln_runtime::generate::choose(row, &greedy, 0) as i64)
                .collect();
            let bl = gpu.upload(elem, &logits);
            for advance in [false, true] {
                let kernel = argmax(elem, rows, vocab, advance);
                let out = gpu.upload_i64(&vec![-1; rows as usize]);
                // Every other row masked: it keeps its id and position.
                let n = rows as i64;
                let ids = gpu.upload_i64(&(0..n).map(|r| 1000 + r).collect::<Vec<_>>());
                let positions = gpu.upload_i64(&(0..n).map(|r| 7 * r).collect::<Vec<_>>());
                let mask =
                    gpu.upload_i64(&(0..n).map(|r| i64::from(r % 2 == 0)).collect::<Vec<_>>());
                let mut args = BTreeMap::from([("logits", Arg::Buf(&bl)), ("out", Arg::Buf(&out))]);
                if advance {
                    args.insert("ids", Arg::Buf(&ids));
                    args.insert("positions", Arg::Buf(&positions));
                    args.insert("mask", Arg::Buf(&mask));
                }
                gpu.launch(&kernel, &args);
                assert_eq!(gpu.download_i64(&out), want, "{} rows={rows}", kernel.name);
                if advance {
                    let live = |r: usize| r.is_multiple_of(2);
                    let next_ids: Vec<i64> = (0..rows as usize)
                        .map(|r| if live(r) { want[r] } else { 1000 + r as i64 })
                        .collect();
                    let next_positions: Vec<i64> = (0..rows as usize)
                        .map(|r| 7 * r as i64 + i64::from(live(r)))
                        .collect();
                    assert_eq!(
                        gpu.download_i64(&ids),
                        next_ids,
                        "{}: next ids",
                        kernel.name
                    );
                    assert_eq!(
                        gpu.download_i64(&positions),
                        next_positions,
                        "{}: next positions",
                        kernel.name
                    );
                }
                println!("ok  {} rows={rows} vocab={vocab}", kernel.name);
            }
        }
    }
}

/// A one-row LM head that folds the greedy choice into a key per row as it stores its logits
/// (`gemv_choosing`), read back by `choose_from_keys`, picks what the runtime's choice at
/// temperature 0 picks over the logits it stored (the first largest; NaN never wins; a row with
/// nothing above -inf picks 0; -0 and +0 tie), and leaves its logits as the plain product does
/// and its keys at 0, over launches one after another.
#[test]
fn products_choose_the_first_largest_logit() {
    use kiln_kernels::gemv::gemv_choosing;
    use kiln_kernels::sampling::choose_from_keys;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0c40_05e5_1a57_0001);
    let greedy = kiln_runtime::generate::Sampling::greedy();
    for elem in ELEMS {
        for (m, k, n) in [
            (1u32, 768u32, 50257u32),
            (1, 2048, 128256),
            (1, 64, 17),
            (3, 100, 1001),
        ] {
            if m > 1 && elem != Elem::F32 && k % 8 == 0 {
                continue;
            }
            let cfg = GemmConfig::plain(m, n, k, elem);
            // Random logits, then logits set through a one-hot x (each output is its weight
            // row's first element): ties for the largest, NaN, -inf, signed zeros.
            let nu = n as usize;
            let mut cases: Vec<(String, Vec<f32>, Vec<f32>)> = vec![(
                "random".into(),
                values(&mut rng, (m * k) as usize, 1.0, elem),
                values(&mut rng, (n * k) as usize, 1.0 / (k as f32).sqrt(), elem),
            )];
            let mut one_hot = vec![0.0f32; (m * k) as usize];
            for r in 0..m as usize {
                one_hot[r * k as usize] = 1.0;
            }
            let firsts = |f: &dyn Fn(usize) -> f32| -> Vec<f32> {
                let mut w = vec![0.0f32; (n * k) as usize];
                for c in 0..nu {
                    w[c * k as usize] = f(c);
                }
                w
            };
            let last = nu - 1;
            cases.push((
                "tie, NaN first".into(),
                one_hot.clone(),
                firsts(&|c| match c {
                    0 => f32::NAN,
                    c if c == nu / 3 || c == last => 4.0,
                    c => -((c % 7) as f32),
                }),
            ));
            cases.push((
                "all -inf".into(),
                one_hot.clone(),
                firsts(&|_| f32::NEG_INFINITY),
            ));
            cases.push(("all NaN".into(), one_hot.clone(), firsts(&|_| f32::NAN)));
            cases.push((
                "signed zeros".into(),
                one_hot.clone(),
                firsts(&|c| match c {
                    c if c == nu / 2 => -0.0,
                    c if c == last => 0.0,
                    _ => -1.0,
                }),
            ));
            let plain = gemm_for(&cfg, Rows::Fastest);
            let kernel = gemv_choosing(&cfg);
            let chooser = choose_from_keys(m, false);
            let best = gpu.upload_i64(&vec![0; m as usize]);
            for (what, x, w) in &cases {
                let (bx, bw) = (gpu.upload(elem, x), gpu.upload(elem, w));
                let want_logits = gpu.poisoned(elem, (m * n) as usize);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bx)),
                    ("w", Arg::Buf(&bw)),
                    ("out", Arg::Buf(&want_logits)),
                ]);
                gpu.launch(&plain, &args);
                let want_logits = gpu.download(elem, &want_logits);
                let want: Vec<i64> = want_logits
                    .chunks(nu)
                    .map(|row| kiln_runtime::generate::choose(row, &greedy, 0) as i64)
                    .collect();
                let logits = gpu.poisoned(elem, (m * n) as usize);
                let tokens = gpu.upload_i64(&vec![-1; m as usize]);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bx)),
                    ("w", Arg::Buf(&bw)),
                    ("out", Arg::Buf(&logits)),
                    ("best", Arg::Buf(&best)),
                ]);
                gpu.launch(&kernel, &args);
                let args = BTreeMap::from([("best", Arg::Buf(&best)), ("out", Arg::Buf(&tokens))]);
                gpu.launch(&chooser, &args);
                let got = gpu.download(elem, &logits);
                let same = got
                    .iter()
                    .zip(&want_logits)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{} {what}: logits differ from the plain product's",
                    kernel.name
                );
                assert_eq!(gpu.download_i64(&tokens), want, "{} {what}", kernel.name);
                assert_eq!(
                    gpu.download_i64(&best),
                    vec![0; m as usize],
                    "{} {what}: keys",
                    kernel.name
                );
                println!("ok  {} {what}: {want:?}", kernel.name);
            }
        }
    }
}

#[test]
fn gemms_match_the_interpreter() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x2468_ace0_1357_9bdf);
    let variants: [(bool, bool, Option<Activation>, bool, bool); 6] = [
        (true, false, None, false, false),
        (false, true, Some(Activation::GeluTanh), false, false),
        (true, true, None, false, true),
        (true, false, None, true, false),
        (true, true, None, true, true),
        (false, true, Some(Activation::GeluErf), false, true),
    ];
    for elem in ELEMS {
        for (transpose_b, bias, activation, swiglu, residual) in variants {
            for (m, k, n) in [
                (1u32, 64u32, 96u32),
                (3, 127, 130),
                (8, 768, 258),
                // A long K: the GEMV's unrolled chunks, then its remainder (f16/bf16 too).
                (2, 2056, 66),
                // One-column-per-warp GEMV rows long enough to be split over 2 to 8 warps, a
                // column of the last block outside the product, and rows too ragged for 16-byte
                // loads.
                (1, 8200, 35),
                (3, 4104, 66),
                (1, 4097, 34),
                // Tensor-core GEMV: several passes of its K steps, a partial last step, 7 of
                // the product's 8 rows, a partial block of columns.
                (7, 4104, 34),
                (17, 127, 130),
                // The tensor-core GEMV in row groups (batched decode of 9 to 16 sequences, and
                // products of up to 16 rows with few columns), and products of 33 and 64 rows
                // on the Hopper kernel with K split.
                (16, 2056, 66),
                (9, 776, 258),
                (13, 4104, 130),
                (33, 776, 258),
                (64, 4104, 130),
                (127, 768, 258),
                (4097, 64, 64),
                // Hopper tiles (128 rows, 256 / 128 / 64 weight rows, consumers together or taking
                // turns, K steps of 64) with ragged edges on every side, and an odd N (GPT-2's
                // vocabulary is odd).
                (300, 776, 1000),
                (520, 264, 520),
                (130, 96, 1001),
                // Staged epilogues with SwiGLU too (520 output columns: rows of 16-byte
                // multiples, a last 64-column box 8 columns wide), ragged M and K.
                (200, 520, 1040),
            ] {
                if swiglu && n % 2 == 1 {
                    continue;
                }
                let cfg = GemmConfig {
                    m,
                    k,
                    n,
                    transpose_b,
                    bias,
                    activation,
                    swiglu,
                    residual,
                    elem,
                    row_norm: None,
                };
                // The kernel lowering picks, the base-image kernel its launches fall back to, the
                // Hopper kernel's other tilings, and the one a batched artifact picks (the
                // tensor-core GEMV for one row too).
                let mut kernels = vec![gemm(&cfg)];
                if kernels[0].image == Image::Sm90a {
                    kernels.push(gemm_base(&cfg));
                    kernels.extend(other_tilings(&cfg, &kernels[0].name));
                    kernels.extend(split_tilings(&cfg, &kernels[0].name));
                }
                let invariant = gemm_for(&cfg, Rows::BatchInvariant);
                if invariant.name != kernels[0].name {
                    kernels.push(invariant);
                }
                check_gemm(&gpu, &mut rng, &cfg, &kernels);
            }
        }
    }
}

/// Runs each of `kernels` (products of `cfg`) on random operands and checks them against the
/// interpreter's `Gemm`.
fn check_gemm(gpu: &Gpu, rng: &mut Rng, cfg: &GemmConfig, kernels: &[GeneratedKernel]) {
    let (m, n, k, elem) = (cfg.m, cfg.n, cfg.k, cfg.elem);
    let n_out = cfg.n_out();
    let x = values(rng, (m * k) as usize, 1.0, elem);
    let w = values(rng, (k * n) as usize, 1.0 / (k as f32).sqrt(), elem);
    let b = values(rng, n as usize, 0.5, elem);
    let r = values(rng, (m * n_out) as usize, 1.0, elem);
    let (bx, bw, bb, br) = (
        gpu.upload(elem, &x),
        gpu.upload(elem, &w),
        gpu.upload(elem, &b),
        gpu.upload(elem, &r),
    );
    let w_shape = if cfg.transpose_b {
        vec![n as usize, k as usize]
    } else {
        vec![k as usize, n as usize]
    };
    let mut inputs = vec![(vec![m as usize, k as usize], x), (w_shape, w)];
    if cfg.bias {
        inputs.push((vec![n as usize], b));
    }
    if cfg.residual {
        inputs.push((vec![m as usize, n_out as usize], r));
    }
    let spec = GemmSpec {
        transpose_b: cfg.transpose_b,
        bias: cfg.bias,
        activation: cfg.activation,
        swiglu: cfg.swiglu,
        residual: cfg.residual,
        prologue: None,
    };
    let want = rounded_reference(Op::Gemm(spec), inputs, elem);
    // The scratch of kernels splitting K: partial sums (as many as any tiling takes) and
    // counters, zero before the first launch.
    let (partial_bytes, counter_bytes) = TILINGS
        .iter()
        .flat_map(|&(t, _)| (1..=MAX_SPLITS).map(move |s| split_scratch(cfg, t.split(s))))
        .fold((4, 4), |(p, c), (tp, tc)| (p.max(tp), c.max(tc)));
    let partials = gpu.upload(Elem::F32, &vec![f32::NAN; partial_bytes as usize / 4]);
    let counters = gpu.upload_u32(&vec![0; counter_bytes as usize / 4]);
    for kernel in kernels {
        let out = gpu.poisoned(elem, (m * n_out) as usize);
        let args = BTreeMap::from([
            ("x", Arg::Buf(&bx)),
            ("w", Arg::Buf(&bw)),
            ("bias", Arg::Buf(&bb)),
            ("residual", Arg::Buf(&br)),
            ("out", Arg::Buf(&out)),
            ("partials", Arg::Buf(&partials)),
            ("counters", Arg::Buf(&counters)),
        ]);
        gpu.launch(kernel, &args);
        let got = gpu.download(elem, &out);
        let what = format!("{} {m}x{n}x{k}", kernel.name);
        check(&what, elem, &got, &want);
        if !kernel.scratch.is_empty() {
            // The parts' sums are added in part order, whichever part finishes last, and the
            // counters are left zero: a second launch gives the same bits.
            let counts = gpu.download(Elem::F32, &counters);
            assert!(
                counts.iter().all(|c| c.to_bits() == 0),
                "{what}: counters left"
            );
            gpu.launch(kernel, &args);
            let again = gpu.download(elem, &out);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&again), "{what}: a second launch differs");
        }
    }
}

/// The Hopper kernel's tilings over products of several tiles per block of the persistent grid
/// (132 blocks): consumers taking turns hand tiles to each other many times, stages go round
/// many times per tile, blocks take several parts of split tiles (some of the same tile), staged
/// epilogues wait for their region's previous stores many times (output rows of 16-byte
/// multiples: 3904 columns, 1104 with SwiGLU); and a decode step's down product of 64 rows (K
/// split in 8 parts of 16 steps).
#[test]
fn hopper_tiles_go_round_the_persistent_grid() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5eed_7113);
    // With an activation too: staged tiles of bias, GELU(erf) and residual, several a block.
    for (m, n, k, swiglu, activation) in [
        (1100u32, 3900u32, 264u32, false, None),
        (1100, 2200, 1000, true, None),
        (1100, 3904, 264, false, None),
        (1100, 2208, 1000, true, None),
        (64, 2048, 8192, false, None),
        (1100, 3904, 264, false, Some(Activation::GeluErf)),
    ] {
        let cfg = GemmConfig {
            bias: true,
            activation,
            swiglu,
            residual: true,
            ..GemmConfig::plain(m, n, k, Elem::BF16)
        };
        let chosen = gemm(&cfg);
        let mut kernels = other_tilings(&cfg, &chosen.name);
        kernels.extend(split_tilings(&cfg, &chosen.name));
        if chosen.path != KernelPath::Wgmma {
            // The Hopper kernel in the tiling it picks (the GEMV takes this product today).
            kernels.push(gemm_wgmma(&cfg, format!("{}_wgmma", chosen.name)));
        }
        kernels.push(chosen);
        check_gemm(&gpu, &mut rng, &cfg, &kernels);
    }
}

/// Decode products that normalise x themselves (RMSNorm, or LayerNorm with its bias, in the
/// tensor-core GEMV's prologue; RMSNorms of odd row counts with a weight of ones, which the
/// prologue leaves out) against the interpreter's `Gemm` with that norm prologue: rows 1 to 8,
/// K from 64 to 4104 (x in shared memory past 48 KB), epilogues on top.
#[test]
fn gemv_norm_prologues_match_the_interpreter() {
    use kiln_kernels::gemv::{gemv_normed, takes_prologue};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0dd5_eed5_9e3d_1234);
    for elem in [Elem::F16, Elem::BF16] {
        for kind in [NormKind::RmsNorm, NormKind::LayerNorm] {
            for (m, k, n, bias, swiglu, residual) in [
                (1u32, 2048u32, 48u32, false, false, false),
                (8, 776, 34, true, true, true),
                (5, 4104, 64, false, false, true),
                (8, 4096, 40, false, true, false),
                (3, 64, 17, true, false, false),
                // Row groups (batch-invariant decode of 9 to 16 sequences).
                (16, 2056, 66, true, false, true),
                (11, 776, 34, false, true, false),
                (13, 4104, 48, false, false, true),
            ] {
                let cfg = GemmConfig {
                    m,
                    k,
                    n,
                    transpose_b: true,
                    bias,
                    activation: None,
                    swiglu,
                    residual,
                    elem,
                    row_norm: None,
                };
                let norm_cfg = NormConfig {
                    kind,
                    residual: false,
                    elem,
                    rows: m,
                    cols: k,
                    eps: 1e-5,
                };
                assert!(
                    takes_prologue(&cfg, &norm_cfg, Rows::BatchInvariant),
                    "{cfg:?}"
                );
                let n_out = cfg.n_out();
                // A mean away from 0 and a spread away from 1, so both statistics matter.
                let x: Vec<f32> = values(&mut rng, (m * k) as usize, 3.0, elem)
                    .iter()
                    .map(|v| round(elem, v + 0.75))
                    .collect();
                let w = values(&mut rng, (k * n) as usize, 1.0 / (k as f32).sqrt(), elem);
                let b = values(&mut rng, n as usize, 0.5, elem);
                let r = values(&mut rng, (m * n_out) as usize, 1.0, elem);
                // Some RMSNorms of a weight of ones, which the prologue leaves out (the
                // compiler moved it into the product's).
                let weighted = kind == NormKind::LayerNorm || m % 2 == 0;
                let mut gamma = values(&mut rng, k as usize, 1.0, elem);
                if !weighted {
                    gamma.fill(1.0);
                }
                let beta = values(&mut rng, k as usize, 0.5, elem);
                let mut inputs = vec![
                    (vec![m as usize, k as usize], x.clone()),
                    (vec![n as usize, k as usize], w.clone()),
                ];
                if bias {
                    inputs.push((vec![n as usize], b.clone()));
                }
                if residual {
                    inputs.push((vec![m as usize, n_out as usize], r.clone()));
                }
                inputs.push((vec![k as usize], gamma.clone()));
                if kind == NormKind::LayerNorm {
                    inputs.push((vec![k as usize], beta.clone()));
                }
                let spec = GemmSpec {
                    transpose_b: true,
                    bias,
                    activation: None,
                    swiglu,
                    residual,
                    prologue: Some(NormSpec {
                        kind,
                        eps: 1e-5,
                        residual: false,
                    }),
                };
                let want = rounded_reference(Op::Gemm(spec), inputs, elem);
                let kernel = gemv_normed(&(cfg, norm_cfg, weighted));
                let bufs: Vec<_> = [&x, &w, &b, &r, &gamma, &beta]
                    .iter()
                    .map(|v| gpu.upload(elem, v))
                    .collect();
                let out = gpu.poisoned(elem, (m * n_out) as usize);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bufs[0])),
                    ("w", Arg::Buf(&bufs[1])),
                    ("bias", Arg::Buf(&bufs[2])),
                    ("residual", Arg::Buf(&bufs[3])),
                    ("norm_weight", Arg::Buf(&bufs[4])),
                    ("norm_bias", Arg::Buf(&bufs[5])),
                    ("out", Arg::Buf(&out)),
                ]);
                gpu.launch(&kernel, &args);
                check(
                    &format!("{} {m}x{n}x{k}", kernel.name),
                    elem,
                    &gpu.download(elem, &out),
                    &want,
                );
            }
        }
    }
}

/// One-row decode products with x's RMSNorm folded in (`gemv_folded`: the norm's weight is in
/// the product's, x's squares summed beside the products, 1/rms applied to the sums) against the
/// interpreter's `Gemm` with that norm prologue, of a weight of ones: K from 770 (element loads)
/// to 8192 (several warps per column), epilogues on top; the choosing form also picks what the
/// runtime picks over the logits it stored, and leaves its key at 0.
#[test]
fn one_row_products_fold_their_rms_norm() {
    use kiln_kernels::gemv::{folds_norm, gemv_folded};
    use kiln_kernels::sampling::choose_from_keys;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5ca1_ed0f_f01d_0002);
    let greedy = kiln_runtime::generate::Sampling::greedy();
    for elem in [Elem::F16, Elem::BF16] {
        for (k, n, bias, swiglu, residual, choose) in [
            (2048u32, 3072u32, false, false, false, false),
            (2048, 1026, true, true, true, false),
            (8192, 64, false, true, false, false),
            (770, 34, true, false, true, false),
            (2048, 32003, false, false, false, true),
            (776, 1001, false, false, false, true),
        ] {
            let cfg = GemmConfig {
                m: 1,
                k,
                n,
                transpose_b: true,
                bias,
                activation: None,
                swiglu,
                residual,
                elem,
                row_norm: None,
            };
            let norm_cfg = NormConfig {
                kind: NormKind::RmsNorm,
                residual: false,
                elem,
                rows: 1,
                cols: k,
                eps: 1e-5,
            };
            assert!(folds_norm(&cfg, &norm_cfg, Rows::Fastest), "{cfg:?}");
            let n_out = cfg.n_out();
            // A spread away from 1, so that the scale matters.
            let x = values(&mut rng, k as usize, 3.0, elem);
            let w = values(&mut rng, (k * n) as usize, 1.0 / (k as f32).sqrt(), elem);
            let b = values(&mut rng, n as usize, 0.5, elem);
            let r = values(&mut rng, n_out as usize, 1.0, elem);
            let gamma = vec![1.0; k as usize];
            let mut inputs = vec![
                (vec![1, k as usize], x.clone()),
                (vec![n as usize, k as usize], w.clone()),
            ];
            if bias {
                inputs.push((vec![n as usize], b.clone()));
            }
            if residual {
                inputs.push((vec![1, n_out as usize], r.clone()));
            }
            inputs.push((vec![k as usize], gamma.clone()));
            let spec = GemmSpec {
                transpose_b: true,
                bias,
                activation: None,
                swiglu,
                residual,
                prologue: Some(NormSpec {
                    kind: NormKind::RmsNorm,
                    eps: 1e-5,
                    residual: false,
                }),
            };
            let want = rounded_reference(Op::Gemm(spec), inputs, elem);
            let kernel = gemv_folded(&(cfg, norm_cfg, choose));
            let bufs: Vec<_> = [&x, &w, &b, &r]
                .iter()
                .map(|v| gpu.upload(elem, v))
                .collect();
            let out = gpu.poisoned(elem, n_out as usize);
            let best = gpu.upload_i64(&[0]);
            let args = BTreeMap::from([
                ("x", Arg::Buf(&bufs[0])),
                ("w", Arg::Buf(&bufs[1])),
                ("bias", Arg::Buf(&bufs[2])),
                ("residual", Arg::Buf(&bufs[3])),
                ("out", Arg::Buf(&out)),
                ("best", Arg::Buf(&best)),
            ]);
            gpu.launch(&kernel, &args);
            let got = gpu.download(elem, &out);
            let what = format!("{} 1x{n}x{k}", kernel.name);
            check(&what, elem, &got, &want);
            if choose {
                let tokens = gpu.upload_i64(&[-1]);
                let args = BTreeMap::from([("best", Arg::Buf(&best)), ("out", Arg::Buf(&tokens))]);
                gpu.launch(&choose_from_keys(1, false), &args);
                let picked = kiln_runtime::generate::choose(&got, &greedy, 0) as i64;
                assert_eq!(gpu.download_i64(&tokens), vec![picked], "{what}");
                assert_eq!(gpu.download_i64(&best), vec![0], "{what}: key");
            }
        }
    }
}

/// Random weights `[n, k]` of a product (scaled so that its sums stay near 1) and its bias.
fn product_weights(rng: &mut Rng, n: u32, k: u32, elem: Elem) -> (Vec<f32>, Vec<f32>) {
    let w = values(rng, (n * k) as usize, 1.0 / (k as f32).sqrt(), elem);
    (w, values(rng, n as usize, 0.5, elem))
}

/// An RMSNorm carried between two Hopper products (`RowNorm`): a residual product writes each
/// row's sums of squares of its stored outputs, one per tile of columns, and a product over
/// those rows (its norm weight folded into its own) scales its sums by each row's 1/rms, in
/// every tiling of both (K split too), over ragged rows and columns: the second product is the
/// interpreter's product with an RMSNorm prologue (weight ones) of the first's output.
#[test]
fn hopper_products_carry_an_rms_norm_between_them() {
    use kiln_kernels::gemm::RowNorm;
    use kiln_kernels::gemm_wgmma::{fits, gemm_wgmma_tiled, row_sum_parts, Tiling};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x00a1_10f5_a1e5);
    let tilings = |cfg: &GemmConfig| -> Vec<(Tiling, GeneratedKernel)> {
        let all = TILINGS.iter().flat_map(|&(t, _)| [t, t.split(2)]);
        (0u32..)
            .zip(all.filter(|&t| fits(cfg, t)))
            .map(|(i, t)| (t, gemm_wgmma_tiled(cfg, t, format!("rms_{i}"))))
            .collect()
    };
    for elem in [Elem::F16, Elem::BF16] {
        for (m, hidden, k, n, swiglu) in [
            (300u32, 520u32, 264u32, 1040u32, true),
            (130, 1000, 96, 258, false),
        ] {
            let first = GemmConfig {
                bias: true,
                residual: true,
                row_norm: Some(RowNorm::Sums),
                ..GemmConfig::plain(m, hidden, k, elem)
            };
            // Rows of several scales, so that each row's 1/rms matters.
            let x = values(&mut rng, (m * k) as usize, 2.0, elem);
            let (w, b) = product_weights(&mut rng, hidden, k, elem);
            let r: Vec<f32> = (0..m * hidden)
                .map(|i| {
                    round(
                        elem,
                        (1 + i / hidden % 5) as f32 * rng.random_range(-1.0f32..1.0),
                    )
                })
                .collect();
            let inputs = vec![
                (vec![m as usize, k as usize], x.clone()),
                (vec![hidden as usize, k as usize], w.clone()),
                (vec![hidden as usize], b.clone()),
                (vec![m as usize, hidden as usize], r.clone()),
            ];
            let spec = GemmSpec {
                transpose_b: true,
                bias: true,
                activation: None,
                swiglu: false,
                residual: true,
                prologue: None,
            };
            let want = rounded_reference(Op::Gemm(spec), inputs, elem);
            let bufs: Vec<Buf> = [&x, &w, &b, &r]
                .iter()
                .map(|v| gpu.upload(elem, v))
                .collect();
            let (partials, counters) = (
                gpu.upload(Elem::F32, &vec![f32::NAN; 1 << 20]),
                gpu.upload_u32(&vec![0; 1 << 12]),
            );
            let mut outs = Vec::new();
            for (tiling, kernel) in tilings(&first) {
                let parts = row_sum_parts(&first, tiling);
                let out = gpu.poisoned(elem, (m * hidden) as usize);
                let sums = gpu.upload(Elem::F32, &vec![f32::NAN; (m * parts) as usize]);
                let args = BTreeMap::from([
                    ("x", Arg::Buf(&bufs[0])),
                    ("w", Arg::Buf(&bufs[1])),
                    ("bias", Arg::Buf(&bufs[2])),
                    ("residual", Arg::Buf(&bufs[3])),
                    ("out", Arg::Buf(&out)),
                    ("row_sums", Arg::Buf(&sums)),
                    ("partials", Arg::Buf(&partials)),
                    ("counters", Arg::Buf(&counters)),
                ]);
                gpu.launch(&kernel, &args);
                let got = gpu.download(elem, &out);
                let what = format!("{tiling:?} {m}x{hidden}x{k} {elem:?}");
                check(&what, elem, &got, &want);
                let got_sums = gpu.download(Elem::F32, &sums);
                for (row, values) in got.chunks(hidden as usize).enumerate() {
                    let want: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                    let part = &got_sums[row * parts as usize..][..parts as usize];
                    let sum: f64 = part.iter().map(|&v| f64::from(v)).sum();
                    assert!(
                        (sum - want).abs() <= 1e-5 * want + 1e-6,
                        "{what}: row {row} sums {sum} against {want}"
                    );
                }
                outs.push((parts, got, sums));
            }
            // The second product over the first's rows, with each of its tilings' sums.
            let second = |parts| GemmConfig {
                swiglu,
                bias: true,
                row_norm: Some(RowNorm::Scale { parts, eps: 1e-5 }),
                ..GemmConfig::plain(m, n, hidden, elem)
            };
            let (w2, b2) = product_weights(&mut rng, n, hidden, elem);
            let (bw2, bb2) = (gpu.upload(elem, &w2), gpu.upload(elem, &b2));
            for (parts, x2, sums) in &outs {
                let spec = GemmSpec {
                    transpose_b: true,
                    bias: true,
                    activation: None,
                    swiglu,
                    residual: false,
                    prologue: Some(NormSpec {
                        kind: NormKind::RmsNorm,
                        eps: 1e-5,
                        residual: false,
                    }),
                };
                let inputs = vec![
                    (vec![m as usize, hidden as usize], x2.clone()),
                    (vec![n as usize, hidden as usize], w2.clone()),
                    (vec![n as usize], b2.clone()),
                    (vec![hidden as usize], vec![1.0; hidden as usize]),
                ];
                let want = rounded_reference(Op::Gemm(spec), inputs, elem);
                let bx2 = gpu.upload(elem, x2);
                let cfg = second(*parts);
                for (tiling, kernel) in tilings(&cfg) {
                    let out = gpu.poisoned(elem, (m * cfg.n_out()) as usize);
                    let args = BTreeMap::from([
                        ("x", Arg::Buf(&bx2)),
                        ("w", Arg::Buf(&bw2)),
                        ("bias", Arg::Buf(&bb2)),
                        ("out", Arg::Buf(&out)),
                        ("norm_sums", Arg::Buf(sums)),
                        ("partials", Arg::Buf(&partials)),
                        ("counters", Arg::Buf(&counters)),
                    ]);
                    gpu.launch(&kernel, &args);
                    let got = gpu.download(elem, &out);
                    let what = format!("{tiling:?} {m}x{n}x{hidden} over {parts} sums {elem:?}");
                    check(&what, elem, &got, &want);
                }
            }
            println!("ok: {m} rows of {hidden} between products, {elem:?}");
        }
    }
}

/// Batch invariance of the tensor-core GEMV (what a batched artifact relies on for each sequence
/// to decode as it does alone): row r of a product of 1 to 16 rows (past 8 in row groups), with
/// and without the norm prologue, is bit for bit row r of the same product over 16 rows, and a
/// row taken alone (a sequence that moved to another row) gets the same bits too.
#[test]
fn tensor_core_gemv_rows_do_not_depend_on_their_neighbours() {
    use kiln_kernels::gemv::gemv_normed;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x1234_8765_abcd_0f0f);
    let elem = Elem::BF16;
    let (k, n) = (2056u32, 96u32);
    let x = values(&mut rng, (16 * k) as usize, 2.0, elem);
    let w = values(&mut rng, (k * n) as usize, 1.0 / (k as f32).sqrt(), elem);
    let gamma = values(&mut rng, k as usize, 1.0, elem);
    let (bx, bw, bg) = (
        gpu.upload(elem, &x),
        gpu.upload(elem, &w),
        gpu.upload(elem, &gamma),
    );
    for normed in [false, true] {
        let run_on = |bx: &_, m: u32| -> Vec<f32> {
            let cfg = GemmConfig {
                m,
                k,
                n,
                transpose_b: true,
                bias: false,
                activation: None,
                swiglu: normed,
                residual: false,
                elem,
                row_norm: None,
            };
            let kernel = if normed {
                let norm = NormConfig {
                    kind: NormKind::RmsNorm,
                    residual: false,
                    elem,
                    rows: m,
                    cols: k,
                    eps: 1e-5,
                };
                gemv_normed(&(cfg.clone(), norm, true))
            } else {
                gemm_for(&cfg, Rows::BatchInvariant)
            };
            assert!(kernel.name.ends_with("_gemv_tc"), "{}", kernel.name);
            let out = gpu.poisoned(elem, (m * cfg.n_out()) as usize);
            let args = BTreeMap::from([
                ("x", Arg::Buf(bx)),
                ("w", Arg::Buf(&bw)),
                ("norm_weight", Arg::Buf(&bg)),
                ("out", Arg::Buf(&out)),
            ]);
            gpu.launch(&kernel, &args);
            gpu.download(elem, &out)
        };
        let run = |m: u32| run_on(&bx, m);
        let all = run(16);
        for r in [1usize, 7, 8, 11, 15] {
            let alone = gpu.upload(elem, &x[r * k as usize..(r + 1) * k as usize]);
            let got = run_on(&alone, 1);
            let want = &all[r * got.len()..(r + 1) * got.len()];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "normed {normed}: row {r} alone differs from row {r} of 16"
            );
        }
        for m in 1..16u32 {
            let got = run(m);
            let n_out = got.len() / m as usize;
            for (i, (a, b)) in got.iter().zip(&all).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "normed {normed}: {m} rows, row {} column {}",
                    i / n_out,
                    i % n_out
                );
            }
        }
        println!("ok  rows 1..16 equal to 16 rows' and rows alone (prologue: {normed})");
    }
}

struct AttentionCase {
    heads: u32,
    kv_heads: u32,
    q_len: u32,
    kv_len: u32,
    head_dim: u32,
    keys: kiln_kernels::attention::KeyRule,
    padding: bool,
    rope: bool,
    /// The IR's drop probability (f64, as the op stores it) and stream.
    dropout: Option<(f64, u32)>,
    /// The Hopper kernel in every shape that fits ([`Shape::space`]), not only the picked one.
    every_shape: bool,
}

impl AttentionCase {
    const fn new(heads: u32, kv_heads: u32, q_len: u32, kv_len: u32, head_dim: u32) -> Self {
        AttentionCase {
            heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
            keys: kiln_kernels::attention::KeyRule::All,
            padding: false,
            rope: false,
            dropout: None,
            every_shape: false,
        }
    }
}

/// The Hopper attention in every shape that fits (two or three consumers, one or two Q buffers,
/// two or three stages of K and of V) matches the interpreter where tiles are ragged: key counts
/// past a tile, query rows past a block, every key rule, padding, GQA and dropout, on one item
/// a block, on a persistent grid, on three blocks taking turns, over every key at head dim
/// 128 in clusters of two blocks sharing K/V (a pair's second block past the rows included),
/// and on a stream grid that splits items between blocks (its counters left zero for the next
/// kernel).
#[test]
fn attention_in_every_shape_matches_the_interpreter() {
    use kiln_kernels::attention::KeyRule;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5a4e_0000_c3c3_b2b2);
    let every = |case: AttentionCase| AttentionCase {
        every_shape: true,
        ..case
    };
    let cases = [
        // Every key over 4097 keys, GQA 2:1, padding.
        AttentionCase {
            padding: true,
            ..AttentionCase::new(4, 2, 300, 4097, 128)
        },
        AttentionCase::new(2, 2, 1000, 1000, 64),
        // Causal over ragged rows, more keys than queries.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            ..AttentionCase::new(2, 2, 777, 1301, 128)
        },
        // A window.
        AttentionCase {
            keys: KeyRule::Causal { window: Some(300) },
            ..AttentionCase::new(2, 1, 1100, 1100, 64)
        },
        // A prompt chunk over a cache.
        AttentionCase {
            keys: KeyRule::Position { window: None },
            ..AttentionCase::new(4, 1, 333, 2000, 128)
        },
        // Dropout: two consumers only.
        AttentionCase {
            dropout: Some((0.1, 3)),
            ..AttentionCase::new(2, 2, 260, 300, 128)
        },
        // Items of one key tile, more than the grid has blocks: a persistent grid.
        AttentionCase::new(12, 12, 100, 100, 64),
        // More items than the grid has blocks, over ragged keys: a stream grid splits them
        // between blocks (GQA, padding; dropout; three consumers).
        AttentionCase {
            padding: true,
            ..AttentionCase::new(10, 5, 1000, 1000, 128)
        },
        AttentionCase {
            dropout: Some((0.1, 3)),
            ..AttentionCase::new(10, 10, 1000, 700, 128)
        },
        AttentionCase::new(10, 10, 2000, 1000, 64),
    ];
    for case in cases.map(every) {
        let batch = if case.heads == 12 { 16 } else { 2 };
        attention_case(
            &gpu,
            &mut rng,
            &case,
            Elem::BF16,
            batch,
            &kiln_ir::RopeScaling::Default,
        );
    }
}

#[test]
fn attention_matches_the_interpreter() {
    use kiln_kernels::attention::KeyRule;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0f0f_1e1e_2d2d_3c3c);
    let cases = [
        // Prefill: GPT-2-like (MHA, causal + padding).
        AttentionCase {
            heads: 4,
            kv_heads: 4,
            q_len: 17,
            kv_len: 17,
            head_dim: 16,
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: false,
            dropout: None,
            every_shape: false,
        },
        // Llama-like: GQA, causal + padding, RoPE on q and k.
        AttentionCase {
            heads: 8,
            kv_heads: 2,
            q_len: 127,
            kv_len: 127,
            head_dim: 64,
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: true,
            dropout: None,
            every_shape: false,
        },
        // RoPE ahead of the Hopper kernel: MQA, head dim 128, ragged length, causal.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            rope: true,
            ..AttentionCase::new(2, 1, 520, 520, 128)
        },
        // Mistral-like sliding window, MQA, head dim 128.
        AttentionCase {
            heads: 4,
            kv_heads: 1,
            q_len: 33,
            kv_len: 33,
            head_dim: 128,
            keys: KeyRule::Causal { window: Some(7) },
            padding: false,
            rope: true,
            dropout: None,
            every_shape: false,
        },
        // BERT-like: padding only, one query row.
        AttentionCase {
            heads: 2,
            kv_heads: 2,
            q_len: 1,
            kv_len: 1,
            head_dim: 32,
            keys: KeyRule::All,
            padding: true,
            rope: false,
            dropout: None,
            every_shape: false,
        },
        // Tensor-core path: GQA, head dim 128, causal + padding, more than one tile of rows/keys.
        AttentionCase {
            heads: 8,
            kv_heads: 2,
            q_len: 130,
            kv_len: 130,
            head_dim: 128,
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: false,
            dropout: None,
            every_shape: false,
        },
        // Tensor-core path: all keys, head dim 64, no mask.
        AttentionCase {
            heads: 4,
            kv_heads: 4,
            q_len: 65,
            kv_len: 65,
            head_dim: 64,
            keys: KeyRule::All,
            padding: false,
            rope: false,
            dropout: None,
            every_shape: false,
        },
        // RoPE on keys with fewer rotation chunks than threads (head dims 16 and 48), padding,
        // a window, more than one key tile.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: true,
            ..AttentionCase::new(4, 2, 150, 150, 16)
        },
        AttentionCase {
            keys: KeyRule::Causal { window: Some(70) },
            rope: true,
            ..AttentionCase::new(6, 3, 200, 200, 48)
        },
        // The Hopper kernel: several query blocks and key tiles, GQA, causal + padding, d 128;
        // every key, d 64.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            padding: true,
            ..AttentionCase::new(4, 2, 300, 300, 128)
        },
        AttentionCase::new(2, 2, 260, 260, 64),
        // Every key at head dim 128: ragged rows and keys, GQA.
        AttentionCase::new(4, 2, 300, 1000, 128),
        // Training-mode dropout.
        AttentionCase {
            heads: 4,
            kv_heads: 2,
            q_len: 40,
            kv_len: 40,
            head_dim: 64,
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: false,
            dropout: Some((0.2, 5)),
            every_shape: false,
        },
        // Decode over a KV cache of 4097 entries (positions from device memory), GQA, RoPE on q.
        AttentionCase {
            heads: 8,
            kv_heads: 2,
            q_len: 1,
            kv_len: 4097,
            head_dim: 64,
            keys: KeyRule::Position { window: None },
            padding: false,
            rope: true,
            dropout: None,
            every_shape: false,
        },
        // Decode with head dim 128, a query group of 7 (Qwen2-7B's 28 heads over 4) and a
        // window, over 1500 entries.
        AttentionCase {
            heads: 7,
            kv_heads: 1,
            q_len: 1,
            kv_len: 1500,
            head_dim: 128,
            keys: KeyRule::Position { window: Some(700) },
            padding: false,
            rope: true,
            dropout: None,
            every_shape: false,
        },
        // Prompt chunks over a dense cache on the Hopper kernel: ragged rows and keys, d 64
        // without RoPE; d 128 with RoPE on q (rotated ahead of it).
        AttentionCase {
            keys: KeyRule::Position { window: None },
            ..AttentionCase::new(4, 2, 300, 1000, 64)
        },
        AttentionCase {
            keys: KeyRule::Position { window: None },
            rope: true,
            ..AttentionCase::new(4, 1, 130, 520, 128)
        },
        // Sliding windows on the Hopper kernel, narrower than the keys: items whose windows
        // start mid-tile, rows of one block in different tiles' windows; with padding, three
        // consumers (d 64 in blocks of 192 rows), dropout, a prompt chunk over a cache (q
        // rotated ahead at d 128), a window shorter than a tile.
        AttentionCase {
            keys: KeyRule::Causal { window: Some(300) },
            padding: true,
            ..AttentionCase::new(4, 2, 1000, 1000, 128)
        },
        AttentionCase {
            keys: KeyRule::Causal { window: Some(130) },
            ..AttentionCase::new(2, 2, 700, 700, 64)
        },
        AttentionCase {
            keys: KeyRule::Causal { window: Some(100) },
            dropout: Some((0.1, 3)),
            ..AttentionCase::new(2, 2, 300, 300, 128)
        },
        AttentionCase {
            keys: KeyRule::Causal { window: Some(20) },
            ..AttentionCase::new(2, 1, 260, 600, 64)
        },
        AttentionCase {
            keys: KeyRule::Position { window: Some(400) },
            ..AttentionCase::new(4, 2, 300, 1000, 64)
        },
        AttentionCase {
            keys: KeyRule::Position { window: Some(200) },
            rope: true,
            ..AttentionCase::new(4, 1, 130, 520, 128)
        },
        // Chunked prefill over a cache with a window.
        AttentionCase {
            heads: 4,
            kv_heads: 4,
            q_len: 5,
            kv_len: 300,
            head_dim: 16,
            keys: KeyRule::Position { window: Some(50) },
            padding: false,
            rope: false,
            dropout: None,
            every_shape: false,
        },
    ];
    for elem in ELEMS {
        for case in &cases {
            attention_case(
                &gpu,
                &mut rng,
                case,
                elem,
                2,
                &kiln_ir::RopeScaling::Default,
            );
        }
    }
}

/// The tensor-core kernels at the shapes prefill benchmarks run (4096 keys, head dims 64 and 128,
/// GQA 4:1, llama3 RoPE, a Mistral window, a prompt chunk over a cache, dropout 0.1), bf16.
#[test]
fn attention_on_tensor_cores_at_benchmark_shapes() {
    use kiln_kernels::attention::{path, KeyRule};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x4096_4096_0bf1_6bf1);
    let llama3 = kiln_ir::RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let cases = [
        // Llama-3.2-1B prefill: d 64, GQA 4:1, causal + padding, llama3 RoPE on q and k.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            padding: true,
            rope: true,
            ..AttentionCase::new(8, 2, 4096, 4096, 64)
        },
        // Mistral-like: d 128, sliding window, RoPE.
        AttentionCase {
            keys: KeyRule::Causal { window: Some(1024) },
            rope: true,
            ..AttentionCase::new(8, 2, 4096, 4096, 128)
        },
        // A prompt chunk of 512 rows over a cache of 4096 entries, RoPE on q.
        AttentionCase {
            keys: KeyRule::Position { window: None },
            rope: true,
            ..AttentionCase::new(8, 2, 512, 4096, 128)
        },
        // Training-mode dropout 0.1, d 64, causal + padding.
        AttentionCase {
            keys: KeyRule::Causal { window: None },
            padding: true,
            dropout: Some((0.1, 7)),
            ..AttentionCase::new(8, 2, 4096, 4096, 64)
        },
        // Every key at d 128 (the benchmark's case without a mask).
        AttentionCase::new(8, 8, 4096, 4096, 128),
    ];
    // Every case on the Hopper kernel: Llama's RoPE leaves it (`prerotated`), for a prefill,
    // with Mistral's window, and for a chunk over a dense cache.
    for case in &cases {
        let cfg = attention_config(case, Elem::BF16, 1);
        assert_eq!(path(&cfg), KernelPath::Wgmma, "{}", cfg_name(&cfg));
        attention_case(&gpu, &mut rng, case, Elem::BF16, 1, &llama3);
    }
    // Items in groups of planes sharing the L2: 3 sequences x 4 heads of d 128 at 4096 keys run
    // as a group of 8 planes and one of 4 (the second crossing a sequence).
    let case = AttentionCase {
        keys: KeyRule::Causal { window: None },
        ..AttentionCase::new(4, 4, 4096, 4096, 128)
    };
    attention_case(&gpu, &mut rng, &case, Elem::BF16, 3, &llama3);
}

/// The GPU attention kernels' dropout masks (tensor cores in f16/bf16, SIMT in f32) are the
/// interpreter's, bit for bit, at p 0.1, 0.3 and 0.5 (the IR's f64 p).
#[test]
fn dropout_masks_match_the_interpreter_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    // 37 rows: part of one query block; 300 rows of 128 keys: three blocks of the Hopper kernel,
    // both of its consumer warpgroups.
    for (b, h, s, t) in [(2usize, 3usize, 37usize, 64usize), (2, 3, 300, 128)] {
        let (q, k, v) = dropout_probe(b, h, s, t);
        dropout_masks_at(&gpu, [b, h, s, t], (&q, &k, &v));
    }
}

fn dropout_masks_at(gpu: &Gpu, [b, h, s, t]: [usize; 4], (q, k, v): (&[f32], &[f32], &[f32])) {
    use kiln_kernels::attention::{attention, attention_base, Dropout, KeyRule};
    for elem in ELEMS {
        for (i, p) in [0.1, 0.3, 0.5].into_iter().enumerate() {
            let case = AttentionCase {
                dropout: Some((p, i as u32 + 2)),
                ..AttentionCase::new(h as u32, h as u32, s as u32, t as u32, t as u32)
            };
            let mut cfg = attention_config(&case, elem, b as u32);
            cfg.scale = 1.0;
            cfg.keys = KeyRule::All;
            // The kernel lowering picks, and the base-image kernel its launches fall back to.
            let mut kernels = vec![attention(&cfg)];
            if kernels[0].image == Image::Sm90a {
                kernels.push(attention_base(&cfg));
            }
            // At this seed one word of plane < 6, row < 37, col < 64 of stream 2 lies between the
            // thresholds of p = 0.1 as f64 and as f32 (429496730 and 429496736): a mask drawn from a
            // rounded p differs there.
            let seed = 0x5eed_0000_0001_4e40_i64;
            let (bq, bk, bv) = (
                gpu.upload(elem, q),
                gpu.upload(elem, k),
                gpu.upload(elem, v),
            );
            let bs = gpu.upload_i64(&[seed]);
            let want =
                dropout_mask_reference(p, Dropout::new(p, i as u32 + 2).stream, seed, [b, h, s, t]);
            for kernel in &kernels {
                let out = gpu.poisoned(elem, b * h * s * t);
                let args = BTreeMap::from([
                    ("q", Arg::Buf(&bq)),
                    ("k", Arg::Buf(&bk)),
                    ("v", Arg::Buf(&bv)),
                    ("out", Arg::Buf(&out)),
                    ("seed", Arg::Buf(&bs)),
                ]);
                gpu.launch(kernel, &args);
                let got = gpu.download(elem, &out);
                assert!(
                    got.iter().all(|x| !x.is_nan()),
                    "{}: unwritten output",
                    kernel.name
                );
                assert_eq!(
                    mask_mismatches(&got, &want),
                    0,
                    "{} p {p}: masks differ",
                    kernel.name
                );
                println!("ok  {} p {p}: mask identical", kernel.name);
            }
        }
    }
}

/// A query that sees no key stores exact zeros, on tensor cores (f16/bf16) and SIMT (f32), as the
/// interpreter defines it: an encoder batch whose row 1 is all padding, and a causal decoder whose
/// row 1 is left-padded by 3 (its first 3 queries see only padding keys).
#[test]
fn attention_of_a_query_that_sees_no_key_is_zero() {
    use kiln_ir::kernel::AttentionSpec;
    use kiln_kernels::attention::{attention, KeyRule};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x2e80_2e80);
    let (b, h, t, d) = (2usize, 4usize, 70usize, 64usize);
    for elem in ELEMS {
        for (keys, unseen) in [(KeyRule::All, t), (KeyRule::Causal { window: None }, 3)] {
            let case = AttentionCase {
                keys,
                padding: true,
                ..AttentionCase::new(h as u32, h as u32, t as u32, t as u32, d as u32)
            };
            let cfg = attention_config(&case, elem, b as u32);
            let kernel = attention(&cfg);
            let q = values(&mut rng, b * h * t * d, 1.5, elem);
            let k = values(&mut rng, b * h * t * d, 1.5, elem);
            let v = values(&mut rng, b * h * t * d, 1.0, elem);
            // Row 0 sees every key; row 1 hides its first `unseen` keys.
            let mask: Vec<i64> = (0..b * t)
                .map(|x| i64::from(x < t || x % t >= unseen))
                .collect();
            let (bq, bk, bv, bm) = (
                gpu.upload(elem, &q),
                gpu.upload(elem, &k),
                gpu.upload(elem, &v),
                gpu.upload_i64(&mask),
            );
            let out = gpu.poisoned(elem, b * h * t * d);
            let args = BTreeMap::from([
                ("q", Arg::Buf(&bq)),
                ("k", Arg::Buf(&bk)),
                ("v", Arg::Buf(&bv)),
                ("out", Arg::Buf(&out)),
                ("mask", Arg::Buf(&bm)),
            ]);
            gpu.launch(&kernel, &args);
            let got = gpu.download(elem, &out);
            let spec = AttentionSpec {
                scale: f64::from(cfg.scale),
                causal: matches!(keys, KeyRule::Causal { .. }),
                window: None,
                padding: true,
                rope: None,
                dropout: None,
            };
            let as_f = mask.iter().map(|v| *v as f32).collect();
            let inputs = vec![
                (vec![b, h, t, d], q),
                (vec![b, h, t, d], k),
                (vec![b, h, t, d], v),
                (vec![b, t], as_f),
            ];
            let mut want = reference_with_seed(Op::Attention(spec), inputs, &[3], None);
            for x in want.iter_mut() {
                *x = round(elem, *x);
            }
            for head in 0..h {
                for i in 0..unseen {
                    let row = ((h + head) * t + i) * d;
                    assert!(
                        got[row..row + d].iter().all(|x| *x == 0.0),
                        "{}: query {i} of batch row 1 sees no key but is not zero",
                        kernel.name
                    );
                    assert!(want[row..row + d].iter().all(|x| *x == 0.0));
                }
            }
            check(&kernel.name, elem, &got, &want);
        }
    }
}

/// The Hopper attention of `cfg` in every shape that fits but the picked one.
fn other_shapes(cfg: &kiln_kernels::attention::AttentionConfig) -> Vec<GeneratedKernel> {
    let kernels = kiln_kernels::attention_wgmma::other_shapes(cfg, &cfg_name(cfg));
    assert!(!kernels.is_empty(), "{}: one shape fits", cfg_name(cfg));
    kernels
}

fn cfg_name(cfg: &kiln_kernels::attention::AttentionConfig) -> String {
    kiln_kernels::attention::attention(cfg).name
}

fn attention_config(
    case: &AttentionCase,
    elem: Elem,
    batch: u32,
) -> kiln_kernels::attention::AttentionConfig {
    use kiln_kernels::attention::{AttentionConfig, KeyRule};
    let cached = matches!(case.keys, KeyRule::Position { .. });
    let mut cfg = AttentionConfig {
        batch,
        heads: case.heads,
        kv_heads: case.kv_heads,
        q_len: case.q_len,
        kv_len: case.kv_len,
        head_dim: case.head_dim,
        scale: 1.0 / (case.head_dim as f32).sqrt(),
        keys: case.keys,
        padding: case.padding,
        rope: case.rope,
        rope_k: case.rope && !cached,
        dropout: case
            .dropout
            .map(|(p, st)| kiln_kernels::attention::Dropout::new(p, st)),
        elem,
        strides: [[0; 3]; 4],
        splits: 1,
        paging: None,
    };
    cfg.strides = cfg.contiguous_strides();
    cfg
}

/// `kernels`, and the Hopper attention among them again on a grid of three blocks, each taking
/// every third item (Q buffers and K/V stages reused across items, as on a persistent grid);
/// not a kernel of clusters, whose blocks take one item each.
fn with_few_blocks(mut kernels: Vec<GeneratedKernel>) -> Vec<GeneratedKernel> {
    let hopper: Vec<GeneratedKernel> = kernels
        .iter()
        .filter(|k| k.path == KernelPath::Wgmma && k.cluster == 1)
        .map(|k| {
            let mut few = k.clone();
            few.launch.grid[0] = few.launch.grid[0].min(3);
            few
        })
        .collect();
    kernels.extend(hopper);
    kernels
}

/// Runs one case on the device (and, over a cache, through key ranges and the combine kernel
/// too) and checks it against the interpreter on fresh inputs.
fn attention_case(
    gpu: &Gpu,
    rng: &mut Rng,
    case: &AttentionCase,
    elem: Elem,
    batch: u32,
    scaling: &kiln_ir::RopeScaling,
) {
    use kiln_ir::kernel::{AttentionSpec, DecodeAttentionSpec};
    use kiln_kernels::attention::{attention, KeyRule};
    let theta = 10000.0;
    let cfg = attention_config(case, elem, batch);
    let cached = matches!(case.keys, KeyRule::Position { .. });
    let kernel = attention(&cfg);
    let (b, h, kvh, s, t, d) = (
        batch as usize,
        case.heads as usize,
        case.kv_heads as usize,
        case.q_len as usize,
        case.kv_len as usize,
        case.head_dim as usize,
    );
    let q = values(rng, b * h * s * d, 1.5, elem);
    let kk = values(rng, b * kvh * t * d, 1.5, elem);
    let v = values(rng, b * kvh * t * d, 1.0, elem);
    // Right padding: row r keeps its first tokens (at least one).
    let mask: Vec<i64> = (0..b)
        .flat_map(|_| {
            let keep = 1 + (rng.random::<u64>() % t as u64) as usize;
            (0..t).map(move |j| i64::from(j < keep))
        })
        .collect();
    // Over a cache, the second sequence's positions run backwards: kernels may not assume an
    // order.
    let positions: Vec<i64> = if cached {
        (0..b)
            .flat_map(|row| {
                let first = s as u64 - 1 + rng.random::<u64>() % (t as u64 - s as u64 + 1);
                let ahead = (0..s as i64).map(move |x| first as i64 + 1 - s as i64 + x);
                let mut row_positions: Vec<i64> = ahead.collect();
                if row == 1 {
                    row_positions.reverse();
                }
                row_positions
            })
            .collect()
    } else {
        (0..b).flat_map(|_| 0..s as i64).collect()
    };
    let seed: i64 = rng.random::<u64>() as i64;
    let (cos, sin) = scaled_rope_tables(scaling, theta, d, t.max(s) + 1);
    let (bq, bk, bv) = (
        gpu.upload(elem, &q),
        gpu.upload(elem, &kk),
        gpu.upload(elem, &v),
    );
    let (bm, bp, bs) = (
        gpu.upload_i64(&mask),
        gpu.upload_i64(&positions),
        gpu.upload_i64(&[seed]),
    );
    let (bc, bn) = (gpu.upload(Elem::F32, &cos), gpu.upload(Elem::F32, &sin));
    let as_f = |x: &[i64]| x.iter().map(|v| *v as f32).collect::<Vec<f32>>();
    let rope = case.rope.then_some((theta, scaling.clone()));
    let mut inputs = vec![
        (vec![b, h, s, d], q),
        (vec![b, kvh, t, d], kk),
        (vec![b, kvh, t, d], v),
    ];
    let (op, ints) = if cached {
        let window = match case.keys {
            KeyRule::Position { window } => window.map(i64::from),
            _ => None,
        };
        inputs.push((vec![b, s], as_f(&positions)));
        let spec = DecodeAttentionSpec {
            scale: f64::from(cfg.scale),
            window,
            rope,
        };
        (Op::DecodeAttention(spec), vec![3])
    } else {
        let mut ints = Vec::new();
        if case.padding {
            ints.push(inputs.len());
            inputs.push((vec![b, t], as_f(&mask)));
        }
        if case.rope {
            ints.push(inputs.len());
            inputs.push((vec![b, s], as_f(&positions)));
        }
        if case.dropout.is_some() {
            ints.push(inputs.len());
            inputs.push((vec![], vec![seed as f32]));
        }
        let (causal, window) = match case.keys {
            KeyRule::Causal { window } => (true, window.map(i64::from)),
            _ => (false, None),
        };
        let spec = AttentionSpec {
            scale: f64::from(cfg.scale),
            causal,
            window,
            padding: case.padding,
            rope,
            dropout: case.dropout,
        };
        (Op::Attention(spec), ints)
    };
    let mut reference_out = reference_with_seed(op, inputs, &ints, case.dropout.map(|_| seed));
    for v in reference_out.iter_mut() {
        *v = round(elem, *v);
    }
    // The kernel lowering picks, and the base-image kernel its launches fall back to.
    let mut kernels = vec![kernel];
    if kernels[0].image == Image::Sm90a {
        kernels.push(kiln_kernels::attention::attention_base(&cfg));
    }
    if case.every_shape && kernels[0].path == KernelPath::Wgmma {
        kernels.extend(other_shapes(&cfg));
    }
    let kernels = with_few_blocks(kernels);
    // A stream grid's split items (as many consumers as any shape has): one zeroed set of
    // counters for every kernel, which each launch must leave zero.
    let stream = kiln_kernels::attention_wgmma::Shape {
        grid: kiln_kernels::attention_wgmma::Grid::Stream,
        consumers: 3,
        ..kiln_kernels::attention_wgmma::Shape::of(&cfg)
    };
    let (partials, counters) = kiln_kernels::attention_wgmma::stream_scratch(&cfg, stream);
    let partials = gpu.poisoned(Elem::F32, partials.max(4) as usize / 4);
    let counters = gpu.upload_u32(&vec![0; counters.max(4) as usize / 4]);
    for kernel in &kernels {
        let out = gpu.poisoned(elem, b * h * s * d);
        let mut args = BTreeMap::from([
            ("q", Arg::Buf(&bq)),
            ("k", Arg::Buf(&bk)),
            ("v", Arg::Buf(&bv)),
            ("mask", Arg::Buf(&bm)),
            ("positions", Arg::Buf(&bp)),
            ("cos", Arg::Buf(&bc)),
            ("sin", Arg::Buf(&bn)),
            ("seed", Arg::Buf(&bs)),
            ("partials", Arg::Buf(&partials)),
            ("counters", Arg::Buf(&counters)),
        ]);
        args.insert("out", Arg::Buf(&out));
        gpu.launch(kernel, &args);
        check(
            &format!("{} b={b}", kernel.name),
            elem,
            &gpu.download(elem, &out),
            &reference_out,
        );
    }
    if let Some(plain) = kiln_kernels::attention::prerotated(&cfg) {
        // RoPE ahead of the Hopper kernel, as lowering runs it: rotated q and k in buffers, then
        // the kernel without RoPE over them (and its base-image fallback).
        let [rq, rk] = kiln_kernels::attention::rotations(&cfg);
        let mut args = BTreeMap::from([
            ("v", Arg::Buf(&bv)),
            ("mask", Arg::Buf(&bm)),
            ("positions", Arg::Buf(&bp)),
            ("cos", Arg::Buf(&bc)),
            ("sin", Arg::Buf(&bn)),
        ]);
        // A chunk over a cache rotates q only (the cache holds rotated keys).
        let q_rot = gpu.poisoned(elem, b * h * s * d);
        let k_rot = gpu.poisoned(elem, b * kvh * t * d);
        let k_rotated = rk.is_some();
        for (rotation, (x, rotated)) in [rq, rk].iter().zip([(&bq, &q_rot), (&bk, &k_rot)]) {
            let Some(rotation) = rotation else { continue };
            args.insert("x", Arg::Buf(x));
            args.insert("out", Arg::Buf(rotated));
            gpu.launch(&kiln_kernels::rope::rotate(rotation), &args);
        }
        args.insert("q", Arg::Buf(&q_rot));
        args.insert("k", Arg::Buf(if k_rotated { &k_rot } else { &bk }));
        let kernels = with_few_blocks(vec![
            attention(&plain),
            kiln_kernels::attention::attention_base(&plain),
        ]);
        let outs: Vec<_> = kernels
            .iter()
            .map(|_| gpu.poisoned(elem, b * h * s * d))
            .collect();
        for (kernel, out) in kernels.iter().zip(&outs) {
            args.insert("out", Arg::Buf(out));
            gpu.launch(kernel, &args);
            check(
                &format!("rope + {} b={b}", kernel.name),
                elem,
                &gpu.download(elem, out),
                &reference_out,
            );
        }
    }
    if cached {
        // The same through key ranges (flash-decoding) and the combine kernel.
        let splits = kiln_kernels::attention::decode_splits(t as u32, b as u32, h as u32).max(4);
        let mut split_cfg = cfg.clone();
        split_cfg.splits = splits;
        let partial = attention(&split_cfg);
        let combine = kiln_kernels::attention::attention_combine(&split_cfg);
        let rows = b * h * s * splits as usize;
        let pacc = gpu.upload(Elem::F32, &vec![f32::NAN; rows * d]);
        let pml = gpu.upload(Elem::F32, &vec![f32::NAN; rows * 2]);
        let out2 = gpu.poisoned(elem, b * h * s * d);
        let mut args2 = BTreeMap::from([
            ("q", Arg::Buf(&bq)),
            ("k", Arg::Buf(&bk)),
            ("v", Arg::Buf(&bv)),
            ("partial_acc", Arg::Buf(&pacc)),
            ("partial_ml", Arg::Buf(&pml)),
            ("mask", Arg::Buf(&bm)),
            ("positions", Arg::Buf(&bp)),
            ("cos", Arg::Buf(&bc)),
            ("sin", Arg::Buf(&bn)),
            ("seed", Arg::Buf(&bs)),
        ]);
        gpu.launch(&partial, &args2);
        args2.insert("out", Arg::Buf(&out2));
        gpu.launch(&combine, &args2);
        check(
            &format!("{} b={b}", partial.name),
            elem,
            &gpu.download(elem, &out2),
            &reference_out,
        );
    }
}

/// RoPE ahead of the Hopper attention (`kiln_kernels::rope::rotate`): from a strided view (a head
/// split of a fused QKV product) into a contiguous buffer, with 16-byte chunks and, for a head
/// dim whose half is not a multiple of the chunk, one pair per thread; at random positions.
#[test]
fn rotations_match_the_interpreter() {
    use kiln_kernels::rope::{rotate, RotateConfig};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0e0e_d0d0_4242_1717);
    let theta = 500000.0;
    let table_rows = 300;
    let (cos, sin) = rope_tables(theta, 64, table_rows);
    for elem in ELEMS {
        // (batch, heads, len, head dim, row stride = heads of the fused product x head dim)
        for (batch, heads, len, d, row) in [(2u32, 3u32, 17u32, 64u32, 5 * 64), (1, 2, 5, 6, 12)] {
            let cfg = RotateConfig {
                batch,
                heads,
                len,
                head_dim: d,
                strides: [len * row, d, row],
                elem,
            };
            let (b, h, l, dd) = (batch as usize, heads as usize, len as usize, d as usize);
            let stored = values(&mut rng, b * l * row as usize, 1.5, elem);
            let dense: Vec<f32> = (0..b * h * l * dd)
                .map(|i| {
                    let (c, r) = (i % dd, i / dd);
                    let (s, bh) = (r % l, r / l);
                    let (hh, bb) = (bh % h, bh / h);
                    stored[bb * l * row as usize + s * row as usize + hh * dd + c]
                })
                .collect();
            let positions: Vec<i64> = (0..b * l)
                .map(|_| (rng.random::<u64>() % table_rows as u64) as i64)
                .collect();
            let (tc, ts) = if d == 64 {
                (cos.clone(), sin.clone())
            } else {
                rope_tables(theta, dd, table_rows)
            };
            let want = reference(
                Op::Rope {
                    theta,
                    scaling: kiln_ir::RopeScaling::Default,
                },
                vec![
                    (vec![b, h, l, dd], dense),
                    (vec![b, l], positions.iter().map(|p| *p as f32).collect()),
                ],
                &[1],
            );
            let want: Vec<f32> = want
                .as_f32()
                .unwrap()
                .iter()
                .map(|v| round(elem, *v))
                .collect();
            let (bx, bp) = (gpu.upload(elem, &stored), gpu.upload_i64(&positions));
            let (bc, bs) = (gpu.upload(Elem::F32, &tc), gpu.upload(Elem::F32, &ts));
            let out = gpu.poisoned(elem, b * h * l * dd);
            let kernel = rotate(&cfg);
            let args = BTreeMap::from([
                ("x", Arg::Buf(&bx)),
                ("out", Arg::Buf(&out)),
                ("positions", Arg::Buf(&bp)),
                ("cos", Arg::Buf(&bc)),
                ("sin", Arg::Buf(&bs)),
            ]);
            gpu.launch(&kernel, &args);
            check(&kernel.name, elem, &gpu.download(elem, &out), &want);
        }
    }
}

/// Top-k / top-p sampling: for a sweep of words over one row of logits (one launch row per word),
/// every token is exactly `choose_with_word`'s, with a NaN and a tie for the largest logit in the
/// row, rows of few distinct values (many keys tie at a threshold), top-k at or past the
/// vocabulary, and vocabularies up to 128256 (single-element and 16-byte loads).
#[test]
fn top_k_top_p_sampling_follows_the_reference() {
    use kiln_kernels::sampling::top_k_top_p;
    use kiln_runtime::generate::{choose_with_word, Sampling};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5a5a_a5a5_1234_4321);
    for elem in ELEMS {
        for (vocab, temperature, top_k, top_p, coarse) in [
            (17u32, 1.0f32, 0u32, 1.0f32, false),
            (4097, 0.7, 50, 1.0, false),
            (4097, 1.3, 0, 0.9, false),
            (4097, 1.0, 5000, 0.5, false),
            (4096, 0.9, 300, 0.8, true),
            (50257, 1.0, 40, 0.95, false),
            (128256, 0.8, 0, 0.9, false),
            (128256, 1.1, 40, 0.7, true),
            (127, 0.5, 1, 1.0, false),
            (127, 0.0, 0, 1.0, false),
        ] {
            let rows = 256u32;
            let mut row: Vec<f32> = values(&mut rng, vocab as usize, 6.0, elem);
            if coarse {
                // Few distinct values: thresholds fall inside runs of equal keys.
                row.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0);
            }
            // A NaN (below every key, no weight) and a tie for the largest logit.
            row[vocab as usize / 3] = f32::NAN;
            let top = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            row[vocab as usize - 1] = top;
            let logits: Vec<f32> = (0..rows).flat_map(|_| row.iter().copied()).collect();
            let words: Vec<u32> = (0..rows)
                .map(|i| ((f64::from(i) + 0.5) / f64::from(rows) * 4_294_967_296.0) as u32)
                .collect();
            let params: Vec<u32> = words
                .iter()
                .flat_map(|w| [temperature.to_bits(), top_k, top_p.to_bits(), *w])
                .collect();
            let kernel = top_k_top_p(elem, rows, vocab);
            let as_f32: Vec<f32> = params.iter().map(|w| f32::from_bits(*w)).collect();
            let bl = gpu.upload(elem, &logits);
            let bp = gpu.upload(Elem::F32, &as_f32);
            let out = gpu.upload_i64(&vec![-1; rows as usize]);
            let args = BTreeMap::from([
                ("logits", Arg::Buf(&bl)),
                ("params", Arg::Buf(&bp)),
                ("out", Arg::Buf(&out)),
            ]);
            gpu.launch(&kernel, &args);
            let mode = Sampling {
                temperature,
                top_k: top_k as usize,
                top_p,
                seed: 0,
            };
            let want: Vec<i64> = words
                .iter()
                .map(|w| choose_with_word(&row, &mode, *w) as i64)
                .collect();
            let what = format!("{} T={temperature} k={top_k} p={top_p}", kernel.name);
            assert_eq!(gpu.download_i64(&out), want, "{what}");
            println!("ok  {what}: {rows}/{rows} exact");
        }
    }
}

/// KV-cache writes (with and without RoPE on the way) against the interpreter's `CacheWrite`
/// (of a `Rope`): written slots hold the new values, every other slot keeps its old value, and
/// padding tokens write nothing.
#[test]
fn kv_cache_writes_match_the_interpreter() {
    use kiln_kernels::kv_cache::{kv_write, KvWriteConfig};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x1111_2222_3333_4444);
    for elem in ELEMS {
        for (new_len, capacity, head_dim, rope) in [
            (1u32, 4097u32, 64u32, true),
            (5, 300, 16, false),
            (17, 64, 128, true),
        ] {
            let (b, kvh) = (2usize, 2usize);
            let (s, t, d) = (new_len as usize, capacity as usize, head_dim as usize);
            let cache = values(&mut rng, b * kvh * t * d, 1.0, elem);
            let new = values(&mut rng, b * kvh * s * d, 1.0, elem);
            let positions: Vec<i64> = (0..b)
                .flat_map(|_| {
                    let first = rng.random::<u64>() % (t - s + 1) as u64;
                    (0..s as i64).map(move |x| first as i64 + x)
                })
                .collect();
            let mask: Vec<i64> = (0..b * s).map(|i| i64::from(i % 7 != 3)).collect();
            let (cos, sin) = rope_tables(10000.0, d, t + 1);
            let cfg = KvWriteConfig {
                batch: b as u32,
                kv_heads: kvh as u32,
                new_len,
                capacity,
                head_dim,
                new_strides: [(kvh * s * d) as u32, (s * d) as u32, d as u32],
                rope,
                elem,
                paging: None,
            };
            let kernel = kv_write(&cfg);
            let bc = gpu.upload(elem, &cache);
            let (bn, bp, bm) = (
                gpu.upload(elem, &new),
                gpu.upload_i64(&positions),
                gpu.upload_i64(&mask),
            );
            let (tc, ts) = (gpu.upload(Elem::F32, &cos), gpu.upload(Elem::F32, &sin));
            let args = BTreeMap::from([
                ("cache", Arg::Buf(&bc)),
                ("new", Arg::Buf(&bn)),
                ("positions", Arg::Buf(&bp)),
                ("mask", Arg::Buf(&bm)),
                ("cos", Arg::Buf(&tc)),
                ("sin", Arg::Buf(&ts)),
            ]);
            gpu.launch(&kernel, &args);
            let want: Vec<f32> =
                cache_write_reference(&cache, &new, &positions, &mask, [b, kvh, s, t, d], rope)
                    .iter()
                    .map(|v| round(elem, *v))
                    .collect();
            check(
                &format!("{} b={b}", kernel.name),
                elem,
                &gpu.download(elem, &bc),
                &want,
            );
        }
    }
}

/// A prompt chunk's entries in one launch (`chunk_entries`: q rotated, keys rotated and values
/// written into their caches), a warp a token and a few lanes a token, leave q's buffer and both
/// caches exactly as the rotation and the two cache writes launched apart do: q, k and v read in
/// place from one fused product's rows, a token whose mask is 0 and one past the cache written to
/// neither cache (q still rotated).
#[test]
fn prompt_chunk_entries_are_the_three_kernels_apart() {
    use kiln_kernels::kv_cache::{chunk_entries, kv_write, ChunkEntriesConfig, KvWriteConfig};
    use kiln_kernels::rope::{rotate, RotateConfig};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x0c4e_e17e_5ca7_7e12);
    for elem in ELEMS {
        for (b, heads, kvh, s, t, d) in [
            (2usize, 8usize, 2usize, 37usize, 300usize, 64usize),
            (1, 4, 4, 16, 64, 128),
        ] {
            // q, k and v are views of one fused product's rows of (heads + 2 kv heads) x d.
            let row = (heads + 2 * kvh) * d;
            let strides = [(s * row) as u32, d as u32, row as u32];
            let [q, k, v] = [0; 3].map(|_| values(&mut rng, b * s * row, 1.0, elem));
            let caches = [0; 2].map(|_| values(&mut rng, b * kvh * t * d, 1.0, elem));
            let positions: Vec<i64> = (0..b * s)
                .map(|i| (t - s - 3 + i % s) as i64 + i64::from(i == b * s - 1) * 10)
                .collect();
            let mask: Vec<i64> = (0..b * s).map(|i| i64::from(i % 11 != 4)).collect();
            let (cos, sin) = rope_tables(10000.0, d, t + 16);
            let keys = KvWriteConfig {
                batch: b as u32,
                kv_heads: kvh as u32,
                new_len: s as u32,
                capacity: t as u32,
                head_dim: d as u32,
                new_strides: strides,
                rope: true,
                elem,
                paging: None,
            };
            let query = RotateConfig {
                batch: b as u32,
                heads: heads as u32,
                len: s as u32,
                head_dim: d as u32,
                strides,
                elem,
            };
            let fused_cfg = |aligned| ChunkEntriesConfig {
                keys: keys.clone(),
                value_strides: strides,
                query: query.clone(),
                aligned,
            };
            let [bq, bk, bv] = [&q, &k, &v].map(|x| gpu.upload(elem, x));
            let (bp, bm) = (gpu.upload_i64(&positions), gpu.upload_i64(&mask));
            let (tc, ts) = (gpu.upload(Elem::F32, &cos), gpu.upload(Elem::F32, &sin));
            let mut outs = Vec::new();
            // Apart, then fused a warp a token, then fused a few lanes a token (rows 16-byte
            // aligned).
            for fused in [None, Some(false), Some(true)] {
                let [kc, vc] = [&caches[0], &caches[1]].map(|c| gpu.upload(elem, c));
                let q_out = gpu.poisoned(elem, b * heads * s * d);
                let common = || {
                    [
                        ("positions", Arg::Buf(&bp)),
                        ("mask", Arg::Buf(&bm)),
                        ("cos", Arg::Buf(&tc)),
                        ("sin", Arg::Buf(&ts)),
                    ]
                };
                if let Some(aligned) = fused {
                    let mut args = BTreeMap::from([
                        ("k_cache", Arg::Buf(&kc)),
                        ("v_cache", Arg::Buf(&vc)),
                        ("k_new", Arg::Buf(&bk)),
                        ("v_new", Arg::Buf(&bv)),
                        ("q", Arg::Buf(&bq)),
                        ("q_out", Arg::Buf(&q_out)),
                    ]);
                    args.extend(common());
                    gpu.launch(&chunk_entries(&fused_cfg(aligned)), &args);
                } else {
                    let mut args =
                        BTreeMap::from([("x", Arg::Buf(&bq)), ("out", Arg::Buf(&q_out))]);
                    args.extend(common());
                    gpu.launch(&rotate(&query), &args);
                    for (c, (cache, new)) in [
                        (keys.clone(), (&kc, &bk)),
                        (fused_cfg(false).values(), (&vc, &bv)),
                    ] {
                        let mut args =
                            BTreeMap::from([("cache", Arg::Buf(cache)), ("new", Arg::Buf(new))]);
                        args.extend(common());
                        gpu.launch(&kv_write(&c), &args);
                    }
                }
                outs.push([&q_out, &kc, &vc].map(|x| gpu.download(elem, x)));
            }
            for (form, fused) in ["a warp a token", "lanes a token"].iter().zip(&outs[1..]) {
                for (what, (apart, fused)) in ["q", "k cache", "v cache"]
                    .iter()
                    .zip(outs[0].iter().zip(fused))
                {
                    let differ = bits_differ(apart, fused);
                    assert_eq!(
                        differ, 0,
                        "{elem:?} b{b} h{heads}/{kvh} d{d} ({form}): {what} differs"
                    );
                }
            }
            let moved = bits_differ(&outs[1][1], &caches[0]);
            assert!(moved > 0, "the keys were written");
        }
    }
}

/// A decode step's attention that writes the step's new key (rotated) and value into the caches
/// itself, merges its key ranges itself, or both (`attention_decode_with`), leaves the caches
/// exactly as the two cache writes launched apart do and its output as the attention and the
/// combine apart (bit for bit without the merge; within the half-precision tolerance with it,
/// which splits the keys over the blocks they need, one block merging in shared memory), through
/// one key range and through many (the writing warp being any of them), with a row whose mask is
/// 0 writing nothing; the merge leaves its counters at zero.
/// Prompt chunks (tensor cores; SIMT in f32) and decode steps over a paged cache read what a
/// dense cache of the same keys holds: the same outputs, bit for bit, from the base image's
/// kernel of each (the pool's other entries NaN: they read nothing else), and from the Hopper
/// kernel where it takes the chunk (checked against the interpreter over a dense cache in
/// `attention_matches_the_interpreter`; the pool's other entries finite: like a dense cache's
/// keys past a row's position, what its last tile holds past the row's keys is weighted by 0).
#[test]
fn attention_over_a_paged_cache_reads_what_a_dense_one_holds() {
    use kiln_kernels::attention::{
        attention, attention_base, decode_splits, AttentionConfig, KeyRule,
    };
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x9a6e_d0ca);
    for elem in [Elem::BF16, Elem::F32] {
        for (q_len, window, d, t, splits) in [
            (128u32, None, 128u32, 1000u32, false),
            (200, None, 64, 900, false),
            (37, Some(300), 64, 700, false),
            (200, Some(150), 128, 1000, false),
            (1, None, 64, 1100, true),
        ] {
            let (b, heads, kv_heads) = (2u32, 8u32, 2u32);
            let mut cfg = AttentionConfig::plain([b, heads, kv_heads, q_len, t, d], elem);
            cfg.scale = 1.0 / (d as f32).sqrt();
            cfg.keys = KeyRule::Position { window };
            if splits {
                cfg.splits = decode_splits(t, b, heads);
            }
            let (bu, hu, kvu, su, du, tu) = (
                b as usize,
                heads as usize,
                kv_heads as usize,
                q_len as usize,
                d as usize,
                t as usize,
            );
            let k = values(&mut rng, bu * kvu * tu * du, 1.0, elem);
            let v = values(&mut rng, bu * kvu * tu * du, 1.0, elem);
            let q = values(&mut rng, bu * hu * su * du, 1.0, elem);
            // The chunk ends at the last key of row 1 and 200 keys earlier in row 0.
            let positions: Vec<i64> = (0..bu)
                .flat_map(|r| (0..su).map(move |i| (tu - su - 200 * (1 - r) + i) as i64))
                .collect();
            let pages = PagedCache::new(&mut rng, [bu, kvu, tu, du], 16);
            let (bq, bp) = (gpu.upload(elem, &q), gpu.upload_i64(&positions));
            let table = gpu.upload_u32(&pages.table);
            let rows = bu * hu * su * cfg.splits as usize;
            let pacc = gpu.upload(Elem::F32, &vec![f32::NAN; rows * du]);
            let pml = gpu.upload(Elem::F32, &vec![f32::NAN; rows * 2]);
            let (mut outs, mut hopper) = (Vec::new(), Vec::new());
            for paged in [false, true] {
                let mut c = cfg.clone();
                let (bk, bv, hk, hv) = if paged {
                    c.take_paging(pages.paging);
                    let up = |x: &[f32], fill| gpu.upload(elem, &pages.scatter(x, fill));
                    (up(&k, f32::NAN), up(&v, f32::NAN), up(&k, 3.0), up(&v, 3.0))
                } else {
                    let up = |x: &[f32]| gpu.upload(elem, x);
                    (up(&k), up(&v), up(&k), up(&v))
                };
                let out = gpu.poisoned(elem, bu * hu * su * du);
                let hopper_out = gpu.poisoned(elem, bu * hu * su * du);
                let mut args = BTreeMap::from([
                    ("q", Arg::Buf(&bq)),
                    ("k", Arg::Buf(&bk)),
                    ("v", Arg::Buf(&bv)),
                    ("out", Arg::Buf(&out)),
                    ("partial_acc", Arg::Buf(&pacc)),
                    ("partial_ml", Arg::Buf(&pml)),
                    ("positions", Arg::Buf(&bp)),
                    ("table", Arg::Buf(&table)),
                ]);
                let kernel = attention_base(&c);
                gpu.launch(&kernel, &args);
                if c.splits > 1 {
                    gpu.launch(&kiln_kernels::attention::attention_combine(&c), &args);
                }
                outs.push((kernel.name, gpu.download(elem, &out)));
                let kernel = attention(&c);
                if kernel.image == Image::Sm90a {
                    args.insert("out", Arg::Buf(&hopper_out));
                    args.insert("k", Arg::Buf(&hk));
                    args.insert("v", Arg::Buf(&hv));
                    gpu.launch(&kernel, &args);
                    hopper.push((kernel.name, gpu.download(elem, &hopper_out)));
                }
            }
            // The bf16 chunks take the Hopper kernel both ways, with a window or without.
            let chunk = elem == Elem::BF16 && q_len > 1;
            let names: Vec<&String> = hopper.iter().map(|(n, _)| n).collect();
            assert_eq!(hopper.len(), if chunk { 2 } else { 0 }, "{names:?}");
            for pair in [&outs, &hopper].into_iter().filter(|p| !p.is_empty()) {
                let (dense, paged) = (&pair[0].1, &pair[1].1);
                assert!(dense.iter().all(|x| x.is_finite()), "{}", pair[0].0);
                let differ = bits_differ(dense, paged);
                assert_eq!(
                    differ, 0,
                    "{} differs from {} at {differ} elements",
                    pair[1].0, pair[0].0
                );
            }
        }
    }
}

#[test]
fn decode_attention_writes_and_merges_as_the_kernels_apart() {
    use kiln_kernels::attention::{attention, attention_combine, decode_splits, AttentionConfig};
    use kiln_kernels::attention_decode::{attention_decode_with, combines, Extras, NewEntries};
    use kiln_kernels::kv_cache::{kv_write, KvWriteConfig};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::seed_from_u64(0x5eed_0fca_c4e5);
    for elem in [Elem::BF16, Elem::F16] {
        for (heads, kv_heads, d, t) in [
            (8u32, 2u32, 64u32, 300u32),
            (8, 2, 128, 2048),
            (4, 4, 64, 1100),
        ] {
            let b = 3u32;
            let mut cfg = AttentionConfig::plain([b, heads, kv_heads, 1, t, d], elem);
            cfg.scale = 1.0 / (d as f32).sqrt();
            cfg.keys = kiln_kernels::attention::KeyRule::Position { window: None };
            cfg.rope = true;
            cfg.splits = decode_splits(t, b, heads);
            let (bu, hu, kvu, du, tu) = (
                b as usize,
                heads as usize,
                kv_heads as usize,
                d as usize,
                t as usize,
            );
            // The new rows as head views of a wider product: a batch stride past the heads.
            let row = (kv_heads * d + 24) as usize;
            let new_strides = [row as u32, d, d];
            let cache_k = values(&mut rng, bu * kvu * tu * du, 1.0, elem);
            let cache_v = values(&mut rng, bu * kvu * tu * du, 1.0, elem);
            let q = values(&mut rng, bu * hu * du, 1.0, elem);
            let k_new = values(&mut rng, bu * row, 1.0, elem);
            let v_new = values(&mut rng, bu * row, 1.0, elem);
            // Keys for one block, for two, and the whole cache: the kernel that merges its
            // ranges takes as many blocks as the keys need.
            let positions: Vec<i64> = [5, 600, t - 1].map(|p| i64::from(p % t)).to_vec();
            let mask = vec![1i64, 0, 1];
            let (cos, sin) = rope_tables(10000.0, du, tu);
            let (bq, bp, bm) = (
                gpu.upload(elem, &q),
                gpu.upload_i64(&positions),
                gpu.upload_i64(&mask),
            );
            let (bkn, bvn) = (gpu.upload(elem, &k_new), gpu.upload(elem, &v_new));
            let (tc, ts) = (gpu.upload(Elem::F32, &cos), gpu.upload(Elem::F32, &sin));
            let rows = bu * hu * cfg.splits as usize;
            let pacc = gpu.upload(Elem::F32, &vec![f32::NAN; rows * du]);
            let pml = gpu.upload(Elem::F32, &vec![f32::NAN; rows * 2]);
            let counters = gpu.upload(Elem::F32, &vec![0.0; bu * kvu]);
            // The same caches paged (blocks of 16 keys, shuffled).
            let pages = PagedCache::new(&mut rng, [bu, kvu, tu, du], 16);
            let table = gpu.upload_u32(&pages.table);
            // `None`: the kernels apart; `paged`: over `pages`.
            let run = |extras: Option<&Extras>, paged: bool| {
                let mut cfg = cfg.clone();
                let paging = paged.then_some(pages.paging);
                let upload = |x: &[f32]| match paged {
                    true => gpu.upload(elem, &pages.scatter(x, f32::NAN)),
                    false => gpu.upload(elem, x),
                };
                if let Some(p) = paging {
                    cfg.take_paging(p);
                }
                let (bk, bv) = (upload(&cache_k), upload(&cache_v));
                let out = gpu.poisoned(elem, bu * hu * du);
                let mut args = BTreeMap::from([
                    ("q", Arg::Buf(&bq)),
                    ("k", Arg::Buf(&bk)),
                    ("v", Arg::Buf(&bv)),
                    ("out", Arg::Buf(&out)),
                    ("partial_acc", Arg::Buf(&pacc)),
                    ("partial_ml", Arg::Buf(&pml)),
                    ("positions", Arg::Buf(&bp)),
                    ("mask", Arg::Buf(&bm)),
                    ("cos", Arg::Buf(&tc)),
                    ("sin", Arg::Buf(&ts)),
                    ("k_new", Arg::Buf(&bkn)),
                    ("v_new", Arg::Buf(&bvn)),
                    ("counters", Arg::Buf(&counters)),
                    ("table", Arg::Buf(&table)),
                ]);
                if extras.is_none_or(|e| e.new.is_none()) {
                    for (cache, new, rope) in [(&bk, &bkn, true), (&bv, &bvn, false)] {
                        let write = kv_write(&KvWriteConfig {
                            batch: b,
                            kv_heads,
                            new_len: 1,
                            capacity: t,
                            head_dim: d,
                            new_strides,
                            rope,
                            elem,
                            paging,
                        });
                        args.insert("cache", Arg::Buf(cache));
                        args.insert("new", Arg::Buf(new));
                        gpu.launch(&write, &args);
                    }
                }
                let kernel = match extras {
                    Some(extras) => attention_decode_with(&cfg, extras),
                    None => attention(&cfg),
                };
                gpu.launch(&kernel, &args);
                if cfg.splits > 1 && extras.is_none_or(|e| !e.combine) {
                    gpu.launch(&attention_combine(&cfg), &args);
                }
                let mut downloaded = [&bk, &bv, &out].map(|x| gpu.download(elem, x));
                if paged {
                    for cache in &mut downloaded[..2] {
                        *cache = pages.gather(cache);
                    }
                }
                (kernel.name, downloaded)
            };
            let (_, apart) = run(None, false);
            // Over a paged cache the kernels apart store and compute exactly the same.
            let (name, paged_apart) = run(None, true);
            for (what, (a, w)) in ["k cache", "v cache", "out"]
                .iter()
                .zip(paged_apart.iter().zip(&apart))
            {
                let differ = bits_differ(a, w);
                assert_eq!(
                    differ, 0,
                    "{name}: {what} differs from the dense cache's at {differ} elements"
                );
            }
            let new = NewEntries {
                strides: [new_strides; 2],
            };
            let mut variants = vec![Extras {
                new: Some(new.clone()),
                combine: false,
            }];
            if combines(&cfg) {
                variants.push(Extras {
                    new: Some(new),
                    combine: true,
                });
                variants.push(Extras {
                    new: None,
                    combine: true,
                });
            }
            for (extras, paged) in variants.iter().flat_map(|e| [(e, false), (e, true)]) {
                let (name, fused) = run(Some(extras), paged);
                for (what, (a, w)) in ["k cache", "v cache", "out"]
                    .iter()
                    .zip(fused.iter().zip(&apart))
                {
                    if *what == "out" && extras.combine {
                        // Its own split of the keys, so its own order of the sums.
                        check(&format!("{name} out"), elem, a, w);
                        continue;
                    }
                    let differ = bits_differ(a, w);
                    assert_eq!(
                        differ, 0,
                        "{name}: {what} differs from the kernels apart at {differ} elements"
                    );
                }
                let left = gpu.download(Elem::F32, &counters);
                assert!(
                    left.iter().all(|c| c.to_bits() == 0),
                    "{name} leaves counters {left:?}"
                );
                if extras.new.is_some() {
                    // The caches hold what the interpreter's cache writes give.
                    let dense = |x: &[f32]| -> Vec<f32> {
                        (0..bu * kvu * du)
                            .map(|i| x[(i / (kvu * du)) * row + i % (kvu * du)])
                            .collect()
                    };
                    let want = cache_write_reference(
                        &cache_k,
                        &dense(&k_new),
                        &positions,
                        &mask,
                        [bu, kvu, 1, tu, du],
                        true,
                    );
                    let want: Vec<f32> = want.iter().map(|v| round(elem, *v)).collect();
                    check(&format!("{name} k cache"), elem, &fused[0], &want);
                }
            }
            assert!(
                variants.len() == 3 || cfg.splits == 1,
                "splits {}",
                cfg.splits
            );
        }
    }
}
