//! [`GpuLlama`]: the [`Llama`] model on a CUDA GPU. Weights and activations stay in the GPU's
//! memory; the matrix products run on cuBLAS (loaded at run time, like the driver and NVRTC:
//! no CUDA toolkit to build), the other ops on NVRTC kernels (`kernels/llama.cu`, compiled
//! through pagedattn's kernel cache), the attention on the engine's `cuda` backend. All of it
//! is queued on the backend's one stream, so a step waits for the GPU only where its logits
//! (or greedy tokens) come back.
//!
//! Precision: bf16 weights, bf16 inputs to every product and to the attention (and a bf16
//! cache), f32 accumulation, an f32 residual stream and f32 logits.
//!
//! Tensor parallelism ([`GpuLlama::new_shard`]): a rank keeps its shard of each product
//! ([`tensor_parallel`](crate::models::tensor_parallel)): its heads' q/k/v rows and output
//! columns, its rows of gate/up and columns of down. After the output and down products the
//! ranks' partial sums are all-reduced over NCCL into the f32 residual stream, which every
//! rank holds whole: rank 0's product adds to the residual, the others' overwrite it with
//! their partial sum, so that the sum is the residual plus every rank's part. The embedding
//! and norms are replicated. The LM head is vocabulary-parallel: a rank computes the logits
//! of its slice of the vocabulary, and its greedy winner there; an all-gather of the winners
//! (`pick` chooses among them) or of the logits gives every rank the step's output, which
//! rank 0 brings back.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use pagedattn::cuda::Cuda;
use pagedattn::{AttentionConfig, Backend, DType, Device, Tensor};
use rayon::prelude::*;

use crate::models::llama::{llama_model_info, Llama, LlamaShape};
use crate::models::nccl::Communicators;
use crate::models::ops::RopeStyle;
use crate::models::tensor_parallel::{columns_of, head_elements, rows_of, TensorParallel};
use crate::serving::engine::AbortRanks;
use crate::serving::model::{Attend, GraphStages, Model, StepTokens};
use crate::{Error, Result};

pagedattn::kernel_params! {
    /// The model's kernels other than products and attention (CUDA C++ for NVRTC): their
    /// argument structs' declarations, then `kernels/llama.cu`.
    pub const KERNEL_SOURCE = include_str!("../../kernels/llama.cu");

    /// `embed`'s arguments (device addresses as u64).
    struct EmbedParams {
        /// `[t]` token ids.
        tokens: u64 => "const unsigned int*",
        /// The bf16 embedding `[vocab, hidden]`.
        table: u64 => "const unsigned short*",
        /// The f32 residual stream `[t, hidden]`.
        x: u64 => "float*",
        hidden: i32 => "int",
        unused: i32 => "int",
    }

    /// `rms_norm`'s arguments.
    struct RmsNormParams {
        x: u64 => "const float*",
        /// The rows of `x` to normalize (0: row r for output row r).
        rows: u64 => "const unsigned int*",
        weight: u64 => "const float*",
        /// bf16 rows.
        out: u64 => "unsigned short*",
        hidden: i32 => "int",
        eps: f32 => "float",
    }

    /// `split_rope`'s arguments.
    struct SplitRopeParams {
        /// The fused bf16 projection `[t, (heads + 2 kv_heads) · D]`.
        qkv: u64 => "const unsigned short*",
        q: u64 => "unsigned short*",
        k: u64 => "unsigned short*",
        v: u64 => "unsigned short*",
        positions: u64 => "const unsigned int*",
        /// RoPE's inverse frequencies (0: no rotation).
        inv_freq: u64 => "const float*",
        /// The q, k and v projections' biases, `[(heads + 2 kv_heads) · D]` (0: none).
        bias: u64 => "const float*",
        heads: i32 => "int",
        kv_heads: i32 => "int",
        head_size: i32 => "int",
        rope_dim: i32 => "int",
        /// 1: pairs (2i, 2i + 1); 0: (i, i + rope_dim / 2).
        adjacent: i32 => "int",
        unused: i32 => "int",
    }

    /// `swiglu`'s arguments.
    struct SwigluParams {
        /// The fused bf16 gate/up product `[t, 2 ffn]`.
        gate_up: u64 => "const unsigned short*",
        out: u64 => "unsigned short*",
        ffn: i32 => "int",
        tokens: i32 => "int",
    }

    /// `argmax`'s arguments.
    struct ArgmaxParams {
        logits: u64 => "const float*",
        /// One token id per row.
        best: u64 => "unsigned int*",
        /// One packed (index, value) winner per row instead of `best` (0: none).
        candidates: u64 => "unsigned long long*",
        /// Columns of a row to compare, and the distance between rows.
        width: i32 => "int",
        stride: i32 => "int",
        /// The vocabulary index of column 0 (a rank's slice's first).
        offset: i32 => "int",
        unused: i32 => "int",
    }

    /// `pick`'s arguments.
    struct PickParams {
        /// `[ranks, rows]` packed winners.
        candidates: u64 => "const unsigned long long*",
        /// One token id per row.
        best: u64 => "unsigned int*",
        rows: i32 => "int",
        ranks: i32 => "int",
    }
}

/// The kernels of [`KERNEL_SOURCE`].
pub const KERNEL_NAMES: [&str; 6] = [
    "embed",
    "rms_norm",
    "split_rope",
    "swiglu",
    "argmax",
    "pick",
];

/// Bytes of cuBLAS's workspace (what it asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// Threads per block of every kernel but `argmax` (a multiple of 32: the reductions use whole
/// warps).
const THREADS: u32 = 256;
/// Threads of an `rms_norm` block.
const NORM_THREADS: u32 = 1024;

/// Threads per block of `argmax` (one block a row of the whole vocabulary).
const ARGMAX_THREADS: u32 = 1024;

/// The loaded kernels of [`KERNEL_SOURCE`].
struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    split_rope: CudaFunction,
    swiglu: CudaFunction,
    argmax: CudaFunction,
    pick: CudaFunction,
}

/// Device memory and its address (which never changes while the memory lives).
struct Buffer<T> {
    memory: CudaSlice<T>,
    addr: u64,
}

impl<T: DeviceRepr + ValidAsZeroBits> Buffer<T> {
    /// `len` zeros.
    fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let memory = stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| gpu_error(&format!("allocating {len} elements"), e))?;
        let addr = memory.device_ptr(stream).0;
        Ok(Buffer { memory, addr })
    }

    /// A copy of `host`.
    fn upload(stream: &Arc<CudaStream>, host: &[T]) -> Result<Self> {
        let memory = stream
            .clone_htod(host)
            .map_err(|e| gpu_error(&format!("uploading {} elements", host.len()), e))?;
        let addr = memory.device_ptr(stream).0;
        Ok(Buffer { memory, addr })
    }

    /// Overwrites the first `host.len()` elements (at most the buffer's length: the caller
    /// sizes buffers before writing).
    fn write(&mut self, stream: &Arc<CudaStream>, host: &[T]) -> Result<()> {
        let mut head = self.memory.slice_mut(..host.len());
        stream
            .memcpy_htod(host, &mut head)
            .map_err(|e| gpu_error("uploading a step's inputs", e))
    }

    /// The first `out.len()` elements, into `out` (waits for the stream).
    fn read(&self, stream: &Arc<CudaStream>, out: &mut [T]) -> Result<()> {
        stream
            .memcpy_dtoh(&self.memory.slice(..out.len()), out)
            .map_err(|e| gpu_error("downloading a step's outputs", e))
    }
}

/// One decoder layer's weights, bf16 (as raw bits) but the norms' f32.
struct Layer {
    attn_norm: Buffer<f32>,
    /// The q, k and v projections as one `[(heads + 2 kv_heads) · D, hidden]` matrix.
    qkv: Buffer<u16>,
    /// Their biases, f32 (Qwen2's), where the model has them.
    qkv_bias: Option<Buffer<f32>>,
    wo: Buffer<u16>,
    ffn_norm: Buffer<f32>,
    /// The gate and up projections as one `[2 ffn, hidden]` matrix.
    gate_up: Buffer<u16>,
    down: Buffer<u16>,
}

/// RoPE's inverse frequencies and which pairs rotate.
struct GpuRope {
    inv_freq: Buffer<f32>,
    dim: usize,
    adjacent: bool,
}

/// A step's activations, sized for up to `tokens` tokens and `rows` logit rows (grown as
/// steps need, never shrunk); the logits `[ranks, rows, width]` where `width` is a rank's
/// slice of the vocabulary (one rank: the vocabulary), the winners `[ranks, rows]`.
struct Activations {
    tokens: usize,
    rows: usize,
    ids: Buffer<u32>,
    positions: Buffer<u32>,
    x: Buffer<f32>,
    h: Buffer<u16>,
    qkv: Buffer<u16>,
    gate_up: Buffer<u16>,
    act: Buffer<u16>,
    row_ids: Buffer<u32>,
    normed: Buffer<u16>,
    logits: Buffer<f32>,
    candidates: Buffer<u64>,
    greedy: Buffer<u32>,
}

/// A rank of a tensor-parallel group: which, the group's communicators, and the rank's slice
/// of the vocabulary (of the LM head's rows).
struct Parallel {
    tp: TensorParallel,
    comms: Arc<Communicators>,
    /// Every rank's slice is `slice` rows (the last padded with zero rows past the
    /// vocabulary); this rank's first is `rank · slice`.
    slice: usize,
}

impl Parallel {
    /// The vocabulary's columns of rank `rank`'s slice.
    fn vocab_of(&self, rank: usize, vocab: usize) -> std::ops::Range<usize> {
        let start = (rank * self.slice).min(vocab);
        start..((rank + 1) * self.slice).min(vocab)
    }
}

/// A Llama model on a CUDA GPU (see the module doc).
pub struct GpuLlama {
    /// The shard's shape: its heads, kv heads and intermediate (the whole model's on one GPU).
    shape: LlamaShape,
    /// `None` on one GPU.
    parallel: Option<Parallel>,
    attention: Vec<AttentionConfig>,
    device: Device,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace (`BLAS_WORKSPACE` bytes).
    _blas_workspace: Buffer<u8>,
    kernels: Kernels,
    embedding: Buffer<u16>,
    layers: Vec<Layer>,
    out_norm: Buffer<f32>,
    /// Every RMSNorm's epsilon.
    eps: f32,
    /// The LM head (a rank's slice of its rows); `None` on one GPU where it is the embedding
    /// (tied).
    head: Option<Buffer<u16>>,
    rope: Option<GpuRope>,
    acts: Option<Activations>,
    /// How many times `acts` was allocated.
    generation: u64,
    /// The attention's query, key, value and output tensors of each token count seen (kept:
    /// a graph captured for a count holds their addresses).
    attn: HashMap<usize, [Tensor; 4]>,
    host_ids: Vec<u32>,
}

/// An engine error for a failed GPU operation.
fn gpu_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("gpu: {what}: {e}"))
}

/// f32 values as bf16 bits, rounded to nearest even.
fn to_bf16(values: &[f32]) -> Vec<u16> {
    values
        .par_iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// A layer's q, k and v biases, the elements `rows` of each, as one `[q | k | v]` vector
/// (zeros for a projection without one), or `None` where none has one.
fn qkv_bias(
    layer: &crate::models::blocks::LayerWeights,
    rows: [std::ops::Range<usize>; 3],
) -> Option<Vec<f32>> {
    let parts = [&layer.wq, &layer.wk, &layer.wv];
    if parts.iter().all(|w| w.bias().is_none()) {
        return None;
    }
    let mut all = Vec::new();
    for (w, rows) in parts.into_iter().zip(rows) {
        match w.bias() {
            Some(b) => all.extend_from_slice(&b[rows]),
            None => all.resize(all.len() + rows.len(), 0.0),
        }
    }
    Some(all)
}

/// An RMSNorm's weight and epsilon.
fn rms(norm: &crate::models::ops::Norm) -> Result<(&[f32], f32)> {
    match norm {
        crate::models::ops::Norm::Rms { weight, eps } => Ok((weight, *eps)),
        crate::models::ops::Norm::Layer { .. } => Err(Error::Model(
            "the GPU model computes RMSNorms, not LayerNorms".into(),
        )),
    }
}

/// The f32 weights of a projection (the model must be loaded at `Precision::Exact`).
fn weights<'a>(linear: &'a crate::models::ops::Linear, name: &str) -> Result<&'a [f32]> {
    linear.f32_weights().ok_or_else(|| {
        Error::Model(format!(
            "{name} is kept quantized: load the model at exact precision for the GPU"
        ))
    })
}

impl GpuLlama {
    /// `model` on `cuda`'s GPU: its weights converted to bf16 and uploaded (the model must
    /// have been loaded at [`Precision::Exact`](crate::models::ops::Precision::Exact)), its kernels
    /// compiled (or found in the kernel cache). The kernels index by the model's shape:
    /// [`Llama::new`] checked every weight, attention config and RoPE width against it.
    pub fn new(model: &Llama, cuda: &Cuda) -> Result<Self> {
        Self::build(model, cuda, None)
    }

    /// Rank `tp.rank`'s shard of `model` on `cuda`'s GPU, whose all-reduces join the other
    /// ranks' through `comms` (rank i's communicator on the group's GPU i). Refused where the
    /// model's heads or intermediate do not divide as vLLM requires
    /// ([`TensorParallel::shard`]).
    pub fn new_shard(
        model: &Llama,
        cuda: &Cuda,
        tp: TensorParallel,
        comms: Arc<Communicators>,
    ) -> Result<Self> {
        if comms.size() != tp.size {
            return Err(Error::Model(format!(
                "rank {} of {}: the communicators are a group of {}",
                tp.rank,
                tp.size,
                comms.size()
            )));
        }
        Self::build(model, cuda, Some((tp, comms)))
    }

    /// `model` sharded over `gpus` (rank i on GPU `gpus[i]`, one communicator a GPU): each
    /// rank's shard, converted and uploaded on a thread of its own (the 8B shape's 16 GB of
    /// bf16 take a while per GPU), and what aborts the ranks' communicators.
    pub fn shards(model: &Llama, gpus: &[usize]) -> Result<(Vec<Box<dyn Model>>, AbortRanks)> {
        let comms = Arc::new(Communicators::new(gpus)?);
        let size = gpus.len();
        let models = std::thread::scope(|scope| {
            let loading: Vec<_> = gpus
                .iter()
                .enumerate()
                .map(|(rank, &gpu)| {
                    let comms = comms.clone();
                    scope.spawn(move || -> Result<Box<dyn Model>> {
                        let cuda = Cuda::new(gpu)?;
                        let tp = TensorParallel { rank, size };
                        Ok(Box::new(GpuLlama::new_shard(model, &cuda, tp, comms)?))
                    })
                })
                .collect();
            loading
                .into_iter()
                .map(|s| {
                    s.join()
                        .map_err(|_| Error::Model("a GPU's shard panicked loading".into()))?
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let abort: AbortRanks = Arc::new(move || comms.abort());
        Ok((models, abort))
    }

    /// [`new`](Self::new) or [`new_shard`](Self::new_shard).
    fn build(
        model: &Llama,
        cuda: &Cuda,
        parallel: Option<(TensorParallel, Arc<Communicators>)>,
    ) -> Result<Self> {
        if !model.runs_on_gpu_model() {
            return Err(Error::Model(format!(
                "{}: the GPU model computes Llama's blocks (RMSNorm, no biases but q/k/v's, \
                 SwiGLU, no soft-capped logits); this model's run on the host (--model-on host)",
                model.shape.name
            )));
        }
        // One epsilon for every norm (the kernels take one).
        let eps = rms(&model.out_norm)?.1;
        fn rms_weight(n: &crate::models::ops::Norm, eps: f32) -> Result<&[f32]> {
            match rms(n)? {
                (w, e) if e == eps => Ok(w),
                (_, e) => Err(Error::Model(format!(
                    "norms of epsilon {e} and {eps}: the GPU model takes one"
                ))),
            }
        }
        let stream = cuda.stream().clone();
        let functions = cuda.load_kernels("llama", KERNEL_SOURCE, &KERNEL_NAMES)?;
        let [embed, rms_norm, split_rope, swiglu, argmax, pick]: [CudaFunction; 6] = functions
            .try_into()
            .map_err(|_| Error::Model("llama.cu: a kernel is missing".into()))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| gpu_error("loading cuBLAS", e))?;
        // A workspace of our own: cuBLAS then allocates nothing inside a graph capture.
        let blas_workspace = Buffer::<u8>::zeros(&stream, BLAS_WORKSPACE)?;
        // SAFETY: the workspace is device memory of BLAS_WORKSPACE bytes that lives as long
        // as the handle (both are fields of the model).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                blas_workspace.addr as *mut c_void,
                BLAS_WORKSPACE,
            )
        }
        .result()
        .map_err(|e| gpu_error("cublasSetWorkspace", e))?;
        let bf16 = |parts: &[&[f32]]| -> Result<Buffer<u16>> {
            Buffer::upload(&stream, &to_bf16(&parts.concat()))
        };
        let full = &model.shape;
        let tp = parallel.as_ref().map_or(TensorParallel::SINGLE, |p| p.0);
        let shard = tp.shard(full.heads, full.kv_heads, full.ffn)?;
        let d = full.head_size;
        let (q_rows, kv_rows) = (
            head_elements(&shard.q_heads, d),
            head_elements(&shard.kv_heads, d),
        );
        let layers = model
            .layers
            .iter()
            .map(|l| {
                let gate = weights(l.mlp.gate.as_ref().expect("a Llama layer"), "gate")?;
                let h = full.hidden;
                Ok(Layer {
                    attn_norm: Buffer::upload(&stream, rms_weight(&l.attn_norm, eps)?)?,
                    qkv: bf16(&[
                        rows_of(weights(&l.wq, "wq")?, h, q_rows.clone()),
                        rows_of(weights(&l.wk, "wk")?, h, kv_rows.clone()),
                        rows_of(weights(&l.wv, "wv")?, h, kv_rows.clone()),
                    ])?,
                    qkv_bias: qkv_bias(l, [q_rows.clone(), kv_rows.clone(), kv_rows.clone()])
                        .map(|b| Buffer::upload(&stream, &b))
                        .transpose()?,
                    wo: bf16(&[&columns_of(
                        weights(&l.wo, "wo")?,
                        full.heads * d,
                        q_rows.clone(),
                    )])?,
                    ffn_norm: Buffer::upload(&stream, rms_weight(&l.ffn_norm, eps)?)?,
                    gate_up: bf16(&[
                        rows_of(gate, h, shard.ffn.clone()),
                        rows_of(weights(&l.mlp.up, "up")?, h, shard.ffn.clone()),
                    ])?,
                    down: bf16(&[&columns_of(
                        weights(&l.mlp.down, "down")?,
                        full.ffn,
                        shard.ffn.clone(),
                    )])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let table = model
            .embedding
            .tokens
            .to_linear(crate::models::ops::Precision::Exact)?;
        let table = weights(&table, "token_embd")?;
        let head = weights(&model.head, "output")?;
        let slice = full.vocab.div_ceil(tp.size);
        let parallel = parallel.map(|(tp, comms)| Parallel { tp, comms, slice });
        let head = match &parallel {
            // A rank's slice of rows, padded to `slice` rows with zeros (logits that `argmax`
            // never compares and the host never reads).
            Some(p) => {
                let rows = p.vocab_of(tp.rank, full.vocab);
                let mut part = to_bf16(rows_of(head, full.hidden, rows));
                part.resize(slice * full.hidden, 0);
                Some(Buffer::upload(&stream, &part)?)
            }
            None if head == table => None,
            None => Some(bf16(&[head])?),
        };
        let rope = match &model.rope {
            Some(r) => Some(GpuRope {
                inv_freq: Buffer::upload(&stream, r.inv_freq())?,
                dim: r.head_dim(),
                adjacent: r.style() == RopeStyle::Normal,
            }),
            None => None,
        };
        let attention = model
            .attention
            .iter()
            .map(|c| shard.attention(c))
            .collect::<Result<Vec<_>>>()?;
        Ok(GpuLlama {
            shape: LlamaShape {
                heads: shard.q_heads.len(),
                kv_heads: shard.kv_heads.len(),
                ffn: shard.ffn.len(),
                ..model.shape.clone()
            },
            parallel,
            attention,
            device: cuda.device(),
            embedding: bf16(&[table])?,
            out_norm: Buffer::upload(&stream, rms_weight(&model.out_norm, eps)?)?,
            eps,
            head,
            rope,
            layers,
            kernels: Kernels {
                embed,
                rms_norm,
                split_rope,
                swiglu,
                argmax,
                pick,
            },
            blas,
            _blas_workspace: blas_workspace,
            stream,
            acts: None,
            generation: 0,
            attn: HashMap::new(),
            host_ids: Vec::new(),
        })
    }
}

/// A launch of `blocks` blocks of [`THREADS`] threads.
fn grid(blocks: usize) -> Result<LaunchConfig> {
    let blocks =
        u32::try_from(blocks).map_err(|_| Error::Model(format!("a launch of {blocks} blocks")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A size as the `int` cuBLAS and the kernels take.
fn int(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Model(format!("{what} = {n} exceeds a 32-bit int")))
}

impl Activations {
    /// Buffers for `tokens` tokens and `rows` logit rows of `shape`.
    fn new(
        stream: &Arc<CudaStream>,
        s: &LlamaShape,
        (tokens, rows): (usize, usize),
        (ranks, width): (usize, usize),
    ) -> Result<Self> {
        let qkv = (s.heads + 2 * s.kv_heads) * s.head_size;
        Ok(Activations {
            tokens,
            rows,
            ids: Buffer::zeros(stream, tokens)?,
            positions: Buffer::zeros(stream, tokens)?,
            x: Buffer::zeros(stream, tokens * s.hidden)?,
            h: Buffer::zeros(stream, tokens * s.hidden)?,
            qkv: Buffer::zeros(stream, tokens * qkv)?,
            gate_up: Buffer::zeros(stream, tokens * 2 * s.ffn)?,
            act: Buffer::zeros(stream, tokens * s.ffn)?,
            row_ids: Buffer::zeros(stream, rows)?,
            normed: Buffer::zeros(stream, rows * s.hidden)?,
            logits: Buffer::zeros(stream, ranks * rows * width)?,
            candidates: Buffer::zeros(stream, ranks * rows)?,
            greedy: Buffer::zeros(stream, rows)?,
        })
    }
}

/// What a forward pass leaves on the host.
enum Output<'a> {
    /// Every logit row.
    Logits(&'a mut Vec<f32>),
    /// Each row's greedy token.
    Greedy(&'a mut Vec<u32>),
}

impl GpuLlama {
    /// Queues `y[t, n] = x[t, k] · w[n, k]ᵀ` (`+ y` with `accumulate`): `x` and `w` bf16,
    /// `y` bf16 or f32 (`y_type`), accumulated in f32.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_type: blas_sys::cudaDataType,
        (t, n, k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let (t, n, k) = (int(t, "tokens")?, int(n, "rows")?, int(k, "columns")?);
        // Column-major, as cuBLAS sees row-major memory: yᵀ[n, t] = w[k, n]ᵀ · xᵀ[k, t].
        // SAFETY: `w` holds n × k elements, `x` t × k and `y` t × n (the callers pass buffers
        // sized for the step), all on this stream's device and alive until the stream passes
        // this product (they belong to `self`, whose buffers outlive every step).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                t,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k,
                x as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                y_type,
                n,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| gpu_error("cublasGemmEx", e))
    }

    /// Makes room for `t` tokens and `rows` logit rows, and the attention tensors of `t`
    /// tokens.
    fn reserve(&mut self, t: usize, rows: usize) -> Result<()> {
        self.reserve_activations(t, rows)?;
        if let std::collections::hash_map::Entry::Vacant(e) = self.attn.entry(t) {
            let c = &self.attention[0];
            e.insert([
                c.zeros_query(self.device, DType::BF16, t)?,
                c.zeros_kv(self.device, DType::BF16, t)?,
                c.zeros_kv(self.device, DType::BF16, t)?,
                c.zeros_query(self.device, DType::BF16, t)?,
            ]);
        }
        Ok(())
    }

    /// Makes room for `t` tokens and `rows` logit rows in the activations. Growing them frees
    /// the old ones: [`generation`](Self::generation) counts it, so that graphs captured on
    /// them are dropped.
    fn reserve_activations(&mut self, t: usize, rows: usize) -> Result<()> {
        let fits = self
            .acts
            .as_ref()
            .is_some_and(|a| a.tokens >= t && a.rows >= rows);
        if !fits {
            let (old_t, old_rows) = self.acts.as_ref().map_or((0, 0), |a| (a.tokens, a.rows));
            let tokens = t.max(old_t).next_power_of_two();
            let rows = rows.max(old_rows).max(1).next_power_of_two();
            self.acts = None;
            let slices = match &self.parallel {
                Some(p) => (p.tp.size, p.slice),
                None => (1, self.shape.vocab),
            };
            self.acts = Some(Activations::new(
                &self.stream,
                &self.shape,
                (tokens, rows),
                slices,
            )?);
            self.generation += 1;
        }
        Ok(())
    }

    /// Uploads `step`'s tokens, positions and logit rows, the tokens padded to `padded` (token
    /// 0 at position 0) and the logit rows to `padded` with the padding rows: rows no one
    /// reads.
    fn load_step(&mut self, step: &StepTokens<'_>, padded: usize) -> Result<()> {
        // The kernels index the embedding by token and the residual stream by logit row:
        // both checked here, where they enter.
        let t = step.tokens.len();
        if let Some(&bad) = step
            .tokens
            .iter()
            .find(|&&id| id as usize >= self.shape.vocab)
        {
            return Err(Error::Model(format!(
                "token id {bad}: expected below the vocabulary size {}",
                self.shape.vocab
            )));
        }
        if step.positions.len() != t {
            return Err(Error::Model(format!(
                "{} positions for {t} tokens",
                step.positions.len()
            )));
        }
        if let Some(&bad) = step.logit_rows.iter().find(|&&r| r >= t) {
            return Err(Error::Model(format!(
                "logit row {bad}: expected below the step's {t} tokens"
            )));
        }
        if padded < t {
            return Err(Error::Model(format!("{t} tokens padded to {padded}")));
        }
        let rows = step.logit_rows.len() + (padded - t);
        self.reserve(padded, rows)?;
        let acts = self.acts.as_mut().expect("reserved");
        let stream = &self.stream;
        let host = &mut self.host_ids;
        host.clear();
        host.extend_from_slice(step.tokens);
        host.resize(padded, 0);
        acts.ids.write(stream, host)?;
        host.clear();
        host.extend(step.positions.iter().map(|&p| p as u32));
        host.resize(padded, 0);
        acts.positions.write(stream, host)?;
        host.clear();
        host.extend(step.logit_rows.iter().map(|&r| r as u32));
        host.extend(step.tokens.len() as u32..padded as u32);
        acts.row_ids.write(stream, host)
    }

    /// Queues the forward of `t` loaded tokens up to the logits of `rows` rows (and their
    /// greedy tokens with `greedy`), calling `attend` per layer: device work only, nothing
    /// allocated or copied from the host (what a CUDA graph captures).
    fn compute(
        &mut self,
        t: usize,
        rows: usize,
        attend: &mut Attend<'_>,
        greedy: bool,
    ) -> Result<()> {
        // Every buffer the kernels touch must hold `t` tokens and `rows` rows (`load_step`
        // sized them): anything else would have them read or write past the end.
        let fits = self
            .acts
            .as_ref()
            .is_some_and(|a| a.tokens >= t && a.rows >= rows && rows <= t);
        if !fits {
            return Err(Error::Model(format!(
                "gpu: a forward of {t} tokens and {rows} logit rows without a load of that size"
            )));
        }
        // Out of the map for the call (moving a tensor leaves its device memory in place).
        let mut tensors = self
            .attn
            .remove(&t)
            .ok_or_else(|| Error::Model(format!("gpu: no attention tensors for {t} tokens")))?;
        let result = self.compute_with(t, rows, attend, greedy, &mut tensors);
        self.attn.insert(t, tensors);
        result
    }

    /// [`compute`](Self::compute) with the attention tensors of `t` tokens.
    fn compute_with(
        &self,
        t: usize,
        rows: usize,
        attend: &mut Attend<'_>,
        greedy: bool,
        [q, k, v, o]: &mut [Tensor; 4],
    ) -> Result<()> {
        let s = &self.shape;
        let acts = self.acts.as_ref().expect("loaded");
        let stream = &self.stream;
        let (qw, kvw) = (s.heads * s.head_size, s.kv_heads * s.head_size);
        let hidden = int(s.hidden, "hidden")?;
        let eps = self.eps;
        let embed = EmbedParams {
            tokens: acts.ids.addr,
            table: self.embedding.addr,
            x: acts.x.addr,
            hidden,
            unused: 0,
        };
        // SAFETY (every launch below): each kernel's one parameter is its params struct, by
        // value; the buffers are sized for at least `t` tokens and `rows` rows (`reserve`), the
        // weights for the model's shape, and the kernels read and write only inside those
        // sizes; all are queued on the stream they belong to.
        unsafe {
            stream
                .launch_builder(&self.kernels.embed)
                .arg(&embed)
                .launch(grid(t)?)
        }
        .map_err(|e| gpu_error("embed", e))?;
        let (rope_freq, rope_dim, adjacent) = match &self.rope {
            Some(r) => (
                r.inv_freq.addr,
                int(r.dim, "rope dim")?,
                i32::from(r.adjacent),
            ),
            None => (0, 0, 0),
        };
        let heads = (int(s.heads, "heads")?, int(s.kv_heads, "kv heads")?);
        let head_size = int(s.head_size, "head size")?;
        let ffn = int(s.ffn, "ffn")?;
        let tokens = int(t, "tokens")?;
        let bf16 = blas_sys::cudaDataType::CUDA_R_16BF;
        let f32t = blas_sys::cudaDataType::CUDA_R_32F;
        let (qa, ka, va) = (
            q.cuda_address_mut()?,
            k.cuda_address_mut()?,
            v.cuda_address_mut()?,
        );
        // split_rope's launch: a row of blocks per token over its q/k/v elements.
        let token_blocks = grid(t)?;
        let rope_blocks = ((s.heads + 2 * s.kv_heads) * s.head_size).div_ceil(THREADS as usize);
        let rope_blocks = u32::try_from(rope_blocks)
            .map_err(|_| Error::Model(format!("a launch of {rope_blocks} blocks per token")))?;
        for (l, layer) in self.layers.iter().enumerate() {
            self.norm(&acts.x, 0, &layer.attn_norm, &acts.h, t, hidden, eps)?;
            self.linear(
                acts.h.addr,
                layer.qkv.addr,
                acts.qkv.addr,
                bf16,
                (t, qw + 2 * kvw, s.hidden),
                false,
            )?;
            let split_rope = SplitRopeParams {
                qkv: acts.qkv.addr,
                q: qa,
                k: ka,
                v: va,
                positions: acts.positions.addr,
                inv_freq: rope_freq,
                bias: layer.qkv_bias.as_ref().map_or(0, |b| b.addr),
                heads: heads.0,
                kv_heads: heads.1,
                head_size,
                rope_dim,
                adjacent,
                unused: 0,
            };
            // SAFETY: as above; q, k and v are `[t, heads or kv_heads, D]` tensors.
            unsafe {
                stream
                    .launch_builder(&self.kernels.split_rope)
                    .arg(&split_rope)
                    .launch(LaunchConfig {
                        // A token's elements over blocks of THREADS.
                        grid_dim: (token_blocks.grid_dim.0, rope_blocks, 1),
                        ..token_blocks
                    })
            }
            .map_err(|e| gpu_error("split_rope", e))?;
            attend(l, q, k, v, o)?;
            self.linear(
                o.cuda_address()?,
                layer.wo.addr,
                acts.x.addr,
                f32t,
                (t, s.hidden, qw),
                self.adds_residual(),
            )?;
            self.all_reduce(&acts.x, t * s.hidden)?;
            self.norm(&acts.x, 0, &layer.ffn_norm, &acts.h, t, hidden, eps)?;
            self.linear(
                acts.h.addr,
                layer.gate_up.addr,
                acts.gate_up.addr,
                bf16,
                (t, 2 * s.ffn, s.hidden),
                false,
            )?;
            let swiglu = SwigluParams {
                gate_up: acts.gate_up.addr,
                out: acts.act.addr,
                ffn,
                tokens,
            };
            // SAFETY: as above.
            unsafe {
                stream
                    .launch_builder(&self.kernels.swiglu)
                    .arg(&swiglu)
                    .launch(grid((t * s.ffn).div_ceil(THREADS as usize).min(65_535))?)
            }
            .map_err(|e| gpu_error("swiglu", e))?;
            self.linear(
                acts.act.addr,
                layer.down.addr,
                acts.x.addr,
                f32t,
                (t, s.hidden, s.ffn),
                self.adds_residual(),
            )?;
            self.all_reduce(&acts.x, t * s.hidden)?;
        }
        if rows == 0 {
            return Ok(());
        }
        self.norm(
            &acts.x,
            acts.row_ids.addr,
            &self.out_norm,
            &acts.normed,
            rows,
            hidden,
            eps,
        )?;
        let head = self.head.as_ref().unwrap_or(&self.embedding).addr;
        // This rank's logits `[rows, width]`: the whole vocabulary's, or its slice's at its
        // place among the ranks' (the all-gather is in place).
        let (rank, width, columns) = match &self.parallel {
            Some(p) => (p.tp.rank, p.slice, p.vocab_of(p.tp.rank, s.vocab)),
            None => (0, s.vocab, 0..s.vocab),
        };
        // (4 bytes an f32.)
        let logits = acts.logits.addr + (4 * rank * rows * width) as u64;
        self.linear(
            acts.normed.addr,
            head,
            logits,
            f32t,
            (rows, width, s.hidden),
            false,
        )?;
        if !greedy {
            return self.all_gather(&acts.logits, rows * width);
        }
        let parallel = self.parallel.as_ref();
        let argmax = ArgmaxParams {
            logits,
            best: acts.greedy.addr,
            // (8 bytes a candidate.)
            candidates: parallel.map_or(0, |_| acts.candidates.addr + (8 * rank * rows) as u64),
            width: int(columns.len(), "vocabulary slice")?,
            stride: int(width, "vocabulary slice")?,
            offset: int(columns.start, "vocabulary")?,
            unused: 0,
        };
        // SAFETY: as above; `greedy` holds `rows` ids, `candidates` `ranks · rows`, `logits`
        // `ranks · rows · width` values.
        unsafe {
            stream
                .launch_builder(&self.kernels.argmax)
                .arg(&argmax)
                .launch(LaunchConfig {
                    block_dim: (ARGMAX_THREADS, 1, 1),
                    ..grid(rows)?
                })
        }
        .map_err(|e| gpu_error("argmax", e))?;
        let Some(p) = parallel else {
            return Ok(());
        };
        self.all_gather(&acts.candidates, rows)?;
        let pick = PickParams {
            candidates: acts.candidates.addr,
            best: acts.greedy.addr,
            rows: int(rows, "rows")?,
            ranks: int(p.tp.size, "ranks")?,
        };
        // SAFETY: as above; `candidates` holds `ranks · rows` winners, `greedy` `rows` ids.
        unsafe {
            stream
                .launch_builder(&self.kernels.pick)
                .arg(&pick)
                .launch(grid(rows.div_ceil(THREADS as usize))?)
        }
        .map(drop)
        .map_err(|e| gpu_error("pick", e))
    }

    /// Runs the model over `step` and leaves `out` on the host.
    fn run(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        out: Output<'_>,
    ) -> Result<()> {
        let (t, rows) = (step.tokens.len(), step.logit_rows.len());
        if t == 0 {
            match out {
                Output::Logits(l) => l.clear(),
                Output::Greedy(g) => g.clear(),
            }
            return Ok(());
        }
        self.load_step(step, t)?;
        self.compute(t, rows, attend, matches!(out, Output::Greedy(_)))?;
        let acts = self.acts.as_ref().expect("loaded");
        if !self.reads_outputs() {
            // A rank other than 0: its part of the step is done once its stream is.
            match out {
                Output::Logits(l) => l.clear(),
                Output::Greedy(g) => g.clear(),
            }
            return self
                .stream
                .synchronize()
                .map_err(|e| gpu_error("finishing a step", e));
        }
        match out {
            Output::Logits(l) => {
                let vocab = self.shape.vocab;
                l.resize(rows * vocab, 0.0);
                let Some(p) = &self.parallel else {
                    return acts.logits.read(&self.stream, l);
                };
                // `[ranks, rows, slice]` gathered: each row's slices side by side.
                let mut gathered = vec![0f32; p.tp.size * rows * p.slice];
                acts.logits.read(&self.stream, &mut gathered)?;
                for rank in 0..p.tp.size {
                    let columns = p.vocab_of(rank, vocab);
                    for row in 0..rows {
                        let from = (rank * rows + row) * p.slice;
                        l[row * vocab + columns.start..row * vocab + columns.end]
                            .copy_from_slice(&gathered[from..from + columns.len()]);
                    }
                }
                Ok(())
            }
            Output::Greedy(g) => {
                g.resize(rows, 0);
                acts.greedy.read(&self.stream, g)
            }
        }
    }

    /// Whether the row-parallel products add to the residual stream (one GPU, or rank 0)
    /// rather than overwrite it with the rank's partial sum.
    fn adds_residual(&self) -> bool {
        self.parallel.as_ref().is_none_or(|p| p.tp.rank == 0)
    }

    /// Whether this rank's outputs are read back (one GPU, or rank 0: every rank computes
    /// them, the same).
    fn reads_outputs(&self) -> bool {
        self.adds_residual()
    }

    /// Queues the in-place all-gather of `count` values a rank in `buffer` (`[ranks, count]`,
    /// this rank's part at its place); nothing on one GPU.
    fn all_gather<T: cudarc::nccl::NcclType>(
        &self,
        buffer: &Buffer<T>,
        count: usize,
    ) -> Result<()> {
        let ranks = self.parallel.as_ref().map_or(1, |p| p.tp.size);
        let Some(p) = self.collective(buffer, ranks * count)? else {
            return Ok(());
        };
        // SAFETY: `buffer` holds `ranks · count` values on this rank's GPU (checked by
        // `collective`), alive as long as the model; the stream is this GPU's; this rank's
        // forward, which alone calls this, runs on one thread at a time.
        unsafe {
            p.comms
                .all_gather_in_place::<T>(p.tp.rank, buffer.addr, count, self.stream.cu_stream())
        }
    }

    /// Queues the sum over the group's ranks of the first `count` values of `x` (nothing on
    /// one GPU).
    fn all_reduce(&self, x: &Buffer<f32>, count: usize) -> Result<()> {
        let Some(p) = self.collective(x, count)? else {
            return Ok(());
        };
        // SAFETY: `x` holds at least `count` values on this rank's GPU (checked by
        // `collective`), alive as long as the model; the stream is this GPU's; this rank's
        // forward, which alone calls this, runs on one thread at a time.
        unsafe {
            p.comms
                .all_reduce_sum_f32(p.tp.rank, x.addr, count, self.stream.cu_stream())
        }
    }

    /// The group a collective over the first `len` values of `buffer` runs in (`None` on one
    /// GPU), once `buffer` is checked to hold them: NCCL reads and writes what it is told.
    fn collective<T>(&self, buffer: &Buffer<T>, len: usize) -> Result<Option<&Parallel>> {
        let Some(p) = &self.parallel else {
            return Ok(None);
        };
        if buffer.memory.len() < len {
            return Err(Error::Model(format!(
                "gpu: a collective over {len} values of a buffer of {}",
                buffer.memory.len()
            )));
        }
        Ok(Some(p))
    }

    /// Queues `out[r] = rms_norm(x[rows[r]]) · weight` for `n` rows (`rows` 0: row r).
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        x: &Buffer<f32>,
        rows: u64,
        weight: &Buffer<f32>,
        out: &Buffer<u16>,
        n: usize,
        hidden: i32,
        eps: f32,
    ) -> Result<()> {
        let params = RmsNormParams {
            x: x.addr,
            rows,
            weight: weight.addr,
            out: out.addr,
            hidden,
            eps,
        };
        // SAFETY: `x` holds every row `rows` names (or `n` rows), `out` n rows, `weight` one.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.rms_norm)
                .arg(&params)
                .launch(LaunchConfig {
                    // A row's block as wide as a block goes (`block_sum` takes 32 warps): at a
                    // step of one token its one block reads the row in a quarter of the
                    // rounds (256 threads took 13.9 us a norm at hidden 4096 on an H200).
                    block_dim: (NORM_THREADS, 1, 1),
                    ..grid(n)?
                })
        }
        .map(drop)
        .map_err(|e| gpu_error("rms_norm", e))
    }
}

impl Model for GpuLlama {
    fn name(&self) -> String {
        format!("{} (GPU, bf16)", self.shape.name)
    }

    fn dtype(&self) -> DType {
        DType::BF16
    }

    llama_model_info!();

    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.run(step, attend, Output::Logits(logits))
    }

    fn forward_greedy(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        _logits: &mut Vec<f32>,
        tokens: &mut Vec<u32>,
    ) -> Result<()> {
        self.run(step, attend, Output::Greedy(tokens))
    }

    fn graph_stages(&mut self) -> Option<&mut dyn GraphStages> {
        Some(self)
    }
}

// SAFETY: device memory is freed only where `reserve` replaces the activations, which bumps
// `generation`; the weights, the cuBLAS workspace and each token count's attention tensors
// live as long as the model; `load_step` writes into the current activations.
unsafe impl GraphStages for GpuLlama {
    fn reserve(&mut self, tokens: usize, rows: usize) -> Result<()> {
        self.reserve_activations(tokens, rows)
    }

    fn load(&mut self, step: &StepTokens<'_>, padded: usize) -> Result<()> {
        self.load_step(step, padded)
    }

    fn compute(&mut self, padded: usize, rows: usize, attend: &mut Attend<'_>) -> Result<()> {
        self.compute(padded, rows, attend, true)
    }

    fn greedy(&mut self, rows: usize, tokens: &mut Vec<u32>) -> Result<()> {
        let acts = self
            .acts
            .as_ref()
            .ok_or_else(|| Error::Model("gpu: greedy tokens before any step".into()))?;
        if rows > acts.rows {
            return Err(Error::Model(format!(
                "gpu: {rows} greedy tokens asked of a step of at most {} rows",
                acts.rows
            )));
        }
        tokens.resize(rows, 0);
        acts.greedy.read(&self.stream, tokens)
    }

    fn generation(&self) -> u64 {
        self.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kernel of llama.cu takes its struct, declared (by `kernel_params!`, which also
    /// checks the layouts) ahead of the file. Whether the CUDA side compiles is the NVRTC
    /// check's (`pagedattn compile-kernels --only llama`).
    #[test]
    fn kernels_take_one_struct_declared_before_llama_cu() {
        let body = include_str!("../../kernels/llama.cu");
        assert!(KERNEL_SOURCE.ends_with(body));
        let prelude = &KERNEL_SOURCE[..KERNEL_SOURCE.len() - body.len()];
        for (declaration, kernel) in [
            (EmbedParams::DECLARATION, "embed(const EmbedParams args)"),
            (
                RmsNormParams::DECLARATION,
                "rms_norm(const RmsNormParams args)",
            ),
            (
                SplitRopeParams::DECLARATION,
                "split_rope(const SplitRopeParams args)",
            ),
            (SwigluParams::DECLARATION, "swiglu(const SwigluParams args)"),
            (ArgmaxParams::DECLARATION, "argmax(const ArgmaxParams args)"),
            (PickParams::DECLARATION, "pick(const PickParams args)"),
        ] {
            assert!(prelude.contains(declaration), "{kernel}");
            assert!(body.contains(kernel), "{kernel}");
        }
        assert_eq!(KERNEL_NAMES.len(), 6);
    }
}
