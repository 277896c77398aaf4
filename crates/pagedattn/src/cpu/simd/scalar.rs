//! The portable fallback: one lane, plain Rust.

use super::{Simd, WithSimd};
use crate::fp8::Fp8Format;

/// Scalar "vectors" of one lane; available everywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scalar;

impl Simd for Scalar {
    const LANES: usize = 1;
    const REGISTERS: usize = 16;
    type V = f32;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        op.with_simd(self)
    }
    #[inline(always)]
    fn splat(self, x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn iota(self) -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> f32 {
        half::bf16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> f32 {
        half::f16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    unsafe fn load_e4m3(self, p: *const u8) -> f32 {
        Fp8Format::E4m3.decode(*p)
    }
    #[inline(always)]
    unsafe fn load_e5m2(self, p: *const u8) -> f32 {
        Fp8Format::E5m2.decode(*p)
    }
    #[inline(always)]
    fn add(self, a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    fn sub(self, a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    fn mul(self, a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    fn div(self, a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    fn fma(self, a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    fn max(self, a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    fn min(self, a: f32, b: f32) -> f32 {
        a.min(b)
    }
    #[inline(always)]
    fn select_lt(self, a: f32, b: f32, x: f32, y: f32) -> f32 {
        if a < b {
            x
        } else {
            y
        }
    }
    #[inline(always)]
    fn round(self, a: f32) -> f32 {
        a.round_ties_even()
    }
    #[inline(always)]
    fn pow2i(self, n: f32) -> f32 {
        f32::from_bits(((n as i32 + 127) as u32) << 23)
    }
    #[inline(always)]
    fn reduce_sum(self, a: f32) -> f32 {
        a
    }
    #[inline(always)]
    fn transpose_sum(self, v: &[f32]) -> f32 {
        v[0]
    }
    #[inline(always)]
    fn reduce_max(self, a: f32) -> f32 {
        a
    }
}
