//! [`TypedCall`]: a forward call with its ISA and element types fixed, and what its units of
//! work share: where the key and value rows are, the query rows, and writing finished rows.

use std::ops::Range;

use crate::config::{AttentionConfig, AttnType};
use crate::dtype::Element;
use crate::kv_cache::KvCacheSpec;
use crate::metadata::AttentionMetadata;
use crate::semantics::{alibi_position, allowed_keys, query_position, KeyMap};
use crate::shared::SharedMut;

use super::kernel::{KvRows, RowLayout, RowStates, ScoreMods};
use super::plan::Plan;
use super::simd::{Load, Simd};

/// A [`ForwardCall`](super::dispatch::ForwardCall) with its ISA `S`, query/output element `T`
/// and key/value element `E` fixed: everything a unit of work (decode unit, prefill group,
/// merge) reads.
pub(super) struct TypedCall<'a, S, T, E> {
    pub(super) s: S,
    pub(super) cfg: &'a AttentionConfig,
    pub(super) md: &'a AttentionMetadata,
    pub(super) query: &'a [T],
    pub(super) keys: &'a [E],
    pub(super) values: &'a [E],
    pub(super) cache_geometry: Option<KvCacheSpec>,
    pub(super) mods: ScoreMods,
    /// Multiplies q·k: the softmax scale times the fp8 k_scale.
    pub(super) score_scale: f32,
    /// Multiplies the output: the fp8 v_scale.
    pub(super) v_scale: f32,
    pub(super) out: SharedMut<T>,
    pub(super) partials: SharedMut<f32>,
    pub(super) plan: &'a Plan,
    /// Whether the AVX512-BF16 kernels may be used.
    #[cfg(target_arch = "x86_64")]
    pub(super) bf16_dot: bool,
    /// Whether the AMX prefill may be used.
    #[cfg(target_arch = "x86_64")]
    pub(super) amx: bool,
}

impl<S: Simd, T: Element + Load, E: Load> TypedCall<'_, S, T, E> {
    pub(super) fn group_size(&self) -> usize {
        self.cfg.num_queries_per_kv()
    }

    /// Where sequence `seq`'s keys and values for `kv_head` are.
    pub(super) fn kv_rows(&self, seq: usize, kv_head: usize) -> KvRows<'_, E> {
        let (d, hkv) = (self.cfg.head_size(), self.cfg.num_kv_heads());
        let cross = self.cfg.attn_type() == AttnType::EncoderDecoder;
        let layout = match self.cache_geometry {
            Some(spec) => {
                let table = if cross {
                    self.md
                        .encoder
                        .as_ref()
                        .expect("validated")
                        .cross_block_tables
                        .row(seq)
                } else {
                    self.md.block_tables.row(seq)
                };
                let block = spec.block_size * d;
                RowLayout::Paged {
                    table,
                    block_size: spec.block_size,
                    block_stride: hkv * block,
                    head_offset: kv_head * block,
                }
            }
            None => {
                let first_token = if cross {
                    self.md.encoder_token_start(seq)
                } else {
                    self.md.query_range(seq).start
                };
                RowLayout::Dense {
                    first_row: (first_token * hkv + kv_head) * d,
                    token_stride: hkv * d,
                }
            }
        };
        KvRows {
            key: self.keys,
            value: self.values,
            layout,
            head_size: d,
        }
    }

    /// The query heads of `kv_head` for `tokens`, one row per (token, head), token-major:
    /// positions and ALiBi slopes.
    pub(super) fn rows(
        &self,
        seq: usize,
        kv_head: usize,
        tokens: Range<usize>,
    ) -> (Vec<usize>, Vec<f32>) {
        let range = self.md.query_range(seq);
        let seq_len = self.md.seq_lens[seq] as usize;
        let group = self.group_size();
        let mut pos = Vec::with_capacity(tokens.len() * group);
        let mut slope = Vec::new();
        let attn_type = self.cfg.attn_type();
        let n = KeyMap::new(self.md, attn_type, None, false).num_positions(seq);
        for t in tokens {
            // ALiBi's position (a cross-attention query past every encoder key is measured
            // from the last key): the masks of the non-causal types use no position.
            let i = query_position(attn_type, seq_len, range.len(), t - range.start);
            let i = alibi_position(attn_type, i, n);
            for gh in 0..group {
                pos.push(i);
                if let Some(slopes) = self.cfg.alibi_slopes() {
                    slope.push(slopes[kv_head * group + gh]);
                }
            }
        }
        (pos, slope)
    }

    /// The query heads of `kv_head` for each token of `tokens` (`group × D` elements each),
    /// with every line of them prefetched first: a token's heads lie `H × D` elements after
    /// the previous token's, a stride the hardware prefetchers do not follow across pages, so
    /// without it each row is a serial trip to memory.
    fn query_heads(&self, kv_head: usize, tokens: Range<usize>) -> impl Iterator<Item = &[T]> {
        let (d, h, group) = (
            self.cfg.head_size(),
            self.cfg.num_heads(),
            self.group_size(),
        );
        let heads = move |t: usize| &self.query[(t * h + kv_head * group) * d..][..group * d];
        let line = 64 / std::mem::size_of::<T>();
        for t in tokens.clone() {
            for x in heads(t).iter().step_by(line) {
                self.s.prefetch(x);
            }
        }
        tokens.map(heads)
    }

    /// The query rows of `kv_head` for `tokens` in f32 (unscaled).
    pub(super) fn q_f32(&self, kv_head: usize, tokens: Range<usize>) -> Vec<f32> {
        let len = tokens.len() * self.group_size() * self.cfg.head_size();
        let mut q = Vec::with_capacity(len);
        for heads in self.query_heads(kv_head, tokens) {
            q.extend(heads.iter().map(|&x| Element::to_f32(x)));
        }
        q
    }

    /// The query rows of `kv_head` for `tokens` as bf16 pairs (unscaled).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn q_bf16_pairs(&self, kv_head: usize, tokens: Range<usize>) -> Vec<u32> {
        let len = tokens.len() * self.group_size() * self.cfg.head_size();
        let mut q = Vec::with_capacity(len / 2);
        for heads in self.query_heads(kv_head, tokens) {
            q.extend(
                heads
                    .chunks_exact(2)
                    .map(|p| p[0].bf16_bits() as u32 | (p[1].bf16_bits() as u32) << 16),
            );
        }
        q
    }

    /// Whether the query token `t` of sequence `seq` attends at least one key (allowed and
    /// present). A row whose running max stayed -inf had only -inf scores if it did (IEEE:
    /// 0 / 0, NaN), and no key at all if not (the contract's zero output).
    pub(super) fn attends_a_key(&self, seq: usize, t: usize) -> bool {
        let attn_type = self.cfg.attn_type();
        let range = self.md.query_range(seq);
        let i = query_position(
            attn_type,
            self.md.seq_lens[seq] as usize,
            range.len(),
            t - range.start,
        );
        let n = KeyMap::new(self.md, attn_type, None, false).num_positions(seq);
        let keys = allowed_keys(attn_type, self.cfg.sliding_window(), i, n);
        let absent = &self.plan.absent[seq];
        let absent_inside =
            absent.partition_point(|&j| j < keys.end) - absent.partition_point(|&j| j < keys.start);
        keys.len() > absent_inside
    }

    /// What a finished row's weighted sum is multiplied by: `v_scale / l`, or, for a row whose
    /// running max stayed -inf, NaN where it attended a key and 0 where it had none. In f64:
    /// `v_scale / l` in f32 underflows for an fp8 `v_scale` near f32's smallest values (any
    /// positive `v_scale` is accepted), where `acc · v_scale / l` is in range.
    pub(super) fn output_norm(&self, m: f32, l: f32, seq: usize, t: usize) -> f64 {
        if m > f32::NEG_INFINITY || l.is_nan() {
            self.v_scale as f64 / l as f64
        } else if self.attends_a_key(seq, t) {
            f64::NAN
        } else {
            0.0
        }
    }

    /// Writes finished rows (`tokens` of sequence `seq` × the heads of `kv_head`) to the
    /// output.
    pub(super) fn finish(
        &self,
        seq: usize,
        kv_head: usize,
        tokens: Range<usize>,
        state: &RowStates,
    ) {
        let (d, group) = (self.cfg.head_size(), self.group_size());
        for (ti, t) in tokens.enumerate() {
            for gh in 0..group {
                let r = ti * group + gh;
                let acc = &state.acc[r * d..(r + 1) * d];
                self.write_row(seq, t, kv_head * group + gh, state.m[r], state.l[r], acc);
            }
        }
    }

    /// Writes the output row of query head `head` of token `t` (of sequence `seq`): its
    /// weighted sum of values `acc`, normalised as [`TypedCall::output_norm`] says for its
    /// running max `m` and sum `l`. Shared by [`TypedCall::finish`] and [`TypedCall::merge`].
    pub(super) fn write_row(&self, seq: usize, t: usize, head: usize, m: f32, l: f32, acc: &[f32]) {
        let (d, h) = (self.cfg.head_size(), self.cfg.num_heads());
        let norm = self.output_norm(m, l, seq, t);
        // SAFETY: the output is `[tokens, H, D]` (validated), and each (token, head) row is
        // written by exactly one unit of work (a unit or prefill tile, or a split-K merge).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.out.ptr().add((t * h + head) * d), d) };
        for (o, a) in dst.iter_mut().zip(acc) {
            *o = T::from_f32((*a as f64 * norm) as f32);
        }
    }
}
