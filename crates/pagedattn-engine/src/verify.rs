//! `--verify`: an attention call of the engine recomputed by the `reference` backend on a
//! dense copy of its keys and values (each sequence's blocks gathered into consecutive blocks
//! of a scratch cache), compared with what the engine's backend produced.

use pagedattn::{
    registry, AttentionConfig, Backend, BlockId, DType, Inputs, KvCache, MetadataBuilder,
    SequenceDesc, Tensor, Workspace,
};

use crate::report::VerifyCounts;
use crate::rng::SplitMix64;

/// Which attention calls are recomputed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum VerifyMode {
    /// None.
    Off,
    /// Each step's calls of the first and the last layer, with this probability per step.
    Sampled(f64),
    /// Every call of every layer.
    Every,
}

/// One sequence of a checked call: tokens already cached, new tokens, its block table.
#[derive(Clone, Copy, Debug)]
pub struct CheckedSeq<'a> {
    /// Tokens in the cache before the call.
    pub cached: usize,
    /// Tokens the call computes.
    pub new: usize,
    /// Its block table in the engine's cache.
    pub table: &'a [BlockId],
}

/// A recomputed call whose output is further from `reference`'s than the output dtype
/// allows.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("verification failed at step {step}, layer {layer}: the output differs from reference's on dense keys and values by {worst:.2e} of its largest magnitude (allowed {allowed:.0e})")]
pub struct Mismatch {
    /// The engine's step.
    pub step: usize,
    /// The layer.
    pub layer: usize,
    /// The largest difference beyond one ulp, as a fraction of the largest output magnitude.
    pub worst: f32,
    /// The dtype's allowance.
    pub allowed: f32,
}

/// Recomputes sampled attention calls and keeps count.
pub struct Verifier {
    mode: VerifyMode,
    reference: Box<dyn Backend>,
    rng: SplitMix64,
    counts: VerifyCounts,
}

impl Verifier {
    /// A verifier in `mode`, sampling steps with the stream of `seed`.
    pub fn new(mode: VerifyMode, seed: u64) -> pagedattn::Result<Self> {
        Ok(Verifier {
            mode,
            reference: registry::backend("reference")?,
            rng: SplitMix64::new(seed),
            counts: VerifyCounts::default(),
        })
    }

    /// The counts so far.
    pub fn counts(&self) -> &VerifyCounts {
        &self.counts
    }

    /// The layers of a step of a `num_layers` model to check (drawn once per step), counting
    /// every call of the step as made.
    pub fn layers_for_step(&mut self, num_layers: usize) -> Vec<usize> {
        self.counts.calls_total += num_layers;
        match self.mode {
            VerifyMode::Off => Vec::new(),
            VerifyMode::Every => (0..num_layers).collect(),
            VerifyMode::Sampled(p) => {
                if self.rng.next_f64() < p {
                    let mut layers = vec![0, num_layers.saturating_sub(1)];
                    layers.dedup();
                    layers
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// Recomputes one call with `reference`: `cache` is the layer's cache on `backend` after
    /// the call wrote the new keys and values; `query`, `key`, `value` and `output` the call's
    /// tensors. Errors from the library (a swap, a plan) are returned as they are; a
    /// difference beyond the output dtype's allowance is `Ok(Err(Mismatch))`.
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &mut self,
        (step, layer): (usize, usize),
        backend: &dyn Backend,
        config: &AttentionConfig,
        cache: &KvCache,
        seqs: &[CheckedSeq<'_>],
        (query, key, value): (&Tensor, &Tensor, &Tensor),
        output: &Tensor,
    ) -> pagedattn::Result<Result<(), Mismatch>> {
        let block = cache.spec().block_size;
        // Each sequence's blocks, gathered into consecutive blocks of a host scratch cache,
        // with room for its new tokens; the new tokens are written again by the recomputation
        // (the same values the engine's call wrote).
        let mut pairs: Vec<(BlockId, BlockId)> = Vec::new();
        let mut dense_tables: Vec<Vec<BlockId>> = Vec::with_capacity(seqs.len());
        let mut next: BlockId = 0;
        for s in seqs {
            let blocks = (s.cached + s.new).div_ceil(block);
            let table: Vec<BlockId> = (next..next + blocks as BlockId).collect();
            pairs.extend(
                s.table[..s.cached.div_ceil(block)]
                    .iter()
                    .copied()
                    .zip(table.iter().copied()),
            );
            next += blocks as BlockId;
            dense_tables.push(table);
        }
        let mut scratch = backend.allocate_swap_space(cache.spec(), next.max(1) as usize)?;
        backend.swap_out(
            std::slice::from_ref(cache),
            std::slice::from_mut(&mut scratch),
            &pairs,
        )?;
        let mut dense = self.reference.load_kv_cache(&scratch)?;
        let spec = *dense.spec();
        let mut builder = MetadataBuilder::for_cache(&spec);
        for (s, table) in seqs.iter().zip(&dense_tables) {
            builder.push(SequenceDesc::prompt(s.cached, s.new, table));
        }
        let metadata = builder.build()?;
        let attention = self.reference.attention(config)?;
        let plan = attention.plan(&metadata, Some(&spec))?;
        let mut workspace = Workspace::empty(self.reference.device());
        workspace.reserve(&plan)?;
        let host = |t: &Tensor| t.to_device(self.reference.device());
        let (q, k, v) = (host(query)?, host(key)?, host(value)?);
        let want = attention.forward(
            &plan,
            &mut workspace,
            Inputs::new(&q).with_kv(&k, &v).with_cache(&mut dense),
        )?;
        let (ulp, allowed) = tolerance(output.dtype());
        let worst = worst_difference(&output.to_f32_vec()?, &want.to_f32_vec()?, ulp);
        self.counts.calls_checked += 1;
        // (A NaN, once seen, stays.)
        if !self.counts.worst.is_nan() && (worst.is_nan() || worst > self.counts.worst) {
            self.counts.worst = worst;
        }
        if worst <= allowed {
            Ok(Ok(()))
        } else {
            // NaN (a non-finite element on one side only) lands here too.
            Ok(Err(Mismatch {
                step,
                layer,
                worst,
                allowed,
            }))
        }
    }
}

/// How far an output may be from `reference`'s beyond one ulp of the element's own dtype, as
/// a fraction of the output's largest magnitude, as (one ulp, allowance): f32 kernels differ
/// by f32 roundings, the bf16 kernels round probabilities to bf16 for their P·V (at most 2^-8
/// of the values' scale).
pub fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (f32::EPSILON, 1e-5),
        DType::F16 => (2f32.powi(-10), 2e-3),
        _ => (2f32.powi(-7), 1e-2),
    }
}

/// The largest `|got - want|` beyond one ulp, over the largest `|want|`; NaN where an element
/// of either is not finite.
pub fn worst_difference(got: &[f32], want: &[f32], ulp: f32) -> f32 {
    let scale = want.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(&a, &b)| {
            let beyond = (a - b).abs() - ulp * a.abs().max(b.abs());
            // (`f32::max` would drop a NaN.)
            if beyond.is_nan() {
                f32::NAN
            } else {
                beyond.max(0.0) / scale
            }
        })
        .fold(0.0f32, |w, e| {
            if e.is_nan() || w.is_nan() {
                f32::NAN
            } else {
                w.max(e)
            }
        })
}
