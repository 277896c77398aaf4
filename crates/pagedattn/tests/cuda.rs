//! The `cuda` backend against the host: transfers, the cache write (byte for byte against the
//! `cpu` backend), swaps and block copies, the kernel caches, and the error paths.
//!
//! The tests that need a GPU are `#[ignore]`d: a run without one lists them as ignored;
//! `tools/gpu-suite.sh` (or `--include-ignored` on a GPU machine) runs them, and run where no
//! GPU is usable they fail saying why. The others run everywhere: the NVRTC tests need
//! libnvrtc only (without it they print `SKIPPED (libnvrtc ...)` and pass). Random tests
//! print their seed when they fail; `PAGEDATTN_TEST_SEED` replays one, and
//! `PAGEDATTN_TEST_CASES` sets their number per setting.

#![cfg(feature = "cuda")]

mod common;

use common::{gpu, seed, skip};

use pagedattn::cpu::Cpu;
use pagedattn::cuda::{self, CachedImage, Cuda, CudaStorage, DiskCache, ImageOrigin};
use pagedattn::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// Whether NVRTC can be loaded; prints the skip line when it cannot.
fn nvrtc(test: &str) -> bool {
    match cuda::nvrtc_version() {
        Err(Error::Driver(reason)) if reason.starts_with("libnvrtc not found") => {
            skip(test, &reason);
            false
        }
        _ => true,
    }
}

/// Random cases per setting: `PAGEDATTN_TEST_CASES`, default 40 (fewer under a sanitizer).
fn cases() -> usize {
    std::env::var("PAGEDATTN_TEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40)
}

/// A directory of its own under the system's temporary directory, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("pagedattn-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Random data
// ---------------------------------------------------------------------------------------------

/// Random raw bits of `dtype` with NaN (quiet, signaling, negative), infinity, zero and
/// subnormal patterns mixed in.
fn random_bits(rng: &mut StdRng, dtype: DType, len: usize) -> HostStorage {
    let specials: &[u32] = match dtype {
        DType::F32 => &[
            0x7fc0_0000,
            0x7f80_0001,
            0xffc0_1234,
            0x7f80_0000,
            0xff80_0000,
            0,
            0x8000_0000,
            1,
            0x8000_0001,
        ],
        DType::F16 | DType::BF16 => &[
            0x7e00, 0x7c01, 0xfe00, 0x7c00, 0xfc00, 0x7fc0, 0x7f81, 0xff80, 0x7f80, 0, 0x8000, 1,
        ],
        DType::U8 => &[0x7f, 0xff, 0x80, 0],
    };
    let mut bytes = vec![0u8; len * dtype.size_bytes()];
    rng.fill(&mut bytes[..]);
    for element in bytes.chunks_exact_mut(dtype.size_bytes()) {
        if rng.random_bool(0.1) {
            let special = specials[rng.random_range(0..specials.len())];
            element.copy_from_slice(&special.to_le_bytes()[..dtype.size_bytes()]);
        }
    }
    HostStorage::from_bytes(dtype, &bytes).unwrap()
}

/// Values that exercise the fp8 encoding: magnitudes from 2^-30 to 2^20 (saturating), ties
/// between two codes (exact after dividing by a power-of-two `scale`), NaN, infinities, zeros
/// and f32 subnormals.
fn random_values(rng: &mut StdRng, count: usize, scale: f32) -> Vec<f32> {
    let formats = [Fp8Format::E4m3, Fp8Format::E5m2];
    (0..count)
        .map(|_| {
            let sign = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
            match rng.random_range(0..10) {
                0 => [
                    f32::NAN,
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    0.0,
                    -0.0,
                    1e-40,
                    -3e-39,
                ][rng.random_range(0..7)],
                1 | 2 => {
                    let f = formats[rng.random_range(0..2)];
                    let c = rng.random_range(0..0x7e_u8);
                    sign * (f.decode(c) + f.decode(c + 1)) / 2.0 * scale
                }
                _ => sign * rng.random_range(1.0f32..2.0) * 2f32.powi(rng.random_range(-30..=20)),
            }
        })
        .collect()
}

/// A random fp8 scale: a power of two (so that ties stay ties) or any positive number.
fn random_scale(rng: &mut StdRng) -> f32 {
    if rng.random_bool(0.5) {
        2f32.powi(rng.random_range(-3..=3))
    } else {
        rng.random_range(0.01f32..20.0)
    }
}

/// A host cache of `spec` in `layout` full of random bits.
fn random_cache(rng: &mut StdRng, spec: KvCacheSpec) -> KvCache {
    let n = spec.buffer_elems();
    let (key, value) = (
        random_bits(rng, spec.storage_dtype(), n),
        random_bits(rng, spec.storage_dtype(), n),
    );
    KvCache::from_canonical(spec, CacheLayout::Hnd, key, value).unwrap()
}

/// Both buffers of a cache, canonical layout, as bytes.
fn cache_bytes(cache: &KvCache) -> (Vec<u8>, Vec<u8>) {
    let (k, v) = cache.to_canonical().unwrap();
    (k.as_bytes().to_vec(), v.as_bytes().to_vec())
}

/// Panics naming the first differing byte if `a != b`.
fn assert_same_bytes(a: &[u8], b: &[u8], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
        panic!(
            "{what}: first difference at byte {i}: {:#04x} vs {:#04x}",
            a[i], b[i]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Without a GPU too
// ---------------------------------------------------------------------------------------------

#[test]
fn kernels_compile_for_sm80_and_sm90a() {
    if !nvrtc("kernels_compile_for_sm80_and_sm90a") {
        return;
    }
    for arch in ["sm_80", "sm_90a"] {
        let names = cuda::compile_check(arch, None, cuda::CheckDepth::Representative)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        cuda::check_spills(arch, &names).unwrap_or_else(|e| panic!("{e}"));
        // A kernel that spills and is not listed fails the check.
        let mut spilling = names.clone();
        let unlisted = spilling
            .iter_mut()
            .find(|(n, r)| n == "copy_blocks" && r.is_some())
            .expect("copy_blocks compiled to machine code");
        unlisted.1.as_mut().unwrap().spill_stores = 4;
        assert!(matches!(
            cuda::check_spills(arch, &spilling),
            Err(Error::Driver(m)) if m.contains("copy_blocks (4 bytes)")
        ));
        for kernel in [
            "write_kv_f32_auto",
            "write_kv_f16_e4m3",
            "write_kv_bf16_e5m2",
            "copy_blocks",
        ] {
            assert!(
                names.iter().any(|(n, _)| n == kernel),
                "{arch}: {kernel} missing from {names:?}"
            );
        }
    }
    assert!(matches!(
        cuda::compile_check("sm_80; rm", None, cuda::CheckDepth::Full),
        Err(Error::Invalid { .. })
    ));
    assert!(
        matches!(
            cuda::compile_check("sm_1", None, cuda::CheckDepth::Full),
            Err(Error::Driver(_))
        ),
        "an architecture NVRTC does not know"
    );
}

#[test]
fn disk_cache_reuses_images_and_recompiles_corrupt_entries() {
    let test = "disk_cache_reuses_images_and_recompiles_corrupt_entries";
    if !nvrtc(test) {
        return;
    }
    let arch = cuda::info().map_or("sm_80".to_string(), |i| i.arch);
    let dir = TempDir::new("kernel-cache");
    let cache = DiskCache::at(&dir.0);
    let origins = |images: &[CachedImage]| images.iter().map(|i| i.origin).collect::<Vec<_>>();
    let first = cache.load_all(&arch).unwrap();
    assert!(
        first.len() >= 2 && first.iter().all(|i| i.origin == ImageOrigin::Compiled),
        "{first:?}"
    );
    let second = cache.load_all(&arch).unwrap();
    assert!(
        second.iter().all(|i| i.origin == ImageOrigin::Disk),
        "{second:?}"
    );
    assert_eq!(
        first.iter().map(|i| i.checksum).collect::<Vec<_>>(),
        second.iter().map(|i| i.checksum).collect::<Vec<_>>()
    );

    // Truncate one entry, flip a payload bit of another, keep the rest.
    let mut entries: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    assert_eq!(
        entries.len(),
        first.len(),
        "one entry per source: {entries:?}"
    );
    let bytes = std::fs::read(&entries[0]).unwrap();
    std::fs::write(&entries[0], &bytes[..bytes.len() / 2]).unwrap();
    let mut bytes = std::fs::read(&entries[1]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&entries[1], &bytes).unwrap();
    let corrupted: Vec<String> = entries[..2]
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();

    let third = cache.load_all(&arch).unwrap();
    for image in &third {
        let was_corrupted = corrupted
            .iter()
            .any(|f| f.starts_with(&format!("{}-", image.source)));
        let expected = if was_corrupted {
            ImageOrigin::Compiled
        } else {
            ImageOrigin::Disk
        };
        assert_eq!(
            image.origin, expected,
            "{image:?} (corrupted: {corrupted:?})"
        );
    }
    assert_eq!(
        first.iter().map(|i| i.checksum).collect::<Vec<_>>(),
        third.iter().map(|i| i.checksum).collect::<Vec<_>>(),
        "the recompiled images are the originals"
    );
    // The recompiled entries were written back, valid.
    assert_eq!(
        origins(&cache.load_all(&arch).unwrap()),
        vec![ImageOrigin::Disk; first.len()]
    );

    // A cache that cannot be written is no error: the images are compiled every time.
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let unwritable = DiskCache::at(file.join("cache"));
    for _ in 0..2 {
        assert_eq!(
            origins(&unwritable.load_all(&arch).unwrap()),
            vec![ImageOrigin::Compiled; first.len()]
        );
    }
}

#[test]
fn host_memory_is_no_cuda_device() {
    assert!(matches!(
        CudaStorage::zeros(Device::Cpu, DType::F32, 4),
        Err(Error::Invalid { .. })
    ));
    let host = HostStorage::zeros(DType::F16, 3).unwrap();
    assert!(matches!(
        CudaStorage::upload(&host, Device::Cpu),
        Err(Error::Invalid { .. })
    ));
}

#[test]
fn without_a_gpu_every_entry_point_says_why() {
    let Err(e) = cuda::info() else {
        skip(
            "without_a_gpu_every_entry_point_says_why",
            "a GPU is usable: this test is for machines without one",
        );
        return;
    };
    let why = e.to_string();
    assert!(
        why.starts_with("no usable CUDA GPU: ") && !why.contains('\n'),
        "{why}"
    );
    let same = |result: Result<()>| match result {
        Err(Error::Driver(m)) => assert_eq!(m, why),
        other => panic!("expected {why:?}, got {other:?}"),
    };
    same(Cuda::new_default().map(drop));
    same(CudaStorage::zeros(Device::Cuda(0), DType::F32, 8).map(drop));
    same(CudaStorage::zeros(Device::CudaHost(0), DType::F32, 0).map(drop));
    same(
        Tensor::zeros(DType::BF16, &[2, 3])
            .unwrap()
            .to_device(Device::Cuda(0))
            .map(drop),
    );
}

// ---------------------------------------------------------------------------------------------
// With a GPU
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn info_describes_the_gpu() {
    let backend = gpu();
    let info = cuda::info().unwrap();
    assert!(
        !info.name.is_empty() && info.total_memory > 0 && info.nvrtc_version.is_some(),
        "{info:?}"
    );
    assert_eq!(
        info.arch,
        cuda::arch_for(info.compute_capability.0, info.compute_capability.1)
    );
    assert!(!info.to_string().contains('\n'));
    assert_eq!(backend.name(), "cuda");
    assert_eq!(
        (backend.device(), backend.swap_device()),
        (Device::Cuda(0), Device::CudaHost(0))
    );
    let details = backend.details();
    for name in ["gpu", "compute capability", "driver", "nvrtc"] {
        assert!(details.iter().any(|(n, _)| *n == name), "{details:?}");
    }
    backend.synchronize().unwrap();
    // The backend's memory is the GPU's: all of it, and less free once a cache takes some.
    let before = backend.memory().unwrap();
    assert_eq!(before.total, info.total_memory as u64);
    assert!(before.available <= before.total, "{before:?}");
    let spec = AttentionConfig::builder(8, 128)
        .build()
        .unwrap()
        .kv_cache_spec(DType::BF16, 4096, 16);
    let cache = backend.allocate_kv_cache(&spec).unwrap();
    let after = backend.memory().unwrap();
    let bytes = 2 * spec.buffer_elems() as u64 * 2;
    assert!(
        after.available + bytes <= before.available + (64 << 20),
        "a {bytes}-byte cache: {before:?} then {after:?}"
    );
    drop(cache);
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn transfers_round_trip_bit_exactly() {
    let _backend = gpu();
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let devices = cuda::info().unwrap().num_devices;
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::U8] {
        for len in [0, 1, 2, 7, 1001, 65_537, (1 << 22) + 3] {
            let what = format!("seed {seed}, {dtype} x {len}");
            let host = Storage::Host(random_bits(&mut rng, dtype, len));
            let on_gpu = host.to_device(Device::Cuda(0)).unwrap();
            assert_eq!(
                (on_gpu.device(), on_gpu.dtype(), on_gpu.len()),
                (Device::Cuda(0), dtype, len)
            );
            // Device to pinned, pinned to pinned, then back to the device twice (pinned to
            // device, device to device).
            let pinned = on_gpu.to_device(Device::CudaHost(0)).unwrap();
            let pinned = pinned.to_device(Device::CudaHost(0)).unwrap();
            assert_eq!(pinned.device(), Device::CudaHost(0));
            let mut back = pinned
                .to_device(Device::Cuda(0))
                .unwrap()
                .to_device(Device::Cuda(0))
                .unwrap();
            if devices > 1 {
                let other = back.to_device(Device::Cuda(1)).unwrap();
                let other = other
                    .to_device(Device::CudaHost(1))
                    .unwrap()
                    .to_device(Device::Cuda(1))
                    .unwrap();
                back = other.to_device(Device::Cuda(0)).unwrap();
            }
            let back = back.to_device(Device::Cpu).unwrap();
            assert_same_bytes(
                back.host("t").unwrap().as_bytes(),
                host.host("t").unwrap().as_bytes(),
                &what,
            );
            // Host straight to pinned memory and back.
            let direct = host
                .to_device(Device::CudaHost(0))
                .unwrap()
                .to_device(Device::Cpu)
                .unwrap();
            assert_same_bytes(
                direct.host("t").unwrap().as_bytes(),
                host.host("t").unwrap().as_bytes(),
                &what,
            );
            for device in [Device::Cuda(0), Device::CudaHost(0)] {
                let zeros = Storage::zeros(device, dtype, len)
                    .unwrap()
                    .to_device(Device::Cpu)
                    .unwrap();
                assert!(
                    zeros.host("z").unwrap().as_bytes().iter().all(|&b| b == 0),
                    "{what}: zeros on {device}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn allocation_failures_are_errors() {
    let backend = gpu();
    match CudaStorage::zeros(Device::Cuda(0), DType::U8, 1 << 50) {
        Err(Error::OutOfMemory { device, bytes }) => {
            assert_eq!((device.as_str(), bytes), ("cuda:0", 1 << 50))
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Sizes past isize::MAX are refused before the driver sees them (no attempt to pin a
    // huge range of host memory).
    for device in [Device::Cuda(0), Device::CudaHost(0)] {
        let too_big = CudaStorage::zeros(device, DType::U8, isize::MAX as usize + 1);
        assert!(matches!(too_big, Err(Error::Invalid { .. })), "{device}");
    }
    assert!(matches!(
        CudaStorage::zeros(Device::Cuda(0), DType::F32, usize::MAX),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        CudaStorage::zeros(Device::Cuda(1 << 20), DType::F32, 1),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(Cuda::new(1 << 20), Err(Error::Invalid { .. })));
    // A cache and swap space of 70 TB each (2^30 blocks of 16 x 8 x 128 f32), as
    // `hardening.rs` asks of the host backends: `OutOfMemory` naming the device and the bytes.
    let config = AttentionConfig::builder(8, 128).build().unwrap();
    let spec = config.kv_cache_spec(DType::F32, 1 << 30, 16);
    for (device, result) in [
        (Device::Cuda(0), backend.allocate_kv_cache(&spec)),
        (
            Device::CudaHost(0),
            backend.allocate_swap_space(&spec, spec.num_blocks),
        ),
    ] {
        match result {
            Err(Error::OutOfMemory { device: d, bytes }) => {
                assert_eq!((d, bytes), (device.to_string(), 1 << 46))
            }
            other => panic!("{device}: expected OutOfMemory, got {other:?}"),
        }
    }
    // The device still works.
    let t = Tensor::from_f32(DType::F32, &[3], &[1.0, 2.0, 3.0]).unwrap();
    assert_eq!(
        t.to_device(Device::Cuda(0)).unwrap().to_f32_vec().unwrap(),
        vec![1.0, 2.0, 3.0]
    );
}

/// One random batch of writes: its config, cache geometry, metadata, keys and values.
struct WriteCase {
    config: AttentionConfig,
    spec: KvCacheSpec,
    metadata: AttentionMetadata,
    key: Tensor,
    value: Tensor,
}

/// A random batch: prefills (with cached context) then decodes, or encoder-decoder sequences
/// writing the cross cache; distinct random blocks; a fifth of the slots set to -1.
fn write_case(
    rng: &mut StdRng,
    dtype: DType,
    kv_cache_dtype: KvCacheDtype,
    tokens: std::ops::RangeInclusive<usize>,
) -> WriteCase {
    let block_size = rng.random_range(1..=16);
    let num_kv_heads = rng.random_range(1..=4);
    let sizes = cuda::ATTENTION_HEAD_SIZES;
    let head_size = sizes[rng.random_range(0..sizes.len())];
    let cross = rng.random_bool(0.2);
    let num_seqs = rng.random_range(1..=4);
    // (tokens already cached, new tokens) per sequence; decodes last.
    let mut seqs: Vec<(usize, usize, bool)> = (0..num_seqs)
        .map(|_| {
            let decode = !cross && rng.random_bool(0.3);
            let new = if decode {
                1
            } else {
                rng.random_range(tokens.clone())
            };
            (rng.random_range(0..=20), new, decode)
        })
        .collect();
    seqs.sort_by_key(|s| s.2);
    let blocks_of =
        |s: &(usize, usize, bool)| if cross { s.1 } else { s.0 + s.1 }.div_ceil(block_size);
    let needed: usize = seqs.iter().map(blocks_of).sum();
    let num_blocks = needed + rng.random_range(0..=4);
    let mut blocks: Vec<i32> = (0..num_blocks as i32).collect();
    blocks.shuffle(rng);
    let mut builder = MetadataBuilder::new(block_size);
    builder.write_cross_kv(cross);
    let mut next = 0;
    for s in &seqs {
        let table = &blocks[next..next + blocks_of(s)];
        next += blocks_of(s);
        let desc = match (cross, s.2) {
            (true, _) => {
                SequenceDesc::prompt(0, rng.random_range(1..=4), &[]).with_encoder(s.1, table)
            }
            (false, true) => SequenceDesc::decode(s.0, table),
            (false, false) => SequenceDesc::prompt(s.0, s.1, table),
        };
        builder.push(desc);
    }
    let mut metadata = builder.build().unwrap();
    let slots = match &mut metadata.encoder {
        Some(encoder) if cross => &mut encoder.cross_slot_mapping,
        _ => &mut metadata.slot_mapping,
    };
    for slot in slots.iter_mut() {
        if rng.random_bool(0.2) {
            *slot = -1;
        }
    }
    let num_kv_tokens = slots.len();
    let mut config = AttentionConfig::builder(num_kv_heads * rng.random_range(1..=2), head_size)
        .num_kv_heads(num_kv_heads)
        .kv_cache_dtype(kv_cache_dtype)
        .attn_type(if cross {
            AttnType::EncoderDecoder
        } else {
            AttnType::Decoder
        });
    let (k_scale, v_scale) = match kv_cache_dtype {
        KvCacheDtype::Auto => (1.0, 1.0),
        _ => (random_scale(rng), random_scale(rng)),
    };
    config = config.kv_scales(k_scale, v_scale);
    let config = config.build().unwrap();
    let shape = [num_kv_tokens, num_kv_heads, head_size];
    let n = num_kv_tokens * num_kv_heads * head_size;
    let key = Tensor::from_f32(dtype, &shape, &random_values(rng, n, k_scale)).unwrap();
    let value = Tensor::from_f32(dtype, &shape, &random_values(rng, n, v_scale)).unwrap();
    WriteCase {
        spec: config.kv_cache_spec(dtype, num_blocks, block_size),
        config,
        metadata,
        key,
        value,
    }
}

/// Writes `case` into the same random cache with the cpu backend and with `cuda`, and
/// compares the two caches byte for byte.
fn check_write(cuda: &dyn Backend, rng: &mut StdRng, case: &WriteCase, what: &str) {
    let start = random_cache(rng, case.spec);
    let cpu = Cpu::new().unwrap();
    let expected = write(&cpu, case, &start).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let cache = write(cuda, case, &start).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(cache.device(), cuda.device());
    let (want, got) = (cache_bytes(&expected), cache_bytes(&cache));
    assert_same_bytes(&got.0, &want.0, &format!("{what}: key cache"));
    assert_same_bytes(&got.1, &want.1, &format!("{what}: value cache"));
}

/// `start` loaded on `backend`, with `case` written into it.
fn write(backend: &dyn Backend, case: &WriteCase, start: &KvCache) -> Result<KvCache> {
    let mut cache = backend.load_kv_cache(start)?;
    let attention = backend.attention(&case.config)?;
    let plan = attention.plan(&case.metadata, Some(&case.spec))?;
    let key = case.key.to_device(backend.device())?;
    let value = case.value.to_device(backend.device())?;
    attention.write_kv(&plan, &key, &value, &mut cache)?;
    Ok(cache)
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cache_write_matches_cpu_byte_for_byte() {
    let cuda = gpu();
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            for i in 0..cases() {
                let case = write_case(&mut rng, dtype, kv_cache_dtype, 1..=40);
                let what = format!(
                    "seed {seed}: {dtype} {kv_cache_dtype} case {i}, {:?}, {:?}",
                    case.spec,
                    case.config.attn_type()
                );
                check_write(&cuda, &mut rng, &case, &what);
            }
            // One large batch.
            let case = write_case(&mut rng, dtype, kv_cache_dtype, 500..=3000);
            check_write(
                &cuda,
                &mut rng,
                &case,
                &format!(
                    "seed {seed}: {dtype} {kv_cache_dtype} large, {:?}",
                    case.spec
                ),
            );
        }
    }
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn cache_write_checks_its_inputs() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(seed());
    let case = write_case(&mut rng, DType::F16, KvCacheDtype::Fp8E4m3, 1..=8);
    let mut cache = cuda.allocate_kv_cache(&case.spec).unwrap();
    let attention = cuda.attention(&case.config).unwrap();
    let plan = attention.plan(&case.metadata, Some(&case.spec)).unwrap();
    // Host tensors.
    assert!(matches!(
        attention.write_kv(&plan, &case.key, &case.value, &mut cache),
        Err(Error::DeviceMismatch { .. })
    ));
    // A plan of another backend.
    let cpu_plan = Cpu::new()
        .unwrap()
        .attention(&case.config)
        .unwrap()
        .plan(&case.metadata, Some(&case.spec))
        .unwrap();
    let (key, value) = (
        case.key.to_device(cuda.device()).unwrap(),
        case.value.to_device(cuda.device()).unwrap(),
    );
    assert!(matches!(
        attention.write_kv(&cpu_plan, &key, &value, &mut cache),
        Err(Error::Invalid { .. })
    ));
    // A cache in host memory.
    let mut host_cache = KvCache::zeros(case.spec, CacheLayout::Hnd).unwrap();
    assert!(matches!(
        attention.write_kv(&plan, &key, &value, &mut host_cache),
        Err(Error::DeviceMismatch { .. })
    ));
    attention.write_kv(&plan, &key, &value, &mut cache).unwrap();
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn swaps_and_block_copies_match_the_host() {
    let cuda = gpu();
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (dtype, kv_cache_dtype, head_size) in [
        (DType::F16, KvCacheDtype::Auto, 64),
        (DType::F32, KvCacheDtype::Auto, 80),
        (DType::BF16, KvCacheDtype::Fp8E4m3, 120),
    ] {
        let what = format!("seed {seed}: {dtype} {kv_cache_dtype} head size {head_size}");
        let spec = |num_blocks| KvCacheSpec {
            num_blocks,
            block_size: 3,
            num_kv_heads: 2,
            head_size,
            dtype,
            kv_cache_dtype,
        };
        let host = random_cache(&mut rng, spec(12));
        let cache = cuda.load_kv_cache(&host).unwrap();

        // Out: distinct swap blocks, any cache blocks.
        let mut swap = cuda.allocate_swap_space(&spec(12), 7).unwrap();
        assert_eq!(swap.device(), Device::CudaHost(0));
        let mut targets: Vec<usize> = (0..7).collect();
        targets.shuffle(&mut rng);
        let out: Vec<(BlockId, BlockId)> = targets[..5]
            .iter()
            .map(|&d| (rng.random_range(0..12usize) as BlockId, d as BlockId))
            .collect();
        cuda.swap_out(
            std::slice::from_ref(&cache),
            std::slice::from_mut(&mut swap),
            &out,
        )
        .unwrap();
        let mut expected = KvCache::zeros(spec(7), CacheLayout::Hnd).unwrap();
        swap_blocks(&host, &mut expected, &out).unwrap();
        assert_eq!(
            cache_bytes(&swap),
            cache_bytes(&expected),
            "{what}: swap out {out:?}"
        );

        // In: into another cache.
        let host_in = random_cache(&mut rng, spec(12));
        let mut cache_in = cuda.load_kv_cache(&host_in).unwrap();
        let mut targets: Vec<usize> = (0..12).collect();
        targets.shuffle(&mut rng);
        let back: Vec<(BlockId, BlockId)> = targets[..6]
            .iter()
            .map(|&d| (rng.random_range(0..7usize) as BlockId, d as BlockId))
            .collect();
        cuda.swap_in(
            std::slice::from_ref(&swap),
            std::slice::from_mut(&mut cache_in),
            &back,
        )
        .unwrap();
        let mut expected_in = host_in.to_device(Device::Cpu).unwrap();
        swap_blocks(&expected, &mut expected_in, &back).unwrap();
        assert_eq!(
            cache_bytes(&cache_in),
            cache_bytes(&expected_in),
            "{what}: swap in {back:?}"
        );

        // Devices are checked.
        assert!(matches!(
            cuda.swap_out(
                std::slice::from_ref(&host),
                std::slice::from_mut(&mut swap),
                &out
            ),
            Err(Error::DeviceMismatch { .. })
        ));
        let mut misplaced = cuda.allocate_kv_cache(&spec(7)).unwrap();
        assert!(matches!(
            cuda.swap_out(
                std::slice::from_ref(&cache),
                std::slice::from_mut(&mut misplaced),
                &out
            ),
            Err(Error::DeviceMismatch { .. })
        ));
        assert!(matches!(
            cuda.swap_out(
                std::slice::from_ref(&cache),
                std::slice::from_mut(&mut swap),
                &[(0, 7)]
            ),
            Err(Error::Invalid { .. })
        ));
    }

    // Copies over layers of different dtypes and block sizes in bytes (some not a multiple of
    // 16), with chains (a destination copied on later), repeated destinations and self-copies.
    for round in 0..cases().div_ceil(2) {
        let specs = [
            KvCacheSpec {
                num_blocks: 9,
                block_size: 4,
                num_kv_heads: 2,
                head_size: 32,
                dtype: DType::F16,
                kv_cache_dtype: KvCacheDtype::Auto,
            },
            KvCacheSpec {
                num_blocks: 9,
                block_size: 3,
                num_kv_heads: 1,
                head_size: 120,
                dtype: DType::BF16,
                kv_cache_dtype: KvCacheDtype::Fp8E5m2,
            },
            KvCacheSpec {
                num_blocks: 9,
                block_size: 2,
                num_kv_heads: 3,
                head_size: 80,
                dtype: DType::F32,
                kv_cache_dtype: KvCacheDtype::Auto,
            },
        ];
        let hosts: Vec<KvCache> = specs.iter().map(|&s| random_cache(&mut rng, s)).collect();
        let mut caches: Vec<KvCache> = hosts
            .iter()
            .map(|h| cuda.load_kv_cache(h).unwrap())
            .collect();
        let mut expected: Vec<KvCache> = hosts
            .iter()
            .map(|h| h.to_device(Device::Cpu).unwrap())
            .collect();
        let mut pairs: Vec<(BlockId, BlockId)> = (0..rng.random_range(1..=12))
            .map(|_| {
                (
                    rng.random_range(0..9usize) as BlockId,
                    rng.random_range(0..9usize) as BlockId,
                )
            })
            .collect();
        if round % 2 == 0 {
            // A chain: 0 -> 1 -> 2 -> 3.
            pairs.extend([(0, 1), (1, 2), (2, 3)]);
        }
        cuda.copy_blocks(&mut caches, &pairs).unwrap();
        copy_blocks(&mut expected, &pairs).unwrap();
        for (i, (got, want)) in caches.iter().zip(&expected).enumerate() {
            assert_eq!(
                cache_bytes(got),
                cache_bytes(want),
                "seed {seed}: layer {i}, pairs {pairs:?}"
            );
        }
    }
    let mut caches = vec![cuda
        .allocate_kv_cache(&KvCacheSpec {
            num_blocks: 2,
            block_size: 1,
            num_kv_heads: 1,
            head_size: 32,
            dtype: DType::F32,
            kv_cache_dtype: KvCacheDtype::Auto,
        })
        .unwrap()];
    assert!(matches!(
        cuda.copy_blocks(&mut caches, &[(0, 2)]),
        Err(Error::Invalid { .. })
    ));
    cuda.copy_blocks(&mut caches, &[]).unwrap();
    cuda.copy_blocks(&mut [], &[(0, 1)]).unwrap();
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn attention_refuses_head_sizes_without_kernels() {
    let cuda = gpu();
    // The capabilities tell the truth: head sizes without an attention kernel are refused
    // when the layer is made, naming the ones there are (tests/cuda_attention.rs runs them).
    let sizes = match cuda.capabilities().head_sizes {
        Sizes::Only(sizes) => sizes,
        Sizes::Any => panic!("cuda lists its head sizes"),
    };
    assert_eq!(sizes, cuda::ATTENTION_HEAD_SIZES);
    for head_size in [8, 48, 72, 100, 160, 512] {
        let config = AttentionConfig::builder(4, head_size)
            .num_kv_heads(2)
            .build()
            .unwrap();
        match cuda.attention(&config) {
            Err(Error::Unsupported { backend, feature }) => {
                assert_eq!(backend, "cuda");
                assert!(
                    feature.starts_with(&format!("head size {head_size} (supported: 32, 64,")),
                    "{feature}"
                );
            }
            Err(other) => panic!("head size {head_size}: expected Unsupported, got {other}"),
            Ok(_) => panic!("head size {head_size}: expected Unsupported, got a layer"),
        }
    }
    let config = AttentionConfig::builder(4, 96).build().unwrap();
    assert!(cuda.attention(&config).is_ok());
    // Nor is a cache of such a head size: nothing could attend over it.
    let spec = AttentionConfig::builder(4, 72)
        .build()
        .unwrap()
        .kv_cache_spec(DType::F16, 4, 2);
    assert!(matches!(
        cuda.allocate_kv_cache(&spec),
        Err(Error::Unsupported { .. })
    ));
}
