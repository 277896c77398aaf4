//! The server's metrics in Prometheus' text format, under vLLM's names where vLLM has the
//! metric (so that its dashboards read ours), `pagedattn:` otherwise.

use std::fmt::Write;

/// A histogram: counts per upper bound, the sum and the count.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending upper bounds; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }
}

/// vLLM's buckets for time to first token, with finer ones below 10 ms (a small model's
/// first token on a GPU).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's buckets for the time between two output tokens, with finer ones below 10 ms.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// vLLM's buckets for a request's whole latency.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Why requests ended, as vLLM's `finished_reason` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// A stop token or string.
    Stop,
    /// `max_tokens`.
    Length,
    /// The client went away, or the server stopped before it finished.
    Abort,
}

/// Everything `/metrics` reports.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting to start (or to be recomputed).
    pub waiting: usize,
    /// Requests swapped out to host memory.
    pub swapped: usize,
    /// KV-cache blocks in use and in the pool.
    pub blocks_used: usize,
    /// Blocks in the pool.
    pub blocks_total: usize,
    /// Prompt tokens of the requests accepted.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Preemptions (swap or recompute).
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Requests refused before they were queued, by status.
    pub refused: Vec<(u16, u64)>,
    /// Requests ended, by reason.
    pub ended: [u64; 3],
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive output tokens.
    pub itl: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            running: 0,
            waiting: 0,
            swapped: 0,
            blocks_used: 0,
            blocks_total: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            steps: 0,
            refused: Vec::new(),
            ended: [0; 3],
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl Metrics {
    /// Counts a request refused with `status`.
    pub fn refuse(&mut self, status: u16) {
        match self.refused.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => self.refused.push((status, 1)),
        }
    }

    /// Counts a request ended for `why`.
    pub fn end(&mut self, why: Ending) {
        self.ended[why as usize] += 1;
    }

    /// The Prometheus text exposition, every series labelled with `model`.
    pub fn render(&self, model: &str) -> String {
        let model = model.replace('\\', "\\\\").replace('"', "\\\"");
        let label = format!("model_name=\"{model}\"");
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{{label}}} {value}");
        };
        one(
            "vllm:num_requests_running",
            "gauge",
            "Requests in the running batch.",
            self.running as f64,
        );
        one(
            "vllm:num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            self.waiting as f64,
        );
        one(
            "vllm:num_requests_swapped",
            "gauge",
            "Requests swapped out to host memory.",
            self.swapped as f64,
        );
        let usage = self.blocks_used as f64 / self.blocks_total.max(1) as f64;
        one(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage: 1 means every block is in use.",
            usage,
        );
        one(
            "pagedattn:kv_cache_blocks_used",
            "gauge",
            "KV-cache blocks in use.",
            self.blocks_used as f64,
        );
        one(
            "pagedattn:kv_cache_blocks_total",
            "gauge",
            "KV-cache blocks in the pool.",
            self.blocks_total as f64,
        );
        one(
            "vllm:prompt_tokens_total",
            "counter",
            "Prompt tokens of the requests accepted.",
            self.prompt_tokens as f64,
        );
        one(
            "vllm:generation_tokens_total",
            "counter",
            "Tokens generated.",
            self.generation_tokens as f64,
        );
        one(
            "vllm:num_preemptions_total",
            "counter",
            "Requests preempted (swapped out or recomputed).",
            self.preemptions as f64,
        );
        one(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            self.prefix_queries as f64,
        );
        one(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            self.prefix_hits as f64,
        );
        one(
            "pagedattn:engine_steps_total",
            "counter",
            "Engine steps run.",
            self.steps as f64,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Requests ended, by reason.\n# TYPE vllm:request_success_total counter"
        );
        for (why, n) in ["stop", "length", "abort"].iter().zip(self.ended) {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{label},finished_reason=\"{why}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP pagedattn:requests_refused_total Requests refused before they were queued, by HTTP status.\n# TYPE pagedattn:requests_refused_total counter"
        );
        for (status, n) in &self.refused {
            let _ = writeln!(
                out,
                "pagedattn:requests_refused_total{{{label},status=\"{status}\"}} {n}"
            );
        }
        for (name, help, h) in [
            (
                "vllm:time_to_first_token_seconds",
                "Seconds from a request's arrival to its first token.",
                &self.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Seconds between a request's consecutive output tokens.",
                &self.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Seconds from a request's arrival to its last token.",
                &self.e2e,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            let mut cumulative = 0;
            for (bound, n) in h.bounds.iter().zip(&h.counts) {
                cumulative += n;
                let _ = writeln!(out, "{name}_bucket{{{label},le=\"{bound}\"}} {cumulative}");
            }
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum{{{label}}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{{label}}} {}", h.count);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_series_carry_the_model() {
        let mut m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(0.3);
        m.ttft.observe(1e6);
        m.end(Ending::Length);
        m.refuse(429);
        let text = m.render("a \"b\"");
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"a \\\"b\\\"\",le=\"0.005\"} 1"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"a \\\"b\\\"\",le=\"0.5\"} 2"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"a \\\"b\\\"\",le=\"+Inf\"} 3"
        ));
        assert!(
            text.contains("vllm:time_to_first_token_seconds_count{model_name=\"a \\\"b\\\"\"} 3")
        );
        assert!(text.contains("finished_reason=\"length\"} 1"));
        assert!(text.contains("status=\"429\"} 1"));
    }
}
