//! A step's forward pass: the step's attention planned once per attention type, then the model
//! run with each of its attention calls routed to that type's plan and the layer's cache,
//! timed, and checked where the step's check says.

use std::sync::Mutex;

use pagedattn::{
    AttentionConfig, AttentionImpl, AttnType, Backend, KvCache, KvCacheSpec, MetadataBuilder, Plan,
    SequenceDesc, Tensor, Workspace,
};

use super::rank::Rank;
use crate::serving::attention::{run_attention, write_kv, DecoderPlans};
use crate::serving::batch::StepBatch;
use crate::serving::check::{CallCheck, CheckedCall, CheckedCross, CheckedSeq};
use crate::serving::clock::AttentionClock;
use crate::serving::model::StepTokens;
use crate::{Error, Result};

/// A step's plans, one per attention type the model has (a type without one this step is
/// not called).
#[derive(Default)]
struct StepPlans {
    /// Decoder self-attention over the paged caches: a plan per group of layers that share
    /// one.
    decoder: DecoderPlans,
    /// Encoder (or encoder-only) attention, without a cache.
    dense: Option<Plan>,
    /// Cross-attention of every sequence, reading the cross caches.
    cross_read: Option<Plan>,
    /// The cross-cache write of the sequences at their first decoder step.
    cross_write: Option<Plan>,
}

/// The engine's check, shared by its ranks (each rank's calls are checked, one at a time).
pub(super) type SharedCheck<'a> = Mutex<Box<dyn CallCheck + 'a>>;

/// The checks of one step: which layers, and where each call's keys and values are.
struct StepCheck<'s, 'c> {
    check: &'s SharedCheck<'c>,
    step: usize,
    layers: &'s [usize],
    seqs: &'s [CheckedSeq<'s>],
    cross: &'s [CheckedCross<'s>],
    dense_lens: &'s [usize],
}

/// Everything an attention call of one step needs: the layer's attention and cache, the
/// step's plans and workspace, the clock, and the step's checks.
struct LayerCalls<'s, 'c> {
    backend: &'s dyn Backend,
    attention: &'s [Box<dyn AttentionImpl>],
    layers: &'s [AttentionConfig],
    cache_of: &'s [Option<usize>],
    caches: &'s mut [KvCache],
    workspace: &'s mut Workspace,
    clock: &'s mut AttentionClock,
    plans: &'s StepPlans,
    calls: &'s mut usize,
    check: Option<StepCheck<'s, 'c>>,
}

impl LayerCalls<'_, '_> {
    /// Attention `layer` of the step: `query`, `key`, `value` and `output` as
    /// [`Attend`](crate::serving::model::Attend) passes them.
    fn call(
        &mut self,
        layer: usize,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        output: &mut Tensor,
    ) -> Result<()> {
        let config = self.layers.get(layer).ok_or_else(|| {
            Error::Model(format!(
                "attention {layer} called: the model has {}",
                self.layers.len()
            ))
        })?;
        let missing = |what: &str| {
            Error::Model(format!(
                "attention {layer} ({}) called in a step without {what}",
                config.attn_type()
            ))
        };
        let (backend, plans, workspace) = (self.backend, self.plans, &mut *self.workspace);
        let attention = self.attention[layer].as_ref();
        let mut cache = self.cache_of[layer].map(|i| &mut self.caches[i]);
        self.clock.time(backend, || match config.attn_type() {
            AttnType::Decoder => {
                let plan = plans
                    .decoder
                    .of(self.layers, config)
                    .ok_or_else(|| missing("decoder tokens"))?;
                let cache = cache.as_deref_mut();
                let kv = Some((key, value));
                run_attention(
                    backend, attention, plan, workspace, query, kv, cache, output,
                )
            }
            AttnType::Encoder | AttnType::EncoderOnly => {
                let plan = plans
                    .dense
                    .as_ref()
                    .ok_or_else(|| missing("encoder tokens"))?;
                let kv = Some((key, value));
                run_attention(backend, attention, plan, workspace, query, kv, None, output)
            }
            AttnType::EncoderDecoder => {
                let cross = cache
                    .as_deref_mut()
                    .ok_or_else(|| missing("a cross cache"))?;
                if key.shape().first().is_some_and(|&n| n > 0) {
                    let plan = plans
                        .cross_write
                        .as_ref()
                        .ok_or_else(|| missing("encoder tokens"))?;
                    write_kv(backend, attention, plan, key, value, cross)?;
                }
                let plan = plans
                    .cross_read
                    .as_ref()
                    .ok_or_else(|| missing("an encoder"))?;
                let cross = Some(cross);
                run_attention(
                    backend, attention, plan, workspace, query, None, cross, output,
                )
            }
        })?;
        *self.calls += 1;
        let Some(check) = self.check.as_mut().filter(|c| c.layers.contains(&layer)) else {
            return Ok(());
        };
        let call = match (config.attn_type(), cache.as_deref()) {
            (AttnType::Decoder, Some(cache)) => CheckedCall::Paged {
                cache,
                seqs: check.seqs,
            },
            (AttnType::EncoderDecoder, Some(cache)) => CheckedCall::Cross {
                cache,
                seqs: check.cross,
            },
            _ => CheckedCall::Dense {
                lens: check.dense_lens,
            },
        };
        let at = (check.step, layer);
        let mut shared = check.check.lock().unwrap_or_else(|p| p.into_inner());
        shared.check_call(at, backend, config, call, (query, key, value), output)??;
        Ok(())
    }
}

/// What a rank's forward of one step is given besides its own state.
pub(super) struct StepForward<'s, 'c> {
    /// The step's scheduled work.
    pub(super) batch: &'s StepBatch,
    /// Its tokens, positions and logit rows.
    pub(super) tokens: StepTokens<'s>,
    /// Each sequence's self-attention description, and the step's encoder runs' lengths.
    pub(super) descs: &'s [SequenceDesc<'s>],
    pub(super) dense_lens: &'s [usize],
    /// Tokens per cache block.
    pub(super) block_size: usize,
    /// The step's index (for the check's reports).
    pub(super) step: usize,
    /// The layers to check this step, and the check.
    pub(super) check: Option<(&'s [usize], &'s SharedCheck<'c>)>,
    /// Leave each logit row's greedy token, not its logits.
    pub(super) greedy: bool,
}

impl Rank<'_> {
    /// The step's forward pass on this rank, with the attention of every layer planned and
    /// (where the check's layers say) checked; the greedy tokens or the logits left in the
    /// rank's output.
    pub(super) fn forward(&mut self, f: &StepForward<'_, '_>) -> Result<()> {
        let (batch, descs, dense_lens) = (f.batch, f.descs, f.dense_lens);
        let plans = self.plan(batch, descs, dense_lens, f.block_size)?;
        let seqs: Vec<CheckedSeq<'_>> = batch
            .seqs
            .iter()
            .map(|s| CheckedSeq {
                cached: s.cached,
                new: s.tokens.len(),
                table: &s.block_table,
            })
            .collect();
        let cross: Vec<CheckedCross<'_>> = batch
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
        let mut calls = LayerCalls {
            backend: self.backend,
            attention: &self.attention,
            layers: &self.layers,
            cache_of: &self.cache_of,
            caches: &mut self.caches,
            workspace: &mut self.workspace,
            clock: &mut self.clock,
            plans: &plans,
            calls: &mut self.attention_calls,
            check: f.check.map(|(layers, check)| StepCheck {
                check,
                step: f.step,
                layers,
                seqs: &seqs,
                cross: &cross,
                dense_lens,
            }),
        };
        let mut attend = |layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, out: &mut Tensor| {
            calls.call(layer, q, k, v, out)
        };
        let out = &mut self.output;
        if f.greedy {
            self.model
                .forward_greedy(&f.tokens, &mut attend, &mut out.logits, &mut out.greedy)
        } else {
            self.model.forward(&f.tokens, &mut attend, &mut out.logits)
        }
    }

    /// The step's plans: for each attention type the model has, its metadata planned once by
    /// the first attention of that type (with that attention's cache geometry).
    fn plan(
        &mut self,
        batch: &StepBatch,
        descs: &[SequenceDesc<'_>],
        dense_lens: &[usize],
        block_size: usize,
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
        if !only_encoder {
            let mut builder = MetadataBuilder::new(block_size);
            for d in descs {
                builder.push(*d);
            }
            plans.decoder = DecoderPlans::new(&self.layers, |layer| plan(layer, &builder))?;
        }
        let dense = first_of(AttnType::Encoder).or(first_of(AttnType::EncoderOnly));
        if let Some(layer) = dense.filter(|_| !dense_lens.is_empty()) {
            let mut builder = MetadataBuilder::new(block_size);
            for &len in dense_lens {
                builder.push(SequenceDesc::prompt(0, len, &[]));
            }
            plans.dense = Some(plan(layer, &builder)?);
        }
        if let Some(layer) = first_of(AttnType::EncoderDecoder).filter(|_| !only_encoder) {
            let with_encoder = |written_only: bool| -> Result<MetadataBuilder<'_>> {
                let mut builder = MetadataBuilder::new(block_size);
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
        let decoder = plans.decoder.iter();
        for p in [&plans.dense, &plans.cross_read, &plans.cross_write]
            .into_iter()
            .flatten()
            .chain(decoder)
        {
            self.workspace.reserve(p)?;
        }
        Ok(plans)
    }
}
