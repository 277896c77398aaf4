//! What drives and judges a run, for the CLI and the tests: [`workload`]s (built-in
//! workloads and JSONL traces), the [`report`]'s text, JSON and SVG, the [`verify`]er (the
//! `reference` backend recomputing the engine's attention calls) and teacher-forced
//! [`score`]s.

pub mod report;
pub mod score;
pub mod verify;
pub mod workload;
