//! The flash-attention tile loop ([`attend`]) and what it works on: the query rows, their
//! online-softmax state, the score settings and the [`TileSource`] a tile's scores and values
//! come from.

use std::ops::Range;

use super::micro::{apply_mods, softmax_step};
use crate::cpu::aligned::AlignedF32;
use crate::cpu::simd::{Simd, WithSimd};

/// Keys per tile.
pub const KEY_TILE: usize = 64;

// Tile columns are tracked as the bits of a u64.
const _: () = assert!(KEY_TILE == 64);

/// The per-layer score settings (the pieces of `crate::semantics`).
#[derive(Debug, Clone, Copy)]
pub struct ScoreMods {
    /// Causal (decoder) mask; non-causal types see every key.
    pub causal: bool,
    /// Sliding window W: key j allowed iff `j > i - W`.
    pub window: Option<usize>,
    /// Soft cap.
    pub soft_cap: Option<f32>,
    /// Whether rows carry ALiBi slopes.
    pub alibi: bool,
}

/// The query rows one kernel call attends together (every query head of one kv head, for one
/// or more tokens) and the keys they visit.
#[derive(Debug, Clone)]
pub struct QueryRows<'a> {
    /// Position of each row.
    pub pos: &'a [usize],
    /// ALiBi slope of each row (empty without ALiBi).
    pub slope: &'a [f32],
    /// Key positions to visit (outside it every key is masked for every row).
    pub keys: Range<usize>,
}

/// Tiles whose terms a row's f32 running sums (`l` and each element of `acc`) take before
/// [`RowStates::fold`] moves them into the f64 totals: it bounds how many terms any f32 sum
/// holds, and so its rounding error, whatever the number of keys (docs/semantics.md,
/// "Accuracy at any length"): 2 keeps the worst case of a 128-term f32 sum under 1e-5.
pub const FOLD_TILES: usize = 2;

/// Online-softmax state of a group's rows: running max, running sum, unnormalized output.
///
/// The tile loop keeps `l` and `acc` in f32 (the kernels' accumulators) for at most
/// [`FOLD_TILES`] tiles, then folds them into f64 totals that carry their own max and are
/// merged log-sum-exp style; `m` and the f32 path are as without the totals. After
/// [`attend`], `l` and `acc` hold the whole sums again (rounded once to f32).
#[derive(Debug, Clone)]
pub struct RowStates {
    /// Running maximum score per row.
    pub m: Vec<f32>,
    /// Running sum of `exp(score - m)` per row (since the last fold, during [`attend`]).
    pub l: Vec<f32>,
    /// Rows × D weighted sums of values (since the last fold, during [`attend`]).
    pub acc: AlignedF32,
    /// The max the f64 totals are relative to, per row (at most `m`).
    total_m: Vec<f32>,
    /// f64 total of the folded `l`, per row.
    total_l: Vec<f64>,
    /// Rows × D f64 totals of the folded `acc`.
    total_acc: Vec<f64>,
}

impl RowStates {
    /// Fresh states for `rows` rows of `d` elements.
    pub fn new(rows: usize, d: usize) -> Self {
        RowStates {
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: AlignedF32::zeros(rows * d),
            total_m: vec![f32::NEG_INFINITY; rows],
            total_l: vec![0.0; rows],
            total_acc: vec![0.0; rows * d],
        }
    }

    /// Adds the f32 sums to the f64 totals and restarts them at 0 (keeping `m`): the totals
    /// are rescaled to the current max by `exp(total_m - m)` in f64, as the f32 path rescales
    /// on a new max, and a NaN or an infinity in the f32 sums reaches the totals as IEEE
    /// arithmetic carries it (a rescale by 1 where the max did not change, so that
    /// `-inf - -inf` never makes a NaN).
    #[inline(always)]
    pub fn fold(&mut self) {
        let d = self.acc.len() / self.m.len().max(1);
        for r in 0..self.m.len() {
            let (m, total_m) = (self.m[r], self.total_m[r]);
            let acc = &mut self.acc[r * d..(r + 1) * d];
            let total = &mut self.total_acc[r * d..(r + 1) * d];
            if total_m == m {
                for (t, a) in total.iter_mut().zip(acc.iter_mut()) {
                    *t += *a as f64;
                    *a = 0.0;
                }
                self.total_l[r] += self.l[r] as f64;
            } else {
                // total_m < m (the max only grows): w is in [0, 1).
                let w = (total_m as f64 - m as f64).exp();
                for (t, a) in total.iter_mut().zip(acc.iter_mut()) {
                    *t = *t * w + *a as f64;
                    *a = 0.0;
                }
                self.total_l[r] = self.total_l[r] * w + self.l[r] as f64;
                self.total_m[r] = m;
            }
            self.l[r] = 0.0;
        }
    }

    /// Folds what is left and puts the totals back into `l` and `acc`, rounded to f32.
    #[inline(always)]
    fn settle(&mut self) {
        self.fold();
        for (l, &t) in self.l.iter_mut().zip(&self.total_l) {
            *l = t as f32;
        }
        for (a, &t) in self.acc.iter_mut().zip(&self.total_acc) {
            *a = t as f32;
        }
    }
}

/// Where a tile's scores and values come from.
pub trait TileSource {
    /// Tiles start at `origin + k * step` (packed layouts need aligned column groups).
    fn alignment(&self) -> (usize, usize);
    /// What the scores and the values of one tile share (where its rows are, say).
    type Tile<'t>
    where
        Self: 't;
    /// The tile of `keys`, which [`TileSource::scores`] and then [`TileSource::accumulate`]
    /// visit.
    fn tile(&self, keys: Range<usize>) -> Self::Tile<'_>;
    /// Scores of every row for the tile's keys into `scores` (`[rows][KEY_TILE]`, scale
    /// applied). `cols` holds the tile columns each row attends: a source may leave the
    /// scores of columns that a row does not attend unwritten (the masks overwrite them).
    fn scores<S: Simd>(
        &self,
        s: S,
        tile: &Self::Tile<'_>,
        cols: &[Range<usize>],
        scores: &mut [f32],
    );
    /// `acc[r] += Σ_j p[r][j] · v_j` over the tile's keys, skipping the columns `skip` marks;
    /// `p[r][j]` is 0 where row r does not attend column j (outside `cols[r]`), so a source
    /// may skip such columns too.
    fn accumulate<S: Simd>(
        &self,
        s: S,
        tile: &Self::Tile<'_>,
        cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    );
    /// The value row of tile column `t` widened to f32 (the fp8 scale not applied), in the
    /// order and at the scale of this source's accumulators (before [`TileSource::finish`]).
    fn value_row(&self, tile: &Self::Tile<'_>, t: usize, out: &mut [f32]);
    /// The columns among `cols` (bit t: tile column t) whose value row holds a NaN or an
    /// infinity; `row` is scratch of `d` elements.
    #[inline(always)]
    fn nonfinite_values(&self, tile: &Self::Tile<'_>, cols: u64, row: &mut [f32]) -> u64 {
        columns(cols)
            .filter(|&t| {
                self.value_row(tile, t, row);
                row.iter().any(|x| !x.is_finite())
            })
            .fold(0, |m, t| m | 1 << t)
    }
    /// Called once after the last tile (e.g. to undo a permuted accumulator layout or a
    /// scaled widening).
    #[inline(always)]
    fn finish(&self, state: &mut RowStates) {
        let _ = state;
    }
}

/// [`attend`] as an operation for [`Simd::vectorize`].
pub struct Attend<'a, 'b, Src> {
    /// Scores and values, one source per kv head.
    pub sources: &'a [Src],
    /// The query rows of each kv head.
    pub groups: &'a [QueryRows<'b>],
    /// Score settings.
    pub mods: &'a ScoreMods,
    /// The rows' softmax state, per kv head.
    pub states: &'a mut [RowStates],
}

impl<Src: TileSource> WithSimd for Attend<'_, '_, Src> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        attend(s, self.sources, self.groups, self.mods, self.states)
    }
}

/// Attends the rows of one or more kv heads over their keys, tile by tile, accumulating into
/// their states. The heads share the key range and the row positions (they differ in values and ALiBi slopes); each tile is visited by every head in
/// turn, so that a decode reads whole cache blocks (every head of a block) close together
/// instead of one head's 4 KiB slice of each block at a time, which keeps memory streaming
/// near its sequential rate. Requires `head_size % S::LANES == 0` (the dispatcher picks the
/// ISA accordingly).
#[inline(always)]
pub fn attend<S: Simd, Src: TileSource>(
    s: S,
    sources: &[Src],
    groups: &[QueryRows<'_>],
    mods: &ScoreMods,
    states: &mut [RowStates],
) {
    let (Some(first), Some(first_state)) = (groups.first(), states.first()) else {
        return;
    };
    debug_assert!(sources.len() == groups.len() && groups.len() == states.len());
    let d = first_state.acc.len() / first_state.m.len().max(1);
    let rows = first.pos.len();
    // Sized by the states, which may pad the rows (AMX's whole 16-row tiles).
    let mut scores = AlignedF32::zeros(first_state.m.len() * KEY_TILE);
    let mut row_cols = vec![0..0; rows];
    let mut value_row = vec![0.0f32; d];
    let (origin, step) = sources[0].alignment();
    let plain = mods.soft_cap.is_none() && !mods.alibi;
    let first_row = first.pos.iter().copied().min().unwrap_or(0);
    let last_row = first.pos.iter().copied().max().unwrap_or(0);
    let keys = first.keys.clone();
    let mut start = keys.start - (keys.start - origin) % step;
    let mut tiles = 0;
    while start < keys.end {
        if tiles == FOLD_TILES {
            states.iter_mut().for_each(RowStates::fold);
            tiles = 0;
        }
        tiles += 1;
        let end = (start + KEY_TILE).min(keys.end);
        let n = end - start;
        // A full tile that every row sees whole, with no score modifier, needs no masking.
        let unmasked = plain
            && n == KEY_TILE
            && start >= keys.start
            && (!mods.causal
                || (end <= first_row + 1
                    && mods
                        .window
                        .is_none_or(|w| last_row.saturating_sub(start) < w)));
        // The columns each row attends, and those some row does not (a key masked for a row
        // has probability 0 there, but 0 · NaN is NaN: such a key's value must not enter that
        // row's P·V when it is not finite).
        let mut seen_by_all = column_bits(0..n);
        for (cols, &pos) in row_cols.iter_mut().zip(first.pos) {
            *cols = attended_columns(start, end, keys.start, pos, mods);
            seen_by_all &= column_bits(cols.clone());
        }
        let masked = column_bits(0..n) & !seen_by_all;
        for ((source, group), state) in sources.iter().zip(groups).zip(states.iter_mut()) {
            let tile = source.tile(start..end);
            let special = if masked == 0 {
                0
            } else {
                source.nonfinite_values(&tile, masked, &mut value_row)
            };
            source.scores(s, &tile, &row_cols, &mut scores);
            for (r, cols) in row_cols.iter().enumerate() {
                let row = &mut scores[r * KEY_TILE..(r + 1) * KEY_TILE];
                if !unmasked {
                    let slope = group.slope.get(r).copied().unwrap_or(0.0);
                    apply_mods(s, row, start, end, cols.clone(), group.pos[r], slope, mods);
                }
                softmax_step(s, row, r, d, state);
            }
            if special == 0 {
                source.accumulate(
                    s,
                    &tile,
                    &row_cols,
                    &[false; KEY_TILE][..n],
                    &mut scores,
                    state,
                );
            } else {
                // Non-finite values that some row must not see: each such key enters the rows
                // that attend it here, and the source's P·V skips it.
                let mut skip = [false; KEY_TILE];
                for t in columns(special) {
                    skip[t] = true;
                    source.value_row(&tile, t, &mut value_row);
                    for (r, cols) in row_cols.iter().enumerate() {
                        if cols.contains(&t) {
                            let p = scores[r * KEY_TILE + t];
                            let acc = &mut state.acc[r * d..(r + 1) * d];
                            for (a, &v) in acc.iter_mut().zip(&value_row) {
                                *a += p * v;
                            }
                        }
                    }
                }
                source.accumulate(s, &tile, &row_cols, &skip[..n], &mut scores, state);
            }
        }
        start = end;
    }
    for (source, state) in sources.iter().zip(states.iter_mut()) {
        state.settle();
        source.finish(state);
    }
}

/// The tile-local columns of tile `start..end` that a row at position `pos` attends: the
/// unit's keys from `first` up to the causal end, inside the window.
#[inline(always)]
fn attended_columns(
    start: usize,
    end: usize,
    first: usize,
    pos: usize,
    mods: &ScoreMods,
) -> Range<usize> {
    let (mut lo, mut hi) = (first.max(start), end);
    if mods.causal {
        hi = hi.min(pos + 1);
        if let Some(w) = mods.window {
            lo = lo.max((pos + 1).saturating_sub(w));
        }
    }
    let lo = lo.min(end);
    (lo - start)..(hi.clamp(lo, end) - start)
}

/// The bits of tile columns `cols` (at most [`KEY_TILE`] = 64 columns).
#[inline(always)]
fn column_bits(cols: Range<usize>) -> u64 {
    if cols.is_empty() {
        0
    } else {
        (u64::MAX >> (64 - cols.len())) << cols.start
    }
}

/// The columns whose bits are set, in order.
#[inline(always)]
fn columns(mut bits: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let t = bits.trailing_zeros() as usize;
        (bits != 0).then(|| {
            bits &= bits - 1;
            t
        })
    })
}
