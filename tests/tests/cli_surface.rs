//! What a user sees of the command lines: `kiln --help`, `kiln eval --dtype`, the numbers
//! `kiln-run embed` prints, and `kiln inspect` of an artifact without CPU code.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_ir::Tensor;
use kiln_tests::{fixture, floats, kiln, kiln_run, minilm_dir, reference, rewrite_checkpoint};

#[test]
fn kiln_help_says_what_kiln_does_today() {
    let help = kiln(&["--help"]).unwrap_err();
    assert!(!help.contains("(later)"), "{help}");
    assert!(
        help.contains("fuses and compiles them into artifacts"),
        "{help}"
    );
}

/// `kiln eval MODEL --input IN --output OUT [--dtype D]`: `last_hidden_state`.
fn eval_hidden(model: &Path, input: &Path, dtype: Option<&str>) -> Vec<f32> {
    let output = input.with_file_name("out.safetensors");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (m, i, o) = (s(model), s(input), s(&output));
    let mut args = vec!["eval", &m, "--input", &i, "--output", &o];
    args.extend(dtype.iter().flat_map(|d| ["--dtype", *d]));
    kiln(&args).unwrap();
    let out = kiln_ir::io::read_tensors(&output).unwrap();
    floats(&out["last_hidden_state"]).to_vec()
}

#[test]
fn kiln_eval_computes_in_the_dtype_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let bert = fixture("bert-tiny");
    // The same weights as a bf16 checkpoint and as an f32 one.
    let bf16 = tmp.path().join("bf16");
    rewrite_checkpoint(&bert, &bf16, safetensors::Dtype::BF16, 1, |_, _| {});
    let f32_dir = tmp.path().join("f32");
    rewrite_checkpoint(&bert, &f32_dir, safetensors::Dtype::F32, 1, |_, tensors| {
        for (_, values) in tensors.values_mut() {
            for v in values.iter_mut() {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
    });
    let r = reference("bert-tiny");
    let input = tmp.path().join("in.safetensors");
    let inputs: BTreeMap<String, Tensor> = ["input_ids", "attention_mask"]
        .map(|k| (k.to_string(), r[k].clone()))
        .into();
    kiln_ir::io::write_tensors(&input, &inputs).unwrap();

    let f32_of_bf16 = eval_hidden(&bf16, &input, Some("f32"));
    let f32_eval = eval_hidden(&f32_dir, &input, None);
    assert_eq!(f32_of_bf16, f32_eval, "--dtype f32: the f32 evaluation");
    assert_eq!(
        eval_hidden(&bf16, &input, None),
        f32_eval,
        "f32 is the default"
    );
    let rounded = eval_hidden(&bf16, &input, Some("bf16"));
    let err = kiln_tests::rel_err(&rounded, &f32_eval);
    assert!(
        (1e-4..2e-2).contains(&err),
        "--dtype bf16 rounds every op: relative difference {err:e}"
    );
    let err = kiln(&[
        "eval",
        bf16.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--dtype",
        "i64",
    ])
    .unwrap_err();
    assert!(err.contains("--dtype must be f32, f16 or bf16"), "{err}");
}

#[test]
fn embed_prints_readable_numbers_and_exact_json() {
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("minilm.kiln");
    let a = art.to_str().unwrap();
    let model = minilm_dir();
    let compile = [
        "compile",
        model.to_str().unwrap(),
        "-o",
        a,
        "--buckets",
        "16",
    ];
    kiln(&[&compile[..], &["--target", "cpu"]].concat()).unwrap();
    let args = ["embed", a, "--text", "short", "--device", "cpu"];
    let text = kiln_run(&args).unwrap();
    let json = kiln_run(&[&args[..], &["--json"]].concat()).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    let exact: Vec<f32> = json["embeddings"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let printed: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(printed.len(), exact.len(), "{text}");
    for (p, x) in printed.iter().zip(&exact) {
        // 7 significant digits in scientific form, whatever the magnitude.
        assert_eq!(*p, format!("{x:.6e}"));
        let (mantissa, _) = p.split_once('e').expect("scientific form");
        assert_eq!(mantissa.trim_start_matches('-').len(), 8, "{p}");
        let back: f32 = p.parse().unwrap();
        assert!((back - x).abs() <= x.abs() * 1e-6, "{p} is {x}");
    }
}

#[test]
fn inspect_says_once_that_no_cpu_code_was_compiled() {
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("bert.kiln");
    let a = art.to_str().unwrap();
    let bert = fixture("bert-tiny");
    let args = ["--buckets", "16,32", "--dtype", "bf16", "--target", "cuda"];
    kiln(&[&["compile", bert.to_str().unwrap(), "-o", a][..], &args].concat()).unwrap();
    let printed = kiln(&["inspect", a]).unwrap();
    assert_eq!(
        printed.matches("no CPU code compiled").count(),
        1,
        "{printed}"
    );
    assert!(!printed.contains("CPU plan"), "{printed}");
    assert!(!printed.contains("CPU calls"), "{printed}");
}
