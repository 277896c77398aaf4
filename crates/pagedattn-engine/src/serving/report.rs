//! What a run measured: per-request latencies, per-step timings and cache occupancy, and the
//! figures derived from them (throughput, latency percentiles, cache use). How a report reads
//! (text, JSON, SVG) is the harness's business.

use serde::Serialize;

use crate::serving::batch::RequestId;

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
    /// Blocks in the device pool (each layer's cache holds as many).
    pub kv_cache_blocks: usize,
    /// Bytes of the device caches of every layer (keys and values, the CUDA graphs' padding
    /// blocks included).
    pub kv_cache_bytes: u64,
    /// The process's peak resident memory in bytes, where whoever ran it measured it.
    pub peak_resident_bytes: Option<u64>,
    /// Times the engine captured its CUDA graphs (every bucket each time), since it was made:
    /// 1 where they were captured at its start and never again, 0 without graphs.
    pub cuda_graph_captures: usize,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median_p99(values), Some((50.0, 99.0)));
        assert_eq!(median_p99(vec![3.0]), Some((3.0, 3.0)));
        assert_eq!(median_p99(Vec::new()), None);
    }
}
