//! `pagedattn bench`: kernel benchmarks against this machine's own ceilings.
//!
//! The ceilings are measured first by the same command (on the CPU, on the instruction set the
//! `cpu` backend runs: memory read bandwidth, the f32 FMA peak and that of the prefill's
//! instruction, `vdpbf16ps` or `tdpbf16ps`, where it is another; on a GPU: device copy
//! bandwidth and the `mma.sync` bf16 peak); then each workload is timed (warm-up, then N
//! iterations, median and min; on a GPU with CUDA events) with the cache write included in
//! every forward call, rotating over enough layers' caches that the working set is several
//! times the last-level cache (a GPU's L2). Decode rows report KV GB/s against the memory
//! ceiling, prefill rows GFLOP/s against the compute peak (`bench/README.md`). `--json` prints
//! every number, the workloads' parameters, the ceilings and the machine, for
//! `bench/torch_compare.py`.

mod ceilings;
#[cfg(feature = "cuda")]
mod gpu;
mod load;
mod machine;
mod platform;
mod report;
mod timing;
mod workloads;

use std::io::Write;

use clap::ValueEnum;
use pagedattn::{registry, Backend, Device, Result};
use serde_json::{json, Value};

use ceilings::CeilingPlan;
use machine::Machine;
use platform::{CpuPlatform, Platform};
use report::{Bound, During, MixedParts, PagingOverhead, Row};
use timing::TimingPlan;
use workloads::{Prepared, Scale, Suite, Workload};

/// Which benchmarks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SuiteArg {
    /// Every suite.
    All,
    /// Only the machine's ceilings.
    Ceilings,
    /// Decode sweep: batch x context, bf16 and fp8 KV.
    Decode,
    /// Prefill sweep: causal prompts, bf16.
    Prefill,
    /// One chunked-prefill batch: prompt chunks, a fresh prompt and decodes in one call.
    Mixed,
    /// The headline decode on contiguous versus shuffled block tables.
    Paging,
}

/// Options of `pagedattn bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// `cpu`, `cuda`, or `auto` for the best one available (not `reference`: the f64 oracle
    /// is no benchmark target).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Which benchmarks to run (the ceilings are always measured).
    #[arg(long, value_enum, default_value_t = SuiteArg::All)]
    pub suite: SuiteArg,
    /// Print the results as JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Fewer rows (the headline ones and a few others) and shorter timings.
    #[arg(long)]
    pub quick: bool,
    /// Measured iterations per row (default: as many as fill --seconds).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Seconds of measurement per row, when --iters is not given (default 1.5, 0.4 with --quick).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Before the ceilings and before each row, wait up to this many seconds for other processes
    /// to leave the CPUs (less than 5% busy over half a second); 0 = do not wait.
    #[arg(long, default_value_t = 0.0)]
    pub wait_quiet: f64,
    /// Only the rows whose name contains this text (e.g. `ctx4096 fp8`); a group timed
    /// together (the paging pair, a mixed batch and its parts) runs whole if one of its rows
    /// matches.
    #[arg(long)]
    pub rows: Option<String>,
    /// Tokens per cache block of every row (default 16, vLLM's): the same rows over larger or
    /// smaller pages.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub block_size: Option<u16>,
    /// Toy shapes (4 heads, D = 32, short sequences): a smoke test.
    #[arg(long, hide = true)]
    pub tiny: bool,
}

impl BenchArgs {
    fn scale(&self) -> Scale {
        if self.tiny {
            Scale::Tiny
        } else if self.quick {
            Scale::Quick
        } else {
            Scale::Full
        }
    }

    fn timing_plan(&self) -> TimingPlan {
        let (warmup, target, min_iters) = match self.scale() {
            Scale::Full => (0.3, 1.5, 5),
            Scale::Quick => (0.1, 0.4, 3),
            Scale::Tiny => (0.0, 0.05, 2),
        };
        TimingPlan {
            warmup_seconds: warmup,
            target_seconds: self.seconds.unwrap_or(target),
            iters: self.iters,
            min_iters,
            probe_every: target / 8.0,
        }
    }

    fn ceiling_plan(&self) -> CeilingPlan {
        match self.scale() {
            Scale::Full => CeilingPlan {
                mem_bytes: 1 << 30,
                mem_passes: 20,
                compute_seconds: 0.2,
                compute_repeats: 5,
            },
            Scale::Quick => CeilingPlan {
                mem_bytes: 1 << 30,
                mem_passes: 10,
                compute_seconds: 0.1,
                compute_repeats: 3,
            },
            Scale::Tiny => CeilingPlan {
                mem_bytes: 64 << 20,
                mem_passes: 3,
                compute_seconds: 0.01,
                compute_repeats: 2,
            },
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_ceiling_plan(&self) -> gpu::GpuCeilingPlan {
        let (copy_bytes, copy_passes, peak_seconds, peak_repeats) = match self.scale() {
            Scale::Full => (2 << 30, 20, 0.01, 5),
            Scale::Quick => (2 << 30, 10, 0.005, 3),
            Scale::Tiny => (64 << 20, 3, 0.001, 2),
        };
        gpu::GpuCeilingPlan {
            copy_bytes,
            copy_passes,
            peak_seconds,
            peak_repeats,
        }
    }

    /// The device-specific part of the run, its ceilings measured.
    fn platform(&self, device: Device, machine: &Machine) -> Result<Box<dyn Platform>> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => Ok(Box::new(gpu::GpuPlatform::measure(
                ordinal,
                &self.gpu_ceiling_plan(),
            )?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(pagedattn::Error::unsupported(
                "bench",
                "GPU benchmarks (this build has no `cuda` feature)",
            )),
            Device::Cpu | Device::CudaHost(_) => {
                // Working sets several times the last-level cache (tiny shapes: no such care).
                let working_set = match self.scale() {
                    Scale::Tiny => 1 << 20,
                    _ => 8 * machine.llc_bytes,
                };
                // The ceilings of the instruction set the cpu backend runs.
                Ok(Box::new(CpuPlatform::measure(
                    &self.ceiling_plan(),
                    machine.threads,
                    pagedattn::cpu::Isa::from_env()?,
                    working_set,
                )))
            }
        }
    }

    fn suites(&self) -> Vec<Suite> {
        match self.suite {
            SuiteArg::All => Suite::ALL.to_vec(),
            SuiteArg::Ceilings => vec![],
            SuiteArg::Decode => vec![Suite::Decode],
            SuiteArg::Prefill => vec![Suite::Prefill],
            SuiteArg::Mixed => vec![Suite::Mixed],
            SuiteArg::Paging => vec![Suite::Paging],
        }
    }
}

/// Where the table goes: stdout, or stderr when stdout carries JSON.
struct Out {
    to_stderr: bool,
}

impl Out {
    fn line(&self, s: &str) {
        if self.to_stderr {
            eprintln!("{s}");
        } else {
            println!("{s}");
            let _ = std::io::stdout().flush();
        }
    }
}

/// Runs `pagedattn bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    let backend = registry::backend(&args.backend)?;
    // `reference` computes one element at a time in f64 to be the others' oracle: even
    // --quick rows take 6-10 s each on it (over 10 minutes in all), timing nothing an engine
    // would run.
    if backend.name() == "reference" {
        return Err(pagedattn::Error::invalid(
            "--backend",
            "reference",
            "cpu, cuda or auto (the reference backend is the f64 oracle, not a benchmark target)",
        ));
    }
    let out = Out {
        to_stderr: args.json,
    };
    let scale = args.scale();
    let machine = Machine::probe();
    let scale_name = match scale {
        Scale::Full => "full",
        Scale::Quick => "quick",
        Scale::Tiny => "tiny",
    };
    out.line(&format!(
        "pagedattn bench: backend {} on {}, {} sizes",
        backend.name(),
        backend.device(),
        scale_name
    ));
    out.line(&format!("machine: {}", machine.summary()));
    let load_before = wait_quiet(args.wait_quiet, &out);
    if let Some(l) = load_before {
        out.line(&format!("load before: {}", l.describe()));
    }
    if let Some(b) = args.block_size {
        out.line(&format!("cache blocks: {b} tokens"));
    }
    let run_start = load::CpuTimes::now();
    let platform = args.platform(backend.device(), &machine)?;
    for l in platform.summary() {
        out.line(&format!("ceiling: {l}"));
    }
    let working_set = match (scale, platform.target()) {
        (Scale::Tiny, _) => 1 << 20,
        _ => platform.working_set(),
    };
    let cx = Context {
        backend: backend.as_ref(),
        working_set,
        plan: args.timing_plan(),
        platform: platform.as_ref(),
    };
    let plan = cx.plan;
    let bounds = platform.bounds();
    let mut rows: Vec<Value> = Vec::new();
    let mut paging = Vec::new();
    let mut mixed = None;
    let suites = args.suites();
    if !suites.is_empty() {
        out.line("");
        out.line(&Row::header());
    }
    for (si, &suite) in suites.iter().enumerate() {
        let mut seed = 1000 * si as u64 + 1;
        let chosen = |group: &Vec<workloads::Workload>| {
            args.rows
                .as_ref()
                .is_none_or(|text| group.iter().any(|w| w.name.contains(text.as_str())))
        };
        for mut group in workloads::groups(suite, scale, platform.target())
            .into_iter()
            .filter(chosen)
        {
            if let Some(b) = args.block_size {
                group.iter_mut().for_each(|w| w.block_size = usize::from(b));
            }
            if args.wait_quiet > 0.0 {
                wait_quiet(args.wait_quiet, &out);
            }
            match cx.run(&group, seed) {
                Ok(measured) => {
                    for r in &measured {
                        out.line(&r.line());
                        rows.push(r.to_json());
                    }
                    let stats: Vec<_> = measured.iter().map(|r| &r.stats).collect();
                    if suite == Suite::Paging && stats.len() == 2 {
                        // The memory's own ratio is the decode's read order's.
                        let decode = group[1].seqs.iter().all(|s| s.is_decode);
                        let memory = bounds.memory_paging_ratio.filter(|_| decode);
                        let p = PagingOverhead::new(&group[1].name, stats[0], stats[1], memory);
                        out.line(&p.line());
                        paging.push(p);
                    } else if suite == Suite::Mixed && stats.len() == 3 {
                        let m = MixedParts::new(stats[0], stats[1], stats[2]);
                        out.line(&m.line());
                        mixed = Some(m);
                    }
                }
                Err(e) => {
                    for w in &group {
                        skipped(&out, &mut rows, w, &e);
                    }
                }
            }
            seed += group.len() as u64;
        }
    }
    if !suites.is_empty() {
        out.line(&footnote(&bounds));
    }
    let load_during = run_start
        .zip(load::CpuTimes::now())
        .and_then(|(a, b)| a.load_until(&b));
    if let Some(l) = load_during {
        out.line(&format!("load during the run: {}", l.describe()));
    }
    if args.json {
        let doc = json!({
            "tool": "pagedattn bench",
            "version": env!("CARGO_PKG_VERSION"),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "backend": backend.name(),
            "device": backend.device().to_string(),
            "scale": scale_name,
            "timing": {
                "warmup_seconds": plan.warmup_seconds,
                "target_seconds": plan.target_seconds,
                "iters": plan.iters,
                "min_iters": plan.min_iters,
                "working_set_bytes": working_set,
            },
            "machine": machine.to_json(),
            "gpu": platform.device_json(),
            "timer": match platform.target() {
                platform::Target::Cpu => "host wall clock",
                platform::Target::Gpu => "CUDA events on the backend's stream",
            },
            "rayon_num_threads": std::env::var("RAYON_NUM_THREADS").ok(),
            "load_before": load_before.map(load::Load::to_json),
            "load_during": load_during.map(load::Load::to_json),
            "ceilings": platform.to_json(),
            "rows": rows,
            "paging": paging.iter().map(PagingOverhead::to_json).collect::<Vec<_>>(),
            "mixed": mixed.map(|m| m.to_json()),
        });
        let text = serde_json::to_string_pretty(&doc).expect("JSON values serialize");
        println!("{text}");
    }
    Ok(())
}

/// The line under the table: what the columns are, and the ceilings at the start.
fn footnote(bounds: &platform::Bounds) -> String {
    let (g, name) = (bounds.compute_gflops, bounds.compute_name);
    match bounds.paged_gbs {
        Some(paged) => format!(
            "(* headline rows. GB/s = KV bytes read / median time; GFLOP/s = 4 x causal pairs x D x H / median time. \
             % bw, % pg and % pk are of the sequential memory read bandwidth, the read rate of the headline \
             decode's access pattern and the {name}, re-measured between the row's own iterations (bw now, \
             pg now, pk now); at the start they were {:.1} GB/s, {paged:.1} GB/s and {g:.0} GFLOP/s. \
             `!` marks rows during which other processes used over 5% of the CPUs)",
            bounds.mem_gbs
        ),
        None => format!(
            "(* headline rows. Times from CUDA events on the backend's stream. GB/s = KV bytes read / median \
             time; GFLOP/s = 4 x causal pairs x D x H / median time. % bw is of the {}, % pk of the {name}, \
             both re-measured between the row's own iterations (bw now, pk now); at the start they were \
             {:.1} GB/s and {g:.0} GFLOP/s. `!` marks rows during which other processes used over 5% of \
             the host's CPUs)",
            bounds.mem_name, bounds.mem_gbs
        ),
    }
}

/// What every row is measured with.
struct Context<'a> {
    backend: &'a dyn Backend,
    /// Bytes of cache to rotate over, at least.
    working_set: usize,
    plan: TimingPlan,
    platform: &'a dyn Platform,
}

impl Context<'_> {
    /// Prepares `variants` (one workload, or a group timed together) and times them
    /// interleaved, re-measuring the ceilings that bound them between iterations.
    fn run(&self, variants: &[Workload], seed: u64) -> Result<Vec<Row>> {
        let mut prepared = variants
            .iter()
            .map(|w| Prepared::new(self.backend, w, w.layers_for(self.working_set), seed))
            .collect::<Result<Vec<_>>>()?;
        let bound = Row::bound_of(&variants[0]);
        let probe_mem = matches!(bound, Bound::Memory | Bound::Both);
        let probe_compute = matches!(bound, Bound::Compute | Bound::Both);
        let (mut mem, mut paged, mut compute) = (Vec::new(), Vec::new(), Vec::new());
        let before = load::CpuTimes::now();
        let mut clock = self.platform.clock()?;
        let stats = timing::measure(
            &self.plan,
            prepared.len(),
            clock.as_mut(),
            |v, i| prepared[v].run(i),
            || {
                if probe_mem {
                    let now = self.platform.probe_memory()?;
                    mem.push(now.mem_gbs);
                    paged.extend(now.paged_gbs);
                }
                if probe_compute {
                    compute.push(self.platform.probe_compute()?);
                }
                Ok(())
            },
        )?;
        let load = before
            .zip(load::CpuTimes::now())
            .and_then(|(a, b)| a.load_until(&b));
        let host_us = match self.backend.device() {
            Device::Cpu => None,
            _ => Some(host_us_per_call(self.backend, &mut prepared[0])?),
        };
        let during = During {
            mem_bw: probe_mem.then(|| timing::median(&mem)),
            paged_read: (probe_mem && !paged.is_empty()).then(|| timing::median(&paged)),
            compute: probe_compute.then(|| timing::median(&compute)),
        };
        let bounds = self.platform.bounds();
        Ok(variants
            .iter()
            .zip(&prepared)
            .zip(stats)
            .map(|((w, p), s)| {
                let mut row = Row::new(w, p.layers(), s, &bounds, during);
                row.load = load;
                row.host_us = host_us;
                row
            })
            .collect())
    }
}

/// Host time to queue one call of `prepared` on a device backend, µs: the median over 100
/// bursts of 32 calls queued back to back after a synchronization (few enough that the
/// driver's launch queue never fills and blocks the host).
fn host_us_per_call(backend: &dyn Backend, prepared: &mut Prepared) -> Result<f64> {
    const CALLS: usize = 32;
    const BURSTS: usize = 100;
    let mut bursts = Vec::with_capacity(BURSTS);
    for _ in 0..BURSTS {
        backend.synchronize()?;
        let start = std::time::Instant::now();
        for i in 0..CALLS {
            prepared.run(i)?;
        }
        bursts.push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
    }
    backend.synchronize()?;
    Ok(timing::median(&bursts))
}

/// Samples the load of other processes, for up to `seconds` until it is under 5%.
fn wait_quiet(seconds: f64, out: &Out) -> Option<load::Load> {
    let start = std::time::Instant::now();
    let window = std::time::Duration::from_millis(500);
    for round in 0.. {
        let l = load::sample(window)?;
        let quiet = l.others < 0.05 && l.steal < 0.05;
        if quiet || start.elapsed().as_secs_f64() >= seconds {
            return Some(l);
        }
        if round % 10 == 0 {
            out.line(&format!("waiting for quiet: {}", l.describe()));
        }
    }
    None
}

/// Records a workload the backend could not run, instead of aborting the whole benchmark.
fn skipped(out: &Out, rows: &mut Vec<Value>, w: &Workload, e: &pagedattn::Error) {
    out.line(&format!(
        "{:<8} {:<40} skipped: {e}",
        w.suite.name(),
        w.name
    ));
    rows.push(json!({
        "suite": w.suite.name(),
        "name": w.name,
        "headline": w.headline,
        "params": w.params_json(),
        "error": e.to_string(),
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole benchmark, toy shapes, on the reference backend: every suite produces rows.
    #[test]
    fn tiny_run_on_reference() {
        let args = BenchArgs {
            backend: "reference".into(),
            suite: SuiteArg::Mixed,
            json: false,
            quick: false,
            iters: Some(1),
            seconds: None,
            tiny: true,
            wait_quiet: 0.0,
            rows: None,
            block_size: Some(8),
        };
        let machine_threads = 1;
        let platform = CpuPlatform::measure(
            &CeilingPlan {
                mem_bytes: 1 << 20,
                mem_passes: 1,
                compute_seconds: 0.001,
                compute_repeats: 1,
            },
            machine_threads,
            pagedattn::cpu::Isa::detect(),
            1 << 16,
        );
        let ceilings = platform.ceilings();
        assert!(ceilings.mem_read_gbs > 0.0 && ceilings.f32_fma().per_core > 0.0);
        let backend = registry::backend(&args.backend).unwrap();
        let cx = Context {
            backend: backend.as_ref(),
            working_set: platform.working_set(),
            plan: args.timing_plan(),
            platform: &platform,
        };
        for suite in Suite::ALL {
            for target in [platform::Target::Cpu, platform::Target::Gpu] {
                for g in workloads::groups(suite, Scale::Tiny, target) {
                    let rows = cx.run(&g, 3).unwrap();
                    assert_eq!(rows.len(), g.len());
                    for r in rows {
                        assert_eq!(r.stats.iters, 1);
                        assert!(r.gbs > 0.0 && r.gflops > 0.0, "{}", r.line());
                        let j = r.to_json();
                        assert_eq!(j["params"]["num_seqs"], r.workload.seqs.len());
                    }
                }
            }
        }
    }
}
