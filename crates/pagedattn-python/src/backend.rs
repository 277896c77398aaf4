//! `Backend`: a backend by name, its cache geometry, and the block copies between caches
//! (vLLM's `swap_blocks` / `copy_blocks`).

use std::sync::Arc;

use pagedattn::{BlockId, CacheLayout, DType, Device, KvCache, KvCacheDtype, KvCacheSpec};
use pyo3::prelude::*;

use crate::dlpack::{Elem, Imported, Place};
use crate::errors::{value_error, OrPyErr};
use crate::stream;
use crate::tensors::{self, Ranges};

/// A backend, kept with its concrete type where the binding needs it (the CUDA stream).
pub enum Kind {
    /// `reference` or `cpu`.
    Host(Box<dyn pagedattn::Backend>),
    /// `cuda` on one GPU.
    #[cfg(feature = "cuda")]
    Cuda(pagedattn::cuda::Cuda),
}

impl Kind {
    /// The backend.
    pub fn backend(&self) -> &dyn pagedattn::Backend {
        match self {
            Kind::Host(b) => b.as_ref(),
            #[cfg(feature = "cuda")]
            Kind::Cuda(c) => c,
        }
    }

    /// Its device.
    pub fn device(&self) -> Device {
        self.backend().device()
    }
}

/// A backend: `reference`, `cpu`, `cuda` or `auto` (see the type stubs).
#[pyclass(frozen, module = "pagedattn._native", name = "Backend")]
pub struct PyBackend {
    pub kind: Arc<Kind>,
}

#[pymethods]
impl PyBackend {
    #[new]
    #[pyo3(signature = (name = "auto", device = 0))]
    fn new(py: Python<'_>, name: &str, device: usize) -> PyResult<Self> {
        let kind = py.detach(|| open(name, device)).py()?;
        Ok(PyBackend {
            kind: Arc::new(kind),
        })
    }

    /// `reference`, `cpu` or `cuda`.
    #[getter]
    fn name(&self) -> &'static str {
        self.kind.backend().name()
    }

    /// Where its tensors live, as torch writes it: `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        match self.kind.device() {
            Device::Cuda(n) => format!("cuda:{n}"),
            _ => "cpu".into(),
        }
    }

    /// `NHD` (token-major blocks) or `HND` (head-major blocks).
    #[getter]
    fn kv_cache_layout(&self) -> &'static str {
        layout_name(self.kind.backend().kv_cache_layout())
    }

    /// The backend's own CUDA stream (a `cudaStream_t` as an int; `None` off the GPU).
    #[getter]
    fn stream(&self) -> Option<u64> {
        match &*self.kind {
            #[cfg(feature = "cuda")]
            Kind::Cuda(cuda) => Some(cuda.stream().cu_stream() as u64),
            _ => None,
        }
    }

    /// One layer's cache shape in this backend's layout.
    fn kv_cache_shape(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
    ) -> (usize, usize, usize, usize, usize) {
        let spec = KvCacheSpec {
            num_blocks,
            block_size,
            num_kv_heads,
            head_size,
            dtype: DType::F32,
            kv_cache_dtype: KvCacheDtype::Auto,
        };
        match self.kind.backend().kv_cache_layout().shape(&spec)[..] {
            [a, b, c, d, e] => (a, b, c, d, e),
            ref other => unreachable!("a cache shape has five axes, not {other:?}"),
        }
    }

    /// What the backend runs on, as (key, value) pairs.
    fn details(&self) -> Vec<(&'static str, String)> {
        self.kind.backend().details()
    }

    /// Waits for the backend's queued work.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.kind.backend().synchronize()).py()
    }

    fn __repr__(&self) -> String {
        format!("Backend({:?}, device={:?})", self.name(), self.device())
    }

    /// Copies whole blocks `src[:, s] -> dst[:, d]` for each `(s, d)` of `src_to_dst`.
    #[pyo3(signature = (src, dst, src_to_dst, *, stream = None))]
    fn swap_blocks(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        src_to_dst: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let pairs = pairs(src_to_dst, "src_to_dst")?;
        let s = self.copy_side(src, "src_kv_cache", false)?;
        let d = self.copy_side(dst, "dst_kv_cache", true)?;
        let mut ranges = Ranges::default();
        ranges.add("src_kv_cache", &s, false)?;
        ranges.add("dst_kv_cache", &d, true)?;
        let src_cache = self.block_cache(py, &s, "src_kv_cache")?;
        let mut dst_cache = self.block_cache(py, &d, "dst_kv_cache")?;
        if src_cache.spec().block_elems() != dst_cache.spec().block_elems()
            || src_cache.spec().storage_dtype() != dst_cache.spec().storage_dtype()
        {
            return Err(value_error(
                "dst_kv_cache block",
                format!("{:?} of {}", &d.shape[2..], d.elem),
                &format!("{:?} of {} (src_kv_cache's block)", &s.shape[2..], s.elem),
            ));
        }
        let on = stream::target(&self.kind, stream, [src, dst])?;
        stream::run(py, &self.kind, on, || {
            self.kind
                .backend()
                .copy_swap_blocks(&src_cache, &mut dst_cache, &pairs)
        })
    }

    /// Copies block `s` to block `d` for each `(s, d)` in every layer's cache.
    #[pyo3(signature = (kv_caches, src_to_dsts, *, stream = None))]
    fn copy_blocks(
        &self,
        py: Python<'_>,
        kv_caches: Vec<Bound<'_, PyAny>>,
        src_to_dsts: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let pairs = pairs(src_to_dsts, "src_to_dsts")?;
        let names: Vec<String> = (0..kv_caches.len())
            .map(|i| format!("kv_caches[{i}]"))
            .collect();
        let device = self.kind.device();
        let imported = kv_caches
            .iter()
            .zip(&names)
            .map(|(c, name)| tensors::argument(c, name, device, true))
            .collect::<PyResult<Vec<_>>>()?;
        let mut ranges = Ranges::default();
        for (t, name) in imported.iter().zip(&names) {
            ranges.add(name, t, true)?;
        }
        let mut caches = imported
            .iter()
            .zip(&names)
            .map(|(t, name)| self.block_cache(py, t, name))
            .collect::<PyResult<Vec<_>>>()?;
        let on = stream::target(&self.kind, stream, kv_caches.iter())?;
        stream::run(py, &self.kind, on, || {
            self.kind.backend().copy_blocks(&mut caches, &pairs)
        })
    }
}

impl PyBackend {
    /// One side of a block copy: on the backend's device, or (for a GPU) in host memory.
    fn copy_side(&self, obj: &Bound<'_, PyAny>, name: &str, write: bool) -> PyResult<Imported> {
        let t = crate::dlpack::import(obj, name)?;
        let device = match (self.kind.device(), t.place) {
            (Device::Cuda(_), Place::Cpu) => Device::Cpu,
            (device, _) => device,
        };
        tensors::check_argument(t, name, device, write)
    }

    /// A cache over `t`'s memory whose geometry is its blocks alone (a block copy moves whole
    /// blocks: heads and tokens do not matter).
    fn block_cache(&self, py: Python<'_>, t: &Imported, name: &str) -> PyResult<KvCache> {
        let (num_blocks, block_elems) = tensors::cache_blocks(t, name)?;
        let (dtype, kv_cache_dtype) = match t.elem {
            Elem::F32 => (DType::F32, KvCacheDtype::Auto),
            Elem::F16 => (DType::F16, KvCacheDtype::Auto),
            Elem::BF16 => (DType::BF16, KvCacheDtype::Auto),
            // Bytes: fp8 codes, copied as they are.
            Elem::U8 | Elem::F8E4m3 | Elem::F8E5m2 => (DType::F32, KvCacheDtype::Fp8E4m3),
            other => {
                return Err(crate::errors::type_error(
                    &format!("{name}.dtype"),
                    other,
                    "float32, float16, bfloat16, uint8 or float8",
                ))
            }
        };
        let spec = KvCacheSpec {
            num_blocks,
            block_size: 1,
            num_kv_heads: 1,
            head_size: block_elems,
            dtype,
            kv_cache_dtype,
        };
        let device = match (self.kind.device(), t.place) {
            (Device::Cuda(n), Place::Cpu) => Device::CudaHost(n),
            (device, _) => device,
        };
        tensors::kv_cache(py, t, spec, CacheLayout::Nhd, device)
    }
}

/// The backend `name` on GPU `device` (for `cuda`).
fn open(name: &str, device: usize) -> pagedattn::Result<Kind> {
    #[cfg(feature = "cuda")]
    {
        let cuda = name == "cuda" || (name == "auto" && pagedattn::cuda::gpu_present());
        if cuda {
            return pagedattn::cuda::Cuda::new(device).map(Kind::Cuda);
        }
    }
    let _ = device;
    let name = if name == "auto" { "cpu" } else { name };
    pagedattn::registry::backend(name).map(Kind::Host)
}

/// `NHD` or `HND`.
pub fn layout_name(layout: CacheLayout) -> &'static str {
    match layout {
        CacheLayout::Nhd => "NHD",
        CacheLayout::Hnd => "HND",
    }
}

/// `(src, dst)` block pairs from an `[N, 2]` index tensor or sequence.
fn pairs(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<(BlockId, BlockId)>> {
    let (values, shape) = tensors::indices(obj, name)?;
    let ok = match shape[..] {
        [n, 2] => n * 2 == values.len(),
        [0] => true,
        _ => false,
    };
    if !ok {
        return Err(value_error(
            &format!("{name}.shape"),
            format!("{shape:?}"),
            "[N, 2]: (source block, destination block) pairs",
        ));
    }
    values
        .chunks_exact(2)
        .map(|p| {
            let block = |b: i64| {
                BlockId::try_from(b)
                    .map_err(|_| value_error(name, b, "block numbers that fit in int32"))
            };
            Ok((block(p[0])?, block(p[1])?))
        })
        .collect()
}
