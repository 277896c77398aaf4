//! Hostile model files: a GGUF mutated as an attacker or a broken download would mutate it,
//! and the path `pagedattn run --model` takes with a file (the reader, the Llama config and
//! weights, the tokenizer, the chat template, then a request served), which must end in an
//! error or a run: never a panic, an abort or a hang. The engine's hostile-input test sweeps
//! seeds of [`mutate`]; the `gguf_reader` fuzz target drives both with libFuzzer.

use std::sync::atomic::AtomicBool;

use crate::models::chat::{ChatMessage, ChatTemplate};
use crate::models::gguf::Gguf;
use crate::models::llama::Llama;
use crate::models::ops::Precision;
use crate::models::tokenizer::Tokenizer;
use crate::rng::SplitMix64;
use crate::serving::blocks::BlockConfig;
use crate::serving::engine::{Engine, EngineConfig, EngineRequest};
use crate::serving::memory::{kv_pool_size, KvCacheMemory};
use crate::serving::sample::SamplingParams;
use crate::serving::scheduler::{PreemptionPolicy, SchedulerConfig};
use crate::Result;

/// How far a file got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The reader refused it.
    Unreadable,
    /// Read, but the model, the tokenizer or the template refused it.
    Refused,
    /// Loaded; the request then ran or stopped with an error (a non-finite value, a token
    /// past the vocabulary).
    Served,
}

/// Values that break counts, lengths and offsets where they land.
const HOSTILE_U64: [u64; 8] = [
    0,
    1,
    255,
    1 << 31,
    u32::MAX as u64,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// `base` with one to three of: a byte flipped (four times in ten), four or eight bytes
/// overwritten with a hostile value (three in ten), bytes inserted or removed (one in ten
/// each), the file cut short (one in ten), each placed by `seed`'s stream (in the first
/// 8 KB, the header, three times in four).
pub fn mutate(base: &[u8], seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut below = |n: usize| (rng.next_f64() * n as f64) as usize % n.max(1);
    let mut bytes = base.to_vec();
    for _ in 0..1 + below(3) {
        let span = if below(4) < 3 {
            bytes.len().min(8192)
        } else {
            bytes.len()
        };
        let at = below(span.max(1));
        match below(10) {
            0..=3 if at < bytes.len() => bytes[at] ^= 1 + below(255) as u8,
            4..=6 => {
                let value = HOSTILE_U64[below(HOSTILE_U64.len())].to_le_bytes();
                for (i, b) in value.iter().enumerate().take(4 << below(2)) {
                    if let Some(x) = bytes.get_mut(at + i) {
                        *x = *b;
                    }
                }
            }
            7 => {
                let n = 1 + below(16);
                let at = at.min(bytes.len());
                bytes.splice(at..at, (0..n).map(|i| (i * 37) as u8));
            }
            8 => {
                let end = (at + 1 + below(16)).min(bytes.len());
                bytes.drain(at.min(end)..end);
            }
            _ => bytes.truncate(at),
        }
    }
    bytes
}

/// Loads `bytes` as `pagedattn run --model` loads a file and, where it loads, renders a chat
/// turn, encodes it and serves it on `cpu` for two tokens in a pool of at most 1 MiB. An
/// error anywhere is an answer (it ends the attempt); a panic or an abort is the bug this
/// looks for.
pub fn load_and_serve(bytes: Vec<u8>) -> Outcome {
    let Ok(file) = Gguf::from_bytes(bytes) else {
        return Outcome::Unreadable;
    };
    let loaded = (|| -> Result<_> {
        Ok((
            Llama::from_gguf(&file, Precision::Exact)?,
            Tokenizer::from_gguf(&file)?,
            ChatTemplate::from_gguf(&file)?,
        ))
    })();
    let Ok((model, tokenizer, chat)) = loaded else {
        return Outcome::Refused;
    };
    let served = (|| -> Result<()> {
        let text = chat.render(&[ChatMessage::new("user", "Hi there")], true)?;
        let prompt = tokenizer.encode(&text, false)?;
        let backend = pagedattn::registry::backend("cpu")?;
        let pool = kv_pool_size(backend.as_ref(), &model, 16, KvCacheMemory::Bytes(1 << 20))?;
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                max_batched_tokens: 256,
                max_seqs: 8,
                preemption: PreemptionPolicy::Auto,
                blocks: BlockConfig {
                    block_size: 16,
                    num_device_blocks: pool.blocks.min(64),
                    num_host_blocks: 0,
                    prefix_caching: true,
                    sliding_window: None,
                    watermark_blocks: 1,
                },
            },
            cuda_graphs: false,
        };
        let request = EngineRequest {
            arrival: 0.0,
            prompt,
            encoder_prompt: None,
            max_new_tokens: 2,
            n: 1,
            sampling: SamplingParams::default(),
            ignore_eos: true,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
        };
        let engine = Engine::new(backend.as_ref(), Box::new(model), &config)?;
        let report = engine.run(
            "hostile",
            vec![request],
            &AtomicBool::new(false),
            &mut |_, _, _| {},
        )?;
        for r in &report.requests {
            for sample in &r.generated {
                tokenizer.decode(sample, true)?;
            }
        }
        Ok(())
    })();
    // Refusing the request (an error) is as good an answer as serving it.
    let _ = served;
    Outcome::Served
}
