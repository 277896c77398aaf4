//! The synthetic model: a Llama-shaped decoder, or an encoder-only or encoder-decoder model
//! of the same blocks ([`crate::models::encdec`]), with weights drawn from a seed, of any size and
//! with any of the attention features (GQA, ALiBi, sliding window, soft cap, fp8 KV cache),
//! so that every feature of the backends runs inside the engine with no download.

use pagedattn::{alibi_slopes_bloom, AttentionConfig, AttnType, DType, KvCacheDtype};
use rayon::prelude::*;

use crate::models::blocks::{InputEmbedding, LayerWeights, Placement};
use crate::models::encdec::{CrossWeights, EncDec, Pooling};
use crate::models::llama::{Llama, LlamaShape};
use crate::models::ops::{Embedding, Linear, Norm, Precision, Rope, RopeStyle};
use crate::rng::SplitMix64;
use crate::serving::model::{Model, ModelKind};
use crate::{Error, Result};

/// The synthetic model's shape and features.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticConfig {
    /// Decoder, encoder-only or encoder-decoder.
    pub kind: ModelKind,
    /// Decoder layers (none for an encoder-only model).
    pub layers: usize,
    /// Encoder layers (none for a decoder).
    pub encoder_layers: usize,
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
    /// ALiBi instead of RoPE (in decoder self-attention; an encoder always uses RoPE).
    pub alibi: bool,
    /// Keys older than this many positions are not attended (decoder self-attention).
    pub sliding_window: Option<usize>,
    /// Attention logits soft cap (every attention).
    pub soft_cap: Option<f32>,
    /// The weights' seed.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            kind: ModelKind::Decoder,
            layers: 4,
            encoder_layers: 0,
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

/// The synthetic decoders `--synthetic` names: the default (small, for tests and workloads)
/// and real models' shapes.
pub const PRESETS: [&str; 3] = ["small", "smollm2", "llama3-8b"];

impl SyntheticConfig {
    /// The decoder preset `name` (one of [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "small" => Ok(SyntheticConfig::default()),
            "smollm2" => Ok(SyntheticConfig::smollm2()),
            "llama3-8b" => Ok(SyntheticConfig::llama3_8b()),
            other => Err(Error::Model(format!(
                "synthetic model {other:?}: expected one of {}",
                PRESETS.join(", ")
            ))),
        }
    }

    /// A decoder shaped like SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 query heads and
    /// 3 kv heads of 64, a vocabulary of 49152, bf16, its own LM head (the real model ties it
    /// to the embedding: the same bytes a step reads). On the GPU its step costs what the real
    /// model's does (the GPU model holds every weight in bf16), without carrying the file.
    pub fn smollm2() -> Self {
        SyntheticConfig {
            layers: 30,
            hidden: 576,
            ffn: 1536,
            heads: 9,
            kv_heads: 3,
            head_size: 64,
            vocab: 49_152,
            max_context: 8192,
            ..SyntheticConfig::default()
        }
    }

    /// A decoder shaped like Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 32 query heads and
    /// 8 kv heads of 128, a vocabulary of 128256, bf16; weights drawn from the seed (8.0 B
    /// parameters: 16 GB in bf16).
    pub fn llama3_8b() -> Self {
        SyntheticConfig {
            layers: 32,
            hidden: 4096,
            ffn: 14336,
            heads: 32,
            kv_heads: 8,
            head_size: 128,
            vocab: 128_256,
            max_context: 8192,
            ..SyntheticConfig::default()
        }
    }

    /// The default shape as an encoder-decoder model: 4 encoder and 4 decoder layers.
    pub fn encoder_decoder() -> Self {
        SyntheticConfig {
            kind: ModelKind::EncoderDecoder,
            encoder_layers: 4,
            ..SyntheticConfig::default()
        }
    }

    /// The default shape as an encoder-only model: 4 encoder layers.
    pub fn encoder_only() -> Self {
        SyntheticConfig {
            kind: ModelKind::EncoderOnly,
            layers: 0,
            encoder_layers: 4,
            ..SyntheticConfig::default()
        }
    }

    /// The model of its kind, boxed for the engine.
    pub fn build_model(&self) -> Result<Box<dyn Model>> {
        Ok(match self.kind {
            ModelKind::Decoder => Box::new(self.build()?),
            ModelKind::EncoderOnly | ModelKind::EncoderDecoder => Box::new(self.build_encdec()?),
        })
    }

    /// The decoder (`kind` decoder) with weights drawn from `seed`: projections uniform in
    /// ±1/√fan-in (so the residual stream stays of order one), norm weights 1.
    pub fn build(&self) -> Result<Llama> {
        self.expect_layers(ModelKind::Decoder)?;
        let mut draw = Draw::new(self.seed);
        let layers = (0..self.layers)
            .map(|_| draw.layer(self))
            .collect::<Result<Vec<_>>>()?;
        let head = draw.matrix(self.vocab, self.hidden)?;
        let embedding = self.embedding()?;
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
                max_context: self.max_context,
                stop_tokens: Vec::new(),
                first_plain_token: 0,
            },
            InputEmbedding::plain(embedding),
            layers,
            unit_norm(self.hidden),
            head,
            rope,
            vec![attention; self.layers],
            self.dtype,
        )
    }

    /// The encoder-only or encoder-decoder model of this config (`kind` encoder-only or encoder-decoder), weights drawn
    /// from its seed as the decoder's are: the encoder's layers, then each decoder layer's
    /// (self-attention and MLP, then cross-attention), then the head. ALiBi and the sliding
    /// window apply to the decoder's self-attention, the soft cap everywhere, the cache dtype
    /// to both caches.
    pub fn build_encdec(&self) -> Result<EncDec> {
        let c = self;
        let kind = c.kind;
        if kind == ModelKind::Decoder {
            return Err(Error::Model(
                "synthetic kind = Decoder: EncDec builds encoder-only and encoder-decoder models"
                    .into(),
            ));
        }
        c.expect_layers(kind)?;
        let mut draw = Draw::new(c.seed);
        let encoder = (0..c.encoder_layers)
            .map(|_| draw.layer(c))
            .collect::<Result<Vec<_>>>()?;
        let (q, kv) = (c.heads * c.head_size, c.kv_heads * c.head_size);
        let decoder = (0..c.layers)
            .map(|_| {
                let layer = draw.layer(c)?;
                let cross = CrossWeights {
                    norm: unit_norm(c.hidden),
                    wq: draw.matrix(q, c.hidden)?,
                    wk: draw.matrix(kv, c.hidden)?,
                    wv: draw.matrix(kv, c.hidden)?,
                    wo: draw.matrix(c.hidden, q)?,
                };
                Ok((layer, cross))
            })
            .collect::<Result<Vec<_>>>()?;
        let head = match kind {
            ModelKind::EncoderDecoder => Some(draw.matrix(c.vocab, c.hidden)?),
            _ => None,
        };
        let config = |attn_type: AttnType| {
            let decoder = attn_type == AttnType::Decoder;
            let cached = attn_type.uses_cache();
            AttentionConfig::builder(c.heads, c.head_size)
                .num_kv_heads(c.kv_heads)
                .attn_type(attn_type)
                .alibi_slopes((decoder && c.alibi).then(|| alibi_slopes_bloom(c.heads)))
                .sliding_window(c.sliding_window.filter(|_| decoder))
                .logits_soft_cap(c.soft_cap)
                .kv_cache_dtype(if cached {
                    c.kv_cache_dtype
                } else {
                    KvCacheDtype::Auto
                })
                .build()
        };
        let encoder_type = match kind {
            ModelKind::EncoderOnly => AttnType::EncoderOnly,
            _ => AttnType::Encoder,
        };
        let mut attention = vec![config(encoder_type)?; c.encoder_layers];
        for _ in 0..c.layers {
            attention.push(config(AttnType::Decoder)?);
            attention.push(config(AttnType::EncoderDecoder)?);
        }
        let name = format!(
            "synthetic {} ({} encoder{} layers, {}/{} heads of {}, {})",
            match kind {
                ModelKind::EncoderOnly => "encoder-only",
                _ => "encoder-decoder",
            },
            c.encoder_layers,
            if c.layers > 0 {
                format!(" + {} decoder", c.layers)
            } else {
                String::new()
            },
            c.heads,
            c.kv_heads,
            c.head_size,
            c.dtype
        );
        let embedding = InputEmbedding::plain(c.embedding()?);
        let decoder_embedding = (kind == ModelKind::EncoderDecoder)
            .then(|| InputEmbedding::shared(embedding.tokens.clone()));
        Ok(EncDec {
            name,
            kind,
            hidden: c.hidden,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_size: c.head_size,
            vocab: c.vocab,
            max_context: c.max_context,
            placement: Placement::Pre,
            encoder_embedding: embedding,
            decoder_embedding,
            encoder,
            encoder_norm: Some(unit_norm(c.hidden)),
            decoder,
            out_norm: Some(unit_norm(c.hidden)),
            head,
            pooling: Pooling::State,
            pooler: None,
            rope: Some(Rope::new(c.head_size, 10_000.0, RopeStyle::Neox)?),
            decoder_rope: !c.alibi,
            attention,
            dtype: c.dtype,
            stop_tokens: Vec::new(),
        })
    }

    /// Checks that the config describes a model of `kind` with the layers it needs: a
    /// decoder has decoder layers and no encoder, an encoder-only model encoder layers and no
    /// decoder, an encoder-decoder model both.
    pub(crate) fn expect_layers(&self, kind: ModelKind) -> Result<()> {
        let bad = |field: &str, value: usize, expected: &str| {
            Err(Error::Model(format!(
                "synthetic {field} = {value}: expected {expected} for a {kind:?} model"
            )))
        };
        if self.kind != kind {
            return Err(Error::Model(format!(
                "synthetic kind = {:?}: expected {kind:?} here",
                self.kind
            )));
        }
        match kind {
            ModelKind::Decoder if self.encoder_layers != 0 => {
                bad("encoder_layers", self.encoder_layers, "0")
            }
            ModelKind::EncoderOnly if self.layers != 0 => bad("layers", self.layers, "0"),
            ModelKind::Decoder | ModelKind::EncoderDecoder if self.layers == 0 => {
                bad("layers", 0, "at least 1")
            }
            ModelKind::EncoderOnly | ModelKind::EncoderDecoder if self.encoder_layers == 0 => {
                bad("encoder_layers", 0, "at least 1")
            }
            _ => Ok(()),
        }
    }

    /// The token embedding, uniform in ±1, from its own stream of the seed.
    pub(crate) fn embedding(&self) -> Result<Embedding> {
        let mut rng = SplitMix64::new(self.seed ^ 0xE3B3_D1D0);
        let table = uniform(&mut rng, self.vocab * self.hidden, 1.0);
        Embedding::from_f32(&table, self.vocab, self.hidden)
            .map_err(|e| Error::Model(e.to_string()))
    }
}

/// The next `n` draws of `stream`, each uniform in ±`bound`, drawn in parallel blocks (an
/// 8B-parameter model's weights in seconds, not minutes): the same values as drawn one by one.
fn uniform(stream: &mut SplitMix64, n: usize, bound: f64) -> Vec<f32> {
    const BLOCK: usize = 1 << 16;
    let mut values = vec![0.0f32; n];
    values
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(i, block)| {
            let mut s = stream.clone();
            s.skip((i * BLOCK) as u64);
            for v in block {
                *v = ((2.0 * s.next_f64() - 1.0) * bound) as f32;
            }
        });
    stream.skip(n as u64);
    values
}

/// The synthetic weights' draw: one stream of the seed, matrices in the order asked.
pub(crate) struct Draw(SplitMix64);

impl Draw {
    /// The stream of `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Draw(SplitMix64::new(seed))
    }

    /// An `[out, inp]` projection, uniform in ±1/√inp: the stream's next `out · inp` draws.
    pub(crate) fn matrix(&mut self, out: usize, inp: usize) -> Result<Linear> {
        let n = out
            .checked_mul(inp)
            .ok_or_else(|| Error::Model(format!("a {out} x {inp} projection")))?;
        let values = uniform(&mut self.0, n, 1.0 / (inp as f64).sqrt());
        Linear::from_f32(&values, out, inp, Precision::Exact)
            .map_err(|e| Error::Model(e.to_string()))
    }

    /// One attention-and-MLP layer of `c`'s shape, norm weights 1.
    pub(crate) fn layer(&mut self, c: &SyntheticConfig) -> Result<LayerWeights> {
        let (q, kv) = (c.heads * c.head_size, c.kv_heads * c.head_size);
        Ok(LayerWeights::llama(
            vec![1.0; c.hidden],
            [
                self.matrix(q, c.hidden)?,
                self.matrix(kv, c.hidden)?,
                self.matrix(kv, c.hidden)?,
                self.matrix(c.hidden, q)?,
            ],
            vec![1.0; c.hidden],
            [
                self.matrix(c.ffn, c.hidden)?,
                self.matrix(c.ffn, c.hidden)?,
                self.matrix(c.hidden, c.ffn)?,
            ],
            SYNTHETIC_EPS,
        ))
    }
}

/// The synthetic models' RMSNorm epsilon.
const SYNTHETIC_EPS: f32 = 1e-5;

/// An RMSNorm of weights 1.
fn unit_norm(hidden: usize) -> Norm {
    Norm::Rms {
        weight: vec![1.0; hidden],
        eps: SYNTHETIC_EPS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_draws_are_the_streams_draws_in_order() {
        let n = 3 * (1 << 16) + 17;
        let mut one_by_one = SplitMix64::new(3);
        let want: Vec<f32> = (0..n)
            .map(|_| ((2.0 * one_by_one.next_f64() - 1.0) * 0.5) as f32)
            .collect();
        let mut stream = SplitMix64::new(3);
        assert_eq!(uniform(&mut stream, n, 0.5), want);
        // The stream continues after them.
        assert_eq!(stream.next_u64(), one_by_one.next_u64());
    }

    #[test]
    fn presets_are_named_and_others_refused() {
        assert_eq!(
            SyntheticConfig::preset("small").unwrap(),
            SyntheticConfig::default()
        );
        let big = SyntheticConfig::preset("llama3-8b").unwrap();
        assert_eq!(
            (big.layers, big.hidden, big.ffn, big.vocab),
            (32, 4096, 14336, 128_256)
        );
        let e = SyntheticConfig::preset("gpt5").unwrap_err().to_string();
        assert!(e.contains("small, smollm2, llama3-8b"), "{e}");
        let smol = SyntheticConfig::preset("smollm2").unwrap();
        assert_eq!(
            (smol.layers, smol.heads, smol.kv_heads, smol.head_size),
            (30, 9, 3, 64)
        );
    }
}
