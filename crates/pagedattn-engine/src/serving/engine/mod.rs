//! The serving loop: requests arrive, the scheduler picks each step's work, the engine moves
//! blocks (swap, copy-on-write), builds the step's metadata, plans it once per attention type,
//! runs the model (every attention through `forward_into` on its plan), samples (or, for an
//! encoder-only model, records the pooled states), and records.
//!
//! Caches: each `decoder` attention has a paged cache, each `encoder_decoder` attention a
//! cross cache; a block id names the same block in every one of them (vLLM's single pool), a
//! decoder sequence's blocks being used in the self caches and an encoder's cross blocks in
//! the cross caches. A cross-attention call first writes the encoder keys and values of the
//! sequences at their first decoder step (`write_kv` through `cross_slot_mapping`), then
//! attends for every sequence of the step with key and value absent, reading the cross cache
//! through `cross_block_tables` and `encoder_seq_lens`: one call serves a batch that mixes
//! first steps and later ones.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use pagedattn::{AttentionConfig, AttnType, Backend, SequenceDesc};

use crate::serving::batch::{RequestId, StepBatch};
use crate::serving::check::CallCheck;
use crate::serving::model::{first_non_finite, Model, ModelKind, StepTokens, NON_FINITE_TOKEN};
use crate::serving::report::{StepRecord, VerifyCounts};
use crate::serving::sample::{Sampler, SamplingParams};
use crate::serving::scheduler::{
    RequestSpec, Sampled, Scheduler, SchedulerConfig, SchedulerError, StepEvent,
};
use crate::{Error, Result};

pub use rank::{AbortRanks, Placed, RankParts};
pub use run::MAX_ARRIVAL_SECONDS;
pub use watchdog::DEFAULT_RANK_TIMEOUT;

use forward::{SharedCheck, StepForward};
use rank::{check_ranks_agree, Rank, RankRunner};

mod forward;
mod rank;
mod run;
mod watchdog;

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The scheduler's budgets and policies, and the block pools (one block id names the
    /// same block in every layer's cache and swap space).
    pub scheduler: SchedulerConfig,
    /// Replay decode steps from CUDA graphs where the backend and the model allow it (a GPU
    /// model on `cuda`); steps with checked calls ([`Engine::with_check`]) run without.
    pub cuda_graphs: bool,
}

/// A request as the engine gets it: token ids and how to sample.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Seconds after the run's start at which it arrives.
    pub arrival: f64,
    /// The prompt's token ids (the decoder's prompt of an encoder-decoder model; the tokens
    /// to encode for an encoder-only model).
    pub prompt: Vec<u32>,
    /// The encoder's prompt: given for an encoder-decoder model, and only for one.
    pub encoder_prompt: Option<Vec<u32>>,
    /// The most tokens to generate per sample (an encoder-only model generates none).
    pub max_new_tokens: usize,
    /// Samples (parallel sampling).
    pub n: usize,
    /// How tokens are drawn.
    pub sampling: SamplingParams,
    /// Generate `max_new_tokens` even past the model's stop tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Tokens that end a sample besides the model's own (vLLM's `stop_token_ids`; they stop
    /// it under `ignore_eos` too).
    pub stop_token_ids: Vec<u32>,
    /// Each sample's fewest generated tokens: until it has them, no stop token is drawn
    /// (their logits are masked, as vLLM's `min_tokens` does).
    pub min_tokens: usize,
}

impl EngineRequest {
    /// A greedy request for `prompt` arriving at once: one sample of at most `max_new_tokens`,
    /// stopping at the model's stop tokens.
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        EngineRequest {
            arrival: 0.0,
            prompt,
            encoder_prompt: None,
            max_new_tokens,
            n: 1,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
        }
    }
}

/// What the engine keeps of an unfinished request besides what the scheduler holds.
#[derive(Clone, Debug)]
struct ActiveRequest {
    sampling: SamplingParams,
    prompt_len: usize,
    min_tokens: usize,
    stop_tokens: Vec<u32>,
}

impl ActiveRequest {
    /// Whether the token sampled at sequence position `position` may not be a stop token
    /// (the sample has fewer than `min_tokens` generated tokens before it).
    fn masks_stop_tokens_at(&self, position: usize) -> bool {
        position.saturating_sub(self.prompt_len) < self.min_tokens && !self.stop_tokens.is_empty()
    }
}

/// One token sampled in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampledToken {
    /// Its request.
    pub request: RequestId,
    /// Which sample of the request it extends.
    pub sample: usize,
    /// The token.
    pub token: u32,
}

/// What one [`Engine::step`] made.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// The step's timings and counts (`None`: the step ran no model, e.g. nothing to run).
    pub record: Option<StepRecord>,
    /// Every token sampled, in the step's batch order (a sample's tokens in its order).
    pub tokens: Vec<SampledToken>,
    /// The pooled final states of the encoder-only requests the step served.
    pub pooled: Vec<(RequestId, Vec<f32>)>,
    /// The scheduler's events: preemptions and swap-ins, then finished requests.
    pub events: Vec<StepEvent>,
}

/// The engine: the scheduler and its block manager, and one rank per device (a backend,
/// the model or its shard, the caches): one rank, or one a GPU with tensor parallelism.
pub struct Engine<'a> {
    /// Rank 0's model answers for all (kind, vocabulary, stop tokens: checked equal); its
    /// outputs are the step's.
    ranks: Vec<Rank<'a>>,
    /// Runs a step's work on every rank.
    runner: RankRunner,
    block_size: usize,
    num_blocks: usize,
    scheduler: Scheduler,
    /// Checks the attention calls of the steps it picks (the harness's verifier), every
    /// rank's.
    check: Option<SharedCheck<'a>>,
    sampler: Sampler,
    /// Each unfinished request's sampling and stop conditions.
    active: HashMap<RequestId, ActiveRequest>,
    /// Logits with stop tokens masked (`min_tokens`).
    masked: Vec<f32>,
    buffers: StepBuffers,
    /// Steps run.
    steps: usize,
    /// When the step records' clock started.
    epoch: Instant,
}

/// A step's inputs, buffers reused from step to step.
#[derive(Default)]
struct StepBuffers {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    logit_rows: Vec<usize>,
    encoder_tokens: Vec<u32>,
    encoder_positions: Vec<usize>,
}

impl StepBuffers {
    /// The step's tokens as a model takes them.
    fn step_tokens(&self) -> StepTokens<'_> {
        StepTokens {
            tokens: &self.tokens,
            positions: &self.positions,
            logit_rows: &self.logit_rows,
            encoder_tokens: &self.encoder_tokens,
            encoder_positions: &self.encoder_positions,
        }
    }
}

impl<'a> Engine<'a> {
    /// An engine for `model` on `backend`: one attention per layer, each layer's cache and
    /// swap space allocated.
    pub fn new(
        backend: &'a dyn Backend,
        model: Box<dyn Model + 'a>,
        config: &EngineConfig,
    ) -> Result<Self> {
        Self::with_ranks(vec![RankParts { backend, model }], None, config)
    }

    /// An engine over `backends` (rank i's backend, borrowed) and `models` (rank i's model,
    /// taken): [`with_ranks`](Self::with_ranks) of a [`Placed`] model's parts.
    pub fn placed(
        backends: &'a [Box<dyn Backend>],
        models: Vec<Box<dyn Model + 'a>>,
        abort: Option<AbortRanks>,
        config: &EngineConfig,
    ) -> Result<Self> {
        if backends.len() != models.len() {
            return Err(Error::Model(format!(
                "{} backends for {} model ranks",
                backends.len(),
                models.len()
            )));
        }
        let ranks = backends
            .iter()
            .zip(models)
            .map(|(backend, model)| RankParts {
                backend: backend.as_ref(),
                model,
            })
            .collect();
        Self::with_ranks(ranks, abort, config)
    }

    /// An engine over several devices (tensor parallelism): `ranks[i]` is GPU i's backend
    /// and model shard, whose collectives (NCCL) join the other ranks'; `abort` makes the
    /// ranks that wait for a failed one return. Each step runs on every rank at once, one
    /// thread a rank; one scheduler and block manager serve all (a block id names the same
    /// block on every rank). The shards' layers may differ in head counts only.
    pub fn with_ranks(
        ranks: Vec<RankParts<'a>>,
        abort: Option<AbortRanks>,
        config: &EngineConfig,
    ) -> Result<Self> {
        let Some(first) = ranks.first() else {
            return Err(Error::Model("an engine of no rank".into()));
        };
        let layers = first.model.layers().to_vec();
        if layers.is_empty() {
            return Err(Error::Model("the model has no layer".into()));
        }
        let kind = first.model.kind();
        let pools = &config.scheduler.blocks;
        // The pools' sizes checked before any cache is allocated; the caches (far larger than
        // the scheduler's bookkeeping of their blocks, and zeroed lazily on the host) before
        // that bookkeeping, so that a pool too large for the memory is a clean out-of-memory
        // error of the allocation that cannot be made.
        let mut scheduler_config = config.scheduler.clone();
        // Blocks that left the window are released only where every decoder self-attention
        // has that window (cross blocks never are).
        let decoders: Vec<&AttentionConfig> = layers
            .iter()
            .filter(|c| c.attn_type() == AttnType::Decoder)
            .collect();
        let window = decoders.first().and_then(|c| c.sliding_window());
        scheduler_config.blocks.sliding_window =
            window.filter(|_| decoders.iter().all(|c| c.sliding_window() == window));
        // An encoder-decoder model's decoder keys depend on the encoder's output, which the
        // prefix hash does not cover (vLLM turns prefix caching off for these models too).
        if kind == ModelKind::EncoderDecoder {
            scheduler_config.blocks.prefix_caching = false;
        }
        scheduler_config.validate()?;
        let mut ranks = ranks
            .into_iter()
            .enumerate()
            .map(|(i, parts)| Rank::new(parts, config, i == 0))
            .collect::<Result<Vec<_>>>()?;
        check_ranks_agree(&ranks)?;
        let mut runner = RankRunner::new(ranks.len(), abort)?;
        // The CUDA graphs, captured now (the ranks' collectives inside: watched as a step is).
        runner.run(&mut ranks, |_, rank| rank.capture_graphs())?;
        let scheduler = Scheduler::new(scheduler_config)?;
        Ok(Engine {
            ranks,
            runner,
            block_size: pools.block_size,
            num_blocks: pools.num_device_blocks,
            scheduler,
            check: None,
            sampler: Sampler::new(),
            active: HashMap::new(),
            masked: Vec::new(),
            buffers: StepBuffers::default(),
            steps: 0,
            epoch: Instant::now(),
        })
    }

    /// Rank 0's model, which answers for every rank's.
    fn model(&self) -> &dyn Model {
        self.ranks[0].model.as_ref()
    }

    /// The engine with `check` called on every attention call of the steps it picks (the
    /// harness's verifier recomputing them with `reference`); its counts go into the report.
    pub fn with_check(mut self, check: Box<dyn CallCheck + 'a>) -> Self {
        self.check = Some(Mutex::new(check));
        self
    }

    /// The engine with a step of several ranks aborted (its collectives, through the abort
    /// hook) once it has run `timeout` ([`DEFAULT_RANK_TIMEOUT`] unless set): the step then
    /// fails saying so, instead of a rank waiting forever for peers that never come.
    pub fn with_rank_timeout(self, timeout: std::time::Duration) -> Self {
        self.runner.set_timeout(timeout);
        self
    }

    /// Restarts the clock that the step records' `end` times count from.
    pub fn restart_clock(&mut self) {
        self.epoch = Instant::now();
    }

    /// Queues request `id` (an id the engine does not hold): checked first against what the
    /// scheduler cannot see (token ids against the vocabulary, lengths against the model's
    /// context, the sampling settings, an encoder prompt against the model's kind), then by
    /// the scheduler (a request larger than the whole pool or a step's budgets). It joins the
    /// running batch at the next step that has room for it. A refused request changes nothing.
    pub fn add_request(
        &mut self,
        id: RequestId,
        r: EngineRequest,
    ) -> std::result::Result<(), SchedulerError> {
        self.check_request(id, &r)?;
        let kind = self.model().kind();
        let spec = match (kind, r.encoder_prompt) {
            (ModelKind::EncoderOnly, None) => RequestSpec::encode(id, r.prompt),
            (ModelKind::EncoderDecoder, Some(encoder)) => {
                RequestSpec::new(id, r.prompt, r.max_new_tokens).encoder_prompt(encoder)
            }
            (ModelKind::Decoder, None) => RequestSpec::new(id, r.prompt, r.max_new_tokens),
            (_, encoder) => {
                return Err(SchedulerError::rejected(
                    id,
                    "encoder_prompt",
                    encoder.map_or("none".into(), |e| format!("{} tokens", e.len())),
                    match kind {
                        ModelKind::EncoderDecoder => {
                            "the encoder's tokens (the model is encoder-decoder)"
                        }
                        _ => "none (only an encoder-decoder model takes one)",
                    },
                ))
            }
        };
        let mut stop_tokens = if r.ignore_eos {
            Vec::new()
        } else {
            self.model().stop_tokens()
        };
        for &t in &r.stop_token_ids {
            if !stop_tokens.contains(&t) {
                stop_tokens.push(t);
            }
        }
        let prompt_len = spec.prompt.len();
        self.scheduler
            .add_request(spec.samples(r.n).stop_tokens(stop_tokens.clone()))?;
        self.active.insert(
            id,
            ActiveRequest {
                sampling: r.sampling,
                prompt_len,
                min_tokens: r.min_tokens,
                stop_tokens,
            },
        );
        Ok(())
    }

    /// Aborts request `id` wherever it is (waiting, running or swapped out), freeing its
    /// blocks at once: what a client that went away asks for. `Ok(false)` for a request the
    /// engine does not hold (finished, refused, or never added).
    pub fn abort(&mut self, id: RequestId) -> Result<bool> {
        let held = self.scheduler.abort(id)?;
        self.active.remove(&id);
        Ok(held)
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// The scheduler: queue lengths, counters, and the block manager (with its check).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Blocks in the device pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of the device caches of every layer on every rank (keys and values, the CUDA
    /// graphs' padding blocks included).
    pub fn kv_cache_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .flat_map(|r| &r.caches)
            .map(|c| 2 * c.spec().block_bytes() as u64 * c.spec().num_blocks as u64)
            .sum()
    }

    /// Devices the engine runs on (its tensor-parallel ranks).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The model's name.
    pub fn model_name(&self) -> String {
        self.model().name()
    }

    /// The attention calls made so far, and the check's counts where there is a check.
    pub fn verify_counts(&self) -> VerifyCounts {
        let mut counts = self
            .check
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|p| p.into_inner()).counts().clone())
            .unwrap_or_default();
        counts.calls_total = self.ranks.iter().map(|r| r.attention_calls).sum();
        counts
    }

    /// Runs the next step: the scheduler picks its work among the queued requests, the
    /// engine moves blocks, runs the model and samples. Returns what the step made: every
    /// sampled token by request and sample (as it is sampled: the tokens to stream), pooled
    /// states, and the scheduler's events (a request's `Finished` event comes in the step
    /// that sampled its last token). With nothing to run (no request held) the output is
    /// empty and `record` is `None`.
    ///
    /// # Errors
    /// The model's or backend's errors, and a scheduler that holds requests but schedules
    /// none (an accounting bug): the engine cannot go on after one.
    pub fn step(&mut self) -> Result<StepOutput> {
        let batch = self.scheduler.schedule()?;
        if batch.seqs.is_empty() && batch.swap_out.is_empty() {
            // Nothing to run: the empty step is closed (the scheduler takes no other until
            // it is).
            let events = self.scheduler.finish_step(&[])?;
            self.forget_finished(&events);
            if self.scheduler.has_unfinished() && events.is_empty() {
                return Err(Error::Accounting(
                    "the scheduler holds requests but schedules nothing".into(),
                ));
            }
            return Ok(StepOutput {
                events,
                ..StepOutput::default()
            });
        }
        let mut buffers = std::mem::take(&mut self.buffers);
        let output = self.run_step(&batch, &mut buffers);
        self.buffers = buffers;
        let output = output?;
        self.forget_finished(&output.events);
        Ok(output)
    }

    /// Drops the per-request state of the requests that finished.
    fn forget_finished(&mut self, events: &[StepEvent]) {
        for event in events {
            if let StepEvent::Finished { request, .. } = event {
                self.active.remove(request);
            }
        }
    }

    /// What the scheduler cannot see of a request, checked when it arrives: its token ids
    /// against the vocabulary, its length against the model's context, its sampling settings
    /// (as the sampler computes them, in f32).
    fn check_request(
        &self,
        id: RequestId,
        r: &EngineRequest,
    ) -> std::result::Result<(), SchedulerError> {
        let reject = |field: &str, value: String, expected: String| {
            SchedulerError::rejected(id, field, value, expected)
        };
        let vocab = self.model().vocab_size();
        let prompts = [
            ("prompt", Some(&r.prompt)),
            ("encoder_prompt", r.encoder_prompt.as_ref()),
        ];
        for (field, tokens) in prompts {
            let Some(tokens) = tokens else { continue };
            if let Some((i, t)) = tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= vocab)
            {
                return Err(reject(
                    field,
                    format!("token {t} at position {i}"),
                    format!("token ids below the vocabulary's size, {vocab}"),
                ));
            }
        }
        let context = self.model().max_context();
        let new_tokens = match self.model().kind() {
            ModelKind::EncoderOnly => 0,
            _ => r.max_new_tokens,
        };
        if r.prompt.len().saturating_add(new_tokens) > context {
            return Err(reject(
                "prompt + max_new_tokens",
                format!("{} + {new_tokens} tokens", r.prompt.len()),
                format!("at most the model's context, {context} tokens"),
            ));
        }
        if let Some(encoder) = r.encoder_prompt.as_ref().filter(|e| e.len() > context) {
            return Err(reject(
                "encoder_prompt",
                format!("{} tokens", encoder.len()),
                format!("at most the model's context, {context} tokens"),
            ));
        }
        r.sampling.validate().map_err(|e| {
            reject(
                "sampling",
                e.to_string(),
                "a temperature that is a number and top_p in (0, 1] as an f32".into(),
            )
        })
    }

    /// Runs one scheduled step.
    fn run_step(&mut self, batch: &StepBatch, buf: &mut StepBuffers) -> Result<StepOutput> {
        let step_start = Instant::now();
        for rank in &mut self.ranks {
            rank.move_blocks(batch)?;
        }
        if batch.seqs.is_empty() {
            // A step that only swapped out: the scheduler still closes it.
            return Ok(StepOutput {
                events: self.scheduler.finish_step(&[])?,
                ..StepOutput::default()
            });
        }
        buf.tokens.clear();
        buf.positions.clear();
        buf.logit_rows.clear();
        buf.encoder_tokens.clear();
        buf.encoder_positions.clear();
        let (mut prefill, mut decode) = (0, 0);
        // Each sequence's self-attention description (also the query side of its
        // cross-attention), and the step's encoder runs.
        let mut descs = Vec::with_capacity(batch.seqs.len());
        let mut dense_lens = Vec::new();
        for s in &batch.seqs {
            let first_row = buf.tokens.len();
            buf.tokens.extend_from_slice(&s.tokens);
            buf.positions.extend(s.cached..s.cached + s.tokens.len());
            if s.encoder_only {
                // Its pooled state is its first token's (BERT's [CLS]).
                buf.logit_rows.push(first_row);
                dense_lens.push(s.tokens.len());
            } else if s.num_samples > 0 {
                buf.logit_rows.push(buf.tokens.len() - 1);
            }
            if let Some(encoder) = s.cross.as_ref().and_then(|c| c.encoder_tokens.as_ref()) {
                buf.encoder_tokens.extend_from_slice(encoder);
                buf.encoder_positions.extend(0..encoder.len());
                dense_lens.push(encoder.len());
                prefill += encoder.len();
            }
            descs.push(if s.is_decode {
                decode += 1;
                SequenceDesc::decode(s.cached, &s.block_table)
            } else {
                prefill += s.tokens.len();
                SequenceDesc::prompt(s.cached, s.tokens.len(), &s.block_table)
            });
        }
        let check_layers = match self.check.as_mut() {
            Some(check) => check
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .layers_for_step(self.ranks[0].layers.len()),
            None => Vec::new(),
        };
        // Every sample of the step greedy, none with stop tokens to mask: the model may keep
        // its logits to itself.
        let greedy = batch.seqs.iter().all(|s| {
            !s.encoder_only
                && (s.num_samples == 0
                    || self.active.get(&s.request).is_none_or(|r| {
                        r.sampling.is_greedy() && !r.masks_stop_tokens_at(s.cached + s.tokens.len())
                    }))
        });
        // A decode step with nothing to check may replay a CUDA graph of the model.
        let graph_step = greedy
            && check_layers.is_empty()
            && batch
                .seqs
                .iter()
                .all(|s| s.is_decode && s.cross.is_none() && !s.encoder_only);
        let forward_start = Instant::now();
        let step = StepForward {
            batch,
            tokens: buf.step_tokens(),
            descs: &descs,
            dense_lens: &dense_lens,
            block_size: self.block_size,
            step: self.steps,
            check: self
                .check
                .as_ref()
                .filter(|_| !check_layers.is_empty())
                .map(|c| (check_layers.as_slice(), c)),
            greedy,
        };
        // Every rank runs the step (a graph replay where one fits: each rank decides alike).
        let replayed = self.runner.run(&mut self.ranks, |_, rank| {
            let replayed = graph_step && rank.replay_decode(step.descs, step.tokens)?;
            if !replayed {
                rank.forward(&step)?;
            }
            Ok(replayed)
        })?[0];
        let forward_seconds = forward_start.elapsed().as_secs_f64();
        let attention_seconds = self.ranks[0].clock.take_seconds()?;
        let out = &self.ranks[0].output;
        let width = self.model().output_width();
        let mut results: Vec<Sampled> = Vec::with_capacity(batch.seqs.len());
        let mut pooled_states = Vec::new();
        let mut row = 0;
        for s in &batch.seqs {
            let mut tokens = Vec::with_capacity(s.num_samples);
            // An encoder-only sequence's pooled state, or a sampling one's logits.
            if greedy && s.num_samples > 0 {
                let token = *out.greedy.get(row).ok_or_else(|| {
                    Error::Model(format!(
                        "{} greedy tokens for {} sequences",
                        out.greedy.len(),
                        batch.seqs.len()
                    ))
                })?;
                if token as usize >= self.model().vocab_size() {
                    return Err(if token == NON_FINITE_TOKEN {
                        Error::NonFinite {
                            at: format!("step {}'s logits (row {row})", self.steps),
                        }
                    } else {
                        Error::Model(format!(
                            "greedy token {token} of row {row}: expected one below the \
                             vocabulary's {}",
                            self.model().vocab_size()
                        ))
                    });
                }
                row += 1;
                tokens.resize(s.num_samples, token);
                results.push(Sampled { seq: s.seq, tokens });
                continue;
            }
            let output = if s.encoder_only || s.num_samples > 0 {
                row += 1;
                Some(
                    out.logits
                        .get((row - 1) * width..row * width)
                        .ok_or_else(|| {
                            Error::Model(format!(
                                "{} output rows for {} sequences",
                                out.logits.len() / width.max(1),
                                batch.seqs.len()
                            ))
                        })?,
                )
            } else {
                None
            };
            if let Some((_, column)) = output.and_then(|o| first_non_finite(o, width)) {
                let what = if s.encoder_only {
                    "pooled state"
                } else {
                    "logits"
                };
                return Err(Error::NonFinite {
                    at: format!(
                        "step {}'s {what} (row {}, element {column})",
                        self.steps,
                        row - 1
                    ),
                });
            }
            if let (true, Some(pooled)) = (s.encoder_only, output) {
                pooled_states.push((s.request, pooled.to_vec()));
            } else if let Some(mut logits) = output {
                let position = s.cached + s.tokens.len();
                let request = self.active.get(&s.request);
                let params = request.map(|r| r.sampling).unwrap_or_default();
                if let Some(r) = request.filter(|r| r.masks_stop_tokens_at(position)) {
                    self.masked.clear();
                    self.masked.extend_from_slice(logits);
                    for &t in &r.stop_tokens {
                        if let Some(l) = self.masked.get_mut(t as usize) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                    logits = &self.masked;
                }
                // The draw of sample i at position p depends on (seed + i, p) only: neither
                // the batch nor a preemption changes it.
                for i in s.sample..s.sample + s.num_samples {
                    let params = SamplingParams {
                        seed: params.seed.wrapping_add(i as u64),
                        ..params
                    };
                    tokens.push(self.sampler.sample(logits, &params, position as u64)?);
                }
            }
            results.push(Sampled { seq: s.seq, tokens });
        }
        // (`results` holds one entry per scheduled sequence, in the batch's order.)
        let sampled: Vec<SampledToken> = batch
            .seqs
            .iter()
            .zip(&results)
            .flat_map(|(s, r)| {
                r.tokens.iter().enumerate().map(|(i, &token)| SampledToken {
                    request: s.request,
                    sample: s.sample + i,
                    token,
                })
            })
            .collect();
        let events = self.scheduler.finish_step(&results)?;
        let usage = self.scheduler.blocks().stats();
        let record = StepRecord {
            end: self.epoch.elapsed().as_secs_f64(),
            seconds: step_start.elapsed().as_secs_f64(),
            forward_seconds,
            attention_seconds,
            graph: replayed,
            prefill_tokens: prefill,
            decode_tokens: decode,
            generated_tokens: sampled.len(),
            blocks_used: usage.device_blocks_in_use,
            blocks_total: self.num_blocks,
            tokens_stored: usage.tokens_stored,
            slots_used: usage.slots_allocated,
        };
        self.steps += 1;
        Ok(StepOutput {
            record: Some(record),
            tokens: sampled,
            pooled: pooled_states,
            events,
        })
    }
}
