//! Replay files: one `forward` call captured as a safetensors file (`docs/replay-format.md`),
//! read, run on any backend, and written back with the results.

use std::collections::HashMap;
use std::str::FromStr;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

use crate::backend::Backend;
use crate::config::{AttentionConfig, AttnType, KvCacheDtype};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::{AttentionMetadata, BlockTables, EncoderMetadata};
use crate::step::Inputs;
use crate::tensor::{HostStorage, Tensor};

/// One captured `forward` call, in host memory.
#[derive(Debug, PartialEq)]
pub struct ReplayCase {
    /// The layer config.
    pub config: AttentionConfig,
    /// `[T, H, D]`.
    pub query: Tensor,
    /// New keys and values, `[Tk, Hkv, D]` each (absent at cross-attention decode).
    pub key_value: Option<(Tensor, Tensor)>,
    /// The cache before the call, in the canonical layout.
    pub kv_cache: Option<KvCache>,
    /// The batch.
    pub metadata: AttentionMetadata,
}

/// What a replayed call produced, in host memory.
#[derive(Debug, PartialEq)]
pub struct ReplayOutput {
    /// `[T, H, D]`.
    pub output: Tensor,
    /// The caches after the call, canonical `[NB, B, Hkv, D]` (keys, values).
    pub kv_cache: Option<(Tensor, Tensor)>,
}

fn format_err(msg: impl std::fmt::Display) -> Error {
    Error::Format(format!("malformed safetensors file: {msg}"))
}

/// The file's `__metadata__` strings.
struct Meta(HashMap<String, String>);

impl Meta {
    fn get<T: FromStr>(&self, key: &str, expected: &str) -> Result<Option<T>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => {
                v.trim().parse().map(Some).map_err(|_| {
                    Error::invalid(format!("metadata {key}"), format!("{v:?}"), expected)
                })
            }
        }
    }

    fn require<T: FromStr>(&self, key: &str, expected: &str) -> Result<T> {
        self.get(key, expected)?.ok_or_else(|| {
            Error::Format(format!(
                "metadata key {key} is missing (expected {expected})"
            ))
        })
    }
}

/// The tensors of a file, with typed, shape-checked access.
struct Tensors<'a> {
    st: SafeTensors<'a>,
}

impl Tensors<'_> {
    fn view(&self, name: &str) -> Option<TensorView<'_>> {
        self.st.tensor(name).ok()
    }

    fn check(
        view: &TensorView<'_>,
        name: &str,
        dtypes: &[StDtype],
        shape: &[Option<usize>],
    ) -> Result<()> {
        if !dtypes.contains(&view.dtype()) {
            return Err(Error::invalid(
                format!("tensor {name} dtype"),
                format!("{:?}", view.dtype()),
                format!("{dtypes:?}"),
            ));
        }
        let s = view.shape();
        if s.len() != shape.len() || s.iter().zip(shape).any(|(&a, b)| b.is_some_and(|b| a != b)) {
            let want: Vec<String> = shape
                .iter()
                .map(|d| d.map_or("_".into(), |d| d.to_string()))
                .collect();
            return Err(Error::invalid(
                format!("tensor {name} shape"),
                format!("{s:?}"),
                format!("[{}]", want.join(", ")),
            ));
        }
        Ok(())
    }

    fn float(
        &self,
        name: &str,
        dtypes: &[StDtype],
        shape: &[Option<usize>],
    ) -> Result<Option<Tensor>> {
        let Some(view) = self.view(name) else {
            return Ok(None);
        };
        Self::check(&view, name, dtypes, shape)?;
        let dtype = from_st_dtype(view.dtype()).expect("checked against float dtypes");
        Ok(Some(Tensor::new(
            view.shape().to_vec(),
            HostStorage::from_bytes(dtype, view.data())?,
        )?))
    }

    fn ints<T: bytemuck::Pod>(
        &self,
        name: &str,
        dtype: StDtype,
        shape: &[Option<usize>],
    ) -> Result<Option<(Vec<usize>, Vec<T>)>> {
        let Some(view) = self.view(name) else {
            return Ok(None);
        };
        Self::check(&view, name, &[dtype], shape)?;
        let values = view
            .data()
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect();
        Ok(Some((view.shape().to_vec(), values)))
    }
}

fn from_st_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::U8 => Some(DType::U8),
        _ => None,
    }
}

fn to_st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::U8 => StDtype::U8,
    }
}

fn required<T>(value: Option<T>, name: &str, when: &str) -> Result<T> {
    value.ok_or_else(|| Error::Format(format!("tensor {name} is missing (it is required {when})")))
}

const FLOATS: [StDtype; 3] = [StDtype::F32, StDtype::F16, StDtype::BF16];

/// Parses a replay case. Every malformation is an error naming what is wrong.
pub fn read_case(bytes: &[u8]) -> Result<ReplayCase> {
    check_unique_keys(bytes)?;
    let st = SafeTensors::deserialize(bytes).map_err(format_err)?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(format_err)?;
    let meta = Meta(header.metadata().clone().unwrap_or_default());
    let tensors = Tensors { st };

    let int = "an integer";
    let num = "a number";
    let attn_type: AttnType = meta.require(
        "attn_type",
        "one of decoder, encoder, encoder_only, encoder_decoder",
    )?;
    let h: usize = meta.require("num_heads", int)?;
    let hkv: usize = meta.require("num_kv_heads", int)?;
    let d: usize = meta.require("head_size", int)?;
    let block_size: Option<usize> = meta.get("block_size", int)?;
    let kv_cache_dtype: KvCacheDtype =
        meta.require("kv_cache_dtype", "one of auto, fp8_e4m3, fp8_e5m2")?;
    let num_prefills: usize = meta.require("num_prefills", int)?;
    let k_scale = meta.get("k_scale", num)?.unwrap_or(1.0);
    let v_scale = meta.get("v_scale", num)?.unwrap_or(1.0);

    let query = required(
        tensors.float("query", &FLOATS, &[None, Some(h), Some(d)])?,
        "query",
        "always",
    )?;
    let qd = [to_st_dtype(query.dtype())];
    let t = query.shape()[0];
    let alibi = tensors.float("alibi_slopes", &[StDtype::F32], &[Some(h)])?;
    let config = AttentionConfig::builder(h, d)
        .num_kv_heads(hkv)
        .scale(meta.require("scale", num)?)
        .alibi_slopes(alibi.map(|a| a.to_f32_vec()).transpose()?)
        .sliding_window(meta.get("sliding_window", int)?)
        .logits_soft_cap(meta.get("logits_soft_cap", num)?)
        .kv_cache_dtype(kv_cache_dtype)
        .kv_scales(k_scale, v_scale)
        .attn_type(attn_type)
        .build()?;

    let key = tensors.float("key", &qd, &[None, Some(hkv), Some(d)])?;
    let tk = key.as_ref().map(|k| k.shape()[0]);
    let value = tensors.float("value", &qd, &[tk, Some(hkv), Some(d)])?;
    let key_value = match (key, value) {
        (Some(k), Some(v)) => Some((k, v)),
        (None, None) => None,
        (k, _) => {
            let missing = if k.is_none() { "key" } else { "value" };
            return Err(Error::Format(format!(
                "tensor {missing} is missing: key and value come together"
            )));
        }
    };

    let cache_dtype = [to_st_dtype(match kv_cache_dtype {
        KvCacheDtype::Auto => query.dtype(),
        _ => DType::U8,
    })];
    let key_cache = tensors.float(
        "key_cache",
        &cache_dtype,
        &[None, block_size, Some(hkv), Some(d)],
    )?;
    let cache_dims = key_cache.as_ref().map(|c| (c.shape()[0], c.shape()[1]));
    let value_cache = tensors.float(
        "value_cache",
        &cache_dtype,
        &[
            cache_dims.map(|c| c.0),
            cache_dims.map(|c| c.1),
            Some(hkv),
            Some(d),
        ],
    )?;
    let kv_cache = match (key_cache, value_cache) {
        (Some(k), Some(v)) => {
            let spec = KvCacheSpec {
                num_blocks: k.shape()[0],
                block_size: k.shape()[1],
                num_kv_heads: hkv,
                head_size: d,
                dtype: query.dtype(),
                kv_cache_dtype,
            };
            Some(KvCache::from_canonical(
                spec,
                CacheLayout::Nhd,
                k.host()?.clone(),
                v.host()?.clone(),
            )?)
        }
        (None, None) => None,
        (k, _) => {
            let missing = if k.is_none() {
                "key_cache"
            } else {
                "value_cache"
            };
            return Err(Error::Format(format!(
                "tensor {missing} is missing: key_cache and value_cache come together"
            )));
        }
    };
    let has_cache = kv_cache.is_some();

    let (_, qsl) = required(
        tensors.ints::<i32>("query_start_loc", StDtype::I32, &[None])?,
        "query_start_loc",
        "always",
    )?;
    let s = qsl.len().saturating_sub(1);
    let (_, seq_lens) = required(
        tensors.ints::<i32>("seq_lens", StDtype::I32, &[Some(s)])?,
        "seq_lens",
        "always",
    )?;
    let self_cache = has_cache && attn_type == AttnType::Decoder;
    let slot_mapping = tensors.ints::<i64>("slot_mapping", StDtype::I64, &[Some(t)])?;
    let block_tables = tensors.ints::<i32>("block_tables", StDtype::I32, &[Some(s), None])?;
    let encoder_seq_lens = tensors.ints::<i32>("encoder_seq_lens", StDtype::I32, &[Some(s)])?;
    let cross_block_tables =
        tensors.ints::<i32>("cross_block_tables", StDtype::I32, &[Some(s), None])?;
    let cross_slot_mapping = tensors.ints::<i64>("cross_slot_mapping", StDtype::I64, &[tk])?;
    let cross = attn_type == AttnType::EncoderDecoder;
    let presence = [
        (
            "slot_mapping",
            slot_mapping.is_some(),
            self_cache,
            "with a decoder cache",
        ),
        (
            "block_tables",
            block_tables.is_some(),
            self_cache,
            "with a decoder cache",
        ),
        (
            "encoder_seq_lens",
            encoder_seq_lens.is_some(),
            cross,
            "for encoder_decoder",
        ),
        (
            "cross_block_tables",
            cross_block_tables.is_some(),
            cross && has_cache,
            "for encoder_decoder with a cache",
        ),
        (
            "cross_slot_mapping",
            cross_slot_mapping.is_some(),
            cross && has_cache && key_value.is_some(),
            "for encoder_decoder with a cache and key/value",
        ),
    ];
    for (name, present, wanted, when) in presence {
        if present != wanted {
            let state = if present { "present" } else { "missing" };
            return Err(Error::Format(format!(
                "tensor {name} is {state}: it belongs in a replay file exactly {when}"
            )));
        }
    }
    let known = [
        "query",
        "key",
        "value",
        "key_cache",
        "value_cache",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "alibi_slopes",
        "encoder_seq_lens",
        "cross_block_tables",
        "cross_slot_mapping",
    ];
    if let Some(unknown) = tensors.st.names().into_iter().find(|n| !known.contains(n)) {
        return Err(Error::Format(format!(
            "unknown tensor {unknown} (see docs/replay-format.md for the tensors of a replay file)"
        )));
    }
    let table = |t: Option<(Vec<usize>, Vec<i32>)>| match t {
        Some((shape, data)) => BlockTables::new(shape[0], shape[1], data),
        None => BlockTables::new(s, 0, Vec::new()),
    };
    let encoder = match encoder_seq_lens {
        Some((_, lens)) => Some(EncoderMetadata {
            encoder_seq_lens: lens,
            cross_block_tables: table(cross_block_tables)?,
            cross_slot_mapping: cross_slot_mapping.map(|(_, v)| v).unwrap_or_default(),
        }),
        None => None,
    };
    let mut metadata = AttentionMetadata::from_parts(
        num_prefills,
        qsl,
        seq_lens,
        slot_mapping.map(|(_, v)| v).unwrap_or_default(),
        table(block_tables)?,
        encoder,
    )?;
    metadata.block_size = block_size;
    Ok(ReplayCase {
        config,
        query,
        key_value,
        kv_cache,
        metadata,
    })
}

/// A tensor to serialize: name, dtype, shape, bytes.
type Entry<'a> = (&'static str, TensorView<'a>);

fn entry<'a>(
    name: &'static str,
    dtype: DType,
    shape: &[usize],
    bytes: &'a [u8],
) -> Result<Entry<'a>> {
    let view = TensorView::new(to_st_dtype(dtype), shape.to_vec(), bytes).map_err(format_err)?;
    Ok((name, view))
}

fn int_entry<'a, T: bytemuck::Pod>(
    name: &'static str,
    dtype: StDtype,
    shape: &[usize],
    values: &'a [T],
) -> Result<Entry<'a>> {
    let view =
        TensorView::new(dtype, shape.to_vec(), bytemuck::cast_slice(values)).map_err(format_err)?;
    Ok((name, view))
}

fn serialize(entries: Vec<Entry<'_>>, meta: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    safetensors::serialize(entries, meta).map_err(format_err)
}

/// Serializes a replay case (the inverse of [`read_case`]).
pub fn write_case(case: &ReplayCase) -> Result<Vec<u8>> {
    let c = &case.config;
    let md = &case.metadata;
    let mut meta: HashMap<String, String> = [
        ("attn_type", c.attn_type().to_string()),
        ("num_heads", c.num_heads().to_string()),
        ("num_kv_heads", c.num_kv_heads().to_string()),
        ("head_size", c.head_size().to_string()),
        ("scale", c.scale().to_string()),
        ("num_prefills", md.num_prefills.to_string()),
        ("kv_cache_dtype", c.kv_cache_dtype().to_string()),
        ("k_scale", c.kv_scales().k_scale.to_string()),
        ("v_scale", c.kv_scales().v_scale.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(cache) = &case.kv_cache {
        meta.insert("block_size".into(), cache.spec().block_size.to_string());
    }
    if let Some(w) = c.sliding_window() {
        meta.insert("sliding_window".into(), w.to_string());
    }
    if let Some(cap) = c.logits_soft_cap() {
        meta.insert("logits_soft_cap".into(), cap.to_string());
    }
    let q = &case.query;
    let mut entries = vec![entry("query", q.dtype(), q.shape(), q.host()?.as_bytes())?];
    if let Some((k, v)) = &case.key_value {
        entries.push(entry("key", k.dtype(), k.shape(), k.host()?.as_bytes())?);
        entries.push(entry("value", v.dtype(), v.shape(), v.host()?.as_bytes())?);
    }
    let canonical = case
        .kv_cache
        .as_ref()
        .map(|cache| Ok((cache.spec(), cache.to_canonical()?)))
        .transpose()?;
    if let Some((spec, (k, v))) = &canonical {
        let shape = [
            spec.num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
        ];
        entries.push(entry("key_cache", k.dtype(), &shape, k.as_bytes())?);
        entries.push(entry("value_cache", v.dtype(), &shape, v.as_bytes())?);
    }
    let s = md.num_seqs();
    entries.push(int_entry(
        "query_start_loc",
        StDtype::I32,
        &[s + 1],
        &md.query_start_loc,
    )?);
    entries.push(int_entry("seq_lens", StDtype::I32, &[s], &md.seq_lens)?);
    let has_cache = case.kv_cache.is_some();
    let slopes = c.alibi_slopes().map(<[f32]>::to_vec);
    if let Some(slopes) = &slopes {
        entries.push(int_entry(
            "alibi_slopes",
            StDtype::F32,
            &[slopes.len()],
            slopes,
        )?);
    }
    match (c.attn_type(), has_cache) {
        (AttnType::Decoder, true) => {
            let bt = &md.block_tables;
            entries.push(int_entry(
                "slot_mapping",
                StDtype::I64,
                &[md.slot_mapping.len()],
                &md.slot_mapping,
            )?);
            entries.push(int_entry(
                "block_tables",
                StDtype::I32,
                &[bt.num_rows(), bt.width()],
                bt.as_slice(),
            )?);
        }
        (AttnType::EncoderDecoder, _) => {
            let enc = md.encoder.as_ref().ok_or_else(|| {
                Error::invalid(
                    "metadata.encoder",
                    "none",
                    "encoder metadata for encoder_decoder",
                )
            })?;
            entries.push(int_entry(
                "encoder_seq_lens",
                StDtype::I32,
                &[s],
                &enc.encoder_seq_lens,
            )?);
            if has_cache {
                let bt = &enc.cross_block_tables;
                entries.push(int_entry(
                    "cross_block_tables",
                    StDtype::I32,
                    &[bt.num_rows(), bt.width()],
                    bt.as_slice(),
                )?);
                if case.key_value.is_some() {
                    let sm = &enc.cross_slot_mapping;
                    entries.push(int_entry(
                        "cross_slot_mapping",
                        StDtype::I64,
                        &[sm.len()],
                        sm,
                    )?);
                }
            }
        }
        _ => {}
    }
    serialize(entries, Some(meta))
}

/// Runs a case on `backend`: the tensors and the cache move to the backend's device (the
/// cache in the backend's layout), the call is planned and run, and the output and the cache
/// come back to the host, the cache in the canonical layout. The output starts as NaN, so
/// that an element the backend never writes cannot pass for a result.
pub fn run_case(case: &ReplayCase, backend: &dyn Backend) -> Result<ReplayOutput> {
    let device = backend.device();
    let attention = backend.attention(&case.config)?;
    let mut cache = case
        .kv_cache
        .as_ref()
        .map(|c| backend.load_kv_cache(c))
        .transpose()?;
    let query = case.query.to_device(device)?;
    let key_value = case
        .key_value
        .as_ref()
        .map(|(k, v)| Ok((k.to_device(device)?, v.to_device(device)?)))
        .transpose()?;
    let plan = attention.plan(&case.metadata, cache.as_ref().map(KvCache::spec))?;
    let mut workspace = backend.workspace(&plan)?;
    let mut inputs = Inputs::new(&query).with_cache_opt(cache.as_mut());
    if let Some((k, v)) = &key_value {
        inputs = inputs.with_kv(k, v);
    }
    let mut output = Tensor::zeros_on(device, query.dtype(), query.shape())?;
    output.fill_nan()?;
    attention.forward_into(&plan, &mut workspace, inputs, &mut output)?;
    let output = output.to_host()?;
    let kv_cache = match cache {
        Some(c) => {
            let spec = *c.spec();
            let shape = vec![
                spec.num_blocks,
                spec.block_size,
                spec.num_kv_heads,
                spec.head_size,
            ];
            let (k, v) = c.to_canonical()?;
            Some((Tensor::new(shape.clone(), k)?, Tensor::new(shape, v)?))
        }
        None => None,
    };
    Ok(ReplayOutput { output, kv_cache })
}

/// Serializes a replay result: `output`, and `key_cache` / `value_cache` when a cache was used.
pub fn write_output(out: &ReplayOutput) -> Result<Vec<u8>> {
    let o = &out.output;
    let mut entries = vec![entry("output", o.dtype(), o.shape(), o.host()?.as_bytes())?];
    if let Some((k, v)) = &out.kv_cache {
        entries.push(entry(
            "key_cache",
            k.dtype(),
            k.shape(),
            k.host()?.as_bytes(),
        )?);
        entries.push(entry(
            "value_cache",
            v.dtype(),
            v.shape(),
            v.host()?.as_bytes(),
        )?);
    }
    serialize(entries, None)
}

/// Parses a file written by [`write_output`] (or an expected-result file in the same format).
pub fn read_output(bytes: &[u8]) -> Result<ReplayOutput> {
    check_unique_keys(bytes)?;
    let tensors = Tensors {
        st: SafeTensors::deserialize(bytes).map_err(format_err)?,
    };
    let any_cache = [FLOATS[0], FLOATS[1], FLOATS[2], StDtype::U8];
    let output = required(
        tensors.float("output", &FLOATS, &[None, None, None])?,
        "output",
        "always",
    )?;
    let shape = [None, None, None, None];
    let kv_cache = match (
        tensors.float("key_cache", &any_cache, &shape)?,
        tensors.float("value_cache", &any_cache, &shape)?,
    ) {
        (Some(k), Some(v)) => Some((k, v)),
        (None, None) => None,
        _ => {
            return Err(Error::invalid(
                "tensor key_cache / value_cache",
                "one missing",
                "both or neither",
            ))
        }
    };
    Ok(ReplayOutput { output, kv_cache })
}

/// Refuses a safetensors file whose JSON header repeats a key in any object (the tensor names,
/// a tensor's fields, `__metadata__`): the safetensors reader would keep the last silently.
fn check_unique_keys(bytes: &[u8]) -> Result<()> {
    use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

    /// Walks any JSON value, failing on a repeated key.
    struct Unique;

    impl<'de> DeserializeSeed<'de> for Unique {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Unique {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                map.next_value_seed(Unique)?;
                if !seen.insert(key.clone()) {
                    return Err(A::Error::custom(format!("the key {key:?} appears twice")));
                }
            }
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
            while seq.next_element_seed(Unique)?.is_some() {}
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> std::result::Result<(), E> {
            Ok(())
        }
    }

    // The header: its length as a little-endian u64, then that many bytes of JSON. A file
    // too short for it is left to the safetensors reader to report.
    let Some(len) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    else {
        return Ok(());
    };
    let Some(header) = usize::try_from(len)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
    else {
        return Ok(());
    };
    let mut json = serde_json::Deserializer::from_slice(header);
    match Unique.deserialize(&mut json) {
        Err(e) if e.is_data() => Err(format_err(format!("header: {e}"))),
        _ => Ok(()),
    }
}
