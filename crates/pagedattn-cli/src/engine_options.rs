//! The engine's options, shared by `pagedattn run` and `pagedattn serve`: the model, the KV
//! cache's pool and the scheduler's budgets and policies; loading the model they name and
//! building the engine's configuration from them.

use std::path::PathBuf;

use pagedattn::Backend;
use pagedattn_engine::models::chat::ChatTemplate;
use pagedattn_engine::models::families::{self, HfModel};
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::hf::HfFolder;
use pagedattn_engine::models::llama::Llama;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::{AbortRanks, EngineConfig, Placed};
use pagedattn_engine::serving::memory::{kv_bytes_per_block, kv_pool_size, KvCacheMemory};
use pagedattn_engine::serving::model::{Model, ModelKind};
use pagedattn_engine::serving::scheduler::{PreemptionPolicy, SchedulerConfig};

/// The model and the engine's budgets and policies.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// A Llama-architecture GGUF file (F32, F16, BF16, Q8_0, Q4_0 or Q4_1 weights; tokenizer
    /// and chat template from the file). Default: the synthetic model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The synthetic decoder's shape when no `--model` is given: `small` (the tests' and
    /// workloads' default), `smollm2` (SmolLM2-135M's shape) or `llama3-8b` (Llama-3-8B's
    /// shape, 16 GB of seeded bf16 weights).
    #[arg(long, default_value = "small", conflicts_with = "model")]
    pub synthetic: String,
    /// Tokens per KV-cache block (8: under 2% of the slots of a chat workload's blocks stay
    /// empty, half of what 16 leaves).
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    pub block_size: usize,
    /// KV-cache blocks per layer (default: what `--kv-cache-memory` or
    /// `--gpu-memory-utilization` holds, at most room for all the workload's requests at
    /// once; requests beyond the pool wait for blocks).
    #[arg(long, value_parser = at_least_one, conflicts_with_all = ["kv_cache_memory", "gpu_memory_utilization"])]
    pub num_blocks: Option<usize>,
    /// The KV cache's memory over all layers, in bytes or with a unit (`512MiB`, `4GiB`).
    /// Default: 4 GiB on the host (at most half of the memory available, as vLLM's CPU
    /// `VLLM_CPU_KVCACHE_SPACE`), `--gpu-memory-utilization`'s share on a GPU.
    #[arg(long, value_parser = byte_size, conflicts_with = "gpu_memory_utilization")]
    pub kv_cache_memory: Option<u64>,
    /// The share of the device's memory the engine may hold, in (0, 1]: the KV cache gets what
    /// the weights and the memory already in use leave of it (vLLM's flag; default 0.9 on a
    /// GPU; with a host backend, a share of the host's memory).
    #[arg(long, value_parser = utilization)]
    pub gpu_memory_utilization: Option<f64>,
    /// Swap blocks per layer in host memory (default: as many as the device's pool, at most
    /// 4 GiB of them, vLLM's `--swap-space`).
    #[arg(long)]
    pub swap_blocks: Option<usize>,
    /// The most tokens computed in one step (prompt chunks and decodes).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    pub max_batched_tokens: usize,
    /// The most sequences in one step.
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    pub max_seqs: usize,
    /// How a request is preempted when blocks run out: swap, recompute or auto.
    #[arg(long, default_value = "auto")]
    pub preemption: String,
    /// Do not reuse the cached blocks of identical prompt prefixes.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// How a GGUF model's projections multiply: `exact` (weights dequantized to f32, what
    /// transformers computes) or `fast` (quantized weights, int8 activations).
    #[arg(long, default_value = "exact")]
    pub precision: String,
    /// Where a model's layers run: `device` (the backend's GPU: bf16 weights and
    /// activations, cuBLAS products, nothing crossing to the host but token ids; Llama's
    /// blocks only: Llama, Mistral, Qwen2, a Llama GGUF) or `host` (the CPU at `--precision`,
    /// attention tensors moved to the backend and back). Default: `device` on a GPU backend
    /// for a model the GPU model computes, `host` otherwise.
    #[arg(long)]
    pub model_on: Option<String>,
    /// Run every decode step's forward pass as it is, never replayed from a CUDA graph (by
    /// default the GPU model's decode steps are, except those `--verify` checks).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Shard the model over this many GPUs (0 to N-1; tensor parallelism over NCCL, one
    /// thread a GPU): each computes its share of the heads and of the feed-forward and holds
    /// its share of the KV cache (`--backend cuda`, the GPU model: Llama's blocks).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub tensor_parallel: usize,
}

/// A byte count: a number, or a number with a unit (`B`, `KiB`, `MiB`, `GiB`, `TiB`; or
/// `K`, `M`, `G`, `T` for the same powers of 1024), at least 1 byte.
pub(crate) fn byte_size(text: &str) -> Result<u64, String> {
    let expected = "a byte count, e.g. 536870912, 512MiB or 4GiB";
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match text[digits.len()..].to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(format!("expected {expected}")),
    };
    checked::<f64>(digits.trim(), |v| v.is_finite() && *v > 0.0, expected).and_then(|v| {
        let bytes = v * (1u64 << shift) as f64;
        if bytes >= 1.0 && bytes < u64::MAX as f64 {
            Ok(bytes as u64)
        } else {
            Err(format!(
                "expected {expected}, at least 1 byte and below 2^64"
            ))
        }
    })
}

/// A share of memory: a fraction in (0, 1].
fn utilization(text: &str) -> Result<f64, String> {
    checked(
        text,
        |v: &f64| *v > 0.0 && *v <= 1.0,
        "a fraction in (0, 1]",
    )
}

/// The swap space's default ceiling (vLLM's `--swap-space` default).
const DEFAULT_SWAP_BYTES: u64 = 4 << 30;

/// A flag's value: `text` read as a `T` and accepted where `valid` holds; otherwise the error
/// says what is `expected` (with the parser's reason where it did not read).
pub(crate) fn checked<T>(
    text: &str,
    valid: impl Fn(&T) -> bool,
    expected: &str,
) -> Result<T, String>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    match text.parse::<T>() {
        Ok(value) if valid(&value) => Ok(value),
        Ok(_) => Err(expected.to_string()),
        Err(e) => Err(format!("{expected} ({e})")),
    }
}

/// A count flag: a whole number of at least 1.
pub(crate) fn at_least_one(text: &str) -> Result<usize, String> {
    checked(text, |&n| n >= 1, "expected a whole number of at least 1")
}

/// A model on its backends and, for a GGUF file, its tokenizer and chat template.
pub struct Loaded {
    /// The model (its shards) on the backends.
    pub placed: Placed,
    /// Its tokenizer and chat template (a GGUF file's; the synthetic model has none).
    pub text: Option<(Tokenizer, ChatTemplate)>,
    /// The token an encoder-decoder model's generation starts from (`config.json`'s
    /// `decoder_start_token_id`), the decoder prompt of a request that gives none.
    pub decoder_start: Option<u32>,
}

/// The ranks' backends: `backend_name`'s, or with `--tensor-parallel N` (N > 1) the `cuda`
/// backend of each of GPUs 0 to N-1 (`--backend` `cuda` or `auto`).
pub fn backends(
    args: &EngineArgs,
    backend_name: &str,
) -> pagedattn_engine::Result<Vec<Box<dyn Backend>>> {
    let n = args.tensor_parallel;
    if n == 1 {
        return Ok(vec![pagedattn::registry::backend(backend_name)?]);
    }
    if !matches!(backend_name, "cuda" | "auto") {
        return Err(pagedattn_engine::Error::Model(format!(
            "--tensor-parallel {n}: expected --backend cuda (it shards the GPU model), not \
             {backend_name}"
        )));
    }
    #[cfg(feature = "cuda")]
    {
        (0..n)
            .map(|gpu| {
                let cuda = pagedattn::cuda::Cuda::new(gpu).map_err(|e| {
                    pagedattn_engine::Error::Model(format!("--tensor-parallel {n}: GPU {gpu}: {e}"))
                })?;
                Ok(Box::new(cuda) as Box<dyn Backend>)
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    Err(pagedattn_engine::Error::Model(format!(
        "--tensor-parallel {n}: this build has no CUDA"
    )))
}

/// Set in the environment of the restart [`find_nccl`] makes, so that it happens once.
#[cfg(feature = "cuda")]
const NCCL_RESTARTED: &str = "PAGEDATTN_NCCL_RESTARTED";

/// With `--tensor-parallel` past 1, makes NCCL loadable: where cudarc does not find
/// `libnccl.so` but a CUDA toolkit or NCCL's pip wheel has `libnccl.so.2`, restarts this
/// program with a directory linking it on `LD_LIBRARY_PATH` (the dynamic loader reads that
/// variable once, at start). Returns where NCCL was not found (the communicators' creation
/// then says what to install), and never where it restarted.
pub fn find_nccl(args: &EngineArgs) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        use pagedattn_engine::models::nccl;
        if args.tensor_parallel < 2
            || nccl::library_loadable()
            || std::env::var_os(NCCL_RESTARTED).is_some()
        {
            return Ok(());
        }
        let Some(cache) = pagedattn::cuda::DiskCache::from_env() else {
            return Ok(());
        };
        let Some(dir) = nccl::library_link_dir(cache.dir()).map_err(|e| e.to_string())? else {
            return Ok(());
        };
        let mut path = std::ffi::OsString::from(dir.as_os_str());
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        let exe = std::env::current_exe().map_err(|e| format!("restarting for NCCL: {e}"))?;
        use std::os::unix::process::CommandExt;
        // (Returns only where the restart failed.)
        let e = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", path)
            .env(NCCL_RESTARTED, "1")
            .exec();
        Err(format!("restarting with {} for NCCL: {e}", dir.display()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = args;
        Ok(())
    }
}

/// Whether the model's layers run on the backend's device (`--model-on`).
fn model_on_device(args: &EngineArgs, backend: &dyn Backend) -> pagedattn_engine::Result<bool> {
    let on_gpu = backend.device() != pagedattn::Device::Cpu;
    match args.model_on.as_deref() {
        None => Ok(on_gpu),
        Some("host") => Ok(false),
        Some("device") if on_gpu => Ok(true),
        Some("device") => Err(pagedattn_engine::Error::Model(format!(
            "--model-on device: backend {} computes on the host (use --backend cuda)",
            backend.name()
        ))),
        Some(other) => Err(pagedattn_engine::Error::Model(format!(
            "--model-on {other}: expected host or device"
        ))),
    }
}

/// The ranks' models and, with several, what aborts their collectives.
type Ranks = (Vec<Box<dyn Model>>, Option<AbortRanks>);

/// `model` alone, where no tensor parallelism was asked for (only the GPU model is sharded).
fn unsharded(args: &EngineArgs, model: Box<dyn Model>) -> pagedattn_engine::Result<Ranks> {
    if args.tensor_parallel > 1 {
        return Err(pagedattn_engine::Error::Model(format!(
            "--tensor-parallel {}: {} is computed on the host; only the GPU model (Llama's \
             blocks, --model-on device) is sharded",
            args.tensor_parallel,
            model.name()
        )));
    }
    Ok((vec![model], None))
}

/// `llama` as the engine serves it: on the backend's GPU where `on_device` (by default only a
/// model of Llama's blocks, which the GPU model computes; asked for explicitly, others are
/// refused), sharded over every backend's GPU with `--tensor-parallel`; else as it is.
fn place(
    llama: Llama,
    on_device: bool,
    args: &EngineArgs,
    backends: &[Box<dyn Backend>],
) -> pagedattn_engine::Result<Ranks> {
    let on_device = on_device && (llama.runs_on_gpu_model() || args.model_on.is_some());
    #[cfg(feature = "cuda")]
    if let (true, pagedattn::Device::Cuda(_)) = (on_device, backends[0].device()) {
        use pagedattn_engine::models::gpu_llama::GpuLlama;
        let gpus = backends
            .iter()
            .map(|b| match b.device() {
                pagedattn::Device::Cuda(gpu) => Ok(gpu),
                other => Err(pagedattn_engine::Error::Model(format!(
                    "a rank on {other}: expected a GPU"
                ))),
            })
            .collect::<pagedattn_engine::Result<Vec<_>>>()?;
        if let [gpu] = gpus[..] {
            let cuda = pagedattn::cuda::Cuda::new(gpu)?;
            return Ok((vec![Box::new(GpuLlama::new(&llama, &cuda)?)], None));
        }
        let (models, abort) = GpuLlama::shards(&llama, &gpus)?;
        return Ok((models, Some(abort)));
    }
    let _ = (on_device, backends);
    unsharded(args, Box::new(llama))
}

/// Loads the model the options name: a GGUF file, a Hugging Face folder, or the synthetic
/// model of `kind` (a file's or folder's kind is its own: the caller checks it).
pub fn load(
    args: &EngineArgs,
    backends: Vec<Box<dyn Backend>>,
    kind: ModelKind,
) -> pagedattn_engine::Result<Loaded> {
    let on_device = model_on_device(args, backends[0].as_ref())?;
    let placed = |(models, abort): Ranks, backends| Placed::new(backends, models, abort);
    if args.model.is_none() && kind != ModelKind::Decoder && args.synthetic != "small" {
        return Err(pagedattn_engine::Error::Model(format!(
            "--synthetic {} names a decoder's shape: this workload runs the synthetic {} model",
            args.synthetic,
            if kind == ModelKind::EncoderOnly {
                "encoder-only"
            } else {
                "encoder-decoder"
            }
        )));
    }
    match &args.model {
        None => Ok(Loaded {
            placed: placed(
                match kind {
                    ModelKind::Decoder => place(
                        SyntheticConfig::preset(&args.synthetic)?.build()?,
                        on_device,
                        args,
                        &backends,
                    )?,
                    ModelKind::EncoderOnly => {
                        unsharded(args, SyntheticConfig::encoder_only().build_model()?)?
                    }
                    ModelKind::EncoderDecoder => {
                        unsharded(args, SyntheticConfig::encoder_decoder().build_model()?)?
                    }
                },
                backends,
            )?,
            text: None,
            decoder_start: None,
        }),
        Some(path) => {
            let precision = match args.precision.as_str() {
                "exact" => Precision::Exact,
                "fast" if on_device => {
                    return Err(pagedattn_engine::Error::Model(
                        "--precision fast is the host model's (int8 dots on the CPU); the GPU model computes in bf16: leave it out, or add --model-on host".into(),
                    ))
                }
                "fast" => Precision::Fast,
                other => {
                    return Err(pagedattn_engine::Error::Model(format!(
                        "--precision {other}: expected exact or fast"
                    )))
                }
            };
            if path.is_dir() {
                let folder = HfFolder::open(path)?;
                let tokenizer = Tokenizer::from_hf_folder(path)?;
                let template = ChatTemplate::from_hf_folder(path, &tokenizer)?;
                let ranks = match families::from_hf(&folder, precision)? {
                    HfModel::Decoder(llama) => place(llama, on_device, args, &backends)?,
                    HfModel::Encoder(_) if args.model_on.as_deref() == Some("device") => {
                        return Err(pagedattn_engine::Error::Model(format!(
                            "--model-on device: {} is an encoder model, computed on the host \
                             (its attention runs on the backend)",
                            path.display()
                        )))
                    }
                    encoder => unsharded(args, encoder.into_model())?,
                };
                let decoder_start = folder
                    .config_usize_opt("decoder_start_token_id")?
                    .and_then(|t| u32::try_from(t).ok());
                return Ok(Loaded {
                    placed: placed(ranks, backends)?,
                    text: Some((tokenizer, template)),
                    decoder_start,
                });
            }
            let file = Gguf::open(path)?;
            let ranks = place(
                Llama::from_gguf(&file, precision)?,
                on_device,
                args,
                &backends,
            )?;
            Ok(Loaded {
                placed: placed(ranks, backends)?,
                text: Some((
                    Tokenizer::from_gguf(&file)?,
                    ChatTemplate::from_gguf(&file)?,
                )),
                decoder_start: None,
            })
        }
    }
}

/// The engine's configuration for `model` on `backend`: the pool's blocks as the options say
/// (`--num-blocks`, else what `--kv-cache-memory` or `--gpu-memory-utilization` hold, at
/// most `wanted` where the caller knows how many its requests can use), swap space, budgets.
pub fn engine_config(
    args: &EngineArgs,
    backend: &dyn Backend,
    model: &dyn Model,
    wanted: Option<usize>,
) -> pagedattn_engine::Result<EngineConfig> {
    let block_bytes = kv_bytes_per_block(model, args.block_size);
    let num_blocks = match args.num_blocks {
        Some(n) => n,
        None => {
            let memory = match (args.kv_cache_memory, args.gpu_memory_utilization) {
                (Some(bytes), _) => KvCacheMemory::Bytes(bytes),
                (None, Some(share)) => KvCacheMemory::Utilization(share),
                (None, None) => KvCacheMemory::default_for(backend)?,
            };
            // (Sized now: the weights are loaded.)
            let pool = kv_pool_size(backend, model, args.block_size, memory)?;
            wanted.map_or(pool.blocks, |w| pool.blocks.min(w))
        }
    };
    let swap_blocks = args.swap_blocks.unwrap_or_else(|| {
        num_blocks.min(usize::try_from(DEFAULT_SWAP_BYTES / block_bytes).unwrap_or(usize::MAX))
    });
    let preemption = match args.preemption.as_str() {
        "swap" => PreemptionPolicy::Swap,
        "recompute" => PreemptionPolicy::Recompute,
        "auto" => PreemptionPolicy::Auto,
        other => {
            return Err(pagedattn_engine::Error::Model(format!(
                "--preemption {other}: expected swap, recompute or auto"
            )))
        }
    };
    Ok(EngineConfig {
        scheduler: SchedulerConfig {
            max_batched_tokens: args.max_batched_tokens,
            max_seqs: args.max_seqs,
            preemption,
            blocks: BlockConfig {
                block_size: args.block_size,
                num_device_blocks: num_blocks,
                num_host_blocks: swap_blocks,
                prefix_caching: !args.no_prefix_caching,
                sliding_window: None,
                watermark_blocks: 1,
            },
        },
        cuda_graphs: !args.no_cuda_graphs,
    })
}
