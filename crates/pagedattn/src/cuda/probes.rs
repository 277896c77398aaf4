//! The probes of a GPU's ceilings that `pagedattn bench` measures against (feature
//! `probes`): the device-to-device copy bandwidth ([`CopyProbe`]) and the tensor cores' bf16
//! rate through `mma.sync` ([`PeakProbe`], `kernels/peak.cu`). Not part of the attention API:
//! the CLI turns the feature on.

use std::sync::Arc;

use cudarc::driver::{result as driver, LaunchConfig, PushKernelArg};

use super::device::{driver_error, Gpu};
use super::kernels::{self, KernelSource};
use super::memory::DeviceBuffer;
use super::timing::time_on;
use super::Cuda;
use crate::error::{Error, Result};

impl Cuda {
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
