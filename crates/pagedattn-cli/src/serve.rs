//! `pagedattn run` with no replay case: the serving engine on a model (the synthetic one, or a
//! GGUF file) and a workload (the built-in `chat` by default, a trace, or prompts given on the
//! command line), verified against `reference` on a sampled fraction of attention calls.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pagedattn::{registry, Backend};
use pagedattn_engine::harness::report::peak_resident_bytes;
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::harness::workload::{self, Builtin, BuiltinParams, Prompt, RequestInput};
use pagedattn_engine::models::chat::{ChatMessage, ChatTemplate};
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::llama::Llama;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::{Engine, EngineConfig, EngineRequest};
use pagedattn_engine::serving::memory::{kv_bytes_per_block, kv_pool_size, KvCacheMemory};
use pagedattn_engine::serving::model::{Model, ModelKind};
use pagedattn_engine::serving::sample::SamplingParams;
use pagedattn_engine::serving::scheduler::{PreemptionPolicy, SchedulerConfig};

/// The engine's options of `pagedattn run`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// A Llama-architecture GGUF file (F32, F16, BF16, Q8_0, Q4_0 or Q4_1 weights; tokenizer
    /// and chat template from the file). Default: the synthetic model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A prompt to complete (repeatable); replaces the workload.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A user turn, through the model's chat template (repeatable); replaces the workload.
    #[arg(long)]
    pub chat: Vec<String>,
    /// A JSONL trace of requests (docs/engine.md); replaces the workload.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The built-in workload: chat, long-context, shared-prefix, or (on the synthetic
    /// model's encoder-only and encoder-decoder shapes) encoder, encoder-decoder.
    #[arg(long, default_value = "chat")]
    pub workload: String,
    /// Requests of the built-in workload.
    #[arg(long, default_value_t = 32, conflicts_with = "trace", value_parser = request_count)]
    pub requests: usize,
    /// Arrivals per second (a Poisson process); default: all at once.
    #[arg(long, conflicts_with = "trace", value_parser = positive_rate)]
    pub rate: Option<f64>,
    /// The most tokens generated per request (a trace's lines say theirs).
    #[arg(long, default_value_t = 128, conflicts_with = "trace")]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (a trace's lines say theirs).
    #[arg(long, default_value_t = 0.0, conflicts_with = "trace", value_parser = temperature)]
    pub temperature: f32,
    /// Nucleus sampling's probability mass (a trace's lines say theirs).
    #[arg(long, default_value_t = 1.0, conflicts_with = "trace", value_parser = probability_mass)]
    pub top_p: f32,
    /// Generate `--max-new-tokens` tokens even past the model's end-of-turn token (fixed
    /// lengths, for benchmarks); with `--trace`, for every line (as its `ignore_eos`).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Seed of the workload's draw and of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Recompute every attention call with `reference` on dense keys and values (default: a
    /// sampled fraction of the steps).
    #[arg(long, conflicts_with = "no_verify")]
    pub verify: bool,
    /// Recompute none.
    #[arg(long)]
    pub no_verify: bool,
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
    /// Where a Llama model's layers run: `device` (the backend's GPU: bf16 weights and
    /// activations, cuBLAS products, nothing crossing to the host but token ids) or `host`
    /// (the CPU at `--precision`, attention tensors moved to the backend and back). Default:
    /// `device` on a GPU backend, `host` otherwise.
    #[arg(long)]
    pub model_on: Option<String>,
    /// Run every decode step's forward pass as it is, never replayed from a CUDA graph (by
    /// default the GPU model's decode steps are, except those `--verify` checks).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Print the report as JSON (every request's generated tokens and text included).
    #[arg(long)]
    pub json: bool,
    /// Write throughput and cache occupancy over time to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// A byte count: a number, or a number with a unit (`B`, `KiB`, `MiB`, `GiB`, `TiB`; or
/// `K`, `M`, `G`, `T` for the same powers of 1024), at least 1 byte.
fn byte_size(text: &str) -> Result<u64, String> {
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

/// The most requests `--requests` draws: each is a record of the report held in memory, and a
/// run of more is a campaign for a trace file.
const MAX_BUILTIN_REQUESTS: usize = 100_000;

/// The largest trace file `--trace` reads (held in memory with its requests while it runs).
const MAX_TRACE_BYTES: u64 = 256 << 20;

/// A flag's value: `text` read as a `T` and accepted where `valid` holds; otherwise the error
/// says what is `expected` (with the parser's reason where it did not read).
fn checked<T>(text: &str, valid: impl Fn(&T) -> bool, expected: &str) -> Result<T, String>
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
fn at_least_one(text: &str) -> Result<usize, String> {
    checked(text, |&n| n >= 1, "expected a whole number of at least 1")
}

/// `--requests`: 1 to [`MAX_BUILTIN_REQUESTS`].
fn request_count(text: &str) -> Result<usize, String> {
    checked(
        text,
        |n| (1..=MAX_BUILTIN_REQUESTS).contains(n),
        &format!("expected a whole number from 1 to {MAX_BUILTIN_REQUESTS}"),
    )
}

/// `--rate`: arrivals per second, finite and above 0.
fn positive_rate(text: &str) -> Result<f64, String> {
    checked(
        text,
        |r: &f64| r.is_finite() && *r > 0.0,
        "expected a finite number of arrivals per second above 0",
    )
}

/// `--temperature`: finite and at least 0, as the sampler computes it (f32).
fn temperature(text: &str) -> Result<f32, String> {
    checked(
        text,
        |t: &f32| t.is_finite() && *t >= 0.0,
        "expected a finite number of at least 0 (0: greedy)",
    )
}

/// `--top-p`: above 0 and at most 1, as the sampler computes it (f32: 1e-300 is 0 there).
fn probability_mass(text: &str) -> Result<f32, String> {
    checked(
        text,
        |p: &f32| *p > 0.0 && *p <= 1.0,
        "expected a probability mass above 0 and at most 1 (as an f32)",
    )
}

/// A model and, for a GGUF file, its tokenizer and chat template.
struct Loaded {
    model: Box<dyn Model>,
    text: Option<(Tokenizer, ChatTemplate)>,
}

/// Whether the model's layers run on the backend's device (`--model-on`).
fn model_on_device(args: &ServeArgs, backend: &dyn Backend) -> pagedattn_engine::Result<bool> {
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

/// `llama` as the engine serves it: on the backend's GPU where `on_device`, else as it is.
fn place(
    llama: Llama,
    on_device: bool,
    backend: &dyn Backend,
) -> pagedattn_engine::Result<Box<dyn Model>> {
    #[cfg(feature = "cuda")]
    if let (true, pagedattn::Device::Cuda(gpu)) = (on_device, backend.device()) {
        let cuda = pagedattn::cuda::Cuda::new(gpu)?;
        return Ok(Box::new(
            pagedattn_engine::models::gpu_llama::GpuLlama::new(&llama, &cuda)?,
        ));
    }
    let _ = (on_device, backend);
    Ok(Box::new(llama))
}

/// The built-in workload in effect (none when prompts, chat turns or a trace replace it).
fn builtin(args: &ServeArgs) -> pagedattn_engine::Result<Option<Builtin>> {
    if !args.prompt.is_empty() || !args.chat.is_empty() || args.trace.is_some() {
        return Ok(None);
    }
    Ok(Some(args.workload.parse()?))
}

/// Loads the model the options name: a GGUF file, or the synthetic model of the kind the
/// workload needs.
fn load(args: &ServeArgs, backend: &dyn Backend) -> pagedattn_engine::Result<Loaded> {
    let kind = builtin(args)?.map_or(ModelKind::Decoder, Builtin::model_kind);
    let on_device = model_on_device(args, backend)?;
    match &args.model {
        None => Ok(Loaded {
            model: match kind {
                ModelKind::Decoder => place(SyntheticConfig::default().build()?, on_device, backend)?,
                ModelKind::EncoderOnly => SyntheticConfig::encoder_only().build_model()?,
                ModelKind::EncoderDecoder => SyntheticConfig::encoder_decoder().build_model()?,
            },
            text: None,
        }),
        Some(_) if kind != ModelKind::Decoder => Err(pagedattn_engine::Error::Model(format!(
            "--workload {} needs an {} model, which only the synthetic model has (leave out --model)",
            args.workload,
            match kind {
                ModelKind::EncoderOnly => "encoder-only",
                _ => "encoder-decoder",
            }
        ))),
        Some(path) => {
            let file = Gguf::open(path)?;
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
            Ok(Loaded {
                model: place(Llama::from_gguf(&file, precision)?, on_device, backend)?,
                text: Some((
                    Tokenizer::from_gguf(&file)?,
                    ChatTemplate::from_gguf(&file)?,
                )),
            })
        }
    }
}

/// The requests the options ask for: prompts and chat turns given on the command line, else
/// the trace, else the built-in workload.
fn requests(
    args: &ServeArgs,
    loaded: &Loaded,
) -> pagedattn_engine::Result<(String, Vec<RequestInput>)> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: 0,
        seed: args.seed,
    };
    let given: Vec<Prompt> = args
        .prompt
        .iter()
        .map(|p| Prompt::Text(p.clone()))
        .chain(args.chat.iter().map(|c| Prompt::Chat(c.clone())))
        .collect();
    if !given.is_empty() {
        let requests = given
            .into_iter()
            .enumerate()
            .map(|(i, prompt)| RequestInput {
                arrival: 0.0,
                prompt,
                encoder_prompt: None,
                max_new_tokens: args.max_new_tokens,
                n: 1,
                sampling: SamplingParams {
                    seed: args.seed.wrapping_add(1000 * i as u64),
                    ..sampling
                },
                ignore_eos: args.ignore_eos,
            })
            .collect();
        return Ok(("prompts from the command line".into(), requests));
    }
    if let Some(path) = &args.trace {
        let io = |source| pagedattn_engine::Error::Io {
            path: path.display().to_string(),
            source,
        };
        let bytes = std::fs::metadata(path).map_err(io)?.len();
        if bytes > MAX_TRACE_BYTES {
            return Err(pagedattn_engine::Error::Model(format!(
                "--trace {}: {bytes} bytes, expected at most {MAX_TRACE_BYTES} (split the trace)",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let mut requests = workload::parse_trace(&text)?;
        for r in &mut requests {
            r.ignore_eos |= args.ignore_eos;
        }
        return Ok((format!("trace {}", path.display()), requests));
    }
    let builtin = builtin(args)?.unwrap_or(Builtin::Chat);
    let model = &loaded.model;
    let params = BuiltinParams {
        requests: args.requests,
        rate: args.rate,
        first_token: model.first_plain_token(),
        vocab: model.vocab_size() as u32,
        max_context: model.max_context(),
        max_new_tokens: args.max_new_tokens,
        sampling,
        ignore_eos: args.ignore_eos,
        seed: args.seed,
    };
    Ok((builtin.to_string(), builtin.requests(&params)))
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// Every request was served.
    Completed,
    /// Ctrl-C stopped it (the report so far was printed).
    Interrupted,
}

/// `pagedattn run` on the engine: serves the requests, prints the report (or JSON), writes the
/// plot. A verification mismatch or a leaked block is an error.
pub fn serve(args: &ServeArgs, backend_name: &str) -> pagedattn_engine::Result<Served> {
    // This thread as one of rayon's workers: a step's parallel products (hundreds a token at
    // batch 1) then split in place instead of waking the pool and sleeping until it is done.
    // (An error means the pool exists already, as it is: nothing lost but that speed.)
    let _ = rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global();
    let backend: Box<dyn Backend> = registry::backend(backend_name)?;
    let loaded = load(args, backend.as_ref())?;
    let (workload_name, inputs) = requests(args, &loaded)?;
    let mut requests = Vec::with_capacity(inputs.len());
    let ids = |prompt: &Prompt| -> pagedattn_engine::Result<Vec<u32>> {
        Ok(match (prompt, &loaded.text) {
            (Prompt::Tokens(t), _) => t.clone(),
            (Prompt::Text(text), Some((tok, _))) => tok.encode(text, true)?,
            // The rendered template holds its special tokens already (transformers'
            // `apply_chat_template` adds none either).
            (Prompt::Chat(turn), Some((tok, chat))) => {
                tok.encode(&chat.render(&[ChatMessage::new("user", turn.clone())], true)?, false)?
            }
            (_, None) => {
                return Err(pagedattn_engine::Error::Model(
                    "the synthetic model has no tokenizer: give token ids (a trace's `tokens`) or a GGUF model".into(),
                ))
            }
        })
    };
    for input in &inputs {
        requests.push(EngineRequest {
            arrival: input.arrival,
            prompt: ids(&input.prompt)?,
            encoder_prompt: input.encoder_prompt.as_ref().map(&ids).transpose()?,
            max_new_tokens: input.max_new_tokens,
            n: input.n,
            sampling: input.sampling,
            ignore_eos: input.ignore_eos,
        });
    }
    // Each request's blocks: every sample's, and its encoder's cross blocks. At most the
    // model's context per sample and as many samples as a step holds (the engine rejects a
    // larger request alone: it must not size the pool for the others), saturating.
    let context = loaded.model.max_context();
    let blocks = |r: &EngineRequest| {
        r.prompt
            .len()
            .saturating_add(r.max_new_tokens)
            .min(context)
            .div_ceil(args.block_size)
            .saturating_mul(r.n.clamp(1, args.max_seqs.min(args.max_batched_tokens)))
            .saturating_add(
                r.encoder_prompt
                    .as_ref()
                    .map_or(0, |e| e.len().div_ceil(args.block_size)),
            )
    };
    let longest = requests.iter().map(blocks).max().unwrap_or(1);
    let all = requests.iter().map(blocks).fold(0, usize::saturating_add);
    let block_bytes = kv_bytes_per_block(loaded.model.as_ref(), args.block_size);
    let num_blocks = match args.num_blocks {
        Some(n) => n,
        None => {
            let memory = match (args.kv_cache_memory, args.gpu_memory_utilization) {
                (Some(bytes), _) => KvCacheMemory::Bytes(bytes),
                (None, Some(share)) => KvCacheMemory::Utilization(share),
                (None, None) => KvCacheMemory::default_for(backend.as_ref())?,
            };
            // (Sized now: the weights are loaded.) No more than the workload can use.
            let pool = kv_pool_size(
                backend.as_ref(),
                loaded.model.as_ref(),
                args.block_size,
                memory,
            )?;
            pool.blocks.min(all.max(longest))
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
    let config = EngineConfig {
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
    };
    let verify = if args.no_verify {
        VerifyMode::Off
    } else if args.verify {
        VerifyMode::Every
    } else {
        VerifyMode::Sampled(0.05)
    };
    let engine = Engine::new(backend.as_ref(), loaded.model, &config)?
        .with_check(Box::new(Verifier::new(verify, args.seed)?));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // Ctrl-C stops the loop after the current step; the report so far is printed.
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::Relaxed));
    }
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(requests.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let started = std::time::Instant::now();
    let mut progress = |done: usize, _total: usize, generated: usize| {
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
            let rate = generated as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!("{rate:.0} tokens/s"));
        }
    };
    let mut report = engine.run(&workload_name, requests, &stop, &mut progress)?;
    report.peak_resident_bytes = peak_resident_bytes();
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if let Some((tok, _)) = &loaded.text {
        for r in &mut report.requests {
            r.text = r
                .generated
                .iter()
                .map(|g| tok.decode(g, true))
                .collect::<Result<_, _>>()?;
        }
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, report.svg()).map_err(|source| pagedattn_engine::Error::Io {
            path: path.display().to_string(),
            source,
        })?;
    }
    if args.json {
        println!("{}", report.to_json());
    } else {
        if !args.prompt.is_empty() || !args.chat.is_empty() {
            for (r, input) in report.requests.iter().zip(&inputs) {
                let shown = match &input.prompt {
                    Prompt::Text(t) | Prompt::Chat(t) => t.clone(),
                    Prompt::Tokens(t) => format!("{t:?}"),
                };
                println!(
                    "> {shown}\n{}\n",
                    r.text.first().map(String::as_str).unwrap_or("")
                );
            }
        }
        println!("{report}");
    }
    Ok(if report.interrupted {
        Served::Interrupted
    } else {
        Served::Completed
    })
}
