//! What the benchmark ran on: CPU model, threads, SIMD features, last-level cache size.

use serde_json::{json, Value};

/// The machine a benchmark ran on.
#[derive(Debug, Clone)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo (or `unknown`).
    pub cpu_model: String,
    /// `vendor_id`, `cpu family` and `model` from /proc/cpuinfo, e.g. `AuthenticAMD 26/2`.
    pub cpu_id: String,
    /// Threads the benchmark may use (`available_parallelism`).
    pub threads: usize,
    /// The SIMD features that matter to the kernels.
    pub simd: Vec<&'static str>,
    /// Size of the last-level cache in bytes (32 MiB when it cannot be read).
    pub llc_bytes: usize,
}

impl Machine {
    /// Probes this machine.
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim() == name)
                .map(|(_, v)| v.trim().to_string())
        };
        let cpu_model = field("model name").unwrap_or_else(|| "unknown".into());
        let cpu_id = format!(
            "{} {}/{}",
            field("vendor_id").unwrap_or_default(),
            field("cpu family").unwrap_or_default(),
            field("model").unwrap_or_default()
        );
        Machine {
            cpu_model,
            cpu_id: cpu_id.trim().to_string(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd: crate::simd_features(),
            llc_bytes: llc_bytes().unwrap_or(32 << 20),
        }
    }

    /// One line for the table header.
    pub fn summary(&self) -> String {
        format!(
            "{} ({}), {} threads, LLC {} MiB, SIMD: {}",
            self.cpu_model,
            self.cpu_id,
            self.threads,
            self.llc_bytes >> 20,
            self.simd.join(" ")
        )
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        json!({
            "cpu_model": self.cpu_model,
            "cpu_id": self.cpu_id,
            "threads": self.threads,
            "simd": self.simd,
            "llc_bytes": self.llc_bytes,
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
        })
    }
}

/// The largest cache size reported under /sys for cpu0 (the L3 on x86 servers).
fn llc_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
}

/// Parses `32768K`, `2M` or `512`.
fn parse_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    Some(match unit {
        "" => n,
        "K" => n << 10,
        "M" => n << 20,
        "G" => n << 30,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("x"), None);
    }
}
