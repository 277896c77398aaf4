//! Decode units: every kv head of one sequence over a key range, on the cache rows in place
//! (the portable kernels, or AVX512-BF16's).

use super::kernel::{Attend, KvRows, PrefetchStream, QueryRows, RowStates, RowsSource};
use super::plan::DecodeUnit;
use super::simd::{Load, Simd};
#[cfg(target_arch = "x86_64")]
use super::{bf16, widen};

use super::call::TypedCall;

/// What the AVX512-BF16 decode kernel needs of a decode unit, per kv head.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct DecodeHeads<'a, 'b, E> {
    unit: &'a DecodeUnit,
    groups: &'a [QueryRows<'b>],
    kvs: &'a [KvRows<'b, E>],
    streams: &'a [PrefetchStream],
}

impl<S: Simd, E: Load> TypedCall<'_, S, E> {
    /// Runs one decode unit: every kv head of one sequence, over the unit's keys.
    pub(super) fn decode(&self, unit: &DecodeUnit) {
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
        // An `if` on the constants alone: the compiler then builds the bf16 kernels only for
        // the ISA token and the element types that can run them.
        #[cfg(target_arch = "x86_64")]
        let done = if S::BF16_KERNELS && E::BF16_EXACT {
            self.decode_bf16(
                DecodeHeads {
                    unit,
                    groups: &groups,
                    kvs: &kvs,
                    streams: &streams,
                },
                &mut states,
            )
        } else {
            false
        };
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

    /// Runs a decode unit with AVX512-BF16 on the cache rows in place, where the call allows
    /// it: bf16 queries, head size a multiple of 32, and bf16 keys and values (cache or
    /// inputs) or an fp8 cache (widened in registers, with AVX512-VBMI). Returns whether it
    /// ran.
    #[cfg(target_arch = "x86_64")]
    fn decode_bf16(&self, rows: DecodeHeads<'_, '_, E>, states: &mut [RowStates]) -> bool {
        use widen::Bf16Rows;
        if !(self.isa.bf16_dot_products(self.cfg.head_size(), false) && self.bf16_queries()) {
            return false;
        }
        // Every kv head of the unit's sequence reads the same buffers (the cache, or the
        // private cache of a detached sequence).
        let kv = &rows.kvs[0];
        match (E::as_bf16_rows(kv.key), E::as_bf16_rows(kv.value)) {
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

    /// [`TypedCall::decode_bf16`] on `key` and `value`: the unit's key and value buffers as
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
}
