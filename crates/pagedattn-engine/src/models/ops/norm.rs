//! Row-wise elementwise ops: RMSNorm, SwiGLU, residual add.

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

/// `out = silu(gate) * up` elementwise, `silu(g) = g / (1 + exp(-g))` in f32 as torch does.
///
/// # Errors
/// If the lengths differ.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("swiglu up", gate.len(), up.len())?;
    check_len("swiglu out", gate.len(), out.len())?;
    let f = |((o, &g), &u): ((&mut f32, &f32), &f32)| *o = g / (1.0 + (-g).exp()) * u;
    if gate.len() >= PAR_ELEMS {
        out.par_iter_mut().zip(gate).zip(up).for_each(f);
    } else {
        out.iter_mut().zip(gate).zip(up).for_each(f);
    }
    Ok(())
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
