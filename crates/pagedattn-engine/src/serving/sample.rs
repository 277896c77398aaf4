//! Sampling: greedy argmax, temperature, top-k, top-p (nucleus) with a counter-based RNG
//! (a draw depends on the request's seed and the step only), and log-softmax.

use std::cmp::Ordering;

/// What sampling refuses: empty logits, buffers of other lengths, bad parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// No logits to sample from.
    #[error("{what}: a dimension is zero")]
    Empty {
        /// The argument.
        what: &'static str,
    },
    /// A buffer's length is not the logits'.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// The argument.
        what: &'static str,
        /// The logits' length.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// A bad sampling setting.
    #[error("{what}: {why}")]
    Param {
        /// The parameter.
        what: &'static str,
        /// Why it is refused.
        why: String,
    },
}

/// Results of sampling.
pub type Result<T> = std::result::Result<T, SamplingError>;

/// The index of the largest logit, the lowest on ties; a NaN counts as the largest (as
/// `torch.argmax` does). 0 for an empty slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            return i as u32;
        }
        if v > bv || i == 0 {
            best = i;
            bv = v;
        }
    }
    best as u32
}

/// `out[i] = logits[i] - log Σ exp(logits)`, the sum taken in f64 after subtracting the
/// maximum.
///
/// # Errors
/// If the lengths differ.
pub fn log_softmax(logits: &[f32], out: &mut [f32]) -> Result<()> {
    if logits.len() != out.len() {
        return Err(SamplingError::Length {
            what: "log_softmax out",
            expected: logits.len(),
            got: out.len(),
        });
    }
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    let lse = m + s.ln();
    for (o, &v) in out.iter_mut().zip(logits) {
        *o = (v as f64 - lse) as f32;
    }
    Ok(())
}

/// A request's sampling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 (or below) is greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps every token.
    pub top_k: usize,
    /// The request's seed.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether the settings pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// # Errors
    /// A NaN temperature, or `top_p` outside (0, 1].
    pub fn validate(&self) -> Result<()> {
        if self.temperature.is_nan() {
            return Err(SamplingError::Param {
                what: "temperature",
                why: "NaN".into(),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::Param {
                what: "top_p",
                why: format!("{} is outside (0, 1]", self.top_p),
            });
        }
        Ok(())
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform draw in [0, 1) of `seed` at `step`: a pure function of the two (so of no
/// batch, thread or earlier draw).
pub fn uniform(seed: u64, step: u64) -> f64 {
    let z = splitmix64(splitmix64(seed) ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Sampling scratch (reused across calls: no allocation once grown to the vocabulary).
#[derive(Debug, Default, Clone)]
pub struct Sampler {
    idx: Vec<u32>,
    w: Vec<f64>,
}

impl Sampler {
    /// An empty scratch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Draws a token from `logits` under `params` at the sequence's `step` (its count of
    /// sampled tokens so far): argmax when greedy; else softmax of `logits / temperature`
    /// (weights `exp((l - max) / T)` in f64) restricted to the `top_k` largest, then to the
    /// smallest prefix (by logit, descending; ties by index) whose mass reaches `top_p` of
    /// what is left, and one draw [`uniform`]`(seed, step)` over what remains. NaN logits are
    /// never drawn (unless greedy, as `argmax`).
    ///
    /// # Errors
    /// Empty `logits` or invalid `params`.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams, step: u64) -> Result<u32> {
        if logits.is_empty() {
            return Err(SamplingError::Empty {
                what: "sample logits",
            });
        }
        params.validate()?;
        if params.is_greedy() {
            return Ok(argmax(logits));
        }
        let v = logits.len();
        let key = |i: u32| {
            let l = logits[i as usize];
            if l.is_nan() {
                f32::NEG_INFINITY
            } else {
                l
            }
        };
        // Descending logit, then ascending index: a total order, so the kept set and its
        // order do not depend on how the selection proceeds.
        let order = |a: &u32, b: &u32| -> Ordering { key(*b).total_cmp(&key(*a)).then(a.cmp(b)) };
        let m = logits.iter().fold(
            f32::NEG_INFINITY,
            |a, &b| if b.is_nan() { a } else { a.max(b) },
        );
        let inv_t = 1.0 / params.temperature as f64;
        self.w.clear();
        self.w.extend(logits.iter().map(|&l| {
            if l.is_nan() || m == f32::NEG_INFINITY {
                0.0
            } else {
                ((l as f64 - m as f64) * inv_t).exp()
            }
        }));
        self.idx.clear();
        self.idx.extend(0..v as u32);
        let w = &self.w;
        let idx = &mut self.idx;
        let top_k = if params.top_k == 0 {
            v
        } else {
            params.top_k.min(v)
        };
        let nucleus = params.top_p < 1.0;
        let kept: usize = if top_k < v {
            idx.select_nth_unstable_by(top_k - 1, order);
            idx.truncate(top_k);
            idx.sort_unstable_by(order);
            if nucleus {
                let total: f64 = idx.iter().map(|&i| w[i as usize]).sum();
                nucleus_len(idx, w, params.top_p as f64 * total)
            } else {
                top_k
            }
        } else if nucleus {
            let total: f64 = w.iter().sum();
            let goal = params.top_p as f64 * total;
            // Grow a sorted head until it holds the nucleus.
            let mut k = 64.min(v);
            loop {
                if k < v {
                    idx.select_nth_unstable_by(k - 1, order);
                }
                idx[..k].sort_unstable_by(order);
                let mass: f64 = idx[..k].iter().map(|&i| w[i as usize]).sum();
                if mass >= goal || k == v {
                    break nucleus_len(&idx[..k], w, goal);
                }
                k = (k * 4).min(v);
            }
        } else {
            v
        };
        let kept = &idx[..kept.max(1)];
        let total: f64 = kept.iter().map(|&i| w[i as usize]).sum();
        let target = uniform(params.seed, step) * total;
        let mut acc = 0.0;
        for &i in kept {
            acc += w[i as usize];
            if acc > target {
                return Ok(i);
            }
        }
        Ok(*kept.last().expect("non-empty"))
    }
}

/// The length of the shortest prefix of `sorted` whose weights sum to at least `goal` (at
/// least 1; all of it if none does).
fn nucleus_len(sorted: &[u32], w: &[f64], goal: f64) -> usize {
    let mut acc = 0.0;
    for (n, &i) in sorted.iter().enumerate() {
        acc += w[i as usize];
        if acc >= goal {
            return n + 1;
        }
    }
    sorted.len()
}
