//! `pagedattn serve`: the engine behind an OpenAI-compatible HTTP server (docs/server.md).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use pagedattn_engine::serving::model::ModelKind;
use pagedattn_server::{EngineParts, Server, ServerConfig};

use crate::engine_options::{
    at_least_one, backends, byte_size, checked, engine_config, load, EngineArgs,
};

/// The options of `pagedattn serve`: where it listens, its limits, and the engine's.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on (0: a free one, printed when the server is up).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model's name in the API (requests' `model`, `/v1/models`). Default: the GGUF
    /// file's name without `.gguf`, or `synthetic`.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Requests that may wait for the running batch; beyond, requests get a 429 with
    /// `Retry-After`.
    #[arg(long, default_value_t = 1024, value_parser = at_least_one)]
    pub max_waiting_requests: usize,
    /// The largest request body (bytes, or with a unit: `8MiB`); beyond, a 413.
    #[arg(long, default_value = "8MiB", value_parser = byte_size)]
    pub max_request_bytes: u64,
    /// The most choices (`n`) a request may ask for.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub max_n: usize,
    /// Seconds that requests in flight may take to finish after SIGINT or SIGTERM before
    /// they are aborted.
    #[arg(long, default_value_t = 30.0, value_parser = shutdown_seconds)]
    pub shutdown_timeout: f64,
}

/// `--shutdown-timeout`: finite seconds of at least 0, at most a day.
fn shutdown_seconds(text: &str) -> Result<f64, String> {
    checked(
        text,
        |s: &f64| (0.0..=86_400.0).contains(s),
        "expected seconds from 0 to 86400",
    )
}

/// Serves until SIGINT or SIGTERM; then the requests in flight finish (or are aborted at the
/// shutdown timeout), the block manager is checked, and it returns.
pub fn serve(args: &ServeArgs, backend_name: &str) -> Result<(), String> {
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .map_err(|e| format!("--host {} --port {}: {e}", args.host, args.port))?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.engine
            .model
            .as_deref()
            .and_then(Path::file_stem)
            .map_or("synthetic".into(), |s| s.to_string_lossy().into_owned())
    });
    let mut config = ServerConfig::new(name.clone());
    config.max_waiting = args.max_waiting_requests;
    config.max_body_bytes = usize::try_from(args.max_request_bytes).unwrap_or(usize::MAX);
    config.max_n = args.max_n;
    config.shutdown_timeout = Duration::from_secs_f64(args.shutdown_timeout);
    config.handle_signals = true;
    let engine_args = args.engine.clone();
    let backend_name = backend_name.to_string();
    let server = Server::start(listener, config, move || {
        let backends = backends(&engine_args, &backend_name)?;
        let loaded = load(&engine_args, backends, ModelKind::Decoder)?;
        let config = engine_config(
            &engine_args,
            loaded.placed.backend(),
            loaded.placed.model(),
            None,
        )?;
        Ok(EngineParts {
            placed: loaded.placed,
            config,
            text: loaded.text,
            decoder_start: loaded.decoder_start,
        })
    })
    .map_err(|e| e.to_string())?;
    // (Tests and scripts read this line for the port.)
    println!(
        "pagedattn serve: `{name}` listening on http://{}",
        server.addr()
    );
    let _ = std::io::stdout().flush();
    let summary = server.wait().map_err(|e| e.to_string())?;
    eprintln!(
        "pagedattn serve: stopped after {} requests finished, {} aborted, {} steps",
        summary.finished, summary.aborted, summary.steps
    );
    Ok(())
}
