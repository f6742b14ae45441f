//! The streamed weights writer against its definition: every slot of the memory plan evaluated by
//! the reference interpreter (checkpoint tensors cast, folded definitions run in f32 and rounded
//! once: concatenations, transposes, a norm's weight moved into a product's) and written whole.
//! The streamed file must be the same bytes, for every family and compiled dtype (stored bf16 or
//! f32, so both the in-place reads and the conversions are checked).

use std::collections::BTreeMap;

use kiln_compiler::bucket::BucketPlan;
use kiln_compiler::compile::{compile, CompileOptions};
use kiln_compiler::plan::{plan_artifact, ArtifactPlan};
use kiln_ir::artifact::ALIGN;
use kiln_ir::{DType, TensorType, WeightSource};
use kiln_tests::fixture;

fn planned(model: &kiln_models::Model) -> ArtifactPlan {
    let opts = CompileOptions::prefill(BucketPlan::new(vec![8], vec![1]).unwrap());
    let (_, compiled) = compile(&model.graph, None, &opts).unwrap();
    let graphs: Vec<&kiln_ir::Graph> = compiled.prefill.iter().map(|b| &b.graph).collect();
    plan_artifact(&graphs, false, None).unwrap()
}

/// The weights file as the interpreter defines it.
fn reference(model: &kiln_models::Model, plan: &ArtifactPlan, path: &std::path::Path) {
    let mut tensors = BTreeMap::new();
    for slot in &plan.memory.weights {
        let name = &slot.name;
        let t = if let Some(t) = plan.tables.get(name) {
            t.clone()
        } else if let Some(def) = plan.folded.get(name) {
            // Computed in f32 from the checkpoint's values, rounded once.
            let wide = kiln_compiler::widen::widen(def).unwrap();
            let mut out = kiln_ir::evaluate(&wide, &BTreeMap::new(), &model.checkpoint).unwrap();
            out.remove(kiln_compiler::fold::VALUE)
                .unwrap()
                .cast(slot.dtype)
        } else {
            let shape = slot.shape.iter().map(|&d| (d as i64).into()).collect();
            let ty = TensorType::new(slot.dtype, shape);
            model.checkpoint.load(name, &ty).unwrap().as_ref().clone()
        };
        tensors.insert(name.clone(), t);
    }
    kiln_ir::io::write_aligned_tensors(path, &plan.memory.weights, &tensors, ALIGN).unwrap();
}

#[test]
fn streamed_weights_equal_the_interpreters() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["llama-tiny", "gpt2-tiny", "bert-tiny"] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let options = kiln_models::ImportOptions {
                dtype,
                ..Default::default()
            };
            let model = kiln_models::import_with(&fixture(name), &options).unwrap();
            let plan = planned(&model);
            assert!(
                !plan.folded.is_empty(),
                "{name}: the plan folds weights (the case under test)"
            );
            // Llama's RMSNorm weights move into the products that read the norms.
            let scaled = plan.folded.keys().any(|k| k.starts_with("Binary(Mul)"));
            assert_eq!(
                scaled,
                name == "llama-tiny",
                "{name}: {:?}",
                plan.folded.keys()
            );
            let want = dir.path().join(format!("{name}-{dtype}-want"));
            let got = dir.path().join(format!("{name}-{dtype}-got"));
            reference(&model, &plan, &want);
            let written = std::sync::atomic::AtomicU64::new(0);
            let digest =
                kiln_compiler::weights::write_weights(&got, &model.checkpoint, &plan, &|n| {
                    written.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                })
                .unwrap();
            let (want, got) = (std::fs::read(&want).unwrap(), std::fs::read(&got).unwrap());
            assert!(want == got, "{name} {dtype}: streamed weights differ");
            assert_eq!(digest, kiln_ir::checksum::digest(&got), "{name} {dtype}");
            let tensors: u64 = plan.memory.weights.iter().map(|s| s.bytes()).sum();
            assert_eq!(written.into_inner(), tensors, "{name} {dtype}: progress");
        }
    }
}
