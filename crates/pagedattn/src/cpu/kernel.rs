//! The flash-attention kernel of the CPU backend, generic over the instruction set ([`Simd`])
//! and over the element type the keys and values are stored in ([`Load`]).
//!
//! One call attends a group of query rows — every query head that shares one kv head, for one
//! or more tokens of one sequence — over a range of key positions, tile by tile, with an
//! online softmax: each K/V tile is read once for all the rows. Decode-sized groups compute
//! each score as a dot product straight from the cache row; larger groups first transpose the
//! tile into a packed `[d][key]` layout so that a row block × key vector micro-kernel needs no
//! horizontal sums. The score pieces (soft cap, ALiBi, causal and window masks) mirror
//! `crate::semantics`, applied to a vector of keys at a time.

use std::ops::Range;

use super::simd::{Load, Simd, WithSimd};

/// Keys per tile.
pub const KEY_TILE: usize = 64;

/// Query rows per micro-kernel block.
const ROW_BLOCK: usize = 8;

/// Groups smaller than this compute scores from cache rows directly (decode); larger ones pack.
const PACK_MIN_ROWS: usize = 8;

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

/// Where the keys and values of one (sequence, kv head) are, as element offsets.
#[derive(Debug, Clone, Copy)]
pub enum RowLayout<'a> {
    /// A paged cache in the `[NB, Hkv, B, D]` layout.
    Paged {
        /// The sequence's block table.
        table: &'a [i32],
        /// B.
        block_size: usize,
        /// Elements per block (Hkv * B * D).
        block_stride: usize,
        /// Offset of this kv head inside a block (head * B * D).
        head_offset: usize,
    },
    /// Input tensors `[Tk, Hkv, D]`.
    Dense {
        /// Offset of key position 0's row.
        first_row: usize,
        /// Elements between consecutive tokens (Hkv * D).
        token_stride: usize,
    },
}

/// The keys and values a group of rows attends over.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a, E> {
    /// Key buffer (cache or input).
    pub key: &'a [E],
    /// Value buffer, same layout.
    pub value: &'a [E],
    /// How positions map to rows.
    pub layout: RowLayout<'a>,
    /// Head size D.
    pub head_size: usize,
}

impl<E> KvRows<'_, E> {
    /// Element offset of position `j`'s row.
    #[inline(always)]
    fn row(&self, j: usize) -> usize {
        match self.layout {
            RowLayout::Paged {
                table,
                block_size,
                block_stride,
                head_offset,
            } => {
                table[j / block_size] as usize * block_stride
                    + head_offset
                    + (j % block_size) * self.head_size
            }
            RowLayout::Dense {
                first_row,
                token_stride,
            } => first_row + j * token_stride,
        }
    }
}

/// One group of query rows and the keys it visits.
#[derive(Debug, Clone)]
pub struct Group<'a> {
    /// Rows × D queries, already multiplied by the softmax scale (and the fp8 k_scale).
    pub q: &'a [f32],
    /// Position of each row.
    pub pos: &'a [usize],
    /// ALiBi slope of each row (empty without ALiBi).
    pub slope: &'a [f32],
    /// Key positions to visit (outside it every key is masked for every row).
    pub keys: Range<usize>,
    /// Positions inside `keys` that are not keys (new tokens with slot -1), sorted.
    pub absent: &'a [usize],
}

/// Online-softmax state of a group's rows: running max, running sum, unnormalized output.
#[derive(Debug, Clone)]
pub struct RowStates {
    /// Running maximum score per row.
    pub m: Vec<f32>,
    /// Running sum of `exp(score - m)` per row.
    pub l: Vec<f32>,
    /// Rows × D weighted sums of values.
    pub acc: Vec<f32>,
}

impl RowStates {
    /// Fresh states for `rows` rows of `d` elements.
    pub fn new(rows: usize, d: usize) -> Self {
        RowStates {
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows * d],
        }
    }
}

/// [`attend`] as an operation for [`Simd::vectorize`].
pub struct Attend<'a, 'b, E> {
    /// Keys and values.
    pub kv: &'a KvRows<'b, E>,
    /// The query rows.
    pub group: &'a Group<'b>,
    /// Score settings.
    pub mods: &'a ScoreMods,
    /// The rows' softmax state.
    pub state: &'a mut RowStates,
}

impl<E: Load> WithSimd for Attend<'_, '_, E> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        attend(s, self.kv, self.group, self.mods, self.state)
    }
}

/// Attends every row of `group` over its keys, accumulating into `state`.
/// Requires `head_size % S::LANES == 0` (the dispatcher picks the ISA accordingly).
#[inline(always)]
pub fn attend<S: Simd, E: Load>(
    s: S,
    kv: &KvRows<'_, E>,
    group: &Group<'_>,
    mods: &ScoreMods,
    state: &mut RowStates,
) {
    let d = kv.head_size;
    let rows = group.pos.len();
    debug_assert_eq!(d % S::LANES, 0);
    let mut scores = vec![0.0f32; rows * KEY_TILE];
    let packed = rows >= PACK_MIN_ROWS;
    let mut kt = if packed {
        vec![0.0f32; d * KEY_TILE]
    } else {
        Vec::new()
    };
    let mut absent = group.absent.iter().copied().peekable();
    let mut start = group.keys.start;
    while start < group.keys.end {
        let end = (start + KEY_TILE).min(group.keys.end);
        let n = end - start;
        prefetch_rows(s, kv, end..(end + KEY_TILE).min(group.keys.end));
        if packed {
            pack_keys(s, kv, start..end, &mut kt);
            for r0 in (0..rows).step_by(ROW_BLOCK) {
                match rows - r0 {
                    1 => qk_packed::<S, 1>(s, group.q, r0, d, &kt, n, &mut scores),
                    2 => qk_packed::<S, 2>(s, group.q, r0, d, &kt, n, &mut scores),
                    3 => qk_packed::<S, 3>(s, group.q, r0, d, &kt, n, &mut scores),
                    4 => qk_packed::<S, 4>(s, group.q, r0, d, &kt, n, &mut scores),
                    5 => qk_packed::<S, 5>(s, group.q, r0, d, &kt, n, &mut scores),
                    6 => qk_packed::<S, 6>(s, group.q, r0, d, &kt, n, &mut scores),
                    7 => qk_packed::<S, 7>(s, group.q, r0, d, &kt, n, &mut scores),
                    _ => qk_packed::<S, ROW_BLOCK>(s, group.q, r0, d, &kt, n, &mut scores),
                }
            }
        } else {
            for (t, j) in (start..end).enumerate() {
                let k = &kv.key[kv.row(j)..][..d];
                for r0 in (0..rows).step_by(ROW_BLOCK) {
                    match rows - r0 {
                        1 => qk_row::<S, E, 1>(s, group.q, r0, k, t, &mut scores),
                        2 => qk_row::<S, E, 2>(s, group.q, r0, k, t, &mut scores),
                        3 => qk_row::<S, E, 3>(s, group.q, r0, k, t, &mut scores),
                        4 => qk_row::<S, E, 4>(s, group.q, r0, k, t, &mut scores),
                        5 => qk_row::<S, E, 5>(s, group.q, r0, k, t, &mut scores),
                        6 => qk_row::<S, E, 6>(s, group.q, r0, k, t, &mut scores),
                        7 => qk_row::<S, E, 7>(s, group.q, r0, k, t, &mut scores),
                        _ => qk_row::<S, E, ROW_BLOCK>(s, group.q, r0, k, t, &mut scores),
                    }
                }
            }
        }
        // Positions in this tile that are not keys: masked for every row, skipped in P·V.
        let mut tile_absent = [false; KEY_TILE];
        while let Some(&j) = absent.peek() {
            if j >= end {
                break;
            }
            if j >= start {
                tile_absent[j - start] = true;
            }
            absent.next();
        }
        for r in 0..rows {
            let row = &mut scores[r * KEY_TILE..(r + 1) * KEY_TILE];
            let slope = group.slope.get(r).copied().unwrap_or(0.0);
            apply_mods(s, row, start, end, group.pos[r], slope, mods);
            for (t, _) in tile_absent[..n].iter().enumerate().filter(|(_, &a)| a) {
                row[t] = f32::NEG_INFINITY;
            }
            softmax_step(s, row, r, d, state);
        }
        accumulate_values(s, kv, start..end, &tile_absent[..n], &scores, state, d);
        start = end;
    }
}

/// Asks for every cache line of the key and value rows of `keys` (the next tile), so that
/// they stream in while the current tile is computed.
#[inline(always)]
fn prefetch_rows<S: Simd, E: Load>(s: S, kv: &KvRows<'_, E>, keys: Range<usize>) {
    let row_bytes = kv.head_size * std::mem::size_of::<E>();
    for j in keys {
        let row = kv.row(j);
        for buf in [kv.key, kv.value] {
            let p = buf[row..].as_ptr() as *const u8;
            for line in (0..row_bytes).step_by(64) {
                s.prefetch(p.wrapping_add(line));
            }
        }
    }
}

/// Scores of rows `r0..r0+R` against one key row read straight from the cache: the key is
/// loaded (and widened) once for the R rows; each row's partial sums are reduced at the end.
#[inline(always)]
fn qk_row<S: Simd, E: Load, const R: usize>(s: S, q: &[f32], r0: usize, k: &[E], t: usize, scores: &mut [f32]) {
    let d = k.len();
    let q = &q[r0 * d..(r0 + R) * d];
    let mut acc = [s.splat(0.0); R];
    for c in (0..d).step_by(S::LANES) {
        // SAFETY: the key row and each query row have d elements, a multiple of LANES.
        let kv = unsafe { E::load(s, k.as_ptr().add(c)) };
        for (r, a) in acc.iter_mut().enumerate() {
            *a = s.fma(unsafe { s.load(q.as_ptr().add(r * d + c)) }, kv, *a);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        scores[(r0 + r) * KEY_TILE + t] = s.reduce_sum(*a);
    }
}

/// Transposes keys `keys` into `kt` as `[d][KEY_TILE]` f32 (unused key columns zero).
#[inline(always)]
fn pack_keys<S: Simd, E: Load>(s: S, kv: &KvRows<'_, E>, keys: Range<usize>, kt: &mut [f32]) {
    let d = kv.head_size;
    let mut lanes = [0.0f32; 16];
    let n = keys.len();
    for (t, j) in keys.enumerate() {
        let k = &kv.key[kv.row(j)..][..d];
        for c in (0..d).step_by(S::LANES) {
            // SAFETY: the row has d elements, a multiple of LANES; `lanes` holds 16 >= LANES.
            unsafe { s.store(lanes.as_mut_ptr(), E::load(s, k.as_ptr().add(c))) };
            for (l, &x) in lanes[..S::LANES].iter().enumerate() {
                kt[(c + l) * KEY_TILE + t] = x;
            }
        }
    }
    if n < KEY_TILE {
        for row in kt.chunks_exact_mut(KEY_TILE) {
            row[n..].fill(0.0);
        }
    }
}

/// Scores of rows `r0..r0+R` against a packed tile: R rows × LANES keys per micro-step.
#[inline(always)]
fn qk_packed<S: Simd, const R: usize>(
    s: S,
    q: &[f32],
    r0: usize,
    d: usize,
    kt: &[f32],
    n: usize,
    scores: &mut [f32],
) {
    let q = &q[r0 * d..(r0 + R) * d];
    for c in (0..n).step_by(S::LANES) {
        let mut acc = [s.splat(0.0); R];
        for dd in 0..d {
            // SAFETY: kt is d × KEY_TILE and c + LANES <= KEY_TILE.
            let k = unsafe { s.load(kt.as_ptr().add(dd * KEY_TILE + c)) };
            for (r, a) in acc.iter_mut().enumerate() {
                *a = s.fma(s.splat(q[r * d + dd]), k, *a);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: a row of scores has KEY_TILE >= c + LANES slots.
            unsafe { s.store(scores.as_mut_ptr().add((r0 + r) * KEY_TILE + c), *a) };
        }
    }
}

/// Soft cap, ALiBi and the masks for one row's tile of scores (keys `start..end`; slots past
/// `end` become -inf).
#[inline(always)]
fn apply_mods<S: Simd>(
    s: S,
    row: &mut [f32],
    start: usize,
    end: usize,
    pos: usize,
    slope: f32,
    mods: &ScoreMods,
) {
    let neg_inf = s.splat(f32::NEG_INFINITY);
    let i = s.splat(pos as f32);
    let limit = s.splat(end as f32);
    let window_start = mods.window.map(|w| s.splat(pos as f32 + 1.0 - w as f32));
    for c in (0..KEY_TILE).step_by(S::LANES) {
        if start + c >= end {
            row[c..].fill(f32::NEG_INFINITY);
            break;
        }
        // SAFETY: c + LANES <= KEY_TILE = row.len().
        let mut v = unsafe { s.load(row.as_ptr().add(c)) };
        let j = s.add(s.iota(), s.splat((start + c) as f32));
        if let Some(cap) = mods.soft_cap {
            v = s.mul(s.splat(cap), s.tanh(s.div(v, s.splat(cap))));
        }
        if mods.alibi {
            let dist = s.sub(j, i);
            v = if mods.causal {
                s.fma(s.splat(slope), dist, v)
            } else {
                let abs = s.max(dist, s.sub(s.splat(0.0), dist));
                s.sub(v, s.mul(s.splat(slope), abs))
            };
        }
        if mods.causal {
            v = s.select_lt(i, j, neg_inf, v);
            if let Some(ws) = window_start {
                v = s.select_lt(j, ws, neg_inf, v);
            }
        }
        v = s.select_lt(j, limit, v, neg_inf);
        // SAFETY: as above.
        unsafe { s.store(row.as_mut_ptr().add(c), v) };
    }
}

/// Folds one row's tile of scores into its online-softmax state; leaves the probabilities
/// (relative to the new running max) in `row`.
#[inline(always)]
fn softmax_step<S: Simd>(s: S, row: &mut [f32], r: usize, d: usize, state: &mut RowStates) {
    let mut mx = s.splat(f32::NEG_INFINITY);
    for c in (0..KEY_TILE).step_by(S::LANES) {
        // SAFETY: c + LANES <= KEY_TILE = row.len().
        mx = s.max(mx, unsafe { s.load(row.as_ptr().add(c)) });
    }
    let m_new = state.m[r].max(s.reduce_max(mx));
    if m_new == f32::NEG_INFINITY {
        row.fill(0.0);
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

/// `acc[r] += Σ_j p[r][j] · v_j` over the tile, skipping positions that are not keys.
#[inline(always)]
fn accumulate_values<S: Simd, E: Load>(
    s: S,
    kv: &KvRows<'_, E>,
    keys: Range<usize>,
    absent: &[bool],
    probs: &[f32],
    state: &mut RowStates,
    d: usize,
) {
    let rows = state.m.len();
    let mut value_rows = [(0usize, 0usize); KEY_TILE];
    let mut count = 0;
    for (t, j) in keys.enumerate().filter(|&(t, _)| !absent[t]) {
        value_rows[count] = (t, kv.row(j));
        count += 1;
    }
    let value_rows = &value_rows[..count];
    for r0 in (0..rows).step_by(ROW_BLOCK) {
        match rows - r0 {
            1 => pv_block::<S, E, 1>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            2 => pv_block::<S, E, 2>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            3 => pv_block::<S, E, 3>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            4 => pv_block::<S, E, 4>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            5 => pv_block::<S, E, 5>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            6 => pv_block::<S, E, 6>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            7 => pv_block::<S, E, 7>(s, kv.value, value_rows, probs, r0, &mut state.acc, d),
            _ => {
                pv_block::<S, E, ROW_BLOCK>(s, kv.value, value_rows, probs, r0, &mut state.acc, d)
            }
        }
    }
}

/// P·V for rows `r0..r0+R`: each value vector is loaded once for the R rows.
#[inline(always)]
fn pv_block<S: Simd, E: Load, const R: usize>(
    s: S,
    values: &[E],
    value_rows: &[(usize, usize)],
    probs: &[f32],
    r0: usize,
    acc: &mut [f32],
    d: usize,
) {
    for c in (0..d).step_by(S::LANES) {
        let mut a = [s.splat(0.0); R];
        for (r, v) in a.iter_mut().enumerate() {
            // SAFETY: acc is rows × d, c + LANES <= d.
            *v = unsafe { s.load(acc.as_ptr().add((r0 + r) * d + c)) };
        }
        for &(t, row) in value_rows {
            // SAFETY: row + d is inside the validated value buffer.
            let v = unsafe { E::load(s, values.as_ptr().add(row + c)) };
            for (r, x) in a.iter_mut().enumerate() {
                *x = s.fma(s.splat(probs[(r0 + r) * KEY_TILE + t]), v, *x);
            }
        }
        for (r, v) in a.iter().enumerate() {
            // SAFETY: as above.
            unsafe { s.store(acc.as_mut_ptr().add((r0 + r) * d + c), *v) };
        }
    }
}
