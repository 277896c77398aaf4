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
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pagedattn::{
    AttentionConfig, AttentionImpl, AttnType, Backend, Device, Inputs, KvCache, KvCacheSpec,
    MetadataBuilder, Plan, SequenceDesc, Tensor, Workspace,
};

use crate::batch::{RequestId, StepBatch};
use crate::clock::AttentionClock;
use crate::graphs::DecodeGraphs;
use crate::model::{Model, ModelKind, StepTokens};
use crate::ops::{Sampler, SamplingParams};
use crate::report::{CacheCounts, Report, RequestRecord, StepRecord};
use crate::scheduler::{
    RequestSpec, Sampled, Scheduler, SchedulerConfig, SchedulerError, StepEvent,
};
use crate::verify::{CheckedCall, CheckedCross, CheckedSeq, Verifier, VerifyMode};
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
    /// Replay decode steps from CUDA graphs where the backend and the model allow it (a GPU
    /// model on `cuda`); steps the verifier checks run without.
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
}

/// The engine: a model, its backend, the caches, the scheduler.
pub struct Engine<'a> {
    backend: &'a dyn Backend,
    model: Box<dyn Model + 'a>,
    attention: Vec<Box<dyn AttentionImpl>>,
    /// Each attention's config.
    layers: Vec<AttentionConfig>,
    /// Each attention's cache's index in `caches` (`None`: it runs without one).
    cache_of: Vec<Option<usize>>,
    /// The caches (every `decoder` and `encoder_decoder` attention's, in layer order).
    caches: Vec<KvCache>,
    swaps: Vec<KvCache>,
    block_size: usize,
    num_blocks: usize,
    workspace: Workspace,
    scheduler: Scheduler,
    verifier: Verifier,
    sampler: Sampler,
    /// Each unfinished request's sampling.
    sampling: HashMap<RequestId, SamplingParams>,
    report: Report,
    steps: usize,
    clock: AttentionClock,
    graphs: Option<DecodeGraphs>,
}

/// Buffers a step reuses.
#[derive(Default)]
struct StepBuffers {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    logit_rows: Vec<usize>,
    encoder_tokens: Vec<u32>,
    encoder_positions: Vec<usize>,
    logits: Vec<f32>,
    /// Each logit row's greedy token, in steps whose every sample is greedy.
    greedy: Vec<u32>,
}

/// A step's plans, one per attention type the model has (a type without one this step is
/// not called).
#[derive(Default)]
struct StepPlans {
    /// Decoder self-attention over the paged caches.
    decoder: Option<Plan>,
    /// Encoder (or encoder-only) attention, without a cache.
    dense: Option<Plan>,
    /// Cross-attention of every sequence, reading the cross caches.
    cross_read: Option<Plan>,
    /// The cross-cache write of the sequences at their first decoder step.
    cross_write: Option<Plan>,
}

/// `t` moved to `device`, or `None` where it is there already.
fn moved(t: &Tensor, device: Device) -> Result<Option<Tensor>> {
    Ok(if t.device() == device {
        None
    } else {
        Some(t.to_device(device)?)
    })
}

/// One attention call on `backend`: a model computing on the host with a GPU backend has its
/// tensors moved to the device and the output moved back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_attention(
    backend: &dyn Backend,
    attention: &dyn AttentionImpl,
    plan: &Plan,
    workspace: &mut Workspace,
    query: &Tensor,
    kv: Option<(&Tensor, &Tensor)>,
    cache: Option<&mut KvCache>,
    output: &mut Tensor,
) -> Result<()> {
    let device = backend.device();
    let q_moved = moved(query, device)?;
    let query = q_moved.as_ref().unwrap_or(query);
    let kv_moved = match kv {
        Some((k, v)) => Some((moved(k, device)?, moved(v, device)?)),
        None => None,
    };
    let kv = kv
        .zip(kv_moved.as_ref())
        .map(|((k, v), (mk, mv))| (mk.as_ref().unwrap_or(k), mv.as_ref().unwrap_or(v)));
    let inputs = Inputs::new(query).with_cache_opt(cache);
    let inputs = match kv {
        Some((k, v)) => inputs.with_kv(k, v),
        None => inputs,
    };
    if output.device() == device {
        attention.forward_into(plan, workspace, inputs, output)?;
    } else {
        let mut out = Tensor::zeros_on(device, output.dtype(), output.shape())?;
        attention.forward_into(plan, workspace, inputs, &mut out)?;
        output.copy_from(&out)?;
    }
    Ok(())
}

/// `write_kv` of `key`/`value` into `cache` on `backend` (moved to its device if needed).
fn write_kv(
    backend: &dyn Backend,
    attention: &dyn AttentionImpl,
    plan: &Plan,
    key: &Tensor,
    value: &Tensor,
    cache: &mut KvCache,
) -> Result<()> {
    let device = backend.device();
    let (mk, mv) = (moved(key, device)?, moved(value, device)?);
    attention.write_kv(
        plan,
        mk.as_ref().unwrap_or(key),
        mv.as_ref().unwrap_or(value),
        cache,
    )?;
    Ok(())
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
        if layers.is_empty() {
            return Err(Error::Model("the model has no layer".into()));
        }
        let pools = &config.scheduler.blocks;
        let attention = layers
            .iter()
            .map(|c| backend.attention(c))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let mut cache_of = Vec::with_capacity(layers.len());
        let mut model = model;
        let graphs = if config.cuda_graphs {
            DecodeGraphs::new(
                backend,
                model.as_mut(),
                pools.block_size,
                pools.num_device_blocks,
                config.scheduler.max_seqs,
            )?
        } else {
            None
        };
        // The padding sequences of graph steps write past the scheduler's pool.
        let cache_blocks = pools.num_device_blocks + graphs.as_ref().map_or(0, |g| g.pad_blocks());
        let mut caches = Vec::new();
        for c in &layers {
            cache_of.push(if c.attn_type().uses_cache() {
                let spec = c.kv_cache_spec(model.dtype(), cache_blocks, pools.block_size);
                caches.push(backend.allocate_kv_cache(&spec)?);
                Some(caches.len() - 1)
            } else {
                None
            });
        }
        let swaps = caches
            .iter()
            .map(|c| backend.allocate_swap_space(c.spec(), pools.num_host_blocks))
            .collect::<pagedattn::Result<Vec<_>>>()?;
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
        if model.kind() == ModelKind::EncoderDecoder {
            scheduler_config.blocks.prefix_caching = false;
        }
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
            layers,
            cache_of,
            caches,
            swaps,
            block_size: pools.block_size,
            num_blocks: pools.num_device_blocks,
            workspace: Workspace::empty(backend.device()),
            scheduler,
            verifier: Verifier::new(config.verify, config.seed)?,
            sampler: Sampler::new(),
            sampling: HashMap::new(),
            steps: 0,
            clock: AttentionClock::new(backend)?,
            graphs,
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
                encoder_prompt_tokens: r.encoder_prompt.as_ref().map_or(0, Vec::len),
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

    /// Hands a request to the scheduler (a request that can never fit, or that does not fit
    /// the model's kind, is recorded as rejected, with the reason).
    fn admit(&mut self, id: RequestId, r: EngineRequest) -> usize {
        let kind = self.model.kind();
        let spec = match (kind, r.encoder_prompt) {
            (ModelKind::EncoderOnly, None) => Ok(RequestSpec::encode(id, r.prompt)),
            (ModelKind::EncoderDecoder, Some(encoder)) => {
                Ok(RequestSpec::new(id, r.prompt, r.max_new_tokens).encoder_prompt(encoder))
            }
            (ModelKind::Decoder, None) => Ok(RequestSpec::new(id, r.prompt, r.max_new_tokens)),
            (_, encoder) => Err(SchedulerError::Rejected {
                request: id,
                field: "encoder_prompt".into(),
                value: encoder.map_or("none".into(), |e| format!("{} tokens", e.len())),
                expected: match kind {
                    ModelKind::EncoderDecoder => {
                        "the encoder's tokens (the model is encoder-decoder)"
                    }
                    _ => "none (only an encoder-decoder model takes one)",
                }
                .into(),
            }),
        };
        let added = spec.and_then(|spec| {
            self.scheduler
                .add_request(spec.samples(r.n).stop_tokens(if r.ignore_eos {
                    Vec::new()
                } else {
                    self.model.stop_tokens()
                }))
        });
        match added {
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
        if batch.seqs.is_empty() {
            // A step that only swapped out: the scheduler still closes it.
            return Ok(self.scheduler.finish_step(&[])?);
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
        let verify_layers = self.verifier.layers_for_step(self.layers.len());
        // Every sample of the step greedy: the model may keep its logits to itself.
        let greedy = batch.seqs.iter().all(|s| {
            !s.encoder_only
                && (s.num_samples == 0
                    || self
                        .sampling
                        .get(&s.request)
                        .copied()
                        .unwrap_or_default()
                        .is_greedy())
        });
        // A decode step with nothing to verify may replay a CUDA graph of the model.
        let graph_step = greedy
            && verify_layers.is_empty()
            && batch
                .seqs
                .iter()
                .all(|s| s.is_decode && s.cross.is_none() && !s.encoder_only);
        let forward_start = Instant::now();
        let replayed = graph_step && self.replay_decode(&descs, buf)?;
        if !replayed {
            self.forward(batch, buf, (&descs, &dense_lens), &verify_layers, greedy)?;
        }
        let forward_seconds = forward_start.elapsed().as_secs_f64();
        let attention_seconds = self.clock.take_seconds()?;
        let width = self.model.output_width();
        let mut results: Vec<Sampled> = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        let mut generated = 0;
        for s in &batch.seqs {
            let mut tokens = Vec::with_capacity(s.num_samples);
            // An encoder-only sequence's pooled state, or a sampling one's logits.
            if greedy && s.num_samples > 0 {
                let token = *buf.greedy.get(row).ok_or_else(|| {
                    Error::Model(format!(
                        "{} greedy tokens for {} sequences",
                        buf.greedy.len(),
                        batch.seqs.len()
                    ))
                })?;
                row += 1;
                tokens.resize(s.num_samples, token);
                generated += tokens.len();
                results.push(Sampled { seq: s.seq, tokens });
                continue;
            }
            let output = if s.encoder_only || s.num_samples > 0 {
                row += 1;
                Some(
                    buf.logits
                        .get((row - 1) * width..row * width)
                        .ok_or_else(|| {
                            Error::Model(format!(
                                "{} output rows for {} sequences",
                                buf.logits.len() / width.max(1),
                                batch.seqs.len()
                            ))
                        })?,
                )
            } else {
                None
            };
            if let (true, Some(pooled)) = (s.encoder_only, output) {
                self.report.requests[s.request as usize].pooled = Some(pooled.to_vec());
            } else if let Some(logits) = output {
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
        for s in batch
            .seqs
            .iter()
            .filter(|s| s.num_samples > 0 || s.encoder_only)
        {
            self.report.requests[s.request as usize]
                .first_token
                .get_or_insert(now);
        }
        let usage = self.scheduler.blocks().stats();
        self.report.steps.push(StepRecord {
            end: now,
            seconds: step_start.elapsed().as_secs_f64(),
            forward_seconds,
            attention_seconds,
            graph: replayed,
            prefill_tokens: prefill,
            decode_tokens: decode,
            generated_tokens: generated,
            blocks_used: usage.device_blocks_in_use,
            blocks_total: self.num_blocks,
            tokens_stored: usage.tokens_stored,
            slots_used: usage.slots_allocated,
        });
        self.steps += 1;
        Ok(events)
    }

    /// Runs a decode step through a CUDA graph where there are graphs and the step fits one
    /// (the greedy tokens left in `buf`); `false` where it ran nothing.
    fn replay_decode(&mut self, descs: &[SequenceDesc<'_>], buf: &mut StepBuffers) -> Result<bool> {
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(false);
        };
        let step = StepTokens {
            tokens: &buf.tokens,
            positions: &buf.positions,
            logit_rows: &buf.logit_rows,
            encoder_tokens: &[],
            encoder_positions: &[],
        };
        graphs.replay(
            self.backend,
            &self.attention,
            &mut self.caches,
            &self.cache_of,
            self.model.as_mut(),
            (descs, step),
            &mut buf.greedy,
        )
    }

    /// The step's forward pass with the attention of every layer planned and (where
    /// `verify_layers` says) verified, the greedy tokens (`greedy`) or the logits left in `buf`.
    fn forward(
        &mut self,
        batch: &StepBatch,
        buf: &mut StepBuffers,
        (descs, dense_lens): (&[SequenceDesc<'_>], &[usize]),
        verify_layers: &[usize],
        greedy: bool,
    ) -> Result<()> {
        let plans = self.plan(batch, descs, dense_lens)?;
        let checked: Vec<CheckedSeq<'_>> = batch
            .seqs
            .iter()
            .map(|s| CheckedSeq {
                cached: s.cached,
                new: s.tokens.len(),
                table: &s.block_table,
            })
            .collect();
        let cross_checked: Vec<CheckedCross<'_>> = batch
            .seqs
            .iter()
            .filter_map(|s| {
                let c = s.cross.as_ref()?;
                Some(CheckedCross {
                    new: s.tokens.len(),
                    encoder_len: c.len,
                    table: &c.block_table,
                    written: c.encoder_tokens.is_some(),
                })
            })
            .collect();
        {
            let (backend, attention, caches, workspace, verifier, layers, cache_of, clock) = (
                self.backend,
                &self.attention,
                &mut self.caches,
                &mut self.workspace,
                &mut self.verifier,
                &self.layers,
                &self.cache_of,
                &mut self.clock,
            );
            let step_index = self.steps;
            let missing = |what: &str, layer: usize| {
                Error::Model(format!(
                    "attention {layer} ({}) called in a step without {what}",
                    layers[layer].attn_type()
                ))
            };
            let mut attend = |layer: usize,
                              q: &Tensor,
                              k: &Tensor,
                              v: &Tensor,
                              out: &mut Tensor|
             -> Result<()> {
                let config = layers.get(layer).ok_or_else(|| {
                    Error::Model(format!(
                        "attention {layer} called: the model has {}",
                        layers.len()
                    ))
                })?;
                let imp = attention[layer].as_ref();
                let mut cache = cache_of[layer].map(|i| &mut caches[i]);
                clock.time(backend, || match config.attn_type() {
                    AttnType::Decoder => {
                        let plan = plans
                            .decoder
                            .as_ref()
                            .ok_or_else(|| missing("decoder tokens", layer))?;
                        run_attention(
                            backend,
                            imp,
                            plan,
                            workspace,
                            q,
                            Some((k, v)),
                            cache.as_deref_mut(),
                            out,
                        )
                    }
                    AttnType::Encoder | AttnType::EncoderOnly => {
                        let plan = plans
                            .dense
                            .as_ref()
                            .ok_or_else(|| missing("encoder tokens", layer))?;
                        run_attention(backend, imp, plan, workspace, q, Some((k, v)), None, out)
                    }
                    AttnType::EncoderDecoder => {
                        let cross = cache
                            .as_deref_mut()
                            .ok_or_else(|| missing("a cross cache", layer))?;
                        if k.shape().first().is_some_and(|&n| n > 0) {
                            let plan = plans
                                .cross_write
                                .as_ref()
                                .ok_or_else(|| missing("encoder tokens", layer))?;
                            write_kv(backend, imp, plan, k, v, cross)?;
                        }
                        let plan = plans
                            .cross_read
                            .as_ref()
                            .ok_or_else(|| missing("an encoder", layer))?;
                        run_attention(backend, imp, plan, workspace, q, None, Some(cross), out)
                    }
                })?;
                verifier.count_call();
                if verify_layers.contains(&layer) {
                    let cache = cache.as_deref();
                    let call = match (config.attn_type(), cache) {
                        (AttnType::Decoder, Some(cache)) => CheckedCall::Paged {
                            cache,
                            seqs: &checked,
                        },
                        (AttnType::EncoderDecoder, Some(cache)) => CheckedCall::Cross {
                            cache,
                            seqs: &cross_checked,
                        },
                        _ => CheckedCall::Dense { lens: dense_lens },
                    };
                    verifier.check_call(
                        (step_index, layer),
                        backend,
                        config,
                        call,
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
                encoder_tokens: &buf.encoder_tokens,
                encoder_positions: &buf.encoder_positions,
            };
            if greedy {
                self.model.forward_greedy(
                    &tokens,
                    &mut attend,
                    &mut buf.logits,
                    &mut buf.greedy,
                )?;
            } else {
                self.model.forward(&tokens, &mut attend, &mut buf.logits)?;
            }
        }
        Ok(())
    }

    /// The step's plans: for each attention type the model has, its metadata planned once by
    /// the first attention of that type (with that attention's cache geometry).
    fn plan(
        &mut self,
        batch: &StepBatch,
        descs: &[SequenceDesc<'_>],
        dense_lens: &[usize],
    ) -> Result<StepPlans> {
        let mut plans = StepPlans::default();
        let first_of = |t: AttnType| self.layers.iter().position(|c| c.attn_type() == t);
        let spec_of = |layer: usize| -> Option<KvCacheSpec> {
            self.cache_of[layer].map(|i| *self.caches[i].spec())
        };
        let plan = |layer: usize, builder: &MetadataBuilder<'_>| -> Result<Plan> {
            Ok(self.attention[layer].plan(&builder.build()?, spec_of(layer).as_ref())?)
        };
        let only_encoder = batch.seqs.iter().all(|s| s.encoder_only);
        if let Some(layer) = first_of(AttnType::Decoder).filter(|_| !only_encoder) {
            let mut builder = MetadataBuilder::new(self.block_size);
            for d in descs {
                builder.push(*d);
            }
            plans.decoder = Some(plan(layer, &builder)?);
        }
        let dense = first_of(AttnType::Encoder).or(first_of(AttnType::EncoderOnly));
        if let Some(layer) = dense.filter(|_| !dense_lens.is_empty()) {
            let mut builder = MetadataBuilder::new(self.block_size);
            for &len in dense_lens {
                builder.push(SequenceDesc::prompt(0, len, &[]));
            }
            plans.dense = Some(plan(layer, &builder)?);
        }
        if let Some(layer) = first_of(AttnType::EncoderDecoder).filter(|_| !only_encoder) {
            let with_encoder = |written_only: bool| -> Result<MetadataBuilder<'_>> {
                let mut builder = MetadataBuilder::new(self.block_size);
                builder.write_cross_kv(written_only);
                for (s, d) in batch.seqs.iter().zip(descs) {
                    let c = s.cross.as_ref().ok_or_else(|| {
                        Error::Model(format!(
                            "sequence {} of an encoder-decoder model scheduled without its encoder",
                            s.seq
                        ))
                    })?;
                    if c.encoder_tokens.is_some() || !written_only {
                        builder.push(d.with_encoder(c.len, &c.block_table));
                    }
                }
                Ok(builder)
            };
            plans.cross_read = Some(plan(layer, &with_encoder(false)?)?);
            if batch
                .seqs
                .iter()
                .any(|s| s.cross.as_ref().is_some_and(|c| c.encoder_tokens.is_some()))
            {
                plans.cross_write = Some(plan(layer, &with_encoder(true)?)?);
            }
        }
        for p in [
            &plans.decoder,
            &plans.dense,
            &plans.cross_read,
            &plans.cross_write,
        ]
        .into_iter()
        .flatten()
        {
            self.workspace.reserve(p)?;
        }
        Ok(plans)
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
