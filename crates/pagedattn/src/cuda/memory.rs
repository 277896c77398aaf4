//! Raw memory of a GPU: device buffers, pinned host buffers (with the event that tells when
//! the GPU is done with them) and the one asynchronous copy every transfer goes through.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::device::{alloc_error, driver_error, Gpu};
use crate::device::Device;
use crate::error::{Error, Result};

/// Device memory this crate owns: allocated on the GPU's own stream, and freed there after
/// that stream has waited for the callers' streams that may still use it (`queue.rs`).
pub(crate) struct DeviceBuffer {
    /// `None` only while dropping.
    slice: Option<CudaSlice<u8>>,
    gpu: Arc<Gpu>,
}

impl DeviceBuffer {
    /// `bytes` of uninitialized device memory on `gpu`.
    ///
    /// # Safety
    /// The caller overwrites every byte before anything reads it.
    pub(crate) unsafe fn uninit(gpu: &Arc<Gpu>, bytes: usize) -> Result<Self> {
        // SAFETY: the caller initializes the memory before reading it.
        Self::alloc(gpu, bytes, |s| unsafe { s.alloc::<u8>(bytes) })
    }

    /// `bytes` of zeroed device memory on `gpu` (zeroed by a memset queued on its stream).
    pub(crate) fn zeroed(gpu: &Arc<Gpu>, bytes: usize) -> Result<Self> {
        Self::alloc(gpu, bytes, |s| s.alloc_zeros::<u8>(bytes))
    }

    fn alloc(
        gpu: &Arc<Gpu>,
        bytes: usize,
        alloc: impl FnOnce(
            &Arc<CudaStream>,
        ) -> std::result::Result<CudaSlice<u8>, cudarc::driver::DriverError>,
    ) -> Result<Self> {
        check_size(bytes)?;
        refuse_in_capture(gpu)?;
        let slice = gpu.with_own_stream(false, |stream| {
            alloc(stream)
                .map_err(|e| alloc_error(Device::Cuda(gpu.ordinal), bytes, "cuMemAllocAsync", e))
        })?;
        Ok(DeviceBuffer {
            slice: Some(slice),
            gpu: gpu.clone(),
        })
    }

    /// Its device address.
    pub(crate) fn address(&self) -> u64 {
        let slice = self.slice.as_ref().expect("only None while dropping");
        // Event tracking is off (see `Gpu::open`), so the guard records nothing.
        let (address, _guard) = slice.device_ptr(&self.gpu.stream);
        address
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // The free is queued on the GPU's own stream when the slice drops, right after this.
        // A failure is kept by the context and reported by its next call.
        self.gpu.ctx.record_err(self.gpu.wait_for_callers());
        self.slice = None;
    }
}

/// [`Error::Unsupported`] inside an `on_stream` call whose stream is being captured into a
/// graph: the memory would be freed while the graph that uses it may still be replayed (and a
/// pinned allocation would end the capture).
fn refuse_in_capture(gpu: &Gpu) -> Result<()> {
    if gpu.capturing_caller() {
        return Err(Error::unsupported(
            "cuda",
            "allocating memory while the caller's stream is being captured into a graph (make \
             plans, workspaces and tensors before the capture)",
        ));
    }
    Ok(())
}

/// Refuses sizes the allocators would panic on (cudarc asserts `bytes < isize::MAX`).
pub(crate) fn check_size(bytes: usize) -> Result<()> {
    if bytes < isize::MAX as usize {
        Ok(())
    } else {
        Err(Error::invalid(
            "buffer size",
            bytes,
            "less than isize::MAX bytes",
        ))
    }
}

/// Page-locked host memory of one GPU, zero-filled when allocated. The host touches it only
/// after `done` (recorded after every asynchronous copy that reads or writes it) has passed,
/// and it is freed only then.
pub(crate) struct Pinned {
    host: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// Pinned memory any context may copy to and from (swap space).
pub(crate) const PORTABLE: u32 = sys::CU_MEMHOSTALLOC_PORTABLE;
/// Pinned memory the host only writes and the GPU reads (staging for uploads): uncached on the
/// host, faster to transfer.
pub(crate) const WRITE_COMBINED: u32 = sys::CU_MEMHOSTALLOC_WRITECOMBINED;

impl Pinned {
    /// `bytes` (> 0) of zeroed pinned memory for `gpu`, allocated with cuMemHostAlloc `flags`.
    pub(crate) fn zeroed(gpu: &Gpu, bytes: usize, flags: u32) -> Result<Self> {
        check_size(bytes)?;
        if bytes == 0 {
            // cudarc asserts a non-null pointer, which a zero-byte request need not give.
            return Err(Error::invalid("pinned buffer size", 0, "at least 1 byte"));
        }
        refuse_in_capture(gpu)?;
        let device = Device::CudaHost(gpu.ordinal);
        // SAFETY: the memory is uninitialized; it is zero-filled below, through the raw
        // pointer, before any reference to it exists.
        let mut host = unsafe { gpu.ctx.alloc_pinned_with_flags::<u8>(bytes, flags) }
            .map_err(|e| alloc_error(device, bytes, "cuMemHostAlloc", e))?;
        let done = gpu
            .ctx
            .new_event(None)
            .map_err(|e| driver_error("cuEventCreate", e))?;
        let ptr = host
            .as_mut_ptr()
            .map_err(|e| driver_error("cuEventSynchronize", e))?;
        // SAFETY: `ptr` points to `bytes` bytes just allocated for this buffer alone.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(Pinned { host, done })
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.host.len()
    }

    /// The contents, once the GPU is done with them.
    pub(crate) fn bytes(&self) -> Result<&[u8]> {
        self.wait()?;
        self.host
            .as_slice()
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }

    /// The contents, mutably, once the GPU is done with them.
    pub(crate) fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        self.host
            .as_mut_slice()
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }

    /// The address asynchronous copies use (host memory is addressed like device memory under
    /// unified addressing).
    pub(crate) fn address(&self) -> Result<u64> {
        let ptr = self
            .host
            .as_ptr()
            .map_err(|e| driver_error("cuEventSynchronize", e))?;
        Ok(ptr as u64)
    }

    /// Records that copies queued on `stream` (of its own GPU) so far use this memory.
    pub(crate) fn mark_used(&self, stream: &CudaStream) -> Result<()> {
        self.done
            .record(stream)
            .map_err(|e| driver_error("cuEventRecord", e))
    }

    /// Waits until the GPU is done with this memory.
    fn wait(&self) -> Result<()> {
        self.done
            .synchronize()
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The memory is freed when `host` drops, right after this: the copies using it must
        // be finished. A failure is kept by the context and reported by its next call.
        self.done.context().record_err(self.done.synchronize());
    }
}

/// Queues a copy of `bytes` bytes from address `src` to address `dst` (device memory, pinned
/// or pageable host memory: unified addressing tells them apart) on `stream`.
///
/// # Safety
/// Both ranges are valid for `bytes` bytes until the copy is done: device and pinned memory
/// freed in stream order or after a synchronization, pageable host memory for the duration of
/// this call (the driver stages uploads from it and finishes downloads to it before
/// returning).
pub(crate) unsafe fn copy_async(
    stream: &CudaStream,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    ctx.bind_to_thread()
        .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    // SAFETY: the caller guarantees both ranges; the stream belongs to the current context.
    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream()) }
        .result()
        .map_err(|e| {
            driver_error(
                &format!("cuMemcpyAsync of {bytes} bytes on cuda:{}", ctx.ordinal()),
                e,
            )
        })
}
