//! The machine's ceilings, measured by the benchmark itself: memory read bandwidth on a buffer
//! far larger than the last-level cache, the f32 FMA peak and the bf16 dot-product peak, each per
//! core and for all cores; and, to tell what the memory gives to a paged cache, the rate of
//! reading the same buffer the way the headline decode reads its cache ([`PagedPattern`]).
//!
//! FLOPs are counted as 2 per FMA lane, and 2 per bf16 product for `vdpbf16ps` (64 per 512-bit
//! instruction: 32 products, each added into an f32 lane).

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

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
    /// The instruction set of the f32 FMA measurement (`avx512`, `avx2+fma`, `portable`).
    pub f32_isa: &'static str,
    /// f32 FMA peak of one core, GFLOP/s.
    pub f32_gflops_core: f64,
    /// f32 FMA peak of all cores together, GFLOP/s.
    pub f32_gflops_all: f64,
    /// bf16 dot peak (`vdpbf16ps`) of one core, GFLOP/s; None without AVX512-BF16.
    pub bf16_gflops_core: Option<f64>,
    /// bf16 dot peak of all cores together, GFLOP/s.
    pub bf16_gflops_all: Option<f64>,
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
    /// The compute-peak kernel and its iteration count for about 20 ms.
    compute: (Kernel, u64),
}

impl Probes {
    /// One pass over the buffer with every thread: GB/s.
    pub fn mem_pass(&self) -> f64 {
        self.buffer.read_gbs(self.threads, self.isa)
    }

    /// One pass of the headline decode's access pattern with every thread: GB/s.
    pub fn paged_pass(&self) -> f64 {
        self.paged.read_gbs(&self.buffer, self.isa)
    }

    /// One short burst of the compute-peak kernel on every thread: GFLOP/s.
    pub fn compute_pass(&self) -> f64 {
        let (kernel, n) = self.compute;
        rate(kernel, n, self.threads)
    }
}

impl Ceilings {
    /// Measures every ceiling; returns them and the probes to re-measure them later.
    pub fn measure(plan: &CeilingPlan, threads: usize) -> (Ceilings, Probes) {
        let isa = Isa::detect();
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
        let f32_core = compute_peak(Kernel::F32(isa), 1, plan);
        let f32_all = compute_peak(Kernel::F32(isa), threads, plan);
        let (bf16_core, bf16_all) = if has_bf16_dot() {
            (
                Some(compute_peak(Kernel::Bf16Dot, 1, plan)),
                Some(compute_peak(Kernel::Bf16Dot, threads, plan)),
            )
        } else {
            (None, None)
        };
        let kernel = if has_bf16_dot() {
            Kernel::Bf16Dot
        } else {
            Kernel::F32(isa)
        };
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
            f32_isa: isa.name(),
            f32_gflops_core: f32_core,
            f32_gflops_all: f32_all,
            bf16_gflops_core: bf16_core,
            bf16_gflops_all: bf16_all,
        };
        let probes = Probes {
            buffer,
            paged,
            isa,
            threads,
            compute: (kernel, calibrate(kernel, 0.02)),
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

    /// The compute ceiling prefill is compared with: the bf16 dot peak of all cores, or the
    /// f32 FMA peak where there is no bf16 dot instruction. Returns (GFLOP/s, its name).
    pub fn compute_ceiling(&self) -> (f64, &'static str) {
        match self.bf16_gflops_all {
            Some(g) => (g, "bf16 dot peak, all cores"),
            None => (self.f32_gflops_all, "f32 FMA peak, all cores"),
        }
    }

    /// Lines for the table header.
    pub fn summary(&self) -> Vec<String> {
        let bf16 = match (self.bf16_gflops_core, self.bf16_gflops_all) {
            (Some(c), Some(a)) => format!("{c:.0} GFLOP/s per core, {a:.0} all cores"),
            _ => "n/a (no AVX512-BF16)".into(),
        };
        vec![
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
            format!(
                "f32 FMA ({}): {:.0} GFLOP/s per core, {:.0} all cores",
                self.f32_isa, self.f32_gflops_core, self.f32_gflops_all
            ),
            format!("bf16 dot (vdpbf16ps): {bf16}"),
        ]
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
            "f32_isa": self.f32_isa,
            "f32_fma_gflops_per_core": self.f32_gflops_core,
            "f32_fma_gflops_all_cores": self.f32_gflops_all,
            "bf16_dot_gflops_per_core": self.bf16_gflops_core,
            "bf16_dot_gflops_all_cores": self.bf16_gflops_all,
            "compute_ceiling_gflops": self.compute_ceiling().0,
            "compute_ceiling": self.compute_ceiling().1,
        })
    }
}

/// The widest f32 instruction set of this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Isa {
    Avx512,
    Avx2Fma,
    Portable,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    }

    fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Portable => "portable",
        }
    }
}

fn has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One cache line of f32.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

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
/// How far ahead, in lines of the visiting order, the reader prefetches into L2 (the best of
/// 48..512 on the development machine) ...
#[cfg(target_arch = "x86_64")]
const PREFETCH_FAR: usize = 128;
/// ... and into L1.
#[cfg(target_arch = "x86_64")]
const PREFETCH_NEAR: usize = 16;

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
            black_box(paged_sum(
                &buffer.lines,
                black_box(&self.runs[t]),
                self.run_lines,
                isa,
            ));
        });
        let lines: usize = self.runs.iter().map(|r| r.len() * self.run_lines).sum();
        (lines * 64) as f64 / seconds / 1e9
    }
}

/// Sums the lines of `runs` (`run_lines` each, a power of two) in order, prefetching ahead.
fn paged_sum(lines: &[Line], runs: &[u32], run_lines: usize, isa: Isa) -> f32 {
    match isa {
        // SAFETY: the ISA was detected at run time.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::paged_sum_avx512(lines, runs, run_lines) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::paged_sum_avx2(lines, runs, run_lines) },
        _ => paged_sum_body(lines, runs, run_lines),
    }
}

/// [`paged_sum`]'s body, compiled for each ISA by its caller.
#[inline(always)]
fn paged_sum_body(lines: &[Line], runs: &[u32], run_lines: usize) -> f32 {
    debug_assert!(run_lines.is_power_of_two());
    let (shift, mask) = (run_lines.trailing_zeros(), run_lines - 1);
    let line = |i: usize| &lines[runs[i >> shift] as usize + (i & mask)];
    let n = runs.len() * run_lines;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..n).step_by(4) {
        for (k, a) in acc.iter_mut().enumerate() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: prefetching never faults; SSE is part of x86_64.
            unsafe {
                use std::arch::x86_64::*;
                let at = |j: usize| line(j).0.as_ptr() as *const i8;
                if i + k + PREFETCH_FAR < n {
                    _mm_prefetch::<_MM_HINT_T1>(at(i + k + PREFETCH_FAR));
                }
                if i + k + PREFETCH_NEAR < n {
                    _mm_prefetch::<_MM_HINT_T0>(at(i + k + PREFETCH_NEAR));
                }
            }
            for (x, y) in a.iter_mut().zip(&line(i + k).0) {
                *x += y;
            }
        }
    }
    acc.iter().flatten().sum()
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
            black_box(sum_lines(black_box(part), isa));
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

fn sum_lines(lines: &[Line], isa: Isa) -> f32 {
    match isa {
        // SAFETY: the ISA was detected at run time.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::sum_avx512(lines) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::sum_avx2(lines) },
        _ => {
            let mut acc = [0f32; 16];
            for l in lines {
                for (a, x) in acc.iter_mut().zip(&l.0) {
                    *a += x;
                }
            }
            acc.iter().sum()
        }
    }
}

/// A compute-peak kernel: independent accumulator chains kept in registers.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    /// f32 FMA on an ISA (read only where an x86 kernel exists; others run the portable one).
    F32(#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] Isa),
    Bf16Dot,
}

impl Kernel {
    /// FLOPs of `n` iterations.
    fn flops(self, n: u64) -> f64 {
        let per_iter = match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::F32(Isa::Avx512) => x86::FMA512_FLOPS,
            #[cfg(target_arch = "x86_64")]
            Kernel::F32(Isa::Avx2Fma) => x86::FMA256_FLOPS,
            #[cfg(target_arch = "x86_64")]
            Kernel::Bf16Dot => x86::DPBF16_FLOPS,
            _ => PORTABLE_FLOPS,
        };
        n as f64 * per_iter
    }

    /// Runs `n` iterations; returns a value to keep alive.
    fn run(self, n: u64) -> f32 {
        let x = black_box(0.999_999f32);
        match self {
            // SAFETY (all arms): the ISA was detected at run time.
            #[cfg(target_arch = "x86_64")]
            Kernel::F32(Isa::Avx512) => unsafe { x86::fma_avx512(n, x) },
            #[cfg(target_arch = "x86_64")]
            Kernel::F32(Isa::Avx2Fma) => unsafe { x86::fma_avx2(n, x) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Bf16Dot => unsafe { x86::dpbf16_avx512(n, x) },
            _ => {
                let mut acc = [1f32; 8];
                for _ in 0..n {
                    for a in acc.iter_mut() {
                        *a = *a * x + 1e-7;
                    }
                    black_box(&mut acc);
                }
                acc.iter().sum()
            }
        }
    }
}

/// FLOPs of one iteration of the portable kernel: 8 multiply-adds.
const PORTABLE_FLOPS: f64 = 16.0;

/// Median GFLOP/s of `kernel` on `threads` threads running at once.
fn compute_peak(kernel: Kernel, threads: usize, plan: &CeilingPlan) -> f64 {
    let n = calibrate(kernel, plan.compute_seconds);
    let runs: Vec<f64> = (0..plan.compute_repeats.max(1))
        .map(|_| rate(kernel, n, threads))
        .collect();
    median(&runs)
}

/// The iteration count for which `kernel` runs about `seconds` on one thread.
fn calibrate(kernel: Kernel, seconds: f64) -> u64 {
    let mut n = 1u64 << 12;
    loop {
        let start = Instant::now();
        black_box(kernel.run(n));
        let t = start.elapsed().as_secs_f64();
        if t > 0.01 || n > 1 << 40 {
            return ((n as f64) * seconds / t).max(1.0) as u64;
        }
        n *= 4;
    }
}

/// GFLOP/s of `n` iterations of `kernel` on each of `threads` threads running at once.
fn rate(kernel: Kernel, n: u64, threads: usize) -> f64 {
    let flops = kernel.flops(n);
    let seconds = on_threads(threads, |_| {
        black_box(kernel.run(black_box(n)));
    });
    flops * threads as f64 / seconds / 1e9
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Line;
    use std::arch::x86_64::*;

    /// Accumulator chains: enough to cover FMA latency times throughput on current cores
    /// (4 cycles x 2 pipes; `vdpbf16ps` has a longer latency).
    const CHAINS: usize = 16;
    const CHAINS_AVX2: usize = 12;
    /// FLOPs of one iteration of each kernel.
    pub const FMA512_FLOPS: f64 = (CHAINS * 16 * 2) as f64;
    pub const FMA256_FLOPS: f64 = (CHAINS_AVX2 * 8 * 2) as f64;
    pub const DPBF16_FLOPS: f64 = (CHAINS * 32 * 2) as f64;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_avx512(lines: &[Line]) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 8];
        let chunks = lines.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (a, l) in acc.iter_mut().zip(c) {
                *a = _mm512_add_ps(*a, _mm512_load_ps(l.0.as_ptr()));
            }
        }
        for l in rest {
            acc[0] = _mm512_add_ps(acc[0], _mm512_load_ps(l.0.as_ptr()));
        }
        let mut total = _mm512_setzero_ps();
        for a in acc {
            total = _mm512_add_ps(total, a);
        }
        _mm512_reduce_add_ps(total)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn paged_sum_avx512(lines: &[Line], runs: &[u32], run_lines: usize) -> f32 {
        super::paged_sum_body(lines, runs, run_lines)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn paged_sum_avx2(lines: &[Line], runs: &[u32], run_lines: usize) -> f32 {
        super::paged_sum_body(lines, runs, run_lines)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn sum_avx2(lines: &[Line]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 8];
        let chunks = lines.chunks_exact(4);
        let rest = chunks.remainder();
        for c in chunks {
            for (i, l) in c.iter().enumerate() {
                let p = l.0.as_ptr();
                acc[2 * i] = _mm256_add_ps(acc[2 * i], _mm256_load_ps(p));
                acc[2 * i + 1] = _mm256_add_ps(acc[2 * i + 1], _mm256_load_ps(p.add(8)));
            }
        }
        for l in rest {
            let p = l.0.as_ptr();
            acc[0] = _mm256_add_ps(acc[0], _mm256_load_ps(p));
            acc[1] = _mm256_add_ps(acc[1], _mm256_load_ps(p.add(8)));
        }
        let mut lanes = [0f32; 8];
        for a in acc {
            let mut v = [0f32; 8];
            _mm256_storeu_ps(v.as_mut_ptr(), a);
            for (s, x) in lanes.iter_mut().zip(v) {
                *s += x;
            }
        }
        lanes.iter().sum()
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(n: u64, x: f32) -> f32 {
        let a = _mm512_set1_ps(x);
        let b = _mm512_set1_ps(1e-7);
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm512_fmadd_ps(*c, a, b);
            }
        }
        let mut total = _mm512_setzero_ps();
        for c in acc {
            total = _mm512_add_ps(total, c);
        }
        _mm512_reduce_add_ps(total)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(n: u64, x: f32) -> f32 {
        let a = _mm256_set1_ps(x);
        let b = _mm256_set1_ps(1e-7);
        let mut acc = [_mm256_set1_ps(1.0); CHAINS_AVX2];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm256_fmadd_ps(*c, a, b);
            }
        }
        let mut total = _mm256_setzero_ps();
        for c in acc {
            total = _mm256_add_ps(total, c);
        }
        let mut v = [0f32; 8];
        _mm256_storeu_ps(v.as_mut_ptr(), total);
        v.iter().sum()
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_avx512(n: u64, x: f32) -> f32 {
        // Products of 1e-3 * 1e-3: the accumulators grow by 3.2e-5 per iteration, far from
        // overflow and never denormal.
        let small = _mm512_set1_ps(x * 1e-3);
        let a = _mm512_cvtne2ps_pbh(small, small);
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm512_dpbf16_ps(*c, a, a);
            }
        }
        let mut total = _mm512_setzero_ps();
        for c in acc {
            total = _mm512_add_ps(total, c);
        }
        _mm512_reduce_add_ps(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
