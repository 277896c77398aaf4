//! The micro-kernels the tile loop and the sources run on a block of rows: scores of a tile
//! ([`score_group`], [`qk_partial`]), the score modifiers ([`apply_mods`]), the online-softmax
//! step ([`softmax_step`]) and P·V ([`accumulate_rows`], [`accumulate_consecutive`],
//! `pv_chunks`).

use std::mem::MaybeUninit;
use std::ops::Range;

use super::prefetch::TileRows;
use super::tile_loop::{RowStates, ScoreMods, KEY_TILE};
use crate::cpu::simd::{Load, Simd};

/// Query rows per micro-kernel block.
pub const ROW_BLOCK: usize = 8;

/// Runs `$body` for each block of up to [`ROW_BLOCK`] rows, with `$r0` the first row and the
/// const `$n` the block's row count (so micro-kernels keep their accumulators in registers).
/// `for_row_blocks!(rows, for S, ...)` sizes the blocks to the ISA `S`: 8 rows with 32 vector
/// registers, 6 with 16 (6 rows × 2 vectors = 12 accumulators, beside two operands and a
/// broadcast).
macro_rules! for_row_blocks {
    ($rows:expr, |$r0:ident, $n:ident| $body:expr) => {
        $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 8, [1 2 3 4 5 6 7], |$r0, $n| $body)
    };
    ($rows:expr, for $s:ty, |$r0:ident, $n:ident| $body:expr) => {
        if <$s as $crate::cpu::simd::Simd>::MANY_REGISTERS {
            $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 8, [1 2 3 4 5 6 7], |$r0, $n| $body)
        } else {
            $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 6, [1 2 3 4 5], |$r0, $n| $body)
        }
    };
    (@blocks $rows:expr, $block:literal, [$($k:literal)*], |$r0:ident, $n:ident| $body:expr) => {{
        const _: () = assert!($block <= $crate::cpu::kernel::ROW_BLOCK);
        let rows = $rows;
        let mut $r0 = 0;
        while $r0 < rows {
            match rows - $r0 {
                $($k => {
                    const $n: usize = $k;
                    $body
                })*
                _ => {
                    const $n: usize = $block;
                    $body
                }
            }
            $r0 += $block;
        }
    }};
}

pub(crate) use for_row_blocks;

/// The widest vector any ISA has, in f32 lanes (sizes the per-group scratch).
const MAX_LANES: usize = 16;

/// Scores of rows `r0..r0+R` for the keys in tile columns `t0..t0+LANES` (those inside the
/// tile): `partial(k0, k1)` gives each row's vectors of partial dot products with two keys
/// (two at a time: each query vector loaded serves both, and the two keys' chains are
/// independent), and [`Simd::transpose_sum`] reduces `LANES` keys at once into one vector of
/// scores per row, stored times `scale`. Columns past the tile get score 0 (the masks
/// overwrite them). The first row block issues the tile's prefetches.
#[inline(always)]
pub fn score_group<S: Simd, const R: usize, E>(
    s: S,
    tile: &TileRows<'_, E>,
    t0: usize,
    r0: usize,
    scale: f32,
    scores: &mut [f32],
    mut partial: impl FnMut(&[E], &[E]) -> [[S::V; R]; 2],
) {
    let mut sums = [[MaybeUninit::<S::V>::uninit(); MAX_LANES]; R];
    for i in (0..S::LANES).step_by(2) {
        // (One call site of `partial`: with two, it is no longer inlined, and its intrinsics
        // become calls compiled without the ISA's features.)
        let (a, b) = (t0 + i, t0 + i + 1);
        let mut parts = if a < tile.len {
            let k0 = tile.key(s, a, r0 == 0);
            let k1 = if b < tile.len {
                tile.key(s, b, r0 == 0)
            } else {
                k0
            };
            partial(k0, k1)
        } else {
            [[s.splat(0.0); R]; 2]
        };
        if b >= tile.len {
            parts[1] = [s.splat(0.0); R];
        }
        for (j, part) in parts.iter().enumerate() {
            for (sum, &p) in sums.iter_mut().zip(part) {
                sum[i + j].write(p);
            }
        }
    }
    for (r, sum) in sums.iter().enumerate() {
        // SAFETY: lanes 0..LANES were all written above (LANES is even); MaybeUninit<V> has
        // V's layout.
        let sum = unsafe { std::slice::from_raw_parts(sum.as_ptr().cast::<S::V>(), S::LANES) };
        let v = s.mul(s.transpose_sum(sum), s.splat(scale));
        // SAFETY: t0 + LANES <= KEY_TILE (a multiple of every LANES); row r0 + r exists.
        unsafe { s.store(scores.as_mut_ptr().add((r0 + r) * KEY_TILE + t0), v) };
    }
}

/// Partial dot products of `R` query rows (`q`, R × D) with two key rows: each key vector
/// is loaded (and widened) once for the R rows, each query vector once for both keys; the
/// keys are widened two vectors at a time ([`Load::load_pair`]).
#[inline(always)]
pub(super) fn qk_partial<S: Simd, E: Load, const R: usize>(
    s: S,
    q: &[f32],
    k0: &[E],
    k1: &[E],
) -> [[S::V; R]; 2] {
    let d = k0.len();
    let mut acc = [[s.splat(0.0); R]; 2];
    let mut c = 0;
    // The key rows and each query row have d elements, a multiple of LANES.
    while c + 2 * S::LANES <= d {
        // SAFETY: c + 2·LANES <= d, so both keys' 2·LANES elements from c are in their rows.
        let (a, b) = unsafe {
            (
                E::load_pair(s, k0.as_ptr().add(c)),
                E::load_pair(s, k1.as_ptr().add(c)),
            )
        };
        qk_step(s, q, d, c, a[0], b[0], &mut acc);
        qk_step(s, q, d, c + S::LANES, a[1], b[1], &mut acc);
        c += 2 * S::LANES;
    }
    if c < d {
        // SAFETY: c < d and both multiples of LANES, so c + LANES <= d.
        let (a, b) = unsafe {
            (
                E::load(s, k0.as_ptr().add(c)),
                E::load(s, k1.as_ptr().add(c)),
            )
        };
        qk_step(s, q, d, c, a, b, &mut acc);
    }
    acc
}

/// One vector chunk (dimensions `c..c+LANES`) of [`qk_partial`]: the widened keys `a` and
/// `b` times each query row, into its two accumulators.
#[inline(always)]
fn qk_step<S: Simd, const R: usize>(
    s: S,
    q: &[f32],
    d: usize,
    c: usize,
    a: S::V,
    b: S::V,
    acc: &mut [[S::V; R]; 2],
) {
    let [acc0, acc1] = acc;
    for (r, (x0, x1)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
        // SAFETY: q is R × d and c + LANES <= d.
        let qv = unsafe { s.load(q.as_ptr().add(r * d + c)) };
        *x0 = s.fma(qv, a, *x0);
        *x1 = s.fma(qv, b, *x1);
    }
}

/// Soft cap, ALiBi and the masks for one row's tile of scores (keys `start..end`; tile columns
/// outside `cols`, the ones the row attends, become -inf).
///
/// Positions never go through f32: the attended columns are worked out in integers
/// (`tile_loop::attended_columns`) and compared as tile-local indices (below `KEY_TILE`, exact
/// in f32), and ALiBi's distance `j - i` is an integer before it is rounded once to f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn apply_mods<S: Simd>(
    s: S,
    row: &mut [f32],
    start: usize,
    end: usize,
    cols: Range<usize>,
    pos: usize,
    slope: f32,
    mods: &ScoreMods,
) {
    let neg_inf = s.splat(f32::NEG_INFINITY);
    let (lo, hi) = (s.splat(cols.start as f32), s.splat(cols.end as f32));
    for c in (0..KEY_TILE).step_by(S::LANES) {
        if start + c >= end {
            row[c..].fill(f32::NEG_INFINITY);
            break;
        }
        // SAFETY: c + LANES <= KEY_TILE = row.len().
        let mut v = unsafe { s.load(row.as_ptr().add(c)) };
        let t = s.add(s.iota(), s.splat(c as f32));
        if let Some(cap) = mods.soft_cap {
            v = s.mul(s.splat(cap), s.tanh(s.div(v, s.splat(cap))));
        }
        if mods.alibi {
            let base = (start + c) as i64 - pos as i64;
            let dist = s.add(s.iota(), s.splat(base as f32));
            v = if mods.causal {
                s.fma(s.splat(slope), dist, v)
            } else {
                let abs = s.max(dist, s.sub(s.splat(0.0), dist));
                s.fma(s.splat(-slope), abs, v)
            };
        }
        v = s.select_lt(t, lo, neg_inf, v);
        v = s.select_lt(t, hi, v, neg_inf);
        // SAFETY: as above.
        unsafe { s.store(row.as_mut_ptr().add(c), v) };
    }
}

/// Folds one row's tile of scores into its online-softmax state; leaves the probabilities
/// (relative to the new running max) in `row`.
#[inline(always)]
pub(super) fn softmax_step<S: Simd>(
    s: S,
    row: &mut [f32],
    r: usize,
    d: usize,
    state: &mut RowStates,
) {
    let mut mx = s.splat(f32::NEG_INFINITY);
    for c in (0..KEY_TILE).step_by(S::LANES) {
        // SAFETY: c + LANES <= KEY_TILE = row.len().
        mx = s.max(mx, unsafe { s.load(row.as_ptr().add(c)) });
    }
    let m_new = state.m[r].max(s.reduce_max(mx));
    if m_new == f32::NEG_INFINITY {
        // Every score so far is -inf or NaN: masked keys and -inf scores weigh 0, NaN scores
        // poison the row (IEEE: exp(NaN) is NaN). Whether the row attended any key at all is
        // settled when it is written out.
        let mut nan = false;
        for p in row.iter_mut() {
            nan |= p.is_nan();
            *p = if p.is_nan() { f32::NAN } else { 0.0 };
        }
        if nan {
            state.l[r] = f32::NAN;
        }
        return;
    }
    let alpha = (state.m[r] - m_new).exp();
    if alpha != 1.0 {
        state.l[r] *= alpha;
        let acc = &mut state.acc[r * d..(r + 1) * d];
        let a = s.splat(alpha);
        for c in (0..d).step_by(S::LANES) {
            // SAFETY: acc has d elements, a multiple of LANES.
            unsafe {
                s.store(
                    acc.as_mut_ptr().add(c),
                    s.mul(a, s.load(acc.as_ptr().add(c))),
                )
            };
        }
    }
    let m = s.splat(m_new);
    let mut sum = s.splat(0.0);
    for c in (0..KEY_TILE).step_by(S::LANES) {
        // SAFETY: as above.
        unsafe {
            let p = s.exp(s.sub(s.load(row.as_ptr().add(c)), m));
            sum = s.add(sum, p);
            s.store(row.as_mut_ptr().add(c), p);
        }
    }
    state.l[r] += s.reduce_sum(sum);
    state.m[r] = m_new;
}

/// The end of the tile columns that some row of `r0..r0 + n` attends (`cols`: each row's);
/// past it every row of the block is masked, so its scores and P·V can skip those columns.
#[inline(always)]
pub fn block_end(cols: &[Range<usize>], r0: usize, n: usize) -> usize {
    cols.get(r0..r0 + n).map_or(KEY_TILE, |block| {
        block.iter().map(|c| c.end).max().unwrap_or(0)
    })
}

/// `acc[r] += Σ_t p[r][t] · values[value_rows[t]..]` for every row, skipping the columns `skip` marks
/// and, per block of rows, the columns past [`block_end`] (their probabilities are 0).
#[inline(always)]
pub fn accumulate_rows<S: Simd, E: Load>(
    s: S,
    values: &[E],
    value_rows: &[usize],
    cols: &[Range<usize>],
    skip: &[bool],
    probs: &[f32],
    state: &mut RowStates,
) {
    let mut present = [(0usize, 0usize); KEY_TILE];
    // before[j]: how many present keys lie before tile column j.
    let mut before = [0usize; KEY_TILE + 1];
    let mut count = 0;
    for (t, &row) in value_rows.iter().enumerate() {
        before[t] = count;
        if !skip[t] {
            present[count] = (t, row);
            count += 1;
        }
    }
    before[value_rows.len()..].fill(count);
    let keys = Listed {
        present: &present[..count],
        before: &before,
    };
    accumulate(s, values, keys, cols, probs, state);
}

/// [`accumulate_rows`] where every column of the tile is present and its value rows are
/// consecutive from `first_row` (a packed prefill's): the passes step through them by
/// arithmetic instead of loading each key's (column, row) pair.
#[inline(always)]
pub fn accumulate_consecutive<S: Simd>(
    s: S,
    values: &[f32],
    first_row: usize,
    cols: &[Range<usize>],
    probs: &[f32],
    state: &mut RowStates,
) {
    let d = state.acc.len() / state.m.len();
    accumulate(s, values, Consecutive { first_row, d }, cols, probs, state);
}

/// The keys a P·V pass visits: (tile column, value row offset) pairs in column order.
trait PassKeys: Copy {
    /// Those before tile column `end`.
    fn before(self, end: usize) -> impl Iterator<Item = (usize, usize)>;
}

/// The keys present, listed.
#[derive(Clone, Copy)]
struct Listed<'a> {
    /// (tile column, value row offset) of the keys present, in column order.
    present: &'a [(usize, usize)],
    /// How many of them lie before each tile column (and before the tile's end).
    before: &'a [usize; KEY_TILE + 1],
}

impl PassKeys for Listed<'_> {
    #[inline(always)]
    fn before(self, end: usize) -> impl Iterator<Item = (usize, usize)> {
        self.present[..self.before[end]].iter().copied()
    }
}

/// Every column, its value row `d` after the previous one's.
#[derive(Clone, Copy)]
struct Consecutive {
    first_row: usize,
    d: usize,
}

impl PassKeys for Consecutive {
    #[inline(always)]
    fn before(self, end: usize) -> impl Iterator<Item = (usize, usize)> {
        (0..end).map(move |t| (t, self.first_row + t * self.d))
    }
}

/// P·V over `keys`, chunk-major: one pass over the tile's keys per group of `W` vector
/// chunks of the head (4 where the 4·R accumulators of a block of all the rows, 4 value
/// vectors and a broadcast fit the registers, e.g. a decode's 4 query heads on AVX-512: fewer
/// passes, so fewer broadcasts and key lookups per FMA; else 2: R·W independent FMA chains
/// per row block, enough to hide the FMA latency), with every row block in turn. The value
/// columns a pass reads (keys × W·LANES) then stay in L1 across the row blocks, where a
/// row-major order streams the whole value tile from L2 once per row block.
#[inline(always)]
fn accumulate<S: Simd, E: Load>(
    s: S,
    values: &[E],
    keys: impl PassKeys,
    cols: &[Range<usize>],
    probs: &[f32],
    state: &mut RowStates,
) {
    let d = state.acc.len() / state.m.len();
    let pass = PvPass {
        values,
        keys,
        cols,
        probs,
        rows: state.m.len(),
        d,
    };
    let acc = &mut state.acc;
    let mut c = 0;
    if 4 * pass.rows + 5 <= S::REGISTERS {
        while c + 4 * S::LANES <= d {
            pass.run::<S, 4>(s, acc, c);
            c += 4 * S::LANES;
        }
    }
    while c + 2 * S::LANES <= d {
        pass.run::<S, 2>(s, acc, c);
        c += 2 * S::LANES;
    }
    if c < d {
        pass.run::<S, 1>(s, acc, c);
    }
}

/// What every pass of [`accumulate`] over a tile's keys shares.
struct PvPass<'a, E, K> {
    values: &'a [E],
    keys: K,
    cols: &'a [Range<usize>],
    probs: &'a [f32],
    rows: usize,
    d: usize,
}

impl<E: Load, K: PassKeys> PvPass<'_, E, K> {
    /// The pass for the `W` vector chunks from dimension `c`, every row block in turn.
    #[inline(always)]
    fn run<S: Simd, const W: usize>(&self, s: S, acc: &mut [f32], c: usize) {
        let d = self.d;
        for_row_blocks!(self.rows, for S, |r0, R| {
            let keys = self.keys.before(block_end(self.cols, r0, R));
            let probs = &self.probs[r0 * KEY_TILE..(r0 + R) * KEY_TILE];
            let acc = &mut acc[r0 * d..(r0 + R) * d];
            pv_chunks::<S, E, R, W>(s, self.values, keys, probs, acc, d, c)
        });
    }
}

/// P·V of one row block (`R` rows: `probs` R × KEY_TILE, `acc` R × d) for the `W` vector
/// chunks from dimension `c`, over `keys` ((tile column, value row offset) pairs): R·W
/// accumulators in registers across the keys, each value vector loaded and widened once for
/// the R rows, each probability broadcast once for the W chunks.
#[inline(always)]
fn pv_chunks<S: Simd, E: Load, const R: usize, const W: usize>(
    s: S,
    values: &[E],
    keys: impl Iterator<Item = (usize, usize)>,
    probs: &[f32],
    acc: &mut [f32],
    d: usize,
    c: usize,
) {
    let mut a = [[s.splat(0.0); W]; R];
    // SAFETY: acc is R × d, c + W·LANES <= d; value rows + d are inside the validated value
    // buffer; probs is R × KEY_TILE and t < KEY_TILE.
    unsafe {
        for (r, row) in a.iter_mut().enumerate() {
            for (w, x) in row.iter_mut().enumerate() {
                *x = s.load(acc.as_ptr().add(r * d + c + w * S::LANES));
            }
        }
        for (t, at) in keys {
            let mut v = [s.splat(0.0); W];
            let mut w = 0;
            while w + 2 <= W {
                [v[w], v[w + 1]] = E::load_pair(s, values.as_ptr().add(at + c + w * S::LANES));
                w += 2;
            }
            if w < W {
                v[w] = E::load(s, values.as_ptr().add(at + c + w * S::LANES));
            }
            for (r, row) in a.iter_mut().enumerate() {
                let p = s.splat(*probs.get_unchecked(r * KEY_TILE + t));
                for (x, &vw) in row.iter_mut().zip(&v) {
                    *x = s.fma(p, vw, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (w, x) in row.iter().enumerate() {
                s.store(acc.as_mut_ptr().add(r * d + c + w * S::LANES), *x);
            }
        }
    }
}
