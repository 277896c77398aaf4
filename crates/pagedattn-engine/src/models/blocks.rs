//! The pieces every model family's layers are built of, on the CPU: the input embedding
//! ([`InputEmbedding`]: tokens, then optionally scaled, learned positions, token types and a
//! norm), a layer's weights ([`LayerWeights`]: attention projections with or without biases,
//! norms before and optionally after each sublayer, a gated or plain [`Mlp`]), and where the
//! norms sit around the residual ([`Placement`]). A family is a choice among these, made by
//! its loader (the `families` module); the forward passes (the decoder of the `llama`
//! module, the encoder(-decoder) of `encdec`) run any choice.

use std::sync::Arc;

use crate::models::ops::{activate, add_assign, gated, Activation, Embedding, Linear, Norm};
use crate::{Error, Result};

/// Where a layer's norms sit around each sublayer `f` (attention, MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// `x += f(norm(x))` (Llama, Gemma, BLOOM); with an output norm, `x += out_norm(f(norm(x)))`
    /// (Gemma-2).
    Pre,
    /// `x = norm(x + f(x))` (BERT, BART: the original transformer's).
    Post,
}

/// Buffers a sublayer reuses across calls.
#[derive(Default)]
pub struct SublayerBuffers {
    h: Vec<f32>,
    y: Vec<f32>,
}

impl Placement {
    /// Updates the rows of `x` by the sublayer `f`, which reads its input rows (the first
    /// argument) and writes its output rows (the second, as long as `x`), with `norm` (and
    /// `out_norm`, pre-norm layers only) where this placement puts them.
    pub fn sublayer(
        self,
        x: &mut [f32],
        norm: &Norm,
        out_norm: Option<&Norm>,
        buf: &mut SublayerBuffers,
        f: impl FnOnce(&[f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        buf.h.resize(x.len(), 0.0);
        buf.y.resize(x.len(), 0.0);
        match self {
            Placement::Pre => {
                norm.apply(x, &mut buf.h)?;
                f(&buf.h, &mut buf.y)?;
                if let Some(out_norm) = out_norm {
                    out_norm.apply(&buf.y, &mut buf.h)?;
                    std::mem::swap(&mut buf.h, &mut buf.y);
                }
                Ok(add_assign(x, &buf.y)?)
            }
            Placement::Post => {
                f(x, &mut buf.y)?;
                add_assign(&mut buf.y, x)?;
                Ok(norm.apply(&buf.y, x)?)
            }
        }
    }
}

/// A feed-forward block: `down(act(gate(x)) * up(x))` when gated (SwiGLU, GeGLU), else
/// `down(act(up(x)))`; biases as the [`Linear`]s carry them.
pub struct Mlp {
    /// The gate projection `[ffn, hidden]` of a gated MLP.
    pub gate: Option<Linear>,
    /// The up projection `[ffn, hidden]`.
    pub up: Linear,
    /// The down projection `[hidden, ffn]`.
    pub down: Linear,
    /// The activation.
    pub activation: Activation,
}

/// The MLP's activations, reused across calls.
#[derive(Default)]
pub struct MlpBuffers {
    sublayer: SublayerBuffers,
    acts: MlpActs,
}

/// The MLP's inner activations.
#[derive(Default)]
struct MlpActs {
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

impl Mlp {
    /// Llama's: `down(silu(gate(x)) * up(x))`.
    pub fn swiglu(gate: Linear, up: Linear, down: Linear) -> Self {
        Mlp {
            gate: Some(gate),
            up,
            down,
            activation: Activation::Silu,
        }
    }

    /// The MLP over the rows of `h` (`[t, hidden]`) into `out` (as long).
    fn forward(&self, h: &[f32], out: &mut [f32], buf: &mut MlpActs) -> Result<()> {
        let inner = h.len() / self.up.in_features() * self.up.out_features();
        buf.up.resize(inner, 0.0);
        self.up.forward(h, &mut buf.up)?;
        match &self.gate {
            Some(gate) => {
                buf.gate.resize(inner, 0.0);
                buf.act.resize(inner, 0.0);
                gate.forward(h, &mut buf.gate)?;
                gated(self.activation, &buf.gate, &buf.up, &mut buf.act)?;
                self.down.forward(&buf.act, out)?;
            }
            None => {
                activate(self.activation, &mut buf.up);
                self.down.forward(&buf.up, out)?;
            }
        }
        Ok(())
    }
}

/// One transformer layer's weights (self-attention and MLP; an encoder-decoder model's
/// cross-attention is `encdec`'s `CrossWeights`).
pub struct LayerWeights {
    /// The norm of the attention sublayer (before it, or after the residual add).
    pub attn_norm: Norm,
    /// Query projection `[heads * head_size, hidden]`.
    pub wq: Linear,
    /// Key projection `[kv_heads * head_size, hidden]`.
    pub wk: Linear,
    /// Value projection `[kv_heads * head_size, hidden]`.
    pub wv: Linear,
    /// Output projection `[hidden, heads * head_size]`.
    pub wo: Linear,
    /// A norm of the attention's output before the residual add (Gemma-2).
    pub attn_out_norm: Option<Norm>,
    /// The norm of the MLP sublayer.
    pub ffn_norm: Norm,
    /// The MLP.
    pub mlp: Mlp,
    /// A norm of the MLP's output before the residual add (Gemma-2).
    pub ffn_out_norm: Option<Norm>,
}

impl LayerWeights {
    /// A Llama layer: RMSNorms of `eps` before each sublayer, projections without biases, a
    /// SwiGLU MLP.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        attn_norm: Vec<f32>,
        [wq, wk, wv, wo]: [Linear; 4],
        ffn_norm: Vec<f32>,
        [gate, up, down]: [Linear; 3],
        eps: f32,
    ) -> Self {
        LayerWeights {
            attn_norm: Norm::Rms {
                weight: attn_norm,
                eps,
            },
            wq,
            wk,
            wv,
            wo,
            attn_out_norm: None,
            ffn_norm: Norm::Rms {
                weight: ffn_norm,
                eps,
            },
            mlp: Mlp::swiglu(gate, up, down),
            ffn_out_norm: None,
        }
    }

    /// The layer's MLP sublayer with its residual over the rows of `x` (`[t, hidden]`).
    pub fn mlp(&self, x: &mut [f32], placement: Placement, buf: &mut MlpBuffers) -> Result<()> {
        let MlpBuffers { sublayer, acts } = buf;
        placement.sublayer(
            x,
            &self.ffn_norm,
            self.ffn_out_norm.as_ref(),
            sublayer,
            |h, out| self.mlp.forward(h, out, acts),
        )
    }

    /// Whether this is a [`llama`](Self::llama) layer, with or without biases on its q, k
    /// and v projections (Qwen2's): what the GPU model computes.
    pub fn is_llama(&self) -> bool {
        let plain = |w: &Linear| w.bias().is_none();
        matches!(self.attn_norm, Norm::Rms { .. })
            && matches!(self.ffn_norm, Norm::Rms { .. })
            && self.attn_out_norm.is_none()
            && self.ffn_out_norm.is_none()
            && self.mlp.gate.as_ref().is_some_and(plain)
            && self.mlp.activation == Activation::Silu
            && [&self.wo, &self.mlp.up, &self.mlp.down]
                .into_iter()
                .all(plain)
    }
}

/// Learned absolute position embeddings: row `position + offset` of `table` is added to a
/// token's embedding (BART's table starts its positions at 2).
pub struct LearnedPositions {
    /// `[rows, hidden]`.
    pub table: Vec<f32>,
    /// Added to a position to find its row.
    pub offset: usize,
}

/// A model's input embedding: the token table's rows, times `scale`, plus the learned
/// position's row and the token type's row, then `norm`.
pub struct InputEmbedding {
    /// The token table (shared with a tied LM head's source, or between an encoder and a
    /// decoder).
    pub tokens: Arc<Embedding>,
    /// Multiplies the token rows (Gemma: √hidden; BART with `scale_embedding`).
    pub scale: Option<f32>,
    /// Learned positions (BERT, BART).
    pub positions: Option<LearnedPositions>,
    /// The row added to every token (BERT's token type 0).
    pub token_type: Option<Vec<f32>>,
    /// The norm of the sum (BERT, BART, BLOOM).
    pub norm: Option<Norm>,
}

impl InputEmbedding {
    /// The token table alone (Llama).
    pub fn plain(tokens: Embedding) -> Self {
        Self::shared(Arc::new(tokens))
    }

    /// A table shared with another embedding (an encoder's and a decoder's), alone.
    pub fn shared(tokens: Arc<Embedding>) -> Self {
        InputEmbedding {
            tokens,
            scale: None,
            positions: None,
            token_type: None,
            norm: None,
        }
    }

    /// Whether it is the token table alone.
    pub fn is_plain(&self) -> bool {
        self.scale.is_none()
            && self.positions.is_none()
            && self.token_type.is_none()
            && self.norm.is_none()
    }

    /// The embeddings of `tokens` at `positions` into `out` (`[tokens.len(), hidden]`).
    pub fn embed(&self, tokens: &[u32], positions: &[usize], out: &mut [f32]) -> Result<()> {
        let hidden = self.tokens.hidden();
        self.tokens.lookup(tokens, out)?;
        if let Some(scale) = self.scale {
            out.iter_mut().for_each(|v| *v *= scale);
        }
        if let Some(p) = &self.positions {
            let rows = p.table.len() / hidden;
            for (&pos, row) in positions.iter().zip(out.chunks_exact_mut(hidden)) {
                let r = pos + p.offset;
                if r >= rows {
                    return Err(Error::Model(format!(
                        "position {pos} past the model's {} learned positions",
                        rows.saturating_sub(p.offset)
                    )));
                }
                add_assign(row, &p.table[r * hidden..(r + 1) * hidden])?;
            }
        }
        if let Some(t) = &self.token_type {
            for row in out.chunks_exact_mut(hidden) {
                add_assign(row, t)?;
            }
        }
        if let Some(norm) = &self.norm {
            let summed = out.to_vec();
            norm.apply(&summed, out)?;
        }
        Ok(())
    }
}
