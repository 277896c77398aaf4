//! Attention types, KV-cache dtypes and the validated per-layer [`AttentionConfig`].

use std::fmt;
use std::str::FromStr;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::fp8::Fp8Format;
use crate::kv_cache::{KvCacheSpec, KvScales};
use crate::tensor::Tensor;

/// What a layer attends over (vLLM's `AttentionType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnType {
    /// Causal self-attention over the paged cache.
    Decoder,
    /// Bidirectional self-attention of an encoder-decoder model's encoder; never touches a cache.
    Encoder,
    /// Bidirectional self-attention of an encoder-only (BERT-like) model; no cache.
    EncoderOnly,
    /// Cross-attention: decoder queries over the encoder's keys and values.
    EncoderDecoder,
}

impl AttnType {
    /// All four types.
    pub const ALL: [AttnType; 4] = [
        AttnType::Decoder,
        AttnType::Encoder,
        AttnType::EncoderOnly,
        AttnType::EncoderDecoder,
    ];

    /// The vLLM spelling: `decoder`, `encoder`, `encoder_only`, `encoder_decoder`.
    pub fn name(self) -> &'static str {
        match self {
            AttnType::Decoder => "decoder",
            AttnType::Encoder => "encoder",
            AttnType::EncoderOnly => "encoder_only",
            AttnType::EncoderDecoder => "encoder_decoder",
        }
    }

    /// Whether queries see only keys at or before their own position.
    pub fn is_causal(self) -> bool {
        self == AttnType::Decoder
    }

    /// Whether the type can use a KV cache (decoder self-cache or cross cache).
    pub fn uses_cache(self) -> bool {
        matches!(self, AttnType::Decoder | AttnType::EncoderDecoder)
    }
}

impl fmt::Display for AttnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AttnType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        AttnType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "attn_type",
                    format!("{s:?}"),
                    "one of decoder, encoder, encoder_only, encoder_decoder",
                )
            })
    }
}

/// How KV-cache elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCacheDtype {
    /// The activation dtype.
    #[default]
    Auto,
    /// fp8 e4m3fn, one byte per element, scaled by `k_scale` / `v_scale`.
    Fp8E4m3,
    /// fp8 e5m2, one byte per element, scaled by `k_scale` / `v_scale`.
    Fp8E5m2,
}

impl KvCacheDtype {
    /// The vLLM spelling: `auto`, `fp8_e4m3`, `fp8_e5m2`.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
            KvCacheDtype::Fp8E5m2 => "fp8_e5m2",
        }
    }

    /// The fp8 format, if the cache is fp8.
    pub fn fp8_format(self) -> Option<Fp8Format> {
        match self {
            KvCacheDtype::Auto => None,
            KvCacheDtype::Fp8E4m3 => Some(Fp8Format::E4m3),
            KvCacheDtype::Fp8E5m2 => Some(Fp8Format::E5m2),
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvCacheDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(KvCacheDtype::Auto),
            // vLLM's plain "fp8" means e4m3.
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8E4m3),
            "fp8_e5m2" => Ok(KvCacheDtype::Fp8E5m2),
            _ => Err(Error::invalid(
                "kv_cache_dtype",
                format!("{s:?}"),
                "one of auto, fp8, fp8_e4m3, fp8_e5m2",
            )),
        }
    }
}

/// The per-layer attention settings, validated when built (see [`AttentionConfig::builder`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    num_heads: usize,
    head_size: usize,
    scale: f32,
    num_kv_heads: usize,
    alibi_slopes: Option<Vec<f32>>,
    sliding_window: Option<usize>,
    logits_soft_cap: Option<f32>,
    kv_cache_dtype: KvCacheDtype,
    kv_scales: KvScales,
    attn_type: AttnType,
}

impl AttentionConfig {
    /// Starts a config with `num_heads` query heads of `head_size`; by default
    /// `num_kv_heads = num_heads`, `scale = 1/sqrt(head_size)`, decoder, auto cache dtype.
    pub fn builder(num_heads: usize, head_size: usize) -> AttentionConfigBuilder {
        AttentionConfigBuilder {
            config: AttentionConfig {
                num_heads,
                head_size,
                scale: 1.0 / (head_size.max(1) as f32).sqrt(),
                num_kv_heads: num_heads,
                alibi_slopes: None,
                sliding_window: None,
                logits_soft_cap: None,
                kv_cache_dtype: KvCacheDtype::Auto,
                kv_scales: KvScales::ONE,
                attn_type: AttnType::Decoder,
            },
        }
    }

    /// Number of query heads (H).
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
    /// Head size (D).
    pub fn head_size(&self) -> usize {
        self.head_size
    }
    /// Softmax scale applied to q·k.
    pub fn scale(&self) -> f32 {
        self.scale
    }
    /// Number of kv heads (Hkv); query head h reads kv head h / (H / Hkv).
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    /// Query heads per kv head (H / Hkv).
    pub fn num_queries_per_kv(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
    /// ALiBi slopes, one per query head.
    pub fn alibi_slopes(&self) -> Option<&[f32]> {
        self.alibi_slopes.as_deref()
    }
    /// Sliding window W: a query sees the W most recent keys, itself included.
    pub fn sliding_window(&self) -> Option<usize> {
        self.sliding_window
    }
    /// Soft cap: scores become `cap * tanh(s / cap)`.
    pub fn logits_soft_cap(&self) -> Option<f32> {
        self.logits_soft_cap
    }
    /// How the KV cache stores elements.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_cache_dtype
    }
    /// The fp8 cache's dequantization scales (1.0 for other caches).
    pub fn kv_scales(&self) -> KvScales {
        self.kv_scales
    }
    /// The attention type.
    pub fn attn_type(&self) -> AttnType {
        self.attn_type
    }

    /// The geometry of a KV cache for this layer: `num_blocks` blocks of `block_size` tokens,
    /// this layer's kv heads, head size and cache dtype, holding keys and values of `dtype`.
    pub fn kv_cache_spec(&self, dtype: DType, num_blocks: usize, block_size: usize) -> KvCacheSpec {
        KvCacheSpec {
            num_blocks,
            block_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            dtype,
            kv_cache_dtype: self.kv_cache_dtype,
        }
    }

    /// The shape of a step's queries and of its attention output: `[num_tokens, H, D]`, for
    /// the step's `num_tokens` query tokens ([`AttentionMetadata::num_tokens`]).
    ///
    /// [`AttentionMetadata::num_tokens`]: crate::AttentionMetadata::num_tokens
    pub fn query_shape(&self, num_tokens: usize) -> [usize; 3] {
        [num_tokens, self.num_heads, self.head_size]
    }

    /// The shape of a step's new keys and of its new values: `[num_tokens, Hkv, D]`, for
    /// `num_tokens` key tokens (the query tokens for self-attention, the encoder's tokens for
    /// cross-attention).
    pub fn kv_shape(&self, num_tokens: usize) -> [usize; 3] {
        [num_tokens, self.num_kv_heads, self.head_size]
    }

    /// A zero-filled `[num_tokens, H, D]` tensor of `dtype` on `device`: a step's queries to
    /// fill in, or the output [`forward_into`](crate::AttentionImpl::forward_into) writes.
    pub fn zeros_query(&self, device: Device, dtype: DType, num_tokens: usize) -> Result<Tensor> {
        Tensor::zeros_on(device, dtype, &self.query_shape(num_tokens))
    }

    /// A zero-filled `[num_tokens, Hkv, D]` tensor of `dtype` on `device`: a step's new keys
    /// or values to fill in.
    pub fn zeros_kv(&self, device: Device, dtype: DType, num_tokens: usize) -> Result<Tensor> {
        Tensor::zeros_on(device, dtype, &self.kv_shape(num_tokens))
    }

    fn validate(&self) -> Result<()> {
        let positive = |field: &str, v: usize| {
            if v == 0 {
                Err(Error::invalid(field, v, "a positive integer"))
            } else {
                Ok(())
            }
        };
        positive("num_heads", self.num_heads)?;
        positive("head_size", self.head_size)?;
        positive("num_kv_heads", self.num_kv_heads)?;
        // Sizes are checked where they enter: one token's query row (H x D elements of up to
        // 4 bytes) must be an allocation that can exist, so that every later product of a
        // token count with it is a tensor's checked element count.
        let row_bytes = self
            .num_heads
            .checked_mul(self.head_size)
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= isize::MAX as usize);
        if row_bytes.is_none() {
            return Err(Error::invalid(
                "head_size",
                self.head_size,
                format!(
                    "a size whose query row (num_heads = {} x head_size x 4 bytes) fits in \
                     isize",
                    self.num_heads
                ),
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::invalid(
                "num_kv_heads",
                self.num_kv_heads,
                format!("a divisor of num_heads = {}", self.num_heads),
            ));
        }
        if !self.scale.is_finite() || self.scale == 0.0 {
            return Err(Error::invalid(
                "scale",
                self.scale,
                "a finite, non-zero number",
            ));
        }
        if let Some(slopes) = &self.alibi_slopes {
            if slopes.len() != self.num_heads {
                return Err(Error::invalid(
                    "alibi_slopes.len()",
                    slopes.len(),
                    format!("num_heads = {}", self.num_heads),
                ));
            }
            if let Some((h, s)) = slopes.iter().enumerate().find(|(_, s)| !s.is_finite()) {
                return Err(Error::invalid(
                    format!("alibi_slopes[{h}]"),
                    s,
                    "a finite number",
                ));
            }
        }
        if let Some(w) = self.sliding_window {
            positive("sliding_window", w)?;
            if !self.attn_type.is_causal() {
                return Err(Error::unsupported(
                    "any",
                    format!(
                        "a sliding window with attn_type {} (non-causal)",
                        self.attn_type
                    ),
                ));
            }
        }
        self.kv_scales.validate(self.kv_cache_dtype)?;
        // Backends apply scale × k_scale as one f32 factor.
        let factor = self.scale.abs() as f64 * self.kv_scales.k_scale as f64;
        if !(f32::MIN_POSITIVE as f64..=f32::MAX as f64).contains(&factor) {
            return Err(Error::invalid(
                "scale",
                self.scale,
                format!(
                    "|scale| * k_scale (k_scale = {}) within f32's normal range \
                     [2^-126, f32::MAX]",
                    self.kv_scales.k_scale
                ),
            ));
        }
        if let Some(cap) = self.logits_soft_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::invalid(
                    "logits_soft_cap",
                    cap,
                    "a finite number > 0",
                ));
            }
        }
        Ok(())
    }
}

/// Builder for [`AttentionConfig`]; [`build`](Self::build) validates every field.
#[derive(Debug, Clone)]
pub struct AttentionConfigBuilder {
    config: AttentionConfig,
}

impl AttentionConfigBuilder {
    /// Softmax scale (default `1/sqrt(head_size)`).
    pub fn scale(mut self, scale: f32) -> Self {
        self.config.scale = scale;
        self
    }
    /// Number of kv heads (default: num_heads).
    pub fn num_kv_heads(mut self, n: usize) -> Self {
        self.config.num_kv_heads = n;
        self
    }
    /// ALiBi slopes, one per query head.
    pub fn alibi_slopes(mut self, slopes: Option<Vec<f32>>) -> Self {
        self.config.alibi_slopes = slopes;
        self
    }
    /// Sliding window (decoder only).
    pub fn sliding_window(mut self, window: Option<usize>) -> Self {
        self.config.sliding_window = window;
        self
    }
    /// Logits soft cap; `Some(0.0)` means disabled, as in vLLM.
    pub fn logits_soft_cap(mut self, cap: Option<f32>) -> Self {
        self.config.logits_soft_cap = cap.filter(|&c| c != 0.0);
        self
    }
    /// KV-cache dtype (default auto).
    pub fn kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.config.kv_cache_dtype = dtype;
        self
    }
    /// Dequantization scales of an fp8 cache (vLLM's `k_scale`, `v_scale`; default 1.0):
    /// keys are stored as `k / k_scale` and read as `code * k_scale`, values likewise.
    pub fn kv_scales(mut self, k_scale: f32, v_scale: f32) -> Self {
        self.config.kv_scales = KvScales { k_scale, v_scale };
        self
    }
    /// Attention type (default decoder).
    pub fn attn_type(mut self, attn_type: AttnType) -> Self {
        self.config.attn_type = attn_type;
        self
    }
    /// Validates and returns the config.
    pub fn build(self) -> Result<AttentionConfig> {
        self.config.validate()?;
        Ok(self.config)
    }
}

/// ALiBi slopes as Bloom, Baichuan and Falcon compute them: for the largest power of two
/// `c <= n`, `base^k` for k = 1..=c with `base = 2^(-8/c)`, then (if `n > c`) `extra^k` for odd
/// k up to `2(n-c)` with `extra = 2^(-4/c)`. Like the PyTorch original, the bases are rounded to
/// f32 and raised to integer powers in f32.
pub fn alibi_slopes_bloom(num_heads: usize) -> Vec<f32> {
    if num_heads == 0 {
        return Vec::new();
    }
    let c = 1usize << num_heads.ilog2();
    let base = 2f64.powf(-8.0 / c as f64) as f32;
    let extra_base = 2f64.powf(-4.0 / c as f64) as f32;
    let extra = num_heads - c;
    (1..=c)
        .map(|k| base.powf(k as f32))
        .chain((0..extra).map(|i| extra_base.powf((2 * i + 1) as f32)))
        .collect()
}

/// ALiBi slopes as MPT computes them: with `P = 2^ceil(log2 n)`, `m_k = k * max_bias / P`,
/// slopes `2^-m_k`; when `P != n`, the odd-indexed slopes then the even ones, cut to n.
pub fn alibi_slopes_mpt(num_heads: usize, alibi_bias_max: f32) -> Vec<f32> {
    if num_heads == 0 {
        return Vec::new();
    }
    let p = num_heads.next_power_of_two();
    let slopes: Vec<f32> = (1..=p)
        .map(|k| (1.0 / 2f64.powf(k as f64 * alibi_bias_max as f64 / p as f64)) as f32)
        .collect();
    if p == num_heads {
        return slopes;
    }
    let odd = slopes.iter().skip(1).step_by(2);
    let even = slopes.iter().step_by(2);
    odd.chain(even).copied().take(num_heads).collect()
}
