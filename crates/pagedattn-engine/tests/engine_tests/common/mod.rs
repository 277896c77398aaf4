//! What the engine's end-to-end tests share: small synthetic models, a built-in workload's
//! requests, and a run of the engine.

use std::sync::atomic::AtomicBool;

use pagedattn::registry;
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::harness::workload::{Builtin, BuiltinParams, Prompt};
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::{Engine, EngineConfig, EngineRequest};
use pagedattn_engine::serving::model::{Attend, Model, ModelKind, StepTokens};
use pagedattn_engine::serving::report::Report;
use pagedattn_engine::serving::sample::SamplingParams;
use pagedattn_engine::serving::scheduler::{PreemptionPolicy, SchedulerConfig};

/// What the shared runs build their model from (a fresh one per run).
pub trait ModelSource: std::fmt::Debug {
    /// The model.
    fn model(&self) -> Box<dyn Model>;
}

impl ModelSource for SyntheticConfig {
    fn model(&self) -> Box<dyn Model> {
        self.build_model().unwrap()
    }
}

/// A small synthetic model of `kind` (fast enough for `reference`).
pub fn small(kind: ModelKind) -> SyntheticConfig {
    let base = match kind {
        ModelKind::EncoderOnly => SyntheticConfig::encoder_only(),
        ModelKind::EncoderDecoder => SyntheticConfig::encoder_decoder(),
        ModelKind::Decoder => SyntheticConfig::default(),
    };
    SyntheticConfig {
        encoder_layers: if kind == ModelKind::Decoder { 0 } else { 2 },
        layers: if kind == ModelKind::EncoderOnly { 0 } else { 2 },
        hidden: 64,
        ffn: 128,
        heads: 4,
        kv_heads: 2,
        head_size: 16,
        vocab: 256,
        max_context: 600,
        ..base
    }
}

/// `count` requests of `workload` for `model`, at most `max_new` new tokens each, drawn from
/// `seed`.
pub fn requests(
    model: &dyn Model,
    workload: Builtin,
    count: usize,
    max_new: usize,
    seed: u64,
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
        seed,
    };
    let ids = |p: Prompt| match p {
        Prompt::Tokens(t) => t,
        other => panic!("{other:?}"),
    };
    workload
        .requests(&params)
        .into_iter()
        .map(|r| EngineRequest {
            arrival: r.arrival,
            prompt: ids(r.prompt),
            encoder_prompt: r.encoder_prompt.map(ids),
            max_new_tokens: r.max_new_tokens,
            n: r.n,
            sampling: r.sampling,
            ignore_eos: r.ignore_eos,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
        })
        .collect()
}

/// An engine's config: `blocks` device blocks of 16 tokens (as many host blocks), a budget of
/// `max_batched_tokens` a step, 32 sequences, prefix caching, CUDA graphs, preemption `auto`.
pub fn config(blocks: usize, max_batched_tokens: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            max_batched_tokens,
            max_seqs: 32,
            preemption: PreemptionPolicy::Auto,
            blocks: BlockConfig {
                block_size: 16,
                num_device_blocks: blocks,
                num_host_blocks: blocks,
                // (The engine turns it off for an encoder-decoder model.)
                prefix_caching: true,
                sliding_window: None,
                watermark_blocks: 1,
            },
        },
        cuda_graphs: true,
    }
}

/// Serves `requests` on `backend` with `blocks` device blocks of 16 tokens (as many host
/// blocks) and a budget of `max_batched_tokens` a step.
pub fn serve(
    backend: &str,
    model: &dyn ModelSource,
    requests: Vec<EngineRequest>,
    (blocks, max_batched_tokens): (usize, usize),
    policy: PreemptionPolicy,
    verify: VerifyMode,
) -> Report {
    let backend = registry::backend(backend).unwrap();
    let mut config = config(blocks, max_batched_tokens);
    config.scheduler.preemption = policy;
    let engine = Engine::new(backend.as_ref(), model.model(), &config)
        .unwrap()
        .with_check(Box::new(Verifier::new(verify, 1).unwrap()));
    engine
        .run("test", requests, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap()
}

/// Every request's samples' generated tokens.
pub fn generated(report: &Report) -> Vec<Vec<Vec<u32>>> {
    report
        .requests
        .iter()
        .map(|r| r.generated.clone())
        .collect()
}

/// Serves `requests` with a roomy pool (`roomy_blocks`: nothing preempted) and then, under
/// each of swap and recompute, a tight one (`tight_blocks`: something preempted), with a
/// budget of `max_batched_tokens` a step, asserting that preemption changed no greedy token;
/// returns the tight runs' reports.
pub fn preemption_changes_nothing(
    model: &dyn ModelSource,
    requests: &[EngineRequest],
    (roomy_blocks, tight_blocks): (usize, usize),
    max_batched_tokens: usize,
) -> Vec<(PreemptionPolicy, Report)> {
    let roomy = serve(
        "cpu",
        model,
        requests.to_vec(),
        (roomy_blocks, max_batched_tokens),
        PreemptionPolicy::Auto,
        VerifyMode::Sampled(0.2),
    );
    assert_eq!(
        roomy.cache.preempted_by_swap + roomy.cache.preempted_by_recompute,
        0
    );
    [PreemptionPolicy::Swap, PreemptionPolicy::Recompute]
        .into_iter()
        .map(|policy| {
            let tight = serve(
                "cpu",
                model,
                requests.to_vec(),
                (tight_blocks, max_batched_tokens),
                policy,
                VerifyMode::Sampled(0.2),
            );
            let preempted = tight.cache.preempted_by_swap + tight.cache.preempted_by_recompute;
            assert!(
                preempted > 0,
                "{policy:?}: the pool is tight enough to preempt"
            );
            assert_eq!(generated(&tight), generated(&roomy), "{policy:?} {model:?}");
            (policy, tight)
        })
        .collect()
}

/// The file the real model is expected at, or `None` after saying, past the test harness's
/// output capture, that the test is skipped. `PAGEDATTN_REQUIRE_MODEL=1` makes absence a failure.
pub fn model_path() -> Option<std::path::PathBuf> {
    use std::io::Write;
    // `PAGEDATTN_SMOLLM2` names the file where the test binary runs away from its checkout
    // (the GPU machine).
    let path = match std::env::var_os("PAGEDATTN_SMOLLM2") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if path.is_file() {
        return Some(path);
    }
    let msg = format!(
        "{} is missing (bash tools/fetch-smollm2.sh fetches it)",
        path.display()
    );
    if std::env::var("PAGEDATTN_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!("{msg} and PAGEDATTN_REQUIRE_MODEL=1");
    }
    // Written to the stderr handle directly: libtest captures only the print macros.
    let _ = writeln!(std::io::stderr(), "SKIPPED: {msg}");
    None
}

/// A greedy request for `max_new_tokens` past any end of turn (as transformers' goldens
/// generate them).
pub fn greedy_past_eos(prompt: Vec<u32>, max_new_tokens: usize) -> EngineRequest {
    EngineRequest {
        ignore_eos: true,
        ..EngineRequest::greedy(prompt, max_new_tokens)
    }
}

/// A hook [`Hooked`] runs before each forward, given the call's index (from 0).
pub type ForwardHook = Box<dyn FnMut(usize) -> pagedattn_engine::Result<()> + Send>;

/// `inner` with `hook` run before each of its forwards (greedy or not): the hook's error is
/// the forward's (a device that fails), and a hook may wait (a rank in a collective that waits
/// for its peers). Both forwards are passed on as they are: a tensor-parallel rank's greedy
/// forward runs other collectives than its logits forward (a wrapper that answered the greedy
/// one with `forward` left its peers waiting in another collective: a hang on 2 GPUs).
pub struct Hooked {
    pub inner: Box<dyn Model>,
    pub hook: ForwardHook,
    pub calls: usize,
}

impl Model for Hooked {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn layers(&self) -> &[pagedattn::AttentionConfig] {
        self.inner.layers()
    }
    fn dtype(&self) -> pagedattn::DType {
        self.inner.dtype()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn stop_tokens(&self) -> Vec<u32> {
        self.inner.stop_tokens()
    }
    fn first_plain_token(&self) -> u32 {
        self.inner.first_plain_token()
    }
    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> pagedattn_engine::Result<()> {
        self.calls += 1;
        (self.hook)(self.calls - 1)?;
        self.inner.forward(step, attend, logits)
    }
    fn forward_greedy(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
        tokens: &mut Vec<u32>,
    ) -> pagedattn_engine::Result<()> {
        self.calls += 1;
        (self.hook)(self.calls - 1)?;
        self.inner.forward_greedy(step, attend, logits, tokens)
    }
}
