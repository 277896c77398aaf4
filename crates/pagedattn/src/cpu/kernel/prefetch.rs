//! The decode's software prefetch policy: the stream of cache rows each head asks for ahead
//! of its reads ([`PrefetchStream`], [`TileRows`]).

use std::ops::Range;

use super::rows::KvRows;
use super::tile_loop::KEY_TILE;
use crate::cpu::simd::Simd;

/// Where a decode source's software prefetches run ahead to (a stream of cache rows to ask for,
/// nothing to do with a CUDA stream). The kv heads of a unit walk each tile in
/// turn ([`attend`](super::attend)), so near the end of its tile a head asks for the next head's first keys
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
/// alone; docs/design/cpu.md).
const PREFETCH_L2_KEYS: usize = 48;

/// When a decode kernel asks for the value rows `PREFETCH_L2_KEYS` steps ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValuesAhead {
    /// With the key rows, while scoring (the portable kernels: their P·V pass walks each
    /// row's vectors across the whole tile, and asking from there was slower; docs/design/cpu.md).
    WithKeys,
    /// From the P·V pass ([`TileRows::prefetch_value_ahead`]: the AVX512-BF16 kernels, which
    /// score faster than the memory delivers; asked for while scoring, the memory idles through
    /// their P·V pass; docs/design/cpu.md).
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
pub(super) enum Level {
    L1,
    L2,
}

/// Asks for every cache line of a row, into `level`.
#[inline(always)]
pub(super) fn prefetch_row<S: Simd, E>(s: S, row: &[E], level: Level) {
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
