//! The library reproduces the replay cases in `tests/replay-cases/`, which an independent
//! NumPy implementation of the contract produced (`tools/replay_cases.py`): `reference` and
//! `cpu` under every instruction set of this machine (NEON and scalar under qemu: `.ci/aarch64`),
//! the output within the dtype's tolerance and the caches after the call byte for byte. (The
//! CLI's `forward` runs the same `replay::run_case`: its tests check the command around it.)

use std::path::{Path, PathBuf};

use pagedattn::replay::{read_case, read_output, run_case};
use pagedattn::{cpu, registry, Backend, DType, Tensor};

/// The backends checked: `reference`, and `cpu` under every instruction set this machine has.
fn backends() -> Vec<(String, Box<dyn Backend>)> {
    let mut backends: Vec<(String, Box<dyn Backend>)> = vec![(
        "reference".into(),
        registry::backend("reference").expect("reference starts"),
    )];
    for isa in cpu::Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let backend = cpu::Cpu::with_isa(isa).expect("an available instruction set");
        backends.push((format!("cpu {}", isa.name()), Box::new(backend)));
    }
    backends
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
fn backends_reproduce_the_independent_cases() {
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
    let backends = backends();
    for path in &cases {
        let name = path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace(".case.safetensors", "");
        let case = read_case(&std::fs::read(path).unwrap()).unwrap();
        let expected_path = path.with_file_name(format!("{name}.expected.safetensors"));
        let want = read_output(&std::fs::read(expected_path).unwrap()).unwrap();
        for (backend_name, backend) in &backends {
            let label = format!("{name} on {backend_name}");
            let got = run_case(&case, backend.as_ref()).unwrap_or_else(|e| panic!("{label}: {e}"));
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
