//! The compiled artifact's schema, shared by the compiler (which writes it) and the runtime
//! (which reads it, and links nothing of the compiler's).
//!
//! An artifact is a folder: `manifest.ron` (this module's [`Manifest`]), the static graph of every
//! bucket (`buckets/*.ron`), `kernels.ptx` (and `kernels.sm_90.cubin` when ptxas was found), the
//! Hopper-only kernels ([`Image::Sm90a`]) as `kernels.sm_90a.ptx` (and `kernels.sm_90a.cubin`),
//! `weights.safetensors` in the compiled dtype with the checkpoint's names, `tokenizer.json` when
//! the checkpoint had one, and `checksums`: one `digest  path` line per file (BLAKE3, as `b3sum`
//! prints it: [`crate::checksum`]), then the list's own line, verified before anything runs.
//!
//! Every bucket carries its [`ExecPlan`]: the kernel launches in order, each argument a place in
//! the one device allocation the [`MemoryPlan`] lays out (weights, KV cache, activation arena) or
//! a constant. A GPU executor needs nothing else: it allocates once, uploads the weights, and
//! captures each plan as a CUDA graph.

use serde::{Deserialize, Serialize};

use crate::inputs::InputContract;
use crate::DType;

/// The artifact format this build writes and reads. Since version 9 every GPU kernel waits for
/// the kernel before it (`griddepcontrol.wait`) before it reads anything an earlier kernel wrote,
/// so the runtime may launch each step while its predecessor still runs (programmatic dependent
/// launch); since version 10 the allocation holds a counters region between the KV cache and the
/// arena ([`Region::Counters`]); since version 11 a decode step's plan may advance its own
/// inputs ([`ExecPlan::advances`]); since version 12 it may carry a sampler
/// ([`ExecPlan::sampler`]); since version 13 the cache may be paged ([`MemoryPlan::paging`]);
/// since version 14 a decoder may list logits chunks ([`Manifest::logits_chunks`]); since
/// version 15 a logits chunk's plan may say where its logits land in row pieces
/// ([`ExecPlan::logits_pieces`]); since version 16 a step may run only where the sm_90a steps
/// fall back ([`Step::base_only`]).
pub const FORMAT_VERSION: u32 = 16;
/// The inputs a decode step that advances them ([`ExecPlan::advances`]) leaves for the next
/// step: token ids (each unmasked row's chosen token), positions (one further) and the mask
/// (unchanged), each i64 `[batch, 1]`.
pub const ADVANCED_INPUTS: [&str; 3] = ["input_ids", "position_ids", "attention_mask"];
/// Every region and every tensor in the device allocation starts at a multiple of this many bytes.
pub const ALIGN: u64 = 256;
/// The output of a decoder's graphs that generation samples from (prompt chunks leave it out).
pub const LOGITS: &str = "logits";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.ron";
/// The weights file's name (the manifest names it: absent under `--no-weights`).
pub const WEIGHTS: &str = "weights.safetensors";
pub use crate::checksum::CHECKSUMS;

/// What an artifact holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `FORMAT_VERSION` of the compiler that wrote it.
    pub format_version: u32,
    /// The compiler's version.
    pub compiler_version: String,
    /// The git commit the compiler was built from (`-dirty` with local changes).
    pub compiler_git: String,
    /// The checkpoint's `config.json`, verbatim.
    pub model_config: String,
    /// The digest of `weights.safetensors` (also in `checksums`; here so the manifest names the
    /// exact weights its plans were made for).
    pub weights_digest: Option<String>,
    /// The checkpoint's architecture (`GPT2LMHeadModel`, ...).
    pub architecture: String,
    /// What the runtime needs to know about the model's inputs and outputs.
    pub model: ModelSummary,
    /// The compiled float type.
    pub dtype: DType,
    /// The weights file, absent for plan-only artifacts.
    pub weights: Option<String>,
    /// `tokenizer.json`, when the checkpoint had one.
    pub tokenizer: Option<String>,
    /// `tokenizer_config.json` (special tokens, the chat template), when the checkpoint had one.
    #[serde(default)]
    pub tokenizer_config: Option<String>,
    /// `generation_config.json` (end-of-sequence ids), when the checkpoint had one.
    #[serde(default)]
    pub generation_config: Option<String>,
    /// The PTX module of every kernel (absent in a `--target cpu` build).
    pub kernels_ptx: Option<String>,
    /// The sm_90 cubin assembled from it, when ptxas was found.
    pub kernels_cubin: Option<String>,
    /// The PTX module of the kernels that need `sm_90a` (wgmma, setmaxnreg), when any does.
    #[serde(default)]
    pub kernels_sm90a_ptx: Option<String>,
    /// The sm_90a cubin assembled from it, when ptxas was found.
    #[serde(default)]
    pub kernels_sm90a_cubin: Option<String>,
    /// The CPU kernels (a shared library for this architecture), when the build has CPU plans.
    pub kernels_cpu: Option<String>,
    /// The generated token sampler in `kernels_cpu` (decoders): `kiln_kernels::cpu::sampling`'s
    /// parameters over one row of `vocab_size` logits.
    pub cpu_sampler: Option<String>,
    /// Sequence buckets, ascending.
    pub seq_buckets: Vec<usize>,
    /// Batch buckets, ascending.
    pub batch_buckets: Vec<usize>,
    /// KV-cache capacity of the decode graphs (decoders).
    pub max_context: Option<usize>,
    /// Prefill / encode buckets, largest first.
    pub prefill: Vec<BucketEntry>,
    /// Decode buckets, largest batch first.
    pub decode: Vec<BucketEntry>,
    /// Logits chunks (decoders, `kiln compile --logits-chunk`), largest first: KV-cached graphs
    /// of one sequence's chunk of tokens that keep every token's logits (prompt chunks do not),
    /// through which a prompt longer than the largest is run whole, each chunk's logits copied to
    /// the host while the next chunk computes.
    #[serde(default)]
    pub logits_chunks: Vec<BucketEntry>,
    /// Streaming multiprocessor versions the cubin was assembled for (`[90]`); empty without one.
    pub targets: Vec<u32>,
    /// The device allocation's layout.
    pub memory: MemoryPlan,
    /// The CPU plans' own layout when they compute wider than the artifact's dtype (f16/bf16
    /// builds run in f32 on the CPU: weights widened from `weights.safetensors` at load, outputs
    /// rounded back); `None` when the CPU plans share `memory`.
    pub cpu_memory: Option<MemoryPlan>,
    /// Every kernel the plans launch: entry name, parameters, launch configuration.
    pub kernel_table: Vec<KernelEntry>,
}

impl Manifest {
    /// Every bucket: prefill, decode (prompt chunks included), then logits chunks.
    pub fn buckets(&self) -> impl Iterator<Item = &BucketEntry> {
        self.prefill
            .iter()
            .chain(&self.decode)
            .chain(&self.logits_chunks)
    }
}

/// The one device allocation every plan of an artifact runs in: `[weights | cache | arena]`, each
/// region and tensor aligned to [`ALIGN`] bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// The weights region: `weights.safetensors`' data section, byte for byte.
    pub weights_bytes: u64,
    /// Each weight's place in that region (derived tensors such as RoPE tables included).
    pub weights: Vec<TensorSlot>,
    /// The KV-cache region (decoders): one slot per cache input (`past_key.0`, ...), sized for
    /// the largest decode batch (a smaller batch uses the leading rows), or, paged, a pool of
    /// blocks per input and the block table ([`MemoryPlan::paging`]).
    pub cache_bytes: u64,
    /// The cache slots: `[rows, KVH, T, D]`, or paged `[blocks, KVH, block_tokens, D]`.
    pub cache: Vec<TensorSlot>,
    /// How the cache is paged; `None`: dense.
    #[serde(default)]
    pub paging: Option<CachePaging>,
    /// The counters region: the most any one launch uses (launches run one at a time, each
    /// leaving them at zero, so all share it from offset 0).
    #[serde(default)]
    pub counter_bytes: u64,
    /// The activation arena: the largest of the buckets' footprints (buckets never run at once).
    pub arena_bytes: u64,
}

/// A paged KV cache: every cache slot is a pool of `blocks` blocks of `block_tokens` keys
/// (`[blocks, KVH, block_tokens, D]`), and row `r`'s key `j` is row `j % block_tokens` of block
/// `table[r * entries + j / block_tokens]`. The table (u32, `[rows, entries]`) lies in the cache
/// region at byte `table`; the runtime writes it between steps, the kernels only read it. Block 0
/// is never handed out: unassigned entries point at it, and nothing writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachePaging {
    /// Keys per block (a power of two).
    pub block_tokens: usize,
    /// Blocks in each pool, block 0 included.
    pub blocks: usize,
    /// Table rows: the largest decode batch.
    pub rows: usize,
    /// Table entries per row: the context in blocks, rounded up.
    pub entries: usize,
    /// The table's byte offset in the cache region.
    pub table: u64,
}

impl CachePaging {
    /// Bytes of the block table.
    pub fn table_bytes(&self) -> u64 {
        (self.rows * self.entries * 4) as u64
    }

    /// Blocks a sequence holding `tokens` keys needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// `Err` naming what contradicts this paging of `memory`'s cache over a context of
    /// `context` keys: every pool holds a whole sequence of the context beside block 0, and the
    /// pools and the table lie in the cache region apart.
    pub fn check(&self, memory: &MemoryPlan, context: usize) -> Result<(), String> {
        let bad = |why: String| Err(format!("its paged KV cache {why}"));
        if !self.block_tokens.is_power_of_two() {
            return bad(format!("has blocks of {} keys", self.block_tokens));
        }
        if self.entries != self.blocks_for(context) || self.blocks <= self.entries {
            return bad(format!(
                "has {} blocks and {} table entries per row for a context of {context} keys",
                self.blocks, self.entries
            ));
        }
        if !self.table.is_multiple_of(4) || self.table + self.table_bytes() > memory.cache_bytes {
            return bad("has its block table misplaced in the cache region".into());
        }
        for slot in &memory.cache {
            let pool = slot.shape.len() == 4
                && slot.shape[0] == self.blocks
                && slot.shape[2] == self.block_tokens;
            if !pool || slot.offset + slot.bytes() > self.table {
                return bad(format!("has `{}` shaped {:?}", slot.name, slot.shape));
            }
        }
        Ok(())
    }
}

impl MemoryPlan {
    /// Byte offset of `region` in the allocation.
    pub fn base(&self, region: Region) -> u64 {
        match region {
            Region::Weights => 0,
            Region::Cache => align(self.weights_bytes),
            Region::Counters => align(self.weights_bytes) + align(self.cache_bytes),
            Region::Arena => self.base(Region::Counters) + align(self.counter_bytes),
        }
    }

    /// Bytes of `region`.
    pub fn region_bytes(&self, region: Region) -> u64 {
        match region {
            Region::Weights => self.weights_bytes,
            Region::Cache => self.cache_bytes,
            Region::Counters => self.counter_bytes,
            Region::Arena => self.arena_bytes,
        }
    }

    /// The whole allocation, bytes.
    pub fn total_bytes(&self) -> u64 {
        self.base(Region::Arena) + align(self.arena_bytes)
    }
}

/// The exported name of the generated CPU sampler over rows of `vocab` logits (the compiler
/// generates it under this name; the runtime checks the manifest's `cpu_sampler` against it).
pub fn cpu_sampler_name(vocab: usize) -> String {
    format!("cpu_sample_f32_v{vocab}")
}

/// The CPU library's file name for this machine's architecture and OS
/// (`kernels.cpu.x86_64-v3-linux.so`: x86-64 code needs the v3 level, AVX2 and FMA): an
/// artifact's CPU library runs where its name matches and the CPU has that level.
pub fn cpu_library_name() -> String {
    let level = if std::env::consts::ARCH == "x86_64" {
        "-v3"
    } else {
        ""
    };
    format!(
        "kernels.cpu.{}{level}-{}.{}",
        std::env::consts::ARCH,
        std::env::consts::OS,
        std::env::consts::DLL_EXTENSION
    )
}

/// `n` rounded up to [`ALIGN`].
pub fn align(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// A named tensor at a byte offset of a region.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorSlot {
    /// Weight, input or output name.
    pub name: String,
    /// Byte offset in its region.
    pub offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Static shape.
    pub shape: Vec<usize>,
}

impl TensorSlot {
    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size_bytes() as u64
    }
}

/// A region of the device allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Region {
    /// Weights and derived constant tables, read only.
    Weights,
    /// The KV cache, kept across requests of a generation.
    Cache,
    /// Counters kernels synchronise their blocks with (the decode attention's merge of its key
    /// ranges): zero at load, and every kernel leaves the counters it uses at zero.
    Counters,
    /// Activations, inputs and outputs of one bucket's run.
    Arena,
}

/// How a kernel parameter is passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamType {
    /// A device pointer (`.u64`).
    Ptr,
    /// A 32-bit unsigned integer.
    U32,
    /// A 32-bit float.
    F32,
    /// A TMA tensor map over the matrix an [`Arg::TensorMap`] points at, passed by value (128
    /// bytes, `.param .align 64 .b8 [128]`), encoded once at load.
    TensorMap(TensorMapSpec),
}

/// The layout a TMA tensor map describes: a tensor of up to 4 dimensions of `dtype` elements,
/// innermost (contiguous) first (`dims`, unused ones 1), `strides` bytes apart in the outer three,
/// copied in boxes of `box_dims` with `swizzle_bytes` (0, 32, 64 or 128) shared-memory swizzle.
/// Elements outside the tensor read as zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMapSpec {
    /// Element type.
    pub dtype: DType,
    /// Elements per dimension, innermost first.
    pub dims: [u64; 4],
    /// Bytes from one index to the next in dimensions 1, 2 and 3.
    pub strides: [u64; 3],
    /// Box extent per dimension, elements.
    pub box_dims: [u32; 4],
    /// Shared-memory swizzle span, bytes.
    pub swizzle_bytes: u32,
}

impl TensorMapSpec {
    /// A row-major matrix of `rows` x `cols` (rows `cols` elements apart), in boxes of
    /// `box_rows` x `box_cols`.
    pub fn matrix(dtype: DType, [rows, cols]: [u64; 2], [box_rows, box_cols]: [u32; 2]) -> Self {
        let row_bytes = cols * dtype.size_bytes() as u64;
        TensorMapSpec {
            dtype,
            dims: [cols, rows, 1, 1],
            strides: [row_bytes, row_bytes * rows, row_bytes * rows],
            box_dims: [box_cols, box_rows, 1, 1],
            swizzle_bytes: 0,
        }
    }

    /// The same with `bytes` of swizzle.
    pub fn swizzled(self, bytes: u32) -> Self {
        TensorMapSpec {
            swizzle_bytes: bytes,
            ..self
        }
    }

    /// Bytes from the tensor's start to the end of its last element.
    pub fn extent_bytes(&self) -> u64 {
        let elem = self.dtype.size_bytes() as u64;
        let outer: u64 = (1..4)
            .map(|i| self.dims[i].saturating_sub(1) * self.strides[i - 1])
            .sum();
        outer + self.dims[0] * elem
    }

    /// Why the driver would refuse to encode it (`cuTensorMapEncodeTiled`'s rules), if it would.
    pub fn check(&self) -> Result<(), String> {
        let elem = self.dtype.size_bytes() as u64;
        let box_row_bytes = u64::from(self.box_dims[0]) * elem;
        if !matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(format!(
                "element type {:?} has no tensor-map form",
                self.dtype
            ));
        }
        if self.dims.iter().any(|&d| d == 0 || d >= 1 << 32) {
            return Err(format!(
                "dimensions {:?} are not ones TMA can address",
                self.dims
            ));
        }
        if self
            .strides
            .iter()
            .any(|&s| !s.is_multiple_of(16) || s >= 1 << 40)
        {
            return Err(format!(
                "strides {:?} are not multiples of 16 bytes below 2^40",
                self.strides
            ));
        }
        if self.strides[0] < self.dims[0] * elem {
            return Err(format!(
                "rows of {} bytes overlap (stride {})",
                self.dims[0] * elem,
                self.strides[0]
            ));
        }
        if self.box_dims.iter().any(|&b| !(1..=256).contains(&b)) {
            return Err(format!("box {:?} exceeds 256 per side", self.box_dims));
        }
        if !box_row_bytes.is_multiple_of(16) {
            return Err(format!(
                "a box row of {box_row_bytes} bytes is not a multiple of 16"
            ));
        }
        match self.swizzle_bytes {
            0 => Ok(()),
            32 | 64 | 128 if box_row_bytes <= u64::from(self.swizzle_bytes) => Ok(()),
            s => Err(format!(
                "swizzle {s} does not hold a box row of {box_row_bytes} bytes"
            )),
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// Blocks per grid (x, y, z).
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub shared_bytes: u32,
}

/// The hardware path a kernel runs on, so that a slow fallback is never silent: reports and
/// `kiln inspect` show it, and the compiler's cost model prices each path differently.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum KernelPath {
    /// Hopper warpgroup MMA (`wgmma.mma_async`).
    Wgmma,
    /// Warp-level tensor-core MMA (`mma.sync`).
    Mma,
    /// The matrix-vector product of at most 8 rows (`kiln_kernels::gemv`).
    Gemv,
    /// CUDA-core arithmetic for a kernel that has a tensor-core form elsewhere (a fallback).
    Simt,
    /// Kernels with no tensor-core form (norms, elementwise, embeddings, sampling, ...).
    #[default]
    Other,
}

impl KernelPath {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Wgmma => "wgmma",
            KernelPath::Mma => "mma",
            KernelPath::Gemv => "gemv",
            KernelPath::Simt => "simt",
            KernelPath::Other => "other",
        }
    }

    /// The path of a node lowered to the launches on `paths`: its main kernel's, the first that
    /// is not [`KernelPath::Other`] (a norm prologue before its product, a combine after a split
    /// attention), or `Other` when all are.
    pub fn main(paths: impl IntoIterator<Item = KernelPath>) -> KernelPath {
        paths
            .into_iter()
            .find(|p| *p != KernelPath::Other)
            .unwrap_or_default()
    }
}

/// One kernel of the module: how it is called. A kernel whose code is the same for several
/// shapes (row kernels take their row count from the grid) is launched by each step with that
/// step's own configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelEntry {
    /// The `.entry` name.
    pub name: String,
    /// Parameters in order.
    pub params: Vec<(String, ParamType)>,
    /// The most dynamic shared memory any launch of it asks for, bytes.
    pub max_shared_bytes: u32,
    /// The hardware path it runs on (`Other` in artifacts written before it was recorded).
    #[serde(default)]
    pub path: KernelPath,
    /// The module image that holds it.
    #[serde(default)]
    pub image: Image,
    /// Blocks per cluster along x: every launch's grid is whole clusters (1, no cluster, in
    /// artifacts written before it was recorded).
    #[serde(default = "one_block")]
    pub cluster: u32,
}

fn one_block() -> u32 {
    1
}

/// The kernel image a kernel is built into: the base module (sm_90 cubin and PTX: Ampere's
/// tensor-core instructions and Hopper's `griddepcontrol`) or the Hopper-only module (`sm_90a`: wgmma, setmaxnreg), which only a GPU of
/// compute capability 9.0 runs. A step on an `Sm90a` kernel carries a fallback on `Sm90` kernels.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Image {
    /// `kernels.ptx` / `kernels.sm_90.cubin`.
    #[default]
    Sm90,
    /// `kernels.sm_90a.ptx` / `kernels.sm_90a.cubin`.
    Sm90a,
}

impl Image {
    /// The PTX `.target` of its module.
    pub fn target(self) -> &'static str {
        match self {
            Image::Sm90 => "sm_90",
            Image::Sm90a => "sm_90a",
        }
    }
}

/// A kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Arg {
    /// The address `base(region) + offset` of the device allocation.
    Ptr(Region, u64),
    /// A 32-bit unsigned constant.
    U32(u32),
    /// A 32-bit float constant.
    F32(f32),
    /// A tensor map (the kernel's [`ParamType::TensorMap`] gives its layout) over the matrix at
    /// `base(region) + offset`.
    TensorMap(Region, u64),
}

/// One launch of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The kernel's entry name (in [`Manifest::kernel_table`]).
    pub kernel: String,
    /// One argument per parameter, in order.
    pub args: Vec<Arg>,
    /// This launch's grid, block and dynamic shared memory.
    pub launch: Launch,
    /// The graph node it computes (`{op}_{node}`), for `kiln inspect` and error messages.
    pub node: String,
    /// The same work on base-image kernels, for a step whose kernel needs [`Image::Sm90a`] when
    /// the GPU cannot run that image.
    #[serde(default)]
    pub fallback: Option<Box<Step>>,
    /// Run only where the GPU cannot run [`Image::Sm90a`] (and the steps fall back): work an
    /// sm_90a step after it does itself, which that step's fallback reads (an RMSNorm that the
    /// Hopper products carry between them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub base_only: bool,
}

/// A bucket's execution plan: copy the inputs into their arena slots, run the steps in order,
/// read the outputs from theirs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecPlan {
    /// Arena bytes this bucket uses.
    pub arena_bytes: u64,
    /// Graph inputs held in the arena (token ids, masks, positions), as i64.
    pub inputs: Vec<TensorSlot>,
    /// Graph inputs that are KV-cache slots (`past_*`), by input name.
    pub cache_inputs: Vec<String>,
    /// Graph outputs in the arena.
    pub outputs: Vec<TensorSlot>,
    /// Graph outputs that are the KV cache updated in place (`present_*`).
    pub cache_outputs: Vec<String>,
    /// The launches, in order.
    pub steps: Vec<Step>,
    /// A decode step's greedy choice (i64 `[batch]`, the first largest logit of each row),
    /// written by the last step: generation reads these instead of the logits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TensorSlot>,
    /// Whether the step that writes `tokens` also leaves the next decode step's inputs in their
    /// slots (each unmasked row's token as its `input_ids`, its `position_ids` one further, the
    /// mask unchanged), so that replays can follow each other without the host in between.
    /// Inputs live in the arena for the whole replay, so nothing else overwrites them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub advances: bool,
    /// The launch a decode step at temperature > 0 runs after the replay: a sampler over the
    /// step's logits that writes `tokens` (`kiln_runtime::generate::choose`, bit for bit), its
    /// parameters in an arena slot alive through the replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<Sampler>,
    /// A logits chunk's LM head in row pieces, in order: after the first `steps` steps, rows
    /// `0..rows` of `logits` are final, so that their copy to the host can start while the later
    /// pieces compute. The last piece covers every row. Empty: the logits are final at the end.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logits_pieces: Vec<LogitsPiece>,
    /// Ops without a GPU kernel at the end of the graph (sentence-transformers pooling), run on
    /// the host after the replay: a graph whose inputs are request inputs and GPU values
    /// (`kiln.value.N`, among `outputs`), and whose outputs are the remaining graph outputs.
    pub host_tail: Option<crate::Graph>,
    /// The plan for the CPU executor, host tail included, over the same memory plan (or, for
    /// f16/bf16 builds, over `Manifest::cpu_memory`): `None` when some op has no CPU version
    /// (`BucketEntry::no_cpu`).
    pub cpu: Option<CpuPlan>,
}

/// One row piece of a logits chunk's logits ([`ExecPlan::logits_pieces`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogitsPiece {
    /// Steps after which the piece is written.
    pub steps: usize,
    /// Rows of `logits` (its second axis) final from then on, counted from the first.
    pub rows: usize,
}

impl ExecPlan {
    /// Checks [`ExecPlan::logits_pieces`] against the plan: steps and rows rising, within the
    /// plan's steps and its `logits` rows, the last piece covering them all.
    pub fn check_logits_pieces(&self) -> Result<(), String> {
        if self.logits_pieces.is_empty() {
            return Ok(());
        }
        let rows = self
            .logits_rows()
            .ok_or("logits pieces without a `[B, S, V]` logits output")?;
        let mut before = LogitsPiece { steps: 0, rows: 0 };
        for p in &self.logits_pieces {
            if p.steps <= before.steps || p.rows <= before.rows || p.steps > self.steps.len() {
                return Err(format!(
                    "logits piece {p:?} does not follow {before:?} within {} steps",
                    self.steps.len()
                ));
            }
            before = *p;
        }
        if before.rows != rows {
            return Err(format!(
                "the last logits piece ends at row {} of {rows}",
                before.rows
            ));
        }
        Ok(())
    }

    /// Drops the steps that only a GPU without sm_90a runs ([`Step::base_only`]), the logits
    /// pieces counted over the steps that remain.
    pub fn drop_base_only(&mut self) {
        let kept = |n: usize| self.steps[..n].iter().filter(|s| !s.base_only).count();
        let pieces: Vec<LogitsPiece> = (self.logits_pieces.iter())
            .map(|p| LogitsPiece {
                steps: kept(p.steps),
                rows: p.rows,
            })
            .collect();
        self.logits_pieces = pieces;
        self.steps.retain(|s| !s.base_only);
    }

    /// Rows of the `logits` output (its second axis), if the plan has one.
    fn logits_rows(&self) -> Option<usize> {
        let logits = self.outputs.iter().find(|s| s.name == LOGITS)?;
        logits.shape.get(1).copied()
    }

    /// The plan's steps in the segments its logits pieces end (the last segment to the end of
    /// the plan), each with the rows of `logits` final after it; one segment of every step and
    /// every row (none without logits) without pieces.
    pub fn logits_segments(&self) -> Vec<(std::ops::Range<usize>, usize)> {
        let Some(last) = self.logits_pieces.len().checked_sub(1) else {
            return vec![(0..self.steps.len(), self.logits_rows().unwrap_or(0))];
        };
        let mut start = 0;
        let mut segments = Vec::with_capacity(self.logits_pieces.len());
        for (i, p) in self.logits_pieces.iter().enumerate() {
            let end = if i == last { self.steps.len() } else { p.steps };
            segments.push((start..end, p.rows));
            start = end;
        }
        segments
    }
}

/// A decode step's sampler: its launch and its parameters' slot (`[batch, 4]` 32-bit words per
/// row: temperature as f32 bits, top-k, top-p as f32 bits, the step's uniform word).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampler {
    /// The launch (logits, parameters, tokens).
    pub step: Step,
    /// Where the runtime writes the parameters.
    pub params: TensorSlot,
}

/// A bucket's plan for the CPU executor: the whole graph (what the GPU leaves to its host tail
/// included) as calls of the artifact's CPU library and of the runtime's GEMM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuPlan {
    /// Graph inputs held in the arena (token ids, masks, positions, as i64), at the CPU memory
    /// plan's offsets.
    pub inputs: Vec<TensorSlot>,
    /// The calls, in order.
    pub steps: Vec<CpuStep>,
    /// Every graph output but the KV cache's, in the arena.
    pub outputs: Vec<TensorSlot>,
}

/// One call of the CPU executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuStep {
    /// What it calls.
    pub call: CpuCall,
    /// One argument per parameter, in order (the GPU kernel's order where there is one).
    pub args: Vec<Arg>,
    /// The graph node it computes (`{op}_{node}`).
    pub node: String,
}

/// What a CPU step calls.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CpuCall {
    /// The generated function `symbol` of the CPU library over the items `0..extent` of its
    /// parallel axis (split across threads by the executor).
    Kernel {
        /// Exported name.
        symbol: String,
        /// Items of the parallel axis.
        extent: u64,
    },
    /// `y = x w^T` (`w` stored `[n, k]`, or `[k, n]` without `transpose_b`) by the runtime's GEMM
    /// library, then the generated `epilogue` over its rows when there is one (arguments `x, w,
    /// [bias], [residual], out`; the product goes straight to `out` without an epilogue).
    Gemm {
        /// Rows.
        m: u64,
        /// Product columns (before SwiGLU halves them).
        n: u64,
        /// Contraction.
        k: u64,
        /// `w` is `[n, k]`.
        transpose_b: bool,
        /// Whether `bias` and `residual` arguments follow `w`.
        bias: bool,
        /// See `bias`.
        residual: bool,
        /// The epilogue's symbol.
        epilogue: Option<String>,
    },
}

/// The model facts inputs are validated and outputs shaped by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// A causal LM (`logits`) rather than an encoder.
    pub decoder: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Length of a learned position table, if any.
    pub max_positions: Option<usize>,
    /// Size of the token type table of a model with a `token_type_ids` input (BERT); `None` for
    /// a model without one.
    pub type_vocab_size: Option<usize>,
    /// The graph outputs, by name.
    pub outputs: Vec<String>,
}

impl ModelSummary {
    /// The summary of a model with input contract `contract` and graph outputs `outputs`.
    pub fn new(contract: InputContract, outputs: Vec<String>) -> ModelSummary {
        ModelSummary {
            decoder: contract.decoder,
            vocab_size: contract.vocab_size,
            max_positions: contract.max_positions,
            type_vocab_size: contract.type_vocab_size,
            outputs,
        }
    }

    /// The input contract requests are validated against.
    pub fn contract(&self) -> InputContract {
        InputContract {
            decoder: self.decoder,
            vocab_size: self.vocab_size,
            max_positions: self.max_positions,
            type_vocab_size: self.type_vocab_size,
        }
    }
}

/// One compiled bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketEntry {
    /// Batch size.
    pub batch: usize,
    /// Sequence length (1 for decode).
    pub seq: usize,
    /// KV-cache capacity (decode buckets).
    pub context: Option<usize>,
    /// The static graph's file, relative to the artifact.
    pub graph: String,
    /// Its kernels, in execution order.
    pub kernels: Vec<String>,
    /// How it runs on a GPU; `None` when some of its ops have no GPU kernel (`no_gpu`).
    pub plan: Option<ExecPlan>,
    /// `{op}_{node}` of the ops without a GPU kernel.
    pub no_gpu: Vec<String>,
    /// `{op}_{node}` of the ops (or view outputs) that keep the bucket from having a CPU plan.
    pub no_cpu: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan of `steps` launches of a chunk whose `logits` are `[1, 520, 8]`, in `pieces`.
    fn plan(steps: usize, pieces: &[(usize, usize)]) -> ExecPlan {
        let step = Step {
            kernel: "k".into(),
            args: Vec::new(),
            launch: Launch {
                grid: [1; 3],
                block: [1; 3],
                shared_bytes: 0,
            },
            node: "gemm_1".into(),
            fallback: None,
            base_only: false,
        };
        ExecPlan {
            arena_bytes: 0,
            inputs: Vec::new(),
            cache_inputs: Vec::new(),
            outputs: vec![TensorSlot {
                name: LOGITS.into(),
                offset: 0,
                dtype: DType::BF16,
                shape: vec![1, 520, 8],
            }],
            cache_outputs: Vec::new(),
            steps: vec![step; steps],
            tokens: None,
            advances: false,
            sampler: None,
            logits_pieces: pieces
                .iter()
                .map(|&(steps, rows)| LogitsPiece { steps, rows })
                .collect(),
            host_tail: None,
            cpu: None,
        }
    }

    #[test]
    fn logits_pieces_split_the_steps_where_rows_become_final() {
        let p = plan(10, &[(7, 256), (8, 512), (9, 520)]);
        assert_eq!(p.check_logits_pieces(), Ok(()));
        // The last segment runs to the end of the plan.
        assert_eq!(
            p.logits_segments(),
            [(0..7, 256), (7..8, 512), (8..10, 520)]
        );
        assert_eq!(plan(10, &[]).logits_segments(), [(0..10, 520)]);
    }

    /// On a GPU that runs sm_90a, the steps only its fallback needs go, and the logits pieces
    /// still end after the same launches.
    #[test]
    fn base_only_steps_drop_out_with_the_pieces_counted_again() {
        let mut p = plan(10, &[(7, 256), (8, 512), (9, 520)]);
        for i in [1, 4] {
            p.steps[i].base_only = true;
            p.steps[i].node = format!("norm_{i}");
        }
        let kept: Vec<String> = (p.steps.iter())
            .filter(|s| !s.base_only)
            .map(|s| s.node.clone())
            .collect();
        p.drop_base_only();
        assert_eq!(
            p.steps.iter().map(|s| &s.node).collect::<Vec<_>>(),
            kept.iter().collect::<Vec<_>>()
        );
        let steps: Vec<usize> = p.logits_pieces.iter().map(|q| q.steps).collect();
        assert_eq!(steps, [5, 6, 7]);
        assert_eq!(p.check_logits_pieces(), Ok(()));
        // A plan without base-only steps is left as it is.
        let mut q = plan(10, &[(7, 256), (9, 520)]);
        q.drop_base_only();
        assert_eq!(q, plan(10, &[(7, 256), (9, 520)]));
    }

    #[test]
    fn logits_pieces_out_of_order_or_short_are_refused() {
        for (pieces, why) in [
            (&[(7, 256), (7, 520)][..], "does not follow"),
            (&[(7, 256), (8, 256), (9, 520)], "does not follow"),
            (&[(0, 520)], "does not follow"),
            (&[(7, 256), (11, 520)], "within 10 steps"),
            (&[(7, 256), (8, 512)], "ends at row 512 of 520"),
        ] {
            let err = plan(10, pieces).check_logits_pieces().unwrap_err();
            assert!(err.contains(why), "{pieces:?}: {err}");
        }
        let mut no_logits = plan(10, &[(10, 520)]);
        no_logits.outputs.clear();
        assert!(no_logits.check_logits_pieces().is_err());
    }
}
