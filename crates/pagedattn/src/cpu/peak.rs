//! Probes of this CPU's ceilings, for `pagedattn bench`: the peak rate of the instruction an
//! instruction set's prefill runs ([`Peak`]), and the rate of reading memory in order
//! ([`SumLines`]) and in a paged cache's order ([`PagedSum`]).
//!
//! The f32 and memory probes are written once over [`Simd`], as [`WithSimd`] operations, and run
//! through [`Isa::vectorize`], the mapping the backend runs its kernels through: so a ceiling is
//! measured on the vectors the kernels of the same [`Isa`] use (`PAGEDATTN_ISA=avx2` measures
//! AVX2's). The bf16 probes are one instruction each, outside [`Simd`]: `vdpbf16ps` here,
//! `tdpbf16ps` in `amx::peak` (the `amx` module is x86-64 only).

use std::hint::black_box;

use super::aligned::floats;
use super::isa::Isa;
use super::simd::{Simd, WithSimd};

/// One cache line of f32: what the memory probes read.
pub use super::aligned::Line;

/// Independent accumulators of the memory probes: enough that the adds keep up with memory.
const READ_CHAINS: usize = 8;

/// Lines [`PagedSum`] reads per step (each into its own accumulators).
const PAGED_STEP: usize = 4;

/// How far ahead, in lines of the visiting order, [`PagedSum`] prefetches into L2 (the best of
/// 48..512 on the development machine) ...
const PREFETCH_FAR: usize = 128;
/// ... and into L1, as the decode kernel does.
const PREFETCH_NEAR: usize = 16;

/// The sum of `acc`'s lanes.
#[inline(always)]
fn total<S: Simd>(s: S, acc: &[S::V]) -> f32 {
    s.reduce_sum(acc.iter().fold(s.splat(0.0), |t, &a| s.add(t, a)))
}

/// Reads the lines in order: their sum (the sequential memory-read probe).
#[derive(Debug, Clone, Copy)]
pub struct SumLines<'a>(pub &'a [Line]);

impl WithSimd for SumLines<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> f32 {
        let xs = floats(self.0);
        let mut acc = [s.splat(0.0); READ_CHAINS];
        let chunks = xs.chunks_exact(READ_CHAINS * S::LANES);
        // Whole lines: a multiple of 16 f32, so of the lanes.
        let rest = chunks.remainder();
        for c in chunks {
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: c holds READ_CHAINS vectors.
                *a = s.add(*a, unsafe { s.load(c.as_ptr().add(i * S::LANES)) });
            }
        }
        for v in rest.chunks_exact(S::LANES) {
            // SAFETY: v holds one vector.
            acc[0] = s.add(acc[0], unsafe { s.load(v.as_ptr()) });
        }
        total(s, &acc)
    }
}

/// Reads runs of lines in a given order, prefetching ahead in that order as the decode kernel
/// does: their sum (the paged memory-read probe, which the bench feeds a paged cache's orders).
#[derive(Debug, Clone, Copy)]
pub struct PagedSum<'a> {
    /// The buffer.
    pub lines: &'a [Line],
    /// The first line of each run, in visiting order.
    pub runs: &'a [u32],
    /// Lines per run: a power of two, 4 at least.
    pub run_lines: usize,
}

impl WithSimd for PagedSum<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> f32 {
        let run_lines = self.run_lines;
        assert!(run_lines.is_power_of_two() && run_lines >= PAGED_STEP);
        let (shift, mask) = (run_lines.trailing_zeros(), run_lines - 1);
        let line = |i: usize| &self.lines[self.runs[i >> shift] as usize + (i & mask)];
        let n = self.runs.len() * run_lines;
        let per_line = 16 / S::LANES;
        let mut acc = [s.splat(0.0); READ_CHAINS];
        for i in (0..n).step_by(PAGED_STEP) {
            for k in 0..PAGED_STEP {
                let at = i + k;
                if at + PREFETCH_FAR < n {
                    s.prefetch_l2(line(at + PREFETCH_FAR));
                }
                if at + PREFETCH_NEAR < n {
                    s.prefetch(line(at + PREFETCH_NEAR));
                }
                let p = line(at).0.as_ptr();
                for j in 0..per_line {
                    let a = &mut acc[(k * per_line + j) % READ_CHAINS];
                    // SAFETY: (j + 1) * LANES <= 16.
                    *a = s.add(*a, unsafe { s.load(p.add(j * S::LANES)) });
                }
            }
        }
        total(s, &acc)
    }
}

/// Accumulators the f32 FMA probe keeps at most: AVX-512's and NEON's 32 registers.
const MAX_FMA_CHAINS: usize = 32;

/// f32 lanes of accumulators the f32 FMA probe keeps at least. The compiler vectorizes scalar
/// code (the scalar prefill outruns 12 one-lane chains), so the scalar probe keeps 32 one-lane
/// chains, which it packs into 8 SSE registers (fewer chains read low, 64 spill; docs/design/cpu.md).
const MIN_FMA_LANES: usize = 32;

/// The f32 FMA probe: `iters` rounds of one FMA on each of `S::REGISTERS - 4` independent
/// accumulators (12 on AVX2, 28 on AVX-512 and NEON): more than FMA latency × FMA pipes on
/// every core we know (16 chains read low on Intel's AVX-512; docs/design/cpu.md), and the operands
/// still fit in registers; 32 for scalar code, which the compiler vectorizes as it does the
/// scalar kernels. Returns the FLOPs done.
#[derive(Debug, Clone, Copy)]
pub struct FmaPeak {
    /// Rounds.
    pub iters: u64,
}

impl WithSimd for FmaPeak {
    type Output = f64;

    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) -> f64 {
        let chains = (S::REGISTERS - 4)
            .max(MIN_FMA_LANES / S::LANES)
            .min(MAX_FMA_CHAINS);
        // x -> 0.999999 x + 1e-7 converges to 0.1: never overflowing, never subnormal.
        let (a, b) = (s.splat(black_box(0.999_999)), s.splat(1e-7));
        let mut acc = [s.splat(0.0); MAX_FMA_CHAINS];
        // Distinct starts, so that no compiler could fold identical chains into one.
        for (i, c) in acc.iter_mut().enumerate() {
            *c = s.splat(1.0 + i as f32 / 64.0);
        }
        let acc = &mut acc[..chains];
        for _ in 0..self.iters {
            for c in acc.iter_mut() {
                *c = s.fma(*c, a, b);
            }
        }
        black_box(total(s, acc));
        self.iters as f64 * (chains * S::LANES * 2) as f64
    }
}

/// Independent `vdpbf16ps` chains of the bf16 dot probe: enough for the Xeon measured, whose
/// peak needs 16 to 24 (Zen 4 reads the same from 8 to 28; docs/design/cpu.md).
#[cfg(target_arch = "x86_64")]
const BF16_CHAINS: usize = 24;

/// The bf16 dot probe: `iters` rounds of one `vdpbf16ps` (32 bf16 products added into 16 f32
/// lanes: 64 FLOPs) on each of [`BF16_CHAINS`] accumulators. Returns the FLOPs done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn bf16_dot(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    // Products of 1e-3 · 1e-3: the accumulators grow by 2e-6 a round, far from overflow and
    // never subnormal.
    let small = _mm512_set1_ps(black_box(1e-3));
    let a = _mm512_cvtne2ps_pbh(small, small);
    let mut acc = [_mm512_setzero_ps(); BF16_CHAINS];
    for (i, c) in acc.iter_mut().enumerate() {
        *c = _mm512_set1_ps(i as f32);
    }
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_dpbf16_ps(*c, a, a);
        }
    }
    let mut sum = _mm512_setzero_ps();
    for c in acc {
        sum = _mm512_add_ps(sum, c);
    }
    black_box(_mm512_reduce_add_ps(sum));
    iters as f64 * (BF16_CHAINS * 64) as f64
}

/// A compute probe: one instruction in independent chains on one thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peak {
    /// f32 FMA on the instruction set's widest vectors ([`FmaPeak`]).
    F32Fma,
    /// AVX512-BF16's `vdpbf16ps`.
    Bf16Dot,
    /// AMX's `tdpbf16ps` (`amx::peak`).
    AmxBf16,
}

impl Peak {
    /// The instruction the bf16 prefill of `isa` spends its time in, whose peak bounds it:
    /// `tdpbf16ps` on `Amx`, `vdpbf16ps` on `Avx512Bf16`, f32 FMA elsewhere (the other
    /// instruction sets widen bf16 to f32).
    pub fn of_prefill(isa: Isa) -> Peak {
        match isa {
            Isa::Amx => Peak::AmxBf16,
            Isa::Avx512Bf16 => Peak::Bf16Dot,
            Isa::Avx512 | Isa::Avx2 | Isa::Neon | Isa::Scalar => Peak::F32Fma,
        }
    }

    /// Its name in the bench's output.
    pub fn name(self) -> &'static str {
        match self {
            Peak::F32Fma => "f32 FMA",
            Peak::Bf16Dot => "bf16 dot (vdpbf16ps)",
            Peak::AmxBf16 => "AMX bf16 (tdpbf16ps)",
        }
    }

    /// Runs `iters` rounds on this thread, on the vectors of `isa`: the FLOPs done, or None
    /// where `isa` lacks the instruction (the bf16 dot needs `Avx512Bf16` or `Amx`, the AMX
    /// one `Amx`).
    ///
    /// # Panics
    /// If this CPU lacks `isa`.
    pub fn run(self, isa: Isa, iters: u64) -> Option<f64> {
        assert!(isa.is_available(), "this CPU lacks {isa}");
        match (self, isa) {
            (Peak::F32Fma, _) => Some(isa.vectorize(FmaPeak { iters })),
            #[cfg(target_arch = "x86_64")]
            (Peak::Bf16Dot, Isa::Avx512Bf16 | Isa::Amx) => {
                // SAFETY: both instruction sets include AVX512-BF16, and this CPU has them.
                Some(unsafe { bf16_dot(iters) })
            }
            #[cfg(target_arch = "x86_64")]
            (Peak::AmxBf16, Isa::Amx) => super::amx::peak(iters),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn available() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available())
    }

    /// Every probe runs on every instruction set of this CPU and counts positive FLOPs: the
    /// f32 FMA everywhere, and the instruction of each one's prefill.
    #[test]
    fn compute_probes_run_on_every_isa() {
        for isa in available() {
            for peak in [Peak::F32Fma, Peak::of_prefill(isa)] {
                let flops = peak
                    .run(isa, 1000)
                    .expect("the ISA has its prefill's instruction");
                assert!(flops.is_finite() && flops > 0.0, "{isa} {peak:?}: {flops}");
            }
        }
        assert_eq!(Peak::AmxBf16.run(Isa::Scalar, 10), None);
        assert_eq!(Peak::Bf16Dot.run(Isa::Scalar, 10), None);
    }

    /// The memory probes add every line they are given, on every instruction set of this CPU:
    /// exactly the plain sum (the values are multiples of 1/8, whose sums here are exact).
    #[test]
    fn memory_probes_sum_their_lines() {
        let lines: Vec<Line> = (0..1000)
            .map(|i| Line(std::array::from_fn(|j| ((i * 3 + j) % 7) as f32 * 0.125)))
            .collect();
        let plain = |ls: &mut dyn Iterator<Item = &Line>| -> f32 { ls.flat_map(|l| l.0).sum() };
        // Runs of 8 lines in a scrambled order, leaving some lines out.
        let runs: Vec<u32> = (0..100u32).map(|r| (r * 37 % 120) * 8).collect();
        let visited = plain(
            &mut runs
                .iter()
                .flat_map(|&r| &lines[r as usize..r as usize + 8]),
        );
        for isa in available() {
            for part in [&lines[..], &lines[..1], &lines[3..500]] {
                assert_eq!(
                    isa.vectorize(SumLines(part)),
                    plain(&mut part.iter()),
                    "{isa}"
                );
            }
            let paged = PagedSum {
                lines: &lines,
                runs: &runs,
                run_lines: 8,
            };
            assert_eq!(isa.vectorize(paged), visited, "{isa}");
        }
    }
}
