//! Encoder-only and encoder-decoder models on the CPU: an encoder of bidirectional
//! self-attention layers (`encoder`, or `encoder_only` for a BERT-like model whose output is
//! each sequence's first token's final state, or BERT's pooler over it), and for an
//! encoder-decoder model (T5/BART-like) a decoder whose layers run causal self-attention over
//! the paged cache, cross-attention over the encoder's output (`encoder_decoder`, through the
//! cross cache), then the MLP. The blocks are [`crate::models::blocks`]'s: norms before
//! (the synthetic models) or after (BERT, BART) each sublayer, RoPE or learned positions.
//!
//! Attention indices ([`Model::layers`]): the encoder's layers first, then per decoder layer
//! its self-attention and its cross-attention.

use pagedattn::{AttentionConfig, DType, Tensor};

use crate::models::blocks::{InputEmbedding, LayerWeights, MlpBuffers, Placement, SublayerBuffers};
use crate::models::check_layer_output;
use crate::models::ops::{Linear, Norm, Rope};
use crate::serving::model::{Attend, Model, ModelKind, StepTokens};
use crate::{Error, Result};

/// A decoder layer's cross-attention weights.
pub struct CrossWeights {
    /// The norm of the cross-attention sublayer.
    pub norm: Norm,
    /// Query projection of the decoder's states.
    pub wq: Linear,
    /// Key projection of the encoder's output.
    pub wk: Linear,
    /// Value projection of the encoder's output.
    pub wv: Linear,
    /// Output projection.
    pub wo: Linear,
}

/// An attention sublayer's weights, borrowed from a [`LayerWeights`] or [`CrossWeights`].
struct AttnWeights<'a> {
    norm: &'a Norm,
    out_norm: Option<&'a Norm>,
    wq: &'a Linear,
    wk: &'a Linear,
    wv: &'a Linear,
    wo: &'a Linear,
}

impl<'a> From<&'a LayerWeights> for AttnWeights<'a> {
    fn from(w: &'a LayerWeights) -> Self {
        AttnWeights {
            norm: &w.attn_norm,
            out_norm: w.attn_out_norm.as_ref(),
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
            out_norm: None,
            wq: &w.wq,
            wk: &w.wk,
            wv: &w.wv,
            wo: &w.wo,
        }
    }
}

/// Where an attention sublayer's keys and values come from.
enum KvSource<'a> {
    /// The sublayer's own input, rotated by RoPE at these positions if `Some`
    /// (self-attention).
    Own(Option<&'a [usize]>),
    /// Another stream's rows, used as they are (cross-attention over the encoder's output).
    Other(&'a [f32]),
}

/// What an encoder-only model outputs for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The final state of the asked rows (the first token's: `[CLS]` pooling, vLLM's
    /// default for BERT embeddings).
    State,
    /// BERT's pooler over that state, `tanh(dense(state))` (transformers' `pooler_output`).
    Pooler,
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
    /// Where every layer's norms sit.
    pub(crate) placement: Placement,
    pub(crate) encoder_embedding: InputEmbedding,
    /// The decoder's (`None` for an encoder-only model).
    pub(crate) decoder_embedding: Option<InputEmbedding>,
    pub(crate) encoder: Vec<LayerWeights>,
    /// The norm of the encoder's output, if it has one.
    pub(crate) encoder_norm: Option<Norm>,
    /// Each decoder layer: self-attention and MLP, cross-attention.
    pub(crate) decoder: Vec<(LayerWeights, CrossWeights)>,
    /// The norm before the LM head, if it has one.
    pub(crate) out_norm: Option<Norm>,
    /// The LM head (`None` for an encoder-only model, which outputs states).
    pub(crate) head: Option<Linear>,
    /// What an encoder-only model outputs.
    pub(crate) pooling: Pooling,
    /// BERT's pooler dense layer, if the model has one.
    pub(crate) pooler: Option<Linear>,
    /// RoPE of self-attention (the encoder's, and the decoder's where `decoder_rope`), or
    /// `None` where positions are learned.
    pub(crate) rope: Option<Rope>,
    /// Whether the decoder's self-attention rotates by RoPE (not with ALiBi).
    pub(crate) decoder_rope: bool,
    pub(crate) attention: Vec<AttentionConfig>,
    pub(crate) dtype: DType,
    pub(crate) stop_tokens: Vec<u32>,
}

impl EncDec {
    /// The same model outputting `pooling` (an encoder-only model's choice).
    ///
    /// # Errors
    /// [`Pooling::Pooler`] for a model without a pooler.
    pub fn with_pooling(mut self, pooling: Pooling) -> Result<Self> {
        if pooling == Pooling::Pooler && self.pooler.is_none() {
            return Err(Error::Model(format!(
                "{}: the model has no pooler",
                self.name
            )));
        }
        self.pooling = pooling;
        Ok(self)
    }

    /// `x` updated by attention sublayer `w` (attention `layer`) over its `x.len() / hidden`
    /// rows, the keys from `kv`.
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
        let mut buf = SublayerBuffers::default();
        self.placement
            .sublayer(x, w.norm, w.out_norm, &mut buf, |h, out| {
                let mut q = vec![0.0; t * q_width];
                w.wq.forward(h, &mut q)?;
                let (source, positions) = match kv {
                    KvSource::Own(positions) => (h, positions),
                    KvSource::Other(rows) => (rows, None),
                };
                let tk = source.len() / self.hidden;
                let (mut k, mut v) = (vec![0.0; tk * kv_width], vec![0.0; tk * kv_width]);
                // (A cross-attention of a step without encoder tokens has no key to project.)
                if tk > 0 {
                    w.wk.forward(source, &mut k)?;
                    w.wv.forward(source, &mut v)?;
                }
                if let (Some(positions), Some(rope)) = (positions, &self.rope) {
                    rope.apply(&mut q, positions, self.heads)?;
                    rope.apply(&mut k, positions, self.kv_heads)?;
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
                Ok(w.wo.forward(&ot.to_f32_vec()?, out)?)
            })
    }

    /// The encoder over `tokens` at `positions`: its final states, `[T, hidden]`.
    fn encode(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attend: &mut Attend<'_>,
    ) -> Result<Vec<f32>> {
        let mut x = vec![0.0; tokens.len() * self.hidden];
        self.encoder_embedding.embed(tokens, positions, &mut x)?;
        let mut mlp = MlpBuffers::default();
        for (l, layer) in self.encoder.iter().enumerate() {
            self.attention(
                layer.into(),
                &mut x,
                KvSource::Own(Some(positions)),
                l,
                attend,
            )?;
            layer.mlp(&mut x, self.placement, &mut mlp)?;
            check_layer_output(&x, self.hidden, || format!("encoder layer {l}"))?;
        }
        normed(x, self.encoder_norm.as_ref())
    }
}

/// `x`'s rows normed by `norm`, or `x` where there is none.
fn normed(x: Vec<f32>, norm: Option<&Norm>) -> Result<Vec<f32>> {
    let Some(norm) = norm else { return Ok(x) };
    let mut out = vec![0.0; x.len()];
    norm.apply(&x, &mut out)?;
    Ok(out)
}

/// The rows `rows` of `x` (rows of `width`).
fn pick(x: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| &x[r * width..(r + 1) * width])
        .copied()
        .collect()
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
        self.stop_tokens.clone()
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
            // The final states of the asked rows (each sequence's first token: BERT's [CLS]),
            // or the pooler over them.
            let states = self.encode(step.tokens, step.positions, attend)?;
            let rows = pick(&states, step.logit_rows, self.hidden);
            match (self.pooling, &self.pooler) {
                (Pooling::Pooler, Some(pooler)) => {
                    logits.resize(rows.len(), 0.0);
                    pooler.forward(&rows, logits)?;
                    logits.iter_mut().for_each(|v| *v = v.tanh());
                }
                _ => *logits = rows,
            }
            return Ok(());
        }
        let encoded = if step.encoder_tokens.is_empty() {
            Vec::new()
        } else {
            self.encode(step.encoder_tokens, step.encoder_positions, attend)?
        };
        let embedding = self.decoder_embedding.as_ref().ok_or_else(|| {
            Error::Model("an encoder-decoder model without a decoder embedding".into())
        })?;
        let mut x = vec![0.0; step.tokens.len() * self.hidden];
        embedding.embed(step.tokens, step.positions, &mut x)?;
        let first = self.encoder.len();
        let positions = self.decoder_rope.then_some(step.positions);
        let mut mlp = MlpBuffers::default();
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
            layer.mlp(&mut x, self.placement, &mut mlp)?;
            check_layer_output(&x, self.hidden, || format!("decoder layer {l}"))?;
        }
        let h = normed(
            pick(&x, step.logit_rows, self.hidden),
            self.out_norm.as_ref(),
        )?;
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| Error::Model("an encoder-decoder model without an LM head".into()))?;
        logits.resize(step.logit_rows.len() * self.vocab, 0.0);
        head.forward(&h, logits)?;
        Ok(())
    }
}
