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
    /// Token index in this call's key/value tensors: the keys of a call without a cache, and
    /// a new token whose slot is -1 (not written, still a key of its own call; with a cache,
    /// read as the cache would hold it: fp8 caches quantize it with the layer's scales).
    InputToken(usize),
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

    /// The positions of sequence `s` that are this call's new tokens written through a slot
    /// mapping, with the index of the first one's token among the call's key/value rows:
    /// the decoder's new tokens and, at a cross-attention prefill, the encoder's tokens.
    /// Empty without a cache (nothing is written).
    pub fn new_tokens(&self, s: usize) -> (Range<usize>, usize) {
        let md = self.metadata;
        match (self.attn_type, self.block_size) {
            (AttnType::Decoder, Some(_)) => (
                md.context_lens[s] as usize..self.num_positions(s),
                md.query_range(s).start,
            ),
            (AttnType::EncoderDecoder, Some(_)) if self.has_new_kv => {
                (0..self.num_positions(s), md.encoder_token_start(s))
            }
            _ => (0..0, 0),
        }
    }

    /// The slot mapping the new tokens of [`new_tokens`](Self::new_tokens) are written
    /// through: `slot_mapping`, or `cross_slot_mapping` for cross-attention.
    pub fn slot_mapping(&self) -> &'a [i64] {
        match (self.attn_type, &self.metadata.encoder) {
            (AttnType::EncoderDecoder, Some(enc)) => &enc.cross_slot_mapping,
            _ => &self.metadata.slot_mapping,
        }
    }

    /// Where key position `j` of sequence `s` is read.
    pub fn locate(&self, s: usize, j: usize) -> KeyLocation {
        let md = self.metadata;
        let (new, first_token) = self.new_tokens(s);
        if new.contains(&j) {
            let t = first_token + j - new.start;
            if self.slot_mapping()[t] < 0 {
                return KeyLocation::InputToken(t);
            }
        }
        let paged = |table: &[i32], b: usize| KeyLocation::Slot(table[j / b] as usize * b + j % b);
        match (self.attn_type, self.block_size) {
            (AttnType::Decoder, Some(b)) => paged(md.block_tables.row(s), b),
            (AttnType::EncoderDecoder, Some(b)) => paged(
                md.encoder
                    .as_ref()
                    .expect("validated")
                    .cross_block_tables
                    .row(s),
                b,
            ),
            (AttnType::EncoderDecoder, None) => {
                KeyLocation::InputToken(md.encoder_token_start(s) + j)
            }
            (_, _) => KeyLocation::InputToken(md.query_range(s).start + j),
        }
    }

    /// Whether sequence `s` has a new token whose slot is -1: a key that is not written.
    pub fn has_unwritten_key(&self, s: usize) -> bool {
        let (new, first_token) = self.new_tokens(s);
        self.slot_mapping()[first_token..first_token + new.len()]
            .iter()
            .any(|&slot| slot < 0)
    }
}
