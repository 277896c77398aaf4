//! Splitting one forward call into work for the thread pool. A decode unit is one sequence ×
//! every kv head × a range of keys (the heads walk the keys together, so that whole cache
//! blocks are read at once); decodes of long sequences are split along the keys (split-K)
//! when the batch alone would not keep every thread busy, and their partial results are
//! merged with an exact log-sum-exp combine. A prefill group is one sequence ×
//! one kv head, whose keys and values are packed once and then shared by its query tiles.

use std::ops::Range;

use super::kernel::KEY_TILE;
use crate::config::AttentionConfig;
use crate::detached::Detached;
use crate::metadata::AttentionMetadata;
use crate::semantics::{allowed_keys, query_position, KeyMap};

/// Query rows a prefill unit aims for (tokens × query heads of the kv head).
const TARGET_ROWS: usize = 64;

/// Least work (keys × kv heads) a split-K partition gets.
const MIN_PARTITION_WORK: usize = 512;

/// Fewest keys a split-K partition gets: one tile.
const MIN_PARTITION_KEYS: usize = KEY_TILE;

/// Units per thread a plan aims for, so that work stealing can balance skewed batches.
const UNITS_PER_THREAD: usize = 8;

/// A query tile of a prefill group and the keys it visits.
#[derive(Debug, Clone)]
pub struct Tile {
    /// Query tokens.
    pub tokens: Range<usize>,
    /// Key positions visited.
    pub keys: Range<usize>,
}

/// The multi-token queries of one (sequence, kv head).
#[derive(Debug, Clone)]
pub struct PrefillGroup {
    /// Sequence index.
    pub seq: usize,
    /// Kv head.
    pub kv_head: usize,
    /// Every key position a tile visits (what is packed).
    pub keys: Range<usize>,
    /// Query tiles.
    pub tiles: Vec<Tile>,
    /// Rough cost: rows × keys summed over tiles.
    pub cost: usize,
}

/// One decode unit of work: one sequence, every kv head.
#[derive(Debug, Clone)]
pub struct DecodeUnit {
    /// Sequence index.
    pub seq: usize,
    /// Query tokens (indices into the call's tokens).
    pub tokens: Range<usize>,
    /// Key positions visited.
    pub keys: Range<usize>,
    /// Where a split-K unit leaves its partial results.
    pub partial: Option<PartialSlots>,
}

/// The partial-result slots of a split-K unit: kv head h uses slot `first + h * stride`.
#[derive(Debug, Clone, Copy)]
pub struct PartialSlots {
    /// Slot of kv head 0.
    pub first: usize,
    /// Slots between consecutive kv heads (the sequence's partition count).
    pub stride: usize,
}

impl DecodeUnit {
    /// Rough cost: tokens × keys (every unit has all heads).
    fn cost(&self) -> usize {
        self.tokens.len() * self.keys.len().max(1)
    }
}

/// Partitions of one (token, kv head) to merge: their slots in the partial buffer.
#[derive(Debug, Clone)]
pub struct Merge {
    /// The sequence.
    pub seq: usize,
    /// The query token.
    pub token: usize,
    /// The kv head.
    pub kv_head: usize,
    /// Consecutive partial slots.
    pub parts: Range<usize>,
}

/// The units of a call, most expensive first, and the merges split-K needs.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Decode units.
    pub units: Vec<DecodeUnit>,
    /// Prefill groups.
    pub prefill: Vec<PrefillGroup>,
    /// Split-K merges.
    pub merges: Vec<Merge>,
    /// Number of partial-result slots.
    pub num_partials: usize,
    /// The sequences with a new token that is not written (slot -1), which read their keys
    /// from a private cache the call fills.
    pub(crate) detached: Option<Detached>,
}

/// Builds the plan of a call for `threads` threads.
pub fn plan(
    config: &AttentionConfig,
    md: &AttentionMetadata,
    key_map: &KeyMap<'_>,
    threads: usize,
) -> Plan {
    let attn_type = config.attn_type();
    let group = config.num_queries_per_kv();
    let hkv = config.num_kv_heads();
    let mut plan = Plan::default();
    // Key range of one query token, from the mask (causal end, window start).
    let key_range = |s: usize, t: usize| -> Range<usize> {
        let range = md.query_range(s);
        let i = query_position(
            attn_type,
            md.seq_lens[s] as usize,
            range.len(),
            t - range.start,
        );
        allowed_keys(
            attn_type,
            config.sliding_window(),
            i,
            key_map.num_positions(s),
        )
    };
    // Decode work, to decide whether to split the keys.
    let decode_keys: usize = (0..md.num_seqs())
        .filter(|&s| md.query_range(s).len() == 1)
        .map(|s| key_range(s, md.query_range(s).start).len())
        .sum();
    let partition = MIN_PARTITION_WORK
        .div_ceil(hkv)
        .max(MIN_PARTITION_KEYS)
        .max(decode_keys.div_ceil(threads * UNITS_PER_THREAD));
    for s in 0..md.num_seqs() {
        let tokens = md.query_range(s);
        if tokens.is_empty() {
            continue;
        }
        if tokens.len() == 1 {
            let keys = key_range(s, tokens.start);
            let parts = keys.len().div_ceil(partition).max(1);
            if parts == 1 {
                plan.units.push(DecodeUnit {
                    seq: s,
                    tokens,
                    keys,
                    partial: None,
                });
                continue;
            }
            // Slots head-major: head h's partitions are consecutive, for its merge.
            let first = plan.num_partials;
            plan.num_partials += parts * hkv;
            let step = keys.len().div_ceil(parts);
            for p in 0..parts {
                let lo = keys.start + p * step;
                plan.units.push(DecodeUnit {
                    seq: s,
                    tokens: tokens.clone(),
                    keys: lo..(lo + step).min(keys.end),
                    partial: Some(PartialSlots {
                        first: first + p,
                        stride: parts,
                    }),
                });
            }
            for g in 0..hkv {
                plan.merges.push(Merge {
                    seq: s,
                    token: tokens.start,
                    kv_head: g,
                    parts: first + g * parts..first + (g + 1) * parts,
                });
            }
            continue;
        }
        let tile = (TARGET_ROWS / group).max(1);
        let tiles: Vec<Tile> = tokens
            .clone()
            .step_by(tile)
            .map(|t0| {
                let t1 = (t0 + tile).min(tokens.end);
                let (first, last) = (key_range(s, t0), key_range(s, t1 - 1));
                Tile {
                    tokens: t0..t1,
                    keys: first.start.min(last.start)..first.end.max(last.end),
                }
            })
            .collect();
        let keys = tiles.iter().map(|t| t.keys.start).min().unwrap_or(0)
            ..tiles.iter().map(|t| t.keys.end).max().unwrap_or(0);
        let cost = tiles
            .iter()
            .map(|t| t.tokens.len() * group * t.keys.len())
            .sum();
        for g in 0..hkv {
            plan.prefill.push(PrefillGroup {
                seq: s,
                kv_head: g,
                keys: keys.clone(),
                tiles: tiles.clone(),
                cost,
            });
        }
    }
    plan.prefill.sort_by_key(|g| std::cmp::Reverse(g.cost));
    plan.units.sort_by_key(|u| std::cmp::Reverse(u.cost()));
    plan
}
