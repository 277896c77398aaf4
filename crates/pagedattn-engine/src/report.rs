//! What a run measured: per-request latencies, per-step timings and cache occupancy, and the
//! final report (text for people, JSON for machines, an SVG plot over time).

use std::fmt::{self, Write};

use serde::Serialize;

use crate::batch::RequestId;

/// One request's record.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestRecord {
    /// The request.
    pub id: RequestId,
    /// Seconds from the run's start to its arrival.
    pub arrival: f64,
    /// Its prompt's tokens.
    pub prompt_tokens: usize,
    /// Its encoder prompt's tokens (encoder-decoder models).
    pub encoder_prompt_tokens: usize,
    /// An encoder-only request's output: the pooled final state (of its first token).
    pub pooled: Option<Vec<f32>>,
    /// Seconds from the run's start to its first generated token.
    pub first_token: Option<f64>,
    /// Seconds from the run's start to its last generated token.
    pub finished: Option<f64>,
    /// Each sample's generated token ids.
    pub generated: Vec<Vec<u32>>,
    /// Each sample's generated text, where the model has a tokenizer.
    pub text: Vec<String>,
    /// Why it was rejected, if it was (it then generated nothing).
    pub rejected: Option<String>,
}

impl RequestRecord {
    /// Tokens generated over all samples.
    pub fn generated_tokens(&self) -> usize {
        self.generated.iter().map(Vec::len).sum()
    }

    /// Seconds from arrival to the first token.
    pub fn time_to_first_token(&self) -> Option<f64> {
        self.first_token.map(|t| t - self.arrival)
    }

    /// Mean seconds between output tokens after the first (of the longest sample); `None`
    /// with fewer than two tokens.
    pub fn time_per_output_token(&self) -> Option<f64> {
        let longest = self.generated.iter().map(Vec::len).max()?;
        match (self.first_token, self.finished) {
            (Some(first), Some(last)) if longest > 1 => Some((last - first) / (longest - 1) as f64),
            _ => None,
        }
    }
}

/// One step's record.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StepRecord {
    /// Seconds from the run's start to the step's end.
    pub end: f64,
    /// The step's seconds.
    pub seconds: f64,
    /// Of which in the model's forward pass, attention included, up to its outputs on the
    /// host (the rest is the engine's own work: scheduling, metadata, plans, sampling).
    pub forward_seconds: f64,
    /// Of which in attention calls (every layer; 0 for a step replayed from a graph).
    pub attention_seconds: f64,
    /// Whether the step was replayed from a CUDA graph (its attention calls untimed).
    pub graph: bool,
    /// Prompt tokens computed.
    pub prefill_tokens: usize,
    /// Decode tokens computed.
    pub decode_tokens: usize,
    /// Tokens generated (sampled) by the step.
    pub generated_tokens: usize,
    /// Device blocks holding some sequence's tokens after the step.
    pub blocks_used: usize,
    /// Device blocks in the pool.
    pub blocks_total: usize,
    /// Tokens stored in the used blocks.
    pub tokens_stored: usize,
    /// Token slots of the used blocks (`blocks_used * block_size`).
    pub slots_used: usize,
}

/// Counts kept by the block manager and scheduler over a run.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct CacheCounts {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queried_tokens: usize,
    /// Of which found there (not computed).
    pub prefix_hit_tokens: usize,
    /// Requests preempted by swapping out.
    pub preempted_by_swap: usize,
    /// Requests preempted by dropping their blocks (recomputed later).
    pub preempted_by_recompute: usize,
    /// Blocks copied to host swap space.
    pub blocks_swapped_out: usize,
    /// Blocks copied back from swap space.
    pub blocks_swapped_in: usize,
    /// Blocks copied on write (a shared last block appended to).
    pub copy_on_write_blocks: usize,
}

/// What `--verify` found.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct VerifyCounts {
    /// Attention calls recomputed with `reference`.
    pub calls_checked: usize,
    /// Attention calls made.
    pub calls_total: usize,
    /// The largest difference seen, as a fraction of the output's largest magnitude.
    pub worst: f32,
}

/// The whole run's report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The model's name.
    pub model: String,
    /// The backend that ran attention.
    pub backend: String,
    /// The workload's name.
    pub workload: String,
    /// Seconds from start to the last request's end.
    pub seconds: f64,
    /// Every request.
    pub requests: Vec<RequestRecord>,
    /// Every step.
    pub steps: Vec<StepRecord>,
    /// Block manager and scheduler counts.
    pub cache: CacheCounts,
    /// Verification.
    pub verify: VerifyCounts,
    /// Whether the run was interrupted (Ctrl-C) before every request finished.
    pub interrupted: bool,
}

/// The median and 99th percentile of some values (nearest rank), or `None` for none.
fn median_p99(mut values: Vec<f64>) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank =
        |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    Some((rank(0.5), rank(0.99)))
}

impl Report {
    /// Prompt tokens of the served requests.
    pub fn prompt_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.prompt_tokens).sum()
    }

    /// Encoder prompt tokens of the served requests (encoder-decoder models).
    pub fn encoder_prompt_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.encoder_prompt_tokens).sum()
    }

    /// Encoder-only requests' pooled outputs: how many, and their mean L2 norm.
    pub fn pooled(&self) -> (usize, f64) {
        let norms: Vec<f64> = self
            .requests
            .iter()
            .filter_map(|r| r.pooled.as_ref())
            .map(|p| {
                p.iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>()
                    .sqrt()
            })
            .collect();
        (
            norms.len(),
            norms.iter().sum::<f64>() / norms.len().max(1) as f64,
        )
    }

    /// Generated tokens, every sample.
    pub fn generated_tokens(&self) -> usize {
        self.requests
            .iter()
            .map(RequestRecord::generated_tokens)
            .sum()
    }

    /// Generated tokens per second of the run.
    pub fn throughput(&self) -> f64 {
        self.generated_tokens() as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// Attention's share of the time of the steps that timed it (those not replayed from a
    /// CUDA graph).
    pub fn attention_share(&self) -> f64 {
        let timed = || self.steps.iter().filter(|s| !s.graph);
        let total: f64 = timed().map(|s| s.seconds).sum();
        let attention: f64 = timed().map(|s| s.attention_seconds).sum();
        attention / total.max(f64::MIN_POSITIVE)
    }

    /// The highest fraction of device blocks in use after a step.
    pub fn peak_cache_use(&self) -> f64 {
        self.steps
            .iter()
            .map(|s| s.blocks_used as f64 / s.blocks_total.max(1) as f64)
            .fold(0.0, f64::max)
    }

    /// Internal waste: the fraction of the used blocks' token slots holding no token, over
    /// every step (slots summed, then divided: steps with more blocks in use weigh more).
    pub fn internal_waste(&self) -> f64 {
        let slots: usize = self.steps.iter().map(|s| s.slots_used).sum();
        let stored: usize = self.steps.iter().map(|s| s.tokens_stored).sum();
        // (No slot allocated, as for an encoder-only model: nothing wasted.)
        match slots {
            0 => 0.0,
            _ => 1.0 - stored as f64 / slots as f64,
        }
    }

    /// The fraction of looked-up prompt tokens found in the prefix cache.
    pub fn prefix_hit_rate(&self) -> f64 {
        self.cache.prefix_hit_tokens as f64 / self.cache.prefix_queried_tokens.max(1) as f64
    }

    /// Median and p99 time to first token, seconds.
    pub fn ttft(&self) -> Option<(f64, f64)> {
        median_p99(
            self.requests
                .iter()
                .filter_map(RequestRecord::time_to_first_token)
                .collect(),
        )
    }

    /// Median and p99 time per output token, seconds.
    pub fn tpot(&self) -> Option<(f64, f64)> {
        median_p99(
            self.requests
                .iter()
                .filter_map(RequestRecord::time_per_output_token)
                .collect(),
        )
    }

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
                " ({replayed} of {} steps replayed from CUDA graphs, untimed)",
                self.steps.len()
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median_p99(values), Some((50.0, 99.0)));
        assert_eq!(median_p99(vec![3.0]), Some((3.0, 3.0)));
        assert_eq!(median_p99(Vec::new()), None);
    }
}
