//! DAG-aware greedy extraction: a class's cost is the cost of every distinct class its best node
//! needs, each counted once (a bitset of classes per candidate), so a value shared by several
//! consumers is paid for once. Classes are revisited from a worklist until no choice improves.

use std::collections::{BTreeMap, VecDeque};

use egg::{Id, Language};
use fixedbitset::FixedBitSet;

use super::analysis::KilnGraph;

/// The chosen node of every reachable class.
pub struct Choice {
    /// Class -> index of its chosen node in `egraph[class].nodes`.
    pub node: BTreeMap<Id, usize>,
    /// The total cost of the extracted DAG.
    pub cost: f64,
}

struct Best {
    total: f64,
    node: usize,
    own: f64,
    needs: FixedBitSet,
}

/// Extracts the cheapest DAG for `roots`, with `own_cost(class, node index)` the cost of one node
/// excluding its children. Returns `None` if a root has no finite extraction.
pub fn extract(
    egraph: &KilnGraph,
    roots: &[Id],
    own_cost: impl Fn(Id, usize) -> f64,
) -> Option<Choice> {
    let ids: Vec<Id> = egraph.classes().map(|c| c.id).collect();
    let index: BTreeMap<Id, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let n = ids.len();
    let mut best: Vec<Option<Best>> = (0..n).map(|_| None).collect();
    let mut queued = vec![true; n];
    let mut work: VecDeque<usize> = (0..n).collect();
    while let Some(ci) = work.pop_front() {
        queued[ci] = false;
        let class = &egraph[ids[ci]];
        let mut improved = false;
        for (ni, node) in class.nodes.iter().enumerate() {
            let children: Vec<usize> = node
                .children()
                .iter()
                .map(|c| index[&egraph.find(*c)])
                .collect();
            if children.iter().any(|c| best[*c].is_none()) {
                continue;
            }
            let mut needs = FixedBitSet::with_capacity(n);
            for c in &children {
                needs.union_with(&best[*c].as_ref().expect("checked").needs);
                needs.insert(*c);
            }
            if needs.contains(ci) {
                continue; // a cycle through this class
            }
            let own = own_cost(ids[ci], ni);
            let total = own
                + needs
                    .ones()
                    .map(|d| best[d].as_ref().expect("needed classes have a choice").own)
                    .sum::<f64>();
            let better = match &best[ci] {
                None => true,
                Some(b) => total < b.total - 1e-15 * b.total.abs().max(1.0),
            };
            if better {
                best[ci] = Some(Best {
                    total,
                    node: ni,
                    own,
                    needs,
                });
                improved = true;
            }
        }
        if improved {
            for parent in egraph[ids[ci]].parents() {
                let p = index[&egraph.find(parent)];
                if !queued[p] {
                    queued[p] = true;
                    work.push_back(p);
                }
            }
        }
    }
    // Follow the final choices from the roots (at the fixpoint they agree with the sets).
    let mut node = BTreeMap::new();
    let mut cost = 0.0;
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    while let Some(id) = stack.pop() {
        if node.contains_key(&id) {
            continue;
        }
        let b = best[index[&id]].as_ref()?;
        node.insert(id, b.node);
        cost += b.own;
        stack.extend(
            egraph[id].nodes[b.node]
                .children()
                .iter()
                .map(|c| egraph.find(*c)),
        );
    }
    Some(Choice { node, cost })
}
