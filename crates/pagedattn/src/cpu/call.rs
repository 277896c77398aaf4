//! [`TypedCall`]: a forward call with its ISA and key/value element type fixed, and what its
//! units of work share: where the key and value rows are, the query rows, and writing
//! finished rows.

use std::ops::Range;

use half::{bf16, f16};

use crate::config::{AttentionConfig, AttnType};
use crate::dtype::Element;
use crate::kv_cache::KvCacheSpec;
use crate::metadata::AttentionMetadata;
use crate::semantics::{alibi_position, allowed_keys, query_position, KeyMap};
use crate::shared::SharedMut;

use super::kernel::{KvRows, RowLayout, RowStates, ScoreMods};
use super::plan::Plan;
use super::simd::{prefetch, Load, Simd};
#[cfg(target_arch = "x86_64")]
use super::Isa;

/// The query rows of a call in the caller's element type. The kernels read them once per
/// unit of work, converted to f32 or bf16 pairs, so they are not generic over it: an element
/// type parameter would multiply every kernel body by three for a conversion of rows × D
/// elements per unit.
#[derive(Clone, Copy)]
pub(super) enum Queries<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

/// Where finished output rows go, in the caller's element type (see [`Queries`]).
#[derive(Clone, Copy)]
pub(super) enum OutRows {
    F32(SharedMut<f32>),
    F16(SharedMut<f16>),
    Bf16(SharedMut<bf16>),
}

/// What every unit of work of a forward call shares, apart from the ISA and the key/value
/// element type: the query and output rows and what decides them (configuration, metadata,
/// plan). Its methods are compiled once, not once per kernel instantiation.
pub(super) struct CallRows<'a> {
    pub(super) cfg: &'a AttentionConfig,
    pub(super) md: &'a AttentionMetadata,
    pub(super) plan: &'a Plan,
    pub(super) query: Queries<'a>,
    pub(super) out: OutRows,
    pub(super) partials: SharedMut<f32>,
    pub(super) cache_geometry: Option<KvCacheSpec>,
    pub(super) mods: ScoreMods,
    /// Multiplies q·k: the softmax scale times the fp8 k_scale.
    pub(super) score_scale: f32,
    /// Multiplies the output: the fp8 v_scale.
    pub(super) v_scale: f32,
    /// The instruction set: which bf16 kernels may run (`Isa::bf16_dot_products`).
    #[cfg(target_arch = "x86_64")]
    pub(super) isa: Isa,
}

/// A forward call with its ISA `S` and key/value element `E` fixed: the [`CallRows`] (through
/// `Deref`) and where the keys and values are read.
pub(super) struct TypedCall<'a, S, E> {
    pub(super) s: S,
    pub(super) call: &'a CallRows<'a>,
    pub(super) keys: &'a [E],
    pub(super) values: &'a [E],
    /// The private cache's keys and values, which detached sequences read (empty without).
    pub(super) detached: (&'a [E], &'a [E]),
}

impl<'a, S, E> std::ops::Deref for TypedCall<'a, S, E> {
    type Target = CallRows<'a>;
    fn deref(&self) -> &CallRows<'a> {
        self.call
    }
}

impl<S: Simd, E: Load> TypedCall<'_, S, E> {
    /// Where sequence `seq`'s keys and values for `kv_head` are.
    pub(super) fn kv_rows(&self, seq: usize, kv_head: usize) -> KvRows<'_, E> {
        let (key, value) = match self.call.detached_table(seq) {
            Some(_) => self.detached,
            None => (self.keys, self.values),
        };
        KvRows {
            key,
            value,
            layout: self.call.kv_layout(seq, kv_head),
            head_size: self.cfg.head_size(),
        }
    }
}

impl CallRows<'_> {
    pub(super) fn group_size(&self) -> usize {
        self.cfg.num_queries_per_kv()
    }

    /// Sequence `seq`'s block table in the private cache, if it is detached.
    fn detached_table(&self, seq: usize) -> Option<&[i32]> {
        self.plan.detached.as_ref().and_then(|d| d.table(seq))
    }

    /// Where sequence `seq`'s keys and values for `kv_head` are in the key and value buffers.
    fn kv_layout(&self, seq: usize, kv_head: usize) -> RowLayout<'_> {
        let (d, hkv) = (self.cfg.head_size(), self.cfg.num_kv_heads());
        let cross = self.cfg.attn_type() == AttnType::EncoderDecoder;
        match self.cache_geometry {
            Some(spec) => {
                let table = if let Some(table) = self.detached_table(seq) {
                    table
                } else if cross {
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
    fn query_heads<'q, T>(
        &self,
        query: &'q [T],
        kv_head: usize,
        tokens: Range<usize>,
    ) -> impl Iterator<Item = &'q [T]> {
        let (d, h, group) = (
            self.cfg.head_size(),
            self.cfg.num_heads(),
            self.group_size(),
        );
        let heads = move |t: usize| &query[(t * h + kv_head * group) * d..][..group * d];
        let line = 64 / std::mem::size_of::<T>();
        for t in tokens.clone() {
            for x in heads(t).iter().step_by(line) {
                prefetch(x);
            }
        }
        tokens.map(heads)
    }

    /// The query rows of `kv_head` for `tokens` in f32 (unscaled).
    pub(super) fn q_f32(&self, kv_head: usize, tokens: Range<usize>) -> Vec<f32> {
        fn widen<T: Element>(
            rows: &CallRows<'_>,
            query: &[T],
            kv_head: usize,
            tokens: Range<usize>,
        ) -> Vec<f32> {
            let len = tokens.len() * rows.group_size() * rows.cfg.head_size();
            let mut q = Vec::with_capacity(len);
            for heads in rows.query_heads(query, kv_head, tokens) {
                q.extend(heads.iter().map(|&x| x.to_f32()));
            }
            q
        }
        match self.query {
            Queries::F32(q) => widen(self, q, kv_head, tokens),
            Queries::F16(q) => widen(self, q, kv_head, tokens),
            Queries::Bf16(q) => widen(self, q, kv_head, tokens),
        }
    }

    /// Whether the queries are bf16 (what the AVX512-BF16 and AMX kernels take).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn bf16_queries(&self) -> bool {
        matches!(self.query, Queries::Bf16(_))
    }

    /// The query rows of `kv_head` for `tokens` as bf16 pairs (unscaled). Only for bf16
    /// queries ([`TypedCall::bf16_queries`]).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn q_bf16_pairs(&self, kv_head: usize, tokens: Range<usize>) -> Vec<u32> {
        let Queries::Bf16(query) = self.query else {
            unreachable!("the bf16 kernels run on bf16 queries only")
        };
        let len = tokens.len() * self.group_size() * self.cfg.head_size();
        let mut q = Vec::with_capacity(len / 2);
        for heads in self.query_heads(query, kv_head, tokens) {
            q.extend(
                heads
                    .chunks_exact(2)
                    .map(|p| p[0].to_bits() as u32 | (p[1].to_bits() as u32) << 16),
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
        !allowed_keys(attn_type, self.cfg.sliding_window(), i, n).is_empty()
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
        /// Writes `acc · norm` rounded to `T` at `out + at`.
        fn write<T: Element>(out: SharedMut<T>, at: usize, acc: &[f32], norm: f64) {
            // SAFETY: the output is `[tokens, H, D]` (validated), and each (token, head) row
            // is written by exactly one unit of work (a unit or prefill tile, or a split-K
            // merge); `at` is such a row's start and `acc` has D elements.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(at), acc.len()) };
            for (o, a) in dst.iter_mut().zip(acc) {
                *o = T::from_f32((*a as f64 * norm) as f32);
            }
        }
        let at = (t * h + head) * d;
        match self.out {
            OutRows::F32(out) => write(out, at, acc, norm),
            OutRows::F16(out) => write(out, at, acc, norm),
            OutRows::Bf16(out) => write(out, at, acc, norm),
        }
    }
}
