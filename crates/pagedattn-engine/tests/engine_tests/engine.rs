//! The engine end to end on the synthetic model: every built-in workload with every
//! attention call verified against `reference`, no block leaked, and preemption (by swap and
//! by recompute) changing no greedy token.

use pagedattn::KvCacheDtype;
use pagedattn_engine::harness::verify::VerifyMode;
use pagedattn_engine::harness::workload::Builtin;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::scheduler::PreemptionPolicy;

use crate::common;

use common::{preemption_changes_nothing, requests, serve, small};

#[test]
fn every_builtin_workload_completes_verified_on_cpu_and_reference() {
    for backend in ["cpu", "reference"] {
        for workload in [Builtin::Chat, Builtin::LongContext, Builtin::SharedPrefix] {
            let model = small(ModelKind::Decoder);
            let reqs = requests(&model.build().unwrap(), workload, 6, 12, 7);
            let want: usize = reqs.iter().map(|r| r.n * r.max_new_tokens).sum();
            let report = serve(
                backend,
                &model,
                reqs,
                (256, 256),
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

/// Requests that arrive while the engine idles (every earlier one finished) are served: the
/// loop once left the empty step it scheduled while idle open and stopped at the next
/// arrival ("schedule called with a step in flight").
#[test]
fn requests_arriving_while_the_engine_idles_are_served() {
    let model = small(ModelKind::Decoder);
    let mut reqs = requests(&model.build().unwrap(), Builtin::Chat, 3, 2, 7);
    // Two new tokens of a two-layer model take milliseconds: the engine idles between.
    for (i, r) in reqs.iter_mut().enumerate() {
        r.arrival = 0.15 * i as f64;
    }
    let want: usize = reqs.iter().map(|r| r.n * r.max_new_tokens).sum();
    let report = serve(
        "cpu",
        &model,
        reqs,
        (256, 256),
        PreemptionPolicy::Auto,
        VerifyMode::Every,
    );
    assert!(report.requests.iter().all(|r| r.rejected.is_none()));
    assert_eq!(report.generated_tokens(), want);
    // Each request was served after its arrival, and the last could not have been admitted
    // before the engine had idled.
    for r in &report.requests {
        assert!(r.finished.is_some_and(|f| f >= r.arrival), "{r:?}");
    }
    assert!(report.seconds >= 0.3);
}

#[test]
fn preemption_changes_no_greedy_token() {
    // Prompts and outputs of at most 200 tokens (13 blocks): a pool of 16 blocks runs one
    // or two requests at a time and preempts often.
    let short = SyntheticConfig {
        max_context: 200,
        ..small(ModelKind::Decoder)
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
        let reqs = requests(&features.build().unwrap(), Builtin::Chat, 12, 64, 7);
        preemption_changes_nothing(&features, &reqs, (512, 16), 256);
    }
}
