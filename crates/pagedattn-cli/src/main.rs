//! `pagedattn`: the serving engine on a model, replayed attention calls on any backend, and
//! the backends' capabilities and speed.

#![warn(missing_docs)]

mod bench;
mod engine_options;
mod example;
mod run;
mod serve;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use pagedattn::replay::{ReplayCase, ReplayOutput};
use pagedattn::{registry, replay, Backend, Error, Result};
use pagedattn_engine::harness::verify::{tolerance, worst_difference};

#[derive(Parser)]
#[command(name = "pagedattn", version, about = "Attention over a paged KV cache")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// How far `compile-kernels` compiles (`pagedattn::cuda::CheckDepth`).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Depth {
    /// Every program to machine code.
    Full,
    /// Every program to PTX; the fixed kernels and the heaviest variants to machine code.
    Representative,
    /// `representative` with each variant's PTX on one of the architectures given (in turn):
    /// every variant's C++ checked once, the heaviest to machine code on each.
    Spread,
}

// (Parsed once per process: the size of its largest variant does not matter.)
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serves a workload with the engine (default: the synthetic model, the `chat` workload,
    /// a sampled fraction of the attention calls recomputed with `reference`).
    Run {
        /// Backend name, or `auto` for the best one available.
        #[arg(long, default_value = "auto")]
        backend: String,
        #[command(flatten)]
        args: run::RunArgs,
    },
    /// Serves a model over HTTP with OpenAI's API (completions and chat completions,
    /// streamed or not), `/health` and Prometheus `/metrics`, until SIGINT or SIGTERM.
    Serve {
        /// Backend name, or `auto` for the best one available.
        #[arg(long, default_value = "auto")]
        backend: String,
        #[command(flatten)]
        args: serve::ServeArgs,
    },
    /// Replays one captured forward call (docs/replay-format.md) on a backend: prints what
    /// ran and how long it took, writes its results (`--output`), checks them against
    /// `reference` (`--check`: exit code 1 on a mismatch).
    Forward {
        /// The replay case (safetensors).
        #[arg(long)]
        input: PathBuf,
        /// Backend name, or `auto` for the best one available.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Where to write `output` and the caches after the call.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Also run the call on `reference` and compare the outputs within the output
        /// dtype's tolerance.
        #[arg(long)]
        check: bool,
    },
    /// Lists the backends available here, their capabilities, and the CPU's SIMD features.
    Info,
    /// Benchmarks the `cpu` or `cuda` backend (decode, prefill, mixed batch, paging) against
    /// this machine's measured ceilings (memory read bandwidth; f32 FMA, bf16 dot or AMX peaks).
    Bench(bench::BenchArgs),
    /// Compiles every CUDA kernel (every attention variant included) through NVRTC for the
    /// given architectures, without a GPU (needs libnvrtc), one program per CPU at a time: the
    /// check CI runs. Any compiler warning is an error.
    #[cfg(feature = "cuda")]
    CompileKernels {
        /// Target architectures, e.g. `sm_80`, `sm_90a` (repeat the flag for several).
        #[arg(long = "arch", required = true)]
        archs: Vec<String>,
        /// Also store the images in the kernel cache directory (`PAGEDATTN_CACHE_DIR`, else
        /// `$XDG_CACHE_HOME/pagedattn/kernels`, else `~/.cache/pagedattn/kernels`), reusing the
        /// valid entries there: a GPU's calls then never wait for NVRTC.
        #[arg(long)]
        cache: bool,
        /// Only the programs whose name contains this (e.g. `bf16_bf16_d128_causal`): a
        /// quick check of a kernel edit; with `--cache`, a cache of those programs (whose
        /// entries are machine code after a 32-byte header: `nvdisasm` reads them without it).
        #[arg(long)]
        only: Option<String>,
        /// Every program to machine code (`full`, as a GPU compiles it), or every program to
        /// PTX and to machine code only the fixed kernels and each dtype / storage / head
        /// size's variant with every score modifier on (`representative`: a fifth of the
        /// time), or that spread over the architectures given, each variant to PTX and each
        /// heaviest one to machine code on one of them, by their order (`spread`: what CI
        /// runs). Not with `--cache`.
        #[arg(long, value_enum, default_value_t = Depth::Full, conflicts_with = "cache")]
        depth: Depth,
        /// `spread` split further into this many parts, one per run: each run compiles one
        /// part (`--part`), and the parts together are the whole sweep (CI: a part per
        /// commit, in turn).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        parts: u16,
        /// Which of the `--parts` parts this run compiles, from 0.
        #[arg(long, default_value_t = 0)]
        part: u16,
        /// Also print, per kernel compiled to machine code, what the assembler reports: its
        /// registers per thread and its stack frame in bytes. Not with `--cache`.
        #[arg(long, conflicts_with = "cache")]
        report: bool,
    },
    /// Writes an example replay case: a mixed batch of chunked prefills with cached context,
    /// a fresh prompt and decodes, GQA, bf16.
    Example {
        /// Where to write the case.
        #[arg(long)]
        output: PathBuf,
        /// Random seed for the contents.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// `e`, named as an error in the replay case `input`.
fn in_case(input: &Path, e: Error) -> Error {
    Error::Format(format!("{}: {e}", input.display()))
}

/// Reads a replay case; errors name the file.
fn read_case(input: &Path) -> Result<ReplayCase> {
    replay::read_case(&read(input)?).map_err(|e| in_case(input, e))
}

/// Runs `case` on `backend`: the results and the milliseconds the call took.
fn run_timed(case: &ReplayCase, backend: &dyn Backend) -> Result<(ReplayOutput, f64)> {
    let start = Instant::now();
    let result = replay::run_case(case, backend)?;
    Ok((result, start.elapsed().as_secs_f64() * 1e3))
}

/// One line on what ran: backend, call, batch, shapes, time.
fn describe(case: &ReplayCase, backend: &dyn Backend, ms: f64) -> String {
    let md = &case.metadata;
    let c = &case.config;
    format!(
        "{}: {} {} call, {} prefill + {} decode sequences, {} query tokens, H={} Hkv={} D={} {} (cache {}), {ms:.2} ms",
        backend.name(),
        c.attn_type(),
        case.query.dtype(),
        md.num_prefills,
        md.num_seqs() - md.num_prefills,
        md.num_tokens(),
        c.num_heads(),
        c.num_kv_heads(),
        c.head_size(),
        if case.kv_cache.is_some() { "paged" } else { "none" },
        c.kv_cache_dtype(),
    )
}

/// `pagedattn forward`: the case on `backend`, its results written to `output`, and with
/// `check` compared with `reference`'s. Returns whether the output matched (true unchecked).
fn forward(input: &Path, backend: &str, output: Option<&Path>, check: bool) -> Result<bool> {
    let case = read_case(input)?;
    let backend = registry::backend(backend)?;
    let name_case = |e: Error| in_case(input, e);
    let (result, ms) = run_timed(&case, backend.as_ref()).map_err(name_case)?;
    let mut text = describe(&case, backend.as_ref(), ms);
    if let Some(path) = output {
        write(path, &replay::write_output(&result)?)?;
        text += &format!(" -> {}", path.display());
    }
    text.push('\n');
    let mut matched = true;
    if check {
        let reference = registry::backend("reference")?;
        let (expected, _) = run_timed(&case, reference.as_ref()).map_err(name_case)?;
        let (ulp, tol) = tolerance(expected.output.dtype());
        let worst = worst_difference(
            &result.output.to_f32_vec()?,
            &expected.output.to_f32_vec()?,
            ulp,
        );
        matched = worst <= tol;
        text += &format!(
            "output vs reference: largest difference beyond one ulp {worst:.1e} of the output's largest magnitude (allowed {tol:.0e}): {}\n",
            if matched { "ok" } else { "MISMATCH" },
        );
    }
    print_ignoring_closed_pipe(&text);
    Ok(matched)
}

/// The text of `pagedattn info`.
fn info() -> String {
    use std::fmt::Write;
    let mut text = String::new();
    for (name, backend) in registry::all_backends() {
        let b = match backend {
            Ok(b) => b,
            Err(e) => {
                let _ = writeln!(text, "backend {name}: unavailable: {e}");
                continue;
            }
        };
        let c = b.capabilities();
        let dtypes: Vec<&str> = c.dtypes.iter().map(|d| d.name()).collect();
        let types: Vec<&str> = c.attn_types.iter().map(|t| t.name()).collect();
        let _ = writeln!(text, "backend {} on {}", b.name(), b.device());
        let _ = writeln!(text, "  dtypes:      {}", dtypes.join(", "));
        let _ = writeln!(text, "  head sizes:  {}", c.head_sizes);
        let _ = writeln!(text, "  block sizes: {}", c.block_sizes);
        let _ = writeln!(text, "  attn types:  {}", types.join(", "));
        let _ = writeln!(
            text,
            "  fp8 KV cache: {}, ALiBi: {}, sliding window: {}, soft cap: {}",
            c.fp8, c.alibi, c.sliding_window, c.soft_cap
        );
        let _ = writeln!(text, "  cache layout: {:?}", b.kv_cache_layout());
        for (name, value) in b.details() {
            let _ = writeln!(text, "  {name}: {value}");
        }
    }
    let _ = writeln!(
        text,
        "cpu: {} threads, SIMD: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        simd_features().join(" ")
    );
    text
}

/// The SIMD features of this CPU that matter to attention kernels.
fn simd_features() -> Vec<&'static str> {
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_x86_feature_detected!($f) { found.push($f); } )* };
        }
        probe!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512bf16",
            "avx512fp16"
        );
        // (AMX has no stable feature detection; the backend's own check also asks Linux.)
        if pagedattn::cpu::Isa::Amx.is_available() {
            found.push("amx-bf16");
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_aarch64_feature_detected!($f) { found.push($f); } )* };
        }
        probe!("neon", "fp16", "bf16", "dotprod", "sve");
    }
    if found.is_empty() {
        found.push("none detected");
    }
    found
}

/// `pagedattn compile-kernels`: every kernel for every architecture, one line each: how many
/// compiled, in how long, per family (the attention variants counted, not listed); with
/// `report`, first a line per kernel compiled to machine code: `ARCH KERNEL registers N stack
/// N`. A kernel that spills registers fails it (unless
/// `kernels/attention/known-spills.txt` lists it).
#[cfg(feature = "cuda")]
fn compile_kernels(
    archs: &[String],
    cache: bool,
    only: Option<&str>,
    depth: impl Fn(usize) -> pagedattn::cuda::CheckDepth,
    report: bool,
) -> Result<()> {
    use pagedattn::cuda::{compile_check, DiskCache, ImageOrigin};
    let disk = if cache {
        Some(DiskCache::from_env().ok_or_else(|| {
            Error::invalid(
                "--cache",
                "no cache directory",
                "PAGEDATTN_CACHE_DIR, XDG_CACHE_HOME or HOME set",
            )
        })?)
    } else {
        None
    };
    for (index, arch) in archs.iter().enumerate() {
        let start = std::time::Instant::now();
        let line = match &disk {
            None => {
                let compiled = compile_check(arch, only, depth(index))?;
                if report {
                    let lines: String = compiled
                        .iter()
                        .filter_map(|(_, r)| r.as_ref())
                        .map(|r| {
                            format!(
                                "{arch} {} registers {} stack {} spills {}/{}\n",
                                r.kernel, r.registers, r.stack_bytes, r.spill_stores, r.spill_loads
                            )
                        })
                        .collect();
                    print_ignoring_closed_pipe(&lines);
                }
                let paid = pagedattn::cuda::check_spills(arch, &compiled)?;
                if !paid.is_empty() {
                    eprintln!(
                        "note: {arch}: {} kernels listed in known-spills.txt no longer spill \
                         (remove their lines): {}",
                        paid.len(),
                        paid.join(", ")
                    );
                }
                let mut kernels: Vec<String> = compiled.into_iter().map(|(k, _)| k).collect();
                // The engine's GPU model's kernels, compiled at its first use like these.
                if only.is_none_or(|o| "llama".contains(o)) {
                    use pagedattn_engine::models::gpu_llama::{KERNEL_NAMES, KERNEL_SOURCE};
                    pagedattn::cuda::compile_program_check("llama", KERNEL_SOURCE, arch)?;
                    kernels.extend(KERNEL_NAMES.iter().map(|k| format!("llama_{k}")));
                }
                format!(
                    "{arch}: {} kernels compiled without warnings in {:.1} s: {}",
                    kernels.len(),
                    start.elapsed().as_secs_f64(),
                    kernel_families(&kernels)
                )
            }
            Some(disk) => {
                let images = disk.fill(arch, only)?;
                let compiled = images
                    .iter()
                    .filter(|i| i.origin == ImageOrigin::Compiled)
                    .count();
                format!(
                    "{arch}: {} programs in {} ({compiled} compiled, {} valid there) in {:.1} s",
                    images.len(),
                    disk.dir().display(),
                    images.len() - compiled,
                    start.elapsed().as_secs_f64()
                )
            }
        };
        print_ignoring_closed_pipe(&format!("{line}\n"));
    }
    Ok(())
}

/// Kernel names grouped by family with their counts: `write_kv_* (9)`, `copy_blocks`,
/// `attention_merge_* (3)`, `attention_*_prefill (N)`, `attention_*_decode1 (N)`, ...
#[cfg(feature = "cuda")]
fn kernel_families(kernels: &[String]) -> String {
    let mut families: Vec<(String, usize)> = Vec::new();
    for name in kernels {
        let family = if let Some(prefix) = ["write_kv_", "attention_merge_", "llama_"]
            .into_iter()
            .find(|p| name.starts_with(p))
        {
            format!("{prefix}*")
        } else if name.starts_with("attention_") {
            let kind = name.rsplit('_').next().unwrap_or(name);
            format!("attention_*_{kind}")
        } else {
            name.clone()
        };
        match families.iter_mut().find(|(f, _)| *f == family) {
            Some((_, n)) => *n += 1,
            None => families.push((family, 1)),
        }
    }
    families
        .iter()
        .map(|(f, n)| {
            if *n == 1 {
                f.clone()
            } else {
                format!("{f} ({n})")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Prints `text` to stdout; a reader that closed the pipe early (`| head`) is not an error.
fn print_ignoring_closed_pipe(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// Parses the command line. `--help` and `--version` print as clap prints them (exit code 0);
/// a usage error is one line on stderr and exit code 2, like every other bad input (README),
/// instead of clap's usage block of 3-6 lines.
fn parse_command_line() -> std::result::Result<Cli, ExitCode> {
    Cli::try_parse().map_err(|e| {
        if !e.use_stderr() {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        let cli = <Cli as clap::CommandFactory>::command();
        // Top-level options take no value, so the first word that is no option is the command.
        let command = match std::env::args().skip(1).find(|a| !a.starts_with('-')) {
            Some(name) if cli.find_subcommand(&name).is_some() => format!("pagedattn {name}"),
            _ => "pagedattn".to_string(),
        };
        let message =
            if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                // (No command at all: clap would print the whole help.)
                let names: Vec<&str> = cli.get_subcommands().map(|c| c.get_name()).collect();
                format!("error: a command is needed: {}", names.join(", "))
            } else {
                one_line(&e.render().to_string())
            };
        eprintln!("{message}; try '{command} --help'");
        ExitCode::from(2)
    })
}

/// clap's rendering of a usage error as one line: the message, then its notes (the arguments
/// missing, the possible values, tips), without the usage and the pointer to `--help`.
fn one_line(rendered: &str) -> String {
    let mut message = String::new();
    // Whether the lines are a list of items (after a line that ends with a colon).
    let mut listing = false;
    for line in rendered.lines().map(str::trim) {
        if line.is_empty()
            || line.starts_with("Usage: ")
            || line.starts_with("For more information")
        {
            continue;
        }
        let separator = if message.is_empty() {
            ""
        } else if message.ends_with(':') {
            listing = true;
            " "
        } else if line.starts_with('[') {
            " "
        } else if line.starts_with("tip:") {
            listing = false;
            "; "
        } else if listing {
            ", "
        } else {
            "; "
        };
        message.push_str(separator);
        message.push_str(line);
    }
    message
}

fn main() -> ExitCode {
    let cli = match parse_command_line() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let engine_args = match &cli.command {
        Command::Run { args, .. } => Some(&args.engine),
        Command::Serve { args, .. } => Some(&args.engine),
        _ => None,
    };
    if let Some(Err(e)) = engine_args.map(engine_options::find_nccl) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let result: std::result::Result<(), String> = match cli.command {
        Command::Run { backend, args } => match run::run(&args, &backend) {
            // The shell's code for a process ended by SIGINT, after the report so far.
            Ok(run::Served::Interrupted) => return ExitCode::from(130),
            other => other.map(|_| ()).map_err(|e| e.to_string()),
        },
        Command::Serve { backend, args } => serve::serve(&args, &backend),
        Command::Forward {
            input,
            backend,
            output,
            check,
        } => match forward(&input, &backend, output.as_deref(), check) {
            Ok(false) => return ExitCode::FAILURE,
            other => other.map(|_| ()).map_err(|e| e.to_string()),
        },
        Command::Bench(args) => bench::run(&args).map_err(|e| e.to_string()),
        Command::Info => {
            print_ignoring_closed_pipe(&info());
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Command::CompileKernels {
            archs,
            cache,
            only,
            depth,
            parts,
            part,
            report,
        } => {
            if part >= parts || (parts > 1 && depth != Depth::Spread) {
                Err(format!(
                    "--part {part} --parts {parts}: expected a part below --parts, and more \
                     than one part only with --depth spread"
                ))
            } else {
                // Each architecture of each part is one slot of the sweep.
                let count = archs.len() * usize::from(parts);
                let first = archs.len() * usize::from(part);
                let depth = move |arch: usize| match depth {
                    Depth::Full => pagedattn::cuda::CheckDepth::Full,
                    Depth::Representative => pagedattn::cuda::CheckDepth::Representative,
                    Depth::Spread => pagedattn::cuda::CheckDepth::Spread {
                        index: first + arch,
                        count,
                    },
                };
                compile_kernels(&archs, cache, only.as_deref(), depth, report)
                    .map_err(|e| e.to_string())
            }
        }
        Command::Example { output, seed } => replay::write_case(&example::mixed_batch(seed))
            .and_then(|bytes| write(&output, &bytes))
            .map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let line = e.replace('\n', " ");
            eprintln!("error: {line}");
            ExitCode::from(2)
        }
    }
}
