//! The `cpu` backend against the `reference` backend (the oracle, itself checked against a
//! dense attention in `reference_vs_dense`), on every instruction-set path this machine has.
//!
//! Every property builds a random call with the generators of `common` (the same as
//! `reference_vs_dense`, with larger shapes), runs it once on `reference` and then on
//! `Cpu::with_isa(isa)` for every `isa` in `Isa::ALL` that `is_available()` here. Each backend
//! gets its own cache, in its own layout, built from the same canonical contents (NaN poison in
//! every slot no sequence covers, context written with `KvCache::write`); outputs start as NaN.
//! After the call the outputs must agree within the tolerance of [`Tolerance`], and the caches
//! must hold the same bytes in the canonical layout.
//!
//! What the shapes are chosen to reach in the cpu kernels (`src/cpu`):
//! * every ISA's vector body: the dispatcher runs the widest ISA whose lane count divides the
//!   head size, so head sizes that are multiples of 16 run AVX-512 (AVX512-BF16 or not),
//!   multiples of 8 but not 16 run AVX2, anything else the scalar body;
//! * the decode path (scores straight from cache rows) and the packed path (groups of
//!   >= 8 query rows: prefill tiles, and decodes of GQA groups of 8 or MQA with 16-32 heads);
//! * key tiles (64 keys) and query tiles (64 / group tokens) with sequences longer than both;
//! * split-K (a decode of more than 256 keys when the batch has few decode keys) and the
//!   log-sum-exp merge, with windows and padding inside the partitions;
//! * paged caches with block sizes 1..=64 and 128, shuffled blocks, table entries past the
//!   end, padding slots, zero-length encoder sequences, all four attention types, fp8.
//!
//! Seeds are fresh every run (proptest's default); a failing case prints its `settings.seed`,
//! which regenerates its data. `PROPTEST_CASES=n` runs n cases per property.

mod common;

use common::*;
use pagedattn::cpu::{Cpu, Isa};
use pagedattn::{
    registry, AttentionConfig, AttentionMetadata, AttnType, Backend, DType, KvCacheDtype, Tensor,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The backends.
// ---------------------------------------------------------------------------------------------

/// The cpu backend on every instruction set this machine can run.
fn cpus() -> Vec<Cpu> {
    Isa::ALL
        .into_iter()
        .filter(|i| i.is_available())
        .map(|i| Cpu::with_isa(i).expect("available"))
        .collect()
}

fn reference() -> Box<dyn Backend> {
    registry::backend("reference").unwrap()
}

#[test]
fn every_available_isa_is_tested() {
    let isas: Vec<Isa> = cpus().iter().map(|c| c.isa()).collect();
    eprintln!("cpu_vs_reference runs the ISAs {isas:?}");
    assert!(isas.contains(&Isa::Scalar));
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            assert!(isas.contains(&Isa::Avx2), "{isas:?}");
        }
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            assert!(isas.contains(&Isa::Avx512), "{isas:?}");
        }
    }
    #[cfg(target_arch = "aarch64")]
    assert!(isas.contains(&Isa::Neon), "{isas:?}");
    for isa in Isa::ALL {
        assert_eq!(Cpu::with_isa(isa).is_ok(), isa.is_available(), "{isa}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerance.
// ---------------------------------------------------------------------------------------------

/// f32 unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// How far a correct f32-accumulating kernel may be from the f64 reference, elementwise:
/// `|got - want| <= ulp * max(|got|, |want|) + tiny + vmax * U * (C0 + C1 * smag) [+ pv]`.
///
/// * Both backends round their result to the output dtype once; when the exact value lies
///   near a rounding boundary they may land on neighbouring values: one ulp, at most
///   `2^-23` (f32), `2^-10` (f16), `2^-7` (bf16) of the value, plus the smallest subnormal
///   step (f16: `2^-24`) for values that small.
/// * The f32 error of the kernel itself. The output is a convex combination of values, so
///   errors are measured against `vmax`, the largest value magnitude (the amplitude; fp8
///   reads round `x / v_scale` to 3 (e4m3) or 2 (e5m2) mantissa bits, up to 1.125 / 1.25 x).
///   - An absolute error `ds` in a score changes its weight by a factor `e^ds`, so moves the
///     output by at most `2 * vmax * ds`. f32 scores carry an error proportional to their
///     magnitude: the scaled query, each product and partial sum of `q.k`, the ALiBi bias
///     and the soft cap (`cap * tanh`, with `tanh` good to a few ulps absolute) are rounded
///     at a few ulps of the largest terms. `smag` bounds those terms:
///     `|scale| * D * qmax * kmax` (the sum of |q_i k_i| can not exceed it; random data reach
///     about a quarter of it) + `max|slope| * max distance` + `cap`. Hence `C1`.
///   - The exponentials (a few ulps), the running sums of the online softmax over tiles and
///     split-K partitions, the P.V sums and the normalisation: a few dozen roundings of
///     quantities bounded by `vmax`. Hence `C0`, which also covers the reference's own
///     rounding to f32.
/// * `pv`, for bf16 calls on AVX512-BF16: prefill rows (sequences with more than one query
///   token) with D a multiple of 16, and decode rows with D a multiple of 32 (bf16 keys
///   and values read in place). Those kernels (`src/cpu/bf16.rs`) round each
///   probability to bf16 for its `vdpbf16ps` P.V, as GPU flash attention does, while the
///   softmax denominator sums the f32 probabilities. Rounding to nearest (bf16 keeps 8
///   significant bits) changes each `p_j` by at most `2^-8 p_j`, so the output by at most
///   `2^-8 * sum p_j |v_j| / l <= 2^-8 * vmax`: `pv = 2^-8 * vmax`, a strict bound of that
///   rounding (the queries, bf16 keys and fp8 codes are exact in bf16, and the scores are
///   accumulated in f32). The largest seen is 0.41 of it.
/// * `flush`, for bf16 calls on AVX512-BF16 and AMX: their dot-product instructions read
///   subnormal inputs as zero and flush subnormal products and sums (docs/semantics.md,
///   "Subnormal bf16 inputs"): `vmax (e^(2δ) - 1) + (n + 1) 2^-126` with `δ = D 2^-126 (1 +
///   |scale|) (qmax + kmax + 1)` and `n` keys at most `max_pos + 1`. Below f32's resolution for
///   the usual amplitudes; it matters for tiny ones.
#[derive(Debug, Clone, Copy)]
struct Tolerance {
    ulp: f64,
    tiny: f64,
    abs: f64,
    pv: f64,
    flush: f64,
    /// Whether `pv` applies to decode rows too.
    pv_decode: bool,
    /// `vmax * U` and the parts of `smag` (dot, ALiBi, soft cap), for calibration.
    unit: f64,
    parts: [f64; 3],
}

/// See [`Tolerance`]. Calibrated with `CPU_VS_REFERENCE_STATS=1 PROPTEST_CASES=2500` (about
/// 50 000 calls over all ISAs): the errors seen reach about 0.5 x the dot part of `smag`,
/// 0.7 x its ALiBi part and 1.25 x the soft cap (in units of `vmax * U`), and about 3 when
/// `smag` is small; the largest seen is 0.34 of this allowance.
const C0: f64 = 16.0;
const C1: f64 = 3.0;

impl Tolerance {
    /// `max_pos`: the largest key or query position of the call (ALiBi distances).
    fn new(st: &Settings, config: &AttentionConfig, max_pos: usize, isa: Isa) -> Tolerance {
        let (ulp, tiny) = match st.dtype {
            DType::F32 => (2f64.powi(-23), 0.0),
            DType::F16 => (2f64.powi(-10), 2f64.powi(-24)),
            DType::BF16 => (2f64.powi(-7), 0.0),
            DType::U8 => unreachable!(),
        };
        let amp = st.amplitude as f64;
        let fp8_growth = match st.kv_cache_dtype {
            KvCacheDtype::Auto => 1.0,
            KvCacheDtype::Fp8E4m3 => 1.125,
            KvCacheDtype::Fp8E5m2 => 1.25,
        };
        let (mut vmax, mut kmax) = (amp * fp8_growth, amp * fp8_growth);
        // An fp8 cache stores an injected infinity as its largest finite code.
        if let (Some(format), true) = (st.kv_cache_dtype.fp8_format(), st.specials > 0.0) {
            let largest = format.max_finite() as f64;
            kmax = kmax.max(largest * st.k_scale as f64);
            vmax = vmax.max(largest * st.v_scale as f64);
        }
        let slope = st.slopes().map_or(0.0, |s| {
            s.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64))
        });
        let parts = [
            (config.scale() as f64).abs() * st.head_size as f64 * amp * kmax,
            slope * max_pos as f64,
            st.soft_cap.map_or(0.0, f64::from),
        ];
        let smag: f64 = parts.iter().sum();
        // The bf16 dot-product kernels (prefill rows; decode rows where the ISA says so):
        // probabilities rounded to bf16 for P·V, subnormals flushed.
        let bf16_pv = st.dtype == DType::BF16 && isa.bf16_dot_products(st.head_size, true);
        // (fp8 caches: their codes widen to bf16 exactly, with AVX512-VBMI; without it the
        // decode takes the f32 path, a looser bound there, while the forced `avx512` run checks
        // that same f32 path at the f32 bound.)
        let pv_decode = bf16_pv && isa.bf16_dot_products(st.head_size, false);
        let flush = if bf16_pv {
            let tiny = 2f64.powi(-126);
            let delta = st.head_size as f64
                * tiny
                * (1.0 + (config.scale() as f64).abs())
                * (amp + kmax + 1.0);
            vmax * (2.0 * delta).exp_m1() + (max_pos + 2) as f64 * tiny
        } else {
            0.0
        };
        Tolerance {
            ulp,
            tiny,
            abs: vmax * U * (C0 + C1 * smag),
            pv: if bf16_pv { 2f64.powi(-8) * vmax } else { 0.0 },
            flush,
            pv_decode,
            unit: vmax * U,
            parts,
        }
    }

    /// The largest difference allowed; `prefill`: the element's token belongs to a sequence
    /// with more than one query token.
    fn bound(&self, got: f64, want: f64, prefill: bool) -> f64 {
        let pv = if prefill || self.pv_decode {
            self.pv
        } else {
            0.0
        };
        self.ulp * got.abs().max(want.abs()) + self.tiny + self.abs + pv + self.flush
    }

    fn allows(&self, got: f64, want: f64, prefill: bool) -> bool {
        got.is_finite() && (got - want).abs() <= self.bound(got, want, prefill)
    }
}

/// Per token of a call: whether its sequence has more than one query token.
fn prefill_tokens(md: &AttentionMetadata) -> Vec<bool> {
    let mut prefill = vec![false; md.num_tokens()];
    for s in 0..md.num_seqs() {
        let range = md.query_range(s);
        let many = range.len() > 1;
        prefill[range].fill(many);
    }
    prefill
}

/// Checks the cpu output of `call` elementwise against the reference output.
fn compare(got: &Tensor, want: &Tensor, call: &Call, tol: &Tolerance, what: &str) -> TestResult {
    prop_assert_eq!(got.shape(), want.shape());
    let (h, d) = (want.shape()[1], want.shape()[2]);
    let prefill = prefill_tokens(&call.metadata);
    let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    let mut worst: Option<(usize, f64)> = None;
    let mut bad = 0;
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let (g, w, p) = (g as f64, w as f64, prefill[i / (h * d)]);
        if !(g.is_finite() && w.is_finite()) {
            if !same_class(g, w) {
                let (t, hh, dd) = (i / (h * d), i / d % h, i % d);
                return Err(TestCaseError::fail(format!(
                    "{what}: output[{t}][{hh}][{dd}] = {g}, reference = {w} (the contract's \
                     NaN / Inf agreement)"
                )));
            }
            continue;
        }
        if !tol.allows(g, w, p) {
            bad += 1;
            let excess = if g.is_finite() {
                (g - w).abs() / tol.bound(g, w, p)
            } else {
                f64::INFINITY
            };
            if worst.is_none_or(|(_, e)| excess > e) {
                worst = Some((i, excess));
            }
        }
        stats::record(g, w, p, tol);
    }
    if let Some((i, _)) = worst {
        let (t, hh, dd) = (i / (h * d), i / d % h, i % d);
        let (g, w) = (got[i] as f64, want[i] as f64);
        return Err(TestCaseError::fail(format!(
            "{what}: output[{t}][{hh}][{dd}] = {g:e}, reference = {w:e} (difference {:e}, \
             allowed {:e}); {bad} of {} elements out of tolerance",
            (g - w).abs(),
            tol.bound(g, w, prefill[t]),
            got.len()
        )));
    }
    Ok(())
}

/// The contract's agreement for outputs that are not both finite: NaN exactly where the
/// reference has NaN; where it has ±Inf, the same infinity or NaN (an f32 weight that
/// underflowed to 0 meeting an infinite value, where the reference's f64 weight did not).
fn same_class(got: f64, want: f64) -> bool {
    if want.is_nan() {
        got.is_nan()
    } else if want.is_infinite() {
        got == want || got.is_nan()
    } else {
        got.is_finite()
    }
}

/// Calibration: with `CPU_VS_REFERENCE_STATS=1`, prints for every call the largest
/// `(|got - want| - ulp * max(|got|, |want|) - tiny) / (vmax * U)` (to compare with
/// `C0 + C1 * smag`) outside the rows that get `pv`, the parts of `smag`, and the largest
/// `(|got - want| - ulp * max(|got|, |want|) - tiny) / pv` of the rows that get it.
mod stats {
    use super::Tolerance;
    use std::sync::atomic::{AtomicU64, Ordering};

    static WORST: AtomicU64 = AtomicU64::new(0);
    static WORST_PV: AtomicU64 = AtomicU64::new(0);

    pub fn enabled() -> bool {
        std::env::var_os("CPU_VS_REFERENCE_STATS").is_some()
    }

    pub fn record(g: f64, w: f64, prefill: bool, tol: &Tolerance) {
        if !enabled() || !g.is_finite() {
            return;
        }
        let e = (g - w).abs() - tol.ulp * g.abs().max(w.abs()) - tol.tiny;
        let (r, worst) = if prefill && tol.pv > 0.0 {
            (e / tol.pv, &WORST_PV)
        } else {
            (e / tol.unit, &WORST)
        };
        worst.fetch_max(r.max(0.0).to_bits(), Ordering::Relaxed);
    }

    /// Prints and resets the worst ratios of the last call.
    pub fn report(tol: &Tolerance, what: &str) {
        if enabled() {
            let r = f64::from_bits(WORST.swap(0, Ordering::Relaxed));
            let pv = f64::from_bits(WORST_PV.swap(0, Ordering::Relaxed));
            let [a, b, c] = tol.parts;
            eprintln!("STATS {r:.3} {a:.3} {b:.3} {c:.3} {pv:.3} {what}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running one case on every backend.
// ---------------------------------------------------------------------------------------------

/// A short description of a case for failure and calibration messages.
fn describe(st: &Settings, attn: &str, max_pos: usize) -> String {
    format!(
        "{attn} {} kv={} H={} Hkv={} D={} B={} alibi={:?} window={:?} cap={:?} scale={:?} \
         amp={} specials={} max_pos={max_pos}",
        st.dtype,
        st.kv_cache_dtype,
        st.num_heads(),
        st.num_kv_heads,
        st.head_size,
        st.block_size,
        st.alibi,
        st.sliding_window,
        st.soft_cap,
        st.scale,
        st.amplitude,
        st.specials,
    )
}

fn run_decoder_paged(case: &DecoderCase) -> TestResult {
    let st = &case.settings;
    let built = DecoderPaged::build(case)?;
    let reference = reference();
    let mut ref_cache = built.cache(reference.kv_cache_layout())?;
    let want = built
        .call
        .run(&*reference, Some(&mut ref_cache), "reference forward")?;
    let max_pos = built.lens.iter().copied().max().unwrap_or(0);
    for cpu in cpus() {
        let isa = cpu.isa();
        let tol = Tolerance::new(st, &built.call.config, max_pos, isa);
        let mut cache = built.cache(cpu.kv_cache_layout())?;
        let got = built
            .call
            .run(&cpu, Some(&mut cache), &format!("cpu ({isa}) forward"))?;
        // The cache first: a write bug reads better as a byte mismatch.
        same_cache(
            &cache,
            &ref_cache,
            &format!("isa {isa}, cache after forward"),
        )?;
        compare(&got, &want, &built.call, &tol, &format!("isa {isa}"))?;
        stats::report(&tol, &format!("{isa} {}", describe(st, "decoder", max_pos)));
    }
    Ok(())
}

fn run_uncached_self(
    st: &Settings,
    attn_type: AttnType,
    lens: &[usize],
    decodes: usize,
) -> TestResult {
    let built = UncachedSelf::build(st, attn_type, lens, decodes)?;
    let max_pos = built.lens.iter().copied().max().unwrap_or(0);
    uncached_matches_on_every_isa(st, &built.call, max_pos, attn_type.name())
}

/// Runs a call without a cache on the reference and on every cpu ISA, and compares.
fn uncached_matches_on_every_isa(
    st: &Settings,
    call: &Call,
    max_pos: usize,
    attn: &str,
) -> TestResult {
    let want = call.run(&*reference(), None, "reference forward")?;
    for cpu in cpus() {
        let isa = cpu.isa();
        let tol = Tolerance::new(st, &call.config, max_pos, isa);
        let got = call.run(&cpu, None, &format!("cpu ({isa}) forward"))?;
        compare(&got, &want, call, &tol, &format!("isa {isa}"))?;
        stats::report(&tol, &format!("{isa} {}", describe(st, attn, max_pos)));
    }
    Ok(())
}

/// The largest query or key position of a cross-attention call.
fn cross_max_pos(enc_lens: &[usize], steps: &[CrossStep]) -> usize {
    let enc = enc_lens.iter().copied().max().unwrap_or(0);
    let dec = steps.iter().map(|s| s.context + s.new).max().unwrap_or(0);
    enc.max(dec)
}

fn run_cross_paged(case: &CrossCase) -> TestResult {
    let st = &case.settings;
    let built = CrossPaged::build(case)?;
    let reference = reference();
    let mut ref_cache = built.poisoned.build(reference.kv_cache_layout());
    let want1 = built
        .call1
        .run(&*reference, Some(&mut ref_cache), "reference call 1")?;
    let want2 = built
        .call2
        .run(&*reference, Some(&mut ref_cache), "reference call 2")?;
    let max_pos = cross_max_pos(&built.enc_lens, &built.steps1)
        .max(cross_max_pos(&built.enc_lens, &built.steps2));
    for cpu in cpus() {
        let isa = cpu.isa();
        let tol = Tolerance::new(st, &built.call1.config, max_pos, isa);
        let mut cache = built.poisoned.build(cpu.kv_cache_layout());
        let got = built.call1.run(
            &cpu,
            Some(&mut cache),
            &format!("cpu ({isa}) call 1 (writes the cross cache)"),
        )?;
        // The cache first: a write bug reads better as a byte mismatch. (The expected bytes
        // after call 1; `reference_vs_dense` holds the reference to them.)
        built
            .after
            .check(&cache, &format!("isa {isa}, cache after call 1"))?;
        compare(
            &got,
            &want1,
            &built.call1,
            &tol,
            &format!("isa {isa}, call 1"),
        )?;
        let got = built.call2.run(
            &cpu,
            Some(&mut cache),
            &format!("cpu ({isa}) call 2 (reads the cross cache)"),
        )?;
        compare(
            &got,
            &want2,
            &built.call2,
            &tol,
            &format!("isa {isa}, call 2"),
        )?;
        same_cache(
            &cache,
            &ref_cache,
            &format!("isa {isa}, cache after both calls"),
        )?;
        stats::report(&tol, &format!("{isa} {}", describe(st, "cross", max_pos)));
    }
    Ok(())
}

fn run_cross_no_cache(case: &CrossNoCacheCase) -> TestResult {
    let st = &case.settings;
    let built = CrossNoCache::build(case)?;
    let max_pos = cross_max_pos(&built.enc_lens, &built.steps);
    uncached_matches_on_every_isa(st, &built.call, max_pos, "cross-nocache")
}

// ---------------------------------------------------------------------------------------------
// Shapes.
// ---------------------------------------------------------------------------------------------

/// The layer shapes of this suite.
fn cpu_space() -> Space {
    Space {
        heads: prop_oneof![
            4 => (1..=3usize, 1..=4usize),
            2 => (1..=2usize, 5..=8usize),
            // MQA with 16-32 query heads: decodes take the packed path too.
            1 => (Just(1usize), 16..=32usize),
        ]
        .boxed(),
        head_size: prop_oneof![
            // Mostly scalar; 8 and 16 reach AVX2 and AVX-512.
            2 => 1..=20usize,
            // AVX-512 (and AVX2, NEON, scalar where AVX-512 is missing): 16..=128.
            3 => (1..=8usize).prop_map(|m| 16 * m),
            // AVX2 (multiples of 8, not of 16): 8..=120.
            2 => (0..=7usize).prop_map(|m| 16 * m + 8),
            // Large odd sizes (scalar) and the largest model sizes.
            1 => prop::sample::select(vec![33usize, 57, 100, 127, 192, 256]),
        ]
        .boxed(),
        block_size: prop_oneof![
            3 => 1..=64usize,
            2 => prop::sample::select(vec![8usize, 16, 32, 64, 128]),
        ]
        .boxed(),
        window: prop::option::weighted(
            0.3,
            prop_oneof![3 => 1..=12usize, 2 => 13..=200usize, 1 => 201..=3000usize],
        )
        .boxed(),
    }
}

/// How large a case's sequences are.
#[derive(Debug, Clone, Copy)]
enum Size {
    /// A few tokens and keys.
    Small,
    /// More queries than one query tile and more keys than one key tile.
    Tiled,
    /// Decodes (and a chunk) over hundreds to thousands of keys: split-K.
    Long,
}

fn size() -> impl Strategy<Value = Size> {
    prop_oneof![5 => Just(Size::Small), 3 => Just(Size::Tiled), 1 => Just(Size::Long)]
}

/// Query tokens per prefill tile of the cpu plan (64 rows / group).
fn query_tile(st: &Settings) -> usize {
    (64 / st.group).max(1)
}

/// Multiply-adds (per query-key pair: H * D) the reference may spend on one sequence of a
/// case, so that cases stay fast whatever the head count and size.
const WORK: usize = 12_000_000;

/// The longest key count a sequence of `queries` queries may have within [`WORK`].
fn max_keys(st: &Settings, queries: usize) -> usize {
    WORK / (queries.max(1) * st.num_heads() * st.head_size)
}

fn decoder_case_cpu() -> impl Strategy<Value = DecoderCase> {
    (settings_in(&cpu_space(), true), size(), 0..=3usize)
        .prop_flat_map(|(st, size, spare_blocks)| {
            let tile = query_tile(&st);
            let (prefills, decodes) = match size {
                Size::Small => (
                    prop::collection::vec(
                        prefill_seq_in(prop_oneof![Just(0usize), 1..=40usize].boxed(), 1..=12),
                        0..=3,
                    )
                    .boxed(),
                    prop::collection::vec(decode_seq_in(1..=80), 0..=3).boxed(),
                ),
                Size::Tiled => {
                    let new = (tile + 1)..=(2 * tile + 8);
                    let context = max_keys(&st, 2 * tile + 8).clamp(1, 150);
                    (
                        prop::collection::vec(
                            prefill_seq_in(prop_oneof![Just(0usize), 1..=context].boxed(), new),
                            1..=2,
                        )
                        .boxed(),
                        prop::collection::vec(decode_seq_in(65..=300), 0..=3).boxed(),
                    )
                }
                Size::Long => {
                    let long = max_keys(&st, 1).clamp(300, 4000);
                    let chunk = max_keys(&st, 8).clamp(1, long);
                    (
                        prop::collection::vec(prefill_seq_in((0..=chunk).boxed(), 1..=8), 0..=1)
                            .boxed(),
                        prop::collection::vec(decode_seq_in(257..=long), 1..=2).boxed(),
                    )
                }
            };
            (Just(st), prefills, decodes, Just(spare_blocks))
        })
        .prop_map(|(settings, mut seqs, decodes, spare_blocks)| {
            seqs.extend(decodes);
            DecoderCase {
                settings,
                seqs,
                spare_blocks,
            }
        })
}

/// Sequence lengths of a self-attention call without a cache: small, or longer than a query
/// tile and a key tile (zero-length ones where `zeros`).
fn uncached_lens(st: &Settings, size: Size, zeros: bool) -> BoxedStrategy<Vec<usize>> {
    let zero = if zeros { 1 } else { 0 };
    match size {
        Size::Small => {
            prop::collection::vec(prop_oneof![zero => Just(0usize), 4 => 1..=12usize], 1..=4)
                .boxed()
        }
        Size::Tiled | Size::Long => {
            let tile = query_tile(st);
            let longest = (tile.max(64) + 16).max(1);
            let cap = ((WORK / (st.num_heads() * st.head_size)) as f64).sqrt() as usize;
            let longest = longest.min(cap.max(2));
            prop::collection::vec(
                prop_oneof![zero => Just(0usize), 1 => 1..=8usize, 3 => 1..=longest],
                1..=3,
            )
            .boxed()
        }
    }
}

fn decoder_no_cache_case_cpu() -> impl Strategy<Value = DecoderNoCacheCase> {
    (settings_in(&cpu_space(), true), size()).prop_flat_map(|(st, size)| {
        let prompts = uncached_lens(&st, size, false)
            .prop_map(|mut l| {
                l.retain(|&n| n > 0);
                l
            })
            .boxed();
        decoder_no_cache_case_in(Just(st), prompts)
    })
}

fn encoder_case_cpu() -> impl Strategy<Value = EncoderCase> {
    (settings_in(&cpu_space(), false), size()).prop_flat_map(|(st, size)| {
        let lens = uncached_lens(&st, size, true);
        encoder_case_in(Just(st), lens)
    })
}

/// Encoder lengths and decoder query counts of a cross-attention case.
fn cross_sizes(st: &Settings, size: Size) -> (BoxedStrategy<usize>, QueryRange) {
    let tile = query_tile(st);
    match size {
        Size::Small => (
            prop_oneof![1 => Just(0usize), 5 => 1..=12usize].boxed(),
            (1, 5),
        ),
        Size::Tiled => {
            let queries = 2 * tile + 8;
            let enc = max_keys(st, queries).clamp(65, 200);
            (
                prop_oneof![1 => Just(0usize), 1 => 1..=12usize, 4 => 65..=enc].boxed(),
                (tile + 1, queries),
            )
        }
        Size::Long => {
            let enc = max_keys(st, 4).clamp(300, 2000);
            (
                prop_oneof![1 => Just(0usize), 4 => 257..=enc].boxed(),
                (1, 4),
            )
        }
    }
}

/// (lowest, highest) query tokens of a cross-attention step.
type QueryRange = (usize, usize);

fn cross_case_cpu() -> impl Strategy<Value = CrossCase> {
    (settings_in(&cpu_space(), false), size()).prop_flat_map(|(st, size)| {
        let (enc, (lo, hi)) = cross_sizes(&st, size);
        let seqs = prop::collection::vec(
            cross_seq_in(
                enc,
                prop_oneof![Just(0usize), 1..=70usize].boxed(),
                lo..=hi,
                lo..=hi,
            ),
            1..=3,
        );
        cross_case_in(Just(st), seqs)
    })
}

fn cross_no_cache_case_cpu() -> impl Strategy<Value = CrossNoCacheCase> {
    (settings_in(&cpu_space(), false), size()).prop_flat_map(|(st, size)| {
        let (enc, (lo, hi)) = cross_sizes(&st, size);
        cross_no_cache_case_in(
            Just(st),
            prop::collection::vec((enc.clone(), 0..=70usize, lo..=hi), 0..=3),
            prop::collection::vec((enc, 0..=70usize), 0..=3),
        )
    })
}

// ---------------------------------------------------------------------------------------------
// The properties.
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    /// Decoder over a paged cache: chunked prefill / prefix-cached prompts, fresh prompts and
    /// decodes in one batch (long ones split along the keys), padding slots, GQA / MQA, ALiBi,
    /// windows, soft cap, fp8.
    #[test]
    fn decoder_paged_matches_reference(case in decoder_case_cpu()) {
        run_decoder_paged(&case)?;
    }

    /// Cross attention with a cross cache: a prefill call that writes the encoder K/V, then a
    /// call without key/value that reads them back.
    #[test]
    fn cross_attention_paged_matches_reference(case in cross_case_cpu()) {
        run_cross_paged(&case)?;
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Decoder without a cache: fresh prompts (and 1-token decodes), keys from the inputs.
    #[test]
    fn decoder_without_cache_matches_reference(case in decoder_no_cache_case_cpu()) {
        run_uncached_self(&case.settings, AttnType::Decoder, &case.prompts, case.decodes)?;
    }

    /// Encoder and encoder-only: bidirectional over each sequence's own tokens, no cache.
    #[test]
    fn encoder_types_match_reference(case in encoder_case_cpu()) {
        run_uncached_self(&case.settings, case.attn_type, &case.lens, 0)?;
    }

    /// Cross attention without a cache: encoder K/V from the inputs.
    #[test]
    fn cross_attention_without_cache_matches_reference(case in cross_no_cache_case_cpu()) {
        run_cross_no_cache(&case)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed cases: empty sequences and queries without keys, on each vector body.
// ---------------------------------------------------------------------------------------------

/// Head sizes that run the AVX-512, AVX2 and scalar bodies.
const HEAD_SIZES: [usize; 3] = [16, 8, 5];

/// Runs `call` on every cpu ISA (with a cache built from `model`, which it must leave as it
/// found it) and requires every output within `tolerance` of `expected`.
fn all_near(call: &Call, model: Option<&CacheModel>, expected: f32, tolerance: f32) {
    for cpu in cpus() {
        let mut c = model.map(|m| (m.build(cpu.kv_cache_layout()), m));
        let out = call
            .run(&cpu, c.as_mut().map(|(c, _)| c), "forward")
            .unwrap_or_else(|e| panic!("{}: {e}", cpu.isa()));
        let values = out.to_f32_vec().unwrap();
        assert!(
            values.iter().all(|&x| (x - expected).abs() <= tolerance),
            "{}: {values:?}",
            cpu.isa(),
        );
        if let Some((cache, model)) = &c {
            model.check(cache, "nothing written").unwrap();
        }
    }
}

#[test]
fn zero_length_encoder_sequences() {
    for dtype in DType::FLOATS {
        for d in HEAD_SIZES {
            // Cross attention: the queries of a sequence with no encoder tokens get exact
            // zeros, with and without a cross cache, at prefill and at decode.
            let st = fixed_settings(dtype, KvCacheDtype::Fp8E4m3, d);
            let (paged, no_cache) = empty_encoder_cases(&st);
            run_cross_paged(&paged).unwrap();
            run_cross_no_cache(&no_cache).unwrap();

            // Every output of an all-empty encoder side is exactly zero.
            let call = Call {
                config: st.config(AttnType::EncoderDecoder),
                query: Tensor::from_f32(dtype, &[4, 4, d], &vec![0.5; 16 * d]).unwrap(),
                kv: Some((
                    Tensor::zeros(dtype, &[0, 2, d]).unwrap(),
                    Tensor::zeros(dtype, &[0, 2, d]).unwrap(),
                )),
                metadata: all_empty_encoder_metadata(),
                scales: st.kv_scales(),
            };
            all_near(&call, None, 0.0, 0.0);

            // Encoder / encoder-only batches with empty sequences, and with nothing at all.
            for t in [AttnType::Encoder, AttnType::EncoderOnly] {
                run_uncached_self(&st, t, &[0, 3, 0, 0, 2], 0).unwrap();
                run_uncached_self(&st, t, &[0, 0], 0).unwrap();
            }
        }
    }
}

#[test]
fn decoder_tokens_with_slot_minus_one_are_keys_but_not_written() {
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            for d in HEAD_SIZES {
                let st = fixed_settings(dtype, kv_cache_dtype, d);
                run_decoder_paged(&unwritten_keys_case(&st)).unwrap();

                // A batch whose keys are all unwritten: every value is 0.25 (as the cache
                // would hold it: fp8 within its rounding), the poisoned cache is neither read
                // nor written.
                let spec = st.spec(3);
                let model = CacheModel::poisoned(spec, st.kv_scales(), &mut st.rng());
                let call = Call {
                    config: st.config(AttnType::Decoder),
                    query: Tensor::from_f32(dtype, &[4, 4, d], &vec![0.5; 16 * d]).unwrap(),
                    kv: Some((
                        Tensor::from_f32(dtype, &[4, 2, d], &vec![0.25; 8 * d]).unwrap(),
                        Tensor::from_f32(dtype, &[4, 2, d], &vec![0.25; 8 * d]).unwrap(),
                    )),
                    metadata: all_unwritten_metadata(),
                    scales: st.kv_scales(),
                };
                all_near(&call, Some(&model), 0.25, 0.25 * FP8_ROUNDING);
            }
        }
    }
}

/// bf16 inputs in the subnormal range (uniform in ±2^-120: about one in 64 below 2^-126, and
/// every product underflows): the cache writes keep every subnormal exactly, and the outputs
/// agree with the reference within the tolerance, whose `flush` term covers the AVX512-BF16
/// and AMX instructions' flush to zero (docs/semantics.md, "Subnormal bf16 inputs"); prefill
/// and decode rows, every head size, on every ISA.
#[test]
fn bf16_subnormal_inputs_meet_the_contract() {
    for d in HEAD_SIZES {
        let mut st = fixed_settings(DType::BF16, KvCacheDtype::Auto, d);
        st.amplitude = 2f32.powi(-120);
        let seq = |context, new, decode| DecoderSeq {
            context,
            new,
            decode,
            pad: vec![false; new],
            extra_blocks: 0,
        };
        let case = DecoderCase {
            settings: st,
            seqs: vec![seq(5, 40, false), seq(70, 1, true)],
            spare_blocks: 1,
        };
        run_decoder_paged(&case).unwrap();
    }
}

/// Long decodes split along the keys (split-K) and merged: 3000 keys, one kv head with a
/// group of 8 (the packed path), with and without a window spanning several partitions, and
/// with the decode's own token as padding. Compared with the reference on every ISA.
#[test]
fn long_decodes_split_along_the_keys() {
    for dtype in DType::FLOATS {
        for d in HEAD_SIZES {
            for (window, pad) in [(None, false), (Some(700), true), (Some(3), false)] {
                let mut st = fixed_settings(dtype, KvCacheDtype::Auto, d);
                st.sliding_window = window;
                st.num_kv_heads = 1;
                st.group = 8;
                st.block_size = 16;
                let case = DecoderCase {
                    settings: st,
                    seqs: vec![DecoderSeq {
                        context: 2999,
                        new: 1,
                        decode: true,
                        pad: vec![pad],
                        extra_blocks: 1,
                    }],
                    spare_blocks: 2,
                };
                run_decoder_paged(&case).unwrap();
            }
        }
    }
}

/// vLLM's sliding-window prompt (window 32, 100 tokens, the 68 oldest with slot -1, blocks
/// reused in a ring): every token is a key of the prompt's queries, only the last 32 are
/// written, on every ISA, for every dtype and cache dtype. The reference is checked against
/// the dense attention over the call's own keys in `reference_vs_dense.rs`.
#[test]
fn vllm_windowed_prompt_matches_reference() {
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            let VllmPrompt {
                settings: st,
                call,
                poisoned,
                after,
            } = vllm_windowed_prompt(&fixed_settings(dtype, kv_cache_dtype, 16));
            let reference = reference();
            let mut ref_cache = poisoned.build(reference.kv_cache_layout());
            let want = call
                .run(&*reference, Some(&mut ref_cache), "reference")
                .unwrap();
            after.check(&ref_cache, "reference").unwrap();
            for cpu in cpus() {
                let isa = cpu.isa();
                let what = format!("{dtype} {kv_cache_dtype} isa {isa}");
                let tol = Tolerance::new(&st, &call.config, 99, isa);
                let mut cache = poisoned.build(cpu.kv_cache_layout());
                let got = call.run(&cpu, Some(&mut cache), &what).unwrap();
                after.check(&cache, &what).unwrap();
                compare(&got, &want, &call, &tol, &what).unwrap();
            }
        }
    }
}
