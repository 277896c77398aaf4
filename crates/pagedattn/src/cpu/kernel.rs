//! The flash-attention tile loop of the CPU backend and its shared pieces, generic over the
//! instruction set ([`Simd`]).
//!
//! One call attends a group of query rows — every query head that shares one kv head, for one
//! or more tokens of one sequence — over a range of key positions, tile by tile, with an
//! online softmax, so that each K/V tile is read once for all the rows. Where the scores and
//! the values come from is a [`TileSource`]: cache rows read directly (decode,
//! [`RowsSource`]), or keys and values packed once per (sequence, kv head) for the prefill
//! micro-kernels (`packed`, and `bf16` for AVX512-BF16). The score pieces (soft cap, ALiBi,
//! causal and window masks) mirror `crate::semantics`, applied to a vector of keys at a time.

use std::mem::MaybeUninit;
use std::ops::Range;

use super::simd::{Load, Simd, WithSimd};

/// Keys per tile.
pub const KEY_TILE: usize = 64;

// Tile columns are tracked as the bits of a u64.
const _: () = assert!(KEY_TILE == 64);

/// Query rows per micro-kernel block.
pub const ROW_BLOCK: usize = 8;

/// Runs `$body` for each block of up to [`ROW_BLOCK`] rows, with `$r0` the first row and the
/// const `$n` the block's row count (so micro-kernels keep their accumulators in registers).
/// `for_row_blocks!(rows, for S, ...)` sizes the blocks to the ISA `S`: 8 rows with 32 vector
/// registers, 4 with 16.
macro_rules! for_row_blocks {
    ($rows:expr, |$r0:ident, $n:ident| $body:expr) => {
        $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 8, [1 2 3 4 5 6 7], |$r0, $n| $body)
    };
    ($rows:expr, for $s:ty, |$r0:ident, $n:ident| $body:expr) => {
        if <$s as $crate::cpu::simd::Simd>::REGISTERS >= 32 {
            $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 8, [1 2 3 4 5 6 7], |$r0, $n| $body)
        } else {
            $crate::cpu::kernel::for_row_blocks!(@blocks $rows, 4, [1 2 3], |$r0, $n| $body)
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

/// The keys and values of one (sequence, kv head), where they are stored.
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
    /// Element offsets of the rows of `keys`, into `out` (walks the block table instead of
    /// dividing per key).
    #[inline(always)]
    pub fn rows_into(&self, keys: Range<usize>, out: &mut [usize]) {
        match self.layout {
            RowLayout::Paged {
                table,
                block_size,
                block_stride,
                head_offset,
            } => {
                // A block at a time: inside one, the rows are consecutive.
                let (mut block, mut offset) = (keys.start / block_size, keys.start % block_size);
                let mut out = &mut out[..keys.len()];
                while !out.is_empty() {
                    let n = (block_size - offset).min(out.len());
                    let (run, rest) = std::mem::take(&mut out).split_at_mut(n);
                    let first = table[block] as usize * block_stride
                        + head_offset
                        + offset * self.head_size;
                    for (i, o) in run.iter_mut().enumerate() {
                        *o = first + i * self.head_size;
                    }
                    (block, offset, out) = (block + 1, 0, rest);
                }
            }
            RowLayout::Dense {
                first_row,
                token_stride,
            } => {
                for (o, j) in out.iter_mut().zip(keys) {
                    *o = first_row + j * token_stride;
                }
            }
        }
    }

    /// Asks for the key and value rows of position `j` into L1 (packing loops, running
    /// [`PACK_PREFETCH_KEYS`] ahead: a sequence's rows come in blocks scattered over the
    /// cache, and without it the loop waits on memory for most of its time).
    #[inline(always)]
    pub fn prefetch<S: Simd>(&self, s: S, j: usize) {
        let row = self.row(j);
        for buf in [self.key, self.value] {
            if let Some(r) = buf.get(row..row + self.head_size) {
                prefetch_row(s, r, Level::L1);
            }
        }
    }

    /// Elements from a row of one kv head to the same position's row of the next kv head.
    pub fn head_stride(&self) -> usize {
        match self.layout {
            RowLayout::Paged { block_size, .. } => block_size * self.head_size,
            RowLayout::Dense { .. } => self.head_size,
        }
    }

    /// Element offset of position `j`'s row.
    #[inline(always)]
    pub fn row(&self, j: usize) -> usize {
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

/// How many keys ahead the prefill packing loops ask for rows ([`KvRows::prefetch`]).
pub const PACK_PREFETCH_KEYS: usize = 16;

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
    /// Positions that are not keys (new tokens with slot -1), sorted.
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
    /// applied).
    fn scores<S: Simd>(&self, s: S, tile: &Self::Tile<'_>, scores: &mut [f32]);
    /// `acc[r] += Σ_j p[r][j] · v_j` over the tile's keys, skipping positions marked absent.
    fn accumulate<S: Simd>(
        &self,
        s: S,
        tile: &Self::Tile<'_>,
        absent: &[bool],
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
/// their states. The heads share the key range, the positions that are not keys and the row
/// positions (they differ in values and ALiBi slopes); each tile is visited by every head in
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
    let mut scores = vec![0.0f32; first_state.m.len() * KEY_TILE];
    let mut row_cols = vec![0..0; rows];
    let mut value_row = vec![0.0f32; d];
    let mut absent = first.absent.iter().copied().peekable();
    let (origin, step) = sources[0].alignment();
    let plain = mods.soft_cap.is_none() && !mods.alibi;
    let first_row = first.pos.iter().copied().min().unwrap_or(0);
    let last_row = first.pos.iter().copied().max().unwrap_or(0);
    let keys = first.keys.clone();
    let mut start = keys.start - (keys.start - origin) % step;
    while start < keys.end {
        let end = (start + KEY_TILE).min(keys.end);
        let n = end - start;
        // Positions in this tile that are not keys: masked for every row, skipped in P·V.
        let mut tile_absent = [false; KEY_TILE];
        let mut absent_bits = 0u64;
        while let Some(&j) = absent.peek() {
            if j >= end {
                break;
            }
            if j >= start {
                tile_absent[j - start] = true;
                absent_bits |= 1 << (j - start);
            }
            absent.next();
        }
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
        let masked = column_bits(0..n) & !absent_bits & !seen_by_all;
        for ((source, group), state) in sources.iter().zip(groups).zip(states.iter_mut()) {
            let tile = source.tile(start..end);
            let special = if masked == 0 {
                0
            } else {
                source.nonfinite_values(&tile, masked, &mut value_row)
            };
            source.scores(s, &tile, &mut scores);
            for (r, cols) in row_cols.iter().enumerate() {
                let row = &mut scores[r * KEY_TILE..(r + 1) * KEY_TILE];
                if !unmasked {
                    let slope = group.slope.get(r).copied().unwrap_or(0.0);
                    apply_mods(s, row, start, end, cols.clone(), group.pos[r], slope, mods);
                }
                if absent_bits != 0 {
                    for t in columns(absent_bits) {
                        row[t] = f32::NEG_INFINITY;
                    }
                }
                softmax_step(s, row, r, d, state);
            }
            if special == 0 {
                source.accumulate(s, &tile, &tile_absent[..n], &mut scores, state);
            } else {
                // Non-finite values that some row must not see: each such key enters the rows
                // that attend it here, and the source's P·V skips it.
                let mut skip = tile_absent;
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
                source.accumulate(s, &tile, &skip[..n], &mut scores, state);
            }
        }
        start = end;
    }
    for (source, state) in sources.iter().zip(states.iter_mut()) {
        source.finish(state);
    }
}

/// The tile-local columns of tile `start..end` that a row at position `pos` attends: the
/// unit's keys from `first` up to the causal end, inside the window (absent positions aside).
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

/// Scores and values read straight from the cache rows (decode: a few rows per key).
#[derive(Debug, Clone, Copy)]
pub struct RowsSource<'a, E> {
    /// Keys and values.
    pub kv: KvRows<'a, E>,
    /// Rows × D queries, unscaled.
    pub q: &'a [f32],
    /// Score scale: softmax scale × fp8 k_scale × the ISA's [`Load::load_scale`] (applied to
    /// each dot product, so that the score overflows only where the product itself leaves
    /// f32's range).
    scale: f32,
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
        RowsSource {
            kv,
            q,
            scale: score_scale * load_scale,
            load_scale,
            stream,
        }
    }
}

/// Where a decode source's software prefetches run ahead to (a stream of cache rows to ask for,
/// nothing to do with a CUDA stream). The kv heads of a unit walk each tile in
/// turn ([`attend`]), so near the end of its tile a head asks for the next head's first keys
/// of the same tile (the same cache blocks), and the last head for the first head's keys of
/// the next tile.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchStream {
    /// End of the key range the unit visits (prefetching stops there).
    pub keys_end: usize,
    /// Elements from this head's rows to the next head's ([`KvRows::head_stride`]), or, for
    /// the last head, back to the first head's (negative; 0 for a single head).
    pub next_head: isize,
    /// Whether this is the unit's last head.
    pub last: bool,
}

impl PrefetchStream {
    /// The stream of head `head` of `heads`, whose rows are `head_stride` apart.
    pub fn of_head(
        head: usize,
        heads: usize,
        head_stride: usize,
        keys_end: usize,
    ) -> PrefetchStream {
        let last = head + 1 == heads;
        let next_head = if last {
            -((head * head_stride) as isize)
        } else {
            head_stride as isize
        };
        PrefetchStream {
            keys_end,
            next_head,
            last,
        }
    }
}

/// How many keys ahead the decode path asks for key rows.
const PREFETCH_KEYS: usize = 16;

/// No row to prefetch (in [`TileRows`]' per-column prefetch targets).
const NO_ROW: usize = usize::MAX;

/// How many keys ahead the decode path asks for key and value rows into L2 (more requests in
/// flight than L1 can track, which keeps the decode nearer the memory's rate than L1 prefetches
/// alone; NOTES.md).
const PREFETCH_L2_KEYS: usize = 48;

/// The widest vector any ISA has, in f32 lanes (sizes the per-group scratch).
const MAX_LANES: usize = 16;

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
    fn scores<S: Simd>(&self, s: S, tile: &TileRows<'_, E>, scores: &mut [f32]) {
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
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        s: S,
        tile: &TileRows<'_, E>,
        absent: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        accumulate_rows(s, self.kv.value, tile.rows(), absent, probs, state);
    }

    fn value_row(&self, tile: &TileRows<'_, E>, t: usize, out: &mut [f32]) {
        let row = &self.kv.value[tile.rows()[t]..][..self.kv.head_size];
        for (o, &x) in out.iter_mut().zip(row) {
            *o = x.to_f32() / self.load_scale;
        }
    }

    fn finish(&self, state: &mut RowStates) {
        if self.load_scale != 1.0 {
            for a in &mut state.acc {
                *a *= self.load_scale;
            }
        }
    }
}

/// When a decode kernel asks for the value rows `PREFETCH_L2_KEYS` steps ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValuesAhead {
    /// With the key rows, while scoring (the portable kernels: their P·V pass walks each
    /// row's vectors across the whole tile, and asking from there was slower; NOTES.md).
    WithKeys,
    /// From the P·V pass ([`TileRows::prefetch_value_ahead`]: the AVX512-BF16 kernels, which
    /// score faster than the memory delivers; asked for while scoring, the memory idles through
    /// their P·V pass; NOTES.md).
    #[cfg(target_arch = "x86_64")]
    FromValues,
}

/// The cache rows of one decode tile, with the prefetch stream that runs ahead of them (in the
/// order the heads visit rows, see [`PrefetchStream`], up to the end of the visited keys): the scores
/// ask for the key row `PREFETCH_L2_KEYS` steps ahead into L2, the key row `PREFETCH_KEYS`
/// steps ahead into L1 and the value row of the key being scored, which the P·V pass reads
/// after the tile's scores; the value row `PREFETCH_L2_KEYS` steps ahead goes into L2 as
/// [`ValuesAhead`] says.
pub struct TileRows<'a, E> {
    kv: &'a KvRows<'a, E>,
    offsets: [usize; KEY_TILE + PREFETCH_L2_KEYS],
    /// Keys in the tile.
    pub len: usize,
    d: usize,
    /// Per column: the key row to prefetch into L1, or [`NO_ROW`].
    l1: [usize; KEY_TILE],
    /// Per column: the key and value rows to prefetch into L2, or [`NO_ROW`].
    l2: [usize; KEY_TILE],
    /// Who asks for the value rows in `l2`.
    values_ahead: ValuesAhead,
}

impl<'a, E> TileRows<'a, E> {
    /// The rows of `keys`, one tile of a head with prefetch stream `stream`, of `d` elements
    /// (the head size, passed apart so that a kernel specialized for one can make it a
    /// constant).
    #[inline(always)]
    pub fn new(
        kv: &'a KvRows<'a, E>,
        keys: Range<usize>,
        stream: PrefetchStream,
        d: usize,
        values_ahead: ValuesAhead,
    ) -> Self {
        debug_assert_eq!(d, kv.head_size);
        let reach = keys.start..(keys.end + PREFETCH_L2_KEYS).min(stream.keys_end);
        let mut offsets = [0usize; KEY_TILE + PREFETCH_L2_KEYS];
        kv.rows_into(reach.clone(), &mut offsets);
        let (len, reach) = (keys.len(), reach.len());
        // Column t's prefetch target `ahead` steps on in the heads' visiting order: this
        // head's row while inside the tile, then the next head's first rows of this tile
        // (the last head: the first head's rows of the next tile).
        let stream_rows = |ahead: usize| {
            let mut out = [NO_ROW; KEY_TILE];
            let same = len.saturating_sub(ahead);
            out[..same].copy_from_slice(&offsets[ahead..ahead + same]);
            for (t, o) in out.iter_mut().enumerate().take(len).skip(same) {
                let (u, inside) = if stream.last {
                    (t + ahead, t + ahead < reach)
                } else {
                    (t + ahead - len, t + ahead - len < len)
                };
                if inside {
                    *o = (offsets[u] as isize + stream.next_head) as usize;
                }
            }
            out
        };
        TileRows {
            kv,
            offsets,
            len,
            d,
            l1: stream_rows(PREFETCH_KEYS),
            l2: stream_rows(PREFETCH_L2_KEYS),
            values_ahead,
        }
    }

    /// Key row of tile column `t` (`t < len`); with `prefetch`, first asks for the rows read
    /// later (see [`TileRows`]).
    #[inline(always)]
    pub fn key<S: Simd>(&self, s: S, t: usize, prefetch: bool) -> &'a [E] {
        debug_assert!(t < self.len);
        // SAFETY: offsets come from validated block tables (every row, up to `reach`, lies
        // inside both buffers with its d elements, and so do the other heads' rows of the same
        // positions, `next_head` away); t < len <= reach.
        unsafe {
            let row = |buf: &'a [E], offset: usize| {
                std::slice::from_raw_parts(buf.as_ptr().add(offset), self.d)
            };
            if prefetch {
                let far = *self.l2.get_unchecked(t);
                if far != NO_ROW {
                    prefetch_row(s, row(self.kv.key, far), Level::L2);
                    if self.values_ahead == ValuesAhead::WithKeys {
                        prefetch_row(s, row(self.kv.value, far), Level::L2);
                    }
                }
                let near = *self.l1.get_unchecked(t);
                if near != NO_ROW {
                    prefetch_row(s, row(self.kv.key, near), Level::L1);
                }
                prefetch_row(
                    s,
                    row(self.kv.value, *self.offsets.get_unchecked(t)),
                    Level::L1,
                );
            }
            row(self.kv.key, *self.offsets.get_unchecked(t))
        }
    }

    /// Element offsets of the tile's rows, one per column.
    #[inline(always)]
    pub fn rows(&self) -> &[usize] {
        &self.offsets[..self.len]
    }

    /// The value buffer the rows index.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn values(&self) -> &'a [E] {
        self.kv.value
    }

    /// Asks for bytes `bytes` of the value row `PREFETCH_L2_KEYS` steps ahead of column `t`
    /// into L2 (the lines that start there: a P·V pass that reads rows in parts asks for each
    /// part's share as it goes). For tiles made with [`ValuesAhead::FromValues`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn prefetch_value_ahead<S: Simd>(&self, s: S, t: usize, bytes: Range<usize>) {
        debug_assert_eq!(self.values_ahead, ValuesAhead::FromValues);
        let far = self.l2[t];
        if far == NO_ROW {
            return;
        }
        let row = self.kv.value.as_ptr().wrapping_add(far) as *const u8;
        let end = bytes.end.min(self.d * std::mem::size_of::<E>());
        prefetch_lines(s, row, bytes.start.next_multiple_of(64)..end, Level::L2);
    }
}

/// The cache level a prefetch fills.
#[derive(Clone, Copy)]
enum Level {
    L1,
    L2,
}

/// Asks for every cache line of a row, into `level`.
#[inline(always)]
fn prefetch_row<S: Simd, E>(s: S, row: &[E], level: Level) {
    prefetch_lines(
        s,
        row.as_ptr() as *const u8,
        0..std::mem::size_of_val(row),
        level,
    );
}

/// Asks for the cache lines at `base + bytes` (a line-aligned start), into `level`.
#[inline(always)]
fn prefetch_lines<S: Simd>(s: S, base: *const u8, bytes: Range<usize>, level: Level) {
    for line in bytes.step_by(64) {
        match level {
            Level::L1 => s.prefetch(base.wrapping_add(line)),
            Level::L2 => s.prefetch_l2(base.wrapping_add(line)),
        }
    }
}

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
fn qk_partial<S: Simd, E: Load, const R: usize>(
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
/// ([`attended_columns`]) and compared as tile-local indices (below `KEY_TILE`, exact in
/// f32), and ALiBi's distance `j - i` is an integer before it is rounded once to f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn apply_mods<S: Simd>(
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
fn softmax_step<S: Simd>(s: S, row: &mut [f32], r: usize, d: usize, state: &mut RowStates) {
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

/// `acc[r] += Σ_t p[r][t] · values[value_rows[t]..]` for every row, skipping absent keys.
#[inline(always)]
pub fn accumulate_rows<S: Simd, E: Load>(
    s: S,
    values: &[E],
    value_rows: &[usize],
    absent: &[bool],
    probs: &[f32],
    state: &mut RowStates,
) {
    let d = state.acc.len() / state.m.len();
    let mut present = [(0usize, 0usize); KEY_TILE];
    let mut count = 0;
    for (t, &row) in value_rows.iter().enumerate().filter(|&(t, _)| !absent[t]) {
        present[count] = (t, row);
        count += 1;
    }
    let present = &present[..count];
    let (rows, acc) = (state.m.len(), &mut state.acc);
    for_row_blocks!(rows, for S, |r0, R| pv_block::<S, E, R>(
        s, values, present, probs, r0, acc, d
    ));
}

/// P·V for rows `r0..r0+R`, `W` vector chunks of the head at a time (4 for one or two rows,
/// else 2: R·W independent FMA chains, enough to hide the FMA latency, that stay in registers
/// across every key of the tile; each value vector is loaded and widened once for the R
/// rows, each probability broadcast once for the W chunks).
#[inline(always)]
fn pv_block<S: Simd, E: Load, const R: usize>(
    s: S,
    values: &[E],
    present: &[(usize, usize)],
    probs: &[f32],
    r0: usize,
    acc: &mut [f32],
    d: usize,
) {
    let probs = &probs[r0 * KEY_TILE..(r0 + R) * KEY_TILE];
    let acc = &mut acc[r0 * d..(r0 + R) * d];
    let mut c = 0;
    if R <= 2 {
        while c + 4 * S::LANES <= d {
            pv_chunks::<S, E, R, 4>(s, values, present, probs, acc, d, c);
            c += 4 * S::LANES;
        }
    }
    while c + 2 * S::LANES <= d {
        pv_chunks::<S, E, R, 2>(s, values, present, probs, acc, d, c);
        c += 2 * S::LANES;
    }
    if c < d {
        pv_chunks::<S, E, R, 1>(s, values, present, probs, acc, d, c);
    }
}

/// [`pv_block`] for the `W` vector chunks from dimension `c`.
#[inline(always)]
fn pv_chunks<S: Simd, E: Load, const R: usize, const W: usize>(
    s: S,
    values: &[E],
    present: &[(usize, usize)],
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
        for &(t, at) in present {
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
