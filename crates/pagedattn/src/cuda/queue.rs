//! Which stream the backend's work goes to, and what orders it with callers' streams.
//!
//! Every buffer this crate owns on a GPU is allocated and freed on the backend's own stream.
//! The work of a call (kernels, copies, events) goes to the caller's stream inside
//! [`Cuda::on_stream`](super::Cuda::on_stream), to the backend's stream otherwise. Instead of a
//! fork and a join around every call, two rules order the streams:
//! - before work goes to a caller's stream, that stream waits for the backend's stream if
//!   anything (an allocation, a memset, an upload) was queued there since it last waited: the
//!   backend's stream counts what it queues (a generation), each caller's stream remembers
//!   the count it waited for;
//! - before anything goes to the backend's stream, the backend's stream waits for the callers'
//!   streams: for an event recorded at the end of every `on_stream` call not waited for yet,
//!   and, inside an `on_stream` call on this thread, for the work queued on its stream so far.
//!
//! A steady run of calls on one caller's stream (a model's layers on torch's stream) thus
//! costs one event record per call and no cross-stream wait on the GPU. A stream being captured
//! into a graph follows neither rule (its work runs when the graph is replayed, ordered by
//! whoever replays it) and may not allocate.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::device::{driver_error, Gpu};
use crate::error::Result;

/// How a GPU's own stream is ordered with the callers' streams its work went to.
#[derive(Default)]
pub(crate) struct StreamOrder {
    /// Counts the operations queued on the backend's stream (incremented after each).
    generation: AtomicU64,
    /// Whether some caller's stream has a done event the backend's stream has not waited for.
    callers_pending: AtomicBool,
    state: Mutex<OrderState>,
}

#[derive(Default)]
struct OrderState {
    /// Recorded on the backend's stream for a caller's stream to wait for; made at first use.
    fork: Option<CudaEvent>,
    /// The callers' streams that work went to.
    callers: Vec<CallerState>,
}

/// What the backend knows of one caller's stream.
struct CallerState {
    /// `cuStreamGetId`: unique within the context for the life of the process, unlike a
    /// handle, which a stream created after this one was destroyed may reuse.
    id: u64,
    /// Recorded on the stream at the end of the last `on_stream` call.
    done: CudaEvent,
    /// Whether the backend's stream has yet to wait for `done`.
    pending: bool,
    /// The backend stream's generation this stream last waited for.
    seen: u64,
}

/// Caller streams the `CallerState` list keeps at most without a pending event (the rest,
/// streams not used lately, are forgotten: a stream seen again starts by waiting).
const REMEMBERED: usize = 8;

/// An `on_stream` call in progress on this thread.
struct Caller {
    ordinal: usize,
    stream: Arc<CudaStream>,
    id: u64,
    seen: u64,
    /// Whether the stream is being captured (then it never waits for the backend's stream,
    /// and the backend's stream never waits for it).
    capturing: bool,
}

thread_local! {
    /// The `on_stream` calls in progress on this thread, innermost last.
    static CALLERS: RefCell<Vec<Caller>> = const { RefCell::new(Vec::new()) };
}

impl Gpu {
    fn order_state(&self) -> MutexGuard<'_, OrderState> {
        // A panic never happens while the lock is held; the state stays valid if one did.
        self.order
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `work` with the stream a call's work goes to now: the caller's stream inside
    /// [`on_stream`](Gpu::on_stream) on this thread (after it waits for the backend's newer
    /// work), else the backend's stream (after it waits for the callers' streams).
    pub(crate) fn with_queue<R>(
        &self,
        work: impl FnOnce(&Arc<CudaStream>) -> Result<R>,
    ) -> Result<R> {
        let caller = CALLERS.with_borrow_mut(|callers| {
            let i = innermost(callers, self.ordinal)?;
            let caller = &mut callers[i];
            Some(self.catch_up(caller).map(|()| caller.stream.clone()))
        });
        match caller {
            Some(stream) => work(&stream?),
            None => self.with_own_stream(true, work),
        }
    }

    /// Runs `work` with the backend's own stream: after the callers' streams when
    /// `after_callers` (a free, or work that reads what they wrote), right away for an
    /// allocation (new memory nobody used). Whatever `work` queues there, a caller's stream
    /// waits for before its next work.
    pub(crate) fn with_own_stream<R>(
        &self,
        after_callers: bool,
        work: impl FnOnce(&Arc<CudaStream>) -> Result<R>,
    ) -> Result<R> {
        if after_callers {
            self.wait_for_callers()
                .map_err(|e| driver_error("cuEventRecord / cuStreamWaitEvent", e))?;
        }
        let result = work(&self.stream);
        // After the work is queued: a caller that reads the old count and waits misses
        // nothing it was told about.
        self.order.generation.fetch_add(1, Ordering::AcqRel);
        result
    }

    /// Makes the backend's stream wait for the work queued on callers' streams so far (see
    /// the module's second rule). A driver error: nothing to report it to when a buffer drops.
    pub(crate) fn wait_for_callers(&self) -> std::result::Result<(), DriverError> {
        let ours = self.stream.cu_stream();
        CALLERS.with_borrow(|callers| -> std::result::Result<(), DriverError> {
            let current = innermost(callers, self.ordinal).map(|i| &callers[i]);
            if let Some(caller) = current.filter(|c| !c.capturing) {
                let mut state = self.order_state();
                let entry = state.entry(&self.ctx, caller.id)?;
                // SAFETY: the caller's stream is live for its `on_stream` call (its contract).
                unsafe { record_and_wait(&entry.done, caller.stream.cu_stream(), ours) }?;
            }
            Ok(())
        })?;
        if self.order.callers_pending.swap(false, Ordering::AcqRel) {
            let mut state = self.order_state();
            for caller in state.callers.iter_mut().filter(|c| c.pending) {
                caller.pending = false;
                // SAFETY: the event belongs to this context; ours is live.
                unsafe { sys::cuStreamWaitEvent(ours, caller.done.cu_event(), 0) }.result()?;
            }
        }
        Ok(())
    }

    /// Makes `caller`'s stream wait for the backend's stream if it queued anything since the
    /// caller last waited (the module's first rule).
    fn catch_up(&self, caller: &mut Caller) -> Result<()> {
        if self.order.generation.load(Ordering::Acquire) <= caller.seen {
            return Ok(());
        }
        let mut state = self.order_state();
        // Read before the record: what is queued after the read is waited for next time.
        let generation = self.order.generation.load(Ordering::Acquire);
        if state.fork.is_none() {
            state.fork = Some(new_event(&self.ctx).map_err(|e| driver_error("cuEventCreate", e))?);
        }
        let fork = state.fork.as_ref().expect("made above");
        // SAFETY: the caller's stream is live for its `on_stream` call (its contract); the
        // lock keeps another thread from recording the fork event between record and wait.
        unsafe { record_and_wait(fork, self.stream.cu_stream(), caller.stream.cu_stream()) }
            .map_err(|e| driver_error("ordering the caller's stream after the backend's", e))?;
        caller.seen = generation;
        Ok(())
    }

    /// Runs `work` with this GPU's work going to `stream` (see the module's rules), on this
    /// thread: `stream` first waits for the backend's newer work; afterwards the backend's
    /// stream will wait for what was queued on `stream` before its next operation.
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU's context for the length of the call.
    pub(crate) unsafe fn on_stream<R>(
        &self,
        stream: sys::CUstream,
        work: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if stream == self.stream.cu_stream() {
            return work();
        }
        let driver = |call: &str, e| driver_error(&format!("{call} on the caller's stream"), e);
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is live (the contract); writes one status.
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) }
            .result()
            .map_err(|e| driver("cuStreamIsCapturing", e))?;
        let capturing = status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (id, seen) = if capturing {
            // A capturing stream may neither be asked its id nor wait for work outside the
            // capture: its work runs when the graph is replayed, ordered by whoever replays
            // it (see `Cuda::on_stream`).
            (0, u64::MAX)
        } else {
            let mut id = 0;
            // SAFETY: the stream is live (the contract); writes one integer.
            unsafe { sys::cuStreamGetId(stream, &mut id) }
                .result()
                .map_err(|e| driver("cuStreamGetId", e))?;
            let mut state = self.order_state();
            let entry = state
                .entry(&self.ctx, id)
                .map_err(|e| driver("cuEventCreate", e))?;
            (id, entry.seen)
        };
        let mut caller = Caller {
            ordinal: self.ordinal,
            // SAFETY: live for this call (the contract); the wrapper does not outlive it (the
            // guard pops it) and never destroys the stream.
            stream: unsafe { self.ctx.wrap_borrowed_stream(stream) },
            id,
            seen,
            capturing,
        };
        // Kernels of the caller's own in `work` may read what the backend's stream wrote.
        self.catch_up(&mut caller)?;
        CALLERS.with_borrow_mut(|callers| callers.push(caller));
        let guard = Popped;
        let result = work();
        let mut caller = guard.pop();
        let ended = if capturing {
            Ok(())
        } else {
            self.end_call(&mut caller)
        };
        let value = result?;
        ended?;
        Ok(value)
    }

    /// What ends an `on_stream` call on a stream not being captured: the caller's stream
    /// catches up with the backend's (so that a capture starting next finds nothing to wait
    /// for outside it) and records its done event.
    fn end_call(&self, caller: &mut Caller) -> Result<()> {
        self.catch_up(caller)?;
        let mut state = self.order_state();
        let entry = state
            .entry(&self.ctx, caller.id)
            .map_err(|e| driver_error("cuEventCreate", e))?;
        entry.seen = entry.seen.max(caller.seen);
        // SAFETY: the event belongs to this context; the stream is live for the call.
        unsafe { sys::cuEventRecord(entry.done.cu_event(), caller.stream.cu_stream()) }
            .result()
            .map_err(|e| driver_error("cuEventRecord on the caller's stream", e))?;
        entry.pending = true;
        self.order.callers_pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether this thread is inside an `on_stream` call on this GPU whose stream is being
    /// captured into a graph (where nothing may be allocated: the graph would outlive it).
    pub(crate) fn capturing_caller(&self) -> bool {
        CALLERS.with_borrow(|callers| {
            innermost(callers, self.ordinal).is_some_and(|i| callers[i].capturing)
        })
    }

    /// Waits until everything queued so far on the stream work goes to now (see
    /// [`with_queue`](Gpu::with_queue)) is done: the caller's stream inside `on_stream`, else
    /// the backend's after the callers' streams.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.with_queue(|stream| {
            stream.synchronize().map_err(|e| {
                driver_error(
                    &format!("synchronizing cuda:{} (cuStreamSynchronize)", self.ordinal),
                    e,
                )
            })
        })
    }
}

/// The index of this thread's innermost `on_stream` call on GPU `ordinal`, if any.
fn innermost(callers: &[Caller], ordinal: usize) -> Option<usize> {
    callers.iter().rposition(|c| c.ordinal == ordinal)
}

/// Pops this thread's innermost `on_stream` call when dropped, so that a panic in its work
/// leaves no borrowed stream behind.
struct Popped;

impl Popped {
    /// Pops the call now.
    fn pop(self) -> Caller {
        std::mem::forget(self);
        CALLERS
            .with_borrow_mut(|callers| callers.pop())
            .expect("pushed by on_stream")
    }
}

impl Drop for Popped {
    fn drop(&mut self) {
        CALLERS.with_borrow_mut(|callers| callers.pop());
    }
}

impl OrderState {
    /// The entry of the caller's stream `id`, made if new.
    fn entry(
        &mut self,
        ctx: &Arc<cudarc::driver::CudaContext>,
        id: u64,
    ) -> std::result::Result<&mut CallerState, DriverError> {
        if let Some(i) = self.callers.iter().position(|c| c.id == id) {
            return Ok(&mut self.callers[i]);
        }
        if self.callers.len() >= REMEMBERED {
            self.callers.retain(|c| c.pending);
        }
        self.callers.push(CallerState {
            id,
            done: new_event(ctx)?,
            pending: false,
            seen: 0,
        });
        Ok(self.callers.last_mut().expect("pushed"))
    }
}

/// An event without timing (cheaper to record and wait for).
fn new_event(
    ctx: &Arc<cudarc::driver::CudaContext>,
) -> std::result::Result<CudaEvent, DriverError> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
}

/// Records `event` on `earlier` and makes `later` wait for it.
///
/// # Safety
/// Both streams are live streams of the event's context; nothing records `event` between the
/// two calls (the wait reads its state when it is queued).
unsafe fn record_and_wait(
    event: &CudaEvent,
    earlier: sys::CUstream,
    later: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe {
        sys::cuEventRecord(event.cu_event(), earlier).result()?;
        sys::cuStreamWaitEvent(later, event.cu_event(), 0).result()
    }
}
