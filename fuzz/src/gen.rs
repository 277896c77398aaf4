//! Random VALID forward calls for the differential target, driven by the fuzz input: the
//! input picks the layer (every attention type, dtypes, fp8 caches with scales, GQA / MQA,
//! ALiBi, sliding windows, soft caps, head sizes for every ISA's vector body, block sizes),
//! the sequences (prefill, decode and chunked prefill mixes, encoder and cross lengths, up to
//! ~200 keys so that decodes cross 64-key tiles) and where NaN and ±Inf go; a seed from the
//! input generates the data, of modest magnitude (|x| <= 8, |scale| <= 4, fp8 scales in
//! [1/16, 16]) so that the contract's exactness domain holds for every finite row.
//!
//! Unused cache slots always hold NaN (random payloads, fp8 NaN codes), as in the tests.

use arbitrary::{Result, Unstructured};
use pagedattn::replay::ReplayCase;
use pagedattn::{
    alibi_slopes_bloom, bf16, f16, AttentionConfig, AttnType, BlockId, CacheLayout, DType,
    Fp8Format, HostStorage, KvCache, KvCacheDtype, KvCacheSpec, MetadataBuilder, SequenceDesc,
    Tensor,
};

use crate::rng::Rng;

/// A generated call and a one-line description of its shape, for failure messages.
#[derive(Debug)]
pub struct Generated {
    /// The call (its cache in the canonical layout).
    pub case: ReplayCase,
    /// Kind, dtypes, shapes, features, sequences and injections.
    pub summary: String,
}

/// Builds one valid call from the input (data from a seed the input gives).
pub fn valid_call(u: &mut Unstructured<'_>) -> Result<Generated> {
    let mut rng = Rng::new(u.arbitrary()?);
    let layer = Layer::arbitrary(u, &mut rng)?;
    let seqs = sequences(u, &layer)?;
    // Padding tokens (slot -1), in eighths of the new tokens of a cached call.
    let pad_rate = *u.choose(&[0u64, 0, 1, 4, 8])?;
    let count = u.int_in_range(0..=4)?;
    let injections = (0..count)
        .map(|_| {
            Ok(Injection {
                site: *u.choose(&Site::ALL)?,
                index: u.arbitrary()?,
                special: *u.choose(&[Special::Nan, Special::PosInf, Special::NegInf])?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let summary = format!(
        "{layer}; sequences (context, new, decode, encoder) {:?}; padding {pad_rate}/8; \
         injections {injections:?}",
        seqs.iter()
            .map(|s| (s.context, s.new, s.decode, s.encoder))
            .collect::<Vec<_>>()
    );
    let case = build(&layer, &seqs, pad_rate, &injections, &mut rng);
    Ok(Generated { case, summary })
}

/// Multiply-adds (query-key pairs × H × D) a call may cost: keeps one execution (the
/// reference in f64, then `cpu` on every ISA, instrumented) at a few milliseconds.
const WORK: usize = 250_000;

/// Head sizes that reach every vector body: multiples of 16 (AVX-512), multiples of 8 but not
/// of 16 (AVX2), and others (scalar; 4 is NEON's width).
const HEAD_SIZES: [usize; 17] = [
    16, 32, 48, 64, 80, 128, 8, 24, 40, 72, 1, 3, 4, 5, 12, 20, 33,
];

/// The calls the generator makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Decoder over a paged cache: prefills over cached context, fresh prompts, decodes.
    DecoderPaged,
    /// Decoder without a cache: fresh prompts (and decodes of one-token sequences).
    DecoderNoCache,
    Encoder,
    EncoderOnly,
    /// Cross attention that writes the encoder's keys and values into the cross cache.
    CrossPrefill,
    /// Cross attention that reads a filled cross cache (no key/value in the call).
    CrossDecode,
    /// Cross attention over the encoder's keys and values as inputs.
    CrossNoCache,
}

/// The paged decoder, the main use, twice as often as each other kind.
const KINDS: [Kind; 8] = [
    Kind::DecoderPaged,
    Kind::DecoderPaged,
    Kind::DecoderNoCache,
    Kind::Encoder,
    Kind::EncoderOnly,
    Kind::CrossPrefill,
    Kind::CrossDecode,
    Kind::CrossNoCache,
];

impl Kind {
    fn attn_type(self) -> AttnType {
        match self {
            Kind::DecoderPaged | Kind::DecoderNoCache => AttnType::Decoder,
            Kind::Encoder => AttnType::Encoder,
            Kind::EncoderOnly => AttnType::EncoderOnly,
            Kind::CrossPrefill | Kind::CrossDecode | Kind::CrossNoCache => AttnType::EncoderDecoder,
        }
    }

    fn is_cross(self) -> bool {
        self.attn_type() == AttnType::EncoderDecoder
    }
}

/// Where an injected NaN or infinity goes.
#[derive(Debug, Clone, Copy)]
enum Site {
    Query,
    /// Keys and values of this call's tokens (or the encoder's, for cross attention).
    NewKey,
    NewValue,
    /// Slots written before the call: cached context, a filled cross cache.
    CachedKey,
    CachedValue,
    /// Slots no key reads: never written, padding, past a sequence's end.
    UnusedKey,
    UnusedValue,
}

impl Site {
    const ALL: [Site; 7] = [
        Site::Query,
        Site::NewKey,
        Site::NewValue,
        Site::CachedKey,
        Site::CachedValue,
        Site::UnusedKey,
        Site::UnusedValue,
    ];
}

#[derive(Debug, Clone, Copy)]
enum Special {
    Nan,
    PosInf,
    NegInf,
}

impl Special {
    fn value(self) -> f32 {
        match self {
            Special::Nan => f32::NAN,
            Special::PosInf => f32::INFINITY,
            Special::NegInf => f32::NEG_INFINITY,
        }
    }
}

/// One NaN or infinity: `index` picks the element among the site's.
#[derive(Debug, Clone, Copy)]
struct Injection {
    site: Site,
    index: u32,
    special: Special,
}

/// The layer settings of a call.
#[derive(Debug, Clone)]
struct Layer {
    kind: Kind,
    dtype: DType,
    cache_dtype: KvCacheDtype,
    num_kv_heads: usize,
    group: usize,
    head_size: usize,
    block_size: usize,
    slopes: Option<Vec<f32>>,
    window: Option<usize>,
    soft_cap: Option<f32>,
    scale: Option<f32>,
    k_scale: f32,
    v_scale: f32,
    /// Data are uniform in [-amplitude, amplitude].
    amplitude: f32,
}

impl Layer {
    fn arbitrary(u: &mut Unstructured<'_>, rng: &mut Rng) -> Result<Layer> {
        let kind = *u.choose(&KINDS)?;
        let dtype = *u.choose(&DType::FLOATS)?;
        let cache_dtype = *u.choose(&[
            KvCacheDtype::Auto,
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ])?;
        let (num_kv_heads, group) = match u.int_in_range(0..=5)? {
            0..=3 => (u.int_in_range(1..=3)?, u.int_in_range(1..=4)?),
            // Groups of 8 and MQA with 16-32 heads: decodes take the packed path too.
            4 => (u.int_in_range(1..=2)?, u.int_in_range(5..=8)?),
            _ => (1, u.int_in_range(16..=32)?),
        };
        let heads = num_kv_heads * group;
        let slopes = match u.int_in_range(0..=3)? {
            0 => Some(alibi_slopes_bloom(heads)),
            // [-0.25, 1], as the tests draw them.
            1 => Some((0..heads).map(|_| rng.uniform(0.625) + 0.375).collect()),
            _ => None,
        };
        let window = if kind.attn_type() == AttnType::Decoder && u.ratio(1, 3)? {
            Some(match u.int_in_range(0..=3)? {
                0 => u.int_in_range(1..=12)?,
                1 => u.int_in_range(13..=200)?,
                2 => u.int_in_range(201..=3000)?,
                // Windows near usize::MAX once wrapped: they are no window.
                _ => usize::MAX - u.int_in_range(0..=3)?,
            })
        } else {
            None
        };
        let soft_cap = if u.ratio(1, 4)? {
            Some(u.int_in_range(1..=60)? as f32 / 2.0)
        } else {
            None
        };
        let scale = if u.ratio(1, 4)? {
            // ±2^(e/8) in [0.048, 4].
            let magnitude = 2f32.powf(u.int_in_range(-35..=16)? as f32 / 8.0);
            Some(if u.arbitrary()? {
                -magnitude
            } else {
                magnitude
            })
        } else {
            None
        };
        let fp8 = cache_dtype != KvCacheDtype::Auto;
        let mut fp8_scale = || -> Result<f32> {
            // 2^(e/4) in [1/16, 16].
            Ok(if fp8 {
                2f32.powf(u.int_in_range(-16..=16)? as f32 / 4.0)
            } else {
                1.0
            })
        };
        let (k_scale, v_scale) = (fp8_scale()?, fp8_scale()?);
        Ok(Layer {
            kind,
            dtype,
            cache_dtype,
            num_kv_heads,
            group,
            head_size: *u.choose(&HEAD_SIZES)?,
            block_size: u.int_in_range(1..=32)?,
            slopes,
            window,
            soft_cap,
            scale,
            k_scale,
            v_scale,
            amplitude: *u.choose(&[0.25f32, 1.0, 4.0, 8.0])?,
        })
    }

    fn num_heads(&self) -> usize {
        self.num_kv_heads * self.group
    }

    fn config(&self) -> AttentionConfig {
        let mut builder = AttentionConfig::builder(self.num_heads(), self.head_size)
            .num_kv_heads(self.num_kv_heads)
            .alibi_slopes(self.slopes.clone())
            .sliding_window(self.window)
            .logits_soft_cap(self.soft_cap)
            .kv_cache_dtype(self.cache_dtype)
            .kv_scales(self.k_scale, self.v_scale)
            .attn_type(self.kind.attn_type());
        if let Some(scale) = self.scale {
            builder = builder.scale(scale);
        }
        builder
            .build()
            .unwrap_or_else(|e| panic!("a generated config was refused: {e}; {self}"))
    }
}

impl std::fmt::Display for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {} cache {} H={} Hkv={} D={} B={} alibi={} window={:?} cap={:?} scale={:?} \
             k_scale={} v_scale={} amplitude={}",
            self.kind,
            self.dtype,
            self.cache_dtype,
            self.num_heads(),
            self.num_kv_heads,
            self.head_size,
            self.block_size,
            self.slopes.is_some(),
            self.window,
            self.soft_cap,
            self.scale,
            self.k_scale,
            self.v_scale,
            self.amplitude
        )
    }
}

/// One sequence of a call.
#[derive(Debug, Clone)]
struct Seq {
    /// Tokens before this call: cached context (decoder) or earlier decoder tokens (cross).
    context: usize,
    /// Query tokens of this call.
    new: usize,
    decode: bool,
    /// Encoder tokens (cross attention).
    encoder: usize,
}

/// The sequences of a call, prefills first, within [`WORK`].
fn sequences(u: &mut Unstructured<'_>, layer: &Layer) -> Result<Vec<Seq>> {
    // Query-key pairs the whole call may have.
    let pairs = (WORK / (layer.num_heads() * layer.head_size)).max(1);
    let (prefills, decodes) = match layer.kind {
        Kind::Encoder | Kind::EncoderOnly => (u.int_in_range(1..=4)?, 0),
        Kind::DecoderNoCache => (u.int_in_range(0..=3)?, u.int_in_range(0..=2)?),
        _ => (u.int_in_range(0..=3)?, u.int_in_range(0..=3)?),
    };
    // Cross attention needs a sequence: the encoder metadata comes from them.
    let decodes = if layer.kind.is_cross() && prefills + decodes == 0 {
        1
    } else {
        decodes
    };
    let per_seq = pairs / (prefills + decodes).max(1);
    let mut seqs = Vec::with_capacity(prefills + decodes);
    for decode in (0..prefills)
        .map(|_| false)
        .chain((0..decodes).map(|_| true))
    {
        let seq = match layer.kind {
            Kind::DecoderPaged if decode => {
                let len = u.int_in_range(1..=per_seq.clamp(1, 200))?;
                Seq {
                    context: len - 1,
                    new: 1,
                    decode,
                    encoder: 0,
                }
            }
            Kind::DecoderPaged => {
                let new = u.int_in_range(1..=per_seq.clamp(1, 70))?;
                let context = (per_seq / new).saturating_sub(new).min(150);
                Seq {
                    context: u.int_in_range(0..=context)?,
                    new,
                    decode,
                    encoder: 0,
                }
            }
            // Self-attention without a cache: each sequence's new tokens are its keys.
            // At least one token: `MetadataBuilder` refuses empty sequences (the tests cover
            // them through `AttentionMetadata::from_parts`).
            Kind::DecoderNoCache | Kind::Encoder | Kind::EncoderOnly => {
                let new = if decode {
                    1
                } else {
                    u.int_in_range(1..=per_seq.isqrt().clamp(1, 100))?
                };
                Seq {
                    context: 0,
                    new,
                    decode,
                    encoder: 0,
                }
            }
            Kind::CrossPrefill | Kind::CrossDecode | Kind::CrossNoCache => {
                let new = if decode {
                    1
                } else {
                    u.int_in_range(1..=per_seq.clamp(1, 40))?
                };
                Seq {
                    context: u.int_in_range(0..=70)?,
                    new,
                    decode,
                    encoder: u.int_in_range(0..=(per_seq / new).min(200))?,
                }
            }
        };
        seqs.push(seq);
    }
    Ok(seqs)
}

/// `n` values uniform in [-amp, amp], rounded to `dtype`.
fn random(rng: &mut Rng, dtype: DType, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| round(dtype, rng.uniform(amp))).collect()
}

/// `x` rounded to `dtype` (nearest even).
fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// A paged cache being filled, in the canonical layout: its bytes, and which slots hold data
/// written before the call.
struct Paged {
    spec: KvCacheSpec,
    fp8: Option<Fp8Format>,
    k_scale: f32,
    v_scale: f32,
    /// Per sequence: its blocks, then entries past its end (never read).
    tables: Vec<Vec<BlockId>>,
    key: Vec<u8>,
    value: Vec<u8>,
    /// Slots written before the call.
    stored: Vec<usize>,
    /// Slots a key of the call may read: stored before, or written by the call.
    used: Vec<bool>,
}

impl Paged {
    /// Blocks for sequences of `lens` positions, taken in order from a random permutation of
    /// all blocks (shuffled, not contiguous), a few spare blocks, every element NaN.
    fn new(layer: &Layer, lens: &[usize], rng: &mut Rng) -> Paged {
        let b = layer.block_size;
        let needed: Vec<usize> = lens.iter().map(|l| l.div_ceil(b)).collect();
        let num_blocks = (needed.iter().sum::<usize>() + rng.below(4)).max(1);
        let mut perm: Vec<BlockId> = (0..num_blocks as BlockId).collect();
        rng.shuffle(&mut perm);
        let mut next = perm.into_iter();
        let tables = needed
            .iter()
            .map(|&n| {
                let mut table: Vec<BlockId> = next.by_ref().take(n).collect();
                let extra = rng.below(3);
                table.extend((0..extra).map(|_| rng.below(num_blocks) as BlockId));
                table
            })
            .collect();
        let spec = KvCacheSpec {
            num_blocks,
            block_size: b,
            num_kv_heads: layer.num_kv_heads,
            head_size: layer.head_size,
            dtype: layer.dtype,
            kv_cache_dtype: layer.cache_dtype,
        };
        let fp8 = layer.cache_dtype.fp8_format();
        let elems = spec.buffer_elems();
        let mut poison = || -> Vec<u8> {
            (0..elems)
                .flat_map(|_| nan_bytes(fp8, layer.dtype, rng.next_u64()))
                .collect()
        };
        let (key, value) = (poison(), poison());
        Paged {
            spec,
            fp8,
            k_scale: layer.k_scale,
            v_scale: layer.v_scale,
            tables,
            key,
            value,
            stored: Vec::new(),
            used: vec![false; spec.num_slots()],
        }
    }

    fn row(&self) -> usize {
        self.spec.num_kv_heads * self.spec.head_size
    }

    fn elem_size(&self) -> usize {
        self.spec.storage_dtype().size_bytes()
    }

    /// The slot of position `pos` of sequence `s`.
    fn slot(&self, s: usize, pos: usize) -> usize {
        let b = self.spec.block_size;
        self.tables[s][pos / b] as usize * b + pos % b
    }

    /// Stores token row (`k`, `v`) at `slot` before the call, as a cache write would.
    fn store(&mut self, slot: usize, k: &[f32], v: &[f32]) {
        let (row, es) = (self.row(), self.elem_size());
        for (e, (&kx, &vx)) in k.iter().zip(v).enumerate() {
            let at = (slot * row + e) * es;
            // (The scales are 1.0 without an fp8 cache.)
            let kb = encode(self.fp8, self.spec.dtype, kx / self.k_scale, kx);
            let vb = encode(self.fp8, self.spec.dtype, vx / self.v_scale, vx);
            self.key[at..at + es].copy_from_slice(&kb);
            self.value[at..at + es].copy_from_slice(&vb);
        }
        self.stored.push(slot);
        self.used[slot] = true;
    }

    /// Puts `special` into element `index` (modulo) of the key or value rows of `slots`.
    fn inject(&mut self, slots: &[usize], index: u32, key: bool, special: Special) {
        if slots.is_empty() {
            return;
        }
        let (row, es) = (self.row(), self.elem_size());
        let i = index as usize;
        let slot = slots[i % slots.len()];
        let at = (slot * row + i / slots.len() % row) * es;
        let bytes = match self.fp8 {
            // e4m3fn has no infinity: its infinities saturate to the largest finite value.
            Some(Fp8Format::E4m3) => vec![match special {
                Special::Nan => 0x7F,
                Special::PosInf => 0x7E,
                Special::NegInf => 0xFE,
            }],
            Some(Fp8Format::E5m2) => vec![match special {
                Special::Nan => 0x7F,
                Special::PosInf => 0x7C,
                Special::NegInf => 0xFC,
            }],
            None => encode(None, self.spec.dtype, 0.0, special.value()),
        };
        let buf = if key { &mut self.key } else { &mut self.value };
        buf[at..at + es].copy_from_slice(&bytes);
    }

    /// Slots no key of the call reads.
    fn unused(&self) -> Vec<usize> {
        (0..self.used.len()).filter(|&s| !self.used[s]).collect()
    }

    fn into_cache(self) -> KvCache {
        let dtype = self.spec.storage_dtype();
        let bytes = |b: &[u8]| HostStorage::from_bytes(dtype, b).expect("whole elements");
        KvCache::from_canonical(
            self.spec,
            CacheLayout::Nhd,
            bytes(&self.key),
            bytes(&self.value),
        )
        .expect("a generated cache is valid")
    }
}

/// The stored bytes of an element: the fp8 code of `scaled` (the value divided by its
/// scale), or `x` in `dtype`.
fn encode(fp8: Option<Fp8Format>, dtype: DType, scaled: f32, x: f32) -> Vec<u8> {
    match (fp8, dtype) {
        (Some(f), _) => vec![f.encode(scaled)],
        (None, DType::F16) => f16::from_f32(x).to_le_bytes().to_vec(),
        (None, DType::BF16) => bf16::from_f32(x).to_le_bytes().to_vec(),
        (None, _) => x.to_le_bytes().to_vec(),
    }
}

/// A NaN element with random sign and payload (fp8: one of the format's NaN codes).
fn nan_bytes(fp8: Option<Fp8Format>, dtype: DType, r: u64) -> Vec<u8> {
    let sign = (r & 1) as u32;
    let payload = (r >> 8) as u32;
    match (fp8, dtype) {
        (Some(Fp8Format::E4m3), _) => vec![0x7F | (sign << 7) as u8],
        // Exponent 11111 with a non-zero mantissa: 0x7D, 0x7E, 0x7F.
        (Some(Fp8Format::E5m2), _) => vec![(0x7D + (payload % 3) as u8) | (sign << 7) as u8],
        (None, DType::F16) => (((sign << 15) | 0x7E00 | (payload & 0x1FF)) as u16)
            .to_le_bytes()
            .to_vec(),
        (None, DType::BF16) => (((sign << 15) | 0x7FC0 | (payload & 0x3F)) as u16)
            .to_le_bytes()
            .to_vec(),
        (None, _) => ((sign << 31) | 0x7FC0_0000 | (payload & 0x3F_FFFF))
            .to_le_bytes()
            .to_vec(),
    }
}

/// Builds the call: data, cache, metadata, padding, injections.
fn build(
    layer: &Layer,
    seqs: &[Seq],
    pad_rate: u64,
    injections: &[Injection],
    rng: &mut Rng,
) -> ReplayCase {
    let (h, hkv, d, dtype, amp) = (
        layer.num_heads(),
        layer.num_kv_heads,
        layer.head_size,
        layer.dtype,
        layer.amplitude,
    );
    let row = hkv * d;
    let kind = layer.kind;
    let num_tokens: usize = seqs.iter().map(|s| s.new).sum();
    let mut query = random(rng, dtype, num_tokens * h * d, amp);
    // The positions the cache pages: the decoder's tokens, or the encoder's.
    let mut paged = match kind {
        Kind::DecoderPaged => {
            let lens: Vec<usize> = seqs.iter().map(|s| s.context + s.new).collect();
            Some(Paged::new(layer, &lens, rng))
        }
        Kind::CrossPrefill | Kind::CrossDecode => {
            let lens: Vec<usize> = seqs.iter().map(|s| s.encoder).collect();
            Some(Paged::new(layer, &lens, rng))
        }
        _ => None,
    };
    // The key/value rows of the call: new tokens, or the encoder's; each sequence's decoder
    // table (the builder borrows them once all are drawn).
    let (mut keys, mut values, mut tables) = (Vec::new(), Vec::new(), Vec::new());
    for (s, seq) in seqs.iter().enumerate() {
        tables.push(match (&paged, kind) {
            (Some(p), Kind::DecoderPaged) => p.tables[s].clone(),
            // Cross attention ignores the decoder's own block tables: sometimes give some.
            (Some(p), _) if rng.chance(1, 2) => {
                let n = (seq.context + seq.new).div_ceil(layer.block_size);
                (0..n)
                    .map(|_| rng.below(p.spec.num_blocks) as BlockId)
                    .collect()
            }
            _ => Vec::new(),
        });
        match (kind, paged.as_mut()) {
            (Kind::DecoderPaged, Some(p)) => {
                for pos in 0..seq.context {
                    let (k, v) = (random(rng, dtype, row, amp), random(rng, dtype, row, amp));
                    p.store(p.slot(s, pos), &k, &v);
                }
                keys.extend(random(rng, dtype, seq.new * row, amp));
                values.extend(random(rng, dtype, seq.new * row, amp));
            }
            (Kind::CrossDecode, Some(p)) => {
                for pos in 0..seq.encoder {
                    let (k, v) = (random(rng, dtype, row, amp), random(rng, dtype, row, amp));
                    p.store(p.slot(s, pos), &k, &v);
                }
            }
            _ if kind.is_cross() => {
                keys.extend(random(rng, dtype, seq.encoder * row, amp));
                values.extend(random(rng, dtype, seq.encoder * row, amp));
            }
            _ => {
                keys.extend(random(rng, dtype, seq.new * row, amp));
                values.extend(random(rng, dtype, seq.new * row, amp));
            }
        }
    }
    let mut builder = MetadataBuilder::new(layer.block_size);
    builder.write_cross_kv(kind == Kind::CrossPrefill);
    for (s, (seq, table)) in seqs.iter().zip(&tables).enumerate() {
        let desc = if seq.decode {
            SequenceDesc::decode(seq.context, table)
        } else {
            SequenceDesc::prompt(seq.context, seq.new, table)
        };
        builder.push(match (&paged, kind.is_cross()) {
            (Some(p), true) => desc.with_encoder(seq.encoder, &p.tables[s]),
            (None, true) => desc.with_encoder(seq.encoder, &[]),
            _ => desc,
        });
    }
    let mut metadata = builder
        .build()
        .unwrap_or_else(|e| panic!("generated sequences were refused: {e}; {layer}"));
    // Padding: tokens whose slot is -1 are neither written nor keys.
    if let Some(p) = paged.as_mut() {
        let slots = match kind {
            Kind::DecoderPaged => &mut metadata.slot_mapping,
            _ => {
                &mut metadata
                    .encoder
                    .as_mut()
                    .expect("cross metadata")
                    .cross_slot_mapping
            }
        };
        for slot in slots.iter_mut() {
            if rng.chance(pad_rate, 8) {
                *slot = -1;
            } else if *slot >= 0 {
                p.used[*slot as usize] = true;
            }
        }
    }
    for inj in injections {
        let i = inj.index as usize;
        match (inj.site, paged.as_mut()) {
            (Site::Query, _) if !query.is_empty() => {
                let n = query.len();
                query[i % n] = inj.special.value();
            }
            (Site::NewKey, _) if !keys.is_empty() => {
                let n = keys.len();
                keys[i % n] = inj.special.value();
            }
            (Site::NewValue, _) if !values.is_empty() => {
                let n = values.len();
                values[i % n] = inj.special.value();
            }
            (Site::CachedKey | Site::CachedValue, Some(p)) => {
                let stored = p.stored.clone();
                let key = matches!(inj.site, Site::CachedKey);
                p.inject(&stored, inj.index, key, inj.special);
            }
            (Site::UnusedKey | Site::UnusedValue, Some(p)) => {
                let unused = p.unused();
                let key = matches!(inj.site, Site::UnusedKey);
                p.inject(&unused, inj.index, key, inj.special);
            }
            _ => {}
        }
    }
    let tensor = |values: &[f32], shape: &[usize]| {
        Tensor::from_f32(dtype, shape, values).expect("generated tensors match their shapes")
    };
    let key_value = (kind != Kind::CrossDecode).then(|| {
        let tk = keys.len() / row;
        (tensor(&keys, &[tk, hkv, d]), tensor(&values, &[tk, hkv, d]))
    });
    ReplayCase {
        config: layer.config(),
        query: tensor(&query, &[num_tokens, h, d]),
        key_value,
        kv_cache: paged.map(Paged::into_cache),
        metadata,
    }
}
