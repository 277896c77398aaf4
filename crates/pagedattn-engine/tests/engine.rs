//! The engine end to end on the synthetic model: every built-in workload with every
//! attention call verified against `reference`, no block leaked, and preemption (by swap and
//! by recompute) changing no greedy token.

use std::sync::atomic::AtomicBool;

use pagedattn::{registry, KvCacheDtype};
use pagedattn_engine::blocks::BlockConfig;
use pagedattn_engine::engine::{Engine, EngineConfig, EngineRequest};
use pagedattn_engine::model::Model;
use pagedattn_engine::ops::SamplingParams;
use pagedattn_engine::report::Report;
use pagedattn_engine::scheduler::{PreemptionPolicy, SchedulerConfig};
use pagedattn_engine::synthetic::SyntheticConfig;
use pagedattn_engine::verify::VerifyMode;
use pagedattn_engine::workload::{Builtin, BuiltinParams, Prompt};

/// A small synthetic model (fast enough for `reference`).
fn small() -> SyntheticConfig {
    SyntheticConfig {
        layers: 2,
        hidden: 64,
        ffn: 128,
        heads: 4,
        kv_heads: 2,
        head_size: 16,
        vocab: 256,
        max_context: 512,
        ..SyntheticConfig::default()
    }
}

/// The requests of `workload` for `model`.
fn requests(
    model: &dyn Model,
    workload: Builtin,
    count: usize,
    max_new: usize,
) -> Vec<EngineRequest> {
    let params = BuiltinParams {
        requests: count,
        rate: None,
        first_token: model.first_plain_token(),
        vocab: model.vocab_size() as u32,
        max_context: model.max_context(),
        max_new_tokens: max_new,
        sampling: SamplingParams::default(),
        ignore_eos: false,
        seed: 7,
    };
    workload
        .requests(&params)
        .into_iter()
        .map(|r| EngineRequest {
            arrival: r.arrival,
            encoder_prompt: None,
            prompt: match r.prompt {
                Prompt::Tokens(t) => t,
                other => panic!("{other:?}"),
            },
            max_new_tokens: r.max_new_tokens,
            n: r.n,
            sampling: r.sampling,
            ignore_eos: r.ignore_eos,
        })
        .collect()
}

/// Serves `requests` on `backend` with `blocks` device blocks of 16 tokens.
fn serve(
    backend: &str,
    model: &SyntheticConfig,
    requests: Vec<EngineRequest>,
    blocks: usize,
    policy: PreemptionPolicy,
    verify: VerifyMode,
) -> Report {
    let backend = registry::backend(backend).unwrap();
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_batched_tokens: 256,
            max_seqs: 32,
            preemption: policy,
            blocks: BlockConfig {
                block_size: 16,
                num_device_blocks: blocks,
                num_host_blocks: blocks,
                prefix_caching: true,
                sliding_window: None,
                watermark_blocks: 1,
            },
        },
        verify,
        seed: 1,
    };
    let engine = Engine::new(backend.as_ref(), Box::new(model.build().unwrap()), &config).unwrap();
    engine
        .run("test", requests, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap()
}

fn generated(report: &Report) -> Vec<Vec<Vec<u32>>> {
    report
        .requests
        .iter()
        .map(|r| r.generated.clone())
        .collect()
}

#[test]
fn every_builtin_workload_completes_verified_on_cpu_and_reference() {
    for backend in ["cpu", "reference"] {
        for workload in [Builtin::Chat, Builtin::LongContext, Builtin::SharedPrefix] {
            let model = small();
            let reqs = requests(&model.build().unwrap(), workload, 6, 12);
            let want: usize = reqs.iter().map(|r| r.n * r.max_new_tokens).sum();
            let report = serve(
                backend,
                &model,
                reqs,
                256,
                PreemptionPolicy::Auto,
                VerifyMode::Every,
            );
            assert!(
                report.requests.iter().all(|r| r.rejected.is_none()),
                "{backend} {workload}"
            );
            // The synthetic model has no stop token: every sample runs to its length.
            assert_eq!(report.generated_tokens(), want, "{backend} {workload}");
            assert_eq!(
                report.verify.calls_checked, report.verify.calls_total,
                "{backend} {workload}"
            );
            assert!(report.verify.calls_checked > 0);
            if workload == Builtin::SharedPrefix {
                assert!(
                    report.cache.prefix_hit_tokens > 0,
                    "{backend}: the shared prompt is reused"
                );
            }
        }
    }
}

#[test]
fn preemption_changes_no_greedy_token() {
    // Prompts and outputs of at most 200 tokens (13 blocks): a pool of 16 blocks runs one
    // or two requests at a time and preempts often.
    let short = SyntheticConfig {
        max_context: 200,
        ..small()
    };
    for features in [
        short.clone(),
        SyntheticConfig {
            kv_cache_dtype: KvCacheDtype::Fp8E4m3,
            ..short.clone()
        },
        SyntheticConfig {
            alibi: true,
            sliding_window: Some(100),
            soft_cap: Some(30.0),
            ..short
        },
    ] {
        let reqs = requests(&features.build().unwrap(), Builtin::Chat, 12, 64);
        let roomy = serve(
            "cpu",
            &features,
            reqs.clone(),
            512,
            PreemptionPolicy::Auto,
            VerifyMode::Sampled(0.2),
        );
        assert_eq!(
            roomy.cache.preempted_by_swap + roomy.cache.preempted_by_recompute,
            0
        );
        for policy in [PreemptionPolicy::Swap, PreemptionPolicy::Recompute] {
            let tight = serve(
                "cpu",
                &features,
                reqs.clone(),
                16,
                policy,
                VerifyMode::Sampled(0.2),
            );
            let preempted = tight.cache.preempted_by_swap + tight.cache.preempted_by_recompute;
            assert!(
                preempted > 0,
                "{policy:?}: the pool is tight enough to preempt"
            );
            assert_eq!(
                generated(&tight),
                generated(&roomy),
                "{policy:?} {}",
                features.layers
            );
        }
    }
}
