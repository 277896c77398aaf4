//! How many KV-cache blocks the memory allows: the pool sized from a share of the device's
//! memory (vLLM's `gpu_memory_utilization`) or from a byte budget (its CPU backend's
//! `VLLM_CPU_KVCACHE_SPACE`), so that what a run holds is bounded by the machine, not by how
//! many requests it is given: requests beyond the pool wait for blocks.

use pagedattn::{Backend, Device};

use crate::serving::model::Model;
use crate::{Error, Result};

/// The host's default budget: vLLM's CPU default (`VLLM_CPU_KVCACHE_SPACE`, 4 GiB), at most
/// half of the memory available, so that a small machine keeps room for everything else.
const HOST_DEFAULT_BYTES: u64 = 4 << 30;

/// The share of a GPU's memory the engine may use by default (vLLM's default); the rest is
/// left for the step's activations, the CUDA context and other processes.
const GPU_DEFAULT_UTILIZATION: f64 = 0.9;

/// How much memory the KV cache may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvCacheMemory {
    /// This fraction of the device's total memory, in (0, 1], for all the engine holds there:
    /// the pool takes what is left of that share once the memory in use now (the weights
    /// loaded, other processes) is counted (vLLM's `gpu_memory_utilization`). Sized after
    /// the model is loaded.
    Utilization(f64),
    /// This many bytes.
    Bytes(u64),
}

impl KvCacheMemory {
    /// The default for `backend`: [`Utilization`](Self::Utilization) 0.9 on a GPU; on the
    /// host 4 GiB, at most half of the memory available now.
    pub fn default_for(backend: &dyn Backend) -> Result<KvCacheMemory> {
        Ok(match backend.device() {
            Device::Cpu => {
                let available = backend.memory()?.available;
                KvCacheMemory::Bytes(HOST_DEFAULT_BYTES.min(available / 2))
            }
            _ => KvCacheMemory::Utilization(GPU_DEFAULT_UTILIZATION),
        })
    }
}

/// The pool of a model that caches no attention (an encoder-only model): a few blocks.
pub const CACHELESS_BLOCKS: usize = 16;

/// A KV pool's size, and what it was sized from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPoolSize {
    /// Blocks per layer.
    pub blocks: usize,
    /// Bytes one block takes over every layer's cache (keys and values).
    pub bytes_per_block: u64,
    /// The bytes the pool could take.
    pub budget: u64,
}

/// Bytes one block of `block_size` tokens takes over every cache the engine allocates for
/// `model` (keys and values of each layer that keeps a cache), at least 1.
pub fn kv_bytes_per_block(model: &dyn Model, block_size: usize) -> u64 {
    model
        .layers()
        .iter()
        .filter(|c| c.attn_type().uses_cache())
        .map(|c| {
            let spec = c.kv_cache_spec(model.dtype(), 1, block_size);
            (spec.block_bytes() as u64).saturating_mul(2)
        })
        .fold(0, u64::saturating_add)
        .max(1)
}

/// The blocks of `block_size` tokens that `memory` holds for `model`'s caches on `backend`
/// (measured now: size a GPU pool after the weights are on it). An error when the budget
/// is invalid or holds no block, naming what is in use.
pub fn kv_pool_size(
    backend: &dyn Backend,
    model: &dyn Model,
    block_size: usize,
    memory: KvCacheMemory,
) -> Result<KvPoolSize> {
    let bytes_per_block = kv_bytes_per_block(model, block_size);
    let budget = match memory {
        KvCacheMemory::Bytes(bytes) => bytes,
        KvCacheMemory::Utilization(share) => {
            if !(share > 0.0 && share <= 1.0) {
                return Err(Error::Model(format!(
                    "memory utilization {share}: expected a fraction in (0, 1]"
                )));
            }
            let m = backend.memory()?;
            let in_use = m.total.saturating_sub(m.available);
            // (Rounded down: the share of 2^64 bytes is within an f64's precision of it.)
            let share_bytes = (m.total as f64 * share) as u64;
            let budget = share_bytes.saturating_sub(in_use);
            if budget < bytes_per_block {
                return Err(Error::Model(format!(
                    "memory utilization {share} ({} of {}'s {}) leaves no room for a KV block \
                     ({bytes_per_block} bytes): {} are in use already; raise it, or give the \
                     pool's size",
                    gib(share_bytes),
                    backend.device(),
                    gib(m.total),
                    gib(in_use),
                )));
            }
            budget
        }
    };
    // A model without a cached attention (encoder-only) keeps nothing in the pool: its
    // blocks are bookkeeping that no request takes, not the budget's bytes a byte each.
    let cacheless = !model.layers().iter().any(|c| c.attn_type().uses_cache());
    let blocks = match cacheless {
        true => CACHELESS_BLOCKS,
        false => usize::try_from(budget / bytes_per_block).unwrap_or(usize::MAX),
    };
    if blocks == 0 {
        return Err(Error::Model(format!(
            "a KV cache of {budget} bytes: expected at least one block ({bytes_per_block} \
             bytes over the model's layers at {block_size} tokens a block)"
        )));
    }
    Ok(KvPoolSize {
        blocks,
        bytes_per_block,
        budget,
    })
}

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
