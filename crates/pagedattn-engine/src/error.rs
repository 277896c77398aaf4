//! The engine's error: one line naming what is wrong. One type for the three wings (the
//! core's, the models' and the harness's errors each a variant), so that a model's error
//! passes through the core's `Model` calls unchanged.

use thiserror::Error;

/// Everything that stops a run.
#[derive(Debug, Error)]
pub enum Error {
    /// The attention library refused something or failed.
    #[error(transparent)]
    Attention(#[from] pagedattn::Error),
    /// A trace or workload the engine cannot use.
    #[error(transparent)]
    Workload(#[from] crate::harness::workload::WorkloadError),
    /// The scheduler refused a call (a request that can never fit is not an error: it is
    /// reported as rejected).
    #[error(transparent)]
    Scheduler(#[from] crate::serving::scheduler::SchedulerError),
    /// A GGUF file the engine cannot read.
    #[error(transparent)]
    Gguf(#[from] crate::models::gguf::GgufError),
    /// A tokenizer that cannot be built, or text or ids it cannot take.
    #[error(transparent)]
    Tokenizer(#[from] crate::models::tokenizer::TokenizerError),
    /// A chat template that cannot be rendered.
    #[error(transparent)]
    Chat(#[from] crate::models::chat::ChatError),
    /// Sampling refused its logits or parameters.
    #[error(transparent)]
    Sampling(#[from] crate::serving::sample::SamplingError),
    /// A model operation refused its sizes or parameters.
    #[error(transparent)]
    Ops(#[from] crate::models::ops::OpsError),
    /// `--verify` found an attention output that differs from `reference`'s.
    #[error(transparent)]
    Verify(#[from] crate::serving::check::Mismatch),
    /// A model's shape or weights the engine cannot use.
    #[error("model: {0}")]
    Model(String),
    /// A model computed a NaN or an infinity: its weights or its arithmetic, named where it
    /// was first seen (a layer's output, the logits), not the attention.
    #[error("model: {at} holds a non-finite value (NaN or ±inf)")]
    NonFinite {
        /// Where: e.g. `layer 3's output (token 0 of the step)`.
        at: String,
    },
    /// The block manager's accounting found a leak or a double free at the end of a run.
    #[error("block accounting: {0}")]
    Accounting(String),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
}

/// The engine's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
