//! [`AttentionMetadata`]: the flat description of one batch (vLLM's field names), its
//! validation, and [`MetadataBuilder`], which derives it from per-sequence descriptions.

use std::ops::Range;

use crate::config::AttnType;
use crate::error::{ensure, Error, Result};
use crate::kv_cache::{check_distinct_slots, BlockId, KvCacheSpec};

/// Per-sequence block tables: row `s` lists the physical blocks of sequence `s`, padded to a
/// common width (vLLM pads with block 0; padding past a sequence's length is never read).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockTables {
    num_rows: usize,
    width: usize,
    data: Vec<BlockId>,
}

impl BlockTables {
    /// A `[num_rows, width]` table from row-major data.
    pub fn new(num_rows: usize, width: usize, data: Vec<BlockId>) -> Result<Self> {
        let elems = num_rows.checked_mul(width);
        ensure(
            elems == Some(data.len()),
            || "block_tables element count".into(),
            data.len(),
            || format!("{num_rows} rows * {width} columns"),
        )?;
        Ok(BlockTables {
            num_rows,
            width,
            data,
        })
    }

    /// A table from ragged rows (`Vec<BlockId>`s or `&[BlockId]`s), padded with 0 to the
    /// longest.
    pub fn from_rows<R: AsRef<[BlockId]>>(rows: &[R]) -> Self {
        let width = rows.iter().map(|r| r.as_ref().len()).max().unwrap_or(0);
        let mut data = Vec::with_capacity(rows.len() * width);
        for row in rows {
            let row = row.as_ref();
            data.extend_from_slice(row);
            data.resize(data.len() + width - row.len(), 0);
        }
        BlockTables {
            num_rows: rows.len(),
            width,
            data,
        }
    }

    /// Number of rows (sequences).
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }
    /// Entries per row.
    pub fn width(&self) -> usize {
        self.width
    }
    /// Row `s`.
    pub fn row(&self, s: usize) -> &[BlockId] {
        &self.data[s * self.width..(s + 1) * self.width]
    }
    /// All entries, row-major.
    pub fn as_slice(&self) -> &[BlockId] {
        &self.data
    }
}

/// The cross-attention part of the metadata (encoder-decoder models).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EncoderMetadata {
    /// Encoder tokens per sequence.
    pub encoder_seq_lens: Vec<i32>,
    /// Blocks of each sequence's encoder K/V in the cross cache.
    pub cross_block_tables: BlockTables,
    /// Cross-cache slot of each encoder token in this call's key/value (empty when the call
    /// carries no encoder key/value, i.e. at decode).
    pub cross_slot_mapping: Vec<i64>,
}

/// One batch: S sequences, prefills first, then decodes (one query token each); T query tokens
/// in that order. Field names and meanings are vLLM's.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttentionMetadata {
    /// Number of prefill sequences (the first ones).
    pub num_prefills: usize,
    /// Query tokens of the prefill sequences.
    pub num_prefill_tokens: usize,
    /// Query tokens of the decode sequences (= their number).
    pub num_decode_tokens: usize,
    /// Cache slot of each new key/value token; -1 = do not write (the token is still a key of
    /// its own call: docs/semantics.md).
    pub slot_mapping: Vec<i64>,
    /// `[S+1]` cumulative query lengths.
    pub query_start_loc: Vec<i32>,
    /// `[S]` keys per sequence: context + new tokens.
    pub seq_lens: Vec<i32>,
    /// `[S]` tokens already in the cache before this call: `seq_len - query_len`.
    pub context_lens: Vec<i32>,
    /// `[S, M]` physical blocks of each sequence.
    pub block_tables: BlockTables,
    /// Longest query length.
    pub max_query_len: usize,
    /// Longest seq_len.
    pub max_seq_len: usize,
    /// Cross-attention fields (encoder-decoder only).
    pub encoder: Option<EncoderMetadata>,
    /// The block size the block tables and slots were computed for, when known (the builder
    /// records it): a plan checks it against the cache's.
    pub block_size: Option<usize>,
}

impl AttentionMetadata {
    /// Builds metadata from the stored fields of a batch and derives the rest
    /// (`num_prefill_tokens`, `num_decode_tokens`, `context_lens`, maxima).
    pub fn from_parts(
        num_prefills: usize,
        query_start_loc: Vec<i32>,
        seq_lens: Vec<i32>,
        slot_mapping: Vec<i64>,
        block_tables: BlockTables,
        encoder: Option<EncoderMetadata>,
    ) -> Result<Self> {
        check_cumulative(&query_start_loc)?;
        let num_seqs = query_start_loc.len() - 1;
        ensure(
            seq_lens.len() == num_seqs,
            || "metadata.seq_lens.len()".into(),
            seq_lens.len(),
            || format!("{num_seqs} (query_start_loc.len() - 1)"),
        )?;
        ensure(
            num_prefills <= num_seqs,
            || "metadata.num_prefills".into(),
            num_prefills,
            || format!("at most the number of sequences, {num_seqs}"),
        )?;
        let query_lens: Vec<i32> = query_start_loc.windows(2).map(|w| w[1] - w[0]).collect();
        let num_tokens = *query_start_loc.last().unwrap() as usize;
        let num_prefill_tokens = query_start_loc[num_prefills] as usize;
        Ok(AttentionMetadata {
            num_prefills,
            num_prefill_tokens,
            num_decode_tokens: num_tokens - num_prefill_tokens,
            context_lens: seq_lens
                .iter()
                .zip(&query_lens)
                // Saturating: a negative seq_len is refused by `validate`, never a panic here.
                .map(|(l, n)| l.saturating_sub(*n))
                .collect(),
            max_query_len: query_lens.iter().copied().max().unwrap_or(0) as usize,
            max_seq_len: seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            encoder,
            block_size: None,
        })
    }

    /// Number of sequences (S).
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Number of query tokens (T).
    pub fn num_tokens(&self) -> usize {
        self.num_prefill_tokens + self.num_decode_tokens
    }

    /// The query tokens of sequence `s`.
    pub fn query_range(&self, s: usize) -> Range<usize> {
        self.query_start_loc[s] as usize..self.query_start_loc[s + 1] as usize
    }

    /// Start of sequence `s`'s encoder tokens in the key/value tensors of an encoder-decoder call.
    pub fn encoder_token_start(&self, s: usize) -> usize {
        let lens = &self
            .encoder
            .as_ref()
            .expect("encoder metadata")
            .encoder_seq_lens;
        lens[..s].iter().map(|&l| l as usize).sum()
    }

    /// Checks every field for a call of `attn_type` with `num_tokens` queries, `num_kv_tokens`
    /// keys/values (None when absent) and optionally a cache.
    pub fn validate(
        &self,
        attn_type: AttnType,
        num_tokens: usize,
        num_kv_tokens: Option<usize>,
        cache: Option<&KvCacheSpec>,
    ) -> Result<()> {
        ensure(
            cache.is_none() || attn_type.uses_cache(),
            || "kv_cache".into(),
            "given",
            || format!("none: attn_type {attn_type} never uses a KV cache"),
        )?;
        self.check_lengths(attn_type, num_tokens)?;
        // Cross-attention fields given to a layer that reads none would be silently ignored.
        ensure(
            self.encoder.is_none() || attn_type == AttnType::EncoderDecoder,
            || "metadata.encoder".into(),
            "set",
            || format!("none for attn_type {attn_type} (only encoder_decoder reads it)"),
        )?;
        match attn_type {
            AttnType::Decoder => self.check_decoder(num_kv_tokens, cache),
            AttnType::Encoder | AttnType::EncoderOnly => {
                require_kv(num_kv_tokens, num_tokens, attn_type)
            }
            AttnType::EncoderDecoder => self.check_cross(num_kv_tokens, cache),
        }
    }

    fn check_lengths(&self, attn_type: AttnType, num_tokens: usize) -> Result<()> {
        check_cumulative(&self.query_start_loc)?;
        let derived = Self::from_parts(
            self.num_prefills,
            self.query_start_loc.clone(),
            self.seq_lens.clone(),
            Vec::new(),
            BlockTables::default(),
            None,
        )?;
        for (field, have, want) in [
            (
                "num_prefill_tokens",
                self.num_prefill_tokens,
                derived.num_prefill_tokens,
            ),
            (
                "num_decode_tokens",
                self.num_decode_tokens,
                derived.num_decode_tokens,
            ),
            ("max_query_len", self.max_query_len, derived.max_query_len),
            ("max_seq_len", self.max_seq_len, derived.max_seq_len),
        ] {
            ensure(
                have == want,
                || format!("metadata.{field}"),
                have,
                || format!("{want}, as derived from query_start_loc and seq_lens"),
            )?;
        }
        ensure(
            self.context_lens == derived.context_lens,
            || "metadata.context_lens".into(),
            format!("{:?}", self.context_lens),
            || format!("{:?} (seq_lens - query lengths)", derived.context_lens),
        )?;
        ensure(
            self.num_tokens() == num_tokens,
            || "query.shape[0]".into(),
            num_tokens,
            || format!("{} (query_start_loc[S])", self.num_tokens()),
        )?;
        for s in 0..self.num_seqs() {
            let n = self.query_range(s).len();
            let (len, ctx) = (self.seq_lens[s], self.context_lens[s]);
            ensure(
                len >= 0,
                || format!("metadata.seq_lens[{s}]"),
                len,
                || "a length >= 0".into(),
            )?;
            if s >= self.num_prefills {
                ensure(
                    n == 1,
                    || format!("query length of sequence {s}"),
                    n,
                    || {
                        format!(
                            "1: sequences after the {} prefills are decodes (prefills come first)",
                            self.num_prefills
                        )
                    },
                )?;
            }
            let expected = match attn_type {
                AttnType::Encoder | AttnType::EncoderOnly => ctx == 0,
                _ => ctx >= 0,
            };
            ensure(
                expected,
                || format!("metadata.seq_lens[{s}]"),
                len,
                || match attn_type {
                    AttnType::Encoder | AttnType::EncoderOnly => {
                        format!("the query length {n} (attn_type {attn_type} has no context)")
                    }
                    _ => format!("at least the query length {n}"),
                },
            )?;
        }
        Ok(())
    }

    fn check_decoder(
        &self,
        num_kv_tokens: Option<usize>,
        cache: Option<&KvCacheSpec>,
    ) -> Result<()> {
        let num_tokens = self.num_tokens();
        require_kv(num_kv_tokens, num_tokens, AttnType::Decoder)?;
        let Some(spec) = cache else {
            for (s, &ctx) in self.context_lens.iter().enumerate() {
                ensure(
                    ctx == 0,
                    || format!("metadata.context_lens[{s}]"),
                    ctx,
                    || "0: cached context needs a KV cache".into(),
                )?;
            }
            return Ok(());
        };
        ensure(
            self.slot_mapping.len() == num_tokens,
            || "metadata.slot_mapping.len()".into(),
            self.slot_mapping.len(),
            || format!("the number of tokens, {num_tokens}"),
        )?;
        let tokens = (0..self.num_seqs()).map(|s| {
            let range = self.query_range(s);
            (s, range.start, self.context_lens[s] as usize, range.len())
        });
        check_paged(
            spec,
            "block_tables",
            &self.block_tables,
            &self.seq_lens,
            "slot_mapping",
            &self.slot_mapping,
            tokens,
        )
    }

    fn check_cross(&self, num_kv_tokens: Option<usize>, cache: Option<&KvCacheSpec>) -> Result<()> {
        let enc = self.encoder.as_ref().ok_or_else(|| {
            Error::invalid(
                "metadata.encoder",
                "none",
                "encoder metadata for attn_type encoder_decoder",
            )
        })?;
        ensure(
            enc.encoder_seq_lens.len() == self.num_seqs(),
            || "metadata.encoder_seq_lens.len()".into(),
            enc.encoder_seq_lens.len(),
            || format!("the number of sequences, {}", self.num_seqs()),
        )?;
        for (s, &e) in enc.encoder_seq_lens.iter().enumerate() {
            ensure(
                e >= 0,
                || format!("metadata.encoder_seq_lens[{s}]"),
                e,
                || "a length >= 0".into(),
            )?;
        }
        let total: usize = enc.encoder_seq_lens.iter().map(|&e| e as usize).sum();
        if let Some(tk) = num_kv_tokens {
            ensure(
                tk == total,
                || "key.shape[0]".into(),
                tk,
                || format!("{total}, the sum of encoder_seq_lens"),
            )?;
        }
        let Some(spec) = cache else {
            return ensure(
                num_kv_tokens.is_some(),
                || "key".into(),
                "absent",
                || {
                    "key and value: without a cache, cross-attention reads the encoder's from the inputs".into()
                },
            );
        };
        let tokens: Vec<(usize, usize, usize, usize)> = if num_kv_tokens.is_some() {
            ensure(
                enc.cross_slot_mapping.len() == total,
                || "metadata.cross_slot_mapping.len()".into(),
                enc.cross_slot_mapping.len(),
                || format!("the number of encoder tokens, {total}"),
            )?;
            (0..self.num_seqs())
                .map(|s| {
                    (
                        s,
                        self.encoder_token_start(s),
                        0,
                        enc.encoder_seq_lens[s] as usize,
                    )
                })
                .collect()
        } else {
            ensure(
                enc.cross_slot_mapping.is_empty(),
                || "metadata.cross_slot_mapping.len()".into(),
                enc.cross_slot_mapping.len(),
                || "0: this call carries no encoder key/value to write".into(),
            )?;
            Vec::new()
        };
        check_paged(
            spec,
            "cross_block_tables",
            &enc.cross_block_tables,
            &enc.encoder_seq_lens,
            "cross_slot_mapping",
            &enc.cross_slot_mapping,
            tokens.into_iter(),
        )
    }
}

/// Checks that `query_start_loc` starts at 0 and never decreases.
fn check_cumulative(qsl: &[i32]) -> Result<()> {
    ensure(
        !qsl.is_empty(),
        || "metadata.query_start_loc.len()".into(),
        0,
        || "S + 1 >= 1".into(),
    )?;
    ensure(
        qsl[0] == 0,
        || "metadata.query_start_loc[0]".into(),
        qsl[0],
        || "0".into(),
    )?;
    for (s, w) in qsl.windows(2).enumerate() {
        ensure(
            w[1] >= w[0],
            || format!("metadata.query_start_loc[{}]", s + 1),
            w[1],
            || format!("at least query_start_loc[{s}] = {}", w[0]),
        )?;
    }
    Ok(())
}

fn require_kv(num_kv_tokens: Option<usize>, num_tokens: usize, attn_type: AttnType) -> Result<()> {
    let tk = num_kv_tokens.ok_or_else(|| {
        Error::invalid(
            "key",
            "absent",
            format!("key and value for attn_type {attn_type}"),
        )
    })?;
    ensure(
        tk == num_tokens,
        || "key.shape[0]".into(),
        tk,
        || format!("the number of query tokens, {num_tokens}"),
    )
}

/// Checks a paged view: each sequence's table covers its `lens[s]` positions with blocks inside
/// the cache, and each written token `(s, first token, first position, count)` has slot -1 or
/// exactly the slot its position maps to through the table.
fn check_paged(
    spec: &KvCacheSpec,
    table_field: &str,
    tables: &BlockTables,
    lens: &[i32],
    slot_field: &str,
    slots: &[i64],
    tokens: impl Iterator<Item = (usize, usize, usize, usize)>,
) -> Result<()> {
    let b = spec.block_size;
    ensure(
        tables.num_rows() == lens.len(),
        || format!("metadata.{table_field} rows"),
        tables.num_rows(),
        || format!("the number of sequences, {}", lens.len()),
    )?;
    for (s, &len) in lens.iter().enumerate() {
        let needed = (len as usize).div_ceil(b);
        ensure(
            tables.width() >= needed,
            || format!("metadata.{table_field} width"),
            tables.width(),
            || {
                format!(
                    "at least {needed} blocks for sequence {s} of {len} tokens (block_size {b})"
                )
            },
        )?;
        for (i, &block) in tables.row(s)[..needed].iter().enumerate() {
            ensure(
                block >= 0 && (block as usize) < spec.num_blocks,
                || format!("metadata.{table_field}[{s}][{i}]"),
                block,
                || format!("a block in [0, {}) (num_blocks)", spec.num_blocks),
            )?;
        }
    }
    for (s, first_token, first_pos, count) in tokens {
        for k in 0..count {
            let (t, pos) = (first_token + k, first_pos + k);
            let slot = slots[t];
            let expected = tables.row(s)[pos / b] as i64 * b as i64 + (pos % b) as i64;
            ensure(
                slot == -1 || slot == expected,
                || format!("metadata.{slot_field}[{t}]"),
                slot,
                || {
                    format!(
                    "-1 or {expected}: position {pos} of sequence {s} maps to that slot through {table_field}"
                )
                },
            )?;
        }
    }
    check_distinct_slots(slots, &format!("metadata.{slot_field}"))
}

/// One sequence of a batch, as a scheduler sees it: the tokens already in the cache and the
/// new tokens of this step (at least one), with the sequence's block table borrowed for the
/// step (the builder copies it into the metadata's flat table).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SequenceDesc<'a> {
    /// Tokens already in the cache (prefix-cache hit, earlier chunks or earlier steps).
    pub context_len: usize,
    /// New tokens computed in this step: at least 1 ([`MetadataBuilder::build`] refuses 0).
    pub query_len: usize,
    /// Whether this is a decode step (exactly one new token).
    pub is_decode: bool,
    /// The sequence's physical blocks; empty when no cache is used (slots become -1).
    pub block_table: &'a [BlockId],
    /// The encoder side, for cross-attention.
    pub encoder: Option<EncoderDesc<'a>>,
}

/// The encoder side of a sequence in an encoder-decoder model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncoderDesc<'a> {
    /// Number of encoder tokens (0 allowed: the decoder's queries then see no key).
    pub len: usize,
    /// Blocks of the encoder K/V in the cross cache.
    pub cross_block_table: &'a [BlockId],
}

impl<'a> SequenceDesc<'a> {
    /// A prompt chunk: `new_len` new tokens after `cached_len` tokens already in the cache
    /// (chunked prefill, prefix caching, or a fresh prompt with `cached_len = 0`).
    pub fn prompt(cached_len: usize, new_len: usize, block_table: &'a [BlockId]) -> Self {
        SequenceDesc {
            context_len: cached_len,
            query_len: new_len,
            is_decode: false,
            block_table,
            encoder: None,
        }
    }

    /// A decode step: one new token after `cached_len` tokens already in the cache (the
    /// sequence holds `cached_len + 1` tokens after the step).
    pub fn decode(cached_len: usize, block_table: &'a [BlockId]) -> Self {
        SequenceDesc {
            context_len: cached_len,
            query_len: 1,
            is_decode: true,
            block_table,
            encoder: None,
        }
    }

    /// Attaches an encoder sequence of `len` tokens (cross-attention).
    pub fn with_encoder(mut self, len: usize, cross_block_table: &'a [BlockId]) -> Self {
        self.encoder = Some(EncoderDesc {
            len,
            cross_block_table,
        });
        self
    }
}

/// Derives [`AttentionMetadata`] (slots included) from per-sequence descriptions.
#[derive(Debug, Clone)]
pub struct MetadataBuilder<'a> {
    block_size: usize,
    write_cross_kv: bool,
    seqs: Vec<SequenceDesc<'a>>,
}

impl<'a> MetadataBuilder<'a> {
    /// A builder for `cache`'s block size.
    pub fn for_cache(cache: &KvCacheSpec) -> Self {
        Self::new(cache.block_size)
    }

    /// A builder for caches of `block_size` tokens per block.
    pub fn new(block_size: usize) -> Self {
        MetadataBuilder {
            block_size,
            write_cross_kv: false,
            seqs: Vec::new(),
        }
    }

    /// Adds a sequence (prefills must come before decodes).
    pub fn push(&mut self, seq: SequenceDesc<'a>) -> &mut Self {
        self.seqs.push(seq);
        self
    }

    /// Whether this call carries the encoder key/value (encoder-decoder prefill), so that
    /// `cross_slot_mapping` is filled.
    pub fn write_cross_kv(&mut self, yes: bool) -> &mut Self {
        self.write_cross_kv = yes;
        self
    }

    /// Builds the metadata. Refused: a sequence with no new token (nothing to compute: leave
    /// it out of the step), a decode of other than one, a prefill after a decode, a table too
    /// short for its sequence, lengths past i32.
    pub fn build(&self) -> Result<AttentionMetadata> {
        let b = self.block_size;
        ensure(
            b > 0,
            || "block_size".into(),
            b,
            || "a positive integer".into(),
        )?;
        let num_prefills = self.seqs.iter().take_while(|s| !s.is_decode).count();
        if let Some(i) = self.seqs[num_prefills..].iter().position(|s| !s.is_decode) {
            return Err(Error::invalid(
                format!("sequence {}", num_prefills + i),
                "a prefill after a decode",
                "prefills first, then decodes",
            ));
        }
        let mut qsl = vec![0i32];
        let (mut seq_lens, mut slots) = (Vec::new(), Vec::new());
        for (s, seq) in self.seqs.iter().enumerate() {
            ensure(
                seq.query_len > 0,
                || format!("sequence {s} query_len"),
                seq.query_len,
                || {
                    "at least 1 new token (leave a sequence with nothing to compute out of the step)".into()
                },
            )?;
            ensure(
                !seq.is_decode || seq.query_len == 1,
                || format!("sequence {s} query_len"),
                seq.query_len,
                || "1 for a decode".into(),
            )?;
            let len = seq.context_len.checked_add(seq.query_len);
            let len = to_i32(len, || format!("sequence {s} context_len + query_len"))?;
            let end = (qsl[s] as usize).checked_add(seq.query_len);
            qsl.push(to_i32(end, || format!("tokens up to sequence {s}"))?);
            seq_lens.push(len);
            let len = len as usize;
            slots.extend(slots_of(
                seq.block_table,
                b,
                seq.context_len..len,
                s,
                "block_table",
            )?);
        }
        let has_encoder = self.seqs.iter().filter(|s| s.encoder.is_some()).count();
        let encoder = if has_encoder == 0 {
            None
        } else {
            ensure(
                has_encoder == self.seqs.len(),
                || "sequences with an encoder".into(),
                has_encoder,
                || format!("all {} or none", self.seqs.len()),
            )?;
            let encs: Vec<&EncoderDesc> = self
                .seqs
                .iter()
                .filter_map(|s| s.encoder.as_ref())
                .collect();
            let encoder_seq_lens = encs
                .iter()
                .enumerate()
                .map(|(s, e)| to_i32(Some(e.len), || format!("sequence {s} encoder len")))
                .collect::<Result<Vec<i32>>>()?;
            let mut cross_slots = Vec::new();
            if self.write_cross_kv {
                for (s, e) in encs.iter().enumerate() {
                    cross_slots.extend(slots_of(
                        e.cross_block_table,
                        b,
                        0..e.len,
                        s,
                        "cross_block_table",
                    )?);
                }
            }
            Some(EncoderMetadata {
                encoder_seq_lens,
                cross_block_tables: BlockTables::from_rows(
                    &encs.iter().map(|e| e.cross_block_table).collect::<Vec<_>>(),
                ),
                cross_slot_mapping: cross_slots,
            })
        };
        let tables: Vec<&[BlockId]> = self.seqs.iter().map(|s| s.block_table).collect();
        let mut metadata = AttentionMetadata::from_parts(
            num_prefills,
            qsl,
            seq_lens,
            slots,
            BlockTables::from_rows(&tables),
            encoder,
        )?;
        metadata.block_size = Some(b);
        Ok(metadata)
    }
}

/// Slots of `positions` through `table` (all -1 when the table is empty: no cache).
fn slots_of(
    table: &[BlockId],
    b: usize,
    positions: Range<usize>,
    s: usize,
    field: &str,
) -> Result<Vec<i64>> {
    if table.is_empty() {
        return Ok(vec![-1; positions.len()]);
    }
    let needed = positions.end.div_ceil(b);
    ensure(
        table.len() >= needed,
        || format!("sequence {s} {field}.len()"),
        table.len(),
        || {
            format!(
                "at least {needed} blocks for {} tokens of block_size {b}",
                positions.end
            )
        },
    )?;
    positions
        .map(|p| {
            let block = table[p / b];
            ensure(
                block >= 0,
                || format!("sequence {s} {field}[{}]", p / b),
                block,
                || "a block number >= 0".into(),
            )?;
            // A block number times the block size, plus the offset: a slot that fits in i64
            // (an error otherwise, never a wrapped slot).
            (block as i64)
                .checked_mul(b as i64)
                .and_then(|x| x.checked_add((p % b) as i64))
                .filter(|_| i64::try_from(b).is_ok())
                .ok_or_else(|| {
                    Error::invalid("block_size", b, "a block size whose slots fit in i64")
                })
        })
        .collect()
}

/// `value` as one of the metadata's i32 fields, or an error naming `field` if it is absent (an
/// overflowed sum) or does not fit.
fn to_i32(value: Option<usize>, field: impl FnOnce() -> String) -> Result<i32> {
    value.and_then(|v| i32::try_from(v).ok()).ok_or_else(|| {
        Error::invalid(
            field(),
            value.map_or("an overflowing sum".to_string(), |v| v.to_string()),
            format!("at most {} (the metadata's fields are i32)", i32::MAX),
        )
    })
}
