//! Every kernel of the catalog assembles for its image's target (sm_90, or sm_90a for the Hopper
//! kernels) with ptxas (`-v`), without spills or warnings (an ignored `setmaxnreg` is a
//! warning), without a serialized wgmma (reported as information, C7520), the GEMM and
//! attention kernels without a stack frame, and `setmaxnreg` never asking for more registers
//! than the block holds at launch (such a request waits forever). ptxas comes from `$KILN_PTXAS`, PATH, or
//! `scripts/fetch-ptxas` (the PyPI wheel of CUDA 13.0); CI installs it. Without one the test says
//! so and passes, as a GPU test without a GPU does.

use std::path::PathBuf;
use std::process::Command;

use kiln_kernels::catalog::catalog;
use kiln_kernels::GeneratedKernel;

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-ptxas");
    let out = Command::new("bash").arg(script).output().ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

/// The number after `prefix` in ptxas's `-v` report, if present.
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

#[test]
fn every_kernel_assembles_without_spills() {
    let Some(ptxas) = ptxas() else {
        println!("SKIPPED: no ptxas (set KILN_PTXAS, put ptxas on PATH, or let scripts/fetch-ptxas download it)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut table = Vec::new();
    for (i, (kind, kernel)) in catalog().into_iter().enumerate() {
        let src = tmp.path().join(format!("k{i}.ptx"));
        std::fs::write(&src, kernel.module()).unwrap();
        let arch = format!("-arch={}", kernel.image.target());
        let out = Command::new(&ptxas)
            .args([arch.as_str(), "-v"])
            .arg(&src)
            .arg("-o")
            .arg(tmp.path().join(format!("k{i}.cubin")))
            .output()
            .expect("ptxas runs");
        let report = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success(),
            "{}: ptxas failed:\n{report}",
            kernel.name
        );
        let warnings: Vec<&str> = report.lines().filter(|l| l.contains("warning")).collect();
        assert!(warnings.is_empty(), "{}: {warnings:?}", kernel.name);
        // ptxas reports a serialized wgmma as information (C7520), not as a warning.
        assert!(
            !report.contains("serialized"),
            "{}: wgmma serialized\n{report}",
            kernel.name
        );
        let spills = figure(&report, "bytes spill stores").unwrap_or(0)
            + figure(&report, "bytes spill loads").unwrap_or(0);
        let stack = figure(&report, "bytes stack frame").unwrap_or(0);
        let registers = figure(&report, "registers").unwrap_or(0);
        assert_eq!(spills, 0, "{}: spills\n{report}", kernel.name);
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
