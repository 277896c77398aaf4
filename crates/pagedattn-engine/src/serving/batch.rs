//! What the scheduler hands the model runner for one step, and what the runner hands back.

use pagedattn::BlockId;

/// A sequence's id, unique for the engine's lifetime (a request with `n` samples has `n`).
pub type SeqId = u64;

/// A request's id, unique for the engine's lifetime.
pub type RequestId = u64;

/// One step's work: block moves first (in this order: `swap_out`, `swap_in`, `copies`), then
/// one forward over `seqs`, then sampling.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepBatch {
    /// The sequences computed this step, in metadata order: prompt chunks first, then decodes
    /// (one new token each). May be empty in a step that only moves blocks (`swap_out`).
    pub seqs: Vec<ScheduledSeq>,
    /// (device block, host swap block) pairs to copy out, every layer.
    pub swap_out: Vec<(BlockId, BlockId)>,
    /// (host swap block, device block) pairs to copy in, every layer.
    pub swap_in: Vec<(BlockId, BlockId)>,
    /// (source, destination) device block pairs to copy (copy-on-write), every layer.
    pub copies: Vec<(BlockId, BlockId)>,
}

/// One sequence of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledSeq {
    /// The sequence.
    pub seq: SeqId,
    /// The request it belongs to.
    pub request: RequestId,
    /// Tokens of the sequence already in the cache (computed by earlier steps, or found in
    /// the prefix cache).
    pub cached: usize,
    /// The token ids computed this step, at positions `cached..cached + tokens.len()`; never
    /// empty.
    pub tokens: Vec<u32>,
    /// Its block table, covering at least `cached + tokens.len()` tokens. Entries of blocks
    /// the sliding window released read as the placeholder block 0 (their keys are never
    /// attended).
    pub block_table: Vec<BlockId>,
    /// How many tokens to sample from the logits of this step's last token: 0 for a prompt
    /// chunk that is not the prompt's last, 1 for a decode, `n` for the last chunk of a
    /// request's prompt with `n` samples (parallel sampling forks the sequence).
    pub num_samples: usize,
    /// Which sample of its request this sequence is (its place in sample order; a prompt
    /// that forks into `n` samples is sample 0 and draws samples `0..n`): with the
    /// request's seed and the position, what a sampled token's random draw depends on.
    pub sample: usize,
    /// Whether this is a decode (one new token after the sequence's computed tokens) rather
    /// than a prompt chunk; decodes come after every prompt chunk.
    pub is_decode: bool,
    /// The encoder side of an encoder-decoder request's sequence: what its cross-attention
    /// reads (`None` for other requests).
    pub cross: Option<CrossSeq>,
    /// Whether this is an encoder-only request's whole prompt, attended bidirectionally
    /// without a cache (`block_table` empty, `cached` and `num_samples` 0): its output is
    /// pooled, not sampled, and the request finishes with this step.
    pub encoder_only: bool,
}

/// The encoder side of a scheduled sequence of an encoder-decoder request.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossSeq {
    /// Its encoder prompt's length: the tokens of the cross cache.
    pub len: usize,
    /// The request's cross-cache block table (covering `len` tokens), shared by its samples.
    pub block_table: Vec<BlockId>,
    /// The encoder prompt when this step runs the encoder and writes the cross keys and
    /// values (the request's first decoder step, once per request and admission: the first
    /// of its sequences scheduled in that step); `None` when they are read from the cross
    /// cache.
    pub encoder_tokens: Option<Vec<u32>>,
}
