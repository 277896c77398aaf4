//! AArch64 NEON, 4 f32 lanes.
//!
//! SAFETY convention of the intrinsic wrappers: an `unsafe` block here without a comment of
//! its own only calls NEON intrinsics, which are sound wherever NEON is present (a [`Neon`]
//! token exists only where it was detected), on registers or on the pointers that the caller
//! of an `unsafe fn` of [`Simd`] vouched for.
#![allow(clippy::undocumented_unsafe_blocks)] // The convention above covers the wrappers.

use std::arch::aarch64::*;

use super::fp8_bits::*;
use super::{Simd, WithSimd};

/// NEON (always present on AArch64), 4 f32 lanes.
#[derive(Debug, Clone, Copy)]
pub struct Neon(());

impl Neon {
    /// The token, if this CPU has NEON.
    pub fn new() -> Option<Self> {
        std::arch::is_aarch64_feature_detected!("neon").then_some(Neon(()))
    }
}

#[target_feature(enable = "neon")]
#[inline]
unsafe fn with_neon<Op: WithSimd>(s: Neon, op: Op) -> Op::Output {
    op.with_simd(s)
}

/// Four bytes widened to u32 lanes.
#[inline(always)]
unsafe fn load_u8x4(p: *const u8) -> uint32x4_t {
    let word = (p as *const u32).read_unaligned();
    vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(
        word,
    )))))
}

/// Decodes lanes holding a small float's magnitude bits `mag` (sign stripped): the bits moved
/// to the top of an f32 by `shift`, rebiased by a multiply (which also normalizes subnormals),
/// with the all-ones exponent `special_min..` mapped to infinity / NaN.
#[inline(always)]
unsafe fn decode_small_float(
    w: uint32x4_t,
    mag_mask: u32,
    shift: i32,
    rebias: f32,
    special_min: u32,
    nan_only: bool,
) -> float32x4_t {
    let mag = vandq_u32(w, vdupq_n_u32(mag_mask));
    let f = vmulq_f32(
        vreinterpretq_f32_u32(vshlq_u32(mag, vdupq_n_s32(shift))),
        vdupq_n_f32(rebias),
    );
    let special_bits = if nan_only {
        vdupq_n_u32(f32::NAN.to_bits())
    } else {
        let man_mask = mag_mask & !special_min;
        vorrq_u32(
            vdupq_n_u32(0x7F80_0000),
            vshlq_u32(vandq_u32(mag, vdupq_n_u32(man_mask)), vdupq_n_s32(shift)),
        )
    };
    let is_special = vcgeq_u32(mag, vdupq_n_u32(special_min));
    let f = vbslq_f32(is_special, vreinterpretq_f32_u32(special_bits), f);
    let sign_bit = vandq_u32(w, vdupq_n_u32(mag_mask + 1));
    let sign = vshlq_u32(sign_bit, vdupq_n_s32(31 - mag_mask.count_ones() as i32));
    vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(f), sign))
}

impl Simd for Neon {
    const LANES: usize = 4;
    const REGISTERS: usize = 32;
    type V = float32x4_t;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        // SAFETY: the token exists only where NEON was detected.
        unsafe { with_neon(self, op) }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> float32x4_t {
        unsafe { vdupq_n_f32(x) }
    }
    #[inline(always)]
    fn iota(self) -> float32x4_t {
        unsafe { vld1q_f32([0.0f32, 1.0, 2.0, 3.0].as_ptr()) }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> float32x4_t {
        vld1q_f32(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: float32x4_t) {
        vst1q_f32(p, v)
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> float32x4_t {
        vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(vld1_u16(p))))
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> float32x4_t {
        // f16 magnitude bits shifted by 13 sit where f32's would, up to a rebias of 2^112.
        decode_small_float(
            vmovl_u16(vld1_u16(p)),
            0x7FFF,
            13,
            f32::from_bits((127 + 112) << 23),
            0x7C00,
            false,
        )
    }
    #[inline(always)]
    unsafe fn load_e4m3(self, p: *const u8) -> float32x4_t {
        decode_small_float(
            load_u8x4(p),
            0x7F,
            E4M3_SHIFT as i32,
            E4M3_REBIAS,
            0x7F,
            true,
        )
    }
    #[inline(always)]
    unsafe fn load_e5m2(self, p: *const u8) -> float32x4_t {
        decode_small_float(
            load_u8x4(p),
            0x7F,
            E5M2_SHIFT as i32,
            E5M2_REBIAS,
            0x7C,
            false,
        )
    }
    #[inline(always)]
    fn add(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vaddq_f32(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vsubq_f32(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vmulq_f32(a, b) }
    }
    #[inline(always)]
    fn div(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vdivq_f32(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        unsafe { vfmaq_f32(c, a, b) }
    }
    #[inline(always)]
    fn max(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vmaxq_f32(a, b) }
    }
    #[inline(always)]
    fn min(self, a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vminq_f32(a, b) }
    }
    #[inline(always)]
    fn select_lt(
        self,
        a: float32x4_t,
        b: float32x4_t,
        x: float32x4_t,
        y: float32x4_t,
    ) -> float32x4_t {
        unsafe { vbslq_f32(vcltq_f32(a, b), x, y) }
    }
    #[inline(always)]
    fn round(self, a: float32x4_t) -> float32x4_t {
        unsafe { vrndnq_f32(a) }
    }
    #[inline(always)]
    fn pow2i(self, n: float32x4_t) -> float32x4_t {
        unsafe {
            let e = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
            vreinterpretq_f32_s32(vshlq_n_s32::<23>(e))
        }
    }
    #[inline(always)]
    fn reduce_sum(self, a: float32x4_t) -> f32 {
        unsafe { vaddvq_f32(a) }
    }
    #[inline(always)]
    fn transpose_sum(self, v: &[float32x4_t]) -> float32x4_t {
        assert_eq!(v.len(), 4);
        unsafe { vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])) }
    }
    #[inline(always)]
    fn reduce_max(self, a: float32x4_t) -> f32 {
        unsafe { vmaxvq_f32(a) }
    }
}
