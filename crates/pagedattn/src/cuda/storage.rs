//! [`CudaStorage`]: the elements of a tensor or cache buffer in a GPU's memory or in pinned
//! host memory registered with it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::device::{gpu, Gpu};
use super::memory::{self, DeviceBuffer, Pinned};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{HostStorage, Storage};

/// Typed elements on a CUDA GPU ([`Device::Cuda`]) or in pinned host memory registered with
/// one ([`Device::CudaHost`]), kept as raw bytes. Operations are queued on the GPU's stream
/// (or the caller's, inside [`Cuda::on_stream`](super::Cuda::on_stream)): in order with each
/// other and the kernels, asynchronous to the host except where a method says it synchronizes.
pub struct CudaStorage {
    gpu: Arc<Gpu>,
    dtype: DType,
    len: usize,
    memory: Memory,
}

/// Where the bytes are.
enum Memory {
    /// No bytes: the allocators refuse zero-byte requests, and nothing needs one.
    Empty {
        /// Whether this is pinned host memory (an empty buffer still has a device).
        pinned: bool,
    },
    Device(DeviceBuffer),
    Pinned(Pinned),
    /// Memory another library lends (zero-copy interchange): a GPU's memory, or host memory
    /// the GPU copies to and from (`host`).
    External {
        address: u64,
        host: bool,
        /// Keeps the memory alive; dropped with the storage.
        _owner: Box<dyn Any + Send + Sync>,
    },
}

impl fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStorage")
            .field("device", &self.device())
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .finish()
    }
}

impl CudaStorage {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// [`Device::Cuda`] for device memory, [`Device::CudaHost`] for pinned host memory.
    pub fn device(&self) -> Device {
        if self.is_pinned() {
            Device::CudaHost(self.gpu.ordinal)
        } else {
            Device::Cuda(self.gpu.ordinal)
        }
    }

    /// `len` zeros of `dtype` on `device` (a GPU or its pinned host memory).
    pub fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self> {
        // SAFETY: zeroed memory.
        unsafe { Self::allocate(device, dtype, len, true) }
    }

    /// `len` elements of `dtype` on `device`: zeros, or with `zero == false` uninitialized
    /// device memory (pinned memory is always zeroed).
    ///
    /// # Safety
    /// With `zero == false`, the caller overwrites every byte before anything reads it.
    unsafe fn allocate(device: Device, dtype: DType, len: usize, zero: bool) -> Result<Self> {
        let (gpu, pinned) = target(device)?;
        let bytes = byte_len(dtype, len)?;
        let memory = match (bytes, pinned, zero) {
            (0, _, _) => Memory::Empty { pinned },
            (_, true, _) => Memory::Pinned(Pinned::zeroed(&gpu, bytes, memory::PORTABLE)?),
            (_, false, true) => Memory::Device(DeviceBuffer::zeroed(&gpu, bytes)?),
            // SAFETY: the caller overwrites it.
            (_, false, false) => Memory::Device(unsafe { DeviceBuffer::uninit(&gpu, bytes)? }),
        };
        Ok(CudaStorage {
            gpu,
            dtype,
            len,
            memory,
        })
    }

    /// `len` elements of `dtype` at `address`, lent by `owner` (dropped with the storage):
    /// memory of a GPU for [`Device::Cuda`], host memory the GPU copies to and from for
    /// [`Device::CudaHost`] (pinned is fastest; pageable memory works, with copies that wait).
    /// Kernels read and write device memory in the order of the stream the backend's work
    /// goes to.
    ///
    /// An [`Error::Invalid`] for a null or misaligned address with `len > 0` or a size that
    /// overflows; the GPU's errors if it cannot be opened.
    ///
    /// # Safety
    /// For as long as `owner` lives, `address` is the start of `len` elements of `dtype` on
    /// `device` (in the GPU's primary context, which this crate uses) that stay allocated and
    /// in place, and nothing but this storage reads or writes them except work ordered
    /// before or after this crate's (on the caller's stream, see
    /// [`Cuda::on_stream`](super::Cuda::on_stream)) or host code after a synchronization.
    pub unsafe fn from_external(
        device: Device,
        dtype: DType,
        len: usize,
        address: u64,
        owner: impl Any + Send + Sync,
    ) -> Result<Self> {
        let (gpu, host) = target(device)?;
        let bytes = byte_len(dtype, len)?;
        memory::check_size(bytes)?;
        let memory = if bytes == 0 {
            Memory::Empty { pinned: host }
        } else if address == 0 || !address.is_multiple_of(dtype.size_bytes() as u64) {
            return Err(Error::invalid(
                "external buffer address",
                format!("{address:#x}"),
                format!(
                    "a non-null address aligned to {} bytes for {dtype}",
                    dtype.size_bytes()
                ),
            ));
        } else {
            Memory::External {
                address,
                host,
                _owner: Box::new(owner),
            }
        };
        Ok(CudaStorage {
            gpu,
            dtype,
            len,
            memory,
        })
    }

    /// A copy of `host` on `device` (a GPU or its pinned host memory). Returns once `host` may
    /// be dropped; the upload to a GPU may still be running.
    pub fn upload(host: &HostStorage, device: Device) -> Result<Self> {
        // SAFETY: device memory is overwritten by the copy below.
        let mut storage = unsafe { Self::allocate(device, host.dtype(), host.len(), false)? };
        storage.write_from_host(host)?;
        Ok(storage)
    }

    /// Overwrites every byte with `host`'s, which has this storage's dtype and length (the
    /// caller checks): queued on the stream for device memory (`host` may be dropped when
    /// this returns), written at once for pinned memory.
    pub(crate) fn write_from_host(&mut self, host: &HostStorage) -> Result<()> {
        let src = host.as_bytes();
        match &mut self.memory {
            Memory::Empty { .. } => {}
            Memory::Pinned(pinned) => pinned.bytes_mut()?.copy_from_slice(src),
            Memory::External {
                address,
                host: true,
                ..
            } => {
                // Copies queued on the stream may still use it.
                self.gpu.synchronize()?;
                // SAFETY: `src.len()` bytes of host memory lent to this storage alone (the
                // constructor's contract), no copy in flight after the synchronization.
                unsafe { std::slice::from_raw_parts_mut(*address as *mut u8, src.len()) }
                    .copy_from_slice(src);
            }
            Memory::Device(_) | Memory::External { host: false, .. } => {
                let dst = self.address()?.unwrap_or(0);
                self.gpu.with_queue(|stream| {
                    // SAFETY: the destination is this whole buffer (as long as `host`, the
                    // caller checks), freed after the streams that use it; the source is
                    // borrowed for this call, which is all a copy from pageable memory needs.
                    unsafe { memory::copy_async(stream, dst, src.as_ptr() as u64, src.len()) }
                })?;
            }
        }
        Ok(())
    }

    /// A copy in host memory. Synchronizes: waits for the work queued on the GPU before it.
    pub fn download(&self) -> Result<HostStorage> {
        let mut host = HostStorage::zeros(self.dtype, self.len)?;
        match &self.memory {
            Memory::Empty { .. } => {}
            Memory::Pinned(pinned) => host.as_bytes_mut().copy_from_slice(pinned.bytes()?),
            Memory::External {
                address,
                host: true,
                ..
            } => {
                self.gpu.synchronize()?;
                let dst = host.as_bytes_mut();
                // SAFETY: `dst.len()` bytes of host memory lent to this storage (the
                // constructor's contract), no copy in flight after the synchronization.
                dst.copy_from_slice(unsafe {
                    std::slice::from_raw_parts(*address as *const u8, dst.len())
                });
            }
            Memory::Device(_) | Memory::External { host: false, .. } => {
                let dst = host.as_bytes_mut();
                let src = self.address()?.unwrap_or(0);
                self.gpu.with_queue(|stream| {
                    // SAFETY: the source is this buffer, alive for this call; the destination
                    // is pageable memory borrowed for this call and written before it
                    // returns (the synchronization below, on top of the driver's own rule).
                    unsafe { memory::copy_async(stream, dst.as_mut_ptr() as u64, src, dst.len()) }
                })?;
                self.gpu.synchronize()?;
            }
        }
        Ok(host)
    }

    /// A copy on `device`: between a GPU and its pinned memory, or between GPUs. A copy
    /// within one GPU is queued on its stream; a copy between two GPUs is finished when this
    /// returns.
    pub fn copy_to(&self, device: Device) -> Result<Self> {
        // SAFETY: the copy below overwrites every byte.
        let mut copy = unsafe { CudaStorage::allocate(device, self.dtype, self.len, false)? };
        let bytes = byte_len(self.dtype, self.len)?;
        copy.copy_ranges_from(self, std::iter::once((0, 0, bytes)))?;
        Ok(copy)
    }

    /// Copies `(source offset, destination offset, length)` byte ranges of `src` into this
    /// storage: queued on the stream when both live with one GPU, finished before returning
    /// when they live with two. The ranges lie inside both buffers (the caller checks).
    pub(crate) fn copy_ranges_from(
        &mut self,
        src: &CudaStorage,
        ranges: impl Iterator<Item = (usize, usize, usize)>,
    ) -> Result<()> {
        let (Some(from), Some(to)) = (src.address()?, self.address()?) else {
            return Ok(()); // an empty buffer: no range has bytes
        };
        let same_gpu = Arc::ptr_eq(&self.gpu, &src.gpu);
        if !same_gpu {
            // The other GPU's stream may still be writing the source.
            src.gpu.synchronize()?;
        }
        self.gpu.with_queue(|stream| {
            for (src_offset, dst_offset, len) in ranges {
                // SAFETY: the caller keeps the ranges inside both buffers; both stay allocated
                // until the copy is done (device memory freed after the streams that use it,
                // pinned memory after its event, and a copy between two GPUs is waited for
                // below).
                unsafe {
                    memory::copy_async(
                        stream,
                        to + dst_offset as u64,
                        from + src_offset as u64,
                        len,
                    )?
                };
            }
            if same_gpu {
                src.mark_used(stream)?;
                self.mark_used(stream)?;
            }
            Ok(())
        })?;
        if same_gpu {
            Ok(())
        } else {
            self.gpu.synchronize()
        }
    }

    /// The device address of device memory, for a kernel (`None` for an empty buffer), or
    /// [`Error::DeviceMismatch`] naming `what` for pinned memory.
    pub(crate) fn kernel_address(&self, what: &str) -> Result<Option<u64>> {
        match &self.memory {
            Memory::Pinned(_) | Memory::External { host: true, .. } => Err(Error::device_mismatch(
                what,
                self.device(),
                format!(
                    "{} (kernels read device memory)",
                    Device::Cuda(self.gpu.ordinal)
                ),
            )),
            _ => self.address(),
        }
    }

    /// The address copies use: device memory's, or pinned memory's host address (`None` for
    /// an empty buffer).
    fn address(&self) -> Result<Option<u64>> {
        match &self.memory {
            Memory::Empty { .. } => Ok(None),
            Memory::Device(buffer) => Ok(Some(buffer.address())),
            Memory::Pinned(pinned) => pinned.address().map(Some),
            Memory::External { address, .. } => Ok(Some(*address)),
        }
    }

    /// Records that work queued so far on `stream` uses this storage.
    fn mark_used(&self, stream: &CudaStream) -> Result<()> {
        match &self.memory {
            Memory::Pinned(pinned) => pinned.mark_used(stream),
            // Device memory is freed after the streams that use it: nothing to record.
            _ => Ok(()),
        }
    }

    fn is_pinned(&self) -> bool {
        matches!(
            self.memory,
            Memory::Pinned(_)
                | Memory::Empty { pinned: true }
                | Memory::External { host: true, .. }
        )
    }
}

/// The GPU of a CUDA device, and whether the device is its pinned host memory.
fn target(device: Device) -> Result<(Arc<Gpu>, bool)> {
    match device {
        Device::Cuda(i) => Ok((gpu(i)?, false)),
        Device::CudaHost(i) => Ok((gpu(i)?, true)),
        Device::Cpu => Err(Error::invalid(
            "device",
            device,
            "cuda:N or the pinned host memory of cuda:N (host memory is a HostStorage)",
        )),
    }
}

/// Bytes of `len` elements of `dtype`, or an error if that overflows.
fn byte_len(dtype: DType, len: usize) -> Result<usize> {
    len.checked_mul(dtype.size_bytes()).ok_or_else(|| {
        Error::invalid(
            "element count",
            len,
            format!("a count whose size in bytes as {dtype} fits in usize"),
        )
    })
}

/// The CUDA storage inside `storage`, or [`Error::DeviceMismatch`] naming `what` for host
/// storage.
pub(crate) fn cuda_storage<'a>(storage: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(c) => Ok(c),
        Storage::Host(_) => Err(on_host(what)),
    }
}

/// [`cuda_storage`], mutably.
pub(crate) fn cuda_storage_mut<'a>(
    storage: &'a mut Storage,
    what: &str,
) -> Result<&'a mut CudaStorage> {
    match storage {
        Storage::Cuda(c) => Ok(c),
        Storage::Host(_) => Err(on_host(what)),
    }
}

fn on_host(what: &str) -> Error {
    Error::device_mismatch(what, Device::Cpu, "a CUDA device: move it with to_device")
}
