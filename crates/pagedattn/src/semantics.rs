//! The pieces of the attention contract (`docs/semantics.md`) that every backend mirrors:
//! positions, which keys a sequence has and where they are read, the mask, ALiBi and soft cap.
//! The reference backend is built from exactly these functions.

use std::ops::Range;

use crate::config::AttnType;
use crate::metadata::AttentionMetadata;

/// Absolute position of query `m` (0-based among the sequence's new tokens): decoder and
/// cross-attention queries sit at the end of their sequence (`seq_len - query_len + m`);
/// encoder queries at `m`.
pub fn query_position(attn_type: AttnType, seq_len: usize, query_len: usize, m: usize) -> usize {
    match attn_type {
        AttnType::Encoder | AttnType::EncoderOnly => m,
        AttnType::Decoder | AttnType::EncoderDecoder => seq_len - query_len + m,
    }
}

/// The key positions, among a sequence's `n`, that query position `i` may see: all of them
/// for the non-causal types; for the decoder `j <= i`, and `i - j < W` with a sliding window W
/// (worked out without overflow for any window).
pub fn allowed_keys(
    attn_type: AttnType,
    sliding_window: Option<usize>,
    i: usize,
    n: usize,
) -> Range<usize> {
    if !attn_type.is_causal() {
        return 0..n;
    }
    let end = i.saturating_add(1).min(n);
    let start = sliding_window.map_or(0, |w| i.saturating_add(1).saturating_sub(w));
    start.min(end)..end
}

/// The position ALiBi measures a query's distances from, for a query at position `i` of a
/// sequence with `n` key positions: `i` itself, except for a cross-attention query past every
/// encoder key, which is measured from the last key, `n - 1`. Its bias `-slope * (i - j)` is
/// then `-slope * (n - 1 - j)` plus a constant of the query, which the softmax ignores; the
/// constant itself, `slope` times how far the decoder has run, would push every score of
/// the query to a magnitude where f32 rounds the score away, or overflows it.
pub fn alibi_position(attn_type: AttnType, i: usize, n: usize) -> usize {
    match attn_type {
        AttnType::EncoderDecoder => i.min(n.saturating_sub(1)),
        _ => i,
    }
}

/// The ALiBi term added to a score: `slope * (j - i)` for the decoder, `-slope * |j - i|` for
/// the non-causal types (`i` from [`alibi_position`]).
pub fn alibi_bias(attn_type: AttnType, slope: f64, i: usize, j: usize) -> f64 {
    let (i, j) = (i as f64, j as f64);
    if attn_type.is_causal() {
        slope * (j - i)
    } else {
        -slope * (j - i).abs()
    }
}

/// The soft cap: `cap * tanh(s / cap)`.
pub fn soft_cap(s: f64, cap: f64) -> f64 {
    cap * (s / cap).tanh()
}

/// Where key position `j` of a sequence is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLocation {
    /// Cache slot (after this call's write).
    Slot(usize),
    /// Token index in this call's key/value tensors.
    InputToken(usize),
    /// Not a key: a new token with slot -1 (padding).
    Absent,
}

/// Which keys each sequence of a batch has, and where they live.
#[derive(Debug, Clone, Copy)]
pub struct KeyMap<'a> {
    metadata: &'a AttentionMetadata,
    attn_type: AttnType,
    /// Block size of the cache, when one is used.
    block_size: Option<usize>,
    /// Whether this call carries key/value tensors.
    has_new_kv: bool,
}

impl<'a> KeyMap<'a> {
    /// The key map of a call; `block_size` is `Some` when a cache is used.
    pub fn new(
        metadata: &'a AttentionMetadata,
        attn_type: AttnType,
        block_size: Option<usize>,
        has_new_kv: bool,
    ) -> Self {
        KeyMap {
            metadata,
            attn_type,
            block_size,
            has_new_kv,
        }
    }

    /// Number of key positions of sequence `s`: its seq_len (decoder), its query length
    /// (encoder types) or its encoder length (cross-attention).
    pub fn num_positions(&self, s: usize) -> usize {
        let md = self.metadata;
        match self.attn_type {
            AttnType::Decoder => md.seq_lens[s] as usize,
            AttnType::Encoder | AttnType::EncoderOnly => md.query_range(s).len(),
            AttnType::EncoderDecoder => {
                md.encoder.as_ref().expect("validated").encoder_seq_lens[s] as usize
            }
        }
    }

    /// Where key position `j` of sequence `s` is read.
    pub fn locate(&self, s: usize, j: usize) -> KeyLocation {
        let md = self.metadata;
        let paged = |table: &[i32], b: usize| KeyLocation::Slot(table[j / b] as usize * b + j % b);
        match (self.attn_type, self.block_size) {
            (AttnType::Decoder, Some(b)) => {
                let ctx = md.context_lens[s] as usize;
                if j >= ctx && md.slot_mapping[md.query_range(s).start + j - ctx] < 0 {
                    return KeyLocation::Absent;
                }
                paged(md.block_tables.row(s), b)
            }
            (AttnType::EncoderDecoder, Some(b)) => {
                let enc = md.encoder.as_ref().expect("validated");
                if self.has_new_kv && enc.cross_slot_mapping[md.encoder_token_start(s) + j] < 0 {
                    return KeyLocation::Absent;
                }
                paged(enc.cross_block_tables.row(s), b)
            }
            (AttnType::EncoderDecoder, None) => {
                KeyLocation::InputToken(md.encoder_token_start(s) + j)
            }
            (_, _) => KeyLocation::InputToken(md.query_range(s).start + j),
        }
    }

    /// The positions of sequence `s` that are not keys (new tokens with slot -1), sorted.
    pub fn absent_positions(&self, s: usize) -> Vec<usize> {
        let md = self.metadata;
        let new_tokens = match (self.attn_type, self.block_size) {
            (AttnType::Decoder, Some(_)) => md.context_lens[s] as usize..self.num_positions(s),
            (AttnType::EncoderDecoder, Some(_)) if self.has_new_kv => 0..self.num_positions(s),
            _ => 0..0,
        };
        new_tokens
            .filter(|&j| self.locate(s, j) == KeyLocation::Absent)
            .collect()
    }
}
