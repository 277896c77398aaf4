//! [`AttentionClock`]: how long a step's attention calls take, for the report's attention
//! share, without stalling a GPU.

use std::time::Instant;

use pagedattn::Backend;

use crate::Result;

/// Times the attention calls of a step: on the host, wall time up to the backend's
/// `synchronize` after each call; on a CUDA GPU, events recorded on the backend's stream
/// around each call, read once per step (so the GPU never waits for the host in between).
pub(crate) enum AttentionClock {
    /// Not timed (a tensor-parallel rank other than 0: the report states rank 0's time).
    Off,
    /// Seconds so far this step.
    Host(f64),
    /// Each call's start and end events (the first `used` pairs recorded this step; events
    /// are created once and recorded again in later steps).
    #[cfg(feature = "cuda")]
    Gpu {
        cuda: pagedattn::cuda::Cuda,
        spans: Vec<(pagedattn::cuda::GpuEvent, pagedattn::cuda::GpuEvent)>,
        used: usize,
    },
}

impl AttentionClock {
    /// The clock for `backend`'s device.
    pub(crate) fn new(backend: &dyn Backend) -> Result<Self> {
        Ok(match backend.device() {
            #[cfg(feature = "cuda")]
            pagedattn::Device::Cuda(i) => AttentionClock::Gpu {
                cuda: pagedattn::cuda::Cuda::new(i)?,
                spans: Vec::new(),
                used: 0,
            },
            _ => AttentionClock::Host(0.0),
        })
    }

    /// Runs `call` (which queues one attention call on `backend`) and times it.
    pub(crate) fn time(
        &mut self,
        backend: &dyn Backend,
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match self {
            AttentionClock::Off => call()?,
            AttentionClock::Host(seconds) => {
                let start = Instant::now();
                call()?;
                backend.synchronize()?;
                *seconds += start.elapsed().as_secs_f64();
            }
            #[cfg(feature = "cuda")]
            AttentionClock::Gpu { cuda, spans, used } => {
                if let Some((start, _)) = spans.get(*used) {
                    start.record(cuda)?;
                } else {
                    spans.push((cuda.record_event()?, cuda.record_event()?));
                }
                call()?;
                spans[*used].1.record(cuda)?;
                *used += 1;
            }
        }
        Ok(())
    }

    /// The step's attention seconds so far (waiting for a GPU's last call), and a fresh
    /// start for the next step.
    pub(crate) fn take_seconds(&mut self) -> Result<f64> {
        match self {
            AttentionClock::Off => Ok(0.0),
            AttentionClock::Host(seconds) => Ok(std::mem::take(seconds)),
            #[cfg(feature = "cuda")]
            AttentionClock::Gpu { spans, used, .. } => {
                let mut total = 0.0;
                for (start, end) in &spans[..std::mem::take(used)] {
                    total += start.seconds_until(end)?;
                }
                Ok(total)
            }
        }
    }
}
