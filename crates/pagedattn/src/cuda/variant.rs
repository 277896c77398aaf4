//! The attention kernels' variants: one NVRTC program per (activation dtype, key/value
//! storage, head size, mask, ALiBi, soft cap), each holding a decode and a prefill kernel
//! instantiated from `kernels/attention.cu`, compiled at the first call that needs it (then
//! cached in the process and on disk like every kernel).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaFunction;

use super::device::Gpu;
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

    /// The program's name, e.g. `attention_bf16_e4m3_d128_causal_alibi`; its kernels are
    /// `<name>_decode` and `<name>_prefill`.
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
            kernels: vec![format!("{name}_decode"), format!("{name}_prefill")],
            name,
        }
    }
}

/// A variant's kernels, loaded on one GPU.
pub(crate) struct AttentionKernels {
    /// Units of one query token.
    pub(crate) decode: CudaFunction,
    /// Units of several query tokens.
    pub(crate) prefill: CudaFunction,
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
    let mut functions = kernels::load(gpu, &variant.source())?;
    let prefill = functions.pop().expect("two kernels");
    let decode = functions.pop().expect("two kernels");
    let k = Arc::new(AttentionKernels { decode, prefill });
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
                "attention_f32_f32_d32_full_decode",
                "attention_f32_f32_d32_full_prefill"
            ]
        );
    }
}
