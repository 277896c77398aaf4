//! What the engine needs of a model: its layers' attention shapes, and a forward pass over
//! one step's tokens that calls back into the engine for every layer's attention.

use pagedattn::{AttentionConfig, DType, Tensor};

/// One step's tokens, in the step's metadata order (each sequence's new tokens together).
#[derive(Clone, Copy, Debug)]
pub struct StepTokens<'a> {
    /// The token ids.
    pub tokens: &'a [u32],
    /// Each token's position in its sequence.
    pub positions: &'a [usize],
    /// The rows (indices into `tokens`) whose logits are wanted, in order.
    pub logit_rows: &'a [usize],
}

/// A layer's attention, run by the engine: `(layer, query, key, value, output)` with
/// `query`/`output` of `[T, H, D]` and `key`/`value` of `[T, Hkv, D]`, on the engine's
/// backend's device and in [`Model::dtype`].
pub type Attend<'a> =
    dyn FnMut(usize, &Tensor, &Tensor, &Tensor, &mut Tensor) -> crate::Result<()> + 'a;

/// A model the engine serves.
pub trait Model: Send {
    /// A name for reports.
    fn name(&self) -> String;
    /// Every layer's attention config, in layer order.
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
    /// Runs the model over `step`, calling `attend` once per layer in order, and writes the
    /// logits of `step.logit_rows` into `logits` (`[rows, vocab]`, resized).
    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> crate::Result<()>;
}
