//! The flash-attention tile loop of the CPU backend and its shared pieces, generic over the
//! instruction set ([`Simd`](crate::cpu::simd::Simd)).
//!
//! One call attends a group of query rows — every query head that shares one kv head, for one
//! or more tokens of one sequence — over a range of key positions, tile by tile, with an
//! online softmax, so that each K/V tile is read once for all the rows. Where the scores and
//! the values come from is a [`TileSource`]: cache rows read directly (decode,
//! [`RowsSource`]), or keys and values packed once per (sequence, kv head) for the prefill
//! micro-kernels (`packed`, and `bf16` for AVX512-BF16). The score pieces (soft cap, ALiBi,
//! causal and window masks) mirror `crate::semantics`, applied to a vector of keys at a time.

mod micro;
mod prefetch;
mod rows;
mod rows_source;
mod tile_loop;

pub(crate) use micro::{
    accumulate_consecutive, accumulate_rows, block_end, for_row_blocks, ROW_BLOCK,
};
pub(crate) use prefetch::PrefetchStream;
pub(crate) use rows::{KvRows, RowLayout, PACK_PREFETCH_KEYS};
pub(crate) use rows_source::RowsSource;
pub(crate) use tile_loop::{Attend, QueryRows, RowStates, ScoreMods, TileSource, KEY_TILE};

// What only the AVX512-BF16 kernels (`cpu::bf16`) use besides.
#[cfg(target_arch = "x86_64")]
pub(crate) use micro::score_group;
#[cfg(target_arch = "x86_64")]
pub(crate) use prefetch::{TileRows, ValuesAhead};
#[cfg(target_arch = "x86_64")]
pub(crate) use tile_loop::attend;
