//! Random batches shared by the property suites (`reference_vs_dense`, `cpu_vs_reference`):
//! layer settings, sequence layouts, data, NaN-poisoned paged caches and the metadata of every
//! attention type, built into calls that run on any backend.
//!
//! Every case is generated from proptest strategies plus one `seed` that regenerates its data
//! (values, block permutation, poison), so a failing case printed by proptest is reproducible.
//! The strategies take the ranges to draw from, so each suite chooses its own sizes; the
//! plain `*_case()` functions are the small sizes of `reference_vs_dense`.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::ops::RangeInclusive;

use half::{bf16, f16};
use pagedattn::{
    alibi_slopes_bloom, AttentionConfig, AttentionMetadata, AttnType, Backend, BlockTables,
    CacheLayout, DType, Fp8Format, HostStorage, Inputs, KvCache, KvCacheDtype, KvCacheSpec, KvPair,
    KvScales, MetadataBuilder, SequenceDesc, Tensor,
};
use proptest::prelude::*;
use proptest::strategy::BoxedStrategy;
use proptest::test_runner::TestCaseError;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

pub type TestResult = Result<(), TestCaseError>;

// ---------------------------------------------------------------------------------------------
// Layer settings shared by all properties.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
pub enum Alibi {
    Off,
    Random,
    Bloom,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub dtype: DType,
    pub kv_cache_dtype: KvCacheDtype,
    pub num_kv_heads: usize,
    pub group: usize,
    pub head_size: usize,
    pub block_size: usize,
    pub alibi: Alibi,
    pub sliding_window: Option<usize>,
    pub soft_cap: Option<f32>,
    pub scale: Option<f32>,
    /// k_scale / v_scale, used only with an fp8 cache dtype.
    pub k_scale: f32,
    pub v_scale: f32,
    /// Inputs are uniform in [-amplitude, amplitude].
    pub amplitude: f32,
    /// The probability that an input element (query, key, value) is NaN, +Inf or -Inf
    /// instead: the suites hold every backend to the contract's IEEE propagation.
    pub specials: f64,
    /// Seeds the data: values, block permutation, poison.
    pub seed: u64,
}

/// The layer shapes a suite draws from.
#[derive(Debug, Clone)]
pub struct Space {
    /// (num_kv_heads, queries per kv head).
    pub heads: BoxedStrategy<(usize, usize)>,
    pub head_size: BoxedStrategy<usize>,
    pub block_size: BoxedStrategy<usize>,
    /// The sliding window of decoder layers (non-causal types never get one).
    pub window: BoxedStrategy<Option<usize>>,
}

impl Space {
    /// The small shapes of `reference_vs_dense`.
    pub fn small() -> Space {
        Space {
            heads: (1..=3usize, 1..=4usize).boxed(),
            head_size: prop_oneof![5 => 1..=16usize, 1 => Just(64usize)].boxed(),
            block_size: prop_oneof![3 => 1..=8usize, 1 => 9..=64usize].boxed(),
            window: prop::option::weighted(0.3, 1..=12usize).boxed(),
        }
    }
}

/// Settings with the small shapes of `reference_vs_dense`.
pub fn settings(allow_window: bool) -> impl Strategy<Value = Settings> {
    settings_in(&Space::small(), allow_window)
}

/// Settings with shapes from `space`; dtypes, cache dtypes, features, scales and amplitudes
/// are drawn the same way for every suite.
pub fn settings_in(space: &Space, allow_window: bool) -> impl Strategy<Value = Settings> {
    let dtype = prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)];
    let kv_cache_dtype = prop_oneof![
        2 => Just(KvCacheDtype::Auto),
        1 => Just(KvCacheDtype::Fp8E4m3),
        1 => Just(KvCacheDtype::Fp8E5m2),
    ];
    let geometry = (
        space.heads.clone(),
        space.head_size.clone(),
        space.block_size.clone(),
    );
    let window = if allow_window {
        space.window.clone()
    } else {
        Just(None).boxed()
    };
    let features = (
        prop_oneof![2 => Just(Alibi::Off), 1 => Just(Alibi::Random), 1 => Just(Alibi::Bloom)],
        window,
        prop::option::weighted(0.3, 0.5f32..30.0),
        prop::option::weighted(0.25, prop_oneof![0.05f32..2.0, -2.0f32..-0.05]),
    );
    let data = (
        -7.0f64..1.5,
        -7.0f64..1.5,
        prop::sample::select(vec![0.25f32, 1.0, 4.0]),
        any::<u64>(),
        prop_oneof![3 => Just(0.0f64), 1 => prop::sample::select(vec![0.002f64, 0.02, 0.2])],
    );
    (dtype, kv_cache_dtype, geometry, features, data).prop_map(
        |(dtype, kv_cache_dtype, geometry, features, data)| Settings {
            dtype,
            kv_cache_dtype,
            num_kv_heads: geometry.0 .0,
            group: geometry.0 .1,
            head_size: geometry.1,
            block_size: geometry.2,
            alibi: features.0,
            sliding_window: features.1,
            soft_cap: features.2,
            scale: features.3,
            k_scale: data.0.exp2() as f32,
            v_scale: data.1.exp2() as f32,
            amplitude: data.2,
            seed: data.3,
            specials: data.4,
        },
    )
}

impl Settings {
    pub fn num_heads(&self) -> usize {
        self.num_kv_heads * self.group
    }

    pub fn rng(&self) -> StdRng {
        StdRng::seed_from_u64(self.seed)
    }

    /// `count` input values: uniform in [-amplitude, amplitude] and rounded to the dtype,
    /// each replaced by NaN, +Inf or -Inf with probability `specials`.
    pub fn values(&self, rng: &mut StdRng, count: usize) -> Vec<f32> {
        let mut xs = random_values(rng, self.dtype, count, self.amplitude);
        if self.specials > 0.0 {
            for x in &mut xs {
                if rng.random_bool(self.specials) {
                    *x = *[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]
                        .choose(&mut *rng)
                        .unwrap();
                }
            }
        }
        xs
    }

    pub fn slopes(&self) -> Option<Vec<f32>> {
        let h = self.num_heads();
        match self.alibi {
            Alibi::Off => None,
            Alibi::Bloom => Some(alibi_slopes_bloom(h)),
            Alibi::Random => {
                let mut rng = StdRng::seed_from_u64(self.seed ^ 0xA11B1);
                Some((0..h).map(|_| rng.random_range(-0.25f32..1.0)).collect())
            }
        }
    }

    pub fn kv_scales(&self) -> KvScales {
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => KvScales::ONE,
            _ => KvScales {
                k_scale: self.k_scale,
                v_scale: self.v_scale,
            },
        }
    }

    pub fn config(&self, attn_type: AttnType) -> AttentionConfig {
        let mut b = AttentionConfig::builder(self.num_heads(), self.head_size)
            .num_kv_heads(self.num_kv_heads)
            .alibi_slopes(self.slopes())
            .sliding_window(self.sliding_window)
            .logits_soft_cap(self.soft_cap)
            .kv_cache_dtype(self.kv_cache_dtype)
            .kv_scales(self.kv_scales().k_scale, self.kv_scales().v_scale)
            .attn_type(attn_type);
        if let Some(scale) = self.scale {
            b = b.scale(scale);
        }
        b.build().expect("generated configs are valid")
    }

    pub fn spec(&self, num_blocks: usize) -> KvCacheSpec {
        KvCacheSpec {
            num_blocks,
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            dtype: self.dtype,
            kv_cache_dtype: self.kv_cache_dtype,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Data helpers.
// ---------------------------------------------------------------------------------------------

/// Rounds to `dtype` with the `half` crate (nearest even); the result is exact in f32.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::U8 => unreachable!(),
    }
}

/// `count` values uniform in [-amp, amp], already rounded to `dtype`.
pub fn random_values(rng: &mut StdRng, dtype: DType, count: usize, amp: f32) -> Vec<f32> {
    (0..count)
        .map(|_| round_to(dtype, rng.random_range(-amp..=amp)))
        .collect()
}

pub fn tensor(dtype: DType, shape: &[usize], values: &[f32]) -> Tensor {
    let t = Tensor::from_f32(dtype, shape, values).expect("tensor");
    // The values are representable: the tensor holds exactly them (NaN as NaN).
    let held = t.to_f32_vec().unwrap();
    assert!(held
        .iter()
        .zip(values)
        .all(|(a, b)| a == b || (a.is_nan() && b.is_nan())));
    t
}

pub fn widen(xs: &[f32]) -> Vec<f64> {
    xs.iter().map(|&x| x as f64).collect()
}

pub fn ok<T>(r: pagedattn::Result<T>, what: &str) -> Result<T, TestCaseError> {
    r.map_err(|e| TestCaseError::fail(format!("{what} failed: {e}")))
}

/// `slot = block * B + offset` of position `pos` through `table`.
pub fn slot_of(table: &[i32], block_size: usize, pos: usize) -> i64 {
    table[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64
}

/// Gives every sequence `ceil(len / B)` distinct blocks taken in order from a random
/// permutation of all blocks (so they are shuffled and non-contiguous), plus `extra[s]` table
/// entries past the end pointing at random blocks, which must never be read. Returns the number
/// of blocks and the tables.
pub fn allocate(
    rng: &mut StdRng,
    block_size: usize,
    lens: &[usize],
    extra: &[usize],
    spare: usize,
) -> (usize, Vec<Vec<i32>>) {
    let needed: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
    let num_blocks = (needed.iter().sum::<usize>() + spare).max(1);
    let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
    perm.shuffle(rng);
    let mut next = perm.into_iter();
    let tables = needed
        .iter()
        .zip(extra)
        .map(|(&n, &e)| {
            let mut t: Vec<i32> = next.by_ref().take(n).collect();
            t.extend((0..e).map(|_| rng.random_range(0..num_blocks as i32)));
            t
        })
        .collect();
    (num_blocks, tables)
}

/// `cases` per property, unless `PROPTEST_CASES` asks for another number (for a long soak).
pub fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // Test files write nothing to the source tree: no regression files. A failure prints
        // the minimal case (its `seed` regenerates the data).
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// One forward call, ready to run on any backend.
// ---------------------------------------------------------------------------------------------

/// The inputs of one `forward` call (the cache is the caller's).
#[derive(Debug)]
pub struct Call {
    pub config: AttentionConfig,
    pub query: Tensor,
    /// New keys and values (absent for a cross-attention call that only reads the cache).
    pub kv: Option<(Tensor, Tensor)>,
    pub metadata: AttentionMetadata,
    /// The config's fp8 scales (for writing context with `KvCache::write`).
    pub scales: KvScales,
}

impl Call {
    /// Plans the call on `backend` and runs it into a NaN-poisoned output; returns the output.
    pub fn run(
        &self,
        backend: &dyn Backend,
        cache: Option<&mut KvCache>,
        what: &str,
    ) -> Result<Tensor, TestCaseError> {
        let attention = ok(backend.attention(&self.config), "attention")?;
        let plan = ok(
            attention.plan(&self.metadata, cache.as_deref().map(KvCache::spec)),
            what,
        )?;
        let mut workspace = ok(backend.workspace(&plan), "workspace")?;
        let mut out = Tensor::zeros(self.query.dtype(), self.query.shape()).unwrap();
        ok(out.fill_nan(), "poisoning the output")?;
        let inputs = Inputs::new(&self.query)
            .with_kv_pair(self.kv.as_ref().map(|(key, value)| KvPair { key, value }))
            .with_cache_opt(cache);
        ok(
            attention.forward_into(&plan, &mut workspace, inputs, &mut out),
            what,
        )?;
        Ok(out)
    }
}
/// One forward call the way an engine makes it: plan the metadata (with the cache's geometry),
/// take a workspace for the plan, run.
pub fn forward_once(
    backend: &dyn Backend,
    attention: &dyn pagedattn::AttentionImpl,
    query: &Tensor,
    kv: Option<KvPair<'_>>,
    cache: Option<&mut KvCache>,
    metadata: &AttentionMetadata,
    output: &mut Tensor,
) -> pagedattn::Result<()> {
    let plan = attention.plan(metadata, cache.as_deref().map(KvCache::spec))?;
    let mut workspace = backend.workspace(&plan)?;
    let inputs = Inputs::new(query).with_kv_pair(kv).with_cache_opt(cache);
    attention.forward_into(&plan, &mut workspace, inputs, output)
}

// ---------------------------------------------------------------------------------------------
// One call with a hand-made cache (the edge cases of `hardening`, `cuda_attention` and
// `long_context`), and the contract's agreement of two outputs.
// ---------------------------------------------------------------------------------------------

/// One call with a hand-made cache: zeros plus the rows written before the call.
#[derive(Debug)]
pub struct HandmadeCall {
    pub config: AttentionConfig,
    pub metadata: AttentionMetadata,
    pub query: Tensor,
    pub kv: Option<(Tensor, Tensor)>,
    /// The cache's dtype and block count, and the rows written before the call
    /// (`[rows, Hkv, D]` keys and values, their slots).
    pub cache: Option<(DType, usize, Tensor, Tensor, Vec<i64>)>,
}

impl HandmadeCall {
    /// Cross attention with an ALiBi slope of -1e38, one decoder token at position 5 and one
    /// encoder key of value 0.5: the contract measures the distance from the last encoder key
    /// (0: the output is the value), not from the decoder's position (an infinite score, NaN
    /// outputs). Shared by the host backends' test (`hardening.rs`) and `cuda`'s.
    pub fn cross_alibi_probe() -> HandmadeCall {
        let d = 32;
        let rows = |x: f32| Tensor::from_f32(DType::F32, &[1, 1, d], &vec![x; d]).unwrap();
        HandmadeCall {
            config: AttentionConfig::builder(1, d)
                .attn_type(AttnType::EncoderDecoder)
                .alibi_slopes(Some(vec![-1e38]))
                .build()
                .unwrap(),
            metadata: MetadataBuilder::new(16)
                .push(SequenceDesc::decode(5, &[]).with_encoder(1, &[0]))
                .build()
                .unwrap(),
            query: rows(1.0),
            kv: None,
            cache: Some((DType::F32, 1, rows(1.0), rows(0.5), vec![0])),
        }
    }

    /// The output on `backend`, which starts poisoned with NaN. Inputs and the cache are
    /// built in host memory and moved to the backend's device.
    pub fn run(&self, backend: &dyn Backend) -> Vec<f32> {
        let device = backend.device();
        let attention = backend.attention(&self.config).unwrap();
        let mut cache = self.cache.as_ref().map(|(dtype, blocks, k, v, slots)| {
            let block_size = self.metadata.block_size.unwrap();
            let spec = self.config.kv_cache_spec(*dtype, *blocks, block_size);
            let mut host = KvCache::zeros(spec, backend.kv_cache_layout()).unwrap();
            host.write(k, v, slots, self.config.kv_scales()).unwrap();
            backend.load_kv_cache(&host).unwrap()
        });
        let plan = attention
            .plan(&self.metadata, cache.as_ref().map(KvCache::spec))
            .unwrap();
        let mut workspace = backend.workspace(&plan).unwrap();
        let query = self.query.to_device(device).unwrap();
        let kv = self
            .kv
            .as_ref()
            .map(|(k, v)| (k.to_device(device).unwrap(), v.to_device(device).unwrap()));
        let mut out = Tensor::zeros_on(device, query.dtype(), query.shape()).unwrap();
        out.fill_nan().unwrap();
        let inputs = Inputs::new(&query)
            .with_kv_pair(kv.as_ref().map(|(key, value)| KvPair { key, value }))
            .with_cache_opt(cache.as_mut());
        attention
            .forward_into(&plan, &mut workspace, inputs, &mut out)
            .unwrap();
        out.to_f32_vec().unwrap()
    }
}

/// The first output element where `got` disagrees with `want` (`reference`'s) as the
/// contract says: NaN exactly where `want` is NaN, the same infinity (or NaN) where it is
/// infinite, and finite elements within `rel` of the largest finite magnitude of `want`.
pub fn disagreement(want: &[f32], got: &[f32], rel: f32) -> Option<String> {
    let largest = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f32, |m, x| m.max(x.abs()));
    want.iter().zip(got).enumerate().find_map(|(i, (&w, &g))| {
        let agrees = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w || g.is_nan()
        } else {
            g.is_finite() && (g - w).abs() <= rel * largest
        };
        (!agrees).then(|| format!("output element {i} = {g:e}, reference {w:e}"))
    })
}

// ---------------------------------------------------------------------------------------------
// A model of the paged cache: the canonical bytes it must hold.
// ---------------------------------------------------------------------------------------------

/// The expected canonical `[NB, B, Hkv, D]` key and value bytes of a cache: NaN poison
/// everywhere, then the stored value of every token written.
#[derive(Debug, Clone)]
pub struct CacheModel {
    pub spec: KvCacheSpec,
    pub fp8: Option<Fp8Format>,
    pub scales: KvScales,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

impl CacheModel {
    /// A cache full of NaNs and infinities: random quiet-NaN payloads and ±Inf for float
    /// caches, random NaN codes (e4m3: 0x7F / 0xFF, it has no infinity; e5m2: exponent 11111,
    /// with a non-zero mantissa for NaN, zero for ±Inf) for fp8.
    pub fn poisoned(spec: KvCacheSpec, scales: KvScales, rng: &mut StdRng) -> Self {
        let fp8 = spec.kv_cache_dtype.fp8_format();
        let n = spec.num_blocks * spec.block_size * spec.num_kv_heads * spec.head_size;
        let mut poison = || {
            let mut bytes = Vec::new();
            for _ in 0..n {
                let r: u32 = rng.random();
                match (fp8, spec.dtype) {
                    (Some(Fp8Format::E4m3), _) => {
                        bytes.push(*[0x7Fu8, 0xFF].choose(&mut *rng).unwrap())
                    }
                    (Some(Fp8Format::E5m2), _) => bytes.push(
                        *[0x7Cu8, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF]
                            .choose(&mut *rng)
                            .unwrap(),
                    ),
                    // One slot in eight holds an infinity (the payload bits cleared).
                    (None, DType::F32) => {
                        let payload = if r & 0x70 == 0 {
                            0
                        } else {
                            0x40_0000 | (r & 0x3F_FFFF)
                        };
                        bytes.extend(((r & 0x8000_0000) | 0x7F80_0000 | payload).to_le_bytes())
                    }
                    (None, DType::F16) => {
                        let payload = if r & 0x70 == 0 {
                            0
                        } else {
                            0x200 | (r as u16 & 0x1FF)
                        };
                        bytes.extend((((r >> 16) as u16 & 0x8000) | 0x7C00 | payload).to_le_bytes())
                    }
                    (None, DType::BF16) => {
                        let payload = if r & 0x70 == 0 {
                            0
                        } else {
                            0x40 | (r as u16 & 0x3F)
                        };
                        bytes.extend((((r >> 16) as u16 & 0x8000) | 0x7F80 | payload).to_le_bytes())
                    }
                    (None, DType::U8) => unreachable!(),
                }
            }
            bytes
        };
        let key = poison();
        let value = poison();
        CacheModel {
            spec,
            fp8,
            scales,
            key,
            value,
        }
    }

    pub fn elem_size(&self) -> usize {
        if self.fp8.is_some() {
            1
        } else {
            self.spec.dtype.size_bytes()
        }
    }

    /// The stored bytes of input element `x` (already in the activation dtype).
    pub fn encode(&self, x: f32, scale: f32) -> Vec<u8> {
        match self.fp8 {
            Some(f) => vec![f.encode(x / scale)],
            None => match self.spec.dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
                DType::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
                DType::U8 => unreachable!(),
            },
        }
    }

    /// What an attention kernel reads back for input element `x`.
    pub fn read(&self, x: f32, scale: f32) -> f64 {
        match self.fp8 {
            Some(f) => f.decode(f.encode(x / scale)) as f64 * scale as f64,
            None => x as f64,
        }
    }

    /// The token row (`[Hkv * D]` keys and values) as read back from the cache.
    pub fn read_row(&self, k: &[f32], v: &[f32]) -> (Vec<f64>, Vec<f64>) {
        (
            k.iter()
                .map(|&x| self.read(x, self.scales.k_scale))
                .collect(),
            v.iter()
                .map(|&x| self.read(x, self.scales.v_scale))
                .collect(),
        )
    }

    /// Records that token row (k, v) is stored at `slot`.
    pub fn store(&mut self, slot: i64, k: &[f32], v: &[f32]) {
        let (es, row) = (
            self.elem_size(),
            self.spec.num_kv_heads * self.spec.head_size,
        );
        let slot = usize::try_from(slot).expect("a real slot");
        for (xs, scale, is_key) in [
            (k, self.scales.k_scale, true),
            (v, self.scales.v_scale, false),
        ] {
            for (e, &x) in xs.iter().enumerate() {
                let bytes = self.encode(x, scale);
                let at = (slot * row + e) * es;
                let buf = if is_key {
                    &mut self.key
                } else {
                    &mut self.value
                };
                buf[at..at + es].copy_from_slice(&bytes);
            }
        }
    }

    /// The cache holding the expected bytes, in `layout`.
    pub fn build(&self, layout: pagedattn::CacheLayout) -> KvCache {
        let dt = self.spec.storage_dtype();
        KvCache::from_canonical(
            self.spec,
            layout,
            HostStorage::from_bytes(dt, &self.key).unwrap(),
            HostStorage::from_bytes(dt, &self.value).unwrap(),
        )
        .expect("cache from canonical buffers")
    }

    /// Every byte of the cache equals the model: written slots hold exactly the stored values,
    /// every other slot keeps its poison.
    pub fn check(&self, cache: &KvCache, when: &str) -> TestResult {
        let (k, v) = cache.to_canonical().unwrap();
        let (es, h, d) = (
            self.elem_size(),
            self.spec.num_kv_heads,
            self.spec.head_size,
        );
        for (name, got, want) in [
            ("key", k.as_bytes(), &self.key),
            ("value", v.as_bytes(), &self.value),
        ] {
            prop_assert_eq!(got.len(), want.len());
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                let e = i / es;
                let (slot, head, dd) = (e / (h * d), e / d % h, e % d);
                return Err(TestCaseError::fail(format!(
                    "{when}: {name} cache slot {slot} head {head} element {dd}: bytes {:02x?}, expected {:02x?}",
                    &got[e * es..(e + 1) * es],
                    &want[e * es..(e + 1) * es]
                )));
            }
        }
        Ok(())
    }
}

/// Compares two caches byte for byte in the canonical layout (both backends must store the
/// same bytes: same rounding, same fp8 codes, untouched poison).
pub fn same_cache(got: &KvCache, want: &KvCache, when: &str) -> TestResult {
    let spec = *want.spec();
    prop_assert_eq!(got.spec(), &spec);
    let es = spec.storage_dtype().size_bytes();
    let (h, d) = (spec.num_kv_heads, spec.head_size);
    let (gk, gv) = got.to_canonical().unwrap();
    let (wk, wv) = want.to_canonical().unwrap();
    for (name, got, want) in [
        ("key", gk.as_bytes(), wk.as_bytes()),
        ("value", gv.as_bytes(), wv.as_bytes()),
    ] {
        prop_assert_eq!(got.len(), want.len());
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            let e = i / es;
            let (slot, head, dd) = (e / (h * d), e / d % h, e % d);
            return Err(TestCaseError::fail(format!(
                "{when}: {name} cache slot {slot} head {head} element {dd}: bytes {:02x?}, expected {:02x?}",
                &got[e * es..(e + 1) * es],
                &want[e * es..(e + 1) * es]
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Decoder over the paged cache: chunked prefill / prefix caching, fresh prompts, decodes.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct DecoderSeq {
    pub context: usize,
    pub new: usize,
    pub decode: bool,
    /// Per new token: slot -1 (padding).
    pub pad: Vec<bool>,
    /// Table entries past the needed ones (never read).
    pub extra_blocks: usize,
}

/// A prompt (chunk) with the small sizes of `reference_vs_dense`.
pub fn prefill_seq() -> impl Strategy<Value = DecoderSeq> {
    prefill_seq_in(prop_oneof![Just(0usize), 1..=12usize].boxed(), 1..=8)
}

/// A prompt (chunk) of `new` tokens after `context` cached ones; 12% of the new tokens are
/// padding.
pub fn prefill_seq_in(
    context: BoxedStrategy<usize>,
    new: RangeInclusive<usize>,
) -> impl Strategy<Value = DecoderSeq> {
    (context, new, 0..=2usize).prop_flat_map(|(context, new, extra_blocks)| {
        prop::collection::vec(prop::bool::weighted(0.12), new).prop_map(move |pad| DecoderSeq {
            context,
            new,
            decode: false,
            pad,
            extra_blocks,
        })
    })
}

/// A decode with the small sizes of `reference_vs_dense`.
pub fn decode_seq() -> impl Strategy<Value = DecoderSeq> {
    decode_seq_in(1..=20)
}

/// A decode of a sequence of `len` tokens (its new token is padding 8% of the time).
pub fn decode_seq_in(len: RangeInclusive<usize>) -> impl Strategy<Value = DecoderSeq> {
    (len, prop::bool::weighted(0.08), 0..=2usize).prop_map(|(len, pad, extra_blocks)| DecoderSeq {
        context: len - 1,
        new: 1,
        decode: true,
        pad: vec![pad],
        extra_blocks,
    })
}

#[derive(Debug, Clone)]
pub struct DecoderCase {
    pub settings: Settings,
    /// Prefills first, then decodes.
    pub seqs: Vec<DecoderSeq>,
    pub spare_blocks: usize,
}

pub fn decoder_case() -> impl Strategy<Value = DecoderCase> {
    (
        settings(true),
        prop::collection::vec(prefill_seq(), 0..=3),
        prop::collection::vec(decode_seq(), 0..=3),
        0..=3usize,
    )
        .prop_map(|(settings, mut seqs, decodes, spare_blocks)| {
            seqs.extend(decodes);
            DecoderCase {
                settings,
                seqs,
                spare_blocks,
            }
        })
}

/// A decoder case built: the call, the logical sequences, and the cache contents before the
/// context, after it and after the call.
pub struct DecoderPaged {
    pub call: Call,
    /// Keys per sequence (context + new).
    pub lens: Vec<usize>,
    /// Per sequence: K and V of every position (`[len, Hkv, D]`), Q of the new tokens.
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    pub queries: Vec<Vec<f32>>,
    /// The cached context, written before the call through its own slot mapping.
    pub context_k: Tensor,
    pub context_v: Tensor,
    pub context_slots: Vec<i64>,
    /// The canonical cache contents: poison only, then with the context, then after the call.
    pub poisoned: CacheModel,
    pub with_context: CacheModel,
    pub after: CacheModel,
}

impl DecoderPaged {
    pub fn build(case: &DecoderCase) -> Result<Self, TestCaseError> {
        let st = &case.settings;
        let mut rng = st.rng();
        let (h, hkv, d, b, dtype) = (
            st.num_heads(),
            st.num_kv_heads,
            st.head_size,
            st.block_size,
            st.dtype,
        );
        let row = hkv * d;
        let config = st.config(AttnType::Decoder);

        let seqs = &case.seqs;
        let lens: Vec<usize> = seqs.iter().map(|s| s.context + s.new).collect();
        let extra: Vec<usize> = seqs.iter().map(|s| s.extra_blocks).collect();
        let (num_blocks, tables) = allocate(&mut rng, b, &lens, &extra, case.spare_blocks);
        let spec = st.spec(num_blocks);
        let scales = st.kv_scales();
        let poisoned = CacheModel::poisoned(spec, scales, &mut rng);
        let mut model = poisoned.clone();

        // The logical sequences: K/V of every position, Q of the new tokens.
        let keys: Vec<Vec<f32>> = lens.iter().map(|&l| st.values(&mut rng, l * row)).collect();
        let values: Vec<Vec<f32>> = lens.iter().map(|&l| st.values(&mut rng, l * row)).collect();
        let queries: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| st.values(&mut rng, s.new * h * d))
            .collect();

        // The cached context.
        let (mut ck, mut cv, mut cslots) = (Vec::new(), Vec::new(), Vec::new());
        for (s, seq) in seqs.iter().enumerate() {
            for p in 0..seq.context {
                let (k, v) = (&keys[s][p * row..][..row], &values[s][p * row..][..row]);
                let slot = slot_of(&tables[s], b, p);
                ck.extend_from_slice(k);
                cv.extend_from_slice(v);
                cslots.push(slot);
                model.store(slot, k, v);
            }
        }
        let n_ctx = cslots.len();
        let with_context = model.clone();

        // Metadata, then padding.
        let mut builder = MetadataBuilder::new(b);
        for (s, seq) in seqs.iter().enumerate() {
            builder.push(if seq.decode {
                SequenceDesc::decode(seq.context, &tables[s])
            } else {
                SequenceDesc::prompt(seq.context, seq.new, &tables[s])
            });
        }
        let mut md = ok(builder.build(), "MetadataBuilder::build")?;
        let (mut nq, mut nk, mut nv, mut slots) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (s, seq) in seqs.iter().enumerate() {
            nq.extend_from_slice(&queries[s]);
            for t in 0..seq.new {
                let p = seq.context + t;
                nk.extend_from_slice(&keys[s][p * row..][..row]);
                nv.extend_from_slice(&values[s][p * row..][..row]);
                slots.push(slot_of(&tables[s], b, p));
            }
        }
        prop_assert_eq!(&md.slot_mapping, &slots, "builder slot_mapping");
        let mut tok = 0;
        for (s, seq) in seqs.iter().enumerate() {
            for t in 0..seq.new {
                if seq.pad[t] {
                    md.slot_mapping[tok] = -1;
                } else {
                    let p = seq.context + t;
                    model.store(
                        slots[tok],
                        &keys[s][p * row..][..row],
                        &values[s][p * row..][..row],
                    );
                }
                tok += 1;
            }
        }
        let num_tokens = tok;
        Ok(DecoderPaged {
            call: Call {
                config,
                query: tensor(dtype, &[num_tokens, h, d], &nq),
                kv: Some((
                    tensor(dtype, &[num_tokens, hkv, d], &nk),
                    tensor(dtype, &[num_tokens, hkv, d], &nv),
                )),
                metadata: md,
                scales,
            },
            lens,
            keys,
            values,
            queries,
            context_k: tensor(dtype, &[n_ctx, hkv, d], &ck),
            context_v: tensor(dtype, &[n_ctx, hkv, d], &cv),
            context_slots: cslots,
            poisoned,
            with_context,
            after: model,
        })
    }

    /// A cache in `layout`: NaN poison, then the context written with `KvCache::write`;
    /// checked byte for byte against the model.
    pub fn cache(&self, layout: CacheLayout) -> Result<KvCache, TestCaseError> {
        let mut cache = self.poisoned.build(layout);
        ok(
            cache.write(
                &self.context_k,
                &self.context_v,
                &self.context_slots,
                self.call.scales,
            ),
            "KvCache::write of the context",
        )?;
        self.with_context
            .check(&cache, "after writing the context")?;
        Ok(cache)
    }
}

// ---------------------------------------------------------------------------------------------
// Self-attention without a cache: decoder (fresh prompts only), encoder, encoder-only.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct DecoderNoCacheCase {
    pub settings: Settings,
    pub prompts: Vec<usize>,
    /// Decodes of a 1-token sequence (no context).
    pub decodes: usize,
}

pub fn decoder_no_cache_case() -> impl Strategy<Value = DecoderNoCacheCase> {
    decoder_no_cache_case_in(settings(true), prop::collection::vec(1..=10usize, 0..=4))
}

pub fn decoder_no_cache_case_in(
    settings: impl Strategy<Value = Settings>,
    prompts: impl Strategy<Value = Vec<usize>>,
) -> impl Strategy<Value = DecoderNoCacheCase> {
    (settings, prompts, 0..=2usize).prop_map(|(settings, prompts, decodes)| DecoderNoCacheCase {
        settings,
        prompts,
        decodes,
    })
}

#[derive(Debug, Clone)]
pub struct EncoderCase {
    pub settings: Settings,
    pub attn_type: AttnType,
    pub lens: Vec<usize>,
}

pub fn encoder_case() -> impl Strategy<Value = EncoderCase> {
    encoder_case_in(
        settings(false),
        prop::collection::vec(prop_oneof![1 => Just(0usize), 4 => 1..=10usize], 1..=4),
    )
}

pub fn encoder_case_in(
    settings: impl Strategy<Value = Settings>,
    lens: impl Strategy<Value = Vec<usize>>,
) -> impl Strategy<Value = EncoderCase> {
    (
        settings,
        prop_oneof![Just(AttnType::Encoder), Just(AttnType::EncoderOnly)],
        lens,
    )
        .prop_map(|(settings, attn_type, lens)| EncoderCase {
            settings,
            attn_type,
            lens,
        })
}

/// Self-attention without a cache, built: each sequence's new tokens are all its keys.
pub struct UncachedSelf {
    pub call: Call,
    /// Tokens per sequence (prompts, then 1 per decode).
    pub lens: Vec<usize>,
    /// `[T, H, D]` queries, `[T, Hkv, D]` keys and values.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl UncachedSelf {
    pub fn build(
        st: &Settings,
        attn_type: AttnType,
        lens: &[usize],
        decodes: usize,
    ) -> Result<Self, TestCaseError> {
        let mut rng = st.rng();
        let (h, hkv, d, dtype) = (st.num_heads(), st.num_kv_heads, st.head_size, st.dtype);
        let row = hkv * d;
        let config = st.config(attn_type);
        let mut all_lens = lens.to_vec();
        all_lens.resize(lens.len() + decodes, 1);
        // From the parts, not `MetadataBuilder`: the encoder suites hold empty sequences on
        // purpose (the backends must handle them), which the builder refuses as a scheduler's
        // mistake. Prompts, then decodes of one token and no context; no cache, no slots.
        let mut query_start_loc = vec![0i32];
        for &n in &all_lens {
            query_start_loc.push(query_start_loc[query_start_loc.len() - 1] + n as i32);
        }
        let num_tokens: usize = all_lens.iter().sum();
        let md = ok(
            AttentionMetadata::from_parts(
                lens.len(),
                query_start_loc,
                all_lens.iter().map(|&n| n as i32).collect(),
                vec![-1; num_tokens],
                BlockTables::from_rows(&vec![[0; 0]; all_lens.len()]),
                None,
            ),
            "AttentionMetadata::from_parts",
        )?;
        let q = st.values(&mut rng, num_tokens * h * d);
        let k = st.values(&mut rng, num_tokens * row);
        let v = st.values(&mut rng, num_tokens * row);
        Ok(UncachedSelf {
            call: Call {
                config,
                query: tensor(dtype, &[num_tokens, h, d], &q),
                kv: Some((
                    tensor(dtype, &[num_tokens, hkv, d], &k),
                    tensor(dtype, &[num_tokens, hkv, d], &v),
                )),
                metadata: md,
                // Scales are only valid (and random) with an fp8 cache dtype; with no cache
                // they change nothing.
                scales: st.kv_scales(),
            },
            lens: all_lens,
            q,
            k,
            v,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Encoder-decoder (cross attention).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
pub enum Next {
    Decode,
    Chunk(usize),
}

#[derive(Debug, Clone)]
pub struct CrossSeq {
    pub encoder_len: usize,
    /// Decoder tokens before the first call (only their count matters: query positions).
    pub decoder_context: usize,
    pub first_len: usize,
    pub then: Next,
    pub extra_blocks: usize,
}

#[derive(Debug, Clone)]
pub struct CrossCase {
    pub settings: Settings,
    pub seqs: Vec<CrossSeq>,
    pub spare_blocks: usize,
    /// Whether the metadata also carries decoder block tables (the self-attention cache's, with
    /// blocks that alias the cross cache's range): cross attention must ignore them.
    pub decoder_tables: bool,
}

pub fn cross_seq() -> impl Strategy<Value = CrossSeq> {
    cross_seq_in(
        prop_oneof![1 => Just(0usize), 5 => 1..=10usize].boxed(),
        prop_oneof![Just(0usize), 1..=4usize].boxed(),
        1..=5,
        1..=4,
    )
}

/// A cross-attention sequence: `first_len` decoder tokens in the call that writes the cross
/// cache, then a decode or a chunk of `chunk` tokens that reads it.
pub fn cross_seq_in(
    encoder_len: BoxedStrategy<usize>,
    decoder_context: BoxedStrategy<usize>,
    first_len: RangeInclusive<usize>,
    chunk: RangeInclusive<usize>,
) -> impl Strategy<Value = CrossSeq> {
    (
        encoder_len,
        decoder_context,
        first_len,
        prop_oneof![Just(Next::Decode), chunk.prop_map(Next::Chunk)],
        0..=2usize,
    )
        .prop_map(
            |(encoder_len, decoder_context, first_len, then, extra_blocks)| CrossSeq {
                encoder_len,
                decoder_context,
                first_len,
                then,
                extra_blocks,
            },
        )
}

pub fn cross_case() -> impl Strategy<Value = CrossCase> {
    cross_case_in(settings(false), prop::collection::vec(cross_seq(), 1..=3))
}

pub fn cross_case_in(
    settings: impl Strategy<Value = Settings>,
    seqs: impl Strategy<Value = Vec<CrossSeq>>,
) -> impl Strategy<Value = CrossCase> {
    (settings, seqs, 0..=3usize, any::<bool>()).prop_map(
        |(settings, seqs, spare_blocks, decoder_tables)| CrossCase {
            settings,
            seqs,
            spare_blocks,
            decoder_tables,
        },
    )
}

/// One decoder step of a cross-attention call: sequence `s`, `context` decoder tokens before,
/// `new` query tokens.
#[derive(Debug, Clone)]
pub struct CrossStep {
    pub s: usize,
    pub context: usize,
    pub new: usize,
    pub decode: bool,
}

/// A cross-attention case built: call 1 (decoder prompts; carries the encoder K/V and writes
/// the cross cache), call 2 (no key/value; decoder chunks first, then decodes, reading the
/// cross cache).
pub struct CrossPaged {
    pub call1: Call,
    pub call2: Call,
    pub enc_lens: Vec<usize>,
    /// Per sequence: encoder K/V `[encoder_len, Hkv, D]`.
    pub enc_k: Vec<Vec<f32>>,
    pub enc_v: Vec<Vec<f32>>,
    /// Per sequence: the queries of call 1 and of call 2.
    pub q1: Vec<Vec<f32>>,
    pub q2: Vec<Vec<f32>>,
    /// The steps of each call, in batch order.
    pub steps1: Vec<CrossStep>,
    pub steps2: Vec<CrossStep>,
    /// The cross cache: poison only, then after call 1 (call 2 writes nothing).
    pub poisoned: CacheModel,
    pub after: CacheModel,
}

impl CrossPaged {
    pub fn build(case: &CrossCase) -> Result<Self, TestCaseError> {
        let st = &case.settings;
        let mut rng = st.rng();
        let (h, hkv, d, b, dtype) = (
            st.num_heads(),
            st.num_kv_heads,
            st.head_size,
            st.block_size,
            st.dtype,
        );
        let row = hkv * d;
        let config = st.config(AttnType::EncoderDecoder);
        let seqs = &case.seqs;
        let enc_lens: Vec<usize> = seqs.iter().map(|s| s.encoder_len).collect();
        let extra: Vec<usize> = seqs.iter().map(|s| s.extra_blocks).collect();
        let (num_blocks, cross_tables) =
            allocate(&mut rng, b, &enc_lens, &extra, case.spare_blocks);
        let spec = st.spec(num_blocks);
        let scales = st.kv_scales();
        let poisoned = CacheModel::poisoned(spec, scales, &mut rng);
        let mut model = poisoned.clone();

        let final_len = |s: &CrossSeq| {
            s.decoder_context
                + s.first_len
                + match s.then {
                    Next::Decode => 1,
                    Next::Chunk(n) => n,
                }
        };
        let decoder_tables: Vec<Vec<i32>> = seqs
            .iter()
            .map(|s| {
                if case.decoder_tables {
                    (0..final_len(s).div_ceil(b))
                        .map(|_| rng.random_range(0..num_blocks as i32))
                        .collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let enc_k: Vec<Vec<f32>> = enc_lens
            .iter()
            .map(|&l| st.values(&mut rng, l * row))
            .collect();
        let enc_v: Vec<Vec<f32>> = enc_lens
            .iter()
            .map(|&l| st.values(&mut rng, l * row))
            .collect();

        // Call 1: decoder prompts with the encoder K/V.
        let q1: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| st.values(&mut rng, s.first_len * h * d))
            .collect();
        let mut builder = MetadataBuilder::new(b);
        builder.write_cross_kv(true);
        for (s, seq) in seqs.iter().enumerate() {
            builder.push(
                SequenceDesc::prompt(seq.decoder_context, seq.first_len, &decoder_tables[s])
                    .with_encoder(seq.encoder_len, &cross_tables[s]),
            );
        }
        let md1 = ok(builder.build(), "MetadataBuilder::build (call 1)")?;
        let (mut ek, mut ev, mut cross_slots) = (Vec::new(), Vec::new(), Vec::new());
        for (s, &l) in enc_lens.iter().enumerate() {
            for p in 0..l {
                let (k, v) = (&enc_k[s][p * row..][..row], &enc_v[s][p * row..][..row]);
                ek.extend_from_slice(k);
                ev.extend_from_slice(v);
                let slot = slot_of(&cross_tables[s], b, p);
                cross_slots.push(slot);
                model.store(slot, k, v);
            }
        }
        prop_assert_eq!(
            &md1.encoder.as_ref().unwrap().cross_slot_mapping,
            &cross_slots,
            "builder cross_slot_mapping"
        );
        let num_enc = cross_slots.len();
        let t1: usize = seqs.iter().map(|s| s.first_len).sum();
        let steps1: Vec<CrossStep> = seqs
            .iter()
            .enumerate()
            .map(|(s, seq)| CrossStep {
                s,
                context: seq.decoder_context,
                new: seq.first_len,
                decode: false,
            })
            .collect();
        let call1 = Call {
            config: config.clone(),
            query: tensor(dtype, &[t1, h, d], &q1.concat()),
            kv: Some((
                tensor(dtype, &[num_enc, hkv, d], &ek),
                tensor(dtype, &[num_enc, hkv, d], &ev),
            )),
            metadata: md1,
            scales,
        };

        // Call 2: chunks first, then decodes.
        let mut steps2: Vec<CrossStep> = Vec::new();
        for want_decode in [false, true] {
            for (s, seq) in seqs.iter().enumerate() {
                let (new, decode) = match seq.then {
                    Next::Decode => (1, true),
                    Next::Chunk(n) => (n, false),
                };
                if decode == want_decode {
                    steps2.push(CrossStep {
                        s,
                        context: seq.decoder_context + seq.first_len,
                        new,
                        decode,
                    });
                }
            }
        }
        let mut q2: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        let mut builder = MetadataBuilder::new(b);
        for step in &steps2 {
            q2[step.s] = st.values(&mut rng, step.new * h * d);
            let desc = if step.decode {
                SequenceDesc::decode(step.context, &decoder_tables[step.s])
            } else {
                SequenceDesc::prompt(step.context, step.new, &decoder_tables[step.s])
            };
            builder.push(desc.with_encoder(enc_lens[step.s], &cross_tables[step.s]));
        }
        let md2 = ok(builder.build(), "MetadataBuilder::build (call 2)")?;
        let t2: usize = steps2.iter().map(|s| s.new).sum();
        let q_all: Vec<f32> = steps2.iter().flat_map(|st| q2[st.s].clone()).collect();
        let call2 = Call {
            config,
            query: tensor(dtype, &[t2, h, d], &q_all),
            kv: None,
            metadata: md2,
            scales,
        };
        Ok(CrossPaged {
            call1,
            call2,
            enc_lens,
            enc_k,
            enc_v,
            q1,
            q2,
            steps1,
            steps2,
            poisoned,
            after: model,
        })
    }
}

#[derive(Debug, Clone)]
pub struct CrossNoCacheCase {
    pub settings: Settings,
    /// (encoder_len, decoder context, query_len); decodes have query_len 1 and come last.
    pub prefills: Vec<(usize, usize, usize)>,
    pub decodes: Vec<(usize, usize)>,
}

pub fn cross_no_cache_case() -> impl Strategy<Value = CrossNoCacheCase> {
    let enc = prop_oneof![1 => Just(0usize), 5 => 1..=10usize];
    cross_no_cache_case_in(
        settings(false),
        prop::collection::vec((enc.clone(), 0..=6usize, 1..=5usize), 0..=3),
        prop::collection::vec((enc, 0..=6usize), 0..=3),
    )
}

pub fn cross_no_cache_case_in(
    settings: impl Strategy<Value = Settings>,
    prefills: impl Strategy<Value = Vec<(usize, usize, usize)>>,
    decodes: impl Strategy<Value = Vec<(usize, usize)>>,
) -> impl Strategy<Value = CrossNoCacheCase> {
    (settings, prefills, decodes)
        // At least one sequence: the builder derives the encoder metadata from them.
        .prop_filter("an empty batch", |(_, p, d)| {
            !(p.is_empty() && d.is_empty())
        })
        .prop_map(|(settings, prefills, decodes)| CrossNoCacheCase {
            settings,
            prefills,
            decodes,
        })
}

/// Cross attention without a cache, built: encoder K/V from the inputs.
pub struct CrossNoCache {
    pub call: Call,
    pub steps: Vec<CrossStep>,
    pub enc_lens: Vec<usize>,
    /// Per sequence: queries, encoder keys and values.
    pub queries: Vec<Vec<f32>>,
    pub enc_k: Vec<Vec<f32>>,
    pub enc_v: Vec<Vec<f32>>,
}

impl CrossNoCache {
    pub fn build(case: &CrossNoCacheCase) -> Result<Self, TestCaseError> {
        let st = &case.settings;
        let mut rng = st.rng();
        let (h, hkv, d, dtype) = (st.num_heads(), st.num_kv_heads, st.head_size, st.dtype);
        let row = hkv * d;
        let config = st.config(AttnType::EncoderDecoder);
        let mut steps = Vec::new();
        let mut enc_lens = Vec::new();
        let mut builder = MetadataBuilder::new(st.block_size);
        for &(e, context, new) in &case.prefills {
            builder.push(SequenceDesc::prompt(context, new, &[]).with_encoder(e, &[]));
            steps.push(CrossStep {
                s: steps.len(),
                context,
                new,
                decode: false,
            });
            enc_lens.push(e);
        }
        for &(e, context) in &case.decodes {
            builder.push(SequenceDesc::decode(context, &[]).with_encoder(e, &[]));
            steps.push(CrossStep {
                s: steps.len(),
                context,
                new: 1,
                decode: true,
            });
            enc_lens.push(e);
        }
        let md = ok(builder.build(), "MetadataBuilder::build")?;
        let queries: Vec<Vec<f32>> = steps
            .iter()
            .map(|s| st.values(&mut rng, s.new * h * d))
            .collect();
        let enc_k: Vec<Vec<f32>> = enc_lens
            .iter()
            .map(|&l| st.values(&mut rng, l * row))
            .collect();
        let enc_v: Vec<Vec<f32>> = enc_lens
            .iter()
            .map(|&l| st.values(&mut rng, l * row))
            .collect();
        let num_tokens: usize = steps.iter().map(|s| s.new).sum();
        let num_enc: usize = enc_lens.iter().sum();
        Ok(CrossNoCache {
            call: Call {
                config,
                query: tensor(dtype, &[num_tokens, h, d], &queries.concat()),
                kv: Some((
                    tensor(dtype, &[num_enc, hkv, d], &enc_k.concat()),
                    tensor(dtype, &[num_enc, hkv, d], &enc_v.concat()),
                )),
                metadata: md,
                scales: st.kv_scales(),
            },
            steps,
            enc_lens,
            queries,
            enc_k,
            enc_v,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed edge cases (empty encoder sides, queries without keys), run by both suites.
// ---------------------------------------------------------------------------------------------

/// Settings of the fixed cases: two kv heads of two queries each, blocks of 4, Bloom ALiBi,
/// fp8 scales 0.5 / 0.25.
pub fn fixed_settings(dtype: DType, kv_cache_dtype: KvCacheDtype, head_size: usize) -> Settings {
    Settings {
        dtype,
        kv_cache_dtype,
        num_kv_heads: 2,
        group: 2,
        head_size,
        block_size: 4,
        alibi: Alibi::Bloom,
        sliding_window: None,
        soft_cap: None,
        scale: None,
        k_scale: 0.5,
        v_scale: 0.25,
        amplitude: 1.0,
        specials: 0.0,
        seed: 7,
    }
}

/// Cross attention where some sequences have no encoder tokens (their queries must get exact
/// zeros), at prefill and at decode: with a cross cache, and without one.
pub fn empty_encoder_cases(st: &Settings) -> (CrossCase, CrossNoCacheCase) {
    let paged = CrossCase {
        settings: st.clone(),
        seqs: vec![
            CrossSeq {
                encoder_len: 0,
                decoder_context: 0,
                first_len: 3,
                then: Next::Chunk(2),
                extra_blocks: 1,
            },
            CrossSeq {
                encoder_len: 5,
                decoder_context: 1,
                first_len: 2,
                then: Next::Decode,
                extra_blocks: 0,
            },
            CrossSeq {
                encoder_len: 0,
                decoder_context: 2,
                first_len: 1,
                then: Next::Decode,
                extra_blocks: 0,
            },
        ],
        spare_blocks: 1,
        decoder_tables: false,
    };
    let no_cache = CrossNoCacheCase {
        settings: st.clone(),
        prefills: vec![(0, 0, 3), (4, 0, 2)],
        decodes: vec![(0, 5), (2, 1)],
    };
    (paged, no_cache)
}

/// A 3-token prompt and a decode, both with an empty encoder side (block size 4).
pub fn all_empty_encoder_metadata() -> AttentionMetadata {
    MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(0, 3, &[]).with_encoder(0, &[]))
        .push(SequenceDesc::decode(3, &[]).with_encoder(0, &[]))
        .build()
        .unwrap()
}

/// Decoder sequences whose new tokens have slot -1 (not written, still keys of their own
/// call): all of a prompt's, some of them, and a decode's only key.
pub fn unwritten_keys_case(st: &Settings) -> DecoderCase {
    let seq = |context, pad: Vec<bool>, decode| DecoderSeq {
        context,
        new: pad.len(),
        decode,
        pad,
        extra_blocks: 1,
    };
    DecoderCase {
        settings: st.clone(),
        seqs: vec![
            // Every new token unwritten, no context: every key comes from the inputs.
            seq(0, vec![true, true, true], false),
            // Written and unwritten tokens mixed.
            seq(0, vec![true, false, false, true, false], false),
            // A decode whose only key is unwritten.
            seq(0, vec![true], true),
        ],
        spare_blocks: 2,
    }
}

/// The largest relative rounding of a normal value stored as fp8 (e5m2's two mantissa bits:
/// half a unit, 2^-3).
pub const FP8_ROUNDING: f32 = 0.125;

/// A 3-token prompt (block 2) and a decode (block 0) whose new tokens all have slot -1: every
/// key comes from the call's inputs, and nothing is written.
pub fn all_unwritten_metadata() -> AttentionMetadata {
    let mut md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(0, 3, &[2]))
        .push(SequenceDesc::decode(0, &[0]))
        .build()
        .unwrap();
    md.slot_mapping.fill(-1);
    md
}

/// A sliding-window prompt as vLLM's model runner gives it (v0.6, `compute_slot_mapping`):
/// window 32, 100 tokens, blocks of 16 reused in a ring of two (physical blocks 1 and 3, the
/// table `[1, 3, 1, 3, 1, 3, 1]`); the 68 tokens older than the window get slot -1 (they must
/// not overwrite the ring), the last 32 their ring slots. Every token is still a key of the
/// prompt's queries. `st`'s window and block size are replaced.
pub fn vllm_windowed_prompt(st: &Settings) -> VllmPrompt {
    let st = Settings {
        sliding_window: Some(32),
        block_size: 16,
        ..st.clone()
    };
    let (len, window, b) = (100usize, 32usize, 16usize);
    let (h, hkv, d) = (st.num_heads(), st.num_kv_heads, st.head_size);
    let mut rng = st.rng();
    let table: Vec<i32> = (0..len.div_ceil(b)).map(|i| [1, 3][i % 2]).collect();
    let poisoned = CacheModel::poisoned(st.spec(4), st.kv_scales(), &mut rng);
    let mut after = poisoned.clone();
    let keys = st.values(&mut rng, len * hkv * d);
    let values = st.values(&mut rng, len * hkv * d);
    let queries = st.values(&mut rng, len * h * d);
    // vLLM: start_idx = max(0, query_len - sliding_window); slot -1 before it.
    let slots: Vec<i64> = (0..len)
        .map(|p| {
            if p < len - window {
                -1
            } else {
                slot_of(&table, b, p)
            }
        })
        .collect();
    for (p, &slot) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let row = hkv * d;
        after.store(slot, &keys[p * row..][..row], &values[p * row..][..row]);
    }
    let metadata = AttentionMetadata::from_parts(
        1,
        vec![0, len as i32],
        vec![len as i32],
        slots,
        BlockTables::from_rows(&[table]),
        None,
    )
    .expect("vLLM's metadata is valid");
    let call = Call {
        config: st.config(AttnType::Decoder),
        query: tensor(st.dtype, &[len, h, d], &queries),
        kv: Some((
            tensor(st.dtype, &[len, hkv, d], &keys),
            tensor(st.dtype, &[len, hkv, d], &values),
        )),
        metadata,
        scales: st.kv_scales(),
    };
    VllmPrompt {
        settings: st,
        call,
        poisoned,
        after,
    }
}

/// [`vllm_windowed_prompt`]'s call and the cache before and after it.
pub struct VllmPrompt {
    /// The settings, with the window and block size of the case.
    pub settings: Settings,
    pub call: Call,
    /// The cache before the call (poison only) and after it (the 32 written tokens).
    pub poisoned: CacheModel,
    pub after: CacheModel,
}

// ---------------------------------------------------------------------------------------------
// The GPU.
// ---------------------------------------------------------------------------------------------

/// Prints one line that `cargo test` does not capture (it captures `eprintln!`).
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let line = format!("{test}: SKIPPED ({reason})\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The backend on GPU 0, for the tests that need one. Those are `#[ignore]`d, so that a run
/// without a GPU lists them as ignored instead of passing them (`tools/gpu-suite.sh` runs them
/// with `--include-ignored`); run where no GPU is usable, or where the backend does not start
/// (no NVRTC, a driver error), they fail saying why.
#[cfg(feature = "cuda")]
pub fn gpu() -> pagedattn::cuda::Cuda {
    if let Err(e) = pagedattn::cuda::info() {
        panic!("this test needs a usable CUDA GPU: {e}");
    }
    pagedattn::cuda::Cuda::new_default()
        .unwrap_or_else(|e| panic!("the GPU is usable but the backend does not start: {e}"))
}

/// A fresh seed (or `PAGEDATTN_TEST_SEED`), for a test to print when it fails.
pub fn seed() -> u64 {
    std::env::var("PAGEDATTN_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}
