//! E-graph fusion: the unfused graph goes into an egg e-graph once (symbolic in `B` and `S`), phased
//! rewrite rules find the fused kernels, and a cost model extracts one fused graph per bucket.
//!
//! - [`lang`]: the e-graph language (IR ops, attributes as leaf children);
//! - [`analysis`]: types, constants and weight-only facts per e-class;
//! - [`rules`](mod@rules): rule files (`compiler/rules/*.ron`) and their appliers;
//! - [`constructors`]: the named guards and builders rules refer to;
//! - [`cost`]: the cost model and kernel classification;
//! - [`extract`]: DAG-aware extraction.
//!
//! Blow-up control: no associativity/commutativity rules (importers emit canonical operand order);
//! rules only add fused nodes over existing classes, never new primitive structure; each phase
//! runs with `SimpleScheduler` under iteration, node and time limits.

pub mod analysis;
pub mod constructors;
pub mod cost;
pub mod extract;
pub mod lang;
pub mod rules;

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use egg::{Id, Runner, SimpleScheduler};
use kiln_ir::{Graph, IrError, NodeId, Op};
use serde::Serialize;

use analysis::{KilnGraph, TypeAnalysis};
use cost::{done_by_writes, kernel_work, CostArg, CostModel};
use lang::{has_attr, static_name, Attr, ENode};
use rules::{load_rules, Rule, PHASES};

/// Errors of the fusion pipeline.
#[derive(Debug, thiserror::Error)]
pub enum FusionError {
    /// A rule file is malformed (a bug in kiln).
    #[error("rule files: {0}")]
    Rules(String),
    /// The extracted graph does not type-check (a bug in kiln).
    #[error("extracted graph: {0}")]
    Ir(#[from] IrError),
    /// An op of the input graph is unknown to the e-graph language.
    #[error("op `{0}` cannot enter the e-graph")]
    UnknownOp(String),
    /// No finite-cost extraction exists for an output.
    #[error("no extraction for output `{0}`")]
    NoExtraction(String),
}

/// Limits of each rule phase.
#[derive(Clone, Debug, Serialize)]
pub struct Limits {
    /// Iterations per phase.
    pub iterations: usize,
    /// E-nodes in the e-graph.
    pub nodes: usize,
    /// Seconds per phase.
    pub seconds: f64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            iterations: 12,
            nodes: 400_000,
            seconds: 30.0,
        }
    }
}

/// What one rule phase did.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseStats {
    /// 1 idioms, 2 kernels, 3 epilogues.
    pub phase: u8,
    /// Iterations run.
    pub iterations: usize,
    /// E-nodes after the phase.
    pub nodes: usize,
    /// E-classes after the phase.
    pub classes: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Why the phase stopped (`Saturated` when no rule applied any more).
    pub stop_reason: String,
}

/// A saturated e-graph with the classes of the graph's outputs.
pub struct Saturated {
    egraph: KilnGraph,
    roots: Vec<(String, Id)>,
    /// The class of every node of the saturated graph, by node index.
    classes: Vec<Id>,
    /// Rule name -> number of times it applied.
    pub rule_counts: BTreeMap<String, usize>,
    /// Per-phase statistics.
    pub phases: Vec<PhaseStats>,
    /// Matches declined because a rule built a node of another type than the matched class's,
    /// each naming the rule (empty unless a builder has a bug).
    pub declined: Vec<String>,
}

/// The rules, loaded once.
pub fn rules() -> Result<&'static [Rule], FusionError> {
    static RULES: OnceLock<Result<Vec<Rule>, String>> = OnceLock::new();
    RULES
        .get_or_init(load_rules)
        .as_deref()
        .map_err(|e| FusionError::Rules(e.clone()))
}

/// Puts `graph` into an e-graph; returns it with the class of every node.
pub fn to_egraph(graph: &Graph) -> Result<(KilnGraph, Vec<Id>), FusionError> {
    let mut eg = KilnGraph::new(TypeAnalysis::default());
    let mut ids = Vec::with_capacity(graph.len());
    for (_, node) in graph.nodes() {
        let id = if node.op.is_leaf() {
            eg.add(ENode::Leaf(Attr::leaf(node.op.clone(), node.ty.clone())))
        } else {
            let name = static_name(node.op.name())
                .ok_or_else(|| FusionError::UnknownOp(node.op.name().to_string()))?;
            let mut children = Vec::with_capacity(node.args.len() + 1);
            if has_attr(name) {
                children.push(eg.add(ENode::Leaf(Attr::of(node.op.clone()))));
            }
            children.extend(node.args.iter().map(|a| ids[a.index()]));
            eg.add(ENode::Op(name, children))
        };
        ids.push(id);
    }
    Ok((eg, ids))
}

/// Saturates `graph` phase by phase.
pub fn saturate(graph: &Graph, limits: &Limits) -> Result<Saturated, FusionError> {
    let all = rules()?;
    let (mut egraph, ids) = to_egraph(graph)?;
    let mut rule_counts: BTreeMap<String, usize> =
        all.iter().map(|r| (r.spec.name.clone(), 0)).collect();
    let mut phases = Vec::new();
    for phase in 1..=PHASES {
        let start = Instant::now();
        let rewrites: Vec<_> = all
            .iter()
            .filter(|r| r.spec.phase == phase)
            .map(|r| &r.rewrite)
            .collect();
        let runner = Runner::<ENode, TypeAnalysis, ()>::new(TypeAnalysis::default())
            .with_egraph(egraph)
            .with_scheduler(SimpleScheduler)
            .with_iter_limit(limits.iterations)
            .with_node_limit(limits.nodes)
            .with_time_limit(Duration::from_secs_f64(limits.seconds))
            .run(rewrites);
        for it in &runner.iterations {
            for (name, n) in &it.applied {
                *rule_counts.entry(name.to_string()).or_insert(0) += n;
            }
        }
        phases.push(PhaseStats {
            phase,
            iterations: runner.iterations.len(),
            nodes: runner.egraph.total_size(),
            classes: runner.egraph.number_of_classes(),
            seconds: start.elapsed().as_secs_f64(),
            stop_reason: format!("{:?}", runner.stop_reason),
        });
        egraph = runner.egraph;
    }
    let roots = graph
        .outputs()
        .iter()
        .map(|o| (o.name.clone(), egraph.find(ids[o.node.index()])))
        .collect();
    let declined = std::mem::take(&mut egraph.analysis.declined);
    Ok(Saturated {
        egraph,
        roots,
        classes: ids,
        rule_counts,
        phases,
        declined,
    })
}

impl Saturated {
    /// The e-graph.
    pub fn egraph(&self) -> &KilnGraph {
        &self.egraph
    }

    /// Extracts the cheapest fused graph with costs evaluated at `bindings` (a bucket); returns it
    /// (still symbolic; specialise it to the bucket) and its modelled cost in seconds: the cost
    /// model over the graph as lowering runs it (`cost::graph_seconds`, which also counts work one
    /// kernel does for other nodes, such as a decode attention's cache writes, once), at most the
    /// extraction's own sum over e-nodes.
    pub fn extract(
        &self,
        bindings: &BTreeMap<String, i64>,
        model: &CostModel,
    ) -> Result<(Graph, f64), FusionError> {
        self.extract_outputs(bindings, model, |_| true)
    }

    /// [`Saturated::extract`] for the outputs `keep` accepts only: what only the others need is
    /// neither extracted nor paid for (the prompt chunk drops `logits`, and its LM head with it).
    pub fn extract_outputs(
        &self,
        bindings: &BTreeMap<String, i64>,
        model: &CostModel,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(Graph, f64), FusionError> {
        let eg = &self.egraph;
        let wanted: Vec<&(String, Id)> = self.roots.iter().filter(|(n, _)| keep(n)).collect();
        let own_cost = |class: Id, node: usize| self.own_cost(class, node, bindings, model);
        let roots: Vec<Id> = wanted.iter().map(|(_, id)| *id).collect();
        let choice = extract::extract(eg, &roots, own_cost).ok_or_else(|| {
            FusionError::NoExtraction(wanted.first().map_or(String::new(), |(n, _)| n.clone()))
        })?;
        let mut graph = Graph::new();
        let mut built: BTreeMap<Id, NodeId> = BTreeMap::new();
        for (name, root) in wanted {
            let id = build(eg, &choice.node, *root, &mut graph, &mut built)?;
            graph.set_output(name, id)?;
        }
        let seconds = cost::graph_seconds(&graph, bindings, model);
        debug_assert!(
            seconds <= choice.cost * (1.0 + 1e-9),
            "{seconds} > {}",
            choice.cost
        );
        Ok((graph, seconds))
    }

    /// The modelled seconds of node `node` of class `class` alone, at `bindings`.
    fn own_cost(
        &self,
        class: Id,
        node: usize,
        bindings: &BTreeMap<String, i64>,
        model: &CostModel,
    ) -> f64 {
        let eg = &self.egraph;
        if eg[class].data.weight_only {
            return 0.0; // folded at compile time
        }
        let Some((op, args)) = TypeAnalysis::op_and_args(eg, &eg[class].nodes[node]) else {
            return 0.0;
        };
        if done_by_writes(&op, consumers(eg, class).iter().map(|(o, p)| (o, *p))) {
            return 0.0;
        }
        let types: Vec<CostArg> = args
            .iter()
            .filter_map(|a| {
                let data = &eg[*a].data;
                Some(CostArg {
                    ty: data.ty.as_ref()?,
                    weight_only: data.weight_only,
                })
            })
            .collect();
        let out = eg[class].data.ty.as_ref().expect("op classes are tensors");
        kernel_work(&op, &types, out, bindings).map_or(0.0, |w| model.seconds(&w))
    }

    /// Every op alternative in the class of the saturated graph's node `node`, whichever one
    /// extraction picks: its op and a graph (output `out`) computing the class through it, its
    /// operands as extraction at `bindings` chooses them. An alternative whose operands need the
    /// class itself (a cycle) has no such graph and is left out. Tests run these against the
    /// interpreter, so that every alternative a rule adds is checked, not only the chosen one.
    pub fn alternatives(
        &self,
        node: NodeId,
        bindings: &BTreeMap<String, i64>,
        model: &CostModel,
    ) -> Result<Vec<(Op, Graph)>, FusionError> {
        let eg = &self.egraph;
        let class = eg.find(self.classes[node.index()]);
        let own_cost = |c: Id, n: usize| self.own_cost(c, n, bindings, model);
        let mut out = Vec::new();
        for (index, enode) in eg[class].nodes.iter().enumerate() {
            let Some((op, args)) = TypeAnalysis::op_and_args(eg, enode) else {
                continue;
            };
            let Some(choice) = extract::extract(eg, &args, own_cost) else {
                continue;
            };
            if choice.node.contains_key(&class) {
                continue;
            }
            let mut choice = choice.node;
            choice.insert(class, index);
            let mut graph = Graph::new();
            let id = build(eg, &choice, class, &mut graph, &mut BTreeMap::new())?;
            graph.set_output("out", id)?;
            out.push((op, graph));
        }
        Ok(out)
    }
}

/// Every e-node that reads `class`: its op and the operand position it reads it at.
fn consumers(eg: &KilnGraph, class: Id) -> Vec<(Op, usize)> {
    let class = eg.find(class);
    let mut out = Vec::new();
    for parent in eg[class].parents() {
        for node in &eg[eg.find(parent)].nodes {
            if let Some((op, args)) = TypeAnalysis::op_and_args(eg, node) {
                for (position, a) in args.iter().enumerate() {
                    if eg.find(*a) == class {
                        out.push((op.clone(), position));
                    }
                }
            }
        }
    }
    out
}

/// Emits the chosen node of `class` (after its operands) into `graph`.
fn build(
    eg: &KilnGraph,
    choice: &BTreeMap<Id, usize>,
    class: Id,
    graph: &mut Graph,
    built: &mut BTreeMap<Id, NodeId>,
) -> Result<NodeId, FusionError> {
    let class = eg.find(class);
    if let Some(id) = built.get(&class) {
        return Ok(*id);
    }
    let node = &eg[class].nodes[choice[&class]];
    let id = match node {
        ENode::Leaf(attr) => {
            let ty = attr.ty.clone().expect("value leaves carry their type");
            match &attr.op {
                Op::Input(name) => graph.input(name, ty.dtype, ty.shape)?,
                Op::Weight(name) => graph.weight(name, ty.dtype, ty.shape)?,
                Op::Scalar(v) => graph.scalar(*v, ty.dtype),
                other => unreachable!("attribute leaf {} chosen as a value", other.name()),
            }
        }
        op_node => {
            let (op, args) = TypeAnalysis::op_and_args(eg, op_node).expect("an op node");
            let mut operands = Vec::with_capacity(args.len());
            for a in args {
                operands.push(build(eg, choice, a, graph, built)?);
            }
            graph.add(op, &operands)?
        }
    };
    built.insert(class, id);
    Ok(id)
}
