//! pagedattn: attention over a paged KV cache, with interchangeable backends.
//!
//! The contract every backend meets is DESIGN.md section 2; [`reference`](mod@reference) implements it as
//! plainly as possible and is the oracle the other backends are tested against.
//!
//! ```
//! use pagedattn::{registry, AttentionConfig, KvCacheSpec, KvCacheDtype, DType, KvPair, KvScales,
//!                 MetadataBuilder, SequenceDesc, Tensor};
//! let backend = registry::backend("reference")?;
//! let config = AttentionConfig::builder(4, 8).num_kv_heads(2).build()?;
//! let spec = KvCacheSpec { num_blocks: 4, block_size: 2, num_kv_heads: 2, head_size: 8,
//!                          dtype: DType::F32, kv_cache_dtype: KvCacheDtype::Auto };
//! let mut cache = backend.allocate_kv_cache(&spec)?;
//! // One prompt of 3 tokens in blocks 2 and 0.
//! let metadata = MetadataBuilder::new(2).push(SequenceDesc::prompt(0, 3, vec![2, 0])).build()?;
//! let q = Tensor::from_f32(DType::F32, &[3, 4, 8], &[0.1; 96])?;
//! let k = Tensor::from_f32(DType::F32, &[3, 2, 8], &[0.2; 48])?;
//! let v = Tensor::from_f32(DType::F32, &[3, 2, 8], &[0.3; 48])?;
//! let mut out = Tensor::zeros(DType::F32, &[3, 4, 8]);
//! let attention = backend.attention(&config)?;
//! attention.forward(&q, Some(KvPair { key: &k, value: &v }), Some(&mut cache), &metadata,
//!                   &mut out, KvScales::default())?;
//! assert!((out.to_f32_vec()[0] - 0.3).abs() < 1e-6);
//! # Ok::<(), pagedattn::Error>(())
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod config;
pub mod cpu;
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
pub mod tensor;

pub use backend::{AttentionImpl, Backend, Capabilities, Device, KvPair, Sizes};
pub use config::{alibi_slopes_bloom, alibi_slopes_mpt, AttentionConfig, AttnType, KvCacheDtype};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use fp8::Fp8Format;
pub use kv_cache::{copy_blocks, swap_blocks, CacheLayout, KvCache, KvCacheSpec, KvScales};
pub use metadata::{
    AttentionMetadata, BlockTables, EncoderDesc, EncoderMetadata, MetadataBuilder, SequenceDesc,
};
pub use tensor::{Storage, Tensor};
