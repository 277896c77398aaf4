//! Regression tests for inputs that once reached undefined behaviour, a panic, an unbounded
//! allocation or a wrong answer through the public API. Scenarios that could crash or exhaust
//! memory run in a child process (this test executable, re-run with `HARDENING_CHILD` set), so
//! that a regression fails the test instead of killing the harness.

mod common;

use std::process::Command;

use common::{disagreement, HandmadeCall};
use pagedattn::*;

/// The environment variable that makes this executable run one scenario as a child.
const CHILD: &str = "HARDENING_CHILD";

/// Runs `scenario` in a child process; the child must exit normally with status 0.
fn in_child(scenario: &str) -> String {
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
    text
}

/// Whether this process is the child running `scenario`.
fn is_child(scenario: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|s| s == scenario)
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T>, field: &str) {
    match result {
        Err(Error::Invalid { field: f, .. }) => assert!(f.contains(field), "{f:?} vs {field:?}"),
        other => panic!("expected Invalid({field}), got {other:?}"),
    }
}

/// A cache whose size in bytes wraps to 0 was once allocated empty, and a `cpu` decode through
/// block 2^30 then read far outside it (SIGSEGV).
#[test]
fn cache_size_overflow_is_an_error_not_a_segfault() {
    let scenario = "cache_size_overflow_is_an_error_not_a_segfault";
    if !is_child(scenario) {
        in_child(scenario);
        return;
    }
    let spec = KvCacheSpec {
        num_blocks: 1 << 61,
        block_size: 8,
        num_kv_heads: 1,
        head_size: 8,
        dtype: DType::F32,
        kv_cache_dtype: KvCacheDtype::Auto,
    };
    for name in ["reference", "cpu"] {
        let backend = registry::backend(name).unwrap();
        assert_invalid(backend.allocate_kv_cache(&spec), "kv_cache.num_blocks");
        let config = AttentionConfig::builder(1, 8).build().unwrap();
        let attention = backend.attention(&config).unwrap();
        // A plan for that geometry is refused too (the decode through block 2^30 that once
        // crashed never starts).
        let md = MetadataBuilder::new(8)
            .push(SequenceDesc::decode(8, &[1 << 30, 0]))
            .build()
            .unwrap();
        assert_invalid(attention.plan(&md, Some(&spec)), "kv_cache.num_blocks");
    }
}

#[test]
fn element_counts_that_overflow_are_errors() {
    assert_invalid(
        Tensor::new(vec![1, 1 << 32, 1 << 32], HostStorage::F32(vec![].into())),
        "tensor shape",
    );
    assert_invalid(
        BlockTables::new(2, 1 << 63, vec![]),
        "block_tables element count",
    );
    // Found by the `constructors` fuzz target: a cache of no blocks whose one block's size
    // overflows passed validation, and `KvCache::from_canonical` then overflowed computing
    // its element count (a panic with overflow checks, a wrapped count without).
    let spec = KvCacheSpec {
        num_blocks: 0,
        block_size: 1 << 40,
        num_kv_heads: 1 << 20,
        head_size: 1 << 10,
        dtype: DType::F32,
        kv_cache_dtype: KvCacheDtype::Auto,
    };
    assert_invalid(spec.validate(), "kv_cache.block_size");
    let empty = || HostStorage::F32(vec![].into());
    let cache = KvCache::from_canonical(spec, CacheLayout::Nhd, empty(), empty());
    assert_invalid(cache, "kv_cache.block_size");
}

#[test]
fn lengths_that_do_not_fit_the_i32_fields_are_errors() {
    let table = vec![0; 4];
    for context in [1usize << 32, (1 << 31) + 5, i32::MAX as usize] {
        let md = MetadataBuilder::new(1 << 31)
            .push(SequenceDesc::prompt(context, 1, &table))
            .build();
        assert_invalid(md, "context_len + query_len");
    }
    let cross = MetadataBuilder::new(16)
        .write_cross_kv(true)
        .push(SequenceDesc::prompt(0, 1, &[]).with_encoder(1 << 40, &[]))
        .build();
    assert_invalid(cross, "encoder len");
    let negative_block = MetadataBuilder::new(1)
        .push(SequenceDesc::prompt(0, 2, &[0, -1]))
        .build();
    assert_invalid(negative_block, "block_table[1]");
    // seq_lens of i32::MIN with one query token: an error, not an overflow panic.
    let md = AttentionMetadata::from_parts(
        0,
        vec![0, 1],
        vec![i32::MIN],
        vec![0],
        BlockTables::from_rows(&[vec![0]]),
        None,
    )
    .unwrap();
    let backend = registry::backend("reference").unwrap();
    let attention = backend
        .attention(&AttentionConfig::builder(1, 8).build().unwrap())
        .unwrap();
    let spec = AttentionConfig::builder(1, 8)
        .build()
        .unwrap()
        .kv_cache_spec(DType::F32, 2, 4);
    assert_invalid(attention.plan(&md, Some(&spec)), "seq_lens[0]");
}

/// A window near `usize::MAX` once wrapped `j + w > i` in `reference`'s mask: it must see what
/// no window sees.
#[test]
fn a_huge_sliding_window_is_no_window() {
    let run = |window: Option<usize>| {
        let config = AttentionConfig::builder(2, 8)
            .sliding_window(window)
            .build()
            .unwrap();
        let md = MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(0, 6, &[]))
            .build()
            .unwrap();
        let values = |n: usize, k: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * 0.61 + k).sin()).collect()
        };
        let q = Tensor::from_f32(DType::F32, &[6, 2, 8], &values(96, 0.0)).unwrap();
        let k = Tensor::from_f32(DType::F32, &[6, 2, 8], &values(96, 1.0)).unwrap();
        let v = Tensor::from_f32(DType::F32, &[6, 2, 8], &values(96, 2.0)).unwrap();
        let mut outs = Vec::new();
        for name in ["reference", "cpu"] {
            let backend = registry::backend(name).unwrap();
            let attention = backend.attention(&config).unwrap();
            let plan = attention.plan(&md, None).unwrap();
            let mut workspace = backend.workspace(&plan).unwrap();
            let out = attention
                .forward(&plan, &mut workspace, Inputs::new(&q).with_kv(&k, &v))
                .unwrap();
            outs.push(out.to_f32_vec().unwrap());
        }
        outs
    };
    let want = run(None);
    for w in [usize::MAX, usize::MAX - 3, 1 << 63] {
        let got = run(Some(w));
        assert_eq!(got[0], want[0], "reference, window {w}");
        for (a, b) in got[1].iter().zip(&want[1]) {
            assert!((a - b).abs() < 1e-6, "cpu, window {w}: {a} vs {b}");
        }
    }
}

/// The peak resident memory of this process, in KiB (Linux).
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `reference` once collected every key position of a sequence and the whole cache as f64: a
/// decode over 2^24 positions (a block table that reuses two blocks) took gigabytes. It streams
/// now: its peak memory stays near the inputs'.
#[test]
fn reference_decodes_long_sequences_in_bounded_memory() {
    let scenario = "reference_decodes_long_sequences_in_bounded_memory";
    if !is_child(scenario) {
        in_child(scenario);
        return;
    }
    let block_size = 1 << 12;
    let seq_len = 1 << 24;
    let config = AttentionConfig::builder(1, 8).build().unwrap();
    let spec = config.kv_cache_spec(DType::F32, 2, block_size);
    let table: Vec<i32> = (0..seq_len / block_size).map(|b| (b % 2) as i32).collect();
    let md = MetadataBuilder::for_cache(&spec)
        .push(SequenceDesc::decode(seq_len - 1, &table))
        .build()
        .unwrap();
    let backend = registry::backend("reference").unwrap();
    let attention = backend.attention(&config).unwrap();
    let mut cache = backend.allocate_kv_cache(&spec).unwrap();
    let plan = attention.plan(&md, Some(&spec)).unwrap();
    let mut workspace = backend.workspace(&plan).unwrap();
    let q = Tensor::from_f32(DType::F32, &[1, 1, 8], &[0.5; 8]).unwrap();
    let kv = Tensor::from_f32(DType::F32, &[1, 1, 8], &[0.25; 8]).unwrap();
    let before = peak_rss_kib();
    let inputs = Inputs::new(&q).with_kv(&kv, &kv).with_cache(&mut cache);
    let out = attention.forward(&plan, &mut workspace, inputs).unwrap();
    // Every key is a zero row of the cache or the new token: softmax over them, exactly.
    let v = out.to_f32_vec().unwrap();
    assert!(v.iter().all(|x| x.is_finite()), "{v:?}");
    if let (Some(before), Some(after)) = (before, peak_rss_kib()) {
        let grown = after.saturating_sub(before);
        assert!(grown < 64 << 10, "peak memory grew by {grown} KiB");
        println!("peak memory grew by {grown} KiB over {seq_len} key positions");
    }
}

/// A replay header that repeats a key was once read with the last value winning.
#[test]
fn replay_headers_with_a_repeated_key_are_refused() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/mixed_batch.safetensors");
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    assert!(replay::read_case(&bytes).is_ok());
    for (anchor, extra) in [
        ("\"__metadata__\":{", "\"attn_type\":\"encoder\","),
        (
            "{",
            "\"query\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},",
        ),
    ] {
        let at = header.find(anchor).unwrap() + anchor.len();
        let edited = format!("{}{extra}{}", &header[..at], &header[at..]);
        let mut file = (edited.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(edited.as_bytes());
        file.extend_from_slice(&bytes[8 + n..]);
        match replay::read_case(&file) {
            Err(Error::Format(m)) => assert!(m.contains("appears twice"), "{m}"),
            other => panic!("expected a format error, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Exact positions, soft caps, scales, NaN and Inf: `reference` against `cpu` on every ISA.
// ---------------------------------------------------------------------------------------------

/// One call to run on every backend: its cache (if any) starts as zeros plus `fill`.
type Case = HandmadeCall;

impl HandmadeCall {
    /// The reference output, after checking that `cpu` on every ISA of this machine agrees
    /// with it: the contract's NaN / Inf classes, and finite elements within `rel` of the
    /// largest finite reference magnitude. (`cuda_attention.rs` holds the GPU to these edges.)
    fn agreed(&self, rel: f32) -> Vec<f32> {
        let want = self.run(&*registry::backend("reference").unwrap());
        for isa in cpu::Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let cpu = cpu::Cpu::with_isa(isa).unwrap();
            if let Some(e) = disagreement(&want, &self.run(&cpu), rel) {
                panic!("cpu {isa}: {e}");
            }
        }
        want
    }
}

/// `reference` and `cpu` (its best instruction set). (The GPU's versions of the tests that
/// use these are in `cuda.rs` and `cuda_attention.rs`.)
fn host_backends() -> Vec<Box<dyn Backend>> {
    vec![
        registry::backend("reference").unwrap(),
        registry::backend("cpu").unwrap(),
    ]
}

/// `n` distinct values of modest size (a fixed pseudo-random pattern).
fn pattern(n: usize, phase: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.731 + phase).sin()).collect()
}

fn f32_tensor(shape: &[usize], values: &[f32]) -> Tensor {
    Tensor::from_f32(DType::F32, shape, values).unwrap()
}

/// A decode at position 2^24 + 999 with a soft cap (which takes the masked path on every
/// tile): `cpu` held positions as f32 and was 7e-3 relative off. The block table reuses one
/// zero block up to the last block, whose keys (the newest one above all) dominate.
#[test]
fn cpu_decode_positions_are_exact_past_2_pow_24() {
    let (bs, d) = (1024usize, 8usize);
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
    let case = Case {
        config,
        metadata: MetadataBuilder::new(bs)
            .push(SequenceDesc::decode(seq_len - 1, &table))
            .build()
            .unwrap(),
        query: f32_tensor(&[1, 1, d], &q),
        kv: Some((
            f32_tensor(&[1, 1, d], &new_k),
            f32_tensor(&[1, 1, d], &pattern(d, 3.0)),
        )),
        cache: Some((
            DType::F32,
            2,
            f32_tensor(&[context, 1, d], &k),
            f32_tensor(&[context, 1, d], &pattern(context * d, 1.0)),
            (0..context as i64).map(|o| bs as i64 + o).collect(),
        )),
    };
    case.agreed(1e-5);
}

/// Cross attention with ALiBi far into the decoder: `cpu` rounded the query position to f32,
/// 3.8e-2 relative off at 2^24 and 0.28 at i32::MAX.
#[test]
fn cpu_cross_alibi_is_exact_at_any_decoder_position() {
    let (h, d, enc) = (4usize, 8usize, 6usize);
    for seq_len in [(1usize << 24) + 2, i32::MAX as usize] {
        let config = AttentionConfig::builder(h, d)
            .num_kv_heads(1)
            .attn_type(AttnType::EncoderDecoder)
            .alibi_slopes(Some(vec![0.5, 0.25, 0.0625, 0.015625]))
            .build()
            .unwrap();
        let case = Case {
            config,
            metadata: MetadataBuilder::new(8)
                .push(SequenceDesc::decode(seq_len - 1, &[]).with_encoder(enc, &[0]))
                .build()
                .unwrap(),
            query: f32_tensor(&[1, h, d], &pattern(h * d, 0.5)),
            kv: None,
            cache: Some((
                DType::F32,
                1,
                f32_tensor(&[enc, 1, d], &pattern(enc * d, 1.5)),
                f32_tensor(&[enc, 1, d], &pattern(enc * d, 2.5)),
                (0..enc as i64).collect(),
            )),
        };
        case.agreed(1e-5);
    }
}

/// A prefill of `n` tokens (one sequence, no cache) with `config`, queries, keys and values
/// of `D = 64` from `q`, `k`, `v` (each `[n, heads, 64]`).
fn prefill(config: AttentionConfig, dtype: DType, q: &[f32], k: &[f32], v: &[f32]) -> Case {
    let (h, hkv, d) = (
        config.num_heads(),
        config.num_kv_heads(),
        config.head_size(),
    );
    let n = q.len() / (h * d);
    let tensor = |shape: &[usize], x: &[f32]| Tensor::from_f32(dtype, shape, x).unwrap();
    Case {
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

/// Soft caps far above the scores: `cpu`'s `tanh` as `1 - 2 / (e^(2x) + 1)` cancelled, and a
/// cap of 1e8 made attention uniform (0.44 relative off; 1e5: 2.7e-3).
#[test]
fn huge_soft_caps_are_accurate() {
    let (n, d) = (40usize, 64usize);
    for cap in [1e5f32, 1e8, 3e38] {
        let config = AttentionConfig::builder(2, d)
            .logits_soft_cap(Some(cap))
            .build()
            .unwrap();
        let x = |phase| pattern(n * 2 * d, phase);
        let q: Vec<f32> = x(0.0).iter().map(|v| v * 4.0).collect();
        prefill(config, DType::F32, &q, &x(1.0), &x(2.0)).agreed(1e-5);
    }
}

/// `scale = 3e38` was folded into the queries by `cpu` and overflowed f32 even where the
/// scores themselves are small (1.0 relative off); the same through an fp8 `k_scale`.
/// Factors outside f32's normal range are refused.
#[test]
fn scales_apply_to_the_dot_product_and_are_range_checked() {
    let (n, d) = (20usize, 64usize);
    let config = AttentionConfig::builder(1, d).scale(3e38).build().unwrap();
    let k: Vec<f32> = pattern(n * d, 1.0).iter().map(|v| v * 3e-38).collect();
    let q: Vec<f32> = pattern(n * d, 0.0).iter().map(|v| v * 2.0).collect();
    prefill(config, DType::F32, &q, &k, &pattern(n * d, 2.0)).agreed(1e-5);

    // fp8: keys of order 1e38 stored with k_scale 3e38, queries of order 1e-37.
    let config = AttentionConfig::builder(1, d)
        .kv_cache_dtype(KvCacheDtype::Fp8E4m3)
        .kv_scales(3e38, 1.0)
        .build()
        .unwrap();
    let k: Vec<f32> = pattern(n * d, 1.0).iter().map(|v| v * 1e38).collect();
    let q: Vec<f32> = pattern(n * d, 0.0).iter().map(|v| v * 1e-37).collect();
    let md = MetadataBuilder::new(16)
        .push(SequenceDesc::prompt(0, n, &[0, 1]))
        .build()
        .unwrap();
    let case = Case {
        config,
        metadata: md,
        query: f32_tensor(&[n, 1, d], &q),
        kv: Some((
            f32_tensor(&[n, 1, d], &k),
            f32_tensor(&[n, 1, d], &pattern(n * d, 2.0)),
        )),
        cache: Some((
            DType::F32,
            2,
            f32_tensor(&[0, 1, d], &[]),
            f32_tensor(&[0, 1, d], &[]),
            vec![],
        )),
    };
    let out = case.agreed(1e-5);
    assert!(out.iter().all(|x| x.is_finite()));

    for (scale, k_scale) in [(3e38f32, 2.0f32), (1e-30, 1e-10), (-3e38, 4.0)] {
        let built = AttentionConfig::builder(1, d)
            .scale(scale)
            .kv_cache_dtype(KvCacheDtype::Fp8E5m2)
            .kv_scales(k_scale, 1.0)
            .build();
        assert_invalid(built, "scale");
    }
}

/// A score beyond f32's range is infinite on every backend: +Inf makes its query's output NaN
/// (Inf - Inf in the softmax); a soft cap maps it to the cap and the output stays finite.
#[test]
fn overflowing_scores_follow_the_contract() {
    let (n, d) = (6usize, 64usize);
    let (q, k, v) = (
        pattern(n * d, 0.0),
        pattern(n * d, 0.0),
        pattern(n * d, 2.0),
    );
    // q_i . k_i is about 32: times 1e38 the diagonal scores overflow, so every row is NaN.
    let config = AttentionConfig::builder(1, d).scale(1e38).build().unwrap();
    let out = prefill(config, DType::F32, &q, &k, &v).agreed(1e-5);
    assert!(out.iter().all(|x| x.is_nan()));
    let config = AttentionConfig::builder(1, d)
        .scale(1e38)
        .logits_soft_cap(Some(30.0))
        .build()
        .unwrap();
    let out = prefill(config, DType::F32, &q, &k, &v).agreed(1e-5);
    assert!(out.iter().all(|x| x.is_finite()));
}

/// NaN and Inf reach exactly the outputs IEEE arithmetic sends them to. `cpu` once gave a zero
/// row for a NaN query, finite rows for Inf in a query or NaN / Inf in a key (its `exp`
/// clamps dropped NaN), and NaN rows for earlier tokens when a later token's value was NaN
/// (0 * NaN in P·V of a masked key).
#[test]
fn nan_and_inf_reach_exactly_the_outputs_they_should() {
    let (n, h, d) = (70usize, 2usize, 64usize);
    let row = |t: usize, head: usize| (t * h + head) * d;
    for dtype in [DType::F32, DType::BF16] {
        let config = AttentionConfig::builder(h, d).build().unwrap();
        let base = |phase| -> Vec<f32> { pattern(n * h * d, phase) };
        let run = |q: &[f32], k: &[f32], v: &[f32]| {
            prefill(config.clone(), dtype, q, k, v).agreed(if dtype == DType::F32 {
                1e-5
            } else {
                2e-2
            })
        };
        let (q, k, v) = (base(0.0), base(1.0), base(2.0));

        // A NaN in query row (token 3, head 1): that row is NaN, every other row finite.
        let mut q1 = q.clone();
        q1[row(3, 1) + 5] = f32::NAN;
        let out = run(&q1, &k, &v);
        for (i, x) in out.iter().enumerate() {
            assert_eq!(x.is_nan(), i / d == 3 * h + 1, "element {i} = {x}");
        }

        // +Inf in a query element whose keys have both signs there: NaN (Inf - Inf).
        let mut q2 = q.clone();
        q2[row(10, 0) + 7] = f32::INFINITY;
        let out = run(&q2, &k, &v);
        assert!(out[row(10, 0)..row(10, 0) + d].iter().all(|x| x.is_nan()));

        // NaN in the key of token 20: rows of tokens >= 20 are NaN, earlier rows finite.
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

        // NaN in the value of a later token (inside the earlier rows' key tiles, or just past
        // an odd tile's end): earlier rows stay finite, later rows are NaN in that dimension.
        for later in [21, 40] {
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
    // Three query heads per kv head: the query tiles hold 21 tokens, so their key tiles end
    // at odd positions, and the bf16 P·V pairs the last key with the next position's value.
    for dtype in [DType::F32, DType::BF16] {
        let config = AttentionConfig::builder(3, d)
            .num_kv_heads(1)
            .build()
            .unwrap();
        let q = pattern(n * 3 * d, 0.0);
        let k = pattern(n * d, 1.0);
        for later in [21, 42, 43] {
            let mut v = pattern(n * d, 2.0);
            v[later * d + 9] = f32::NAN;
            let out = prefill(config.clone(), dtype, &q, &k, &v).agreed(2e-2);
            for t in 0..n {
                let x = out[t * 3 * d + 9];
                assert_eq!(x.is_nan(), t >= later, "{dtype} token {t}: {x}");
            }
        }
    }
}

#[test]
fn workspace_sizes_that_overflow_are_errors() {
    // Found by the `constructors` fuzz target: the cpu plan sized a split-K record as
    // `head_size + 2` floats unchecked (an overflow panic with overflow checks, a wrapped
    // workspace size without). Such a head size is refused where it enters, by the config;
    // the largest one it accepts plans.
    assert_invalid(AttentionConfig::builder(1, usize::MAX).build(), "head_size");
    let config = AttentionConfig::builder(1, isize::MAX as usize / 4)
        .build()
        .unwrap();
    let empty = MetadataBuilder::new(1).build().unwrap();
    let cpu = registry::backend("cpu").unwrap();
    cpu.attention(&config).unwrap().plan(&empty, None).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Issue 23: buffers a caller cannot resize, OutOfMemory, sizes checked where they enter,
// cross-attention ALiBi as the contract says, encoder metadata refused where it is not read.
// ---------------------------------------------------------------------------------------------

/// The accessors once handed out the storage itself: a caller replaced a cache's 1024-block
/// key buffer with 256 elements and a `cpu` decode read far outside it (SIGSEGV); shrunk
/// outputs, queries and workspaces crashed or panicked too. Now they hand out slices of the
/// buffers' own length (replacing a buffer does not compile: `HostSliceMut`'s examples), and
/// what a caller writes through them — NaN in every slot here — reaches only what the
/// contract says.
#[test]
fn safe_accessors_hand_out_buffers_of_their_own_length() {
    let (h, d, bs) = (2usize, 16usize, 16usize);
    let config = AttentionConfig::builder(h, d)
        .num_kv_heads(1)
        .build()
        .unwrap();
    for name in ["reference", "cpu"] {
        let backend = registry::backend(name).unwrap();
        // 64 blocks (the crash had 1024): CI runs this test under Miri, which interprets
        // every element written.
        let spec = config.kv_cache_spec(DType::F32, 64, bs);
        let mut cache = backend.allocate_kv_cache(&spec).unwrap();
        {
            let (mut key, mut value) = cache.host_buffers_mut().unwrap();
            assert_eq!(
                (key.len(), value.len()),
                (spec.buffer_elems(), spec.buffer_elems())
            );
            assert_eq!(key.dtype(), DType::F32);
            key.as_slice_mut::<f32>().unwrap().fill(f32::NAN);
            value.as_bytes_mut().fill(0xFF);
            assert!(key.as_slice_mut::<f16>().is_none());
        }
        // A sequence's first token, decoded into block 60 over the NaN the caller left
        // there: its one key is the token itself.
        let md = MetadataBuilder::new(bs)
            .push(SequenceDesc::decode(0, &[60]))
            .build()
            .unwrap();
        let attention = backend.attention(&config).unwrap();
        let plan = attention.plan(&md, Some(cache.spec())).unwrap();
        let mut workspace = backend.workspace(&plan).unwrap();
        let mut q = f32_tensor(&[1, h, d], &pattern(h * d, 0.5));
        let k = f32_tensor(&[1, 1, d], &pattern(d, 1.5));
        let v = f32_tensor(&[1, 1, d], &pattern(d, 2.5));
        {
            let mut view = q.host_mut().unwrap();
            assert_eq!(view.len(), h * d);
            view.as_slice_mut::<f32>().unwrap()[0] = 0.25;
        }
        let mut out = Tensor::zeros(DType::F32, &[1, h, d]).unwrap();
        out.host_mut().unwrap().as_bytes_mut().fill(0xFF);
        let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(&mut cache);
        attention
            .forward_into(&plan, &mut workspace, inputs, &mut out)
            .unwrap();
        // One key: every head's output is that key's value.
        let got = out.to_f32_vec().unwrap();
        for (i, x) in got.iter().enumerate() {
            assert_eq!(*x, pattern(d, 2.5)[i % d], "{name}: element {i}");
        }
    }
}

/// `allocate_kv_cache` of 70 TB once printed "memory allocation of 70368744177664 bytes
/// failed" and aborted the process; a tensor or a host buffer that large did the same. They are
/// `OutOfMemory` errors naming the bytes now (in a child process: an abort must fail the test,
/// not end the harness).
#[test]
fn allocations_beyond_memory_are_out_of_memory() {
    const NAME: &str = "allocations_beyond_memory_are_out_of_memory";
    if !is_child(NAME) {
        in_child(NAME);
        return;
    }
    let out_of_memory = |result: Result<()>, on: Device, bytes: usize| match result {
        Err(Error::OutOfMemory { device, bytes: b }) => {
            assert_eq!((device, b), (on.to_string(), bytes));
        }
        other => panic!("expected OutOfMemory of {bytes} bytes on {on}, got {other:?}"),
    };
    // 2^30 blocks of 16 x 8 x 128 f32: 2^46 bytes (70 TB) per buffer.
    let config = AttentionConfig::builder(8, 128).build().unwrap();
    let spec = config.kv_cache_spec(DType::F32, 1 << 30, 16);
    for backend in host_backends() {
        let (device, swap) = (backend.device(), backend.swap_device());
        out_of_memory(backend.allocate_kv_cache(&spec).map(drop), device, 1 << 46);
        out_of_memory(
            backend
                .allocate_swap_space(&spec, spec.num_blocks)
                .map(drop),
            swap,
            1 << 46,
        );
    }
    // Beyond any address space: 2^62 bytes.
    let cpu = Device::Cpu;
    let huge = Tensor::zeros(DType::F32, &[1 << 30, 1 << 30]);
    out_of_memory(huge.map(drop), cpu, 1 << 62);
    out_of_memory(Tensor::zeros(DType::U8, &[1 << 62]).map(drop), cpu, 1 << 62);
    out_of_memory(
        HostStorage::zeros(DType::F16, 1 << 61).map(drop),
        cpu,
        1 << 62,
    );
}

/// `Tensor::zeros(F32, &[2^33, 2^33, 1])` once returned a tensor of that shape holding no
/// element (its count wrapped to 0), and configs of 2^32 heads of size 2^32 built and planned;
/// such a tensor passed to a `cpu` forward aborted. Both are refused where they enter.
#[test]
fn sizes_that_overflow_are_refused_where_they_enter() {
    assert_invalid(
        Tensor::zeros(DType::F32, &[1 << 33, 1 << 33, 1]),
        "tensor shape",
    );
    assert_invalid(
        AttentionConfig::builder(1 << 32, 1 << 32).build(),
        "head_size",
    );
    assert_invalid(
        AttentionConfig::builder(1 << 32, 1 << 32)
            .num_kv_heads(1)
            .build(),
        "head_size",
    );
}

/// Cross attention with a slope of -1e38, one decoder token at position 5 and one encoder
/// key: `reference` measured the distance from the decoder's position (a bias of 5e38, an
/// infinite score, NaN outputs) where `cpu` and `cuda` measured it from the last encoder key
/// (0, the value itself). The contract now says the last key: every backend gives the value.
#[test]
fn cross_alibi_is_measured_from_the_last_encoder_key() {
    let d = 32;
    let case = Case::cross_alibi_probe();
    assert_eq!(case.agreed(0.0), vec![0.5; d]);
}

/// Encoder metadata given to a layer that reads none (encoder-only, encoder, decoder) is an
/// error naming it, instead of being silently ignored.
#[test]
fn encoder_metadata_is_refused_where_it_is_not_read() {
    let md = MetadataBuilder::new(16)
        .push(SequenceDesc::prompt(0, 3, &[]).with_encoder(2, &[]))
        .build()
        .unwrap();
    for attn_type in [AttnType::EncoderOnly, AttnType::Encoder, AttnType::Decoder] {
        let config = AttentionConfig::builder(2, 32)
            .attn_type(attn_type)
            .build()
            .unwrap();
        for backend in host_backends() {
            let attention = backend.attention(&config).unwrap();
            assert_invalid(attention.plan(&md, None), "metadata.encoder");
        }
    }
}
