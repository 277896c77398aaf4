//! The `cuda` backend's attention against the `reference` backend (the oracle, itself checked
//! against a dense attention in `reference_vs_dense`).
//!
//! Every property builds a random call with the generators of `common` (those of
//! `reference_vs_dense` and `cpu_vs_reference`, restricted to the head sizes the cuda kernels
//! are compiled for), runs it on `reference` and on the GPU, each with its own cache built from
//! the same canonical contents (NaN and infinities in every slot no sequence covers, context
//! written with `KvCache::write`), outputs poisoned with NaN beforehand. After the call the
//! outputs must agree within [`allowed`] and the contract's NaN / Inf agreement, and the caches
//! must hold the same bytes. A quarter of the cases put NaN / ±Inf into queries, keys and
//! values (`Settings::specials`).
//!
//! What the shapes reach in the kernels (`kernels/attention/`, `src/cuda/plan.rs`): every
//! head size and dtype, fp8 caches; decode units (one token, up to 8 query heads: GQA groups
//! above 8 take several units; the decode1 / decode4 / decode8 kernels by group size) and prefill units (64
//! rows of tokens x heads: the tensor-core prefills for bf16 / f16, fp8 caches widened into
//! them, the scalar one for f32 with tiles of 4 to 32 keys) with sequences longer
//! than several tiles; split-K partitions and their merge (long decodes in small batches);
//! paged caches with block sizes
//! 1..=128, shuffled blocks, table entries past the end, padding slots; all four attention
//! types, with and without a cache; windows, ALiBi, soft caps; queries without keys. Fixed
//! cases then hold the GPU to the contract's edges as `hardening.rs` holds `cpu`: positions
//! past 2^24 and at i32::MAX, huge soft caps and scales, overflowing scores, and exactly where
//! NaN and Inf may reach.
//!
//! Every test needs a GPU and is `#[ignore]`d: a run without one lists them as ignored;
//! `tools/gpu-suite.sh` (or `--include-ignored` on a GPU machine) runs them, and run where no
//! GPU is usable they fail saying why.
//! Seeds are fresh every run; a failing case prints its `settings.seed`. Cases per property:
//! `PAGEDATTN_TEST_CASES` (the GPU suite lowers it under the sanitizers), else the default
//! below, which `PROPTEST_CASES` overrides. `CUDA_ATTENTION_STATS=1` prints the largest error
//! seen, as a fraction of the kernel's part of the allowance, after each property (per
//! property with `--test-threads=1`).

#![cfg(feature = "cuda")]

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use pagedattn::cuda::{Cuda, ATTENTION_HEAD_SIZES};
use pagedattn::{
    registry, AttentionConfig, AttnType, Backend, CacheLayout, DType, Error, Inputs, KvCache,
    KvCacheDtype, MetadataBuilder, SequenceDesc, Tensor,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The backends.
// ---------------------------------------------------------------------------------------------

fn reference() -> Box<dyn Backend> {
    registry::backend("reference").unwrap()
}

/// Cases per property: `PAGEDATTN_TEST_CASES`, else `default` (`PROPTEST_CASES` overrides
/// either, through `common::config`).
fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PAGEDATTN_TEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    config(n)
}

/// Runs `call` on the GPU: its tensors and `cache` (already on the GPU) in, a NaN-poisoned
/// output on the GPU out.
fn run_on_gpu(
    cuda: &Cuda,
    call: &Call,
    cache: Option<&mut KvCache>,
    what: &str,
) -> Result<Tensor, TestCaseError> {
    let device = cuda.device();
    let attention = ok(cuda.attention(&call.config), "attention")?;
    let plan = ok(
        attention.plan(&call.metadata, cache.as_deref().map(KvCache::spec)),
        what,
    )?;
    let mut workspace = ok(cuda.workspace(&plan), "workspace")?;
    let query = ok(call.query.to_device(device), "query to the GPU")?;
    let kv = match &call.kv {
        Some((k, v)) => Some((
            ok(k.to_device(device), "key to the GPU")?,
            ok(v.to_device(device), "value to the GPU")?,
        )),
        None => None,
    };
    let mut out = ok(
        Tensor::zeros_on(device, query.dtype(), query.shape()),
        "output",
    )?;
    ok(out.fill_nan(), "poisoning the output")?;
    let mut inputs = Inputs::new(&query).with_cache_opt(cache);
    if let Some((k, v)) = &kv {
        inputs = inputs.with_kv(k, v);
    }
    ok(
        attention.forward_into(&plan, &mut workspace, inputs, &mut out),
        what,
    )?;
    Ok(out)
}

/// A host cache loaded on the GPU.
fn on_gpu(cuda: &Cuda, cache: &KvCache) -> Result<KvCache, TestCaseError> {
    ok(cuda.load_kv_cache(cache), "load_kv_cache")
}

// ---------------------------------------------------------------------------------------------
// Tolerance.
// ---------------------------------------------------------------------------------------------

/// f32 unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// The allowance's constants: `C0` for the roundings of quantities bounded by the largest
/// value, `C1` for those bounded by the score terms (see [`allowed`]).
const C0: f64 = 16.0;
const C1: f64 = 3.0;

/// The largest `|got - want|` allowed for one output element of a call with settings `st`,
/// layer `config` and largest query or key position `max_pos`:
///
/// `ulp * max(|got|, |want|) + tiny + vmax * U * (C0 + C1 * smag)`.
///
/// * Both backends round their result to the output dtype once, so near a rounding boundary
///   they may differ by one unit in the last place of the value (2^-23, 2^-10, 2^-7 of it for
///   f32, f16, bf16), plus f16's subnormal step for values that small.
/// * The kernels compute in f32 what `reference` computes in f64. The output is a convex
///   combination of values, so its error is measured against `vmax`, the largest value
///   magnitude the call can read (the amplitude, grown by fp8 rounding — 3 or 2 mantissa bits,
///   up to 1.125x / 1.25x — or an fp8 cache's largest code times its scale where injected
///   infinities were saturated). An error `ds` in a score scales its weight by `e^ds`, moving
///   the output by at most about `2 * vmax * ds`; f32 scores err by a few roundings of their
///   largest terms, bounded by `smag = |scale| * D * qmax * kmax + max|slope| * max_pos + cap`
///   (the dot product's terms, the ALiBi bias, the soft cap): hence `C1`. The exponentials
///   (CUDA's `expf` and `tanhf` are within 2 ulps), the running sums over key tiles, the
///   split-K merge, the P.V sums and the normalisation are a few dozen roundings of
///   quantities bounded by `vmax`: hence `C0`. Both constants are those the `cpu` suite
///   calibrated for the same f32 computation.
///
/// Plus [`pv_allowance`] for the rows whose kernel runs the P.V on the tensor cores, which
/// round each probability first (`rounding`: to what).
fn allowed(
    st: &Settings,
    config: &AttentionConfig,
    (max_pos, rounding): (usize, Option<DType>),
    got: f64,
    want: f64,
) -> (f64, f64) {
    let (ulp, tiny) = match st.dtype {
        DType::F32 => (2f64.powi(-23), 0.0),
        DType::F16 => (2f64.powi(-10), 2f64.powi(-24)),
        DType::BF16 => (2f64.powi(-7), 0.0),
        DType::U8 => unreachable!(),
    };
    let (kmax, vmax) = value_bounds(st);
    let amplitude = st.amplitude as f64;
    let slope = st.slopes().map_or(0.0, |s| {
        s.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64))
    });
    let smag = (config.scale() as f64).abs() * st.head_size as f64 * amplitude * kmax
        + slope * max_pos as f64
        + st.soft_cap.map_or(0.0, f64::from);
    let kernel =
        vmax * U * (C0 + C1 * smag) + rounding.map_or(0.0, |r| pv_allowance(r, vmax, max_pos));
    (ulp * got.abs().max(want.abs()) + tiny + kernel, kernel)
}

/// The largest key and value magnitudes a call with settings `st` can read (see [`allowed`]).
fn value_bounds(st: &Settings) -> (f64, f64) {
    let amplitude = st.amplitude as f64;
    let growth = match st.kv_cache_dtype {
        KvCacheDtype::Auto => 1.0,
        KvCacheDtype::Fp8E4m3 => 1.125,
        KvCacheDtype::Fp8E5m2 => 1.25,
    };
    let (mut kmax, mut vmax) = (amplitude * growth, amplitude * growth);
    if let (Some(format), true) = (st.kv_cache_dtype.fp8_format(), st.specials > 0.0) {
        let largest = format.max_finite() as f64;
        kmax = kmax.max(largest * st.k_scale as f64);
        vmax = vmax.max(largest * st.v_scale as f64);
    }
    (kmax, vmax)
}

/// What the tensor cores round each probability to for a row's P.V, where its kernel runs it
/// there (bf16 and f16 activations): the prefill's to the activation type (fp8 codes are
/// widened into it); the decode's to the activation type, or to f16 where it reads fp8 codes
/// (which it converts to f16).
fn p_rounding(st: &Settings, cached: bool, prefill: bool) -> Option<DType> {
    let fp8 = cached && st.kv_cache_dtype != KvCacheDtype::Auto;
    match st.dtype {
        DType::BF16 | DType::F16 if prefill || !fp8 => Some(st.dtype),
        DType::BF16 | DType::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The P.V's allowance for probabilities `p_j <= 1` rounded to `rounding`, while the softmax
/// denominator `l >= 1` sums the f32 probabilities (as the `cpu` suite's AVX512-BF16
/// kernels). Rounding to nearest changes `p_j` by at most `2^-9 p_j` (bf16, 8 significant
/// bits) or `2^-11 p_j` (f16) plus, for f16, half its smallest subnormal step (`2^-25`)
/// below `2^-14`; the output moves by at most that over `l`, times `vmax`: `2^-8 vmax`
/// (bf16) and `(2^-10 + keys 2^-25) vmax` (f16), twice the bound, as in the `cpu` suite.
/// `keys`: the most keys a row of the call attends (bounded by the largest position + 1).
fn pv_allowance(rounding: DType, vmax: f64, max_pos: usize) -> f64 {
    match rounding {
        DType::BF16 => 2f64.powi(-8) * vmax,
        DType::F16 => (2f64.powi(-10) + (max_pos + 1) as f64 * 2f64.powi(-25)) * vmax,
        _ => 0.0,
    }
}

/// The largest error seen as a fraction of the allowance (bits of an f64), for
/// `CUDA_ATTENTION_STATS`.
static WORST: AtomicU64 = AtomicU64::new(0);

/// Prints and resets [`WORST`] when `CUDA_ATTENTION_STATS` is set.
fn report(property: &str) {
    let worst = f64::from_bits(WORST.swap(0, Ordering::Relaxed));
    if std::env::var_os("CUDA_ATTENTION_STATS").is_some() {
        let line = format!("STATS {property}: largest error {worst:.3} of the allowance\n");
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// Checks the GPU output of `call` elementwise against the reference output; `cached`: the
/// call reads its keys and values from a cache (the fp8 storage then applies).
fn compare(
    got: &Tensor,
    want: &Tensor,
    st: &Settings,
    call: &Call,
    (max_pos, cached): (usize, bool),
    what: &str,
) -> TestResult {
    prop_assert_eq!(got.shape(), want.shape());
    let (h, d) = (want.shape()[1], want.shape()[2]);
    let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    // Rows of sequences with several query tokens run the prefill kernel.
    let md = &call.metadata;
    let mut prefill_token = vec![false; md.num_tokens()];
    for s in 0..md.num_seqs() {
        let tokens = md.query_range(s);
        let several = tokens.len() > 1;
        prefill_token[tokens].fill(several);
    }
    let rounding = |i: usize| p_rounding(st, cached, prefill_token[i / (h * d)]);
    let at = |i: usize| format!("output[{}][{}][{}]", i / (h * d), i / d % h, i % d);
    let mut worst: Option<(usize, f64)> = None;
    let mut bad = 0;
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g as f64, w as f64);
        if !(g.is_finite() && w.is_finite()) {
            if !same_class(g, w) {
                return Err(TestCaseError::fail(format!(
                    "{what}: {} = {g}, reference = {w} (the contract's NaN / Inf agreement)",
                    at(i)
                )));
            }
            continue;
        }
        let (bound, kernel) = allowed(st, &call.config, (max_pos, rounding(i)), g, w);
        let excess = (g - w).abs() / bound;
        let used = ((g - w).abs() - (bound - kernel)).max(0.0) / kernel;
        WORST.fetch_max(used.to_bits(), Ordering::Relaxed);
        if excess > 1.0 {
            bad += 1;
            if worst.is_none_or(|(_, e)| excess > e) {
                worst = Some((i, excess));
            }
        }
    }
    if let Some((i, _)) = worst {
        let (g, w) = (got[i] as f64, want[i] as f64);
        return Err(TestCaseError::fail(format!(
            "{what}: {} = {g:e}, reference = {w:e} (difference {:e}, allowed {:e}); {bad} of {} \
             elements out of tolerance",
            at(i),
            (g - w).abs(),
            allowed(st, &call.config, (max_pos, rounding(i)), g, w).0,
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

// ---------------------------------------------------------------------------------------------
// Running one case on both backends.
// ---------------------------------------------------------------------------------------------

fn run_decoder_paged(cuda: &Cuda, case: &DecoderCase) -> TestResult {
    let st = &case.settings;
    let built = DecoderPaged::build(case)?;
    let reference = reference();
    let mut ref_cache = built.cache(reference.kv_cache_layout())?;
    let want = built
        .call
        .run(&*reference, Some(&mut ref_cache), "reference forward")?;
    let mut cache = on_gpu(cuda, &built.cache(cuda.kv_cache_layout())?)?;
    let got = run_on_gpu(cuda, &built.call, Some(&mut cache), "cuda forward")?;
    // The cache first: a write bug reads better as a byte mismatch.
    same_cache(&cache, &ref_cache, "cache after forward")?;
    let max_pos = built.lens.iter().copied().max().unwrap_or(0);
    compare(&got, &want, st, &built.call, (max_pos, true), "decoder")
}

fn run_uncached_self(
    cuda: &Cuda,
    st: &Settings,
    attn_type: AttnType,
    lens: &[usize],
    decodes: usize,
) -> TestResult {
    let built = UncachedSelf::build(st, attn_type, lens, decodes)?;
    let max_pos = built.lens.iter().copied().max().unwrap_or(0);
    let want = built.call.run(&*reference(), None, "reference forward")?;
    let got = run_on_gpu(cuda, &built.call, None, "cuda forward")?;
    compare(
        &got,
        &want,
        st,
        &built.call,
        (max_pos, false),
        attn_type.name(),
    )
}

/// The largest query or key position of a cross-attention call.
fn cross_max_pos(enc_lens: &[usize], steps: &[CrossStep]) -> usize {
    let enc = enc_lens.iter().copied().max().unwrap_or(0);
    let dec = steps.iter().map(|s| s.context + s.new).max().unwrap_or(0);
    enc.max(dec)
}

fn run_cross_paged(cuda: &Cuda, case: &CrossCase) -> TestResult {
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
    let mut cache = on_gpu(cuda, &built.poisoned.build(cuda.kv_cache_layout()))?;
    let got = run_on_gpu(
        cuda,
        &built.call1,
        Some(&mut cache),
        "cuda call 1 (writes the cross cache)",
    )?;
    built.after.check(&cache, "cache after call 1")?;
    compare(
        &got,
        &want1,
        st,
        &built.call1,
        (max_pos, true),
        "cross call 1",
    )?;
    let got = run_on_gpu(
        cuda,
        &built.call2,
        Some(&mut cache),
        "cuda call 2 (reads the cross cache)",
    )?;
    compare(
        &got,
        &want2,
        st,
        &built.call2,
        (max_pos, true),
        "cross call 2",
    )?;
    same_cache(&cache, &ref_cache, "cache after both calls")
}

fn run_cross_no_cache(cuda: &Cuda, case: &CrossNoCacheCase) -> TestResult {
    let st = &case.settings;
    let built = CrossNoCache::build(case)?;
    let max_pos = cross_max_pos(&built.enc_lens, &built.steps);
    let want = built.call.run(&*reference(), None, "reference forward")?;
    let got = run_on_gpu(cuda, &built.call, None, "cuda forward")?;
    compare(
        &got,
        &want,
        st,
        &built.call,
        (max_pos, false),
        "cross without cache",
    )
}

// ---------------------------------------------------------------------------------------------
// Shapes.
// ---------------------------------------------------------------------------------------------

/// The layer shapes of this suite: the cuda head sizes, GQA groups that fit one unit and
/// groups that take several (decode units hold 8 query heads, prefill units 16 rows).
fn gpu_space() -> Space {
    Space {
        heads: prop_oneof![
            4 => (1..=3usize, 1..=4usize),
            2 => (1..=2usize, 5..=12usize),
            1 => (Just(1usize), 16..=40usize),
        ]
        .boxed(),
        head_size: prop::sample::select(ATTENTION_HEAD_SIZES.to_vec()).boxed(),
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
    /// Several prefill units per sequence and several key tiles per unit.
    Tiled,
    /// Decodes over hundreds to thousands of keys (split-K in small batches), and a chunk.
    Long,
}

fn size() -> impl Strategy<Value = Size> {
    prop_oneof![5 => Just(Size::Small), 3 => Just(Size::Tiled), 1 => Just(Size::Long)]
}

/// Query tokens per 64 rows of tokens x heads: half a prefill unit (`PREFILL_ROWS` = 128) and
/// one CTA of the tensor-core prefill above D = 128, so that the tiled cases' 2-3 tiles span
/// two units, the second one partial.
fn query_tile(st: &Settings) -> usize {
    (64 / st.group.min(64)).max(1)
}

/// Multiply-adds (per query-key pair: H * D) the reference may spend on one sequence of a
/// case, so that cases stay fast whatever the head count and size.
const WORK: usize = 12_000_000;

/// The longest key count a sequence of `queries` queries may have within [`WORK`].
fn max_keys(st: &Settings, queries: usize) -> usize {
    WORK / (queries.max(1) * st.num_heads() * st.head_size)
}

fn decoder_case_gpu() -> impl Strategy<Value = DecoderCase> {
    (settings_in(&gpu_space(), true), size(), 0..=3usize)
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
                    let new = (2 * tile + 1)..=(3 * tile + 8);
                    let context = max_keys(&st, 3 * tile + 8).clamp(1, 150);
                    (
                        prop::collection::vec(
                            prefill_seq_in(prop_oneof![Just(0usize), 1..=context].boxed(), new),
                            1..=2,
                        )
                        .boxed(),
                        prop::collection::vec(decode_seq_in(33..=300), 0..=3).boxed(),
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

/// Sequence lengths of a self-attention call without a cache: small, or longer than a
/// prefill unit's tokens and a key tile (zero-length ones where `zeros`).
fn uncached_lens(st: &Settings, size: Size, zeros: bool) -> BoxedStrategy<Vec<usize>> {
    let zero = if zeros { 1 } else { 0 };
    match size {
        Size::Small => {
            prop::collection::vec(prop_oneof![zero => Just(0usize), 4 => 1..=12usize], 1..=4)
                .boxed()
        }
        Size::Tiled | Size::Long => {
            let cap = ((WORK / (st.num_heads() * st.head_size)) as f64).sqrt() as usize;
            let longest = (3 * query_tile(st)).max(80).min(cap.max(2));
            prop::collection::vec(
                prop_oneof![zero => Just(0usize), 1 => 1..=8usize, 3 => 1..=longest],
                1..=3,
            )
            .boxed()
        }
    }
}

fn decoder_no_cache_case_gpu() -> impl Strategy<Value = DecoderNoCacheCase> {
    (settings_in(&gpu_space(), true), size()).prop_flat_map(|(st, size)| {
        let prompts = uncached_lens(&st, size, false)
            .prop_map(|mut l| {
                l.retain(|&n| n > 0);
                l
            })
            .boxed();
        decoder_no_cache_case_in(Just(st), prompts)
    })
}

fn encoder_case_gpu() -> impl Strategy<Value = EncoderCase> {
    (settings_in(&gpu_space(), false), size()).prop_flat_map(|(st, size)| {
        let lens = uncached_lens(&st, size, true);
        encoder_case_in(Just(st), lens)
    })
}

/// Encoder lengths and (lowest, highest) decoder query counts of a cross-attention case.
fn cross_sizes(st: &Settings, size: Size) -> (BoxedStrategy<usize>, (usize, usize)) {
    let tile = query_tile(st);
    match size {
        Size::Small => (
            prop_oneof![1 => Just(0usize), 5 => 1..=12usize].boxed(),
            (1, 5),
        ),
        Size::Tiled => {
            let queries = 3 * tile + 8;
            let enc = max_keys(st, queries).clamp(65, 200);
            (
                prop_oneof![1 => Just(0usize), 1 => 1..=12usize, 4 => 65..=enc].boxed(),
                (2 * tile + 1, queries),
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

fn cross_case_gpu() -> impl Strategy<Value = CrossCase> {
    (settings_in(&gpu_space(), false), size()).prop_flat_map(|(st, size)| {
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

fn cross_no_cache_case_gpu() -> impl Strategy<Value = CrossNoCacheCase> {
    (settings_in(&gpu_space(), false), size()).prop_flat_map(|(st, size)| {
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

/// Decoder over a paged cache: chunked prefill / prefix-cached prompts, fresh prompts and
/// decodes in one batch (long ones split along the keys), padding slots, GQA / MQA, ALiBi,
/// windows, soft cap, fp8.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn decoder_paged_matches_reference() {
    let cuda = gpu();
    proptest!(cases(96), |(case in decoder_case_gpu())| {
        run_decoder_paged(&cuda, &case)?;
    });
    report("decoder_paged_matches_reference");
}

/// Cross attention with a cross cache: a prefill call that writes the encoder K/V, then a
/// call without key/value that reads them back.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cross_attention_paged_matches_reference() {
    let cuda = gpu();
    proptest!(cases(64), |(case in cross_case_gpu())| {
        run_cross_paged(&cuda, &case)?;
    });
    report("cross_attention_paged_matches_reference");
}

/// Decoder without a cache: fresh prompts (and 1-token decodes), keys from the inputs.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn decoder_without_cache_matches_reference() {
    let cuda = gpu();
    proptest!(cases(48), |(case in decoder_no_cache_case_gpu())| {
        run_uncached_self(&cuda, &case.settings, AttnType::Decoder, &case.prompts, case.decodes)?;
    });
    report("decoder_without_cache_matches_reference");
}

/// Encoder and encoder-only: bidirectional over each sequence's own tokens, no cache.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn encoder_types_match_reference() {
    let cuda = gpu();
    proptest!(cases(48), |(case in encoder_case_gpu())| {
        run_uncached_self(&cuda, &case.settings, case.attn_type, &case.lens, 0)?;
    });
    report("encoder_types_match_reference");
}

/// Cross attention without a cache: encoder K/V from the inputs.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cross_attention_without_cache_matches_reference() {
    let cuda = gpu();
    proptest!(cases(48), |(case in cross_no_cache_case_gpu())| {
        run_cross_no_cache(&cuda, &case)?;
    });
    report("cross_attention_without_cache_matches_reference");
}

// ---------------------------------------------------------------------------------------------
// Fixed cases.
// ---------------------------------------------------------------------------------------------

/// The smallest and largest head sizes, and one that is no multiple of 32 (80).
const FIXED_HEAD_SIZES: [usize; 3] = [32, 80, 256];

/// Unwraps a property's result in a plain test.
fn must(result: TestResult, what: &str) {
    if let Err(e) = result {
        panic!("{what}: {e}");
    }
}

/// Runs `call` on the GPU and requires exact zeros everywhere.
/// Runs `call` and requires every output within `tolerance` of `expected`.
fn all_near(
    cuda: &Cuda,
    call: &Call,
    cache: Option<&mut KvCache>,
    (expected, tolerance): (f32, f32),
    what: &str,
) {
    let out = run_on_gpu(cuda, call, cache, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    let values = out.to_f32_vec().unwrap();
    assert!(
        values.iter().all(|&x| (x - expected).abs() <= tolerance),
        "{what}: {values:?}"
    );
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn zero_length_encoder_sequences() {
    let cuda = gpu();
    for dtype in DType::FLOATS {
        for d in FIXED_HEAD_SIZES {
            let what = format!("{dtype} D={d}");
            // Cross attention: the queries of a sequence with no encoder tokens get exact
            // zeros, with and without a cross cache, at prefill and at decode.
            let st = fixed_settings(dtype, KvCacheDtype::Fp8E4m3, d);
            let (paged, no_cache) = empty_encoder_cases(&st);
            must(run_cross_paged(&cuda, &paged), &what);
            must(run_cross_no_cache(&cuda, &no_cache), &what);

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
            all_near(&cuda, &call, None, (0.0, 0.0), &what);

            // Encoder / encoder-only batches with empty sequences, and with nothing at all.
            for t in [AttnType::Encoder, AttnType::EncoderOnly] {
                must(run_uncached_self(&cuda, &st, t, &[0, 3, 0, 0, 2], 0), &what);
                must(run_uncached_self(&cuda, &st, t, &[0, 0], 0), &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn decoder_tokens_with_slot_minus_one_are_keys_but_not_written() {
    let cuda = gpu();
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            for d in FIXED_HEAD_SIZES {
                let what = format!("{dtype} {kv_cache_dtype} D={d}");
                let st = fixed_settings(dtype, kv_cache_dtype, d);
                must(run_decoder_paged(&cuda, &unwritten_keys_case(&st)), &what);

                // A batch whose keys are all unwritten: every value is 0.25 (as the cache
                // would hold it), the poisoned cache is neither read nor written.
                let spec = st.spec(3);
                let model = CacheModel::poisoned(spec, st.kv_scales(), &mut st.rng());
                let mut cache = cuda.load_kv_cache(&model.build(CacheLayout::Nhd)).unwrap();
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
                let near = (0.25, 0.25 * FP8_ROUNDING);
                all_near(&cuda, &call, Some(&mut cache), near, &what);
                model.check(&cache, "nothing written").unwrap();
            }
        }
    }
}

/// Long decodes split along the keys (split-K) and merged: 3000 keys, one kv head with a
/// group of 8, with and without a window spanning several partitions, with the decode's own
/// token as padding, and a window of 3 (one partition).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn long_decodes_split_along_the_keys() {
    let cuda = gpu();
    for dtype in DType::FLOATS {
        for d in FIXED_HEAD_SIZES {
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
                must(
                    run_decoder_paged(&cuda, &case),
                    &format!("{dtype} D={d} window {window:?} pad {pad}"),
                );
            }
        }
    }
}

/// One plan serves layers that differ in scale, ALiBi, soft cap and fp8 scales; a forward
/// repeated on the same inputs gives the same bits (the kernels are deterministic).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn one_plan_serves_every_layer() {
    let cuda = gpu();
    let reference = reference();
    let spec = pagedattn::KvCacheSpec {
        num_blocks: 12,
        block_size: 4,
        num_kv_heads: 2,
        head_size: 64,
        dtype: DType::BF16,
        kv_cache_dtype: KvCacheDtype::Fp8E5m2,
    };
    let metadata = MetadataBuilder::for_cache(&spec)
        .push(SequenceDesc::prompt(3, 6, &[7, 2, 9]))
        .push(SequenceDesc::decode(10, &[0, 5, 11]))
        .build()
        .unwrap();
    let layer = |scale: f32, alibi: bool, cap: Option<f32>, k_scale: f32| {
        AttentionConfig::builder(6, 64)
            .num_kv_heads(2)
            .scale(scale)
            .alibi_slopes(alibi.then(|| pagedattn::alibi_slopes_bloom(6)))
            .logits_soft_cap(cap)
            .kv_cache_dtype(KvCacheDtype::Fp8E5m2)
            .kv_scales(k_scale, 0.5)
            .build()
            .unwrap()
    };
    let layers = [
        layer(0.125, false, None, 1.0),
        layer(-0.3, true, None, 0.25),
        layer(0.2, true, Some(5.0), 2.0),
    ];
    let tensor = |shape: &[usize], seed: f32| {
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| (i as f32 * seed).sin() * 2.0).collect();
        Tensor::from_f32(DType::BF16, shape, &values).unwrap()
    };
    let (q, k, v) = (
        tensor(&[7, 6, 64], 0.37),
        tensor(&[7, 2, 64], 0.11),
        tensor(&[7, 2, 64], 0.23),
    );
    let dev = |t: &Tensor| t.to_device(cuda.device()).unwrap();
    let (gq, gk, gv) = (dev(&q), dev(&k), dev(&v));
    let plan = cuda
        .attention(&layers[0])
        .unwrap()
        .plan(&metadata, Some(&spec))
        .unwrap();
    let mut workspace = cuda.workspace(&plan).unwrap();
    for (i, config) in layers.iter().enumerate() {
        let attention = cuda.attention(config).unwrap();
        let mut cache = cuda.allocate_kv_cache(&spec).unwrap();
        let mut outputs = Vec::new();
        for _ in 0..2 {
            let inputs = Inputs::new(&gq).with_kv(&gk, &gv).with_cache(&mut cache);
            let out = attention.forward(&plan, &mut workspace, inputs).unwrap();
            outputs.push(out.to_f32_vec().unwrap());
        }
        assert_eq!(
            outputs[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            outputs[1].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "layer {i}: a repeated forward differs"
        );
        let reference_attention = reference.attention(config).unwrap();
        let mut ref_cache = reference.allocate_kv_cache(&spec).unwrap();
        let mut want = Tensor::zeros(DType::BF16, &[7, 6, 64]).unwrap();
        forward_once(
            &*reference,
            &*reference_attention,
            &q,
            Some(pagedattn::KvPair { key: &k, value: &v }),
            Some(&mut ref_cache),
            &metadata,
            &mut want,
        )
        .unwrap();
        let want = want.to_f32_vec().unwrap();
        let worst = outputs[0]
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
            .fold(0.0f32, f32::max);
        // bf16 outputs: a few units of 2^-8 relative.
        assert!(worst < 0.02, "layer {i}: worst difference {worst}");
    }
}

/// Encoder metadata given to a layer that reads none (encoder-only, encoder, decoder) is an
/// error naming it, as on the host backends (`hardening.rs`).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn encoder_metadata_is_refused_where_it_is_not_read() {
    let cuda = gpu();
    let md = MetadataBuilder::new(16)
        .push(SequenceDesc::prompt(0, 3, &[]).with_encoder(2, &[]))
        .build()
        .unwrap();
    for attn_type in [AttnType::EncoderOnly, AttnType::Encoder, AttnType::Decoder] {
        let config = AttentionConfig::builder(2, 32)
            .attn_type(attn_type)
            .build()
            .unwrap();
        let attention = cuda.attention(&config).unwrap();
        match attention.plan(&md, None) {
            Err(Error::Invalid { field, .. }) => {
                assert!(field.contains("metadata.encoder"), "{attn_type:?}: {field}")
            }
            other => panic!("{attn_type:?}: expected Invalid(metadata.encoder), got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The contract's edges (the cases `hardening.rs` holds `cpu` to): exact positions, soft caps,
// scales, overflow, NaN and Inf, on the GPU against `reference`.
// ---------------------------------------------------------------------------------------------

/// One call with a hand-made cache: zeros plus the rows written before the call.
type Edge = HandmadeCall;

impl HandmadeCall {
    /// The reference output, after checking that the GPU agrees with it: the contract's NaN /
    /// Inf classes, and finite elements within `rel` of the largest finite reference
    /// magnitude.
    fn agreed(&self, cuda: &Cuda, rel: f32) -> Vec<f32> {
        let want = self.run(&*reference());
        if let Some(e) = disagreement(&want, &self.run(cuda), rel) {
            panic!("{e}");
        }
        want
    }
}

/// `n` distinct values of modest size (a fixed pseudo-random pattern).
fn wave(n: usize, phase: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.731 + phase).sin()).collect()
}

fn f32_tensor(shape: &[usize], values: &[f32]) -> Tensor {
    Tensor::from_f32(DType::F32, shape, values).unwrap()
}

/// A decode at position 2^24 + 999 with a soft cap: the mask compares positions past f32's
/// integers. The block table reuses one zero block up to the last block, whose keys (the
/// newest one above all) dominate. (Sixteen million keys: split-K over every partition the
/// GPU takes.)
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn decode_positions_are_exact_past_2_pow_24() {
    let cuda = gpu();
    let (bs, d) = (1024usize, 32usize);
    let seq_len: usize = (1 << 24) + 1000;
    let blocks = seq_len.div_ceil(bs);
    let mut table = vec![0i32; blocks];
    table[blocks - 1] = 1;
    let config = AttentionConfig::builder(1, d)
        .scale(1.0)
        .logits_soft_cap(Some(50.0))
        .build()
        .unwrap();
    let last = (blocks - 1) * bs;
    let context = seq_len - 1 - last;
    // Keys of the last block score 8..=20 against q = (4, 0, ...); the new key scores 30.
    let mut k = vec![0.0f32; context * d];
    for (o, row) in k.chunks_exact_mut(d).enumerate() {
        row[0] = 2.0 + 0.5 * (o % 7) as f32;
    }
    let mut new_k = vec![0.0f32; d];
    new_k[0] = 7.5;
    let mut q = vec![0.0f32; d];
    q[0] = 4.0;
    Edge {
        config,
        metadata: MetadataBuilder::new(bs)
            .push(SequenceDesc::decode(seq_len - 1, &table))
            .build()
            .unwrap(),
        query: f32_tensor(&[1, 1, d], &q),
        kv: Some((
            f32_tensor(&[1, 1, d], &new_k),
            f32_tensor(&[1, 1, d], &wave(d, 3.0)),
        )),
        cache: Some((
            DType::F32,
            2,
            f32_tensor(&[context, 1, d], &k),
            f32_tensor(&[context, 1, d], &wave(context * d, 1.0)),
            (0..context as i64).map(|o| bs as i64 + o).collect(),
        )),
    }
    .agreed(&cuda, 1e-5);
}

/// A long f32 decode where every key weighs about the same: 2^21 + 1000 keys of two physical
/// blocks taken in turn through the block table, four query heads of one kv head (the
/// decode's f32 sums folded into f64 every few chunks, split-K merged in f64), values near 1
/// so that the tolerance is relative to the output itself.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn long_decodes_keep_f32_accuracy() {
    let cuda = gpu();
    let (h, bs, d) = (4usize, 1024usize, 64usize);
    let seq_len: usize = (1 << 21) + 1000;
    let table: Vec<i32> = (0..seq_len.div_ceil(bs)).map(|b| (b % 2) as i32).collect();
    let config = AttentionConfig::builder(h, d)
        .num_kv_heads(1)
        .scale(0.05)
        .logits_soft_cap(Some(50.0))
        .build()
        .unwrap();
    let rows = 2 * bs;
    let values: Vec<f32> = wave(rows * d, 1.0).iter().map(|x| 1.0 + 0.5 * x).collect();
    let new_v: Vec<f32> = wave(d, 3.0).iter().map(|x| 1.0 + 0.5 * x).collect();
    Edge {
        config,
        metadata: MetadataBuilder::new(bs)
            .push(SequenceDesc::decode(seq_len - 1, &table))
            .build()
            .unwrap(),
        query: f32_tensor(&[1, h, d], &wave(h * d, 0.5)),
        kv: Some((
            f32_tensor(&[1, 1, d], &wave(d, 2.0)),
            f32_tensor(&[1, 1, d], &new_v),
        )),
        cache: Some((
            DType::F32,
            2,
            f32_tensor(&[rows, 1, d], &wave(rows * d, 4.0)),
            f32_tensor(&[rows, 1, d], &values),
            (0..rows as i64).collect(),
        )),
    }
    .agreed(&cuda, 1e-5);
}

/// Cross attention with ALiBi far into the decoder, at decoder positions 2^24 + 1 and
/// i32::MAX - 1: the distances must be exact.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cross_alibi_is_exact_at_any_decoder_position() {
    let cuda = gpu();
    let (h, d, enc) = (4usize, 32usize, 6usize);
    for seq_len in [(1usize << 24) + 2, i32::MAX as usize] {
        let config = AttentionConfig::builder(h, d)
            .num_kv_heads(1)
            .attn_type(AttnType::EncoderDecoder)
            .alibi_slopes(Some(vec![0.5, 0.25, 0.0625, 0.015625]))
            .build()
            .unwrap();
        Edge {
            config,
            metadata: MetadataBuilder::new(8)
                .push(SequenceDesc::decode(seq_len - 1, &[]).with_encoder(enc, &[0]))
                .build()
                .unwrap(),
            query: f32_tensor(&[1, h, d], &wave(h * d, 0.5)),
            kv: None,
            cache: Some((
                DType::F32,
                1,
                f32_tensor(&[enc, 1, d], &wave(enc * d, 1.5)),
                f32_tensor(&[enc, 1, d], &wave(enc * d, 2.5)),
                (0..enc as i64).collect(),
            )),
        }
        .agreed(&cuda, 1e-5);
    }
}

/// Cross attention with a slope of -1e38, one decoder token at position 5 and one encoder
/// key: the ALiBi distance is measured from the last encoder key (0, the value itself), not
/// from the decoder's position (an infinite score, NaN outputs).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cross_alibi_is_measured_from_the_last_encoder_key() {
    let cuda = gpu();
    let d = 32;
    let edge = Edge::cross_alibi_probe();
    assert_eq!(edge.agreed(&cuda, 0.0), vec![0.5; d]);
}

/// A prefill of `n` tokens (one sequence, no cache) with `config` and `dtype` queries, keys
/// and values from `q`, `k`, `v`.
fn prefill_edge(config: AttentionConfig, dtype: DType, q: &[f32], k: &[f32], v: &[f32]) -> Edge {
    let (h, hkv, d) = (
        config.num_heads(),
        config.num_kv_heads(),
        config.head_size(),
    );
    let n = q.len() / (h * d);
    let tensor = |shape: &[usize], x: &[f32]| Tensor::from_f32(dtype, shape, x).unwrap();
    Edge {
        metadata: MetadataBuilder::new(16)
            .push(SequenceDesc::prompt(0, n, &[]))
            .build()
            .unwrap(),
        query: tensor(&[n, h, d], q),
        kv: Some((tensor(&[n, hkv, d], k), tensor(&[n, hkv, d], v))),
        cache: None,
        config,
    }
}

/// Soft caps far above the scores stay accurate (no cancellation in tanh).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn huge_soft_caps_are_accurate() {
    let cuda = gpu();
    let (n, d) = (40usize, 64usize);
    for cap in [1e5f32, 1e8, 3e38] {
        let config = AttentionConfig::builder(2, d)
            .logits_soft_cap(Some(cap))
            .build()
            .unwrap();
        let x = |phase| wave(n * 2 * d, phase);
        let q: Vec<f32> = x(0.0).iter().map(|v| v * 4.0).collect();
        prefill_edge(config, DType::F32, &q, &x(1.0), &x(2.0)).agreed(&cuda, 1e-5);
    }
}

/// `scale = 3e38` multiplies the dot product (small scores stay finite); the same through an
/// fp8 `k_scale` of 3e38.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn scales_apply_to_the_dot_product() {
    let cuda = gpu();
    let (n, d) = (20usize, 64usize);
    let config = AttentionConfig::builder(1, d).scale(3e38).build().unwrap();
    let k: Vec<f32> = wave(n * d, 1.0).iter().map(|v| v * 3e-38).collect();
    let q: Vec<f32> = wave(n * d, 0.0).iter().map(|v| v * 2.0).collect();
    prefill_edge(config, DType::F32, &q, &k, &wave(n * d, 2.0)).agreed(&cuda, 1e-5);

    // fp8: keys of order 1e38 stored with k_scale 3e38, queries of order 1e-37.
    let config = AttentionConfig::builder(1, d)
        .kv_cache_dtype(KvCacheDtype::Fp8E4m3)
        .kv_scales(3e38, 1.0)
        .build()
        .unwrap();
    let k: Vec<f32> = wave(n * d, 1.0).iter().map(|v| v * 1e38).collect();
    let q: Vec<f32> = wave(n * d, 0.0).iter().map(|v| v * 1e-37).collect();
    let out = Edge {
        config,
        metadata: MetadataBuilder::new(16)
            .push(SequenceDesc::prompt(0, n, &[0, 1]))
            .build()
            .unwrap(),
        query: f32_tensor(&[n, 1, d], &q),
        kv: Some((
            f32_tensor(&[n, 1, d], &k),
            f32_tensor(&[n, 1, d], &wave(n * d, 2.0)),
        )),
        cache: Some((
            DType::F32,
            2,
            f32_tensor(&[0, 1, d], &[]),
            f32_tensor(&[0, 1, d], &[]),
            vec![],
        )),
    }
    .agreed(&cuda, 1e-5);
    assert!(out.iter().all(|x| x.is_finite()));
}

/// A score beyond f32's range is infinite: +Inf makes its query's output NaN; a soft cap maps
/// it to the cap and the output stays finite.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn overflowing_scores_follow_the_contract() {
    let cuda = gpu();
    let (n, d) = (6usize, 64usize);
    let (q, k, v) = (wave(n * d, 0.0), wave(n * d, 0.0), wave(n * d, 2.0));
    let config = AttentionConfig::builder(1, d).scale(1e38).build().unwrap();
    let out = prefill_edge(config, DType::F32, &q, &k, &v).agreed(&cuda, 1e-5);
    assert!(out.iter().all(|x| x.is_nan()));
    let config = AttentionConfig::builder(1, d)
        .scale(1e38)
        .logits_soft_cap(Some(30.0))
        .build()
        .unwrap();
    let out = prefill_edge(config, DType::F32, &q, &k, &v).agreed(&cuda, 1e-5);
    assert!(out.iter().all(|x| x.is_finite()));
}

/// NaN and Inf reach exactly the outputs IEEE arithmetic sends them to: a NaN query makes its
/// row NaN, +Inf in a query makes it NaN (Inf - Inf), a NaN key makes the rows that attend it
/// NaN, a NaN value reaches the rows that attend it in its dimension only (never a row for
/// which that key is masked: 0 * NaN).
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn nan_and_inf_reach_exactly_the_outputs_they_should() {
    let cuda = gpu();
    // 200 tokens: units of 32 tokens x 2 heads, and tiles of 64 keys in the tensor-core
    // prefill (bf16, f16), whose diagonal tiles hold the masked NaN values below.
    let (n, h, d) = (200usize, 2usize, 64usize);
    let row = |t: usize, head: usize| (t * h + head) * d;
    for dtype in DType::FLOATS {
        let config = AttentionConfig::builder(h, d).build().unwrap();
        let rel = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        let run = |q: &[f32], k: &[f32], v: &[f32]| {
            prefill_edge(config.clone(), dtype, q, k, v).agreed(&cuda, rel)
        };
        let base = |phase| wave(n * h * d, phase);
        let (q, k, v) = (base(0.0), base(1.0), base(2.0));

        let mut q1 = q.clone();
        q1[row(3, 1) + 5] = f32::NAN;
        let out = run(&q1, &k, &v);
        for (i, x) in out.iter().enumerate() {
            assert_eq!(x.is_nan(), i / d == 3 * h + 1, "element {i} = {x}");
        }

        let mut q2 = q.clone();
        q2[row(10, 0) + 7] = f32::INFINITY;
        let out = run(&q2, &k, &v);
        assert!(out[row(10, 0)..row(10, 0) + d].iter().all(|x| x.is_nan()));

        let mut k3 = k.clone();
        k3[row(20, 0) + 2] = f32::NAN;
        let out = run(&q, &k3, &v);
        for t in 0..n {
            let r = &out[row(t, 0)..row(t, 0) + d];
            assert!(
                r.iter().all(|x| x.is_nan() == (t >= 20)),
                "token {t}: {r:?}"
            );
        }

        for later in [21, 40, 130, 191] {
            let mut v4 = v.clone();
            v4[row(later, 0) + 9] = f32::NAN;
            let out = run(&q, &k, &v4);
            for t in 0..n {
                let x = out[row(t, 0) + 9];
                assert_eq!(x.is_nan(), t >= later, "token {t}: {x}");
                assert!(out[row(t, 0) + 8].is_finite());
            }
        }
    }
    // Three query heads per kv head: prefill units of 21 tokens, whose key ranges end at
    // every position.
    for dtype in DType::FLOATS {
        let config = AttentionConfig::builder(3, d)
            .num_kv_heads(1)
            .build()
            .unwrap();
        let q = wave(n * 3 * d, 0.0);
        let k = wave(n * d, 1.0);
        for later in [21, 42, 43, 150] {
            let mut v = wave(n * d, 2.0);
            v[later * d + 9] = f32::NAN;
            let out = prefill_edge(config.clone(), dtype, &q, &k, &v).agreed(&cuda, 2e-2);
            for t in 0..n {
                let x = out[t * 3 * d + 9];
                assert_eq!(x.is_nan(), t >= later, "{dtype} token {t}: {x}");
            }
        }
    }
}

/// The tensor-core prefill's tiles (64 keys, 32 above D = 128) against the reference: every
/// head size (80, 96, 112 and 120 padded to multiples of 16), bf16 and f16, caches of the same
/// dtype and of both fp8 formats (codes widened in the stage: 16-byte units, 8-byte ones at
/// D = 120), block sizes 8 to 128 (a 64-key tile gathers several blocks, or part of one),
/// prefills of 150 tokens over 70 tokens of prefix context (the causal diagonal spans two
/// tiles) and of 65 fresh tokens (a last tile of one key), padding slots, windows, ALiBi, soft
/// caps; the cache's unused slots hold NaN and infinities.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn tensor_core_prefill_tiles_and_blocks() {
    let cuda = gpu();
    let block_sizes = [8, 16, 32, 64, 128];
    let storages = [
        KvCacheDtype::Auto,
        KvCacheDtype::Fp8E4m3,
        KvCacheDtype::Fp8E5m2,
    ];
    for (dtype, storage) in [DType::BF16, DType::F16]
        .into_iter()
        .flat_map(|dtype| storages.map(|storage| (dtype, storage)))
    {
        for (i, &d) in ATTENTION_HEAD_SIZES.iter().enumerate() {
            let mut st = fixed_settings(dtype, storage, d);
            st.block_size = block_sizes[i % block_sizes.len()];
            st.num_kv_heads = 1;
            st.alibi = if i % 3 == 0 { Alibi::Bloom } else { Alibi::Off };
            st.sliding_window = (i % 4 == 1).then_some(90);
            st.soft_cap = (i % 4 == 2).then_some(20.0);
            st.seed = 11 + i as u64;
            let seqs = vec![
                DecoderSeq {
                    context: 70,
                    new: 150,
                    decode: false,
                    pad: (0..150).map(|t| t % 37 == 5).collect(),
                    extra_blocks: 1,
                },
                DecoderSeq {
                    context: 0,
                    new: 65,
                    decode: false,
                    pad: vec![false; 65],
                    extra_blocks: 0,
                },
            ];
            let what = format!("{dtype} {storage} D={d} B={}", st.block_size);
            let case = DecoderCase {
                settings: st,
                seqs,
                spare_blocks: 2,
            };
            must(run_decoder_paged(&cuda, &case), &what);
        }
    }
}

/// vLLM's sliding-window prompt (window 32, 100 tokens, the 68 oldest with slot -1, blocks
/// reused in a ring): every token is a key of the prompt's queries (read from the call's
/// private cache), only the last 32 are written; against the reference, every dtype and
/// cache dtype and head sizes of every prefill family.
#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn vllm_windowed_prompt_matches_reference() {
    let cuda = gpu();
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            for d in [32, 80, 128, 256] {
                let what = format!("{dtype} {kv_cache_dtype} D={d}");
                let VllmPrompt {
                    settings: st,
                    call,
                    poisoned,
                    after,
                } = vllm_windowed_prompt(&fixed_settings(dtype, kv_cache_dtype, d));
                let reference = reference();
                let mut ref_cache = poisoned.build(reference.kv_cache_layout());
                let want = call
                    .run(&*reference, Some(&mut ref_cache), "reference")
                    .unwrap();
                let mut cache = cuda
                    .load_kv_cache(&poisoned.build(cuda.kv_cache_layout()))
                    .unwrap();
                let got = run_on_gpu(&cuda, &call, Some(&mut cache), &what).unwrap();
                after.check(&cache, &what).unwrap();
                must(compare(&got, &want, &st, &call, (99, true), &what), &what);
            }
        }
    }
}
