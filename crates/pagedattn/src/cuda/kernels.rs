//! The kernel sources (`crates/pagedattn/kernels/*.cu`, embedded in the library), their
//! loading on a GPU, and the launches of the cache write, the block copy and the split-K merge
//! (the attention kernels' variants are in `variant.rs`, their launches in `attention.rs`).
//! Each of those kernels takes one argument struct, declared here by
//! [`kernel_params!`](crate::kernel_params) for the host and for CUDA (before its file).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::abi;
use super::compile;
use super::device::{driver_error, Gpu};
use super::memory::{self, DeviceBuffer};
use crate::config::KvCacheDtype;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCacheSpec, KvScales};

/// One program for NVRTC: a `.cu` file (with what it is compiled after) and the kernels
/// (`extern "C"` names) it defines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KernelSource {
    /// The file name without `.cu`, or the variant's name for a generated program.
    pub(crate) name: String,
    /// The CUDA C++ source, as NVRTC compiles it.
    pub(crate) code: String,
    /// The kernels, in the order their users index them.
    pub(crate) kernels: Vec<String>,
}

/// The shared element types of the attention kernels, compiled before their files.
pub(crate) const ELEMENTS: &str = include_str!("../../kernels/elements.cuh");

crate::kernel_params! {
    /// The cache write's program: [`WriteKvParams`]'s declaration, then `cache_write.cu`.
    const CACHE_WRITE = include_str!("../../kernels/cache_write.cu");

    /// The arguments of every cache-write kernel: device addresses as u64, of `[T, Hkv, D]`
    /// keys and values, of the two cache buffers and of `T` slots.
    struct WriteKvParams {
        key: u64 => "const void*",
        value: u64 => "const void*",
        key_cache: u64 => "void*",
        value_cache: u64 => "void*",
        slot_mapping: u64 => "const long long*",
        block_size: i64 => "long long",
        num_kv_heads: i32 => "int",
        head_size: i32 => "int",
        k_scale: f32 => "float",
        v_scale: f32 => "float",
    }
}

crate::kernel_params! {
    /// The block copy's program: [`CopyBlocksParams`]'s declaration, then `copy_blocks.cu`.
    const COPY_BLOCKS = include_str!("../../kernels/copy_blocks.cu");

    /// The block copy's arguments.
    struct CopyBlocksParams {
        /// The device address of the table: 3 words per layer, then 2 per pair.
        table: u64 => "const unsigned long long*",
        num_layers: i64 => "long long",
        num_pairs: i64 => "long long",
    }
}

crate::kernel_params! {
    /// The split-K merge's program after `elements.cuh` and the merge records' fields:
    /// [`MergeParams`]'s declaration, then `attention_merge.cu`.
    const ATTENTION_MERGE = include_str!("../../kernels/attention_merge.cu");

    /// The arguments of every merge kernel (device addresses as u64).
    struct MergeParams {
        /// The workspace's partial records.
        partials: u64 => "const float*",
        /// The plan's merge records.
        merges: u64 => "const i64*",
        /// `[T, H, D]`.
        output: u64 => "void*",
        num_heads: i64 => "i64",
        head_size: i64 => "i64",
        /// v_scale: multiplies each merged row.
        out_scale: f32 => "float",
        unused: f32 => "float",
    }
}

/// The cache write: one kernel per (activation dtype, cache format), indexed by
/// [`write_index`].
fn cache_write() -> KernelSource {
    let formats = ["auto", "e4m3", "e5m2"];
    KernelSource {
        name: "cache_write".into(),
        code: CACHE_WRITE.into(),
        kernels: ["f32", "f16", "bf16"]
            .iter()
            .flat_map(|d| formats.iter().map(move |f| format!("write_kv_{d}_{f}")))
            .collect(),
    }
}

/// Block copies of every layer in one launch.
fn copy_blocks_source() -> KernelSource {
    KernelSource {
        name: "copy_blocks".into(),
        code: COPY_BLOCKS.into(),
        kernels: vec!["copy_blocks".into()],
    }
}

/// The split-K merge, one kernel per output dtype, indexed by [`dtype_index`].
fn attention_merge() -> KernelSource {
    KernelSource {
        name: "attention_merge".into(),
        code: [ELEMENTS, &abi::merge_header(), ATTENTION_MERGE].concat(),
        kernels: ["f32", "f16", "bf16"]
            .iter()
            .map(|d| format!("attention_merge_{d}"))
            .collect(),
    }
}

/// The sources every GPU loads at its first use (the attention variants are compiled one by
/// one, at the first call that needs each: `variant.rs`).
pub(crate) fn fixed_sources() -> &'static [KernelSource; 3] {
    static SOURCES: OnceLock<[KernelSource; 3]> = OnceLock::new();
    SOURCES.get_or_init(|| [cache_write(), copy_blocks_source(), attention_merge()])
}

/// The row of an activation dtype in the per-dtype kernel lists.
fn dtype_index(dtype: DType, what: &str) -> Result<usize> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        DType::U8 => Err(Error::invalid(what, dtype, "f32, f16 or bf16")),
    }
}

/// The position of the cache-write kernel for `dtype` and `kv_cache_dtype` in
/// [`cache_write`]'s list.
fn write_index(dtype: DType, kv_cache_dtype: KvCacheDtype) -> Result<usize> {
    let row = dtype_index(dtype, "kv_cache.dtype")?;
    let column = match kv_cache_dtype {
        KvCacheDtype::Auto => 0,
        KvCacheDtype::Fp8E4m3 => 1,
        KvCacheDtype::Fp8E5m2 => 2,
    };
    Ok(row * 3 + column)
}

/// The kernels of one GPU that are loaded once, at its first use.
pub(crate) struct Kernels {
    write: Vec<CudaFunction>,
    copy_blocks: CudaFunction,
    merge: Vec<CudaFunction>,
}

impl Kernels {
    /// Compiles (or finds in the caches) every fixed source for `gpu`'s architecture, side by
    /// side, and loads it.
    pub(crate) fn load(gpu: &Gpu) -> Result<Self> {
        let sources = fixed_sources();
        compile::images(sources, &gpu.arch)?;
        let [write, copy, merge] = sources;
        Ok(Kernels {
            write: load(gpu, write)?,
            copy_blocks: load(gpu, copy)?.swap_remove(0),
            merge: load(gpu, merge)?,
        })
    }
}

/// Loads `source`'s image on `gpu` and looks up its kernels, in order.
pub(crate) fn load(gpu: &Gpu, source: &KernelSource) -> Result<Vec<CudaFunction>> {
    let image = compile::image(source, &gpu.arch)?;
    let module = gpu
        .ctx
        .load_module(Ptx::from_binary(image.to_vec()))
        .map_err(|e| {
            driver_error(
                &format!(
                    "cuModuleLoadData of {}.cu for {} on cuda:{}",
                    source.name, gpu.arch, gpu.ordinal
                ),
                e,
            )
        })?;
    source
        .kernels
        .iter()
        .map(|name| {
            module
                .load_function(name)
                .map_err(|e| driver_error(&format!("cuModuleGetFunction({name})"), e))
        })
        .collect()
}

/// One cache write: device addresses of `[T, Hkv, D]` keys and values, of the two cache
/// buffers (head-major layout) and of `T` slots; all valid for `spec` (the forward gate's
/// checks).
pub(crate) struct WriteKv {
    pub(crate) key: u64,
    pub(crate) value: u64,
    pub(crate) key_cache: u64,
    pub(crate) value_cache: u64,
    pub(crate) slot_mapping: u64,
    pub(crate) num_tokens: usize,
    pub(crate) spec: KvCacheSpec,
    pub(crate) scales: KvScales,
}

/// Threads per block of the cache write and the block copy.
const THREADS: u32 = 256;

/// Queues the cache write on `gpu`'s stream.
pub(crate) fn write_kv(gpu: &Gpu, w: &WriteKv) -> Result<()> {
    if w.num_tokens == 0 {
        return Ok(());
    }
    let spec = &w.spec;
    let too_big = |field: &str, value: usize| {
        Error::unsupported(
            "cuda",
            format!(
                "{field} = {value} in one cache write (at most {})",
                i32::MAX
            ),
        )
    };
    let tokens = u32::try_from(w.num_tokens)
        .ok()
        .filter(|&t| t <= i32::MAX as u32)
        .ok_or_else(|| too_big("tokens", w.num_tokens))?;
    let row = spec.num_kv_heads * spec.head_size;
    if row > i32::MAX as usize {
        return Err(too_big("num_kv_heads * head_size", row));
    }
    let params = WriteKvParams {
        key: w.key,
        value: w.value,
        key_cache: w.key_cache,
        value_cache: w.value_cache,
        slot_mapping: w.slot_mapping,
        block_size: spec.block_size as i64,
        num_kv_heads: spec.num_kv_heads as i32,
        head_size: spec.head_size as i32,
        k_scale: w.scales.k_scale,
        v_scale: w.scales.v_scale,
    };
    let kernel = &gpu.kernels()?.write[write_index(spec.dtype, spec.kv_cache_dtype)?];
    let threads = (row as u32).next_multiple_of(32).min(THREADS);
    let config = LaunchConfig {
        grid_dim: (tokens, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    gpu.with_queue(|stream| {
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&params);
        // SAFETY: `params` is the kernel's one parameter (`WriteKvParams`, by value). The
        // caller's checks keep every access in bounds: T rows of keys and
        // values, T slots, each -1 or a slot of the cache. The memory outlives the kernel:
        // device memory is freed after the streams that use it.
        unsafe { launch.launch(config) }
            .map_err(|e| driver_error("cuLaunchKernel(write_kv)", e))?;
        Ok(())
    })
}

/// One layer of a block copy: the device addresses of its key and value buffers and the
/// size of one block in bytes.
pub(crate) struct CopyLayer {
    pub(crate) key: u64,
    pub(crate) value: u64,
    pub(crate) block_bytes: u64,
}

/// Queues the copy of `(src, dst)` block pairs, in order, inside every layer, in one launch.
/// The pairs lie inside every layer (the caller checks).
pub(crate) fn copy_blocks(
    gpu: &Arc<Gpu>,
    layers: &[CopyLayer],
    pairs: &[(usize, usize)],
) -> Result<()> {
    if layers.is_empty() || pairs.is_empty() {
        return Ok(());
    }
    let num_layers = u32::try_from(layers.len())
        .ok()
        .filter(|&n| n <= i32::MAX as u32)
        .ok_or_else(|| {
            Error::unsupported("cuda", format!("copy_blocks over {} layers", layers.len()))
        })?;
    let table: Vec<u64> = layers
        .iter()
        .flat_map(|l| [l.key, l.value, l.block_bytes])
        .chain(pairs.iter().flat_map(|&(s, d)| [s as u64, d as u64]))
        .collect();
    let kernel = &gpu.kernels()?.copy_blocks;
    let bytes: &[u8] = bytemuck::cast_slice(&table);
    // SAFETY: the copy below overwrites every byte.
    let device_table = unsafe { DeviceBuffer::uninit(gpu, bytes.len())? };
    let table_address = device_table.address();
    let params = CopyBlocksParams {
        table: table_address,
        num_layers: layers.len() as i64,
        num_pairs: pairs.len() as i64,
    };
    let config = LaunchConfig {
        grid_dim: (num_layers, 2, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    gpu.with_queue(|stream| {
        // SAFETY: the destination is the whole new buffer; the pageable source is borrowed
        // for this call, which is all an upload from pageable memory needs.
        unsafe { memory::copy_async(stream, table_address, bytes.as_ptr() as u64, bytes.len())? };
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&params);
        // SAFETY: `params` is the kernel's one parameter (`CopyBlocksParams`); the table holds 3 words per
        // layer and 2 per pair as the kernel reads them, every block of every pair lies
        // inside its layer's buffers, and the table is freed (when it drops here) after the
        // streams that use it, so after the kernel.
        unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(copy_blocks)", e))
    })?;
    Ok(())
}

/// One split-K merge launch: the device addresses of the workspace's partials, of the plan's
/// merge records and of the `[T, H, D]` output, and what the records index.
pub(crate) struct Merge {
    pub(crate) partials: u64,
    pub(crate) merges: u64,
    pub(crate) count: usize,
    pub(crate) output: u64,
    pub(crate) dtype: DType,
    pub(crate) num_heads: usize,
    pub(crate) head_size: usize,
    pub(crate) v_scale: f32,
}

/// Threads per block of the merge: they stride over the head's dimensions.
const MERGE_THREADS: u32 = 128;

/// Queues the merge of `m.count` output rows from their partitions' partials.
pub(crate) fn merge(gpu: &Gpu, m: &Merge) -> Result<()> {
    if m.count == 0 {
        return Ok(());
    }
    let blocks = grid_size(m.count, "split-K merges")?;
    let kernel = &gpu.kernels()?.merge[dtype_index(m.dtype, "output.dtype")?];
    let params = MergeParams {
        partials: m.partials,
        merges: m.merges,
        output: m.output,
        num_heads: m.num_heads as i64,
        head_size: m.head_size as i64,
        out_scale: m.v_scale,
        unused: 0.0,
    };
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (MERGE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    gpu.with_queue(|stream| {
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&params);
        // SAFETY: `params` is the kernel's one parameter (`MergeParams`, by value). The plan wrote
        // `count` merge records whose partial slots lie inside the workspace (checked to hold the
        // plan's workspace bytes) and were all written by the attention kernels queued before
        // this launch on the same stream; each record's (token, head) row lies inside the output,
        // whose shape the forward gate checked.
        unsafe { launch.launch(config) }
            .map_err(|e| driver_error("cuLaunchKernel(attention_merge)", e))?;
        Ok(())
    })
}

/// A launch's block count, or `Unsupported` past the grid's limit (2^31 - 1 blocks).
pub(crate) fn grid_size(count: usize, what: &str) -> Result<u32> {
    u32::try_from(count)
        .ok()
        .filter(|&n| n <= i32::MAX as u32)
        .ok_or_else(|| Error::unsupported("cuda", format!("{count} {what} in one launch")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each fixed kernel takes its struct, declared (by `kernel_params!`, which also checks
    /// the layouts) ahead of the kernel in its program.
    #[test]
    fn fixed_kernels_take_one_struct_declared_before_their_file() {
        let [write, copy, merge] = fixed_sources();
        for (source, declaration, kernel) in [
            (
                write,
                WriteKvParams::DECLARATION,
                "(const WriteKvParams args)",
            ),
            (
                copy,
                CopyBlocksParams::DECLARATION,
                "(const CopyBlocksParams args)",
            ),
            (merge, MergeParams::DECLARATION, "(const MergeParams args)"),
        ] {
            let at = |needle: &str| source.code.find(needle).expect(needle);
            assert!(at(declaration) < at(kernel), "{}", source.name);
        }
        // The merge's declaration names elements.cuh's `i64`.
        assert!(merge.code.find(MergeParams::DECLARATION).unwrap() > ELEMENTS.len());
    }
}
