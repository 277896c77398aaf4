//! The backend's registration ([`Cpu`], registry name `cpu`) and its layers
//! ([`CpuAttention`]): planning, the cache write and the forward call, which hands the
//! work to [`run_isa`].

use crate::backend::{AttentionImpl, Backend, Capabilities};
use crate::config::AttentionConfig;
use crate::detached::Detached;
use crate::device::Device;
use crate::error::Result;
use crate::kv_cache::write_kv_checked;
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::semantics::KeyMap;
use crate::step::{partials_bytes, ForwardCheck, Inputs, KvPair, Plan as StepPlan, Workspace};
use crate::tensor::Tensor;

use super::plan::{self, Plan};
use super::{Isa, ISA_ENV};

use super::dispatch::{run_isa, ForwardCall};
use super::hugepages::advise_huge_pages;

/// The CPU backend (registry name `cpu`).
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    isa: Isa,
}

impl Cpu {
    /// The backend on the best instruction set of this CPU, or the one `PAGEDATTN_ISA` names.
    pub fn new() -> Result<Self> {
        Ok(Cpu {
            isa: Isa::from_env()?,
        })
    }

    /// The backend on a given instruction set (an error if this CPU lacks it).
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if isa.is_available() {
            Ok(Cpu { isa })
        } else {
            Err(crate::Error::unsupported(
                "cpu",
                format!("instruction set {isa} on this CPU"),
            ))
        }
    }

    /// The instruction set it runs.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::everything()
    }

    fn kv_cache_layout(&self) -> CacheLayout {
        CacheLayout::Hnd
    }

    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>> {
        self.capabilities().check_config(self.name(), config)?;
        Ok(Box::new(CpuAttention {
            config: config.clone(),
            backend: *self,
            capabilities: self.capabilities(),
        }))
    }

    fn details(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "instruction set",
                format!("{} (force another with {ISA_ENV})", self.isa),
            ),
            ("threads", rayon::current_num_threads().to_string()),
        ]
    }

    fn allocate_kv_cache(&self, spec: &KvCacheSpec) -> Result<KvCache> {
        self.capabilities().check_cache(self.name(), spec)?;
        let mut cache = KvCache::zeros(*spec, self.kv_cache_layout())?;
        let (key, value) = cache.host_buffers_mut()?;
        for buf in [key, value] {
            advise_huge_pages(buf.into_bytes());
        }
        Ok(cache)
    }
}

/// One layer's attention on the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuAttention {
    config: AttentionConfig,
    backend: Cpu,
    capabilities: Capabilities,
}

impl AttentionImpl for CpuAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<StepPlan> {
        let cfg = &self.config;
        self.gate().plan(metadata, cache, |md, has_new_kv| {
            let key_map = KeyMap::new(md, cfg.attn_type(), cache.map(|c| c.block_size), has_new_kv);
            let mut plan = plan::plan(cfg, md, &key_map, rayon::current_num_threads());
            plan.detached = Detached::plan(cfg, md, cache.map(|c| c.block_size), has_new_kv)?;
            // Per partial: the kv head's query rows, each m, l and D accumulators.
            let floats = cfg
                .head_size()
                .checked_add(2)
                .and_then(|f| f.checked_mul(cfg.num_queries_per_kv()));
            let bytes = partials_bytes("cpu", plan.num_partials, floats)?;
            Ok((plan, bytes))
        })
    }

    fn write_kv(
        &self,
        plan: &StepPlan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        write_kv_checked(&self.gate(), plan, KvPair { key, value }, cache)
    }

    fn forward_into(
        &self,
        plan: &StepPlan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        // One hand-off to the thread pool per call: the cache write, the attention and the
        // split-K merges below then start their parallel work from inside it, instead of each
        // waking the pool from the caller's thread (which costs more than a short decode).
        rayon::scope(|_| self.forward_in_pool(plan, workspace, inputs, output))
    }
}

impl CpuAttention {
    /// The gate of this layer's calls.
    fn gate(&self) -> ForwardCheck<'_> {
        ForwardCheck {
            backend: "cpu",
            device: Device::Cpu,
            capabilities: &self.capabilities,
            layout: CacheLayout::Hnd,
            config: &self.config,
        }
    }

    /// [`AttentionImpl::forward_into`], run on a thread of the pool.
    fn forward_in_pool(
        &self,
        step: &StepPlan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        self.gate().call(step, &inputs, output, workspace)?;
        let plan: &Plan = step.prepared("cpu")?;
        let (query, new_kv, mut kv_cache) = inputs.into_parts();
        if let (Some(cache), Some(kv)) = (kv_cache.as_deref_mut(), new_kv) {
            let slots = crate::kv_cache::write_slots(&self.config, step.metadata());
            cache.write_checked(kv.key, kv.value, slots, self.config.kv_scales())?;
        }
        let partials: &mut [f32] = match workspace.storage_mut() {
            // A workspace holds f32 (`Workspace::reserve`; its storage is never public).
            Some(storage) => storage
                .host_mut("workspace")?
                .as_slice_mut()
                .expect("a workspace holds f32"),
            None => &mut [],
        };
        let cache = kv_cache.as_deref();
        let private = match (&plan.detached, cache, new_kv) {
            (Some(detached), Some(cache), Some(kv)) => {
                Some(detached.fill_host(cache, kv, self.config.kv_scales())?)
            }
            _ => None,
        };
        let (keys, values) = match (cache, new_kv) {
            (Some(c), _) => {
                let (k, v) = c.host_buffers()?;
                (k, v)
            }
            (None, Some(kv)) => (kv.key.host()?, kv.value.host()?),
            (None, None) => unreachable!("validated: without a cache, key and value are given"),
        };
        let call = ForwardCall {
            config: &self.config,
            metadata: step.metadata(),
            plan,
            query: query.host()?,
            keys,
            values,
            detached: match &private {
                Some(p) => Some(p.host_buffers()?),
                None => None,
            },
            cache_geometry: cache.map(|c| *c.spec()),
            scales: self.config.kv_scales(),
            #[cfg(target_arch = "x86_64")]
            isa: self.backend.isa,
        };
        let output = output.host_mut()?;
        run_isa(self.backend.isa, &call, output, partials)
    }
}
