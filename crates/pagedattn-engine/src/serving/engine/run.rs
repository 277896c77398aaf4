//! [`Engine::run`]: a whole workload served to the end and reported, a client of the engine's
//! request API ([`Engine::add_request`], [`Engine::step`]) as the HTTP server is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{Engine, EngineRequest, StepOutput};
use crate::serving::batch::RequestId;
use crate::serving::report::{CacheCounts, Report, RequestRecord};
use crate::serving::scheduler::{SchedulerError, StepEvent};
use crate::{Error, Result};

/// The latest arrival [`Engine::run`] waits for: a day after the run's start.
pub const MAX_ARRIVAL_SECONDS: f64 = 86_400.0;

impl Engine<'_> {
    /// Serves `requests` to the end (or until `stop` is set), returning the report. Requests
    /// arrive at their `arrival` times (the engine waits when it has nothing to do);
    /// `progress` is called after every step with (requests done, requests, generated tokens).
    pub fn run(
        mut self,
        workload: &str,
        requests: Vec<EngineRequest>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<Report> {
        let mut report = Report {
            model: self.model_name(),
            backend: self.ranks[0].backend.name().into(),
            workload: workload.into(),
            kv_cache_blocks: self.num_blocks(),
            kv_cache_bytes: self.kv_cache_bytes(),
            ..Report::default()
        };
        self.restart_clock();
        let start = self.epoch;
        // Request i's record is `report.requests[i]`.
        report.requests = requests
            .iter()
            .enumerate()
            .map(|(i, r)| RequestRecord {
                id: i as RequestId,
                arrival: r.arrival,
                prompt_tokens: r.prompt.len(),
                encoder_prompt_tokens: r.encoder_prompt.as_ref().map_or(0, Vec::len),
                ..RequestRecord::default()
            })
            .collect();
        let mut pending: Vec<(RequestId, EngineRequest)> = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i as RequestId, r))
            .collect();
        let total = pending.len();
        let mut done = 0;
        // An arrival that is no time after the start, or later than a run is meant to wait
        // for (a replayed trace's clock, not a calendar), is rejected now: the loop could
        // never reach it, or would idle until then.
        pending.retain(|(id, r)| {
            let ok = r.arrival.is_finite() && (0.0..=MAX_ARRIVAL_SECONDS).contains(&r.arrival);
            if !ok {
                let e = SchedulerError::rejected(
                    *id,
                    "arrival",
                    r.arrival,
                    format!("seconds in [0, {MAX_ARRIVAL_SECONDS}] (a day)"),
                );
                report.requests[*id as usize].rejected = Some(e.to_string());
                done += 1;
            }
            ok
        });
        pending.sort_by(|a, b| a.1.arrival.total_cmp(&b.1.arrival));
        pending.reverse();
        loop {
            if stop.load(Ordering::Relaxed) {
                report.interrupted = true;
                break;
            }
            let now = start.elapsed().as_secs_f64();
            while pending.last().is_some_and(|(_, r)| r.arrival <= now) {
                if let Some((id, r)) = pending.pop() {
                    if let Err(e) = self.add_request(id, r) {
                        report.requests[id as usize].rejected = Some(e.to_string());
                        done += 1;
                    }
                }
            }
            if !self.has_unfinished() {
                // Nothing to run now: wait for the next arrival, or stop after the last.
                match pending.last() {
                    None => break,
                    Some((_, next)) => {
                        let wait = (next.arrival - now).clamp(0.0, 0.05);
                        std::thread::sleep(Duration::from_secs_f64(wait));
                        continue;
                    }
                }
            }
            let output = self.step()?;
            done += record(&mut report, output, start.elapsed().as_secs_f64());
            progress(done, total, report.generated_tokens());
        }
        if !report.interrupted {
            // Every request finished: every block must be free (cached prefixes included).
            self.scheduler()
                .blocks()
                .check()
                .map_err(|e| Error::Accounting(e.to_string()))?;
        }
        report.seconds = start.elapsed().as_secs_f64();
        let stats = self.scheduler().stats();
        report.cache = CacheCounts {
            prefix_queried_tokens: stats.blocks.prefix_query_tokens as usize,
            prefix_hit_tokens: stats.blocks.prefix_hit_tokens as usize,
            preempted_by_swap: stats.preempted_by_swap as usize,
            preempted_by_recompute: stats.preempted_by_recompute as usize,
            blocks_swapped_out: stats.blocks.swapped_out_blocks as usize,
            blocks_swapped_in: stats.blocks.swapped_in_blocks as usize,
            copy_on_write_blocks: stats.blocks.cow_copies as usize,
        };
        report.verify = self.verify_counts();
        report.cuda_graph_captures = self.ranks[0].graphs.as_ref().map_or(0, |g| g.captures());
        Ok(report)
    }
}

/// Records a step's output at `now` (seconds from the run's start) in `report`; returns the
/// requests it finished.
fn record(report: &mut Report, output: StepOutput, now: f64) -> usize {
    let StepOutput {
        record,
        tokens,
        pooled,
        events,
    } = output;
    report.steps.extend(record);
    for t in &tokens {
        report.requests[t.request as usize]
            .first_token
            .get_or_insert(now);
    }
    for (request, state) in pooled {
        let r = &mut report.requests[request as usize];
        r.first_token.get_or_insert(now);
        r.pooled = Some(state);
    }
    let mut finished = 0;
    for event in events {
        if let StepEvent::Finished { request, samples } = event {
            let r = &mut report.requests[request as usize];
            r.finished = Some(now);
            r.generated = samples.into_iter().map(|s| s.tokens).collect();
            finished += 1;
        }
    }
    finished
}
