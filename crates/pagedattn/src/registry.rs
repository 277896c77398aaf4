//! Backend selection by name, or `auto` for the best one available here.

use crate::backend::Backend;
use crate::cpu::Cpu;
use crate::error::{Error, Result};
use crate::reference::Reference;

/// Every backend available on this machine, best first.
pub fn available_backends() -> Vec<Box<dyn Backend>> {
    let mut all: Vec<Box<dyn Backend>> = Vec::new();
    if let Ok(cpu) = Cpu::new() {
        all.push(Box::new(cpu));
    }
    all.push(Box::new(Reference));
    all
}

/// The backend called `name`, or the best available one for `auto`.
pub fn backend(name: &str) -> Result<Box<dyn Backend>> {
    let mut all = available_backends();
    if name == "auto" {
        return Ok(all.swap_remove(0));
    }
    let names: Vec<&str> = all.iter().map(|b| b.name()).collect();
    let available = format!("auto, {}", names.join(", "));
    match all.iter().position(|b| b.name() == name) {
        Some(i) => Ok(all.swap_remove(i)),
        None => Err(Error::invalid(
            "backend",
            format!("{name:?}"),
            format!("one of {available}"),
        )),
    }
}
