//! Encoder-only and encoder-decoder models on the CPU, of the Llama blocks (RMSNorm, RoPE,
//! SwiGLU MLP): an encoder of bidirectional self-attention layers (`encoder`, or
//! `encoder_only` for a BERT-like model whose output is the pooled final state of each
//! sequence's first token), and for an encoder-decoder model (T5/BART-like) a decoder whose
//! layers run causal self-attention over the paged cache, cross-attention over the encoder's
//! output (`encoder_decoder`, through the cross cache), then the MLP.
//!
//! Attention indices ([`Model::layers`]): the encoder's layers first, then per decoder layer
//! its self-attention and its cross-attention.

use pagedattn::{alibi_slopes_bloom, AttentionConfig, AttnType, DType, KvCacheDtype, Tensor};

use crate::llama::{LayerWeights, MlpBuffers};
use crate::model::{Attend, Model, ModelKind, StepTokens};
use crate::ops::{add_assign, rms_norm, Embedding, Linear, Rope, RopeStyle};
use crate::synthetic::{Draw, SyntheticConfig};
use crate::{Error, Result};

/// A decoder layer's cross-attention weights.
struct CrossWeights {
    /// RMSNorm weight before cross-attention.
    norm: Vec<f32>,
    /// Query projection of the decoder's states.
    wq: Linear,
    /// Key projection of the encoder's output.
    wk: Linear,
    /// Value projection of the encoder's output.
    wv: Linear,
    /// Output projection.
    wo: Linear,
}

/// An attention sublayer's weights, borrowed from a [`LayerWeights`] or [`CrossWeights`].
struct AttnWeights<'a> {
    norm: &'a [f32],
    wq: &'a Linear,
    wk: &'a Linear,
    wv: &'a Linear,
    wo: &'a Linear,
}

impl<'a> From<&'a LayerWeights> for AttnWeights<'a> {
    fn from(w: &'a LayerWeights) -> Self {
        AttnWeights {
            norm: &w.attn_norm,
            wq: &w.wq,
            wk: &w.wk,
            wv: &w.wv,
            wo: &w.wo,
        }
    }
}

impl<'a> From<&'a CrossWeights> for AttnWeights<'a> {
    fn from(w: &'a CrossWeights) -> Self {
        AttnWeights {
            norm: &w.norm,
            wq: &w.wq,
            wk: &w.wk,
            wv: &w.wv,
            wo: &w.wo,
        }
    }
}

/// Where an attention sublayer's keys and values come from.
enum KvSource<'a> {
    /// The sublayer's own (normed) input, rotated by RoPE at these positions if `Some`
    /// (self-attention).
    Own(Option<&'a [usize]>),
    /// Another stream's rows, used as they are (cross-attention over the encoder's output).
    Other(&'a [f32]),
}

/// An encoder-only or encoder-decoder model (see the [module docs](self)).
pub struct EncDec {
    name: String,
    kind: ModelKind,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_size: usize,
    vocab: usize,
    max_context: usize,
    rms_eps: f32,
    embedding: Embedding,
    encoder: Vec<LayerWeights>,
    encoder_norm: Vec<f32>,
    /// Each decoder layer: self-attention and MLP, cross-attention.
    decoder: Vec<(LayerWeights, CrossWeights)>,
    out_norm: Vec<f32>,
    /// The LM head (`None` for an encoder-only model, which outputs states).
    head: Option<Linear>,
    rope: Rope,
    /// Whether the decoder's self-attention rotates by RoPE (not with ALiBi).
    decoder_rope: bool,
    attention: Vec<AttentionConfig>,
    dtype: DType,
}

impl EncDec {
    /// The synthetic model of `c` (`kind` encoder-only or encoder-decoder), weights drawn
    /// from its seed as the decoder's are: the encoder's layers, then each decoder layer's
    /// (self-attention and MLP, then cross-attention), then the head. ALiBi and the sliding
    /// window apply to the decoder's self-attention, the soft cap everywhere, the cache dtype
    /// to both caches.
    pub fn synthetic(c: &SyntheticConfig) -> Result<Self> {
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
                    norm: vec![1.0; c.hidden],
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
        Ok(EncDec {
            name,
            kind,
            hidden: c.hidden,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_size: c.head_size,
            vocab: c.vocab,
            max_context: c.max_context,
            rms_eps: 1e-5,
            embedding: c.embedding()?,
            encoder,
            encoder_norm: vec![1.0; c.hidden],
            decoder,
            out_norm: vec![1.0; c.hidden],
            head,
            rope: Rope::new(c.head_size, 10_000.0, RopeStyle::Neox)?,
            decoder_rope: !c.alibi,
            attention,
            dtype: c.dtype,
        })
    }

    /// `x += wo · attend(norm(x) · wq, keys · wk, keys · wv)` for the `x.len() / hidden`
    /// rows of `x`, with attention `layer`; the keys come from `kv`.
    fn attention(
        &self,
        w: AttnWeights<'_>,
        x: &mut [f32],
        kv: KvSource<'_>,
        layer: usize,
        attend: &mut Attend<'_>,
    ) -> Result<()> {
        let t = x.len() / self.hidden;
        let (q_width, kv_width) = (self.heads * self.head_size, self.kv_heads * self.head_size);
        let mut h = vec![0.0; x.len()];
        rms_norm(x, w.norm, self.rms_eps, &mut h)?;
        let mut q = vec![0.0; t * q_width];
        w.wq.forward(&h, &mut q)?;
        let (source, positions) = match kv {
            KvSource::Own(positions) => (h.as_slice(), positions),
            KvSource::Other(rows) => (rows, None),
        };
        let tk = source.len() / self.hidden;
        let (mut k, mut v) = (vec![0.0; tk * kv_width], vec![0.0; tk * kv_width]);
        // (A cross-attention of a step without encoder tokens has no key to project.)
        if tk > 0 {
            w.wk.forward(source, &mut k)?;
            w.wv.forward(source, &mut v)?;
        }
        if let Some(positions) = positions {
            self.rope.apply(&mut q, positions, self.heads)?;
            self.rope.apply(&mut k, positions, self.kv_heads)?;
        }
        let tensor = |rows: usize, heads: usize, values: &[f32]| {
            Tensor::from_f32(self.dtype, &[rows, heads, self.head_size], values)
        };
        let (qt, kt, vt) = (
            tensor(t, self.heads, &q)?,
            tensor(tk, self.kv_heads, &k)?,
            tensor(tk, self.kv_heads, &v)?,
        );
        let mut ot = Tensor::zeros(self.dtype, &[t, self.heads, self.head_size])?;
        attend(layer, &qt, &kt, &vt, &mut ot)?;
        let mut out = vec![0.0; x.len()];
        w.wo.forward(&ot.to_f32_vec()?, &mut out)?;
        add_assign(x, &out)?;
        Ok(())
    }

    /// The encoder over `tokens` at `positions`: its final normed states, `[T, hidden]`.
    fn encode(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attend: &mut Attend<'_>,
    ) -> Result<Vec<f32>> {
        let mut x = vec![0.0; tokens.len() * self.hidden];
        self.embedding.lookup(tokens, &mut x)?;
        for (l, layer) in self.encoder.iter().enumerate() {
            self.attention(
                layer.into(),
                &mut x,
                KvSource::Own(Some(positions)),
                l,
                attend,
            )?;
            layer.mlp(&mut x, self.rms_eps, &mut MlpBuffers::default())?;
        }
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &self.encoder_norm, self.rms_eps, &mut out)?;
        Ok(out)
    }

    /// The rows `rows` of `x`, normed by `norm`.
    fn rows(&self, x: &[f32], rows: &[usize], norm: &[f32]) -> Result<Vec<f32>> {
        let picked: Vec<f32> = rows
            .iter()
            .flat_map(|&r| &x[r * self.hidden..(r + 1) * self.hidden])
            .copied()
            .collect();
        let mut out = vec![0.0; picked.len()];
        rms_norm(&picked, norm, self.rms_eps, &mut out)?;
        Ok(out)
    }
}

impl Model for EncDec {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn kind(&self) -> ModelKind {
        self.kind
    }

    fn layers(&self) -> &[AttentionConfig] {
        &self.attention
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn stop_tokens(&self) -> Vec<u32> {
        Vec::new()
    }

    fn first_plain_token(&self) -> u32 {
        0
    }

    fn output_width(&self) -> usize {
        match self.kind {
            ModelKind::EncoderOnly => self.hidden,
            _ => self.vocab,
        }
    }

    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if self.kind == ModelKind::EncoderOnly {
            // The final states (already normed by the encoder) of the asked rows: each
            // sequence's first token, its pooled state (BERT's [CLS] pooling).
            let states = self.encode(step.tokens, step.positions, attend)?;
            logits.clear();
            for &r in step.logit_rows {
                logits.extend_from_slice(&states[r * self.hidden..(r + 1) * self.hidden]);
            }
            return Ok(());
        }
        let encoded = if step.encoder_tokens.is_empty() {
            Vec::new()
        } else {
            self.encode(step.encoder_tokens, step.encoder_positions, attend)?
        };
        let mut x = vec![0.0; step.tokens.len() * self.hidden];
        self.embedding.lookup(step.tokens, &mut x)?;
        let first = self.encoder.len();
        let positions = self.decoder_rope.then_some(step.positions);
        for (l, (layer, cross)) in self.decoder.iter().enumerate() {
            let index = first + 2 * l;
            self.attention(
                layer.into(),
                &mut x,
                KvSource::Own(positions),
                index,
                attend,
            )?;
            self.attention(
                cross.into(),
                &mut x,
                KvSource::Other(&encoded),
                index + 1,
                attend,
            )?;
            layer.mlp(&mut x, self.rms_eps, &mut MlpBuffers::default())?;
        }
        let h = self.rows(&x, step.logit_rows, &self.out_norm)?;
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| Error::Model("an encoder-decoder model without an LM head".into()))?;
        logits.resize(step.logit_rows.len() * self.vocab, 0.0);
        head.forward(&h, logits)?;
        Ok(())
    }
}
