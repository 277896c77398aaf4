//! Row-wise and elementwise ops: the norms (RMSNorm, LayerNorm, [`Norm`]), the activations
//! ([`Activation`], gated as SwiGLU/GeGLU or plain), soft capping, the residual add.

use rayon::prelude::*;

use super::{check_len, OpsError, Result};

/// Elements over which a row-wise op goes parallel.
const PAR_ELEMS: usize = 1 << 16;

/// RMSNorm of each row of `x` (`[t, h]` with `h = weight.len()`) into `out`, as
/// transformers' `LlamaRMSNorm` computes it in f32: `weight * (x * rsqrt(mean(x²) + eps))`,
/// `rsqrt` as `1 / sqrt`. The mean of squares is summed in f64 and rounded once to f32 (torch
/// sums in f32 in an order of its own; this is the correctly rounded value it approximates).
///
/// # Errors
/// An empty `weight`, `x` not a whole number of rows, or `out` not `x`'s length.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let h = weight.len();
    if h == 0 {
        return Err(OpsError::Empty {
            what: "rms_norm weight",
        });
    }
    check_len(
        "rms_norm x (a multiple of the weight)",
        x.len().div_ceil(h) * h,
        x.len(),
    )?;
    check_len("rms_norm out", x.len(), out.len())?;
    let row = |(xs, os): (&[f32], &mut [f32])| {
        let ss: f64 = xs.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let var = (ss / h as f64) as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((o, &v), &w) in os.iter_mut().zip(xs).zip(weight) {
            *o = w * (v * r);
        }
    };
    if x.len() >= PAR_ELEMS {
        x.par_chunks(h).zip(out.par_chunks_mut(h)).for_each(row);
    } else {
        x.chunks(h).zip(out.chunks_mut(h)).for_each(row);
    }
    Ok(())
}

/// LayerNorm of each row of `x` (`[t, h]` with `h = weight.len()`) into `out`, as torch's
/// `layer_norm` computes it in f32: `(x - mean) * rsqrt(var + eps) * weight + bias` with the
/// biased variance. Mean and variance are summed in f64 and rounded once to f32.
///
/// # Errors
/// An empty `weight`, `bias` not `weight`'s length, `x` not a whole number of rows, or `out`
/// not `x`'s length.
pub fn layer_norm(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<()> {
    let h = weight.len();
    if h == 0 {
        return Err(OpsError::Empty {
            what: "layer_norm weight",
        });
    }
    check_len("layer_norm bias", h, bias.len())?;
    check_len(
        "layer_norm x (a multiple of the weight)",
        x.len().div_ceil(h) * h,
        x.len(),
    )?;
    check_len("layer_norm out", x.len(), out.len())?;
    let row = |(xs, os): (&[f32], &mut [f32])| {
        let mean = xs.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
        let var = xs.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
        let (mean, r) = (mean as f32, 1.0 / (var as f32 + eps).sqrt());
        for (((o, &v), &w), &b) in os.iter_mut().zip(xs).zip(weight).zip(bias) {
            *o = (v - mean) * r * w + b;
        }
    };
    if x.len() >= PAR_ELEMS {
        x.par_chunks(h).zip(out.par_chunks_mut(h)).for_each(row);
    } else {
        x.chunks(h).zip(out.chunks_mut(h)).for_each(row);
    }
    Ok(())
}

/// A normalization of the residual stream's rows, with its weights.
#[derive(Clone, Debug)]
pub enum Norm {
    /// RMSNorm ([`rms_norm`]). Gemma's `x * (1 + w)` is this with `1 + w` as the weight
    /// (the same f32 product).
    Rms {
        /// The scale per element.
        weight: Vec<f32>,
        /// Added to the mean of squares.
        eps: f32,
    },
    /// LayerNorm ([`layer_norm`]).
    Layer {
        /// The scale per element.
        weight: Vec<f32>,
        /// The shift per element.
        bias: Vec<f32>,
        /// Added to the variance.
        eps: f32,
    },
}

impl Norm {
    /// The width of the rows it normalizes.
    pub fn width(&self) -> usize {
        match self {
            Norm::Rms { weight, .. } | Norm::Layer { weight, .. } => weight.len(),
        }
    }

    /// Normalizes each row of `x` into `out`.
    ///
    /// # Errors
    /// As [`rms_norm`] and [`layer_norm`].
    pub fn apply(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        match self {
            Norm::Rms { weight, eps } => rms_norm(x, weight, *eps, out),
            Norm::Layer { weight, bias, eps } => layer_norm(x, weight, bias, *eps, out),
        }
    }
}

/// An MLP's activation function, in f32 as torch computes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x / (1 + exp(-x))` (SiLU; Llama's SwiGLU gate).
    Silu,
    /// GELU by `tanh`: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (`gelu_pytorch_tanh`,
    /// Gemma; BLOOM's `bloom_gelu` is the same function).
    GeluTanh,
    /// GELU by `erf`: `0.5 x (1 + erf(x / √2))` (`gelu`, BERT and BART).
    Gelu,
    /// `max(x, 0)` (`relu`, OPT).
    Relu,
}

impl Activation {
    /// The function at `x`.
    pub fn at(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
            }
            Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
            // Not `x.max(0.0)`, which turns a NaN into 0: torch's relu keeps it, and so the
            // layer check still sees a broken value.
            Activation::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
        }
    }
}

/// `out = act(gate) * up` elementwise (SwiGLU with [`Activation::Silu`], GeGLU with GELU).
///
/// # Errors
/// If the lengths differ.
pub fn gated(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("gated up", gate.len(), up.len())?;
    check_len("gated out", gate.len(), out.len())?;
    let f = |((o, &g), &u): ((&mut f32, &f32), &f32)| *o = act.at(g) * u;
    if gate.len() >= PAR_ELEMS {
        out.par_iter_mut().zip(gate).zip(up).for_each(f);
    } else {
        out.iter_mut().zip(gate).zip(up).for_each(f);
    }
    Ok(())
}

/// `x = act(x)` elementwise (an ungated MLP's activation).
pub fn activate(act: Activation, x: &mut [f32]) {
    let f = |v: &mut f32| *v = act.at(*v);
    if x.len() >= PAR_ELEMS {
        x.par_iter_mut().for_each(f);
    } else {
        x.iter_mut().for_each(f);
    }
}

/// `x = cap · tanh(x / cap)` elementwise: Gemma-2's soft cap of its final logits.
pub fn soft_cap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = (*v / cap).tanh() * cap;
    }
}

/// `out = silu(gate) * up` elementwise, `silu(g) = g / (1 + exp(-g))` in f32 as torch does.
///
/// # Errors
/// If the lengths differ.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    gated(Activation::Silu, gate, up, out)
}

/// The residual add `x += y`.
///
/// # Errors
/// If the lengths differ.
pub fn add_assign(x: &mut [f32], y: &[f32]) -> Result<()> {
    check_len("add_assign y", x.len(), y.len())?;
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
    Ok(())
}
