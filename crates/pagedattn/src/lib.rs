//! pagedattn: attention over a paged KV cache, with interchangeable backends.
//!
//! The contract every backend meets is `docs/semantics.md` in the repository;
//! [`reference`](mod@reference) implements it as plainly as possible and is the oracle the
//! other backends are tested against.
//!
//! A step: build the metadata of the batch, [`plan`](AttentionImpl::plan) it once, then run
//! every layer's [`forward`](AttentionImpl::forward) with that plan and a [`Workspace`].
//!
//! ```
//! use pagedattn::{registry, AttentionConfig, DType, Inputs, MetadataBuilder, SequenceDesc, Tensor};
//! let backend = registry::backend("reference")?;
//! let config = AttentionConfig::builder(4, 8).num_kv_heads(2).build()?;
//! let mut cache = backend.allocate_kv_cache(&config.kv_cache_spec(DType::F32, 4, 2))?;
//! // One prompt of 3 tokens in blocks 2 and 0.
//! let metadata = MetadataBuilder::for_cache(cache.spec())
//!     .push(SequenceDesc::prompt(0, 3, vec![2, 0]))
//!     .build()?;
//! let attention = backend.attention(&config)?;
//! let plan = attention.plan(&metadata, Some(cache.spec()))?;
//! let mut workspace = backend.workspace(&plan)?;
//! let q = Tensor::from_f32(DType::F32, &[3, 4, 8], &[0.1; 96])?;
//! let k = Tensor::from_f32(DType::F32, &[3, 2, 8], &[0.2; 48])?;
//! let v = Tensor::from_f32(DType::F32, &[3, 2, 8], &[0.3; 48])?;
//! let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(&mut cache);
//! let out = attention.forward(&plan, &mut workspace, inputs)?;
//! assert!((out.to_f32_vec()?[0] - 0.3).abs() < 1e-6);
//! # Ok::<(), pagedattn::Error>(())
//! ```

#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod kv_cache;
pub mod metadata;
pub mod reference;
pub mod registry;
pub mod replay;
pub mod semantics;
mod shared;
pub mod step;
pub mod tensor;

pub use backend::{AttentionImpl, Backend, Capabilities, GraphCapacity, Sizes};
pub use config::{alibi_slopes_bloom, alibi_slopes_mpt, AttentionConfig, AttnType, KvCacheDtype};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use fp8::Fp8Format;
/// The 16-bit float types of tensors (re-exported from the `half` crate).
pub use half::{bf16, f16};
pub use kv_cache::{copy_blocks, swap_blocks, CacheLayout, KvCache, KvCacheSpec, KvScales};
pub use metadata::{
    AttentionMetadata, BlockTables, EncoderDesc, EncoderMetadata, MetadataBuilder, SequenceDesc,
};
pub use step::{Inputs, KvPair, Plan, Workspace};
pub use tensor::{HostSliceMut, HostStorage, Storage, Tensor};
