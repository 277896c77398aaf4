//! Sequences with a new token whose slot is -1: a key of its own call that is not written
//! (docs/semantics.md, "Where the keys come from"; vLLM gives a sliding-window prompt's tokens
//! older than the window slot -1, and a profiling run every token). The kernels read each
//! sequence's keys from one paged buffer, so such a sequence is *detached*: it reads every key
//! from a private cache that the call fills after its write, with the context blocks its
//! queries can see copied from the cache and every one of its new tokens written through the
//! cache's own write (an fp8 cache's codes are the same). The private cache has the cache's
//! geometry; this plan of it is made once per step, and each backend fills it per call.

use std::ops::Range;

use crate::config::{AttentionConfig, AttnType};
use crate::error::{Error, Result};
use crate::kv_cache::{swap_blocks, BlockId, KvCache, KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::semantics::{allowed_keys, query_position, KeyMap};
use crate::step::KvPair;

/// The detached sequences of one step and the private cache they read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Detached {
    /// Per sequence of the step: where its private block table lies in `tables` (`None`: it
    /// reads the cache).
    rows: Vec<Option<Range<usize>>>,
    /// The detached sequences' private block tables, `ceil(n / B)` entries each for `n` key
    /// positions (entries of blocks no query sees name any private block).
    tables: Vec<BlockId>,
    /// (cache block, private block): the context blocks the detached sequences' queries see,
    /// copied after the call's write.
    pub(crate) copies: Vec<(BlockId, BlockId)>,
    /// Per key/value token of the call: its slot in the private cache, or -1 (a token of a
    /// sequence that reads the cache, or one no query sees).
    pub(crate) slots: Vec<i64>,
    /// Blocks of the private cache.
    pub(crate) num_blocks: usize,
}

impl Detached {
    /// The detached sequences of a call of `config` over `md` (validated) with a cache of
    /// `block_size` (`None`: no cache, nothing detached); `has_new_kv`: whether calls carry
    /// key/value tensors. `None` when every new token is written.
    pub(crate) fn plan(
        config: &AttentionConfig,
        md: &AttentionMetadata,
        block_size: Option<usize>,
        has_new_kv: bool,
    ) -> Result<Option<Detached>> {
        let Some(b) = block_size else {
            return Ok(None);
        };
        let attn_type = config.attn_type();
        let key_map = KeyMap::new(md, attn_type, block_size, has_new_kv);
        let mut detached = Detached {
            rows: vec![None; md.num_seqs()],
            slots: vec![-1; key_map.slot_mapping().len()],
            ..Detached::default()
        };
        let too_many = || {
            Error::unsupported(
                "attention",
                "a private cache of more than 2^31 blocks for the sequences with slot -1 tokens",
            )
        };
        for s in (0..md.num_seqs()).filter(|&s| key_map.has_unwritten_key(s)) {
            let n = key_map.num_positions(s);
            let (new, first_token) = key_map.new_tokens(s);
            let queries = md.query_range(s).len();
            // The first key any query sees (a later query's window starts no earlier): the
            // blocks before it are never read.
            let first_query = query_position(attn_type, md.seq_lens[s] as usize, queries, 0);
            let seen = allowed_keys(attn_type, config.sliding_window(), first_query, n).start;
            let (skipped, blocks) = (seen / b, n.div_ceil(b));
            let base = detached.num_blocks;
            detached.num_blocks = base + (blocks - skipped);
            let private = |block: usize| {
                BlockId::try_from(base + block.saturating_sub(skipped)).map_err(|_| too_many())
            };
            let row = detached.tables.len()..detached.tables.len() + blocks;
            for block in 0..blocks {
                detached.tables.push(private(block)?);
            }
            detached.rows[s] = Some(row);
            // Context exists for the decoder only (a cross-attention prefill's keys are all
            // new).
            if attn_type == AttnType::Decoder {
                let context = md.block_tables.row(s)[..new.start.div_ceil(b)].iter();
                for (block, &cached) in context.enumerate().skip(skipped) {
                    detached.copies.push((cached, private(block)?));
                }
            }
            for j in new.clone().filter(|&j| j >= skipped * b) {
                let block = private(j / b)? as i64;
                detached.slots[first_token + j - new.start] = block * b as i64 + (j % b) as i64;
            }
        }
        BlockId::try_from(detached.num_blocks).map_err(|_| too_many())?;
        Ok((!detached.tables.is_empty()).then_some(detached))
    }

    /// Sequence `s`'s private block table, if it is detached.
    pub(crate) fn table(&self, s: usize) -> Option<&[BlockId]> {
        let row = self.rows.get(s)?.clone()?;
        Some(&self.tables[row])
    }

    /// The private cache's geometry: `cache`'s with this plan's blocks.
    pub(crate) fn spec(&self, cache: &KvCacheSpec) -> KvCacheSpec {
        cache.with_num_blocks(self.num_blocks)
    }

    /// The private cache in host memory, filled from `cache` (after the call's write) and the
    /// call's key/value tensors `kv`, written with the layer's fp8 `scales`.
    pub(crate) fn fill_host(
        &self,
        cache: &KvCache,
        kv: KvPair<'_>,
        scales: KvScales,
    ) -> Result<KvCache> {
        let mut private = KvCache::zeros(self.spec(cache.spec()), cache.layout())?;
        swap_blocks(cache, &mut private, &self.copies)?;
        private.write_checked(kv.key, kv.value, &self.slots, scales)?;
        Ok(private)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::BlockTables;

    fn window_config(window: usize) -> AttentionConfig {
        AttentionConfig::builder(2, 8)
            .num_kv_heads(1)
            .sliding_window(Some(window))
            .build()
            .unwrap()
    }

    /// One prefill of `len` tokens after `context` cached ones.
    fn prompt(
        len: usize,
        context: usize,
        slots: Vec<i64>,
        table: Vec<BlockId>,
    ) -> AttentionMetadata {
        let query = (len - context) as i32;
        let tables = BlockTables::from_rows(&[table]);
        AttentionMetadata::from_parts(1, vec![0, query], vec![len as i32], slots, tables, None)
            .unwrap()
    }

    /// vLLM's slots for a window-32 prompt of 100 tokens (block size 16, blocks reused
    /// cyclically): positions 0..68 get -1.
    #[test]
    fn a_windowed_prompt_reads_only_the_blocks_its_window_sees() {
        let config = window_config(32);
        let slots: Vec<i64> = (0..100)
            .map(|p| {
                if p < 68 {
                    -1
                } else {
                    [5, 9][(p / 16) % 2] * 16 + (p % 16) as i64
                }
            })
            .collect();
        let table: Vec<BlockId> = (0..7).map(|i| [5, 9][i % 2] as BlockId).collect();
        let md = prompt(100, 0, slots, table);
        let d = Detached::plan(&config, &md, Some(16), true)
            .unwrap()
            .unwrap();
        // The first query (position 0) sees from 0: every block.
        assert_eq!(d.num_blocks, 7);
        assert_eq!(d.table(0).unwrap(), &[0, 1, 2, 3, 4, 5, 6]);
        assert!(d.copies.is_empty());
        assert_eq!(d.slots, (0..100).collect::<Vec<i64>>());
    }

    /// A chunk of 4 tokens after 60 of context, window 8: only blocks from position 53 on.
    #[test]
    fn a_windowed_chunk_copies_the_context_it_sees() {
        let config = window_config(8);
        let table: Vec<BlockId> = vec![10, 11, 12, 13];
        let md = prompt(64, 60, vec![-1, 13 * 16 + 13, 13 * 16 + 14, -1], table);
        let d = Detached::plan(&config, &md, Some(16), true)
            .unwrap()
            .unwrap();
        assert_eq!(d.num_blocks, 1);
        assert_eq!(d.table(0).unwrap(), &[0, 0, 0, 0]);
        assert_eq!(d.copies, vec![(13, 0)]);
        assert_eq!(d.slots, vec![12, 13, 14, 15]);
        // Without slot -1 nothing is detached.
        let md = prompt(64, 60, vec![220, 221, 222, 223], vec![10, 11, 12, 13]);
        assert_eq!(Detached::plan(&config, &md, Some(16), true).unwrap(), None);
    }
}
