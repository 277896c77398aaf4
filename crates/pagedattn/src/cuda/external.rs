//! What code outside this crate needs to run kernels of its own beside the attention, in
//! order with it and without a host wait (a model's layers between attention calls): the
//! backend's stream, NVRTC through this crate's kernel caches, and the device addresses of
//! tensors; or to run this crate's work in order with a stream of its own
//! ([`Cuda::on_stream`]).
//!
//! The stream and kernels are `cudarc`'s types (version 0.19, the `cudarc` a caller depends
//! on for launches).

use std::sync::{Arc, PoisonError};

use cudarc::driver::{sys, CudaFunction, CudaStream};

use super::device::{driver_error, Gpu};
use super::kernels::{self, KernelSource};
use super::storage::{cuda_storage, cuda_storage_mut};
use super::Cuda;
use crate::error::Result;
use crate::tensor::Tensor;

impl Cuda {
    /// The stream every operation of this backend is queued to (one per GPU, shared by the
    /// process). Work queued on it runs in order with the attention calls, cache writes and
    /// copies; [`Backend::synchronize`](crate::Backend::synchronize) waits for it too.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// Runs `work` (calls of this backend: forward calls, cache writes, copies, plans) in
    /// order with the caller's `stream`: after the work queued there before this call, and
    /// before the work queued there after it, without a host wait. The backend's stream
    /// waits for an event recorded on `stream`, `work` queues on the backend's stream, and
    /// `stream` waits for an event recorded after it. While `stream` is being captured into
    /// a CUDA graph, the backend's work joins the capture (what `work` queues must then be
    /// capturable: see [`capture`](Cuda::capture)). `work`'s error comes first; the join is
    /// queued whatever it returns.
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU's primary context (the null stream included)
    /// for the length of the call.
    pub unsafe fn on_stream<R>(
        &self,
        stream: sys::CUstream,
        work: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let ours = self.gpu.stream.cu_stream();
        if stream == ours {
            return work();
        }
        // SAFETY: the caller's stream is live (this function's contract); ours is.
        unsafe { order(&self.gpu, stream, ours)? };
        let result = work();
        // SAFETY: as above.
        let joined = unsafe { order(&self.gpu, ours, stream) };
        let value = result?;
        joined?;
        Ok(value)
    }

    /// Compiles the CUDA C++ program `code` for this GPU with NVRTC (the options and caches
    /// of the attention's kernels: the process's map, and the disk cache where
    /// [`CACHE_DIR_ENV`](super::CACHE_DIR_ENV) or the user's cache directory gives one),
    /// loads it, and returns its `extern "C"` kernels named in `kernels`, in that order.
    /// `name` names the program in errors and in the disk cache. NVRTC gets no include
    /// path: the program includes no CUDA header.
    pub fn load_kernels(
        &self,
        name: &str,
        code: &str,
        kernels: &[&str],
    ) -> Result<Vec<CudaFunction>> {
        let source = KernelSource {
            name: name.to_string(),
            code: code.to_string(),
            kernels: kernels.iter().map(|k| k.to_string()).collect(),
        };
        kernels::load(&self.gpu, &source)
    }
}

impl Tensor {
    /// The address in a GPU's memory of this tensor's first element, for a kernel of the
    /// caller's that reads it (0 for a tensor with no elements). An error for a tensor in
    /// host or pinned memory.
    ///
    /// The address stays valid while the tensor lives: a tensor's storage is never resized
    /// or moved. A kernel given it must stay inside the tensor's `numel` elements and be
    /// queued on the backend's [`stream`](Cuda::stream) (device memory is freed in that
    /// stream's order).
    pub fn cuda_address(&self) -> Result<u64> {
        Ok(cuda_storage(self.storage(), "tensor")?
            .kernel_address("tensor")?
            .unwrap_or(0))
    }

    /// [`cuda_address`](Tensor::cuda_address), for a kernel that writes the tensor: borrowed
    /// mutably, so that no shared borrow reads it meanwhile.
    pub fn cuda_address_mut(&mut self) -> Result<u64> {
        Ok(cuda_storage_mut(self.storage_mut(), "tensor")?
            .kernel_address("tensor")?
            .unwrap_or(0))
    }
}

/// Makes `later` wait for the work queued on `earlier` so far (an event recorded on `earlier`,
/// waited for by `later`; `later` = the backend's stream uses the first of the GPU's two
/// events, the caller's stream the second).
///
/// # Safety
/// Both streams are live streams of `gpu`'s primary context.
unsafe fn order(gpu: &Gpu, earlier: sys::CUstream, later: sys::CUstream) -> Result<()> {
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    // A panic never happens while the lock is held; the events stay valid if one did.
    let mut events = gpu
        .join_events
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if events.is_none() {
        let new = || {
            gpu.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| driver_error("cuEventCreate", e))
        };
        *events = Some([new()?, new()?]);
    }
    let [fork, join] = events.as_ref().expect("made above");
    let event = if later == gpu.stream.cu_stream() {
        fork
    } else {
        join
    };
    // SAFETY: the event belongs to this context; the streams are live (the caller's
    // contract). The lock keeps another thread from re-recording the event between the
    // record and the wait, which reads its state when it is queued.
    unsafe {
        sys::cuEventRecord(event.cu_event(), earlier)
            .result()
            .map_err(|e| driver_error("cuEventRecord on the caller's stream", e))?;
        sys::cuStreamWaitEvent(later, event.cu_event(), 0)
            .result()
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }
}
