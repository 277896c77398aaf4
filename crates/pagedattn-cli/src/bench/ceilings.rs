//! The machine's ceilings, measured by the benchmark itself on the instruction set the `cpu`
//! backend runs ([`Isa::from_env`]: `PAGEDATTN_ISA` measures another's): memory read bandwidth
//! on a buffer far larger than the last-level cache, the f32 FMA peak and the peak of the
//! instruction the bf16 prefill runs where that is another (`vdpbf16ps` on `avx512bf16`,
//! `tdpbf16ps` on `amx`), each per core and for all cores; and, to tell what the memory gives
//! to a paged cache, the rate of reading the same buffer the way the headline decode reads its
//! cache ([`PagedPattern`]). The probes are the library's (`pagedattn::cpu::peak`), run through
//! the backend's own mapping of an instruction set to its vectors.
//!
//! FLOPs are counted as 2 per FMA lane, 2 per bf16 product for `vdpbf16ps` (64 per 512-bit
//! instruction: 32 products, each added into an f32 lane) and `tdpbf16ps` (16 × 16 × 32
//! products per instruction).

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use pagedattn::cpu::peak::{Line, PagedSum, Peak, SumLines};
use pagedattn::cpu::Isa;
use serde_json::{json, Value};

use super::timing::median;
use super::workloads::shuffle;

/// How long and how large the ceiling measurements are.
#[derive(Debug, Clone, Copy)]
pub struct CeilingPlan {
    /// Size of the buffer the memory bandwidth is measured on.
    pub mem_bytes: usize,
    /// Passes over it (the median is reported).
    pub mem_passes: usize,
    /// Seconds one compute-peak measurement runs.
    pub compute_seconds: f64,
    /// Compute-peak measurements (the median is reported).
    pub compute_repeats: usize,
}

/// The measured ceilings.
#[derive(Debug, Clone)]
pub struct Ceilings {
    /// Threads used for the "all cores" figures.
    pub threads: usize,
    /// Memory read bandwidth with every thread, GB/s (10^9 bytes), median of the passes.
    pub mem_read_gbs: f64,
    /// Slowest and fastest pass with every thread, GB/s.
    pub mem_read_gbs_range: (f64, f64),
    /// Every pass with every thread, GB/s, in order.
    pub mem_read_gbs_passes: Vec<f64>,
    /// Memory read bandwidth of one thread, GB/s.
    pub mem_read_gbs_1t: f64,
    /// Sequential and paged read orders measured in interleaved rounds: the sequential read
    /// first (its passes are [`Ceilings::mem_read_gbs_passes`]), then [`ReadOrder::ALL`].
    pub read_orders: Vec<OrderRate>,
    /// Size of the buffer read, bytes.
    pub mem_buffer_bytes: usize,
    /// The instruction set every figure was measured on: the `cpu` backend's.
    pub isa: Isa,
    /// The compute peaks: the f32 FMA first, then the instruction of the prefill of
    /// [`Ceilings::isa`] where that is another ([`Peak::of_prefill`]).
    pub peaks: Vec<PeakRate>,
}

/// One compute peak, measured.
#[derive(Debug, Clone, Copy)]
pub struct PeakRate {
    /// Which.
    pub peak: Peak,
    /// GFLOP/s of one core.
    pub per_core: f64,
    /// GFLOP/s of all cores together.
    pub all_cores: f64,
}

/// The read rate of one order of reading the bandwidth buffer, with every thread.
#[derive(Debug, Clone)]
pub struct OrderRate {
    /// "sequential" or a [`ReadOrder`]'s name.
    pub name: &'static str,
    /// Median over the rounds, GB/s.
    pub gbs: f64,
    /// Median over the rounds of its rate divided by the decode order's in the same round.
    pub vs_decode: f64,
}

/// The ceiling measurements, kept ready to be re-run between a workload's iterations, so that a
/// row can be compared with the ceiling measured under the same conditions (on a shared VM the
/// memory bandwidth drifts by 2x within seconds).
pub struct Probes {
    buffer: Buffer,
    paged: PagedPattern,
    isa: Isa,
    threads: usize,
    /// The prefill's compute-peak probe and its round count for one burst.
    compute: (Peak, u64),
}

/// Bursts of [`Probes::compute_pass`], about 20 ms in all. The fastest counts: a thread
/// descheduled for a few ms only ever slows a burst (on the 2-vCPU development VM, single
/// 20 ms bursts between prefill iterations read 15-25% low about one time in three, and rows
/// at 75% of the peak then read over 100% of it).
const COMPUTE_BURSTS: usize = 3;

impl Probes {
    /// One pass over the buffer with every thread: GB/s.
    pub fn mem_pass(&self) -> f64 {
        self.buffer.read_gbs(self.threads, self.isa)
    }

    /// One pass of the headline decode's access pattern with every thread: GB/s.
    pub fn paged_pass(&self) -> f64 {
        self.paged.read_gbs(&self.buffer, self.isa)
    }

    /// The prefill's compute-peak probe on every thread, the best of a few short bursts:
    /// GFLOP/s.
    pub fn compute_pass(&self) -> f64 {
        let (peak, n) = self.compute;
        (0..COMPUTE_BURSTS)
            .map(|_| rate(peak, self.isa, n, self.threads))
            .fold(0.0, f64::max)
    }
}

impl Ceilings {
    /// Measures every ceiling on `isa`; returns them and the probes to re-measure them later.
    ///
    /// # Panics
    /// If this CPU lacks `isa`.
    pub fn measure(plan: &CeilingPlan, threads: usize, isa: Isa) -> (Ceilings, Probes) {
        let buffer = Buffer::new(plan.mem_bytes, threads);
        // Rounds of one pass per order (the sequential read first), so that the VM's drift hits
        // them alike.
        let mut patterns: Vec<PagedPattern> = ReadOrder::ALL
            .iter()
            .map(|&o| PagedPattern::new(buffer.lines.len(), threads, o))
            .collect();
        let mut rounds: Vec<Vec<f64>> = Vec::new();
        for _ in 0..plan.mem_passes.max(1) {
            let mut round = vec![buffer.read_gbs(threads, isa)];
            round.extend(patterns.iter().map(|p| p.read_gbs(&buffer, isa)));
            rounds.push(round);
        }
        let column = |i: usize| rounds.iter().map(|r| r[i]).collect::<Vec<_>>();
        let names = std::iter::once("sequential").chain(ReadOrder::ALL.iter().map(|o| o.name()));
        let read_orders: Vec<OrderRate> = names
            .enumerate()
            .map(|(i, name)| OrderRate {
                name,
                gbs: median(&column(i)),
                vs_decode: median(
                    &rounds
                        .iter()
                        .map(|r| r[i] / r[ReadOrder::Decode.round_index()])
                        .collect::<Vec<_>>(),
                ),
            })
            .collect();
        let all = column(0);
        let one: Vec<f64> = (0..plan.mem_passes.div_ceil(2).max(1))
            .map(|_| buffer.read_gbs(1, isa))
            .collect();
        // The decode's order (first of ReadOrder::ALL), kept to re-measure during the rows.
        let paged = patterns.swap_remove(0);
        let prefill = Peak::of_prefill(isa);
        let peaks: Vec<PeakRate> = std::iter::once(Peak::F32Fma)
            .chain((prefill != Peak::F32Fma).then_some(prefill))
            .map(|peak| PeakRate {
                peak,
                per_core: compute_peak(peak, isa, 1, plan),
                all_cores: compute_peak(peak, isa, threads, plan),
            })
            .collect();
        let ceilings = Ceilings {
            threads,
            mem_read_gbs: median(&all),
            mem_read_gbs_range: (
                all.iter().copied().fold(f64::INFINITY, f64::min),
                all.iter().copied().fold(0.0, f64::max),
            ),
            mem_read_gbs_passes: all.clone(),
            mem_read_gbs_1t: median(&one),
            read_orders,
            mem_buffer_bytes: buffer.bytes(),
            isa,
            peaks,
        };
        let probes = Probes {
            buffer,
            paged,
            isa,
            threads,
            compute: (
                prefill,
                calibrate(prefill, isa, 0.02 / COMPUTE_BURSTS as f64),
            ),
        };
        (ceilings, probes)
    }

    /// Read rate of the headline decode's access pattern with every thread, GB/s (median).
    pub fn paged_read_gbs(&self) -> f64 {
        self.read_orders[ReadOrder::Decode.round_index()].gbs
    }

    /// The memory's own paging overhead: how much faster the decode's read order goes over
    /// blocks in address order than over shuffled ones (median of the per-round ratios).
    pub fn memory_paging_ratio(&self) -> f64 {
        self.read_orders[ReadOrder::ContiguousBlocks.round_index()].vs_decode
    }

    /// The measured rate of `peak`, where it was measured.
    pub fn peak(&self, peak: Peak) -> Option<&PeakRate> {
        self.peaks.iter().find(|p| p.peak == peak)
    }

    /// The f32 FMA peak (always measured).
    pub fn f32_fma(&self) -> &PeakRate {
        self.peak(Peak::F32Fma)
            .expect("the f32 FMA peak is always measured")
    }

    /// The compute ceiling prefill rows are compared with: the peak of all cores of the
    /// instruction the prefill of [`Ceilings::isa`] runs, so that no row can exceed it.
    /// Returns (GFLOP/s, its name).
    pub fn compute_ceiling(&self) -> (f64, &'static str) {
        let peak = Peak::of_prefill(self.isa);
        let name = match peak {
            Peak::F32Fma => "f32 FMA peak, all cores",
            Peak::Bf16Dot => "bf16 dot (vdpbf16ps) peak, all cores",
            Peak::AmxBf16 => "AMX bf16 (tdpbf16ps) peak, all cores",
        };
        let rate = self.peak(peak).expect("the prefill's peak is measured");
        (rate.all_cores, name)
    }

    /// Lines for the table header.
    pub fn summary(&self) -> Vec<String> {
        let prefill = Peak::of_prefill(self.isa);
        let mut lines = vec![
            format!(
                "instruction set: {} (the cpu backend's; {} forces another); every figure below is measured on it",
                self.isa,
                pagedattn::cpu::ISA_ENV
            ),
            format!(
                "memory read: {:.1} GB/s with {} threads (passes {:.1}..{:.1}), {:.1} GB/s with 1 thread; {} MiB buffer",
                self.mem_read_gbs,
                self.threads,
                self.mem_read_gbs_range.0,
                self.mem_read_gbs_range.1,
                self.mem_read_gbs_1t,
                self.mem_buffer_bytes >> 20
            ),
            format!(
                "paged read (the headline decode's access pattern on the same buffer): {:.1} GB/s with {} threads",
                self.paged_read_gbs(),
                self.threads
            ),
            format!(
                "read orders, {} threads, one pass each per round (median GB/s; per round, x the decode order's): {}",
                self.threads,
                self.read_orders
                    .iter()
                    .map(|o| format!("{} {:.1} ({:.2}x)", o.name, o.gbs, o.vs_decode))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ];
        lines.extend(self.peaks.iter().map(|p| {
            format!(
                "{} on {}: {:.0} GFLOP/s per core, {:.0} all cores{}",
                p.peak.name(),
                self.isa,
                p.per_core,
                p.all_cores,
                if p.peak == prefill {
                    " (the prefill's compute ceiling)"
                } else {
                    ""
                }
            )
        }));
        lines
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        json!({
            "threads": self.threads,
            "mem_read_gbs": self.mem_read_gbs,
            "mem_read_gbs_min_pass": self.mem_read_gbs_range.0,
            "mem_read_gbs_max_pass": self.mem_read_gbs_range.1,
            "mem_read_gbs_passes": self.mem_read_gbs_passes,
            "mem_read_gbs_1thread": self.mem_read_gbs_1t,
            "mem_buffer_bytes": self.mem_buffer_bytes,
            "paged_read_gbs": self.paged_read_gbs(),
            "read_orders": self.read_orders.iter().map(|o| json!({
                "order": o.name,
                "gbs": o.gbs,
                "vs_decode_order": o.vs_decode,
            })).collect::<Vec<_>>(),
            "isa": self.isa.name(),
            "f32_isa": self.isa.name(),
            "f32_fma_gflops_per_core": self.f32_fma().per_core,
            "f32_fma_gflops_all_cores": self.f32_fma().all_cores,
            "bf16_dot_gflops_per_core": self.peak(Peak::Bf16Dot).map(|p| p.per_core),
            "bf16_dot_gflops_all_cores": self.peak(Peak::Bf16Dot).map(|p| p.all_cores),
            "amx_bf16_gflops_per_core": self.peak(Peak::AmxBf16).map(|p| p.per_core),
            "amx_bf16_gflops_all_cores": self.peak(Peak::AmxBf16).map(|p| p.all_cores),
            "compute_ceiling_gflops": self.compute_ceiling().0,
            "compute_ceiling": self.compute_ceiling().1,
        })
    }
}

/// How the headline decode (8 kv heads, blocks of 16 tokens, head size 128, bf16) reads a
/// paged cache: blocks of 32 KiB in random order (keys in one half of the buffer, values in the
/// other), a unit's heads walking tiles of 4 blocks head by head (one head's 4 KiB run of each
/// block's keys, then of its values), with software prefetches running ahead in that order, as
/// the decode kernel's ([`ReadOrder::Decode`]). Its read rate is what the memory gives to a
/// paged decode, against the sequential read rate of [`Ceilings::mem_read_gbs`]; the other
/// [`ReadOrder`]s read the same blocks otherwise, to tell what another kernel order or cache
/// layout could get.
struct PagedPattern {
    /// Per thread: the first line of each run, in visiting order.
    runs: Vec<Vec<u32>>,
    /// Lines per run: a power of two.
    run_lines: usize,
}

/// Orders of reading a paged cache's shuffled blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOrder {
    /// The decode kernel's: head by head over tiles of 4 blocks, 4 KiB runs.
    Decode,
    /// The decode's order over a contiguous block table (blocks in address order), as the
    /// paging suite's contiguous row reads them.
    ContiguousBlocks,
    /// Each block whole (keys, then values), blocks in table order: 32 KiB runs.
    WholeBlocks,
    /// The decode's order over the token-major layout `[NB, B, Hkv, D]`: a head's row of each
    /// position is its own 256-byte run.
    TokenMajor,
}

impl ReadOrder {
    /// Every order, the decode's first.
    pub const ALL: [ReadOrder; 4] = [
        ReadOrder::Decode,
        ReadOrder::ContiguousBlocks,
        ReadOrder::WholeBlocks,
        ReadOrder::TokenMajor,
    ];

    /// Its name in the output.
    pub fn name(self) -> &'static str {
        match self {
            ReadOrder::Decode => "decode order",
            ReadOrder::ContiguousBlocks => "decode order on contiguous blocks",
            ReadOrder::WholeBlocks => "whole blocks",
            ReadOrder::TokenMajor => "token-major layout",
        }
    }

    /// Its place in a round of [`Ceilings::read_orders`] (after the sequential read).
    fn round_index(self) -> usize {
        1 + ReadOrder::ALL
            .iter()
            .position(|&o| o == self)
            .expect("one of the orders")
    }
}

/// Lines of one kv head's rows in one block (4 KiB).
const RUN_LINES: usize = 64;
/// Lines of one row (head size 128, bf16).
const ROW_LINES: usize = 4;
/// Positions per block.
const BLOCK_TOKENS: usize = RUN_LINES / ROW_LINES;
/// Kv heads per block.
const PAGED_HEADS: usize = 8;
/// Blocks per decode tile.
const TILE_BLOCKS: usize = 4;

impl PagedPattern {
    /// The visiting order over a buffer of `lines` lines, split between `threads` threads.
    fn new(lines: usize, threads: usize, read: ReadOrder) -> PagedPattern {
        let block = RUN_LINES * PAGED_HEADS;
        let half = lines / 2;
        let blocks = half / block;
        // A fixed shuffle of the blocks, as the decode workloads' block tables get.
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        if read != ReadOrder::ContiguousBlocks {
            shuffle(&mut order, 0x5EED);
        }
        let per_thread = (blocks / threads.max(1)) / TILE_BLOCKS * TILE_BLOCKS;
        let run_lines = match read {
            ReadOrder::Decode | ReadOrder::ContiguousBlocks => RUN_LINES,
            ReadOrder::WholeBlocks => block,
            ReadOrder::TokenMajor => ROW_LINES,
        };
        let runs = (0..threads.max(1))
            .map(|t| {
                let mut runs = Vec::new();
                let mut push = |line: usize| runs.push(line as u32);
                for tile in order[t * per_thread..(t + 1) * per_thread].chunks(TILE_BLOCKS) {
                    let tile = tile.iter().map(|&b| b as usize * block);
                    if read == ReadOrder::WholeBlocks {
                        for b in tile {
                            push(b);
                            push(half + b);
                        }
                        continue;
                    }
                    for head in 0..PAGED_HEADS {
                        for base in [0, half] {
                            for b in tile.clone() {
                                if read != ReadOrder::TokenMajor {
                                    push(base + b + head * RUN_LINES);
                                    continue;
                                }
                                for pos in 0..BLOCK_TOKENS {
                                    push(base + b + (pos * PAGED_HEADS + head) * ROW_LINES);
                                }
                            }
                        }
                    }
                }
                runs
            })
            .collect();
        PagedPattern { runs, run_lines }
    }

    /// One pass, every thread its share: GB/s.
    fn read_gbs(&self, buffer: &Buffer, isa: Isa) -> f64 {
        let seconds = on_threads(self.runs.len(), |t| {
            black_box(isa.vectorize(PagedSum {
                lines: &buffer.lines,
                runs: black_box(&self.runs[t]),
                run_lines: self.run_lines,
            }));
        });
        let lines: usize = self.runs.iter().map(|r| r.len() * self.run_lines).sum();
        (lines * 64) as f64 / seconds / 1e9
    }
}

/// A buffer of cache lines, written (so every page is faulted in) by the threads that read it.
struct Buffer {
    lines: Vec<Line>,
}

impl Buffer {
    fn new(bytes: usize, threads: usize) -> Buffer {
        let n = (bytes / 64).max(threads * 64);
        let mut lines: Vec<Line> = Vec::with_capacity(n);
        // Backed like the cpu backend's caches, which the decode rows read.
        pagedattn::cpu::advise_huge_pages_uninit(lines.spare_capacity_mut());
        // Each thread first-touches (and so places) its own share of the pages.
        std::thread::scope(|s| {
            for (t, part) in lines.spare_capacity_mut()[..n]
                .chunks_mut(n.div_ceil(threads))
                .enumerate()
            {
                s.spawn(move || {
                    for (i, l) in part.iter_mut().enumerate() {
                        l.write(Line([((i + t) % 7) as f32 * 0.125; 16]));
                    }
                });
            }
        });
        // SAFETY: the threads above initialized all n lines.
        unsafe { lines.set_len(n) };
        Buffer { lines }
    }

    fn bytes(&self) -> usize {
        self.lines.len() * 64
    }

    /// One pass of `threads` threads, each summing its share: GB/s.
    fn read_gbs(&self, threads: usize, isa: Isa) -> f64 {
        let chunk = self.lines.len().div_ceil(threads);
        let seconds = on_threads(threads, |t| {
            let part = self.lines.chunks(chunk).nth(t).unwrap_or(&[]);
            black_box(isa.vectorize(SumLines(black_box(part))));
        });
        self.bytes() as f64 / seconds / 1e9
    }
}

/// Runs `work(t)` on `threads` threads started together; returns the seconds from the first
/// start to the last end, each taken by the worker itself (a coordinating thread may not be
/// scheduled when the workers start, when they occupy every core).
fn on_threads(threads: usize, work: impl Fn(usize) + Sync) -> f64 {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, work) = (&barrier, &work);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    work(t);
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("benchmark thread"))
            .collect()
    });
    let first = spans
        .iter()
        .map(|s| s.0)
        .min()
        .expect("one thread at least");
    let last = spans
        .iter()
        .map(|s| s.1)
        .max()
        .expect("one thread at least");
    (last - first).as_secs_f64()
}

/// Median GFLOP/s of `peak` on `isa` on `threads` threads running at once.
fn compute_peak(peak: Peak, isa: Isa, threads: usize, plan: &CeilingPlan) -> f64 {
    let n = calibrate(peak, isa, plan.compute_seconds);
    let runs: Vec<f64> = (0..plan.compute_repeats.max(1))
        .map(|_| rate(peak, isa, n, threads))
        .collect();
    median(&runs)
}

/// FLOPs of `n` rounds of `peak` on `isa`, on this thread.
fn run(peak: Peak, isa: Isa, n: u64) -> f64 {
    peak.run(isa, n)
        .expect("the instruction set runs the peaks it is measured with")
}

/// The round count for which `peak` runs about `seconds` on one thread.
fn calibrate(peak: Peak, isa: Isa, seconds: f64) -> u64 {
    let mut n = 1u64 << 12;
    loop {
        let start = Instant::now();
        run(peak, isa, n);
        let t = start.elapsed().as_secs_f64();
        if t > 0.01 || n > 1 << 40 {
            return ((n as f64) * seconds / t).max(1.0) as u64;
        }
        n *= 4;
    }
}

/// GFLOP/s of `n` rounds of `peak` on each of `threads` threads running at once.
fn rate(peak: Peak, isa: Isa, n: u64, threads: usize) -> f64 {
    // The FLOPs are linear in the rounds: one round tells them.
    let flops = run(peak, isa, 1) * n as f64;
    let seconds = on_threads(threads, |_| {
        run(peak, isa, black_box(n));
    });
    flops * threads as f64 / seconds / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On every instruction set of this CPU: every figure is positive and finite, the compute
    /// ceiling is the peak of the prefill's instruction, and the header and JSON name the set.
    #[test]
    fn ceilings_of_every_isa() {
        let plan = CeilingPlan {
            mem_bytes: 1 << 20,
            mem_passes: 1,
            compute_seconds: 0.001,
            compute_repeats: 1,
        };
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let (c, probes) = Ceilings::measure(&plan, 2, isa);
            let prefill = c.peak(Peak::of_prefill(isa)).expect("measured");
            assert_eq!(c.compute_ceiling().0, prefill.all_cores, "{isa}");
            let figures = [
                c.mem_read_gbs,
                c.mem_read_gbs_1t,
                c.paged_read_gbs(),
                probes.mem_pass(),
                probes.paged_pass(),
                probes.compute_pass(),
            ];
            let peaks = c.peaks.iter().flat_map(|p| [p.per_core, p.all_cores]);
            for x in figures.into_iter().chain(peaks) {
                assert!(x.is_finite() && x > 0.0, "{isa}: {x}");
            }
            assert!(c.summary()[0].contains(isa.name()));
            let j = c.to_json();
            assert_eq!(j["isa"], isa.name());
            assert!(j["f32_fma_gflops_all_cores"].as_f64().unwrap() > 0.0);
            let amx = j["amx_bf16_gflops_all_cores"].as_f64();
            assert_eq!(amx.is_some(), isa == Isa::Amx, "{isa}");
            let bf16 = j["bf16_dot_gflops_all_cores"].as_f64();
            assert_eq!(bf16.is_some(), isa == Isa::Avx512Bf16, "{isa}");
        }
    }

    /// Every read order visits each line of each thread's blocks (keys and values) exactly
    /// once, and no other line.
    #[test]
    fn read_orders_visit_each_line_once() {
        let block = RUN_LINES * PAGED_HEADS;
        let lines = 2 * 24 * block;
        let mut want: Option<Vec<u32>> = None;
        for order in ReadOrder::ALL {
            let pattern = PagedPattern::new(lines, 2, order);
            let mut seen: Vec<u32> = pattern
                .runs
                .iter()
                .flatten()
                .flat_map(|&r| r..r + pattern.run_lines as u32)
                .collect();
            seen.sort_unstable();
            // 24 blocks per half, 12 per thread: all of them, in both halves.
            assert_eq!(seen.len(), lines, "{order:?}");
            assert!(seen.windows(2).all(|w| w[0] < w[1]), "{order:?}");
            match &want {
                Some(w) => assert_eq!(&seen, w, "{order:?}"),
                None => want = Some(seen),
            }
        }
    }
}
