//! What the engine needs of a model: its kind, its attentions' shapes, and a forward pass over
//! one step's tokens that calls back into the engine for every attention.

use pagedattn::{AttentionConfig, DType, Tensor};

/// One step's tokens, in the step's metadata order (each sequence's new tokens together).
#[derive(Clone, Copy, Debug)]
pub struct StepTokens<'a> {
    /// The token ids.
    pub tokens: &'a [u32],
    /// Each token's position in its sequence.
    pub positions: &'a [usize],
    /// The rows (indices into `tokens`) whose logits (pooled states, for an encoder-only
    /// model) are wanted, in order.
    pub logit_rows: &'a [usize],
    /// An encoder-decoder model's encoder tokens of this step: the encoder prompts of the
    /// sequences whose cross keys and values are written this step, concatenated in step
    /// order (empty in other steps and for other models).
    pub encoder_tokens: &'a [u32],
    /// Each encoder token's position in its encoder prompt.
    pub encoder_positions: &'a [usize],
}

/// What a model computes, which decides how the engine serves its requests (vLLM's model
/// types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// A decoder (Llama): causal self-attention over a paged cache, tokens generated.
    Decoder,
    /// An encoder-only model (BERT-like): one bidirectional pass over a request's tokens,
    /// without a cache; the output is the pooled final state, nothing is generated.
    EncoderOnly,
    /// An encoder-decoder model (T5/BART-like): the encoder runs once over the request's
    /// encoder prompt; the decoder generates, each layer cross-attending to the encoder's
    /// output through a cross cache written at the request's first decoder step.
    EncoderDecoder,
}

/// An attention, run by the engine: `(layer, query, key, value, output)` with `layer` an
/// index into [`Model::layers`], `query`/`output` of `[T, H, D]` and `key`/`value` of
/// `[Tk, Hkv, D]`, on the engine's backend's device and in [`Model::dtype`]. By the layer's
/// [`AttnType`](pagedattn::AttnType): `decoder` and `encoder_only` take the step's tokens
/// (`Tk = T`); `encoder` the step's encoder tokens (queries and keys alike); `encoder_decoder`
/// the step's decoder tokens as queries and the encoder's keys and values of the step's
/// encoder tokens (`Tk` = their count, 0 in a step that runs no encoder).
pub type Attend<'a> =
    dyn FnMut(usize, &Tensor, &Tensor, &Tensor, &mut Tensor) -> crate::Result<()> + 'a;

/// The token [`Model::forward_greedy`] gives a row whose logits are not all finite (no token
/// is this large): the engine stops with [`Error::NonFinite`](crate::Error::NonFinite).
pub const NON_FINITE_TOKEN: u32 = u32::MAX;

/// The first element of `values` (rows of `width`) that is not finite, as `(row, column)`.
pub fn first_non_finite(values: &[f32], width: usize) -> Option<(usize, usize)> {
    let at = values.iter().position(|v| !v.is_finite())?;
    Some((at / width.max(1), at % width.max(1)))
}

/// A model the engine serves.
pub trait Model: Send {
    /// A name for reports.
    fn name(&self) -> String;
    /// What it computes (how its requests are served).
    fn kind(&self) -> ModelKind {
        ModelKind::Decoder
    }
    /// Every attention's config (the `layer` of [`Attend`] indexes it). The engine gives
    /// each `decoder` attention a paged cache and each `encoder_decoder` one a cross cache;
    /// `encoder` and `encoder_only` attentions run without one.
    fn layers(&self) -> &[AttentionConfig];
    /// The dtype of the query, key, value and output tensors (and of the KV cache).
    fn dtype(&self) -> DType;
    /// Token ids are below this.
    fn vocab_size(&self) -> usize;
    /// The longest sequence (prompt and output) it serves.
    fn max_context(&self) -> usize;
    /// Token ids that end a sample (end of sequence, end of turn).
    fn stop_tokens(&self) -> Vec<u32>;
    /// Token ids below this are special (workloads draw random prompts above it).
    fn first_plain_token(&self) -> u32;
    /// Width of a row of [`forward`](Self::forward)'s output: the vocabulary for models that
    /// generate (logits), the pooled state's width for encoder-only models.
    fn output_width(&self) -> usize {
        self.vocab_size()
    }
    /// Runs the model over `step`, calling `attend` once per attention it runs (the encoder's
    /// only in steps with encoder tokens), and writes the rows `step.logit_rows` of its
    /// output into `logits` (`[rows, output_width]`, resized): logits, or an encoder-only
    /// model's pooled states.
    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> crate::Result<()>;

    /// The model's work as stages a CUDA graph can capture, where every op of it is queued
    /// on the engine backend's GPU stream (`None`, the default, for a model computing on the
    /// host). The engine replays decode steps through graphs with them.
    fn graph_stages(&mut self) -> Option<&mut dyn GraphStages> {
        None
    }

    /// [`forward`](Self::forward) for a step whose every sample is greedy: writes each of
    /// `step.logit_rows`' greedy token ([`argmax`](crate::serving::sample::argmax) of its logits) into
    /// `tokens` (resized), [`NON_FINITE_TOKEN`] for a row with a NaN or an infinity. `logits`
    /// is scratch space. A model whose logits live on a device overrides this to bring back
    /// the tokens alone.
    fn forward_greedy(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
        tokens: &mut Vec<u32>,
    ) -> crate::Result<()> {
        self.forward(step, attend, logits)?;
        let width = self.output_width().max(1);
        tokens.clear();
        tokens.extend(logits.chunks_exact(width).map(|row| {
            if row.iter().all(|v| v.is_finite()) {
                crate::serving::sample::argmax(row)
            } else {
                NON_FINITE_TOKEN
            }
        }));
        Ok(())
    }
}

/// A decode step in three stages, so that the middle one can be captured in a CUDA graph and
/// replayed: the step's inputs are copied in first, the greedy tokens copied out last.
///
/// # Safety
/// The engine replays a captured [`compute`](Self::compute) while
/// [`generation`](Self::generation) is unchanged: until it changes, every piece of device
/// memory a compute for a `padded` used (inputs, activations, the tensors it passed to
/// `attend`, weights, workspaces) stays allocated at the same address, and a later
/// [`load`](Self::load) of that `padded` writes its inputs there.
pub unsafe trait GraphStages {
    /// Makes room for steps of up to `tokens` tokens and `rows` logit rows, so that no such
    /// step changes the [`generation`](Self::generation) afterwards (the engine calls it
    /// before capturing).
    fn reserve(&mut self, tokens: usize, rows: usize) -> crate::Result<()>;

    /// Copies a step's tokens, positions and logit rows into the model's device buffers, the
    /// tokens padded to `padded` (rows that no logit row names).
    fn load(&mut self, step: &StepTokens<'_>, padded: usize) -> crate::Result<()>;

    /// Queues the forward of the `padded` loaded tokens up to the greedy token of each of the
    /// first `rows` logit rows, calling `attend` per layer: device work only, no copy from or
    /// to the host, no wait, and no allocation for a `padded` seen by [`load`](Self::load).
    fn compute(&mut self, padded: usize, rows: usize, attend: &mut Attend<'_>)
        -> crate::Result<()>;

    /// The greedy tokens of the first `rows` logit rows of the last compute (waits for it).
    fn greedy(&mut self, rows: usize, tokens: &mut Vec<u32>) -> crate::Result<()>;

    /// Changes whenever the model reallocates device memory that a captured compute used: a
    /// graph captured under another generation must not be replayed.
    fn generation(&self) -> u64;
}
