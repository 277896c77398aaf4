//! The `cpu` backend: flash-style attention over the paged cache with SIMD kernels generic
//! over the instruction set (chosen at run time) and rayon over (sequence, kv head, query
//! tile or key partition).
//!
//! Cache layout: `[NB, Hkv, B, D]` (head-major inside a block). A work unit reads one kv
//! head of one sequence, so every block it visits is one contiguous run of `B * D` elements
//! for keys and one for values: the access pattern is long sequential streams that the
//! hardware prefetcher follows, instead of `Hkv` short strided pieces per block as the
//! token-major layout would give.

pub mod isa;
pub mod kernel;
pub mod plan;
pub mod simd;
mod write;

use rayon::prelude::*;

use crate::backend::{AttentionImpl, Backend, Capabilities, Device, ForwardCheck, KvPair, Sizes};
use crate::config::{AttentionConfig, AttnType};
use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::kv_cache::{CacheLayout, KvCache, KvScales};
use crate::metadata::AttentionMetadata;
use crate::semantics::{query_position, KeyMap};
use crate::tensor::{Storage, Tensor};

pub use isa::{Isa, ISA_ENV};
use kernel::{Group, KvRows, RowLayout, RowStates, ScoreMods};
use simd::{E4m3, E5m2, Load, Simd};
use write::SharedMut;

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
        Capabilities {
            dtypes: DType::FLOATS.to_vec(),
            head_sizes: Sizes::Any,
            block_sizes: Sizes::Any,
            attn_types: AttnType::ALL.to_vec(),
            fp8: true,
            alibi: true,
            sliding_window: true,
            soft_cap: true,
        }
    }

    fn kv_cache_layout(&self) -> CacheLayout {
        CacheLayout::Hnd
    }

    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>> {
        self.capabilities().check_config(self.name(), config)?;
        Ok(Box::new(CpuAttention {
            config: config.clone(),
            backend: *self,
        }))
    }

    fn swap_blocks(
        &self,
        src: &KvCache,
        dst: &mut KvCache,
        pairs: &[(usize, usize)],
    ) -> Result<()> {
        write::swap_parallel(src, dst, pairs)
    }

    fn copy_blocks(&self, caches: &mut [KvCache], pairs: &[(usize, usize)]) -> Result<()> {
        write::copy_parallel(caches, pairs)
    }
}

/// One layer's attention on the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuAttention {
    config: AttentionConfig,
    backend: Cpu,
}

impl AttentionImpl for CpuAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn forward(
        &self,
        query: &Tensor,
        new_kv: Option<KvPair<'_>>,
        mut kv_cache: Option<&mut KvCache>,
        metadata: &AttentionMetadata,
        output: &mut Tensor,
        scales: KvScales,
    ) -> Result<()> {
        let backend = self.backend;
        ForwardCheck {
            backend: backend.name(),
            capabilities: &backend.capabilities(),
            layout: backend.kv_cache_layout(),
            config: &self.config,
        }
        .run(query, new_kv, kv_cache.as_deref(), metadata, output, scales)?;
        if let (Some(cache), Some(kv)) = (kv_cache.as_deref_mut(), new_kv) {
            let slots = match self.config.attn_type() {
                AttnType::EncoderDecoder => {
                    &metadata
                        .encoder
                        .as_ref()
                        .expect("validated")
                        .cross_slot_mapping
                }
                _ => &metadata.slot_mapping,
            };
            write::write_parallel(cache, kv.key, kv.value, slots, scales)?;
        }
        let call = Call {
            config: &self.config,
            metadata,
            query,
            new_kv,
            cache: kv_cache.as_deref(),
            scales,
        };
        crate::with_element!(query.dtype(), T => run_isa::<T>(self.backend.isa, &call, output));
        Ok(())
    }
}

/// Everything one forward call reads.
struct Call<'a> {
    config: &'a AttentionConfig,
    metadata: &'a AttentionMetadata,
    query: &'a Tensor,
    new_kv: Option<KvPair<'a>>,
    cache: Option<&'a KvCache>,
    scales: KvScales,
}

/// Picks the widest instruction set whose vector width divides the head size (so kernels
/// need no tails) and runs the call on it.
fn run_isa<T: Element + Load>(isa: Isa, call: &Call<'_>, output: &mut Tensor) {
    let d = call.config.head_size();
    #[cfg(target_arch = "x86_64")]
    {
        use simd::x86::{Avx2, Avx512};
        if matches!(isa, Isa::Avx512Bf16 | Isa::Avx512) && d.is_multiple_of(Avx512::LANES) {
            let s = Avx512::new().expect("checked when the backend was built");
            let s = if isa == Isa::Avx512 {
                s.without_bf16()
            } else {
                s
            };
            return run_kv::<_, T>(s, call, output);
        }
        if matches!(isa, Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2) && d.is_multiple_of(Avx2::LANES) {
            return run_kv::<_, T>(
                Avx2::new().expect("AVX-512 machines have AVX2"),
                call,
                output,
            );
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        use simd::neon::Neon;
        if isa == Isa::Neon && d.is_multiple_of(Neon::LANES) {
            return run_kv::<_, T>(
                Neon::new().expect("checked when the backend was built"),
                call,
                output,
            );
        }
    }
    let _ = isa;
    run_kv::<_, T>(simd::scalar::Scalar, call, output)
}

/// Dispatches on the element type the keys and values are read from.
fn run_kv<S: Simd, T: Element + Load>(s: S, call: &Call<'_>, output: &mut Tensor) {
    /// Views bytes as fp8 codes.
    fn codes<C>(bytes: &[u8]) -> &[C] {
        // SAFETY: E4m3 and E5m2 are repr(transparent) over u8.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const C, bytes.len()) }
    }
    match call.cache {
        Some(cache) => match (
            cache.key(),
            cache.value(),
            call.config.kv_cache_dtype().fp8_format(),
        ) {
            (Storage::U8(k), Storage::U8(v), Some(crate::Fp8Format::E4m3)) => {
                run::<S, T, E4m3>(s, call, codes(k), codes(v), output)
            }
            (Storage::U8(k), Storage::U8(v), Some(crate::Fp8Format::E5m2)) => {
                run::<S, T, E5m2>(s, call, codes(k), codes(v), output)
            }
            (k, v, _) => run::<S, T, T>(
                s,
                call,
                k.as_slice().expect("validated"),
                v.as_slice().expect("validated"),
                output,
            ),
        },
        None => {
            let kv = call
                .new_kv
                .expect("validated: without a cache, key and value are given");
            let (k, v) = (kv.key.storage(), kv.value.storage());
            run::<S, T, T>(
                s,
                call,
                k.as_slice().expect("validated"),
                v.as_slice().expect("validated"),
                output,
            )
        }
    }
}

/// Runs the plan: units in parallel, then the split-K merges.
fn run<S: Simd, T: Element + Load, E: Load>(
    s: S,
    call: &Call<'_>,
    keys: &[E],
    values: &[E],
    output: &mut Tensor,
) {
    let cfg = call.config;
    let md = call.metadata;
    let (d, hkv, group) = (
        cfg.head_size(),
        cfg.num_kv_heads(),
        cfg.num_queries_per_kv(),
    );
    let h = cfg.num_heads();
    let attn_type = cfg.attn_type();
    let fp8 = call.cache.is_some() && cfg.kv_cache_dtype().fp8_format().is_some();
    let (k_scale, v_scale) = if fp8 {
        (call.scales.k_scale, call.scales.v_scale)
    } else {
        (1.0, 1.0)
    };
    let q_scale = cfg.scale() * k_scale;
    let key_map = KeyMap::new(
        md,
        attn_type,
        call.cache.map(|c| c.spec().block_size),
        call.new_kv.is_some(),
    );
    let plan = plan::plan(cfg, md, &key_map, rayon::current_num_threads());
    let mods = ScoreMods {
        causal: attn_type.is_causal(),
        window: cfg.sliding_window(),
        soft_cap: cfg.logits_soft_cap(),
        alibi: cfg.alibi_slopes().is_some(),
    };
    let query = call.query.storage().as_slice::<T>().expect("validated");
    let out = SharedMut(
        output
            .storage_mut()
            .as_slice_mut::<T>()
            .expect("validated")
            .as_mut_ptr(),
    );
    let mut partials = vec![0.0f32; plan.num_partials * group * (d + 2)];
    let parts = SharedMut(partials.as_mut_ptr());
    let cache_geometry = call.cache.map(|c| *c.spec());

    plan.units.par_iter().for_each(|unit| {
        let s_idx = unit.seq;
        let range = md.query_range(s_idx);
        let seq_len = md.seq_lens[s_idx] as usize;
        let rows = unit.tokens.len() * group;
        let mut q = vec![0.0f32; rows * d];
        let mut pos = Vec::with_capacity(rows);
        let mut slope = Vec::new();
        for (ti, t) in unit.tokens.clone().enumerate() {
            let i = query_position(attn_type, seq_len, range.len(), t - range.start);
            for gh in 0..group {
                let head = unit.kv_head * group + gh;
                let src = &query[(t * h + head) * d..][..d];
                let dst = &mut q[(ti * group + gh) * d..][..d];
                for (o, x) in dst.iter_mut().zip(src) {
                    *o = Element::to_f32(*x) * q_scale;
                }
                pos.push(i);
                if let Some(slopes) = cfg.alibi_slopes() {
                    slope.push(slopes[head]);
                }
            }
        }
        let layout = match cache_geometry {
            Some(spec) => {
                let table = match attn_type {
                    AttnType::EncoderDecoder => md
                        .encoder
                        .as_ref()
                        .expect("validated")
                        .cross_block_tables
                        .row(s_idx),
                    _ => md.block_tables.row(s_idx),
                };
                let block = spec.block_size * d;
                RowLayout::Paged {
                    table,
                    block_size: spec.block_size,
                    block_stride: hkv * block,
                    head_offset: unit.kv_head * block,
                }
            }
            None => {
                let first_token = match attn_type {
                    AttnType::EncoderDecoder => md.encoder_token_start(s_idx),
                    _ => range.start,
                };
                RowLayout::Dense {
                    first_row: (first_token * hkv + unit.kv_head) * d,
                    token_stride: hkv * d,
                }
            }
        };
        let kv = KvRows {
            key: keys,
            value: values,
            layout,
            head_size: d,
        };
        let g = Group {
            q: &q,
            pos: &pos,
            slope: &slope,
            keys: unit.keys.clone(),
            absent: &plan.absent[s_idx],
        };
        let mut state = RowStates::new(rows, d);
        s.vectorize(kernel::Attend { kv: &kv, group: &g, mods: &mods, state: &mut state });
        match unit.partial {
            Some(slot) => {
                // SAFETY: each partial slot belongs to one unit.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        parts.ptr().add(slot * group * (d + 2)),
                        group * (d + 2),
                    )
                };
                for r in 0..group {
                    dst[r * (d + 2)] = state.m[r];
                    dst[r * (d + 2) + 1] = state.l[r];
                    dst[r * (d + 2) + 2..(r + 1) * (d + 2)]
                        .copy_from_slice(&state.acc[r * d..(r + 1) * d]);
                }
            }
            None => {
                for (ti, t) in unit.tokens.clone().enumerate() {
                    for gh in 0..group {
                        let r = ti * group + gh;
                        let head = unit.kv_head * group + gh;
                        let norm = if state.l[r] > 0.0 {
                            v_scale / state.l[r]
                        } else {
                            0.0
                        };
                        // SAFETY: (token, head) rows are written by exactly one unit.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(out.ptr().add((t * h + head) * d), d)
                        };
                        for (o, a) in dst.iter_mut().zip(&state.acc[r * d..(r + 1) * d]) {
                            *o = T::from_f32(a * norm);
                        }
                    }
                }
            }
        }
    });

    let partials = &partials;
    plan.merges.par_iter().for_each(|merge| {
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
            if m > f32::NEG_INFINITY {
                for p in merge.parts.clone() {
                    let w = (part(p)[0] - m).exp();
                    l += part(p)[1] * w;
                    for (a, x) in acc.iter_mut().zip(&part(p)[2..]) {
                        *a += x * w;
                    }
                }
            }
            let norm = if l > 0.0 { v_scale / l } else { 0.0 };
            let head = merge.kv_head * group + gh;
            // SAFETY: each (token, head) row is merged by exactly one merge.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out.ptr().add((merge.token * h + head) * d), d)
            };
            for (o, a) in dst.iter_mut().zip(&acc) {
                *o = T::from_f32(a * norm);
            }
        }
    });
}
