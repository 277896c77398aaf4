//! Tensors in by DLPack, zero copy.
//!
//! Two ways in. The fast one is DLPack's C exchange API (`type(t).__dlpack_c_exchange_api__`,
//! torch 2.10 and later): a C call fills a `DLTensor` view of the object in well under a
//! microsecond and names the framework's current stream. The other is the `__dlpack__`
//! protocol (numpy, older torch): a capsule holding a managed tensor this module owns until
//! it is dropped. Neither `dlpark` nor `pyo3-dlpack` exposes the exchange API, whose cost per
//! tensor is what keeps a Python call's overhead within a few microseconds, and the protocol
//! side is a few dozen lines; so the structs of `dlpack.h` (version 1.3) are declared here.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Mutex;

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::{ffi, intern};

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: c_int,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// `DLPackExchangeAPI`: only the members this module calls are typed.
#[repr(C)]
struct ExchangeApi {
    version: DLPackVersion,
    prev_api: *mut c_void,
    managed_tensor_allocator: *mut c_void,
    managed_tensor_from_py_object_no_sync: *mut c_void,
    managed_tensor_to_py_object_no_sync: *mut c_void,
    dltensor_from_py_object_no_sync:
        Option<unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int>,
    current_work_stream: Option<unsafe extern "C" fn(c_int, i32, *mut *mut c_void) -> c_int>,
}

const KDL_CPU: c_int = 1;
const KDL_CUDA: c_int = 2;
const KDL_CUDA_HOST: c_int = 3;
const READ_ONLY: u64 = 1;

/// Where an imported tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Host memory (pinned or not).
    Cpu,
    /// The memory of CUDA GPU `n`.
    Cuda(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Cpu => f.write_str("cpu"),
            Place::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// An imported tensor's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    BF16,
    U8,
    F8E4m3,
    F8E5m2,
    I32,
    I64,
    /// Anything else: (DLPack type code, bits, lanes).
    Other(u8, u8, u16),
}

impl std::fmt::Display for Elem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Elem::F32 => f.write_str("float32"),
            Elem::F16 => f.write_str("float16"),
            Elem::BF16 => f.write_str("bfloat16"),
            Elem::U8 => f.write_str("uint8"),
            Elem::F8E4m3 => f.write_str("float8_e4m3fn"),
            Elem::F8E5m2 => f.write_str("float8_e5m2"),
            Elem::I32 => f.write_str("int32"),
            Elem::I64 => f.write_str("int64"),
            Elem::Other(code, bits, lanes) => {
                write!(f, "DLPack type (code {code}, {bits} bits, {lanes} lanes)")
            }
        }
    }
}

impl Elem {
    fn of(t: DLDataType) -> Elem {
        match (t.code, t.bits, t.lanes) {
            (2, 32, 1) => Elem::F32,
            (2, 16, 1) => Elem::F16,
            (4, 16, 1) => Elem::BF16,
            (1, 8, 1) => Elem::U8,
            (10, 8, 1) => Elem::F8E4m3,
            (12, 8, 1) => Elem::F8E5m2,
            (0, 32, 1) => Elem::I32,
            (0, 64, 1) => Elem::I64,
            (code, bits, lanes) => Elem::Other(code, bits, lanes),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::BF16 => 2,
            Elem::U8 | Elem::F8E4m3 | Elem::F8E5m2 => 1,
            Elem::I64 => 8,
            Elem::Other(_, bits, lanes) => (bits as usize * lanes as usize).div_ceil(8),
        }
    }
}

/// A tensor of another library seen through DLPack: where its elements are, what they are,
/// and the object that keeps them alive (held for as long as this is).
pub struct Imported {
    /// Address of the first element.
    pub address: u64,
    pub shape: Vec<usize>,
    /// Whether the elements are dense and row-major.
    pub contiguous: bool,
    pub elem: Elem,
    pub place: Place,
    /// Whether the producer forbids writes (a read-only numpy array).
    pub read_only: bool,
    /// The Python object.
    pub object: Py<PyAny>,
    /// The managed tensor of the `__dlpack__` path, released when this is dropped.
    _managed: Option<Managed>,
}

impl Imported {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.elem.size()
    }
}

/// The exchange API of `obj`'s type, if it has one (looked up once per type).
fn exchange_api(obj: &Bound<'_, PyAny>) -> Option<&'static ExchangeApi> {
    // Type address -> API address (0: none). The type is kept alive with its entry, so that
    // its address is never reused for another type.
    type Cache = HashMap<usize, (Py<PyType>, usize)>;
    static APIS: Mutex<Option<Cache>> = Mutex::new(None);
    let ty = obj.get_type();
    let key = ty.as_ptr() as usize;
    let mut apis = APIS.lock().unwrap_or_else(|e| e.into_inner());
    let apis = apis.get_or_insert_with(HashMap::new);
    let api = match apis.get(&key) {
        Some(&(_, api)) => api,
        None => {
            let api = find_exchange_api(&ty).unwrap_or(0);
            apis.insert(key, (ty.unbind(), api));
            api
        }
    };
    // SAFETY: a nonzero entry is the address of a DLPackExchangeAPI of major version 1 that
    // its framework keeps for the life of the process (the exchange API's contract).
    (api != 0).then(|| unsafe { &*(api as *const ExchangeApi) })
}

/// The address of `ty`'s `DLPackExchangeAPI`, if it has one this module can use.
fn find_exchange_api(ty: &Bound<'_, PyType>) -> Option<usize> {
    let capsule = ty
        .getattr(intern!(ty.py(), "__dlpack_c_exchange_api__"))
        .ok()?;
    // SAFETY: `capsule` is a live object; a wrong name or type returns null with an error set,
    // which is cleared below.
    let ptr =
        unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dlpack_exchange_api".as_ptr()) };
    if ptr.is_null() {
        let _ = PyErr::take(ty.py());
        return None;
    }
    // SAFETY: a capsule of this name holds a DLPackExchangeAPI, whose header is stable.
    let api = unsafe { &*(ptr as *const ExchangeApi) };
    (api.version.major == 1
        && api.dltensor_from_py_object_no_sync.is_some()
        && api.current_work_stream.is_some())
    .then_some(ptr as usize)
}

/// Imports `obj` (a torch tensor, a numpy array, anything with `__dlpack__`); `name` names it
/// in errors.
pub fn import(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Imported> {
    if let Some(api) = exchange_api(obj) {
        let convert = api
            .dltensor_from_py_object_no_sync
            .expect("checked when the API was found");
        let mut view = std::mem::MaybeUninit::<DLTensor>::uninit();
        // SAFETY: `obj` has the type the API was found on (the cache is keyed by type); the
        // call fills `view` or returns -1 with a Python error set.
        let status = unsafe { convert(obj.as_ptr() as *mut c_void, view.as_mut_ptr()) };
        if status != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: filled by the successful call; its shape and strides stay valid while
        // `obj` lives unchanged, and are copied out at once.
        let view = unsafe { view.assume_init() };
        // SAFETY: as above.
        return unsafe { describe(&view, false, obj.clone().unbind(), name) };
    }
    import_by_protocol(obj, name)
}

/// The `__dlpack__` path: takes the capsule's managed tensor.
fn import_by_protocol(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Imported> {
    let py = obj.py();
    if !obj.hasattr(intern!(py, "__dlpack__"))? {
        return Err(PyTypeError::new_err(format!(
            "{name} is a {}: expected a tensor or array that supports DLPack (torch.Tensor, \
             numpy.ndarray)",
            obj.get_type().name()?
        )));
    }
    let kwargs = PyDict::new(py);
    // A CUDA tensor is handed over without a synchronization: the call is ordered on the
    // producer's current stream instead (see stream.rs).
    let device: (c_int, i32) = obj
        .call_method0(intern!(py, "__dlpack_device__"))?
        .extract()?;
    if device.0 == KDL_CUDA {
        kwargs.set_item("stream", -1)?;
    }
    kwargs.set_item("max_version", PyTuple::new(py, [1, 3])?)?;
    let capsule = match obj.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs)) {
        Ok(c) => c,
        // A producer older than DLPack 1.0 does not take `max_version`.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            kwargs.del_item("max_version")?;
            obj.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    let managed = Managed::take(&capsule)?;
    let (view, read_only) = managed.view();
    // SAFETY: the managed tensor is owned by `managed`, which `Imported` keeps.
    let mut imported = unsafe { describe(view, read_only, obj.clone().unbind(), name) }?;
    imported._managed = Some(managed);
    Ok(imported)
}

/// An `Imported` from a filled `DLTensor`.
///
/// # Safety
/// `view`'s shape and strides are valid for `ndim` elements, and its data for the elements
/// they describe, while `object` (and the managed tensor, if any, which the caller puts in
/// the result) live.
unsafe fn describe(
    view: &DLTensor,
    read_only: bool,
    object: Py<PyAny>,
    name: &str,
) -> PyResult<Imported> {
    let ndim = view.ndim.max(0) as usize;
    let (shape, strides): (&[i64], Option<&[i64]>) = if ndim == 0 {
        (&[], None)
    } else {
        // SAFETY: `ndim` entries (the function's contract).
        unsafe {
            (
                std::slice::from_raw_parts(view.shape, ndim),
                (!view.strides.is_null()).then(|| std::slice::from_raw_parts(view.strides, ndim)),
            )
        }
    };
    let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    // Row-major and dense: each stride the product of the sizes after it (a dimension of
    // size 1 may have any stride; no stride matters when there are no elements).
    let contiguous = match strides {
        None => true,
        Some(strides) => {
            shape.contains(&0) || {
                let mut expected = 1i64;
                shape.iter().zip(strides).rev().all(|(&size, &stride)| {
                    let ok = size == 1 || stride == expected;
                    expected = expected.saturating_mul(size as i64);
                    ok
                })
            }
        }
    };
    let place = match (view.device.device_type, view.device.device_id) {
        (KDL_CPU | KDL_CUDA_HOST, _) => Place::Cpu,
        (KDL_CUDA, id) if id >= 0 => Place::Cuda(id as usize),
        (kind, id) => {
            return Err(PyTypeError::new_err(format!(
                "{name} is on DLPack device ({kind}, {id}): expected the CPU or a CUDA GPU"
            )))
        }
    };
    Ok(Imported {
        address: (view.data as u64).wrapping_add(view.byte_offset),
        shape,
        contiguous,
        elem: Elem::of(view.dtype),
        place,
        read_only,
        object,
        _managed: None,
    })
}

/// A managed tensor taken from a DLPack capsule: released (its deleter called) on drop.
struct Managed {
    ptr: *mut c_void,
    versioned: bool,
}

// SAFETY: the managed tensor is owned by this value alone (its capsule was renamed "used"),
// and DLPack deleters may be called from any thread.
unsafe impl Send for Managed {}
// SAFETY: shared access only reads the immutable description.
unsafe impl Sync for Managed {}

impl Managed {
    /// Takes the managed tensor out of `capsule` (renaming it "used", as the protocol says).
    fn take(capsule: &Bound<'_, PyAny>) -> PyResult<Managed> {
        let names: [(&CStr, &CStr, bool); 2] = [
            (c"dltensor_versioned", c"used_dltensor_versioned", true),
            (c"dltensor", c"used_dltensor", false),
        ];
        for (name, used, versioned) in names {
            // SAFETY: `capsule` is a live object; a null answer leaves an error, cleared.
            let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), name.as_ptr()) };
            if ptr.is_null() {
                let _ = PyErr::take(capsule.py());
                continue;
            }
            // SAFETY: renames a capsule just read; `used` is a static string.
            if unsafe { ffi::PyCapsule_SetName(capsule.as_ptr(), used.as_ptr() as *const c_char) }
                != 0
            {
                return Err(PyErr::fetch(capsule.py()));
            }
            return Ok(Managed { ptr, versioned });
        }
        Err(PyBufferError::new_err(
            "__dlpack__ returned no unused DLPack capsule",
        ))
    }

    /// The tensor's description and whether it is read-only.
    fn view(&self) -> (&DLTensor, bool) {
        // SAFETY: `ptr` is a live managed tensor of the kind `versioned` says until drop.
        unsafe {
            if self.versioned {
                let m = &*(self.ptr as *const DLManagedTensorVersioned);
                (&m.dl_tensor, m.flags & READ_ONLY != 0)
            } else {
                (&(*(self.ptr as *const DLManagedTensor)).dl_tensor, false)
            }
        }
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        // SAFETY: the managed tensor is ours and released exactly once, here.
        unsafe {
            if self.versioned {
                let m = self.ptr as *mut DLManagedTensorVersioned;
                if let Some(deleter) = (*m).deleter {
                    deleter(m);
                }
            } else {
                let m = self.ptr as *mut DLManagedTensor;
                if let Some(deleter) = (*m).deleter {
                    deleter(m);
                }
            }
        }
    }
}

/// The producer's current stream on CUDA GPU `device` through the exchange API of `obj`'s
/// type, or `None` if it has none.
pub fn current_stream(obj: &Bound<'_, PyAny>, device: usize) -> PyResult<Option<u64>> {
    let Some(api) = exchange_api(obj) else {
        return Ok(None);
    };
    let query = api.current_work_stream.expect("checked when found");
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; -1 leaves a Python error.
    if unsafe { query(KDL_CUDA, device as i32, &mut stream) } != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    Ok(Some(stream as u64))
}
