//! From one forward call to typed kernels: the ISA ([`run_isa`]), the element type of the
//! keys and values ([`run_kv`]), then the plan's work in parallel ([`run`]).
//!
//! Only these two are type parameters of the kernels (three ISA tokens on x86 × five key/value
//! element types); the query and output element type is read through an enum
//! ([`Queries`], [`OutRows`]), so that it does not multiply the compiled kernels.

use crate::config::AttentionConfig;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::shared::SharedMut;
use crate::tensor::{HostSliceMut, HostStorage};

use super::kernel::ScoreMods;
use super::plan::Plan;
use super::simd::{E4m3, E5m2, Load, Simd, WithSimd};
use super::Isa;

use super::call::{CallRows, OutRows, Queries, TypedCall};
use super::parallel;

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
    /// The key and value buffers of the private cache the detached sequences read
    /// ([`Detached`](crate::detached::Detached)), when the call has any.
    pub(super) detached: Option<(&'a HostStorage, &'a HostStorage)>,
    pub(super) cache_geometry: Option<KvCacheSpec>,
    pub(super) scales: KvScales,
    /// The instruction set: which bf16 kernels may run (`Isa::bf16_dot_products`).
    #[cfg(target_arch = "x86_64")]
    pub(super) isa: Isa,
}

/// Runs the call on the widest vectors of `isa` whose width divides the head size (so kernels
/// need no tails). [`Error::OutOfMemory`](crate::Error::OutOfMemory) where scratch sized by
/// the metadata (a prefill group's packed keys) cannot be allocated.
pub(super) fn run_isa(
    isa: Isa,
    call: &ForwardCall<'_>,
    output: HostSliceMut<'_>,
    partials: &mut [f32],
) -> Result<()> {
    let cfg = call.config;
    let fp8 = call.cache_geometry.is_some() && cfg.kv_cache_dtype().fp8_format().is_some();
    let (k_scale, v_scale) = if fp8 {
        (call.scales.k_scale, call.scales.v_scale)
    } else {
        (1.0, 1.0)
    };
    let attn_type = cfg.attn_type();
    let rows = CallRows {
        cfg,
        md: call.metadata,
        plan: call.plan,
        query: match call.query {
            HostStorage::F32(q) => Queries::F32(q),
            HostStorage::F16(q) => Queries::F16(q),
            HostStorage::BF16(q) => Queries::Bf16(q),
            HostStorage::U8(_) => unreachable!("validated: queries are f32, f16 or bf16"),
        },
        out: match output {
            HostSliceMut::F32(o) => OutRows::F32(SharedMut(o.as_mut_ptr())),
            HostSliceMut::F16(o) => OutRows::F16(SharedMut(o.as_mut_ptr())),
            HostSliceMut::BF16(o) => OutRows::Bf16(SharedMut(o.as_mut_ptr())),
            HostSliceMut::U8(_) => unreachable!("validated: outputs are f32, f16 or bf16"),
        },
        partials: SharedMut(partials.as_mut_ptr()),
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
        #[cfg(target_arch = "x86_64")]
        isa: call.isa,
    };
    isa.vectorize_dividing(cfg.head_size(), RunKv { call, rows: &rows })?;
    // The split-K merges, once every partition is written.
    let partials = &*partials;
    let merges = &call.plan.merges;
    parallel::for_each(merges.len(), &|i| rows.merge(&merges[i], partials));
    Ok(())
}

/// [`run_kv`] as an operation on the token [`Isa::vectorize_dividing`] picks.
struct RunKv<'r, 'a> {
    call: &'r ForwardCall<'a>,
    rows: &'r CallRows<'r>,
}

impl WithSimd for RunKv<'_, '_> {
    type Output = Result<()>;
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> Result<()> {
        run_kv::<S>(s, self.call, self.rows)
    }
}

/// An element type keys and values are stored as, viewed in a host buffer.
trait Stored: Load + Sized {
    /// The buffer's elements, if it holds this type.
    fn view(buf: &HostStorage) -> Option<&[Self]>;
}

impl Stored for f32 {
    fn view(buf: &HostStorage) -> Option<&[Self]> {
        match buf {
            HostStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Stored for half::f16 {
    fn view(buf: &HostStorage) -> Option<&[Self]> {
        match buf {
            HostStorage::F16(v) => Some(v),
            _ => None,
        }
    }
}

impl Stored for half::bf16 {
    fn view(buf: &HostStorage) -> Option<&[Self]> {
        match buf {
            HostStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

/// Views a byte buffer as fp8 codes.
///
/// # Safety
/// `C` is repr(transparent) over u8.
unsafe fn codes<C>(buf: &HostStorage) -> Option<&[C]> {
    let HostStorage::U8(bytes) = buf else {
        return None;
    };
    // SAFETY: `C` has u8's size and alignment (the caller's promise), and the slice is the
    // buffer's, for its lifetime.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const C, bytes.len()) })
}

impl Stored for E4m3 {
    fn view(buf: &HostStorage) -> Option<&[Self]> {
        // SAFETY: E4m3 is repr(transparent) over u8.
        unsafe { codes(buf) }
    }
}

impl Stored for E5m2 {
    fn view(buf: &HostStorage) -> Option<&[Self]> {
        // SAFETY: E5m2 is repr(transparent) over u8.
        unsafe { codes(buf) }
    }
}

/// Dispatches on the element type the keys and values are read from.
fn run_kv<S: Simd>(s: S, call: &ForwardCall<'_>, rows: &CallRows<'_>) -> Result<()> {
    let fp8 = call
        .cache_geometry
        .and_then(|_| call.config.kv_cache_dtype().fp8_format());
    match (call.keys, fp8) {
        (HostStorage::U8(_), Some(crate::Fp8Format::E4m3)) => run_typed::<S, E4m3>(s, call, rows),
        (HostStorage::U8(_), Some(crate::Fp8Format::E5m2)) => run_typed::<S, E5m2>(s, call, rows),
        (HostStorage::F32(_), None) => run_typed::<S, f32>(s, call, rows),
        (HostStorage::F16(_), None) => run_typed::<S, half::f16>(s, call, rows),
        (HostStorage::BF16(_), None) => run_typed::<S, half::bf16>(s, call, rows),
        _ => Err(mismatch(call.keys, call.values)),
    }
}

/// [`run`] with the call's buffers viewed as `E` (all of them, or an error).
fn run_typed<S: Simd, E: Stored>(s: S, call: &ForwardCall<'_>, rows: &CallRows<'_>) -> Result<()> {
    fn view<'a, T: Stored>(k: &'a HostStorage, v: &'a HostStorage) -> Result<(&'a [T], &'a [T])> {
        match (T::view(k), T::view(v)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(mismatch(k, v)),
        }
    }
    let (keys, values) = view::<E>(call.keys, call.values)?;
    let detached = match call.detached {
        Some((k, v)) => view::<E>(k, v)?,
        None => (&[][..], &[][..]),
    };
    run(s, rows, (keys, values), detached)
}

/// The error for key and value buffers of element types the call cannot read.
fn mismatch(k: &HostStorage, v: &HostStorage) -> Error {
    Error::invalid(
        "key / value",
        format!("{} keys and {} values", k.dtype(), v.dtype()),
        "keys and values of the query's element type, or fp8 codes in an fp8 cache",
    )
}

/// Runs the plan's prefill groups and decode units in parallel. A prefill group whose packing
/// cannot be allocated ends the call with its error (decode units allocate only what the
/// configuration bounds: rows × D, a key tile).
fn run<S: Simd, E: Load>(
    s: S,
    rows: &CallRows<'_>,
    (keys, values): (&[E], &[E]),
    detached: (&[E], &[E]),
) -> Result<()> {
    let ctx = TypedCall {
        s,
        call: rows,
        keys,
        values,
        detached,
    };
    let plan = rows.plan;
    parallel::join(
        &|| parallel::try_for_each(plan.prefill.len(), &|i| ctx.prefill(&plan.prefill[i])),
        &|| parallel::for_each(plan.units.len(), &|i| ctx.decode(&plan.units[i])),
    )
}
