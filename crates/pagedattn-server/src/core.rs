//! The engine loop: one thread owns the engine (vLLM's `EngineCore`). It takes requests and
//! aborts from the HTTP tasks between steps, runs steps while any request is unfinished, and
//! hands each request's tokens to its task as they are sampled. A request whose task went away
//! (the client disconnected) or stopped taking its tokens is aborted before the next step, its
//! blocks freed at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use pagedattn_engine::serving::batch::RequestId;
use pagedattn_engine::serving::engine::{Engine, EngineRequest};
use pagedattn_engine::serving::scheduler::{FinishReason, SchedulerError, StepEvent};
use tokio::sync::mpsc::Sender;

use crate::error::ApiError;
use crate::metrics::{Ending, Metrics};

/// A request for the engine, from an HTTP task.
pub(crate) struct Submission {
    /// The engine's id for it (unique over the server's life).
    pub id: RequestId,
    /// Which of its HTTP request's prompts it is.
    pub part: usize,
    /// The request.
    pub request: EngineRequest,
    /// When the HTTP request arrived (time to first token counts from here).
    pub arrived: Instant,
    /// Where its events go.
    pub events: Sender<Event>,
}

/// What an HTTP task asks of the engine loop.
pub(crate) enum Command {
    /// Queue a request.
    Add(Submission),
    /// Drop a request (its choices ended by stop strings).
    Abort(RequestId),
}

/// What the engine loop tells an HTTP task about one of its requests.
#[derive(Debug)]
pub(crate) enum Event {
    /// The request is queued.
    Accepted,
    /// The request was refused; nothing of it is queued.
    Rejected { error: ApiError },
    /// Tokens sampled in one step, as (sample, token).
    Tokens {
        part: usize,
        tokens: Vec<(usize, u32)>,
    },
    /// An encoder-only request's pooled output (its embedding), before its `Finished`.
    Pooled { part: usize, state: Vec<f32> },
    /// Every sample finished; each one's reason, in sample order.
    Finished {
        part: usize,
        reasons: Vec<FinishReason>,
    },
    /// The server stopped serving it (shutdown's deadline, or the engine failed).
    Aborted { why: ApiError },
}

/// What the engine loop and the HTTP side share.
pub(crate) struct Shared {
    /// The metrics, updated by the loop after each step.
    pub metrics: Mutex<Metrics>,
    /// Requests in the running batch (published after each step).
    pub running: AtomicUsize,
    /// Set when shutdown begins: new requests are refused.
    pub stopping: AtomicBool,
    /// When shutdown aborts the requests still unfinished.
    pub deadline: Mutex<Option<Instant>>,
    /// Why the engine stopped, if it failed.
    pub failure: Mutex<Option<String>>,
}

impl Shared {
    /// State for a server not yet serving.
    pub fn new() -> Self {
        Shared {
            metrics: Mutex::new(Metrics::default()),
            running: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            deadline: Mutex::new(None),
            failure: Mutex::new(None),
        }
    }

    /// The metrics, whatever a panicking holder left.
    pub fn metrics(&self) -> std::sync::MutexGuard<'_, Metrics> {
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the loop keeps of a request it serves.
struct Active {
    part: usize,
    events: Sender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// How the engine loop ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Requests that finished.
    pub finished: u64,
    /// Requests aborted (clients gone, stop strings, shutdown).
    pub aborted: u64,
    /// Steps run.
    pub steps: u64,
}

/// The HTTP error of a request the engine refused.
fn refusal(e: SchedulerError) -> ApiError {
    let param = match &e {
        SchedulerError::Rejected { field, .. } => match field.as_str() {
            "prompt + max_new_tokens" | "max_new_tokens" => "max_tokens",
            "sampling" => "temperature",
            other => other,
        },
        _ => "prompt",
    }
    .to_string();
    // (The engine's message names the request by its internal id: the client knows none.)
    let message = match e {
        SchedulerError::Rejected {
            field,
            value,
            expected,
            ..
        } => format!("{field} = {value}: expected {expected}"),
        other => other.to_string(),
    };
    ApiError::invalid(param, message)
}

/// Serves `engine` until every command sender is gone and no request is unfinished (or the
/// engine fails: every request then gets the error). After the loop the block manager's
/// check must pass: every block free, cached prefixes included.
pub(crate) fn run(
    mut engine: Engine<'_>,
    commands: Receiver<Command>,
    shared: &Shared,
) -> pagedattn_engine::Result<Summary> {
    let mut active: HashMap<RequestId, Active> = HashMap::new();
    let mut summary = Summary::default();
    let mut disconnected = false;
    shared.metrics().blocks_total = engine.num_blocks();
    loop {
        // Commands: waited for while idle, taken as they are between steps otherwise.
        if !engine.has_unfinished() && !disconnected {
            match commands.recv_timeout(Duration::from_millis(50)) {
                Ok(command) => take(&mut engine, command, &mut active, shared, &mut summary)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => disconnected = true,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(command) => take(&mut engine, command, &mut active, shared, &mut summary)?,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        let past_deadline = shared
            .deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|d| Instant::now() >= d);
        let gone: Vec<RequestId> = active
            .iter()
            .filter(|(_, a)| past_deadline || a.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(a) = active.remove(&id) {
                abort(&mut engine, id, Ending::Abort, shared, &mut summary)?;
                if past_deadline {
                    let _ = a.events.try_send(Event::Aborted {
                        why: ApiError::status(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the server shut down before the request finished",
                        ),
                    });
                }
            }
        }
        if !engine.has_unfinished() {
            publish(&engine, shared, &summary);
            if disconnected {
                break;
            }
            continue;
        }
        let output = match engine.step() {
            Ok(output) => output,
            Err(e) => {
                let why = ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the engine failed: {e}"),
                );
                for (_, a) in active.drain() {
                    let _ = a.events.try_send(Event::Aborted { why: why.clone() });
                }
                *shared.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return Err(e);
            }
        };
        let now = Instant::now();
        summary.steps += u64::from(output.record.is_some());
        // Each request's tokens of the step, in order, as one event.
        let mut tokens: Vec<(RequestId, Vec<(usize, u32)>)> = Vec::new();
        for t in &output.tokens {
            match tokens.last_mut() {
                Some((id, list)) if *id == t.request => list.push((t.sample, t.token)),
                _ => tokens.push((t.request, vec![(t.sample, t.token)])),
            }
        }
        let mut stalled = Vec::new();
        {
            let mut m = shared.metrics();
            m.generation_tokens += output.tokens.len() as u64;
            for (id, list) in tokens {
                let Some(a) = active.get_mut(&id) else {
                    continue;
                };
                match a.last_token {
                    None => m.ttft.observe((now - a.arrived).as_secs_f64()),
                    Some(last) => m.itl.observe((now - last).as_secs_f64()),
                }
                a.last_token = Some(now);
                let event = Event::Tokens {
                    part: a.part,
                    tokens: list,
                };
                // A full queue: a task that stopped reading; a closed one: a task gone.
                if a.events.try_send(event).is_err() {
                    stalled.push(id);
                }
            }
            for (id, state) in output.pooled {
                let Some(a) = active.get(&id) else {
                    continue;
                };
                let event = Event::Pooled {
                    part: a.part,
                    state,
                };
                if a.events.try_send(event).is_err() {
                    stalled.push(id);
                }
            }
            for event in output.events {
                match event {
                    StepEvent::Finished { request, samples } => {
                        let Some(a) = active.remove(&request) else {
                            continue;
                        };
                        let reasons: Vec<FinishReason> = samples.iter().map(|s| s.reason).collect();
                        let ending = if reasons.iter().any(|r| matches!(r, FinishReason::Stop(_))) {
                            Ending::Stop
                        } else {
                            Ending::Length
                        };
                        m.end(ending);
                        m.e2e.observe((now - a.arrived).as_secs_f64());
                        summary.finished += 1;
                        let _ = a.events.try_send(Event::Finished {
                            part: a.part,
                            reasons,
                        });
                    }
                    StepEvent::Preempted { .. } => m.preemptions += 1,
                    StepEvent::SwappedIn { .. } => {}
                }
            }
        }
        for id in stalled {
            if active.remove(&id).is_some() {
                abort(&mut engine, id, Ending::Abort, shared, &mut summary)?;
            }
        }
        publish(&engine, shared, &summary);
    }
    engine
        .scheduler()
        .blocks()
        .check()
        .map_err(|e| pagedattn_engine::Error::Accounting(e.to_string()))?;
    Ok(summary)
}

/// Aborts request `id` in the engine (between steps: every block freed) and counts it ended
/// for `why`.
fn abort(
    engine: &mut Engine<'_>,
    id: RequestId,
    why: Ending,
    shared: &Shared,
    summary: &mut Summary,
) -> pagedattn_engine::Result<()> {
    engine.abort(id)?;
    summary.aborted += 1;
    shared.metrics().end(why);
    Ok(())
}

/// Carries out one command.
fn take(
    engine: &mut Engine<'_>,
    command: Command,
    active: &mut HashMap<RequestId, Active>,
    shared: &Shared,
    summary: &mut Summary,
) -> pagedattn_engine::Result<()> {
    match command {
        Command::Add(s) => {
            let part = s.part;
            if shared.stopping.load(Ordering::Relaxed) {
                let error = ApiError::status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the server is shutting down",
                );
                let _ = s.events.try_send(Event::Rejected { error });
                return Ok(());
            }
            let prompt_tokens = s.request.prompt.len() as u64;
            match engine.add_request(s.id, s.request) {
                Ok(()) => {
                    shared.metrics().prompt_tokens += prompt_tokens;
                    let _ = s.events.try_send(Event::Accepted);
                    active.insert(
                        s.id,
                        Active {
                            part,
                            events: s.events,
                            arrived: s.arrived,
                            last_token: None,
                        },
                    );
                }
                Err(e) => {
                    let _ = s.events.try_send(Event::Rejected { error: refusal(e) });
                }
            }
        }
        // (Every choice ended by a stop string: a stop, for the metrics.)
        Command::Abort(id) => {
            if active.remove(&id).is_some() {
                abort(engine, id, Ending::Stop, shared, summary)?;
            }
        }
    }
    Ok(())
}

/// Publishes the queues and the cache's use.
fn publish(engine: &Engine<'_>, shared: &Shared, summary: &Summary) {
    let scheduler = engine.scheduler();
    let (waiting, running, swapped) = scheduler.queue_lengths();
    let stats = scheduler.stats();
    shared.running.store(running, Ordering::Relaxed);
    let mut m = shared.metrics();
    m.running = running;
    m.waiting = waiting;
    m.swapped = swapped;
    m.blocks_used = stats.blocks.device_blocks_in_use;
    m.prefix_queries = stats.blocks.prefix_query_tokens;
    m.prefix_hits = stats.blocks.prefix_hit_tokens;
    m.steps = summary.steps;
}
