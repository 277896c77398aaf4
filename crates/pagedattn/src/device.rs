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

/// A device's memory in bytes: what it has and what is free to allocate now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// All of it (for the host, within this process's control group's limit).
    pub total: u64,
    /// What an allocation can take now without displacing anything: a GPU's free memory,
    /// the host's available memory (the kernel's estimate, which counts reclaimable caches).
    pub available: u64,
}

/// The host's memory: `MemTotal` and `MemAvailable` of `/proc/meminfo`, each capped by the
/// limit of this process's cgroup v2 (`memory.max`, less `memory.current` for what is
/// available), so that a container's budget is what counts. Not on other systems: the
/// error says so.
pub fn host_memory() -> crate::Result<MemoryInfo> {
    #[cfg(target_os = "linux")]
    {
        let read = |path: &str| {
            std::fs::read_to_string(path).map_err(|e| crate::Error::Io {
                path: path.into(),
                message: e.to_string(),
            })
        };
        let meminfo = read("/proc/meminfo")?;
        let field = |name: &str| -> crate::Result<u64> {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
                .map(|kib| kib.saturating_mul(1024))
                .ok_or_else(|| crate::Error::Format(format!("/proc/meminfo: no {name} in kB")))
        };
        let (mut total, mut available) = (field("MemTotal")?, field("MemAvailable")?);
        // The cgroup's limit ("max": none) where it is lower; absent files: no cgroup v2.
        let number = |path: &str| read(path).ok()?.trim().parse::<u64>().ok();
        if let Some(limit) = number("/sys/fs/cgroup/memory.max") {
            let used = number("/sys/fs/cgroup/memory.current").unwrap_or(0);
            total = total.min(limit);
            available = available.min(limit.saturating_sub(used));
        }
        Ok(MemoryInfo { total, available })
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(crate::Error::Unsupported {
            backend: "cpu".into(),
            feature: "reading the host's memory (Linux only): give the KV cache's size".into(),
        })
    }
}
