//! Which instruction set the CPU backend runs: detected at run time, or forced through the
//! `PAGEDATTN_ISA` environment variable (`amx`, `avx512bf16`, `avx512`, `avx2`, `neon`,
//! `scalar`),
//! which is how the tests run every path on one machine.

use std::fmt;
use std::str::FromStr;

use super::simd::{scalar::Scalar, Simd, WithSimd};
use crate::error::{Error, Result};

/// The environment variable that forces an instruction set.
pub const ISA_ENV: &str = "PAGEDATTN_ISA";

/// An instruction set the CPU kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Intel AMX tiles (`tdpbf16ps`) for the bf16 prefill, AVX-512's f32 kernels for the
    /// rest: on the AMX Xeons measured, `vdpbf16ps` issues at half the rate of f32 FMAs, so
    /// the AVX512-BF16 decode and prefill are slower there than the f32 ones (BENCHMARKS.md).
    Amx,
    /// AVX-512 with AVX512-BF16 (`vdpbf16ps` for bf16 prefill).
    Avx512Bf16,
    /// AVX-512 F/BW/VL.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AArch64 NEON.
    Neon,
    /// Portable scalar code.
    Scalar,
}

impl Isa {
    /// All instruction sets, best first.
    pub const ALL: [Isa; 6] = [
        Isa::Amx,
        Isa::Avx512Bf16,
        Isa::Avx512,
        Isa::Avx2,
        Isa::Neon,
        Isa::Scalar,
    ];

    /// The name used by `PAGEDATTN_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Amx => "amx",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Scalar => "scalar",
        }
    }

    /// Whether bf16 calls of head size `head_size` run on bf16 dot-product instructions
    /// here: AVX512-BF16's `vdpbf16ps` for prefill rows (sequences of more than one query
    /// token) with `head_size` a multiple of 16 and for decode rows with a multiple of 32;
    /// AMX's `tdpbf16ps` for prefill rows with a multiple of 32 (its decode is AVX-512's f32).
    /// Those kernels round each probability to bf16 for P·V and flush subnormal inputs,
    /// products and sums to zero (docs/semantics.md); the tests' tolerances ask this too.
    pub fn bf16_dot_products(self, head_size: usize, prefill: bool) -> bool {
        match self {
            Isa::Avx512Bf16 => head_size.is_multiple_of(if prefill { 16 } else { 32 }),
            Isa::Amx => prefill && head_size.is_multiple_of(32),
            _ => false,
        }
    }

    /// Whether this CPU can run it.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Bf16.is_available() && super::amx::available(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => super::simd::x86::Avx512::new().is_some_and(|a| a.has_bf16()),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::simd::x86::Avx512::new().is_some(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::simd::x86::Avx2::new().is_some(),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::simd::neon::Neon::new().is_some(),
            Isa::Scalar => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best instruction set of this CPU: the first of [`Isa::ALL`] it has, except
    /// AVX512-BF16 on Intel CPUs, whose `vdpbf16ps` issues at half the rate of f32 FMAs (the
    /// f32 AVX-512 kernels are faster there; AMD's runs at twice it).
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|&i| i.is_available() && !(i == Isa::Avx512Bf16 && intel()))
            .unwrap_or(Isa::Scalar)
    }

    /// Runs `op` on this instruction set's widest f32 vectors: [`Isa::vectorize_dividing`]
    /// with no width constraint (0 is a multiple of every lane count).
    ///
    /// # Panics
    /// If this CPU lacks the instruction set ([`Isa::is_available`]).
    pub fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        self.vectorize_dividing(0, op)
    }

    /// Runs `op` on the widest f32 vectors of this instruction set whose lane count divides
    /// `n` (narrower ones down to scalar where it does not, so that kernels need no tails).
    /// The one place an [`Isa`] becomes a [`Simd`] token: the backend runs every call through
    /// it and the benchmark's probes (`cpu::peak`) too, so that both run the same
    /// vectors. `Amx` and `Avx512Bf16` get the AVX-512 token with AVX512-BF16 use on, `Avx512`
    /// without.
    ///
    /// # Panics
    /// If this CPU lacks the instruction set ([`Isa::is_available`]).
    pub fn vectorize_dividing<Op: WithSimd>(self, n: usize, op: Op) -> Op::Output {
        #[cfg(target_arch = "x86_64")]
        {
            use super::simd::x86::{Avx2, Avx512};
            if matches!(self, Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512)
                && n.is_multiple_of(Avx512::LANES)
            {
                let s = Avx512::new().expect("this CPU has the instruction set");
                let s = if self == Isa::Avx512 {
                    s.without_bf16()
                } else {
                    s
                };
                return s.vectorize(op);
            }
            if matches!(self, Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2)
                && n.is_multiple_of(Avx2::LANES)
            {
                return Avx2::new()
                    .expect("AVX-512 machines have AVX2")
                    .vectorize(op);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use super::simd::neon::Neon;
            if self == Isa::Neon && n.is_multiple_of(Neon::LANES) {
                return Neon::new()
                    .expect("this CPU has the instruction set")
                    .vectorize(op);
            }
        }
        Scalar.vectorize(op)
    }

    /// `PAGEDATTN_ISA` if set (an error if this CPU lacks it), else the best one.
    pub fn from_env() -> Result<Isa> {
        match std::env::var(ISA_ENV) {
            Ok(name) if !name.is_empty() => {
                let isa: Isa = name.parse()?;
                if isa.is_available() {
                    Ok(isa)
                } else {
                    Err(Error::unsupported(
                        "cpu",
                        format!("{ISA_ENV}={name}: this CPU lacks it"),
                    ))
                }
            }
            _ => Ok(Isa::detect()),
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Isa::ALL.into_iter().find(|i| i.name() == s).ok_or_else(|| {
            Error::invalid(
                ISA_ENV,
                format!("{s:?}"),
                "one of amx, avx512bf16, avx512, avx2, neon, scalar",
            )
        })
    }
}

/// Whether this is an Intel CPU (CPUID vendor "GenuineIntel").
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID exists on every x86_64 CPU. Newer Rust declares the intrinsic safe; the
        // minimum supported Rust (1.89) still declares it unsafe.
        #[allow(unused_unsafe)]
        let leaf = unsafe { std::arch::x86_64::__cpuid(0) };
        [leaf.ebx, leaf.edx, leaf.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .eq(*b"GenuineIntel")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}
