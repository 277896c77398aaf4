//! The `reference` backend: the contract (`docs/semantics.md`) written as plainly as possible,
//! in f64.
//! It is the oracle every other backend is tested against; it is slow on purpose.

use crate::backend::{AttentionImpl, Backend, Capabilities};
use crate::config::AttentionConfig;
use crate::device::Device;
use crate::error::Result;
use crate::fp8::Fp8Format;
use crate::kv_cache::{write_kv_checked, write_slots, CacheLayout, KvCache, KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::semantics::{
    alibi_bias, alibi_position, allowed_keys, query_position, soft_cap, KeyLocation, KeyMap,
};
use crate::step::{ForwardCheck, Inputs, KvPair, Plan, Workspace};
use crate::tensor::{zeroed_vec, HostSliceMut, HostStorage, Tensor};

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

/// Where a call's keys and values are read: the cache's buffers (fp8 codes decoded with their
/// scales) and the input tensors, one element at a time as f64, so that memory stays bounded
/// whatever the sequences' lengths.
struct KeyValueRows<'a> {
    /// The cache's key and value buffers and the cache, when keys are read from one.
    cache: Option<(&'a HostStorage, &'a HostStorage, &'a KvCache)>,
    /// The call's key and value tensors, when it carries them.
    input: Option<(&'a HostStorage, &'a HostStorage)>,
    /// The cache's fp8 format and scales (None: elements are values).
    fp8: Option<(Fp8Format, KvScales)>,
    num_kv_heads: usize,
    head_size: usize,
}

/// Where a key's row is: its first element in the cache's buffers or in the input tensors.
#[derive(Clone, Copy)]
enum Row {
    Cache(usize),
    Input(usize),
}

impl KeyValueRows<'_> {
    fn row(&self, location: KeyLocation, kv_head: usize) -> Row {
        match location {
            KeyLocation::Slot(slot) => Row::Cache(
                self.cache
                    .expect("slot implies a cache")
                    .2
                    .row_start(slot, kv_head),
            ),
            KeyLocation::InputToken(t) => {
                Row::Input((t * self.num_kv_heads + kv_head) * self.head_size)
            }
        }
    }

    /// Element `x` of the key row `row`.
    fn key(&self, row: Row, x: usize) -> f64 {
        self.element(row, x, 0, |s| s.k_scale)
    }

    /// Element `x` of the value row `row`.
    fn value(&self, row: Row, x: usize) -> f64 {
        self.element(row, x, 1, |s| s.v_scale)
    }

    /// Element `x` of a key (`side` 0) or value (1) row. An input element read beside a
    /// cache is the value the cache would hold: with an fp8 cache, its code's value.
    fn element(&self, row: Row, x: usize, side: usize, scale: fn(&KvScales) -> f32) -> f64 {
        let fp8 = self.fp8.map(|(f, s)| (f, scale(&s)));
        match row {
            Row::Cache(i) => {
                let (k, v, _) = self.cache.expect("a cache row implies a cache");
                element([k, v][side], fp8, i + x)
            }
            Row::Input(i) => {
                let (k, v) = self.input.expect("an input row implies input tensors");
                let x = element([k, v][side], None, i + x);
                match fp8 {
                    Some((format, scale)) => {
                        format.decode(format.encode(x as f32 / scale)) as f64 * scale as f64
                    }
                    None => x,
                }
            }
        }
    }
}

/// Element `i` of `buf` as f64: fp8 codes decoded and multiplied by their scale.
fn element(buf: &HostStorage, fp8: Option<(Fp8Format, f32)>, i: usize) -> f64 {
    match (buf, fp8) {
        (HostStorage::U8(codes), Some((format, scale))) => {
            format.decode(codes[i]) as f64 * scale as f64
        }
        (HostStorage::F32(v), _) => v[i] as f64,
        (HostStorage::F16(v), _) => v[i].to_f64(),
        (HostStorage::BF16(v), _) => v[i].to_f64(),
        (HostStorage::U8(_), None) => unreachable!("validated: byte buffers are fp8 caches"),
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
        // 2. Read every key and value from the cache when there is one (new tokens with slot
        // -1 from the inputs, as the cache would hold them), else from the inputs.
        let cache = kv_cache.as_deref();
        let rows = KeyValueRows {
            cache: match cache {
                Some(c) => {
                    let (k, v) = c.host_buffers()?;
                    Some((k, v, c))
                }
                None => None,
            },
            input: match new_kv {
                Some(kv) => Some((kv.key.host()?, kv.value.host()?)),
                None => None,
            },
            fp8: cache.and_then(|_| {
                cfg.kv_cache_dtype()
                    .fp8_format()
                    .map(|f| (f, cfg.kv_scales()))
            }),
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
        let q = query.host()?.to_f64_vec()?;
        let (h_count, d) = (cfg.num_heads(), cfg.head_size());
        let mut out = zeroed_vec::<f64>(q.len())?;
        for s in 0..metadata.num_seqs() {
            let range = metadata.query_range(s);
            let seq_len = metadata.seq_lens[s] as usize;
            for (m, t) in range.clone().enumerate() {
                let i = query_position(attn_type, seq_len, range.len(), m);
                for h in 0..h_count {
                    let q_row = &q[(t * h_count + h) * d..][..d];
                    let o_row = &mut out[(t * h_count + h) * d..][..d];
                    self.attend_one(q_row, o_row, h, i, s, &key_map, &rows);
                }
            }
        }
        store(output.host_mut()?, &out);
        Ok(())
    }
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
    /// One query row of head `h` at position `i` over the keys of sequence `seq`, streaming:
    /// one pass for the largest score, one for the softmax-weighted sum of the values.
    #[allow(clippy::too_many_arguments)]
    fn attend_one(
        &self,
        q: &[f64],
        out: &mut [f64],
        h: usize,
        i: usize,
        seq: usize,
        key_map: &KeyMap<'_>,
        rows: &KeyValueRows<'_>,
    ) {
        let cfg = &self.config;
        let kv_head = h / cfg.num_queries_per_kv();
        let d = cfg.head_size();
        // The keys this query sees: (position, start of its row).
        let n = key_map.num_positions(seq);
        let allowed = allowed_keys(cfg.attn_type(), cfg.sliding_window(), i, n);
        let alibi_i = alibi_position(cfg.attn_type(), i, n);
        let keys = || {
            allowed
                .clone()
                .map(|j| (j, rows.row(key_map.locate(seq, j), kv_head)))
        };
        // Each step's result in f32's range: what f32 rounds to infinity is infinite.
        let score = |j: usize, row: Row| {
            let dot: f64 = (0..d).map(|x| q[x] * rows.key(row, x)).sum();
            let mut s = in_f32_range(cfg.scale() as f64 * dot);
            if let Some(cap) = cfg.logits_soft_cap() {
                s = soft_cap(s, cap as f64);
            }
            if let Some(slopes) = cfg.alibi_slopes() {
                s = in_f32_range(s + alibi_bias(cfg.attn_type(), slopes[h] as f64, alibi_i, j));
            }
            s
        };
        out.fill(0.0);
        if keys().next().is_none() {
            return; // No key: a zero output.
        }
        let max = keys()
            .map(|(j, row)| score(j, row))
            .fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0.0;
        for (j, row) in keys() {
            let e = (score(j, row) - max).exp();
            total += e;
            for (x, o) in out.iter_mut().enumerate() {
                *o += e * rows.value(row, x);
            }
        }
        for o in out.iter_mut() {
            *o /= total;
        }
    }
}

/// `x`, or ±infinity where rounding it to f32 overflows (the contract keeps scores in f32's
/// range).
fn in_f32_range(x: f64) -> f64 {
    if (x as f32).is_infinite() {
        x.signum() * f64::INFINITY
    } else {
        x
    }
}

/// Rounds f64 results into float storage.
fn store(mut dst: HostSliceMut<'_>, values: &[f64]) {
    crate::with_element!(dst.dtype(), T => {
        let dst = dst.as_slice_mut::<T>().expect("dtype matched");
        for (o, &v) in dst.iter_mut().zip(values) {
            *o = <T as crate::dtype::Element>::from_f64(v);
        }
    })
}
