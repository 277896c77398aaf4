//! The `cuda` backend: tensors and caches in a GPU's memory, swap space in pinned host memory,
//! and kernels compiled at first use by NVRTC for the GPU's architecture.
//!
//! Everything on one GPU is queued on one stream per GPU, shared by the process, or on a
//! caller's stream inside [`Cuda::on_stream`]: operations run in the order they were issued,
//! asynchronously to the host. Only downloads to host memory, [`Backend::synchronize`], copies
//! between two GPUs and the freeing of pinned memory (which waits for the copies that use it)
//! wait.
//!
//! Cache layout: `[NB, Hkv, B, D]` (head-major), the `cpu` backend's, so that caches compare
//! byte for byte. Attention runs for the head sizes in [`ATTENTION_HEAD_SIZES`] (a layer of
//! another head size is [`Error::Unsupported`](crate::Error::Unsupported) when it is made):
//! one kernel variant per activation dtype, key/value storage, head size and score modifiers,
//! compiled at the first call that needs it. A failed driver call is
//! [`Error::CudaDriver`](crate::Error::CudaDriver), which keeps the driver's code.
//!
//! Without a usable GPU (no driver, no device) every entry point answers
//! [`Error::Driver`](crate::Error::Driver) with one line starting `no usable CUDA GPU:`;
//! [`compile_check`] needs NVRTC only.

mod abi;
mod attention;
mod compile;
mod device;
mod external;
mod graph;
mod kernels;
mod memory;
mod nvrtc_path;
mod packed;
mod plan;
#[cfg(feature = "probes")]
mod probes;
mod queue;
mod storage;
mod timing;
mod variant;

use std::sync::Arc;

pub use attention::CudaAttention;
pub use compile::{
    arch_for, check_spills, compile_check, compile_program_check, nvrtc_version, CachedImage,
    CheckDepth, DiskCache, ImageOrigin, KernelResources, CACHE_DIR_ENV,
};
/// The trait of a kernel argument passed by value (`cudarc`'s), which the argument structs of
/// [`kernel_params!`](crate::kernel_params) implement.
pub use cudarc::driver::DeviceRepr;
pub use device::{gpu_present, info, DeviceInfo};
pub use graph::Graph;
pub use nvrtc_path::{add_nvrtc_search_dirs, find_cuda_library};
#[cfg(feature = "probes")]
pub use probes::{CopyProbe, PeakProbe};
pub use storage::CudaStorage;
pub use timing::GpuEvent;
pub use variant::ATTENTION_HEAD_SIZES;

use crate::backend::{check_sides, AttentionImpl, Backend, Capabilities, Sizes};
use crate::config::AttentionConfig;
use crate::device::{Device, MemoryInfo};
use crate::error::Result;
use crate::kv_cache::{check_pairs, check_swap, BlockId, CacheLayout, KvCache};
use device::Gpu;
use kernels::CopyLayer;
use storage::{cuda_storage, cuda_storage_mut};

/// The CUDA backend (registry name `cuda`) on one GPU.
pub struct Cuda {
    gpu: Arc<Gpu>,
    info: DeviceInfo,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("info", &self.info).finish()
    }
}

impl Cuda {
    /// The backend on GPU `ordinal`. Fails if no GPU is usable, or if NVRTC, which compiles
    /// the kernels at their first use, cannot be loaded.
    pub fn new(ordinal: usize) -> Result<Self> {
        let gpu = device::gpu(ordinal)?;
        let info = device::info_of(&gpu)?;
        compile::nvrtc_version()?;
        Ok(Cuda { gpu, info })
    }

    /// The backend on GPU 0.
    pub fn new_default() -> Result<Self> {
        Self::new(0)
    }

    /// What its GPU is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Captures the work `work` queues on this backend's stream (forward calls, cache
    /// writes) as a [`Graph`] instead of running it. Run each call once before capturing it:
    /// a kernel variant is compiled and loaded at its first use, which a capture refuses.
    /// Plans for captured calls come from `plan_for_graph`, so that `replan` can refresh
    /// them for the steps the graph is replayed for.
    pub fn capture(&self, work: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let global = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        graph::capture(&self.gpu, global, work)
    }

    /// [`capture`](Self::capture) where only this thread's calls that a graph cannot hold
    /// (allocations, synchronizations, module loads) are refused while it lasts, not every
    /// thread's: for a program whose other threads drive other GPUs at the same time (the
    /// ranks of a tensor-parallel engine, capturing and allocating each on its own thread).
    pub fn capture_on_this_thread(&self, work: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let local = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        graph::capture(&self.gpu, local, work)
    }
}

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal)
    }

    fn swap_device(&self) -> Device {
        Device::CudaHost(self.gpu.ordinal)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            head_sizes: Sizes::Only(ATTENTION_HEAD_SIZES.to_vec()),
            ..Capabilities::everything()
        }
    }

    fn kv_cache_layout(&self) -> CacheLayout {
        CacheLayout::Hnd
    }

    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>> {
        let capabilities = self.capabilities();
        capabilities.check_config(self.name(), config)?;
        Ok(Box::new(CudaAttention::new(
            config,
            self.gpu.clone(),
            capabilities,
        )?))
    }

    fn memory(&self) -> Result<MemoryInfo> {
        device::memory_of(&self.gpu)
    }

    fn details(&self) -> Vec<(&'static str, String)> {
        let i = &self.info;
        let (major, minor) = i.compute_capability;
        let nvrtc = i
            .nvrtc_version
            .map_or("not found".to_string(), |(a, b)| format!("{a}.{b}"));
        vec![
            (
                "gpu",
                format!("{} ({} of {})", i.name, self.device(), i.num_devices),
            ),
            (
                "compute capability",
                format!("{major}.{minor} (kernels for {})", i.arch),
            ),
            (
                "memory",
                format!("{:.1} GiB", i.total_memory as f64 / (1u64 << 30) as f64),
            ),
            (
                "driver",
                format!("CUDA {}.{}", i.driver_version.0, i.driver_version.1),
            ),
            ("nvrtc", nvrtc),
            (
                "kernel cache",
                DiskCache::from_env().map_or_else(
                    || format!("none: kernels compile in every process (set {CACHE_DIR_ENV})"),
                    |cache| {
                        format!(
                            "{} (fill it: pagedattn compile-kernels --cache)",
                            cache.dir().display()
                        )
                    },
                ),
            ),
        ]
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn copy_swap_blocks(
        &self,
        src: &KvCache,
        dst: &mut KvCache,
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        swap_blocks(src, dst, pairs)
    }

    fn copy_blocks(&self, caches: &mut [KvCache], pairs: &[(BlockId, BlockId)]) -> Result<()> {
        let mut layers = Vec::with_capacity(caches.len());
        // The same numbers for every layer, each layer's check bounding them by its own size.
        let mut indices = Vec::new();
        for (i, cache) in caches.iter().enumerate() {
            let what = format!("caches[{i}]");
            check_sides(cache, self.device(), &what, "the backend's device")?;
            let spec = cache.spec();
            indices = check_pairs(pairs, spec.num_blocks, spec.num_blocks)?;
            let block_bytes = spec.block_bytes();
            let address = |buffer, name| -> Result<u64> {
                let what = format!("{what}.{name}");
                Ok(cuda_storage(buffer, &what)?
                    .kernel_address(&what)?
                    .unwrap_or(0))
            };
            layers.push(CopyLayer {
                key: address(cache.key(), "key")?,
                value: address(cache.value(), "value")?,
                block_bytes: block_bytes as u64,
            });
        }
        kernels::copy_blocks(&self.gpu, &layers, &indices)
    }
}

/// Queues one copy per pair of whole blocks, keys and values, from `src` to `dst` (a GPU's
/// cache and its swap space: the caller checks the devices).
fn swap_blocks(src: &KvCache, dst: &mut KvCache, pairs: &[(BlockId, BlockId)]) -> Result<()> {
    let pairs = check_swap(src, dst, pairs)?;
    let spec = src.spec();
    let block_bytes = spec.block_bytes();
    let ranges = || {
        pairs
            .iter()
            .map(move |&(s, d)| (s * block_bytes, d * block_bytes, block_bytes))
    };
    let (dst_key, dst_value) = dst.buffers_mut();
    cuda_storage_mut(dst_key, "dst.key")?
        .copy_ranges_from(cuda_storage(src.key(), "src.key")?, ranges())?;
    cuda_storage_mut(dst_value, "dst.value")?
        .copy_ranges_from(cuda_storage(src.value(), "src.value")?, ranges())
}
