//! Where the keys and values of one (sequence, kv head) are: paged cache rows or dense input
//! rows ([`KvRows`]).

use std::ops::Range;

use super::prefetch::{prefetch_row, Level};
use crate::cpu::simd::Simd;

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
