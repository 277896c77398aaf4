//! Regression tests for inputs that once reached undefined behaviour, a panic, an unbounded
//! allocation or a wrong answer through the public API. Scenarios that could crash or exhaust
//! memory run in a child process (this test executable, re-run with `HARDENING_CHILD` set), so
//! that a regression fails the test instead of killing the harness.

use std::process::Command;

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
            .push(SequenceDesc::decode(9, vec![1 << 30, 0]))
            .build()
            .unwrap();
        assert_invalid(attention.plan(&md, Some(&spec)), "kv_cache.num_blocks");
    }
}

#[test]
fn element_counts_that_overflow_are_errors() {
    assert_invalid(
        Tensor::new(vec![1, 1 << 32, 1 << 32], HostStorage::F32(vec![])),
        "tensor shape",
    );
    assert_invalid(
        BlockTables::new(2, 1 << 63, vec![]),
        "block_tables element count",
    );
}

#[test]
fn lengths_that_do_not_fit_the_i32_fields_are_errors() {
    let table = vec![0; 4];
    for context in [1usize << 32, (1 << 31) + 5, i32::MAX as usize] {
        let md = MetadataBuilder::new(1 << 31)
            .push(SequenceDesc::prompt(context, 1, table.clone()))
            .build();
        assert_invalid(md, "context_len + query_len");
    }
    let cross = MetadataBuilder::new(16)
        .write_cross_kv(true)
        .push(SequenceDesc::prompt(0, 1, vec![]).with_encoder(1 << 40, vec![]))
        .build();
    assert_invalid(cross, "encoder len");
    let negative_block = MetadataBuilder::new(1)
        .push(SequenceDesc::prompt(0, 2, vec![0, -1]))
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
            .push(SequenceDesc::prompt(0, 6, vec![]))
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
        .push(SequenceDesc::decode(seq_len, table))
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
