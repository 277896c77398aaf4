//! The backend API: what a backend reports, the memory and cache operations it provides, and
//! the attention implementation it builds from a config.

use std::fmt;

use crate::config::{AttentionConfig, AttnType};
use crate::device::{Device, MemoryInfo};
use crate::dtype::DType;
use crate::error::{ensure, Error, Result};
use crate::kv_cache::{self, BlockId, CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::step::{Inputs, Plan, Workspace};
use crate::tensor::Tensor;

/// A set of supported sizes (head sizes, block sizes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sizes {
    /// Every positive size.
    Any,
    /// Only these.
    Only(Vec<usize>),
}

impl Sizes {
    /// Whether `n` is supported.
    pub fn contains(&self, n: usize) -> bool {
        match self {
            Sizes::Any => n > 0,
            Sizes::Only(v) => v.contains(&n),
        }
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sizes::Any => f.write_str("any"),
            Sizes::Only(v) => {
                let names: Vec<String> = v.iter().map(usize::to_string).collect();
                f.write_str(&names.join(", "))
            }
        }
    }
}

/// What a backend supports. Anything outside it is answered with [`Error::Unsupported`].
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    /// Activation dtypes.
    pub dtypes: Vec<DType>,
    /// Head sizes.
    pub head_sizes: Sizes,
    /// Cache block sizes.
    pub block_sizes: Sizes,
    /// Attention types.
    pub attn_types: Vec<AttnType>,
    /// fp8 KV caches.
    pub fp8: bool,
    /// ALiBi.
    pub alibi: bool,
    /// Sliding windows.
    pub sliding_window: bool,
    /// Logits soft cap.
    pub soft_cap: bool,
}

impl Capabilities {
    /// Every dtype, head size, block size, attention type and feature.
    pub fn everything() -> Self {
        Capabilities {
            dtypes: DType::FLOATS.to_vec(),
            head_sizes: Sizes::Any,
            block_sizes: Sizes::Any,
            attn_types: AttnType::ALL.to_vec(),
            fp8: true,
            alibi: true,
            sliding_window: true,
            soft_cap: true,
        }
    }

    /// Checks a layer config against these capabilities.
    pub fn check_config(&self, backend: &str, config: &AttentionConfig) -> Result<()> {
        let unsupported = |feature: String| Err(Error::unsupported(backend, feature));
        if !self.head_sizes.contains(config.head_size()) {
            return unsupported(format!(
                "head size {} (supported: {})",
                config.head_size(),
                self.head_sizes
            ));
        }
        if !self.attn_types.contains(&config.attn_type()) {
            return unsupported(format!("attn_type {}", config.attn_type()));
        }
        let features = [
            (
                config.kv_cache_dtype().fp8_format().is_some(),
                self.fp8,
                "fp8 KV cache",
            ),
            (config.alibi_slopes().is_some(), self.alibi, "ALiBi"),
            (
                config.sliding_window().is_some(),
                self.sliding_window,
                "sliding window",
            ),
            (
                config.logits_soft_cap().is_some(),
                self.soft_cap,
                "logits soft cap",
            ),
        ];
        for (wanted, have, name) in features {
            if wanted && !have {
                return unsupported(name.to_string());
            }
        }
        Ok(())
    }

    /// Checks a cache geometry against these capabilities.
    pub fn check_cache(&self, backend: &str, spec: &KvCacheSpec) -> Result<()> {
        spec.validate()?;
        if !self.block_sizes.contains(spec.block_size) {
            return Err(Error::unsupported(
                backend,
                format!(
                    "block size {} (supported: {})",
                    spec.block_size, self.block_sizes
                ),
            ));
        }
        if !self.head_sizes.contains(spec.head_size) {
            return Err(Error::unsupported(
                backend,
                format!("head size {}", spec.head_size),
            ));
        }
        self.check_dtype(backend, spec.dtype)?;
        if spec.kv_cache_dtype.fp8_format().is_some() && !self.fp8 {
            return Err(Error::unsupported(backend, "fp8 KV cache"));
        }
        Ok(())
    }

    /// Checks an activation dtype.
    pub fn check_dtype(&self, backend: &str, dtype: DType) -> Result<()> {
        if self.dtypes.contains(&dtype) {
            Ok(())
        } else {
            Err(Error::unsupported(backend, format!("dtype {dtype}")))
        }
    }
}

/// What a plan made for CUDA-graph capture holds ([`AttentionImpl::plan_for_graph`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphCapacity {
    /// The most key positions a sequence of any later step has: its `seq_len` for
    /// self-attention, its encoder length for cross-attention.
    pub max_seq_len: usize,
}

/// One layer's attention, built by a backend from an [`AttentionConfig`].
///
/// A step runs as: [`plan`](Self::plan) once (validates the metadata and prepares it on the
/// device), then [`forward`](Self::forward) for every layer, each given the plan and a
/// [`Workspace`]. Layers whose configs differ only in scale, ALiBi slopes, soft cap or fp8
/// scales share one plan.
pub trait AttentionImpl: Send + Sync {
    /// The config it was built from.
    fn config(&self) -> &AttentionConfig;

    /// Validates a step's metadata (with the cache geometry, when the layers use a cache) and
    /// turns it into this backend's prepared plan, uploaded to the device once.
    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<Plan>;

    /// A plan whose forward calls can be captured in a CUDA graph and replayed for later
    /// steps: [`replan`](Self::replan) refreshes it in place for every later step of the same
    /// batch shape (the same sequences and query tokens per sequence) whose sequences have at
    /// most `capacity.max_seq_len` key positions, keeping every device address and launch
    /// shape the graph holds. Host backends have no graphs: their default is [`plan`](Self::plan).
    fn plan_for_graph(
        &self,
        metadata: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
        capacity: GraphCapacity,
    ) -> Result<Plan> {
        let _ = capacity;
        self.plan(metadata, cache)
    }

    /// Re-plans `plan` for a new step's metadata. A plan from
    /// [`plan_for_graph`](Self::plan_for_graph) is refreshed in place (a graph captured on it
    /// then runs the new step), or refused with an error naming what does not fit its
    /// capacity, leaving it as it was; any other plan is replaced by a new one.
    fn replan(
        &self,
        plan: &mut Plan,
        metadata: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
    ) -> Result<()> {
        *plan = self.plan(metadata, cache)?;
        Ok(())
    }

    /// Writes new keys and values into `cache` through the plan's slot mapping (the cross
    /// slot mapping for encoder-decoder), as the first half of [`forward`](Self::forward)
    /// does; fp8 caches quantize with the config's scales.
    fn write_kv(
        &self,
        plan: &Plan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()>;

    /// Writes the inputs' new keys and values into the cache (if both are given), then
    /// attends: `output[T, H, D]` for `query[T, H, D]`. Allocates nothing: the workspace must
    /// hold [`Plan::workspace_bytes`] (see [`Workspace::reserve`]).
    fn forward_into(
        &self,
        plan: &Plan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()>;

    /// [`forward_into`](Self::forward_into) into a new output on the query's device.
    fn forward(
        &self,
        plan: &Plan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
    ) -> Result<Tensor> {
        let query = inputs.query();
        let mut output = Tensor::zeros_on(query.device(), query.dtype(), query.shape())?;
        self.forward_into(plan, workspace, inputs, &mut output)?;
        Ok(output)
    }
}

/// A backend: a device, a cache layout and an attention implementation.
pub trait Backend: Send + Sync {
    /// Its registry name (`reference`, `cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Where its tensors and caches live and it computes.
    fn device(&self) -> Device;
    /// Where its swap space lives (host memory the device copies to and from).
    fn swap_device(&self) -> Device {
        Device::Cpu
    }
    /// What it supports.
    fn capabilities(&self) -> Capabilities;
    /// The layout of the caches it allocates and reads.
    fn kv_cache_layout(&self) -> CacheLayout;
    /// Builds one layer's attention; unsupported settings are refused here.
    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>>;

    /// Facts worth showing a user beyond the capabilities (e.g. the instruction set the CPU
    /// backend runs), as (name, value) pairs.
    fn details(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// The memory of the device it computes on ([`device`](Self::device)): what a KV cache
    /// can be sized from. The host's ([`host_memory`](crate::device::host_memory)) unless
    /// the backend computes elsewhere.
    fn memory(&self) -> Result<MemoryInfo> {
        crate::device::host_memory()
    }

    /// Waits until the work queued on the device is done (nothing to wait for on the host).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The shape of one layer's cache for `spec`.
    fn kv_cache_shape(&self, spec: &KvCacheSpec) -> Result<Vec<usize>> {
        self.capabilities().check_cache(self.name(), spec)?;
        Ok(self.kv_cache_layout().shape(spec))
    }

    /// Allocates one layer's zero-filled cache on the device.
    fn allocate_kv_cache(&self, spec: &KvCacheSpec) -> Result<KvCache> {
        self.capabilities().check_cache(self.name(), spec)?;
        KvCache::zeros_on(self.device(), *spec, self.kv_cache_layout())
    }

    /// Allocates zero-filled swap space of `num_blocks` blocks for a cache of `spec` (the same
    /// block geometry and dtypes: `spec.with_num_blocks(num_blocks)`), in host memory the
    /// device copies to and from ([`Backend::swap_device`]) and in this backend's layout: what
    /// [`swap_out`](Self::swap_out) and [`swap_in`](Self::swap_in) expect. One per layer.
    fn allocate_swap_space(&self, spec: &KvCacheSpec, num_blocks: usize) -> Result<KvCache> {
        let spec = spec.with_num_blocks(num_blocks);
        self.capabilities().check_cache(self.name(), &spec)?;
        KvCache::zeros_on(self.swap_device(), spec, self.kv_cache_layout())
    }

    /// A copy of `cache` (any layout, any device) in this backend's layout on its device.
    fn load_kv_cache(&self, cache: &KvCache) -> Result<KvCache> {
        self.capabilities().check_cache(self.name(), cache.spec())?;
        cache
            .to_device(Device::Cpu)?
            .to_layout(self.kv_cache_layout())?
            .to_device(self.device())
    }

    /// A workspace on this backend's device, large enough for `plan`.
    fn workspace(&self, plan: &Plan) -> Result<Workspace> {
        let mut workspace = Workspace::empty(self.device());
        workspace.reserve(plan)?;
        Ok(workspace)
    }

    /// Swaps blocks out of every layer: copies `(cache block, swap block)` pairs from each
    /// layer's device cache `caches[l]` to its swap space `swaps[l]` (vLLM's `swap_blocks`
    /// towards the CPU). Every layer is checked before any is copied.
    fn swap_out(
        &self,
        caches: &[KvCache],
        swaps: &mut [KvCache],
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        check_swap_layers(self, caches, swaps, pairs, Towards::Swap)?;
        for (cache, swap) in caches.iter().zip(swaps) {
            self.copy_swap_blocks(cache, swap, pairs)?;
        }
        Ok(())
    }

    /// Swaps blocks in to every layer: copies `(swap block, cache block)` pairs from each
    /// layer's swap space `swaps[l]` to its device cache `caches[l]`. Every layer is checked
    /// before any is copied.
    fn swap_in(
        &self,
        swaps: &[KvCache],
        caches: &mut [KvCache],
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        check_swap_layers(self, caches, swaps, pairs, Towards::Cache)?;
        for (swap, cache) in swaps.iter().zip(caches) {
            self.copy_swap_blocks(swap, cache, pairs)?;
        }
        Ok(())
    }

    /// The copy behind [`swap_out`](Self::swap_out) and [`swap_in`](Self::swap_in), one layer
    /// at a time, once they have checked where every cache lives: between host caches by
    /// default; a GPU backend queues copies between its memory and pinned host memory.
    fn copy_swap_blocks(
        &self,
        src: &KvCache,
        dst: &mut KvCache,
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        kv_cache::swap_blocks(src, dst, pairs)
    }

    /// Copies blocks `(src, dst)` inside every layer's cache (copy-on-write), pair by pair in
    /// order.
    fn copy_blocks(&self, caches: &mut [KvCache], pairs: &[(BlockId, BlockId)]) -> Result<()> {
        for (i, cache) in caches.iter().enumerate() {
            check_sides(cache, self.device(), &format!("caches[{i}]"), ON_DEVICE)?;
        }
        kv_cache::copy_blocks(caches, pairs)
    }
}

/// Which way a swap copies.
#[derive(Clone, Copy)]
enum Towards {
    /// From the caches to the swap spaces (`swap_out`).
    Swap,
    /// From the swap spaces to the caches (`swap_in`).
    Cache,
}

/// Checks a swap of every layer before any copy: one swap space per layer, each cache on the
/// backend's device and each swap space in its swap space, and each layer's pairs (errors
/// name the layer).
fn check_swap_layers<B: Backend + ?Sized>(
    backend: &B,
    caches: &[KvCache],
    swaps: &[KvCache],
    pairs: &[(BlockId, BlockId)],
    towards: Towards,
) -> Result<()> {
    ensure(
        swaps.len() == caches.len(),
        || "swaps.len()".into(),
        swaps.len(),
        || format!("caches.len() = {}: one swap space per layer", caches.len()),
    )?;
    for (l, (cache, swap)) in caches.iter().zip(swaps).enumerate() {
        check_sides(cache, backend.device(), &format!("caches[{l}]"), ON_DEVICE)?;
        check_sides(
            swap,
            backend.swap_device(),
            &format!("swaps[{l}]"),
            IN_SWAP_SPACE,
        )?;
        let (src, dst) = match towards {
            Towards::Swap => (cache, swap),
            Towards::Cache => (swap, cache),
        };
        kv_cache::check_swap(src, dst, pairs).map_err(|e| match e {
            Error::Invalid {
                field,
                value,
                expected,
            } => Error::Invalid {
                field: format!("{field} of layer {l}"),
                value,
                expected,
            },
            other => other,
        })?;
    }
    Ok(())
}

/// What a device cache of a swap must be on.
const ON_DEVICE: &str = "the backend's device";

/// What swap space must be on.
const IN_SWAP_SPACE: &str = "the backend's swap space: allocate it with allocate_swap_space";

/// Checks that `cache` lives on `device`.
pub(crate) fn check_sides(
    cache: &KvCache,
    device: Device,
    what: &str,
    expected: &str,
) -> Result<()> {
    if cache.device() == device {
        Ok(())
    } else {
        Err(Error::device_mismatch(
            what,
            cache.device(),
            format!("{device} ({expected})"),
        ))
    }
}
