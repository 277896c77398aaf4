//! Element types of tensors and caches, and the conversions the kernels share.

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a tensor or cache buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// Raw bytes: the storage of an fp8 KV cache.
    U8,
}

impl DType {
    /// The activation dtypes: what queries, keys, values and outputs may be.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether this is one of the activation dtypes (f32, f16, bf16).
    pub fn is_float(self) -> bool {
        self != DType::U8
    }

    /// The lowercase name: `f32`, `f16`, `bf16`, `u8`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "u8" | "uint8" => Ok(DType::U8),
            _ => Err(Error::invalid("dtype", s, "one of f32, f16, bf16, u8")),
        }
    }
}

/// A floating-point element type the kernels read and write (f32, f16, bf16).
pub trait Element: Copy + Send + Sync + bytemuck::Pod + PartialEq + fmt::Debug + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Narrows from f32, rounding to nearest even.
    fn from_f32(x: f32) -> Self;
    /// Narrows from f64, rounding to nearest even (once).
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

/// Runs `$body` with the type alias `$t` bound to the [`Element`] type of a float [`DType`].
/// `U8` is a caller bug (validation rejects it before any kernel runs) and panics.
#[macro_export]
#[doc(hidden)]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F16 => {
                type $t = ::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = ::half::bf16;
                $body
            }
            $crate::DType::U8 => unreachable!("u8 is not an activation dtype"),
        }
    };
}
