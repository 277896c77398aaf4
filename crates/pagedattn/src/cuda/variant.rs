//! The attention kernels' variants: per (activation dtype, key/value storage, head size,
//! mask, ALiBi, soft cap) and architecture a prefill kernel and three decode kernels (for
//! kv-head groups of 1, up to 4 and up to 8 query heads), each its own NVRTC program so that
//! the four compile side by side, at the first call that needs the variant (then cached in
//! the process and on disk like every kernel).
//!
//! A program is assembled from the pieces in `kernels/attention/` (one file per piece: the
//! variant's hooks, the paged-KV loader, the softmax, each architecture family's tensor-core
//! steps, the mainloops, the epilogue, the decode), after the declarations the host shares
//! with them (`abi.rs`) and before what this module generates: each kernel family's shape
//! (threads come from `abi.rs`; rows, tiles and shared-memory layout from [`MmaShape`],
//! [`ScalarShape`] and [`DecodeShape`], which the launches use too) and the entry points.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::CudaFunction;

use super::abi::{self, Mask, DECODE_KERNEL_ROWS, DECODE_ROWS, PREFILL_ROWS, WARPS};
use super::compile;
use super::device::{driver_error, Gpu};
use super::kernels::{self, KernelSource, ELEMENTS};
use crate::config::{AttentionConfig, KvCacheDtype};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The head sizes the `cuda` attention kernels are compiled for (the backend's capabilities:
/// a layer of another head size is [`Error::Unsupported`](crate::Error::Unsupported)).
pub const ATTENTION_HEAD_SIZES: [usize; 9] = [32, 64, 80, 96, 112, 120, 128, 192, 256];

/// The pieces of an attention program, in the order they are compiled (each file says what
/// it holds). The prefill's pieces are those of its kernel family.
mod pieces {
    pub(super) const PTX: &str = include_str!("../../kernels/attention/ptx.cuh");
    pub(super) const SOFTMAX: &str = include_str!("../../kernels/attention/softmax.cuh");
    pub(super) const VARIANT: &str = include_str!("../../kernels/attention/variant.cuh");
    pub(super) const PAGED_KV: &str = include_str!("../../kernels/attention/paged_kv.cuh");
    pub(super) const PREFILL_SCALAR: &str =
        include_str!("../../kernels/attention/prefill_scalar.cuh");
    pub(super) const TENSOR_CORE_SM80: &str =
        include_str!("../../kernels/attention/tensor_core_sm80.cuh");
    pub(super) const TENSOR_CORE_SM90: &str =
        include_str!("../../kernels/attention/tensor_core_sm90.cuh");
    pub(super) const EPILOGUE: &str = include_str!("../../kernels/attention/epilogue.cuh");
    pub(super) const PREFILL_MMA: &str = include_str!("../../kernels/attention/prefill_mma.cuh");
    pub(super) const PREFILL_SM90: &str = include_str!("../../kernels/attention/prefill_sm90.cuh");
    pub(super) const DECODE_MERGE: &str = include_str!("../../kernels/attention/decode_merge.cuh");
    pub(super) const DECODE: &str = include_str!("../../kernels/attention/decode.cuh");
    pub(super) const DECODE_MMA: &str = include_str!("../../kernels/attention/decode_mma.cuh");
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

    /// Whether the prefill runs on the tensor cores (`prefill_mma.cuh`, or on sm_90a from
    /// D = 64 on `prefill_sm90.cuh`): bf16 and f16 activations, their keys and values stored
    /// as such or as fp8 codes (widened into the activation type in shared memory). f32
    /// activations run the scalar prefill.
    pub(crate) fn tensor_cores(&self) -> bool {
        matches!(self.dtype, DType::BF16 | DType::F16)
    }

    /// The prefill's shape on `arch`: the tensor cores' (see [`Variant::tensor_cores`]) or
    /// the scalar kernel's.
    pub(crate) fn prefill(&self, arch: &str) -> PrefillShape {
        if self.tensor_cores() && arch == "sm_90a" && self.head_size >= 64 {
            PrefillShape::Sm90(Sm90Shape::new(self.head_size))
        } else if self.tensor_cores() {
            PrefillShape::Mma(MmaShape::new(self.head_size))
        } else {
            PrefillShape::Scalar(ScalarShape::new(self.head_size))
        }
    }

    /// Bytes of a stored key or value element.
    fn stored_bytes(&self) -> usize {
        match self.storage {
            KvCacheDtype::Auto => self.dtype.size_bytes(),
            KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => 1,
        }
    }

    /// The decode kernel's shape for `rows` rows (1, 4 or 8): on the tensor cores
    /// (`decode_mma.cuh`) for bf16 and f16 activations where its rings fit two CTAs per
    /// multiprocessor, else on the CUDA cores (`decode.cuh`).
    pub(crate) fn decode(&self, rows: usize) -> DecodeKernel {
        let stored = self.stored_bytes();
        if matches!(self.dtype, DType::BF16 | DType::F16) {
            let scale_q = self.dtype == DType::BF16 && stored == 1;
            if let Some(shape) = DecodeMmaShape::new(stored, self.head_size, rows, scale_q) {
                return DecodeKernel::Mma(shape);
            }
        }
        DecodeKernel::Cuda(DecodeShape::new(stored, self.head_size, rows))
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

    /// The variant's programs for `arch`, one per kernel (so that NVRTC, which compiles a
    /// program on one thread, compiles them side by side): the prefill, then one decode per
    /// [`DECODE_KERNEL_ROWS`] entry. Each holds the element types, the shared declarations,
    /// its kernel family's pieces, then the variant's hooks, the kernel's shape and its entry
    /// point; the program is named as its kernel.
    pub(crate) fn sources(&self, arch: &str) -> Vec<KernelSource> {
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
        let header = abi::header();
        let common = [
            ELEMENTS,
            &header,
            pieces::PTX,
            pieces::SOFTMAX,
            pieces::VARIANT,
            pieces::PAGED_KV,
        ];
        // One program: the shared pieces and `pieces`, the variant's hooks, the kernel's shape
        // (the struct `shape` declares) and its entry point, which calls `call` with `threads`
        // per CTA (one CTA per multiprocessor where the kernel reallocates registers between
        // its warpgroups).
        let program = |pieces: &[&str], kernel: &str, shape: String, threads: u32, call: &str| {
            let kernel = format!("{name}_{kernel}");
            let code = format!(
                "\n// Generated by src/cuda/variant.rs for {kernel} on {arch}.\n\
                 typedef Variant<{}, {}, {}> V;\n{shape}\
                 extern \"C\" __global__ void __launch_bounds__({threads}, 1) {kernel}(const Params p) {{\n    {call}(p);\n}}\n",
                self.mask.c_name(),
                self.alibi,
                self.soft_cap
            );
            KernelSource {
                code: [&common[..], pieces, &[code.as_str()]].concat().concat(),
                kernels: vec![kernel.clone()],
                name: kernel,
            }
        };
        let prefill = self.prefill(arch);
        let (prefill_pieces, call): (&[&str], String) = match prefill {
            PrefillShape::Mma(_) => (
                &[
                    pieces::TENSOR_CORE_SM80,
                    pieces::EPILOGUE,
                    pieces::PREFILL_MMA,
                ],
                format!(
                    "prefill_mma<{element}, {storage}, V, PrefillShape, MmaSync<{element}, \
                     PrefillShape>>"
                ),
            ),
            PrefillShape::Sm90(_) => (
                &[
                    pieces::TENSOR_CORE_SM80,
                    pieces::TENSOR_CORE_SM90,
                    pieces::EPILOGUE,
                    pieces::PREFILL_SM90,
                ],
                format!("prefill_sm90<{element}, {storage}, V, PrefillShape>"),
            ),
            PrefillShape::Scalar(_) => (
                &[pieces::PREFILL_SCALAR],
                format!("prefill_scalar<{element}, {storage}, V, PrefillShape>"),
            ),
        };
        let mut sources = vec![program(
            prefill_pieces,
            "prefill",
            prefill.cuda("PrefillShape"),
            prefill.launch().1,
            &call,
        )];
        for rows in DECODE_KERNEL_ROWS {
            let decode = self.decode(rows);
            let (decode_pieces, call): (&[&str], String) = match decode {
                DecodeKernel::Cuda(_) => (
                    &[pieces::DECODE_MERGE, pieces::DECODE],
                    format!("decode<{element}, {storage}, V, DecodeShape>"),
                ),
                // fp8 codes convert into f16 for the tensor cores.
                DecodeKernel::Mma(_) => (
                    &[
                        pieces::TENSOR_CORE_SM80,
                        pieces::DECODE_MERGE,
                        pieces::DECODE_MMA,
                    ],
                    format!(
                        "decode_mma<{element}, {storage}, {}, V, DecodeShape>",
                        if self.storage == KvCacheDtype::Auto {
                            element
                        } else {
                            "F16"
                        }
                    ),
                ),
            };
            sources.push(program(
                decode_pieces,
                &format!("decode{rows}"),
                decode.cuda("DecodeShape"),
                abi::THREADS,
                &call,
            ));
        }
        sources
    }
}

/// A CUDA struct of compile-time constants: `struct NAME { static constexpr int A = 1; ... };`
fn constants(name: &str, ints: &[(&str, usize)], flags: &[(&str, bool)]) -> String {
    let mut s = format!("struct {name} {{\n");
    for (field, value) in ints {
        s += &format!("    static constexpr int {field} = {value};\n");
    }
    for (field, value) in flags {
        s += &format!("    static constexpr bool {field} = {value};\n");
    }
    s + "};\n"
}

/// A prefill kernel's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefillShape {
    /// The tensor-core kernel of mma.sync (`prefill_mma.cuh`).
    Mma(MmaShape),
    /// Hopper's warp-specialized wgmma kernel (`prefill_sm90.cuh`).
    Sm90(Sm90Shape),
    /// The scalar kernel (`prefill_scalar.cuh`).
    Scalar(ScalarShape),
}

impl PrefillShape {
    /// CTAs per unit (a unit's [`PREFILL_ROWS`] rows, CTA by CTA), threads per CTA and
    /// dynamic shared memory in bytes.
    pub(crate) fn launch(&self) -> (u32, u32, u32) {
        let (cta_rows, threads, bytes) = match self {
            PrefillShape::Mma(s) => (s.cta_rows, abi::THREADS, s.bytes),
            PrefillShape::Sm90(s) => (Sm90Shape::CTA_ROWS, Sm90Shape::THREADS, s.bytes),
            PrefillShape::Scalar(s) => (s.rows, abi::THREADS, 0),
        };
        ((PREFILL_ROWS / cta_rows) as u32, threads, bytes as u32)
    }

    /// The shape as a CUDA struct of constants.
    fn cuda(&self, name: &str) -> String {
        match self {
            PrefillShape::Mma(s) => s.cuda(name),
            PrefillShape::Sm90(s) => s.cuda(name),
            PrefillShape::Scalar(s) => s.cuda(name),
        }
    }
}

/// The Hopper prefill's shape and shared-memory layout (`S` of `prefill_sm90.cuh`, which says
/// what each field means): a producer warpgroup and two consumer warpgroups of 64 rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sm90Shape {
    d: usize,
    /// D padded to a multiple of 64 (the swizzle atom).
    dp: usize,
    /// Keys per tile: 128, or 64 above D = 128 (the accumulators: O of DP and S of KT
    /// columns per 64 rows).
    kt: usize,
    /// Tiles in each of the key and value rings: as many as shared memory holds, up to 4.
    stages: usize,
    q_bytes: usize,
    tile_bytes: usize,
    /// Per consumer warp: 16 rows of P as elements, for the P.V by selects.
    scratch_bytes: usize,
    /// Where the zero slab starts (after the rings and the scratch).
    zero_at: usize,
    bytes: usize,
}

impl Sm90Shape {
    /// Threads: three warpgroups.
    const THREADS: u32 = 384;
    /// Rows per CTA: 64 per consumer warpgroup.
    const CTA_ROWS: usize = 128;
    /// Registers per thread of the producer and of the consumers (`setmaxnreg`): together
    /// what one CTA of 384 threads holds (64 K registers).
    const PRODUCER_REGS: usize = 40;
    const CONSUMER_REGS: usize = 232;
    const ALIGN: usize = 1024;
    /// Zeros, the values of the dummy multiplications: 16 rows of 128 columns.
    const ZERO_SLAB: usize = 4096;
    /// Shared memory a CTA may take on sm_90 (227 KiB), less 8 KiB for the static arrays.
    const SHARED: usize = 227 * 1024 - 8 * 1024;

    /// The shape for head size `d`.
    pub(crate) fn new(d: usize) -> Self {
        let dp = d.div_ceil(64) * 64;
        let kt = if dp <= 128 { 128 } else { 64 };
        let q_bytes = Self::CTA_ROWS * dp * 2;
        let tile_bytes = kt * dp * 2;
        let scratch_bytes = 16 * kt * 2;
        // The query tile, the warps' scratch, the zero slab, the alignment's slack.
        let fixed = q_bytes + 8 * scratch_bytes + Self::ZERO_SLAB + (Self::ALIGN - 16);
        let stages = ((Self::SHARED - fixed) / (2 * tile_bytes)).min(4);
        Sm90Shape {
            d,
            dp,
            kt,
            stages,
            q_bytes,
            tile_bytes,
            scratch_bytes,
            zero_at: q_bytes + 2 * stages * tile_bytes + 8 * scratch_bytes,
            bytes: fixed + 2 * stages * tile_bytes,
        }
    }

    fn cuda(&self, name: &str) -> String {
        constants(
            name,
            &[
                ("D", self.d),
                ("DP", self.dp),
                ("KT", self.kt),
                ("STAGES", self.stages),
                ("THREADS", Self::THREADS as usize),
                ("CTA_ROWS", Self::CTA_ROWS),
                ("PRODUCER_REGS", Self::PRODUCER_REGS),
                ("CONSUMER_REGS", Self::CONSUMER_REGS),
                ("Q_BYTES", self.q_bytes),
                ("TILE_BYTES", self.tile_bytes),
                ("SCRATCH_BYTES", self.scratch_bytes),
                ("ZERO_AT", self.zero_at),
                ("ZERO_BYTES", Self::ZERO_SLAB),
                ("ALIGN", Self::ALIGN),
                ("BYTES", self.bytes),
            ],
            &[],
        )
    }
}

/// The mma.sync prefill's shape and shared-memory layout (`S` of `prefill_mma.cuh`, which
/// says what each field means).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmaShape {
    d: usize,
    /// D padded to a multiple of 16.
    dp: usize,
    /// Row blocks of 16 per warp: two up to D = 128, one above (the accumulators would not
    /// fit).
    mt: usize,
    cta_rows: usize,
    /// Keys per tile: 64, or 32 above D = 128.
    kt: usize,
    /// Tile rows padded by 16 bytes (ldmatrix without bank conflicts).
    row_bytes: usize,
    tile_bytes: usize,
    /// The query fragments live in registers (up to 128 columns of rows per warp).
    q_regs: bool,
    q_bytes: usize,
    /// The P.V by selects' scratch: 16 rows of P as elements per warp.
    p_bytes: usize,
    scratch_in_keys: bool,
    scratch: usize,
    /// Dynamic shared memory: four tiles (two stages of keys, two of values), the query tile
    /// and the scratch.
    bytes: usize,
}

impl MmaShape {
    /// The shape for head size `d`.
    pub(crate) fn new(d: usize) -> Self {
        let dp = d.div_ceil(16) * 16;
        let mt = if dp <= 128 { 2 } else { 1 };
        let cta_rows = 16 * WARPS * mt;
        let kt = if d <= 128 { 64 } else { 32 };
        let row_bytes = (dp + 8) * 2;
        let tile_bytes = kt * row_bytes;
        let q_regs = mt * dp <= 128;
        let q_bytes = cta_rows * row_bytes;
        let p_bytes = WARPS * 16 * kt * 2;
        let scratch_in_keys = !q_regs && tile_bytes >= p_bytes;
        let scratch = if q_regs {
            q_bytes.max(p_bytes)
        } else if scratch_in_keys {
            q_bytes
        } else {
            q_bytes + p_bytes
        };
        MmaShape {
            d,
            dp,
            mt,
            cta_rows,
            kt,
            row_bytes,
            tile_bytes,
            q_regs,
            q_bytes,
            p_bytes,
            scratch_in_keys,
            scratch,
            bytes: 4 * tile_bytes + scratch,
        }
    }

    fn cuda(&self, name: &str) -> String {
        constants(
            name,
            &[
                ("D", self.d),
                ("DP", self.dp),
                ("MT", self.mt),
                ("CTA_ROWS", self.cta_rows),
                ("KT", self.kt),
                ("ROW_BYTES", self.row_bytes),
                ("TILE_BYTES", self.tile_bytes),
                ("Q_BYTES", self.q_bytes),
                ("P_BYTES", self.p_bytes),
                ("SCRATCH", self.scratch),
                ("BYTES", self.bytes),
            ],
            &[
                ("Q_REGS", self.q_regs),
                ("SCRATCH_IN_KEYS", self.scratch_in_keys),
            ],
        )
    }
}

/// The scalar prefill's shape (`S` of `prefill_scalar.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScalarShape {
    d: usize,
    /// Rows per CTA.
    rows: usize,
    /// Keys per tile: the most of 32, 16, 8, 4 whose f32 tiles fit in 44 KiB of static
    /// shared memory.
    kt: usize,
}

impl ScalarShape {
    const ROWS: usize = 16;

    /// The shape for head size `d`.
    pub(crate) fn new(d: usize) -> Self {
        let rows = Self::ROWS;
        // Queries, keys (rows padded by one float), values, probabilities.
        let floats = |keys: usize| rows * d + keys * (d + 1) + keys * d + rows * keys;
        let kt = [32, 16, 8]
            .into_iter()
            .find(|&keys| floats(keys) * 4 <= 44 * 1024)
            .unwrap_or(4);
        ScalarShape { d, rows, kt }
    }

    fn cuda(&self, name: &str) -> String {
        constants(
            name,
            &[("D", self.d), ("ROWS", self.rows), ("KT", self.kt)],
            &[],
        )
    }
}

/// A decode kernel's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeKernel {
    /// The tensor-core decode (`decode_mma.cuh`).
    Mma(DecodeMmaShape),
    /// The CUDA-core decode (`decode.cuh`).
    Cuda(DecodeShape),
}

impl DecodeKernel {
    /// Dynamic shared memory in bytes.
    pub(crate) fn bytes(&self) -> u32 {
        match self {
            DecodeKernel::Mma(s) => s.bytes as u32,
            DecodeKernel::Cuda(s) => s.bytes as u32,
        }
    }

    /// The shape as a CUDA struct of constants.
    fn cuda(&self, name: &str) -> String {
        match self {
            DecodeKernel::Mma(s) => s.cuda(name),
            DecodeKernel::Cuda(s) => s.cuda(name),
        }
    }
}

/// Dynamic shared memory a decode may take: two CTAs per multiprocessor share an H100's
/// 228 KiB (less 1 KiB reserved per CTA and their static shared memory), as the split of
/// long decodes assumes.
const DECODE_SHARED: usize = 112 * 1024;

/// Tiles in each warp's ring of the tensor-core decode. Two (one tile in flight a warp while
/// it computes another: 64 KiB an SM at D = 128) read as fast as three on an H200 in bf16 and
/// 1.4% faster with fp8 codes (bench/results/cuda-2026-11-30-session39.md): the decode is
/// bound by what the memory system delivers, not by the bytes asked for ahead.
const DECODE_MMA_STAGES: usize = 2;

/// The tensor-core decode's shape (`S` of `decode_mma.cuh`, which says what each field means).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodeMmaShape {
    d: usize,
    dp: usize,
    rows: usize,
    /// Keys per tile: 32 where a row takes at most 128 bytes, else 16 (the mma's rows).
    kt: usize,
    stored: usize,
    row_bytes: usize,
    copy: usize,
    cpr: usize,
    tile_bytes: usize,
    staging: usize,
    /// Tiles between folds of a warp's f32 state into its f64 one: 128 keys.
    fold: usize,
    swizzle: bool,
    scale_q: bool,
    /// The rings, then the warps' f64 accumulators (rows x D each).
    bytes: usize,
}

impl DecodeMmaShape {
    /// The shape for keys and values stored in `stored` bytes per element, head size `d`,
    /// `rows` rows, the queries scaled into f16 (`scale_q`: bf16 queries, fp8 codes); `None`
    /// where two stages with [`DECODE_ROWS`] rows do not fit [`DECODE_SHARED`]
    /// (the variant's every decode then runs on the CUDA cores).
    fn new(stored: usize, d: usize, rows: usize, scale_q: bool) -> Option<Self> {
        let dp = d.next_multiple_of(16);
        let kt = if d * stored <= 128 { 32 } else { 16 };
        // Swizzled rows of a multiple of 8 16-byte units, else an odd number of units, past
        // the padding.
        let swizzle = (d * stored).is_multiple_of(128);
        let units = dp * stored / 16 + 1;
        let row_bytes = if swizzle {
            d * stored
        } else {
            16 * (units + 1 - units % 2)
        };
        let copy = if (d * stored).is_multiple_of(16) {
            16
        } else {
            8
        };
        let tile_bytes = kt * row_bytes;
        let ring = WARPS * DECODE_MMA_STAGES * 2 * tile_bytes;
        let outer = |rows: usize| WARPS * rows * d * 8;
        if ring + outer(DECODE_ROWS) > DECODE_SHARED {
            return None;
        }
        Some(DecodeMmaShape {
            d,
            dp,
            rows,
            kt,
            stored,
            row_bytes,
            copy,
            cpr: d * stored / copy,
            tile_bytes,
            staging: ring,
            fold: 128 / kt,
            swizzle,
            scale_q,
            bytes: ring + outer(rows),
        })
    }

    fn cuda(&self, name: &str) -> String {
        constants(
            name,
            &[
                ("D", self.d),
                ("DP", self.dp),
                ("ROWS", self.rows),
                ("KT", self.kt),
                ("STORED", self.stored),
                ("ROW_BYTES", self.row_bytes),
                ("COPY", self.copy),
                ("CPR", self.cpr),
                ("TILE_BYTES", self.tile_bytes),
                ("STAGE_BYTES", 2 * self.tile_bytes),
                ("STAGES", DECODE_MMA_STAGES),
                ("STAGING", self.staging),
                ("FOLD", self.fold),
                ("BYTES", self.bytes),
            ],
            &[("SWIZZLE", self.swizzle), ("SCALE_Q", self.scale_q)],
        )
    }
}

/// The CUDA-core decode's shape (`S` of `decode.cuh`, which says what each field means).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodeShape {
    d: usize,
    rows: usize,
    ch: usize,
    lanes: usize,
    kpw: usize,
    /// Words of 8 stored elements.
    w: usize,
    /// Keys per lane and chunk: the scores s[U][ROWS] live in registers.
    u: usize,
    chunk: usize,
    copy: usize,
    copies: usize,
    piece: usize,
    stage_bytes: usize,
    /// Chunks in a warp's ring: about 16 KiB of loads in flight per warp, at most 8 chunks.
    stages: usize,
    staging: usize,
    /// Chunks between folds of a warp's f32 state into its f64 one: 128 keys per lane's sum.
    fold: usize,
    /// The rings, then the warps' f64 accumulators (rows x D each).
    bytes: usize,
}

impl DecodeShape {
    /// The shape for keys and values stored in `stored` bytes per element, head size `d`,
    /// `rows` rows.
    pub(crate) fn new(stored: usize, d: usize, rows: usize) -> Self {
        let ch = d / 8;
        let lanes = ch.next_power_of_two();
        let kpw = 32 / lanes;
        let w = 2 * stored;
        let u = 8.min(32 / w).min(32 / rows).min(32 / kpw);
        let copy = 16.min(4 * w);
        let copies = 4 * w / copy;
        let piece = 32 * copy;
        let stage_bytes = u * 2 * copies * piece;
        let stages = 8.min(1 + 16384usize.div_ceil(stage_bytes));
        let staging = WARPS * stages * stage_bytes;
        DecodeShape {
            d,
            rows,
            ch,
            lanes,
            kpw,
            w,
            u,
            chunk: kpw * u,
            copy,
            copies,
            piece,
            stage_bytes,
            stages,
            staging,
            fold: 128 / u,
            bytes: staging + WARPS * rows * d * 8,
        }
    }

    fn cuda(&self, name: &str) -> String {
        constants(
            name,
            &[
                ("D", self.d),
                ("ROWS", self.rows),
                ("CH", self.ch),
                ("LANES", self.lanes),
                ("KPW", self.kpw),
                ("W", self.w),
                ("U", self.u),
                ("CHUNK", self.chunk),
                ("COPY", self.copy),
                ("COPIES", self.copies),
                ("PIECE", self.piece),
                ("STAGE_BYTES", self.stage_bytes),
                ("STAGES", self.stages),
                ("STAGING", self.staging),
                ("FOLD", self.fold),
                ("BYTES", self.bytes),
            ],
            &[],
        )
    }
}

/// A variant's kernels, loaded on one GPU.
pub(crate) struct AttentionKernels {
    /// Units of several query tokens.
    pub(crate) prefill: CudaFunction,
    /// Its CTAs per unit, threads per CTA and dynamic shared memory in bytes.
    pub(crate) prefill_launch: (u32, u32, u32),
    /// Units of one query token, for kv-head groups of 1, up to 4 and up to 8 query heads,
    /// each with its dynamic shared memory in bytes.
    decode: [(CudaFunction, u32); 3],
}

impl AttentionKernels {
    /// The decode kernel for units of up to `heads` query heads (at most
    /// [`DECODE_ROWS`](super::abi::DECODE_ROWS)), with its dynamic shared memory: the one
    /// with the fewest rows that hold them, since every row costs the same whether a head
    /// fills it or not.
    pub(crate) fn decode(&self, heads: usize) -> (&CudaFunction, u32) {
        let fits = DECODE_KERNEL_ROWS.iter().position(|&rows| heads <= rows);
        let (f, bytes) = &self.decode[fits.unwrap_or(DECODE_KERNEL_ROWS.len() - 1)];
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
/// call that needs them, the variant's programs side by side, with the GPU's fixed kernels
/// where they are not loaded yet (a first call needs those too). Every kernel of the variant,
/// not only those the call launches: a variant used once outside a graph capture can then be
/// captured (a module load inside a capture fails), and the compilations run in parallel, so
/// a first call waits for about the slowest one alone. Host work only: nothing waits for the
/// GPU.
pub(crate) fn kernels(gpu: &Gpu, variant: Variant) -> Result<Arc<AttentionKernels>> {
    // Held while compiling, so that two threads never load one variant twice. Nothing panics
    // while it is held, and the map stays valid if something did.
    let mut loaded = gpu.variants.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(k) = loaded.get(&variant) {
        return Ok(k.clone());
    }
    let mut sources = variant.sources(&gpu.arch);
    let own = sources.len();
    if !gpu.fixed_kernels_loaded() {
        sources.extend_from_slice(kernels::fixed_sources());
    }
    compile::images(&sources, &gpu.arch)?;
    // The prefill, then one decode per DECODE_KERNEL_ROWS entry (`Variant::sources`).
    let mut functions = sources[..own]
        .iter()
        .map(|source| kernels::load(gpu, source))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten();
    let Some(prefill) = functions.next() else {
        unreachable!("a variant's sources name its prefill first");
    };
    let prefill_launch = variant.prefill(&gpu.arch).launch();
    if prefill_launch.2 > 0 {
        allow_shared(&prefill, prefill_launch.2)?;
    }
    let decode = functions
        .zip(DECODE_KERNEL_ROWS)
        .map(|(f, rows)| {
            let bytes = variant.decode(rows).bytes();
            allow_shared(&f, bytes).map(|()| (f, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    let Ok(decode) = <[(CudaFunction, u32); 3]>::try_from(decode) else {
        unreachable!("three decode kernels");
    };
    let k = Arc::new(AttentionKernels {
        prefill,
        prefill_launch,
        decode,
    });
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
    fn the_sources_instantiate_the_variant() {
        let v = Variant::all().next().unwrap();
        let sources = v.sources("sm_80");
        let names: Vec<&str> = sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "attention_f32_f32_d32_full_prefill",
                "attention_f32_f32_d32_full_decode1",
                "attention_f32_f32_d32_full_decode4",
                "attention_f32_f32_d32_full_decode8"
            ]
        );
        for source in &sources {
            // One kernel per program, named as the program.
            assert_eq!(source.kernels, std::slice::from_ref(&source.name));
            assert!(source
                .code
                .contains("typedef Variant<MASK_NONE, false, false> V;"));
        }
        assert!(sources[0].code.contains(
            "attention_f32_f32_d32_full_prefill(const Params p) {\n    \
             prefill_scalar<F32, Plain<F32>, V, PrefillShape>(p);"
        ));
        // A decode's program holds the decode alone, with its own shape.
        let decode8 = &sources[3].code;
        assert!(decode8.contains("decode<F32, Plain<F32>, V, DecodeShape>(p);"));
        assert!(decode8.contains("static constexpr int ROWS = 8;"));
        assert!(!decode8.contains("void prefill_scalar(") && !decode8.contains("PrefillShape"));
        assert!(!sources[0].code.contains("void decode("));
        // The Hopper prefill and its wgmma steps join on sm_90a from D = 64, and only there.
        let bf16 = |d| {
            let config = AttentionConfig::builder(8, d).build().unwrap();
            Variant::for_call(&config, DType::BF16, true).unwrap()
        };
        let prefill = |d, arch| bf16(d).sources(arch).swap_remove(0).code;
        let hopper = prefill(128, "sm_90a");
        assert!(hopper.contains("prefill_sm90<BF16, Plain<BF16>, V, PrefillShape>(p);"));
        assert!(
            hopper.contains("__launch_bounds__(384, 1) attention_bf16_bf16_d128_causal_prefill")
        );
        assert!(hopper.contains("PAGEDATTN_WGMMA(BF16") && !hopper.contains("void prefill_mma("));
        assert!(!prefill(128, "sm_80").contains("PAGEDATTN_WGMMA(BF16"));
        assert!(!prefill(32, "sm_90a").contains("PAGEDATTN_WGMMA(BF16"));
        assert!(prefill(32, "sm_90a").contains(
            "prefill_mma<BF16, Plain<BF16>, V, PrefillShape, MmaSync<BF16, PrefillShape>>(p);"
        ));
        // bf16 decodes run on the tensor cores (fp8 codes as f16), but for D = 256.
        let decode4 = |d| bf16(d).sources("sm_80").swap_remove(2).code;
        assert!(decode4(128).contains("decode_mma<BF16, Plain<BF16>, BF16, V, DecodeShape>(p);"));
        assert!(decode4(256).contains("decode<BF16, Plain<BF16>, V, DecodeShape>(p);"));
        let fp8 = AttentionConfig::builder(8, 64)
            .kv_cache_dtype(KvCacheDtype::Fp8E4m3)
            .build()
            .unwrap();
        let fp8 = Variant::for_call(&fp8, DType::BF16, true).unwrap();
        assert!(fp8.sources("sm_90a")[3]
            .code
            .contains("decode_mma<BF16, E4M3, F16, V, DecodeShape>(p);"));
    }

    #[test]
    fn tensor_cores_for_16_bit_activations() {
        let bf16 = AttentionConfig::builder(8, 120).build().unwrap();
        let v = Variant::for_call(&bf16, DType::BF16, true).unwrap();
        assert!(v.tensor_cores());
        // D = 120 pads to 128: 4 tiles of 64 x 136 elements, then the query tile (128 rows,
        // 32 per warp); the scratch (4 warps x 16 rows x 64 elements) fits in a key stage.
        assert_eq!(
            v.prefill("sm_80").launch(),
            (1, 128, 4 * 64 * 272 + 128 * 272)
        );
        // On sm_90a the warp-specialized kernel: D pads to 128, tiles of 128 keys; the query
        // tile, two stages of key and value tiles, 8 warps' scratch of 16 x 128 elements, the
        // zero slab, 1 KiB of alignment less the 16 any start has.
        assert_eq!(
            v.prefill("sm_90a").launch(),
            (
                1,
                384,
                128 * 128 * 2 + 4 * 128 * 128 * 2 + 8 * 16 * 128 * 2 + 4096 + 1008
            )
        );
        // D = 64: tiles of 64 columns, four stages.
        assert_eq!(Sm90Shape::new(64).stages, 4);
        // D = 256: tiles of 64 keys, two stages (208 KiB with the rest).
        let d256 = Sm90Shape::new(256);
        assert_eq!((d256.kt, d256.stages), (64, 2));
        for d in ATTENTION_HEAD_SIZES.into_iter().filter(|&d| d >= 64) {
            let s = Sm90Shape::new(d);
            assert!(s.stages >= 2 && s.bytes <= Sm90Shape::SHARED, "D = {d}");
        }
        assert!(!Variant::for_call(&bf16, DType::F32, true)
            .unwrap()
            .tensor_cores());
        let fp8 = AttentionConfig::builder(8, 64)
            .kv_cache_dtype(KvCacheDtype::Fp8E5m2)
            .build()
            .unwrap();
        let v = Variant::for_call(&fp8, DType::F16, true).unwrap();
        // fp8 codes widen into f16 in the tensor-core prefills' stages.
        assert!(v.tensor_cores());
        assert_eq!(v.prefill("sm_90a"), PrefillShape::Sm90(Sm90Shape::new(64)));
        assert!(v.sources("sm_90a")[0]
            .code
            .contains("prefill_sm90<F16, E5M2, V, PrefillShape>(p);"));
        assert!(v.sources("sm_80")[0]
            .code
            .contains("prefill_mma<F16, E5M2, V, PrefillShape, MmaSync<F16, PrefillShape>>(p);"));
        // f32 activations: the scalar prefill, a unit's 128 rows in CTAs of 16, tiles of 32
        // keys.
        let v = Variant::for_call(&fp8, DType::F32, true).unwrap();
        assert_eq!(v.prefill("sm_90a").launch(), (8, 128, 0));
        assert_eq!(ScalarShape::new(64).kt, 32);
        // D = 256: the f32 tiles of 16 keys would take 49 KiB; 8 keys take 33 KiB.
        assert_eq!(ScalarShape::new(256).kt, 8);
        // D = 256: tiles of 32 keys, 16 rows per warp, two CTAs per unit; the scratch in a
        // key stage.
        let d256 = AttentionConfig::builder(8, 256).build().unwrap();
        let v = Variant::for_call(&d256, DType::BF16, true).unwrap();
        assert_eq!(
            v.prefill("sm_80").launch(),
            (2, 128, 4 * 32 * 528 + 64 * 528)
        );
        // D = 32: the query fragments in registers; the scratch (4 warps x 16 rows x 64
        // elements) fits in the query tile's bytes.
        assert_eq!(MmaShape::new(32).bytes, 4 * 64 * 80 + 128 * 80);
        // D = 80: a key stage (11 KiB) holds the scratch (8 KiB). Every head size leaves room
        // for two CTAs per multiprocessor (2 x 113 KiB).
        assert_eq!(MmaShape::new(80).bytes, 4 * 64 * 176 + 128 * 176);
        for d in ATTENTION_HEAD_SIZES {
            assert!(MmaShape::new(d).bytes <= 113 * 1024, "D = {d}");
        }
    }

    #[test]
    fn decode_shapes() {
        let variant = |dtype, storage, head_size| {
            let cfg = AttentionConfig::builder(32, head_size)
                .num_kv_heads(8)
                .kv_cache_dtype(storage)
                .build()
                .unwrap();
            Variant::for_call(&cfg, dtype, true).unwrap()
        };
        let mma = |v: Variant, rows| match v.decode(rows) {
            DecodeKernel::Mma(s) => s,
            DecodeKernel::Cuda(_) => panic!("{} runs the CUDA-core decode", v.name()),
        };
        let cuda = |v: Variant, rows| match v.decode(rows) {
            DecodeKernel::Cuda(s) => s,
            DecodeKernel::Mma(_) => panic!("{} runs the tensor-core decode", v.name()),
        };
        // After the rings, the warps' f64 accumulators: 4 warps x rows x D.
        let outer = |rows: usize, d: usize| 4 * rows * d * 8;
        // bf16, D = 128, on the tensor cores: tiles of 16 keys, swizzled rows of 256 bytes;
        // three stages of keys and values per warp, 112 KiB in all with four rows (two with
        // eight rows, whose accumulators take 16 KiB more).
        let v = variant(DType::BF16, KvCacheDtype::Auto, 128);
        let bf16 = mma(v, 4);
        assert_eq!((bf16.kt, bf16.row_bytes), (16, 256));
        assert!(bf16.swizzle && !bf16.scale_q);
        assert_eq!(bf16.bytes, 4 * 2 * 2 * 16 * 256 + outer(4, 128));
        // fp8 codes: tiles of 32 keys, swizzled 128-byte rows; bf16 queries scale into f16, f16
        // queries need not.
        let fp8 = mma(variant(DType::BF16, KvCacheDtype::Fp8E4m3, 128), 8);
        assert_eq!(
            (fp8.kt, fp8.row_bytes, fp8.copy, fp8.fold),
            (32, 128, 16, 4)
        );
        assert!(fp8.swizzle && fp8.scale_q);
        // D = 96: rows of 12 units padded to 13.
        let d96 = mma(variant(DType::F16, KvCacheDtype::Auto, 96), 4);
        assert_eq!((d96.row_bytes, d96.swizzle), (13 * 16, false));
        assert!(!mma(variant(DType::F16, KvCacheDtype::Fp8E5m2, 128), 8).scale_q);
        // D = 120 fp8: 8-byte copies; D = 80 fp8: rows of 5 units padded to 7.
        assert_eq!(
            mma(variant(DType::F16, KvCacheDtype::Fp8E4m3, 120), 1).copy,
            8
        );
        assert_eq!(
            mma(variant(DType::F16, KvCacheDtype::Fp8E4m3, 80), 1).row_bytes,
            7 * 16
        );
        // Where two stages and eight rows' accumulators pass 112 KiB, and for f32, the
        // CUDA-core decode.
        assert!(DecodeMmaShape::new(2, 192, 1, false).is_none());
        cuda(variant(DType::BF16, KvCacheDtype::Auto, 256), 1);
        let f32 = cuda(variant(DType::F32, KvCacheDtype::Auto, 256), 8);
        // f32, D = 256: two 16-byte copies per lane and key, three stages of 8 KiB.
        assert_eq!(f32.bytes, 4 * 3 * 8192 + outer(8, 256));
        for v in Variant::all() {
            for rows in DECODE_KERNEL_ROWS {
                if let DecodeKernel::Mma(s) = v.decode(rows) {
                    assert!(s.bytes <= DECODE_SHARED, "{}", v.name());
                }
            }
        }
        // Every decode fits the 163 KiB a block may take on an A100 (sm_80), with its
        // static shared memory (under 1 KiB).
        for v in Variant::all() {
            for rows in DECODE_KERNEL_ROWS {
                assert!(v.decode(rows).bytes() <= 162 * 1024, "{}", v.name());
            }
        }
    }
}
