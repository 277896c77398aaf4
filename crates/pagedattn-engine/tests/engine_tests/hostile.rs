//! The engine against hostile model files: a tiny Llama GGUF mutated thousands of ways, each
//! loaded as `pagedattn run --model` loads a file and, where it loads, served: an error or a
//! run, never a panic, an abort or a hang. `PAGEDATTN_HOSTILE_CASES` and
//! `PAGEDATTN_HOSTILE_SEED` set the sweep (CI: 10,000 from seed 0; a campaign: millions, see
//! NOTES.md); the `gguf_reader` fuzz target drives the same functions with libFuzzer. And a
//! model whose arithmetic overflows stops naming the layer.

use std::sync::atomic::AtomicBool;

use pagedattn_engine::harness::hostile::{load_and_serve, mutate, Outcome};
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::gguf_writer::{tiny_llama, TinyLlama};
use pagedattn_engine::models::llama::Llama;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::serving::engine::{Engine, EngineConfig, EngineRequest};
use pagedattn_engine::serving::model::Model;
use pagedattn_engine::serving::sample::SamplingParams;

/// An environment variable's number, or `default`.
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn the_tiny_llama_loads_and_serves() {
    assert_eq!(
        load_and_serve(tiny_llama(&TinyLlama::default())),
        Outcome::Served
    );
}

#[test]
fn mutated_gguf_files_are_errors_or_runs() {
    let base = tiny_llama(&TinyLlama::default());
    let cases = env_u64("PAGEDATTN_HOSTILE_CASES", 10_000);
    let first = env_u64("PAGEDATTN_HOSTILE_SEED", 0);
    let mut outcomes = [0usize; 3];
    for seed in first..first + cases {
        let bytes = mutate(&base, seed);
        // A panic names its seed (then PAGEDATTN_HOSTILE_SEED=seed PAGEDATTN_HOSTILE_CASES=1
        // replays it alone).
        let outcome = std::panic::catch_unwind(|| load_and_serve(bytes))
            .unwrap_or_else(|_| panic!("seed {seed}: the mutated file made the engine panic"));
        outcomes[outcome as usize] += 1;
    }
    // The sweep reaches every stage: the reader, the loaders and the engine.
    if cases >= 1000 {
        assert!(outcomes.iter().all(|&n| n >= 10), "{outcomes:?}");
    }
    eprintln!("unreadable, refused, served: {outcomes:?}");
}

/// One request for `prompt`, two tokens at `temperature`.
pub fn request(prompt: Vec<u32>, temperature: f32) -> EngineRequest {
    EngineRequest {
        arrival: 0.0,
        prompt,
        encoder_prompt: None,
        max_new_tokens: 2,
        n: 1,
        sampling: SamplingParams {
            temperature,
            ..SamplingParams::default()
        },
        ignore_eos: true,
        stop_token_ids: Vec::new(),
        min_tokens: 0,
    }
}

/// The tiny Llama with `ffn_down` weights near f32's (and bf16's) largest, so that its first
/// MLP's product overflows, and heads of 32 (a head size the `cuda` backend has).
pub fn overflowing_llama() -> Llama {
    let bytes = tiny_llama(&TinyLlama {
        hidden: 64,
        heads: 2,
        kv_heads: 1,
        ffn_down_factor: f32::MAX,
        ..TinyLlama::default()
    });
    Llama::from_gguf(&Gguf::from_bytes(bytes).unwrap(), Precision::Exact).unwrap()
}

/// The error that stops serving one request of `temperature` with `model` on `backend`
/// (CUDA graphs as `cuda_graphs` says): the run must fail.
pub fn run_to_error(
    backend: &str,
    model: Box<dyn Model + '_>,
    cuda_graphs: bool,
    temperature: f32,
) -> String {
    let backend = pagedattn::registry::backend(backend).unwrap();
    let config = EngineConfig {
        cuda_graphs,
        ..crate::common::config(64, 256)
    };
    let engine = Engine::new(backend.as_ref(), model, &config).unwrap_or_else(|e| panic!("{e}"));
    engine
        .run(
            "overflow",
            vec![request(vec![10, 20, 30], temperature)],
            &AtomicBool::new(false),
            &mut |_, _, _| {},
        )
        .unwrap_err()
        .to_string()
}

#[test]
fn a_model_that_overflows_stops_naming_the_layer() {
    let err = run_to_error("cpu", Box::new(overflowing_llama()), false, 0.0);
    assert!(
        err.starts_with("model: layer 0's output (token ")
            && err.ends_with("holds a non-finite value (NaN or ±inf)"),
        "{err}"
    );
}
