//! The serving loop: requests arrive, the scheduler picks each step's work, the engine moves
//! blocks (swap, copy-on-write), builds the step's metadata, plans it once, runs the model
//! (every layer's attention through `forward_into` on the plan), samples, and records.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pagedattn::{
    AttentionImpl, Backend, Inputs, KvCache, KvCacheSpec, MetadataBuilder, Plan, SequenceDesc,
    Tensor, Workspace,
};

use crate::batch::{RequestId, StepBatch};
use crate::model::{Model, StepTokens};
use crate::ops::{Sampler, SamplingParams};
use crate::report::{CacheCounts, Report, RequestRecord, StepRecord};
use crate::scheduler::{RequestSpec, Sampled, Scheduler, SchedulerConfig, StepEvent};
use crate::verify::{CheckedSeq, Verifier, VerifyMode};
use crate::{Error, Result};

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The scheduler's budgets and policies, and the block pools (one block id names the
    /// same block in every layer's cache and swap space).
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
    pub sampling: SamplingParams,
    /// Generate `max_new_tokens` even past the model's stop tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
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
    sampler: Sampler,
    /// Each unfinished request's sampling.
    sampling: HashMap<RequestId, SamplingParams>,
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
    pub fn new(
        backend: &'a dyn Backend,
        model: Box<dyn Model + 'a>,
        config: &EngineConfig,
    ) -> Result<Self> {
        let layers = model.layers().to_vec();
        let first = layers
            .first()
            .ok_or_else(|| Error::Model("the model has no layer".into()))?;
        let pools = &config.scheduler.blocks;
        let spec = first.kv_cache_spec(model.dtype(), pools.num_device_blocks, pools.block_size);
        let attention = layers
            .iter()
            .map(|c| backend.attention(c))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let caches = layers
            .iter()
            .map(|c| {
                backend.allocate_kv_cache(&c.kv_cache_spec(
                    model.dtype(),
                    pools.num_device_blocks,
                    pools.block_size,
                ))
            })
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let swaps = caches
            .iter()
            .map(|c| backend.allocate_swap_space(c.spec(), pools.num_host_blocks))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        // Blocks that left the window are released only where every layer has that window.
        let mut scheduler_config = config.scheduler.clone();
        let window = first.sliding_window();
        scheduler_config.blocks.sliding_window =
            window.filter(|_| layers.iter().all(|c| c.sliding_window() == window));
        let scheduler = Scheduler::new(scheduler_config)?;
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
            sampler: Sampler::new(),
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
        // Request i's record is `report.requests[i]`.
        self.report.requests = requests
            .iter()
            .enumerate()
            .map(|(i, r)| RequestRecord {
                id: i as RequestId,
                arrival: r.arrival,
                prompt_tokens: r.prompt.len(),
                ..RequestRecord::default()
            })
            .collect();
        let mut pending: Vec<(RequestId, EngineRequest)> = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i as RequestId, r))
            .collect();
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
                    done += self.admit(id, r);
                }
            }
            let batch = self.scheduler.schedule()?;
            if batch.seqs.is_empty() && batch.swap_out.is_empty() {
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
        if !self.report.interrupted {
            // Every request finished: every block must be free (cached prefixes included).
            self.scheduler
                .blocks()
                .check()
                .map_err(|e| Error::Accounting(e.to_string()))?;
        }
        self.report.seconds = start.elapsed().as_secs_f64();
        let stats = self.scheduler.stats();
        self.report.cache = CacheCounts {
            prefix_queried_tokens: stats.blocks.prefix_query_tokens as usize,
            prefix_hit_tokens: stats.blocks.prefix_hit_tokens as usize,
            preempted_by_swap: stats.preempted_by_swap as usize,
            preempted_by_recompute: stats.preempted_by_recompute as usize,
            blocks_swapped_out: stats.blocks.swapped_out_blocks as usize,
            blocks_swapped_in: stats.blocks.swapped_in_blocks as usize,
            copy_on_write_blocks: stats.blocks.cow_copies as usize,
        };
        self.report.verify = self.verifier.counts().clone();
        Ok(self.report)
    }

    /// Hands a request to the scheduler (a request that can never fit is recorded as
    /// rejected, with the reason).
    fn admit(&mut self, id: RequestId, r: EngineRequest) -> usize {
        let spec = RequestSpec::new(id, r.prompt, r.max_new_tokens)
            .samples(r.n)
            .stop_tokens(if r.ignore_eos {
                Vec::new()
            } else {
                self.model.stop_tokens()
            });
        match self.scheduler.add_request(spec) {
            Ok(()) => {
                self.sampling.insert(id, r.sampling);
                0
            }
            Err(e) => {
                self.report.requests[id as usize].rejected = Some(e.to_string());
                1
            }
        }
    }

    /// Runs one scheduled step; returns the scheduler's events.
    fn step(
        &mut self,
        batch: &StepBatch,
        buf: &mut StepBuffers,
        start: Instant,
    ) -> Result<Vec<StepEvent>> {
        let step_start = Instant::now();
        if !batch.swap_out.is_empty() {
            self.backend
                .swap_out(&self.caches, &mut self.swaps, &batch.swap_out)?;
        }
        if !batch.swap_in.is_empty() {
            self.backend
                .swap_in(&self.swaps, &mut self.caches, &batch.swap_in)?;
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
            builder.push(if s.is_decode {
                decode += 1;
                SequenceDesc::decode(s.cached, &s.block_table)
            } else {
                prefill += s.tokens.len();
                SequenceDesc::prompt(s.cached, s.tokens.len(), &s.block_table)
            });
            buf.tokens.extend_from_slice(&s.tokens);
            buf.positions.extend(s.cached..s.cached + s.tokens.len());
            if s.num_samples > 0 {
                buf.logit_rows.push(buf.tokens.len() - 1);
            }
        }
        if batch.seqs.is_empty() {
            // A step that only swapped out: the scheduler still closes it.
            return Ok(self.scheduler.finish_step(&[])?);
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
            let mut attend = |layer: usize,
                              q: &Tensor,
                              k: &Tensor,
                              v: &Tensor,
                              out: &mut Tensor|
             -> Result<()> {
                let t = Instant::now();
                let device = backend.device();
                if q.device() == device && out.device() == device {
                    attention[layer].forward_into(
                        &plan,
                        workspace,
                        Inputs::new(q).with_kv(k, v).with_cache(&mut caches[layer]),
                        out,
                    )?;
                } else {
                    // A model computing on the host, attention on a GPU backend: the step's
                    // tensors cross to the device and the output comes back.
                    let (dq, dk, dv) = (
                        q.to_device(device)?,
                        k.to_device(device)?,
                        v.to_device(device)?,
                    );
                    let mut dout = Tensor::zeros_on(device, out.dtype(), out.shape())?;
                    attention[layer].forward_into(
                        &plan,
                        workspace,
                        Inputs::new(&dq)
                            .with_kv(&dk, &dv)
                            .with_cache(&mut caches[layer]),
                        &mut dout,
                    )?;
                    out.copy_from(&dout)?;
                }
                backend.synchronize()?;
                attention_seconds += t.elapsed().as_secs_f64();
                if verify_layers.contains(&layer) {
                    verifier.check(
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
        let mut results: Vec<Sampled> = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        let mut generated = 0;
        for s in &batch.seqs {
            let mut tokens = Vec::with_capacity(s.num_samples);
            if s.num_samples > 0 {
                let logits = &buf.logits[row * vocab..(row + 1) * vocab];
                row += 1;
                let params = self.sampling.get(&s.request).copied().unwrap_or_default();
                // The draw of sample i at position p depends on (seed + i, p) only: neither
                // the batch nor a preemption changes it.
                let position = (s.cached + s.tokens.len()) as u64;
                for i in s.sample..s.sample + s.num_samples {
                    let params = SamplingParams {
                        seed: params.seed.wrapping_add(i as u64),
                        ..params
                    };
                    tokens.push(self.sampler.sample(logits, &params, position)?);
                }
                generated += tokens.len();
            }
            results.push(Sampled { seq: s.seq, tokens });
        }
        let events = self.scheduler.finish_step(&results)?;
        let now = start.elapsed().as_secs_f64();
        for s in batch.seqs.iter().filter(|s| s.num_samples > 0) {
            self.report.requests[s.request as usize]
                .first_token
                .get_or_insert(now);
        }
        let usage = self.scheduler.blocks().stats();
        self.report.steps.push(StepRecord {
            end: now,
            seconds: step_start.elapsed().as_secs_f64(),
            attention_seconds,
            prefill_tokens: prefill,
            decode_tokens: decode,
            generated_tokens: generated,
            blocks_used: usage.device_blocks_in_use,
            blocks_total: self.spec.num_blocks,
            tokens_stored: usage.tokens_stored,
            slots_used: usage.slots_allocated,
        });
        self.steps += 1;
        Ok(events)
    }

    /// Records a scheduler event; returns 1 when a request finished.
    fn record(&mut self, event: StepEvent, start: Instant) -> usize {
        let now = start.elapsed().as_secs_f64();
        match event {
            StepEvent::Finished { request, samples } => {
                self.sampling.remove(&request);
                let r = &mut self.report.requests[request as usize];
                r.finished = Some(now);
                r.generated = samples.into_iter().map(|s| s.tokens).collect();
                1
            }
            StepEvent::Preempted { .. } | StepEvent::SwappedIn { .. } => 0,
        }
    }
}
