//! x86-64: AVX2 + FMA + F16C (8 lanes) and AVX-512 (16 lanes, optionally with AVX512-BF16).

use std::arch::x86_64::*;

use super::{Simd, WithSimd};

/// What the x86 e4m3 loads divide values by (see [`Simd::E4M3_SCALE`]).
const E4M3_AS_F16_SCALE: f32 = 256.0;

/// 16 e4m3 codes (one per 16-bit lane, zero-extended) as the f16 bits of their value / 2^8:
/// the code's exponent and mantissa shifted under f16's (bits 13-7; f16's exponent bias, 15,
/// is 8 more than e4m3's, and both have subnormals, so this is exact), the sign moved from bit
/// 7 to bit 15, and magnitude 0x7F (NaN; e4m3fn has no infinities) made all ones (an f16
/// NaN). Six integer instructions for 16 codes, against ten per 8 through f32 bit arithmetic.
#[inline(always)]
unsafe fn e4m3_as_f16(codes: __m256i) -> __m256i {
    // codes + (codes & 0x80) carries the sign into bit 8 and clears bit 7.
    let sign = _mm256_and_si256(codes, _mm256_set1_epi16(0x80));
    let h = _mm256_slli_epi16::<7>(_mm256_add_epi16(codes, sign));
    let nan = _mm256_cmpeq_epi16(
        _mm256_or_si256(codes, _mm256_set1_epi16(0x80)),
        _mm256_set1_epi16(0xFF),
    );
    _mm256_or_si256(h, nan)
}

/// AVX2 + FMA + F16C, 8 f32 lanes.
#[derive(Debug, Clone, Copy)]
pub struct Avx2(());

impl Avx2 {
    /// The token, if this CPU has AVX2, FMA and F16C.
    pub fn new() -> Option<Self> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Avx2(()))
    }

    /// Per 128-bit half: `(a0 + a1, a2 + a3, b0 + b1, b2 + b3)`.
    #[inline(always)]
    fn pair_within(self, a: __m256, b: __m256) -> __m256 {
        unsafe {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
            )
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn with_avx2<Op: WithSimd>(s: Avx2, op: Op) -> Op::Output {
    op.with_simd(s)
}

impl Simd for Avx2 {
    const LANES: usize = 8;
    const REGISTERS: usize = 16;
    type V = __m256;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        // SAFETY: the token exists only where the features were detected.
        unsafe { with_avx2(self, op) }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    fn iota(self) -> __m256 {
        unsafe { _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0) }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> __m256 {
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    const E4M3_SCALE: f32 = E4M3_AS_F16_SCALE;
    #[inline(always)]
    unsafe fn load_e4m3(self, p: *const u8) -> __m256 {
        let codes = _mm256_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
        _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_as_f16(codes)))
    }
    #[inline(always)]
    unsafe fn load_e4m3_pair(self, p: *const u8) -> [__m256; 2] {
        let h = e4m3_as_f16(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)));
        [
            _mm256_cvtph_ps(_mm256_castsi256_si128(h)),
            _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)),
        ]
    }
    #[inline(always)]
    unsafe fn load_e5m2(self, p: *const u8) -> __m256 {
        // An e5m2 code is the high byte of the f16 of the same value (infinities, NaN and
        // subnormals included): one interleave with zeros and F16C's conversion.
        let codes = _mm_loadl_epi64(p as *const __m128i);
        _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), codes))
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    fn select_lt(self, a: __m256, b: __m256, x: __m256, y: __m256) -> __m256 {
        unsafe { _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)) }
    }
    #[inline(always)]
    fn round(self, a: __m256) -> __m256 {
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    fn pow2i(self, n: __m256) -> __m256 {
        unsafe {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    fn reduce_sum(self, a: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
    #[inline(always)]
    fn prefetch<T>(self, p: *const T) {
        super::prefetch(p)
    }
    #[inline(always)]
    fn prefetch_l2<T>(self, p: *const T) {
        // SAFETY: prefetching never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
    #[inline(always)]
    fn transpose_sum(self, v: &[__m256]) -> __m256 {
        assert_eq!(v.len(), 8);
        // Two rounds of pairing lanes inside each 128-bit half, then the halves.
        let mut level = [v[0]; 4];
        for (i, x) in level.iter_mut().enumerate() {
            *x = self.pair_within(v[2 * i], v[2 * i + 1]);
        }
        let (lo, hi) = (
            self.pair_within(level[0], level[1]),
            self.pair_within(level[2], level[3]),
        );
        unsafe {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(lo, hi),
                _mm256_permute2f128_ps::<0x31>(lo, hi),
            )
        }
    }
    #[inline(always)]
    fn reduce_max(self, a: __m256) -> f32 {
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
}

/// AVX-512 (F, BW, VL, with F16C), 16 f32 lanes; `bf16` says whether AVX512-BF16's
/// `vdpbf16ps` is available to the bf16 prefill kernel.
#[derive(Debug, Clone, Copy)]
pub struct Avx512 {
    bf16: bool,
}

impl Avx512 {
    /// The token, if this CPU has AVX-512 F/BW/VL and F16C (using AVX512-BF16 where present).
    pub fn new() -> Option<Self> {
        let base = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        base.then(|| Avx512 {
            bf16: is_x86_feature_detected!("avx512bf16"),
        })
    }

    /// The same token with AVX512-BF16 use switched off (for forcing the plain AVX-512 path).
    pub fn without_bf16(self) -> Self {
        Avx512 { bf16: false }
    }

    /// Whether `vdpbf16ps` may be used.
    pub fn has_bf16(self) -> bool {
        self.bf16
    }

    /// The token with AVX512-BF16, without detection (kernels that already run inside a
    /// function compiled for those features).
    ///
    /// # Safety
    /// AVX-512 (F, BW, VL), FMA, F16C and AVX512-BF16 must be available.
    #[inline(always)]
    pub unsafe fn assume_bf16() -> Self {
        Avx512 { bf16: true }
    }

    /// Per 128-bit lane: `(a0 + a1, a2 + a3, b0 + b1, b2 + b3)`.
    #[inline(always)]
    pub(crate) fn pair_within(self, a: __m512, b: __m512) -> __m512 {
        unsafe {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
            )
        }
    }

    /// By 128-bit lanes: `(a0 + a1, a2 + a3, b0 + b1, b2 + b3)`.
    #[inline(always)]
    fn pair_across(self, a: __m512, b: __m512) -> __m512 {
        unsafe {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
unsafe fn with_avx512<Op: WithSimd>(s: Avx512, op: Op) -> Op::Output {
    op.with_simd(s)
}

impl Simd for Avx512 {
    const LANES: usize = 16;
    const REGISTERS: usize = 32;
    const BF16_KERNELS: bool = true;
    type V = __m512;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        // SAFETY: the token exists only where the features were detected.
        unsafe { with_avx512(self, op) }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn iota(self) -> __m512 {
        unsafe {
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            )
        }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> __m512 {
        let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    const E4M3_SCALE: f32 = E4M3_AS_F16_SCALE;
    #[inline(always)]
    unsafe fn load_e4m3(self, p: *const u8) -> __m512 {
        let codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        _mm512_cvtph_ps(e4m3_as_f16(codes))
    }
    #[inline(always)]
    unsafe fn load_e4m3_pair(self, p: *const u8) -> [__m512; 2] {
        let codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
        // As `e4m3_as_f16`, 32 codes at a time (NaN through a mask register).
        let sign = _mm512_and_si512(codes, _mm512_set1_epi16(0x80));
        let h = _mm512_slli_epi16::<7>(_mm512_add_epi16(codes, sign));
        let nan = _mm512_cmpeq_epi16_mask(
            _mm512_or_si512(codes, _mm512_set1_epi16(0x80)),
            _mm512_set1_epi16(0xFF),
        );
        let h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(-1));
        [
            _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)),
        ]
    }
    #[inline(always)]
    unsafe fn load_e5m2(self, p: *const u8) -> __m512 {
        // As `Avx2::load_e5m2`: the codes as the high bytes of 16 f16.
        let codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        _mm512_cvtph_ps(_mm256_slli_epi16::<8>(codes))
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn select_lt(self, a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), y, x) }
    }
    #[inline(always)]
    fn round(self, a: __m512) -> __m512 {
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    fn pow2i(self, n: __m512) -> __m512 {
        unsafe {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    fn reduce_sum(self, a: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(a) }
    }
    #[inline(always)]
    fn exp(self, x: __m512) -> __m512 {
        // The generic reduction, with `vscalefps` applying 2^n (overflow to inf included) and
        // zeroing lanes below -87 (-inf included) in one instruction, so no clamping.
        let (n, p) = self.exp_reduced(x);
        unsafe {
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-87.0));
            _mm512_maskz_scalef_ps(keep, p, n)
        }
    }
    #[inline(always)]
    fn transpose_sum(self, v: &[__m512]) -> __m512 {
        assert_eq!(v.len(), 16);
        // Two rounds of pairing lanes inside 128-bit lanes leave, per 128-bit lane, partial sums
        // of four vectors; two rounds of pairing 128-bit lanes finish them, in order.
        let mut level = [v[0]; 8];
        for (i, x) in level.iter_mut().enumerate() {
            *x = self.pair_within(v[2 * i], v[2 * i + 1]);
        }
        for i in 0..4 {
            level[i] = self.pair_within(level[2 * i], level[2 * i + 1]);
        }
        for i in 0..2 {
            level[i] = self.pair_across(level[2 * i], level[2 * i + 1]);
        }
        self.pair_across(level[0], level[1])
    }
    #[inline(always)]
    fn prefetch<T>(self, p: *const T) {
        super::prefetch(p)
    }
    #[inline(always)]
    fn prefetch_l2<T>(self, p: *const T) {
        // SAFETY: prefetching never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
    #[inline(always)]
    fn reduce_max(self, a: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(a) }
    }
}
