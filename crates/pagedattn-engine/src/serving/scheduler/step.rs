//! One step's scheduling: decodes (preempting when blocks run out), swap-ins, prompt chunks
//! and admissions, under the budgets.

use crate::serving::batch::{CrossSeq, RequestId, ScheduledSeq, SeqId, StepBatch};

use super::{invalid, Preemption, PreemptionPolicy, Scheduler, SchedulerError, StepEvent};

/// What is left of a step's budgets.
struct Budget {
    tokens: usize,
    seqs: usize,
}

impl Budget {
    /// Whether `seqs` sequences of one token each still fit.
    fn fits(&self, seqs: usize) -> bool {
        seqs <= self.tokens && seqs <= self.seqs
    }
}

/// The batch being built: prompt chunks and decodes apart, to be joined in metadata order.
#[derive(Default)]
struct Draft {
    prefills: Vec<ScheduledSeq>,
    decodes: Vec<ScheduledSeq>,
    batch: StepBatch,
    preempted: bool,
}

impl Scheduler {
    /// Builds the next step (see the module docs for the policy). Refused while the previous
    /// step is not finished.
    pub fn schedule(&mut self) -> Result<StepBatch, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(invalid(
                "schedule",
                "called with a step in flight",
                "finish_step first",
            ));
        }
        let mut budget = Budget {
            tokens: self.config.max_batched_tokens,
            seqs: self.config.max_seqs,
        };
        let mut draft = Draft::default();
        self.schedule_decodes(&mut budget, &mut draft)?;
        // Swapping in during a step that swapped out could reuse a host block being written.
        if !draft.preempted {
            self.swap_in(&mut budget, &mut draft)?;
        }
        let running: Vec<_> = self.running.iter().map(|&(_, id)| id).collect();
        for id in running {
            self.schedule_prompt_chunks(id, &mut budget, &mut draft)?;
        }
        // New prompts wait for swapped requests (older) and for steps without preemption
        // (blocks are short).
        if !draft.preempted && self.swapped.is_empty() {
            self.admit(&mut budget, &mut draft)?;
        }
        let Draft {
            prefills,
            decodes,
            mut batch,
            ..
        } = draft;
        batch.seqs = prefills;
        batch.seqs.extend(decodes);
        self.stats.steps += 1;
        self.stats.scheduled_tokens += batch
            .seqs
            .iter()
            .map(|s| s.tokens.len() as u64)
            .sum::<u64>();
        self.in_flight = Some(batch.clone());
        Ok(batch)
    }

    /// Running requests' decodes, oldest first; a request whose next tokens need more blocks
    /// than are free preempts the newest running requests, itself last.
    fn schedule_decodes(
        &mut self,
        budget: &mut Budget,
        draft: &mut Draft,
    ) -> Result<(), SchedulerError> {
        let order: Vec<(u64, RequestId)> = self.running.iter().copied().collect();
        // order[end..] have been preempted.
        let mut end = order.len();
        let mut i = 0;
        while i < end {
            let id = order[i].1;
            i += 1;
            let seqs = self.decoding_seqs(id);
            if seqs.is_empty() || !budget.fits(seqs.len()) {
                continue;
            }
            let preempted_self = loop {
                let needed = self.blocks.blocks_needed_to_append_one_each(&seqs)?;
                if needed <= self.blocks.free_device_blocks() {
                    break false;
                }
                end -= 1;
                self.preempt(order[end].1, draft)?;
                if end + 1 == i {
                    break true;
                }
            };
            if !preempted_self {
                self.schedule_decode(id, budget, draft)?;
            }
        }
        Ok(())
    }

    /// Appends each decoding sequence of `id`'s last token and schedules it; the caller has
    /// checked the blocks and the budget.
    fn schedule_decode(
        &mut self,
        id: RequestId,
        budget: &mut Budget,
        draft: &mut Draft,
    ) -> Result<(), SchedulerError> {
        for seq in self.decoding_seqs(id) {
            let r = &self.requests[&id];
            let sample = r
                .seqs
                .iter()
                .position(|s| s.id == seq)
                .ok_or_else(|| invalid("seq", seq, "a live sequence"))?;
            let tokens = &r.seqs[sample].tokens;
            let last = tokens[tokens.len() - 1];
            let cached = tokens.len() - 1;
            if let Some(pair) = self.blocks.append(seq, &[last])? {
                draft.batch.copies.push(pair);
            }
            let cross = self.cross_seq(id, false)?;
            draft.decodes.push(ScheduledSeq {
                seq,
                request: id,
                cached,
                tokens: vec![last],
                block_table: self.blocks.block_table(seq)?,
                num_samples: 1,
                sample,
                is_decode: true,
                cross,
                encoder_only: false,
            });
            budget.tokens -= 1;
            budget.seqs -= 1;
        }
        Ok(())
    }

    /// Swaps requests back in, oldest first, while their blocks (plus those their decodes
    /// grow into) fit and their decodes fit the budget; schedules those decodes. The growth
    /// is counted exactly, not as a block per decoding sequence: a request that could run
    /// alone in the pool when it was swapped out must fit alone again.
    fn swap_in(&mut self, budget: &mut Budget, draft: &mut Draft) -> Result<(), SchedulerError> {
        while let Some(&key) = self.swapped.first() {
            let id = key.1;
            let seqs = self.requests[&id].block_ids();
            let decoding = self.decoding_seqs(id);
            let needed = self.blocks.blocks_to_swap(&seqs)?
                + self.blocks.blocks_needed_to_append_one_each(&decoding)?
                + self.watermark();
            if needed > self.blocks.free_device_blocks() || !budget.fits(decoding.len()) {
                break;
            }
            draft.batch.swap_in.extend(self.blocks.swap_in(&seqs)?);
            self.swapped.remove(&key);
            self.running.insert(key);
            self.events.push(StepEvent::SwappedIn { request: id });
            self.schedule_decode(id, budget, draft)?;
        }
        Ok(())
    }

    /// Admits waiting requests strictly in arrival order while their prompts fit (above the
    /// watermark) and the budgets last; schedules their first chunks.
    fn admit(&mut self, budget: &mut Budget, draft: &mut Draft) -> Result<(), SchedulerError> {
        while let Some(&key) = self.waiting.first() {
            if budget.tokens == 0 || budget.seqs == 0 {
                break;
            }
            let id = key.1;
            let r = &self.requests[&id];
            if r.spec.encoder_only {
                // One step, no blocks: it waits for a step with room for its whole prompt.
                if r.spec.prompt.len() > budget.tokens {
                    break;
                }
                self.schedule_encoder_only(id, budget, draft);
                self.waiting.remove(&key);
                self.running.insert(key);
                continue;
            }
            let encoder = r.spec.encoder_prompt.as_deref().unwrap_or_default();
            // The encoder runs in this step, with at least one decoder token.
            if !encoder.is_empty() && encoder.len() >= budget.tokens {
                break;
            }
            let needed: usize = r
                .live()
                .map(|s| self.blocks.blocks_needed_to_allocate(&s.tokens))
                .sum::<usize>()
                + encoder.len().div_ceil(self.config.blocks.block_size);
            if needed + self.watermark() > self.blocks.free_device_blocks() {
                break;
            }
            for s in r
                .live()
                .map(|s| (s.id, s.tokens.clone()))
                .collect::<Vec<_>>()
            {
                self.blocks.allocate(s.0, &s.1)?;
            }
            if let Some(cross) = r.cross {
                let encoder = encoder.to_vec();
                self.blocks.allocate_cross(cross, &encoder)?;
                budget.tokens -= encoder.len();
            }
            self.waiting.remove(&key);
            self.running.insert(key);
            self.schedule_prompt_chunks(id, budget, draft)?;
        }
        Ok(())
    }

    /// Schedules encoder-only request `id`'s whole prompt; the caller has checked the
    /// budget.
    fn schedule_encoder_only(&mut self, id: RequestId, budget: &mut Budget, draft: &mut Draft) {
        let r = &self.requests[&id];
        let s = &r.seqs[0];
        draft.prefills.push(ScheduledSeq {
            seq: s.id,
            request: id,
            cached: 0,
            tokens: s.tokens.clone(),
            block_table: Vec::new(),
            num_samples: 0,
            sample: 0,
            is_decode: false,
            cross: None,
            encoder_only: true,
        });
        budget.tokens -= s.tokens.len();
        budget.seqs -= 1;
    }

    /// What `id`'s sequences scheduled now read through cross-attention (`None` for a
    /// request without an encoder): with the encoder prompt to run if `first` (the first of
    /// its sequences scheduled in this step) and its cross keys and values are not yet
    /// written.
    fn cross_seq(&self, id: RequestId, first: bool) -> Result<Option<CrossSeq>, SchedulerError> {
        let r = &self.requests[&id];
        let (Some(cross), Some(encoder)) = (r.cross, &r.spec.encoder_prompt) else {
            return Ok(None);
        };
        let write = first && self.blocks.num_computed(cross)? == 0;
        Ok(Some(CrossSeq {
            len: encoder.len(),
            block_table: self.blocks.block_table(cross)?,
            encoder_tokens: write.then(|| encoder.clone()),
        }))
    }

    /// The next chunk of each of `id`'s sequences still computing its prompt, as the budget
    /// allows.
    fn schedule_prompt_chunks(
        &mut self,
        id: RequestId,
        budget: &mut Budget,
        draft: &mut Draft,
    ) -> Result<(), SchedulerError> {
        let r = &self.requests[&id];
        if r.spec.encoder_only {
            // Scheduled whole at admission, finished by that step.
            return Ok(());
        }
        let mut first = true;
        for (sample, s) in r.seqs.iter().enumerate() {
            if s.finished.is_some() || s.decoding {
                continue;
            }
            if budget.tokens == 0 || budget.seqs == 0 {
                break;
            }
            let cached = self.blocks.num_computed(s.id)?;
            let len = (s.tokens.len() - cached).min(budget.tokens);
            let last = cached + len == s.tokens.len();
            draft.prefills.push(ScheduledSeq {
                seq: s.id,
                request: id,
                cached,
                tokens: s.tokens[cached..cached + len].to_vec(),
                block_table: self.blocks.block_table(s.id)?,
                num_samples: if last { r.samples_at_prompt_end() } else { 0 },
                sample,
                is_decode: false,
                cross: self.cross_seq(id, first)?,
                encoder_only: false,
            });
            first = false;
            budget.tokens -= len;
            budget.seqs -= 1;
        }
        Ok(())
    }

    /// Preempts running request `id`: swaps it out or frees it per the policy (recomputing
    /// when the host pool cannot take it).
    fn preempt(&mut self, id: RequestId, draft: &mut Draft) -> Result<(), SchedulerError> {
        let r = &self.requests[&id];
        let key = r.key();
        let seqs = r.block_ids();
        let swap = match self.config.preemption {
            PreemptionPolicy::Swap => true,
            PreemptionPolicy::Recompute => false,
            PreemptionPolicy::Auto => r.spec.n > 1,
        };
        let fits = self.blocks.blocks_to_swap(&seqs)? <= self.blocks.free_host_blocks();
        if swap && !fits {
            self.stats.swap_fallbacks += 1;
        }
        self.running.remove(&key);
        let how = if swap && fits {
            draft.batch.swap_out.extend(self.blocks.swap_out(&seqs)?);
            self.swapped.insert(key);
            self.stats.preempted_by_swap += 1;
            Preemption::Swap
        } else {
            for &seq in &seqs {
                self.blocks.free(seq)?;
            }
            if let Some(r) = self.requests.get_mut(&id) {
                r.seqs.iter_mut().for_each(|s| s.decoding = false);
            }
            self.waiting.insert(key);
            self.stats.preempted_by_recompute += 1;
            Preemption::Recompute
        };
        draft.preempted = true;
        self.events.push(StepEvent::Preempted { request: id, how });
        Ok(())
    }

    /// The live sequences of `id` that compute one token per step.
    fn decoding_seqs(&self, id: RequestId) -> Vec<SeqId> {
        self.requests.get(&id).map_or_else(Vec::new, |r| {
            r.live().filter(|s| s.decoding).map(|s| s.id).collect()
        })
    }

    /// The blocks kept free when adding to the device: the configured watermark while
    /// something runs, none when nothing does (a request that fits the pool must be able to
    /// start alone).
    fn watermark(&self) -> usize {
        if self.running.is_empty() {
            0
        } else {
            self.config.blocks.watermark_blocks
        }
    }
}
