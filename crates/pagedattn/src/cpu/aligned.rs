//! f32 buffers aligned to a cache line, for the kernels' packed operands and scratch: the
//! allocator only promises 16 bytes, so a 32- or 64-byte vector load at a multiple of its
//! size from the start of a `Vec<f32>` could straddle two cache lines (a split load).

use std::ops::{Deref, DerefMut};

/// One cache line of f32.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A zero-initialised f32 buffer whose first element is 64-byte aligned.
#[derive(Debug, Clone)]
pub struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        AlignedF32 {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` around 16 f32 with no padding (its size, 64, is its
        // alignment), so the lines are `16 * lines.len() >= len` consecutive f32.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}
