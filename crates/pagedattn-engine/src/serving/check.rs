//! The engine's hook for checking its attention calls: after a call it hands the call's
//! tensors and where its keys and values are to a [`CallCheck`] (the harness's verifier,
//! which recomputes the call with the `reference` backend). The core knows the hook, not the
//! oracle.

use pagedattn::{AttentionConfig, Backend, BlockId, KvCache, Tensor};

use crate::serving::report::VerifyCounts;

/// A check of the engine's attention calls on sampled steps (`Send`: a tensor-parallel
/// engine checks each rank's calls from that rank's thread, one call at a time).
pub trait CallCheck: Send {
    /// The attentions (indices into the model's layers) to check in a step of a model of
    /// `num_layers` attentions; drawn once per step (a step calls an encoder's attentions
    /// only when it runs the encoder). A step with some is not replayed from a CUDA graph.
    fn layers_for_step(&mut self, num_layers: usize) -> Vec<usize>;

    /// Checks one call of step `at.0`, attention `at.1`: `config` its attention, `call`
    /// where its keys and values are on `backend`, `qkv` and `output` its tensors. Errors of
    /// the library are returned as they are; a wrong output is `Ok(Err(Mismatch))`.
    fn check_call(
        &mut self,
        at: (usize, usize),
        backend: &dyn Backend,
        config: &AttentionConfig,
        call: CheckedCall<'_>,
        qkv: (&Tensor, &Tensor, &Tensor),
        output: &Tensor,
    ) -> pagedattn::Result<Result<(), Mismatch>>;

    /// The counts so far (the engine fills in `calls_total`).
    fn counts(&self) -> &VerifyCounts;
}

/// One sequence of a checked call: tokens already cached, new tokens, its block table.
#[derive(Clone, Copy, Debug)]
pub struct CheckedSeq<'a> {
    /// Tokens in the cache before the call.
    pub cached: usize,
    /// Tokens the call computes.
    pub new: usize,
    /// Its block table in the engine's cache.
    pub table: &'a [BlockId],
}

/// A checked call's sequences, by what the call attends over.
#[derive(Clone, Copy, Debug)]
pub enum CheckedCall<'a> {
    /// Causal self-attention over the layer's paged cache (`decoder`), which the call wrote
    /// its new keys and values to.
    Paged {
        /// The layer's cache on the engine's backend, after the call.
        cache: &'a KvCache,
        /// The call's sequences.
        seqs: &'a [CheckedSeq<'a>],
    },
    /// Bidirectional attention over each sequence's own tokens, without a cache (`encoder`,
    /// `encoder_only`).
    Dense {
        /// Each sequence's tokens (queries and keys alike).
        lens: &'a [usize],
    },
    /// Cross-attention over the cross cache (`encoder_decoder`), which the call wrote the
    /// encoder keys and values it carried to.
    Cross {
        /// The layer's cross cache on the engine's backend, after the call.
        cache: &'a KvCache,
        /// The call's sequences.
        seqs: &'a [CheckedCross<'a>],
    },
}

/// One sequence of a checked cross-attention call.
#[derive(Clone, Copy, Debug)]
pub struct CheckedCross<'a> {
    /// Decoder tokens the call computes (its queries).
    pub new: usize,
    /// Its encoder's tokens (the keys it attends).
    pub encoder_len: usize,
    /// Its cross block table in the engine's cross cache.
    pub table: &'a [BlockId],
    /// Whether the call carried its encoder keys and values (they follow those of the
    /// previous written sequences in the call's key/value tensors) rather than reading them
    /// from the cross cache.
    pub written: bool,
}

/// A recomputed call whose output is further from `reference`'s than the output dtype
/// allows, or whose inputs were not finite (the model's doing: not compared).
#[derive(Debug, PartialEq)]
pub struct Mismatch {
    /// The engine's step.
    pub step: usize,
    /// The layer.
    pub layer: usize,
    /// The largest difference beyond one ulp, as a fraction of the largest output magnitude
    /// (NaN where the inputs were not finite).
    pub worst: f32,
    /// The dtype's allowance.
    pub allowed: f32,
    /// Whether the call's query, keys and values were all finite.
    pub inputs_finite: bool,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (step, layer) = (self.step, self.layer);
        if self.inputs_finite {
            write!(
                f,
                "verification failed at step {step}, layer {layer}: the output differs from \
                 reference's on dense keys and values by {:.2e} of its largest magnitude \
                 (allowed {:.0e})",
                self.worst, self.allowed
            )
        } else {
            write!(
                f,
                "model: the attention of layer {layer} at step {step} was given a non-finite \
                 query, key or value (NaN or ±inf): the model computed it before this \
                 attention"
            )
        }
    }
}

impl std::error::Error for Mismatch {}
