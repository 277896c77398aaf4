//! The paged KV cache: its geometry, layouts, the write of new tokens through a slot mapping,
//! fp8 quantization, and block swap / copy.
//!
//! A slot is `block * block_size + offset`. Every layout keeps a block contiguous (block-major),
//! so swapping and copying move whole blocks as one byte range whatever the layout inside.

use std::fmt;

use crate::config::{AttentionConfig, KvCacheDtype};
use crate::dtype::{DType, Element};
use rayon::prelude::*;

use crate::device::Device;
use crate::error::{ensure, Error, Result};
use crate::fp8::Fp8Format;
use crate::metadata::AttentionMetadata;
use crate::semantics::KeyMap;
use crate::shared::SharedMut;
use crate::step::{ForwardCheck, KvPair, Plan};
use crate::tensor::{try_collect, HostSliceMut, HostStorage, Storage, Tensor};

/// A block's index in a cache: the entries of block tables and of swap and copy pairs. `i32`,
/// as vLLM's block tables and the tables the kernels read; a valid id is in `[0, num_blocks)`.
pub type BlockId = i32;

/// Dequantization scales of an fp8 cache (vLLM's `k_scale`, `v_scale`); 1.0 for other caches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    /// Keys are stored as `k / k_scale` and read as `code * k_scale`.
    pub k_scale: f32,
    /// Values are stored as `v / v_scale` and read as `code * v_scale`.
    pub v_scale: f32,
}

impl KvScales {
    /// Both scales 1.0: what every cache that is not fp8 has.
    pub const ONE: KvScales = KvScales {
        k_scale: 1.0,
        v_scale: 1.0,
    };

    /// Checks the scales for a cache of `dtype`: finite and positive, and exactly 1.0 unless
    /// the cache is fp8 (a scale that would be ignored is an error, not a silent no-op).
    pub fn validate(&self, dtype: KvCacheDtype) -> Result<()> {
        for (field, s) in [("k_scale", self.k_scale), ("v_scale", self.v_scale)] {
            ensure(
                s.is_finite() && s > 0.0,
                || field.into(),
                s,
                || "a finite number > 0".into(),
            )?;
            ensure(
                dtype.fp8_format().is_some() || s == 1.0,
                || field.into(),
                s,
                || "1.0: scales apply only to fp8 KV caches".into(),
            )?;
        }
        Ok(())
    }
}

/// The geometry and element type of one layer's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Number of blocks (NB).
    pub num_blocks: usize,
    /// Tokens per block (B).
    pub block_size: usize,
    /// Number of kv heads (Hkv).
    pub num_kv_heads: usize,
    /// Head size (D).
    pub head_size: usize,
    /// The activation dtype of the keys and values written into it.
    pub dtype: DType,
    /// How elements are stored (the activation dtype, or fp8).
    pub kv_cache_dtype: KvCacheDtype,
}

impl KvCacheSpec {
    /// The dtype of the stored elements: the activation dtype, or U8 for fp8.
    pub fn storage_dtype(&self) -> DType {
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => self.dtype,
            _ => DType::U8,
        }
    }

    /// The same geometry and dtypes with `num_blocks` blocks: the spec of a swap space (or of
    /// any other cache whose blocks a swap or copy moves to and from this one's).
    pub fn with_num_blocks(self, num_blocks: usize) -> KvCacheSpec {
        KvCacheSpec { num_blocks, ..self }
    }

    /// Number of token slots (NB * B).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Elements in one block of the key (or value) buffer: B * Hkv * D.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_size
    }

    /// Bytes of one block of the key (or value) buffer, as stored
    /// ([`storage_dtype`](Self::storage_dtype)).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.storage_dtype().size_bytes()
    }

    /// Elements in the key (or value) buffer.
    pub fn buffer_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Checks that the geometry is non-degenerate and the dtype is a float type.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("block_size", self.block_size),
            ("num_kv_heads", self.num_kv_heads),
            ("head_size", self.head_size),
        ] {
            ensure(
                v > 0,
                || format!("kv_cache.{field}"),
                v,
                || "a positive integer".into(),
            )?;
        }
        ensure(
            self.dtype.is_float(),
            || "kv_cache.dtype".into(),
            self.dtype,
            || "f32, f16 or bf16".into(),
        )?;
        // The block first: with no blocks the cache is empty, but a block's size must still
        // be a number (`block_elems` and every offset inside a block are computed from it).
        let block_bytes = [self.num_kv_heads, self.head_size]
            .iter()
            .try_fold(self.block_size, |n, &f| n.checked_mul(f))
            .and_then(|n| n.checked_mul(self.storage_dtype().size_bytes()))
            .filter(|&n| n <= isize::MAX as usize);
        ensure(
            block_bytes.is_some(),
            || "kv_cache.block_size".into(),
            self.block_size,
            || "a block whose size in bytes (B * Hkv * D * element size) fits in isize".into(),
        )?;
        let bytes = block_bytes
            .and_then(|b| b.checked_mul(self.num_blocks))
            .filter(|&n| n <= isize::MAX as usize);
        ensure(
            bytes.is_some(),
            || "kv_cache.num_blocks".into(),
            self.num_blocks,
            || "a cache whose size in bytes fits in isize".into(),
        )
    }
}

impl fmt::Display for KvCacheSpec {
    /// One phrase, e.g. `cache spec of 16 blocks of 16 slots, 8 kv heads, head size 128, bf16`
    /// (`bf16 stored as fp8_e4m3` for an fp8 cache): what error messages show of a spec.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural =
            |n: usize, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        write!(
            f,
            "cache spec of {} {} of {} {}, {} kv {}, head size {}, {}",
            self.num_blocks,
            plural(self.num_blocks, "block", "blocks"),
            self.block_size,
            plural(self.block_size, "slot", "slots"),
            self.num_kv_heads,
            plural(self.num_kv_heads, "head", "heads"),
            self.head_size,
            self.dtype,
        )?;
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => Ok(()),
            stored => write!(f, " stored as {stored}"),
        }
    }
}

/// How one block's elements are ordered inside the key and value buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheLayout {
    /// `[NB, B, Hkv, D]`, token-major: the canonical layout (also the replay file's).
    Nhd,
    /// `[NB, Hkv, B, D]`, head-major: one kv head's keys of a block are contiguous, so a kernel
    /// that walks one kv head streams `B * D` contiguous elements per block.
    Hnd,
}

impl fmt::Display for CacheLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheLayout::Nhd => "Nhd",
            CacheLayout::Hnd => "Hnd",
        })
    }
}

impl CacheLayout {
    /// The cache's shape: `[2, NB, B, Hkv, D]` or `[2, NB, Hkv, B, D]` (index 0 of the first
    /// axis holds keys, 1 holds values).
    pub fn shape(self, spec: &KvCacheSpec) -> Vec<usize> {
        let (nb, b, h, d) = (
            spec.num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
        );
        match self {
            CacheLayout::Nhd => vec![2, nb, b, h, d],
            CacheLayout::Hnd => vec![2, nb, h, b, d],
        }
    }

    /// Index of element `d = 0` of (`slot`, `head`) in a key or value buffer.
    pub fn row_start(self, spec: &KvCacheSpec, slot: usize, head: usize) -> usize {
        let (b, h, d) = (spec.block_size, spec.num_kv_heads, spec.head_size);
        let (block, offset) = (slot / b, slot % b);
        match self {
            CacheLayout::Nhd => ((block * b + offset) * h + head) * d,
            CacheLayout::Hnd => ((block * h + head) * b + offset) * d,
        }
    }
}

/// One layer's paged KV cache: two buffers (keys, values) in a backend's layout, on the
/// backend's device.
#[derive(Debug, PartialEq)]
pub struct KvCache {
    spec: KvCacheSpec,
    layout: CacheLayout,
    key: Storage,
    value: Storage,
}

impl KvCache {
    /// A zero-filled cache in host memory.
    pub fn zeros(spec: KvCacheSpec, layout: CacheLayout) -> Result<Self> {
        spec.validate()?;
        let n = spec.buffer_elems();
        Ok(KvCache {
            spec,
            layout,
            key: HostStorage::zeros(spec.storage_dtype(), n)?.into(),
            value: HostStorage::zeros(spec.storage_dtype(), n)?.into(),
        })
    }

    /// A zero-filled cache on `device`.
    pub fn zeros_on(device: Device, spec: KvCacheSpec, layout: CacheLayout) -> Result<Self> {
        spec.validate()?;
        let n = spec.buffer_elems();
        Ok(KvCache {
            spec,
            layout,
            key: Storage::zeros(device, spec.storage_dtype(), n)?,
            value: Storage::zeros(device, spec.storage_dtype(), n)?,
        })
    }

    /// A host cache in `layout` from key and value buffers in the canonical `[NB, B, Hkv, D]`
    /// layout.
    pub fn from_canonical(
        spec: KvCacheSpec,
        layout: CacheLayout,
        key: HostStorage,
        value: HostStorage,
    ) -> Result<Self> {
        KvCache::from_storages(spec, CacheLayout::Nhd, key.into(), value.into())?.to_layout(layout)
    }

    /// A cache made of two buffers already in `layout`, on one device: how memory another
    /// library owns (see [`HostBuffer::from_external`](crate::HostBuffer::from_external))
    /// becomes a cache without a copy. Each buffer holds `NB * B * Hkv * D` elements of the
    /// spec's storage dtype.
    pub fn from_storages(
        spec: KvCacheSpec,
        layout: CacheLayout,
        key: Storage,
        value: Storage,
    ) -> Result<Self> {
        spec.validate()?;
        for (field, buf) in [("key_cache", &key), ("value_cache", &value)] {
            ensure(
                buf.dtype() == spec.storage_dtype(),
                || format!("{field} dtype"),
                buf.dtype(),
                || {
                    format!(
                        "{} for kv_cache_dtype {}",
                        spec.storage_dtype(),
                        spec.kv_cache_dtype
                    )
                },
            )?;
            ensure(
                buf.len() == spec.buffer_elems(),
                || format!("{field} element count"),
                buf.len(),
                || format!("{} (= NB * B * Hkv * D)", spec.buffer_elems()),
            )?;
        }
        ensure(
            key.device() == value.device(),
            || "value_cache device".into(),
            value.device(),
            || format!("{} (the key cache's)", key.device()),
        )?;
        Ok(KvCache {
            spec,
            layout,
            key,
            value,
        })
    }

    /// The key and value buffers in the canonical `[NB, B, Hkv, D]` layout, in host memory
    /// (copied from the device first if the cache lives on one).
    pub fn to_canonical(&self) -> Result<(HostStorage, HostStorage)> {
        let c = self.to_device(Device::Cpu)?.to_layout(CacheLayout::Nhd)?;
        Ok((
            c.key.into_host("kv_cache.key")?,
            c.value.into_host("kv_cache.value")?,
        ))
    }

    /// A copy of this cache on its own device.
    pub fn try_clone(&self) -> Result<KvCache> {
        self.to_device(self.device())
    }

    /// A copy of this cache on `device`, in the same layout.
    pub fn to_device(&self, device: Device) -> Result<KvCache> {
        Ok(KvCache {
            spec: self.spec,
            layout: self.layout,
            key: self.key.to_device(device)?,
            value: self.value.to_device(device)?,
        })
    }

    /// The same host cache in another layout.
    pub fn to_layout(&self, layout: CacheLayout) -> Result<KvCache> {
        let spec = &self.spec;
        let row_bytes = spec.head_size * spec.storage_dtype().size_bytes();
        let relayout = |src: &Storage, what: &str| -> Result<Storage> {
            let src = src.host(what)?;
            if layout == self.layout {
                return Ok(src.try_clone()?.into());
            }
            let mut dst = HostStorage::zeros(src.dtype(), src.len())?;
            let (s, d) = (src.as_bytes(), dst.as_bytes_mut());
            for slot in 0..spec.num_slots() {
                for head in 0..spec.num_kv_heads {
                    let from = self.layout.row_start(spec, slot, head) * row_bytes / spec.head_size;
                    let to = layout.row_start(spec, slot, head) * row_bytes / spec.head_size;
                    d[to..to + row_bytes].copy_from_slice(&s[from..from + row_bytes]);
                }
            }
            Ok(dst.into())
        };
        Ok(KvCache {
            spec: self.spec,
            layout,
            key: relayout(&self.key, "kv_cache.key")?,
            value: relayout(&self.value, "kv_cache.value")?,
        })
    }

    /// The geometry and dtypes.
    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }
    /// The element order inside a block.
    pub fn layout(&self) -> CacheLayout {
        self.layout
    }
    /// Where the buffers live.
    pub fn device(&self) -> Device {
        self.key.device()
    }
    /// The shape in this cache's layout.
    pub fn shape(&self) -> Vec<usize> {
        self.layout.shape(&self.spec)
    }
    /// The key buffer, in this cache's layout.
    pub fn key(&self) -> &Storage {
        &self.key
    }
    /// The value buffer, in this cache's layout.
    pub fn value(&self) -> &Storage {
        &self.value
    }
    /// Both buffers, mutably (keys, values), for the backends: never public, because a
    /// caller could put buffers of another length, dtype or device in their place (see
    /// [`HostSliceMut`]).
    #[cfg(feature = "cuda")]
    pub(crate) fn buffers_mut(&mut self) -> (&mut Storage, &mut Storage) {
        (&mut self.key, &mut self.value)
    }
    /// Both host buffers (keys, values), or [`Error::DeviceMismatch`].
    pub fn host_buffers(&self) -> Result<(&HostStorage, &HostStorage)> {
        Ok((
            self.key.host("kv_cache.key")?,
            self.value.host("kv_cache.value")?,
        ))
    }
    /// Both host buffers (keys, values), writable in place: slices whose length and type
    /// cannot change, or [`Error::DeviceMismatch`].
    pub fn host_buffers_mut(&mut self) -> Result<(HostSliceMut<'_>, HostSliceMut<'_>)> {
        Ok((
            self.key.host_mut("kv_cache.key")?.view_mut(),
            self.value.host_mut("kv_cache.value")?.view_mut(),
        ))
    }
    /// Index of element `d = 0` of (`slot`, `head`) in either buffer.
    pub fn row_start(&self, slot: usize, head: usize) -> usize {
        self.layout.row_start(&self.spec, slot, head)
    }

    /// Checks that `key`/`value` are `[Tk, Hkv, D]` tensors of the cache's activation dtype and
    /// that every slot is -1 or inside the cache. `field` names the slot mapping in errors.
    pub fn check_write(
        &self,
        key: &Tensor,
        value: &Tensor,
        slot_mapping: &[i64],
        field: &str,
    ) -> Result<()> {
        let spec = &self.spec;
        for (name, t) in [("key", key), ("value", value)] {
            ensure(
                t.dtype() == spec.dtype,
                || format!("{name}.dtype"),
                t.dtype(),
                || format!("{} (the KV cache's dtype)", spec.dtype),
            )?;
            let shape = t.shape();
            ensure(
                shape.len() == 3 && shape[1..] == [spec.num_kv_heads, spec.head_size],
                || format!("{name}.shape"),
                format_args!("{shape:?}"),
                || {
                    format!(
                        "[Tk, {}, {}] (num_kv_heads, head_size)",
                        spec.num_kv_heads, spec.head_size
                    )
                },
            )?;
        }
        ensure(
            key.shape()[0] == value.shape()[0],
            || "value.shape[0]".into(),
            value.shape()[0],
            || format!("key.shape[0] = {}", key.shape()[0]),
        )?;
        ensure(
            slot_mapping.len() == key.shape()[0],
            || format!("{field}.len()"),
            slot_mapping.len(),
            || format!("the number of key tokens, {}", key.shape()[0]),
        )?;
        for (t, &slot) in slot_mapping.iter().enumerate() {
            ensure(
                slot == -1 || (slot >= 0 && (slot as u64) < spec.num_slots() as u64),
                || format!("{field}[{t}]"),
                slot,
                || {
                    format!(
                        "-1 or a slot in [0, {}) (num_blocks * block_size)",
                        spec.num_slots()
                    )
                },
            )?;
        }
        // Tokens are written in parallel: two tokens may not share a slot.
        check_distinct_slots(slot_mapping, field)
    }

    /// Writes token `t` of `key`/`value` ([Tk, Hkv, D]) to slot `slot_mapping[t]` of this
    /// host cache, tokens in parallel; slot -1 is skipped, and two tokens may not share a slot.
    /// fp8 caches store `encode(x / k_scale)` (resp. `v_scale`), see [`Fp8Format`].
    pub fn write(
        &mut self,
        key: &Tensor,
        value: &Tensor,
        slot_mapping: &[i64],
        scales: KvScales,
    ) -> Result<()> {
        self.check_write(key, value, slot_mapping, "slot_mapping")?;
        scales.validate(self.spec.kv_cache_dtype)?;
        self.write_checked(key, value, slot_mapping, scales)
    }

    /// [`KvCache::write`] for input already checked by `check_write` (a forward's gate).
    pub(crate) fn write_checked(
        &mut self,
        key: &Tensor,
        value: &Tensor,
        slot_mapping: &[i64],
        scales: KvScales,
    ) -> Result<()> {
        let fp8 = self.spec.kv_cache_dtype.fp8_format();
        let (spec, layout) = (self.spec, self.layout);
        let (key_buf, value_buf) = self.host_buffers_mut()?;
        for (src, dst, scale) in [
            (key.storage().host("key")?, key_buf, scales.k_scale),
            (value.storage().host("value")?, value_buf, scales.v_scale),
        ] {
            crate::with_element!(spec.dtype, T => {
                let src = src.as_slice::<T>().ok_or_else(|| {
                    Error::invalid("key.dtype", src.dtype(), format!("{} (the cache's)", spec.dtype))
                })?;
                write_tokens(&spec, layout, src, dst, slot_mapping, fp8, scale);
            });
        }
        Ok(())
    }

    /// Both host buffers decoded to f64 in this cache's layout (fp8 codes times their scale):
    /// what an attention kernel reads. Slots never written decode to whatever they hold.
    pub fn dequantize(&self, scales: KvScales) -> Result<(Vec<f64>, Vec<f64>)> {
        let fp8 = self.spec.kv_cache_dtype.fp8_format();
        let decode = |buf: &HostStorage, scale: f32| match (buf, fp8) {
            (HostStorage::U8(codes), Some(f)) => try_collect(
                codes.len(),
                codes.iter().map(|&c| f.decode(c) as f64 * scale as f64),
            ),
            _ => buf.to_f64_vec(),
        };
        let (key, value) = self.host_buffers()?;
        Ok((decode(key, scales.k_scale)?, decode(value, scales.v_scale)?))
    }
}

/// Checks that no two tokens of `slot_mapping` write the same slot (-1 excepted).
pub(crate) fn check_distinct_slots(slot_mapping: &[i64], field: &str) -> Result<()> {
    let mut written: Vec<(i64, usize)> = slot_mapping
        .iter()
        .enumerate()
        .filter(|&(_, &slot)| slot >= 0)
        .map(|(t, &slot)| (slot, t))
        .collect();
    written.sort_unstable();
    match written.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(Error::invalid(
            format!("{field}[{}]", w[1].1),
            w[1].0,
            format!(
                "a slot no other token writes (token {} writes it too)",
                w[0].1
            ),
        )),
        None => Ok(()),
    }
}

/// Stores each token row of `src` at its slot in `dst`, quantizing to fp8 if asked; tokens in
/// parallel (their slots are distinct, checked by `check_write`, so their rows are disjoint).
fn write_tokens<T: Element>(
    spec: &KvCacheSpec,
    layout: CacheLayout,
    src: &[T],
    dst: HostSliceMut<'_>,
    slot_mapping: &[i64],
    fp8: Option<Fp8Format>,
    scale: f32,
) {
    let (d, hkv) = (spec.head_size, spec.num_kv_heads);
    let rows = |t: usize, slot: i64| {
        (0..hkv).map(move |h| {
            (
                &src[(t * hkv + h) * d..][..d],
                layout.row_start(spec, slot as usize, h),
            )
        })
    };
    // Runs `store(row, at)` for every row of every written token, tokens in parallel.
    let for_each_row = |store: &(dyn Fn(&[T], usize) + Sync)| {
        slot_mapping
            .par_iter()
            .enumerate()
            .filter(|(_, &slot)| slot >= 0)
            .for_each(|(t, &slot)| rows(t, slot).for_each(|(row, at)| store(row, at)));
    };
    match (dst, fp8) {
        (HostSliceMut::U8(out), Some(format)) => {
            let out = SharedMut(out.as_mut_ptr());
            for_each_row(&|row, at| {
                for (i, &x) in row.iter().enumerate() {
                    // SAFETY: distinct slots own distinct rows of the buffer.
                    unsafe { *out.ptr().add(at + i) = format.encode(x.to_f32() / scale) };
                }
            });
        }
        (dst, _) => {
            let out = SharedMut(
                dst.into_slice::<T>()
                    .expect("auto cache has the input dtype")
                    .as_mut_ptr(),
            );
            for_each_row(&|row, at| {
                // SAFETY: distinct slots own distinct rows of the buffer.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.ptr().add(at), d) };
            });
        }
    }
}

/// Checks a list of (source block, destination block) pairs against two block counts and
/// returns them as indices: an id that is negative or past its cache is an error naming it.
pub(crate) fn check_pairs(
    pairs: &[(BlockId, BlockId)],
    src_blocks: usize,
    dst_blocks: usize,
) -> Result<Vec<(usize, usize)>> {
    let index = |i: usize, side: &str, id: BlockId, blocks: usize| {
        usize::try_from(id)
            .ok()
            .filter(|&b| b < blocks)
            .ok_or_else(|| {
                Error::invalid(
                    format!("pairs[{i}].{side}"),
                    id,
                    format!("a block in [0, {blocks})"),
                )
            })
    };
    pairs
        .iter()
        .enumerate()
        .map(|(i, &(s, d))| {
            Ok((
                index(i, "src", s, src_blocks)?,
                index(i, "dst", d, dst_blocks)?,
            ))
        })
        .collect()
}

/// Checks a swap: same block geometry, dtype and layout, pairs in range, distinct destinations;
/// returns the pairs as indices.
pub(crate) fn check_swap(
    src: &KvCache,
    dst: &KvCache,
    pairs: &[(BlockId, BlockId)],
) -> Result<Vec<(usize, usize)>> {
    let (a, b) = (src.spec, dst.spec);
    ensure(
        (
            a.block_size,
            a.num_kv_heads,
            a.head_size,
            a.dtype,
            a.kv_cache_dtype,
        ) == (
            b.block_size,
            b.num_kv_heads,
            b.head_size,
            b.dtype,
            b.kv_cache_dtype,
        ) && src.layout == dst.layout,
        || "dst cache".into(),
        format!("a {b} in layout {}", dst.layout),
        || {
            format!(
                "the source's block geometry, dtype and layout (a {a} in layout {})",
                src.layout
            )
        },
    )?;
    let indices = check_pairs(pairs, a.num_blocks, b.num_blocks)?;
    let mut seen = vec![false; b.num_blocks];
    for (i, &(_, d)) in indices.iter().enumerate() {
        ensure(
            !std::mem::replace(&mut seen[d], true),
            || format!("pairs[{i}].dst"),
            d,
            || "a block not already a destination of this swap".into(),
        )?;
    }
    Ok(indices)
}

/// Copies whole blocks between two host caches (vLLM's `swap_blocks`), `(src block, dst
/// block)` pairs. Both caches must have the same block geometry, dtype and layout; their block
/// counts may differ; each destination block appears once. Backends wrap it as
/// [`Backend::swap_out`](crate::Backend::swap_out) and
/// [`Backend::swap_in`](crate::Backend::swap_in), over every layer.
pub fn swap_blocks(src: &KvCache, dst: &mut KvCache, pairs: &[(BlockId, BlockId)]) -> Result<()> {
    let pairs = check_swap(src, dst, pairs)?;
    let block_bytes = src.spec.block_elems() * src.spec.storage_dtype().size_bytes();
    // Destinations are distinct, so each destination block has at most one source.
    let mut source_of = vec![None; dst.spec.num_blocks];
    for (sb, db) in pairs {
        source_of[db] = Some(sb);
    }
    let (src_key, src_value) = src.host_buffers()?;
    let (dst_key, dst_value) = dst.host_buffers_mut()?;
    for (from, to) in [(src_key, dst_key), (src_value, dst_value)] {
        let s = from.as_bytes();
        to.into_bytes()
            .par_chunks_mut(block_bytes)
            .zip(&source_of)
            .for_each(|(block, source)| {
                if let Some(sb) = *source {
                    block.copy_from_slice(&s[sb * block_bytes..][..block_bytes]);
                }
            });
    }
    Ok(())
}

/// Copies block `src` to block `dst` inside every layer's host cache, keys and values, pair by
/// pair in order (vLLM's `copy_blocks`, used for copy-on-write); the layers in parallel.
pub fn copy_blocks(caches: &mut [KvCache], pairs: &[(BlockId, BlockId)]) -> Result<()> {
    // Every layer is checked before any is written: a refused copy changes nothing. The
    // indices are the same numbers for every layer; each layer's check bounds them by its own
    // block count.
    let mut indices = Vec::new();
    for cache in caches.iter() {
        indices = check_pairs(pairs, cache.spec.num_blocks, cache.spec.num_blocks)?;
        cache.host_buffers()?;
    }
    caches.par_iter_mut().for_each(|cache| {
        let block_bytes = cache.spec.block_elems() * cache.spec.storage_dtype().size_bytes();
        let (key, value) = cache
            .host_buffers_mut()
            .expect("checked above: host buffers");
        for buf in [key, value] {
            let bytes = buf.into_bytes();
            for &(s, d) in &indices {
                bytes.copy_within(s * block_bytes..(s + 1) * block_bytes, d * block_bytes);
            }
        }
    });
    Ok(())
}

/// The slot mapping new keys and values are written through: the cross slot mapping for
/// encoder-decoder, the slot mapping otherwise.
pub(crate) fn write_slots<'m>(
    config: &AttentionConfig,
    metadata: &'m AttentionMetadata,
) -> &'m [i64] {
    // The contract's rule (`KeyMap`), which does not depend on the cache's geometry.
    KeyMap::new(metadata, config.attn_type(), None, true).slot_mapping()
}

/// `AttentionImpl::write_kv` of the host backends: the gate, then the host cache write.
pub(crate) fn write_kv_checked(
    gate: &ForwardCheck<'_>,
    plan: &Plan,
    kv: KvPair<'_>,
    cache: &mut KvCache,
) -> Result<()> {
    gate.write(plan, kv, cache)?;
    let slots = write_slots(gate.config, plan.metadata());
    cache.write_checked(kv.key, kv.value, slots, gate.config.kv_scales())
}
