//! An OpenAI-compatible HTTP server on the pagedattn engine (`pagedattn serve`).
//!
//! Two threads and a runtime: the engine loop owns the engine on its own thread (a rayon
//! worker, so that a step's parallel work splits in place) and runs steps while requests are
//! unfinished; tokio's runtime serves HTTP (axum): each request is read, checked and tokenized
//! by its task, handed to the loop over a channel, and answered from the tokens the loop sends
//! back as they are sampled. Requests that arrive while others run join the running batch at
//! the next step. A decoder answers completions and chats, an encoder-decoder model
//! completions (the prompt encoded), an encoder-only model embeddings. See docs/server.md for the endpoints, options and metrics.

#![warn(missing_docs)]

mod core;
mod error;
mod metrics;
mod openai;
mod routes;
mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pagedattn_engine::models::chat::ChatTemplate;
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::engine::{Engine, EngineConfig, Placed};
use pagedattn_engine::serving::model::ModelKind;

pub use crate::core::Summary;
pub use crate::error::ApiError;
pub use crate::openai::{MAX_PROMPTS, MAX_STOP_STRINGS};

/// How the server is set up.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model's name in the API (`model` of requests, `/v1/models`).
    pub model_name: String,
    /// Requests that may wait for the running batch; beyond, a 429 with `Retry-After`.
    pub max_waiting: usize,
    /// The largest request body, in bytes; beyond, a 413.
    pub max_body_bytes: usize,
    /// The most choices (`n`) per request.
    pub max_n: usize,
    /// After a shutdown begins, how long in-flight requests may take to finish before they
    /// are aborted.
    pub shutdown_timeout: Duration,
    /// Begin the shutdown on SIGINT or SIGTERM (the command line's server; tests call
    /// [`Server::shutdown`]).
    pub handle_signals: bool,
    /// Tokio's worker threads (the HTTP side: parsing, tokenizing, streaming).
    pub http_threads: usize,
}

impl ServerConfig {
    /// Defaults for a model served as `model_name`.
    pub fn new(model_name: impl Into<String>) -> Self {
        ServerConfig {
            model_name: model_name.into(),
            max_waiting: 1024,
            max_body_bytes: 8 << 20,
            max_n: 16,
            shutdown_timeout: Duration::from_secs(30),
            handle_signals: false,
            http_threads: 2,
        }
    }
}

/// What the engine loop's thread builds before serving: the backend, the model on it, the
/// engine's configuration, and the model's tokenizer and chat template where it has them.
pub struct EngineParts {
    /// The model on its backend (or its shards on theirs, with tensor parallelism).
    pub placed: Placed,
    /// The engine's pools, budgets and policies.
    pub config: EngineConfig,
    /// The tokenizer and chat template (text prompts, chat, stop strings); without them the
    /// server takes token ids only.
    pub text: Option<(Tokenizer, ChatTemplate)>,
    /// An encoder-decoder model's decoder start token: a completion's prompt is encoded, and
    /// the answer generated from this token.
    pub decoder_start: Option<u32>,
}

/// Why the server could not start or did not end cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The engine could not be built, failed while serving, or leaked blocks.
    #[error(transparent)]
    Engine(#[from] pagedattn_engine::Error),
    /// The listener or the runtime.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    /// A thread of the server panicked.
    #[error("server: the {0} thread panicked")]
    Panicked(&'static str),
}

/// Stops the server if the engine thread panics (a bug: the model's and backend's failures
/// are errors), so that the process ends with the panic instead of answering 503 forever.
struct StopOnPanic {
    stop: Arc<tokio::sync::Notify>,
    shared: Arc<core::Shared>,
}

impl Drop for StopOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            *self
                .shared
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some("the engine thread panicked".into());
            self.stop.notify_one();
        }
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<tokio::sync::Notify>,
    http: JoinHandle<std::io::Result<()>>,
    engine: JoinHandle<pagedattn_engine::Result<Summary>>,
}

/// What the engine thread reports once the engine is built.
struct Ready {
    kind: ModelKind,
    max_context: usize,
    vocab: usize,
    text: Option<(Tokenizer, ChatTemplate)>,
    decoder_start: Option<u32>,
}

impl Server {
    /// Builds the engine (`build` runs on the engine loop's thread, which owns the engine)
    /// and serves on `listener` (bound already: port 0 picks a free one). Returns once the
    /// model is loaded and the server accepts requests.
    pub fn start(
        listener: std::net::TcpListener,
        config: ServerConfig,
        build: impl FnOnce() -> pagedattn_engine::Result<EngineParts> + Send + 'static,
    ) -> Result<Server, ServerError> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(core::Shared::new());
        let (commands, command_rx) = std::sync::mpsc::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Ready>();
        let engine_shared = Arc::clone(&shared);
        let stop = Arc::new(tokio::sync::Notify::new());
        let stop_on_failure = Arc::clone(&stop);
        let engine = std::thread::Builder::new()
            .name("pagedattn-engine".into())
            .spawn(move || {
                // This thread as one of rayon's workers (as `pagedattn run` does): a step's
                // parallel products then split in place. (An error: the pool exists already.)
                let _ = rayon::ThreadPoolBuilder::new()
                    .use_current_thread()
                    .build_global();
                let parts = build()?;
                let model = parts.placed.model();
                let ready = Ready {
                    kind: model.kind(),
                    max_context: model.max_context(),
                    vocab: model.vocab_size(),
                    text: parts.text,
                    decoder_start: parts.decoder_start,
                };
                let (backends, models, abort) = parts.placed.into_parts();
                let engine = Engine::placed(&backends, models, abort, &parts.config)?;
                if ready_tx.send(ready).is_err() {
                    return Ok(Summary::default());
                }
                let _stop_on_panic = StopOnPanic {
                    stop: Arc::clone(&stop_on_failure),
                    shared: Arc::clone(&engine_shared),
                };
                let served = core::run(engine, command_rx, &engine_shared);
                if served.is_err() {
                    // An engine that failed serves no more: the server stops, and `wait`
                    // returns the error (a supervisor restarts the process, as with vLLM).
                    stop_on_failure.notify_one();
                }
                served
            })?;
        let Ok(ready) = ready_rx.recv() else {
            // The thread ended before the engine was ready: its error says why.
            return Err(match engine.join() {
                Ok(Err(e)) => e.into(),
                Ok(Ok(_)) => ServerError::Panicked("engine"),
                Err(_) => ServerError::Panicked("engine"),
            });
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.http_threads.max(1))
            .thread_name("pagedattn-http")
            .enable_all()
            .build()?;
        let state = Arc::new(routes::AppState {
            kind: ready.kind,
            decoder_start: ready.decoder_start,
            max_context: ready.max_context,
            vocab: ready.vocab,
            text: ready.text.map(Arc::new),
            commands,
            shared: Arc::clone(&shared),
            next_id: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            created: routes::unix_seconds(),
            config: config.clone(),
        });
        let stop_rx = Arc::clone(&stop);
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let http = std::thread::Builder::new()
            .name("pagedattn-http-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let shutdown = async move {
                        wait_for_stop(&stop_rx, config.handle_signals).await;
                        // New requests are refused from now; the engine aborts what has not
                        // finished by the deadline.
                        shared.stopping.store(true, Ordering::Relaxed);
                        *shared.deadline.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Instant::now() + config.shutdown_timeout);
                    };
                    axum::serve(listener, routes::router(state))
                        .with_graceful_shutdown(shutdown)
                        .await
                })
            })?;
        Ok(Server {
            addr,
            stop,
            http,
            engine,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Begins the shutdown (as SIGINT or SIGTERM does): new requests are refused, the
    /// requests in flight finish (or are aborted at the shutdown timeout), then the server
    /// stops. [`Server::wait`] returns when it has.
    pub fn shutdown(&self) {
        self.stop.notify_one();
    }

    /// Waits until the server has stopped; returns the engine loop's summary, or why it
    /// failed (a leaked block included: the block manager is checked at the end).
    pub fn wait(self) -> Result<Summary, ServerError> {
        let http = self.http.join().map_err(|_| ServerError::Panicked("http"));
        let engine = self
            .engine
            .join()
            .map_err(|_| ServerError::Panicked("engine"))?;
        let summary = engine?;
        http??;
        Ok(summary)
    }
}

/// Returns when [`Server::shutdown`] is called or, with `signals`, on SIGINT or SIGTERM.
async fn wait_for_stop(stop: &tokio::sync::Notify, signals: bool) {
    if !signals {
        stop.notified().await;
        return;
    }
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = stop.notified() => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
