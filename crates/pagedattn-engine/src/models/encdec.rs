//! Encoder-only and encoder-decoder models on the CPU, of the Llama blocks (RMSNorm, RoPE,
//! SwiGLU MLP): an encoder of bidirectional self-attention layers (`encoder`, or
//! `encoder_only` for a BERT-like model whose output is the pooled final state of each
//! sequence's first token), and for an encoder-decoder model (T5/BART-like) a decoder whose
//! layers run causal self-attention over the paged cache, cross-attention over the encoder's
//! output (`encoder_decoder`, through the cross cache), then the MLP.
//!
//! Attention indices ([`Model::layers`]): the encoder's layers first, then per decoder layer
//! its self-attention and its cross-attention.

use pagedattn::{AttentionConfig, DType, Tensor};

use crate::models::check_layer_output;
use crate::models::llama::{LayerWeights, MlpBuffers};
use crate::models::ops::{add_assign, rms_norm, Embedding, Linear, Rope};
use crate::serving::model::{Attend, Model, ModelKind, StepTokens};
use crate::{Error, Result};

/// A decoder layer's cross-attention weights.
pub(crate) struct CrossWeights {
    /// RMSNorm weight before cross-attention.
    pub(crate) norm: Vec<f32>,
    /// Query projection of the decoder's states.
    pub(crate) wq: Linear,
    /// Key projection of the encoder's output.
    pub(crate) wk: Linear,
    /// Value projection of the encoder's output.
    pub(crate) wv: Linear,
    /// Output projection.
    pub(crate) wo: Linear,
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
    pub(crate) name: String,
    pub(crate) kind: ModelKind,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_size: usize,
    pub(crate) vocab: usize,
    pub(crate) max_context: usize,
    pub(crate) rms_eps: f32,
    pub(crate) embedding: Embedding,
    pub(crate) encoder: Vec<LayerWeights>,
    pub(crate) encoder_norm: Vec<f32>,
    /// Each decoder layer: self-attention and MLP, cross-attention.
    pub(crate) decoder: Vec<(LayerWeights, CrossWeights)>,
    pub(crate) out_norm: Vec<f32>,
    /// The LM head (`None` for an encoder-only model, which outputs states).
    pub(crate) head: Option<Linear>,
    pub(crate) rope: Rope,
    /// Whether the decoder's self-attention rotates by RoPE (not with ALiBi).
    pub(crate) decoder_rope: bool,
    pub(crate) attention: Vec<AttentionConfig>,
    pub(crate) dtype: DType,
}

impl EncDec {
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
            check_layer_output(&x, self.hidden, || format!("encoder layer {l}"))?;
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
            check_layer_output(&x, self.hidden, || format!("decoder layer {l}"))?;
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
