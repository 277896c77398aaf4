//! A serving engine over `pagedattn`: continuous batching with chunked prefill, a block
//! manager with prefix caching, swapping and copy-on-write, and the models it serves
//! (Llama-architecture GGUF files, and a synthetic model with seeded weights as a decoder, an
//! encoder-only or an encoder-decoder model).
//!
//! The engine talks to the attention backends through `pagedattn`'s public API only (specs,
//! `MetadataBuilder`, `plan`, `forward_into`, `swap_out` / `swap_in`, `copy_blocks`); the
//! backends know nothing of scheduling.
//!
//! ```text
//!  workload / trace -> scheduler -> block manager  (block ids, reference counts, prefix hashes)
//!                          |              | swap / copy pairs
//!                          v              v
//!                     one step (batch::StepBatch): metadata, one plan, per layer the model's
//!                     ops and attention's forward_into; sampling
//! ```

pub mod batch;
pub mod blocks;
pub mod chat;
mod clock;
pub mod encdec;
pub mod engine;
pub mod error;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu_llama;
mod graphs;
pub mod llama;
pub mod model;
pub mod ops;
pub mod report;
pub mod rng;
pub mod scheduler;
pub mod score;
pub mod synthetic;
pub mod tokenizer;
pub mod verify;
pub mod weights;
pub mod workload;

pub use error::{Error, Result};
