//! The GPUs of this process: one context and one stream per ordinal, opened at first use and
//! kept for the life of the process; what a GPU is ([`info`]); and the driver's errors.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::result::{self as driver, DriverError};
use cudarc::driver::{sys, CudaContext, CudaStream};

use super::compile;
use super::kernels::Kernels;
use super::memory::Pinned;
use super::queue::StreamOrder;
use super::variant;
use crate::device::Device;
use crate::error::{Error, Result};

/// One GPU: its context, the stream every operation of this crate on it is queued to (but
/// those of calls on a caller's stream, see `queue.rs`), and its kernels (loaded at first
/// use).
pub(crate) struct Gpu {
    /// The device ordinal.
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    pub(crate) capability: (u32, u32),
    /// The architecture its kernels are compiled for, e.g. `sm_90a`.
    pub(crate) arch: String,
    /// Streaming multiprocessors (how many thread blocks keep it busy).
    pub(crate) sm_count: usize,
    kernels: OnceLock<Kernels>,
    /// The attention variants loaded so far.
    pub(crate) variants: variant::Loaded,
    /// Staging memory of plans that were dropped, for the next plans (`packed.rs`).
    pub(crate) staging: Mutex<Vec<Pinned>>,
    /// How `stream` is ordered with the callers' streams work went to (`queue.rs`).
    pub(crate) order: StreamOrder,
}

impl Gpu {
    /// Opens GPU `ordinal`: retains its primary context and creates the stream.
    fn open(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            driver_error(
                &format!("opening cuda:{ordinal} (cuDevicePrimaryCtxRetain)"),
                e,
            )
        })?;
        // SAFETY: cudarc's event tracking orders uses of one buffer across several streams
        // with events recorded at every use. This crate orders its streams itself: buffers
        // are allocated and freed on `stream`, which waits for the callers' streams before a
        // free, and a caller's stream waits for `stream` before using what it queued
        // (`queue.rs`); copies between two GPUs synchronize, and pinned memory, which the
        // host also reads, carries its own event. Disabling it before anything is allocated
        // leaves no buffer with half of the bookkeeping.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| {
            driver_error(
                &format!("creating a stream on cuda:{ordinal} (cuStreamCreate)"),
                e,
            )
        })?;
        let (major, minor) = ctx.compute_capability().map_err(|e| {
            driver_error(
                &format!("reading the compute capability of cuda:{ordinal}"),
                e,
            )
        })?;
        let capability = (major.max(0) as u32, minor.max(0) as u32);
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| {
                driver_error(
                    &format!("reading the multiprocessor count of cuda:{ordinal}"),
                    e,
                )
            })?;
        Ok(Gpu {
            ordinal,
            ctx,
            stream,
            capability,
            arch: compile::arch_for(capability.0, capability.1),
            sm_count: sm_count.max(1) as usize,
            kernels: OnceLock::new(),
            variants: Default::default(),
            staging: Mutex::new(Vec::new()),
            order: StreamOrder::default(),
        })
    }

    /// Whether [`kernels`](Gpu::kernels) has loaded the fixed kernels.
    pub(crate) fn fixed_kernels_loaded(&self) -> bool {
        self.kernels.get().is_some()
    }

    /// The kernels, compiled (or read from the caches) and loaded at the first call.
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        if let Some(kernels) = self.kernels.get() {
            return Ok(kernels);
        }
        // Two threads may both load at the first call; one result is kept, the other dropped.
        let loaded = Kernels::load(self)?;
        Ok(self.kernels.get_or_init(|| loaded))
    }
}

/// The GPU `ordinal`, opened at the first call and shared by every caller in the process.
pub(crate) fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: Mutex<Vec<Option<Arc<Gpu>>>> = Mutex::new(Vec::new());
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::invalid(
            "device",
            Device::Cuda(ordinal),
            format!("cuda:0 to cuda:{} (the GPUs of this machine)", count - 1),
        ));
    }
    // A panic never happens while the lock is held, and the list stays valid if one did.
    let mut gpus = GPUS.lock().unwrap_or_else(PoisonError::into_inner);
    if gpus.len() < count {
        gpus.resize(count, None);
    }
    if let Some(gpu) = &gpus[ordinal] {
        return Ok(gpu.clone());
    }
    let gpu = Arc::new(Gpu::open(ordinal)?);
    gpus[ordinal] = Some(gpu.clone());
    Ok(gpu)
}

/// The number of GPUs, after checking once that the driver library loads, initializes and
/// sees one; otherwise why no GPU is usable.
fn device_count() -> Result<usize> {
    static COUNT: OnceLock<Result<usize>> = OnceLock::new();
    COUNT
        .get_or_init(|| {
            // SAFETY: only tries to open the library under the names cudarc loads it by;
            // cudarc panics on its first call into a library it cannot find.
            if !unsafe { sys::is_culib_present() } {
                return Err(no_gpu(
                    "libcuda not found (no NVIDIA driver on this machine)",
                ));
            }
            driver::init().map_err(|e| no_gpu(&driver_error("cuInit", e).to_string()))?;
            let count = driver::device::get_count()
                .map_err(|e| no_gpu(&driver_error("cuDeviceGetCount", e).to_string()))?;
            if count > 0 {
                Ok(count as usize)
            } else {
                Err(no_gpu("the driver sees no CUDA device"))
            }
        })
        .clone()
}

/// What a GPU is, for `pagedattn info` and the backend's details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its ordinal.
    pub ordinal: usize,
    /// GPUs on this machine.
    pub num_devices: usize,
    /// The device name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// The architecture the kernels are compiled for, e.g. `sm_90a`.
    pub arch: String,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Free device memory in bytes when asked.
    pub free_memory: usize,
    /// The newest CUDA version the driver supports (major, minor).
    pub driver_version: (u32, u32),
    /// The NVRTC version, or `None` if libnvrtc cannot be loaded (the kernels cannot compile).
    pub nvrtc_version: Option<(u32, u32)>,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} of {}: {}, compute capability {major}.{minor} (kernels for {}), {:.1} GiB ({:.1} GiB free), driver for CUDA {}.{}, ",
            self.ordinal,
            self.num_devices,
            self.name,
            self.arch,
            self.total_memory as f64 / GIB,
            self.free_memory as f64 / GIB,
            self.driver_version.0,
            self.driver_version.1,
        )?;
        match self.nvrtc_version {
            Some((major, minor)) => write!(f, "NVRTC {major}.{minor}"),
            None => f.write_str("NVRTC not found (kernels cannot compile)"),
        }
    }
}

/// `gpu`'s memory now.
pub(crate) fn memory_of(gpu: &Gpu) -> Result<crate::MemoryInfo> {
    let (free, total) = gpu
        .ctx
        .mem_get_info()
        .map_err(|e| driver_error(&format!("cuMemGetInfo on cuda:{}", gpu.ordinal), e))?;
    Ok(crate::MemoryInfo {
        total: total as u64,
        available: free as u64,
    })
}

/// What GPU 0 is, or one line saying why no GPU is usable (no libcuda, no device, a driver
/// error).
pub fn info() -> Result<DeviceInfo> {
    info_of(&*gpu(0)?)
}

/// What `gpu` is.
pub(crate) fn info_of(gpu: &Gpu) -> Result<DeviceInfo> {
    let ctx = &gpu.ctx;
    let what = |call: &str| format!("{call} on cuda:{}", gpu.ordinal);
    let name = ctx
        .name()
        .map_err(|e| driver_error(&what("cuDeviceGetName"), e))?;
    let total_memory = ctx
        .total_mem()
        .map_err(|e| driver_error(&what("cuDeviceTotalMem"), e))?;
    let free_memory = memory_of(gpu)?.available as usize;
    let mut version = 0;
    // SAFETY: writes one int through a valid pointer; the library is loaded (the GPU is open).
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| driver_error("cuDriverGetVersion", e))?;
    let version = version.max(0) as u32;
    Ok(DeviceInfo {
        ordinal: gpu.ordinal,
        num_devices: device_count()?,
        name,
        compute_capability: gpu.capability,
        arch: gpu.arch.clone(),
        total_memory,
        free_memory,
        driver_version: (version / 1000, version % 1000 / 10),
        nvrtc_version: compile::nvrtc_version().ok(),
    })
}

/// Whether the driver is installed and sees at least one GPU.
pub fn gpu_present() -> bool {
    device_count().is_ok()
}

/// The error saying no GPU is usable, and why.
fn no_gpu(reason: &str) -> Error {
    Error::Driver(format!("no usable CUDA GPU: {reason}"))
}

/// [`Error::CudaDriver`] for a failed driver call, naming what was being done and keeping the
/// driver's code.
pub(crate) fn driver_error(what: &str, e: DriverError) -> Error {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    Error::CudaDriver {
        call: what.to_string(),
        code: e.0 as u32,
        name,
        description: e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "no description".to_string()),
    }
}

/// [`Error::OutOfMemory`] for an allocation that ran out of memory, [`driver_error`] otherwise.
pub(crate) fn alloc_error(device: Device, bytes: usize, what: &str, e: DriverError) -> Error {
    match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
            device: device.to_string(),
            bytes,
        },
        _ => driver_error(&format!("{what} of {bytes} bytes on {device}"), e),
    }
}
