//! Rotary position embeddings, with cos/sin computed as transformers computes them.

use super::{OpsError, Result};

/// Largest head size [`Rope`] takes (its per-token cos/sin live on the stack).
const MAX_HEAD_DIM: usize = 1024;

/// Which elements of a head rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GGUF / llama.cpp's "normal" mode: pairs `(x[2i], x[2i+1])` rotate by `θ_i` (what
    /// llama-architecture GGUF weights, whose q/k rows are permuted, need).
    Normal,
    /// Neox / transformers' `rotate_half`: pairs `(x[i], x[i + d/2])` rotate by `θ_i` (weights
    /// in Hugging Face's layout).
    Neox,
}

/// RoPE for heads of `head_dim` elements: `θ_i = pos · inv_freq[i]`, `inv_freq[i] = 1 /
/// base^(2i/d)`, all as transformers' `LlamaRotaryEmbedding` does in f32 (`2i/d` and the
/// power's result rounded to f32, `1 / p` and `pos · inv_freq` in f32, then cos and sin,
/// here computed in f64 and rounded once).
#[derive(Clone, Debug)]
pub struct Rope {
    head_dim: usize,
    style: RopeStyle,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// # Errors
    /// If `head_dim` is odd, zero or above 1024, or `base` is not positive and finite.
    pub fn new(head_dim: usize, base: f32, style: RopeStyle) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
            return Err(OpsError::Param {
                what: "rope head_dim",
                why: format!("{head_dim} is not an even number in 2..={MAX_HEAD_DIM}"),
            });
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(OpsError::Param {
                what: "rope base",
                why: format!("{base} is not positive and finite"),
            });
        }
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / head_dim as f32;
                let p = (base as f64).powf(e as f64) as f32;
                1.0 / p
            })
            .collect();
        Ok(Rope {
            head_dim,
            style,
            inv_freq,
        })
    }

    /// The head size.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The pairing.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// `inv_freq[i]`, `head_dim / 2` of them.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// cos and sin of `θ_i` at `pos` (each `head_dim / 2` long).
    ///
    /// # Panics
    /// If `cos` or `sin` is not `head_dim / 2` long.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        assert_eq!(cos.len(), self.inv_freq.len());
        assert_eq!(sin.len(), self.inv_freq.len());
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let theta = (p * f) as f64;
            *c = theta.cos() as f32;
            *s = theta.sin() as f32;
        }
    }

    /// Rotates every head of every row of `x` (`[t, heads · head_dim]`, `t =
    /// positions.len()`) in place, row `r` at `positions[r]`: `x1' = x1·cos − x2·sin`,
    /// `x2' = x2·cos + x1·sin` (each product rounded, as transformers' `q * cos +
    /// rotate_half(q) * sin`).
    ///
    /// # Errors
    /// If `x` is not `positions.len()` rows of `heads` heads.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], heads: usize) -> Result<()> {
        let w = heads * self.head_dim;
        super::check_len(
            "rope x (positions × heads × head_dim)",
            positions.len() * w,
            x.len(),
        )?;
        if w == 0 {
            return Ok(());
        }
        let half = self.head_dim / 2;
        let mut cos = [0f32; MAX_HEAD_DIM / 2];
        let mut sin = [0f32; MAX_HEAD_DIM / 2];
        let (cos, sin) = (&mut cos[..half], &mut sin[..half]);
        for (row, &pos) in x.chunks_exact_mut(w).zip(positions) {
            self.cos_sin(pos, cos, sin);
            for head in row.chunks_exact_mut(self.head_dim) {
                for i in 0..half {
                    let (a, b) = match self.style {
                        RopeStyle::Normal => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x1, x2) = (head[a], head[b]);
                    head[a] = x1 * cos[i] - x2 * sin[i];
                    head[b] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
        Ok(())
    }
}
