//! The HTTP side: OpenAI's endpoints, `/health` and `/metrics`. A generation request is read
//! and checked here (tokenized, templated), its prompts handed to the engine loop, and its
//! tokens turned into text and stop-string decisions as they come back, either streamed as
//! server-sent events or gathered into one response.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender as CommandSender;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use pagedattn_engine::models::chat::ChatTemplate;
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::batch::RequestId;
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::scheduler::FinishReason;
use serde_json::{json, Value};
use tokio::sync::mpsc::{channel, Receiver};

use crate::core::{Command, Event, Shared, Submission};
use crate::error::ApiError;
use crate::openai::{self, EncodingFormat, Generation, ModelInfo};
use crate::text::ChoiceText;
use crate::ServerConfig;

/// Events queued per HTTP request: a client that falls this many steps behind has stopped
/// reading, and its request is aborted.
const EVENT_QUEUE: usize = 1024;

/// What every handler sees.
pub(crate) struct AppState {
    pub config: ServerConfig,
    pub max_context: usize,
    pub vocab: usize,
    pub text: Option<Arc<(Tokenizer, ChatTemplate)>>,
    pub commands: CommandSender<Command>,
    pub shared: Arc<Shared>,
    pub next_id: AtomicU64,
    /// Engine requests handed over and not yet ended.
    pub pending: AtomicUsize,
    /// Seconds since the epoch when the server started (the model's `created`).
    pub created: u64,
    /// What the model computes (which endpoints answer).
    pub kind: ModelKind,
    /// An encoder-decoder model's decoder start token.
    pub decoder_start: Option<u32>,
}

impl AppState {
    fn model(&self) -> ModelInfo<'_> {
        ModelInfo {
            name: &self.config.model_name,
            max_context: self.max_context,
            vocab: self.vocab,
            text: self.text.as_deref(),
            max_n: self.config.max_n,
            kind: self.kind,
            decoder_start: self.decoder_start,
        }
    }
}

/// The router over `state`.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::status(StatusCode::NOT_FOUND, "no such endpoint").with_code("not_found")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::status(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this endpoint",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    json_response(json!({
        "object": "list",
        "data": [{
            "id": s.config.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "pagedattn",
            "root": s.config.model_name,
            "max_model_len": s.max_context,
        }],
    }))
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s
        .shared
        .failure
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
    {
        None => StatusCode::OK.into_response(),
        Some(why) => ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the engine failed: {why}"),
        )
        .into_response(),
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s.shared.metrics().render(&s.config.model_name);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The endpoints that run the engine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completion,
    Chat,
    Embeddings,
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Completion).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Chat).await
}

async fn embeddings(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Embeddings).await
}

async fn generate(
    s: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    let answer = async {
        let bytes = body.map_err(|e| {
            let status = e.status();
            let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
                format!("the request body is over {} bytes", s.config.max_body_bytes)
            } else {
                e.body_text()
            };
            ApiError::status(status, message)
        })?;
        let (spec, format) = match endpoint {
            Endpoint::Completion => (openai::completion(&bytes, &s.model())?, None),
            Endpoint::Chat => (openai::chat_completion(&bytes, &s.model())?, None),
            Endpoint::Embeddings => {
                let e = openai::embeddings(&bytes, &s.model())?;
                (Generation::pooled(e.requests), Some(e.format))
            }
        };
        let run = Run::start(Arc::clone(&s), spec, endpoint).await?;
        Ok::<_, ApiError>(match format {
            Some(format) => run.embeddings(format).await?,
            None if run.stream => run.into_stream(),
            None => run.gather().await?,
        })
    }
    .await;
    answer.unwrap_or_else(|e| {
        s.shared.metrics().refuse(e.status.as_u16());
        e.into_response()
    })
}

/// One engine request of a run.
struct PartState {
    id: RequestId,
    prompt_len: usize,
    done: bool,
}

/// One choice of a run.
struct Choice {
    text: Option<ChoiceText>,
    token_ids: Vec<u32>,
    finish: Option<&'static str>,
    /// Whether the role delta of a chat stream went out.
    started: bool,
}

/// New output of one choice.
struct Delta {
    index: usize,
    text: String,
    token_ids: Vec<u32>,
    finish: Option<&'static str>,
}

/// A generation request in flight: its engine requests' events turned into choices' deltas.
/// Dropping it (the client went away) closes its event queue: the engine loop aborts what is
/// left of it before its next step.
struct Run {
    state: Arc<AppState>,
    endpoint: Endpoint,
    events: Receiver<Event>,
    backlog: VecDeque<Event>,
    parts: Vec<PartState>,
    choices: Vec<Choice>,
    /// Each encoder-only request's pooled output, as it comes.
    pooled: Vec<Option<Vec<f32>>>,
    n: usize,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    id: String,
    created: u64,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.state
            .pending
            .fetch_sub(self.parts.len(), Ordering::Relaxed);
    }
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Run {
    /// Hands the prompts to the engine loop and waits until each is queued (or one refused:
    /// the others are then dropped with the run).
    async fn start(
        state: Arc<AppState>,
        spec: Generation,
        endpoint: Endpoint,
    ) -> Result<Run, ApiError> {
        let arrived = Instant::now();
        if state.shared.stopping.load(Ordering::Relaxed) {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            ));
        }
        let parts = spec.requests.len();
        let before = state.pending.fetch_add(parts, Ordering::Relaxed);
        let (tx, events) = channel(EVENT_QUEUE);
        let first = state.next_id.fetch_add(parts as u64, Ordering::Relaxed);
        let mut run = Run {
            endpoint,
            events,
            backlog: VecDeque::new(),
            parts: Vec::with_capacity(parts),
            choices: Vec::new(),
            pooled: vec![None; parts],
            n: spec.n,
            stop: spec.stop,
            stream: spec.stream,
            include_usage: spec.include_usage,
            return_token_ids: spec.return_token_ids,
            id: format!("{:x}{first:08x}", state.created),
            created: unix_seconds(),
            state,
        };
        let waiting = before.saturating_sub(run.state.shared.running.load(Ordering::Relaxed));
        // (`parts` is counted in `pending` from here: the drop subtracts it.)
        run.parts.extend((0..parts).map(|i| PartState {
            id: first + i as u64,
            prompt_len: 0,
            done: false,
        }));
        if waiting + parts > run.state.config.max_waiting {
            let mut e = ApiError::status(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the server's queue is full ({waiting} requests waiting, at most {}): retry later",
                    run.state.config.max_waiting
                ),
            )
            .with_code("queue_full");
            e.retry_after = Some(1);
            return Err(e);
        }
        for (part, request) in spec.requests.into_iter().enumerate() {
            run.parts[part].prompt_len =
                request.prompt.len() + request.encoder_prompt.as_ref().map_or(0, Vec::len);
            let text = run
                .state
                .text
                .is_some()
                .then(|| ChoiceText::new(&request.prompt));
            run.choices.extend((0..spec.n).map(|_| Choice {
                text: text.clone(),
                token_ids: Vec::new(),
                finish: None,
                started: false,
            }));
            let submitted = run.state.commands.send(Command::Add(Submission {
                id: run.parts[part].id,
                part,
                request,
                arrived,
                events: tx.clone(),
            }));
            if submitted.is_err() {
                return Err(engine_gone());
            }
        }
        drop(tx);
        let mut acked = 0;
        while acked < parts {
            match run.events.recv().await {
                Some(Event::Accepted) => acked += 1,
                Some(Event::Rejected { error }) => return Err(error),
                Some(other) => run.backlog.push_back(other),
                None => return Err(engine_gone()),
            }
        }
        Ok(run)
    }

    /// The next deltas (`None` once every choice has finished).
    async fn next(&mut self) -> Result<Option<Vec<Delta>>, ApiError> {
        loop {
            if self.parts.iter().all(|p| p.done) {
                return Ok(None);
            }
            let event = match self.backlog.pop_front() {
                Some(e) => e,
                None => self.events.recv().await.ok_or_else(engine_gone)?,
            };
            let deltas = match event {
                Event::Tokens { part, tokens } => self.tokens(part, tokens),
                Event::Pooled { part, state } => {
                    if let Some(slot) = self.pooled.get_mut(part) {
                        *slot = Some(state);
                    }
                    Vec::new()
                }
                Event::Finished { part, reasons } => self.finished(part, &reasons),
                Event::Aborted { why } => return Err(why),
                Event::Accepted | Event::Rejected { .. } => Vec::new(),
            };
            if !deltas.is_empty() {
                return Ok(Some(deltas));
            }
        }
    }

    fn tokens(&mut self, part: usize, tokens: Vec<(usize, u32)>) -> Vec<Delta> {
        if self.parts.get(part).is_none_or(|p| p.done) {
            return Vec::new();
        }
        let text = self.state.text.as_deref();
        let mut deltas: Vec<Delta> = Vec::new();
        for (sample, token) in tokens {
            let index = part * self.n + sample;
            let Some(choice) = self.choices.get_mut(index) else {
                continue;
            };
            if choice.finish.is_some() {
                continue;
            }
            choice.token_ids.push(token);
            let new_text = match (&mut choice.text, &text) {
                (Some(t), Some(tk)) => t.push(&tk.0, token, &self.stop).unwrap_or_default(),
                _ => String::new(),
            };
            if choice.text.as_ref().is_some_and(ChoiceText::stopped) {
                choice.finish = Some("stop");
            }
            match deltas.iter_mut().find(|d| d.index == index) {
                Some(d) => {
                    d.text.push_str(&new_text);
                    d.token_ids.push(token);
                    d.finish = choice.finish;
                }
                None => deltas.push(Delta {
                    index,
                    text: new_text,
                    token_ids: vec![token],
                    finish: choice.finish,
                }),
            }
        }
        // Every choice of the prompt ended by a stop string: the engine may drop it.
        let range = part * self.n..(part + 1) * self.n;
        if self.choices[range].iter().all(|c| c.finish.is_some()) {
            self.parts[part].done = true;
            let _ = self
                .state
                .commands
                .send(Command::Abort(self.parts[part].id));
        }
        // (A model without a tokenizer streams a chunk a step, text or not: its clients
        // count tokens by chunks.)
        let every = self.return_token_ids || self.state.text.is_none();
        deltas.retain(|d| every || !d.text.is_empty() || d.finish.is_some());
        deltas
    }

    fn finished(&mut self, part: usize, reasons: &[FinishReason]) -> Vec<Delta> {
        let Some(p) = self.parts.get_mut(part).filter(|p| !p.done) else {
            return Vec::new();
        };
        p.done = true;
        let mut deltas = Vec::new();
        let text = self.state.text.as_deref();
        for (sample, reason) in reasons.iter().enumerate() {
            let index = part * self.n + sample;
            let Some(choice) = self.choices.get_mut(index) else {
                continue;
            };
            if choice.finish.is_some() {
                continue;
            }
            let rest = match (&mut choice.text, &text) {
                (Some(t), Some(tk)) => t.finish(&tk.0, &self.stop).unwrap_or_default(),
                _ => String::new(),
            };
            choice.finish = Some(match reason {
                FinishReason::Length => "length",
                FinishReason::Stop(_) => "stop",
            });
            deltas.push(Delta {
                index,
                text: rest,
                token_ids: Vec::new(),
                finish: choice.finish,
            });
        }
        deltas
    }

    fn usage(&self) -> Value {
        let prompt: usize = self.parts.iter().map(|p| p.prompt_len).sum();
        let completion: usize = self.choices.iter().map(|c| c.token_ids.len()).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }

    fn object(&self, chunk: bool) -> (&'static str, String) {
        match (self.endpoint, chunk) {
            (Endpoint::Completion, _) => ("text_completion", format!("cmpl-{}", self.id)),
            (Endpoint::Chat, false) => ("chat.completion", format!("chatcmpl-{}", self.id)),
            (Endpoint::Chat, true) => ("chat.completion.chunk", format!("chatcmpl-{}", self.id)),
            (Endpoint::Embeddings, _) => ("list", format!("embd-{}", self.id)),
        }
    }

    /// The embeddings answer: every input's pooled output, as `format` writes it.
    async fn embeddings(mut self, format: EncodingFormat) -> Result<Response, ApiError> {
        while self.next().await?.is_some() {}
        let mut data = Vec::with_capacity(self.pooled.len());
        for (index, state) in self.pooled.iter().enumerate() {
            let state = state.as_ref().ok_or_else(|| {
                ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the engine finished input {index} without its embedding"),
                )
            })?;
            let embedding = match format {
                EncodingFormat::Float => json!(state),
                EncodingFormat::Base64 => {
                    use base64::Engine as _;
                    let bytes: Vec<u8> = state.iter().flat_map(|v| v.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
        }
        let prompt: usize = self.parts.iter().map(|p| p.prompt_len).sum();
        Ok(json_response(json!({
            "object": "list", "data": data, "model": self.state.config.model_name,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        })))
    }

    /// The whole answer at once.
    async fn gather(mut self) -> Result<Response, ApiError> {
        let mut texts = vec![String::new(); self.choices.len()];
        while let Some(deltas) = self.next().await? {
            for d in deltas {
                texts[d.index].push_str(&d.text);
            }
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .zip(texts)
            .enumerate()
            .map(|(index, (c, text))| {
                let mut choice = match self.endpoint {
                    Endpoint::Completion | Endpoint::Embeddings => json!({
                        "index": index, "text": text, "logprobs": null,
                        "finish_reason": c.finish,
                    }),
                    Endpoint::Chat => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null, "finish_reason": c.finish,
                    }),
                };
                if self.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                }
                choice
            })
            .collect();
        let (object, id) = self.object(false);
        Ok(json_response(json!({
            "id": id, "object": object, "created": self.created,
            "model": self.state.config.model_name,
            "choices": choices, "usage": self.usage(),
        })))
    }

    /// One chunk of a stream, as its event's bytes.
    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> String {
        let (object, id) = self.object(true);
        let mut chunk = json!({
            "id": id, "object": object, "created": self.created,
            "model": self.state.config.model_name, "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        format!("data: {chunk}\n\n")
    }

    /// A stream's chunks for some deltas.
    fn stream_chunks(&mut self, deltas: Vec<Delta>) -> String {
        let mut out = String::new();
        for d in deltas {
            // (Embeddings never stream.)
            let mut choice = match self.endpoint {
                Endpoint::Completion | Endpoint::Embeddings => json!({
                    "index": d.index, "text": d.text, "logprobs": null, "finish_reason": d.finish,
                }),
                Endpoint::Chat => {
                    let started = std::mem::replace(&mut self.choices[d.index].started, true);
                    if !started {
                        let role = json!({
                            "index": d.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": null, "finish_reason": null,
                        });
                        out.push_str(&self.chunk(vec![role], None));
                    }
                    let delta = if d.text.is_empty() && d.finish.is_some() {
                        json!({})
                    } else {
                        json!({"content": d.text})
                    };
                    json!({"index": d.index, "delta": delta, "logprobs": null, "finish_reason": d.finish})
                }
            };
            if self.return_token_ids {
                choice["token_ids"] = json!(d.token_ids);
            }
            out.push_str(&self.chunk(vec![choice], None));
        }
        out
    }

    /// The answer as server-sent events: chunks as tokens come, usage last where asked for,
    /// then `[DONE]`; an error midway is sent as an error object before `[DONE]`.
    fn into_stream(self) -> Response {
        let stream = futures_util::stream::unfold(Some(self), |run| async move {
            let mut run = run?;
            match run.next().await {
                Ok(Some(deltas)) => {
                    let text = run.stream_chunks(deltas);
                    Some((
                        Ok::<_, std::convert::Infallible>(Bytes::from(text)),
                        Some(run),
                    ))
                }
                Ok(None) => {
                    let mut text = String::new();
                    if run.include_usage {
                        let usage = run.usage();
                        text.push_str(&run.chunk(Vec::new(), Some(usage)));
                    }
                    text.push_str("data: [DONE]\n\n");
                    Some((Ok(Bytes::from(text)), None))
                }
                Err(e) => {
                    let text = format!("data: {}\n\ndata: [DONE]\n\n", e.body());
                    Some((Ok(Bytes::from(text)), None))
                }
            }
        });
        (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(stream),
        )
            .into_response()
    }
}

fn json_response(value: Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn engine_gone() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "the engine is not serving (it stopped or failed: see /health)",
    )
}
