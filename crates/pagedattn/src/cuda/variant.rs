//! The attention kernels' variants: one NVRTC program per (activation dtype, key/value
//! storage, head size, mask, ALiBi, soft cap), each holding a prefill kernel and three decode
//! kernels (for kv-head groups of 1, up to 4 and up to 8 query heads) instantiated from
//! `kernels/attention.cu`, compiled at the first call that needs it (then cached in the
//! process and on disk like every kernel).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::CudaFunction;

use super::device::{driver_error, Gpu};
use super::kernels::{self, KernelSource, ELEMENTS};
use crate::config::{AttentionConfig, KvCacheDtype};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The head sizes the `cuda` attention kernels are compiled for. A layer with another head
/// size can still write its cache on the GPU; its forward answers
/// [`Error::Unsupported`](crate::Error::Unsupported).
pub const ATTENTION_HEAD_SIZES: [usize; 9] = [32, 64, 80, 96, 112, 120, 128, 192, 256];

/// The template source of every variant.
const ATTENTION: &str = include_str!("../../kernels/attention.cu");

/// Which keys a query may see, as far as the kernel needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Mask {
    /// Non-causal: encoder types and cross attention.
    None,
    /// Causal (decoder).
    Causal,
    /// Causal with a sliding window.
    Window,
}

/// One compiled program of the attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    /// The activation dtype (queries, outputs, and keys and values not stored as fp8).
    pub(crate) dtype: DType,
    /// How keys and values are stored: as `dtype` (`Auto`), or as fp8 codes.
    pub(crate) storage: KvCacheDtype,
    pub(crate) head_size: usize,
    pub(crate) mask: Mask,
    pub(crate) alibi: bool,
    pub(crate) soft_cap: bool,
}

impl Variant {
    /// The variant a forward of `config` with `dtype` activations runs; `cached`: the keys
    /// and values are read from a cache (fp8 storage applies only there). An unsupported head
    /// size is [`Error::Unsupported`].
    pub(crate) fn for_call(config: &AttentionConfig, dtype: DType, cached: bool) -> Result<Self> {
        let head_size = config.head_size();
        if !ATTENTION_HEAD_SIZES.contains(&head_size) {
            let sizes: Vec<String> = ATTENTION_HEAD_SIZES.iter().map(|d| d.to_string()).collect();
            return Err(Error::unsupported(
                "cuda",
                format!(
                    "attention with head size {head_size} (supported: {})",
                    sizes.join(", ")
                ),
            ));
        }
        let mask = match (config.attn_type().is_causal(), config.sliding_window()) {
            (false, _) => Mask::None,
            (true, None) => Mask::Causal,
            (true, Some(_)) => Mask::Window,
        };
        Ok(Variant {
            dtype,
            storage: if cached {
                config.kv_cache_dtype()
            } else {
                KvCacheDtype::Auto
            },
            head_size,
            mask,
            alibi: config.alibi_slopes().is_some(),
            soft_cap: config.logits_soft_cap().is_some(),
        })
    }

    /// Whether every score modifier is on (the window mask, ALiBi and the soft cap): the
    /// variant with the most code of its dtype, storage and head size.
    pub(crate) fn has_every_modifier(&self) -> bool {
        self.mask == Mask::Window && self.alibi && self.soft_cap
    }

    /// Every variant, in a fixed order.
    pub(crate) fn all() -> impl Iterator<Item = Variant> {
        let storages = [
            KvCacheDtype::Auto,
            KvCacheDtype::Fp8E4m3,
            KvCacheDtype::Fp8E5m2,
        ];
        DType::FLOATS.into_iter().flat_map(move |dtype| {
            storages.into_iter().flat_map(move |storage| {
                ATTENTION_HEAD_SIZES.into_iter().flat_map(move |head_size| {
                    [Mask::None, Mask::Causal, Mask::Window]
                        .into_iter()
                        .flat_map(move |mask| {
                            [(false, false), (true, false), (false, true), (true, true)]
                                .into_iter()
                                .map(move |(alibi, soft_cap)| Variant {
                                    dtype,
                                    storage,
                                    head_size,
                                    mask,
                                    alibi,
                                    soft_cap,
                                })
                        })
                })
            })
        })
    }

    /// Whether the prefill runs on the tensor cores (`prefill_mma` in attention.cu): bf16 and
    /// f16 activations whose keys and values are stored as such. Other variants run the
    /// scalar prefill.
    pub(crate) fn tensor_cores(&self) -> bool {
        matches!(self.dtype, DType::BF16 | DType::F16) && self.storage == KvCacheDtype::Auto
    }

    /// The prefill kernel's launch shape: (CTAs per unit, dynamic shared memory in bytes).
    /// The tensor-core kernel runs a unit's [`PREFILL_ROWS`](super::plan::PREFILL_ROWS) rows
    /// in CTAs of [`mma_cta_rows`] on `MmaShape<D>::BYTES` (attention.cu); the scalar kernel
    /// takes [`SCALAR_ROWS`] of them per CTA, in static shared memory.
    pub(crate) fn prefill_shape(&self) -> (u32, u32) {
        if self.tensor_cores() {
            (
                (super::plan::PREFILL_ROWS / mma_cta_rows(self.head_size)) as u32,
                mma_shared_bytes(self.head_size),
            )
        } else {
            ((super::plan::PREFILL_ROWS / SCALAR_ROWS) as u32, 0)
        }
    }

    /// Dynamic shared memory of the decode kernel of `rows` rows (1, 4 or 8):
    /// `DecodeShape<C, D, ROWS>::BYTES` of attention.cu, computed the same way (the kernel
    /// traps if a launch gives less). Each of the 4 warps keeps a ring of chunks of keys and
    /// values staged in flight (about 16 KiB ahead, at most 8 chunks), then its f64
    /// accumulators (rows x D), into which its f32 sums are folded every few chunks.
    pub(crate) fn decode_shared_bytes(&self, rows: usize) -> u32 {
        let stored = match self.storage {
            KvCacheDtype::Auto => self.dtype.size_bytes(),
            KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => 1,
        };
        let d = self.head_size;
        let lanes = (d / 8).next_power_of_two();
        let keys_per_step = 32 / lanes;
        let words = 2 * stored;
        let per_lane = 8.min(32 / words).min(32 / rows).min(32 / keys_per_step);
        let stage = per_lane * 2 * 32 * 4 * words;
        let stages = 8.min(1 + 16384usize.div_ceil(stage));
        let staging = WARPS * stages * stage;
        let outer = WARPS * rows * d * 8;
        (staging + outer) as u32
    }

    /// The program's name, e.g. `attention_bf16_e4m3_d128_causal_alibi`; its kernels are
    /// `<name>_prefill` and `<name>_decode1`, `_decode4`, `_decode8`.
    pub(crate) fn name(&self) -> String {
        let storage = match self.storage {
            KvCacheDtype::Auto => self.dtype.to_string(),
            other => other.to_string().trim_start_matches("fp8_").to_string(),
        };
        let mask = match self.mask {
            Mask::None => "full",
            Mask::Causal => "causal",
            Mask::Window => "window",
        };
        format!(
            "attention_{}_{storage}_d{}_{mask}{}{}",
            self.dtype,
            self.head_size,
            if self.alibi { "_alibi" } else { "" },
            if self.soft_cap { "_softcap" } else { "" },
        )
    }

    /// The program: the element types, the template, and the line instantiating this variant.
    pub(crate) fn source(&self) -> KernelSource {
        let name = self.name();
        let element = match self.dtype {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U8 => unreachable!("activations are floats"),
        };
        let storage = match self.storage {
            KvCacheDtype::Auto => format!("Plain<{element}>"),
            KvCacheDtype::Fp8E4m3 => "E4M3".to_string(),
            KvCacheDtype::Fp8E5m2 => "E5M2".to_string(),
        };
        let mask = match self.mask {
            Mask::None => "MASK_NONE",
            Mask::Causal => "MASK_CAUSAL",
            Mask::Window => "MASK_WINDOW",
        };
        let line = format!(
            "ATTENTION_KERNELS({name}, {element}, {storage}, {}, {mask}, {}, {})\n",
            self.head_size, self.alibi, self.soft_cap
        );
        KernelSource {
            code: [ELEMENTS, ATTENTION, &line].concat(),
            kernels: ["prefill", "decode1", "decode4", "decode8"]
                .iter()
                .map(|k| format!("{name}_{k}"))
                .collect(),
            name,
        }
    }
}

/// Query rows of the scalar prefill's CTAs (`SCALAR_ROWS` in attention.cu).
const SCALAR_ROWS: usize = 16;

/// Row blocks of 16 per warp in the tensor-core prefill for head size `d` (`MmaShape<D>::MT`
/// of attention.cu): two up to D = 128, one above (the accumulators would not fit).
fn mma_row_blocks(d: usize) -> usize {
    if d.div_ceil(16) * 16 <= 128 {
        2
    } else {
        1
    }
}

/// Query rows of one tensor-core prefill CTA for head size `d` (`MmaShape<D>::CTA_ROWS`).
pub(crate) fn mma_cta_rows(d: usize) -> usize {
    16 * WARPS * mma_row_blocks(d)
}

/// Dynamic shared memory of the tensor-core prefill for head size `d`: `MmaShape<D>::BYTES`
/// of attention.cu, computed the same way (the kernel traps if a launch gives less). Two
/// stages of key tiles and two of value tiles (64 keys, or 32 above D = 128; rows of D
/// padded to a multiple of 16, plus 16 bytes), then the query tile and the scratch of the
/// P.V by selects, one row block of each warp at a time (in the query tile's bytes when the
/// query fragments live in registers, in the tile's key stage when that holds it, else
/// after the query tile). The wgmma kernels of sm_90a (D = 120, 128) store the same tiles
/// unpadded, 128-byte swizzled, from a 1 KiB-aligned start: fewer bytes, which this covers.
pub(crate) fn mma_shared_bytes(d: usize) -> u32 {
    let dp = d.div_ceil(16) * 16;
    let keys = if d <= 128 { 64 } else { 32 };
    let row_bytes = (dp + 8) * 2;
    let tile = keys * row_bytes;
    let q_regs = mma_row_blocks(d) * dp <= 128;
    let q = mma_cta_rows(d) * row_bytes;
    let p = WARPS * 16 * keys * 4;
    let scratch = if q_regs {
        q.max(p)
    } else if tile >= p {
        q
    } else {
        q + p
    };
    (4 * tile + scratch) as u32
}

/// Warps of an attention kernel's CTA (`WARPS` in attention.cu).
const WARPS: usize = 4;

/// Rows of the three decode kernels (`_decode1`, `_decode4`, `_decode8`).
const DECODE_KERNEL_ROWS: [usize; 3] = [1, 4, 8];

/// A variant's kernels, loaded on one GPU.
pub(crate) struct AttentionKernels {
    /// Units of several query tokens.
    pub(crate) prefill: CudaFunction,
    /// Units of one query token, for kv-head groups of 1, up to 4 and up to 8 query heads,
    /// each with its dynamic shared memory in bytes.
    decode: [(CudaFunction, u32); 3],
}

impl AttentionKernels {
    /// The decode kernel for units of up to `heads` query heads (at most
    /// [`DECODE_ROWS`](super::plan::DECODE_ROWS)), with its dynamic shared memory: the one
    /// with the fewest rows that hold them, since every row costs the same whether a head
    /// fills it or not.
    pub(crate) fn decode(&self, heads: usize) -> (&CudaFunction, u32) {
        let (f, bytes) = match heads {
            0 | 1 => &self.decode[0],
            2..=4 => &self.decode[1],
            _ => &self.decode[2],
        };
        (f, *bytes)
    }
}

/// Allows `function` `bytes` of dynamic shared memory (above 48 KiB a kernel's must be
/// allowed explicitly).
fn allow_shared(function: &CudaFunction, bytes: u32) -> Result<()> {
    function
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| driver_error("cuFuncSetAttribute(max dynamic shared memory)", e))
}

/// The variants loaded on one GPU so far.
pub(crate) type Loaded = Mutex<HashMap<Variant, Arc<AttentionKernels>>>;

/// `variant`'s kernels on `gpu`: compiled (or read from the caches) and loaded at the first
/// call that needs them. Host work only: nothing waits for the GPU.
pub(crate) fn kernels(gpu: &Gpu, variant: Variant) -> Result<Arc<AttentionKernels>> {
    // Held while compiling, so that two threads never load one variant twice. Nothing panics
    // while it is held, and the map stays valid if something did.
    let mut loaded = gpu.variants.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(k) = loaded.get(&variant) {
        return Ok(k.clone());
    }
    let functions = kernels::load(gpu, &variant.source())?;
    let Ok([prefill, decode1, decode4, decode8]) = <[CudaFunction; 4]>::try_from(functions) else {
        unreachable!("a variant's source names four kernels");
    };
    let (_, shared) = variant.prefill_shape();
    if shared > 0 {
        allow_shared(&prefill, shared)?;
    }
    let decode = [decode1, decode4, decode8]
        .into_iter()
        .zip(DECODE_KERNEL_ROWS)
        .map(|(f, rows)| {
            let bytes = variant.decode_shared_bytes(rows);
            allow_shared(&f, bytes).map(|()| (f, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    let Ok(decode) = <[(CudaFunction, u32); 3]>::try_from(decode) else {
        unreachable!("three decode kernels");
    };
    let k = Arc::new(AttentionKernels { prefill, decode });
    loaded.insert(variant, k.clone());
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AttnType;

    #[test]
    fn every_variant_has_its_own_name() {
        let names: std::collections::HashSet<String> = Variant::all().map(|v| v.name()).collect();
        assert_eq!(names.len(), 3 * 3 * 9 * 3 * 4);
        assert!(names.contains("attention_bf16_e4m3_d128_causal_alibi"));
        assert!(names.contains("attention_f32_f32_d80_full_softcap"));
        assert!(names.contains("attention_f16_e5m2_d256_window_alibi_softcap"));
    }

    #[test]
    fn a_call_picks_its_variant() {
        let config = AttentionConfig::builder(8, 128)
            .num_kv_heads(2)
            .sliding_window(Some(4))
            .kv_cache_dtype(KvCacheDtype::Fp8E4m3)
            .kv_scales(0.5, 2.0)
            .logits_soft_cap(Some(30.0))
            .build()
            .unwrap();
        let v = Variant::for_call(&config, DType::BF16, true).unwrap();
        assert_eq!(v.name(), "attention_bf16_e4m3_d128_window_softcap");
        // Without a cache the keys are the inputs: no fp8.
        let v = Variant::for_call(&config, DType::BF16, false).unwrap();
        assert_eq!(v.storage, KvCacheDtype::Auto);
        let encoder = AttentionConfig::builder(2, 64)
            .attn_type(AttnType::EncoderOnly)
            .build()
            .unwrap();
        assert_eq!(
            Variant::for_call(&encoder, DType::F32, false).unwrap().mask,
            Mask::None
        );
        let odd = AttentionConfig::builder(2, 72).build().unwrap();
        assert!(matches!(
            Variant::for_call(&odd, DType::F16, true),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn the_source_instantiates_the_variant() {
        let v = Variant::all().next().unwrap();
        let source = v.source();
        assert!(source
            .code
            .ends_with("ATTENTION_KERNELS(attention_f32_f32_d32_full, F32, Plain<F32>, 32, MASK_NONE, false, false)\n"));
        assert_eq!(
            source.kernels,
            [
                "attention_f32_f32_d32_full_prefill",
                "attention_f32_f32_d32_full_decode1",
                "attention_f32_f32_d32_full_decode4",
                "attention_f32_f32_d32_full_decode8"
            ]
        );
    }

    #[test]
    fn tensor_cores_for_16_bit_activations_stored_as_such() {
        let bf16 = AttentionConfig::builder(8, 120).build().unwrap();
        let v = Variant::for_call(&bf16, DType::BF16, true).unwrap();
        assert!(v.tensor_cores());
        // D = 120 pads to 128: 4 tiles of 64 x 136 elements, then the query tile (128 rows,
        // 32 per warp); the scratch (4 warps x 16 rows x 64 f32) fits in a key stage.
        assert_eq!(v.prefill_shape(), (1, 4 * 64 * 272 + 128 * 272));
        assert!(!Variant::for_call(&bf16, DType::F32, true)
            .unwrap()
            .tensor_cores());
        let fp8 = AttentionConfig::builder(8, 64)
            .kv_cache_dtype(KvCacheDtype::Fp8E5m2)
            .build()
            .unwrap();
        let v = Variant::for_call(&fp8, DType::F16, true).unwrap();
        // The scalar prefill: a unit's 128 rows in CTAs of 16.
        assert_eq!(v.prefill_shape(), (8, 0));
        // D = 256: tiles of 32 keys, 16 rows per warp, two CTAs per unit; the scratch in a
        // key stage.
        let d256 = AttentionConfig::builder(8, 256).build().unwrap();
        let v = Variant::for_call(&d256, DType::BF16, true).unwrap();
        assert_eq!(v.prefill_shape(), (2, 4 * 32 * 528 + 64 * 528));
        // D = 32: the query fragments in registers; the scratch (4 warps x 16 rows x 64 f32)
        // is larger than the query tile it shares bytes with.
        assert_eq!(mma_shared_bytes(32), 4 * 64 * 80 + 16384);
        // D = 80: a key stage (11 KiB) is too small for the scratch, which follows the query
        // tile. Every head size leaves room for two CTAs per multiprocessor (2 x 113 KiB).
        assert_eq!(mma_shared_bytes(80), 4 * 64 * 176 + 128 * 176 + 16384);
        for d in [32, 64, 80, 96, 112, 120, 128, 192, 256] {
            assert!(mma_shared_bytes(d) <= 113 * 1024, "D = {d}");
        }
        // The wgmma layout (sm_90a, D = 120 and 128): four swizzled 64 x 128 tiles, the
        // 128-row query tile (the scratch in a key stage), 1 KiB of alignment.
        for d in [120, 128] {
            assert!(4 * 64 * 128 * 2 + 128 * 128 * 2 + 1024 <= mma_shared_bytes(d));
        }
    }

    #[test]
    fn decode_rings_hold_16_kib_ahead_per_warp() {
        let variant = |dtype, storage, head_size| {
            let cfg = AttentionConfig::builder(32, head_size)
                .num_kv_heads(8)
                .kv_cache_dtype(storage)
                .build()
                .unwrap();
            Variant::for_call(&cfg, dtype, true).unwrap()
        };
        // After the rings, the warps' f64 accumulators: 4 warps x rows x D.
        let outer = |rows: u32, d: u32| 4 * rows * d * 8;
        // bf16, D = 128: chunks of 2 x 8 keys, 8 KiB of keys and values per warp; three
        // stages (two ahead), four warps.
        let bf16 = variant(DType::BF16, KvCacheDtype::Auto, 128);
        assert_eq!(bf16.decode_shared_bytes(4), 4 * 3 * 8192 + outer(4, 128));
        assert_eq!(bf16.decode_shared_bytes(1), 4 * 3 * 8192 + outer(1, 128));
        // Eight rows: 4 keys per lane, 4 KiB chunks, five stages; 112 KiB in all, so that two
        // CTAs still share an H100's 228 KiB.
        assert_eq!(bf16.decode_shared_bytes(8), 4 * 5 * 4096 + outer(8, 128));
        assert_eq!(bf16.decode_shared_bytes(8), 112 * 1024);
        // fp8, D = 256: 2 KiB chunks, at most eight stages.
        let fp8 = variant(DType::BF16, KvCacheDtype::Fp8E4m3, 256);
        assert_eq!(fp8.decode_shared_bytes(8), 4 * 8 * 2048 + outer(8, 256));
        // f32, D = 256: two 16-byte copies per lane and key.
        let f32 = variant(DType::F32, KvCacheDtype::Auto, 256);
        assert_eq!(f32.decode_shared_bytes(8), 4 * 3 * 8192 + outer(8, 256));
        // Every decode fits the 163 KiB a block may take on an A100 (sm_80), with its
        // static shared memory (under 1 KiB).
        for v in Variant::all() {
            for rows in DECODE_KERNEL_ROWS {
                assert!(v.decode_shared_bytes(rows) <= 162 * 1024, "{}", v.name());
            }
        }
    }
}
