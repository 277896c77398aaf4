//! The `cpu` backend: flash-style attention over the paged cache with SIMD kernels generic
//! over the instruction set (chosen at run time) and rayon over (sequence, kv head, query
//! tile or key partition).
//!
//! Cache layout: `[NB, Hkv, B, D]` (head-major inside a block). The kernels read one kv head
//! at a time, whose rows of a block are then one contiguous run of `B * D` elements for keys
//! and one for values (a decode unit walks every kv head of its sequence tile by tile, so the
//! runs of a block are read close together); the prefill packs a head's keys from those runs.
//! The token-major layout would give `B` pieces of `D` elements, `Hkv * D` apart, per head and
//! block: more, shorter pieces per block, which read slower in this decode's order (NOTES.md,
//! "Measurements moved out of the cpu doc comments").

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod bf16;
mod isa;
pub(crate) mod kernel;
pub(crate) mod packed;
pub mod peak;
pub(crate) mod plan;
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub(crate) mod widen;

use rayon::prelude::*;

use crate::backend::{AttentionImpl, Backend, Capabilities};
use crate::config::{AttentionConfig, AttnType};
use crate::device::Device;
#[cfg(target_arch = "x86_64")]
use crate::dtype::DType;
use crate::dtype::Element;
use crate::error::Result;
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::reference::write_kv_checked;
use crate::semantics::{allowed_keys, query_position, KeyMap};
use crate::step::{partials_bytes, ForwardCheck, Inputs, KvPair, Plan as StepPlan, Workspace};
use crate::tensor::{HostStorage, Tensor};

use crate::shared::SharedMut;
pub use isa::{Isa, ISA_ENV};
use kernel::{
    Attend, KvRows, PrefetchStream, QueryRows, RowLayout, RowStates, RowsSource, ScoreMods,
};
use plan::{DecodeUnit, Merge, Plan, PrefillGroup};
use simd::{E4m3, E5m2, Load, Simd, WithSimd};
use std::mem::MaybeUninit;
use std::ops::Range;

/// The CPU backend (registry name `cpu`).
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    isa: Isa,
}

impl Cpu {
    /// The backend on the best instruction set of this CPU, or the one `PAGEDATTN_ISA` names.
    pub fn new() -> Result<Self> {
        Ok(Cpu {
            isa: Isa::from_env()?,
        })
    }

    /// The backend on a given instruction set (an error if this CPU lacks it).
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if isa.is_available() {
            Ok(Cpu { isa })
        } else {
            Err(crate::Error::unsupported(
                "cpu",
                format!("instruction set {isa} on this CPU"),
            ))
        }
    }

    /// The instruction set it runs.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::everything()
    }

    fn kv_cache_layout(&self) -> CacheLayout {
        CacheLayout::Hnd
    }

    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>> {
        self.capabilities().check_config(self.name(), config)?;
        Ok(Box::new(CpuAttention {
            config: config.clone(),
            backend: *self,
            capabilities: self.capabilities(),
        }))
    }

    fn details(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "instruction set",
                format!("{} (force another with {ISA_ENV})", self.isa),
            ),
            ("threads", rayon::current_num_threads().to_string()),
        ]
    }

    fn allocate_kv_cache(&self, spec: &KvCacheSpec) -> Result<KvCache> {
        self.capabilities().check_cache(self.name(), spec)?;
        let mut cache = KvCache::zeros(*spec, self.kv_cache_layout())?;
        let (key, value) = cache.host_buffers_mut()?;
        for buf in [key, value] {
            advise_huge_pages(buf.as_bytes_mut());
        }
        Ok(cache)
    }
}

/// Asks the kernel to back a freshly allocated (not yet touched) buffer with transparent huge
/// pages: a decode walks hundreds of scattered blocks per sequence, and with 4 KiB pages each
/// block would cost a TLB miss. Harmless where huge pages are unavailable.
fn advise_huge_pages(buf: &mut [u8]) {
    advise_range(buf.as_mut_ptr() as usize, buf.len());
}

/// [`Cpu`]'s huge-page advice for a buffer of the caller's, before its first touch (as
/// `pagedattn bench` does for its bandwidth buffer, so that it is backed like a cache).
pub fn advise_huge_pages_uninit<T>(buf: &mut [MaybeUninit<T>]) {
    advise_range(buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
}

/// `madvise(MADV_HUGEPAGE)` on the whole huge pages inside `start..start + len`.
fn advise_range(start: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (first, end) = (start.next_multiple_of(HUGE), (start + len) & !(HUGE - 1));
        if end > first {
            // SAFETY: the range lies inside the caller's buffer; MADV_HUGEPAGE changes no
            // contents.
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}

/// One layer's attention on the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuAttention {
    config: AttentionConfig,
    backend: Cpu,
    capabilities: Capabilities,
}

impl AttentionImpl for CpuAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<StepPlan> {
        let cfg = &self.config;
        self.gate().plan(metadata, cache, |md, has_new_kv| {
            let key_map = KeyMap::new(md, cfg.attn_type(), cache.map(|c| c.block_size), has_new_kv);
            let plan = plan::plan(cfg, md, &key_map, rayon::current_num_threads());
            // Per partial: the kv head's query rows, each m, l and D accumulators.
            let floats = cfg
                .head_size()
                .checked_add(2)
                .and_then(|f| f.checked_mul(cfg.num_queries_per_kv()));
            let bytes = partials_bytes("cpu", plan.num_partials, floats)?;
            Ok((plan, bytes))
        })
    }

    fn write_kv(
        &self,
        plan: &StepPlan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        write_kv_checked(&self.gate(), plan, KvPair { key, value }, cache)
    }

    fn forward_into(
        &self,
        plan: &StepPlan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        // One hand-off to the thread pool per call: the cache write, the attention and the
        // split-K merges below then start their parallel work from inside it, instead of each
        // waking the pool from the caller's thread (which costs more than a short decode).
        rayon::scope(|_| self.forward_in_pool(plan, workspace, inputs, output))
    }
}

impl CpuAttention {
    /// The gate of this layer's calls.
    fn gate(&self) -> ForwardCheck<'_> {
        ForwardCheck {
            backend: "cpu",
            device: Device::Cpu,
            capabilities: &self.capabilities,
            layout: CacheLayout::Hnd,
            config: &self.config,
        }
    }

    /// [`AttentionImpl::forward_into`], run on a thread of the pool.
    fn forward_in_pool(
        &self,
        step: &StepPlan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        self.gate().call(step, &inputs, output, workspace)?;
        let plan: &Plan = step.prepared("cpu")?;
        let (query, new_kv, mut kv_cache) = inputs.into_parts();
        if let (Some(cache), Some(kv)) = (kv_cache.as_deref_mut(), new_kv) {
            let slots = crate::reference::write_slots(&self.config, step.metadata());
            cache.write_checked(kv.key, kv.value, slots, self.config.kv_scales())?;
        }
        let partials: &mut [f32] = match workspace.storage_mut() {
            Some(storage) => storage
                .host_mut("workspace")?
                .as_slice_mut()
                .expect("a workspace holds f32"),
            None => &mut [],
        };
        let cache = kv_cache.as_deref();
        let (keys, values) = match (cache, new_kv) {
            (Some(c), _) => {
                let (k, v) = c.host_buffers()?;
                (k, v)
            }
            (None, Some(kv)) => (kv.key.host()?, kv.value.host()?),
            (None, None) => unreachable!("validated: without a cache, key and value are given"),
        };
        let call = ForwardCall {
            config: &self.config,
            metadata: step.metadata(),
            plan,
            query: query.host()?,
            keys,
            values,
            cache_geometry: cache.map(|c| *c.spec()),
            scales: self.config.kv_scales(),
            #[cfg(target_arch = "x86_64")]
            bf16_dot: self.backend.isa == Isa::Avx512Bf16,
            #[cfg(target_arch = "x86_64")]
            amx: self.backend.isa == Isa::Amx,
        };
        let output = output.host_mut()?;
        crate::with_element!(query.dtype(), T => run_isa::<T>(self.backend.isa, &call, output, partials));
        Ok(())
    }
}

/// Everything one forward call reads, with the storage's element types still open (see
/// [`TypedCall`]).
struct ForwardCall<'a> {
    config: &'a AttentionConfig,
    metadata: &'a AttentionMetadata,
    plan: &'a Plan,
    query: &'a HostStorage,
    /// Where keys are read: the cache's buffer, or the input keys without a cache.
    keys: &'a HostStorage,
    /// Where values are read, likewise.
    values: &'a HostStorage,
    cache_geometry: Option<KvCacheSpec>,
    scales: KvScales,
    /// Whether the AVX512-BF16 kernels may be used.
    #[cfg(target_arch = "x86_64")]
    bf16_dot: bool,
    /// Whether the AMX prefill may be used.
    #[cfg(target_arch = "x86_64")]
    amx: bool,
}

/// Runs the call on the widest vectors of `isa` whose width divides the head size (so kernels
/// need no tails).
fn run_isa<T: Element + Load>(
    isa: Isa,
    call: &ForwardCall<'_>,
    output: &mut HostStorage,
    partials: &mut [f32],
) {
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
    output: &'r mut HostStorage,
    partials: &'r mut [f32],
    element: std::marker::PhantomData<T>,
}

impl<T: Element + Load> WithSimd for RunKv<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        run_kv::<S, T>(s, self.call, self.output, self.partials)
    }
}

/// Dispatches on the element type the keys and values are read from.
fn run_kv<S: Simd, T: Element + Load>(
    s: S,
    call: &ForwardCall<'_>,
    output: &mut HostStorage,
    partials: &mut [f32],
) {
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

/// A [`ForwardCall`] with its ISA `S`, query/output element `T` and key/value element `E`
/// fixed: everything a unit of work (decode unit, prefill group, merge) reads.
struct TypedCall<'a, S, T, E> {
    s: S,
    cfg: &'a AttentionConfig,
    md: &'a AttentionMetadata,
    query: &'a [T],
    keys: &'a [E],
    values: &'a [E],
    cache_geometry: Option<KvCacheSpec>,
    mods: ScoreMods,
    /// Multiplies q·k: the softmax scale times the fp8 k_scale.
    score_scale: f32,
    /// Multiplies the output: the fp8 v_scale.
    v_scale: f32,
    out: SharedMut<T>,
    partials: SharedMut<f32>,
    plan: &'a Plan,
    /// Whether the AVX512-BF16 kernels may be used.
    #[cfg(target_arch = "x86_64")]
    bf16_dot: bool,
    /// Whether the AMX prefill may be used.
    #[cfg(target_arch = "x86_64")]
    amx: bool,
}

/// What the AVX512-BF16 decode kernel needs of a decode unit, per kv head.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct DecodeHeads<'a, 'b, E> {
    unit: &'a DecodeUnit,
    groups: &'a [QueryRows<'b>],
    kvs: &'a [KvRows<'b, E>],
    streams: &'a [PrefetchStream],
}

impl<S: Simd, T: Element + Load, E: Load> TypedCall<'_, S, T, E> {
    fn group_size(&self) -> usize {
        self.cfg.num_queries_per_kv()
    }

    /// Where sequence `seq`'s keys and values for `kv_head` are.
    fn kv_rows(&self, seq: usize, kv_head: usize) -> KvRows<'_, E> {
        let (d, hkv) = (self.cfg.head_size(), self.cfg.num_kv_heads());
        let cross = self.cfg.attn_type() == AttnType::EncoderDecoder;
        let layout = match self.cache_geometry {
            Some(spec) => {
                let table = if cross {
                    self.md
                        .encoder
                        .as_ref()
                        .expect("validated")
                        .cross_block_tables
                        .row(seq)
                } else {
                    self.md.block_tables.row(seq)
                };
                let block = spec.block_size * d;
                RowLayout::Paged {
                    table,
                    block_size: spec.block_size,
                    block_stride: hkv * block,
                    head_offset: kv_head * block,
                }
            }
            None => {
                let first_token = if cross {
                    self.md.encoder_token_start(seq)
                } else {
                    self.md.query_range(seq).start
                };
                RowLayout::Dense {
                    first_row: (first_token * hkv + kv_head) * d,
                    token_stride: hkv * d,
                }
            }
        };
        KvRows {
            key: self.keys,
            value: self.values,
            layout,
            head_size: d,
        }
    }

    /// The query heads of `kv_head` for `tokens`, one row per (token, head), token-major:
    /// positions and ALiBi slopes.
    fn rows(&self, seq: usize, kv_head: usize, tokens: Range<usize>) -> (Vec<usize>, Vec<f32>) {
        let range = self.md.query_range(seq);
        let seq_len = self.md.seq_lens[seq] as usize;
        let group = self.group_size();
        let mut pos = Vec::with_capacity(tokens.len() * group);
        let mut slope = Vec::new();
        // A cross-attention query sits past every encoder key: its ALiBi term
        // `-slope * (i - j)` is `-slope * (n - 1 - j)` plus a constant of the row, which the
        // softmax ignores. Using position n - 1 keeps the distances small integers (exact in
        // f32) however far the decoder has run; the other types' positions are already keys'.
        let last_key = match (self.cfg.attn_type(), &self.md.encoder) {
            (AttnType::EncoderDecoder, Some(enc)) => {
                (enc.encoder_seq_lens[seq] as usize).saturating_sub(1)
            }
            _ => usize::MAX,
        };
        for t in tokens {
            let i = query_position(self.cfg.attn_type(), seq_len, range.len(), t - range.start);
            let i = if self.cfg.attn_type().is_causal() {
                i
            } else {
                i.min(last_key)
            };
            for gh in 0..group {
                pos.push(i);
                if let Some(slopes) = self.cfg.alibi_slopes() {
                    slope.push(slopes[kv_head * group + gh]);
                }
            }
        }
        (pos, slope)
    }

    /// The query rows of `kv_head` for `tokens` in f32 (unscaled).
    fn q_f32(&self, kv_head: usize, tokens: Range<usize>) -> Vec<f32> {
        let (d, h, group) = (
            self.cfg.head_size(),
            self.cfg.num_heads(),
            self.group_size(),
        );
        let mut q = Vec::with_capacity(tokens.len() * group * d);
        for t in tokens {
            let heads = &self.query[(t * h + kv_head * group) * d..][..group * d];
            q.extend(heads.iter().map(|&x| Element::to_f32(x)));
        }
        q
    }

    /// Whether the query token `t` of sequence `seq` attends at least one key (allowed and
    /// present). A row whose running max stayed -inf had only -inf scores if it did (IEEE:
    /// 0 / 0, NaN), and no key at all if not (the contract's zero output).
    fn attends_a_key(&self, seq: usize, t: usize) -> bool {
        let attn_type = self.cfg.attn_type();
        let range = self.md.query_range(seq);
        let i = query_position(
            attn_type,
            self.md.seq_lens[seq] as usize,
            range.len(),
            t - range.start,
        );
        let n = KeyMap::new(self.md, attn_type, None, false).num_positions(seq);
        let keys = allowed_keys(attn_type, self.cfg.sliding_window(), i, n);
        let absent = &self.plan.absent[seq];
        let absent_inside =
            absent.partition_point(|&j| j < keys.end) - absent.partition_point(|&j| j < keys.start);
        keys.len() > absent_inside
    }

    /// What a finished row's weighted sum is multiplied by: `v_scale / l`, or, for a row whose
    /// running max stayed -inf, NaN where it attended a key and 0 where it had none.
    fn output_norm(&self, m: f32, l: f32, seq: usize, t: usize) -> f32 {
        if m > f32::NEG_INFINITY || l.is_nan() {
            self.v_scale / l
        } else if self.attends_a_key(seq, t) {
            f32::NAN
        } else {
            0.0
        }
    }

    /// Writes finished rows (`tokens` of sequence `seq` × the heads of `kv_head`) to the
    /// output.
    fn finish(&self, seq: usize, kv_head: usize, tokens: Range<usize>, state: &RowStates) {
        let (d, group) = (self.cfg.head_size(), self.group_size());
        for (ti, t) in tokens.enumerate() {
            for gh in 0..group {
                let r = ti * group + gh;
                let acc = &state.acc[r * d..(r + 1) * d];
                self.write_row(seq, t, kv_head * group + gh, state.m[r], state.l[r], acc);
            }
        }
    }

    /// Writes the output row of query head `head` of token `t` (of sequence `seq`): its
    /// weighted sum of values `acc`, normalised as [`TypedCall::output_norm`] says for its
    /// running max `m` and sum `l`. Shared by [`TypedCall::finish`] and [`TypedCall::merge`].
    fn write_row(&self, seq: usize, t: usize, head: usize, m: f32, l: f32, acc: &[f32]) {
        let (d, h) = (self.cfg.head_size(), self.cfg.num_heads());
        let norm = self.output_norm(m, l, seq, t);
        // SAFETY: the output is `[tokens, H, D]` (validated), and each (token, head) row is
        // written by exactly one unit of work (a unit or prefill tile, or a split-K merge).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.out.ptr().add((t * h + head) * d), d) };
        for (o, a) in dst.iter_mut().zip(acc) {
            *o = T::from_f32(a * norm);
        }
    }

    /// Runs one decode unit: every kv head of one sequence, over the unit's keys.
    fn decode(&self, unit: &DecodeUnit) {
        let (d, hkv) = (self.cfg.head_size(), self.cfg.num_kv_heads());
        let rows: Vec<_> = (0..hkv)
            .map(|h| self.rows(unit.seq, h, unit.tokens.clone()))
            .collect();
        let groups: Vec<QueryRows> = rows
            .iter()
            .map(|(pos, slope)| QueryRows {
                pos,
                slope,
                keys: unit.keys.clone(),
                absent: &self.plan.absent[unit.seq],
            })
            .collect();
        let mut states: Vec<RowStates> = rows
            .iter()
            .map(|(pos, _)| RowStates::new(pos.len(), d))
            .collect();
        let kvs: Vec<KvRows<'_, E>> = (0..hkv).map(|h| self.kv_rows(unit.seq, h)).collect();
        let streams: Vec<PrefetchStream> = (0..hkv)
            .map(|h| PrefetchStream::of_head(h, hkv, kvs[h].head_stride(), unit.keys.end))
            .collect();
        #[cfg(target_arch = "x86_64")]
        let done = self.decode_bf16(
            DecodeHeads {
                unit,
                groups: &groups,
                kvs: &kvs,
                streams: &streams,
            },
            &mut states,
        );
        #[cfg(not(target_arch = "x86_64"))]
        let done = false;
        if !done {
            let qs: Vec<Vec<f32>> = (0..hkv)
                .map(|h| self.q_f32(h, unit.tokens.clone()))
                .collect();
            let sources: Vec<_> = qs
                .iter()
                .enumerate()
                .map(|(h, q)| RowsSource::new::<S>(kvs[h], q, self.score_scale, streams[h]))
                .collect();
            self.s.vectorize(Attend {
                sources: &sources,
                groups: &groups,
                mods: &self.mods,
                states: &mut states,
            });
        }
        for (h, state) in states.iter().enumerate() {
            match unit.partial {
                None => self.finish(unit.seq, h, unit.tokens.clone(), state),
                Some(slots) => {
                    let width = self.group_size() * (d + 2);
                    let slot = slots.first + h * slots.stride;
                    // SAFETY: each partial slot belongs to one (unit, kv head).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(self.partials.ptr().add(slot * width), width)
                    };
                    for (r, part) in dst.chunks_exact_mut(d + 2).enumerate() {
                        part[0] = state.m[r];
                        part[1] = state.l[r];
                        part[2..].copy_from_slice(&state.acc[r * d..(r + 1) * d]);
                    }
                }
            }
        }
    }

    /// Packs one prefill group's keys and values, then runs its query tiles in parallel.
    fn prefill(&self, pg: &PrefillGroup) {
        let d = self.cfg.head_size();
        let kv = self.kv_rows(pg.seq, pg.kv_head);
        let absent = &self.plan.absent[pg.seq];
        #[cfg(target_arch = "x86_64")]
        {
            let amx = self.amx && d.is_multiple_of(32);
            if T::DTYPE == DType::BF16
                && E::BF16_EXACT
                && (amx || (self.bf16_dot && d.is_multiple_of(16)))
            {
                let packed = bf16::pack_bf16(&kv, pg.keys.clone(), absent);
                pg.tiles.par_iter().for_each(|tile| {
                    let (pos, slope) = self.rows(pg.seq, pg.kv_head, tile.tokens.clone());
                    let group = QueryRows {
                        pos: &pos,
                        slope: &slope,
                        keys: tile.keys.clone(),
                        absent,
                    };
                    let mut q = self.q_bf16_pairs(pg.kv_head, tile.tokens.clone());
                    let scale = self.score_scale;
                    let state = if amx {
                        // Whole 16-row tiles: zero query rows pad the last, and the states
                        // carry the padding.
                        let padded = amx::padded_rows(pos.len());
                        q.resize(padded * d / 2, 0);
                        let packed = &packed;
                        let source = amx::AmxSource {
                            packed,
                            q: &q,
                            scale,
                        };
                        attend_bf16_tile(&source, &group, &self.mods, padded, d)
                    } else {
                        let packed = &packed;
                        let source = bf16::PackedBf16Source {
                            packed,
                            q: &q,
                            scale,
                        };
                        attend_bf16_tile(&source, &group, &self.mods, pos.len(), d)
                    };
                    self.finish(pg.seq, pg.kv_head, tile.tokens.clone(), &state);
                });
                return;
            }
        }
        let packed = self.s.vectorize(packed::PackF32 {
            kv: &kv,
            keys: pg.keys.clone(),
            absent,
        });
        pg.tiles.par_iter().for_each(|tile| {
            let (pos, slope) = self.rows(pg.seq, pg.kv_head, tile.tokens.clone());
            let q = self.q_f32(pg.kv_head, tile.tokens.clone());
            let source = packed::PackedF32Source {
                packed: &packed,
                q: &q,
                scale: self.score_scale,
            };
            let group = QueryRows {
                pos: &pos,
                slope: &slope,
                keys: tile.keys.clone(),
                absent,
            };
            let mut state = RowStates::new(pos.len(), d);
            self.s.vectorize(Attend {
                sources: std::slice::from_ref(&source),
                groups: std::slice::from_ref(&group),
                mods: &self.mods,
                states: std::slice::from_mut(&mut state),
            });
            self.finish(pg.seq, pg.kv_head, tile.tokens.clone(), &state);
        });
    }

    /// The query rows of `kv_head` for `tokens` as bf16 pairs (unscaled).
    #[cfg(target_arch = "x86_64")]
    fn q_bf16_pairs(&self, kv_head: usize, tokens: Range<usize>) -> Vec<u32> {
        let (d, h, group) = (
            self.cfg.head_size(),
            self.cfg.num_heads(),
            self.group_size(),
        );
        let mut q = Vec::with_capacity(tokens.len() * group * d / 2);
        for t in tokens {
            let heads = &self.query[(t * h + kv_head * group) * d..][..group * d];
            q.extend(
                heads
                    .chunks_exact(2)
                    .map(|p| p[0].bf16_bits() as u32 | (p[1].bf16_bits() as u32) << 16),
            );
        }
        q
    }

    /// Runs a decode unit with AVX512-BF16 on the cache rows in place, where the call allows
    /// it: bf16 queries, head size a multiple of 32, and bf16 keys and values (cache or
    /// inputs) or an fp8 cache (widened in registers, with AVX512-VBMI). Returns whether it
    /// ran.
    #[cfg(target_arch = "x86_64")]
    fn decode_bf16(&self, rows: DecodeHeads<'_, '_, E>, states: &mut [RowStates]) -> bool {
        use widen::Bf16Rows;
        if !(self.bf16_dot && T::DTYPE == DType::BF16 && self.cfg.head_size().is_multiple_of(32)) {
            return false;
        }
        match (E::as_bf16_rows(self.keys), E::as_bf16_rows(self.values)) {
            (Some(Bf16Rows::Bits(k)), Some(Bf16Rows::Bits(v))) => {
                self.attend_rows_bf16(k, v, rows, states)
            }
            (Some(Bf16Rows::E4m3(k)), Some(Bf16Rows::E4m3(v))) if widen::has_vbmi() => {
                self.attend_rows_bf16(k, v, rows, states)
            }
            (Some(Bf16Rows::E5m2(k)), Some(Bf16Rows::E5m2(v))) if widen::has_vbmi() => {
                self.attend_rows_bf16(k, v, rows, states)
            }
            _ => return false,
        }
        true
    }

    /// [`TypedCall::decode_bf16`] on `key` and `value`: the call's key and value buffers as
    /// the kernels read them ([`Load::as_bf16_rows`]).
    #[cfg(target_arch = "x86_64")]
    fn attend_rows_bf16<C: widen::Bf16Elem>(
        &self,
        key: &[C],
        value: &[C],
        rows: DecodeHeads<'_, '_, E>,
        states: &mut [RowStates],
    ) {
        let d = self.cfg.head_size();
        let qs: Vec<Vec<u32>> = (0..rows.kvs.len())
            .map(|h| self.q_bf16_pairs(h, rows.unit.tokens.clone()))
            .collect();
        let quads: Vec<Vec<u32>> = qs.iter().map(|q| bf16::pack_quads(q, d)).collect();
        // Specialized for the common head sizes (see `RowsBf16Source`).
        macro_rules! attend_rows {
            ($d:literal) => {{
                let sources: Vec<_> = qs
                    .iter()
                    .enumerate()
                    .map(|(h, q)| bf16::RowsBf16Source::<C, $d> {
                        kv: KvRows {
                            key,
                            value,
                            layout: rows.kvs[h].layout,
                            head_size: d,
                        },
                        q,
                        quads: &quads[h],
                        scale: self.score_scale,
                        stream: rows.streams[h],
                    })
                    .collect();
                bf16::attend_bf16(&sources, rows.groups, &self.mods, states)
            }};
        }
        match d {
            64 => attend_rows!(64),
            128 => attend_rows!(128),
            256 => attend_rows!(256),
            _ => attend_rows!(0),
        }
    }

    /// Combines the split-K partitions of one (token, kv head) and writes the output rows.
    fn merge(&self, merge: &Merge, partials: &[f32]) {
        let (d, group) = (self.cfg.head_size(), self.group_size());
        let width = group * (d + 2);
        for gh in 0..group {
            let part = |p: usize| &partials[p * width + gh * (d + 2)..][..d + 2];
            let m = merge
                .parts
                .clone()
                .map(|p| part(p)[0])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut acc = vec![0.0f32; d];
            let mut l = 0.0f32;
            for p in merge.parts.clone() {
                // A partition whose max stayed -inf weighs 0 (its sum is 0, or NaN from a NaN
                // score, which 0 * NaN keeps); with every max -inf, `output_norm` decides.
                let w = if m > f32::NEG_INFINITY {
                    (part(p)[0] - m).exp()
                } else {
                    0.0
                };
                l += part(p)[1] * w;
                for (a, x) in acc.iter_mut().zip(&part(p)[2..]) {
                    *a += x * w;
                }
            }
            let head = merge.kv_head * group + gh;
            self.write_row(merge.seq, merge.token, head, m, l, &acc);
        }
    }
}

/// One prefill tile's rows (`rows`, padding included) attended with a bf16 source.
#[cfg(target_arch = "x86_64")]
fn attend_bf16_tile<Src: bf16::Bf16Source>(
    source: &Src,
    group: &QueryRows<'_>,
    mods: &ScoreMods,
    rows: usize,
    d: usize,
) -> RowStates {
    let mut state = RowStates::new(rows, d);
    bf16::attend_bf16(
        std::slice::from_ref(source),
        std::slice::from_ref(group),
        mods,
        std::slice::from_mut(&mut state),
    );
    state
}

/// Runs the plan: prefill groups and decode units in parallel, then the split-K merges.
fn run<S: Simd, T: Element + Load, E: Load>(
    s: S,
    call: &ForwardCall<'_>,
    keys: &[E],
    values: &[E],
    output: &mut HostStorage,
    partials: &mut [f32],
) {
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
        out: SharedMut(output.as_slice_mut::<T>().expect("validated").as_mut_ptr()),
        partials: SharedMut(partials.as_mut_ptr()),
        plan,
        #[cfg(target_arch = "x86_64")]
        bf16_dot: call.bf16_dot,
        #[cfg(target_arch = "x86_64")]
        amx: call.amx,
    };
    rayon::join(
        || plan.prefill.par_iter().for_each(|pg| ctx.prefill(pg)),
        || plan.units.par_iter().for_each(|unit| ctx.decode(unit)),
    );
    let partials = &*partials;
    plan.merges.par_iter().for_each(|m| ctx.merge(m, partials));
}
