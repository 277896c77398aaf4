//! The `reference` backend against a dense, non-paged attention written here, in f64, straight
//! from DESIGN.md section 2 (and independently of `src/reference.rs` and `src/semantics.rs`).
//!
//! Every property builds a random batch, runs `reference` on it through the public API (paged
//! cache with shuffled, non-contiguous blocks; unused slots and the output poisoned with NaN) and
//! compares the output, and the cache after the call, with what the dense side computes from
//! the logical per-sequence K/V arrays. Seeds are fresh every run (proptest's default); a
//! failing case prints its `settings.seed`, which regenerates its data.
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

use half::{bf16, f16};
use pagedattn::{
    alibi_slopes_bloom, registry, AttentionConfig, AttnType, DType, Fp8Format, KvCache,
    KvCacheDtype, KvCacheSpec, KvPair, KvScales, MetadataBuilder, SequenceDesc, Storage, Tensor,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

type TestResult = Result<(), TestCaseError>;

// ---------------------------------------------------------------------------------------------
// The dense attention of DESIGN.md section 2, in f64.
// ---------------------------------------------------------------------------------------------

/// One key/value token as an attention kernel reads it (`[Hkv * D]` each), or `None` when the
/// position is not a key (padding).
type KvRow = Option<(Vec<f64>, Vec<f64>)>;

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
                let Some((k, v)) = row else { continue };
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

// ---------------------------------------------------------------------------------------------
// Layer settings shared by all properties.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Alibi {
    Off,
    Random,
    Bloom,
}

#[derive(Debug, Clone)]
struct Settings {
    dtype: DType,
    kv_cache_dtype: KvCacheDtype,
    num_kv_heads: usize,
    group: usize,
    head_size: usize,
    block_size: usize,
    alibi: Alibi,
    sliding_window: Option<usize>,
    soft_cap: Option<f32>,
    scale: Option<f32>,
    /// k_scale / v_scale, used only with an fp8 cache dtype.
    k_scale: f32,
    v_scale: f32,
    /// Inputs are uniform in [-amplitude, amplitude].
    amplitude: f32,
    /// Seeds the data: values, block permutation, poison.
    seed: u64,
}

fn settings(allow_window: bool) -> impl Strategy<Value = Settings> {
    let dtype = prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)];
    let kv_cache_dtype = prop_oneof![
        2 => Just(KvCacheDtype::Auto),
        1 => Just(KvCacheDtype::Fp8E4m3),
        1 => Just(KvCacheDtype::Fp8E5m2),
    ];
    let geometry = (
        1..=3usize,
        1..=4usize,
        prop_oneof![5 => 1..=16usize, 1 => Just(64usize)],
        prop_oneof![3 => 1..=8usize, 1 => 9..=64usize],
    );
    let window = if allow_window {
        prop::option::weighted(0.3, 1..=12usize).boxed()
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
    );
    (dtype, kv_cache_dtype, geometry, features, data).prop_map(
        |(dtype, kv_cache_dtype, geometry, features, data)| Settings {
            dtype,
            kv_cache_dtype,
            num_kv_heads: geometry.0,
            group: geometry.1,
            head_size: geometry.2,
            block_size: geometry.3,
            alibi: features.0,
            sliding_window: features.1,
            soft_cap: features.2,
            scale: features.3,
            k_scale: data.0.exp2() as f32,
            v_scale: data.1.exp2() as f32,
            amplitude: data.2,
            seed: data.3,
        },
    )
}

impl Settings {
    fn num_heads(&self) -> usize {
        self.num_kv_heads * self.group
    }

    fn rng(&self) -> StdRng {
        StdRng::seed_from_u64(self.seed)
    }

    fn slopes(&self) -> Option<Vec<f32>> {
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

    fn kv_scales(&self) -> KvScales {
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => KvScales::default(),
            _ => KvScales {
                k_scale: self.k_scale,
                v_scale: self.v_scale,
            },
        }
    }

    fn config(&self, attn_type: AttnType) -> AttentionConfig {
        let mut b = AttentionConfig::builder(self.num_heads(), self.head_size)
            .num_kv_heads(self.num_kv_heads)
            .alibi_slopes(self.slopes())
            .sliding_window(self.sliding_window)
            .logits_soft_cap(self.soft_cap)
            .kv_cache_dtype(self.kv_cache_dtype)
            .attn_type(attn_type);
        if let Some(scale) = self.scale {
            b = b.scale(scale);
        }
        b.build().expect("generated configs are valid")
    }

    fn dense(&self, config: &AttentionConfig, causal: bool) -> Dense {
        Dense {
            num_heads: self.num_heads(),
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            // The parameter as the layer holds it (default 1/sqrt(D) rounded to f32).
            scale: config.scale() as f64,
            soft_cap: self.soft_cap.map(f64::from),
            slopes: self
                .slopes()
                .map(|s| s.into_iter().map(f64::from).collect()),
            window: if causal { self.sliding_window } else { None },
            causal,
        }
    }

    fn spec(&self, num_blocks: usize) -> KvCacheSpec {
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
fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::U8 => unreachable!(),
    }
}

/// `count` values uniform in [-amp, amp], already rounded to `dtype`.
fn random_values(rng: &mut StdRng, dtype: DType, count: usize, amp: f32) -> Vec<f32> {
    (0..count)
        .map(|_| round_to(dtype, rng.random_range(-amp..=amp)))
        .collect()
}

fn tensor(dtype: DType, shape: &[usize], values: &[f32]) -> Tensor {
    let t = Tensor::from_f32(dtype, shape, values).expect("tensor");
    // The values are representable: the tensor holds exactly them.
    assert_eq!(t.to_f32_vec(), values);
    t
}

fn widen(xs: &[f32]) -> Vec<f64> {
    xs.iter().map(|&x| x as f64).collect()
}

fn ok<T>(r: pagedattn::Result<T>, what: &str) -> Result<T, TestCaseError> {
    r.map_err(|e| TestCaseError::fail(format!("{what} failed: {e}")))
}

/// `slot = block * B + offset` of position `pos` through `table`.
fn slot_of(table: &[i32], block_size: usize, pos: usize) -> i64 {
    table[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64
}

/// Gives every sequence `ceil(len / B)` distinct blocks taken in order from a random
/// permutation of all blocks (so they are shuffled and non-contiguous), plus `extra[s]` table
/// entries past the end pointing at random blocks, which must never be read. Returns the number
/// of blocks and the tables.
fn allocate(
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

/// Checks the output elementwise against the dense result, with a tolerance for the one
/// rounding of f64 into the output dtype.
fn check_output(out: &Tensor, want: &[f64], num_heads: usize, head_size: usize) -> TestResult {
    let tol = match out.dtype() {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::U8 => unreachable!(),
    };
    let got = out.to_f32_vec();
    prop_assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        if !(g.is_finite() && (g - w).abs() <= tol * (w.abs() + 1e-3)) {
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
// A model of the paged cache: the canonical bytes it must hold.
// ---------------------------------------------------------------------------------------------

/// The expected canonical `[NB, B, Hkv, D]` key and value bytes of a cache: NaN poison
/// everywhere, then the stored value of every token written.
struct CacheModel {
    spec: KvCacheSpec,
    fp8: Option<Fp8Format>,
    scales: KvScales,
    key: Vec<u8>,
    value: Vec<u8>,
}

impl CacheModel {
    /// A cache full of NaNs: random quiet-NaN payloads for float caches, random NaN codes
    /// (e4m3: 0x7F / 0xFF; e5m2: exponent 11111 with a non-zero mantissa) for fp8.
    fn poisoned(spec: KvCacheSpec, scales: KvScales, rng: &mut StdRng) -> Self {
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
                        *[0x7Du8, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
                            .choose(&mut *rng)
                            .unwrap(),
                    ),
                    (None, DType::F32) => bytes
                        .extend(((r & 0x8000_0000) | 0x7FC0_0000 | (r & 0x3F_FFFF)).to_le_bytes()),
                    (None, DType::F16) => bytes.extend(
                        (((r >> 16) as u16 & 0x8000) | 0x7E00 | (r as u16 & 0x1FF)).to_le_bytes(),
                    ),
                    (None, DType::BF16) => bytes.extend(
                        (((r >> 16) as u16 & 0x8000) | 0x7FC0 | (r as u16 & 0x3F)).to_le_bytes(),
                    ),
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

    fn elem_size(&self) -> usize {
        if self.fp8.is_some() {
            1
        } else {
            self.spec.dtype.size_bytes()
        }
    }

    /// The stored bytes of input element `x` (already in the activation dtype).
    fn encode(&self, x: f32, scale: f32) -> Vec<u8> {
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
    fn read(&self, x: f32, scale: f32) -> f64 {
        match self.fp8 {
            Some(f) => f.decode(f.encode(x / scale)) as f64 * scale as f64,
            None => x as f64,
        }
    }

    /// The token row (`[Hkv * D]` keys and values) as read back from the cache.
    fn read_row(&self, k: &[f32], v: &[f32]) -> (Vec<f64>, Vec<f64>) {
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
    fn store(&mut self, slot: i64, k: &[f32], v: &[f32]) {
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
    fn build(&self, layout: pagedattn::CacheLayout) -> KvCache {
        let dt = self.spec.storage_dtype();
        KvCache::from_canonical(
            self.spec,
            layout,
            Storage::from_bytes(dt, &self.key).unwrap(),
            Storage::from_bytes(dt, &self.value).unwrap(),
        )
        .expect("cache from canonical buffers")
    }

    /// Every byte of the cache equals the model: written slots hold exactly the stored values,
    /// every other slot keeps its poison.
    fn check(&self, cache: &KvCache, when: &str) -> TestResult {
        let (k, v) = cache.to_canonical();
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

// ---------------------------------------------------------------------------------------------
// Decoder over the paged cache: chunked prefill / prefix caching, fresh prompts, decodes.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct DecoderSeq {
    context: usize,
    new: usize,
    decode: bool,
    /// Per new token: slot -1 (padding).
    pad: Vec<bool>,
    /// Table entries past the needed ones (never read).
    extra_blocks: usize,
}

fn prefill_seq() -> impl Strategy<Value = DecoderSeq> {
    (
        prop_oneof![Just(0usize), 1..=12usize],
        1..=8usize,
        0..=2usize,
    )
        .prop_flat_map(|(context, new, extra_blocks)| {
            prop::collection::vec(prop::bool::weighted(0.12), new).prop_map(move |pad| DecoderSeq {
                context,
                new,
                decode: false,
                pad,
                extra_blocks,
            })
        })
}

fn decode_seq() -> impl Strategy<Value = DecoderSeq> {
    (1..=20usize, prop::bool::weighted(0.08), 0..=2usize).prop_map(|(len, pad, extra_blocks)| {
        DecoderSeq {
            context: len - 1,
            new: 1,
            decode: true,
            pad: vec![pad],
            extra_blocks,
        }
    })
}

#[derive(Debug, Clone)]
struct DecoderCase {
    settings: Settings,
    /// Prefills first, then decodes.
    seqs: Vec<DecoderSeq>,
    spare_blocks: usize,
}

fn decoder_case() -> impl Strategy<Value = DecoderCase> {
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

fn run_decoder_paged(case: &DecoderCase) -> TestResult {
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
    let backend = registry::backend("reference").unwrap();
    let attention = ok(backend.attention(&config), "attention")?;

    let seqs = &case.seqs;
    let lens: Vec<usize> = seqs.iter().map(|s| s.context + s.new).collect();
    let extra: Vec<usize> = seqs.iter().map(|s| s.extra_blocks).collect();
    let (num_blocks, tables) = allocate(&mut rng, b, &lens, &extra, case.spare_blocks);
    let spec = st.spec(num_blocks);
    let layout = ok(backend.allocate_kv_cache(&spec), "allocate_kv_cache")?.layout();
    let scales = st.kv_scales();
    let mut model = CacheModel::poisoned(spec, scales, &mut rng);
    let mut cache = model.build(layout);

    // The logical sequences: K/V of every position, Q of the new tokens.
    let keys: Vec<Vec<f32>> = lens
        .iter()
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();
    let values: Vec<Vec<f32>> = lens
        .iter()
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();
    let queries: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| random_values(&mut rng, dtype, s.new * h * d, st.amplitude))
        .collect();

    // The cached context, written before the call through its own slot mapping.
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
    ok(
        cache.write(
            &tensor(dtype, &[n_ctx, hkv, d], &ck),
            &tensor(dtype, &[n_ctx, hkv, d], &cv),
            &cslots,
            scales,
        ),
        "KvCache::write of the context",
    )?;
    model.check(&cache, "after writing the context")?;

    // Metadata, then padding.
    let mut builder = MetadataBuilder::new(b);
    for (s, seq) in seqs.iter().enumerate() {
        builder.push(if seq.decode {
            SequenceDesc::decode(lens[s], tables[s].clone())
        } else {
            SequenceDesc::prompt(seq.context, seq.new, tables[s].clone())
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

    let q = tensor(dtype, &[num_tokens, h, d], &nq);
    let k = tensor(dtype, &[num_tokens, hkv, d], &nk);
    let v = tensor(dtype, &[num_tokens, hkv, d], &nv);
    let mut out = Tensor::zeros(dtype, &[num_tokens, h, d]);
    out.fill_nan();
    ok(
        attention.forward(
            &q,
            Some(KvPair { key: &k, value: &v }),
            Some(&mut cache),
            &md,
            &mut out,
            scales,
        ),
        "forward",
    )?;

    // Dense side.
    let dense = st.dense(&config, true);
    let mut want = vec![0.0; num_tokens * h * d];
    let mut tok = 0;
    for (s, seq) in seqs.iter().enumerate() {
        let rows: Vec<KvRow> = (0..lens[s])
            .map(|p| {
                let padded = p >= seq.context && seq.pad[p - seq.context];
                (!padded).then(|| {
                    model.read_row(&keys[s][p * row..][..row], &values[s][p * row..][..row])
                })
            })
            .collect();
        for t in 0..seq.new {
            let qrow = widen(&queries[s][t * h * d..][..h * d]);
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
// Decoder without a cache (fresh prompts only; keys are the inputs).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct DecoderNoCacheCase {
    settings: Settings,
    prompts: Vec<usize>,
    /// Decodes of a 1-token sequence (no context).
    decodes: usize,
}

fn decoder_no_cache_case() -> impl Strategy<Value = DecoderNoCacheCase> {
    (
        settings(true),
        prop::collection::vec(1..=10usize, 0..=4),
        0..=2usize,
    )
        .prop_map(|(settings, prompts, decodes)| DecoderNoCacheCase {
            settings,
            prompts,
            decodes,
        })
}

/// Self-attention without a cache: each sequence's new tokens are all its keys.
fn run_uncached_self(
    st: &Settings,
    attn_type: AttnType,
    lens: &[usize],
    decodes: usize,
) -> TestResult {
    let mut rng = st.rng();
    let (h, hkv, d, dtype) = (st.num_heads(), st.num_kv_heads, st.head_size, st.dtype);
    let row = hkv * d;
    let config = st.config(attn_type);
    let backend = registry::backend("reference").unwrap();
    let attention = ok(backend.attention(&config), "attention")?;
    let mut builder = MetadataBuilder::new(st.block_size);
    for &n in lens {
        builder.push(SequenceDesc::prompt(0, n, vec![]));
    }
    for _ in 0..decodes {
        builder.push(SequenceDesc::decode(1, vec![]));
    }
    let mut all_lens = lens.to_vec();
    all_lens.resize(lens.len() + decodes, 1);
    let md = ok(builder.build(), "MetadataBuilder::build")?;
    let num_tokens: usize = all_lens.iter().sum();
    let qv = random_values(&mut rng, dtype, num_tokens * h * d, st.amplitude);
    let kv = random_values(&mut rng, dtype, num_tokens * row, st.amplitude);
    let vv = random_values(&mut rng, dtype, num_tokens * row, st.amplitude);
    let q = tensor(dtype, &[num_tokens, h, d], &qv);
    let k = tensor(dtype, &[num_tokens, hkv, d], &kv);
    let v = tensor(dtype, &[num_tokens, hkv, d], &vv);
    let mut out = Tensor::zeros(dtype, &[num_tokens, h, d]);
    out.fill_nan();
    // Scales are only valid (and random) with an fp8 cache dtype; with no cache they change
    // nothing.
    ok(
        attention.forward(
            &q,
            Some(KvPair { key: &k, value: &v }),
            None,
            &md,
            &mut out,
            st.kv_scales(),
        ),
        "forward",
    )?;
    let dense = st.dense(&config, attn_type == AttnType::Decoder);
    let mut want = vec![0.0; num_tokens * h * d];
    let mut start = 0;
    for &n in &all_lens {
        let rows: Vec<KvRow> = (start..start + n)
            .map(|t| Some((widen(&kv[t * row..][..row]), widen(&vv[t * row..][..row]))))
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
// Encoder and encoder-only (bidirectional, no cache, zero-length sequences allowed).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct EncoderCase {
    settings: Settings,
    attn_type: AttnType,
    lens: Vec<usize>,
}

fn encoder_case() -> impl Strategy<Value = EncoderCase> {
    (
        settings(false),
        prop_oneof![Just(AttnType::Encoder), Just(AttnType::EncoderOnly)],
        prop::collection::vec(prop_oneof![1 => Just(0usize), 4 => 1..=10usize], 1..=4),
    )
        .prop_map(|(settings, attn_type, lens)| EncoderCase {
            settings,
            attn_type,
            lens,
        })
}

// ---------------------------------------------------------------------------------------------
// Encoder-decoder (cross attention).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Next {
    Decode,
    Chunk(usize),
}

#[derive(Debug, Clone)]
struct CrossSeq {
    encoder_len: usize,
    /// Decoder tokens before the first call (only their count matters: query positions).
    decoder_context: usize,
    first_len: usize,
    then: Next,
    extra_blocks: usize,
}

#[derive(Debug, Clone)]
struct CrossCase {
    settings: Settings,
    seqs: Vec<CrossSeq>,
    spare_blocks: usize,
    /// Whether the metadata also carries decoder block tables (the self-attention cache's, with
    /// blocks that alias the cross cache's range): cross attention must ignore them.
    decoder_tables: bool,
}

fn cross_seq() -> impl Strategy<Value = CrossSeq> {
    (
        prop_oneof![1 => Just(0usize), 5 => 1..=10usize],
        prop_oneof![Just(0usize), 1..=4usize],
        1..=5usize,
        prop_oneof![Just(Next::Decode), (1..=4usize).prop_map(Next::Chunk)],
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

fn cross_case() -> impl Strategy<Value = CrossCase> {
    (
        settings(false),
        prop::collection::vec(cross_seq(), 1..=3),
        0..=3usize,
        any::<bool>(),
    )
        .prop_map(|(settings, seqs, spare_blocks, decoder_tables)| CrossCase {
            settings,
            seqs,
            spare_blocks,
            decoder_tables,
        })
}

/// One decoder step of a cross-attention call: sequence `s`, `context` decoder tokens before,
/// `new` query tokens.
struct CrossStep {
    s: usize,
    context: usize,
    new: usize,
    decode: bool,
}

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
    let backend = registry::backend("reference").unwrap();
    let attention = ok(backend.attention(&config), "attention")?;
    let seqs = &case.seqs;
    let enc_lens: Vec<usize> = seqs.iter().map(|s| s.encoder_len).collect();
    let extra: Vec<usize> = seqs.iter().map(|s| s.extra_blocks).collect();
    let (num_blocks, cross_tables) = allocate(&mut rng, b, &enc_lens, &extra, case.spare_blocks);
    let spec = st.spec(num_blocks);
    let layout = ok(backend.allocate_kv_cache(&spec), "allocate_kv_cache")?.layout();
    let scales = st.kv_scales();
    let mut model = CacheModel::poisoned(spec, scales, &mut rng);
    let mut cache = model.build(layout);

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
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();
    let enc_v: Vec<Vec<f32>> = enc_lens
        .iter()
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();

    // Call 1: decoder prompts; the call carries the encoder K/V and writes the cross cache.
    let q1: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| random_values(&mut rng, dtype, s.first_len * h * d, st.amplitude))
        .collect();
    let mut builder = MetadataBuilder::new(b);
    builder.write_cross_kv(true);
    for (s, seq) in seqs.iter().enumerate() {
        builder.push(
            SequenceDesc::prompt(
                seq.decoder_context,
                seq.first_len,
                decoder_tables[s].clone(),
            )
            .with_encoder(seq.encoder_len, cross_tables[s].clone()),
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
    let q = tensor(dtype, &[t1, h, d], &q1.concat());
    let k = tensor(dtype, &[num_enc, hkv, d], &ek);
    let v = tensor(dtype, &[num_enc, hkv, d], &ev);
    let mut out = Tensor::zeros(dtype, &[t1, h, d]);
    out.fill_nan();
    ok(
        attention.forward(
            &q,
            Some(KvPair { key: &k, value: &v }),
            Some(&mut cache),
            &md1,
            &mut out,
            scales,
        ),
        "forward (call 1, writes the cross cache)",
    )?;
    let enc_rows: Vec<Vec<KvRow>> = (0..seqs.len())
        .map(|s| {
            (0..enc_lens[s])
                .map(|p| {
                    Some(model.read_row(&enc_k[s][p * row..][..row], &enc_v[s][p * row..][..row]))
                })
                .collect()
        })
        .collect();
    let dense = st.dense(&config, false);
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
    check_output(&out, &dense_cross(&dense, &steps1, &q1, &enc_rows), h, d)
        .map_err(|e| TestCaseError::fail(format!("call 1: {e}")))?;
    model.check(&cache, "after call 1")?;

    // Call 2: no key/value; decoder chunks first, then decodes, read the cross cache.
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
        q2[step.s] = random_values(&mut rng, dtype, step.new * h * d, st.amplitude);
        let desc = if step.decode {
            SequenceDesc::decode(step.context + 1, decoder_tables[step.s].clone())
        } else {
            SequenceDesc::prompt(step.context, step.new, decoder_tables[step.s].clone())
        };
        builder.push(desc.with_encoder(enc_lens[step.s], cross_tables[step.s].clone()));
    }
    let md2 = ok(builder.build(), "MetadataBuilder::build (call 2)")?;
    let t2: usize = steps2.iter().map(|s| s.new).sum();
    let q_all: Vec<f32> = steps2.iter().flat_map(|st| q2[st.s].clone()).collect();
    let q = tensor(dtype, &[t2, h, d], &q_all);
    let mut out = Tensor::zeros(dtype, &[t2, h, d]);
    out.fill_nan();
    ok(
        attention.forward(&q, None, Some(&mut cache), &md2, &mut out, scales),
        "forward (call 2, reads the cross cache)",
    )?;
    check_output(&out, &dense_cross(&dense, &steps2, &q2, &enc_rows), h, d)
        .map_err(|e| TestCaseError::fail(format!("call 2: {e}")))?;
    model.check(&cache, "after call 2")
}

#[derive(Debug, Clone)]
struct CrossNoCacheCase {
    settings: Settings,
    /// (encoder_len, decoder context, query_len); decodes have query_len 1 and come last.
    prefills: Vec<(usize, usize, usize)>,
    decodes: Vec<(usize, usize)>,
}

fn cross_no_cache_case() -> impl Strategy<Value = CrossNoCacheCase> {
    let enc = prop_oneof![1 => Just(0usize), 5 => 1..=10usize];
    (
        settings(false),
        prop::collection::vec((enc.clone(), 0..=6usize, 1..=5usize), 0..=3),
        prop::collection::vec((enc, 0..=6usize), 0..=3),
    )
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

fn run_cross_no_cache(case: &CrossNoCacheCase) -> TestResult {
    let st = &case.settings;
    let mut rng = st.rng();
    let (h, hkv, d, dtype) = (st.num_heads(), st.num_kv_heads, st.head_size, st.dtype);
    let row = hkv * d;
    let config = st.config(AttnType::EncoderDecoder);
    let backend = registry::backend("reference").unwrap();
    let attention = ok(backend.attention(&config), "attention")?;
    let mut steps = Vec::new();
    let mut enc_lens = Vec::new();
    let mut builder = MetadataBuilder::new(st.block_size);
    for &(e, context, new) in &case.prefills {
        builder.push(SequenceDesc::prompt(context, new, vec![]).with_encoder(e, vec![]));
        steps.push(CrossStep {
            s: steps.len(),
            context,
            new,
            decode: false,
        });
        enc_lens.push(e);
    }
    for &(e, context) in &case.decodes {
        builder.push(SequenceDesc::decode(context + 1, vec![]).with_encoder(e, vec![]));
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
        .map(|s| random_values(&mut rng, dtype, s.new * h * d, st.amplitude))
        .collect();
    let enc_k: Vec<Vec<f32>> = enc_lens
        .iter()
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();
    let enc_v: Vec<Vec<f32>> = enc_lens
        .iter()
        .map(|&l| random_values(&mut rng, dtype, l * row, st.amplitude))
        .collect();
    let num_tokens: usize = steps.iter().map(|s| s.new).sum();
    let num_enc: usize = enc_lens.iter().sum();
    let q = tensor(dtype, &[num_tokens, h, d], &queries.concat());
    let k = tensor(dtype, &[num_enc, hkv, d], &enc_k.concat());
    let v = tensor(dtype, &[num_enc, hkv, d], &enc_v.concat());
    let mut out = Tensor::zeros(dtype, &[num_tokens, h, d]);
    out.fill_nan();
    ok(
        attention.forward(
            &q,
            Some(KvPair { key: &k, value: &v }),
            None,
            &md,
            &mut out,
            st.kv_scales(),
        ),
        "forward",
    )?;
    let enc_rows: Vec<Vec<KvRow>> = (0..enc_lens.len())
        .map(|s| {
            (0..enc_lens[s])
                .map(|p| {
                    Some((
                        widen(&enc_k[s][p * row..][..row]),
                        widen(&enc_v[s][p * row..][..row]),
                    ))
                })
                .collect()
        })
        .collect();
    let dense = st.dense(&config, false);
    check_output(
        &out,
        &dense_cross(&dense, &steps, &queries, &enc_rows),
        h,
        d,
    )
}

// ---------------------------------------------------------------------------------------------
// The properties.
// ---------------------------------------------------------------------------------------------

/// `cases` per property, unless `PROPTEST_CASES` asks for another number (for a long soak).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // This file is the only one the suite writes to: no regression files. A failure
        // prints the minimal case (its `seed` regenerates the data).
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

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
    let mut out = Tensor::zeros(DType::F32, &[3, 1, 2]);
    out.fill_nan();
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
        let (kb, vb) = cache.buffers_mut();
        kb.as_slice_mut::<f32>().unwrap().fill(f32::NAN);
        vb.as_slice_mut::<f32>().unwrap().fill(f32::NAN);
        let md = MetadataBuilder::new(2)
            .push(SequenceDesc::prompt(0, 3, vec![1, 0]))
            .build()
            .unwrap();
        let attention = backend.attention(&config).unwrap();
        attention
            .forward(&q, kv, Some(&mut cache), &md, &mut out, KvScales::default())
            .unwrap();
    } else {
        let md = MetadataBuilder::new(2)
            .push(SequenceDesc::prompt(0, 3, vec![]))
            .build()
            .unwrap();
        let attention = backend.attention(&config).unwrap();
        attention
            .forward(&q, kv, None, &md, &mut out, KvScales::default())
            .unwrap();
    }
    out.to_f32_vec()
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
    .map(|(k, v)| Some((k.to_vec(), v.to_vec())))
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

fn fixed_settings(dtype: DType, kv_cache_dtype: KvCacheDtype) -> Settings {
    Settings {
        dtype,
        kv_cache_dtype,
        num_kv_heads: 2,
        group: 2,
        head_size: 8,
        block_size: 4,
        alibi: Alibi::Bloom,
        sliding_window: None,
        soft_cap: None,
        scale: None,
        k_scale: 0.5,
        v_scale: 0.25,
        amplitude: 1.0,
        seed: 7,
    }
}

#[test]
fn zero_length_encoder_sequences() {
    for dtype in DType::FLOATS {
        // Cross attention: the queries of a sequence with no encoder tokens get exact zeros,
        // with and without a cross cache, at prefill and at decode.
        let st = fixed_settings(dtype, KvCacheDtype::Fp8E4m3);
        let case = CrossCase {
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
        run_cross_paged(&case).unwrap();
        run_cross_no_cache(&CrossNoCacheCase {
            settings: st.clone(),
            prefills: vec![(0, 0, 3), (4, 0, 2)],
            decodes: vec![(0, 5), (2, 1)],
        })
        .unwrap();
        // And directly: every output of an all-empty encoder side is exactly zero.
        let backend = registry::backend("reference").unwrap();
        let config = st.config(AttnType::EncoderDecoder);
        let attention = backend.attention(&config).unwrap();
        let md = MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(0, 3, vec![]).with_encoder(0, vec![]))
            .push(SequenceDesc::decode(4, vec![]).with_encoder(0, vec![]))
            .build()
            .unwrap();
        let q = Tensor::from_f32(dtype, &[4, 4, 8], &[0.5; 128]).unwrap();
        let kv = Tensor::zeros(dtype, &[0, 2, 8]);
        let mut out = Tensor::zeros(dtype, &[4, 4, 8]);
        out.fill_nan();
        attention
            .forward(
                &q,
                Some(KvPair {
                    key: &kv,
                    value: &kv,
                }),
                None,
                &md,
                &mut out,
                st.kv_scales(),
            )
            .unwrap();
        assert!(out.to_f32_vec().iter().all(|&x| x == 0.0), "{dtype}");

        // Encoder / encoder-only batches with empty sequences, and with nothing at all.
        for t in [AttnType::Encoder, AttnType::EncoderOnly] {
            run_uncached_self(&st, t, &[0, 3, 0, 0, 2], 0).unwrap();
            run_uncached_self(&st, t, &[0, 0], 0).unwrap();
        }
    }
}

#[test]
fn decoder_queries_without_keys_give_zeros() {
    for dtype in DType::FLOATS {
        for kv_cache_dtype in [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ] {
            let st = fixed_settings(dtype, kv_cache_dtype);
            let seq = |context, pad: Vec<bool>, decode| DecoderSeq {
                context,
                new: pad.len(),
                decode,
                pad,
                extra_blocks: 1,
            };
            let case = DecoderCase {
                settings: st.clone(),
                seqs: vec![
                    // All new tokens padding, no context: every query sees no key.
                    seq(0, vec![true, true, true], false),
                    // First token padding: its query sees no key; the others see later keys.
                    seq(0, vec![true, false, false, true, false], false),
                    // A decode whose only key is padding.
                    seq(0, vec![true], true),
                ],
                spare_blocks: 2,
            };
            run_decoder_paged(&case).unwrap();

            // Directly: exact zeros for every row of a batch whose keys are all padding.
            let backend = registry::backend("reference").unwrap();
            let attention = backend.attention(&st.config(AttnType::Decoder)).unwrap();
            let spec = st.spec(3);
            let mut cache = backend.allocate_kv_cache(&spec).unwrap();
            let mut rng = st.rng();
            let model = CacheModel::poisoned(spec, st.kv_scales(), &mut rng);
            cache = model.build(cache.layout());
            let mut md = MetadataBuilder::new(4)
                .push(SequenceDesc::prompt(0, 3, vec![2]))
                .push(SequenceDesc::decode(1, vec![0]))
                .build()
                .unwrap();
            md.slot_mapping.fill(-1);
            let q = Tensor::from_f32(dtype, &[4, 4, 8], &[0.5; 128]).unwrap();
            let kv = Tensor::from_f32(dtype, &[4, 2, 8], &[0.25; 64]).unwrap();
            let mut out = Tensor::zeros(dtype, &[4, 4, 8]);
            out.fill_nan();
            attention
                .forward(
                    &q,
                    Some(KvPair {
                        key: &kv,
                        value: &kv,
                    }),
                    Some(&mut cache),
                    &md,
                    &mut out,
                    st.kv_scales(),
                )
                .unwrap();
            assert!(
                out.to_f32_vec().iter().all(|&x| x == 0.0),
                "{dtype} {kv_cache_dtype}: {:?}",
                out.to_f32_vec()
            );
            model.check(&cache, "nothing written").unwrap();
        }
    }
}
