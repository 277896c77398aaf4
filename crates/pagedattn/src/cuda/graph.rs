//! CUDA graphs of forward calls: [`Cuda::capture`](super::Cuda::capture) records the work a
//! closure queues on the backend's stream (a decode step of every layer, say) as one graph,
//! which [`Graph::replay`] launches again for later steps once their plans were refreshed in
//! place ([`AttentionImpl::replan`](crate::AttentionImpl::replan)).

use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};

use super::device::{driver_error, Gpu};
use crate::error::{Error, Result};

/// Work captured from a GPU's stream, launched as one unit.
pub struct Graph {
    graph: CudaGraph,
    gpu: Arc<Gpu>,
}

// SAFETY: a graph's handles (CUgraph, CUgraphExec) are driver objects any thread may use, one
// thread at a time (the driver does not synchronize concurrent use of one, which `&mut`-free
// `replay` cannot cause across threads without `Sync`); cudarc binds the graph's context to
// the calling thread before each launch and at the drop.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.gpu.ordinal)
            .finish_non_exhaustive()
    }
}

/// Runs `work` with `gpu`'s stream in capture mode and returns what it queued as a graph.
///
/// In `mode` `CU_STREAM_CAPTURE_MODE_GLOBAL`, while the capture lasts a call that could not be
/// part of a graph (an allocation, a synchronization, a module load) fails instead of
/// running, on every thread, so that nothing such slips into the captured step unnoticed;
/// in `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`, on this thread only (other threads drive other
/// GPUs). The capture ends whatever `work` returns; its error comes first.
pub(crate) fn capture(
    gpu: &Arc<Gpu>,
    mode: sys::CUstreamCaptureMode,
    work: impl FnOnce() -> Result<()>,
) -> Result<Graph> {
    // Outside the capture: a captured stream cannot wait for work that is not.
    gpu.wait_for_callers()
        .map_err(|e| driver_error("ordering the stream after callers' streams", e))?;
    gpu.stream
        .begin_capture(mode)
        .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
    let worked = work();
    let ended = gpu
        .stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| driver_error("cuStreamEndCapture / cuGraphInstantiate", e));
    worked?;
    match ended? {
        Some(graph) => Ok(Graph {
            graph,
            gpu: gpu.clone(),
        }),
        None => Err(Error::invalid(
            "capture",
            "no work",
            "at least one operation queued on the backend's stream",
        )),
    }
}

impl Graph {
    /// Queues the captured work on the stream again (without waiting for it).
    ///
    /// # Safety
    /// The graph holds the device addresses its calls used when captured: every tensor,
    /// cache, workspace and plan they named is still alive, none was reallocated, and each
    /// plan was refreshed only by `replan` (which keeps its memory and launch shapes) with
    /// metadata valid for the caches the calls used.
    pub unsafe fn replay(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| driver_error(&format!("cuGraphLaunch on cuda:{}", self.gpu.ordinal), e))
    }
}
