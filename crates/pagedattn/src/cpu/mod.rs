//! The `cpu` backend ([`Cpu`], registry name `cpu`): flash-style attention over a paged KV
//! cache in host memory, with SIMD kernels for the instruction set chosen at run time and each
//! call's work spread over a rayon thread pool.
//!
//! It runs everything the contract (`docs/semantics.md`) describes: every attention type,
//! f32 / f16 / bf16 activations, fp8 caches (e4m3, e5m2; dequantized as they are read), GQA and
//! MQA, ALiBi, sliding windows, soft caps, any head size (vector kernels where it is a multiple
//! of the vector width, scalar ones otherwise) and any block size. Scores, softmax and P·V
//! accumulate in f32; with bf16 queries on `avx512bf16` and `amx` the probabilities are
//! rounded to bf16 for the P·V product, as GPU flash attention does.
//!
//! Its caches are in [`CacheLayout::Hnd`](crate::CacheLayout::Hnd) (`[NB, Hkv, B, D]`: a kv
//! head's rows of a block are one contiguous run), and [`Cpu`]'s `allocate_kv_cache` asks the
//! kernel to back them with transparent huge pages, since a decode reads hundreds of scattered
//! blocks per sequence.
//!
//! # Instruction sets
//!
//! [`Isa`] lists them, best first:
//!
//! - `amx`: Intel AMX tiles (`tdpbf16ps`) for the bf16 prefill, AVX-512 for the rest. Intel
//!   Xeons of Sapphire Rapids and later, on Linux (the process asks the kernel for the tile
//!   state).
//! - `avx512bf16`: AVX-512 with AVX512-BF16 (`vdpbf16ps`) for bf16 prefill and decode.
//! - `avx512`: AVX-512 F / BW / VL.
//! - `avx2`: AVX2 with FMA and F16C.
//! - `neon`: AArch64.
//! - `scalar`: portable code, everywhere.
//!
//! [`Cpu::new`] (and the registry's `cpu`) runs the one [`Isa::detect`] finds: the best this
//! CPU has, except `avx512bf16` on Intel CPUs, whose `vdpbf16ps` issues at half the rate of
//! f32 FMAs, so that `avx512` is faster there. The `PAGEDATTN_ISA` environment variable
//! ([`ISA_ENV`]) forces one by name (`PAGEDATTN_ISA=amx`, `=avx2`, `=scalar`, ...); it is an
//! error if this CPU lacks it. [`Cpu::with_isa`] picks one in code, and
//! [`Isa::is_available`] says which this CPU has.
//!
//! # Threads
//!
//! A forward call runs on the rayon pool it is called from: rayon's global pool (as many
//! threads as `RAYON_NUM_THREADS`, else one per logical CPU), or the caller's own pool when it
//! calls inside `ThreadPool::install`. The work is split per sequence, kv head and query tile,
//! and long decodes also along their keys (partitions merged afterwards), for the number of
//! threads of the pool the plan is made in: plan in the pool that runs the calls.
//!
//! Also public: [`simd`] (the instruction-set abstraction the kernels are written against),
//! `peak` (with the `probes` feature: the probes of this CPU's ceilings that `pagedattn bench`
//! measures) and
//! [`advise_huge_pages_uninit`] (the caches' huge-page advice, for a buffer of the caller's).

pub(crate) mod aligned;
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
mod backend;
#[cfg(target_arch = "x86_64")]
pub(crate) mod bf16;
mod call;
mod decode;
mod dispatch;
mod hugepages;
mod isa;
pub(crate) mod kernel;
mod merge;
pub(crate) mod packed;
mod parallel;
#[cfg(feature = "probes")]
pub mod peak;
pub(crate) mod plan;
mod prefill;
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub(crate) mod widen;

pub use backend::{Cpu, CpuAttention};
pub use hugepages::advise_huge_pages_uninit;
pub use isa::{Isa, ISA_ENV};
