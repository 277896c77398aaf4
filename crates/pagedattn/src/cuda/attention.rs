//! [`CudaAttention`]: one layer's attention on a GPU. Plans upload the step's metadata, the
//! cache write runs as a kernel; the attention kernels do not exist yet, so a forward answers
//! [`Error::Unsupported`] after the gate, having written nothing.

use std::ops::Range;
use std::sync::Arc;

use super::device::Gpu;
use super::kernels::{self, WriteKv};
use super::packed::Packed;
use super::storage::{cuda_storage, cuda_storage_mut};
use crate::backend::{AttentionImpl, Capabilities};
use crate::config::AttentionConfig;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::reference::write_slots;
use crate::step::{ForwardCheck, Inputs, KvPair, Plan, Workspace};
use crate::tensor::{Storage, Tensor};

/// One layer's attention on the `cuda` backend.
pub struct CudaAttention {
    config: AttentionConfig,
    gpu: Arc<Gpu>,
    capabilities: Capabilities,
}

impl std::fmt::Debug for CudaAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAttention")
            .field("config", &self.config)
            .field("device", &Device::Cuda(self.gpu.ordinal))
            .finish_non_exhaustive()
    }
}

/// A plan's data on the GPU.
struct Prepared {
    /// The GPU it was uploaded to.
    ordinal: usize,
    /// The step's metadata.
    metadata: Packed,
    /// Where the slot mapping of the cache write is in `metadata`.
    slot_mapping: Range<usize>,
}

impl CudaAttention {
    pub(crate) fn new(config: &AttentionConfig, gpu: Arc<Gpu>, capabilities: Capabilities) -> Self {
        CudaAttention {
            config: config.clone(),
            gpu,
            capabilities,
        }
    }

    /// The gate of this layer's calls.
    fn gate(&self) -> ForwardCheck<'_> {
        ForwardCheck {
            backend: "cuda",
            device: Device::Cuda(self.gpu.ordinal),
            capabilities: &self.capabilities,
            layout: CacheLayout::Hnd,
            config: &self.config,
        }
    }
}

impl AttentionImpl for CudaAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<Plan> {
        self.gate().plan(metadata, cache, |md, _| {
            let (packed, ranges) = Packed::upload(&self.gpu, &[write_slots(&self.config, md)])?;
            let prepared = Prepared {
                ordinal: self.gpu.ordinal,
                metadata: packed,
                slot_mapping: ranges[0].clone(),
            };
            Ok((prepared, 0))
        })
    }

    fn write_kv(
        &self,
        plan: &Plan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        self.gate().write(plan, KvPair { key, value }, cache)?;
        let prepared: &Prepared = plan.prepared("cuda")?;
        if prepared.ordinal != self.gpu.ordinal {
            return Err(Error::device_mismatch(
                "plan",
                Device::Cuda(prepared.ordinal),
                format!(
                    "{} (plan with this layer's backend)",
                    Device::Cuda(self.gpu.ordinal)
                ),
            ));
        }
        let num_tokens = prepared.slot_mapping.len();
        if key.shape()[0] != num_tokens {
            return Err(Error::invalid(
                "key.shape[0]",
                key.shape()[0],
                format!("{num_tokens}, the plan's write slots"),
            ));
        }
        let spec = *cache.spec();
        let (key_cache, value_cache) = cache.buffers_mut();
        let write = WriteKv {
            key: address(key.storage(), "key")?,
            value: address(value.storage(), "value")?,
            key_cache: address_mut(key_cache, "kv_cache.key")?,
            value_cache: address_mut(value_cache, "kv_cache.value")?,
            slot_mapping: prepared
                .metadata
                .address(&self.gpu, prepared.slot_mapping.start),
            num_tokens,
            spec,
            scales: self.config.kv_scales(),
        };
        kernels::write_kv(&self.gpu, &write)
    }

    fn forward_into(
        &self,
        plan: &Plan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        self.gate().call(plan, &inputs, output, workspace)?;
        Err(Error::unsupported("cuda", "attention kernels"))
    }
}

/// The device address of a tensor or cache buffer on the GPU (0 when it is empty).
fn address(storage: &Storage, what: &str) -> Result<u64> {
    Ok(cuda_storage(storage, what)?
        .kernel_address(what)?
        .unwrap_or(0))
}

/// [`address`] of a buffer a kernel writes (borrowed mutably, so that nothing else holds it).
fn address_mut(storage: &mut Storage, what: &str) -> Result<u64> {
    Ok(cuda_storage_mut(storage, what)?
        .kernel_address(what)?
        .unwrap_or(0))
}
