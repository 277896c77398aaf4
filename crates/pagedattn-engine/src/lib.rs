//! A serving engine over `pagedattn`: continuous batching with chunked prefill, a block
//! manager with prefix caching, swapping and copy-on-write, and the models it serves
//! (Llama-architecture GGUF files, and a synthetic model with seeded weights as a decoder, an
//! encoder-only or an encoder-decoder model).
//!
//! The crate has three wings, each importing only those before it:
//!
//! - [`serving`], the core: the [`Engine`]'s step loop, the
//!   scheduler, the block manager, step batches, sampling, CUDA-graph decode steps, the run's
//!   records, and the [`Model`](serving::model::Model) trait it calls. It names no model
//!   family and no test oracle: a model is a `dyn Model`, and a check of its attention calls
//!   (the harness's verifier) a `dyn` [`CallCheck`](serving::check::CallCheck).
//! - [`models`]: the model families (Llama on the host and on the GPU, the synthetic
//!   decoder, encoder-only and encoder-decoder models), their shared ops (products, norms,
//!   RoPE, quantisation), and the readers of what a model comes in (GGUF, tokenizer, chat
//!   template).
//! - [`harness`]: what drives and judges a run — workloads and traces, the report's text,
//!   JSON and plot, the verifier (the `reference` backend recomputing attention calls) and
//!   teacher-forced scoring. The CLI and the tests reach it; the core does not.
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
//!
//! One crate with three folders rather than three crates: the wings share one error type and
//! one build (a crate split would add a link and a metadata pass to the cold build, and three
//! names to the API), and `tests/layout.rs` checks the import rules the compiler would.

pub mod error;
pub mod harness;
pub mod models;
pub mod rng;
pub mod serving;

pub use error::{Error, Result};
pub use serving::engine::{Engine, EngineConfig, EngineRequest};
