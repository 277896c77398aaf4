//! Measuring a GPU, for benchmarks: CUDA events on the backend's stream ([`GpuEvent`],
//! [`Cuda::time`]), the device-to-device copy bandwidth ([`CopyProbe`]) and the tensor cores'
//! bf16 rate through `mma.sync` ([`PeakProbe`]), and the sizes a benchmark needs
//! ([`Cuda::l2_cache_bytes`], [`Cuda::sm_count`]).
//!
//! The events are recorded on the stream the backend's work goes to (its own stream, or the
//! caller's inside [`Cuda::on_stream`]), so the time between two of them is the GPU's time
//! for the work queued between them (launch gaps included when the host does not keep the
//! stream ahead).

use std::sync::Arc;

use cudarc::driver::{result as driver, sys, CudaEvent, LaunchConfig, PushKernelArg};

use super::device::{driver_error, Gpu};
use super::kernels::{self, KernelSource};
use super::memory::DeviceBuffer;
use super::Cuda;
use crate::error::{Error, Result};

/// A timing event recorded on a GPU's stream.
pub struct GpuEvent {
    event: CudaEvent,
}

impl std::fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuEvent")
    }
}

impl GpuEvent {
    /// Seconds of GPU time from this event to `end` (recorded later on the same stream);
    /// waits until `end` has passed.
    pub fn seconds_until(&self, end: &GpuEvent) -> Result<f64> {
        let ms = self
            .event
            .elapsed_ms(&end.event)
            .map_err(|e| driver_error("cuEventElapsedTime", e))?;
        Ok(f64::from(ms) / 1e3)
    }

    /// Records the event again, now, on `cuda`'s stream (an event is reused once its time
    /// has been read).
    pub fn record(&self, cuda: &Cuda) -> Result<()> {
        cuda.gpu.with_queue(|stream| {
            self.event
                .record(stream)
                .map_err(|e| driver_error("cuEventRecord", e))
        })
    }
}

/// A timing event recorded now on `gpu`'s stream.
fn record_on(gpu: &Gpu) -> Result<GpuEvent> {
    let event = gpu.with_queue(|stream| {
        stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("cuEventCreate / cuEventRecord", e))
    })?;
    Ok(GpuEvent { event })
}

/// GPU seconds of the work `work` queues on `gpu`'s stream; waits for it.
fn time_on(gpu: &Gpu, work: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = record_on(gpu)?;
    work()?;
    let end = record_on(gpu)?;
    start.seconds_until(&end)
}

impl Cuda {
    /// A timing event recorded now on the backend's stream: everything queued so far comes
    /// before it.
    pub fn record_event(&self) -> Result<GpuEvent> {
        record_on(&self.gpu)
    }

    /// Runs `work` (which queues work on the backend's stream) between two events and returns
    /// the GPU's time for it in seconds; waits until the work is done.
    pub fn time(&self, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        time_on(&self.gpu, work)
    }

    /// The GPU's L2 cache, bytes.
    pub fn l2_cache_bytes(&self) -> Result<usize> {
        let bytes = self
            .gpu
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| driver_error("cuDeviceGetAttribute(L2_CACHE_SIZE)", e))?;
        Ok(bytes.max(0) as usize)
    }

    /// The GPU's streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.gpu.sm_count
    }

    /// Two device buffers of `bytes` each, to time device-to-device copies.
    pub fn copy_probe(&self, bytes: usize) -> Result<CopyProbe> {
        let src = DeviceBuffer::zeroed(&self.gpu, bytes)?;
        let dst = DeviceBuffer::zeroed(&self.gpu, bytes)?;
        Ok(CopyProbe {
            gpu: self.gpu.clone(),
            src,
            dst,
            bytes,
        })
    }

    /// The `mma.sync` bf16 peak kernel, compiled (NVRTC) and loaded.
    pub fn peak_probe(&self) -> Result<PeakProbe> {
        let source = KernelSource {
            name: "peak".into(),
            code: include_str!("../../kernels/peak.cu").into(),
            kernels: vec!["mma_bf16_peak".into()],
        };
        let kernel = kernels::load(&self.gpu, &source)?.swap_remove(0);
        let blocks = PEAK_BLOCKS_PER_SM * self.gpu.sm_count;
        let out = DeviceBuffer::zeroed(&self.gpu, blocks * PEAK_THREADS * 4)?;
        Ok(PeakProbe {
            gpu: self.gpu.clone(),
            kernel,
            out,
            blocks,
        })
    }
}

/// Device-to-device copies of one large buffer into another (`cuMemcpyDtoDAsync`).
pub struct CopyProbe {
    gpu: Arc<Gpu>,
    src: DeviceBuffer,
    dst: DeviceBuffer,
    bytes: usize,
}

impl std::fmt::Debug for CopyProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyProbe")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl CopyProbe {
    /// Bytes copied by one pass (read once and written once).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues one copy of the whole buffer, on the backend's stream.
    pub fn queue(&self) -> Result<()> {
        let (src, dst) = (self.src.address(), self.dst.address());
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        self.gpu.with_queue(|stream| {
            // SAFETY: both ranges are whole buffers of `bytes` allocated on this GPU and alive
            // while the copy runs (freed after the streams that use them).
            unsafe { driver::memcpy_dtod_async(dst, src, self.bytes, stream.cu_stream()) }
                .map_err(|e| driver_error(&format!("cuMemcpyDtoDAsync of {} bytes", self.bytes), e))
        })
    }

    /// GPU seconds of one copy, timed with events.
    pub fn seconds(&self) -> Result<f64> {
        time_on(&self.gpu, || self.queue())
    }
}

/// Thread blocks per multiprocessor and threads per block of the peak kernel: 8 warps of 8
/// independent product chains each, 4 blocks per multiprocessor (32 warps, 8 per scheduler).
const PEAK_BLOCKS_PER_SM: usize = 4;
const PEAK_THREADS: usize = 256;
/// Independent `mma.sync` chains per warp (`CHAINS` in peak.cu).
const PEAK_CHAINS: u64 = 8;
/// FLOPs of one m16n8k16 product.
const MMA_FLOPS: u64 = 2 * 16 * 8 * 16;

/// The tensor cores' bf16 rate through `mma.sync.aligned.m16n8k16` (f32 accumulators) on
/// register operands: an upper bound for kernels built on `mma.sync`, not the chip's `wgmma`
/// rate (Hopper's bf16 peak, which only warpgroup MMAs reach).
pub struct PeakProbe {
    gpu: Arc<Gpu>,
    kernel: cudarc::driver::CudaFunction,
    out: DeviceBuffer,
    blocks: usize,
}

impl std::fmt::Debug for PeakProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeakProbe")
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl PeakProbe {
    /// FLOPs of one launch of `iters` iterations.
    pub fn flops(&self, iters: u32) -> f64 {
        let warps = (self.blocks * PEAK_THREADS / 32) as u64;
        (warps * u64::from(iters) * PEAK_CHAINS * MMA_FLOPS) as f64
    }

    /// Queues one launch of `iters` iterations on the backend's stream.
    pub fn queue(&self, iters: u32) -> Result<()> {
        let iters = i32::try_from(iters)
            .map_err(|_| Error::invalid("peak iterations", iters, "at most i32::MAX"))?;
        let out = self.out.address();
        let config = LaunchConfig {
            grid_dim: (self.blocks as u32, 1, 1),
            block_dim: (PEAK_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.gpu.with_queue(|stream| {
            let mut launch = stream.launch_builder(&self.kernel);
            launch.arg(&out).arg(&iters);
            // SAFETY: the arguments match the kernel's (float*, int); `out` holds one float
            // per thread of the grid and outlives the launch (freed after the streams that
            // use it).
            unsafe { launch.launch(config) }
                .map_err(|e| driver_error("cuLaunchKernel(mma_bf16_peak)", e))?;
            Ok(())
        })
    }

    /// FLOP/s of one launch of `iters` iterations, timed with events.
    pub fn rate(&self, iters: u32) -> Result<f64> {
        let seconds = time_on(&self.gpu, || self.queue(iters))?;
        Ok(self.flops(iters) / seconds.max(1e-9))
    }
}
