//! The `reference` backend: the contract (`docs/semantics.md`) written as plainly as possible,
//! in f64.
//! It is the oracle every other backend is tested against; it is slow on purpose.

use crate::backend::{AttentionImpl, Backend, Capabilities};
use crate::config::{AttentionConfig, AttnType};
use crate::device::Device;
use crate::error::Result;
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::semantics::{alibi_bias, key_allowed, query_position, soft_cap, KeyLocation, KeyMap};
use crate::step::{ForwardCheck, Inputs, KvPair, Plan, Workspace};
use crate::tensor::{HostStorage, Tensor};

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
            capabilities: self.capabilities(),
        }))
    }
}

/// One layer's reference attention.
#[derive(Debug, Clone)]
pub struct ReferenceAttention {
    config: AttentionConfig,
    capabilities: Capabilities,
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

    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<Plan> {
        self.gate().plan(metadata, cache, |_, _| Ok(((), 0)))
    }

    fn write_kv(
        &self,
        plan: &Plan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        write_kv_checked(&self.gate(), plan, KvPair { key, value }, cache)
    }

    fn forward_into(
        &self,
        plan: &Plan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        let cfg = &self.config;
        self.gate().call(plan, &inputs, output, workspace)?;
        let metadata = plan.metadata();
        let (query, new_kv, mut kv_cache) = inputs.into_parts();
        let attn_type = cfg.attn_type();
        // 1. Write the new keys and values into the cache.
        if let (Some(cache), Some(kv)) = (kv_cache.as_deref_mut(), new_kv) {
            cache.write_checked(
                kv.key,
                kv.value,
                write_slots(cfg, metadata),
                cfg.kv_scales(),
            )?;
        }
        // 2. Gather every key and value as f64: from the cache when there is one.
        let cache = kv_cache.as_deref();
        let (keys, values) = match (cache, new_kv) {
            (Some(c), _) => c.dequantize(cfg.kv_scales())?,
            (None, Some(kv)) => (kv.key.host()?.to_f64_vec(), kv.value.host()?.to_f64_vec()),
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
            plan.num_kv_tokens().is_some(),
        );
        // 3. Attend.
        let q = query.host()?.to_f64_vec();
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
        store(output.host_mut()?, &out);
        Ok(())
    }
}

/// The slot mapping new keys and values are written through: the cross slot mapping for
/// encoder-decoder, the slot mapping otherwise.
pub(crate) fn write_slots<'m>(
    config: &AttentionConfig,
    metadata: &'m AttentionMetadata,
) -> &'m [i64] {
    match (config.attn_type(), &metadata.encoder) {
        (AttnType::EncoderDecoder, Some(enc)) => &enc.cross_slot_mapping,
        _ => &metadata.slot_mapping,
    }
}

/// `AttentionImpl::write_kv` of the host backends: the gate, then the host cache write.
pub(crate) fn write_kv_checked(
    gate: &ForwardCheck<'_>,
    plan: &Plan,
    kv: KvPair<'_>,
    cache: &mut KvCache,
) -> Result<()> {
    gate.write(plan, kv, cache)?;
    let slots = write_slots(gate.config, plan.metadata());
    cache.write_checked(kv.key, kv.value, slots, gate.config.kv_scales())
}

impl ReferenceAttention {
    /// The gate of this layer's calls.
    fn gate(&self) -> ForwardCheck<'_> {
        ForwardCheck {
            backend: "reference",
            device: Device::Cpu,
            capabilities: &self.capabilities,
            layout: CacheLayout::Nhd,
            config: &self.config,
        }
    }
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
fn store(dst: &mut HostStorage, values: &[f64]) {
    crate::with_element!(dst.dtype(), T => {
        let dst = dst.as_slice_mut::<T>().expect("dtype matched");
        for (o, &v) in dst.iter_mut().zip(values) {
            *o = <T as crate::dtype::Element>::from_f64(v);
        }
    })
}
