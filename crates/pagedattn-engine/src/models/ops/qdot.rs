//! The fast path's integer kernels: one group of 16 weight rows against up to 8 int8
//! activation rows, block by block. Every kernel computes, per (row, activation row), the
//! same exact integer dot of each 32-block and folds it into an f32 accumulator with the same
//! fused multiply-adds in the same order (`acc = fma(dw * da, isum, acc)`, then for Q4_1
//! `acc = fma(m, da * Σqa, acc)`), so every instruction set gives bit-identical results.

// The kernels index several per-activation-row register arrays with one counter.
#![allow(clippy::needless_range_loop)]

use super::quant::{QKind, QWeights, QuantActs, GROUP};

/// The integer-dot instruction set of the fast path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QIsa {
    /// AVX-512 F/BW + VNNI (`vpdpbusd`).
    #[cfg(target_arch = "x86_64")]
    Vnni512,
    /// AVX2 (`vpmaddubsw`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Portable code.
    Scalar,
}

impl QIsa {
    /// The kernels for `isa`: AVX512-VNNI for the AVX-512 sets when the CPU has VNNI (AVX2
    /// otherwise), AVX2 for AVX2, scalar for the rest.
    pub fn of(isa: pagedattn::cpu::Isa) -> QIsa {
        #[cfg(target_arch = "x86_64")]
        {
            use pagedattn::cpu::Isa;
            let vnni = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni");
            let avx2 = std::arch::is_x86_feature_detected!("avx2");
            match isa {
                Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 if vnni => return QIsa::Vnni512,
                Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2 if avx2 => return QIsa::Avx2,
                _ => {}
            }
        }
        let _ = isa;
        QIsa::Scalar
    }
}

/// Most activation rows one kernel call takes.
pub(crate) const MAX_COLS: usize = 8;

const K4_0: u8 = 0;
const K4_1: u8 = 1;
const K8_0: u8 = 2;

/// Computes group `g` of `w` against activation rows `c0..c0 + out.len()` of `a` (`k`
/// elements each), writing the 16 rows' results per activation row into `out`
/// (`out.len() <= MAX_COLS`).
pub(crate) fn group(
    isa: QIsa,
    w: &QWeights,
    a: &QuantActs,
    g: usize,
    c0: usize,
    out: &mut [[f32; GROUP]],
) {
    let n = out.len();
    debug_assert!((1..=MAX_COLS).contains(&n));
    debug_assert!(g < w.groups && (c0 + n) * w.cols <= a.q.len());
    macro_rules! by_cols {
        ($f:ident, $k:expr) => {
            match n {
                8 => $f::<$k, 8>(w, a, g, c0, out),
                7 => $f::<$k, 7>(w, a, g, c0, out),
                6 => $f::<$k, 6>(w, a, g, c0, out),
                5 => $f::<$k, 5>(w, a, g, c0, out),
                4 => $f::<$k, 4>(w, a, g, c0, out),
                3 => $f::<$k, 3>(w, a, g, c0, out),
                2 => $f::<$k, 2>(w, a, g, c0, out),
                _ => $f::<$k, 1>(w, a, g, c0, out),
            }
        };
    }
    macro_rules! by_kind {
        ($f:ident) => {
            match w.kind {
                QKind::Q4_0 => by_cols!($f, K4_0),
                QKind::Q4_1 => by_cols!($f, K4_1),
                QKind::Q8_0 => by_cols!($f, K8_0),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `QIsa::Vnni512` is only made where the CPU has AVX-512 F/BW/VNNI (`QIsa::of`).
        QIsa::Vnni512 => unsafe { by_kind!(vnni512) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `QIsa::Avx2` is only made where the CPU has AVX2 (`QIsa::of`).
        QIsa::Avx2 => unsafe { by_kind!(avx2) },
        QIsa::Scalar => by_kind!(scalar),
    }
}

/// The reference kernel, in plain integer and f32 arithmetic.
fn scalar<const K: u8, const C: usize>(
    w: &QWeights,
    a: &QuantActs,
    g: usize,
    c0: usize,
    out: &mut [[f32; GROUP]],
) {
    let (nb, k) = (w.nb, w.cols);
    let bb = w.kind.block_bytes();
    for (c, o) in out.iter_mut().enumerate().take(C) {
        let row = c0 + c;
        let aq = &a.q[row * k..][..k];
        for (r, y) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for b in 0..nb {
                let wq = &w.qs[(g * nb + b) * bb..][..bb];
                let ab = &aq[b * 32..][..32];
                let mut isum = 0i32;
                if K == K8_0 {
                    for gq in 0..8 {
                        for j in 0..4 {
                            isum += (wq[gq * 64 + r * 4 + j] as i8) as i32 * ab[gq * 4 + j] as i32;
                        }
                    }
                } else {
                    for p in 0..4 {
                        for j in 0..4 {
                            let v = wq[p * 64 + r * 4 + j];
                            isum += (v & 15) as i32 * ab[p * 4 + j] as i32
                                + (v >> 4) as i32 * ab[16 + p * 4 + j] as i32;
                        }
                    }
                    if K == K4_0 {
                        isum -= 8 * a.sum[row * nb + b];
                    }
                }
                let at = (g * nb + b) * GROUP + r;
                let s = w.d[at] * a.d[row * nb + b];
                acc = s.mul_add(isum as f32, acc);
                if K == K4_1 {
                    acc = w.m[at].mul_add(a.ds[row * nb + b], acc);
                }
            }
            *y = acc;
        }
    }
}

/// Four activation bytes as one i32 (for a broadcast).
///
/// # Safety
/// `p..p + 4` must be readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn four(p: *const i8) -> i32 {
    // SAFETY: the caller's promise; the read is unaligned.
    unsafe { (p as *const i32).read_unaligned() }
}

/// AVX512-VNNI: 16 rows per zmm; per 4-byte group one `vpdpbusd` per activation row with the
/// activation's 4 bytes broadcast. Q8_0's signed weights are biased by 128 to unsigned and
/// `128 Σqa` subtracted; Q4_0's `8 Σqa` likewise.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI; `g` and `c0 + C` in range (checked by `group`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni512<const K: u8, const C: usize>(
    w: &QWeights,
    a: &QuantActs,
    g: usize,
    c0: usize,
    out: &mut [[f32; GROUP]],
) {
    use std::arch::x86_64::*;
    let (nb, k) = (w.nb, w.cols);
    let bb = w.kind.block_bytes();
    let m4 = _mm512_set1_epi8(0x0f);
    let bias = _mm512_set1_epi8(-128);
    let mut facc = [_mm512_setzero_ps(); C];
    // SAFETY (all pointer arithmetic below): group g's blocks lie in w.qs / w.d / w.m, and
    // activation rows c0..c0 + C of k bytes in a.q, with nb scales each in a.d / a.sum / a.ds
    // (the caller checked both ranges).
    unsafe {
        let qbase = w.qs.as_ptr().add(g * nb * bb);
        let dbase = w.d.as_ptr().add(g * nb * GROUP);
        let abase = a.q.as_ptr().add(c0 * k);
        for b in 0..nb {
            let wq = qbase.add(b * bb);
            let mut i0 = [_mm512_setzero_si512(); C];
            let mut i1 = [_mm512_setzero_si512(); C];
            if K == K8_0 {
                for gq in (0..8).step_by(2) {
                    let v0 =
                        _mm512_xor_si512(_mm512_loadu_si512(wq.add(gq * 64) as *const _), bias);
                    let v1 = _mm512_xor_si512(
                        _mm512_loadu_si512(wq.add(gq * 64 + 64) as *const _),
                        bias,
                    );
                    for c in 0..C {
                        let ap = abase.add(c * k + b * 32 + gq * 4);
                        i0[c] = _mm512_dpbusd_epi32(i0[c], v0, _mm512_set1_epi32(four(ap)));
                        i1[c] = _mm512_dpbusd_epi32(i1[c], v1, _mm512_set1_epi32(four(ap.add(4))));
                    }
                }
            } else {
                for p in 0..4 {
                    let v = _mm512_loadu_si512(wq.add(p * 64) as *const _);
                    let lo = _mm512_and_si512(v, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                    for c in 0..C {
                        let ap = abase.add(c * k + b * 32 + p * 4);
                        i0[c] = _mm512_dpbusd_epi32(i0[c], lo, _mm512_set1_epi32(four(ap)));
                        i1[c] = _mm512_dpbusd_epi32(i1[c], hi, _mm512_set1_epi32(four(ap.add(16))));
                    }
                }
            }
            let dw = _mm512_loadu_ps(dbase.add(b * GROUP));
            for c in 0..C {
                let at = (c0 + c) * nb + b;
                let mut iv = _mm512_add_epi32(i0[c], i1[c]);
                if K == K4_0 {
                    iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(8 * *a.sum.get_unchecked(at)));
                } else if K == K8_0 {
                    iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(128 * *a.sum.get_unchecked(at)));
                }
                let s = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.get_unchecked(at)));
                facc[c] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(iv), facc[c]);
                if K == K4_1 {
                    let mw = _mm512_loadu_ps(w.m.as_ptr().add((g * nb + b) * GROUP));
                    facc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.ds.get_unchecked(at)), facc[c]);
                }
            }
        }
        for c in 0..C {
            _mm512_storeu_ps(out[c].as_mut_ptr(), facc[c]);
        }
    }
}

/// AVX2: the 16 rows as two halves of 8 (one ymm each); `vpmaddubsw` then `vpmaddwd` with
/// ones make each lane's 4-byte dot. Q8_0 uses `|w|` and `sign(a, w)` so that no pair of
/// products overflows 16 bits (at most 2 · 128 · 127).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `g` and `c0 + C` in range (checked by `group`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const K: u8, const C: usize>(
    w: &QWeights,
    a: &QuantActs,
    g: usize,
    c0: usize,
    out: &mut [[f32; GROUP]],
) {
    use std::arch::x86_64::*;
    let (nb, k) = (w.nb, w.cols);
    let bb = w.kind.block_bytes();
    let m4 = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut facc = [[_mm256_setzero_ps(); 2]; C];
    // SAFETY (all pointer arithmetic below): as in `vnni512`.
    unsafe {
        let qbase = w.qs.as_ptr().add(g * nb * bb);
        let dbase = w.d.as_ptr().add(g * nb * GROUP);
        let abase = a.q.as_ptr().add(c0 * k);
        for b in 0..nb {
            let wq = qbase.add(b * bb);
            for h in 0..2 {
                let mut iacc = [_mm256_setzero_si256(); C];
                if K == K8_0 {
                    for gq in 0..8 {
                        let v = _mm256_loadu_si256(wq.add(gq * 64 + h * 32) as *const _);
                        let av = _mm256_abs_epi8(v);
                        for c in 0..C {
                            let ap = abase.add(c * k + b * 32 + gq * 4);
                            let x = _mm256_sign_epi8(_mm256_set1_epi32(four(ap)), v);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, x), ones);
                            iacc[c] = _mm256_add_epi32(iacc[c], p);
                        }
                    }
                } else {
                    for p in 0..4 {
                        let v = _mm256_loadu_si256(wq.add(p * 64 + h * 32) as *const _);
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                        for c in 0..C {
                            let ap = abase.add(c * k + b * 32 + p * 4);
                            // Each 16-bit sum is at most 4 · 15 · 127: no saturation.
                            let s = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four(ap))),
                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four(ap.add(16)))),
                            );
                            iacc[c] = _mm256_add_epi32(iacc[c], _mm256_madd_epi16(s, ones));
                        }
                    }
                }
                let dw = _mm256_loadu_ps(dbase.add(b * GROUP + h * 8));
                for c in 0..C {
                    let at = (c0 + c) * nb + b;
                    let mut iv = iacc[c];
                    if K == K4_0 {
                        iv = _mm256_sub_epi32(iv, _mm256_set1_epi32(8 * *a.sum.get_unchecked(at)));
                    }
                    let s = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked(at)));
                    facc[c][h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(iv), facc[c][h]);
                    if K == K4_1 {
                        let mw = _mm256_loadu_ps(w.m.as_ptr().add((g * nb + b) * GROUP + h * 8));
                        facc[c][h] = _mm256_fmadd_ps(
                            mw,
                            _mm256_set1_ps(*a.ds.get_unchecked(at)),
                            facc[c][h],
                        );
                    }
                }
            }
        }
        for c in 0..C {
            _mm256_storeu_ps(out[c].as_mut_ptr(), facc[c][0]);
            _mm256_storeu_ps(out[c].as_mut_ptr().add(8), facc[c][1]);
        }
    }
}
