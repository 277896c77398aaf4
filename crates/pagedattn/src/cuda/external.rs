//! What code outside this crate needs to run kernels of its own beside the attention, in
//! order with it and without a host wait (a model's layers between attention calls): the
//! backend's stream, NVRTC through this crate's kernel caches, and the device addresses of
//! tensors; or to run this crate's work in order with a stream of its own
//! ([`Cuda::on_stream`]).
//!
//! The stream and kernels are `cudarc`'s types (version 0.19, the `cudarc` a caller depends
//! on for launches).

use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaStream};

use super::kernels::{self, KernelSource};
use super::storage::{cuda_storage, cuda_storage_mut};
use super::Cuda;
use crate::error::Result;
use crate::tensor::Tensor;

impl Cuda {
    /// The stream every operation of this backend is queued to outside
    /// [`on_stream`](Cuda::on_stream) (one per GPU, shared by the process). Work queued on it
    /// runs in order with those attention calls, cache writes and copies;
    /// [`Backend::synchronize`](crate::Backend::synchronize) waits for it too.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// Runs `work` (calls of this backend: forward calls, cache writes, copies, plans) with
    /// its work queued on the caller's `stream`, this thread's calls on this GPU only: in
    /// order with the work queued there before and after, without a host wait and without a
    /// second stream in between (a call costs one event recorded on `stream` at the end).
    /// While `stream` is being captured into a CUDA graph, the work joins the capture (it
    /// must then be capturable: see [`capture`](Cuda::capture)).
    ///
    /// The buffers this backend allocates stay safe to use from any stream: they are freed
    /// on the backend's stream after it waits for the work queued on callers' streams, and
    /// a caller's stream waits for the backend's before it uses what was queued there
    /// (allocations, uploads). Work queued on two callers' streams is ordered by the caller,
    /// as for its own tensors (the same plan replanned on one stream and run on another
    /// needs the caller's event between them).
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU's primary context (the null stream included)
    /// for the length of the call.
    pub unsafe fn on_stream<R>(
        &self,
        stream: sys::CUstream,
        work: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        // SAFETY: the same contract.
        unsafe { self.gpu.on_stream(stream, work) }
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
    /// queued on the backend's [`stream`](Cuda::stream), or on a caller's stream within
    /// [`on_stream`](Cuda::on_stream) (device memory is freed on the backend's stream after
    /// it has waited for those).
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
