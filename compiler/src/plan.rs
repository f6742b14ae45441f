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
    align, Arg, CachePaging, CpuCall, CpuPlan, CpuStep, ExecPlan, KernelEntry, LogitsPiece,
    MemoryPlan, ParamType, Region, Step, TensorSlot, ALIGN,
};
use kiln_ir::io::aligned_layout;
use kiln_ir::{DType, Graph, NodeId, Op, Tensor};
use kiln_kernels::paging::Paging;

use crate::fold::{fold_weights, Folded};
use crate::fusion::cost::is_view;
use crate::lower::{
    is_cache, lower, CpuKernel, CpuLaunch, GraphLaunches, KernelLaunch, Lowered, Operand, RopeTable,
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
                cluster: k.cluster,
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

    let tables = rope_tables(graphs, &lowered);
    let (weights, weights_bytes) = weights_region(&lowered, &tables)?;
    let (cache, cache_bytes, cache_paging) = cache_region(&lowered, paging)?;
    let counter_bytes = counter_bytes(&lowered);
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

/// The RoPE tables the lowered graphs' launches read, by name, each long enough for every
/// position a bucket can see: a prefill bucket's positions are below its length (the last axis
/// of its `[B, S]` inputs), a decode bucket's below its cache capacity.
fn rope_tables(graphs: &[&Graph], lowered: &[(Graph, GraphLaunches)]) -> BTreeMap<String, Tensor> {
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
    for (_, launches) in lowered {
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
    tables
}

/// The weights region: every weight of every bucket, then the tables, in name order; and its
/// bytes.
fn weights_region(
    lowered: &[(Graph, GraphLaunches)],
    tables: &BTreeMap<String, Tensor>,
) -> Result<(Vec<TensorSlot>, u64), PlanError> {
    let mut entries: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
    for (graph, _) in lowered {
        for (_, name, ty) in graph.weights() {
            entries.insert(name.to_string(), (ty.dtype, static_shape(ty, name)?));
        }
    }
    for (name, t) in tables {
        entries.insert(name.clone(), (DType::F32, t.shape.clone()));
    }
    let list: Vec<(String, DType, Vec<usize>)> =
        entries.into_iter().map(|(n, (d, s))| (n, d, s)).collect();
    let weights = aligned_layout(&list, ALIGN);
    let weights_bytes = weights.last().map_or(0, |s| s.offset + s.bytes());
    Ok((weights, weights_bytes))
}

/// The cache region: one slot per `past_*` input, the largest shape any bucket declares, as
/// pools of blocks with their table under `paging`; and its bytes.
fn cache_region(
    lowered: &[(Graph, GraphLaunches)],
    paging: Option<KvPaging>,
) -> Result<(Vec<TensorSlot>, u64, Option<CachePaging>), PlanError> {
    let mut cache_shapes: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
    for (graph, _) in lowered {
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
    Ok((cache, cache_bytes, cache_paging))
}

/// The counters region: every launch counts from offset 0 of one region, as large as the most
/// any uses.
fn counter_bytes(lowered: &[(Graph, GraphLaunches)]) -> u64 {
    lowered
        .iter()
        .flat_map(|(_, launches)| &launches.nodes)
        .flat_map(|(_, node)| &node.launches)
        .flat_map(|launch| &launch.args)
        .filter_map(|(_, op)| match op {
            Operand::Counters(bytes) => Some(*bytes),
            _ => None,
        })
        .max()
        .unwrap_or(0)
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

/// `cos` or `sin` of `position * inv_freq[i]` (times YaRN's attention factor), in f64 rounded to
/// f32, `[positions, head_dim / 2]`.
fn rope_table(t: &RopeTable, positions: usize, sin: bool) -> Tensor {
    let inv = t.scaling.inv_freq(t.theta, t.head_dim as usize);
    let mut values = Vec::with_capacity(positions * inv.len());
    for p in 0..positions {
        for f in &inv {
            let (s, c) = t.scaling.sin_cos(p as f64, *f);
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

/// A bucket's execution plan: every value's home and the arena placed ([`Storage`]), the GPU
/// launches (the token choice and sampler last), the CPU calls, and the input and output slots;
/// with the nodes no CPU kernel covers (then the plan has no CPU part).
fn plan_bucket(
    g: &Graph,
    launches: &crate::lower::GraphLaunches,
    memory: &MemoryPlan,
    kernels: &Lowered,
    tail: Option<HostTail>,
    cpu_kernels: &mut BTreeMap<String, CpuKernel>,
) -> Result<(ExecPlan, Vec<String>), PlanError> {
    let gpu_logits = !tail
        .as_ref()
        .is_some_and(|t| t.outputs.iter().any(|o| o == crate::compile::LOGITS));
    // A decode step's chosen tokens come from logits the GPU computed (not its host tail's).
    let choice = launches.tokens.as_ref().filter(|_| gpu_logits);
    let mut storage = Storage::new(g, memory, launches, tail.as_ref(), choice)?;
    if gpu_logits && g.inputs().any(|(_, name, _)| is_cache(name)) {
        logits_alone(g, &mut storage);
    }
    let at = Addresses::new(g, memory, kernels, &storage);
    let (mut steps, logits_pieces) = gpu_steps(g, launches, &at)?;
    let (tokens, sampler) = match (choice, storage.tokens, storage.params) {
        (Some(choice), Some(b), Some(pb)) => {
            let (tokens, sampler) = token_choice(g, choice, &at, (b, pb), &mut steps)?;
            (Some(tokens), Some(sampler))
        }
        _ => (None, None),
    };
    let (steps_cpu, no_cpu) = at.cpu_steps(launches, cpu_kernels)?;
    let mut inputs = Vec::new();
    let mut cache_inputs = Vec::new();
    for (id, name, _) in g.inputs() {
        if is_cache(name) {
            cache_inputs.push(name.to_string());
        } else {
            inputs.push(at.slot(name, id)?);
        }
    }
    let (outputs, cache_outputs) = at.gpu_outputs(tail.as_ref())?;
    let cpu = match no_cpu.is_empty().then_some(steps_cpu) {
        Some(steps) => Some(CpuPlan {
            inputs: inputs.clone(),
            steps,
            outputs: at.cpu_outputs()?,
        }),
        None => None,
    };
    let plan = ExecPlan {
        arena_bytes: at.arena_bytes,
        inputs,
        cache_inputs,
        outputs,
        cache_outputs,
        steps,
        tokens,
        advances: choice.is_some_and(|c| c.advances) && storage.tokens.is_some(),
        sampler,
        logits_pieces,
        host_tail: tail.map(|t| t.graph),
        cpu,
    };
    plan.check_logits_pieces().map_err(PlanError::Layout)?;
    Ok((plan, no_cpu))
}

/// A KV-cached graph's logits may be written straight into a ring buffer, every address in
/// their slot moved there (the CUDA executor's logits chunks): they share their bytes with no
/// other value, since one inside them would move with them and one running past their end
/// would overrun the buffer. So they are alive from the first step.
fn logits_alone(g: &Graph, storage: &mut Storage) {
    let logits = g
        .outputs()
        .iter()
        .find(|o| o.name == crate::compile::LOGITS);
    if let Some(o) = logits {
        storage.alive_from_start(o.node);
    }
}

/// The GPU steps of `launches`, node by node (a launch's fallback with it), and the LM head's
/// pieces among them.
fn gpu_steps(
    g: &Graph,
    launches: &crate::lower::GraphLaunches,
    at: &Addresses,
) -> Result<(Vec<Step>, Vec<LogitsPiece>), PlanError> {
    let (mut steps, mut logits_pieces) = (Vec::new(), Vec::new());
    for (id, node) in &launches.nodes {
        let name = format!("{}_{}", g.node(*id).op.name(), id.0);
        logits_pieces.extend(node.pieces.iter().map(|&(i, rows)| LogitsPiece {
            steps: steps.len() + i + 1,
            rows: rows as usize,
        }));
        for launch in &node.launches {
            let mut s = at.step(*id, launch, name.clone())?;
            if let Some(fallback) = &launch.fallback {
                s.fallback = Some(Box::new(at.step(*id, fallback, name.clone())?));
            }
            steps.push(s);
        }
    }
    Ok((steps, logits_pieces))
}

/// A decode step's token choice after `steps`: the greedy choice's step appended, the token
/// slot (value `b`, an i64 a row) and the sampler (its step and the sampling parameters, value
/// `pb`, four i32 a row).
fn token_choice(
    g: &Graph,
    choice: &crate::lower::TokenChoice,
    at: &Addresses,
    (b, pb): (usize, usize),
    steps: &mut Vec<Step>,
) -> Result<(TensorSlot, kiln_ir::artifact::Sampler), PlanError> {
    // Its operands are graph values and the token slot: no node's scratch.
    let after = NodeId(g.len() as u32 - 1);
    steps.push(at.step(after, &choice.launch, "greedy_tokens".into())?);
    let tokens = TensorSlot {
        name: "tokens".into(),
        offset: at.offsets[b],
        dtype: DType::I64,
        shape: vec![choice.rows as usize],
    };
    let sampler = kiln_ir::artifact::Sampler {
        step: at.step(after, &choice.sampler, "sampled_tokens".into())?,
        params: TensorSlot {
            name: "sampling".into(),
            offset: at.offsets[pb],
            dtype: DType::I32,
            shape: vec![choice.rows as usize, 4],
        },
    };
    Ok((tokens, sampler))
}

/// Where a bucket's values live: each value's storage root and element offset (views and
/// in-place writes resolved), each root's home, and the arena buffers with their lifetimes (in
/// graph order, then scratch, view outputs' copies, the chosen tokens and the sampler's
/// parameters).
struct Storage {
    /// Each weight's (and RoPE table's) byte offset in the weights region.
    weight_at: BTreeMap<String, u64>,
    root: Vec<(NodeId, u64)>,
    homes: BTreeMap<NodeId, Home>,
    buffers: Vec<crate::memory::Lifetime>,
    /// Each launched node's scratch buffers.
    scratch: BTreeMap<NodeId, Vec<usize>>,
    /// Each product's row sums for the products after it (`Operand::RowSums`).
    row_sums: BTreeMap<NodeId, usize>,
    /// Outputs that are strided views (a CLS slice) and the contiguous buffer the CPU plan
    /// copies each into at the end (the GPU gathers them in its host tail).
    copied_outputs: Vec<(usize, usize)>,
    /// A decode step's chosen tokens (i64, one per row), written after every other step.
    tokens: Option<usize>,
    /// The sampler's parameters, written before the replay and read after it.
    params: Option<usize>,
}

impl Storage {
    fn new(
        g: &Graph,
        memory: &MemoryPlan,
        launches: &crate::lower::GraphLaunches,
        tail: Option<&HostTail>,
        choice: Option<&crate::lower::TokenChoice>,
    ) -> Result<Storage, PlanError> {
        let mut storage = Storage::homes(g, memory)?;
        storage.extend_lifetimes(g, launches, tail);
        let end = g.len();
        for (id, node) in &launches.nodes {
            for bytes in &node.scratch {
                let b = storage.push(*bytes, id.index(), id.index());
                storage.scratch.entry(*id).or_default().push(b);
            }
            if let Some((bytes, last)) = node.row_sums {
                let b = storage.push(bytes, id.index(), last.index());
                storage.row_sums.insert(*id, b);
            }
        }
        for (i, o) in g.outputs().iter().enumerate() {
            if output_is_view(g, o.node) {
                let b = storage.push(value_bytes(g, o.node, &o.name)?, end, end);
                storage.copied_outputs.push((i, b));
            }
        }
        storage.tokens = choice.map(|t| storage.push(u64::from(t.rows) * 8, end, end));
        // Alive throughout, like the inputs.
        storage.params = choice.map(|t| storage.push(u64::from(t.rows) * 16, 0, end));
        Ok(storage)
    }

    /// Every value's root and home: weights and cache slots where the memory plan put them,
    /// other roots an arena buffer from their node (inputs from the first step) on.
    fn homes(g: &Graph, memory: &MemoryPlan) -> Result<Storage, PlanError> {
        let offsets = |slots: &[kiln_ir::artifact::TensorSlot]| -> BTreeMap<String, u64> {
            slots.iter().map(|s| (s.name.clone(), s.offset)).collect()
        };
        let cache_at = offsets(&memory.cache);
        let mut storage = Storage {
            weight_at: offsets(&memory.weights),
            root: Vec::with_capacity(g.len()),
            homes: BTreeMap::new(),
            buffers: Vec::new(),
            scratch: BTreeMap::new(),
            row_sums: BTreeMap::new(),
            copied_outputs: Vec::new(),
            tokens: None,
            params: None,
        };
        for (id, node) in g.nodes() {
            let r = match &node.op {
                Op::Slice { axis, start, .. } => {
                    let (base, offset) = storage.root[node.args[0].index()];
                    let src = static_shape(g.ty(node.args[0]), "a slice operand")?;
                    let inner: usize = src[axis + 1..].iter().product();
                    let start = start.as_const().unwrap_or(0) as u64;
                    (base, offset + start * inner as u64)
                }
                op if is_view(op) => storage.root[node.args[0].index()],
                Op::CacheWrite => storage.root[node.args[0].index()],
                _ => (id, 0),
            };
            storage.root.push(r);
            if r.0 != id {
                continue;
            }
            let home = match &node.op {
                Op::Weight(name) => {
                    Home::Weight(*storage.weight_at.get(name).ok_or_else(|| {
                        PlanError::Layout(format!(
                            "weight `{name}` has no place in the weights region"
                        ))
                    })?)
                }
                Op::Input(name) if is_cache(name) => Home::Cache(cache_at[name]),
                op => {
                    // Inputs are written before the first step; values when their node runs.
                    let first = if matches!(op, Op::Input(_)) {
                        0
                    } else {
                        id.index()
                    };
                    let bytes = value_bytes(g, id, "a value")?;
                    Home::Buffer(storage.push(bytes, first, first))
                }
            };
            storage.homes.insert(id, home);
        }
        Ok(storage)
    }

    /// A value is alive until the last node that reads it or any view of it, or a launch reads
    /// it without its node naming it (a decode attention reads the new keys and values of the
    /// cache writes it does); outputs, the host tail's values and inputs to the end.
    fn extend_lifetimes(
        &mut self,
        g: &Graph,
        launches: &crate::lower::GraphLaunches,
        tail: Option<&HostTail>,
    ) {
        let end = g.len();
        for (id, node) in g.nodes() {
            for a in &node.args {
                self.extend(*a, id.index());
            }
        }
        for (id, node) in &launches.nodes {
            let launched = node.launches.iter().flat_map(|l| {
                let fallback = l.fallback.iter().flat_map(|f| &f.args);
                l.args.iter().chain(fallback)
            });
            for (_, operand) in launched {
                if let Some(v) = operand.value() {
                    self.extend(v, id.index());
                }
            }
        }
        for o in g.outputs() {
            self.extend(o.node, end);
        }
        for b in tail.iter().flat_map(|t| &t.boundary) {
            self.extend(*b, end);
        }
        for (id, node) in g.nodes() {
            if matches!(node.op, Op::Input(_)) {
                self.extend(id, end);
            }
        }
    }

    /// Makes `id`'s buffer (if its root has one) alive from the first step.
    fn alive_from_start(&mut self, id: NodeId) {
        if let Some(Home::Buffer(b)) = self.homes.get(&self.root[id.index()].0) {
            self.buffers[*b].first = 0;
        }
    }

    /// Keeps `id`'s buffer (if its root has one) alive until step `at`.
    fn extend(&mut self, id: NodeId, at: usize) {
        if let Some(Home::Buffer(b)) = self.homes.get(&self.root[id.index()].0) {
            self.buffers[*b].last = self.buffers[*b].last.max(at);
        }
    }

    /// A new arena buffer of `bytes` alive from step `first` to `last`: its index.
    fn push(&mut self, bytes: u64, first: usize, last: usize) -> usize {
        self.buffers
            .push(crate::memory::Lifetime { bytes, first, last });
        self.buffers.len() - 1
    }
}

/// The bytes of value `id` (`what` names it in an error).
fn value_bytes(g: &Graph, id: NodeId, what: &str) -> Result<u64, PlanError> {
    let ty = g.ty(id);
    Ok(static_shape(ty, what)?.iter().product::<usize>() as u64 * ty.dtype.size_bytes() as u64)
}

/// A bucket's [`Storage`] with the arena placed: the arguments of its launches and CPU calls
/// and its slots.
struct Addresses<'a> {
    g: &'a Graph,
    memory: &'a MemoryPlan,
    kernels: &'a Lowered,
    storage: &'a Storage,
    offsets: Vec<u64>,
    arena_bytes: u64,
}

impl<'a> Addresses<'a> {
    fn new(
        g: &'a Graph,
        memory: &'a MemoryPlan,
        kernels: &'a Lowered,
        storage: &'a Storage,
    ) -> Addresses<'a> {
        let (offsets, arena_bytes) = crate::memory::place(&storage.buffers);
        Addresses {
            g,
            memory,
            kernels,
            storage,
            offsets,
            arena_bytes,
        }
    }

    /// Where value `id` is.
    fn address(&self, id: NodeId) -> Arg {
        let (base, elems) = self.storage.root[id.index()];
        let offset = elems * self.g.ty(base).dtype.size_bytes() as u64;
        match self.storage.homes[&base] {
            Home::Weight(at) => Arg::Ptr(Region::Weights, at + offset),
            Home::Cache(at) => Arg::Ptr(Region::Cache, at + offset),
            Home::Buffer(b) => Arg::Ptr(Region::Arena, self.offsets[b] + offset),
        }
    }

    /// Operand `op` of node `id`'s launch or call.
    fn operand(&self, id: NodeId, op: &Operand) -> Result<Arg, PlanError> {
        let arena = |b: usize| Arg::Ptr(Region::Arena, self.offsets[b]);
        Ok(match op {
            Operand::Value(v) => self.address(*v),
            Operand::Scratch(i) => arena(self.storage.scratch[&id][*i]),
            Operand::RowSums(writer) => {
                arena(*self.storage.row_sums.get(writer).ok_or_else(|| {
                    PlanError::Layout(format!("node {} writes no row sums", writer.0))
                })?)
            }
            Operand::Rope { table, sin } => {
                let name = table_name(table, *sin);
                let at = self.storage.weight_at.get(&name).ok_or_else(|| {
                    PlanError::Layout(format!("RoPE table `{name}` has no place in the weights"))
                })?;
                Arg::Ptr(Region::Weights, *at)
            }
            Operand::U32(v) => Arg::U32(*v),
            Operand::Arena(offset) => Arg::Ptr(Region::Arena, *offset),
            Operand::Counters(_) => Arg::Ptr(Region::Counters, 0),
            Operand::BlockTable => {
                let paging = self.memory.paging.as_ref().ok_or_else(|| {
                    PlanError::Layout("a launch reads the block table of a dense cache".into())
                })?;
                Arg::Ptr(Region::Cache, paging.table)
            }
            Operand::Tokens => arena(self.storage.tokens.ok_or_else(|| {
                PlanError::Layout("a launch writes tokens the bucket does not choose".into())
            })?),
            Operand::SamplingParams => arena(self.storage.params.ok_or_else(|| {
                PlanError::Layout("a launch samples in a bucket that chooses no tokens".into())
            })?),
            Operand::Offset(op, bytes) => match self.operand(id, op)? {
                Arg::Ptr(region, at) => Arg::Ptr(region, at + bytes),
                arg => {
                    return Err(PlanError::Layout(format!(
                        "an offset of {bytes} bytes into {arg:?}, which is no address"
                    )))
                }
            },
        })
    }

    /// Node `id`'s `launch` as a plan step (tensor-map parameters where the kernel takes them).
    fn step(&self, id: NodeId, launch: &KernelLaunch, node: String) -> Result<Step, PlanError> {
        let signature = &self.kernels.kernels[&launch.kernel].signature;
        let args = launch
            .args
            .iter()
            .zip(signature)
            .map(|((_, op), (_, ty))| {
                Ok(match (self.operand(id, op)?, ty) {
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
            base_only: launch.base_only,
        })
    }

    /// The CPU plan's calls: every kernel node's calls and every primitive's strided calls, in
    /// graph order, then the copies of view outputs; and the nodes without CPU calls.
    fn cpu_steps(
        &self,
        launches: &crate::lower::GraphLaunches,
        cpu_kernels: &mut BTreeMap<String, CpuKernel>,
    ) -> Result<(Vec<CpuStep>, Vec<String>), PlanError> {
        let g = self.g;
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
        let copies: Vec<_> = self
            .storage
            .copied_outputs
            .iter()
            .map(|&(i, buffer)| {
                let node = g.outputs()[i].node;
                let out = Operand::Arena(self.offsets[buffer]);
                (node, crate::lower::materialize(g, node, out))
            })
            .collect();
        let calls = cpu_calls
            .iter()
            .map(|(id, c)| (*id, c.map(|c| c.iter().collect::<Vec<_>>())))
            .chain(
                copies
                    .iter()
                    .map(|(id, c)| (*id, c.as_ref().map(|c| vec![c]))),
            );
        let mut steps = Vec::new();
        let mut no_cpu = Vec::new();
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
                    .map(|op| self.operand(id, op))
                    .collect::<Result<Vec<_>, _>>()?;
                steps.push(CpuStep {
                    call: cpu_call(call, cpu_kernels),
                    args,
                    node: node.clone(),
                });
            }
        }
        Ok((steps, no_cpu))
    }

    /// The slot of value `id` in the arena, named `name`.
    fn slot(&self, name: &str, id: NodeId) -> Result<TensorSlot, PlanError> {
        let Arg::Ptr(Region::Arena, offset) = self.address(id) else {
            return Err(PlanError::Layout(format!("`{name}` is not in the arena")));
        };
        let ty = self.g.ty(id);
        Ok(TensorSlot {
            name: name.to_string(),
            offset,
            dtype: ty.dtype,
            shape: static_shape(ty, name)?,
        })
    }

    /// The GPU plan's output slots (the values its host tail reads first, then the graph's
    /// outputs but the tail's) and the cache slots it writes.
    fn gpu_outputs(
        &self,
        tail: Option<&HostTail>,
    ) -> Result<(Vec<TensorSlot>, Vec<String>), PlanError> {
        let g = self.g;
        let mut outputs = Vec::new();
        let mut cache_outputs = Vec::new();
        for b in tail.iter().flat_map(|t| &t.boundary) {
            outputs.push(self.slot(&value_name(*b), *b)?);
        }
        for o in g.outputs() {
            if tail.is_some_and(|t| t.outputs.contains(&o.name)) {
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
                _ => outputs.push(self.slot(&o.name, o.node)?),
            }
        }
        Ok((outputs, cache_outputs))
    }

    /// The CPU plan's output slots: every graph output but the cache writes, view outputs in
    /// the buffers the CPU plan copies them into.
    fn cpu_outputs(&self) -> Result<Vec<TensorSlot>, PlanError> {
        let g = self.g;
        let mut outputs = Vec::new();
        for (i, o) in g.outputs().iter().enumerate() {
            let copied = self.storage.copied_outputs.iter().find(|(j, _)| *j == i);
            if let Some(&(_, buffer)) = copied {
                let ty = g.ty(o.node);
                outputs.push(TensorSlot {
                    name: o.name.clone(),
                    offset: self.offsets[buffer],
                    dtype: ty.dtype,
                    shape: static_shape(ty, &o.name)?,
                });
            } else if !matches!(g.node(stripped(g, o.node)).op, Op::CacheWrite) {
                outputs.push(self.slot(&o.name, o.node)?);
            }
        }
        Ok(outputs)
    }
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
