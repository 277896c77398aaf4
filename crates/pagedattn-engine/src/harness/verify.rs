//! `--verify`: an attention call of the engine recomputed by the `reference` backend on a
//! dense copy of its keys and values (each sequence's blocks gathered into consecutive blocks
//! of a scratch cache), compared with what the engine's backend produced.

use pagedattn::{
    registry, AttentionConfig, AttentionMetadata, Backend, BlockId, DType, Inputs, KvCache,
    MetadataBuilder, SequenceDesc, Tensor, Workspace,
};

use crate::rng::SplitMix64;
use crate::serving::check::{CallCheck, CheckedCall, CheckedSeq, Mismatch};
use crate::serving::report::VerifyCounts;

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

    /// Recomputes one decoder call with `reference`: `cache` is the layer's cache on
    /// `backend` after the call wrote the new keys and values; `query`, `key`, `value` and
    /// `output` the call's tensors. [`check_call`](Self::check_call) of a
    /// [`CheckedCall::Paged`].
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &mut self,
        at: (usize, usize),
        backend: &dyn Backend,
        config: &AttentionConfig,
        cache: &KvCache,
        seqs: &[CheckedSeq<'_>],
        qkv: (&Tensor, &Tensor, &Tensor),
        output: &Tensor,
    ) -> pagedattn::Result<Result<(), Mismatch>> {
        self.check_call(
            at,
            backend,
            config,
            CheckedCall::Paged { cache, seqs },
            qkv,
            output,
        )
    }
}

impl CallCheck for Verifier {
    /// The counts so far.
    fn counts(&self) -> &VerifyCounts {
        &self.counts
    }

    /// The attentions of a step of a model of `num_layers` attentions to check (drawn once
    /// per step; a step calls an encoder's attentions only when it runs the encoder).
    fn layers_for_step(&mut self, num_layers: usize) -> Vec<usize> {
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

    /// Recomputes one call of any attention type with `reference` on dense keys and values:
    /// the call's cache blocks it read (not those it wrote) gathered into consecutive blocks
    /// of a scratch cache, what it wrote written again by `reference` from the call's
    /// `key`/`value`. Errors from the library (a swap, a plan) are returned as they are; a
    /// difference beyond the output dtype's allowance is `Ok(Err(Mismatch))`.
    fn check_call(
        &mut self,
        (step, layer): (usize, usize),
        backend: &dyn Backend,
        config: &AttentionConfig,
        call: CheckedCall<'_>,
        (query, key, value): (&Tensor, &Tensor, &Tensor),
        output: &Tensor,
    ) -> pagedattn::Result<Result<(), Mismatch>> {
        let reference = self.reference.as_ref();
        let host = |t: &Tensor| t.to_device(reference.device());
        let (q, k, v) = (host(query)?, host(key)?, host(value)?);
        let (ulp, allowed) = tolerance(output.dtype());
        for t in [&q, &k, &v] {
            if t.to_f32_vec()?.iter().any(|x| !x.is_finite()) {
                // The attention is not to blame for what it was given.
                return Ok(Err(Mismatch {
                    step,
                    layer,
                    worst: f32::NAN,
                    allowed,
                    inputs_finite: false,
                }));
            }
        }
        let attention = reference.attention(config)?;
        let mut workspace = Workspace::empty(reference.device());
        let mut forward = |metadata: &AttentionMetadata,
                           kv: bool,
                           cache: Option<&mut KvCache>|
         -> pagedattn::Result<Tensor> {
            let plan = attention.plan(metadata, cache.as_deref().map(KvCache::spec))?;
            workspace.reserve(&plan)?;
            let inputs = Inputs::new(&q).with_cache_opt(cache);
            let inputs = if kv { inputs.with_kv(&k, &v) } else { inputs };
            attention.forward(&plan, &mut workspace, inputs)
        };
        let want = match call {
            CheckedCall::Dense { lens } => {
                let mut builder = MetadataBuilder::new(1);
                for &len in lens {
                    builder.push(SequenceDesc::prompt(0, len, &[]));
                }
                forward(&builder.build()?, true, None)?
            }
            CheckedCall::Paged { cache, seqs } => {
                let (mut dense, tables) = gather(
                    reference,
                    backend,
                    cache,
                    seqs.iter().map(|s| (s.cached, s.cached + s.new, s.table)),
                )?;
                let mut builder = MetadataBuilder::for_cache(dense.spec());
                for (s, table) in seqs.iter().zip(&tables) {
                    builder.push(SequenceDesc::prompt(s.cached, s.new, table));
                }
                forward(&builder.build()?, true, Some(&mut dense))?
            }
            CheckedCall::Cross { cache, seqs } => {
                let (mut dense, tables) = gather(
                    reference,
                    backend,
                    cache,
                    seqs.iter().map(|s| {
                        let read = if s.written { 0 } else { s.encoder_len };
                        (read, s.encoder_len, s.table)
                    }),
                )?;
                let spec = *dense.spec();
                let metadata = |written_only: bool| {
                    let mut builder = MetadataBuilder::for_cache(&spec);
                    builder.write_cross_kv(written_only);
                    for (s, table) in seqs.iter().zip(&tables) {
                        if s.written || !written_only {
                            builder.push(
                                SequenceDesc::prompt(0, s.new, &[])
                                    .with_encoder(s.encoder_len, table),
                            );
                        }
                    }
                    builder.build()
                };
                if seqs.iter().any(|s| s.written) {
                    let plan = attention.plan(&metadata(true)?, Some(&spec))?;
                    attention.write_kv(&plan, &k, &v, &mut dense)?;
                }
                forward(&metadata(false)?, false, Some(&mut dense))?
            }
        };
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
                inputs_finite: true,
            }))
        }
    }
}

/// Each sequence's blocks, as `(tokens to copy, tokens in all, table in `cache`)`, gathered
/// into consecutive blocks of a scratch cache on `reference` (room for every token; the
/// first `tokens to copy` copied from `cache`, the rest left for the recomputation to write):
/// the scratch cache and each sequence's table in it.
fn gather<'a>(
    reference: &dyn Backend,
    backend: &dyn Backend,
    cache: &KvCache,
    seqs: impl Iterator<Item = (usize, usize, &'a [BlockId])>,
) -> pagedattn::Result<(KvCache, Vec<Vec<BlockId>>)> {
    let block = cache.spec().block_size;
    let mut pairs: Vec<(BlockId, BlockId)> = Vec::new();
    let mut tables: Vec<Vec<BlockId>> = Vec::new();
    let mut next: BlockId = 0;
    for (copy, total, table) in seqs {
        let blocks = total.div_ceil(block);
        let dense: Vec<BlockId> = (next..next + blocks as BlockId).collect();
        pairs.extend(
            table[..copy.div_ceil(block)]
                .iter()
                .copied()
                .zip(dense.iter().copied()),
        );
        next += blocks as BlockId;
        tables.push(dense);
    }
    let mut scratch = backend.allocate_swap_space(cache.spec(), next.max(1) as usize)?;
    backend.swap_out(
        std::slice::from_ref(cache),
        std::slice::from_mut(&mut scratch),
        &pairs,
    )?;
    Ok((reference.load_kv_cache(&scratch)?, tables))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_difference_scales_by_the_largest_output_and_flags_nan() {
        let want = [1.0, -4.0, 0.001];
        let ulp = 2f32.powi(-7);
        // Within one ulp of each element: nothing beyond it.
        let got = [1.0 + ulp / 2.0, -4.0, 0.001];
        assert_eq!(worst_difference(&got, &want, ulp), 0.0);
        // 0.04 off an element, beyond its ulp (0.001 * 2^-7), over the largest |want| 4.
        let got = [1.0, -4.0, 0.041];
        let w = worst_difference(&got, &want, ulp);
        assert!((w - (0.04 - ulp * 0.041) / 4.0).abs() < 1e-6, "{w}");
        let (_, tol) = tolerance(DType::BF16);
        assert!(worst_difference(&[0.0; 3], &want, ulp) > tol);
        assert!(worst_difference(&[1.0, f32::NAN, 0.001], &want, ulp).is_nan());
    }
}
