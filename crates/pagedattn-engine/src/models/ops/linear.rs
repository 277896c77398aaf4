//! [`Linear`]: `y = x Wᵀ` over a GGUF weight matrix, exact (f32) or fast (int8 dots).

use std::cell::RefCell;

use rayon::prelude::*;

use super::gemv::Gemv;
use super::qdot::{self, QIsa, MAX_COLS};
use super::quant::{dequantize_row, QWeights, QuantActs, ACT_BLOCK, GROUP};
use super::{check_len, isa_from_env, Isa, OpsError, Result};
use crate::models::weights::WeightType;

/// From this many activation rows on (and for a single row), the exact path multiplies with the
/// `gemm` project (its `gemm-f32` crate); between, with its own f32 kernel (which measured
/// faster up to 64 rows on Zen 5: `cargo bench --bench ops -- gemm`).
pub const GEMM_MIN_ROWS: usize = 96;

/// Multiply-adds under which a product runs on the calling thread alone.
const SERIAL_MACS: usize = 1 << 18;

/// How a [`Linear`] multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Weights dequantized to f32 at load, f32 products with f32 accumulation: what Hugging
    /// Face transformers computes over a GGUF file (the golden path).
    Exact,
    /// Quantized weights kept as they are (Q4_0, Q4_1, Q8_0), activations quantized to int8
    /// per 32-block on the fly, integer dot products. Float weight types run as `Exact`.
    Fast,
}

enum Repr {
    F32(Vec<f32>),
    Quant(QWeights),
}

/// A weight matrix `[out, in]` (each row of `in` elements contiguous, as GGUF stores it) and
/// its product `y[t, out] = x[t, in] · Wᵀ`.
pub struct Linear {
    out: usize,
    inp: usize,
    ty: WeightType,
    precision: Precision,
    isa: Isa,
    gemm_min_rows: usize,
    repr: Repr,
    /// Added to every output row (`[out]`), where the layer has one.
    bias: Option<Vec<f32>>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("out", &self.out)
            .field("in", &self.inp)
            .field("ty", &self.ty)
            .field("precision", &self.precision)
            .field("isa", &self.isa)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

thread_local! {
    static ACTS: RefCell<QuantActs> = RefCell::new(QuantActs::default());
}

/// A raw pointer that tasks writing disjoint parts of one buffer share.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: every user writes a part of the buffer no other task touches, and the buffer
// outlives the parallel section (it is borrowed mutably for its whole length).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl Linear {
    /// A matrix of `out` rows of `inp` elements stored as `ty` in `bytes` (GGUF's layout).
    /// The instruction set is `PAGEDATTN_ISA`'s, else the best of this CPU.
    ///
    /// # Errors
    /// A zero dimension, `inp` not a whole number of `ty`'s blocks, `bytes` not the matrix's
    /// size, or a bad `PAGEDATTN_ISA`.
    pub fn from_gguf(
        bytes: &[u8],
        ty: WeightType,
        out: usize,
        inp: usize,
        precision: Precision,
    ) -> Result<Self> {
        if out == 0 || inp == 0 {
            return Err(OpsError::Empty { what: "Linear" });
        }
        let row = ty.row_bytes(inp).ok_or(OpsError::NotBlockMultiple {
            what: "Linear in",
            ty,
            len: inp,
            block: ty.block_len(),
        })?;
        check_len("Linear bytes", row * out, bytes.len())?;
        let isa = isa_from_env()?;
        let quantized = matches!(ty, WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q8_0);
        let repr = if precision == Precision::Fast && quantized {
            Repr::Quant(QWeights::new(ty, bytes, out, inp))
        } else {
            let mut w = vec![0f32; out * inp];
            w.par_chunks_mut(inp)
                .zip(bytes.par_chunks(row))
                .for_each(|(o, b)| dequantize_row(ty, b, o).expect("sizes checked"));
            Repr::F32(w)
        };
        Ok(Linear {
            out,
            inp,
            ty,
            precision,
            isa,
            gemm_min_rows: GEMM_MIN_ROWS,
            repr,
            bias: None,
        })
    }

    /// A matrix from f32 values (`[out, inp]`, row-major), for synthetic models. Both
    /// precisions compute in f32.
    ///
    /// # Errors
    /// A zero dimension, `values` not `out * inp` long, or a bad `PAGEDATTN_ISA`.
    pub fn from_f32(values: &[f32], out: usize, inp: usize, precision: Precision) -> Result<Self> {
        if out == 0 || inp == 0 {
            return Err(OpsError::Empty { what: "Linear" });
        }
        check_len("Linear values", out * inp, values.len())?;
        Ok(Linear {
            out,
            inp,
            ty: WeightType::F32,
            precision,
            isa: isa_from_env()?,
            gemm_min_rows: GEMM_MIN_ROWS,
            repr: Repr::F32(values.to_vec()),
            bias: None,
        })
    }

    /// The same matrix with a bias added to every output row, `y = x · Wᵀ + b`.
    ///
    /// # Errors
    /// `bias` not `out` long.
    pub fn with_bias(mut self, bias: Vec<f32>) -> Result<Self> {
        check_len("Linear bias", self.out, bias.len())?;
        self.bias = Some(bias);
        Ok(self)
    }

    /// The bias added to every output row, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// Output features (rows of the matrix).
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Input features (columns of the matrix).
    pub fn in_features(&self) -> usize {
        self.inp
    }

    /// The type the weights were given in.
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// The precision asked for at construction.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The weights as f32 (`[out, in]`, row-major), unless they are kept quantized (`Fast`
    /// over a quantized type).
    pub fn f32_weights(&self) -> Option<&[f32]> {
        match &self.repr {
            Repr::F32(w) => Some(w),
            Repr::Quant(_) => None,
        }
    }

    /// Whether products run on int8 dots (`Fast` over a quantized type).
    pub fn is_quantized(&self) -> bool {
        matches!(self.repr, Repr::Quant(_))
    }

    /// Sets the number of activation rows from which the exact path multiplies with the
    /// `gemm` crate ([`GEMM_MIN_ROWS`] by default; 1 always; `usize::MAX` never, not even for
    /// a single row).
    pub fn set_gemm_min_rows(&mut self, rows: usize) {
        self.gemm_min_rows = rows;
    }

    /// The instruction set chosen at construction.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// `y[t, out] = x[t, in] · Wᵀ (+ bias)` for `t = x.len() / in` rows.
    ///
    /// # Errors
    /// If `x` is not a whole number of rows, or `y` not `t * out` long.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        self.forward_isa(self.isa, x, y)
    }

    /// [`Linear::forward`] on the kernels of `isa` (every instruction set gives the same bits
    /// on the fast path; the exact path's f32 sums may differ in order).
    ///
    /// # Errors
    /// As [`Linear::forward`], and if this CPU lacks `isa`.
    pub fn forward_isa(&self, isa: Isa, x: &[f32], y: &mut [f32]) -> Result<()> {
        if !isa.is_available() {
            return Err(OpsError::Isa(format!("this CPU lacks {isa}")));
        }
        if !x.len().is_multiple_of(self.inp) {
            return Err(OpsError::Length {
                what: "Linear x (a multiple of in)",
                expected: x.len().div_ceil(self.inp) * self.inp,
                got: x.len(),
            });
        }
        let t = x.len() / self.inp;
        check_len("Linear y", t * self.out, y.len())?;
        if t == 0 {
            return Ok(());
        }
        match &self.repr {
            Repr::F32(w) => self.forward_f32(isa, w, x, y, t),
            Repr::Quant(q) => self.forward_quant(QIsa::of(isa), q, x, y, t),
        }
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.out) {
                for (v, &b) in row.iter_mut().zip(bias) {
                    *v += b;
                }
            }
        }
        Ok(())
    }

    fn forward_f32(&self, isa: Isa, w: &[f32], x: &[f32], y: &mut [f32], t: usize) {
        let (out, k) = (self.out, self.inp);
        let threads = rayon::current_num_threads();
        // A single row too: gemm's matrix-vector kernel measured about 1.5-2x this one's.
        if t >= self.gemm_min_rows || (t == 1 && self.gemm_min_rows != usize::MAX) {
            let par = if t * out * k < SERIAL_MACS || threads == 1 {
                gemm_common::Parallelism::None
            } else {
                gemm_common::Parallelism::Rayon(threads)
            };
            // SAFETY: dst is y as [t, out] (column stride 1, row stride out), lhs x as [t, k]
            // (1, k), rhs Wᵀ as [k, out] (row stride 1, column stride k): every index the
            // product reads or writes lies in the slices, whose lengths were checked.
            unsafe {
                gemm_f32::gemm::f32::get_gemm_fn()(
                    t,
                    out,
                    k,
                    y.as_mut_ptr(),
                    1,
                    out as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                );
            }
            return;
        }
        let yp = SendPtr(y.as_mut_ptr());
        let run = |o0: usize, o1: usize| {
            let p = yp;
            isa.vectorize_dividing(
                k,
                Gemv {
                    w,
                    x,
                    k,
                    o0,
                    o1,
                    y: p.0,
                    ldy: out,
                },
            )
        };
        if t * out * k < SERIAL_MACS || threads == 1 {
            run(0, out);
        } else {
            // Chunks of whole 8-row tiles, about 4 per thread.
            let chunk = out.div_ceil(threads * 4).next_multiple_of(8);
            (0..out.div_ceil(chunk))
                .into_par_iter()
                .for_each(|i| run(i * chunk, ((i + 1) * chunk).min(out)));
        }
    }

    fn forward_quant(&self, qisa: QIsa, w: &QWeights, x: &[f32], y: &mut [f32], t: usize) {
        let k = self.inp;
        debug_assert!(k.is_multiple_of(ACT_BLOCK));
        ACTS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut acts) => {
                acts.fill(x, k);
                quant_tasks(qisa, w, &acts, y, t);
            }
            // Re-entered on this thread (a nested parallel call stole this work): a buffer of
            // its own.
            Err(_) => {
                let mut acts = QuantActs::default();
                acts.fill(x, k);
                quant_tasks(qisa, w, &acts, y, t);
            }
        });
    }
}

/// Runs the fast kernels over all groups and activation rows, split into tasks of
/// (group range × activation-row range).
fn quant_tasks(qisa: QIsa, w: &QWeights, acts: &QuantActs, y: &mut [f32], t: usize) {
    let (out, groups) = (w.rows, w.groups);
    let col_tiles = t.div_ceil(MAX_COLS);
    let yp = SendPtr(y.as_mut_ptr());
    // Groups whose weights fill about 128 KiB (half of L2 on the smallest we target): each
    // activation tile then meets them all while they stay in cache, and the tile's outputs
    // are written as runs of consecutive rows (no page per 16 floats on a wide LM head).
    let group_bytes =
        w.nb * (w.kind.block_bytes() + GROUP * 4 * if w.m.is_empty() { 1 } else { 2 });
    let super_groups = ((128 << 10) / group_bytes).max(1);
    let run = |g0: usize, g1: usize, ct0: usize, ct1: usize| {
        let p = yp;
        let mut buf = [[0f32; GROUP]; MAX_COLS];
        for s0 in (g0..g1).step_by(super_groups) {
            for ct in ct0..ct1 {
                let c0 = ct * MAX_COLS;
                let n = MAX_COLS.min(t - c0);
                for g in s0..(s0 + super_groups).min(g1) {
                    let rows = GROUP.min(out - g * GROUP);
                    qdot::group(qisa, w, acts, g, c0, &mut buf[..n]);
                    for (c, b) in buf[..n].iter().enumerate() {
                        // SAFETY: row c0 + c < t and columns g*16 .. g*16 + rows <= out lie
                        // in y ([t, out]); this task alone writes groups g0..g1 of rows
                        // ct0..ct1.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                b.as_ptr(),
                                p.0.add((c0 + c) * out + g * GROUP),
                                rows,
                            )
                        };
                    }
                }
            }
        }
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || t * out * w.cols < SERIAL_MACS {
        run(0, groups, 0, col_tiles);
        return;
    }
    // About 4 tasks a thread on large products, 1 on small ones (rayon's dispatch costs
    // microseconds).
    let target = threads * (t * out * w.cols / (1 << 20)).clamp(1, 4);
    // A matrix that fits in L2 is split by activation rows first (each task meets every
    // weight, from cache, with few activations); a larger one by weight rows first (its
    // weights read from memory once).
    let (gsplit, csplit) = if groups * group_bytes <= 512 << 10 {
        let csplit = col_tiles.min(target);
        (target.div_ceil(csplit).min(groups), csplit)
    } else {
        let gsplit = groups.min(target);
        (gsplit, target.div_ceil(gsplit).min(col_tiles))
    };
    (0..gsplit * csplit).into_par_iter().for_each(|i| {
        let (gi, ci) = (i / csplit, i % csplit);
        run(
            groups * gi / gsplit,
            groups * (gi + 1) / gsplit,
            col_tiles * ci / csplit,
            col_tiles * (ci + 1) / csplit,
        )
    });
}
