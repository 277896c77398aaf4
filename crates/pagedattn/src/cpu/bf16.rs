//! Prefill with AVX512-BF16 (`vdpbf16ps`): bf16 queries against keys and values that are
//! exactly bf16 (a bf16 cache, or fp8 codes, which widen to bf16 without rounding; their
//! scales are applied to the scores and the output instead). Twice the multiply-adds per
//! instruction of the f32 path; the probabilities are rounded to bf16 for P·V, as GPU flash
//! attention does.
//!
//! Layouts, packed once per (sequence, kv head): keys `[group of 16][d/2][16]` as u32 pairs
//! of consecutive dimensions, so one `vdpbf16ps` multiplies a broadcast query pair by 16
//! keys; values `[pair of keys][d]` as u32 pairs of consecutive keys, so one `vdpbf16ps`
//! multiplies a broadcast probability pair by 16 dimensions of two value rows.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::error::Result;
use crate::tensor::zeroed_vec;

use super::kernel::{
    attend, for_row_blocks, score_group, KvRows, PrefetchStream, QueryRows, RowStates, ScoreMods,
    TileRows, TileSource, ValuesAhead, KEY_TILE, PACK_PREFETCH_KEYS,
};
use super::simd::x86::Avx512;
use super::simd::{Load, Simd};
use super::widen::Bf16Elem;

/// Keys per column group (the lanes of a 512-bit vector of f32).
const LANES: usize = 16;

/// Keys and values of one (sequence, kv head) packed as bf16 pairs.
#[derive(Debug, Clone)]
pub struct PackedBf16 {
    origin: usize,
    d: usize,
    kt: Vec<u32>,
    v: Vec<u32>,
}

/// Packs positions `keys`: 4 × keys × D bytes,
/// sized by the caller's metadata, so [`Error::OutOfMemory`](crate::Error::OutOfMemory)
/// where the host cannot allocate them.
pub fn pack_bf16<E: Load>(kv: &KvRows<'_, E>, keys: Range<usize>) -> Result<PackedBf16> {
    debug_assert!(E::BF16_EXACT);
    let d = kv.head_size;
    let half = d / 2;
    let mut kt = zeroed_vec::<u32>(keys.len().div_ceil(LANES).saturating_mul(half * LANES))?;
    let mut v = zeroed_vec::<u32>(keys.len().div_ceil(2).saturating_mul(d))?;
    let mut pairs = vec![0u32; half];
    // SAFETY: only called where AVX512-BF16 was detected (the token only prefetches here).
    let s = unsafe { Avx512::assume_bf16() };
    for (t, j) in keys.clone().enumerate() {
        if j + PACK_PREFETCH_KEYS < keys.end {
            kv.prefetch(s, j + PACK_PREFETCH_KEYS);
        }
        let row = kv.row(j);
        let (k, val) = (&kv.key[row..][..d], &kv.value[row..][..d]);
        // The key's pairs first (a loop the compiler vectorizes), then scattered to its column.
        for (x, pair) in pairs.iter_mut().zip(k.chunks_exact(2)) {
            *x = pair[0].bf16_bits() as u32 | (pair[1].bf16_bits() as u32) << 16;
        }
        let column = &mut kt[(t / LANES) * half * LANES + t % LANES..];
        for (p, &x) in pairs.iter().enumerate() {
            column[p * LANES] = x;
        }
        let (pair, shift) = (t / 2, 16 * (t % 2));
        for (x, &e) in v[pair * d..][..d].iter_mut().zip(val) {
            *x |= (e.bf16_bits() as u32) << shift;
        }
    }
    Ok(PackedBf16 {
        origin: keys.start,
        d,
        kt,
        v,
    })
}

impl PackedBf16 {
    /// The head size.
    pub(crate) fn head_size(&self) -> usize {
        self.d
    }

    /// The first packed position.
    pub(crate) fn origin(&self) -> usize {
        self.origin
    }

    /// `n` column groups of 16 keys from group `first` (`[group][d/2][16]` pairs).
    pub(crate) fn key_groups(&self, first: usize, n: usize) -> &[u32] {
        let group = self.d / 2 * LANES;
        &self.kt[first * group..(first + n) * group]
    }

    /// The value row of position `pos` (packed) in f32.
    pub(crate) fn value_row(&self, pos: usize, out: &mut [f32]) {
        let column = pos - self.origin;
        let shift = 16 * (column % 2);
        for (o, &x) in out
            .iter_mut()
            .zip(&self.v[(column / 2) * self.d..][..self.d])
        {
            *o = f32::from_bits((x >> shift) << 16);
        }
    }

    /// The packed value pairs of tile `keys`, `pairs` key pairs of them from the tile's start
    /// (at least the tile's; a kernel that reads whole chunks asks for more), ready for a P·V
    /// whose probabilities are 0 outside the tile's attended columns. The columns `0 * v` must
    /// not see are zeroed in a copy in `scratch`: the tile's `skip` ones, and past the tile's end those whose value is not
    /// finite (`0 * NaN` would reach rows that mask them) or that lie past the packed keys.
    pub(crate) fn tile_values<'s>(
        &'s self,
        keys: &Range<usize>,
        skip: &[bool],
        pairs: usize,
        scratch: &'s mut Vec<u32>,
    ) -> &'s [u32] {
        let d = self.d;
        let first_pair = (keys.start - self.origin) / 2;
        let have = (self.v.len() / d).saturating_sub(first_pair).min(pairs);
        let packed = &self.v[first_pair * d..(first_pair + have) * d];
        let n = keys.len();
        let value_at =
            |t: usize| (packed[(t / 2) * d..][..d].iter()).map(move |&x| x >> (16 * (t % 2)));
        let extra =
            (n..2 * pairs).filter(|&t| t >= 2 * have || value_at(t).any(|x| x & 0x7f80 == 0x7f80));
        let mut zero = skip
            .iter()
            .enumerate()
            .filter(|(_, &a)| a)
            .map(|(t, _)| t)
            .chain(extra)
            .peekable();
        if have == pairs && zero.peek().is_none() {
            return packed;
        }
        scratch.clear();
        scratch.extend_from_slice(packed);
        scratch.resize(pairs * d, 0);
        for t in zero.filter(|&t| t < 2 * have) {
            let keep = !(0xffffu32 << (16 * (t % 2)));
            for x in &mut scratch[(t / 2) * d..][..d] {
                *x &= keep;
            }
        }
        scratch
    }
}

/// A query tile (bf16 pairs) against packed bf16 keys and values.
#[derive(Debug, Clone, Copy)]
pub struct PackedBf16Source<'a> {
    /// The packed keys and values.
    pub packed: &'a PackedBf16,
    /// Rows × d/2 query pairs, unscaled.
    pub q: &'a [u32],
    /// Score scale: softmax scale × fp8 k_scale.
    pub scale: f32,
}

/// Reinterprets a vector of 16 u32 bf16 pairs as the `__m512bh` that `vdpbf16ps` takes
/// (the same bits: no conversion).
#[inline(always)]
fn as_bf16_pairs(x: __m512i) -> __m512bh {
    // SAFETY: same size; bf16 pairs reinterpreted.
    unsafe { std::mem::transmute(x) }
}

impl TileSource for PackedBf16Source<'_> {
    type Tile<'t>
        = Range<usize>
    where
        Self: 't;

    fn alignment(&self) -> (usize, usize) {
        (self.packed.origin, LANES)
    }

    #[inline(always)]
    fn tile(&self, keys: Range<usize>) -> Range<usize> {
        keys
    }

    #[inline(always)]
    fn scores<S: Simd>(
        &self,
        _s: S,
        keys: &Range<usize>,
        _cols: &[Range<usize>],
        scores: &mut [f32],
    ) {
        let p = self.packed;
        let half = p.d / 2;
        let rows = self.q.len() / half;
        let first_group = (keys.start - p.origin) / LANES;
        let groups = keys.len().div_ceil(LANES);
        // The groups of G column groups of 16 keys (two at a time, then any last one).
        let kt = |g: usize, n: usize| &p.kt[(first_group + g) * half * LANES..][..n * half * LANES];
        let mut g = 0;
        while g + 2 <= groups {
            for_row_blocks!(rows, |r0, R| qk_groups_bf16::<R, 2, 1>(
                self.q,
                r0,
                half,
                kt(g, 2),
                g * LANES,
                self.scale,
                scores
            ));
            g += 2;
        }
        if g < groups {
            for_row_blocks!(rows, |r0, R| qk_groups_bf16::<R, 1, 2>(
                self.q,
                r0,
                half,
                kt(g, 1),
                g * LANES,
                self.scale,
                scores
            ));
        }
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        _s: S,
        keys: &Range<usize>,
        _cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        let p = self.packed;
        let rows = state.m.len();
        probs_to_pairs(probs, rows);
        let pairs = keys.len().div_ceil(2);
        let mut scratch = Vec::new();
        let v = p.tile_values(keys, skip, pairs, &mut scratch);
        for_row_blocks!(rows, |r0, R| pv_block_bf16::<R>(
            v,
            pairs,
            p.d,
            probs,
            r0,
            &mut state.acc
        ));
    }

    fn value_row(&self, keys: &Range<usize>, t: usize, out: &mut [f32]) {
        self.packed.value_row(keys.start + t, out)
    }
}

/// Scores of rows `r0..r0+R` against `G` consecutive column groups of 16 keys (columns
/// `c..c + 16G`, `kt` their packed keys), `SPLIT` accumulator chains per row and group taking
/// alternate query pairs. R·G·SPLIT independent `vdpbf16ps` chains keep both FMA pipes busy
/// through the instruction's latency, and each broadcast query pair serves `G` groups: with
/// one group the loads (a broadcast per `vdpbf16ps`) rather than the dot products limited it.
#[inline(always)]
fn qk_groups_bf16<const R: usize, const G: usize, const SPLIT: usize>(
    q: &[u32],
    r0: usize,
    half: usize,
    kt: &[u32],
    c: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let q = &q[r0 * half..(r0 + R) * half];
    // SAFETY: only called inside `attend_bf16`, where AVX512-BF16 is enabled; kt is
    // G × half × 16 with half even (d % 16 == 0 on this path), a multiple of SPLIT (1 or 2).
    unsafe {
        let mut acc = [[[_mm512_setzero_ps(); G]; R]; SPLIT];
        for p0 in (0..half).step_by(SPLIT) {
            for (s, acc) in acc.iter_mut().enumerate() {
                let p = p0 + s;
                let mut k = [as_bf16_pairs(_mm512_setzero_si512()); G];
                for (g, k) in k.iter_mut().enumerate() {
                    *k = as_bf16_pairs(_mm512_loadu_si512(
                        kt.as_ptr().add((g * half + p) * LANES) as *const __m512i
                    ));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let qv =
                        as_bf16_pairs(_mm512_set1_epi32(*q.get_unchecked(r * half + p) as i32));
                    for (a, &kg) in row.iter_mut().zip(&k) {
                        *a = _mm512_dpbf16_ps(*a, qv, kg);
                    }
                }
            }
        }
        let scale = _mm512_set1_ps(scale);
        for r in 0..R {
            for g in 0..G {
                let mut sum = acc[0][r][g];
                for split in &acc[1..] {
                    sum = _mm512_add_ps(sum, split[r][g]);
                }
                _mm512_storeu_ps(
                    scores.as_mut_ptr().add((r0 + r) * KEY_TILE + c + g * LANES),
                    _mm512_mul_ps(sum, scale),
                );
            }
        }
    }
}

/// P·V for rows `r0..r0+R`: `probs` rows start with the tile's bf16 probability pairs. Two
/// 16-dimension chunks at a time (2R independent accumulator chains, and each broadcast
/// probability pair serves both), then the last chunk alone where d % 32 == 16.
#[inline(always)]
fn pv_block_bf16<const R: usize>(
    v: &[u32],
    pairs: usize,
    d: usize,
    probs: &[f32],
    r0: usize,
    acc: &mut [f32],
) {
    let probs = &probs[r0 * KEY_TILE..(r0 + R) * KEY_TILE];
    let acc = &mut acc[r0 * d..(r0 + R) * d];
    let mut c = 0;
    while c + 2 * LANES <= d {
        pv_chunks_bf16::<R, 2>(v, pairs, d, probs, acc, c);
        c += 2 * LANES;
    }
    if c < d {
        pv_chunks_bf16::<R, 1>(v, pairs, d, probs, acc, c);
    }
}

/// [`pv_block_bf16`] for the `W` 16-dimension chunks from dimension `c`.
#[inline(always)]
fn pv_chunks_bf16<const R: usize, const W: usize>(
    v: &[u32],
    pairs: usize,
    d: usize,
    probs: &[f32],
    acc: &mut [f32],
    c: usize,
) {
    // SAFETY: only called inside `attend_bf16`; v is pairs × d, acc is R × d, c + 16W <= d;
    // probs rows hold KEY_TILE / 2 >= pairs pairs.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); W]; R];
        for (r, row) in a.iter_mut().enumerate() {
            for (w, x) in row.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(acc.as_ptr().add(r * d + c + w * LANES));
            }
        }
        for p in 0..pairs {
            let mut vv = [as_bf16_pairs(_mm512_setzero_si512()); W];
            for (w, x) in vv.iter_mut().enumerate() {
                *x = as_bf16_pairs(_mm512_loadu_si512(
                    v.as_ptr().add(p * d + c + w * LANES) as *const __m512i
                ));
            }
            for (r, row) in a.iter_mut().enumerate() {
                let pp = (probs.as_ptr().add(r * KEY_TILE) as *const u32)
                    .add(p)
                    .read();
                let pp = as_bf16_pairs(_mm512_set1_epi32(pp as i32));
                for (x, &vw) in row.iter_mut().zip(&vv) {
                    *x = _mm512_dpbf16_ps(*x, pp, vw);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (w, x) in row.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add(r * d + c + w * LANES), *x);
            }
        }
    }
}

/// Decode with AVX512-BF16: bf16 queries against cache rows read in place (no packing), bf16
/// or fp8 codes widened to bf16 in registers ([`Bf16Elem`]).
/// Scores, where the rows come in blocks of four (GQA groups of 4 or 8, the common ones): each
/// `vdpbf16ps` multiplies 8 dimensions of one key, broadcast to the four 128-bit lanes, by the
/// same dimensions of four query rows (one per lane, [`pack_quads`]), so that four keys' sums
/// need two rounds of in-lane pairing and no cross-lane reduction; other row counts: dot
/// products of query pairs with 32-element key chunks, reduced 16 keys at a time. P·V takes
/// two value rows at a time, interleaved into key pairs with `vpunpck[lh]wd`, which visits the
/// dimensions of each 32-element chunk in a fixed permuted order that [`TileSource::finish`]
/// undoes once at the end.
///
/// `D` is the head size where the dispatcher specializes for it (64, 128, 256: the chunk
/// loops unroll and the queries stay in registers), 0 for any other multiple of 32.
#[derive(Debug, Clone, Copy)]
pub struct RowsBf16Source<'a, C, const D: usize> {
    /// Where the rows are (bf16 bits or fp8 codes).
    pub kv: KvRows<'a, C>,
    /// Rows × d/2 query pairs, unscaled.
    pub q: &'a [u32],
    /// The same queries lane-packed by [`pack_quads`] (empty where the rows do not come in
    /// blocks of four).
    pub quads: &'a [u32],
    /// Score scale.
    pub scale: f32,
    /// Where the prefetches run ahead to.
    pub stream: PrefetchStream,
}

/// Elements per 512-bit chunk of a bf16 row.
const CHUNK: usize = 32;

/// The dimension that accumulator lane `i` of a 32-element chunk holds in the decode P·V
/// order: lane i of the low half holds dimension (i / 4) * 8 + i % 4, lane i of the high half
/// dimension (i / 4) * 8 + 4 + i % 4.
#[inline(always)]
fn permuted_dimension(i: usize) -> usize {
    let (half, i) = (i / 16, i % 16);
    (i / 4) * 8 + 4 * half + i % 4
}

impl<C, const D: usize> RowsBf16Source<'_, C, D> {
    /// The head size, a constant where specialized.
    #[inline(always)]
    fn head_size(&self) -> usize {
        if D > 0 {
            D
        } else {
            self.kv.head_size
        }
    }
}

impl<C: Bf16Elem, const D: usize> TileSource for RowsBf16Source<'_, C, D> {
    type Tile<'t>
        = TileRows<'t, C>
    where
        Self: 't;

    fn alignment(&self) -> (usize, usize) {
        (0, 1)
    }

    #[inline(always)]
    fn tile(&self, keys: Range<usize>) -> TileRows<'_, C> {
        TileRows::new(
            &self.kv,
            keys,
            self.stream,
            self.head_size(),
            ValuesAhead::FromValues,
        )
    }

    #[inline(always)]
    fn scores<S: Simd>(
        &self,
        _s: S,
        tile: &TileRows<'_, C>,
        _cols: &[Range<usize>],
        scores: &mut [f32],
    ) {
        // SAFETY: this source only runs inside `attend_bf16` (see `Bf16Source`).
        let s = unsafe { Avx512::assume_bf16() };
        // SAFETY: as above (and AVX512-VBMI where C needs it, see `attend_bf16`).
        let table = unsafe { C::table() };
        let half = self.head_size() / 2;
        let rows = self.q.len() / half;
        if !self.quads.is_empty() {
            let d = self.head_size();
            for (b, quad) in self.quads.chunks_exact(2 * d).enumerate() {
                for t0 in (0..tile.len).step_by(4) {
                    quad_scores(
                        s,
                        table,
                        tile,
                        t0,
                        quad,
                        d,
                        b == 0,
                        self.scale,
                        &mut scores[4 * b * KEY_TILE..],
                    );
                }
            }
            return;
        }
        for t0 in (0..tile.len).step_by(LANES) {
            for_row_blocks!(rows, |r0, R| score_group(
                s,
                tile,
                t0,
                r0,
                self.scale,
                scores,
                |k0, k1| {
                    let q = &self.q[r0 * half..(r0 + R) * half];
                    [
                        qk_partial_bf16::<C, R>(table, q, k0),
                        qk_partial_bf16::<C, R>(table, q, k1),
                    ]
                }
            ));
        }
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        s: S,
        tile: &TileRows<'_, C>,
        _cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        let rows = state.m.len();
        probs_to_pairs(probs, rows);
        // Column t's load mask: all ones for a key to read; skipped columns, and
        // the odd tail column of the last pair, load as zeros without touching memory. (An
        // array, not a bitmask: the same mask folded into a u128 came out with a bit missing
        // when compiled into this AVX-512 kernel; see docs/design/cpu.md.)
        let mut masks = [0u32; KEY_TILE];
        for (m, &a) in masks.iter_mut().zip(skip) {
            *m = if a { 0 } else { u32::MAX };
        }
        let pairs = tile.len.div_ceil(2);
        let whole = masks[..2 * pairs].iter().all(|&m| m != 0);
        let columns = ValueColumns {
            // SAFETY: only run inside `attend_bf16` (see `scores`).
            table: unsafe { C::table() },
            tile,
            masks: &masks[..2 * pairs],
            whole,
        };
        let d = self.head_size();
        for_row_blocks!(rows, |r0, R| pv_rows::<S, C, R>(
            s,
            columns,
            d,
            probs,
            r0,
            &mut state.acc
        ));
    }

    fn value_row(&self, tile: &TileRows<'_, C>, t: usize, out: &mut [f32]) {
        let row = &self.kv.value[tile.rows()[t]..][..self.head_size()];
        for (chunk, values) in out.chunks_exact_mut(CHUNK).zip(row.chunks_exact(CHUNK)) {
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = values[permuted_dimension(i)].to_f32();
            }
        }
    }

    #[inline(always)]
    fn finish(&self, state: &mut RowStates) {
        // Undo the P·V order.
        for chunk in state.acc.chunks_exact_mut(CHUNK) {
            let permuted: [f32; CHUNK] = chunk.try_into().expect("chunk of 32");
            for (i, &x) in permuted.iter().enumerate() {
                chunk[permuted_dimension(i)] = x;
            }
        }
    }
}

/// Rounds each row's tile of probabilities to bf16 pairs of consecutive keys, in place at the
/// start of the row (u32 pair `p` holds keys 2p and 2p + 1).
#[inline(always)]
pub(crate) fn probs_to_pairs(probs: &mut [f32], rows: usize) {
    for r in 0..rows {
        let row = &mut probs[r * KEY_TILE..(r + 1) * KEY_TILE];
        for c in (0..KEY_TILE).step_by(2 * LANES) {
            // SAFETY: only called under AVX512-BF16; both halves are read before the 16 u32
            // are written over f32 c/2..c/2+16, which lie at or before the lanes just read.
            unsafe {
                let lo = _mm512_loadu_ps(row.as_ptr().add(c));
                let hi = _mm512_loadu_ps(row.as_ptr().add(c + LANES));
                let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(row.as_mut_ptr().add(c / 2) as *mut __m512i, pairs);
            }
        }
    }
}

/// Queries lane-packed for the four-row decode scores: for each block of four rows and each
/// group of 8 dimensions, 16 pairs whose 128-bit lane `l` holds row `l`'s 4 pairs of those
/// dimensions. Empty unless the rows (`q`, rows × d/2 pairs) come in blocks of four.
pub fn pack_quads(q: &[u32], d: usize) -> Vec<u32> {
    let half = d / 2;
    let rows = q.len() / half;
    if !rows.is_multiple_of(4) {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(q.len());
    for block in q.chunks_exact(4 * half) {
        for c in (0..half).step_by(4) {
            for row in block.chunks_exact(half) {
                out.extend_from_slice(&row[c..c + 4]);
            }
        }
    }
    out
}

/// Scores of four query rows (`quad`: one block of [`pack_quads`]) against tile columns
/// `t0..t0+4`, stored times `scale` into rows 0..4 of `scores`. Columns past the tile repeat
/// its last key (the masks overwrite them); `prefetch` issues the tile's prefetches.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn quad_scores<C: Bf16Elem>(
    s: Avx512,
    table: C::Table,
    tile: &TileRows<'_, C>,
    t0: usize,
    quad: &[u32],
    d: usize,
    prefetch: bool,
    scale: f32,
    scores: &mut [f32],
) {
    let last = tile.len - 1;
    // (A loop, not a closure called four times: such a closure is not inlined.)
    let mut keys: [&[C]; 4] = [&[]; 4];
    for (i, k) in keys.iter_mut().enumerate() {
        *k = tile.key(s, (t0 + i).min(last), prefetch && t0 + i <= last);
    }
    // SAFETY: only called under AVX512-BF16 (and VBMI where C needs it); key rows hold d
    // elements and `quad` d/8 vectors of 16 pairs (d % 32 == 0); t0 + 4 <= KEY_TILE and
    // `scores` holds four rows.
    unsafe {
        // Even and odd groups of 8 dimensions in separate accumulators: 8 independent chains.
        let mut acc = [[_mm512_setzero_ps(); 4]; 2];
        let mut c = 0;
        while c + 2 * CHUNK <= d {
            quad_chunk::<C, 2>(table, &keys, quad, c, &mut acc);
            c += 2 * CHUNK;
        }
        if c < d {
            quad_chunk::<C, 1>(table, &keys, quad, c, &mut acc);
        }
        let [even, odd] = acc;
        let sum = |i: usize| _mm512_add_ps(even[i], odd[i]);
        // Lane l of 128-bit lane r: row r's score of key t0 + l.
        let v = s.pair_within(s.pair_within(sum(0), sum(1)), s.pair_within(sum(2), sum(3)));
        let v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        let out = scores.as_mut_ptr().add(t0);
        let store = |r: usize, x: __m128| _mm_storeu_ps(out.add(r * KEY_TILE), x);
        store(0, _mm512_extractf32x4_ps::<0>(v));
        store(1, _mm512_extractf32x4_ps::<1>(v));
        store(2, _mm512_extractf32x4_ps::<2>(v));
        store(3, _mm512_extractf32x4_ps::<3>(v));
    }
}

/// [`quad_scores`] over dimensions `c..c + 32 * W` of the four keys: each key's chunk as bf16
/// in memory (the row itself, or widened into a buffer), read 8 dimensions at a time
/// broadcast to the four lanes.
#[inline(always)]
unsafe fn quad_chunk<C: Bf16Elem, const W: usize>(
    table: C::Table,
    keys: &[&[C]; 4],
    quad: &[u32],
    c: usize,
    acc: &mut [[__m512; 4]; 2],
) {
    let mut bufs = [[MaybeUninit::<u16>::uninit(); 2 * CHUNK]; 4];
    let mut rows = [std::ptr::null::<u16>(); 4];
    for ((row, key), buf) in rows.iter_mut().zip(keys).zip(&mut bufs) {
        *row = C::bf16_chunk::<W>(table, key.as_ptr().add(c), buf);
    }
    let lanes = |k: *const u16, g: usize| {
        as_bf16_pairs(_mm512_broadcast_i32x4(_mm_loadu_si128(
            k.add(8 * g) as *const __m128i
        )))
    };
    for g in (0..W * CHUNK / 8).step_by(2) {
        let q = |g: usize| {
            as_bf16_pairs(_mm512_loadu_si512(
                quad.as_ptr().add(2 * c + 16 * g) as *const __m512i
            ))
        };
        let (q0, q1) = (q(g), q(g + 1));
        for (i, &k) in rows.iter().enumerate() {
            acc[0][i] = _mm512_dpbf16_ps(acc[0][i], q0, lanes(k, g));
            acc[1][i] = _mm512_dpbf16_ps(acc[1][i], q1, lanes(k, g + 1));
        }
    }
}

/// Partial dot products of `R` query rows (`q`, R × d/2 pairs) with one key row.
#[inline(always)]
fn qk_partial_bf16<C: Bf16Elem, const R: usize>(
    table: C::Table,
    q: &[u32],
    k: &[C],
) -> [__m512; R] {
    let half = k.len() / 2;
    // SAFETY: only called under AVX512-BF16; rows hold d = 2 * half elements, d % 32 == 0.
    unsafe {
        // Even and odd chunks in separate accumulators: half the dependency chain per key.
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for (i, c) in (0..k.len()).step_by(CHUNK).enumerate() {
            let [kv] = C::widen::<1>(table, k.as_ptr().add(c), None);
            let kv = as_bf16_pairs(kv);
            for (r, a) in acc[i % 2].iter_mut().enumerate() {
                let qv = as_bf16_pairs(_mm512_loadu_si512(
                    q.as_ptr().add(r * half + c / 2) as *const __m512i
                ));
                *a = _mm512_dpbf16_ps(*a, qv, kv);
            }
        }
        let [mut sum, odd] = acc;
        for (x, y) in sum.iter_mut().zip(odd) {
            *x = _mm512_add_ps(*x, y);
        }
        sum
    }
}

/// The value rows of a tile's columns (pairs of them), as the decode's P·V reads them.
#[derive(Clone, Copy)]
struct ValueColumns<'a, 't, C: Bf16Elem> {
    /// How the rows widen to bf16.
    table: C::Table,
    /// Where the columns' rows are (bf16 bits or fp8 codes), and the rows to ask for ahead.
    tile: &'a TileRows<'t, C>,
    /// Column t's load mask: zero where it is not a key (loads zeros, touches no memory), and
    /// for the odd tail column of the last pair, which is past the tile.
    masks: &'a [u32],
    /// Every column is a key: plain loads.
    whole: bool,
}

impl<C: Bf16Elem> ValueColumns<'_, '_, C> {
    /// Elements `c..c + 32 * W` of column `t`'s row, as bf16 (a function, not a closure:
    /// closures do not take the kernel's target features and may stay calls).
    ///
    /// # Safety
    /// Under the kernel's target features; `t` a column, `c + 32 * W <= d`.
    #[inline(always)]
    unsafe fn chunks<const W: usize>(&self, t: usize, c: usize) -> [__m512i; W] {
        // The odd tail column past the tile has no row: any address, its mask reads nothing.
        let row = self.tile.rows().get(t).copied().unwrap_or(0);
        let p = self.tile.values().as_ptr().wrapping_add(row + c);
        let mask = if self.whole {
            None
        } else {
            Some(self.masks[t])
        };
        C::widen::<W>(self.table, p, mask)
    }
}

/// P·V for rows `r0..r0+R` over value rows taken two keys at a time (permuted order). Two
/// 32-element chunks at a time where the accumulators fit in registers (R <= 4), so that each
/// broadcast probability pair serves both. The first row block asks for the value rows ahead
/// ([`TileRows::prefetch_value_ahead`]), each chunk its part.
#[inline(always)]
fn pv_rows<S: Simd, C: Bf16Elem, const R: usize>(
    s: S,
    columns: ValueColumns<'_, '_, C>,
    d: usize,
    probs: &[f32],
    r0: usize,
    acc: &mut [f32],
) {
    let probs = &probs[r0 * KEY_TILE..(r0 + R) * KEY_TILE];
    let acc = &mut acc[r0 * d..(r0 + R) * d];
    let mut c = 0;
    if R <= 4 {
        while c + 2 * CHUNK <= d {
            pv_row_chunks::<S, C, R, 2>(s, columns, d, probs, acc, c, r0 == 0);
            c += 2 * CHUNK;
        }
    }
    while c < d {
        pv_row_chunks::<S, C, R, 1>(s, columns, d, probs, acc, c, r0 == 0);
        c += CHUNK;
    }
}

/// [`pv_rows`] for the `W` 32-element chunks from dimension `c`; with `prefetch`, asking for
/// those chunks of the value rows ahead.
#[inline(always)]
fn pv_row_chunks<S: Simd, C: Bf16Elem, const R: usize, const W: usize>(
    s: S,
    columns: ValueColumns<'_, '_, C>,
    d: usize,
    probs: &[f32],
    acc: &mut [f32],
    c: usize,
    prefetch: bool,
) {
    let size = std::mem::size_of::<C>();
    let bytes = c * size..(c + W * CHUNK) * size;
    // SAFETY: only called under AVX512-BF16 (and VBMI where C needs it); rows with a mask are
    // inside the validated value buffer and hold d elements (d % 32 == 0, c + 32W <= d),
    // masked-off loads touch no memory (with `whole`, every column is present); acc is R × d;
    // probability rows start with the pairs.
    unsafe {
        // a[r][w] = [low half, high half] of chunk w of row r.
        let mut a = [[[_mm512_setzero_ps(); 2]; W]; R];
        for (r, row) in a.iter_mut().enumerate() {
            for (w, x) in row.iter_mut().enumerate() {
                let at = acc.as_ptr().add(r * d + c + w * CHUNK);
                *x = [_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(LANES))];
            }
        }
        for p in 0..columns.masks.len() / 2 {
            if prefetch {
                columns.tile.prefetch_value_ahead(s, 2 * p, bytes.clone());
                columns
                    .tile
                    .prefetch_value_ahead(s, 2 * p + 1, bytes.clone());
            }
            let (va, vb) = (
                columns.chunks::<W>(2 * p, c),
                columns.chunks::<W>(2 * p + 1, c),
            );
            let mut v = [[as_bf16_pairs(_mm512_setzero_si512()); 2]; W];
            for ((x, &a), &b) in v.iter_mut().zip(&va).zip(&vb) {
                *x = [
                    as_bf16_pairs(_mm512_unpacklo_epi16(a, b)),
                    as_bf16_pairs(_mm512_unpackhi_epi16(a, b)),
                ];
            }
            for (r, row) in a.iter_mut().enumerate() {
                let pp = (probs.as_ptr().add(r * KEY_TILE) as *const u32)
                    .add(p)
                    .read();
                let pp = as_bf16_pairs(_mm512_set1_epi32(pp as i32));
                for (x, vw) in row.iter_mut().zip(&v) {
                    x[0] = _mm512_dpbf16_ps(x[0], pp, vw[0]);
                    x[1] = _mm512_dpbf16_ps(x[1], pp, vw[1]);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (w, x) in row.iter().enumerate() {
                let at = acc.as_mut_ptr().add(r * d + c + w * CHUNK);
                _mm512_storeu_ps(at, x[0]);
                _mm512_storeu_ps(at.add(LANES), x[1]);
            }
        }
    }
}

/// The tile sources whose kernels use AVX512-BF16 instructions: only [`attend_bf16`] runs them.
pub trait Bf16Source: TileSource {
    /// Whether the kernels also use AVX512-VBMI (fp8 widening).
    const NEEDS_VBMI: bool = false;
    /// Whether the kernels use AMX tiles (configured around the call).
    const AMX: bool = false;
}

impl Bf16Source for PackedBf16Source<'_> {}
impl<C: Bf16Elem, const D: usize> Bf16Source for RowsBf16Source<'_, C, D> {
    const NEEDS_VBMI: bool = C::NEEDS_VBMI;
}

/// [`attend`] with AVX512-BF16: the rows of one or more kv heads, one source each.
///
/// # Panics
/// If this CPU lacks AVX512-BF16, or AVX512-VBMI where the sources need it (the dispatcher
/// only calls it where they were detected).
pub fn attend_bf16<Src: Bf16Source>(
    sources: &[Src],
    groups: &[QueryRows<'_>],
    mods: &ScoreMods,
    states: &mut [RowStates],
) {
    let s = Avx512::new()
        .filter(|a| a.has_bf16())
        .expect("AVX512-BF16 was detected by the dispatcher");
    if Src::NEEDS_VBMI {
        assert!(
            super::widen::has_vbmi(),
            "AVX512-VBMI was detected by the dispatcher"
        );
        // SAFETY: the features were just checked.
        unsafe { attend_with_bf16_vbmi(s, sources, groups, mods, states) }
    } else if Src::AMX {
        // SAFETY: as below; `with_tiles` checks AMX and configures the tiles.
        super::amx::with_tiles(|| unsafe { attend_with_bf16(s, sources, groups, mods, states) })
    } else {
        // SAFETY: the features were just checked.
        unsafe { attend_with_bf16(s, sources, groups, mods, states) }
    }
}

/// Defines `$name`: [`attend`] compiled for the target features `$features`.
macro_rules! attend_with {
    ($name:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<Src: Bf16Source>(
            s: Avx512,
            sources: &[Src],
            groups: &[QueryRows<'_>],
            mods: &ScoreMods,
            states: &mut [RowStates],
        ) {
            attend(s, sources, groups, mods, states)
        }
    };
}

attend_with!(
    attend_with_bf16,
    "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c"
);
attend_with!(
    attend_with_bf16_vbmi,
    "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,fma,f16c"
);
