//! Timing a GPU's work: CUDA events on the backend's stream ([`GpuEvent`], [`Cuda::time`]),
//! and the sizes a measurement needs ([`Cuda::l2_cache_bytes`], [`Cuda::sm_count`]). (The
//! probes of the GPU's ceilings are `probes.rs`, behind the `probes` feature.)
//!
//! The events are recorded on the stream the backend's work goes to (its own stream, or the
//! caller's inside [`Cuda::on_stream`]), so the time between two of them is the GPU's time
//! for the work queued between them (launch gaps included when the host does not keep the
//! stream ahead).

use cudarc::driver::{sys, CudaEvent};

use super::device::{driver_error, Gpu};
use super::Cuda;
use crate::error::Result;

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
pub(super) fn record_on(gpu: &Gpu) -> Result<GpuEvent> {
    let event = gpu.with_queue(|stream| {
        stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("cuEventCreate / cuEventRecord", e))
    })?;
    Ok(GpuEvent { event })
}

/// GPU seconds of the work `work` queues on `gpu`'s stream; waits for it.
pub(super) fn time_on(gpu: &Gpu, work: impl FnOnce() -> Result<()>) -> Result<f64> {
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
}
