//! Dequantization of GGUF rows to f32, the int8 quantization of activations (llama.cpp's
//! Q8_1 scheme), and the repacking of quantized weights into the fast kernels' layout.

use half::{bf16, f16};

use super::{OpsError, Result};
use crate::models::weights::WeightType;

/// Elements per activation block (and per weight block of the quantized types).
pub const ACT_BLOCK: usize = 32;

/// Rows of a weight group: the fast kernels compute 16 output rows at once.
pub(crate) const GROUP: usize = 16;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes one row of `out.len()` elements stored as `ty` in `bytes` into `out`, as
/// gguf-py (and so Hugging Face transformers) does, in f32: `Q4_0` `d * (q - 8)`, `Q4_1`
/// `(d * q) + m` (two roundings, no fused multiply-add), `Q8_0` `d * q`.
///
/// # Errors
/// If `out.len()` is not a whole number of blocks or `bytes` is not its size.
pub fn dequantize_row(ty: WeightType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let row = ty.row_bytes(out.len()).ok_or(OpsError::NotBlockMultiple {
        what: "dequantize_row",
        ty,
        len: out.len(),
        block: ty.block_len(),
    })?;
    super::check_len("dequantize_row bytes", row, bytes.len())?;
    match ty {
        WeightType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        WeightType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        WeightType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = d * ((b[2 + j] & 15) as i32 - 8) as f32;
                    o[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
                }
            }
        }
        WeightType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = d * (b[4 + j] & 15) as f32 + m;
                    o[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
                }
            }
        }
        WeightType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
    }
    Ok(())
}

/// Quantizes `x` (a whole number of 32-blocks) to int8 per block as llama.cpp's
/// `quantize_row_q8_1` does: `d = max|x| / 127`, `q = round(x / d)` (here `x * (1 / d)`,
/// rounded half to even, the same in every instruction set). Writes `q`, `d` and `Σq` per
/// block.
///
/// # Panics
/// If the lengths disagree.
pub fn quantize_row_q8(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    assert_eq!(x.len(), q.len());
    assert_eq!(x.len(), d.len() * ACT_BLOCK);
    assert_eq!(d.len(), sum.len());
    quantize_dispatch(x, q, d, sum);
}

/// The body, written so that the compiler vectorizes it: the same IEEE operations on every
/// instruction set (rounding by adding and subtracting 1.5 · 2^23, exact round-half-even
/// for |v| < 2^22), so every path gives the same bytes.
#[inline(always)]
fn quantize_body(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    const MAGIC: f32 = 12_582_912.0;
    for (((xb, qb), db), sb) in x
        .chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .zip(d.iter_mut())
        .zip(sum.iter_mut())
    {
        let mut amax = 0.0f32;
        for &v in xb {
            let a = v.abs();
            amax = if a > amax { a } else { amax };
        }
        let scale = amax / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let mut s = 0i32;
        for (qv, &xv) in qb.iter_mut().zip(xb) {
            let r = ((xv * inv + MAGIC) - MAGIC).clamp(-127.0, 127.0) as i8;
            *qv = r;
            s += r as i32;
        }
        *db = scale;
        *sb = s;
    }
}

fn quantize_dispatch(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        fn avx512(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
            quantize_body(x, q, d, sum)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
            quantize_body(x, q, d, sum)
        }
        if std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the features were just detected.
            return unsafe { avx512(x, q, d, sum) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the feature was just detected.
            return unsafe { avx2(x, q, d, sum) };
        }
    }
    quantize_body(x, q, d, sum)
}

/// One row's inputs and outputs in [`QuantActs::fill`].
type Row<'a> = (
    ((&'a [f32], &'a mut [i8]), (&'a mut [f32], &'a mut [i32])),
    &'a mut [f32],
);

/// A batch of activations quantized per 32-block: what the fast kernels read.
#[derive(Default)]
pub(crate) struct QuantActs {
    /// `[t, in]` int8 values.
    pub q: Vec<i8>,
    /// `[t, in / 32]` scales.
    pub d: Vec<f32>,
    /// `[t, in / 32]` sums of the block's `q`.
    pub sum: Vec<i32>,
    /// `[t, in / 32]` `d * Σq` (the Q4_1 minimum's factor).
    pub ds: Vec<f32>,
}

impl QuantActs {
    /// Quantizes `x` (`[t, k]`), reusing the buffers (they only ever grow); rows in parallel
    /// when there are many.
    pub fn fill(&mut self, x: &[f32], k: usize) {
        use rayon::prelude::*;
        let nb = k / ACT_BLOCK;
        let t = x.len() / k;
        for v in [&mut self.d, &mut self.ds] {
            if v.len() < t * nb {
                v.resize(t * nb, 0.0);
            }
        }
        if self.q.len() < t * k {
            self.q.resize(t * k, 0);
        }
        if self.sum.len() < t * nb {
            self.sum.resize(t * nb, 0);
        }
        let row = |(((xs, q), (d, s)), ds): Row<'_>| {
            quantize_dispatch(xs, q, d, s);
            for (o, (&dv, &sv)) in ds.iter_mut().zip(d.iter().zip(s.iter())) {
                *o = dv * sv as f32;
            }
        };
        let (q, d, s, ds) = (
            &mut self.q[..t * k],
            &mut self.d[..t * nb],
            &mut self.sum[..t * nb],
            &mut self.ds[..t * nb],
        );
        if t * k >= 1 << 15 {
            x.par_chunks(k)
                .zip(q.par_chunks_mut(k))
                .zip(d.par_chunks_mut(nb).zip(s.par_chunks_mut(nb)))
                .zip(ds.par_chunks_mut(nb))
                .for_each(row);
        } else {
            x.chunks(k)
                .zip(q.chunks_mut(k))
                .zip(d.chunks_mut(nb).zip(s.chunks_mut(nb)))
                .zip(ds.chunks_mut(nb))
                .for_each(row);
        }
    }
}

/// The integer type of repacked weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QKind {
    /// 4-bit, `(q - 8) * d`.
    Q4_0,
    /// 4-bit, `q * d + m`.
    Q4_1,
    /// 8-bit signed, `q * d`.
    Q8_0,
}

impl QKind {
    /// Repacked bytes of one group's block (16 rows × 32 weights).
    pub fn block_bytes(self) -> usize {
        match self {
            QKind::Q4_0 | QKind::Q4_1 => GROUP * 16,
            QKind::Q8_0 => GROUP * 32,
        }
    }
}

/// Quantized weights repacked for the fast kernels. Rows are taken 16 at a time (a group; the
/// last one padded with zero rows); per group and 32-block, the integer values are stored in
/// chunks of 64 bytes holding 4 consecutive bytes of each of the 16 rows (one `vpdpbusd`
/// operand): for the 4-bit types chunk `p` (0..4) holds GGUF's bytes `4p..4p+4` of each row,
/// whose low nibbles are elements `4p..4p+4` and high nibbles elements `16+4p..16+4p+4`; for
/// Q8_0 chunk `g` (0..8) holds elements `4g..4g+4`. Scales (and Q4_1's minimums) are f32,
/// 16 per group and block.
pub(crate) struct QWeights {
    pub kind: QKind,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row.
    pub nb: usize,
    /// Groups of 16 rows.
    pub groups: usize,
    /// `[groups, nb, block_bytes]`.
    pub qs: Vec<u8>,
    /// `[groups, nb, 16]`.
    pub d: Vec<f32>,
    /// `[groups, nb, 16]` (Q4_1 only; empty otherwise).
    pub m: Vec<f32>,
}

impl QWeights {
    /// Repacks `rows` GGUF rows of `cols` elements (`bytes` already checked to be their size).
    pub fn new(ty: WeightType, bytes: &[u8], rows: usize, cols: usize) -> Self {
        let kind = match ty {
            WeightType::Q4_0 => QKind::Q4_0,
            WeightType::Q4_1 => QKind::Q4_1,
            WeightType::Q8_0 => QKind::Q8_0,
            _ => unreachable!("only quantized types are repacked"),
        };
        let nb = cols / ACT_BLOCK;
        let groups = rows.div_ceil(GROUP);
        let bb = kind.block_bytes();
        let mut qs = vec![0u8; groups * nb * bb];
        let mut d = vec![0f32; groups * nb * GROUP];
        let mut m = if kind == QKind::Q4_1 {
            vec![0f32; groups * nb * GROUP]
        } else {
            Vec::new()
        };
        let src_bb = ty.block_bytes();
        let row_bytes = nb * src_bb;
        for r in 0..rows {
            let (g, rr) = (r / GROUP, r % GROUP);
            for b in 0..nb {
                let src = &bytes[r * row_bytes + b * src_bb..][..src_bb];
                let at = (g * nb + b) * GROUP + rr;
                d[at] = f16_at(src, 0);
                let dst = &mut qs[(g * nb + b) * bb..][..bb];
                match kind {
                    QKind::Q4_0 | QKind::Q4_1 => {
                        let nib = if kind == QKind::Q4_1 {
                            m[at] = f16_at(src, 2);
                            &src[4..20]
                        } else {
                            &src[2..18]
                        };
                        for p in 0..4 {
                            dst[p * 64 + rr * 4..][..4].copy_from_slice(&nib[p * 4..][..4]);
                        }
                    }
                    QKind::Q8_0 => {
                        for gq in 0..8 {
                            dst[gq * 64 + rr * 4..][..4].copy_from_slice(&src[2 + gq * 4..][..4]);
                        }
                    }
                }
            }
        }
        QWeights {
            kind,
            rows,
            cols,
            nb,
            groups,
            qs,
            d,
            m,
        }
    }
}
