//! Tensor parallelism's arithmetic (Megatron-LM's, as vLLM shards a Llama): which heads and
//! which rows of the feed-forward a rank computes, and the slices of each weight it keeps.
//! The q/k/v and gate/up products are column-parallel (a rank computes its heads' and its
//! intermediate rows' outputs), the output and down products row-parallel (a rank multiplies
//! its share of the inputs, and the ranks' partial sums are all-reduced); norms and the
//! embedding are replicated. Host code only: the GPU model uploads what it says.

use std::ops::Range;

use pagedattn::AttentionConfig;

use crate::{Error, Result};

/// A rank of a tensor-parallel group of `size` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorParallel {
    /// This rank, below `size`.
    pub rank: usize,
    /// Ranks in the group (1: no parallelism).
    pub size: usize,
}

/// What one rank of a model computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Its query heads.
    pub q_heads: Range<usize>,
    /// Its key/value heads (one head, shared with other ranks, where the group has more
    /// ranks than the model has kv heads: vLLM replicates them).
    pub kv_heads: Range<usize>,
    /// Its rows of the feed-forward's intermediate.
    pub ffn: Range<usize>,
}

/// `n` split into `parts` equal parts, part `i`; an error naming `what` where it does not
/// divide (vLLM refuses a model whose heads or intermediate do not divide by the group).
fn part(n: usize, parts: usize, i: usize, what: &str) -> Result<Range<usize>> {
    if !n.is_multiple_of(parts) {
        return Err(Error::Model(format!(
            "--tensor-parallel {parts}: the model's {what} ({n}) must be divisible by it \
             (vLLM refuses it too)"
        )));
    }
    let len = n / parts;
    Ok(i * len..(i + 1) * len)
}

impl TensorParallel {
    /// One rank alone.
    pub const SINGLE: TensorParallel = TensorParallel { rank: 0, size: 1 };

    /// What this rank computes of a model of `heads` query heads, `kv_heads` key/value heads
    /// and an intermediate of `ffn`. Refused as vLLM refuses it: query heads or the
    /// intermediate that do not divide by the group, kv heads that neither divide by it nor
    /// divide it.
    pub fn shard(&self, heads: usize, kv_heads: usize, ffn: usize) -> Result<Shard> {
        let (rank, size) = (self.rank, self.size);
        if size == 0 || rank >= size {
            return Err(Error::Model(format!(
                "rank {rank} of a tensor-parallel group of {size}: expected a rank below the size"
            )));
        }
        let q_heads = part(heads, size, rank, "attention heads")?;
        let kv_heads = if kv_heads >= size {
            part(kv_heads, size, rank, "key/value heads")?
        } else if size.is_multiple_of(kv_heads) {
            // Each kv head serves size / kv_heads ranks: the one whose query heads it serves.
            let head = rank / (size / kv_heads);
            head..head + 1
        } else {
            return Err(Error::Model(format!(
                "--tensor-parallel {size}: the model's {kv_heads} key/value heads must divide \
                 it or be divisible by it (vLLM refuses it too)"
            )));
        };
        Ok(Shard {
            q_heads,
            kv_heads,
            ffn: part(ffn, size, rank, "intermediate size")?,
        })
    }
}

impl Shard {
    /// `config` with this shard's heads (and their ALiBi slopes).
    pub fn attention(&self, config: &AttentionConfig) -> Result<AttentionConfig> {
        let slopes = config
            .alibi_slopes()
            .map(|s| s[self.q_heads.clone()].to_vec());
        let (k_scale, v_scale) = (config.kv_scales().k_scale, config.kv_scales().v_scale);
        Ok(
            AttentionConfig::builder(self.q_heads.len(), config.head_size())
                .scale(config.scale())
                .num_kv_heads(self.kv_heads.len())
                .alibi_slopes(slopes)
                .sliding_window(config.sliding_window())
                .logits_soft_cap(config.logits_soft_cap())
                .kv_cache_dtype(config.kv_cache_dtype())
                .kv_scales(k_scale, v_scale)
                .attn_type(config.attn_type())
                .build()?,
        )
    }
}

/// The rows `rows` of a row-major matrix of `columns` columns.
pub fn rows_of(matrix: &[f32], columns: usize, rows: Range<usize>) -> &[f32] {
    &matrix[rows.start * columns..rows.end * columns]
}

/// The columns `keep` of every row of a row-major matrix of `columns` columns.
pub fn columns_of(matrix: &[f32], columns: usize, keep: Range<usize>) -> Vec<f32> {
    matrix
        .chunks_exact(columns)
        .flat_map(|row| &row[keep.clone()])
        .copied()
        .collect()
}

/// `range` of heads as a range of elements of `head_size` each.
pub fn head_elements(range: &Range<usize>, head_size: usize) -> Range<usize> {
    range.start * head_size..range.end * head_size
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(rank: usize, size: usize) -> TensorParallel {
        TensorParallel { rank, size }
    }

    #[test]
    fn heads_and_rows_split_evenly_and_kv_heads_replicate_past_their_count() {
        // 32/8 heads on 2 ranks: 16 query heads and 4 kv heads each.
        let s = tp(1, 2).shard(32, 8, 14336).unwrap();
        assert_eq!((s.q_heads, s.kv_heads, s.ffn), (16..32, 4..8, 7168..14336));
        // 32/2 heads on 4 ranks: each kv head serves two ranks, the ones whose query heads
        // (16 per kv head) it serves.
        let kv: Vec<_> = (0..4)
            .map(|r| tp(r, 4).shard(32, 2, 64).unwrap().kv_heads)
            .collect();
        assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
        for r in 0..4 {
            let s = tp(r, 4).shard(32, 2, 64).unwrap();
            let group = 32 / 2;
            assert!(s.q_heads.clone().all(|h| h / group == s.kv_heads.start));
        }
        assert_eq!(
            tp(0, 1).shard(9, 3, 1536).unwrap(),
            Shard {
                q_heads: 0..9,
                kv_heads: 0..3,
                ffn: 0..1536
            }
        );
    }

    #[test]
    fn what_vllm_refuses_is_refused_naming_the_count() {
        // SmolLM2's 9/3 heads on 2 ranks.
        let err = tp(0, 2).shard(9, 3, 1536).unwrap_err().to_string();
        assert!(
            err.contains("attention heads (9) must be divisible"),
            "{err}"
        );
        // 12 query heads on 4 ranks, 3 kv heads: 3 neither divides by 4 nor divides it.
        let err = tp(0, 4).shard(12, 3, 64).unwrap_err().to_string();
        assert!(err.contains("3 key/value heads must divide"), "{err}");
        let err = tp(0, 2).shard(8, 2, 63).unwrap_err().to_string();
        assert!(err.contains("intermediate size (63)"), "{err}");
        assert!(tp(2, 2).shard(8, 2, 64).is_err());
    }

    #[test]
    fn sharded_products_sum_to_the_whole() {
        // A column-parallel product followed by a row-parallel one, as the attention's
        // projections and the feed-forward are sharded: the ranks' partial outputs sum to the
        // unsharded result.
        let (hidden, inner) = (6, 8);
        let w1: Vec<f32> = (0..inner * hidden)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let w2: Vec<f32> = (0..hidden * inner)
            .map(|i| (i as f32 * 0.11).cos())
            .collect();
        let x: Vec<f32> = (0..hidden).map(|i| i as f32 - 2.5).collect();
        let matvec = |w: &[f32], cols: usize, v: &[f32]| -> Vec<f32> {
            w.chunks_exact(cols)
                .map(|row| row.iter().zip(v).map(|(a, b)| a * b).sum())
                .collect()
        };
        let whole = matvec(&w2, inner, &matvec(&w1, hidden, &x));
        let mut summed = vec![0f32; hidden];
        for r in 0..4 {
            let rows = part(inner, 4, r, "inner").unwrap();
            let h = matvec(rows_of(&w1, hidden, rows.clone()), hidden, &x);
            let partial = matvec(&columns_of(&w2, inner, rows.clone()), rows.len(), &h);
            for (s, p) in summed.iter_mut().zip(partial) {
                *s += p;
            }
        }
        for (a, b) in summed.iter().zip(&whole) {
            assert!((a - b).abs() < 1e-4, "{summed:?} {whole:?}");
        }
    }

    #[test]
    fn a_shards_attention_keeps_its_heads_and_everything_else() {
        let config = AttentionConfig::builder(8, 16)
            .num_kv_heads(2)
            .alibi_slopes(Some((0..8).map(|h| h as f32).collect()))
            .sliding_window(Some(64))
            .logits_soft_cap(Some(30.0))
            .scale(0.3)
            .build()
            .unwrap();
        let s = tp(1, 2).shard(8, 2, 16).unwrap();
        let c = s.attention(&config).unwrap();
        assert_eq!((c.num_heads(), c.num_kv_heads()), (4, 1));
        assert_eq!(c.alibi_slopes().unwrap(), &[4.0, 5.0, 6.0, 7.0]);
        assert_eq!(c.sliding_window(), Some(64));
        assert_eq!(c.logits_soft_cap(), Some(30.0));
        assert_eq!(c.scale(), 0.3);
    }
}
