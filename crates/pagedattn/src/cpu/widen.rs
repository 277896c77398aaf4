//! Cache elements as the AVX512-BF16 decode kernels read them: 32 or 64 at a time, as
//! vectors of bf16. bf16 rows load as they are; fp8 codes (e4m3fn, e5m2) widen exactly (every
//! fp8 value is a bf16) in registers, so an fp8 cache is read at one byte per element and
//! multiplied with `vdpbf16ps` like a bf16 one.
//!
//! The fp8 widening looks the codes up in two 128-entry byte tables with `vpermi2b`
//! (AVX512-VBMI), which takes 7 index bits, the code's magnitude: the high byte (sign bit
//! clear) and the low byte of the magnitude's bf16. The code's sign bit is then copied into
//! the high byte, and the bytes are interleaved into words. Eight instructions per 64 codes,
//! against ~20 for the f32 path's bit arithmetic and two conversions to reach bf16 from it.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::simd::{E4m3, E5m2};
use crate::fp8::Fp8Format;

/// Cache rows (or input rows) as the AVX512-BF16 decode kernels read them, one variant per
/// [`Bf16Elem`] ([`Load::as_bf16_rows`](super::simd::Load::as_bf16_rows)).
#[derive(Debug, Clone, Copy)]
pub enum Bf16Rows<'a> {
    /// bf16 rows, as their bits.
    Bits(&'a [u16]),
    /// fp8 e4m3fn codes.
    E4m3(&'a [E4m3]),
    /// fp8 e5m2 codes.
    E5m2(&'a [E5m2]),
}

/// An element type the AVX512-BF16 decode kernels read rows of.
pub trait Bf16Elem: Copy + Send + Sync + 'static {
    /// What widening needs in registers (the fp8 tables), loaded by each pass over a tile
    /// (the byte tables behind it are built once).
    type Table: Copy;
    /// Whether widening uses AVX512-VBMI instructions.
    const NEEDS_VBMI: bool;

    /// Loads the table.
    ///
    /// # Safety
    /// Only inside a function compiled for AVX-512 F/BW (and VBMI where `NEEDS_VBMI`).
    unsafe fn table() -> Self::Table;

    /// The `32 * W` elements at `p` as `W` vectors of 32 bf16, in order (`W` is 1 or 2). With
    /// `mask` `Some(0)` the result is zero and memory is not touched; `Some(u32::MAX)` and
    /// `None` (an unmasked load) read every element.
    ///
    /// # Safety
    /// As [`Bf16Elem::table`]; `p` valid for `32 * W` elements unless the mask is zero.
    unsafe fn widen<const W: usize>(
        t: Self::Table,
        p: *const Self,
        mask: Option<u32>,
    ) -> [__m512i; W];

    /// One element as f32 (for the rare scalar paths).
    fn to_f32(self) -> f32;

    /// The `32 * W` elements at `p` as bf16 in memory: `p` itself for bf16, else widened into
    /// `buf`.
    ///
    /// # Safety
    /// As [`Bf16Elem::widen`] with every element read.
    #[inline(always)]
    unsafe fn bf16_chunk<const W: usize>(
        t: Self::Table,
        p: *const Self,
        buf: &mut [MaybeUninit<u16>; 64],
    ) -> *const u16 {
        let v = Self::widen::<W>(t, p, None);
        for (i, x) in v.iter().enumerate() {
            _mm512_storeu_si512(buf.as_mut_ptr().add(32 * i) as *mut __m512i, *x);
        }
        buf.as_ptr() as *const u16
    }
}

/// bf16 bits.
impl Bf16Elem for u16 {
    type Table = ();
    const NEEDS_VBMI: bool = false;

    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }

    #[inline(always)]
    unsafe fn table() {}

    #[inline(always)]
    unsafe fn bf16_chunk<const W: usize>(
        _: (),
        p: *const u16,
        _: &mut [MaybeUninit<u16>; 64],
    ) -> *const u16 {
        p
    }

    #[inline(always)]
    unsafe fn widen<const W: usize>(_: (), p: *const u16, mask: Option<u32>) -> [__m512i; W] {
        // (A loop, not `std::array::from_fn`: its closure is not always inlined.)
        let mut out = [_mm512_setzero_si512(); W];
        for (w, o) in out.iter_mut().enumerate() {
            let at = p.wrapping_add(32 * w) as *const i16;
            *o = match mask {
                None => _mm512_loadu_si512(at as *const __m512i),
                Some(m) => _mm512_maskz_loadu_epi16(m, at),
            };
        }
        out
    }
}

/// The registers of an fp8 widening: byte tables (two vectors of 64 each) and constants.
#[derive(Clone, Copy)]
pub struct Fp8Table {
    high: [__m512i; 2],
    low: [__m512i; 2],
    sign: __m512i,
    /// Qword indices that put the interleaved words back in order (dimensions 0-31, 32-63).
    order: [__m512i; 2],
}

/// The bf16 bytes of each fp8 magnitude (code & 0x7F): high bytes, then low bytes.
struct Bf16Bytes {
    high: [u8; 128],
    low: [u8; 128],
}

impl Bf16Bytes {
    fn of(format: Fp8Format) -> Bf16Bytes {
        let bits = |m: usize| half::bf16::from_f32(format.decode(m as u8)).to_bits();
        Bf16Bytes {
            high: std::array::from_fn(|m| (bits(m) >> 8) as u8),
            low: std::array::from_fn(|m| bits(m) as u8),
        }
    }

    /// The tables of `format`, built once.
    fn get(format: Fp8Format) -> &'static Bf16Bytes {
        static E4M3: OnceLock<Bf16Bytes> = OnceLock::new();
        static E5M2: OnceLock<Bf16Bytes> = OnceLock::new();
        let cell = match format {
            Fp8Format::E4m3 => &E4M3,
            Fp8Format::E5m2 => &E5M2,
        };
        cell.get_or_init(|| Bf16Bytes::of(format))
    }

    /// In registers.
    #[inline(always)]
    unsafe fn load(&self) -> Fp8Table {
        let half = |t: &[u8; 128], i: usize| _mm512_loadu_si512(t.as_ptr().add(64 * i) as *const _);
        Fp8Table {
            high: [half(&self.high, 0), half(&self.high, 1)],
            low: [half(&self.low, 0), half(&self.low, 1)],
            sign: _mm512_set1_epi8(0x80u8 as i8),
            // After the in-lane interleave, vector a holds dimensions [0-7, 16-23, 32-39,
            // 48-55] and b [8-15, 24-31, 40-47, 56-63] (two qwords per group of 8).
            order: [
                _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15),
            ],
        }
    }
}

/// Widens 64 fp8 codes (`x`) to bf16: dimensions 0-31 and 32-63.
#[inline(always)]
unsafe fn widen64(t: &Fp8Table, x: __m512i) -> [__m512i; 2] {
    let high = _mm512_permutex2var_epi8(t.high[0], x, t.high[1]);
    // high | (x & 0x80): the sign.
    let high = _mm512_ternarylogic_epi32::<0xF8>(high, x, t.sign);
    let low = _mm512_permutex2var_epi8(t.low[0], x, t.low[1]);
    let (a, b) = (
        _mm512_unpacklo_epi8(low, high),
        _mm512_unpackhi_epi8(low, high),
    );
    [
        _mm512_permutex2var_epi64(a, t.order[0], b),
        _mm512_permutex2var_epi64(a, t.order[1], b),
    ]
}

/// [`Bf16Elem::widen`] for fp8 codes.
#[inline(always)]
unsafe fn widen_codes<const W: usize>(
    t: &Fp8Table,
    p: *const u8,
    mask: Option<u32>,
) -> [__m512i; W] {
    let x = match (W, mask) {
        (2, None) => _mm512_loadu_si512(p as *const __m512i),
        (2, Some(m)) => _mm512_maskz_loadu_epi8(m as u64 | (m as u64) << 32, p as *const i8),
        (_, None) => _mm512_zextsi256_si512(_mm256_loadu_si256(p as *const __m256i)),
        (_, Some(m)) => _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(m, p as *const i8)),
    };
    let both = widen64(t, x);
    let mut out = [_mm512_setzero_si512(); W];
    out.copy_from_slice(&both[..W]);
    out
}

macro_rules! fp8_elem {
    ($code:ty, $format:expr) => {
        impl Bf16Elem for $code {
            type Table = Fp8Table;
            const NEEDS_VBMI: bool = true;

            fn to_f32(self) -> f32 {
                $format.decode(self.0)
            }

            #[inline(always)]
            unsafe fn table() -> Fp8Table {
                Bf16Bytes::get($format).load()
            }

            #[inline(always)]
            unsafe fn widen<const W: usize>(
                t: Fp8Table,
                p: *const Self,
                mask: Option<u32>,
            ) -> [__m512i; W] {
                widen_codes::<W>(&t, p as *const u8, mask)
            }
        }
    };
}

fp8_elem!(E4m3, Fp8Format::E4m3);
fp8_elem!(E5m2, Fp8Format::E5m2);

/// Whether this CPU has AVX512-VBMI (the fp8 widening's `vpermi2b`).
pub fn has_vbmi() -> bool {
    is_x86_feature_detected!("avx512vbmi")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    unsafe fn widen_all<C: Bf16Elem>(codes: &[C], mask: Option<u32>) -> Vec<u16> {
        let t = C::table();
        let two: [__m512i; 2] = C::widen::<2>(t, codes.as_ptr(), mask);
        let one: [__m512i; 1] = C::widen::<1>(t, codes.as_ptr().add(64), mask);
        let mut out = vec![0u16; 96];
        for (i, v) in two.iter().chain(&one).enumerate() {
            _mm512_storeu_si512(out.as_mut_ptr().add(32 * i) as *mut __m512i, *v);
        }
        out
    }

    /// Every code of both formats, at every position of a 64- and a 32-code load, widens to
    /// the bf16 of its exact value; a zero mask gives zeros.
    #[test]
    fn fp8_codes_widen_to_their_exact_bf16() {
        if !(std::arch::is_x86_feature_detected!("avx512bw") && has_vbmi()) {
            return;
        }
        fn check<C: Bf16Elem>(make: fn(u8) -> C, format: Fp8Format) {
            for rotate in [0usize, 37, 96, 160] {
                let codes: Vec<u8> = (0..96).map(|i| ((i + rotate) % 256) as u8).collect();
                let cs: Vec<C> = codes.iter().map(|&c| make(c)).collect();
                for mask in [None, Some(u32::MAX)] {
                    // SAFETY: AVX-512 BW and VBMI were detected above (F and VL come with
                    // BW on every CPU that has it); `cs` holds the 96 codes it reads.
                    let got = unsafe { widen_all(&cs, mask) };
                    for (&c, &g) in codes.iter().zip(&got) {
                        let want = format.decode(c);
                        let got = half::bf16::from_bits(g).to_f32();
                        if want.is_nan() {
                            assert!(got.is_nan(), "{format:?} code {c:#04x}: {got}");
                        } else {
                            assert_eq!(got.to_bits(), want.to_bits(), "{format:?} code {c:#04x}");
                        }
                    }
                }
                // SAFETY: as above (a zero mask reads nothing).
                let zeros = unsafe { widen_all(&cs, Some(0)) };
                assert!(zeros.iter().all(|&z| z == 0));
            }
        }
        check(E4m3, Fp8Format::E4m3);
        check(E5m2, Fp8Format::E5m2);
        // bf16 bits pass through.
        let bits: Vec<u16> = (0..96).map(|i| 0x3F80 + i).collect();
        // SAFETY: the features were detected above; `bits` holds the 96 elements read.
        assert_eq!(unsafe { widen_all(&bits, None) }, bits);
    }
}
