//! The `reference` backend: DESIGN.md section 2 written as plainly as possible, in f64.
//! It is the oracle every other backend is tested against; it is slow on purpose.

use crate::backend::{AttentionImpl, Backend, Capabilities, Device, ForwardCheck, KvPair};
use crate::config::{AttentionConfig, AttnType};
use crate::error::Result;
use crate::kv_cache::{CacheLayout, KvCache, KvScales};
use crate::metadata::AttentionMetadata;
use crate::semantics::{alibi_bias, key_allowed, query_position, soft_cap, KeyLocation, KeyMap};
use crate::tensor::{Storage, Tensor};

/// The reference backend (registry name `reference`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Reference;

impl Backend for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::everything()
    }

    fn kv_cache_layout(&self) -> CacheLayout {
        CacheLayout::Nhd
    }

    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>> {
        self.capabilities().check_config(self.name(), config)?;
        Ok(Box::new(ReferenceAttention {
            config: config.clone(),
        }))
    }
}

/// One layer's reference attention.
#[derive(Debug, Clone)]
pub struct ReferenceAttention {
    config: AttentionConfig,
}

/// Key and value rows, as f64, with the function that finds the row of (location, kv head).
struct KeyValueRows<'a> {
    keys: Vec<f64>,
    values: Vec<f64>,
    cache: Option<&'a KvCache>,
    num_kv_heads: usize,
    head_size: usize,
}

impl KeyValueRows<'_> {
    fn row_start(&self, location: KeyLocation, kv_head: usize) -> usize {
        match location {
            KeyLocation::Slot(slot) => self
                .cache
                .expect("slot implies a cache")
                .row_start(slot, kv_head),
            KeyLocation::InputToken(t) => (t * self.num_kv_heads + kv_head) * self.head_size,
            KeyLocation::Absent => unreachable!("absent keys are filtered out"),
        }
    }
}

impl AttentionImpl for ReferenceAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn forward(
        &self,
        query: &Tensor,
        new_kv: Option<KvPair<'_>>,
        mut kv_cache: Option<&mut KvCache>,
        metadata: &AttentionMetadata,
        output: &mut Tensor,
        scales: KvScales,
    ) -> Result<()> {
        let cfg = &self.config;
        let backend = Reference;
        ForwardCheck {
            backend: backend.name(),
            capabilities: &backend.capabilities(),
            layout: backend.kv_cache_layout(),
            config: cfg,
        }
        .run(query, new_kv, kv_cache.as_deref(), metadata, output, scales)?;

        let attn_type = cfg.attn_type();
        // 1. Write the new keys and values into the cache.
        if let (Some(cache), Some(kv)) = (kv_cache.as_deref_mut(), new_kv) {
            let slots = match attn_type {
                AttnType::EncoderDecoder => {
                    &metadata
                        .encoder
                        .as_ref()
                        .expect("validated")
                        .cross_slot_mapping
                }
                _ => &metadata.slot_mapping,
            };
            cache.write(kv.key, kv.value, slots, scales)?;
        }
        // 2. Gather every key and value as f64: from the cache when there is one.
        let cache = kv_cache.as_deref();
        let (keys, values) = match (cache, new_kv) {
            (Some(c), _) => c.dequantize(scales),
            (None, Some(kv)) => (
                kv.key.storage().to_f64_vec(),
                kv.value.storage().to_f64_vec(),
            ),
            (None, None) => unreachable!("validated: without a cache, key and value are given"),
        };
        let rows = KeyValueRows {
            keys,
            values,
            cache,
            num_kv_heads: cfg.num_kv_heads(),
            head_size: cfg.head_size(),
        };
        let key_map = KeyMap::new(
            metadata,
            attn_type,
            cache.map(|c| c.spec().block_size),
            new_kv.is_some(),
        );
        // 3. Attend.
        let q = query.storage().to_f64_vec();
        let (h_count, d) = (cfg.num_heads(), cfg.head_size());
        let mut out = vec![0.0f64; q.len()];
        for s in 0..metadata.num_seqs() {
            let keys: Vec<(usize, KeyLocation)> = (0..key_map.num_positions(s))
                .map(|j| (j, key_map.locate(s, j)))
                .filter(|&(_, loc)| loc != KeyLocation::Absent)
                .collect();
            let range = metadata.query_range(s);
            let seq_len = metadata.seq_lens[s] as usize;
            for (m, t) in range.clone().enumerate() {
                let i = query_position(attn_type, seq_len, range.len(), m);
                for h in 0..h_count {
                    let q_row = &q[(t * h_count + h) * d..][..d];
                    let o_row = &mut out[(t * h_count + h) * d..][..d];
                    self.attend_one(q_row, o_row, h, i, &keys, &rows);
                }
            }
        }
        store(output.storage_mut(), &out);
        Ok(())
    }
}

impl ReferenceAttention {
    /// One query row of head `h` at position `i` over a sequence's keys.
    fn attend_one(
        &self,
        q: &[f64],
        out: &mut [f64],
        h: usize,
        i: usize,
        keys: &[(usize, KeyLocation)],
        rows: &KeyValueRows<'_>,
    ) {
        let cfg = &self.config;
        let kv_head = h / cfg.num_queries_per_kv();
        let d = cfg.head_size();
        let mut scored = Vec::with_capacity(keys.len());
        for &(j, loc) in keys {
            if !key_allowed(cfg.attn_type(), cfg.sliding_window(), i, j) {
                continue;
            }
            let row = rows.row_start(loc, kv_head);
            let k = &rows.keys[row..row + d];
            let mut s = cfg.scale() as f64 * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
            if let Some(cap) = cfg.logits_soft_cap() {
                s = soft_cap(s, cap as f64);
            }
            if let Some(slopes) = cfg.alibi_slopes() {
                s += alibi_bias(cfg.attn_type(), slopes[h] as f64, i, j);
            }
            scored.push((s, row));
        }
        out.fill(0.0);
        let max = scored
            .iter()
            .map(|&(s, _)| s)
            .fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = scored.iter().map(|&(s, _)| (s - max).exp()).sum();
        for &(s, row) in &scored {
            let p = (s - max).exp() / total;
            for (o, v) in out.iter_mut().zip(&rows.values[row..row + d]) {
                *o += p * v;
            }
        }
    }
}

/// Rounds f64 results into float storage.
fn store(dst: &mut Storage, values: &[f64]) {
    crate::with_element!(dst.dtype(), T => {
        let dst = dst.as_slice_mut::<T>().expect("dtype matched");
        for (o, &v) in dst.iter_mut().zip(values) {
            *o = <T as crate::dtype::Element>::from_f64(v);
        }
    })
}
