//! `PAGEDATTN_ISA` forces the instruction set of the `cpu` backend, for `Cpu::new()` and for
//! the backend the registry hands out.
//!
//! One test in its own binary (so its own process): it changes the environment variable,
//! which no other test of this process reads at the same time.

use pagedattn::cpu::{Cpu, Isa, ISA_ENV};
use pagedattn::{
    registry, AttentionConfig, Backend, DType, Inputs, MetadataBuilder, SequenceDesc, Tensor,
};

/// The outputs of two small prefill calls (f32 and bf16, D = 32, 70 keys, GQA group 2) on
/// `backend`. Their roundings differ between instruction sets: the lanes of a dot product
/// are summed in a different order on AVX-512 (16), AVX2 (8) and scalar code, and the
/// AVX512-BF16 kernel rounds probabilities to bf16 for P.V.
fn fingerprint(backend: &dyn Backend) -> Vec<u32> {
    let (h, hkv, d, t) = (4, 2, 32, 70);
    let mut bits = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let config = AttentionConfig::builder(h, d)
            .num_kv_heads(hkv)
            .build()
            .unwrap();
        let md = MetadataBuilder::new(16)
            .push(SequenceDesc::prompt(0, t, &[]))
            .build()
            .unwrap();
        // Deterministic values with plenty of rounding in their products and sums.
        let values = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0 - 1.0) * 1.7)
                .collect()
        };
        let q = Tensor::from_f32(dtype, &[t, h, d], &values(t * h * d, 1)).unwrap();
        let k = Tensor::from_f32(dtype, &[t, hkv, d], &values(t * hkv * d, 2)).unwrap();
        let v = Tensor::from_f32(dtype, &[t, hkv, d], &values(t * hkv * d, 3)).unwrap();
        let attention = backend.attention(&config).unwrap();
        let plan = attention.plan(&md, None).unwrap();
        let mut workspace = backend.workspace(&plan).unwrap();
        let out = attention
            .forward(&plan, &mut workspace, Inputs::new(&q).with_kv(&k, &v))
            .unwrap();
        bits.extend(out.to_f32_vec().unwrap().iter().map(|x| x.to_bits()));
    }
    bits
}

fn set(value: &str) {
    // Edition 2021: safe; this process runs no other test that reads the environment.
    std::env::set_var(ISA_ENV, value);
}

#[test]
fn pagedattn_isa_is_honoured() {
    assert_eq!(ISA_ENV, "PAGEDATTN_ISA");
    let available: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.is_available()).collect();
    assert!(available.contains(&Isa::Scalar));
    let prints: Vec<(Isa, Vec<u32>)> = available
        .iter()
        .map(|&isa| (isa, fingerprint(&Cpu::with_isa(isa).unwrap())))
        .collect();

    // Unset or empty: the best instruction set of this CPU.
    std::env::remove_var(ISA_ENV);
    assert_eq!(Cpu::new().unwrap().isa(), Isa::detect());
    // The first available one, save AVX512-BF16, which Intel CPUs skip (slow `vdpbf16ps`).
    let best = available.iter().position(|&i| i == Isa::detect()).unwrap();
    assert!(
        available[..best].iter().all(|&i| i == Isa::Avx512Bf16),
        "{available:?}"
    );
    set("");
    assert_eq!(Cpu::new().unwrap().isa(), Isa::detect());

    for &(isa, ref print) in &prints {
        set(isa.name());
        assert_eq!(Cpu::new().unwrap().isa(), isa);
        assert_eq!(Isa::from_env().unwrap(), isa);
        // The registry's backend runs that instruction set: its results are bit-identical
        // to `Cpu::with_isa(isa)`'s, and differ from those of every instruction set whose
        // results differ from `isa`'s on these calls.
        // (`auto` is `cpu` where no GPU is seen.)
        let names: &[&str] = if gpu_present() {
            &["cpu"]
        } else {
            &["cpu", "auto"]
        };
        for &name in names {
            let backend = registry::backend(name).unwrap();
            assert_eq!(backend.name(), "cpu", "{ISA_ENV}={isa}: registry {name:?}");
            let got = fingerprint(&*backend);
            assert!(
                &got == print,
                "{ISA_ENV}={isa}: registry {name:?} does not compute as Cpu::with_isa({isa})"
            );
        }
    }
    // The fingerprints tell the vector bodies apart (else the check above proves little).
    for (i, (a, pa)) in prints.iter().enumerate() {
        for (b, pb) in &prints[i + 1..] {
            let same_body = matches!((a, b), (Isa::Avx512Bf16, Isa::Avx512));
            if !same_body {
                assert_ne!(pa, pb, "{a} and {b} compute identically");
            }
        }
    }

    // Instruction sets this CPU lacks, and names that are none: errors that name the variable.
    let unavailable: Vec<&str> = Isa::ALL
        .into_iter()
        .filter(|i| !i.is_available())
        .map(|i| i.name())
        .collect();
    let bad = ["avx9000", "AVX2", "sse"];
    for &name in unavailable.iter().chain(&bad) {
        set(name);
        let err = Cpu::new().unwrap_err().to_string();
        assert!(
            err.contains(ISA_ENV) && err.contains(name),
            "{ISA_ENV}={name}: {err}"
        );
        assert!(Isa::from_env().is_err(), "{name}");
    }
    // The same through the registry: asking for "cpu" must not answer as if the backend did
    // not exist (the user set the variable wrongly; the error must say so).
    let mut wrong = Vec::new();
    for &name in unavailable.iter().chain(&bad) {
        set(name);
        match registry::backend("cpu") {
            Ok(b) => wrong.push(format!("{ISA_ENV}={name}: registry gave {:?}", b.name())),
            Err(e) if !e.to_string().contains(ISA_ENV) => wrong.push(format!(
                "{ISA_ENV}={name}: registry error \"{e}\" does not name {ISA_ENV}"
            )),
            Err(_) => {}
        }
    }
    std::env::remove_var(ISA_ENV);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Whether the driver sees a GPU (then `auto` is the cuda backend).
fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    return pagedattn::cuda::gpu_present();
    #[cfg(not(feature = "cuda"))]
    false
}
