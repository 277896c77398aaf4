//! FP8 (e4m3fn and e5m2) encoding of KV-cache elements.
//!
//! Encoding rounds to nearest even and saturates to the largest finite value (infinities too),
//! as CUDA's `cvt.rn.satfinite` does; NaN becomes `0x7F`. Decoding is exact.

use std::sync::OnceLock;

/// One of the two fp8 formats a KV cache can be stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest finite 448.
    E4m3,
    /// e5m2: 5 exponent bits (bias 15), 2 mantissa bits, largest finite 57344.
    E5m2,
}

/// The canonical NaN code written for a NaN input.
const NAN_CODE: u8 = 0x7F;

impl Fp8Format {
    fn mantissa_bits(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 3,
            Fp8Format::E5m2 => 2,
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 7,
            Fp8Format::E5m2 => 15,
        }
    }

    /// The largest finite value.
    pub fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    /// Encodes `x`: round to nearest even, saturate to ±[`max_finite`](Self::max_finite).
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs().min(self.max_finite());
        let mbits = self.mantissa_bits();
        let min_normal_exp = 1 - self.bias();
        let exp = if a == 0.0 {
            min_normal_exp
        } else {
            exponent_of(a).max(min_normal_exp)
        };
        // `a / 2^exp * 2^mbits` is exact; rounding it gives the mantissa (with the implicit one
        // for normals). A carry to 2^(mbits+1) moves to the next binade, which the code layout
        // absorbs because the exponent field sits right above the mantissa.
        // Subnormals fall out of the same formula: their exponent field is 0, one below
        // `min_normal_exp + bias`, and `q` carries no implicit one.
        let q = (a * pow2(mbits - exp)).round_ties_even() as i32;
        let code = ((exp + self.bias()) << mbits) + q - (1 << mbits);
        sign | code as u8
    }

    /// Decodes a code to its exact value.
    pub fn decode(self, code: u8) -> f32 {
        self.decode_table()[code as usize]
    }

    /// The 256 decoded values, indexed by code (for kernels that dequantize by lookup).
    pub fn decode_table(self) -> &'static [f32; 256] {
        static E4M3: OnceLock<[f32; 256]> = OnceLock::new();
        static E5M2: OnceLock<[f32; 256]> = OnceLock::new();
        let cell = match self {
            Fp8Format::E4m3 => &E4M3,
            Fp8Format::E5m2 => &E5M2,
        };
        cell.get_or_init(|| std::array::from_fn(|c| self.decode_slow(c as u8)))
    }

    fn decode_slow(self, code: u8) -> f32 {
        let mbits = self.mantissa_bits();
        let exp_field = ((code & 0x7F) >> mbits) as i32;
        let man = (code as i32) & ((1 << mbits) - 1);
        let all_ones_exp = (1 << (7 - mbits)) - 1;
        let magnitude = match self {
            Fp8Format::E4m3 if exp_field == all_ones_exp && man == (1 << mbits) - 1 => f32::NAN,
            Fp8Format::E5m2 if exp_field == all_ones_exp => {
                if man == 0 {
                    f32::INFINITY
                } else {
                    f32::NAN
                }
            }
            _ if exp_field == 0 => man as f32 * pow2(1 - self.bias() - mbits),
            _ => (((1 << mbits) + man) as f32) * pow2(exp_field - self.bias() - mbits),
        };
        if code & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        }
    }
}

/// floor(log2(a)) for a positive normal f32.
fn exponent_of(a: f32) -> i32 {
    ((a.to_bits() >> 23) & 0xFF) as i32 - 127
}

/// 2^e as f32, for the small exponents used here.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest finite code by exhaustive search, ties to the even code.
    fn nearest(format: Fp8Format, x: f32) -> u8 {
        let magnitude = x.abs().min(format.max_finite()) as f64;
        let mut best = (f64::INFINITY, 0u8);
        for c in 0..0x80u8 {
            let v = format.decode(c);
            if !v.is_finite() {
                continue;
            }
            let d = (v as f64 - magnitude).abs();
            if d < best.0 || (d == best.0 && c & 1 == 0) {
                best = (d, c);
            }
        }
        best.1 | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn decode_known_values() {
        assert_eq!(Fp8Format::E4m3.decode(0x7E), 448.0);
        assert!(Fp8Format::E4m3.decode(0x7F).is_nan());
        assert_eq!(Fp8Format::E4m3.decode(0x38), 1.0);
        assert_eq!(Fp8Format::E4m3.decode(0x01), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5m2.decode(0x7B), 57344.0);
        assert_eq!(Fp8Format::E5m2.decode(0x7C), f32::INFINITY);
        assert_eq!(Fp8Format::E5m2.decode(0x3C), 1.0);
        assert_eq!(Fp8Format::E5m2.decode(0x01), 2f32.powi(-16));
        assert_eq!(Fp8Format::E5m2.decode(0xC0), -2.0);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for f in [Fp8Format::E4m3, Fp8Format::E5m2] {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_finite() {
                    assert_eq!(f.encode(v), c, "{f:?} code {c:#x} value {v}");
                }
            }
        }
    }

    #[test]
    fn encode_matches_exhaustive_nearest_search() {
        let mut state = 0x9E3779B97F4A7C15u64;
        for f in [Fp8Format::E4m3, Fp8Format::E5m2] {
            let mut probes = vec![
                0.0f32,
                -0.0,
                1e-30,
                -1e-30,
                f32::INFINITY,
                f32::NEG_INFINITY,
                1e9,
            ];
            // Exact midpoints between neighbouring codes: the ties.
            for c in 0..0x7Eu8 {
                let (a, b) = (f.decode(c), f.decode(c + 1));
                if a.is_finite() && b.is_finite() {
                    probes.extend([(a + b) / 2.0, -(a + b) / 2.0]);
                }
            }
            for _ in 0..20_000 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let mag = ((state >> 40) as f32 / (1u64 << 24) as f32)
                    * 2f32.powi((state % 40) as i32 - 22);
                probes.push(if state & 1 == 0 { mag } else { -mag });
            }
            for x in probes {
                assert_eq!(f.encode(x), nearest(f, x), "{f:?} x = {x:e}");
            }
        }
        assert_eq!(Fp8Format::E4m3.encode(f32::NAN), 0x7F);
        assert_eq!(Fp8Format::E4m3.encode(-0.0), 0x80);
    }
}
