//! The work of one step on a GPU, made once on the host when the step is planned: what the
//! attention kernels need to know about each sequence, the block-table entries they read, and
//! the work list, one record per thread block (a *unit*) plus the split-K merges. Every
//! record is a run of i64 in the layout `abi.rs` declares for both sides ([`SeqField`],
//! [`UnitField`], [`MergeField`]).
//!
//! A unit is one sequence, one kv head, some query rows of it and a range of key positions:
//! * decode units (sequences with one query token, run by the decode kernel): the query heads
//!   of the kv head, [`DECODE_ROWS`] at a time, over the token's allowed keys;
//! * prefill units (several query tokens, run by the prefill kernel): [`PREFILL_ROWS`] rows of
//!   (token, query head), the kv head's heads first, over the union of their allowed keys.
//!
//! Split-K: when the units would leave the GPU underused (fewer than two thread blocks per
//! multiprocessor), a decode unit with more than [`MIN_PARTITION_KEYS`] keys is split into
//! partitions of at least that many keys (multiples of [`PARTITION_ALIGN`]), as many as the
//! grid holds without passing that size; each partition leaves a partial result per row in
//! the workspace, and a merge per row combines them. A plan for CUDA graphs gives every decode
//! unit the same number of partition records whatever its length ([`Split::Fixed`]), so that
//! the records keep their count from step to step: the keys are divided as the automatic split
//! divides them, the records past those are empty, and their merges read only the partitions
//! that hold keys (none, when the unit is not split: it writes its rows itself and the merge
//! record is idle). A short context thus costs a graph step what it costs an eager one, not a
//! merge over the capacity's partitions.

use std::ops::Range;

use super::abi::{MergeField, SeqField, UnitField, DECODE_ROWS, PREFILL_ROWS};
use crate::config::{AttentionConfig, AttnType};
use crate::detached::Detached;
use crate::metadata::AttentionMetadata;
use crate::semantics::{allowed_keys, query_position, KeyMap};

/// The fewest keys a split-K partition gets.
pub(crate) const MIN_PARTITION_KEYS: usize = 256;
/// Partitions are multiples of the largest key tile, so that only a partition's last tile is
/// partial.
pub(crate) const PARTITION_ALIGN: usize = 32;
/// Thread blocks per multiprocessor below which long decodes are split.
const BLOCKS_PER_SM: usize = 2;
/// Bytes of keys and values (counted as 16-bit elements) of the kv heads whose prefill units
/// run together: a third of an H100's L2 cache.
const L2_GROUP_BYTES: usize = 16 << 20;

/// f32 elements of one partial record: m, l, attended, padding, then the D accumulators
/// (`None` where that overflows).
pub(crate) fn partial_floats(head_size: usize) -> Option<usize> {
    head_size.checked_add(4)
}

/// How decode units are split into partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Split {
    /// As many as the grid holds without passing [`BLOCKS_PER_SM`] thread blocks per
    /// multiprocessor of a GPU with this many, in partitions of at least
    /// [`MIN_PARTITION_KEYS`] keys.
    Auto { sm_count: usize },
    /// Exactly `parts` records per decode unit (1: no split), the keys divided as
    /// `Auto { sm_count }` divides them (into at most `parts`), the other records empty.
    Fixed { parts: usize, sm_count: usize },
}

/// The partitions a graph plan gives each decode unit: what [`Split::Auto`] would choose for
/// `units` thread blocks whose keys number `max_keys`.
pub(crate) fn graph_parts(units: usize, max_keys: usize, sm_count: usize) -> usize {
    max_keys
        .div_ceil(MIN_PARTITION_KEYS)
        .clamp(1, max_parts(units, sm_count))
}

/// The most partitions [`Split::Auto`] gives a unit when the grid has `blocks` thread blocks:
/// as many as keep the split grid within one wave of [`BLOCKS_PER_SM`] blocks per
/// multiprocessor. One more would start a second wave for a few blocks, and a wave takes as
/// long as its partitions: 64 units on 264 places split in 5 run two waves of a fifth of the
/// keys, in 4 one wave of a quarter.
fn max_parts(blocks: usize, sm_count: usize) -> usize {
    (BLOCKS_PER_SM * sm_count.max(1) / blocks.max(1)).max(1)
}

/// The records of one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Work {
    /// [`SeqField::COUNT`] per sequence.
    pub(crate) seqs: Vec<i64>,
    /// For a paged call, the block-table entries of each sequence's key positions (exactly
    /// `ceil(n / B)` per sequence, the ones the metadata's validation checked).
    pub(crate) tables: Vec<i64>,
    /// Decode units, [`UnitField::COUNT`] each: those of detached sequences last.
    pub(crate) decode: Vec<i64>,
    /// Prefill units, likewise.
    pub(crate) prefill: Vec<i64>,
    /// How many of the decode units, at the section's end, read the call's private cache
    /// (detached sequences): a launch of their own, whose key and value buffers are it.
    pub(crate) private_decode: usize,
    /// How many of the prefill units, likewise.
    pub(crate) private_prefill: usize,
    /// [`MergeField::COUNT`] per output row computed by split-K.
    pub(crate) merges: Vec<i64>,
    /// Partial records the split-K units write.
    pub(crate) num_partials: usize,
}

/// One unit before it becomes a record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Unit {
    seq: usize,
    kv_head: usize,
    /// First query token, from the sequence's first, and the count.
    token: usize,
    tokens: usize,
    /// First query head inside the kv head's group, and the count.
    head: usize,
    heads: usize,
    keys: Range<usize>,
    /// (first partial slot, partitions, this partition) of a split unit.
    split: Option<(usize, usize, usize)>,
    /// Whether its sequence is detached (reads the private cache).
    private: bool,
}

impl Unit {
    fn record(&self) -> [i64; UnitField::COUNT] {
        let (base, parts, part) = match self.split {
            Some((base, parts, part)) => (base as i64, parts as i64, part as i64),
            None => (-1, 1, 0),
        };
        let mut r = [0; UnitField::COUNT];
        r[UnitField::Seq] = self.seq as i64;
        r[UnitField::KvHead] = self.kv_head as i64;
        r[UnitField::Token] = self.token as i64;
        r[UnitField::Tokens] = self.tokens as i64;
        r[UnitField::Head] = self.head as i64;
        r[UnitField::Heads] = self.heads as i64;
        r[UnitField::KeyStart] = self.keys.start as i64;
        r[UnitField::KeyEnd] = self.keys.end as i64;
        r[UnitField::PartBase] = base;
        r[UnitField::Parts] = parts;
        r[UnitField::Part] = part;
        r
    }
}

/// The work of a call of `config` over `md` (validated): `block_size` is the cache's when the
/// keys are read from one, `has_new_kv` whether calls carry key/value tensors, `detached` the
/// sequences that read the call's private cache, `split` how decode units are split.
pub(crate) fn build(
    config: &AttentionConfig,
    md: &AttentionMetadata,
    block_size: Option<usize>,
    has_new_kv: bool,
    detached: Option<&Detached>,
    split: Split,
) -> Work {
    let attn_type = config.attn_type();
    let key_map = KeyMap::new(md, attn_type, block_size, has_new_kv);
    let cross = attn_type == AttnType::EncoderDecoder;
    let group = config.num_queries_per_kv();
    let mut work = Work::default();
    let (mut decode, mut prefill) = (Vec::new(), Vec::new());
    // Prefill units come in groups of kv heads whose keys and values fit in a part of the L2
    // cache (`L2_GROUP_BYTES`), so that the thread blocks running at once re-read keys and
    // values from L2 rather than from memory (each unit of a long causal prompt reads its kv
    // head's keys from the start).
    let l2_rows = (L2_GROUP_BYTES / (4 * config.head_size())).max(1);
    let (mut l2_group, mut group_rows) = (0, 0);
    // Where sequence s's encoder tokens start among the call's key/value rows.
    let mut encoder_start = 0;
    for s in 0..md.num_seqs() {
        let tokens = md.query_range(s);
        let n = key_map.num_positions(s);
        let first_pos = query_position(attn_type, md.seq_lens[s] as usize, tokens.len(), 0);
        let private = detached.and_then(|d| d.table(s));
        let key_base = match block_size {
            Some(b) => {
                let table = match (private, &md.encoder) {
                    (Some(table), _) => table,
                    (None, Some(enc)) if cross => enc.cross_block_tables.row(s),
                    (None, _) => md.block_tables.row(s),
                };
                let start = work.tables.len();
                work.tables
                    .extend(table[..n.div_ceil(b)].iter().map(|&x| x as i64));
                start
            }
            None if cross => encoder_start,
            None => tokens.start,
        };
        let mut record = [0; SeqField::COUNT];
        record[SeqField::QueryStart] = tokens.start;
        record[SeqField::Keys] = n;
        record[SeqField::FirstPos] = first_pos;
        record[SeqField::KeyBase] = key_base;
        work.seqs.extend(record.map(|x| x as i64));
        if cross {
            encoder_start += n;
        }
        let keys_of = |m: usize| allowed_keys(attn_type, config.sliding_window(), first_pos + m, n);
        for kv_head in 0..config.num_kv_heads() {
            if tokens.len() == 1 {
                for head in (0..group).step_by(DECODE_ROWS) {
                    decode.push(Unit {
                        seq: s,
                        kv_head,
                        token: 0,
                        tokens: 1,
                        head,
                        heads: DECODE_ROWS.min(group - head),
                        keys: keys_of(0),
                        split: None,
                        private: private.is_some(),
                    });
                }
                continue;
            }
            // This kv head's keys join the current L2 group, or open the next one.
            if group_rows > 0 && group_rows + n > l2_rows {
                l2_group += 1;
                group_rows = 0;
            }
            group_rows += n;
            let heads = group.min(PREFILL_ROWS);
            let per_unit = PREFILL_ROWS / heads;
            for head in (0..group).step_by(heads) {
                for token in (0..tokens.len()).step_by(per_unit) {
                    let last = (token + per_unit).min(tokens.len()) - 1;
                    let (a, b) = (keys_of(token), keys_of(last));
                    prefill.push((
                        l2_group,
                        Unit {
                            seq: s,
                            kv_head,
                            token,
                            tokens: last + 1 - token,
                            head,
                            heads: heads.min(group - head),
                            keys: a.start.min(b.start)..a.end.max(b.end),
                            split: None,
                            private: private.is_some(),
                        },
                    ));
                }
            }
        }
    }
    let blocks = decode.len() + prefill.len();
    // The detached sequences' units last: they run in a launch of their own.
    decode.sort_by_key(|u| u.private);
    for unit in decode {
        let len = unit.keys.len();
        let auto = |sm_count| {
            let parts = len
                .div_ceil(MIN_PARTITION_KEYS)
                .min(max_parts(blocks, sm_count));
            if parts > 1 {
                // Rounding the partitions up to the alignment may leave fewer.
                len.div_ceil(len.div_ceil(parts).next_multiple_of(PARTITION_ALIGN))
            } else {
                1
            }
        };
        // Records, and the partitions among them that hold keys.
        let (records, used) = match split {
            Split::Auto { sm_count } => {
                let parts = auto(sm_count);
                (parts, parts)
            }
            Split::Fixed { parts, sm_count } => {
                let records = parts.max(1);
                (records, auto(sm_count).min(records))
            }
        };
        if unit.private {
            work.private_decode += records;
        }
        if records == 1 {
            work.decode.extend(unit.record());
            continue;
        }
        let step = len.div_ceil(used).next_multiple_of(PARTITION_ALIGN);
        let base = work.num_partials;
        work.num_partials += unit.heads * records;
        for part in 0..records {
            // The records past `used` are empty; with one partition used, the first writes the
            // rows itself.
            let start = (unit.keys.start + part * step).min(unit.keys.end);
            let split = Unit {
                keys: start..(start + step).min(unit.keys.end),
                split: (used > 1 || part > 0).then_some((base, records, part)),
                ..unit.clone()
            };
            work.decode.extend(split.record());
        }
        let token = md.query_range(unit.seq).start;
        for r in 0..unit.heads {
            let head = unit.kv_head * group + unit.head + r;
            let mut merge = [0; MergeField::COUNT];
            merge[MergeField::Token] = token;
            merge[MergeField::Head] = head;
            merge[MergeField::First] = base + r * records;
            // 0: the row is the first partition's, written whole (the merge is idle).
            merge[MergeField::Count] = if used > 1 { used } else { 0 };
            work.merges.extend(merge.map(|x| x as i64));
        }
    }
    // Within an L2 group, longest units first: thread blocks start in grid order, so the short
    // units fill the gaps the long ones leave at the end instead of the long ones running alone
    // in a last wave (a causal prompt's units grow from 1 key tile to its whole length).
    // (The detached sequences' units after all the others: a launch of their own.)
    prefill.sort_by_key(|(l2_group, unit)| {
        (unit.private, *l2_group, std::cmp::Reverse(unit.keys.len()))
    });
    for (_, unit) in prefill {
        work.private_prefill += unit.private as usize;
        work.prefill.extend(unit.record());
    }
    work
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KvCacheDtype;
    use crate::kv_cache::BlockId;
    use crate::metadata::{MetadataBuilder, SequenceDesc};

    fn config(heads: usize, kv_heads: usize, window: Option<usize>) -> AttentionConfig {
        AttentionConfig::builder(heads, 64)
            .num_kv_heads(kv_heads)
            .sliding_window(window)
            .kv_cache_dtype(KvCacheDtype::Auto)
            .build()
            .unwrap()
    }

    fn units(records: &[i64]) -> Vec<&[i64]> {
        records.chunks(UnitField::COUNT).collect()
    }

    /// Every (token, head) row of the call is written exactly once: by an unsplit unit, or by
    /// the merge of its partitions, whose key ranges tile the row's keys.
    fn check_cover(work: &Work, md: &AttentionMetadata, cfg: &AttentionConfig) {
        let (h, group) = (cfg.num_heads(), cfg.num_queries_per_kv());
        let mut written = vec![0; md.num_tokens() * h];
        let mut parts: std::collections::HashMap<usize, Vec<Range<i64>>> = Default::default();
        for u in units(&work.decode).into_iter().chain(units(&work.prefill)) {
            let start = md.query_start_loc[u[0] as usize] as usize + u[2] as usize;
            for r in 0..(u[3] * u[5]) as usize {
                let token = start + r / u[5] as usize;
                let head = u[1] as usize * group + u[4] as usize + r % u[5] as usize;
                if u[8] < 0 {
                    written[token * h + head] += 1;
                } else {
                    let slot = (u[8] + r as i64 * u[9] + u[10]) as usize;
                    parts.entry(slot).or_default().push(u[6]..u[7]);
                }
            }
        }
        for m in work.merges.chunks(MergeField::COUNT) {
            if m[3] == 0 {
                continue;
            }
            written[(m[0] * h as i64 + m[1]) as usize] += 1;
            let mut ranges: Vec<Range<i64>> = (m[2]..m[2] + m[3])
                .flat_map(|slot| parts.remove(&(slot as usize)).unwrap())
                .collect();
            ranges.sort_by_key(|r| r.start);
            assert!(
                ranges.windows(2).all(|w| w[0].end == w[1].start),
                "{ranges:?}"
            );
        }
        assert!(
            parts.values().flatten().all(|keys| keys.is_empty()),
            "partials with keys nobody merges: {parts:?}"
        );
        assert!(written.iter().all(|&w| w == 1), "{written:?}");
    }

    #[test]
    fn long_decodes_are_split_and_merged() {
        let cfg = config(8, 2, None);
        let md = MetadataBuilder::new(16)
            .push(SequenceDesc::prompt(5, 20, &[0, 1]))
            .push(SequenceDesc::decode(2999, &(2..190).collect::<Vec<_>>()))
            .push(SequenceDesc::decode(99, &(190..197).collect::<Vec<_>>()))
            .build()
            .unwrap();
        let wide = Split::Auto { sm_count: 132 };
        let work = build(&cfg, &md, Some(16), true, None, wide);
        check_cover(&work, &md, &cfg);
        let decode = units(&work.decode);
        // The long decode: split for both kv heads, partitions of >= 256 keys, 32-aligned.
        let split: Vec<_> = decode.iter().filter(|u| u[8] >= 0).collect();
        assert!(split.len() >= 4, "{split:?}");
        assert!(split
            .iter()
            .all(|u| u[0] == 1 && u[7] - u[6] >= 32 && u[6] % 32 == 0));
        // The short decode is not split.
        assert!(decode.iter().any(|u| u[0] == 2 && u[8] < 0));
        assert_eq!(work.num_partials, split.len() * 4);
        // Compact tables: ceil(25/16) + ceil(3000/16) + ceil(100/16) entries.
        assert_eq!(work.tables.len(), 2 + 188 + 7);
        // A full GPU gets no split.
        let busy = build(&cfg, &md, Some(16), true, None, Split::Auto { sm_count: 1 });
        assert!(busy.merges.is_empty() && busy.num_partials == 0);
        check_cover(&busy, &md, &cfg);
    }

    #[test]
    fn a_split_grid_stays_within_one_wave() {
        // 8 decodes of 16384 keys, 8 kv heads: 64 units on 132 x 2 places. Split in 5 they
        // would run as two waves of a fifth of the keys; in 4, as one of a quarter.
        let cfg = config(32, 8, None);
        let tables: Vec<Vec<BlockId>> = (0..8)
            .map(|i| (i * 1024..(i + 1) * 1024).collect())
            .collect();
        let mut b = MetadataBuilder::new(16);
        for blocks in &tables {
            b.push(SequenceDesc::decode(16383, blocks));
        }
        let md = b.build().unwrap();
        let wide = Split::Auto { sm_count: 132 };
        let work = build(&cfg, &md, Some(16), true, None, wide);
        check_cover(&work, &md, &cfg);
        let decode = units(&work.decode);
        assert_eq!(decode.len(), 64 * 4);
        assert!(decode.iter().all(|u| u[7] - u[6] == 4096), "{decode:?}");
        assert_eq!(graph_parts(64, 16384, 132), 4);
        // Fewer units than places but more than half: no split (two waves of halves would
        // take as long as one of wholes).
        assert_eq!(max_parts(200, 132), 1);
        assert_eq!(max_parts(8, 132), 33);
    }

    #[test]
    fn fixed_splits_keep_the_record_counts_and_split_as_auto_does() {
        // A graph plan's steps: the same batch, sequences of other lengths (one empty of
        // keys but its new token, one shorter than a partition per part).
        let cfg = config(8, 2, None);
        let step = |lens: [usize; 3]| {
            let tables: Vec<Vec<BlockId>> = (lens.iter().enumerate())
                .map(|(i, n)| {
                    (i * 200..i * 200 + n.div_ceil(16))
                        .map(|x| x as BlockId)
                        .collect()
                })
                .collect();
            let mut b = MetadataBuilder::new(16);
            for (n, blocks) in lens.into_iter().zip(&tables) {
                b.push(SequenceDesc::decode(n - 1, blocks));
            }
            b.build().unwrap()
        };
        // The partitions that hold keys, or write their rows: (seq, kv head, head, keys,
        // whether the unit writes its rows itself).
        let used = |work: &Work| -> Vec<(i64, i64, i64, Range<i64>, bool)> {
            (units(&work.decode).into_iter())
                .filter(|u| u[6] < u[7] || u[8] < 0)
                .map(|u| (u[0], u[1], u[4], u[6]..u[7], u[8] < 0))
                .collect()
        };
        // 6 units of up to 2000 keys: 8 partitions each.
        let parts = graph_parts(6, 2000, 132);
        assert_eq!(parts, 8);
        let fixed = Split::Fixed {
            parts,
            sm_count: 132,
        };
        let mut shapes = Vec::new();
        for lens in [[1, 40, 1000], [2000, 3, 700], [1, 1, 1]] {
            let md = step(lens);
            let work = build(&cfg, &md, Some(16), true, None, fixed);
            check_cover(&work, &md, &cfg);
            shapes.push((work.decode.len(), work.merges.len(), work.num_partials));
            let auto = build(
                &cfg,
                &md,
                Some(16),
                true,
                None,
                Split::Auto { sm_count: 132 },
            );
            assert_eq!(used(&work), used(&auto), "{lens:?}");
        }
        assert!(shapes.iter().all(|&s| s == shapes[0]), "{shapes:?}");
        assert_eq!(
            shapes[0],
            (
                3 * 2 * 8 * UnitField::COUNT,
                3 * 8 * MergeField::COUNT,
                3 * 8 * 8
            )
        );
        // Contexts within one partition: every unit writes its rows, every merge is idle.
        let short = build(&cfg, &step([200, 1, 256]), Some(16), true, None, fixed);
        assert!(short.merges.chunks(MergeField::COUNT).all(|m| m[3] == 0));
        assert_eq!(units(&short.decode).iter().filter(|u| u[8] < 0).count(), 6);
        assert_eq!(graph_parts(6, 4096, 132), 16);
        assert_eq!(graph_parts(6, 100, 132), 1);
        assert_eq!(graph_parts(1000, 4096, 132), 1);
    }

    #[test]
    fn prefill_units_come_in_l2_groups_of_kv_heads_longest_first() {
        // D = 64: 65536 key rows per group, so four kv heads of a 16384-token prompt each.
        let cfg = config(8, 8, None);
        let md = MetadataBuilder::new(4096)
            .push(SequenceDesc::prompt(0, 16384, &[0, 1, 2, 3]))
            .build()
            .unwrap();
        let work = build(
            &cfg,
            &md,
            Some(4096),
            true,
            None,
            Split::Auto { sm_count: 132 },
        );
        let all = units(&work.prefill);
        assert_eq!(all.len(), 8 * 128);
        for (half, heads) in all.chunks(4 * 128).zip([0..4, 4..8]) {
            assert!(half.iter().all(|u| heads.contains(&u[1])), "{heads:?}");
            let lens: Vec<i64> = half.iter().map(|u| u[7] - u[6]).collect();
            assert!(lens.windows(2).all(|w| w[0] >= w[1]), "{lens:?}");
        }
    }

    #[test]
    fn prefill_units_cover_their_rows_keys() {
        // Groups of 3 (5 tokens per unit), 20 of them (16 heads, then 4), one window.
        for (heads, kv_heads) in [(6, 2), (20, 1), (32, 2)] {
            let cfg = config(heads, kv_heads, Some(7));
            let md = MetadataBuilder::new(4)
                .push(SequenceDesc::prompt(9, 23, &[0, 1, 2, 3, 4, 5, 6, 7]))
                .push(SequenceDesc::prompt(0, 2, &[8]))
                .push(SequenceDesc::decode(0, &[9]))
                .build()
                .unwrap();
            let work = build(&cfg, &md, Some(4), true, None, Split::Auto { sm_count: 1 });
            check_cover(&work, &md, &cfg);
            for u in units(&work.prefill) {
                assert!((u[3] * u[5]) as usize <= PREFILL_ROWS);
                // The union of the tokens' windows: [first - 6, last + 1) in positions.
                let ctx = md.context_lens[u[0] as usize] as i64;
                let (first, last) = (ctx + u[2], ctx + u[2] + u[3] - 1);
                assert_eq!(u[6]..u[7], (first - 6).max(0)..last + 1);
            }
            // (All these kv heads' keys fit in one L2 group.)
            let lens: Vec<i64> = units(&work.prefill).iter().map(|u| u[7] - u[6]).collect();
            assert!(
                lens.windows(2).all(|w| w[0] >= w[1]),
                "longest first: {lens:?}"
            );
            assert!(units(&work.decode)
                .iter()
                .all(|u| u[5] as usize <= DECODE_ROWS));
        }
    }

    #[test]
    fn sequences_say_where_their_keys_are() {
        let cfg = config(4, 2, None);
        let mut md = MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(6, 3, &[3, 1, 0]))
            .push(SequenceDesc::decode(1, &[2]))
            .build()
            .unwrap();
        let work = build(&cfg, &md, Some(4), true, None, Split::Auto { sm_count: 1 });
        assert_eq!(work.seqs, [0, 9, 6, 0, 3, 2, 1, 3]);
        assert_eq!(work.tables, [3, 1, 0, 2]);
        assert_eq!((work.private_decode, work.private_prefill), (0, 0));
        // A new token with slot -1: the first sequence reads its private cache's blocks, in
        // units of their own at the end of the prefill section.
        md.slot_mapping[1] = -1;
        let detached = Detached::plan(&cfg, &md, Some(4), true).unwrap().unwrap();
        let split = Split::Auto { sm_count: 1 };
        let work = build(&cfg, &md, Some(4), true, Some(&detached), split);
        assert_eq!(work.seqs, [0, 9, 6, 0, 3, 2, 1, 3]);
        assert_eq!(work.tables, [0, 1, 2, 2]);
        // The prompt's units (all of the prefill section) are the private ones.
        assert_eq!(work.private_decode, 0);
        assert_eq!(work.private_prefill, units(&work.prefill).len());
        // A decode with slot -1 among ordinary ones: its units last.
        let mut md = MetadataBuilder::new(4)
            .push(SequenceDesc::decode(5, &[3, 1]))
            .push(SequenceDesc::decode(2, &[2]))
            .push(SequenceDesc::decode(6, &[0, 4]))
            .build()
            .unwrap();
        md.slot_mapping[0] = -1;
        let detached = Detached::plan(&cfg, &md, Some(4), true).unwrap().unwrap();
        let work = build(&cfg, &md, Some(4), true, Some(&detached), split);
        let decode = units(&work.decode);
        let first_private = decode.len() - work.private_decode;
        assert!(work.private_decode > 0);
        assert!(decode[..first_private].iter().all(|u| u[0] != 0));
        assert!(decode[first_private..].iter().all(|u| u[0] == 0));
        // Without a cache, the keys are the inputs' rows of each sequence.
        let md = MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(0, 3, &[]))
            .push(SequenceDesc::prompt(0, 2, &[]))
            .build()
            .unwrap();
        let work = build(&cfg, &md, None, true, None, Split::Auto { sm_count: 1 });
        assert_eq!(work.seqs, [0, 3, 0, 0, 3, 2, 0, 3]);
        assert!(work.tables.is_empty());
    }
}
