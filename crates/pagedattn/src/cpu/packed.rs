//! Prefill: the keys and values of one (sequence, kv head) packed once, in f32, for
//! register-blocked micro-kernels shared by every query tile of that sequence.
//!
//! Keys are stored transposed in column groups of `LANES` keys, `[group][d][LANES]`, so that
//! a block of rows × `LANES` keys is a sequence of broadcast-multiply-adds with no horizontal
//! sums. Values are widened to f32 rows (positions that are not keys become zero rows).

use std::ops::Range;

use crate::error::Result;

use super::aligned::AlignedF32;
use super::kernel::{
    accumulate_consecutive, accumulate_rows, block_end, for_row_blocks, KvRows, RowStates,
    TileSource, KEY_TILE, PACK_PREFETCH_KEYS,
};
use super::simd::{Load, Simd, WithSimd};

/// Keys and values of one (sequence, kv head), packed in f32.
#[derive(Debug, Clone)]
pub struct PackedF32 {
    origin: usize,
    lanes: usize,
    d: usize,
    kt: AlignedF32,
    v: AlignedF32,
}

/// [`pack_f32`] as an operation for [`Simd::vectorize`].
pub struct PackF32<'a, 'b, E> {
    /// Where the rows are.
    pub kv: &'a KvRows<'b, E>,
    /// Positions to pack.
    pub keys: Range<usize>,
}

impl<E: Load> WithSimd for PackF32<'_, '_, E> {
    type Output = Result<PackedF32>;
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> Result<PackedF32> {
        pack_f32(s, self.kv, self.keys)
    }
}

/// Packs positions `keys` (the column groups start at `keys.start`): 8 × keys × D bytes,
/// sized by the caller's metadata, so [`Error::OutOfMemory`](crate::Error::OutOfMemory)
/// where the host cannot allocate them.
#[inline(always)]
pub fn pack_f32<S: Simd, E: Load>(
    s: S,
    kv: &KvRows<'_, E>,
    keys: Range<usize>,
) -> Result<PackedF32> {
    let (d, lanes) = (kv.head_size, S::LANES);
    let groups = keys.len().div_ceil(lanes);
    let mut kt = AlignedF32::try_zeros(groups.saturating_mul(d * lanes))?;
    let mut v = AlignedF32::try_zeros(keys.len().saturating_mul(d))?;
    let mut widened = [0.0f32; 16];
    // Packed rows hold the exact values (undoing a scaled widening once here).
    let scale = s.splat(E::load_scale::<S>());
    for (t, j) in keys.clone().enumerate() {
        if j + PACK_PREFETCH_KEYS < keys.end {
            kv.prefetch(s, j + PACK_PREFETCH_KEYS);
        }
        let row = kv.row(j);
        let (k, val) = (&kv.key[row..][..d], &kv.value[row..][..d]);
        let column = &mut kt[(t / lanes) * d * lanes + t % lanes..];
        for c in (0..d).step_by(lanes) {
            // SAFETY: rows have d elements, a multiple of LANES; `widened` holds 16 >= LANES.
            unsafe {
                s.store(
                    widened.as_mut_ptr(),
                    s.mul(scale, E::load(s, k.as_ptr().add(c))),
                );
                s.store(
                    v.as_mut_ptr().add(t * d + c),
                    s.mul(scale, E::load(s, val.as_ptr().add(c))),
                );
            }
            for (l, &x) in widened[..lanes].iter().enumerate() {
                column[(c + l) * lanes] = x;
            }
        }
    }
    Ok(PackedF32 {
        origin: keys.start,
        lanes,
        d,
        kt,
        v,
    })
}

/// A query tile against packed f32 keys and values.
#[derive(Debug, Clone, Copy)]
pub struct PackedF32Source<'a> {
    /// The packed keys and values.
    pub packed: &'a PackedF32,
    /// Rows × D queries, unscaled.
    pub q: &'a [f32],
    /// Score scale: softmax scale × fp8 k_scale.
    pub scale: f32,
}

impl TileSource for PackedF32Source<'_> {
    type Tile<'t>
        = Range<usize>
    where
        Self: 't;

    fn alignment(&self) -> (usize, usize) {
        (self.packed.origin, self.packed.lanes)
    }

    #[inline(always)]
    fn tile(&self, keys: Range<usize>) -> Range<usize> {
        keys
    }

    #[inline(always)]
    fn scores<S: Simd>(
        &self,
        s: S,
        keys: &Range<usize>,
        cols: &[Range<usize>],
        scores: &mut [f32],
    ) {
        let p = self.packed;
        debug_assert_eq!(p.lanes, S::LANES);
        let rows = self.q.len() / p.d;
        let first_group = (keys.start - p.origin) / S::LANES;
        let groups = keys.len().div_ceil(S::LANES);
        // `n` column groups from group `g` of the tile.
        let kt =
            |g: usize, n: usize| &p.kt[(first_group + g) * p.d * S::LANES..][..n * p.d * S::LANES];
        // Two column groups at a time (each broadcast query element serves both), then any
        // last one; row blocks sized to the ISA's registers. A block skips the groups that
        // none of its rows attends (past the causal diagonal).
        let mut g = 0;
        while g < groups {
            let c = g * S::LANES;
            if g + 2 <= groups {
                for_row_blocks!(rows, for S, |r0, R| if c < block_end(cols, r0, R) {
                    qk_groups::<S, R, 2>(s, self.q, r0, p.d, kt(g, 2), c, self.scale, scores)
                });
                g += 2;
            } else {
                for_row_blocks!(rows, for S, |r0, R| if c < block_end(cols, r0, R) {
                    qk_groups::<S, R, 1>(s, self.q, r0, p.d, kt(g, 1), c, self.scale, scores)
                });
                g += 1;
            }
        }
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        s: S,
        keys: &Range<usize>,
        cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        let p = self.packed;
        let first_row = (keys.start - p.origin) * p.d;
        if skip.iter().any(|&a| a) {
            let mut rows = [0usize; KEY_TILE];
            for (t, row) in rows[..skip.len()].iter_mut().enumerate() {
                *row = first_row + t * p.d;
            }
            accumulate_rows(s, &p.v, &rows[..skip.len()], cols, skip, probs, state);
        } else {
            accumulate_consecutive(s, &p.v, first_row, cols, probs, state);
        }
    }

    fn value_row(&self, keys: &Range<usize>, t: usize, out: &mut [f32]) {
        let p = self.packed;
        out.copy_from_slice(&p.v[(keys.start + t - p.origin) * p.d..][..p.d]);
    }
}

/// Scores of rows `r0..r0+R` against `G` consecutive column groups of `LANES` keys (columns
/// `c..c + G·LANES`, `kt` their packed keys), times `scale`: R·G accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn qk_groups<S: Simd, const R: usize, const G: usize>(
    s: S,
    q: &[f32],
    r0: usize,
    d: usize,
    kt: &[f32],
    c: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let q = &q[r0 * d..(r0 + R) * d];
    let mut acc = [[s.splat(0.0); G]; R];
    for dd in 0..d {
        // SAFETY: kt is G × d × LANES; q is R × d.
        unsafe {
            let mut k = [s.splat(0.0); G];
            for (g, x) in k.iter_mut().enumerate() {
                *x = s.load(kt.as_ptr().add((g * d + dd) * S::LANES));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let qv = s.splat(*q.get_unchecked(r * d + dd));
                for (a, &kg) in row.iter_mut().zip(&k) {
                    *a = s.fma(qv, kg, *a);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (g, a) in row.iter().enumerate() {
            // SAFETY: a row of scores has KEY_TILE >= c + G·LANES slots.
            unsafe {
                s.store(
                    scores
                        .as_mut_ptr()
                        .add((r0 + r) * KEY_TILE + c + g * S::LANES),
                    s.mul(*a, s.splat(scale)),
                )
            };
        }
    }
}
