//! Where memory lives and work runs.

use std::fmt;

/// A place memory lives: host memory, a CUDA GPU's memory, or page-locked host memory
/// registered with a CUDA GPU (the swap space that GPU copies to and from asynchronously).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Ordinary host memory; the `reference` and `cpu` backends compute here.
    Cpu,
    /// A CUDA GPU, by ordinal.
    Cuda(usize),
    /// Pinned host memory of CUDA GPU `n` (readable by the host only through a transfer).
    CudaHost(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::CudaHost(i) => write!(f, "pinned host memory of cuda:{i}"),
        }
    }
}
