//! How a run's [`Report`] reads: text for people, JSON for machines, an SVG plot over time.

use std::fmt::{self, Write};

use crate::serving::report::Report;

impl Report {
    /// The report and its derived figures as one JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        let pair = |p: Option<(f64, f64)>| {
            p.map(|(m, p99)| serde_json::json!({"median_s": m, "p99_s": p99}))
        };
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let serde_json::Value::Object(map) = &mut v {
            map.insert(
                "summary".into(),
                serde_json::json!({
                    "requests": self.requests.len(),
                    "rejected": self.requests.iter().filter(|r| r.rejected.is_some()).count(),
                    "prompt_tokens": self.prompt_tokens(),
                    "generated_tokens": self.generated_tokens(),
                    "throughput_tokens_per_s": self.throughput(),
                    "time_to_first_token": pair(self.ttft()),
                    "time_per_output_token": pair(self.tpot()),
                    "attention_share": self.attention_share(),
                    "peak_cache_use": self.peak_cache_use(),
                    "internal_waste": self.internal_waste(),
                    "prefix_hit_rate": self.prefix_hit_rate(),
                }),
            );
        }
        v
    }

    /// Throughput (generated tokens per second, in windows of a fiftieth of the run) and
    /// cache occupancy (% of device blocks) over time, as an SVG document.
    pub fn svg(&self) -> String {
        let (w, h, pad) = (720.0, 180.0, 40.0);
        let span = self.seconds.max(1e-9);
        let windows = 50usize;
        let mut rate = vec![0.0f64; windows];
        for s in &self.steps {
            let i = ((s.end / span * windows as f64) as usize).min(windows - 1);
            rate[i] += s.generated_tokens as f64;
        }
        for r in &mut rate {
            *r /= span / windows as f64;
        }
        let occupancy: Vec<(f64, f64)> = self
            .steps
            .iter()
            .map(|s| {
                (
                    s.end,
                    100.0 * s.blocks_used as f64 / s.blocks_total.max(1) as f64,
                )
            })
            .collect();
        let mut svg = String::new();
        let _ = write!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">"#,
            w + 2.0 * pad,
            2.0 * h + 3.0 * pad
        );
        let panels: [Panel; 2] = [
            (
                "generated tokens/s",
                rate.iter()
                    .enumerate()
                    .map(|(i, &r)| ((i as f64 + 0.5) * span / windows as f64, r))
                    .collect(),
                rate.iter().copied().fold(1.0, f64::max),
            ),
            ("KV cache blocks in use (%)", occupancy, 100.0),
        ];
        for (p, (title, points, top)) in panels.iter().enumerate() {
            let y0 = pad + p as f64 * (h + pad);
            let _ = write!(
                svg,
                r##"<rect x="{pad}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/><text x="{pad}" y="{}">{title} (max {top:.0}) over {span:.1} s</text>"##,
                y0 - 6.0
            );
            let path: Vec<String> = points
                .iter()
                .map(|&(t, v)| format!("{:.1},{:.1}", pad + t / span * w, y0 + h - v / top * h))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                ["#1f77b4", "#d62728"][p],
                path.join(" ")
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A plot panel: its title, its (seconds, value) points and its top value.
type Panel<'a> = (&'a str, Vec<(f64, f64)>, f64);

/// Seconds as a person reads them (ms below a second).
fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rejected = self
            .requests
            .iter()
            .filter(|r| r.rejected.is_some())
            .count();
        writeln!(
            f,
            "{} on {}, workload {}{}",
            self.model,
            self.backend,
            self.workload,
            if self.interrupted {
                " (interrupted: the report so far)"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "requests: {} ({} rejected); prompt tokens {}, generated tokens {} in {}: {:.1} tokens/s",
            self.requests.len(),
            rejected,
            self.prompt_tokens(),
            self.generated_tokens(),
            secs(self.seconds),
            self.throughput()
        )?;
        let pair = |p: Option<(f64, f64)>| match p {
            Some((m, p99)) => format!("median {}, p99 {}", secs(m), secs(p99)),
            None => "none".into(),
        };
        let encoder = self.encoder_prompt_tokens();
        if encoder > 0 {
            writeln!(
                f,
                "encoder prompt tokens {encoder}, each encoded once into the cross cache"
            )?;
        }
        let (pooled, norm) = self.pooled();
        if pooled > 0 {
            writeln!(
                f,
                "pooled outputs: {pooled} (encoder-only requests), mean norm {norm:.3}"
            )?;
        }
        writeln!(f, "time to first token: {}", pair(self.ttft()))?;
        writeln!(f, "time per output token: {}", pair(self.tpot()))?;
        let replayed = self.steps.iter().filter(|s| s.graph).count();
        let graphs = if replayed > 0 {
            format!(
                " ({replayed} of {} steps replayed from CUDA graphs, untimed; graphs captured {} time(s))",
                self.steps.len(),
                self.cuda_graph_captures
            )
        } else {
            String::new()
        };
        writeln!(
            f,
            "attention: {:.1}% of the step time{graphs}; KV cache: peak {:.1}% of the blocks, internal waste {:.2}%",
            100.0 * self.attention_share(),
            100.0 * self.peak_cache_use(),
            100.0 * self.internal_waste()
        )?;
        let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "memory: KV cache {} blocks, {:.1} MiB",
            self.kv_cache_blocks,
            mib(self.kv_cache_bytes)
        )?;
        match self.peak_resident_bytes {
            Some(peak) => writeln!(f, "; peak resident {:.1} MiB", mib(peak))?,
            None => writeln!(f)?,
        }
        let c = &self.cache;
        writeln!(
            f,
            "prefix cache: {:.1}% of {} prompt tokens hit; preemptions: {} by swap, {} by recompute; blocks swapped out {}, in {}; copy-on-write copies {}",
            100.0 * self.prefix_hit_rate(),
            c.prefix_queried_tokens,
            c.preempted_by_swap,
            c.preempted_by_recompute,
            c.blocks_swapped_out,
            c.blocks_swapped_in,
            c.copy_on_write_blocks
        )?;
        let v = &self.verify;
        write!(
            f,
            "verification: {} of {} attention calls recomputed with reference on dense keys and values, largest difference {:.1e}",
            v.calls_checked, v.calls_total, v.worst
        )
    }
}

/// This process's peak resident memory in bytes (`VmHWM` of `/proc/self/status`), where
/// the system reports it (Linux).
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::report::{RequestRecord, StepRecord};

    #[test]
    fn latencies_and_shares_follow_their_definitions() {
        let request = |id, arrival, first, last, n| RequestRecord {
            id,
            arrival,
            prompt_tokens: 10,
            first_token: Some(first),
            finished: Some(last),
            generated: vec![vec![7; n]],
            ..RequestRecord::default()
        };
        let report = Report {
            seconds: 4.0,
            requests: vec![request(0, 0.0, 0.5, 2.5, 5), request(1, 1.0, 1.25, 1.25, 1)],
            steps: vec![
                StepRecord {
                    seconds: 1.0,
                    attention_seconds: 0.25,
                    blocks_used: 2,
                    blocks_total: 8,
                    tokens_stored: 20,
                    slots_used: 32,
                    ..StepRecord::default()
                },
                StepRecord {
                    seconds: 1.0,
                    attention_seconds: 0.75,
                    blocks_used: 4,
                    blocks_total: 8,
                    tokens_stored: 64,
                    slots_used: 64,
                    ..StepRecord::default()
                },
            ],
            ..Report::default()
        };
        assert_eq!(report.generated_tokens(), 6);
        assert_eq!(report.throughput(), 1.5);
        assert_eq!(report.ttft(), Some((0.25, 0.5)));
        assert_eq!(
            report.tpot(),
            Some((0.5, 0.5)),
            "(2.5 - 0.5) / 4; one token has none"
        );
        assert_eq!(report.attention_share(), 0.5);
        assert_eq!(report.peak_cache_use(), 0.5);
        assert_eq!(report.internal_waste(), 1.0 - 84.0 / 96.0);
        let text = report.to_string();
        assert!(
            text.contains("generated tokens 6 in 4.00 s: 1.5 tokens/s"),
            "{text}"
        );
        let json = report.to_json();
        assert_eq!(json["summary"]["generated_tokens"], 6);
        assert_eq!(
            json["requests"][0]["generated"][0].as_array().map(Vec::len),
            Some(5)
        );
        assert!(report.svg().starts_with("<svg"));
    }
}
