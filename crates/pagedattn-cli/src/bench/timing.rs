//! Timing: warm-up, then N iterations, median and min. Variants measured together are
//! interleaved iteration by iteration, so that drift (frequency, neighbours) hits them alike.

use std::time::Instant;

use pagedattn::Result;

/// How many iterations to run.
#[derive(Debug, Clone, Copy)]
pub struct TimingPlan {
    /// Seconds of warm-up (at least two iterations).
    pub warmup_seconds: f64,
    /// Seconds of measurement a row aims at, when `iters` is not given.
    pub target_seconds: f64,
    /// A fixed number of measured iterations.
    pub iters: Option<usize>,
    /// Fewest measured iterations.
    pub min_iters: usize,
    /// Seconds of measurement between two calls of the probe (the ceilings re-measured).
    pub probe_every: f64,
}

/// Summary of the measured iterations of one variant, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Measured iterations.
    pub iters: usize,
    /// Median.
    pub median: f64,
    /// Fastest.
    pub min: f64,
    /// Slowest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Stats {
    fn of(times: &[f64]) -> Stats {
        Stats {
            iters: times.len(),
            median: median(times),
            min: times.iter().copied().fold(f64::INFINITY, f64::min),
            max: times.iter().copied().fold(0.0, f64::max),
            mean: times.iter().sum::<f64>() / times.len().max(1) as f64,
        }
    }
}

/// The median of `xs` (the mean of the middle two for an even count; 0 when empty).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// How iterations are timed: marks in the order of the work, read back as the time between
/// consecutive marks. On the host a mark is the wall clock (the work is done when the call
/// returns); on a GPU it is an event queued on the stream, so the host can run ahead and the
/// marks are read (waiting for the GPU) only when [`Clock::laps`] is called.
pub trait Clock {
    /// Marks the current point of the work.
    fn mark(&mut self) -> Result<()>;
    /// Seconds between each mark and the next since the last call, in order (one fewer than
    /// the marks); forgets them.
    fn laps(&mut self) -> Result<Vec<f64>>;
}

/// The host's wall clock: for backends whose calls return when their work is done.
#[derive(Debug, Default)]
pub struct HostClock {
    marks: Vec<Instant>,
}

impl Clock for HostClock {
    fn mark(&mut self) -> Result<()> {
        self.marks.push(Instant::now());
        Ok(())
    }

    fn laps(&mut self) -> Result<Vec<f64>> {
        let laps = self
            .marks
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        self.marks.clear();
        Ok(laps)
    }
}

/// Times `variants` alternatives of one workload. `run(variant, i)` runs iteration `i` of a
/// variant (`i` counts that variant's calls, warm-up included, so the caller can rotate over
/// layers with `i % layers`). `probe` is called before the first measured round, then between
/// rounds every `probe_every` seconds (counted in rounds of the warm-up's median length), and
/// after the last one. Iterations follow one another with no wait in between; the clock's
/// marks are read at each probe. Returns one [`Stats`] per variant.
pub fn measure(
    plan: &TimingPlan,
    variants: usize,
    clock: &mut dyn Clock,
    mut run: impl FnMut(usize, usize) -> Result<()>,
    mut probe: impl FnMut() -> Result<()>,
) -> Result<Vec<Stats>> {
    let mut calls = vec![0usize; variants];
    // One round: every variant once (in `order`), a mark before each and after the last.
    let mut round = |order: &mut dyn Iterator<Item = usize>, clock: &mut dyn Clock| {
        let mut ran = Vec::with_capacity(variants);
        clock.mark()?;
        for v in order {
            run(v, calls[v])?;
            calls[v] += 1;
            clock.mark()?;
            ran.push(v);
        }
        Ok::<Vec<usize>, pagedattn::Error>(ran)
    };
    // Warm-up: every variant at least three times, and for at least `warmup_seconds` overall.
    // The first round is left out of the estimate of a round's length: it includes one-time
    // costs (a GPU kernel's compilation at its first use, first touches of memory).
    let warm_start = Instant::now();
    let mut warm = Vec::new();
    while warm.len() < 3 || warm_start.elapsed().as_secs_f64() < plan.warmup_seconds {
        round(&mut (0..variants), clock)?;
        warm.push(clock.laps()?.iter().sum::<f64>());
    }
    let per_round = median(&warm[1..]).max(1e-9);
    let iters = plan.iters.unwrap_or_else(|| {
        ((plan.target_seconds / per_round).round() as usize).clamp(plan.min_iters, 100_000)
    });
    let probe_rounds = (plan.probe_every / per_round).round().max(1.0);
    let probe_rounds = if probe_rounds.is_finite() && probe_rounds < usize::MAX as f64 {
        probe_rounds as usize
    } else {
        usize::MAX
    };
    let mut times = vec![Vec::with_capacity(iters); variants];
    // What each lap since the last probe timed: a variant's iteration, or (None) the step
    // from one round's last mark to the next round's first.
    let mut pending: Vec<Option<usize>> = Vec::new();
    let mut collect = |pending: &mut Vec<Option<usize>>, clock: &mut dyn Clock| {
        for (v, t) in pending.drain(..).zip(clock.laps()?) {
            if let Some(v) = v {
                times[v].push(t);
            }
        }
        Ok::<(), pagedattn::Error>(())
    };
    probe()?;
    for i in 0..iters {
        if i > 0 && i % probe_rounds == 0 {
            collect(&mut pending, clock)?;
            probe()?;
        }
        // Alternate the order too, so no variant always follows the same one.
        let mut order = (0..variants).map(|k| if i % 2 == 0 { k } else { variants - 1 - k });
        pending.extend(round(&mut order, clock)?.into_iter().map(Some));
        pending.push(None);
    }
    collect(&mut pending, clock)?;
    probe()?;
    Ok(times.iter().map(|t| Stats::of(t)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn fixed_iterations_and_interleaving() {
        let plan = TimingPlan {
            warmup_seconds: 0.0,
            target_seconds: 0.0,
            iters: Some(5),
            min_iters: 1,
            probe_every: f64::INFINITY,
        };
        let mut seen = Vec::new();
        let mut probes = 0;
        let stats = measure(
            &plan,
            2,
            &mut HostClock::default(),
            |v, i| {
                seen.push((v, i));
                Ok(())
            },
            || {
                probes += 1;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(probes, 2);
        assert_eq!(stats.len(), 2);
        assert!(stats.iter().all(|s| s.iters == 5));
        // Three warm-up rounds, then 5 measured rounds: each variant counts 0..8.
        for v in 0..2 {
            let idx: Vec<usize> = seen.iter().filter(|s| s.0 == v).map(|s| s.1).collect();
            assert_eq!(idx, (0..8).collect::<Vec<_>>());
        }
    }

    /// A clock that reads a counter the work advances: each variant's iterations must get
    /// exactly their own time, with probes (and the clock's reads) in the middle of the run.
    #[test]
    fn laps_go_to_their_variants() {
        use std::cell::Cell;
        struct Counter<'a> {
            now: &'a Cell<f64>,
            marks: Vec<f64>,
        }
        impl Clock for Counter<'_> {
            fn mark(&mut self) -> Result<()> {
                self.marks.push(self.now.get());
                Ok(())
            }
            fn laps(&mut self) -> Result<Vec<f64>> {
                let laps = self.marks.windows(2).map(|w| w[1] - w[0]).collect();
                self.marks.clear();
                Ok(laps)
            }
        }
        let now = Cell::new(0.0);
        let plan = TimingPlan {
            warmup_seconds: 0.0,
            target_seconds: 0.0,
            iters: Some(9),
            min_iters: 1,
            probe_every: 12.0,
        };
        let mut probes = 0;
        let stats = measure(
            &plan,
            3,
            &mut Counter {
                now: &now,
                marks: Vec::new(),
            },
            |v, _| {
                now.set(now.get() + (v + 1) as f64);
                Ok(())
            },
            || {
                // Time passing during a probe belongs to no iteration.
                now.set(now.get() + 100.0);
                probes += 1;
                Ok(())
            },
        )
        .unwrap();
        // Rounds of 6 units: a probe every 2 rounds, plus the first and the last.
        assert_eq!(probes, 2 + 4);
        for (v, s) in stats.iter().enumerate() {
            assert_eq!((s.iters, s.min, s.max), (9, (v + 1) as f64, (v + 1) as f64));
        }
    }
}
