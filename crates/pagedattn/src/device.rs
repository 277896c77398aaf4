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
/// memory limit of this process's control group (less its usage, for what is available), so
/// that a container's budget is what counts. Not on other systems: the error says so.
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
        if let Some((limit, used)) = cgroup_memory() {
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

/// This process's control group's memory limit and usage in bytes, where it has a limit:
/// cgroup v2 (`memory.max`, `memory.current`) or v1's memory controller
/// (`memory.limit_in_bytes`, `memory.usage_in_bytes`), in the process's own group as
/// `/proc/self/cgroup` names it, else at the hierarchy's mount point (where a container sees
/// its own group). v2's `max` (no limit) reads as none; v1's no-limit is a huge number, which
/// caps nothing.
#[cfg(target_os = "linux")]
fn cgroup_memory() -> Option<(u64, u64)> {
    let number = |path: &str| {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in groups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (mount, limit, usage) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        for dir in [format!("{mount}{path}"), mount.to_string()] {
            if let Some(bytes) = number(&format!("{dir}/{limit}")) {
                return Some((bytes, number(&format!("{dir}/{usage}")).unwrap_or(0)));
            }
        }
    }
    None
}
