//! The artifact's execution plans and static memory plan: every bucket's kernel launches with
//! each argument an address in one device allocation `[weights | KV cache | arena]`.
//!
//! - Weights (folded, see `fold.rs`) and the RoPE tables the kernels read are laid out once, in
//!   name order, each at a multiple of `ALIGN` bytes; `weights.safetensors` is written in exactly
//!   that layout, so its data section is the weights region byte for byte.
//! - The KV cache has one slot per `past_*` input, sized for the largest decode batch; a
//!   `CacheWrite` updates its slot in place and its `present_*` output is that slot. Paged
//!   ([`KvPaging`]), each slot is a pool of blocks and the region ends with the block table.
//! - Activations, scratch buffers and the graph's inputs and outputs share the arena: each lives
//!   from the node that writes it to the last node that reads it (through views), and
//!   `memory::place` gives buffers alive at once disjoint offsets. Buckets never run at once, so
//!   the arena is the largest bucket's footprint.
//!
//! Views are not copies: a value read through reshapes, head splits and slices is its source's
//! storage at an element offset, which is how `lower.rs` configured the kernels that read it.

use std::collections::BTreeMap;

use kiln_ir::artifact::{
    align, Arg, CachePaging, CpuCall, CpuPlan, CpuStep, ExecPlan, KernelEntry, MemoryPlan,
    ParamType, Region, Step, TensorSlot, ALIGN,
};
use kiln_ir::io::aligned_layout;
use kiln_ir::{DType, Graph, NodeId, Op, Tensor};
use kiln_kernels::paging::Paging;

use crate::fold::{fold_weights, Folded};
use crate::fusion::cost::is_view;
use crate::lower::{
    is_cache, lower, CpuKernel, CpuLaunch, KernelLaunch, Lowered, Operand, RopeTable,
};

/// Why an artifact cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The graph could not be rebuilt with its weights folded.
    #[error("weight folding failed: {0}")]
    Fold(#[from] kiln_ir::IrError),
    /// A value the plan cannot place.
    #[error("{0}")]
    Layout(String),
}

/// How the compiler pages KV caches: blocks of `block` keys, `blocks` of them per cache input
/// (block 0 included; `None`: as many as the largest decode batch can hold at full context,
/// plus block 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPaging {
    /// Keys per block (a power of two).
    pub block: u32,
    /// Blocks per pool.
    pub blocks: Option<usize>,
}

impl KvPaging {
    /// Blocks in each pool of caches of `rows` rows, `entries` table entries each.
    pub fn pool_blocks(&self, rows: usize, entries: usize) -> usize {
        self.blocks
            .unwrap_or_else(|| kiln_kernels::paging::whole_rows_pool(rows, entries))
    }
}

/// One bucket's graph as the artifact stores it (weights folded) and how it runs.
pub struct PlannedBucket {
    /// The static graph with its weight-only values folded.
    pub graph: Graph,
    /// Its launches and buffers; `None` when some op has no GPU kernel (listed in `unsupported`).
    pub plan: Option<ExecPlan>,
    /// `{op}_{node}` of the ops without a kernel.
    pub unsupported: Vec<String>,
    /// `{op}_{node}` of the ops (or view outputs) that keep it from having a CPU plan.
    pub no_cpu: Vec<String>,
}

/// Everything the artifact writer needs beyond the bucket graphs.
pub struct ArtifactPlan {
    /// The buckets, in the order given.
    pub buckets: Vec<PlannedBucket>,
    /// Every kernel the plans launch.
    pub kernels: Lowered,
    /// The device allocation's layout.
    pub memory: MemoryPlan,
    /// Folded weight name -> its definition (output `value`), evaluated when weights are written.
    pub folded: BTreeMap<String, Graph>,
    /// RoPE table name -> its contents (`[positions, head_dim / 2]`, f32).
    pub tables: BTreeMap<String, Tensor>,
    /// The CPU kernels the CPU plans call, by symbol.
    pub cpu_kernels: BTreeMap<String, CpuKernel>,
    /// The CPU plans' own memory plan, when they run on widened (f32) graphs.
    pub cpu_memory: Option<MemoryPlan>,
}

impl ArtifactPlan {
    /// The kernel table of the manifest.
    pub fn kernel_table(&self) -> Vec<KernelEntry> {
        let mut shared: BTreeMap<&str, u32> = BTreeMap::new();
        let steps = self
            .buckets
            .iter()
            .flat_map(|b| b.plan.iter().flat_map(|p| &p.steps));
        for step in steps.flat_map(|s| std::iter::once(s).chain(s.fallback.as_deref())) {
            let s = shared.entry(&step.kernel).or_default();
            *s = (*s).max(step.launch.shared_bytes);
        }
        self.kernels
            .kernels
            .values()
            .map(|k| KernelEntry {
                name: k.name.clone(),
                params: k.signature.clone(),
                max_shared_bytes: shared.get(k.name.as_str()).copied().unwrap_or(0),
                path: k.path,
                image: k.image,
            })
            .collect()
    }
}

/// Plans `graphs` (static bucket graphs, prefill and decode alike) as one artifact; with
/// `cpu_plans`, half-precision graphs also get CPU plans, made from their f32 twins
/// (`widen.rs`) over a memory plan of their own.
pub fn plan_artifact(
    graphs: &[&Graph],
    cpu_plans: bool,
    paging: Option<KvPaging>,
) -> Result<ArtifactPlan, PlanError> {
    let mut art = plan_graphs(graphs, paging)?;
    if cpu_plans && art.buckets.iter().any(|b| crate::widen::has_half(&b.graph)) {
        let widened = art
            .buckets
            .iter()
            .map(|b| crate::widen::widen(&b.graph))
            .collect::<Result<Vec<_>, _>>()?;
        let wide = plan_graphs(&widened.iter().collect::<Vec<_>>(), paging)?;
        for (bucket, twin) in art.buckets.iter_mut().zip(wide.buckets) {
            if let Some(plan) = bucket.plan.as_mut() {
                plan.cpu = twin.plan.and_then(|p| p.cpu);
            }
            bucket.no_cpu = twin.no_cpu;
        }
        art.cpu_kernels = wide.cpu_kernels;
        art.cpu_memory = Some(wide.memory);
    }
    Ok(art)
}

/// Plans `graphs` as they are typed: GPU plans, and CPU plans for f32 graphs.
fn plan_graphs(graphs: &[&Graph], paging: Option<KvPaging>) -> Result<ArtifactPlan, PlanError> {
    let rows = crate::lower::batch_rows(graphs.iter().copied());
    let cache_rows = crate::lower::cache_rows(graphs.iter().copied());
    let mut kernels = Lowered::new(rows, paging, cache_rows);
    let mut folded = BTreeMap::new();
    let mut lowered = Vec::new();
    for g in graphs {
        let Folded { graph, definitions } = fold_weights(g)?;
        folded.extend(definitions);
        let launches = lower(&graph, &mut kernels);
        lowered.push((graph, launches));
    }

    // RoPE tables long enough for every position a bucket can see: a prefill bucket's
    // positions are below its length (the last axis of its `[B, S]` inputs), a decode bucket's
    // below its cache capacity.
    let dim = |ty: &kiln_ir::TensorType, axis: usize| {
        ty.shape
            .get(axis)
            .and_then(|d| d.as_const())
            .map_or(0, |v| v.max(0) as usize)
    };
    let positions = graphs
        .iter()
        .flat_map(|g| g.nodes().map(|(_, n)| n))
        .map(|n| match n.op {
            Op::Input(_) if n.ty.rank() == 2 => dim(&n.ty, 1),
            Op::CacheWrite => dim(&n.ty, 2),
            _ => 0,
        })
        .max()
        .unwrap_or(0)
        .max(1);
    let mut tables = BTreeMap::new();
    for (_, launches) in &lowered {
        for (_, node) in &launches.nodes {
            for launch in &node.launches {
                for (_, op) in &launch.args {
                    if let Operand::Rope { table, sin } = op {
                        tables
                            .entry(table_name(table, *sin))
                            .or_insert_with(|| rope_table(table, positions, *sin));
                    }
                }
            }
        }
    }

    // Weights region: every weight of every bucket, then the tables, in name order.
    let mut entries: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
    for (graph, _) in &lowered {
        for (_, name, ty) in graph.weights() {
            entries.insert(name.to_string(), (ty.dtype, static_shape(ty, name)?));
        }
    }
    for (name, t) in &tables {
        entries.insert(name.clone(), (DType::F32, t.shape.clone()));
    }
    let list: Vec<(String, DType, Vec<usize>)> =
        entries.into_iter().map(|(n, (d, s))| (n, d, s)).collect();
    let weights = aligned_layout(&list, ALIGN);
    let weights_bytes = weights.last().map_or(0, |s| s.offset + s.bytes());

    // Cache region: one slot per `past_*` input, the largest shape any bucket declares.
    let mut cache_shapes: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
    for (graph, _) in &lowered {
        for (_, name, ty) in graph.inputs().filter(|(_, n, _)| is_cache(n)) {
            let shape = static_shape(ty, name)?;
            let slot = cache_shapes
                .entry(name.to_string())
                .or_insert((ty.dtype, shape.clone()));
            if shape.iter().product::<usize>() > slot.1.iter().product::<usize>() {
                slot.1 = shape;
            }
        }
    }
    let mut list: Vec<(String, DType, Vec<usize>)> = cache_shapes
        .into_iter()
        .map(|(n, (d, s))| (n, d, s))
        .collect();
    let cache_paging = match paging {
        Some(p) if !list.is_empty() => Some(page_caches(&mut list, p)?),
        _ => None,
    };
    let cache = aligned_layout(&list, ALIGN);
    let mut cache_bytes = cache.last().map_or(0, |s| s.offset + s.bytes());
    let cache_paging = cache_paging.map(|mut p| {
        p.table = align(cache_bytes);
        cache_bytes = p.table + p.table_bytes();
        p
    });

    // Counters: every launch counts from offset 0 of one region, as large as the most any uses.
    let counter_bytes = lowered
        .iter()
        .flat_map(|(_, launches)| &launches.nodes)
        .flat_map(|(_, node)| &node.launches)
        .flat_map(|launch| &launch.args)
        .filter_map(|(_, op)| match op {
            Operand::Counters(bytes) => Some(*bytes),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let mut memory = MemoryPlan {
        weights_bytes,
        weights,
        cache_bytes,
        cache,
        paging: cache_paging,
        counter_bytes,
        arena_bytes: 0,
    };
    let mut buckets = Vec::new();
    let mut cpu_kernels = BTreeMap::new();
    for (graph, launches) in lowered {
        let tail = host_tail(&graph, &launches)?;
        // Without a GPU plan there is no CPU plan either (they share the memory plan): the ops
        // that keep the GPU plan from existing keep the CPU one too.
        let (plan, no_cpu) = if launches.unsupported.is_empty() || tail.is_some() {
            let (plan, no_cpu) =
                plan_bucket(&graph, &launches, &memory, &kernels, tail, &mut cpu_kernels)?;
            memory.arena_bytes = memory.arena_bytes.max(plan.arena_bytes);
            (Some(plan), no_cpu)
        } else {
            (None, launches.unsupported.clone())
        };
        buckets.push(PlannedBucket {
            graph,
            plan,
            unsupported: launches.unsupported,
            no_cpu,
        });
    }
    memory.arena_bytes = align(memory.arena_bytes);
    Ok(ArtifactPlan {
        buckets,
        kernels,
        memory,
        folded,
        tables,
        cpu_kernels,
        cpu_memory: None,
    })
}

/// Turns the cache slots `list` (`[rows, KVH, T, D]` each) into pools of `paging`'s blocks, and
/// returns the paging (its table not yet placed).
fn page_caches(
    list: &mut [(String, DType, Vec<usize>)],
    paging: KvPaging,
) -> Result<CachePaging, PlanError> {
    let layout = |e: String| PlanError::Layout(format!("paged KV cache: {e}"));
    let first = list[0].0.clone();
    let [rows, _, context, _] = list[0].2[..] else {
        return Err(layout(format!(
            "`{first}` is not [rows, heads, keys, head dim]"
        )));
    };
    let block = paging.block as usize;
    if !block.is_power_of_two() {
        return Err(layout(format!(
            "blocks of {block} keys; a block holds a power of two"
        )));
    }
    let entries = context.div_ceil(block);
    let blocks = paging.pool_blocks(rows, entries);
    // The kernels' layout: `Lowered::paging` paged them by the same numbers.
    debug_assert_eq!(
        Paging::new(paging.block, context as u32, blocks as u32).map(|p| p.entries as usize),
        Some(entries)
    );
    if blocks <= entries {
        return Err(layout(format!(
            "{blocks} blocks hold no sequence of the context: {context} keys need {entries} blocks beside block 0"
        )));
    }
    for (name, _, shape) in list.iter_mut() {
        let [r, heads, keys, dim] = shape[..] else {
            return Err(layout(format!(
                "`{name}` is not [rows, heads, keys, head dim]"
            )));
        };
        if (r, keys) != (rows, context) {
            return Err(layout(format!(
                "`{name}` has {r} rows of {keys} keys; `{first}` has {rows} of {context}"
            )));
        }
        if u32::try_from(blocks * heads * block * dim).is_err() {
            return Err(layout(format!(
                "`{name}`'s pool of {blocks} blocks exceeds 2^32 elements"
            )));
        }
        *shape = vec![blocks, heads, block, dim];
    }
    Ok(CachePaging {
        block_tokens: block,
        blocks,
        rows,
        entries,
        table: 0,
    })
}

fn static_shape(ty: &kiln_ir::TensorType, name: &str) -> Result<Vec<usize>, PlanError> {
    ty.shape
        .iter()
        .map(|d| d.as_const().and_then(|v| usize::try_from(v).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| PlanError::Layout(format!("`{name}` has a symbolic shape {ty}")))
}

/// The weights-region name of a RoPE table.
fn table_name(t: &RopeTable, sin: bool) -> String {
    format!(
        "kiln.rope_{}(theta={}, head_dim={}, {:?})",
        if sin { "sin" } else { "cos" },
        t.theta,
        t.head_dim,
        t.scaling
    )
}

/// `cos` or `sin` of `position * inv_freq[i]`, in f64 rounded to f32, `[positions, head_dim / 2]`.
fn rope_table(t: &RopeTable, positions: usize, sin: bool) -> Tensor {
    let inv = t.scaling.inv_freq(t.theta, t.head_dim as usize);
    let mut values = Vec::with_capacity(positions * inv.len());
    for p in 0..positions {
        for f in &inv {
            let (s, c) = (p as f64 * f).sin_cos();
            values.push(if sin { s } else { c } as f32);
        }
    }
    Tensor::f32(vec![positions, inv.len()], values)
}

/// Where a value lives before the arena is placed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Home {
    /// A weight or table: its byte offset in the weights region.
    Weight(u64),
    /// A KV-cache slot: its byte offset in the cache region.
    Cache(u64),
    /// Arena buffer `i` (a node's value or an input).
    Buffer(usize),
}

/// The ops without a GPU kernel, outputs that are strided views, and everything computed from
/// them, when no kernel reads any of it (a tail such as sentence-transformers pooling): a host
/// graph reading the GPU values it needs as inputs `kiln.value.N`. `None` when there is nothing to run on the host, or when a kernel
/// would need a host value (then the bucket has no GPU plan).
struct HostTail {
    graph: Graph,
    /// GPU values the host graph reads.
    boundary: Vec<NodeId>,
    /// Graph outputs computed on the host.
    outputs: Vec<String>,
}

fn host_tail(
    g: &Graph,
    launches: &crate::lower::GraphLaunches,
) -> Result<Option<HostTail>, PlanError> {
    let mut in_tail = vec![false; g.len()];
    for id in &launches.unsupported_nodes {
        in_tail[id.index()] = true;
    }
    // An output that is a strided view of a GPU value (CLS pooling: a slice of the hidden
    // states) is gathered on the host too.
    for o in g.outputs() {
        if output_is_view(g, o.node) {
            in_tail[o.node.index()] = true;
        }
    }
    if !in_tail.iter().any(|&t| t) {
        return Ok(None);
    }
    for (id, node) in g.nodes() {
        if node.args.iter().any(|a| in_tail[a.index()]) {
            in_tail[id.index()] = true;
        }
    }
    if launches.nodes.iter().any(|(id, _)| in_tail[id.index()]) {
        return Ok(None);
    }
    let mut tail = Graph::new();
    let mut copied: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut boundary = Vec::new();
    fn copy(
        g: &Graph,
        id: NodeId,
        in_tail: &[bool],
        tail: &mut Graph,
        copied: &mut BTreeMap<NodeId, NodeId>,
        boundary: &mut Vec<NodeId>,
    ) -> Result<NodeId, kiln_ir::IrError> {
        if let Some(&c) = copied.get(&id) {
            return Ok(c);
        }
        let node = g.node(id);
        let new = match &node.op {
            Op::Input(name) => tail.input(name, node.ty.dtype, node.ty.shape.clone())?,
            Op::Weight(name) => tail.weight(name, node.ty.dtype, node.ty.shape.clone())?,
            Op::Scalar(v) => tail.scalar(*v, node.ty.dtype),
            op if in_tail[id.index()] || is_view(op) => {
                let args = node
                    .args
                    .iter()
                    .map(|a| copy(g, *a, in_tail, tail, copied, boundary))
                    .collect::<Result<Vec<_>, _>>()?;
                tail.add(op.clone(), &args)?
            }
            _ => {
                boundary.push(id);
                tail.input(&value_name(id), node.ty.dtype, node.ty.shape.clone())?
            }
        };
        copied.insert(id, new);
        Ok(new)
    }
    let mut outputs = Vec::new();
    for o in g.outputs() {
        if in_tail[o.node.index()] {
            let v = copy(g, o.node, &in_tail, &mut tail, &mut copied, &mut boundary)?;
            tail.set_output(&o.name, v)?;
            outputs.push(o.name.clone());
        }
    }
    Ok(Some(HostTail {
        graph: tail,
        boundary,
        outputs,
    }))
}

/// `id` with its reshapes looked through (a reshape keeps a value's storage).
fn stripped(g: &Graph, mut id: NodeId) -> NodeId {
    while let Op::Reshape(_) = g.node(id).op {
        id = g.node(id).args[0];
    }
    id
}

/// Whether output value `id` is a strided view of another value (a CLS slice), not a block of
/// its own.
fn output_is_view(g: &Graph, id: NodeId) -> bool {
    is_view(&g.node(stripped(g, id)).op)
}

/// The name under which a GPU value the host tail reads is copied back.
fn value_name(id: NodeId) -> String {
    format!("kiln.value.{}", id.0)
}

fn plan_bucket(
    g: &Graph,
    launches: &crate::lower::GraphLaunches,
    memory: &MemoryPlan,
    kernels: &Lowered,
    tail: Option<HostTail>,
    cpu_kernels: &mut BTreeMap<String, CpuKernel>,
) -> Result<(ExecPlan, Vec<String>), PlanError> {
    let weight_at: BTreeMap<&str, u64> = memory
        .weights
        .iter()
        .map(|s| (s.name.as_str(), s.offset))
        .collect();
    let cache_at: BTreeMap<&str, u64> = memory
        .cache
        .iter()
        .map(|s| (s.name.as_str(), s.offset))
        .collect();
    let end = g.len();
    // Storage of every value: its root value and element offset (views and in-place writes
    // resolved), and the arena buffers with their lifetimes.
    let mut root: Vec<(NodeId, u64)> = Vec::with_capacity(end);
    let mut homes: BTreeMap<NodeId, Home> = BTreeMap::new();
    let mut buffers: Vec<crate::memory::Lifetime> = Vec::new();
    let mut buffer_node: Vec<Option<NodeId>> = Vec::new();
    for (id, node) in g.nodes() {
        let r = match &node.op {
            Op::Slice { axis, start, .. } => {
                let (base, offset) = root[node.args[0].index()];
                let src = static_shape(g.ty(node.args[0]), "a slice operand")?;
                let inner: usize = src[axis + 1..].iter().product();
                let start = start.as_const().unwrap_or(0) as u64;
                (base, offset + start * inner as u64)
            }
            op if is_view(op) => root[node.args[0].index()],
            Op::CacheWrite => root[node.args[0].index()],
            _ => (id, 0),
        };
        root.push(r);
        if r.0 != id {
            continue;
        }
        let bytes = static_shape(&node.ty, "a value")?.iter().product::<usize>() as u64
            * node.ty.dtype.size_bytes() as u64;
        let home = match &node.op {
            Op::Weight(name) => Home::Weight(*weight_at.get(name.as_str()).ok_or_else(|| {
                PlanError::Layout(format!(
                    "weight `{name}` has no place in the weights region"
                ))
            })?),
            Op::Input(name) if is_cache(name) => Home::Cache(cache_at[name.as_str()]),
            op => {
                // Inputs are written before the first step; values when their node runs.
                let first = if matches!(op, Op::Input(_)) {
                    0
                } else {
                    id.index()
                };
                buffers.push(crate::memory::Lifetime {
                    bytes,
                    first,
                    last: first,
                });
                buffer_node.push(Some(id));
                Home::Buffer(buffers.len() - 1)
            }
        };
        homes.insert(id, home);
    }
    // A value is alive until the last node that reads it or any view of it; outputs to the end.
    let extend = |buffers: &mut Vec<crate::memory::Lifetime>, id: NodeId, at: usize| {
        if let Some(Home::Buffer(b)) = homes.get(&root[id.index()].0) {
            buffers[*b].last = buffers[*b].last.max(at);
        }
    };
    for (id, node) in g.nodes() {
        for a in &node.args {
            extend(&mut buffers, *a, id.index());
        }
    }
    // A launch may read values its node's operands do not name (a decode attention reads the
    // new keys and values of the cache writes it does): those live until it runs too.
    for (id, node) in &launches.nodes {
        let launched = node.launches.iter().flat_map(|l| {
            let fallback = l.fallback.iter().flat_map(|f| &f.args);
            l.args.iter().chain(fallback)
        });
        for (_, operand) in launched {
            if let Operand::Value(v) = operand {
                extend(&mut buffers, *v, id.index());
            }
        }
    }
    for o in g.outputs() {
        extend(&mut buffers, o.node, end);
    }
    for b in tail.iter().flat_map(|t| &t.boundary) {
        extend(&mut buffers, *b, end);
    }
    for (id, node) in g.nodes() {
        if matches!(node.op, Op::Input(_)) {
            extend(&mut buffers, id, end);
        }
    }
    // Scratch buffers live while their node runs.
    let mut scratch_of: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
    for (id, node) in &launches.nodes {
        for bytes in &node.scratch {
            buffers.push(crate::memory::Lifetime {
                bytes: *bytes,
                first: id.index(),
                last: id.index(),
            });
            buffer_node.push(None);
            scratch_of.entry(*id).or_default().push(buffers.len() - 1);
        }
    }
    // Outputs that are strided views (a CLS slice) get a contiguous buffer of their own, which
    // the CPU plan copies them into at the end (the GPU gathers them in its host tail).
    let mut copied_outputs: Vec<(usize, usize)> = Vec::new();
    for (i, o) in g.outputs().iter().enumerate() {
        if output_is_view(g, o.node) {
            let ty = g.ty(o.node);
            let bytes = static_shape(ty, &o.name)?.iter().product::<usize>() as u64
                * ty.dtype.size_bytes() as u64;
            buffers.push(crate::memory::Lifetime {
                bytes,
                first: end,
                last: end,
            });
            buffer_node.push(None);
            copied_outputs.push((i, buffers.len() - 1));
        }
    }
    // A decode step's chosen tokens (i64, one per row) are written after every other step, from
    // logits the GPU computed (not ones its host tail computes).
    let gpu_logits = !tail
        .as_ref()
        .is_some_and(|t| t.outputs.iter().any(|o| o == crate::compile::LOGITS));
    let choice = launches.tokens.as_ref().filter(|_| gpu_logits);
    let tokens_buffer = choice.map(|t| {
        buffers.push(crate::memory::Lifetime {
            bytes: u64::from(t.rows) * 8,
            first: end,
            last: end,
        });
        buffer_node.push(None);
        buffers.len() - 1
    });
    // The sampler's parameters are written before the replay and read after it: alive
    // throughout, like the inputs.
    let params_buffer = choice.map(|t| {
        buffers.push(crate::memory::Lifetime {
            bytes: u64::from(t.rows) * 16,
            first: 0,
            last: end,
        });
        buffer_node.push(None);
        buffers.len() - 1
    });
    let (offsets, arena_bytes) = crate::memory::place(&buffers);

    let address = |id: NodeId| -> Result<Arg, PlanError> {
        let (base, elems) = root[id.index()];
        let offset = elems * g.ty(base).dtype.size_bytes() as u64;
        Ok(match homes[&base] {
            Home::Weight(at) => Arg::Ptr(Region::Weights, at + offset),
            Home::Cache(at) => Arg::Ptr(Region::Cache, at + offset),
            Home::Buffer(b) => Arg::Ptr(Region::Arena, offsets[b] + offset),
        })
    };
    let operand = |id: NodeId, op: &Operand| -> Result<Arg, PlanError> {
        Ok(match op {
            Operand::Value(v) => address(*v)?,
            Operand::Scratch(i) => Arg::Ptr(Region::Arena, offsets[scratch_of[&id][*i]]),
            Operand::Rope { table, sin } => {
                let name = table_name(table, *sin);
                Arg::Ptr(Region::Weights, weight_at[name.as_str()])
            }
            Operand::U32(v) => Arg::U32(*v),
            Operand::Arena(offset) => Arg::Ptr(Region::Arena, *offset),
            Operand::Counters(_) => Arg::Ptr(Region::Counters, 0),
            Operand::BlockTable => {
                let paging = memory.paging.as_ref().ok_or_else(|| {
                    PlanError::Layout("a launch reads the block table of a dense cache".into())
                })?;
                Arg::Ptr(Region::Cache, paging.table)
            }
            Operand::Tokens => {
                let b = tokens_buffer.ok_or_else(|| {
                    PlanError::Layout("a launch writes tokens the bucket does not choose".into())
                })?;
                Arg::Ptr(Region::Arena, offsets[b])
            }
            Operand::SamplingParams => {
                let b = params_buffer.ok_or_else(|| {
                    PlanError::Layout("a launch samples in a bucket that chooses no tokens".into())
                })?;
                Arg::Ptr(Region::Arena, offsets[b])
            }
        })
    };
    let step = |id: NodeId, launch: &KernelLaunch, node: String| -> Result<Step, PlanError> {
        let signature = &kernels.kernels[&launch.kernel].signature;
        let args = launch
            .args
            .iter()
            .zip(signature)
            .map(|((_, op), (_, ty))| {
                Ok(match (operand(id, op)?, ty) {
                    (Arg::Ptr(region, at), ParamType::TensorMap(_)) => Arg::TensorMap(region, at),
                    (arg, _) => arg,
                })
            })
            .collect::<Result<Vec<_>, PlanError>>()?;
        debug_assert_eq!(args.len(), signature.len());
        Ok(Step {
            kernel: launch.kernel.clone(),
            args,
            launch: launch.launch,
            node,
            fallback: None,
        })
    };
    let mut steps = Vec::new();
    for (id, node) in &launches.nodes {
        let name = format!("{}_{}", g.node(*id).op.name(), id.0);
        for launch in &node.launches {
            let mut s = step(*id, launch, name.clone())?;
            if let Some(fallback) = &launch.fallback {
                s.fallback = Some(Box::new(step(*id, fallback, name.clone())?));
            }
            steps.push(s);
        }
    }
    let (mut tokens, mut sampler) = (None, None);
    if let (Some(choice), Some(b), Some(pb)) = (choice, tokens_buffer, params_buffer) {
        // Its operands are graph values and the token slot: no node's scratch.
        let after = NodeId(g.len() as u32 - 1);
        steps.push(step(after, &choice.launch, "greedy_tokens".into())?);
        tokens = Some(TensorSlot {
            name: "tokens".into(),
            offset: offsets[b],
            dtype: DType::I64,
            shape: vec![choice.rows as usize],
        });
        sampler = Some(kiln_ir::artifact::Sampler {
            step: step(after, &choice.sampler, "sampled_tokens".into())?,
            params: TensorSlot {
                name: "sampling".into(),
                offset: offsets[pb],
                dtype: DType::I32,
                shape: vec![choice.rows as usize, 4],
            },
        });
    }
    // The CPU plan: every kernel node's calls and every primitive's strided calls, in graph
    // order, then the copies of view outputs.
    let mut cpu_calls: Vec<(NodeId, Option<&Vec<CpuLaunch>>)> = launches
        .nodes
        .iter()
        .map(|(id, n)| (*id, n.cpu.as_ref()))
        .chain(
            launches
                .unsupported_nodes
                .iter()
                .zip(&launches.unsupported_cpu)
                .map(|(id, c)| (*id, c.as_ref())),
        )
        .collect();
    cpu_calls.sort_by_key(|(id, _)| *id);
    let mut copies = Vec::new();
    for &(i, buffer) in &copied_outputs {
        let out = Operand::Arena(offsets[buffer]);
        copies.push((
            g.outputs()[i].node,
            crate::lower::materialize(g, g.outputs()[i].node, out),
        ));
    }
    let mut steps_cpu = Vec::new();
    let mut no_cpu = Vec::new();
    let calls = cpu_calls
        .iter()
        .map(|(id, c)| (*id, c.map(|c| c.iter().collect::<Vec<_>>())))
        .chain(
            copies
                .iter()
                .map(|(id, c)| (*id, c.as_ref().map(|c| vec![c]))),
        );
    for (id, calls) in calls {
        let node = format!("{}_{}", g.node(id).op.name(), id.0);
        let Some(calls) = calls else {
            no_cpu.push(node);
            continue;
        };
        for call in calls {
            let args = call
                .args
                .iter()
                .map(|op| operand(id, op))
                .collect::<Result<Vec<_>, _>>()?;
            steps_cpu.push(CpuStep {
                call: cpu_call(call, cpu_kernels),
                args,
                node: node.clone(),
            });
        }
    }
    let slot = |name: &str, id: NodeId| -> Result<TensorSlot, PlanError> {
        let Arg::Ptr(Region::Arena, offset) = address(id)? else {
            return Err(PlanError::Layout(format!("`{name}` is not in the arena")));
        };
        let ty = g.ty(id);
        Ok(TensorSlot {
            name: name.to_string(),
            offset,
            dtype: ty.dtype,
            shape: static_shape(ty, name)?,
        })
    };
    let mut inputs = Vec::new();
    let mut cache_inputs = Vec::new();
    for (id, name, _) in g.inputs() {
        if is_cache(name) {
            cache_inputs.push(name.to_string());
        } else {
            inputs.push(slot(name, id)?);
        }
    }
    let mut outputs = Vec::new();
    let mut cache_outputs = Vec::new();
    for b in tail.iter().flat_map(|t| &t.boundary) {
        outputs.push(slot(&value_name(*b), *b)?);
    }
    for o in g.outputs() {
        if tail.as_ref().is_some_and(|t| t.outputs.contains(&o.name)) {
            continue;
        }
        // An output read through a view must still be one contiguous block (reshapes only).
        match g.node(stripped(g, o.node)).op {
            Op::CacheWrite => cache_outputs.push(o.name.clone()),
            ref op if is_view(op) => {
                return Err(PlanError::Layout(format!(
                    "output `{}` is a strided view ({})",
                    o.name,
                    op.name()
                )))
            }
            _ => outputs.push(slot(&o.name, o.node)?),
        }
    }
    let cpu = match no_cpu.is_empty().then_some(steps_cpu) {
        Some(steps) => {
            let mut outputs = Vec::new();
            for (i, o) in g.outputs().iter().enumerate() {
                if let Some(&(_, buffer)) = copied_outputs.iter().find(|(j, _)| *j == i) {
                    let ty = g.ty(o.node);
                    outputs.push(TensorSlot {
                        name: o.name.clone(),
                        offset: offsets[buffer],
                        dtype: ty.dtype,
                        shape: static_shape(ty, &o.name)?,
                    });
                } else if !matches!(g.node(stripped(g, o.node)).op, Op::CacheWrite) {
                    outputs.push(slot(&o.name, o.node)?);
                }
            }
            Some(CpuPlan {
                inputs: inputs.clone(),
                steps,
                outputs,
            })
        }
        None => None,
    };
    let plan = ExecPlan {
        arena_bytes,
        inputs,
        cache_inputs,
        outputs,
        cache_outputs,
        steps,
        tokens,
        advances: choice.is_some_and(|c| c.advances) && tokens_buffer.is_some(),
        sampler,
        host_tail: tail.map(|t| t.graph),
        cpu,
    };
    Ok((plan, no_cpu))
}

/// The CPU call of `launch`, registering the generated functions it needs in `kernels`.
fn cpu_call(launch: &CpuLaunch, kernels: &mut BTreeMap<String, CpuKernel>) -> CpuCall {
    use kiln_kernels::cpu;
    let symbol = match &launch.kernel {
        CpuKernel::Norm(c) => cpu::norm::name(c),
        CpuKernel::Activation(a) => cpu::elementwise::name(*a),
        CpuKernel::Embedding(c) => cpu::embedding::name(c),
        CpuKernel::KvWrite(c) => cpu::kv_cache::name(c),
        CpuKernel::Attention(c) => cpu::attention::name(c),
        CpuKernel::Strided(c) => cpu::strided::name(c),
        CpuKernel::Gemm(c) => {
            let epilogue = cpu::epilogue::needed(c).then(|| {
                let name = cpu::epilogue::name(c);
                kernels.insert(name.clone(), launch.kernel.clone());
                name
            });
            return CpuCall::Gemm {
                m: u64::from(c.m),
                n: u64::from(c.n),
                k: u64::from(c.k),
                transpose_b: c.transpose_b,
                bias: c.bias,
                residual: c.residual,
                epilogue,
            };
        }
    };
    kernels.insert(symbol.clone(), launch.kernel.clone());
    CpuCall::Kernel {
        symbol,
        extent: launch.extent,
    }
}
