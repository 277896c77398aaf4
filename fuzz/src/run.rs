//! The backends the targets compare.

use pagedattn::cpu::{Cpu, Isa};
use pagedattn::reference::Reference;
use pagedattn::Backend;

/// The `cpu` backend on every instruction set this machine has (each has its own kernels, so
/// each is a separate backend to compare).
pub fn cpus() -> Vec<Cpu> {
    Isa::ALL
        .into_iter()
        .filter(|isa| isa.is_available())
        .map(|isa| Cpu::with_isa(isa).expect("an available instruction set starts"))
        .collect()
}

/// The `cpu` backend on this machine's best instruction set (for what does not depend on the
/// instruction set: plans, caches).
pub fn cpu() -> Cpu {
    Cpu::with_isa(Isa::detect()).expect("the detected instruction set starts")
}

/// `reference` and `cpu` on its best instruction set: the host backends, for what does not
/// depend on the instruction set.
pub fn host_backends() -> Vec<Box<dyn Backend>> {
    vec![Box::new(reference()), Box::new(cpu())]
}

/// `reference`, the oracle.
pub fn reference() -> Reference {
    Reference
}
