//! Every kernel of the catalog assembles for its image's target (sm_90, or sm_90a for the Hopper
//! kernels) with ptxas (`-v`), without spills or warnings (an ignored `setmaxnreg` is a
//! warning), without a serialized wgmma (reported as information, C7520), the GEMM and
//! attention kernels without a stack frame, and `setmaxnreg` never asking for more registers
//! than the block holds at launch (such a request waits forever); and so does every kernel of
//! artifacts compiled for the real shapes of `tests/data/configs` (bf16, two in f16; dense and
//! paged caches, prompt chunks), whose kernels the catalog does not all foresee. ptxas comes from
//! `$KILN_PTXAS`, PATH, or `scripts/fetch-ptxas` (the PyPI wheel of CUDA 13.0); CI installs it.
//! Without one the tests say so and pass, as a GPU test without a GPU does.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_kernels::catalog::catalog;
use kiln_kernels::GeneratedKernel;

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let script = kiln_tests::workspace_root().join("scripts/fetch-ptxas");
    let out = Command::new("bash").arg(script).output().ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

/// The number just before `suffix` in ptxas's `-v` report (its first such line), if present.
fn figure(report: &str, suffix: &str) -> Option<u64> {
    report.lines().find_map(|line| {
        let at = line.find(suffix)?;
        line[..at].split_whitespace().last()?.parse().ok()
    })
}

/// The registers a warp-specialised kernel's warpgroups hold once they have set their counts (one
/// warpgroup lowering its count, the producer, and the others raising theirs), if it sets any.
fn registers_after_setmaxnreg(kernel: &GeneratedKernel) -> Option<u64> {
    let count = |dir: &str| -> Vec<u64> {
        let op = format!("setmaxnreg.{dir}.sync.aligned.u32");
        let mut counts: Vec<u64> = (kernel.ptx.lines())
            .filter_map(|l| l.trim().strip_prefix(op.as_str()))
            .map(|n| n.trim().trim_end_matches(';').parse().expect("a count"))
            .collect();
        counts.dedup();
        counts
    };
    let (lower, raise) = (count("dec"), count("inc"));
    if lower.is_empty() && raise.is_empty() {
        return None;
    }
    assert!(
        lower.len() <= 1 && raise.len() <= 1,
        "{}: one count each way",
        kernel.name
    );
    let warpgroups = u64::from(kernel.launch.block[0]) / 128;
    let producer = lower.first().copied().unwrap_or(0);
    let consumers = raise.first().copied().unwrap_or(0);
    Some(128 * (producer + (warpgroups - 1) * consumers))
}

/// ptxas `-v` for `arch` over the module `src`, the cubin to `cubin`: whether it assembled, and
/// its report.
fn assemble(ptxas: &Path, arch: &str, src: &Path, cubin: &Path) -> (bool, String) {
    let out = Command::new(ptxas)
        .args([format!("-arch={arch}").as_str(), "-v"])
        .arg(src)
        .arg("-o")
        .arg(cubin)
        .output()
        .expect("ptxas runs");
    let report = String::from_utf8_lossy(&out.stderr).to_string();
    (out.status.success(), report)
}

/// The ptxas to use, or `None` after saying why the test passes without one.
fn ptxas_or_skip() -> Option<PathBuf> {
    let found = ptxas();
    if found.is_none() {
        println!("SKIPPED: no ptxas (set KILN_PTXAS, put ptxas on PATH, or let scripts/fetch-ptxas download it)");
    }
    found
}

#[test]
fn every_kernel_assembles_without_spills() {
    let Some(ptxas) = ptxas_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut table = Vec::new();
    for (i, (kind, kernel)) in catalog().into_iter().enumerate() {
        let src = tmp.path().join(format!("k{i}.ptx"));
        std::fs::write(&src, kernel.module()).unwrap();
        let cubin = tmp.path().join(format!("k{i}.cubin"));
        let (assembled, report) = assemble(&ptxas, kernel.image.target(), &src, &cubin);
        assert!(assembled, "{}: ptxas failed:\n{report}", kernel.name);
        let warnings: Vec<&str> = report.lines().filter(|l| l.contains("warning")).collect();
        assert!(warnings.is_empty(), "{}: {warnings:?}", kernel.name);
        let (spills, serialized) = spills_by_function(&report);
        assert!(
            serialized.is_empty(),
            "{}: wgmma serialized\n{report}",
            kernel.name
        );
        assert!(spills.is_empty(), "{}: spills\n{report}", kernel.name);
        let stack = figure(&report, "bytes stack frame").unwrap_or(0);
        let registers = figure(&report, "registers").unwrap_or(0);
        if let Some(after) = registers_after_setmaxnreg(&kernel) {
            let launch = registers * u64::from(kernel.launch.block[0]);
            assert!(
                after <= launch,
                "{}: setmaxnreg asks for {after} registers, the block holds {launch}",
                kernel.name
            );
        }
        if kind == "gemm" || kind == "attention" {
            assert_eq!(stack, 0, "{}: stack frame\n{report}", kernel.name);
        }
        table.push(format!(
            "{:<48} {registers:>4} registers ({})",
            kernel.name,
            kernel.image.target()
        ));
    }
    println!("{}", table.join("\n"));
}

/// Each function's spills (stores and loads, bytes) in a ptxas `-v` report, and its lines that
/// report a serialized wgmma (information, C7520, not a warning).
fn spills_by_function(report: &str) -> (Vec<(String, u64)>, Vec<String>) {
    let (mut spills, mut serialized) = (Vec::new(), Vec::new());
    let mut function = String::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            function = rest.trim().to_string();
        } else if line.contains("bytes spill stores") {
            let bytes = figure(line, "bytes spill stores").unwrap_or(0)
                + figure(line, "bytes spill loads").unwrap_or(0);
            if bytes > 0 {
                spills.push((function.clone(), bytes));
            }
        } else if line.contains("serialized") {
            serialized.push(line.trim().to_string());
        }
    }
    (spills, serialized)
}

/// Kernels of the real shapes' artifacts known to spill, with why they are let through; the test
/// fails if one of them stops spilling, so that the list stays true.
const KNOWN_SPILLS: &[&str] = &[];

#[test]
fn every_kernel_of_the_real_shapes_assembles_without_spills() {
    let Some(ptxas) = ptxas_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let configs = kiln_tests::workspace_root().join("tests/data/configs");
    let mut spilled = Vec::new();
    for (name, paged, dtype) in [
        ("bert-base", false, "bf16"),
        ("gpt2-small", false, "bf16"),
        ("llama-3.1-8b", false, "bf16"),
        ("llama-3.1-8b", true, "bf16"),
        ("mistral-7b", true, "bf16"),
        ("qwen2-7b", false, "bf16"),
        ("qwen2-7b", true, "bf16"),
        ("llama-3.2-1b", true, "bf16"),
        // f16 builds take the same tilings with other conversions.
        ("gpt2-small", false, "f16"),
        ("llama-3.1-8b", true, "f16"),
    ] {
        let out = tmp.path().join(format!("{name}-{paged}-{dtype}"));
        let model = configs.join(name);
        let mut args = vec![
            "compile",
            model.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--no-weights",
            "--dtype",
            dtype,
            "--buckets",
            "128,1024",
            "--batch-buckets",
            "1,8",
            "--target",
            "cuda",
            "-q",
        ];
        if name != "bert-base" {
            args.extend(["--max-context", "1024", "--prefill-chunk", "256"]);
            args.extend(["--kv-block-size", if paged { "16" } else { "0" }]);
        }
        kiln_tests::kiln(&args).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (module, arch) in [("kernels.sm_90a.ptx", "sm_90a"), ("kernels.ptx", "sm_90")] {
            let src = out.join(module);
            if !src.exists() {
                continue;
            }
            let cubin = tmp.path().join("module.cubin");
            let (assembled, report) = assemble(&ptxas, arch, &src, &cubin);
            assert!(assembled, "{name} {dtype} {module}: ptxas failed");
            let warnings: Vec<&str> = report.lines().filter(|l| l.contains("warning")).collect();
            assert!(warnings.is_empty(), "{name} {dtype} {module}: {warnings:?}");
            let (spills, serialized) = spills_by_function(&report);
            assert!(
                serialized.is_empty(),
                "{name} {dtype} {module}: {serialized:?}"
            );
            spilled.extend(spills.into_iter().map(|(f, bytes)| (name, f, bytes)));
        }
    }
    let unknown: Vec<_> = (spilled.iter())
        .filter(|(_, f, _)| !KNOWN_SPILLS.contains(&f.as_str()))
        .collect();
    assert!(unknown.is_empty(), "kernels spill: {unknown:?}");
    for known in KNOWN_SPILLS {
        assert!(
            spilled.iter().any(|(_, f, _)| f == known),
            "{known} no longer spills: take it off KNOWN_SPILLS"
        );
    }
}
