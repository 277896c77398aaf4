//! `pagedattn`: replay captured attention calls on any backend, and inspect the backends.

#![warn(missing_docs)]

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
    println!(
        "{}: {} {} call, {} prefill + {} decode sequences, {} query tokens, H={} Hkv={} D={} {} (cache {}), {:.2} ms -> {}",
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
    );
    Ok(())
}

fn info() {
    for b in registry::available_backends() {
        let c = b.capabilities();
        let dtypes: Vec<&str> = c.dtypes.iter().map(|d| d.name()).collect();
        let types: Vec<&str> = c.attn_types.iter().map(|t| t.name()).collect();
        println!("backend {} on {}", b.name(), b.device());
        println!("  dtypes:      {}", dtypes.join(", "));
        println!("  head sizes:  {}", c.head_sizes);
        println!("  block sizes: {}", c.block_sizes);
        println!("  attn types:  {}", types.join(", "));
        println!(
            "  fp8 KV cache: {}, ALiBi: {}, sliding window: {}, soft cap: {}",
            c.fp8, c.alibi, c.sliding_window, c.soft_cap
        );
        println!("  cache layout: {:?}", b.kv_cache_layout());
    }
    println!(
        "cpu: {} threads, SIMD: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        simd_features().join(" ")
    );
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Forward {
            input,
            backend,
            output,
        } => forward(&input, &backend, &output),
        Command::Info => {
            info();
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
