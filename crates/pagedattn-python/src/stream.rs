//! The caller's CUDA stream: which one a call is ordered on, and running the call there.

use pyo3::prelude::*;

use crate::backend::Kind;
use crate::dlpack;
use crate::errors::{type_error, OrPyErr};

/// The stream a call on `kind` is ordered on: none for the host backends; for a GPU, `stream`
/// if given (a raw `cudaStream_t` as an int, or an object with `.cuda_stream` such as a
/// `torch.cuda.Stream`), else the current stream of the framework of the first of `tensors`
/// that names one (DLPack's exchange API), else torch's current stream, else the null stream.
pub fn target<'py, 'a>(
    kind: &Kind,
    stream: Option<&Bound<'py, PyAny>>,
    tensors: impl IntoIterator<Item = &'a Bound<'py, PyAny>>,
) -> PyResult<Option<u64>>
where
    'py: 'a,
{
    let ordinal = match kind.device() {
        pagedattn::Device::Cuda(n) => n,
        _ => return Ok(None),
    };
    if let Some(s) = stream {
        let raw = if let Ok(raw) = s.extract::<u64>() {
            raw
        } else if let Ok(attr) = s.getattr("cuda_stream") {
            attr.extract::<u64>()?
        } else {
            return Err(type_error(
                "stream",
                s.get_type().name()?,
                "an int (cudaStream_t) or an object with .cuda_stream (torch.cuda.Stream)",
            ));
        };
        return Ok(Some(raw));
    }
    let mut py = None;
    for t in tensors {
        py = Some(t.py());
        if let Some(current) = dlpack::current_stream(t, ordinal)? {
            return Ok(Some(current));
        }
    }
    // No exchange API (numpy, an older torch): ask torch, if it is loaded.
    if let Some(py) = py {
        let modules = py.import("sys")?.getattr("modules")?;
        if let Ok(Some(torch)) = modules.get_item("torch").map(Some) {
            let current = torch
                .getattr("cuda")?
                .call_method1("current_stream", (ordinal,))?
                .getattr("cuda_stream")?
                .extract::<u64>()?;
            return Ok(Some(current));
        }
    }
    Ok(Some(0))
}

/// Runs `work` without the GIL, ordered on `on` (see [`target`]) for a GPU backend.
pub fn run<R: Send>(
    py: Python<'_>,
    kind: &Kind,
    on: Option<u64>,
    work: impl FnOnce() -> pagedattn::Result<R> + Send,
) -> PyResult<R> {
    py.detach(|| match (kind, on) {
        #[cfg(feature = "cuda")]
        // SAFETY: the stream is the framework's current stream of this GPU, or one the
        // caller names; torch's streams (and the null stream) live in the GPU's primary
        // context, which the backend uses. A raw stream handle is trusted as torch trusts
        // `torch.cuda.ExternalStream`'s.
        (Kind::Cuda(cuda), Some(stream)) => unsafe { cuda.on_stream(stream as usize as _, work) },
        _ => work(),
    })
    .py()
}
