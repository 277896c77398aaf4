//! The kernel sources (`crates/pagedattn/kernels/*.cu`, embedded in the library), their
//! loading on a GPU, and their launches.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::compile;
use super::device::{driver_error, Gpu};
use super::memory;
use crate::config::KvCacheDtype;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCacheSpec, KvScales};

/// A `.cu` file and the kernels (`extern "C"` names) it defines.
pub(crate) struct KernelSource {
    /// The file name without `.cu`.
    pub(crate) name: &'static str,
    /// The CUDA C++ source.
    pub(crate) code: &'static str,
    /// The kernels, in the order [`Kernels`] keeps them.
    pub(crate) kernels: &'static [&'static str],
}

/// The cache write: one kernel per (activation dtype, cache format), indexed by
/// [`write_index`].
const CACHE_WRITE: KernelSource = KernelSource {
    name: "cache_write",
    code: include_str!("../../kernels/cache_write.cu"),
    kernels: &[
        "write_kv_f32_auto",
        "write_kv_f32_e4m3",
        "write_kv_f32_e5m2",
        "write_kv_f16_auto",
        "write_kv_f16_e4m3",
        "write_kv_f16_e5m2",
        "write_kv_bf16_auto",
        "write_kv_bf16_e4m3",
        "write_kv_bf16_e5m2",
    ],
};

/// Block copies of every layer in one launch.
const COPY_BLOCKS: KernelSource = KernelSource {
    name: "copy_blocks",
    code: include_str!("../../kernels/copy_blocks.cu"),
    kernels: &["copy_blocks"],
};

/// Every kernel source.
pub(crate) const SOURCES: [&KernelSource; 2] = [&CACHE_WRITE, &COPY_BLOCKS];

/// The position of the cache-write kernel for `dtype` and `kv_cache_dtype` in
/// [`CACHE_WRITE`]'s list.
fn write_index(dtype: DType, kv_cache_dtype: KvCacheDtype) -> Result<usize> {
    let row = match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::U8 => return Err(Error::invalid("kv_cache.dtype", dtype, "f32, f16 or bf16")),
    };
    let column = match kv_cache_dtype {
        KvCacheDtype::Auto => 0,
        KvCacheDtype::Fp8E4m3 => 1,
        KvCacheDtype::Fp8E5m2 => 2,
    };
    Ok(row * 3 + column)
}

/// The kernels of one GPU, loaded once.
pub(crate) struct Kernels {
    write: Vec<CudaFunction>,
    copy_blocks: CudaFunction,
}

impl Kernels {
    /// Compiles (or finds in the caches) every source for `gpu`'s architecture and loads it.
    pub(crate) fn load(gpu: &Gpu) -> Result<Self> {
        let write = load(gpu, &CACHE_WRITE)?;
        let copy_blocks = load(gpu, &COPY_BLOCKS)?.swap_remove(0);
        Ok(Kernels { write, copy_blocks })
    }
}

/// Loads `source`'s image on `gpu` and looks up its kernels.
fn load(gpu: &Gpu, source: &'static KernelSource) -> Result<Vec<CudaFunction>> {
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

/// Threads per block of the kernels.
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
    let (heads, head_size, block_size) = (
        spec.num_kv_heads as i32,
        spec.head_size as i32,
        spec.block_size as i64,
    );
    let kernel = &gpu.kernels()?.write[write_index(spec.dtype, spec.kv_cache_dtype)?];
    let threads = (row as u32).next_multiple_of(32).min(THREADS);
    let config = LaunchConfig {
        grid_dim: (tokens, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream.launch_builder(kernel);
    launch
        .arg(&w.key)
        .arg(&w.value)
        .arg(&w.key_cache)
        .arg(&w.value_cache)
        .arg(&w.slot_mapping)
        .arg(&heads)
        .arg(&head_size)
        .arg(&block_size)
        .arg(&w.scales.k_scale)
        .arg(&w.scales.v_scale);
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as
    // 64-bit addresses). The caller's checks keep every access in bounds: T rows of keys and
    // values, T slots, each -1 or a slot of the cache. The memory outlives the kernel: frees
    // are queued on the same stream.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(write_kv)", e))?;
    Ok(())
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
pub(crate) fn copy_blocks(gpu: &Gpu, layers: &[CopyLayer], pairs: &[(usize, usize)]) -> Result<()> {
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
    let device_table = unsafe { memory::alloc_device(gpu, bytes.len())? };
    let table_address = memory::device_address(gpu, &device_table);
    // SAFETY: the destination is the whole new buffer; the pageable source is borrowed for
    // this call, which is all an upload from pageable memory needs.
    unsafe { memory::copy_async(gpu, table_address, bytes.as_ptr() as u64, bytes.len())? };
    let (layer_count, pair_count) = (layers.len() as i64, pairs.len() as i64);
    let config = LaunchConfig {
        grid_dim: (num_layers, 2, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream.launch_builder(kernel);
    launch
        .arg(&table_address)
        .arg(&layer_count)
        .arg(&pair_count);
    // SAFETY: the arguments match the kernel's parameters; the table holds 3 words per layer
    // and 2 per pair as the kernel reads them, every block of every pair lies inside its
    // layer's buffers, and the table is freed (when it drops here) in stream order, after
    // the kernel.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(copy_blocks)", e))?;
    Ok(())
}
