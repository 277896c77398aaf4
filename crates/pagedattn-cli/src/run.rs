//! `pagedattn run` with no replay case: the serving engine on a model (the synthetic one, or a
//! GGUF file) and a workload (the built-in `chat` by default, a trace, or prompts given on the
//! command line), verified against `reference` on a sampled fraction of attention calls.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::engine_options::{backends, checked, engine_config, load, EngineArgs, Loaded};
use pagedattn_engine::harness::report::peak_resident_bytes;
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::harness::workload::{self, Builtin, BuiltinParams, Prompt, RequestInput};
use pagedattn_engine::models::chat::ChatMessage;
use pagedattn_engine::serving::engine::{Engine, EngineRequest};
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::sample::SamplingParams;

/// The options of `pagedattn run`: the engine's, and the workload's.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A prompt to complete (repeatable); replaces the workload.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A user turn, through the model's chat template (repeatable); replaces the workload.
    #[arg(long)]
    pub chat: Vec<String>,
    /// A JSONL trace of requests (docs/engine.md); replaces the workload.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The built-in workload: chat, long-context, shared-prefix (decoders), encoder
    /// (encoder-only models), encoder-decoder. Default: `chat`, or the model's kind's
    /// (`encoder` for BERT, `encoder-decoder` for BART).
    #[arg(long)]
    pub workload: Option<String>,
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
    /// Print the report as JSON (every request's generated tokens and text included).
    #[arg(long)]
    pub json: bool,
    /// Write throughput and cache occupancy over time to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// The most requests `--requests` draws: each is a record of the report held in memory, and a
/// run of more is a campaign for a trace file.
const MAX_BUILTIN_REQUESTS: usize = 100_000;

/// The largest trace file `--trace` reads (held in memory with its requests while it runs).
const MAX_TRACE_BYTES: u64 = 256 << 20;

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

/// The built-in workload in effect (none when prompts, chat turns or a trace replace it):
/// `--workload`, else the one of a model of `kind`.
fn builtin(args: &RunArgs, kind: ModelKind) -> pagedattn_engine::Result<Option<Builtin>> {
    if !args.prompt.is_empty() || !args.chat.is_empty() || args.trace.is_some() {
        return Ok(None);
    }
    Ok(Some(match &args.workload {
        Some(w) => w.parse()?,
        None => match kind {
            ModelKind::Decoder => Builtin::Chat,
            ModelKind::EncoderOnly => Builtin::Encoder,
            ModelKind::EncoderDecoder => Builtin::EncoderDecoder,
        },
    }))
}

/// The name of a model kind, for messages.
fn kind_name(kind: ModelKind) -> &'static str {
    match kind {
        ModelKind::Decoder => "a decoder",
        ModelKind::EncoderOnly => "an encoder-only",
        ModelKind::EncoderDecoder => "an encoder-decoder",
    }
}

/// The requests the options ask for: prompts and chat turns given on the command line, else
/// the trace, else the built-in workload.
fn requests(
    args: &RunArgs,
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
        // An encoder-decoder model encodes the prompt and generates from its decoder start.
        let encoder_decoder = loaded.placed.model().kind() == ModelKind::EncoderDecoder;
        let requests = given
            .into_iter()
            .enumerate()
            .map(|(i, prompt)| RequestInput {
                arrival: 0.0,
                prompt: match encoder_decoder {
                    true => Prompt::Tokens(Vec::new()),
                    false => prompt.clone(),
                },
                encoder_prompt: encoder_decoder.then_some(prompt),
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
    let model = loaded.placed.model();
    let builtin = builtin(args, model.kind())?.unwrap_or(Builtin::Chat);
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
pub fn run(args: &RunArgs, backend_name: &str) -> pagedattn_engine::Result<Served> {
    // This thread as one of rayon's workers: a step's parallel products (hundreds a token at
    // batch 1) then split in place instead of waking the pool and sleeping until it is done.
    // (An error means the pool exists already, as it is: nothing lost but that speed.)
    let _ = rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global();
    // The synthetic model's kind is the workload's; a file's or folder's is its own.
    let kind = builtin(args, ModelKind::Decoder)?.map_or(ModelKind::Decoder, Builtin::model_kind);
    let loaded = load(&args.engine, backends(&args.engine, backend_name)?, kind)?;
    let model_kind = loaded.placed.model().kind();
    if let Some(w) = builtin(args, model_kind)?.filter(|w| w.model_kind() != model_kind) {
        return Err(pagedattn_engine::Error::Model(format!(
            "--workload {w} needs {} model; {} is {} model",
            kind_name(w.model_kind()),
            loaded.placed.model().name(),
            kind_name(model_kind)
        )));
    }
    let (workload_name, inputs) = requests(args, &loaded)?;
    let mut requests = Vec::with_capacity(inputs.len());
    let ids = |prompt: &Prompt| -> pagedattn_engine::Result<Vec<u32>> {
        Ok(match (prompt, &loaded.text) {
            // An encoder-decoder request without a decoder prompt starts from the model's
            // decoder start token.
            (Prompt::Tokens(t), _) if t.is_empty() && model_kind == ModelKind::EncoderDecoder => {
                vec![loaded.decoder_start.ok_or_else(|| {
                    pagedattn_engine::Error::Model(format!(
                        "{}: no decoder prompt, and the model names no decoder start token",
                        loaded.placed.model().name()
                    ))
                })?]
            }
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
            stop_token_ids: Vec::new(),
            min_tokens: 0,
        });
    }
    // Each request's blocks: every sample's, and its encoder's cross blocks. At most the
    // model's context per sample and as many samples as a step holds (the engine rejects a
    // larger request alone: it must not size the pool for the others), saturating.
    let context = loaded.placed.model().max_context();
    let blocks = |r: &EngineRequest| {
        r.prompt
            .len()
            .saturating_add(r.max_new_tokens)
            .min(context)
            .div_ceil(args.engine.block_size)
            .saturating_mul(r.n.clamp(1, args.engine.max_seqs.min(args.engine.max_batched_tokens)))
            .saturating_add(
                r.encoder_prompt
                    .as_ref()
                    .map_or(0, |e| e.len().div_ceil(args.engine.block_size)),
            )
    };
    let longest = requests.iter().map(blocks).max().unwrap_or(1);
    let all = requests.iter().map(blocks).fold(0, usize::saturating_add);
    let config = engine_config(
        &args.engine,
        loaded.placed.backend(),
        loaded.placed.model(),
        Some(all.max(longest)),
    )?;
    let verify = if args.no_verify {
        VerifyMode::Off
    } else if args.verify {
        VerifyMode::Every
    } else {
        VerifyMode::Sampled(0.05)
    };
    let (backends, models, abort) = loaded.placed.into_parts();
    let engine = Engine::placed(&backends, models, abort, &config)?
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
