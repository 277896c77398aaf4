//! Results: one row per workload, printed as a table line and collected into the JSON output.

use serde_json::{json, Value};

use super::load::Load;
use super::platform::Bounds;
use super::timing::Stats;
use super::workloads::{Suite, Workload};

/// What a row is bound by, so the table shows the figure that matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// KV bytes per second against the memory read bandwidth (decode).
    Memory,
    /// FLOPs per second against the compute peak (prefill).
    Compute,
    /// Both (a mixed batch).
    Both,
}

/// The ceilings re-measured between a row's iterations (medians; None where not probed).
#[derive(Debug, Clone, Copy, Default)]
pub struct During {
    /// Sequential memory read bandwidth, GB/s.
    pub mem_bw: Option<f64>,
    /// Read rate of the headline decode's access pattern, GB/s.
    pub paged_read: Option<f64>,
    /// Compute peak, GFLOP/s.
    pub compute: Option<f64>,
}

/// One measured workload.
#[derive(Debug, Clone)]
pub struct Row {
    /// The workload.
    pub workload: Workload,
    /// Caches rotated over.
    pub layers: usize,
    /// The timings, seconds.
    pub stats: Stats,
    /// What the row is compared with.
    pub bound: Bound,
    /// KV bytes read per call.
    pub kv_bytes: f64,
    /// FLOPs per call.
    pub flops: f64,
    /// KV GB/s at the median time.
    pub gbs: f64,
    /// FLOP rate at the median time, GFLOP/s.
    pub gflops: f64,
    /// Memory read bandwidth measured between this row's iterations (median), GB/s.
    pub mem_bw_during: Option<f64>,
    /// Read rate of the headline decode's access pattern measured between this row's
    /// iterations (median), GB/s.
    pub paged_read_during: Option<f64>,
    /// Compute peak measured between this row's iterations (median), GFLOP/s.
    pub compute_during: Option<f64>,
    /// `gbs` as % of the memory read bandwidth measured during the row (or at the start).
    pub pct_mem_bw: f64,
    /// `gbs` as % of the paged read rate measured during the row (or at the start), where
    /// the platform measures one.
    pub pct_paged_read: Option<f64>,
    /// `gflops` as % of the compute ceiling measured during the row (or at the start).
    pub pct_compute: f64,
    /// What other processes used while the row was timed.
    pub load: Option<Load>,
    /// On a device backend: host time to queue one call, µs (median of bursts of calls
    /// queued back to back after a synchronization), what a caller's thread spends per call.
    pub host_us: Option<f64>,
}

impl Row {
    /// What a workload is bound by.
    pub fn bound_of(workload: &Workload) -> Bound {
        match workload.suite {
            Suite::Decode => Bound::Memory,
            Suite::Prefill => Bound::Compute,
            Suite::Paging if workload.seqs.iter().all(|s| s.is_decode) => Bound::Memory,
            Suite::Paging => Bound::Compute,
            Suite::Mixed => Bound::Both,
        }
    }

    /// A row from a workload's timings, the ceilings measured at the start, and those
    /// measured between the row's iterations.
    pub fn new(
        workload: &Workload,
        layers: usize,
        stats: Stats,
        bounds: &Bounds,
        during: During,
    ) -> Row {
        let bound = Row::bound_of(workload);
        let (kv_bytes, flops) = (workload.kv_bytes(), workload.flops());
        let gbs = kv_bytes / stats.median / 1e9;
        let gflops = flops / stats.median / 1e9;
        Row {
            workload: workload.clone(),
            layers,
            stats,
            bound,
            kv_bytes,
            flops,
            gbs,
            gflops,
            mem_bw_during: during.mem_bw,
            paged_read_during: during.paged_read,
            compute_during: during.compute,
            pct_mem_bw: 100.0 * gbs / during.mem_bw.unwrap_or(bounds.mem_gbs),
            pct_paged_read: during
                .paged_read
                .or(bounds.paged_gbs)
                .map(|paged| 100.0 * gbs / paged),
            pct_compute: 100.0 * gflops / during.compute.unwrap_or(bounds.compute_gflops),
            load: None,
            host_us: None,
        }
    }

    /// The column headers of [`Row::line`].
    pub fn header() -> String {
        format!(
            "{:<8} {:<40} {:>6} {:>6} {:>10} {:>10} {:>8} {:>6} {:>7} {:>6} {:>7} {:>9} {:>6} {:>7}",
            "suite",
            "workload",
            "layers",
            "iters",
            "median ms",
            "min ms",
            "GB/s",
            "% bw",
            "bw now",
            "% pg",
            "pg now",
            "GFLOP/s",
            "% pk",
            "pk now"
        )
    }

    /// One table line; a `*` marks a headline row.
    pub fn line(&self) -> String {
        let w = &self.workload;
        let mem = matches!(self.bound, Bound::Memory | Bound::Both);
        let comp = matches!(self.bound, Bound::Compute | Bound::Both);
        let show = |yes: bool, x: f64, prec: usize| {
            if yes && !x.is_nan() {
                format!("{x:.prec$}")
            } else {
                "-".into()
            }
        };
        let noisy = self.load.is_some_and(|l| l.others > 0.05 || l.steal > 0.05);
        let name = format!(
            "{}{}{}",
            w.name,
            if w.headline { " *" } else { "" },
            if noisy { " !" } else { "" }
        );
        format!(
            "{:<8} {:<40} {:>6} {:>6} {:>10.3} {:>10.3} {:>8} {:>6} {:>7} {:>6} {:>7} {:>9} {:>6} {:>7}",
            w.suite.name(),
            name,
            self.layers,
            self.stats.iters,
            self.stats.median * 1e3,
            self.stats.min * 1e3,
            show(mem, self.gbs, 1),
            show(mem, self.pct_mem_bw, 1),
            show(mem, self.mem_bw_during.unwrap_or(f64::NAN), 1),
            show(mem, self.pct_paged_read.unwrap_or(f64::NAN), 1),
            show(mem, self.paged_read_during.unwrap_or(f64::NAN), 1),
            show(comp, self.gflops, 1),
            show(comp, self.pct_compute, 1),
            show(comp, self.compute_during.unwrap_or(f64::NAN), 0),
        )
    }

    /// The JSON object: the workload's parameters and every number.
    pub fn to_json(&self) -> Value {
        let w = &self.workload;
        let s = &self.stats;
        json!({
            "suite": w.suite.name(),
            "name": w.name,
            "headline": w.headline,
            "bound": match self.bound {
                Bound::Memory => "memory",
                Bound::Compute => "compute",
                Bound::Both => "both",
            },
            "params": w.params_json(),
            "layers": self.layers,
            "cache_bytes_per_layer": w.cache_bytes(),
            "iters": s.iters,
            "median_ms": s.median * 1e3,
            "min_ms": s.min * 1e3,
            "max_ms": s.max * 1e3,
            "mean_ms": s.mean * 1e3,
            "kv_bytes": self.kv_bytes,
            "flops": self.flops,
            "gbs": self.gbs,
            "gbs_at_min": self.kv_bytes / s.min / 1e9,
            "gflops": self.gflops,
            "gflops_at_min": self.flops / s.min / 1e9,
            "mem_read_gbs_during": self.mem_bw_during,
            "paged_read_gbs_during": self.paged_read_during,
            "pct_paged_read": self.pct_paged_read,
            "compute_peak_gflops_during": self.compute_during,
            "pct_mem_bw": self.pct_mem_bw,
            "pct_compute_peak": self.pct_compute,
            "load": self.load.map(Load::to_json),
            "host_us_per_call": self.host_us,
        })
    }
}

/// Paged versus contiguous block tables on the same workload, measured interleaved.
#[derive(Debug, Clone)]
pub struct PagingOverhead {
    /// The pair's workload (its shuffled row's name).
    pub workload: String,
    /// Median of the shuffled run / median of the contiguous run.
    pub ratio_median: f64,
    /// Fastest shuffled / fastest contiguous.
    pub ratio_min: f64,
    /// The same ratio for the memory alone: the decode's read order without the kernel
    /// ([`super::ceilings::Ceilings::memory_paging_ratio`]), where the platform measures it.
    pub memory_ratio: Option<f64>,
}

impl PagingOverhead {
    /// From the pair's timings (contiguous, then shuffled) and the memory's own ratio.
    pub fn new(
        workload: &str,
        contiguous: &Stats,
        shuffled: &Stats,
        memory_ratio: Option<f64>,
    ) -> PagingOverhead {
        PagingOverhead {
            workload: workload.to_string(),
            ratio_median: shuffled.median / contiguous.median,
            ratio_min: shuffled.min / contiguous.min,
            memory_ratio,
        }
    }

    /// One line for the table.
    pub fn line(&self) -> String {
        let memory = match self.memory_ratio {
            Some(r) => {
                format!("; the memory's alone (the decode's read order, loads only): {r:.3}")
            }
            None => String::new(),
        };
        format!(
            "paging overhead of {}: shuffled / contiguous = {:.3} (medians), {:.3} (minimums){memory}",
            self.workload, self.ratio_median, self.ratio_min
        )
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        json!({
            "workload": self.workload,
            "ratio_paged_over_contiguous": self.ratio_median,
            "ratio_paged_over_contiguous_min": self.ratio_min,
            "memory_ratio_paged_over_contiguous": self.memory_ratio,
        })
    }
}

/// A mixed batch against its prefill part and its decode part, measured interleaved.
#[derive(Debug, Clone, Copy)]
pub struct MixedParts {
    /// Median of the whole batch / (median of the prefill part + median of the decode part).
    pub ratio_median: f64,
    /// The same with the fastest iterations.
    pub ratio_min: f64,
}

impl MixedParts {
    /// From the whole batch's, the prefill part's and the decode part's timings.
    pub fn new(whole: &Stats, prefill: &Stats, decode: &Stats) -> MixedParts {
        MixedParts {
            ratio_median: whole.median / (prefill.median + decode.median),
            ratio_min: whole.min / (prefill.min + decode.min),
        }
    }

    /// One line for the table.
    pub fn line(&self) -> String {
        format!(
            "mixed batch / (its prefill part + its decode part, run one after the other) = {:.3} (medians), \
             {:.3} (minimums); at most 1 is the target",
            self.ratio_median, self.ratio_min
        )
    }

    /// The JSON object.
    pub fn to_json(self) -> Value {
        json!({
            "ratio_whole_over_parts": self.ratio_median,
            "ratio_whole_over_parts_min": self.ratio_min,
        })
    }
}
