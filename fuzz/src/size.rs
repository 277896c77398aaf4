//! Sizes as fuzz inputs: lengths, dimensions and counts that are mostly small (so that most
//! inputs describe something that can run), sometimes at the edge of an integer type and
//! sometimes anything at all (so that every overflow check is reached).

use arbitrary::Arbitrary;

/// A `usize` drawn from a fuzz input.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Size {
    /// 0..=255.
    Small(u8),
    /// 0..=65535.
    Medium(u16),
    /// An integer type's edge, moved by a small signed delta (wrapping).
    Edge(Edge, i8),
    /// Any 64-bit value.
    Any(u64),
}

/// The values where sizes overflow: the limits of the metadata's i32 fields, of 32-bit
/// indices, of `isize` (allocation sizes) and of `usize`, and the powers of two.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Edge {
    /// `i32::MAX`.
    I32Max,
    /// `u32::MAX`.
    U32Max,
    /// `isize::MAX`.
    IsizeMax,
    /// `usize::MAX`.
    UsizeMax,
    /// `2^(k % 64)`.
    Pow2(u8),
}

impl Size {
    /// The size.
    pub fn get(self) -> usize {
        match self {
            Size::Small(x) => x as usize,
            Size::Medium(x) => x as usize,
            Size::Edge(edge, delta) => {
                let base = match edge {
                    Edge::I32Max => i32::MAX as usize,
                    Edge::U32Max => u32::MAX as usize,
                    Edge::IsizeMax => isize::MAX as usize,
                    Edge::UsizeMax => usize::MAX,
                    Edge::Pow2(k) => 1usize << (k % 64),
                };
                base.wrapping_add_signed(delta as isize)
            }
            Size::Any(x) => x as usize,
        }
    }
}
