//! SmolLM2-135M-Instruct (the Q4_1 GGUF) served by the engine: with f32 activations and
//! weights dequantized as transformers dequantizes them, the greedy tokens of every prompt of
//! golden/smollm2.json (written by tools/golden-smollm2.py from transformers on the same
//! file) are transformers' tokens, all prompts served in one batch.

use crate::golden_file::{golden, ids};

use std::sync::atomic::AtomicBool;

use pagedattn::registry;
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::llama::Llama;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::{Engine, EngineConfig};
use pagedattn_engine::serving::scheduler::{PreemptionPolicy, SchedulerConfig};

/// Serves every golden prompt on `backend` in one run (chunked prefill: 64 tokens a step)
/// and compares each request's 32 greedy tokens with transformers'.
fn greedy_tokens_match_on(backend: &str) {
    let Some(path) = crate::common::model_path() else {
        return;
    };
    let golden = golden();
    let cases = golden["generation_cases"]
        .as_array()
        .expect("generation cases");
    let file = Gguf::open(&path).expect("the SmolLM2 file reads");
    let model = Llama::from_gguf(&file, Precision::Exact).expect("the model loads");
    let backend = registry::backend(backend).expect("the backend starts");
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_batched_tokens: 64,
            max_seqs: 16,
            preemption: PreemptionPolicy::Auto,
            blocks: BlockConfig {
                block_size: 16,
                num_device_blocks: 256,
                num_host_blocks: 0,
                prefix_caching: true,
                sliding_window: None,
                watermark_blocks: 1,
            },
        },
        cuda_graphs: true,
    };
    let requests = cases
        .iter()
        // (transformers generated past the end of the turn.)
        .map(|c| crate::common::greedy_past_eos(ids(&c["prompt_ids"]), 32))
        .collect();
    let engine = Engine::new(backend.as_ref(), Box::new(model), &config)
        .expect("the engine starts")
        .with_check(Box::new(
            Verifier::new(VerifyMode::Sampled(0.1), 0).expect("the verifier starts"),
        ));
    let report = engine
        .run(
            "golden",
            requests,
            &AtomicBool::new(false),
            &mut |_, _, _| {},
        )
        .expect("the run completes");
    let mut failures = Vec::new();
    for (case, got) in cases.iter().zip(&report.requests) {
        let want = ids(&case["generated_ids"]);
        if got.generated != [want.clone()] {
            failures.push(format!(
                "{}: got {:?}, transformers {want:?}",
                case["name"], got.generated
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(report.verify.calls_checked > 0);
}

#[test]
fn greedy_tokens_match_transformers_on_cpu() {
    greedy_tokens_match_on("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
fn greedy_tokens_match_transformers_on_cuda() {
    greedy_tokens_match_on("cuda");
}
