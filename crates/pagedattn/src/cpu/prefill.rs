//! Prefill groups: one (sequence, kv head)'s keys and values packed once, then its query
//! tiles in parallel.

use crate::error::Result;

#[cfg(target_arch = "x86_64")]
use super::kernel::ScoreMods;
use super::kernel::{Attend, QueryRows, RowStates};
use super::packed;
use super::parallel;
use super::plan::PrefillGroup;
use super::simd::{Load, Simd};
#[cfg(target_arch = "x86_64")]
use super::Isa;
#[cfg(target_arch = "x86_64")]
use super::{amx, bf16};

use super::call::TypedCall;

impl<S: Simd, E: Load> TypedCall<'_, S, E> {
    /// Packs one prefill group's keys and values, then runs its query tiles in parallel.
    /// The packing is the one allocation sized by the caller's metadata (the group's keys):
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) where the host cannot make it. The
    /// tiles' scratch (query rows, row states, scores) is sized by the configuration (rows ×
    /// D, a key tile) and allocated as usual.
    pub(super) fn prefill(&self, pg: &PrefillGroup) -> Result<()> {
        let d = self.cfg.head_size();
        let kv = self.kv_rows(pg.seq, pg.kv_head);
        #[cfg(target_arch = "x86_64")]
        {
            let amx = self.isa == Isa::Amx;
            // An `if` on the constants alone first: the compiler then builds the bf16
            // kernels only for the ISA token and the element types that can run them.
            if S::BF16_KERNELS
                && E::BF16_EXACT
                && self.bf16_queries()
                && self.isa.bf16_dot_products(d, true)
            {
                let packed = bf16::pack_bf16(&kv, pg.keys.clone())?;
                parallel::for_each(pg.tiles.len(), &|i| {
                    let tile = &pg.tiles[i];
                    let (pos, slope) = self.rows(pg.seq, pg.kv_head, tile.tokens.clone());
                    let group = QueryRows {
                        pos: &pos,
                        slope: &slope,
                        keys: tile.keys.clone(),
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
                return Ok(());
            }
        }
        let packed = self.s.vectorize(packed::PackF32 {
            kv: &kv,
            keys: pg.keys.clone(),
        })?;
        parallel::for_each(pg.tiles.len(), &|i| {
            let tile = &pg.tiles[i];
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
        Ok(())
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
