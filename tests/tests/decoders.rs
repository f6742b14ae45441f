//! GPT-2 and Llama fixtures through `kiln eval` and the reference interpreter: logits at every
//! reference length, greedy decoding, and a padded batch.

use std::collections::BTreeMap;

use kiln_compiler::tensor_io::{read_tensors, write_tensors};
use kiln_ir::Tensor;
use kiln_models::inputs::TokenBatch;
use kiln_tests::{argmax, fixture, floats, kiln, reference, rel_err};

const DECODERS: [&str; 2] = ["gpt2-tiny", "llama-tiny"];
const LENGTHS: [usize; 5] = [1, 7, 16, 33, 100];
const TOLERANCE: f64 = 1e-4;

fn ids(t: &Tensor) -> Vec<i64> {
    t.as_i64().expect("i64 ids").to_vec()
}

#[test]
fn eval_reproduces_reference_logits_at_every_length() {
    let tmp = tempfile::tempdir().unwrap();
    for name in DECODERS {
        let reference = reference(name);
        let dir = fixture(name);
        for l in LENGTHS {
            let input = tmp.path().join(format!("{name}-{l}-in.safetensors"));
            let output = tmp.path().join(format!("{name}-{l}-out.safetensors"));
            let ids = reference[&format!("input_ids_{l}")].clone();
            write_tensors(&input, &BTreeMap::from([("input_ids".to_string(), ids)])).unwrap();
            kiln(&[
                "eval",
                dir.to_str().unwrap(),
                "--input",
                input.to_str().unwrap(),
                "--output",
                output.to_str().unwrap(),
            ])
            .unwrap();
            let out = read_tensors(&output).unwrap();
            let logits = &out["logits"];
            let want = &reference[&format!("logits_{l}")];
            assert_eq!(logits.shape, want.shape, "{name} L={l}");
            let err = rel_err(floats(logits), floats(want));
            assert!(err < TOLERANCE, "{name} L={l}: relative error {err:e}");
        }
    }
}

#[test]
fn greedy_decoding_reproduces_reference_tokens() {
    for name in DECODERS {
        let reference = reference(name);
        let model = kiln_models::import(&fixture(name)).unwrap();
        let mut tokens = ids(&reference["greedy_prompt"]);
        let want = ids(&reference["greedy_tokens"]);
        let vocab = *reference["logits_1"].shape.last().unwrap();
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let batch = TokenBatch::unmasked(vec![tokens.clone()]);
            let out = model.evaluate(&batch).unwrap();
            let logits = floats(&out["logits"]);
            let last = &logits[logits.len() - vocab..];
            let next = argmax(last) as i64;
            got.push(next);
            tokens.push(next);
        }
        assert_eq!(got, want, "{name}: greedy continuation");
    }
}

#[test]
fn padded_batch_reproduces_each_prompt_alone() {
    for name in DECODERS {
        let reference = reference(name);
        let model = kiln_models::import(&fixture(name)).unwrap();
        let a = ids(&reference["batch_a"]);
        let b = ids(&reference["batch_b"]);
        assert_ne!(a.len(), b.len(), "the fixture pads one prompt");
        let batch = TokenBatch::padded(&[a.clone(), b.clone()], 0);
        let out = model.evaluate(&batch).unwrap();
        let logits = &out["logits"];
        let (l, vocab) = (logits.shape[1], logits.shape[2]);
        for (row, (prompt, key)) in [(&a, "batch_a_last_logits"), (&b, "batch_b_last_logits")]
            .into_iter()
            .enumerate()
        {
            let start = (row * l + prompt.len() - 1) * vocab;
            let got = &floats(logits)[start..start + vocab];
            let err = rel_err(got, floats(&reference[key]));
            assert!(err < TOLERANCE, "{name} {key}: relative error {err:e}");
        }
    }
}
