//! The serving core: requests in, tokens out. The [`engine`] runs steps: the [`scheduler`]
//! picks each step's work with the [`blocks`] manager, the engine moves blocks (swap,
//! copy-on-write), plans attention once per step, runs the [`model`] (any `dyn Model`),
//! samples ([`sample`]) and records ([`report`]). Decode steps may replay CUDA graphs. The
//! KV pool's size comes from the memory the device has ([`memory`]).
//!
//! Nothing here names a model family or the `reference` backend: the models and the harness
//! depend on this module, never the reverse (`tests/layout.rs` checks it).

mod attention;
pub mod batch;
pub mod blocks;
pub mod check;
mod clock;
pub mod engine;
mod graphs;
pub mod memory;
pub mod model;
pub mod report;
pub mod sample;
pub mod scheduler;

pub(crate) use attention::{run_attention, write_kv, DecoderPlans};
