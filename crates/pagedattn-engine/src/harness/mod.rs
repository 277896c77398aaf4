//! What drives and judges a run, for the CLI and the tests: [`workload`]s (built-in
//! workloads and JSONL traces), the [`report`]'s text, JSON and SVG, the [`verify`]er (the
//! `reference` backend recomputing the engine's attention calls), teacher-forced [`score`]s
//! and [`hostile`] model files.

pub mod hostile;
pub mod report;
pub mod score;
pub mod verify;
pub mod workload;
