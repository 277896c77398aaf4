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

/// A model whose logits hold a NaN: the synthetic decoder's, one element poisoned.
struct PoisonedLogits(Box<dyn pagedattn_engine::serving::model::Model>);

impl pagedattn_engine::serving::model::Model for PoisonedLogits {
    fn name(&self) -> String {
        self.0.name()
    }
    fn layers(&self) -> &[pagedattn::AttentionConfig] {
        self.0.layers()
    }
    fn dtype(&self) -> pagedattn::DType {
        self.0.dtype()
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn stop_tokens(&self) -> Vec<u32> {
        self.0.stop_tokens()
    }
    fn first_plain_token(&self) -> u32 {
        self.0.first_plain_token()
    }
    fn forward(
        &mut self,
        step: &pagedattn_engine::serving::model::StepTokens<'_>,
        attend: &mut pagedattn_engine::serving::model::Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> pagedattn_engine::Result<()> {
        self.0.forward(step, attend, logits)?;
        logits[3] = f32::NAN;
        Ok(())
    }
}

#[test]
fn non_finite_logits_stop_the_run_naming_them() {
    use pagedattn_engine::serving::engine::{Engine, EngineConfig};
    use pagedattn_engine::serving::sample::SamplingParams;
    let backend = pagedattn::registry::backend("cpu").unwrap();
    // Greedy (the model's argmax flags the row) and sampled (the engine checks the logits).
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            ..SamplingParams::default()
        },
    ] {
        let model = small(ModelKind::Decoder).build_model().unwrap();
        let mut reqs = requests(model.as_ref(), Builtin::Chat, 2, 4, 0);
        for r in &mut reqs {
            r.sampling = sampling;
        }
        let config = EngineConfig {
            cuda_graphs: false,
            ..common::config(64, 256)
        };
        let engine =
            Engine::new(backend.as_ref(), Box::new(PoisonedLogits(model)), &config).unwrap();
        let err = engine
            .run(
                "poisoned",
                reqs,
                &std::sync::atomic::AtomicBool::new(false),
                &mut |_, _, _| {},
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("step 0's logits") && err.contains("non-finite value (NaN or ±inf)"),
            "{err}"
        );
    }
}
