//! [`StepWatchdog`]: the ranks' step never hangs. A rank that waits in a collective whose peer
//! never comes (a bug that gives ranks different collectives, a GPU that stopped) would wait
//! forever; the watchdog's thread aborts the ranks' collectives once a step has run past its
//! timeout (PyTorch's NCCL watchdog does the same for its process groups), and the step
//! returns an error saying so.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::rank::AbortRanks;
use crate::{Error, Result};

/// How long a step of several ranks may run before the watchdog aborts it by default:
/// minutes, so that a first step compiling its kernels (seconds each with NVRTC) is not cut.
pub const DEFAULT_RANK_TIMEOUT: Duration = Duration::from_secs(600);

/// What the watchdog's thread and the engine share.
struct Watch {
    timeout: Duration,
    /// The step in progress: its number and start.
    running: Option<(u64, Instant)>,
    /// The last step the watchdog aborted.
    fired: Option<u64>,
    stop: bool,
}

/// A thread that aborts the ranks when a step runs past the timeout (see the module doc).
pub(crate) struct StepWatchdog {
    shared: Arc<(Mutex<Watch>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    next: u64,
}

/// The watch, whatever a panicking holder left (it holds plain values).
fn lock(m: &Mutex<Watch>) -> MutexGuard<'_, Watch> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StepWatchdog {
    /// A watchdog that calls `abort` when a step runs past [`DEFAULT_RANK_TIMEOUT`].
    pub(crate) fn new(abort: AbortRanks) -> Result<Self> {
        let shared = Arc::new((
            Mutex::new(Watch {
                timeout: DEFAULT_RANK_TIMEOUT,
                running: None,
                fired: None,
                stop: false,
            }),
            Condvar::new(),
        ));
        let watched = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("rank-watchdog".into())
            .spawn(move || watch(&watched, &abort))
            .map_err(|e| Error::Model(format!("starting the ranks' watchdog: {e}")))?;
        Ok(StepWatchdog {
            shared,
            thread: Some(thread),
            next: 0,
        })
    }

    /// Steps may run this long from now on.
    pub(crate) fn set_timeout(&self, timeout: Duration) {
        lock(&self.shared.0).timeout = timeout;
        self.shared.1.notify_all();
    }

    /// Runs `step` watched: an error if the watchdog aborted it (the ranks' own errors are
    /// then its consequences), else what it returned.
    pub(crate) fn watch<T>(&mut self, step: impl FnOnce() -> Result<T>) -> Result<T> {
        let id = self.next;
        self.next += 1;
        lock(&self.shared.0).running = Some((id, Instant::now()));
        self.shared.1.notify_all();
        let result = step();
        let mut w = lock(&self.shared.0);
        w.running = None;
        self.shared.1.notify_all();
        if w.fired == Some(id) {
            return Err(Error::Model(format!(
                "a step (or the start's CUDA-graph capture) ran past the ranks' timeout of \
                 {:?}: its collectives were aborted (a rank waited for peers that never came)",
                w.timeout
            )));
        }
        result
    }
}

/// The watchdog's loop: sleeps until a step starts, then until it ends or its time is up.
fn watch(shared: &(Mutex<Watch>, Condvar), abort: &AbortRanks) {
    let (m, wake) = shared;
    let mut w = lock(m);
    loop {
        if w.stop {
            return;
        }
        match w.running {
            None => w = wake.wait(w).unwrap_or_else(|p| p.into_inner()),
            Some((id, start)) if w.fired != Some(id) => {
                let elapsed = start.elapsed();
                if elapsed < w.timeout {
                    let left = w.timeout - elapsed;
                    w = wake
                        .wait_timeout(w, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    continue;
                }
                w.fired = Some(id);
                // (Not under the lock: the abort waits for no one, but the engine's thread
                // takes the lock when the step returns.)
                drop(w);
                abort();
                w = lock(m);
            }
            // This step was aborted: wait for it to end.
            Some(_) => w = wake.wait(w).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

impl Drop for StepWatchdog {
    fn drop(&mut self) {
        lock(&self.shared.0).stop = true;
        self.shared.1.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
