//! Rewrite rules as data: one RON file per family under `compiler/rules/`, each rule a left-hand
//! pattern and either a right-hand pattern (with an optional named guard that checks attributes and
//! binds computed ones) or a named builder that constructs the fused node(s) in Rust.

use std::sync::Arc;

use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol, Var};
use serde::Deserialize;

use super::analysis::{KilnGraph, TypeAnalysis};
pub use super::constructors::BuilderKind;
use super::constructors::{builder, guard, Builder, Guard};
use super::lang::{Attr, ENode};

/// The rule files, in the order they are listed in reports.
const RULE_FILES: &[(&str, &str)] = &[
    ("softmax", include_str!("../../rules/softmax.ron")),
    ("activation", include_str!("../../rules/activation.ron")),
    ("norm", include_str!("../../rules/norm.ron")),
    ("attention", include_str!("../../rules/attention.ron")),
    ("gemm", include_str!("../../rules/gemm.ron")),
    ("embedding", include_str!("../../rules/embedding.ron")),
];

/// The number of rule phases: 1 idioms, 2 kernels, 3 epilogues, 4 prologues.
pub const PHASES: u8 = 4;

/// One rule as written in a rule file.
#[derive(Clone, Debug, Deserialize)]
pub struct RuleSpec {
    /// Unique name (reports count firings by it).
    pub name: String,
    /// One line: what the rule recognises.
    pub doc: String,
    /// 1 = idioms, 2 = kernels, 3 = epilogues, 4 = prologues.
    pub phase: u8,
    /// The pattern to find.
    pub lhs: String,
    /// The pattern to add, for pattern rules.
    #[serde(default)]
    pub rhs: Option<String>,
    /// A named check of a pattern rule's attributes that may bind computed attributes.
    #[serde(default)]
    pub guard: Option<String>,
    /// A named constructor of the fused node(s), for builder rules.
    #[serde(default)]
    pub build: Option<String>,
}

/// A loaded rule: its spec, family (file) and egg rewrite.
pub struct Rule {
    /// The rule as written.
    pub spec: RuleSpec,
    /// The file it came from.
    pub family: &'static str,
    /// The egg rewrite.
    pub rewrite: Rewrite<ENode, TypeAnalysis>,
}

/// Loads every rule file. A malformed file is a bug in kiln, reported with the file's name.
pub fn load_rules() -> Result<Vec<Rule>, String> {
    let mut rules = Vec::new();
    for (family, text) in RULE_FILES {
        let specs: Vec<RuleSpec> =
            ron::from_str(text).map_err(|e| format!("rules/{family}.ron: {e}"))?;
        for spec in specs {
            let rewrite = make_rewrite(&spec).map_err(|e| format!("rule `{}`: {e}", spec.name))?;
            rules.push(Rule {
                spec,
                family,
                rewrite,
            });
        }
    }
    Ok(rules)
}

fn make_rewrite(spec: &RuleSpec) -> Result<Rewrite<ENode, TypeAnalysis>, String> {
    if !(1..=PHASES).contains(&spec.phase) {
        return Err(format!("phase {} is not in 1..={PHASES}", spec.phase));
    }
    let lhs: Pattern<ENode> = spec.lhs.parse().map_err(|e| format!("lhs: {e}"))?;
    let kind = match (&spec.rhs, &spec.build) {
        (Some(rhs), None) => ApplyKind::Pattern {
            rhs: rhs.parse().map_err(|e| format!("rhs: {e}"))?,
            guard: spec
                .guard
                .as_deref()
                .map(|g| guard(g).ok_or_else(|| format!("unknown guard `{g}`")))
                .transpose()?,
        },
        (None, Some(b)) => {
            ApplyKind::Build(builder(b).ok_or_else(|| format!("unknown builder `{b}`"))?)
        }
        _ => return Err("needs exactly one of `rhs` and `build`".into()),
    };
    Rewrite::new(
        spec.name.clone(),
        lhs,
        RuleApplier {
            kind: Arc::new(kind),
        },
    )
}

enum ApplyKind {
    Pattern {
        rhs: Pattern<ENode>,
        guard: Option<Guard>,
    },
    Build(Builder),
}

struct RuleApplier {
    kind: Arc<ApplyKind>,
}

impl Applier<ENode, TypeAnalysis> for RuleApplier {
    fn apply_one(
        &self,
        egraph: &mut KilnGraph,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<ENode>>,
        rule_name: Symbol,
    ) -> Vec<Id> {
        let built: Vec<(Id, Id)> = match self.kind.as_ref() {
            ApplyKind::Pattern { rhs, guard } => {
                let mut subst = subst.clone();
                if let Some(g) = guard {
                    let Some(bindings) = g(egraph, &subst) else {
                        return vec![];
                    };
                    for (name, attr) in bindings {
                        let id = egraph.add(ENode::Leaf(attr));
                        subst.insert(var(name), id);
                    }
                }
                vec![(eclass, egraph.add_instantiation(&rhs.ast, &subst))]
            }
            ApplyKind::Build(BuilderKind::Alternatives(b)) => b(egraph, subst)
                .into_iter()
                .map(|id| (eclass, id))
                .collect(),
            ApplyKind::Build(BuilderKind::Unions(b)) => b(egraph, eclass, subst),
        };
        built
            .into_iter()
            .filter(|&(class, id)| union_checked(egraph, class, id, rule_name.as_str()))
            .map(|(class, _)| class)
            .collect()
    }
}

/// Unions what rule `rule` built into `class` when both have the same type, and says whether the
/// class changed. A node of another type is a bug in the rule's builder: the match is declined
/// (nothing is unioned, so the e-graph stays sound) and an error naming the rule is recorded in
/// the analysis and logged, instead of the analysis's merge panicking.
pub fn union_checked(egraph: &mut KilnGraph, class: Id, built: Id, rule: &str) -> bool {
    let (want, got) = (&egraph[class].data.ty, &egraph[built].data.ty);
    if want != got {
        let show = |t: &Option<kiln_ir::TensorType>| {
            t.as_ref()
                .map_or("an attribute".to_string(), |t| t.to_string())
        };
        let message = format!(
            "rule `{rule}` built {} for a class of {}: the match is declined",
            show(got),
            show(want)
        );
        tracing::warn!("{message}");
        egraph.analysis.declined.push(message);
        return false;
    }
    egraph.union(class, built)
}

/// The pattern variable `?name` (`name` given with its `?`).
pub fn var(name: &str) -> Var {
    name.parse().expect("pattern variables are written `?name`")
}

/// The attribute leaf bindings a guard returns.
pub type Bindings = Vec<(&'static str, Attr)>;
