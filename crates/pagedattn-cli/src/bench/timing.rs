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

/// Times `variants` alternatives of one workload. `run(variant, i)` runs iteration `i` of a
/// variant (`i` counts that variant's calls, warm-up included, so the caller can rotate over
/// layers with `i % layers`). `probe` is called before the first measured round, then between
/// rounds every `probe_every` seconds, and after the last one. Returns one [`Stats`] per variant.
pub fn measure(
    plan: &TimingPlan,
    variants: usize,
    mut run: impl FnMut(usize, usize) -> Result<()>,
    mut probe: impl FnMut(),
) -> Result<Vec<Stats>> {
    let mut calls = vec![0usize; variants];
    let mut timed = |v: usize, run: &mut dyn FnMut(usize, usize) -> Result<()>| {
        let start = Instant::now();
        run(v, calls[v])?;
        calls[v] += 1;
        Ok::<f64, pagedattn::Error>(start.elapsed().as_secs_f64())
    };
    // Warm-up: every variant at least twice, and for at least `warmup_seconds` overall.
    let warm_start = Instant::now();
    let mut warm = Vec::new();
    let mut rounds = 0;
    while rounds < 2 || warm_start.elapsed().as_secs_f64() < plan.warmup_seconds {
        let mut round = 0.0;
        for v in 0..variants {
            round += timed(v, &mut run)?;
        }
        warm.push(round);
        rounds += 1;
    }
    let per_round = median(&warm).max(1e-9);
    let iters = plan.iters.unwrap_or_else(|| {
        ((plan.target_seconds / per_round).round() as usize).clamp(plan.min_iters, 100_000)
    });
    let mut times = vec![Vec::with_capacity(iters); variants];
    probe();
    let mut since_probe = 0.0;
    for i in 0..iters {
        if since_probe >= plan.probe_every {
            probe();
            since_probe = 0.0;
        }
        // Alternate the order too, so no variant always follows the same one.
        for k in 0..variants {
            let v = if i % 2 == 0 { k } else { variants - 1 - k };
            let t = timed(v, &mut run)?;
            since_probe += t;
            times[v].push(t);
        }
    }
    probe();
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
            |v, i| {
                seen.push((v, i));
                Ok(())
            },
            || probes += 1,
        )
        .unwrap();
        assert_eq!(probes, 2);
        assert_eq!(stats.len(), 2);
        assert!(stats.iter().all(|s| s.iters == 5));
        // Two warm-up rounds, then 5 measured rounds: each variant counts 0..7.
        for v in 0..2 {
            let idx: Vec<usize> = seen.iter().filter(|s| s.0 == v).map(|s| s.1).collect();
            assert_eq!(idx, (0..7).collect::<Vec<_>>());
        }
    }
}
