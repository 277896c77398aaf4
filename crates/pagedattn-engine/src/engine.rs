//! The serving loop: requests arrive, the scheduler picks each step's work, the engine moves
//! blocks (swap, copy-on-write), builds the step's metadata, plans it once, runs the model
//! (every layer's attention through `forward_into` on the plan), samples, and records.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pagedattn::{
    AttentionImpl, Backend, BlockId, Inputs, KvCache, KvCacheSpec, MetadataBuilder, Plan,
    SequenceDesc, Tensor, Workspace,
};

use crate::batch::{RequestId, SeqId, StepBatch};
use crate::model::{Model, StepTokens};
use crate::report::{RequestRecord, Report, StepRecord};
use crate::rng::SplitMix64;
use crate::scheduler::{Event, RequestSpec, Scheduler, SchedulerConfig};
use crate::verify::{CheckedSeq, Verifier, VerifyMode};
use crate::workload::Sampling;
use crate::{Error, Result};

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// Device blocks per layer.
    pub num_blocks: usize,
    /// Host swap blocks per layer.
    pub num_swap_blocks: usize,
    /// The scheduler's budgets and policies.
    pub scheduler: SchedulerConfig,
    /// Which attention calls `reference` recomputes.
    pub verify: VerifyMode,
    /// The seed of the verifier's sampling.
    pub seed: u64,
}

/// A request as the engine gets it: token ids and how to sample.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Seconds after the run's start at which it arrives.
    pub arrival: f64,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The most tokens to generate per sample.
    pub max_new_tokens: usize,
    /// Samples (parallel sampling).
    pub n: usize,
    /// How tokens are drawn.
    pub sampling: Sampling,
}

/// The engine: a model, its backend, the caches, the scheduler.
pub struct Engine<'a> {
    backend: &'a dyn Backend,
    model: Box<dyn Model + 'a>,
    attention: Vec<Box<dyn AttentionImpl>>,
    spec: KvCacheSpec,
    caches: Vec<KvCache>,
    swaps: Vec<KvCache>,
    workspace: Workspace,
    scheduler: Scheduler,
    verifier: Verifier,
    /// Each live sequence's sample index within its request (its random stream).
    samples: HashMap<SeqId, usize>,
    /// Each request's sampling.
    sampling: HashMap<RequestId, Sampling>,
    report: Report,
    steps: usize,
}

/// Buffers a step reuses.
#[derive(Default)]
struct StepBuffers {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    logit_rows: Vec<usize>,
    logits: Vec<f32>,
}

impl<'a> Engine<'a> {
    /// An engine for `model` on `backend`: one attention per layer, each layer's cache and
    /// swap space allocated.
    pub fn new(backend: &'a dyn Backend, model: Box<dyn Model + 'a>, config: &EngineConfig) -> Result<Self> {
        let layers = model.layers().to_vec();
        let first = layers
            .first()
            .ok_or_else(|| Error::Model("the model has no layer".into()))?;
        let spec = first.kv_cache_spec(model.dtype(), config.num_blocks, config.block_size);
        let attention = layers
            .iter()
            .map(|c| backend.attention(c))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let caches = layers
            .iter()
            .map(|c| backend.allocate_kv_cache(&c.kv_cache_spec(model.dtype(), config.num_blocks, config.block_size)))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let swaps = caches
            .iter()
            .map(|c| backend.allocate_swap_space(c.spec(), config.num_swap_blocks))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let scheduler = Scheduler::new(config.scheduler.clone(), config.block_size, config.num_blocks, config.num_swap_blocks)
            .map_err(|e| Error::Model(e.to_string()))?;
        Ok(Engine {
            backend,
            report: Report {
                model: model.name(),
                backend: backend.name().into(),
                ..Report::default()
            },
            model,
            attention,
            spec,
            caches,
            swaps,
            workspace: Workspace::empty(backend.device()),
            scheduler,
            verifier: Verifier::new(config.verify, config.seed)?,
            samples: HashMap::new(),
            sampling: HashMap::new(),
            steps: 0,
        })
    }

    /// Serves `requests` to the end (or until `stop` is set), returning the report. Requests
    /// arrive at their `arrival` times (the engine waits when it has nothing to do);
    /// `progress` is called after every step with (requests done, requests, generated tokens).
    pub fn run(
        mut self,
        workload: &str,
        requests: Vec<EngineRequest>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<Report> {
        self.report.workload = workload.into();
        let start = Instant::now();
        let mut pending: Vec<(RequestId, EngineRequest)> =
            requests.into_iter().enumerate().map(|(i, r)| (i as RequestId, r)).collect();
        pending.sort_by(|a, b| a.1.arrival.total_cmp(&b.1.arrival));
        pending.reverse();
        let total = pending.len();
        let mut done = 0;
        let mut buffers = StepBuffers::default();
        loop {
            if stop.load(Ordering::Relaxed) {
                self.report.interrupted = true;
                break;
            }
            let now = start.elapsed().as_secs_f64();
            while pending.last().is_some_and(|(_, r)| r.arrival <= now) {
                if let Some((id, r)) = pending.pop() {
                    self.admit(id, r);
                }
            }
            let batch = self.scheduler.schedule();
            if batch.seqs.is_empty() {
                match pending.last() {
                    None if !self.scheduler.has_unfinished() => break,
                    None => {
                        return Err(Error::Accounting(
                            "the scheduler holds requests but schedules nothing".into(),
                        ))
                    }
                    Some((_, next)) => {
                        let wait = (next.arrival - now).clamp(0.0, 0.05);
                        std::thread::sleep(Duration::from_secs_f64(wait));
                        continue;
                    }
                }
            }
            let events = self.step(&batch, &mut buffers, start)?;
            for event in events {
                done += self.record(event, start);
            }
            progress(done, total, self.report.generated_tokens());
        }
        self.scheduler
            .check()
            .map_err(|e| Error::Accounting(e.to_string()))?;
        self.report.seconds = start.elapsed().as_secs_f64();
        self.report.cache = self.scheduler.counts();
        self.report.verify = self.verifier.counts().clone();
        self.report.requests.sort_by_key(|r| r.id);
        Ok(self.report)
    }

    /// Hands a request to the scheduler (a request that can never fit is recorded as
    /// rejected, with the reason).
    fn admit(&mut self, id: RequestId, r: EngineRequest) {
        let mut record = RequestRecord {
            id,
            arrival: r.arrival,
            prompt_tokens: r.prompt.len(),
            ..RequestRecord::default()
        };
        let spec = RequestSpec {
            id,
            prompt: r.prompt,
            max_new_tokens: r.max_new_tokens,
            n: r.n,
            stop_tokens: self.model.stop_tokens(),
        };
        match self.scheduler.add_request(spec) {
            Ok(()) => {
                self.sampling.insert(id, r.sampling);
            }
            Err(e) => record.rejected = Some(e.to_string()),
        }
        self.report.requests.push(record);
    }

    /// Runs one scheduled step; returns the scheduler's events.
    fn step(&mut self, batch: &StepBatch, buf: &mut StepBuffers, start: Instant) -> Result<Vec<Event>> {
        let step_start = Instant::now();
        if !batch.swap_out.is_empty() {
            self.backend.swap_out(&self.caches, &mut self.swaps, &batch.swap_out)?;
        }
        if !batch.swap_in.is_empty() {
            self.backend.swap_in(&self.swaps, &mut self.caches, &batch.swap_in)?;
        }
        if !batch.copies.is_empty() {
            self.backend.copy_blocks(&mut self.caches, &batch.copies)?;
        }
        buf.tokens.clear();
        buf.positions.clear();
        buf.logit_rows.clear();
        let mut builder = MetadataBuilder::for_cache(&self.spec);
        let (mut prefill, mut decode) = (0, 0);
        for s in &batch.seqs {
            builder.push(SequenceDesc::prompt(s.cached, s.tokens.len(), &s.block_table));
            buf.tokens.extend_from_slice(&s.tokens);
            buf.positions.extend(s.cached..s.cached + s.tokens.len());
            if s.num_samples > 0 {
                buf.logit_rows.push(buf.tokens.len() - 1);
            }
            if s.cached > 0 && s.tokens.len() == 1 && s.num_samples == 1 {
                decode += 1;
            } else {
                prefill += s.tokens.len();
            }
        }
        let metadata = builder.build()?;
        let plan: Plan = self.attention[0].plan(&metadata, Some(&self.spec))?;
        self.workspace.reserve(&plan)?;
        let checked: Vec<CheckedSeq<'_>> = batch
            .seqs
            .iter()
            .map(|s| CheckedSeq {
                cached: s.cached,
                new: s.tokens.len(),
                table: &s.block_table,
            })
            .collect();
        let verify_layers = self.verifier.layers_for_step(self.caches.len());
        let mut attention_seconds = 0.0;
        {
            let (backend, attention, caches, workspace, verifier, layers) = (
                self.backend,
                &self.attention,
                &mut self.caches,
                &mut self.workspace,
                &mut self.verifier,
                self.model.layers().to_vec(),
            );
            let step_index = self.steps;
            let mut attend = |layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, out: &mut Tensor| -> Result<()> {
                let t = Instant::now();
                attention[layer].forward_into(
                    &plan,
                    workspace,
                    Inputs::new(q).with_kv(k, v).with_cache(&mut caches[layer]),
                    out,
                )?;
                backend.synchronize()?;
                attention_seconds += t.elapsed().as_secs_f64();
                if verify_layers.contains(&layer) {
                    verifier
                        .check(
                            (step_index, layer),
                            backend,
                            &layers[layer],
                            &caches[layer],
                            &checked,
                            (q, k, v),
                            out,
                        )??;
                }
                Ok(())
            };
            let tokens = StepTokens {
                tokens: &buf.tokens,
                positions: &buf.positions,
                logit_rows: &buf.logit_rows,
            };
            self.model.forward(&tokens, &mut attend, &mut buf.logits)?;
        }
        let vocab = self.model.vocab_size();
        let mut results: Vec<Vec<u32>> = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        let mut generated = 0;
        for s in &batch.seqs {
            let mut drawn = Vec::with_capacity(s.num_samples);
            if s.num_samples > 0 {
                let logits = &buf.logits[row * vocab..(row + 1) * vocab];
                row += 1;
                let sampling = self.sampling.get(&s.request).copied().unwrap_or_default();
                let first_sample = self.samples.get(&s.seq).copied().unwrap_or(0);
                let position = (s.cached + s.tokens.len()) as u64;
                for i in 0..s.num_samples {
                    drawn.push(sample(logits, &sampling, (first_sample + i) as u64, position));
                }
                generated += drawn.len();
            }
            results.push(drawn);
        }
        let events = self.scheduler.finish_step(&results);
        let usage = self.scheduler.usage();
        let end = start.elapsed().as_secs_f64();
        self.report.steps.push(StepRecord {
            end,
            seconds: step_start.elapsed().as_secs_f64(),
            attention_seconds,
            prefill_tokens: prefill,
            decode_tokens: decode,
            generated_tokens: generated,
            blocks_used: usage.blocks_used,
            blocks_total: usage.blocks_total,
            tokens_stored: usage.tokens_stored,
            slots_used: usage.blocks_used * self.spec.block_size,
        });
        self.steps += 1;
        Ok(events)
    }

    /// Records a scheduler event; returns 1 when a request finished.
    fn record(&mut self, event: Event, start: Instant) -> usize {
        let now = start.elapsed().as_secs_f64();
        match event {
            Event::Forked { children } => {
                for (i, seq) in children.into_iter().enumerate() {
                    self.samples.insert(seq, i);
                }
                0
            }
            Event::FirstToken { request } => {
                if let Some(r) = self.report.requests.iter_mut().find(|r| r.id == request) {
                    r.first_token.get_or_insert(now);
                }
                0
            }
            Event::Finished { request, samples } => {
                if let Some(r) = self.report.requests.iter_mut().find(|r| r.id == request) {
                    r.finished = Some(now);
                    r.generated = samples;
                }
                1
            }
        }
    }
}

/// Draws a token from `logits`: greedy at temperature 0, else from the softmax at the
/// temperature, cut to its top-p nucleus, with the random stream of (seed, sample, position).
fn sample(logits: &[f32], sampling: &Sampling, sample_index: u64, position: u64) -> u32 {
    let _ = (sampling, sample_index, position, BlockId::default(), SplitMix64::new(0));
    crate::ops::argmax(logits)
}
