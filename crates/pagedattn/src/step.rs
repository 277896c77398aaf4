//! One step of a model: its [`Plan`] (the validated metadata, prepared once by a backend and
//! shared by every layer), the [`Workspace`] a forward computes in, the [`Inputs`] of one
//! layer's call, and [`ForwardCheck`], the one gate every input passes.

use std::any::Any;
use std::fmt;

use crate::backend::Capabilities;
use crate::config::{AttentionConfig, AttnType, KvCacheDtype};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{ensure, Error, Result};
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::tensor::{Storage, Tensor};

/// The key and value tensors of a call, `[Tk, Hkv, D]` each.
#[derive(Debug, Clone, Copy)]
pub struct KvPair<'a> {
    /// New keys.
    pub key: &'a Tensor,
    /// New values.
    pub value: &'a Tensor,
}

/// The tensors of one layer's forward call: the query, optionally new keys and values, and
/// optionally the layer's cache.
#[derive(Debug)]
pub struct Inputs<'a> {
    query: &'a Tensor,
    key_value: Option<KvPair<'a>>,
    cache: Option<&'a mut KvCache>,
}

impl<'a> Inputs<'a> {
    /// A call with `query[T, H, D]` only (add keys, values and a cache with the methods below).
    pub fn new(query: &'a Tensor) -> Self {
        Inputs {
            query,
            key_value: None,
            cache: None,
        }
    }

    /// With new keys and values, `[Tk, Hkv, D]` each.
    pub fn with_kv(mut self, key: &'a Tensor, value: &'a Tensor) -> Self {
        self.key_value = Some(KvPair { key, value });
        self
    }

    /// With new keys and values if `kv` is `Some`.
    pub fn with_kv_pair(mut self, kv: Option<KvPair<'a>>) -> Self {
        self.key_value = kv;
        self
    }

    /// With the layer's KV cache.
    pub fn with_cache(mut self, cache: &'a mut KvCache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// With the layer's KV cache if `cache` is `Some`.
    pub fn with_cache_opt(mut self, cache: Option<&'a mut KvCache>) -> Self {
        self.cache = cache;
        self
    }

    /// The query.
    pub fn query(&self) -> &'a Tensor {
        self.query
    }

    /// The new keys and values.
    pub fn key_value(&self) -> Option<KvPair<'a>> {
        self.key_value
    }

    /// The parts: query, new keys and values, cache.
    pub fn into_parts(self) -> (&'a Tensor, Option<KvPair<'a>>, Option<&'a mut KvCache>) {
        (self.query, self.key_value, self.cache)
    }
}

/// What a plan was made for: the parts of a layer's config it depends on. Layers that agree
/// on these share a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PlanShape {
    attn_type: AttnType,
    num_heads: usize,
    num_kv_heads: usize,
    head_size: usize,
    sliding_window: Option<usize>,
    kv_cache_dtype: KvCacheDtype,
}

impl fmt::Display for PlanShape {
    /// E.g. `decoder layer of 8 heads (2 kv heads) of size 64, window 128, cache fp8_e4m3`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        write!(
            f,
            "{} layer of {} head{} ({} kv head{}) of size {}",
            self.attn_type,
            self.num_heads,
            s(self.num_heads),
            self.num_kv_heads,
            s(self.num_kv_heads),
            self.head_size
        )?;
        if let Some(w) = self.sliding_window {
            write!(f, ", window {w}")?;
        }
        write!(f, ", cache {}", self.kv_cache_dtype)
    }
}

impl PlanShape {
    fn of(config: &AttentionConfig) -> Self {
        PlanShape {
            attn_type: config.attn_type(),
            num_heads: config.num_heads(),
            num_kv_heads: config.num_kv_heads(),
            head_size: config.head_size(),
            sliding_window: config.sliding_window(),
            kv_cache_dtype: config.kv_cache_dtype(),
        }
    }
}

/// A step's metadata, validated once and prepared by one backend for every layer of the step
/// (FlashInfer's `DecodePlan`): on a GPU it holds the metadata already uploaded.
pub struct Plan {
    backend: &'static str,
    shape: PlanShape,
    metadata: AttentionMetadata,
    cache: Option<KvCacheSpec>,
    num_kv_tokens: Option<usize>,
    workspace_bytes: usize,
    prepared: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("backend", &self.backend)
            .field("num_tokens", &self.metadata.num_tokens())
            .field("num_kv_tokens", &self.num_kv_tokens)
            .field("cache", &self.cache)
            .field("workspace_bytes", &self.workspace_bytes)
            .finish_non_exhaustive()
    }
}

impl Plan {
    /// The validated metadata.
    pub fn metadata(&self) -> &AttentionMetadata {
        &self.metadata
    }

    /// The cache geometry the plan was made for.
    pub fn cache_spec(&self) -> Option<&KvCacheSpec> {
        self.cache.as_ref()
    }

    /// Query tokens of the step (T).
    pub fn num_tokens(&self) -> usize {
        self.metadata.num_tokens()
    }

    /// Key/value tokens a forward takes (Tk), or `None` when the call carries none (a
    /// cross-attention decode reads the encoder's keys from the cache).
    pub fn num_kv_tokens(&self) -> Option<usize> {
        self.num_kv_tokens
    }

    /// Scratch bytes a forward on this plan needs in its [`Workspace`].
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }

    /// The backend's prepared data, or an error if another backend made the plan.
    pub fn prepared<P: Any>(&self, backend: &str) -> Result<&P> {
        let made_by = self.backend;
        self.prepared
            .downcast_ref()
            .ok_or_else(|| other_backend(made_by, backend))
    }

    /// [`prepared`](Self::prepared), mutably (a backend re-planning in place).
    pub fn prepared_mut<P: Any>(&mut self, backend: &str) -> Result<&mut P> {
        let made_by = self.backend;
        self.prepared
            .downcast_mut()
            .ok_or_else(|| other_backend(made_by, backend))
    }
}

/// The workspace bytes of `partials` split-K records of `floats` f32 each (`None`: a record's
/// size overflowed), or `Unsupported` naming `backend` where the size overflows.
pub(crate) fn partials_bytes(
    backend: &'static str,
    partials: usize,
    floats: Option<usize>,
) -> Result<usize> {
    floats
        .and_then(|f| f.checked_mul(partials))
        .and_then(|f| f.checked_mul(4))
        .ok_or_else(|| {
            Error::unsupported(
                backend,
                format!("a split-K workspace of {partials} partial records that large"),
            )
        })
}

/// The error for a plan `made_by` one backend used by `backend`.
fn other_backend(made_by: &str, backend: &str) -> Error {
    Error::invalid(
        "plan",
        format!("a plan of backend {made_by}"),
        format!("a plan made by backend {backend}"),
    )
}

/// Scratch memory on a device for forward calls (split-K partial results and the like),
/// allocated ahead so that a forward allocates nothing.
#[derive(Debug)]
pub struct Workspace {
    device: Device,
    /// f32 elements.
    storage: Option<Storage>,
}

impl Workspace {
    /// A workspace on `device` with no memory yet.
    pub fn empty(device: Device) -> Self {
        Workspace {
            device,
            storage: None,
        }
    }

    /// Grows the workspace (if needed) to what `plan` asks for.
    pub fn reserve(&mut self, plan: &Plan) -> Result<()> {
        if self.bytes() < plan.workspace_bytes {
            let elems = plan.workspace_bytes.div_ceil(4);
            self.storage = Some(Storage::zeros(self.device, DType::F32, elems)?);
        }
        Ok(())
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.storage.as_ref().map_or(0, |s| s.len() * 4)
    }

    /// Its device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The memory, for a backend's kernels (f32 elements; `None` while empty). Never
    /// public: a caller could put storage of another size, dtype or device in its place.
    pub(crate) fn storage_mut(&mut self) -> Option<&mut Storage> {
        self.storage.as_mut()
    }
}

/// The one gate of a forward call. [`ForwardCheck::plan`] checks a step's metadata against a
/// layer's config, its cache geometry and the backend, once per step;
/// [`ForwardCheck::call`] checks one call's tensors against the plan, in time independent of
/// the metadata's size. What passes needs no further checks.
pub struct ForwardCheck<'a> {
    /// Name of the backend (for errors).
    pub backend: &'static str,
    /// The backend's device.
    pub device: Device,
    /// The backend's capabilities.
    pub capabilities: &'a Capabilities,
    /// The layout the backend reads.
    pub layout: CacheLayout,
    /// The layer config.
    pub config: &'a AttentionConfig,
}

impl ForwardCheck<'_> {
    /// Validates `metadata` for this layer and `cache` geometry and builds a plan around the
    /// backend's `prepare`d data, which gets the validated metadata and whether calls carry
    /// key/value tensors.
    pub fn plan<P: Any + Send + Sync>(
        &self,
        metadata: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
        prepare: impl FnOnce(&AttentionMetadata, bool) -> Result<(P, usize)>,
    ) -> Result<Plan> {
        let c = self.config;
        if let Some(spec) = cache {
            self.check_cache_spec(spec)?;
            if let Some(b) = metadata.block_size {
                ensure(
                    b == spec.block_size,
                    || "metadata.block_size".into(),
                    b,
                    || format!("{} (the cache's block size)", spec.block_size),
                )?;
            }
        }
        let num_kv_tokens = match (c.attn_type(), cache) {
            (AttnType::EncoderDecoder, Some(_)) => {
                let enc = metadata.encoder.as_ref();
                let writes = enc.is_some_and(|e| !e.cross_slot_mapping.is_empty());
                writes.then(|| enc.map_or(0, |e| e.cross_slot_mapping.len()))
            }
            (AttnType::EncoderDecoder, None) => Some(metadata.encoder.as_ref().map_or(0, |e| {
                e.encoder_seq_lens.iter().map(|&l| l.max(0) as usize).sum()
            })),
            _ => Some(metadata.num_tokens()),
        };
        metadata.validate(c.attn_type(), metadata.num_tokens(), num_kv_tokens, cache)?;
        let (prepared, workspace_bytes) = prepare(metadata, num_kv_tokens.is_some())?;
        Ok(Plan {
            backend: self.backend,
            shape: PlanShape::of(c),
            metadata: metadata.clone(),
            cache: cache.copied(),
            num_kv_tokens,
            workspace_bytes,
            prepared: Box::new(prepared),
        })
    }

    /// Checks one call against `plan`: the plan's backend and layer shape, every tensor's
    /// device, dtype and shape, the cache's geometry and layout, and the workspace's size.
    pub fn call(
        &self,
        plan: &Plan,
        inputs: &Inputs<'_>,
        output: &Tensor,
        workspace: &Workspace,
    ) -> Result<()> {
        self.check_plan(plan)?;
        let c = self.config;
        let (h, d) = (c.num_heads(), c.head_size());
        let query = inputs.query;
        let t = plan.num_tokens();
        let dtype = query.dtype();
        ensure(
            dtype.is_float(),
            || "query.dtype".into(),
            dtype,
            || "f32, f16 or bf16".into(),
        )?;
        self.capabilities.check_dtype(self.backend, dtype)?;
        for (name, x) in [("query", query), ("output", output)] {
            self.check_tensor(name, x, dtype, &[Some(t), Some(h), Some(d)])?;
        }
        match (inputs.key_value, plan.num_kv_tokens) {
            // Key/value tensors of no tokens are accepted where none are expected: nothing to
            // write either way.
            (Some(kv), Some(_)) => self.check_kv(plan, kv, dtype)?,
            (Some(kv), None) if kv.key.shape().first() == Some(&0) => {
                self.check_kv(plan, kv, dtype)?
            }
            (None, None) | (None, Some(0)) => {}
            (Some(kv), None) => {
                return Err(Error::invalid(
                    "key",
                    format!("a tensor of shape {:?}", kv.key.shape()),
                    "absent: the plan's metadata has no cross_slot_mapping to write them with",
                ))
            }
            (None, Some(tk)) => {
                return Err(Error::invalid(
                    "key",
                    "absent",
                    format!(
                        "[{tk}, {}, {d}] key and value tensors for this plan",
                        c.num_kv_heads()
                    ),
                ))
            }
        }
        match (inputs.cache.as_deref(), plan.cache.is_some()) {
            (Some(cache), true) => self.check_cache(plan, cache, dtype)?,
            (None, false) => {}
            (Some(_), false) => {
                return Err(Error::invalid(
                    "kv_cache",
                    "given",
                    "none: the plan was made without a cache",
                ))
            }
            (None, true) => {
                return Err(Error::invalid(
                    "kv_cache",
                    "absent",
                    "the layer's cache: the plan was made for one",
                ))
            }
        }
        self.check_device("workspace", workspace.device())?;
        ensure(
            workspace.bytes() >= plan.workspace_bytes,
            || "workspace bytes".into(),
            workspace.bytes(),
            || {
                format!(
                    "at least {}: call Workspace::reserve(&plan) before forward",
                    plan.workspace_bytes
                )
            },
        )
    }

    /// Checks a cache write (`AttentionImpl::write_kv`) against `plan`.
    pub fn write(&self, plan: &Plan, kv: KvPair<'_>, cache: &KvCache) -> Result<()> {
        self.check_plan(plan)?;
        ensure(
            plan.num_kv_tokens.is_some(),
            || "key".into(),
            "given",
            || "no write: the plan's metadata has no cross_slot_mapping".into(),
        )?;
        ensure(
            plan.cache.is_some(),
            || "kv_cache".into(),
            "given",
            || "a plan made for a cache".into(),
        )?;
        let dtype = cache.spec().dtype;
        self.check_kv(plan, kv, dtype)?;
        self.check_cache(plan, cache, dtype)
    }

    /// Checks that `plan` was made by this backend for this layer's shape.
    fn check_plan(&self, plan: &Plan) -> Result<()> {
        ensure(
            plan.backend == self.backend,
            || "plan".into(),
            format_args!("a plan of backend {}", plan.backend),
            || format!("a plan made by backend {}", self.backend),
        )?;
        let shape = PlanShape::of(self.config);
        ensure(
            plan.shape == shape,
            || "plan".into(),
            format_args!("a plan for a {}", plan.shape),
            || format!("a plan made for this layer's shape (a {shape})"),
        )
    }

    /// Checks new keys and values: `[Tk, Hkv, D]` of `dtype` on the backend's device.
    fn check_kv(&self, plan: &Plan, kv: KvPair<'_>, dtype: DType) -> Result<()> {
        let tk = plan.num_kv_tokens.unwrap_or(0);
        let c = self.config;
        let shape = [Some(tk), Some(c.num_kv_heads()), Some(c.head_size())];
        self.check_tensor("key", kv.key, dtype, &shape)?;
        self.check_tensor("value", kv.value, dtype, &shape)
    }

    /// Checks a tensor's device, dtype and shape.
    fn check_tensor(
        &self,
        name: &str,
        x: &Tensor,
        dtype: DType,
        shape: &[Option<usize>],
    ) -> Result<()> {
        self.check_device(name, x.device())?;
        ensure(
            x.dtype() == dtype,
            || format!("{name}.dtype"),
            x.dtype(),
            || format!("{dtype} (the query's)"),
        )?;
        check_shape(name, x, shape)
    }

    /// Checks the cache against the plan's geometry, the activation dtype and the backend.
    fn check_cache(&self, plan: &Plan, cache: &KvCache, dtype: DType) -> Result<()> {
        self.check_device("kv_cache", cache.device())?;
        if let Some(spec) = &plan.cache {
            ensure(
                cache.spec() == spec,
                || "kv_cache".into(),
                format_args!("a {}", cache.spec()),
                || format!("a {spec}: the geometry the plan was made for"),
            )?;
        }
        ensure(
            cache.spec().dtype == dtype,
            || "kv_cache.dtype".into(),
            cache.spec().dtype,
            || format!("{dtype} (the query's)"),
        )?;
        ensure(
            cache.layout() == self.layout,
            || "kv_cache.layout".into(),
            cache.layout(),
            || {
                format!(
                    "{}: allocate the cache with backend {}",
                    self.layout, self.backend
                )
            },
        )
    }

    /// Checks a cache geometry against the config and the backend's capabilities.
    fn check_cache_spec(&self, spec: &KvCacheSpec) -> Result<()> {
        let c = self.config;
        for (field, have, want) in [
            ("kv_cache.num_kv_heads", spec.num_kv_heads, c.num_kv_heads()),
            ("kv_cache.head_size", spec.head_size, c.head_size()),
        ] {
            ensure(
                have == want,
                || field.into(),
                have,
                || format!("{want} (the config's)"),
            )?;
        }
        ensure(
            spec.kv_cache_dtype == c.kv_cache_dtype(),
            || "kv_cache.kv_cache_dtype".into(),
            spec.kv_cache_dtype,
            || format!("{} (the config's)", c.kv_cache_dtype()),
        )?;
        self.capabilities.check_cache(self.backend, spec)
    }

    fn check_device(&self, name: &str, device: Device) -> Result<()> {
        if device == self.device {
            Ok(())
        } else {
            Err(Error::device_mismatch(
                name,
                device,
                format!(
                    "{} (backend {}'s device): move it with to_device",
                    self.device, self.backend
                ),
            ))
        }
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
        format_args!("{shape:?}"),
        || format!("[{}]", want.join(", ")),
    )
}
