//! `pagedattn run`: the built-in workload (or a replay case) on a backend, checked against
//! `reference`.

use std::path::Path;
use std::process::{Command, Output};

use pagedattn::cpu::{Isa, ISA_ENV};

fn pagedattn(args: &[&str], isa: Option<Isa>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pagedattn"));
    cmd.args(args);
    if let Some(isa) = isa {
        cmd.env(ISA_ENV, isa.name());
    }
    cmd.output().unwrap()
}

/// Exit code 0 and the check's verdict "ok" on stdout, which names `backend`.
fn assert_ok(out: &Output, backend: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout} stderr: {stderr}"
    );
    assert!(stdout.contains(&format!("{backend}: ")), "{stdout}");
    assert!(stdout.trim_end().ends_with(": ok"), "{stdout}");
}

#[test]
fn built_in_workload_matches_reference_on_every_isa() {
    assert_ok(
        &pagedattn(&["run", "--backend", "reference"], None),
        "reference",
    );
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let out = pagedattn(&["run", "--backend", "cpu"], Some(isa));
        assert_ok(&out, "cpu");
    }
}

#[test]
fn replay_case_runs_and_writes_output() {
    let case = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/mixed_batch.safetensors");
    let out_path =
        std::env::temp_dir().join(format!("pagedattn-run-{}.safetensors", std::process::id()));
    let out = pagedattn(
        &[
            "run",
            "--input",
            case.to_str().unwrap(),
            "--output",
            out_path.to_str().unwrap(),
        ],
        None,
    );
    assert_ok(&out, "cpu");
    let written = std::fs::read(&out_path).unwrap();
    let result = pagedattn::replay::read_output(&written).unwrap();
    let case = pagedattn::replay::read_case(&std::fs::read(&case).unwrap()).unwrap();
    assert_eq!(result.output.shape(), case.query.shape());
    std::fs::remove_file(out_path).unwrap();
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    for args in [
        &["run", "--input", "/nonexistent/case.safetensors"][..],
        &["run", "--backend", "nope"][..],
    ] {
        let out = pagedattn(args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
}
