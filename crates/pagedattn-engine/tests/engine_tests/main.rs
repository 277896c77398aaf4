//! The engine's integration tests, one module a subject, in one executable: one build and
//! link of the test harness and the shared helpers instead of one per file (a cold
//! `cargo test` spent most of its time building and linking ten executables).

mod common;

mod golden_file;

mod blocks;
mod encdec;
mod engine;
mod gguf;
mod golden;
mod gpu_model;
mod hf;
mod hf_hostile;
mod hostile;
mod layout;
mod memory;
mod ops;
mod ranks;
mod scheduler;
mod tensor_parallel;
mod tokenizer;
mod verify;
