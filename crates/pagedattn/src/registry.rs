//! Backend selection by name, or `auto` for the best one available here.

use crate::backend::Backend;
use crate::cpu::Cpu;
use crate::error::{Error, Result};
use crate::reference::Reference;

/// The names of the backends of this library.
pub const BACKEND_NAMES: [&str; 3] = ["cpu", "cuda", "reference"];

/// The backend called `name` (one of [`BACKEND_NAMES`]), or for `auto` the best one here:
/// `cuda` on GPU 0 where the driver sees a GPU, else `cpu`. A backend that cannot start says
/// why (e.g. `PAGEDATTN_ISA` naming an instruction set this CPU lacks, or a GPU without
/// NVRTC) instead of being skipped, under `auto` too.
pub fn backend(name: &str) -> Result<Box<dyn Backend>> {
    match name {
        "auto" if gpu_present() => cuda(),
        "auto" => backend("cpu"),
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

/// Whether the driver sees a GPU.
#[cfg(feature = "cuda")]
fn gpu_present() -> bool {
    crate::cuda::gpu_present()
}

/// No GPU in a build without the `cuda` backend.
#[cfg(not(feature = "cuda"))]
fn gpu_present() -> bool {
    false
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
