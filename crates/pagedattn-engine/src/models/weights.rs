//! The element types a model's weights are stored in (GGUF's `ggml_type` values that the
//! engine reads), with their block geometry.

/// A weight tensor's storage type: plain floats, or GGUF's block quantizations (a block of
/// `block_len()` consecutive elements of a row stored in `block_bytes()` bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// 32-bit float (`GGML_TYPE_F32` = 0).
    F32,
    /// IEEE half (`GGML_TYPE_F16` = 1).
    F16,
    /// bfloat16 (`GGML_TYPE_BF16` = 30).
    BF16,
    /// 32 weights: an f16 scale `d`, then 16 bytes of 4-bit values `q`; weight = (q - 8) * d
    /// (`GGML_TYPE_Q4_0` = 2). Byte j holds element j in its low nibble and element j + 16 in
    /// its high nibble.
    Q4_0,
    /// 32 weights: f16 scale `d`, f16 minimum `m`, then 16 bytes of 4-bit values; weight =
    /// q * d + m (`GGML_TYPE_Q4_1` = 3), nibbles as in `Q4_0`.
    Q4_1,
    /// 32 weights: an f16 scale `d`, then 32 signed bytes `q`; weight = q * d
    /// (`GGML_TYPE_Q8_0` = 8).
    Q8_0,
}

impl WeightType {
    /// The type of GGUF's `ggml_type` code, or `None` for a type the engine does not read.
    pub fn from_ggml(code: u32) -> Option<Self> {
        Some(match code {
            0 => WeightType::F32,
            1 => WeightType::F16,
            2 => WeightType::Q4_0,
            3 => WeightType::Q4_1,
            8 => WeightType::Q8_0,
            30 => WeightType::BF16,
            _ => return None,
        })
    }

    /// GGUF's `ggml_type` code of this type.
    pub fn ggml_code(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q8_0 => 8,
            WeightType::BF16 => 30,
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_len(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q8_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q8_0 => 34,
        }
    }

    /// Bytes of a row of `len` elements, or `None` when `len` is not a whole number of blocks
    /// (or the size overflows).
    pub fn row_bytes(self, len: usize) -> Option<usize> {
        if len.is_multiple_of(self.block_len()) {
            (len / self.block_len()).checked_mul(self.block_bytes())
        } else {
            None
        }
    }
}
