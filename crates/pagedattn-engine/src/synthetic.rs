//! The synthetic model: a Llama-shaped decoder with weights drawn from a seed, of any size and
//! with any of the attention features (GQA, ALiBi, sliding window, soft cap, fp8 KV cache),
//! so that every feature of the backends runs inside the engine with no download.

use pagedattn::{alibi_slopes_bloom, AttentionConfig, DType, KvCacheDtype};

use crate::llama::{LayerWeights, Llama, LlamaShape};
use crate::ops::{Embedding, Linear, Precision, Rope, RopeStyle};
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// The synthetic model's shape and features.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticConfig {
    /// Decoder layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// The MLP's inner width.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (a divisor of `heads`).
    pub kv_heads: usize,
    /// Each head's size.
    pub head_size: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The longest sequence served.
    pub max_context: usize,
    /// The attention tensors' and cache's dtype.
    pub dtype: DType,
    /// The cache's storage (fp8 or the dtype itself).
    pub kv_cache_dtype: KvCacheDtype,
    /// ALiBi instead of RoPE.
    pub alibi: bool,
    /// Keys older than this many positions are not attended.
    pub sliding_window: Option<usize>,
    /// Attention logits soft cap.
    pub soft_cap: Option<f32>,
    /// The weights' seed.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            layers: 4,
            hidden: 256,
            ffn: 512,
            heads: 8,
            kv_heads: 2,
            head_size: 32,
            vocab: 2048,
            max_context: 4096,
            dtype: DType::BF16,
            kv_cache_dtype: KvCacheDtype::Auto,
            alibi: false,
            sliding_window: None,
            soft_cap: None,
            seed: 0,
        }
    }
}

impl SyntheticConfig {
    /// The model with weights drawn from `seed`: projections uniform in ±1/√fan-in (so the
    /// residual stream stays of order one), norm weights 1.
    pub fn build(&self) -> Result<Llama> {
        let mut rng = SplitMix64::new(self.seed);
        let mut matrix = |out: usize, inp: usize| -> Result<Linear> {
            let bound = 1.0 / (inp as f64).sqrt();
            let values: Vec<f32> = (0..out * inp)
                .map(|_| ((2.0 * rng.next_f64() - 1.0) * bound) as f32)
                .collect();
            Linear::from_f32(&values, out, inp, Precision::Exact)
                .map_err(|e| Error::Model(e.to_string()))
        };
        let (q, kv) = (self.heads * self.head_size, self.kv_heads * self.head_size);
        let layers = (0..self.layers)
            .map(|_| {
                Ok(LayerWeights {
                    attn_norm: vec![1.0; self.hidden],
                    wq: matrix(q, self.hidden)?,
                    wk: matrix(kv, self.hidden)?,
                    wv: matrix(kv, self.hidden)?,
                    wo: matrix(self.hidden, q)?,
                    ffn_norm: vec![1.0; self.hidden],
                    gate: matrix(self.ffn, self.hidden)?,
                    up: matrix(self.ffn, self.hidden)?,
                    down: matrix(self.hidden, self.ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let head = matrix(self.vocab, self.hidden)?;
        let mut rng = SplitMix64::new(self.seed ^ 0xE3B3_D1D0);
        let table: Vec<f32> = (0..self.vocab * self.hidden)
            .map(|_| (2.0 * rng.next_f64() - 1.0) as f32)
            .collect();
        let embedding = Embedding::from_f32(&table, self.vocab, self.hidden)
            .map_err(|e| Error::Model(e.to_string()))?;
        let attention = AttentionConfig::builder(self.heads, self.head_size)
            .num_kv_heads(self.kv_heads)
            .alibi_slopes(self.alibi.then(|| alibi_slopes_bloom(self.heads)))
            .sliding_window(self.sliding_window)
            .logits_soft_cap(self.soft_cap)
            .kv_cache_dtype(self.kv_cache_dtype)
            .build()?;
        let rope = (!self.alibi)
            .then(|| Rope::new(self.head_size, 10_000.0, RopeStyle::Neox))
            .transpose()
            .map_err(|e| Error::Model(e.to_string()))?;
        Llama::new(
            LlamaShape {
                name: format!(
                    "synthetic ({} layers, {}/{} heads of {}, {}{}{}{}{})",
                    self.layers,
                    self.heads,
                    self.kv_heads,
                    self.head_size,
                    self.dtype,
                    if self.alibi { ", ALiBi" } else { "" },
                    self.sliding_window
                        .map(|w| format!(", window {w}"))
                        .unwrap_or_default(),
                    self.soft_cap
                        .map(|c| format!(", soft cap {c}"))
                        .unwrap_or_default(),
                    match self.kv_cache_dtype {
                        KvCacheDtype::Auto => String::new(),
                        other => format!(", {other} cache"),
                    }
                ),
                layers: self.layers,
                hidden: self.hidden,
                ffn: self.ffn,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_size: self.head_size,
                vocab: self.vocab,
                rms_eps: 1e-5,
                max_context: self.max_context,
                stop_tokens: Vec::new(),
                first_plain_token: 0,
            },
            embedding,
            layers,
            vec![1.0; self.hidden],
            head,
            rope,
            vec![attention; self.layers],
            self.dtype,
        )
    }
}
