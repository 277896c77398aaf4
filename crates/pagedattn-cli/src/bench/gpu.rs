//! The GPU's side of a benchmark run (`--backend cuda`): iterations timed with CUDA events on
//! the backend's stream, and the GPU's own ceilings, measured in the same run:
//!
//! * device copy bandwidth: `cuMemcpyDtoDAsync` of one large buffer into another, timed with
//!   events, counted as (bytes read + bytes written) / time, the usual "copy bandwidth" (the
//!   read rate alone is half of it). Decode rows' KV bytes read per second are compared with
//!   it, as issue 12's target is ("3.5 TB/s of KV read, about 88% of the copy bandwidth").
//! * `mma.sync` bf16 peak: back-to-back independent `mma.sync.aligned.m16n8k16` products
//!   (bf16 operands, f32 accumulators) on register operands (`kernels/peak.cu`); prefill rows
//!   are compared with it. It is the rate of that instruction, not Hopper's `wgmma` peak.
//!
//! Both are re-measured between a row's iterations (one copy, one short peak launch), as the
//! CPU's are. The working set of rotated caches is 8x the GPU's L2.

use pagedattn::cuda::{CopyProbe, Cuda, DeviceInfo, GpuEvent, PeakProbe};
use pagedattn::Result;
use serde_json::{json, Value};

use super::platform::{Bounds, MemoryNow, Platform, Target};
use super::timing::{median, Clock};

/// How large and how long the GPU's ceiling measurements are.
#[derive(Debug, Clone, Copy)]
pub struct GpuCeilingPlan {
    /// Bytes of each of the copy's two buffers.
    pub copy_bytes: usize,
    /// Copies timed at the start (the median is reported).
    pub copy_passes: usize,
    /// GPU seconds of one peak launch.
    pub peak_seconds: f64,
    /// Peak launches timed at the start (the median is reported).
    pub peak_repeats: usize,
}

const MEM_NAME: &str = "device copy bandwidth, (read + write) bytes / time";
const COMPUTE_NAME: &str = "mma.sync bf16 peak (m16n8k16, f32 accumulate)";

/// A GPU, its probes and its ceilings measured at the start of the run.
pub struct GpuPlatform {
    cuda: Cuda,
    l2_bytes: usize,
    copy: CopyProbe,
    peak: PeakProbe,
    /// Iterations of one peak launch (about `peak_seconds`).
    peak_iters: u32,
    /// Copy bandwidth of each pass, (read + write) GB/s.
    copy_passes: Vec<f64>,
    /// Peak of each launch, GFLOP/s.
    peak_passes: Vec<f64>,
}

impl GpuPlatform {
    /// Opens GPU `ordinal` and measures its ceilings.
    pub fn measure(ordinal: usize, plan: &GpuCeilingPlan) -> Result<GpuPlatform> {
        let cuda = Cuda::new(ordinal)?;
        let l2_bytes = cuda.l2_cache_bytes()?;
        let copy = cuda.copy_probe(plan.copy_bytes)?;
        let peak = cuda.peak_probe()?;
        // Warm-up (the first launch of each loads its module), then calibrate the peak
        // launch to about `peak_seconds`.
        copy.seconds()?;
        let mut iters = 64u32;
        loop {
            let seconds = peak.flops(iters) / peak.rate(iters)?;
            if seconds >= plan.peak_seconds / 4.0 || iters >= 1 << 24 {
                let scale = (plan.peak_seconds / seconds.max(1e-9)).clamp(1.0, 64.0);
                iters = ((f64::from(iters) * scale) as u32).max(1);
                break;
            }
            iters *= 4;
        }
        let rw_gbs = |copy: &CopyProbe| -> Result<f64> {
            Ok(2.0 * copy.bytes() as f64 / copy.seconds()? / 1e9)
        };
        let copy_passes = (0..plan.copy_passes.max(1))
            .map(|_| rw_gbs(&copy))
            .collect::<Result<Vec<_>>>()?;
        let peak_passes = (0..plan.peak_repeats.max(1))
            .map(|_| Ok(peak.rate(iters)? / 1e9))
            .collect::<Result<Vec<_>>>()?;
        Ok(GpuPlatform {
            cuda,
            l2_bytes,
            copy,
            peak,
            peak_iters: iters,
            copy_passes,
            peak_passes,
        })
    }

    fn info(&self) -> &DeviceInfo {
        self.cuda.info()
    }

    fn copy_gbs(&self) -> f64 {
        median(&self.copy_passes)
    }

    fn peak_gflops(&self) -> f64 {
        median(&self.peak_passes)
    }
}

impl Platform for GpuPlatform {
    fn target(&self) -> Target {
        Target::Gpu
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            mem_gbs: self.copy_gbs(),
            mem_name: MEM_NAME,
            paged_gbs: None,
            compute_gflops: self.peak_gflops(),
            compute_name: COMPUTE_NAME,
            memory_paging_ratio: None,
        }
    }

    fn summary(&self) -> Vec<String> {
        let i = self.info();
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            (lo, hi)
        };
        let (clo, chi) = range(&self.copy_passes);
        let (plo, phi) = range(&self.peak_passes);
        vec![
            format!(
                "gpu: {} (cuda:{}), compute capability {}.{} (kernels for {}), {} SMs, L2 {} MiB, {:.1} GiB, driver for CUDA {}.{}",
                i.name,
                i.ordinal,
                i.compute_capability.0,
                i.compute_capability.1,
                i.arch,
                self.cuda.sm_count(),
                self.l2_bytes >> 20,
                i.total_memory as f64 / (1u64 << 30) as f64,
                i.driver_version.0,
                i.driver_version.1
            ),
            format!(
                "device copy (cuMemcpyDtoDAsync, {} MiB, CUDA events): {:.1} GB/s counting read + write bytes \
                 (passes {clo:.1}..{chi:.1}), i.e. {:.1} GB/s of reads",
                self.copy.bytes() >> 20,
                self.copy_gbs(),
                self.copy_gbs() / 2.0
            ),
            format!(
                "mma.sync bf16 peak (m16n8k16, f32 accumulate, register operands, {} SMs x {} iterations): \
                 {:.1} TFLOP/s (launches {:.1}..{:.1}); not the wgmma peak",
                self.cuda.sm_count(),
                self.peak_iters,
                self.peak_gflops() / 1e3,
                plo / 1e3,
                phi / 1e3
            ),
        ]
    }

    fn to_json(&self) -> Value {
        json!({
            "kind": "gpu",
            "copy_gbs": self.copy_gbs(),
            "copy_read_gbs": self.copy_gbs() / 2.0,
            "copy_gbs_passes": self.copy_passes,
            "copy_bytes": self.copy.bytes(),
            "copy_counting": "(read + write) bytes / time",
            "mma_bf16_gflops": self.peak_gflops(),
            "mma_bf16_gflops_passes": self.peak_passes,
            "mma_iters": self.peak_iters,
            "mem_ceiling": MEM_NAME,
            "mem_ceiling_gbs": self.copy_gbs(),
            "compute_ceiling": COMPUTE_NAME,
            "compute_ceiling_gflops": self.peak_gflops(),
        })
    }

    fn device_json(&self) -> Option<Value> {
        let i = self.info();
        Some(json!({
            "name": i.name,
            "ordinal": i.ordinal,
            "compute_capability": [i.compute_capability.0, i.compute_capability.1],
            "arch": i.arch,
            "sm_count": self.cuda.sm_count(),
            "l2_bytes": self.l2_bytes,
            "total_memory": i.total_memory,
            "driver_cuda_version": [i.driver_version.0, i.driver_version.1],
            "nvrtc_version": i.nvrtc_version.map(|(a, b)| [a, b]),
        }))
    }

    fn working_set(&self) -> usize {
        8 * self.l2_bytes.max(1 << 20)
    }

    fn clock(&self) -> Result<Box<dyn Clock + '_>> {
        Ok(Box::new(EventClock {
            cuda: &self.cuda,
            events: Vec::new(),
            used: 0,
        }))
    }

    fn probe_memory(&self) -> Result<MemoryNow> {
        Ok(MemoryNow {
            mem_gbs: 2.0 * self.copy.bytes() as f64 / self.copy.seconds()? / 1e9,
            paged_gbs: None,
        })
    }

    fn probe_compute(&self) -> Result<f64> {
        // A quarter of the calibrated launch: enough to fill the GPU, short between rows.
        Ok(self.peak.rate((self.peak_iters / 4).max(1))? / 1e9)
    }
}

/// Marks as CUDA events on the backend's stream: the host queues iterations ahead, and the
/// events are read (waiting for the GPU) only at [`Clock::laps`]. Events are reused.
struct EventClock<'a> {
    cuda: &'a Cuda,
    events: Vec<GpuEvent>,
    used: usize,
}

impl Clock for EventClock<'_> {
    fn mark(&mut self) -> Result<()> {
        if let Some(e) = self.events.get(self.used) {
            e.record(self.cuda)?;
        } else {
            self.events.push(self.cuda.record_event()?);
        }
        self.used += 1;
        Ok(())
    }

    fn laps(&mut self) -> Result<Vec<f64>> {
        let marks = &self.events[..self.used];
        let laps = marks
            .windows(2)
            .map(|w| w[0].seconds_until(&w[1]))
            .collect::<Result<Vec<_>>>();
        self.used = 0;
        laps
    }
}
