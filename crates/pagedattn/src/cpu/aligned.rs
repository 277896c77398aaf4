//! f32 in whole, 64-byte aligned cache lines, for the kernels' packed operands and scratch
//! and for the bench's memory probes: the allocator only promises 16 bytes, so a 32- or
//! 64-byte vector load at a multiple of its size from the start of a `Vec<f32>` could
//! straddle two cache lines (a split load).

use std::ops::{Deref, DerefMut};

/// One cache line of f32.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(64))]
pub struct Line(pub [f32; 16]);

/// The f32 of `lines`, in order.
pub(crate) fn floats(lines: &[Line]) -> &[f32] {
    // SAFETY: a Line is 16 f32 and nothing else (repr(C), 64 bytes, no padding).
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast(), lines.len() * 16) }
}

/// The f32 of `lines`, in order, writable.
fn floats_mut(lines: &mut [Line]) -> &mut [f32] {
    // SAFETY: as in `floats`, and `&mut` makes the borrow unique.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast(), lines.len() * 16) }
}

/// A zero-initialised f32 buffer whose first element is 64-byte aligned.
#[derive(Debug, Clone)]
pub struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// `len` zeros. For sizes the configuration bounds (rows × D, a key tile); a size that
    /// follows the caller's metadata goes through [`AlignedF32::try_zeros`].
    pub fn zeros(len: usize) -> Self {
        AlignedF32 {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }

    /// `len` zeros, or [`Error::OutOfMemory`](crate::Error::OutOfMemory) naming the bytes
    /// where the host cannot allocate them.
    pub(crate) fn try_zeros(len: usize) -> crate::Result<Self> {
        let mut lines = crate::tensor::vec_with_capacity(len.div_ceil(16))?;
        lines.resize(len.div_ceil(16), Line([0.0; 16]));
        Ok(AlignedF32 { lines, len })
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &floats(&self.lines)[..self.len]
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut floats_mut(&mut self.lines)[..self.len]
    }
}
