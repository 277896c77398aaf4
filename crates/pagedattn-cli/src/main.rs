//! `pagedattn`: replay captured attention calls on any backend, and inspect the backends.

#![warn(missing_docs)]

mod bench;
mod example;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use pagedattn::{registry, replay, Error, Result};

#[derive(Parser)]
#[command(name = "pagedattn", version, about = "Attention over a paged KV cache")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replays one captured forward call (docs/replay-format.md) and writes its results.
    Forward {
        /// The replay case (safetensors).
        #[arg(long)]
        input: PathBuf,
        /// Backend name, or `auto` for the best one available.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Where to write `output` and the caches after the call.
        #[arg(long)]
        output: PathBuf,
    },
    /// Lists the backends available here, their capabilities, and the CPU's SIMD features.
    Info,
    /// Benchmarks a backend (decode, prefill, mixed batch, paging) against this machine's
    /// measured ceilings (memory read bandwidth, FMA and bf16 dot peaks).
    Bench(bench::BenchArgs),
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

fn forward(input: &Path, backend: &str, output: &Path) -> Result<()> {
    let in_input = |e: Error| Error::Format(format!("{}: {e}", input.display()));
    let case = replay::read_case(&read(input)?).map_err(in_input)?;
    let backend = registry::backend(backend)?;
    let start = Instant::now();
    let result = replay::run_case(&case, backend.as_ref()).map_err(in_input)?;
    let elapsed = start.elapsed();
    write(output, &replay::write_output(&result)?)?;
    let md = &case.metadata;
    let c = &case.config;
    print_ignoring_closed_pipe(&format!(
        "{}: {} {} call, {} prefill + {} decode sequences, {} query tokens, H={} Hkv={} D={} {} (cache {}), {:.2} ms -> {}\n",
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
        elapsed.as_secs_f64() * 1e3,
        output.display(),
    ));
    Ok(())
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

/// Prints `text` to stdout; a reader that closed the pipe early (`| head`) is not an error.
fn print_ignoring_closed_pipe(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Forward {
            input,
            backend,
            output,
        } => forward(&input, &backend, &output),
        Command::Bench(args) => bench::run(&args),
        Command::Info => {
            print_ignoring_closed_pipe(&info());
            Ok(())
        }
        Command::Example { output, seed } => {
            replay::write_case(&example::mixed_batch(seed)).and_then(|bytes| write(&output, &bytes))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let line = e.to_string().replace('\n', " ");
            eprintln!("error: {line}");
            ExitCode::from(2)
        }
    }
}
