//! How busy the machine was with other work: a benchmark on a shared 2-core VM is only as good
//! as the quiet it ran in. Reads /proc/stat (all CPUs) and /proc/self/stat (this process);
//! where those are missing (not Linux) every figure is None.

use std::time::Duration;

/// CPU time counters at one instant, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct CpuTimes {
    busy: u64,
    steal: u64,
    total: u64,
    ours: u64,
}

/// Fractions of the machine's CPU time between two snapshots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Used by other processes (not this one), 0..1 of all CPUs.
    pub others: f64,
    /// Stolen by the hypervisor, 0..1 of all CPUs.
    pub steal: f64,
}

impl CpuTimes {
    /// Reads the counters now.
    pub fn now() -> Option<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let [user, nice, system, idle, iowait, irq, softirq, steal] = cpu[..] else {
            return None;
        };
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after_comm = &own[own.rfind(')')? + 1..];
        let f: Vec<&str> = after_comm.split_whitespace().collect();
        let ours = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(CpuTimes {
            busy: user + nice + system + irq + softirq,
            steal,
            total: user + nice + system + idle + iowait + irq + softirq + steal,
            ours,
        })
    }

    /// The load between `self` (earlier) and `later`.
    pub fn load_until(&self, later: &CpuTimes) -> Option<Load> {
        let total = later.total.checked_sub(self.total)?;
        if total == 0 {
            return None;
        }
        let busy = later.busy.saturating_sub(self.busy);
        let ours = later.ours.saturating_sub(self.ours);
        Some(Load {
            others: busy.saturating_sub(ours) as f64 / total as f64,
            steal: later.steal.saturating_sub(self.steal) as f64 / total as f64,
        })
    }
}

/// The load of other processes over `window`, while this one sleeps.
pub fn sample(window: Duration) -> Option<Load> {
    let a = CpuTimes::now()?;
    std::thread::sleep(window);
    a.load_until(&CpuTimes::now()?)
}

impl Load {
    /// A short description, with a warning when the machine was not quiet.
    pub fn describe(&self) -> String {
        let warn = if self.others > 0.05 || self.steal > 0.05 {
            " -- NOT QUIET: figures are unreliable"
        } else {
            ""
        };
        format!(
            "other processes {:.0}% of all CPUs, hypervisor steal {:.0}%{warn}",
            100.0 * self.others,
            100.0 * self.steal
        )
    }

    /// The JSON object.
    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({"others": self.others, "steal": self.steal})
    }
}
