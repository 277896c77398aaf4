//! The instruction-set abstraction the CPU kernels are written against: f32 vectors of
//! `LANES` lanes, loads that widen every cache element type to f32, and the few operations
//! softmax needs. Each ISA implements [`Simd`] once; the kernels are generic over it, and
//! `Simd::vectorize` runs them with the ISA's target features enabled (the pulp pattern: the
//! whole kernel inlines into one `#[target_feature]` function).
//!
//! Why not the `pulp` crate itself: the kernels need f16 / bf16 / fp8 widening loads and
//! AVX512-BF16 dot products, which pulp does not expose; the trait here is the small subset
//! that the kernels use, implemented directly with `std::arch`.
//!
//! SAFETY convention of the intrinsic wrappers (`x86`, `neon`): an `unsafe` block in those
//! modules without a comment of its own only calls the ISA's intrinsics, which are sound
//! wherever the ISA's features are present (its token exists only where they were detected,
//! and the wrappers run inside functions compiled with them), on registers or on the pointers
//! that the caller of an `unsafe fn` of [`Simd`] or [`Load`] vouched for. Every other `unsafe`
//! block in the crate states its own reason (`clippy::undocumented_unsafe_blocks`).

#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod scalar;
// The wrappers' SAFETY convention is stated in the module doc above.
#[allow(clippy::undocumented_unsafe_blocks)]
#[cfg(target_arch = "x86_64")]
pub mod x86;

/// An operation to run with an instruction set's target features enabled (see
/// [`Simd::vectorize`]); `with_simd` must be `#[inline(always)]` so that the whole operation
/// compiles inside the `#[target_feature]` function.
pub trait WithSimd {
    /// What the operation returns.
    type Output;
    /// Runs the operation on `s`.
    fn with_simd<S: Simd>(self, s: S) -> Self::Output;
}

/// Hints that the cache line holding `p` will be read soon, outside the kernels (with no ISA
/// token at hand): SSE's prefetch, which every x86_64 CPU has; a no-op elsewhere.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching never faults, whatever the address; SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One instruction set's f32 vector operations. Values of `Self` are tokens proving that the
/// instruction set is available on this CPU (they are only built after detection).
pub trait Simd: Copy + Send + Sync + 'static {
    /// f32 lanes per vector.
    const LANES: usize;
    /// Vector registers the ISA has (16 for AVX2, 32 for AVX-512 and NEON): how many
    /// accumulators a micro-kernel can keep without spilling.
    const REGISTERS: usize;
    /// Whether the ISA has 32 vector registers or more (micro-kernels then block 8 rows, else
    /// 6): a constant of its own so that an `if` on it compiles only the branch taken.
    const MANY_REGISTERS: bool = Self::REGISTERS >= 32;
    /// A vector of `LANES` f32.
    type V: Copy;
    /// Whether tokens of this ISA can carry AVX512-BF16 (and AMX): the bf16 kernels are
    /// compiled only for such a token, behind an `if` on this constant.
    const BF16_KERNELS: bool = false;

    /// Runs `op` with this instruction set's target features enabled; kernels are
    /// `#[inline(always)]` so that they compile inside it.
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output;

    /// Every lane `x`.
    fn splat(self, x: f32) -> Self::V;
    /// Lanes `0, 1, ..., LANES-1` as f32.
    fn iota(self) -> Self::V;
    /// `LANES` f32 from `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` f32.
    unsafe fn load(self, p: *const f32) -> Self::V;
    /// Stores `LANES` f32 to `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing `LANES` f32.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    /// `LANES` bf16 (as raw bits) widened to f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` u16.
    unsafe fn load_bf16(self, p: *const u16) -> Self::V;
    /// `LANES` f16 (as raw bits) widened to f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` u16.
    unsafe fn load_f16(self, p: *const u16) -> Self::V;
    /// What [`Simd::load_e4m3`] divides each value by: 1 where the load is exact; 256 on x86,
    /// which widens e4m3 through f16 (f16's exponent bias is 8 more than e4m3's, so the code's
    /// bits placed under f16's give the value / 2^8, subnormals included). Kernels multiply
    /// their dot products and sums back by it (through [`Load::load_scale`]).
    const E4M3_SCALE: f32 = 1.0;
    /// `LANES` fp8 e4m3fn codes decoded to f32 (the fp8 k/v scale not applied), divided by
    /// [`Simd::E4M3_SCALE`] (a power of two: exact).
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` bytes.
    unsafe fn load_e4m3(self, p: *const u8) -> Self::V;
    /// `2 · LANES` e4m3 codes as two vectors, as [`Simd::load_e4m3`] decodes them (where the
    /// ISA can, in one pass of integer instructions for both).
    ///
    /// # Safety
    /// `p` must be valid for reading `2 · LANES` bytes.
    #[inline(always)]
    unsafe fn load_e4m3_pair(self, p: *const u8) -> [Self::V; 2] {
        [self.load_e4m3(p), self.load_e4m3(p.add(Self::LANES))]
    }
    /// `LANES` fp8 e5m2 codes decoded to f32 (unscaled).
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` bytes.
    unsafe fn load_e5m2(self, p: *const u8) -> Self::V;

    /// `a + b`.
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a - b`.
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b`.
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a / b`.
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, fused where the ISA has FMA.
    fn fma(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise maximum.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise minimum.
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a < b { x } else { y }`.
    fn select_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    /// Rounds to the nearest integer (ties to even).
    fn round(self, a: Self::V) -> Self::V;
    /// `2^n` for integer-valued lanes `n` in [-126, 127].
    fn pow2i(self, n: Self::V) -> Self::V;
    /// Sum of the lanes.
    fn reduce_sum(self, a: Self::V) -> f32;
    /// The lane sums of `LANES` vectors at once: lane `i` of the result is the sum of the lanes
    /// of `v[i]` (a transposing tree of pairwise adds, about three instructions per vector,
    /// against a full horizontal reduction each). `v.len()` must be `LANES`.
    fn transpose_sum(self, v: &[Self::V]) -> Self::V;
    /// Hints that the cache line holding `p` will be read soon (into L1: measured ~30% faster
    /// decode than into L2 on Zen 5); a no-op where the ISA has no stable prefetch.
    #[inline(always)]
    fn prefetch<T>(self, p: *const T) {
        let _ = p;
    }
    /// Hints that the cache line holding `p` will be read later (into L2); a no-op where the
    /// ISA has no stable prefetch.
    #[inline(always)]
    fn prefetch_l2<T>(self, p: *const T) {
        let _ = p;
    }
    /// Maximum of the lanes.
    fn reduce_max(self, a: Self::V) -> f32;

    /// `e^x`, accurate to a few ulp; exactly 0 below -87 (and for -Inf), +Inf from 88 on (f32's
    /// largest value is e^88.72) and NaN for NaN: the softmax relies on NaN going through.
    #[inline(always)]
    fn exp(self, x: Self::V) -> Self::V {
        // The clamp keeps `pow2i` in its range, NaN included (which it turns into a bound).
        let clamped = self.min(self.max(x, self.splat(-87.0)), self.splat(88.0));
        let (n, p) = self.exp_reduced(clamped);
        self.saturate_exp(x, self.mul(p, self.pow2i(n)), self.splat(0.0))
    }

    /// `e` where `x` is in [-87, 88); `below` under -87; +Inf from 88 on; NaN for NaN (the
    /// comparisons are false for NaN, and `NaN + Inf` is NaN).
    #[inline(always)]
    fn saturate_exp(self, x: Self::V, e: Self::V, below: Self::V) -> Self::V {
        let high = self.splat(88.0);
        let e = self.select_lt(x, self.splat(-87.0), below, e);
        self.select_lt(x, high, e, self.add(x, self.splat(f32::INFINITY)))
    }

    /// `(n, e^r)` with `x = n ln2 + r`, n an integer and `|r| <= ln2 / 2` (so `e^x` is
    /// `e^r · 2^n`): the reduction in two steps (Cody-Waite), then the degree-6 Taylor
    /// polynomial in Horner form.
    #[inline(always)]
    fn exp_reduced(self, x: Self::V) -> (Self::V, Self::V) {
        let (n, r) = self.reduce_ln2(x);
        (n, self.fma(self.expm1_over(r), r, self.splat(1.0)))
    }

    /// `(n, r)` with `x = n ln2 + r`, n an integer and `|r| <= ln2 / 2` (Cody-Waite, two
    /// steps).
    #[inline(always)]
    fn reduce_ln2(self, x: Self::V) -> (Self::V, Self::V) {
        let n = self.round(self.mul(x, self.splat(std::f32::consts::LOG2_E)));
        let r = self.fma(n, self.splat(-0.693_145_75), x);
        (n, self.fma(n, self.splat(-1.428_606_8e-6), r))
    }

    /// `(e^r - 1) / r` for `|r| <= ln2 / 2`: the Taylor polynomial of degree 5, Horner form.
    #[inline(always)]
    fn expm1_over(self, r: Self::V) -> Self::V {
        let mut p = self.splat(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0] {
            p = self.fma(p, r, self.splat(c));
        }
        p
    }

    /// `e^x - 1`, accurate relative to the result for small `|x|` too (no `1 + ... - 1`);
    /// exactly -1 below -87, +Inf from 88 on, NaN for NaN.
    #[inline(always)]
    fn expm1(self, x: Self::V) -> Self::V {
        let clamped = self.min(self.max(x, self.splat(-87.0)), self.splat(88.0));
        let (n, r) = self.reduce_ln2(clamped);
        let scale = self.pow2i(n);
        // 2^n (e^r - 1) + (2^n - 1); for |x| <= ln2/2, n = 0 and this is e^r - 1 itself.
        let e = self.add(
            self.mul(scale, self.mul(self.expm1_over(r), r)),
            self.sub(scale, self.splat(1.0)),
        );
        self.saturate_exp(x, e, self.splat(-1.0))
    }

    /// `tanh(x)` as `sign(x) · -m / (2 + m)` with `m = e^(-2|x|) - 1`: accurate relative to
    /// the result for every `x` (the form `1 - 2 / (e^(2x) + 1)` cancels for small `|x|`);
    /// ±1 for ±Inf, NaN for NaN.
    #[inline(always)]
    fn tanh(self, x: Self::V) -> Self::V {
        let zero = self.splat(0.0);
        let a = self.max(x, self.sub(zero, x));
        let m = self.expm1(self.mul(a, self.splat(-2.0)));
        let t = self.div(self.sub(zero, m), self.add(m, self.splat(2.0)));
        let t = self.select_lt(x, zero, self.sub(zero, t), t);
        // Whatever `max` does with NaN on this ISA: NaN comes back as itself, +Inf as 1.
        let t = self.select_lt(x, self.splat(f32::INFINITY), t, x);
        self.select_lt(self.splat(f32::MAX), x, self.splat(1.0), t)
    }
}

/// Element types a kernel can read K/V rows (and queries) from, widened to f32.
pub trait Load: Copy + Send + Sync + 'static {
    /// Widens `LANES` elements at `p` to f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `S::LANES` elements.
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V;
    /// `2 · LANES` elements at `p` as two vectors, each as [`Load::load`] widens it.
    ///
    /// # Safety
    /// `p` must be valid for reading `2 · S::LANES` elements.
    #[inline(always)]
    unsafe fn load_pair<S: Simd>(s: S, p: *const Self) -> [S::V; 2] {
        [Self::load(s, p), Self::load(s, p.add(S::LANES))]
    }
    /// What [`Load::load`] on `S` divides values by (a power of two; see
    /// [`Simd::E4M3_SCALE`]): 1 unless the ISA widens this type scaled.
    #[inline(always)]
    fn load_scale<S: Simd>() -> f32 {
        1.0
    }
    /// Widens one element (for scalar tails and tests), exactly (not divided by
    /// [`Load::load_scale`]).
    fn to_f32(self) -> f32;
    /// Whether every value of this type is exactly a bf16 (bf16 itself, and both fp8 formats).
    const BF16_EXACT: bool = false;
    /// The bf16 bits of the value (rounded to nearest even unless `BF16_EXACT`).
    fn bf16_bits(self) -> u16 {
        half::bf16::from_f32(self.to_f32()).to_bits()
    }
    /// The rows as the AVX512-BF16 decode kernels read them, or `None` for a type they do not
    /// read (what the decode dispatches on).
    #[cfg(target_arch = "x86_64")]
    fn as_bf16_rows(rows: &[Self]) -> Option<super::widen::Bf16Rows<'_>> {
        let _ = rows;
        None
    }
}

impl Load for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V {
        s.load(p)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Load for half::bf16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V {
        s.load_bf16(p as *const u16)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    const BF16_EXACT: bool = true;
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    #[cfg(target_arch = "x86_64")]
    fn as_bf16_rows(rows: &[Self]) -> Option<super::widen::Bf16Rows<'_>> {
        Some(super::widen::Bf16Rows::Bits(bytemuck::cast_slice(rows)))
    }
}

impl Load for half::f16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V {
        s.load_f16(p as *const u16)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// An fp8 e4m3fn code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct E4m3(pub u8);

/// An fp8 e5m2 code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct E5m2(pub u8);

impl Load for E4m3 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V {
        s.load_e4m3(p as *const u8)
    }
    #[inline(always)]
    unsafe fn load_pair<S: Simd>(s: S, p: *const Self) -> [S::V; 2] {
        s.load_e4m3_pair(p as *const u8)
    }
    #[inline(always)]
    fn load_scale<S: Simd>() -> f32 {
        S::E4M3_SCALE
    }
    fn to_f32(self) -> f32 {
        crate::fp8::Fp8Format::E4m3.decode(self.0)
    }
    const BF16_EXACT: bool = true;
    #[cfg(target_arch = "x86_64")]
    fn as_bf16_rows(rows: &[Self]) -> Option<super::widen::Bf16Rows<'_>> {
        Some(super::widen::Bf16Rows::E4m3(rows))
    }
}

impl Load for E5m2 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V {
        s.load_e5m2(p as *const u8)
    }
    fn to_f32(self) -> f32 {
        crate::fp8::Fp8Format::E5m2.decode(self.0)
    }
    const BF16_EXACT: bool = true;
    #[cfg(target_arch = "x86_64")]
    fn as_bf16_rows(rows: &[Self]) -> Option<super::widen::Bf16Rows<'_>> {
        Some(super::widen::Bf16Rows::E5m2(rows))
    }
}

/// Bit-level fp8 decoding for NEON, written per lane (x86 widens both formats through f16).
#[cfg(target_arch = "aarch64")]
pub(crate) mod fp8_bits {
    /// f32 bits of an e4m3 code whose magnitude bits are `m = code & 0x7F`, before the
    /// exponent rebias: the code's exponent and mantissa placed at the top of an f32 (the
    /// vector code multiplies by 2^120 afterwards, which also normalizes subnormals).
    pub const E4M3_SHIFT: u32 = 20;
    /// 2^(127 - 7): rebias from e4m3's exponent bias to f32's.
    pub const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
    /// e5m2 counterpart of [`E4M3_SHIFT`].
    pub const E5M2_SHIFT: u32 = 21;
    /// 2^(127 - 15).
    pub const E5M2_REBIAS: f32 = f32::from_bits((127 + 112) << 23);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks one ISA's loads, math and reductions against scalar f64 math.
    struct CheckIsa;

    impl WithSimd for CheckIsa {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            check_isa_body(s)
        }
    }

    fn check_isa<S: Simd>(s: S) {
        s.vectorize(CheckIsa)
    }

    #[inline(always)]
    fn check_isa_body<S: Simd>(s: S) {
        // SAFETY: `s` is a detected ISA's token; every pointer loaded from or stored to has
        // the LANES elements (2·LANES for the pair loads) the operation touches in its buffer.
        unsafe {
            let n = S::LANES;
            let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.73 - 3.1).collect();
            let v = s.load(xs.as_ptr());
            let mut out = vec![0.0f32; n];
            s.store(out.as_mut_ptr(), s.exp(v));
            for (o, x) in out.iter().zip(&xs) {
                let want = (*x as f64).exp();
                assert!(
                    ((*o as f64) - want).abs() <= 4e-7 * want,
                    "exp({x}) = {o}, want {want}"
                );
            }
            s.store(out.as_mut_ptr(), s.tanh(v));
            for (o, x) in out.iter().zip(&xs) {
                assert!(
                    ((*o as f64) - (*x as f64).tanh()).abs() < 1e-6,
                    "tanh({x}) = {o}"
                );
            }
            // Relative accuracy where `1 - 2 / (e^(2x) + 1)` cancels: tiny and mid arguments.
            for x in [1e-8f32, -3e-6, 1e-3, -0.2, 0.34, 0.7, -5.0, 20.0, 100.0] {
                s.store(out.as_mut_ptr(), s.tanh(s.splat(x)));
                let want = (x as f64).tanh();
                assert!(
                    ((out[0] as f64) - want).abs() <= 4e-7 * want.abs(),
                    "tanh({x}) = {}, want {want}",
                    out[0]
                );
                s.store(out.as_mut_ptr(), s.expm1(s.splat(x.min(80.0))));
                let want = (x.min(80.0) as f64).exp_m1();
                assert!(
                    ((out[0] as f64) - want).abs() <= 4e-7 * want.abs().max(1e-30),
                    "expm1({x}) = {}, want {want}",
                    out[0]
                );
            }
            for tiny in [f32::NEG_INFINITY, -100.0, -87.5] {
                s.store(out.as_mut_ptr(), s.exp(s.splat(tiny)));
                assert!(out.iter().all(|&o| o == 0.0), "exp({tiny}) = {out:?}");
            }
            // IEEE edges: NaN goes through every function; infinities saturate.
            let nan = f32::NAN;
            let inf = f32::INFINITY;
            type Case<S> = (
                &'static str,
                fn(S, <S as Simd>::V) -> <S as Simd>::V,
                [(f32, f32); 3],
            );
            let cases: [Case<S>; 3] = [
                ("exp", S::exp, [(nan, nan), (inf, inf), (-inf, 0.0)]),
                ("expm1", S::expm1, [(nan, nan), (inf, inf), (-inf, -1.0)]),
                ("tanh", S::tanh, [(nan, nan), (inf, 1.0), (-inf, -1.0)]),
            ];
            for (name, f, pairs) in cases {
                for (x, want) in pairs {
                    s.store(out.as_mut_ptr(), f(s, s.splat(x)));
                    assert!(
                        out.iter()
                            .all(|&o| o == want || (o.is_nan() && want.is_nan())),
                        "{name}({x}) = {out:?}, want {want}"
                    );
                }
            }
            assert!((s.reduce_sum(v) - xs.iter().sum::<f32>()).abs() < 1e-4);
            // Vector i holds i * 100 + lane: its lane sum lands in lane i.
            let rows: Vec<S::V> = (0..n)
                .map(|i| s.add(s.iota(), s.splat(i as f32 * 100.0)))
                .collect();
            s.store(out.as_mut_ptr(), s.transpose_sum(&rows));
            for (i, o) in out.iter().enumerate() {
                let want = (0..n).map(|l| (i * 100 + l) as f32).sum::<f32>();
                assert_eq!(*o, want, "transpose_sum lane {i}");
            }
            assert_eq!(s.reduce_max(v), xs.iter().cloned().fold(f32::MIN, f32::max));
            s.store(out.as_mut_ptr(), s.iota());
            assert!(out.iter().enumerate().all(|(i, &o)| o == i as f32));
            let lt = s.select_lt(v, s.splat(0.0), s.splat(1.0), s.splat(2.0));
            s.store(out.as_mut_ptr(), lt);
            for (o, x) in out.iter().zip(&xs) {
                assert_eq!(*o, if *x < 0.0 { 1.0 } else { 2.0 });
            }
            // Every code of both fp8 formats and a sweep of 16-bit floats.
            for format in [crate::fp8::Fp8Format::E4m3, crate::fp8::Fp8Format::E5m2] {
                for base in (0..256).step_by(n) {
                    let codes: Vec<u8> = (base..base + n).map(|c| (c % 256) as u8).collect();
                    let (v, scale) = match format {
                        crate::fp8::Fp8Format::E4m3 => (s.load_e4m3(codes.as_ptr()), S::E4M3_SCALE),
                        crate::fp8::Fp8Format::E5m2 => (s.load_e5m2(codes.as_ptr()), 1.0),
                    };
                    s.store(out.as_mut_ptr(), v);
                    for (o, &c) in out.iter().zip(&codes) {
                        let want = format.decode(c) / scale;
                        assert!(
                            o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                            "{format:?} code {c:#x}: {o} vs {want}"
                        );
                    }
                }
            }
            // The pair load decodes as two single loads.
            let codes: Vec<u8> = (0..256).map(|c| (c * 37 % 256) as u8).collect();
            for base in (0..256 - 2 * n).step_by(n) {
                let p = codes[base..].as_ptr();
                let [a, b] = s.load_e4m3_pair(p);
                for (got, want) in [(a, s.load_e4m3(p)), (b, s.load_e4m3(p.add(n)))] {
                    let mut g = vec![0.0f32; n];
                    s.store(g.as_mut_ptr(), got);
                    s.store(out.as_mut_ptr(), want);
                    for (g, w) in g.iter().zip(&out) {
                        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
                    }
                }
            }
            for base in (0..65536u32).step_by(977) {
                let bits: Vec<u16> = (0..n as u32)
                    .map(|i| ((base + i * 131) % 65536) as u16)
                    .collect();
                s.store(out.as_mut_ptr(), s.load_bf16(bits.as_ptr()));
                for (o, &b) in out.iter().zip(&bits) {
                    let want = half::bf16::from_bits(b).to_f32();
                    assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()));
                }
                s.store(out.as_mut_ptr(), s.load_f16(bits.as_ptr()));
                for (o, &b) in out.iter().zip(&bits) {
                    let want = half::f16::from_bits(b).to_f32();
                    assert!(
                        o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                        "f16 {b:#x}: {o} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn scalar_isa() {
        check_isa(scalar::Scalar);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_isas() {
        if let Some(s) = x86::Avx2::new() {
            check_isa(s);
        }
        if let Some(s) = x86::Avx512::new() {
            check_isa(s);
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_isa() {
        if let Some(s) = neon::Neon::new() {
            check_isa(s);
        }
    }
}
