//! The `reference` backend against a dense, non-paged attention written here, in f64, straight
//! from the contract, `docs/semantics.md` (and independently of `src/reference.rs` and `src/semantics.rs`).
//!
//! Every property builds a random batch, runs `reference` on it through the public API (paged
//! cache with shuffled, non-contiguous blocks; unused slots and the output poisoned with NaN) and
//! compares the output, and the cache after the call, with what the dense side computes from
//! the logical per-sequence K/V arrays. Seeds are fresh every run (proptest's default); a
//! failing case prints its `settings.seed`, which regenerates its data.
//! The random batches come from `common` (shared with `cpu_vs_reference`).
//!
//! How the dense side reads the contract:
//! * score `scale * q.k`, then soft cap `cap * tanh(s / cap)`, then ALiBi: decoder
//!   `+ slope_h * (j - i)`, non-causal types (encoder, encoder-only, cross) `- slope_h * |j - i|`,
//!   where i is the query's absolute position in its (decoder) sequence and j the key's
//!   position in the key sequence; then the mask, softmax over the allowed keys, weighted sum of
//!   values. No allowed key: exact zeros.
//! * Decoder: query of new token t at position `ctx + t` sees keys j <= i (and `j > i - W` with a
//!   sliding window). A new token whose slot is -1 is not written and is not a key; positions do
//!   not shift.
//! * With a cache, every key/value is read from the cache: fp8 caches give
//!   `decode(encode(x / scale)) * scale` (the division in f32, the product in f64). Without a
//!   cache, keys and values are the (dtype-rounded) input tensors, even if the config names an
//!   fp8 cache dtype.
//! * Query head h reads kv head `h / (H / Hkv)`.

mod common;

use common::*;
use pagedattn::{
    registry, AttentionConfig, AttnType, DType, KvCacheDtype, KvCacheSpec, KvPair, MetadataBuilder,
    SequenceDesc, Tensor,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The dense attention of `docs/semantics.md`, in f64.
// ---------------------------------------------------------------------------------------------

/// One key/value token as an attention kernel reads it (`[Hkv * D]` each).
type KvRow = (Vec<f64>, Vec<f64>);

#[derive(Debug, Clone)]
struct Dense {
    num_heads: usize,
    num_kv_heads: usize,
    head_size: usize,
    scale: f64,
    soft_cap: Option<f64>,
    slopes: Option<Vec<f64>>,
    window: Option<usize>,
    causal: bool,
}

impl Dense {
    /// Output `[H * D]` of query `q` (`[H * D]`) at position `pos` over the keys of its sequence
    /// (`keys[j]` is the key at position j).
    fn query(&self, q: &[f64], pos: usize, keys: &[KvRow], out: &mut [f64]) {
        let (d, group) = (self.head_size, self.num_heads / self.num_kv_heads);
        for h in 0..self.num_heads {
            let kvh = h / group;
            let qh = &q[h * d..(h + 1) * d];
            let mut scored: Vec<(f64, &[f64])> = Vec::new();
            for (j, row) in keys.iter().enumerate() {
                let (k, v) = row;
                if self.causal {
                    if j > pos {
                        continue;
                    }
                    // Window W: allowed iff pos - W < j.
                    if self.window.is_some_and(|w| j + w <= pos) {
                        continue;
                    }
                }
                let kh = &k[kvh * d..(kvh + 1) * d];
                let mut s = self.scale * qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>();
                if let Some(cap) = self.soft_cap {
                    s = cap * (s / cap).tanh();
                }
                if let Some(slopes) = &self.slopes {
                    let dist = j as f64 - pos as f64;
                    s += if self.causal {
                        slopes[h] * dist
                    } else {
                        -slopes[h] * dist.abs()
                    };
                }
                scored.push((s, &v[kvh * d..(kvh + 1) * d]));
            }
            let o = &mut out[h * d..(h + 1) * d];
            o.fill(0.0);
            if scored.is_empty() {
                continue;
            }
            let max = scored
                .iter()
                .map(|&(s, _)| s)
                .fold(f64::NEG_INFINITY, f64::max);
            let mut denom = 0.0;
            for &(s, v) in &scored {
                let w = (s - max).exp();
                denom += w;
                for (o, &x) in o.iter_mut().zip(v) {
                    *o += w * x;
                }
            }
            for o in o.iter_mut() {
                *o /= denom;
            }
        }
    }
}

/// The dense attention of a layer with these settings.
fn dense_of(st: &Settings, config: &AttentionConfig, causal: bool) -> Dense {
    Dense {
        num_heads: st.num_heads(),
        num_kv_heads: st.num_kv_heads,
        head_size: st.head_size,
        // The parameter as the layer holds it (default 1/sqrt(D) rounded to f32).
        scale: config.scale() as f64,
        soft_cap: st.soft_cap.map(f64::from),
        slopes: st.slopes().map(|s| s.into_iter().map(f64::from).collect()),
        window: if causal { st.sliding_window } else { None },
        causal,
    }
}

/// Checks the output elementwise against the dense result, with a tolerance for the one
/// rounding of f64 into the output dtype.
fn check_output(out: &Tensor, want: &[f64], num_heads: usize, head_size: usize) -> TestResult {
    let tol = match out.dtype() {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::U8 => unreachable!(),
    };
    let got = ok(out.to_f32_vec(), "output to host")?;
    prop_assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        // Beyond the output dtype's range the rounded result is infinite.
        let w = if round_to(out.dtype(), w as f32).is_infinite() {
            w.signum() * f64::INFINITY
        } else {
            w
        };
        // Both compute in f64 with IEEE arithmetic: NaN and ±Inf land on the same elements.
        let agrees = if w.is_finite() {
            g.is_finite() && (g - w).abs() <= tol * (w.abs() + 1e-3)
        } else {
            g == w || (g.is_nan() && w.is_nan())
        };
        if !agrees {
            let (t, h, d) = (
                i / (num_heads * head_size),
                i / head_size % num_heads,
                i % head_size,
            );
            return Err(TestCaseError::fail(format!(
                "output[{t}][{h}][{d}] = {g:e}, dense = {w:e} (tolerance {tol:e} relative)"
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Decoder over the paged cache: chunked prefill / prefix caching, fresh prompts, decodes.
// ---------------------------------------------------------------------------------------------

fn run_decoder_paged(case: &DecoderCase) -> TestResult {
    let st = &case.settings;
    let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
    let row = hkv * d;
    let backend = registry::backend("reference").unwrap();
    let built = DecoderPaged::build(case)?;
    let layout = ok(
        backend.allocate_kv_cache(&built.poisoned.spec),
        "allocate_kv_cache",
    )?
    .layout();
    let mut cache = built.cache(layout)?;
    let out = built.call.run(&*backend, Some(&mut cache), "forward")?;

    // Dense side.
    let dense = dense_of(st, &built.call.config, true);
    let model = &built.after;
    let num_tokens = built.call.query.shape()[0];
    let mut want = vec![0.0; num_tokens * h * d];
    let mut tok = 0;
    for (s, seq) in case.seqs.iter().enumerate() {
        let (keys, values) = (&built.keys[s], &built.values[s]);
        // Every position is a key, a new token with slot -1 too (as the cache would hold it).
        let rows: Vec<KvRow> = (0..built.lens[s])
            .map(|p| model.read_row(&keys[p * row..][..row], &values[p * row..][..row]))
            .collect();
        for t in 0..seq.new {
            let qrow = widen(&built.queries[s][t * h * d..][..h * d]);
            dense.query(
                &qrow,
                seq.context + t,
                &rows,
                &mut want[tok * h * d..][..h * d],
            );
            tok += 1;
        }
    }
    check_output(&out, &want, h, d)?;
    model.check(&cache, "after forward")
}

// ---------------------------------------------------------------------------------------------
// Self-attention without a cache: decoder (fresh prompts only), encoder, encoder-only.
// ---------------------------------------------------------------------------------------------

/// Self-attention without a cache: each sequence's new tokens are all its keys.
fn run_uncached_self(
    st: &Settings,
    attn_type: AttnType,
    lens: &[usize],
    decodes: usize,
) -> TestResult {
    let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
    let row = hkv * d;
    let backend = registry::backend("reference").unwrap();
    let built = UncachedSelf::build(st, attn_type, lens, decodes)?;
    let out = built.call.run(&*backend, None, "forward")?;
    let (qv, kv, vv) = (&built.q, &built.k, &built.v);
    let dense = dense_of(st, &built.call.config, attn_type == AttnType::Decoder);
    let num_tokens: usize = built.lens.iter().sum();
    let mut want = vec![0.0; num_tokens * h * d];
    let mut start = 0;
    for &n in &built.lens {
        let rows: Vec<KvRow> = (start..start + n)
            .map(|t| (widen(&kv[t * row..][..row]), widen(&vv[t * row..][..row])))
            .collect();
        for i in 0..n {
            let t = start + i;
            dense.query(
                &widen(&qv[t * h * d..][..h * d]),
                i,
                &rows,
                &mut want[t * h * d..][..h * d],
            );
        }
        start += n;
    }
    check_output(&out, &want, h, d)
}

// ---------------------------------------------------------------------------------------------
// Encoder-decoder (cross attention).
// ---------------------------------------------------------------------------------------------

/// Dense cross attention of `steps` (in batch order) over each sequence's encoder rows.
fn dense_cross(
    dense: &Dense,
    steps: &[CrossStep],
    queries: &[Vec<f32>],
    enc_rows: &[Vec<KvRow>],
) -> Vec<f64> {
    let hd = dense.num_heads * dense.head_size;
    let mut want = Vec::new();
    for step in steps {
        for t in 0..step.new {
            let mut o = vec![0.0; hd];
            dense.query(
                &widen(&queries[step.s][t * hd..][..hd]),
                step.context + t,
                &enc_rows[step.s],
                &mut o,
            );
            want.extend(o);
        }
    }
    want
}

fn run_cross_paged(case: &CrossCase) -> TestResult {
    let st = &case.settings;
    let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
    let row = hkv * d;
    let backend = registry::backend("reference").unwrap();
    let built = CrossPaged::build(case)?;
    let layout = ok(
        backend.allocate_kv_cache(&built.poisoned.spec),
        "allocate_kv_cache",
    )?
    .layout();
    let mut cache = built.poisoned.build(layout);
    let model = &built.after;

    // Call 1: decoder prompts; the call carries the encoder K/V and writes the cross cache.
    let out = built.call1.run(
        &*backend,
        Some(&mut cache),
        "forward (call 1, writes the cross cache)",
    )?;
    let enc_rows: Vec<Vec<KvRow>> = (0..case.seqs.len())
        .map(|s| {
            let (k, v) = (&built.enc_k[s], &built.enc_v[s]);
            (0..built.enc_lens[s])
                .map(|p| model.read_row(&k[p * row..][..row], &v[p * row..][..row]))
                .collect()
        })
        .collect();
    let dense = dense_of(st, &built.call1.config, false);
    check_output(
        &out,
        &dense_cross(&dense, &built.steps1, &built.q1, &enc_rows),
        h,
        d,
    )
    .map_err(|e| TestCaseError::fail(format!("call 1: {e}")))?;
    model.check(&cache, "after call 1")?;

    // Call 2: no key/value; decoder chunks first, then decodes, read the cross cache.
    let out = built.call2.run(
        &*backend,
        Some(&mut cache),
        "forward (call 2, reads the cross cache)",
    )?;
    check_output(
        &out,
        &dense_cross(&dense, &built.steps2, &built.q2, &enc_rows),
        h,
        d,
    )
    .map_err(|e| TestCaseError::fail(format!("call 2: {e}")))?;
    model.check(&cache, "after call 2")
}

fn run_cross_no_cache(case: &CrossNoCacheCase) -> TestResult {
    let st = &case.settings;
    let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
    let row = hkv * d;
    let backend = registry::backend("reference").unwrap();
    let built = CrossNoCache::build(case)?;
    let out = built.call.run(&*backend, None, "forward")?;
    let enc_rows: Vec<Vec<KvRow>> = (0..built.enc_lens.len())
        .map(|s| {
            (0..built.enc_lens[s])
                .map(|p| {
                    (
                        widen(&built.enc_k[s][p * row..][..row]),
                        widen(&built.enc_v[s][p * row..][..row]),
                    )
                })
                .collect()
        })
        .collect();
    let dense = dense_of(st, &built.call.config, false);
    check_output(
        &out,
        &dense_cross(&dense, &built.steps, &built.queries, &enc_rows),
        h,
        d,
    )
}

// ---------------------------------------------------------------------------------------------
// The properties.
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    /// Decoder over a paged cache: chunked prefill / prefix-cached prompts, fresh prompts and
    /// decodes in one batch, padding slots, GQA, ALiBi, windows, soft cap, fp8.
    #[test]
    fn decoder_paged_matches_dense(case in decoder_case()) {
        run_decoder_paged(&case)?;
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Decoder without a cache: fresh prompts (and 1-token decodes), keys from the inputs.
    #[test]
    fn decoder_without_cache_matches_dense(case in decoder_no_cache_case()) {
        run_uncached_self(&case.settings, AttnType::Decoder, &case.prompts, case.decodes)?;
    }

    /// Encoder and encoder-only: bidirectional over each sequence's own tokens, no cache.
    #[test]
    fn encoder_types_match_dense(case in encoder_case()) {
        run_uncached_self(&case.settings, case.attn_type, &case.lens, 0)?;
    }


    /// Cross attention without a cache: encoder K/V from the inputs.
    #[test]
    fn cross_attention_without_cache_matches_dense(case in cross_no_cache_case()) {
        run_cross_no_cache(&case)?;
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Cross attention with a cross cache: a prefill call that writes the encoder K/V, then a
    /// call without key/value that reads them back.
    #[test]
    fn cross_attention_paged_matches_dense(case in cross_case()) {
        run_cross_paged(&case)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-computed cases.
// ---------------------------------------------------------------------------------------------

/// One sequence of 3 tokens, 1 head, D = 2, scale 1, f32, block size 2 (blocks [1, 0]).
/// Every query is q = (1, 0); keys k0 = (0, 5), k1 = (1, 7), k2 = (2, -3), so q.k_j = j;
/// values v0 = (1, 0), v1 = (0, 1), v2 = (1, 1).
fn hand_case(attn_type: AttnType, slopes: Option<Vec<f32>>, cap: Option<f32>) -> Vec<f32> {
    let backend = registry::backend("reference").unwrap();
    let config = AttentionConfig::builder(1, 2)
        .scale(1.0)
        .alibi_slopes(slopes)
        .logits_soft_cap(cap)
        .attn_type(attn_type)
        .build()
        .unwrap();
    let q = Tensor::from_f32(DType::F32, &[3, 1, 2], &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]).unwrap();
    let k = Tensor::from_f32(DType::F32, &[3, 1, 2], &[0.0, 5.0, 1.0, 7.0, 2.0, -3.0]).unwrap();
    let v = Tensor::from_f32(DType::F32, &[3, 1, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]).unwrap();
    let mut out = Tensor::zeros(DType::F32, &[3, 1, 2]).unwrap();
    out.fill_nan().unwrap();
    let kv = Some(KvPair { key: &k, value: &v });
    if attn_type == AttnType::Decoder {
        let spec = KvCacheSpec {
            num_blocks: 2,
            block_size: 2,
            num_kv_heads: 1,
            head_size: 2,
            dtype: DType::F32,
            kv_cache_dtype: KvCacheDtype::Auto,
        };
        let mut cache = backend.allocate_kv_cache(&spec).unwrap();
        let (mut kb, mut vb) = cache.host_buffers_mut().unwrap();
        kb.as_slice_mut::<f32>().unwrap().fill(f32::NAN);
        vb.as_slice_mut::<f32>().unwrap().fill(f32::NAN);
        let md = MetadataBuilder::new(2)
            .push(SequenceDesc::prompt(0, 3, &[1, 0]))
            .build()
            .unwrap();
        let attention = backend.attention(&config).unwrap();
        forward_once(
            &*backend,
            &*attention,
            &q,
            kv,
            Some(&mut cache),
            &md,
            &mut out,
        )
        .unwrap();
    } else {
        let md = MetadataBuilder::new(2)
            .push(SequenceDesc::prompt(0, 3, &[]))
            .build()
            .unwrap();
        let attention = backend.attention(&config).unwrap();
        forward_once(&*backend, &*attention, &q, kv, None, &md, &mut out).unwrap();
    }
    out.to_f32_vec().unwrap()
}

/// The same case through this file's dense attention (so the numbers below also check it).
fn hand_case_dense(causal: bool, slopes: Option<Vec<f64>>, cap: Option<f64>) -> Vec<f32> {
    let dense = Dense {
        num_heads: 1,
        num_kv_heads: 1,
        head_size: 2,
        scale: 1.0,
        soft_cap: cap,
        slopes,
        window: None,
        causal,
    };
    let rows: Vec<KvRow> = [
        ([0.0, 5.0], [1.0, 0.0]),
        ([1.0, 7.0], [0.0, 1.0]),
        ([2.0, -3.0], [1.0, 1.0]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_vec(), v.to_vec()))
    .collect();
    let mut out = vec![0.0; 6];
    for i in 0..3 {
        dense.query(&[1.0, 0.0], i, &rows, &mut out[2 * i..2 * i + 2]);
    }
    out.into_iter().map(|x| x as f32).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() < 1e-6,
            "{what}: element {i} = {g}, computed by hand {w}"
        );
    }
}

#[test]
fn hand_computed_decoder() {
    // Scores s_j = q.k_j = j, causal.
    // token 0: only k0 -> out = v0 = (1, 0).
    // token 1: softmax(0, 1) = (1, e) / (1 + e) = (0.26894142, 0.73105858) -> out = (p0, p1).
    // token 2: softmax(0, 1, 2) = (1, e, e^2) / 11.10733793 = (0.09003057, 0.24472847,
    //          0.66524096) -> out = (p0 + p2, p1 + p2) = (0.75527153, 0.90996943).
    let want = [1.0, 0.0, 0.268941421, 0.731058579, 0.755271529, 0.909969427];
    assert_close(
        &hand_case(AttnType::Decoder, None, None),
        &want,
        "reference",
    );
    assert_close(&hand_case_dense(true, None, None), &want, "dense");
}

#[test]
fn hand_computed_decoder_alibi() {
    // Slope 1, decoder: s_j = j + (j - i).
    // token 0: (1, 0).
    // token 1: s = (-1, 1): p = (1, e^2) / (1 + e^2) = (0.11920292, 0.88079708) -> (p0, p1).
    // token 2: s = (-2, 0, 2): sum e^-2 + 1 + e^2 = 8.52439138, p = (0.01587624, 0.11731043,
    //          0.86681333) -> (p0 + p2, p1 + p2) = (0.88268957, 0.98412376).
    let want = [1.0, 0.0, 0.119202922, 0.880797078, 0.882689572, 0.984123760];
    assert_close(
        &hand_case(AttnType::Decoder, Some(vec![1.0]), None),
        &want,
        "reference",
    );
    assert_close(
        &hand_case_dense(true, Some(vec![1.0]), None),
        &want,
        "dense",
    );
}

#[test]
fn hand_computed_decoder_soft_cap() {
    // Cap 1: s_j = tanh(j) = (0, 0.76159416, 0.96402758); e^s = (1, 2.14168768, 2.62223650).
    // token 0: (1, 0).
    // token 1: p = (1, 2.14168768) / 3.14168768 = (0.31830026, 0.68169974) -> (p0, p1).
    // token 2: sum 5.76392419, p = (0.17349291, 0.37156764, 0.45493945)
    //          -> (p0 + p2, p1 + p2) = (0.62843236, 0.82650709).
    let want = [1.0, 0.0, 0.318300258, 0.681699742, 0.628432364, 0.826507087];
    assert_close(
        &hand_case(AttnType::Decoder, None, Some(1.0)),
        &want,
        "reference",
    );
    assert_close(&hand_case_dense(true, None, Some(1.0)), &want, "dense");
}

#[test]
fn hand_computed_encoder_alibi() {
    // Non-causal, slope 1: s_j = j - |j - i|.
    // token 0: s = (0, 0, 0): uniform -> (2/3, 2/3).
    // token 1: s = (-1, 1, 1): sum e^-1 + 2e = 5.80444, p = (0.06337894, 0.46831053,
    //          0.46831053) -> (p0 + p2, p1 + p2) = (0.53168947, 0.93662106).
    // token 2: s = (-2, 0, 2): as the decoder's token 2 -> (0.88268957, 0.98412376).
    let want = [
        2.0 / 3.0,
        2.0 / 3.0,
        0.531689470,
        0.936621060,
        0.882689572,
        0.984123760,
    ];
    for t in [AttnType::Encoder, AttnType::EncoderOnly] {
        assert_close(&hand_case(t, Some(vec![1.0]), None), &want, t.name());
    }
    assert_close(
        &hand_case_dense(false, Some(vec![1.0]), None),
        &want,
        "dense",
    );
}

// ---------------------------------------------------------------------------------------------
// Exact zeros.
// ---------------------------------------------------------------------------------------------

/// Head size of the fixed cases.
const HEAD_SIZE: usize = 8;

#[test]
fn zero_length_encoder_sequences() {
    for dtype in DType::FLOATS {
        // Cross attention: the queries of a sequence with no encoder tokens get exact zeros,
        // with and without a cross cache, at prefill and at decode.
        let st = fixed_settings(dtype, KvCacheDtype::Fp8E4m3, HEAD_SIZE);
        let (paged, no_cache) = empty_encoder_cases(&st);
        run_cross_paged(&paged).unwrap();
        run_cross_no_cache(&no_cache).unwrap();
        // And directly: every output of an all-empty encoder side is exactly zero.
        let backend = registry::backend("reference").unwrap();
        let config = st.config(AttnType::EncoderDecoder);
        let attention = backend.attention(&config).unwrap();
        let md = all_empty_encoder_metadata();
        let q = Tensor::from_f32(dtype, &[4, 4, 8], &[0.5; 128]).unwrap();
        let kv = Tensor::zeros(dtype, &[0, 2, 8]).unwrap();
        let mut out = Tensor::zeros(dtype, &[4, 4, 8]).unwrap();
        out.fill_nan().unwrap();
        let kv = Some(KvPair {
            key: &kv,
            value: &kv,
        });
        forward_once(&*backend, &*attention, &q, kv, None, &md, &mut out).unwrap();
        assert!(
            out.to_f32_vec().unwrap().iter().all(|&x| x == 0.0),
            "{dtype}"
        );

        // Encoder / encoder-only batches with empty sequences, and with nothing at all.
        for t in [AttnType::Encoder, AttnType::EncoderOnly] {
            run_uncached_self(&st, t, &[0, 3, 0, 0, 2], 0).unwrap();
            run_uncached_self(&st, t, &[0, 0], 0).unwrap();
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
            let st = fixed_settings(dtype, kv_cache_dtype, HEAD_SIZE);
            run_decoder_paged(&unwritten_keys_case(&st)).unwrap();

            // Directly: a batch whose keys are all unwritten reads every value (0.25, as the
            // cache would hold it) from the inputs, and neither reads nor writes the
            // poisoned cache.
            let backend = registry::backend("reference").unwrap();
            let attention = backend.attention(&st.config(AttnType::Decoder)).unwrap();
            let spec = st.spec(3);
            let mut cache = backend.allocate_kv_cache(&spec).unwrap();
            let mut rng = st.rng();
            let model = CacheModel::poisoned(spec, st.kv_scales(), &mut rng);
            cache = model.build(cache.layout());
            let md = all_unwritten_metadata();
            let q = Tensor::from_f32(dtype, &[4, 4, 8], &[0.5; 128]).unwrap();
            let kv = Tensor::from_f32(dtype, &[4, 2, 8], &[0.25; 64]).unwrap();
            let mut out = Tensor::zeros(dtype, &[4, 4, 8]).unwrap();
            out.fill_nan().unwrap();
            let kv = Some(KvPair {
                key: &kv,
                value: &kv,
            });
            forward_once(
                &*backend,
                &*attention,
                &q,
                kv,
                Some(&mut cache),
                &md,
                &mut out,
            )
            .unwrap();
            assert!(
                out.to_f32_vec()
                    .unwrap()
                    .iter()
                    .all(|&x| (x - 0.25).abs() <= 0.25 * FP8_ROUNDING),
                "{dtype} {kv_cache_dtype}: {:?}",
                out.to_f32_vec().unwrap()
            );
            model.check(&cache, "nothing written").unwrap();
        }
    }
}

/// vLLM's sliding-window prompt (window 32, 100 tokens, the 68 oldest with slot -1): the
/// reference attends every token's key, as vLLM's prefill does over the key and value tensors
/// it is given (with an fp8 cache, as the cache would hold them), and writes only the last 32.
#[test]
fn vllm_windowed_prompt_attends_every_token() {
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [KvCacheDtype::Auto, KvCacheDtype::Fp8E4m3] {
            let VllmPrompt {
                settings: st,
                call,
                poisoned,
                after,
            } = vllm_windowed_prompt(&fixed_settings(dtype, kv_cache_dtype, 16));
            let backend = registry::backend("reference").unwrap();
            let mut cache = poisoned.build(backend.kv_cache_layout());
            let out = call.run(&*backend, Some(&mut cache), "forward").unwrap();
            after.check(&cache, "after forward").unwrap();
            let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
            let row = hkv * d;
            let (keys, values) = call.kv.as_ref().unwrap();
            let (keys, values) = (keys.to_f32_vec().unwrap(), values.to_f32_vec().unwrap());
            let rows: Vec<KvRow> = (0..100)
                .map(|p| after.read_row(&keys[p * row..][..row], &values[p * row..][..row]))
                .collect();
            let dense = dense_of(&st, &call.config, true);
            let queries = call.query.to_f32_vec().unwrap();
            let mut want = vec![0.0; 100 * h * d];
            for (i, out) in want.chunks_mut(h * d).enumerate() {
                dense.query(&widen(&queries[i * h * d..][..h * d]), i, &rows, out);
            }
            check_output(&out, &want, h, d).unwrap();
        }
    }
}
