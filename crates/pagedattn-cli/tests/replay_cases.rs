//! `pagedattn forward` reproduces the replay cases in `tests/replay-cases/`, which an
//! independent NumPy implementation of the contract produced (`tools/replay_cases.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use pagedattn::cpu::{Isa, ISA_ENV};
use pagedattn::replay::read_output;
use pagedattn::{DType, Tensor};

/// Backends checked against the expected files, with the instruction set forced through
/// `PAGEDATTN_ISA` for `cpu` (every one this machine has).
fn runs() -> Vec<(&'static str, Option<Isa>)> {
    let mut runs = vec![("reference", None)];
    runs.extend(
        Isa::ALL
            .into_iter()
            .filter(|i| i.is_available())
            .map(|i| ("cpu", Some(i))),
    );
    runs
}

fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/replay-cases")
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        DType::U8 => unreachable!("outputs are floats"),
    }
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{name}: output shape");
    assert_eq!(got.dtype(), want.dtype(), "{name}: output dtype");
    let tol = tolerance(want.dtype());
    let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let (a, b) = (*a as f64, b as f64);
        assert!(
            (a - b).abs() <= tol * (b.abs() + 1e-6),
            "{name}: output[{i}] = {a}, expected {b} (tolerance {tol} relative)"
        );
    }
}

#[test]
fn forward_reproduces_independent_cases() {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(cases_dir())
        .expect("tests/replay-cases exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".case.safetensors"))
        .collect();
    cases.sort();
    assert!(
        cases.len() >= 15,
        "expected the replay cases, found {}",
        cases.len()
    );
    let out_dir = tempdir();
    for (backend, isa) in runs() {
        for case in &cases {
            let name = case
                .file_name()
                .unwrap()
                .to_string_lossy()
                .replace(".case.safetensors", "");
            let label = format!("{name} on {backend} {}", isa.map_or("", |i| i.name()));
            let out = out_dir.join(format!("{name}.{backend}.safetensors"));
            let mut cmd = command(env!("CARGO_BIN_EXE_pagedattn"));
            if let Some(isa) = isa {
                cmd.env(ISA_ENV, isa.name());
            }
            let status = cmd
                .args(["forward", "--backend", backend, "--input"])
                .arg(case)
                .arg("--output")
                .arg(&out)
                .output()
                .unwrap();
            assert!(
                status.status.success(),
                "{label}: {}",
                String::from_utf8_lossy(&status.stderr)
            );
            let got = read_output(&std::fs::read(&out).unwrap()).unwrap();
            let expected_path = case.with_file_name(format!("{name}.expected.safetensors"));
            let want = read_output(&std::fs::read(expected_path).unwrap()).unwrap();
            assert_close(&label, &got.output, &want.output);
            match (&got.kv_cache, &want.kv_cache) {
                (Some((gk, gv)), Some((wk, wv))) => {
                    assert_eq!(gk.shape(), wk.shape(), "{label}: key_cache shape");
                    assert!(
                        gk.host().unwrap().as_bytes() == wk.host().unwrap().as_bytes(),
                        "{label}: key_cache differs"
                    );
                    assert!(
                        gv.host().unwrap().as_bytes() == wv.host().unwrap().as_bytes(),
                        "{label}: value_cache differs"
                    );
                }
                (None, None) => {}
                (g, w) => panic!(
                    "{label}: cache present in output {} / expected {}",
                    g.is_some(),
                    w.is_some()
                ),
            }
        }
    }
}

/// A command running `program`, through `PAGEDATTN_TEST_RUNNER` when set (e.g. qemu for a
/// cross-compiled binary: `.ci/aarch64`).
fn command(program: &str) -> Command {
    match std::env::var("PAGEDATTN_TEST_RUNNER") {
        Ok(runner) if !runner.trim().is_empty() => {
            let mut words = runner.split_whitespace();
            let mut cmd = Command::new(words.next().unwrap());
            cmd.args(words).arg(program);
            cmd
        }
        _ => Command::new(program),
    }
}

/// A fresh directory under the target dir for this test's outputs.
pub fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagedattn-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
