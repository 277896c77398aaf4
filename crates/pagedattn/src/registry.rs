//! Backend selection by name, or `auto` for the best one available here.

use crate::backend::Backend;
use crate::cpu::Cpu;
use crate::error::{Error, Result};
use crate::reference::Reference;

/// The names of the backends built into this binary, best first.
pub const BACKEND_NAMES: [&str; 2] = ["cpu", "reference"];

/// The backend called `name` (one of [`BACKEND_NAMES`]), or the best one for `auto`. A
/// backend that cannot start here says why (e.g. `PAGEDATTN_ISA` naming an instruction set
/// this CPU lacks) instead of being skipped.
pub fn backend(name: &str) -> Result<Box<dyn Backend>> {
    match name {
        "auto" => backend(BACKEND_NAMES[0]),
        "cpu" => Ok(Box::new(Cpu::new()?)),
        "reference" => Ok(Box::new(Reference)),
        _ => Err(Error::invalid(
            "backend",
            format!("{name:?}"),
            format!("one of auto, {}", BACKEND_NAMES.join(", ")),
        )),
    }
}

/// Every built-in backend: the backend, or why it cannot start here.
pub fn all_backends() -> Vec<(&'static str, Result<Box<dyn Backend>>)> {
    BACKEND_NAMES
        .into_iter()
        .map(|name| (name, backend(name)))
        .collect()
}
