//! A raw pointer that parallel loops share to write disjoint parts of one buffer.

/// A pointer that may cross threads: every user writes a disjoint part of the buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);
// SAFETY: users only write disjoint elements (documented at each use).
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper).
    pub(crate) fn ptr(self) -> *mut T {
        self.0
    }
}
