//! Backend selection by name, or `auto` for the best one available here.

use crate::backend::Backend;
use crate::cpu::Cpu;
use crate::error::{Error, Result};
use crate::reference::Reference;

/// The names of the backends of this library.
pub const BACKEND_NAMES: [&str; 3] = ["cpu", "cuda", "reference"];

/// What `auto` picks: the first of these that starts here. `cuda` joins once its attention
/// kernels exist (until then its `forward` answers `Unsupported`).
const AUTO_ORDER: [&str; 2] = ["cpu", "reference"];

/// The backend called `name` (one of [`BACKEND_NAMES`]), or the best one for `auto`. A
/// backend that cannot start here says why (e.g. `PAGEDATTN_ISA` naming an instruction set
/// this CPU lacks, or no usable GPU) instead of being skipped.
pub fn backend(name: &str) -> Result<Box<dyn Backend>> {
    match name {
        "auto" => backend(AUTO_ORDER[0]),
        "cpu" => Ok(Box::new(Cpu::new()?)),
        "cuda" => cuda(),
        "reference" => Ok(Box::new(Reference)),
        _ => Err(Error::invalid(
            "backend",
            format!("{name:?}"),
            format!("one of auto, {}", BACKEND_NAMES.join(", ")),
        )),
    }
}

/// The `cuda` backend on GPU 0.
#[cfg(feature = "cuda")]
fn cuda() -> Result<Box<dyn Backend>> {
    Ok(Box::new(crate::cuda::Cuda::new(0)?))
}

/// The `cuda` backend in a build without it.
#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Box<dyn Backend>> {
    Err(Error::unsupported(
        "cuda",
        "this build (compiled without the `cuda` feature)",
    ))
}

/// Every backend of the library: the backend, or why it cannot start here.
pub fn all_backends() -> Vec<(&'static str, Result<Box<dyn Backend>>)> {
    BACKEND_NAMES
        .into_iter()
        .map(|name| (name, backend(name)))
        .collect()
}
