//! What differs between a run on the CPU and one on a GPU, behind one trait: how iterations are
//! timed, which ceilings bound the rows (measured at the start and re-measured between a row's
//! iterations), how large the rotated working set must be, and the shapes of the workloads.
//! Everything else (workloads, timing loop, rows, JSON) is shared.

use pagedattn::cpu::Isa;
use pagedattn::Result;
use serde_json::Value;

use super::ceilings::{CeilingPlan, Ceilings, Probes};
use super::timing::{Clock, HostClock};

/// Which family of shapes the workloads take (`workloads::suite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The CPU backends' shapes (issue 3's targets).
    Cpu,
    /// A GPU's shapes (issue 12's targets: larger batches and prompts, the mixed batch's
    /// parts).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gpu,
}

/// The ceilings the rows are compared with, as measured at the start of the run.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The memory ceiling, GB/s.
    pub mem_gbs: f64,
    /// What it is, for the table's footnote and the JSON.
    pub mem_name: &'static str,
    /// The read rate of the headline decode's access pattern, GB/s, where it is measured.
    pub paged_gbs: Option<f64>,
    /// The compute ceiling, GFLOP/s.
    pub compute_gflops: f64,
    /// What it is.
    pub compute_name: &'static str,
    /// The memory's own shuffled / contiguous ratio for the decode's read order, where
    /// measured.
    pub memory_paging_ratio: Option<f64>,
}

/// The ceilings re-measured once between a row's iterations.
#[derive(Debug, Clone, Copy)]
pub struct MemoryNow {
    /// The memory ceiling, GB/s.
    pub mem_gbs: f64,
    /// The paged read rate, GB/s, where measured.
    pub paged_gbs: Option<f64>,
}

/// The device-specific part of a benchmark run.
pub trait Platform {
    /// The shapes the workloads take.
    fn target(&self) -> Target;
    /// The ceilings measured at the start.
    fn bounds(&self) -> Bounds;
    /// Lines for the table header (`ceiling: ...`).
    fn summary(&self) -> Vec<String>;
    /// The ceilings' JSON object.
    fn to_json(&self) -> Value;
    /// What the device is, for the JSON (None for the CPU: `machine` says it).
    fn device_json(&self) -> Option<Value>;
    /// Bytes of cache to rotate over, at least.
    fn working_set(&self) -> usize;
    /// A clock for the backend's work.
    fn clock(&self) -> Result<Box<dyn Clock + '_>>;
    /// The memory ceiling, measured once now.
    fn probe_memory(&self) -> Result<MemoryNow>;
    /// The compute ceiling, measured once now, GFLOP/s.
    fn probe_compute(&self) -> Result<f64>;
}

/// The CPU: host wall clock, the memory read bandwidth, the paged read rate and the peak of all
/// cores of the instruction the prefill runs (`tdpbf16ps`, `vdpbf16ps` or f32 FMA, by the
/// instruction set); working set 8x the last-level cache.
pub struct CpuPlatform {
    ceilings: Ceilings,
    probes: Probes,
    working_set: usize,
}

impl CpuPlatform {
    /// Measures the CPU's ceilings on `isa` with `threads` threads.
    pub fn measure(
        plan: &CeilingPlan,
        threads: usize,
        isa: Isa,
        working_set: usize,
    ) -> CpuPlatform {
        let (ceilings, probes) = Ceilings::measure(plan, threads, isa);
        CpuPlatform {
            ceilings,
            probes,
            working_set,
        }
    }

    /// The ceilings measured at the start.
    #[cfg(test)]
    pub fn ceilings(&self) -> &Ceilings {
        &self.ceilings
    }
}

impl Platform for CpuPlatform {
    fn target(&self) -> Target {
        Target::Cpu
    }

    fn bounds(&self) -> Bounds {
        let c = &self.ceilings;
        let (compute_gflops, compute_name) = c.compute_ceiling();
        Bounds {
            mem_gbs: c.mem_read_gbs,
            mem_name: "sequential memory read bandwidth",
            paged_gbs: Some(c.paged_read_gbs()),
            compute_gflops,
            compute_name,
            memory_paging_ratio: Some(c.memory_paging_ratio()),
        }
    }

    fn summary(&self) -> Vec<String> {
        self.ceilings.summary()
    }

    fn to_json(&self) -> Value {
        self.ceilings.to_json()
    }

    fn device_json(&self) -> Option<Value> {
        None
    }

    fn working_set(&self) -> usize {
        self.working_set
    }

    fn clock(&self) -> Result<Box<dyn Clock + '_>> {
        Ok(Box::new(HostClock::default()))
    }

    fn probe_memory(&self) -> Result<MemoryNow> {
        Ok(MemoryNow {
            mem_gbs: self.probes.mem_pass(),
            paged_gbs: Some(self.probes.paged_pass()),
        })
    }

    fn probe_compute(&self) -> Result<f64> {
        Ok(self.probes.compute_pass())
    }
}
