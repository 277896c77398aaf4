//! `pagedattn bench`: kernel benchmarks against this machine's own ceilings.
//!
//! The ceilings (memory read bandwidth, f32 FMA and bf16 dot peaks) are measured first by the same
//! command; then each workload is timed (warm-up, then N iterations, median and min) with the
//! cache write included in every forward call, rotating over enough layers' caches that the
//! working set is several times the last-level cache. Decode rows report KV GB/s against the
//! memory bandwidth, prefill rows GFLOP/s against the compute peak (`bench/README.md`).
//! `--json` prints every number, the workloads' parameters, the ceilings and the machine, for
//! `bench/torch_compare.py`.

mod ceilings;
mod load;
mod machine;
mod report;
mod timing;
mod workloads;

use std::io::Write;

use clap::ValueEnum;
use pagedattn::{registry, Backend, Result};
use serde_json::{json, Value};

use ceilings::{CeilingPlan, Ceilings, Probes};
use machine::Machine;
use report::{Bound, During, PagingOverhead, Row};
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
    /// Backend name, or `auto` for the best one available.
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
    /// Toy shapes (4 heads, D = 32, short sequences): a smoke test, and the way to run the slow
    /// `reference` backend in seconds.
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
    let out = Out {
        to_stderr: args.json,
    };
    let scale = args.scale();
    let machine = Machine::probe();
    if backend.name() == "reference" && scale != Scale::Tiny {
        eprintln!(
            "note: `reference` is the slow oracle; full-size rows take minutes each (add --tiny for toy shapes)"
        );
    }
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
    let run_start = load::CpuTimes::now();
    let (ceilings, probes) = Ceilings::measure(&args.ceiling_plan(), machine.threads);
    for l in ceilings.summary() {
        out.line(&format!("ceiling: {l}"));
    }
    // Working sets several times the last-level cache (tiny shapes: no such care).
    let working_set = match scale {
        Scale::Tiny => 1 << 20,
        _ => 8 * machine.llc_bytes,
    };
    let cx = Context {
        backend: backend.as_ref(),
        working_set,
        plan: args.timing_plan(),
        ceilings: &ceilings,
        probes: &probes,
    };
    let plan = cx.plan;
    let mut rows: Vec<Value> = Vec::new();
    let mut paging = None;
    let suites = args.suites();
    if !suites.is_empty() {
        out.line("");
        out.line(&Row::header());
    }
    for (si, &suite) in suites.iter().enumerate() {
        let all = workloads::suite(suite, scale);
        let seed = 1000 * si as u64 + 1;
        if suite == Suite::Paging {
            if args.wait_quiet > 0.0 {
                wait_quiet(args.wait_quiet, &out);
            }
            match cx.run(&all, seed) {
                Ok(measured) => {
                    for r in &measured {
                        out.line(&r.line());
                        rows.push(r.to_json());
                    }
                    let p = PagingOverhead::new(
                        &measured[0].stats,
                        &measured[1].stats,
                        ceilings.memory_paging_ratio(),
                    );
                    out.line(&p.line());
                    paging = Some(p);
                }
                Err(e) => skipped(&out, &mut rows, &all[0], &e),
            }
            continue;
        }
        for (i, w) in all.iter().enumerate() {
            let one = std::slice::from_ref(w);
            let seed = seed + i as u64;
            if args.wait_quiet > 0.0 {
                wait_quiet(args.wait_quiet, &out);
            }
            match cx.run(one, seed) {
                Ok(measured) => {
                    out.line(&measured[0].line());
                    rows.push(measured[0].to_json());
                }
                Err(e) => skipped(&out, &mut rows, w, &e),
            }
        }
    }
    if !suites.is_empty() {
        let (g, name) = ceilings.compute_ceiling();
        out.line(&format!(
            "(* headline rows. GB/s = KV bytes read / median time; GFLOP/s = 4 x causal pairs x D x H / median time. \
             % bw, % pg and % pk are of the sequential memory read bandwidth, the read rate of the headline \
             decode's access pattern and the {name}, re-measured between the row's own iterations (bw now, \
             pg now, pk now); at the start they were {:.1} GB/s, {:.1} GB/s and {g:.0} GFLOP/s. \
             `!` marks rows during which other processes used over 5% of the CPUs)",
            ceilings.mem_read_gbs, ceilings.paged_read_gbs()
        ));
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
            "rayon_num_threads": std::env::var("RAYON_NUM_THREADS").ok(),
            "load_before": load_before.map(load::Load::to_json),
            "load_during": load_during.map(load::Load::to_json),
            "ceilings": ceilings.to_json(),
            "rows": rows,
            "paging": paging.map(|p| p.to_json()),
        });
        let text = serde_json::to_string_pretty(&doc).expect("JSON values serialize");
        println!("{text}");
    }
    Ok(())
}

/// What every row is measured with.
struct Context<'a> {
    backend: &'a dyn Backend,
    /// Bytes of cache to rotate over, at least.
    working_set: usize,
    plan: TimingPlan,
    ceilings: &'a Ceilings,
    probes: &'a Probes,
}

impl Context<'_> {
    /// Prepares `variants` (one workload, or the paging pair) and times them interleaved,
    /// re-measuring the ceilings that bound them between iterations.
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
        let stats = timing::measure(
            &self.plan,
            prepared.len(),
            |v, i| prepared[v].run(i),
            || {
                if probe_mem {
                    mem.push(self.probes.mem_pass());
                    paged.push(self.probes.paged_pass());
                }
                if probe_compute {
                    compute.push(self.probes.compute_pass());
                }
            },
        )?;
        let load = before
            .zip(load::CpuTimes::now())
            .and_then(|(a, b)| a.load_until(&b));
        let during = During {
            mem_bw: probe_mem.then(|| timing::median(&mem)),
            paged_read: probe_mem.then(|| timing::median(&paged)),
            compute: probe_compute.then(|| timing::median(&compute)),
        };
        Ok(variants
            .iter()
            .zip(&prepared)
            .zip(stats)
            .map(|((w, p), s)| {
                let mut row = Row::new(w, p.layers(), s, self.ceilings, during);
                row.load = load;
                row
            })
            .collect())
    }
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
        };
        let machine_threads = 1;
        let (ceilings, probes) = Ceilings::measure(
            &CeilingPlan {
                mem_bytes: 1 << 20,
                mem_passes: 1,
                compute_seconds: 0.001,
                compute_repeats: 1,
            },
            machine_threads,
        );
        assert!(ceilings.mem_read_gbs > 0.0 && ceilings.f32_gflops_core > 0.0);
        let backend = registry::backend(&args.backend).unwrap();
        let cx = Context {
            backend: backend.as_ref(),
            working_set: 1 << 16,
            plan: args.timing_plan(),
            ceilings: &ceilings,
            probes: &probes,
        };
        for suite in Suite::ALL {
            let all = workloads::suite(suite, Scale::Tiny);
            let groups: Vec<&[Workload]> = if suite == Suite::Paging {
                vec![&all[..]]
            } else {
                all.chunks(1).collect()
            };
            for g in groups {
                let rows = cx.run(g, 3).unwrap();
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
