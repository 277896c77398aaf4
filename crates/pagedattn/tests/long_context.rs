//! Accuracy at the lengths the contract allows, and fp8 caches with extreme scales.
//!
//! The long decodes read two physical blocks reused through the block table, so that every
//! key contributes comparably over 2^24 + 1000 and i32::MAX positions; the exact answer is
//! computed here in f64 from each distinct key's multiplicity (the softmax over repeated keys
//! is a short weighted sum). `cpu` runs on every instruction set this machine has (at
//! i32::MAX, each distinct kernel path once). The fp8 probes hold `cpu` to `reference` with
//! `k_scale` near f32's largest values and `v_scale` near its smallest normal ones. A prefill
//! whose packed keys cannot be allocated is `OutOfMemory`.
//!
//! The same long decodes and fp8 probes on `cuda` are separate tests that need a GPU and are
//! `#[ignore]`d: a run without one lists them as ignored; `tools/gpu-suite.sh run all` (or
//! `--include-ignored` on a GPU machine) runs them, and run where no GPU is usable they fail
//! saying why. The `cpu` decode over i32::MAX keys is `#[ignore]`d too (40 s of a 2-core
//! machine, most of the test command's time): `.ci/run` runs it by name, and the GPU suite
//! with the rest.

mod common;

use std::process::Command;
use std::time::Instant;

use common::{disagreement, HandmadeCall};
use pagedattn::*;

/// One call with a hand-made cache: zeros plus the rows written before the call.
type Call = HandmadeCall;

/// The `cpu` backend on every instruction set this machine has.
fn cpu_isas() -> impl Iterator<Item = (cpu::Isa, cpu::Cpu)> {
    cpu::Isa::ALL
        .into_iter()
        .filter(|isa| isa.is_available())
        .map(|isa| (isa, cpu::Cpu::with_isa(isa).unwrap()))
}

/// `n` values `offset + amplitude * sin(0.731 i + phase)`: distinct, of modest size.
fn pattern(n: usize, phase: f32, offset: f32, amplitude: f32) -> Vec<f32> {
    (0..n)
        .map(|i| offset + amplitude * (i as f32 * 0.731 + phase).sin())
        .collect()
}

fn tensor(dtype: DType, shape: &[usize], values: &[f32]) -> Tensor {
    Tensor::from_f32(dtype, shape, values).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Long decodes against the exact answer.
// ---------------------------------------------------------------------------------------------

/// Head size: a multiple of every ISA's vector width, so that each ISA runs its own kernels.
const D: usize = 16;
/// The soft cap.
const CAP: f32 = 50.0;

/// A decode at position `seq_len - 1` over two physical blocks of `block_size` keys, block `b`
/// of the sequence being physical block `b % 2`, head size `d`: the call, and the exact output
/// in f64.
fn long_decode(seq_len: usize, block_size: usize, d: usize) -> (Call, Vec<f64>) {
    let config = AttentionConfig::builder(1, d)
        .scale(1.0)
        .logits_soft_cap(Some(CAP))
        .build()
        .unwrap();
    let blocks = seq_len.div_ceil(block_size);
    let table: Vec<i32> = (0..blocks).map(|b| (b % 2) as i32).collect();
    // Scores in about [-4, 4] (every key weighs within e^8 of every other), values near 1
    // (the output is far from 0, so a relative error means what it says).
    let rows = 2 * block_size;
    let q = pattern(d, 0.3, 0.0, 1.0);
    let mut k = pattern(rows * d, 1.0, 0.0, 1.0);
    let mut v = pattern(rows * d, 2.0, 1.0, 0.5);
    let (new_k, new_v) = (pattern(d, 4.0, 0.0, 1.0), pattern(d, 5.0, 1.0, 0.5));
    // The new token overwrites its slot before the keys are read.
    let last = seq_len - 1;
    let slot = table[last / block_size] as usize * block_size + last % block_size;
    k[slot * d..(slot + 1) * d].copy_from_slice(&new_k);
    v[slot * d..(slot + 1) * d].copy_from_slice(&new_v);
    let metadata = MetadataBuilder::new(block_size)
        .push(SequenceDesc::decode(seq_len - 1, &table))
        .build()
        .unwrap();
    let call = Call {
        config,
        metadata,
        query: tensor(DType::F32, &[1, 1, d], &q),
        kv: Some((
            tensor(DType::F32, &[1, 1, d], &new_k),
            tensor(DType::F32, &[1, 1, d], &new_v),
        )),
        cache: Some((
            DType::F32,
            2,
            tensor(DType::F32, &[rows, 1, d], &k),
            tensor(DType::F32, &[rows, 1, d], &v),
            (0..rows as i64).collect(),
        )),
    };
    // How many positions read each slot.
    let mut count = vec![0u64; rows];
    for (b, &p) in table.iter().enumerate() {
        let n = block_size.min(seq_len - b * block_size);
        for c in &mut count[p as usize * block_size..][..n] {
            *c += 1;
        }
    }
    let score = |row: &[f32]| {
        let dot: f64 = q.iter().zip(row).map(|(&a, &b)| a as f64 * b as f64).sum();
        CAP as f64 * (dot / CAP as f64).tanh()
    };
    let scores: Vec<f64> = k.chunks_exact(d).map(score).collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (mut l, mut acc) = (0.0f64, vec![0.0f64; d]);
    for ((&s, &c), row) in scores.iter().zip(&count).zip(v.chunks_exact(d)) {
        let w = c as f64 * (s - max).exp();
        l += w;
        for (a, &x) in acc.iter_mut().zip(row) {
            *a += w * x as f64;
        }
    }
    (call, acc.iter().map(|a| a / l).collect())
}

/// The largest `|got - want|` over the output, relative to the largest `|want|`.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_finite() {
                (g as f64 - w).abs() / scale
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// Checks `backend`'s output of `call` against `want` within 1e-5 relative.
fn check(what: &str, backend: &dyn Backend, call: &Call, want: &[f64]) {
    let start = Instant::now();
    let got = call.run(backend);
    let err = relative_error(&got, want);
    println!("{what}: relative error {err:.2e} ({:.1?})", start.elapsed());
    assert!(
        err <= 1e-5,
        "{what}: relative error {err:.2e}: {got:?} vs {want:?}"
    );
}

/// The decode: 2^24 + 1000 keys with soft cap 50, f32 (`cpu` was 1.3e-3 off on every
/// instruction set).
#[test]
fn decode_over_2_pow_24_keys_is_accurate() {
    let (call, want) = long_decode((1 << 24) + 1000, 1 << 12, D);
    check(
        "reference",
        &*registry::backend("reference").unwrap(),
        &call,
        &want,
    );
    for (isa, cpu) in cpu_isas() {
        check(&format!("cpu {isa}"), &cpu, &call, &want);
    }
}

/// The longest sequence the contract allows, decoding at its last position over all its keys
/// (`reference` is left out: it takes minutes there). Each distinct kernel path once, at the
/// head size of one vector of its own width (the cheapest key it has; the long-context folding
/// is the generic attend's, shared by every path): AVX-512 at 16, AVX2 at 8, scalar at 1 (and
/// NEON at 4). AVX512-BF16 and AMX are skipped: with f32 queries they run AVX-512's kernels
/// (their own take bf16 queries), which would only repeat its 2^31 keys.
/// `LONG_CONTEXT_WIDEST=1` runs the widest path alone (`.ci/run`, where each path's 2^31 keys
/// take 40-100 s of a 2-core machine; `tools/gpu-suite.sh all` runs every path).
#[test]
#[ignore = "minutes of a 2-core machine: .ci/run and tools/gpu-suite.sh run it (-- --ignored --exact)"]
fn decode_over_i32_max_keys_is_accurate() {
    let widest_only = std::env::var_os("LONG_CONTEXT_WIDEST").is_some();
    let mut calls: Vec<(usize, (Call, Vec<f64>))> = Vec::new();
    for (isa, cpu) in cpu_isas() {
        let d = match isa {
            cpu::Isa::Amx | cpu::Isa::Avx512Bf16 => continue,
            cpu::Isa::Avx512 => 16,
            cpu::Isa::Avx2 => 8,
            cpu::Isa::Neon => 4,
            _ => 1,
        };
        if !calls.iter().any(|(dd, _)| *dd == d) {
            calls.push((d, long_decode(i32::MAX as usize, 1 << 16, d)));
        }
        let (call, want) = &calls.iter().find(|(dd, _)| *dd == d).unwrap().1;
        check(&format!("cpu {isa}, head size {d}"), &cpu, call, want);
        if widest_only {
            break;
        }
    }
}

/// Both long decodes on the GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cuda_long_decodes_are_accurate() {
    let cuda = common::gpu();
    // The smallest head size the GPU has (it has no 16).
    let d = pagedattn::cuda::ATTENTION_HEAD_SIZES[0];
    for (seq_len, block_size) in [((1 << 24) + 1000, 1 << 12), (i32::MAX as usize, 1 << 16)] {
        let (call, want) = long_decode(seq_len, block_size, d);
        check(&format!("cuda, {seq_len} keys"), &cuda, &call, &want);
    }
}

// ---------------------------------------------------------------------------------------------
// Scratch the host cannot allocate.
// ---------------------------------------------------------------------------------------------

/// The environment variable naming the scenario a child process runs.
const CHILD: &str = "PAGEDATTN_LONG_CONTEXT_CHILD";

/// Runs `scenario` in a child process, which must exit normally with status 0 (an abort
/// fails the test instead of killing the harness).
fn in_child(scenario: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([scenario, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, scenario)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{scenario} ended with {:?} (a signal means a crash):\n{text}",
        out.status
    );
    println!("{text}");
}

/// Whether this process is the child running `scenario`.
fn is_child(scenario: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|s| s == scenario)
}

/// Why an allocation of `bytes` might succeed on this host (so that the test would not show
/// what it means to), if it might: Linux's default heuristic overcommit
/// (`vm.overcommit_memory = 0`) refuses a single allocation larger than RAM plus swap, and
/// `2` refuses it too; `1` grants anything (the packing would then fill it, page by page).
fn allocation_might_succeed(bytes: u64) -> Option<String> {
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").ok()?;
    if overcommit.trim() == "1" {
        return Some("vm.overcommit_memory is 1".into());
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |field: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let total = (kib("MemTotal:") + kib("SwapTotal:")) * 1024;
    (total >= bytes).then(|| format!("RAM + swap is {total} bytes"))
}

/// A prefill chunk of 2 tokens at the end of an i32::MAX-token sequence packs its whole key
/// range per (sequence, kv head): with head size 64, 512 GiB of f32 keys and as much of
/// values, or 256 GiB of bf16 keys (the AVX512-BF16 packing, bf16 queries). On every
/// instruction set and both query types that is `Error::OutOfMemory`, not an abort inside a
/// thread-pool task. Meaningful where a 256 GiB allocation fails: RAM plus swap below it,
/// with Linux's default overcommit (skipped otherwise, saying why).
#[test]
fn prefill_packing_too_large_for_the_host_is_out_of_memory() {
    let scenario = "prefill_packing_too_large_for_the_host_is_out_of_memory";
    if let Some(why) = allocation_might_succeed(256 << 30) {
        println!("skipped: a 256 GiB allocation might succeed here ({why})");
        return;
    }
    if !is_child(scenario) {
        in_child(scenario);
        return;
    }
    let (d, block_size, n) = (64usize, 1usize << 16, 2usize);
    let seq_len = i32::MAX as usize;
    // Every block of the table is physical block 0 (the cache is one block).
    let table = vec![0i32; seq_len.div_ceil(block_size)];
    for dtype in [DType::F32, DType::BF16] {
        let config = AttentionConfig::builder(1, d).build().unwrap();
        let spec = config.kv_cache_spec(dtype, 1, block_size);
        let md = MetadataBuilder::for_cache(&spec)
            .push(SequenceDesc::prompt(seq_len - n, n, &table))
            .build()
            .unwrap();
        let q = tensor(dtype, &[n, 1, d], &pattern(n * d, 0.3, 0.0, 1.0));
        let k = tensor(dtype, &[n, 1, d], &pattern(n * d, 1.0, 0.0, 1.0));
        let v = tensor(dtype, &[n, 1, d], &pattern(n * d, 2.0, 0.0, 1.0));
        for (isa, cpu) in cpu_isas() {
            let attention = cpu.attention(&config).unwrap();
            let mut cache = cpu.allocate_kv_cache(&spec).unwrap();
            let plan = attention.plan(&md, Some(&spec)).unwrap();
            let mut workspace = cpu.workspace(&plan).unwrap();
            let mut out = Tensor::zeros(dtype, &[n, 1, d]).unwrap();
            let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(&mut cache);
            let result = attention.forward_into(&plan, &mut workspace, inputs, &mut out);
            println!("{dtype:?} {isa}: {result:?}");
            match result {
                Err(Error::OutOfMemory { device, bytes }) => {
                    assert_eq!(device, "cpu");
                    assert!(bytes >= 256 << 30, "{dtype:?} {isa}: {bytes} bytes");
                }
                other => panic!("{dtype:?} {isa}: expected OutOfMemory, got {other:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fp8 caches with extreme scales.
// ---------------------------------------------------------------------------------------------

/// Checks each of `backends` against `reference` on every call of
/// [`fp8_extreme_scale_calls`]: the contract's NaN / Inf classes, and finite elements within
/// the call's tolerance of the largest finite reference magnitude (or equal where that is 0).
fn fp8_probes_agree(backends: &[(String, Box<dyn Backend>)]) {
    let reference = registry::backend("reference").unwrap();
    for (what, call, rel) in fp8_extreme_scale_calls() {
        let want = call.run(&*reference);
        for (name, backend) in backends {
            if let Some(e) = disagreement(&want, &call.run(&**backend), rel) {
                panic!("{what}, {name}: {e}");
            }
        }
    }
}

/// fp8 caches with `k_scale` near 1e38 and `v_scale` near 1e-38 (`|scale| * k_scale` near 1,
/// in range): keys of order 1e38 and values of order 1e-38 stored as codes of order 1, read
/// by decodes and prefills, f32 and bf16 queries (the AVX512-BF16 and AMX kernels take bf16),
/// both fp8 formats; and a 16-bit cache with a scale of 3e38. Each call is named, with the
/// tolerance of its outputs.
fn fp8_extreme_scale_calls() -> Vec<(String, Call, f32)> {
    let mut calls = Vec::new();
    let (h, d, n) = (2usize, 64usize, 40usize);
    let formats = [KvCacheDtype::Fp8E4m3, KvCacheDtype::Fp8E5m2];
    // (softmax scale, k_scale, v_scale, key amplitude, value amplitude): keys and values of
    // order 1 stored as code 0 and as the saturated code with the scales of the report; codes
    // of order 1 with scales near f32's limits.
    let scales = [
        (3.0f32, 1e38f32, 1e-40f32, 1.0f32, 1.0f32),
        (3.0, 1e38, 1e-38, 0.9e38, 1e-38),
        (1e-38, 1e38, 1e-38, 0.9e38, 1e-38),
        (3e-38, 3e37, 1.5e-38, 2.7e37, 1.5e-38),
        (1e-37, 3.4e38, 1.2e-38, 3e38, 1.2e-38),
    ];
    // And a 16-bit cache under a scale near f32's largest, its keys multiples of 2^-126
    // (f32's least normal) and its queries integers: scores of order 100, every product and
    // sum exact (no subnormal for a kernel to flush). Kernels that keep the scale out of the
    // scores must not fold it into an exponent factor, which would overflow.
    let cases = formats
        .into_iter()
        .flat_map(|format| scales.map(|s| (format, s)))
        .chain([(KvCacheDtype::Auto, (3e38, 1.0, 1.0, 1.0, 1.0))]);
    for (kv_cache_dtype, (scale, k_scale, v_scale, k_amp, v_amp)) in cases {
        for dtype in [DType::F32, DType::BF16] {
            let config = AttentionConfig::builder(h, d)
                .num_kv_heads(1)
                .scale(scale)
                .kv_cache_dtype(kv_cache_dtype)
                .kv_scales(k_scale, v_scale)
                .build()
                .unwrap();
            let exact = kv_cache_dtype == KvCacheDtype::Auto;
            let k: Vec<f32> = pattern(n * d, 1.0, 0.0, k_amp)
                .iter()
                .map(|&x| {
                    if exact {
                        (4.0 * x).round() * f32::MIN_POSITIVE
                    } else {
                        x
                    }
                })
                .collect();
            let v: Vec<f32> = pattern(n * d, 2.0, 0.5, 1.0)
                .iter()
                .map(|x| x * v_amp)
                .collect();
            // bf16 outputs round to 2^-8 relative.
            let rel = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            let q: Vec<f32> = pattern(n * h * d, 0.0, 0.0, 1.0)
                .iter()
                .map(|&x| if exact { (3.0 * x).round() } else { x })
                .collect();
            // A prompt of n tokens written into the cache; then, on its own, the last of
            // them as a decode over the n - 1 before it.
            let prompt = MetadataBuilder::new(16)
                .push(SequenceDesc::prompt(0, n, &[0, 1, 2]))
                .build()
                .unwrap();
            let what =
                format!("{kv_cache_dtype:?} {dtype:?} scales {scale:e} {k_scale:e} {v_scale:e}");
            let prefill = Call {
                config: config.clone(),
                metadata: prompt,
                query: tensor(dtype, &[n, h, d], &q),
                kv: Some((tensor(dtype, &[n, 1, d], &k), tensor(dtype, &[n, 1, d], &v))),
                cache: Some((
                    dtype,
                    3,
                    tensor(dtype, &[0, 1, d], &[]),
                    tensor(dtype, &[0, 1, d], &[]),
                    vec![],
                )),
            };
            calls.push((format!("prefill {what}"), prefill, rel));
            let decode = Call {
                config,
                metadata: MetadataBuilder::new(16)
                    .push(SequenceDesc::decode(n - 1, &[0, 1, 2]))
                    .build()
                    .unwrap(),
                query: tensor(dtype, &[1, h, d], &q[..h * d]),
                kv: Some((
                    tensor(dtype, &[1, 1, d], &k[(n - 1) * d..]),
                    tensor(dtype, &[1, 1, d], &v[(n - 1) * d..]),
                )),
                cache: Some((
                    dtype,
                    3,
                    tensor(dtype, &[n - 1, 1, d], &k[..(n - 1) * d]),
                    tensor(dtype, &[n - 1, 1, d], &v[..(n - 1) * d]),
                    (0..n as i64 - 1).collect(),
                )),
            };
            calls.push((format!("decode {what}"), decode, rel));
        }
    }
    calls
}

/// The fp8 probes on every `cpu` ISA: `cpu` gave NaN where `reference` gives values of order
/// 1e-38.
#[test]
fn fp8_caches_with_extreme_scales_follow_the_reference() {
    let isas: Vec<(String, Box<dyn Backend>)> = cpu_isas()
        .map(|(isa, cpu)| (format!("cpu {isa}"), Box::new(cpu) as _))
        .collect();
    fp8_probes_agree(&isas);
}

/// The fp8 probes on the GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cuda_fp8_caches_with_extreme_scales_follow_the_reference() {
    fp8_probes_agree(&[("cuda".to_string(), Box::new(common::gpu()))]);
}
