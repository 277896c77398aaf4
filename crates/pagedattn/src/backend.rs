//! The backend API: what a backend reports, the cache operations it provides, and the
//! attention implementation it builds from a config. Also the checks every `forward` shares.

use std::fmt;

use crate::config::{AttentionConfig, AttnType};
use crate::dtype::DType;
use crate::error::{ensure, Error, Result};
use crate::kv_cache::{self, CacheLayout, KvCache, KvCacheSpec, KvScales};
use crate::metadata::AttentionMetadata;
use crate::tensor::Tensor;

/// Where a backend computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// A CUDA GPU, by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A set of supported sizes (head sizes, block sizes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sizes {
    /// Every positive size.
    Any,
    /// Only these.
    Only(Vec<usize>),
}

impl Sizes {
    /// Whether `n` is supported.
    pub fn contains(&self, n: usize) -> bool {
        match self {
            Sizes::Any => n > 0,
            Sizes::Only(v) => v.contains(&n),
        }
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sizes::Any => f.write_str("any"),
            Sizes::Only(v) => {
                let names: Vec<String> = v.iter().map(usize::to_string).collect();
                f.write_str(&names.join(", "))
            }
        }
    }
}

/// What a backend supports. Anything outside it is answered with [`Error::Unsupported`].
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    /// Activation dtypes.
    pub dtypes: Vec<DType>,
    /// Head sizes.
    pub head_sizes: Sizes,
    /// Cache block sizes.
    pub block_sizes: Sizes,
    /// Attention types.
    pub attn_types: Vec<AttnType>,
    /// fp8 KV caches.
    pub fp8: bool,
    /// ALiBi.
    pub alibi: bool,
    /// Sliding windows.
    pub sliding_window: bool,
    /// Logits soft cap.
    pub soft_cap: bool,
}

impl Capabilities {
    /// Every dtype, head size, block size, attention type and feature.
    pub fn everything() -> Self {
        Capabilities {
            dtypes: DType::FLOATS.to_vec(),
            head_sizes: Sizes::Any,
            block_sizes: Sizes::Any,
            attn_types: AttnType::ALL.to_vec(),
            fp8: true,
            alibi: true,
            sliding_window: true,
            soft_cap: true,
        }
    }

    /// Checks a layer config against these capabilities.
    pub fn check_config(&self, backend: &str, config: &AttentionConfig) -> Result<()> {
        let unsupported = |feature: String| Err(Error::unsupported(backend, feature));
        if !self.head_sizes.contains(config.head_size()) {
            return unsupported(format!(
                "head size {} (supported: {})",
                config.head_size(),
                self.head_sizes
            ));
        }
        if !self.attn_types.contains(&config.attn_type()) {
            return unsupported(format!("attn_type {}", config.attn_type()));
        }
        let features = [
            (
                config.kv_cache_dtype().fp8_format().is_some(),
                self.fp8,
                "fp8 KV cache",
            ),
            (config.alibi_slopes().is_some(), self.alibi, "ALiBi"),
            (
                config.sliding_window().is_some(),
                self.sliding_window,
                "sliding window",
            ),
            (
                config.logits_soft_cap().is_some(),
                self.soft_cap,
                "logits soft cap",
            ),
        ];
        for (wanted, have, name) in features {
            if wanted && !have {
                return unsupported(name.to_string());
            }
        }
        Ok(())
    }

    /// Checks a cache geometry against these capabilities.
    pub fn check_cache(&self, backend: &str, spec: &KvCacheSpec) -> Result<()> {
        spec.validate()?;
        if !self.block_sizes.contains(spec.block_size) {
            return Err(Error::unsupported(
                backend,
                format!(
                    "block size {} (supported: {})",
                    spec.block_size, self.block_sizes
                ),
            ));
        }
        if !self.head_sizes.contains(spec.head_size) {
            return Err(Error::unsupported(
                backend,
                format!("head size {}", spec.head_size),
            ));
        }
        self.check_dtype(backend, spec.dtype)?;
        if spec.kv_cache_dtype.fp8_format().is_some() && !self.fp8 {
            return Err(Error::unsupported(backend, "fp8 KV cache"));
        }
        Ok(())
    }

    /// Checks an activation dtype.
    pub fn check_dtype(&self, backend: &str, dtype: DType) -> Result<()> {
        if self.dtypes.contains(&dtype) {
            Ok(())
        } else {
            Err(Error::unsupported(backend, format!("dtype {dtype}")))
        }
    }
}

/// The key and value tensors of a call, `[Tk, Hkv, D]` each (present or absent together).
#[derive(Debug, Clone, Copy)]
pub struct KvPair<'a> {
    /// New keys.
    pub key: &'a Tensor,
    /// New values.
    pub value: &'a Tensor,
}

/// One layer's attention, built by a backend from an [`AttentionConfig`].
pub trait AttentionImpl: Send + Sync {
    /// The config it was built from.
    fn config(&self) -> &AttentionConfig;

    /// Writes `new_kv` into `kv_cache` through the metadata's slot mapping (the cross slot
    /// mapping for encoder-decoder), then attends: `output[T, H, D]` for `query[T, H, D]`.
    fn forward(
        &self,
        query: &Tensor,
        new_kv: Option<KvPair<'_>>,
        kv_cache: Option<&mut KvCache>,
        metadata: &AttentionMetadata,
        output: &mut Tensor,
        scales: KvScales,
    ) -> Result<()>;
}

/// A backend: a device, a cache layout and an attention implementation.
pub trait Backend: Send + Sync {
    /// Its registry name (`reference`, `cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Where it computes.
    fn device(&self) -> Device;
    /// What it supports.
    fn capabilities(&self) -> Capabilities;
    /// The layout of the caches it allocates and reads.
    fn kv_cache_layout(&self) -> CacheLayout;
    /// Builds one layer's attention; unsupported settings are refused here.
    fn attention(&self, config: &AttentionConfig) -> Result<Box<dyn AttentionImpl>>;

    /// Facts worth showing a user beyond the capabilities (e.g. the instruction set the CPU
    /// backend runs), as (name, value) pairs.
    fn details(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// The shape of one layer's cache for `spec`.
    fn kv_cache_shape(&self, spec: &KvCacheSpec) -> Result<Vec<usize>> {
        self.capabilities().check_cache(self.name(), spec)?;
        Ok(self.kv_cache_layout().shape(spec))
    }

    /// Allocates one layer's zero-filled cache.
    fn allocate_kv_cache(&self, spec: &KvCacheSpec) -> Result<KvCache> {
        self.capabilities().check_cache(self.name(), spec)?;
        KvCache::zeros(*spec, self.kv_cache_layout())
    }

    /// Copies blocks `(src, dst)` from one cache to another (swap in / out).
    fn swap_blocks(
        &self,
        src: &KvCache,
        dst: &mut KvCache,
        pairs: &[(usize, usize)],
    ) -> Result<()> {
        kv_cache::swap_blocks(src, dst, pairs)
    }

    /// Copies blocks `(src, dst)` inside every layer's cache (copy-on-write).
    fn copy_blocks(&self, caches: &mut [KvCache], pairs: &[(usize, usize)]) -> Result<()> {
        kv_cache::copy_blocks(caches, pairs)
    }
}

/// Everything a `forward` call is checked against before any work: tensor dtypes and shapes,
/// the cache against the config and the backend, the scales, and the metadata.
pub struct ForwardCheck<'a> {
    /// Name of the backend (for errors).
    pub backend: &'a str,
    /// The backend's capabilities.
    pub capabilities: &'a Capabilities,
    /// The layout the backend reads.
    pub layout: CacheLayout,
    /// The layer config.
    pub config: &'a AttentionConfig,
}

impl ForwardCheck<'_> {
    /// Runs every check of a `forward` call.
    pub fn run(
        &self,
        query: &Tensor,
        new_kv: Option<KvPair<'_>>,
        kv_cache: Option<&KvCache>,
        metadata: &AttentionMetadata,
        output: &Tensor,
        scales: KvScales,
    ) -> Result<()> {
        let c = self.config;
        let (h, hkv, d) = (c.num_heads(), c.num_kv_heads(), c.head_size());
        let dtype = query.dtype();
        ensure(
            dtype.is_float(),
            || "query.dtype".into(),
            dtype,
            || "f32, f16 or bf16".into(),
        )?;
        self.capabilities.check_dtype(self.backend, dtype)?;
        check_shape("query", query, &[None, Some(h), Some(d)])?;
        let t = query.shape()[0];
        ensure(
            output.dtype() == dtype,
            || "output.dtype".into(),
            output.dtype(),
            || format!("{dtype} (the query's)"),
        )?;
        check_shape("output", output, &[Some(t), Some(h), Some(d)])?;
        let num_kv_tokens = match new_kv {
            Some(kv) => {
                for (name, x) in [("key", kv.key), ("value", kv.value)] {
                    ensure(
                        x.dtype() == dtype,
                        || format!("{name}.dtype"),
                        x.dtype(),
                        || format!("{dtype} (the query's)"),
                    )?;
                }
                check_shape("key", kv.key, &[None, Some(hkv), Some(d)])?;
                let tk = kv.key.shape()[0];
                check_shape("value", kv.value, &[Some(tk), Some(hkv), Some(d)])?;
                Some(tk)
            }
            None => None,
        };
        scales.validate(c.kv_cache_dtype())?;
        if let Some(cache) = kv_cache {
            let spec = cache.spec();
            for (field, have, want) in [
                ("kv_cache.num_kv_heads", spec.num_kv_heads, hkv),
                ("kv_cache.head_size", spec.head_size, d),
            ] {
                ensure(
                    have == want,
                    || field.into(),
                    have,
                    || format!("{want} (the config's)"),
                )?;
            }
            ensure(
                spec.dtype == dtype,
                || "kv_cache.dtype".into(),
                spec.dtype,
                || format!("{dtype} (the query's)"),
            )?;
            ensure(
                spec.kv_cache_dtype == c.kv_cache_dtype(),
                || "kv_cache.kv_cache_dtype".into(),
                spec.kv_cache_dtype,
                || format!("{} (the config's)", c.kv_cache_dtype()),
            )?;
            ensure(
                cache.layout() == self.layout,
                || "kv_cache.layout".into(),
                format!("{:?}", cache.layout()),
                || {
                    format!(
                        "{:?}: allocate the cache with backend {}",
                        self.layout, self.backend
                    )
                },
            )?;
            self.capabilities.check_cache(self.backend, spec)?;
        }
        metadata.validate(c.attn_type(), t, num_kv_tokens, kv_cache.map(KvCache::spec))
    }
}

/// Checks a tensor's rank and the dimensions given as `Some`.
fn check_shape(name: &str, t: &Tensor, expected: &[Option<usize>]) -> Result<()> {
    let shape = t.shape();
    let ok = shape.len() == expected.len()
        && shape
            .iter()
            .zip(expected)
            .all(|(&s, e)| e.is_none_or(|e| e == s));
    let want: Vec<String> = expected
        .iter()
        .map(|e| e.map_or("_".to_string(), |e| e.to_string()))
        .collect();
    ensure(
        ok,
        || format!("{name}.shape"),
        format!("{shape:?}"),
        || format!("[{}]", want.join(", ")),
    )
}
