//! kiln's kernel generators: PTX text for every kernel kind, parameterised by the static shapes and
//! dtypes of a bucket, with the typed signature and launch configuration the runtime checks.
//!
//! - [`ptx`] — the typed PTX builder;
//! - [`attention`] — fused attention, prefill and decode (GQA, masks, RoPE, dropout), SIMT;
//! - [`attention_decode`] — decode attention over a KV cache, a query group per warp from one
//!   read of its K/V;
//! - [`attention_tc`] — FlashAttention-2 style prefill attention on tensor cores;
//! - [`attention_wgmma`] — FlashAttention-3 style prefill attention on sm_90a (TMA, wgmma);
//! - [`reduce`] — block-wide reductions the row kernels share;
//! - [`norm`] — LayerNorm / RMSNorm (with the residual add);
//! - [`elementwise`] — activations;
//! - [`embedding`] — summed embedding lookups;
//! - [`gemm`] — matrix products with their fused epilogues (SIMT, every configuration);
//! - [`gemm_tc`] — the tensor-core GEMM (f16/bf16, `mma.sync`, `ldmatrix`, `cp.async`);
//! - [`gemm_wgmma`] — the Hopper GEMM (sm_90a: TMA, `wgmma`, warp specialisation);
//! - [`hopper`] — the PTX of Hopper's asynchronous machinery (mbarriers, TMA, wgmma);
//! - [`gemv`] — products with at most 8 rows (decode; 16 in row groups where decode must be
//!   batch-invariant): a warp per output column;
//! - [`kv_cache`] — writing new keys/values into a KV cache in place (RoPE on the way);
//! - [`paging`] — paged KV caches: block tables, rows found through them;
//! - [`rope`] — RoPE into a contiguous buffer, ahead of the Hopper attention kernel;
//! - [`sampling`] — token choice: greedy (argmax) and top-k / top-p with temperature;
//! - [`catalog`] — the configurations the snapshot, assembler and GPU tests cover.
//!
//! Values that vary per request (token ids, lengths, positions) are read through pointers, so a
//! captured CUDA graph stays valid for every request of its bucket. Element indices are 32-bit:
//! every tensor a kernel addresses must have fewer than 2^32 elements (`check_index_range`).
//! Depends on `kiln-ir` only.

pub mod attention;
pub mod attention_decode;
pub mod attention_tc;
pub mod attention_wgmma;
pub mod catalog;
pub mod cpu;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemm_tc;
pub mod gemm_wgmma;
pub mod gemv;
pub mod hopper;
pub mod kv_cache;
pub mod norm;
pub mod paging;
pub mod ptx;
pub mod reduce;
pub mod rope;
pub mod sampling;

use serde::{Deserialize, Serialize};

pub use kiln_ir::artifact::{Image, TensorMapSpec};
pub use ptx::{Elem, ParamType};

/// Grid, block and dynamic shared memory of a launch, and the hardware path a kernel runs on
/// (the artifact's schema owns the types: `kiln inspect` shows the path).
pub use kiln_ir::artifact::{KernelPath, Launch};

/// One generated kernel: its entry name, PTX text (an `.entry`, without the module header), the
/// ordered parameter list the runtime must pass, and its launch configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeneratedKernel {
    /// The `.entry` name.
    pub name: String,
    /// The `.entry` text.
    pub ptx: String,
    /// Parameters in order: name and how it is passed.
    pub signature: Vec<(String, ParamType)>,
    /// The parameters of [`Self::signature`] that point at the kernel's own working memory
    /// ([`ptx::Kernel::param_scratch`]).
    pub scratch: Vec<String>,
    /// How to launch it.
    pub launch: Launch,
    /// Which hardware path it runs on.
    pub path: KernelPath,
    /// The module image it needs.
    pub image: Image,
    /// Blocks per cluster along x ([`ptx::Kernel::cluster`]; 1: none).
    pub cluster: u32,
}

impl GeneratedKernel {
    /// Finishes `kernel` with its launch configuration (path [`KernelPath::Other`]).
    pub fn new(kernel: ptx::Kernel, launch: Launch) -> GeneratedKernel {
        GeneratedKernel {
            name: kernel.name().to_string(),
            signature: kernel.params().to_vec(),
            scratch: kernel.scratch_params().to_vec(),
            cluster: kernel.cluster_blocks(),
            ptx: kernel.finish(),
            launch,
            path: KernelPath::Other,
            image: Image::Sm90,
        }
    }

    /// The names of the pointer parameters the node's operands bind, in order: every one but
    /// the scalars and the kernel's scratch.
    pub fn operand_params(&self) -> impl Iterator<Item = &str> {
        self.signature
            .iter()
            .filter(|(p, ty)| {
                !matches!(ty, ParamType::U32 | ParamType::F32) && !self.scratch.contains(p)
            })
            .map(|(p, _)| p.as_str())
    }

    /// The same kernel, built into `image`.
    pub fn in_image(mut self, image: Image) -> GeneratedKernel {
        self.image = image;
        self
    }

    /// The same kernel, marked as running on `path`.
    pub fn on(mut self, path: KernelPath) -> GeneratedKernel {
        self.path = path;
        self
    }

    /// A complete PTX module holding only this kernel, for its image's target.
    pub fn module(&self) -> String {
        ptx::module_for(self.image.target(), std::slice::from_ref(&self.ptx))
    }
}

/// Whether tensors of `counts` elements can be addressed by the kernels' 32-bit element indices;
/// a lowering that gets `false` must split the work (for example an LM head over a huge batch).
pub fn check_index_range(counts: &[u64]) -> bool {
    counts.iter().all(|&c| c < 1 << 32)
}

/// Threads per block of the row kernels (norms, sampling, embedding).
pub const ROW_THREADS: u32 = 256;
