//! The `cpu` backend: flash-style attention over the paged cache with SIMD kernels generic
//! over the instruction set (chosen at run time) and rayon over (sequence, kv head, query
//! tile or key partition).
//!
//! Cache layout: `[NB, Hkv, B, D]` (head-major inside a block). The kernels read one kv head
//! at a time, whose rows of a block are then one contiguous run of `B * D` elements for keys
//! and one for values (a decode unit walks every kv head of its sequence tile by tile, so the
//! runs of a block are read close together); the prefill packs a head's keys from those runs.
//! The token-major layout would give `B` pieces of `D` elements, `Hkv * D` apart, per head and
//! block: more, shorter pieces per block, which read slower in this decode's order (NOTES.md,
//! "Measurements moved out of the cpu doc comments").
//!
//! Where things are: `backend` (registration, a layer's plan, cache write and forward call),
//! `hugepages`, `dispatch` (the ISA and element types, then the plan's work in parallel),
//! `call` (the typed call and what its units of work share), `decode`, `prefill`, `merge`;
//! `kernel` (the tile loop, micro-kernels, row layouts and prefetch policy), `packed`, `bf16`,
//! `amx` and `widen` (prefill packing and the x86 bf16 kernels), `plan` (the work split),
//! `simd` (the ISA abstraction), `isa` and `peak` (the ceilings' probes).

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
pub mod peak;
pub(crate) mod plan;
mod prefill;
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub(crate) mod widen;

pub use backend::{Cpu, CpuAttention};
pub use hugepages::advise_huge_pages_uninit;
pub use isa::{Isa, ISA_ENV};
