//! A GGUF file as `pagedattn run --model` meets it: the reader, the Llama config and weights,
//! the tokenizer, the chat template, then a request served on `cpu`
//! (`pagedattn_engine::harness::hostile::load_and_serve`): an error or a run, never a panic,
//! an abort or a hang. The input is either the file itself (first byte odd) or, so that
//! libFuzzer starts from a whole model rather than from nothing, a seed of the hostile
//! mutations of a tiny Llama (`mutate`; first byte even, the next eight the seed).

#![no_main]

use libfuzzer_sys::fuzz_target;
use pagedattn_engine::harness::hostile::{load_and_serve, mutate};
use pagedattn_engine::models::gguf_writer::{tiny_llama, TinyLlama};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let file = if mode % 2 == 1 {
        rest.to_vec()
    } else {
        let mut seed = [0u8; 8];
        for (s, b) in seed.iter_mut().zip(rest) {
            *s = *b;
        }
        // The tiny model's bytes, built once.
        static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let base = BASE.get_or_init(|| tiny_llama(&TinyLlama::default()));
        mutate(base, u64::from_le_bytes(seed))
    };
    load_and_serve(file);
});
