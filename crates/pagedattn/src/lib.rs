//! pagedattn: attention over a paged KV cache for LLM inference engines, with
//! interchangeable backends behind one contract.
//!
//! The contract every backend meets (positions, masks, ALiBi, soft cap, fp8 caches, NaN and
//! infinities, what is an error) is `docs/semantics.md` in the repository (it is not part of
//! this documentation); the [`reference`](mod@reference) backend implements it as plainly as
//! possible and is the oracle the other backends are tested against.
//!
//! # Backends
//!
//! [`registry::backend`] builds one by name (`auto`: `cuda` where a GPU is usable, else `cpu`):
//! - `reference`: the contract in f64 on the host, as plainly as possible; the oracle.
//! - `cpu`: SIMD kernels (AMX, AVX-512, AVX2, NEON, scalar; chosen at run time) on every core.
//! - `cuda` (the `cuda` feature, on by default): an NVIDIA GPU, kernels compiled at run time by
//!   NVRTC; swap space in pinned host memory.
//!
//! # A step
//!
//! The engine keeps one [`KvCache`] per layer ([`Backend::allocate_kv_cache`], geometry from
//! [`AttentionConfig::kv_cache_spec`]) and, per sequence, a block table of [`BlockId`]s. Each
//! step, [`MetadataBuilder`] turns the scheduled sequences ([`SequenceDesc::prompt`]:
//! cached then new tokens; [`SequenceDesc::decode`]: one new token after the cached ones) into
//! [`AttentionMetadata`]; [`plan`](AttentionImpl::plan) validates it once, then every layer's
//! [`forward`](AttentionImpl::forward) writes its new keys and values into its cache and
//! attends. Between steps, [`swap_out`](Backend::swap_out) / [`swap_in`](Backend::swap_in) move
//! a preempted sequence's blocks to and from host swap space
//! ([`Backend::allocate_swap_space`]) and [`copy_blocks`](Backend::copy_blocks) copies blocks
//! for a fork (copy-on-write), every layer in one call.
//!
//! Below, one layer on `reference`: queries and keys are zero, so every key the query sees
//! weighs the same and each output is the mean of the values its query sees.
//!
//! ```
//! use pagedattn::{registry, AttentionConfig, BlockId, DType, Inputs, KvCache};
//! use pagedattn::{MetadataBuilder, SequenceDesc, Tensor};
//!
//! let backend = registry::backend("reference")?;
//! let config = AttentionConfig::builder(2, 4).num_kv_heads(1).build()?;
//! let attention = backend.attention(&config)?;
//! let spec = config.kv_cache_spec(DType::F32, 4, 2); // 4 blocks of 2 tokens
//! let mut caches = vec![backend.allocate_kv_cache(&spec)?]; // one per layer
//!
//! // One step whose new tokens have values `values`: the first output element of each token.
//! let step = |caches: &mut [KvCache], seqs: &[SequenceDesc<'_>], values: &[f32]| {
//!     let mut builder = MetadataBuilder::for_cache(&spec);
//!     for seq in seqs {
//!         builder.push(*seq);
//!     }
//!     let metadata = builder.build()?;
//!     let plan = attention.plan(&metadata, Some(&spec))?;
//!     let mut workspace = backend.workspace(&plan)?;
//!     let t = metadata.num_tokens();
//!     let q = config.zeros_query(backend.device(), DType::F32, t)?;
//!     let k = config.zeros_kv(backend.device(), DType::F32, t)?;
//!     let v: Vec<f32> = values.iter().flat_map(|&x| [x; 4]).collect();
//!     let v = Tensor::from_f32(DType::F32, &config.kv_shape(t), &v)?;
//!     let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(&mut caches[0]);
//!     let out = attention.forward(&plan, &mut workspace, inputs)?.to_f32_vec()?;
//!     Ok::<_, pagedattn::Error>(out.chunks(8).map(|token| token[0]).collect::<Vec<_>>())
//! };
//!
//! // A prompt of 2 tokens in block 0, then a decode step: block 0 is full, the table grows.
//! let mut table: Vec<BlockId> = vec![0];
//! assert_eq!(step(&mut caches, &[SequenceDesc::prompt(0, 2, &table)], &[1.0, 3.0])?, [1.0, 2.0]);
//! table.push(1);
//! assert_eq!(step(&mut caches, &[SequenceDesc::decode(2, &table)], &[5.0])?, [3.0]);
//!
//! // Preempted: its blocks go to host swap space; another prompt takes blocks 0 and 1; the
//! // sequence comes back in blocks 3 and 2.
//! let mut swaps = vec![backend.allocate_swap_space(&spec, 2)?];
//! backend.swap_out(&caches, &mut swaps, &[(0, 0), (1, 1)])?;
//! step(&mut caches, &[SequenceDesc::prompt(0, 4, &[0, 1])], &[9.0; 4])?;
//! backend.swap_in(&swaps, &mut caches, &[(0, 3), (1, 2)])?;
//! let table: Vec<BlockId> = vec![3, 2];
//!
//! // A fork shares the full block 3 and gets a copy of the last one, which both write into.
//! backend.copy_blocks(&mut caches, &[(2, 0)])?;
//! let fork: Vec<BlockId> = vec![3, 0];
//! let both = [SequenceDesc::decode(3, &table), SequenceDesc::decode(3, &fork)];
//! assert_eq!(step(&mut caches, &both, &[7.0, 11.0])?, [4.0, 5.0]);
//! # Ok::<(), pagedattn::Error>(())
//! ```

#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod detached;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fp8;
mod host_buffer;
pub mod kv_cache;
pub mod metadata;
pub mod reference;
pub mod registry;
pub mod replay;
pub mod semantics;
mod shared;
pub mod step;
pub mod tensor;

// The README's Rust code compiles and runs as doctests (not under Miri: its engine step on a
// realistic layer takes minutes there, and the crate's own doctest covers the same calls).
#[cfg(all(doctest, not(miri)))]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

pub use backend::{AttentionImpl, Backend, Capabilities, GraphCapacity, Sizes};
pub use config::{alibi_slopes_bloom, alibi_slopes_mpt, AttentionConfig, AttnType, KvCacheDtype};
pub use device::{Device, MemoryInfo};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use fp8::Fp8Format;
/// The 16-bit float types of tensors (re-exported from the `half` crate).
pub use half::{bf16, f16};
pub use kv_cache::{
    copy_blocks, swap_blocks, BlockId, CacheLayout, KvCache, KvCacheSpec, KvScales,
};
pub use metadata::{
    AttentionMetadata, BlockTables, EncoderDesc, EncoderMetadata, MetadataBuilder, SequenceDesc,
};
pub use step::{Inputs, KvPair, Plan, Workspace};
pub use tensor::{HostBuffer, HostSliceMut, HostStorage, Storage, Tensor};
