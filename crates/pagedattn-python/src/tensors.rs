//! Imported tensors as the library's tensors and caches, over the same memory; index
//! tensors and sequences as integers; the check that a call's tensors do not overlap.

use pagedattn::{
    CacheLayout, DType, Device, HostBuffer, HostStorage, KvCache, KvCacheDtype, KvCacheSpec,
    Storage, Tensor,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::dlpack::{import, Elem, Imported, Place};
use crate::errors::{type_error, value_error, OrPyErr};

/// Imports `obj` as an argument named `name` that the call reads (`write == false`) or
/// writes, checking what every such argument must be: C-contiguous, on `device`, writable if
/// written.
pub fn argument(
    obj: &Bound<'_, PyAny>,
    name: &str,
    device: Device,
    write: bool,
) -> PyResult<Imported> {
    check_argument(import(obj, name)?, name, device, write)
}

/// [`argument`]'s checks on a tensor already imported.
pub fn check_argument(t: Imported, name: &str, device: Device, write: bool) -> PyResult<Imported> {
    if !t.contiguous {
        return Err(PyValueError::new_err(format!(
            "{name} is not contiguous (shape {:?}): expected a C-contiguous tensor (call \
             .contiguous() on it; nothing is copied behind the caller's back)",
            t.shape
        )));
    }
    let expected = match device {
        Device::Cpu | Device::CudaHost(_) => Place::Cpu,
        Device::Cuda(n) => Place::Cuda(n),
    };
    if t.place != expected {
        return Err(type_error(
            &format!("{name}.device"),
            t.place,
            &format!("{expected} (the backend's device)"),
        ));
    }
    if write && t.read_only {
        return Err(value_error(name, "a read-only array", "a writable tensor"));
    }
    Ok(t)
}

/// The library's dtype of an activation tensor's elements.
pub fn activation_dtype(t: &Imported, name: &str) -> PyResult<DType> {
    match t.elem {
        Elem::F32 => Ok(DType::F32),
        Elem::F16 => Ok(DType::F16),
        Elem::BF16 => Ok(DType::BF16),
        other => Err(type_error(
            &format!("{name}.dtype"),
            other,
            "float32, float16 or bfloat16",
        )),
    }
}

/// A tensor of shape `shape` over `t`'s memory (on `device`), whose elements are `dtype`.
pub fn tensor(
    py: Python<'_>,
    t: &Imported,
    dtype: DType,
    shape: Vec<usize>,
    device: Device,
) -> PyResult<Tensor> {
    Tensor::new(shape, storage(py, t, 0, t.numel(), dtype, device)?).py()
}

/// `len` elements of `dtype` of `t`'s memory starting at element `first`, as storage on
/// `device` (the GPU's memory, its host memory for copies, or the host).
pub fn storage(
    py: Python<'_>,
    t: &Imported,
    first: usize,
    len: usize,
    dtype: DType,
    device: Device,
) -> PyResult<Storage> {
    let address = t.address + (first * dtype.size_bytes()) as u64;
    let owner = t.object.clone_ref(py);
    match device {
        Device::Cpu => {
            // SAFETY: `t` was imported from a live object that `owner` keeps alive; its
            // `numel` elements of `t.elem` (the same size as `dtype`) start at `t.address`
            // and the range lies inside them. The binding checks that no other tensor of the
            // call overlaps one it writes, and holds the objects for the call.
            let buffer = |ptr| unsafe { host(dtype, ptr, len, owner) };
            buffer(address).map(Storage::Host)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) | Device::CudaHost(_) => {
            // SAFETY: as for the host; the memory is the GPU's (or host memory for copies)
            // in its primary context, and the call is ordered on the producer's stream.
            unsafe {
                pagedattn::cuda::CudaStorage::from_external(device, dtype, len, address, owner)
            }
            .map(Storage::Cuda)
            .py()
        }
        #[cfg(not(feature = "cuda"))]
        _ => Err(PyTypeError::new_err("this build has no CUDA")),
    }
}

/// Host storage of `len` elements of `dtype` at `address`.
///
/// # Safety
/// As [`HostBuffer::from_external`].
unsafe fn host(dtype: DType, address: u64, len: usize, owner: Py<PyAny>) -> PyResult<HostStorage> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(match dtype {
            DType::F32 => {
                HostStorage::F32(HostBuffer::from_external(address as *mut _, len, owner).py()?)
            }
            DType::F16 => {
                HostStorage::F16(HostBuffer::from_external(address as *mut _, len, owner).py()?)
            }
            DType::BF16 => {
                HostStorage::BF16(HostBuffer::from_external(address as *mut _, len, owner).py()?)
            }
            DType::U8 => {
                HostStorage::U8(HostBuffer::from_external(address as *mut _, len, owner).py()?)
            }
        })
    }
}

/// The geometry of a cache tensor `(2, NB, ...)`: its block count and elements per block.
pub fn cache_blocks(t: &Imported, name: &str) -> PyResult<(usize, usize)> {
    match t.shape[..] {
        [2, num_blocks, ..] if num_blocks > 0 => Ok((num_blocks, t.numel() / 2 / num_blocks)),
        _ => Err(value_error(
            &format!("{name}.shape"),
            format!("{:?}", t.shape),
            "(2, num_blocks, ...): keys at index 0, values at 1",
        )),
    }
}

/// The storage dtype and fp8 flavour check of a cache tensor for `kv_cache_dtype`.
pub fn check_cache_elem(
    t: &Imported,
    kv_cache_dtype: KvCacheDtype,
    dtype: DType,
    name: &str,
) -> PyResult<()> {
    let ok = match (kv_cache_dtype, t.elem) {
        (KvCacheDtype::Auto, e) => {
            activation_dtype(t, name).is_ok_and(|d| d == dtype) && e != Elem::U8
        }
        (_, Elem::U8) => true,
        (KvCacheDtype::Fp8E4m3, Elem::F8E4m3) | (KvCacheDtype::Fp8E5m2, Elem::F8E5m2) => true,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    let expected = match kv_cache_dtype {
        KvCacheDtype::Auto => format!("{dtype} (the activations' dtype, kv_cache_dtype auto)"),
        KvCacheDtype::Fp8E4m3 => "uint8 or float8_e4m3fn (kv_cache_dtype fp8_e4m3)".into(),
        KvCacheDtype::Fp8E5m2 => "uint8 or float8_e5m2 (kv_cache_dtype fp8_e5m2)".into(),
    };
    Err(type_error(&format!("{name}.dtype"), t.elem, &expected))
}

/// The cache over `t`'s memory: keys in its first half, values in the second.
pub fn kv_cache(
    py: Python<'_>,
    t: &Imported,
    spec: KvCacheSpec,
    layout: CacheLayout,
    device: Device,
) -> PyResult<KvCache> {
    let dtype = spec.storage_dtype();
    let half = t.numel() / 2;
    let key = storage(py, t, 0, half, dtype, device)?;
    let value = storage(py, t, half, half, dtype, device)?;
    KvCache::from_storages(spec, layout, key, value).py()
}

/// The memory ranges of a call's tensors: none that is written may overlap another.
#[derive(Default)]
pub struct Ranges<'a> {
    ranges: Vec<(&'a str, Place, u64, u64, bool)>,
}

impl<'a> Ranges<'a> {
    /// Adds tensor `t`, named `name`, which the call writes if `write`.
    pub fn add(&mut self, name: &'a str, t: &Imported, write: bool) -> PyResult<()> {
        let (start, end) = (t.address, t.address + t.bytes() as u64);
        if start == end {
            return Ok(());
        }
        for &(other, place, s, e, w) in &self.ranges {
            if place == t.place && start < e && s < end && (write || w) {
                return Err(PyValueError::new_err(format!(
                    "{name} overlaps {other}: a tensor the call writes must not share memory \
                     with another of its tensors"
                )));
            }
        }
        self.ranges.push((name, t.place, start, end, write));
        Ok(())
    }
}

/// Integers from an index tensor or array (int32 / int64, any device: a CUDA tensor is
/// copied to the host first with its `.cpu()`), or a sequence of ints; with the shape.
pub fn indices(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<(Vec<i64>, Vec<usize>)> {
    if obj.hasattr("__dlpack__")? {
        let mut t = import(obj, name)?;
        if let Place::Cuda(_) = t.place {
            let host = obj.call_method0("cpu").map_err(|_| {
                PyTypeError::new_err(format!(
                    "{name} is on {}: expected host memory or a tensor with .cpu()",
                    t.place
                ))
            })?;
            t = import(&host, name)?;
        }
        if !t.contiguous {
            match obj.call_method0("contiguous") {
                // An index tensor is read once into a vector: a copy costs nothing extra.
                Ok(c) => t = import(&c, name)?,
                Err(_) => {
                    return Err(value_error(
                        name,
                        "a non-contiguous array",
                        "a contiguous one",
                    ))
                }
            }
        }
        let n = t.numel();
        // SAFETY: `n` contiguous elements of the imported type at `address`, kept alive by
        // `t` for this function; read once.
        let values: Vec<i64> = unsafe {
            match t.elem {
                Elem::I64 => std::slice::from_raw_parts(t.address as *const i64, n).to_vec(),
                Elem::I32 => std::slice::from_raw_parts(t.address as *const i32, n)
                    .iter()
                    .map(|&x| x as i64)
                    .collect(),
                other => {
                    return Err(type_error(
                        &format!("{name}.dtype"),
                        other,
                        "int32 or int64",
                    ))
                }
            }
        };
        return Ok((values, t.shape.clone()));
    }
    // A (nested) sequence of ints.
    if let Ok(flat) = obj.extract::<Vec<i64>>() {
        let n = flat.len();
        return Ok((flat, vec![n]));
    }
    let rows: Vec<Vec<i64>> = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name}: expected an int32/int64 tensor or array, or a sequence of ints"
        ))
    })?;
    let width = rows.first().map_or(0, Vec::len);
    if let Some(r) = rows.iter().position(|r| r.len() != width) {
        return Err(value_error(
            &format!("len({name}[{r}])"),
            rows[r].len(),
            &format!("{width} (every row as long as the first)"),
        ));
    }
    let shape = vec![rows.len(), width];
    Ok((rows.concat(), shape))
}
