//! The decode's [`TileSource`]: scores and values read straight from
//! the cache rows ([`RowsSource`]).

use std::ops::Range;

use super::micro::{accumulate_rows, for_row_blocks, qk_partial, score_group};
use super::prefetch::{PrefetchStream, TileRows, ValuesAhead};
use super::rows::KvRows;
use super::tile_loop::{RowStates, TileSource, KEY_TILE};
use crate::cpu::simd::{Load, Simd};

/// Scores and values read straight from the cache rows (decode: a few rows per key).
#[derive(Debug, Clone, Copy)]
pub struct RowsSource<'a, E> {
    /// Keys and values.
    pub kv: KvRows<'a, E>,
    /// Rows × D queries, unscaled.
    pub q: &'a [f32],
    /// Score scale: softmax scale × fp8 k_scale × the ISA's [`Load::load_scale`] (applied to
    /// each dot product, so that the score overflows only where the product itself leaves
    /// f32's range) where that product is finite; else the load scale alone, and
    /// `after_scale` applies the score scale.
    scale: f32,
    /// The score scale, where folding the load scale into it would overflow (a score scale
    /// within a factor `load_scale` of f32's largest value, which the contract accepts); 1
    /// elsewhere. The scores are then `(dot · load_scale) · score_scale`: exact dot product
    /// first, one rounding, as with the single factor.
    after_scale: f32,
    /// What this ISA's loads divide the cache elements by ([`Load::load_scale`]): the P·V
    /// sums are multiplied back by it in [`TileSource::finish`].
    load_scale: f32,
    /// Where the prefetches run ahead to.
    pub stream: PrefetchStream,
}

impl<'a, E: Load> RowsSource<'a, E> {
    /// The source of `kv` and the queries `q` on ISA `S`, with score scale `score_scale`
    /// (softmax scale × fp8 k_scale).
    pub fn new<S: Simd>(
        kv: KvRows<'a, E>,
        q: &'a [f32],
        score_scale: f32,
        stream: PrefetchStream,
    ) -> Self {
        let load_scale = E::load_scale::<S>();
        let (scale, after_scale) = if (score_scale * load_scale).is_finite() {
            (score_scale * load_scale, 1.0)
        } else {
            (load_scale, score_scale)
        };
        RowsSource {
            kv,
            q,
            scale,
            after_scale,
            load_scale,
            stream,
        }
    }
}

impl<E: Load> TileSource for RowsSource<'_, E> {
    type Tile<'t>
        = TileRows<'t, E>
    where
        Self: 't;

    fn alignment(&self) -> (usize, usize) {
        (0, 1)
    }

    #[inline(always)]
    fn tile(&self, keys: Range<usize>) -> TileRows<'_, E> {
        TileRows::new(
            &self.kv,
            keys,
            self.stream,
            self.kv.head_size,
            ValuesAhead::WithKeys,
        )
    }

    #[inline(always)]
    fn scores<S: Simd>(
        &self,
        s: S,
        tile: &TileRows<'_, E>,
        _cols: &[Range<usize>],
        scores: &mut [f32],
    ) {
        let d = self.kv.head_size;
        let rows = self.q.len() / d;
        for t0 in (0..tile.len).step_by(S::LANES) {
            for_row_blocks!(rows, for S, |r0, R| score_group(
                s,
                tile,
                t0,
                r0,
                self.scale,
                scores,
                |k0, k1| qk_partial::<S, E, R>(s, &self.q[r0 * d..(r0 + R) * d], k0, k1)
            ));
        }
        if self.after_scale != 1.0 {
            let after = s.splat(self.after_scale);
            for c in (0..rows * KEY_TILE).step_by(S::LANES) {
                // SAFETY: scores holds rows × KEY_TILE f32, a multiple of LANES.
                unsafe {
                    let at = scores.as_mut_ptr().add(c);
                    s.store(at, s.mul(s.load(at), after));
                }
            }
        }
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        s: S,
        tile: &TileRows<'_, E>,
        cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        accumulate_rows(s, self.kv.value, tile.rows(), cols, skip, probs, state);
    }

    fn value_row(&self, tile: &TileRows<'_, E>, t: usize, out: &mut [f32]) {
        let row = &self.kv.value[tile.rows()[t]..][..self.kv.head_size];
        for (o, &x) in out.iter_mut().zip(row) {
            *o = x.to_f32() / self.load_scale;
        }
    }

    fn finish(&self, state: &mut RowStates) {
        if self.load_scale != 1.0 {
            for a in state.acc.iter_mut() {
                *a *= self.load_scale;
            }
        }
    }
}
