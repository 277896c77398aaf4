//! Continuous batching with chunked prefill (vLLM's V0 scheduler is the model).
//!
//! Each step, under a token budget and a sequence budget: running decodes first (one token
//! each, oldest request first), preempting the newest running requests when their next tokens
//! need blocks that are not free; then swapped-out requests are swapped back in (oldest first,
//! never in a step that swapped out); then prompt chunks of running requests, then new (or
//! recompute-preempted) requests, oldest first. In the batch, prompt chunks come before
//! decodes (the attention metadata's order).
//!
//! No starvation: every queue is kept in arrival order and preemption always takes the newest
//! running request, so the oldest request on the device is never preempted while another
//! runs; `add_request` refuses requests that could not run alone in the whole pool, so the
//! oldest request, once alone, always fits. Its decodes come first in the budget, swapped
//! requests go back in before any new prompt is admitted, and waiting requests are admitted
//! strictly in order (the head is never overtaken); the watermark is waived when nothing
//! runs. Every other request finishes in a bounded number of steps, so the oldest eventually
//! runs, and by induction every request finishes.

mod request;
mod step;

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use crate::serving::batch::{RequestId, SeqId, StepBatch};
use crate::serving::blocks::{BlockConfig, BlockError, BlockManager, BlockStats};
use request::{Request, Seq};

/// How the scheduler frees blocks when running requests need more than are free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionPolicy {
    /// Copy the victim's blocks to host swap blocks, to copy back later (falls back to
    /// recompute when the host pool is too small).
    Swap,
    /// Free the victim's blocks; it goes back to the waiting queue with its prompt and
    /// generated tokens as a new prompt.
    Recompute,
    /// vLLM's rule: recompute a single-sample request, swap one with `n > 1` (recomputing `n`
    /// diverged samples costs `n` prompts).
    Auto,
}

/// What a preemption did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preemption {
    /// Swapped out to the host.
    Swap,
    /// Freed, to be computed again.
    Recompute,
}

/// The scheduler's budgets, policy and block pools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per step at most (decodes count one each).
    pub max_batched_tokens: usize,
    /// Sequences per step at most.
    pub max_seqs: usize,
    /// How to preempt.
    pub preemption: PreemptionPolicy,
    /// The block manager's pools and features.
    pub blocks: BlockConfig,
}

impl SchedulerConfig {
    /// Refuses zero budgets or a bad block configuration ([`BlockConfig::validate`]).
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if self.max_batched_tokens == 0 {
            return Err(invalid("max_batched_tokens", 0, "> 0"));
        }
        if self.max_seqs == 0 {
            return Err(invalid("max_seqs", 0, "> 0"));
        }
        Ok(self.blocks.validate()?)
    }
}

/// A request to serve. Built with [`RequestSpec::new`]; fields may be added (encoder prompts
/// for encoder-decoder models), hence `non_exhaustive`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestSpec {
    /// The request's id, unique for the engine's lifetime.
    pub id: RequestId,
    /// The prompt's token ids (not empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate per sample at most (> 0).
    pub max_new_tokens: usize,
    /// Samples (parallel sampling; > 0): the prompt is computed once and forked.
    pub n: usize,
    /// Token ids that end a sample (EOS); the stop token is part of the sample's output.
    pub stop_tokens: Vec<u32>,
    /// An encoder-decoder request's encoder prompt (not empty): the encoder runs over it once,
    /// at the request's first decoder step, whose cross-attention writes its keys and values
    /// into the request's cross-cache blocks; every later step reads them there.
    pub encoder_prompt: Option<Vec<u32>>,
    /// Whether this is an encoder-only request ([`RequestSpec::encode`]): `prompt` is computed
    /// in one step, bidirectionally and without blocks, and nothing is generated.
    pub encoder_only: bool,
}

impl RequestSpec {
    /// One sample of up to `max_new_tokens` tokens after `prompt`, no stop tokens.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        RequestSpec {
            id,
            prompt,
            max_new_tokens,
            n: 1,
            stop_tokens: Vec::new(),
            encoder_prompt: None,
            encoder_only: false,
        }
    }

    /// An encoder-only request: `tokens` encoded in one step (so at most the step's token
    /// budget), finished with it; nothing is generated (`max_new_tokens` and `n` play no
    /// part).
    pub fn encode(id: RequestId, tokens: Vec<u32>) -> Self {
        RequestSpec {
            encoder_only: true,
            ..RequestSpec::new(id, tokens, 1)
        }
    }

    /// With an encoder prompt (an encoder-decoder request).
    pub fn encoder_prompt(mut self, tokens: Vec<u32>) -> Self {
        self.encoder_prompt = Some(tokens);
        self
    }

    /// With `n` samples.
    pub fn samples(mut self, n: usize) -> Self {
        self.n = n;
        self
    }

    /// With these stop tokens.
    pub fn stop_tokens(mut self, stop_tokens: Vec<u32>) -> Self {
        self.stop_tokens = stop_tokens;
        self
    }
}

/// What the model runner sampled for one scheduled sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sampled {
    /// The sequence (as scheduled).
    pub seq: SeqId,
    /// Its `num_samples` tokens, in sample order.
    pub tokens: Vec<u32>,
}

/// Why a sample stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_new_tokens`.
    Length,
    /// It generated this stop token.
    Stop(u32),
}

/// One finished sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SampleOutput {
    /// Its sequence.
    pub seq: SeqId,
    /// The tokens it generated.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub reason: FinishReason,
}

/// Something the engine reports after a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepEvent {
    /// Every sample of a request has finished; samples in sample order (none for an
    /// encoder-only request).
    Finished {
        /// The request.
        request: RequestId,
        /// Its samples.
        samples: Vec<SampleOutput>,
    },
    /// A request was preempted this step.
    Preempted {
        /// The request.
        request: RequestId,
        /// How.
        how: Preemption,
    },
    /// A swapped-out request was swapped back in this step.
    SwappedIn {
        /// The request.
        request: RequestId,
    },
}

/// A refused scheduler call; a refused call changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// A request that can never run (the others go on).
    #[error("request {request} rejected: {field} = {value}: expected {expected}")]
    Rejected {
        /// The request.
        request: RequestId,
        /// The offending field.
        field: String,
        /// Its value.
        value: String,
        /// What would have been accepted.
        expected: String,
    },
    /// A bad configuration, step result or call order.
    #[error("{field} = {value}: expected {expected}")]
    Invalid {
        /// The argument or field.
        field: String,
        /// Its value.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// The block manager refused (a scheduler bug: the scheduler checks capacity first).
    #[error(transparent)]
    Blocks(#[from] BlockError),
}

impl SchedulerError {
    /// [`SchedulerError::Rejected`] of `request`: `field` is `value`, `expected` would do.
    pub fn rejected(
        request: RequestId,
        field: impl Into<String>,
        value: impl fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        SchedulerError::Rejected {
            request,
            field: field.into(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}

fn invalid(
    field: impl Into<String>,
    value: impl fmt::Display,
    expected: impl Into<String>,
) -> SchedulerError {
    SchedulerError::Invalid {
        field: field.into(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// Counters for reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    /// Steps scheduled.
    pub steps: u64,
    /// Tokens computed (prompt chunks and decodes).
    pub scheduled_tokens: u64,
    /// Preemptions by swapping.
    pub preempted_by_swap: u64,
    /// Preemptions by recomputing.
    pub preempted_by_recompute: u64,
    /// Swap preemptions turned into recomputes because the host pool was too small.
    pub swap_fallbacks: u64,
    /// Requests finished.
    pub finished_requests: u64,
    /// Requests aborted before they finished.
    pub aborted_requests: u64,
    /// The block manager's counters (copy-on-write copies, swapped blocks, prefix hits).
    pub blocks: BlockStats,
}

/// Arrival-ordered queue keys.
type Queue = BTreeSet<(u64, RequestId)>;

/// The scheduler (see the [module docs](self)).
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    requests: HashMap<RequestId, Request>,
    waiting: Queue,
    running: Queue,
    swapped: Queue,
    next_arrival: u64,
    next_seq: SeqId,
    /// The batch handed out and not yet finished.
    in_flight: Option<StepBatch>,
    /// Preemptions and swap-ins of the step in flight, reported by `finish_step`.
    events: Vec<StepEvent>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler with empty queues; refuses what [`SchedulerConfig::validate`] refuses,
    /// and pools whose bookkeeping the host cannot hold.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        config.validate()?;
        Ok(Scheduler {
            blocks: BlockManager::new(config.blocks.clone())?,
            config,
            requests: HashMap::new(),
            waiting: Queue::new(),
            running: Queue::new(),
            swapped: Queue::new(),
            next_arrival: 0,
            next_seq: 0,
            in_flight: None,
            events: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The block manager (for its `check` and statistics).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Drops request `id` wherever it is (waiting, running or swapped out) and frees every
    /// block it holds at once (device and host, its cross cache included; blocks it shares
    /// with a cached prefix stay cached): what a client that went away asks for. Between steps
    /// only (an abort with a step in flight is refused: the step's results name the request).
    /// `Ok(false)` for a request it does not hold (finished, rejected, or never added).
    pub fn abort(&mut self, id: RequestId) -> Result<bool, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(invalid(
                "abort",
                "called with a step in flight",
                "a call between finish_step and schedule",
            ));
        }
        let Some(r) = self.requests.remove(&id) else {
            return Ok(false);
        };
        for queue in [&mut self.waiting, &mut self.running, &mut self.swapped] {
            queue.remove(&r.key());
        }
        for seq in r.block_ids() {
            // (A waiting request holds no blocks yet, or none since a recompute preemption.)
            if self.blocks.contains(seq) {
                self.blocks.free(seq)?;
            }
        }
        self.stats.aborted_requests += 1;
        Ok(true)
    }

    /// Requests (waiting, running, swapped out).
    pub fn queue_lengths(&self) -> (usize, usize, usize) {
        (self.waiting.len(), self.running.len(), self.swapped.len())
    }

    /// The counters.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            blocks: self.blocks.stats(),
            ..self.stats.clone()
        }
    }

    /// Queues a request, or rejects it if it can never run: an empty prompt, no tokens or
    /// samples asked for, more samples than a step's budgets hold, or more blocks than the
    /// whole device pool. The block bound counts each sample's whole sequence (after a
    /// recompute preemption its samples no longer share their prompt blocks) up to its last
    /// computed token (the final sampled token is never written).
    pub fn add_request(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        let reject = |field: &str, value: String, expected: String| {
            SchedulerError::rejected(spec.id, field, value, expected)
        };
        let c = &self.config;
        if self.requests.contains_key(&spec.id) {
            return Err(reject(
                "id",
                spec.id.to_string(),
                "an id not already queued".into(),
            ));
        }
        if spec.prompt.is_empty() {
            return Err(reject(
                "prompt",
                "[] (0 tokens)".into(),
                "at least one token".into(),
            ));
        }
        if spec.max_new_tokens == 0 {
            return Err(reject("max_new_tokens", "0".into(), "> 0".into()));
        }
        let max_n = c.max_seqs.min(c.max_batched_tokens);
        if spec.n == 0 || spec.n > max_n {
            return Err(reject(
                "n",
                spec.n.to_string(),
                format!("in [1, {max_n}] (the step budgets hold every sample's decode)"),
            ));
        }
        if spec.encoder_only {
            if spec.encoder_prompt.is_some() {
                return Err(reject(
                    "encoder_prompt",
                    "given".into(),
                    "none for an encoder-only request (its prompt is what it encodes)".into(),
                ));
            }
            if spec.prompt.len() > c.max_batched_tokens {
                return Err(reject(
                    "prompt",
                    format!("{} tokens", spec.prompt.len()),
                    format!(
                        "at most max_batched_tokens = {} (an encoder-only prompt is computed in one step)",
                        c.max_batched_tokens
                    ),
                ));
            }
            self.queue(spec, None);
            return Ok(());
        }
        let b = &c.blocks;
        let mut cross_blocks = 0;
        if let Some(encoder) = &spec.encoder_prompt {
            // The encoder runs in the step of the first decoder chunk, one token at least.
            if encoder.is_empty() || encoder.len() >= c.max_batched_tokens {
                return Err(reject(
                    "encoder_prompt",
                    format!("{} tokens", encoder.len()),
                    format!(
                        "in [1, {}] (the encoder runs in one step with at least one decoder token, under max_batched_tokens = {})",
                        c.max_batched_tokens.saturating_sub(1),
                        c.max_batched_tokens
                    ),
                ));
            }
            if b.prefix_caching {
                return Err(reject(
                    "encoder_prompt",
                    format!("{} tokens", encoder.len()),
                    "none while prefix caching is on (the decoder's cached keys depend on the encoder's output, which the prefix hash does not cover)".into(),
                ));
            }
            cross_blocks = encoder.len().div_ceil(b.block_size);
        }
        // (Saturating: the counts are the request's, and too many is a rejection below.)
        let tokens = spec.prompt.len().saturating_add(spec.max_new_tokens) - 1;
        let needed = spec
            .n
            .saturating_mul(tokens.div_ceil(b.block_size))
            .saturating_add(cross_blocks);
        if needed > b.num_device_blocks {
            return Err(reject(
                "prompt + max_new_tokens",
                format!(
                    "{} + {} tokens in {} samples{}",
                    spec.prompt.len(),
                    spec.max_new_tokens,
                    spec.n,
                    spec.encoder_prompt
                        .as_ref()
                        .map(|e| format!(", {} encoder tokens", e.len()))
                        .unwrap_or_default()
                ),
                format!(
                    "at most {} device blocks of {} tokens in all ({needed} needed)",
                    b.num_device_blocks, b.block_size
                ),
            ));
        }
        let cross = spec.encoder_prompt.is_some().then(|| {
            self.next_seq += 1;
            self.next_seq - 1
        });
        self.queue(spec, cross);
        Ok(())
    }

    /// Queues an accepted request (with its cross-cache sequence's id, if it has one).
    fn queue(&mut self, spec: RequestSpec, cross: Option<SeqId>) {
        let seq = Seq {
            id: self.next_seq,
            tokens: spec.prompt.clone(),
            decoding: false,
            finished: None,
        };
        self.next_seq += 1;
        let request = Request {
            arrival: self.next_arrival,
            seqs: vec![seq],
            sampled: false,
            cross,
            spec,
        };
        self.next_arrival += 1;
        self.waiting.insert(request.key());
        self.requests.insert(request.spec.id, request);
    }

    /// Takes the step's sampled tokens (one entry per scheduled sequence, `num_samples`
    /// tokens each): records the computed tokens, forks `n`-sample requests at their prompt's
    /// sampling, appends each sample, finishes samples at a stop token or `max_new_tokens`
    /// (freeing their blocks), and returns the step's events: preemptions and swap-ins of
    /// [`schedule`](Self::schedule), then finished requests.
    pub fn finish_step(&mut self, results: &[Sampled]) -> Result<Vec<StepEvent>, SchedulerError> {
        let batch = self.in_flight.as_ref().ok_or_else(|| {
            invalid(
                "finish_step",
                "called with no step in flight",
                "a call after schedule",
            )
        })?;
        let sampled = match_results(batch, results)?;
        let batch = self.in_flight.take().unwrap_or_default();
        let mut touched = Vec::new();
        for (s, tokens) in batch.seqs.iter().zip(sampled) {
            if s.encoder_only {
                // Its one step is its whole work.
                touched.push(s.request);
                continue;
            }
            self.blocks
                .mark_computed(s.seq, s.cached + s.tokens.len())?;
            if let Some(c) = &s.cross {
                if c.encoder_tokens.is_some() {
                    let id = self.requests.get(&s.request).and_then(|r| r.cross);
                    let id = id.ok_or_else(|| {
                        invalid("request", s.request, "a request with a cross cache")
                    })?;
                    self.blocks.mark_computed(id, c.len)?;
                }
            }
            if !tokens.is_empty() {
                self.take_samples(s.request, s.seq, tokens)?;
                if !touched.contains(&s.request) {
                    touched.push(s.request);
                }
            }
        }
        let mut events = std::mem::take(&mut self.events);
        for id in touched {
            if let Some(samples) = self.finished_samples(id) {
                if let Some(r) = self.requests.remove(&id) {
                    self.running.remove(&r.key());
                    if let Some(cross) = r.cross {
                        self.blocks.free(cross)?;
                    }
                }
                self.stats.finished_requests += 1;
                events.push(StepEvent::Finished {
                    request: id,
                    samples,
                });
            }
        }
        Ok(events)
    }

    /// Appends a scheduled sequence's samples: the first sampling of an `n`-sample request
    /// forks it, sample `i` going to its `i`-th sequence.
    fn take_samples(
        &mut self,
        id: RequestId,
        seq: SeqId,
        tokens: &[u32],
    ) -> Result<(), SchedulerError> {
        let r = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| invalid("request", id, "a queued request"))?;
        let mut targets = vec![seq];
        if tokens.len() > 1 {
            let parent = r
                .seqs
                .iter()
                .find(|s| s.id == seq)
                .cloned()
                .ok_or_else(|| invalid("seq", seq, "a sequence of its request"))?;
            for _ in 1..tokens.len() {
                let child = Seq {
                    id: self.next_seq,
                    ..parent.clone()
                };
                self.next_seq += 1;
                self.blocks.fork(seq, child.id)?;
                targets.push(child.id);
                r.seqs.push(child);
            }
        }
        r.sampled = true;
        for (target, &token) in targets.into_iter().zip(tokens) {
            let s = r
                .seqs
                .iter_mut()
                .find(|s| s.id == target)
                .ok_or_else(|| invalid("seq", target, "a sequence of its request"))?;
            s.tokens.push(token);
            s.decoding = true;
            let generated = s.tokens.len() - r.spec.prompt.len();
            s.finished = if r.spec.stop_tokens.contains(&token) {
                Some(FinishReason::Stop(token))
            } else if generated >= r.spec.max_new_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if s.finished.is_some() {
                self.blocks.free(target)?;
            }
        }
        Ok(())
    }

    /// The outputs of request `id` if every sample has finished (none for an encoder-only
    /// request, finished by its one step).
    fn finished_samples(&self, id: RequestId) -> Option<Vec<SampleOutput>> {
        let r = self.requests.get(&id)?;
        if r.spec.encoder_only {
            return Some(Vec::new());
        }
        r.seqs
            .iter()
            .map(|s| {
                s.finished.map(|reason| SampleOutput {
                    seq: s.id,
                    tokens: r.generated(s).to_vec(),
                    reason,
                })
            })
            .collect()
    }
}

/// Pairs each scheduled sequence with its result's tokens, checking that every scheduled
/// sequence has exactly one result of `num_samples` tokens.
fn match_results<'a>(
    batch: &StepBatch,
    results: &'a [Sampled],
) -> Result<Vec<&'a [u32]>, SchedulerError> {
    if results.len() != batch.seqs.len() {
        return Err(invalid(
            "results.len()",
            results.len(),
            format!("{} (one per scheduled sequence)", batch.seqs.len()),
        ));
    }
    let by_seq: HashMap<SeqId, (usize, &[u32])> = results
        .iter()
        .enumerate()
        .map(|(i, r)| (r.seq, (i, r.tokens.as_slice())))
        .collect();
    batch
        .seqs
        .iter()
        .map(|s| match by_seq.get(&s.seq) {
            None => Err(invalid(
                "results",
                format!("no entry for sequence {}", s.seq),
                "one per scheduled sequence",
            )),
            Some(&(i, tokens)) if tokens.len() != s.num_samples => Err(invalid(
                format!("results[{i}].tokens.len()"),
                tokens.len(),
                format!("{} (num_samples of sequence {})", s.num_samples, s.seq),
            )),
            Some(&(_, tokens)) => Ok(tokens),
        })
        .collect()
}
