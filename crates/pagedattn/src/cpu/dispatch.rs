//! From one forward call to typed kernels: the ISA ([`run_isa`]), the element types of the
//! keys and values ([`run_kv`]), then the plan's work in parallel ([`run`]).

use rayon::prelude::*;

use crate::config::AttentionConfig;
use crate::dtype::Element;
use crate::error::Result;
use crate::kv_cache::{KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::shared::SharedMut;
use crate::tensor::{HostSliceMut, HostStorage};

use super::kernel::ScoreMods;
use super::plan::Plan;
use super::simd::{E4m3, E5m2, Load, Simd, WithSimd};
use super::Isa;

use super::call::TypedCall;

/// Everything one forward call reads, with the storage's element types still open (see
/// [`TypedCall`]).
pub(super) struct ForwardCall<'a> {
    pub(super) config: &'a AttentionConfig,
    pub(super) metadata: &'a AttentionMetadata,
    pub(super) plan: &'a Plan,
    pub(super) query: &'a HostStorage,
    /// Where keys are read: the cache's buffer, or the input keys without a cache.
    pub(super) keys: &'a HostStorage,
    /// Where values are read, likewise.
    pub(super) values: &'a HostStorage,
    pub(super) cache_geometry: Option<KvCacheSpec>,
    pub(super) scales: KvScales,
    /// Whether the AVX512-BF16 kernels may be used.
    #[cfg(target_arch = "x86_64")]
    pub(super) bf16_dot: bool,
    /// Whether the AMX prefill may be used.
    #[cfg(target_arch = "x86_64")]
    pub(super) amx: bool,
}

/// Runs the call on the widest vectors of `isa` whose width divides the head size (so kernels
/// need no tails). [`Error::OutOfMemory`](crate::Error::OutOfMemory) where scratch sized by
/// the metadata (a prefill group's packed keys) cannot be allocated.
pub(super) fn run_isa<T: Element + Load>(
    isa: Isa,
    call: &ForwardCall<'_>,
    output: HostSliceMut<'_>,
    partials: &mut [f32],
) -> Result<()> {
    isa.vectorize_dividing(
        call.config.head_size(),
        RunKv::<T> {
            call,
            output,
            partials,
            element: std::marker::PhantomData,
        },
    )
}

/// [`run_kv`] as an operation on the token [`Isa::vectorize_dividing`] picks.
struct RunKv<'r, 'a, T> {
    call: &'r ForwardCall<'a>,
    output: HostSliceMut<'r>,
    partials: &'r mut [f32],
    element: std::marker::PhantomData<T>,
}

impl<T: Element + Load> WithSimd for RunKv<'_, '_, T> {
    type Output = Result<()>;
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> Result<()> {
        run_kv::<S, T>(s, self.call, self.output, self.partials)
    }
}

/// Dispatches on the element type the keys and values are read from.
fn run_kv<S: Simd, T: Element + Load>(
    s: S,
    call: &ForwardCall<'_>,
    output: HostSliceMut<'_>,
    partials: &mut [f32],
) -> Result<()> {
    /// Views bytes as fp8 codes.
    fn codes<C>(bytes: &[u8]) -> &[C] {
        // SAFETY: E4m3 and E5m2 are repr(transparent) over u8.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const C, bytes.len()) }
    }
    let fp8 = call
        .cache_geometry
        .and_then(|_| call.config.kv_cache_dtype().fp8_format());
    match (call.keys, call.values, fp8) {
        (HostStorage::U8(k), HostStorage::U8(v), Some(crate::Fp8Format::E4m3)) => {
            run::<S, T, E4m3>(s, call, codes(k), codes(v), output, partials)
        }
        (HostStorage::U8(k), HostStorage::U8(v), Some(crate::Fp8Format::E5m2)) => {
            run::<S, T, E5m2>(s, call, codes(k), codes(v), output, partials)
        }
        (k, v, _) => run::<S, T, T>(
            s,
            call,
            k.as_slice().expect("validated"),
            v.as_slice().expect("validated"),
            output,
            partials,
        ),
    }
}

/// Runs the plan: prefill groups and decode units in parallel, then the split-K merges. A
/// prefill group whose packing cannot be allocated ends the call with its error (decode units
/// and merges allocate only what the configuration bounds: rows × D, a key tile).
fn run<S: Simd, T: Element + Load, E: Load>(
    s: S,
    call: &ForwardCall<'_>,
    keys: &[E],
    values: &[E],
    output: HostSliceMut<'_>,
    partials: &mut [f32],
) -> Result<()> {
    let cfg = call.config;
    let md = call.metadata;
    let plan = call.plan;
    let fp8 = call.cache_geometry.is_some() && cfg.kv_cache_dtype().fp8_format().is_some();
    let (k_scale, v_scale) = if fp8 {
        (call.scales.k_scale, call.scales.v_scale)
    } else {
        (1.0, 1.0)
    };
    let attn_type = cfg.attn_type();
    let ctx = TypedCall {
        s,
        cfg,
        md,
        query: call.query.as_slice::<T>().expect("validated"),
        keys,
        values,
        cache_geometry: call.cache_geometry,
        mods: ScoreMods {
            causal: attn_type.is_causal(),
            window: cfg.sliding_window(),
            soft_cap: cfg.logits_soft_cap(),
            alibi: cfg.alibi_slopes().is_some(),
        },
        // Validated to be a normal f32 (`AttentionConfig`).
        score_scale: (cfg.scale() as f64 * k_scale as f64) as f32,
        v_scale,
        out: SharedMut(output.into_slice::<T>().expect("validated").as_mut_ptr()),
        partials: SharedMut(partials.as_mut_ptr()),
        plan,
        #[cfg(target_arch = "x86_64")]
        bf16_dot: call.bf16_dot,
        #[cfg(target_arch = "x86_64")]
        amx: call.amx,
    };
    let (prefill, ()) = rayon::join(
        || plan.prefill.par_iter().try_for_each(|pg| ctx.prefill(pg)),
        || plan.units.par_iter().for_each(|unit| ctx.decode(unit)),
    );
    prefill?;
    let partials = &*partials;
    plan.merges.par_iter().for_each(|m| ctx.merge(m, partials));
    Ok(())
}
