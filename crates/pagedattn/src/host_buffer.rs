//! [`HostBuffer`]: the elements of one host tensor or cache buffer, in memory this crate
//! allocated or in memory another library lends it (zero-copy interchange: a torch tensor, a
//! numpy array).

use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A fixed-length run of `T` in host memory: a `Vec<T>` this crate owns, or external memory
/// whose owner this buffer keeps alive. Reads and writes go through slices (`Deref`), so the
/// length never changes.
pub struct HostBuffer<T> {
    memory: Memory<T>,
}

enum Memory<T> {
    Owned(Vec<T>),
    External {
        ptr: NonNull<T>,
        len: usize,
        /// Keeps the memory alive; dropped with the buffer.
        _owner: Box<dyn Any + Send + Sync>,
    },
}

// SAFETY: an owned buffer is a `Vec<T>`; an external one is, by its constructor's contract,
// memory this buffer alone reads and writes for its life, i.e. a `Box<[T]>` freed by its
// owner instead of the allocator. Both are `Send`/`Sync` exactly when `T` is.
unsafe impl<T: Send> Send for HostBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for HostBuffer<T> {}

impl<T> HostBuffer<T> {
    /// `len` elements at `ptr`, lent by `owner`, which is dropped when this buffer is.
    ///
    /// An [`Error::Invalid`] for a null or misaligned `ptr` with `len > 0`, or a length whose
    /// size in bytes exceeds `isize::MAX`.
    ///
    /// # Safety
    /// For as long as `owner` lives, `ptr` addresses `len` initialized elements of `T` that
    /// nothing but this buffer reads or writes (no other Rust reference, no other thread, no
    /// device work) and that stay allocated and in place.
    pub unsafe fn from_external(
        ptr: *mut T,
        len: usize,
        owner: impl Any + Send + Sync,
    ) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize);
        if bytes.is_none() {
            return Err(Error::invalid(
                "external buffer length",
                len,
                "a size in bytes of at most isize::MAX",
            ));
        }
        let ptr = match NonNull::new(ptr) {
            Some(p) if p.as_ptr().is_aligned() => p,
            // An empty slice needs only a dangling, aligned pointer.
            _ if len == 0 => NonNull::dangling(),
            _ => {
                return Err(Error::invalid(
                    "external buffer address",
                    format!("{ptr:p}"),
                    format!(
                        "a non-null address aligned to {} bytes",
                        std::mem::align_of::<T>()
                    ),
                ))
            }
        };
        Ok(HostBuffer {
            memory: Memory::External {
                ptr,
                len,
                _owner: Box::new(owner),
            },
        })
    }

    /// Whether the memory is lent by another owner (not allocated by this crate).
    pub fn is_external(&self) -> bool {
        matches!(self.memory, Memory::External { .. })
    }
}

impl<T> From<Vec<T>> for HostBuffer<T> {
    fn from(v: Vec<T>) -> Self {
        HostBuffer {
            memory: Memory::Owned(v),
        }
    }
}

impl<T> Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.memory {
            Memory::Owned(v) => v,
            // SAFETY: `len` initialized elements, read only through this buffer (the
            // constructor's contract), borrowed for as long as `self` is.
            Memory::External { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
        }
    }
}

impl<T> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.memory {
            Memory::Owned(v) => v,
            // SAFETY: as in `deref`, and `&mut self` makes this the only borrow.
            Memory::External { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
        }
    }
}

impl<T: Clone> Clone for HostBuffer<T> {
    /// An owned copy (of external memory too). Aborts if the host cannot hold it, as
    /// `Vec::clone` does: [`HostStorage::try_clone`](crate::HostStorage::try_clone) returns
    /// an error instead.
    fn clone(&self) -> Self {
        self.to_vec().into()
    }
}

impl<T: PartialEq> PartialEq for HostBuffer<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: fmt::Debug> fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn external_memory_is_read_and_written_in_place_and_its_owner_dropped_with_it() {
        struct Owner(Vec<f32>, Arc<AtomicBool>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let mut owner = Owner(vec![1.0, 2.0, 3.0], dropped.clone());
        let ptr = owner.0.as_mut_ptr();
        // SAFETY: the Vec's heap memory does not move when `owner` does, and only the buffer
        // uses it from here on.
        let mut buf = unsafe { HostBuffer::from_external(ptr, 3, owner) }.unwrap();
        assert!(buf.is_external());
        buf[1] = 5.0;
        assert_eq!(&*buf, &[1.0, 5.0, 3.0]);
        let copy = buf.clone();
        assert!(!copy.is_external());
        assert_eq!(copy, buf);
        assert!(!dropped.load(Ordering::SeqCst));
        drop(buf);
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[test]
    fn bad_external_addresses_are_errors() {
        // SAFETY: refused before any use.
        let null = unsafe { HostBuffer::<f32>::from_external(std::ptr::null_mut(), 4, ()) };
        assert!(null.unwrap_err().to_string().contains("address"));
        let mut v = vec![0u32; 4];
        let odd = (v.as_mut_ptr() as *mut u8).wrapping_add(1) as *mut u32;
        // SAFETY: refused before any use.
        let misaligned = unsafe { HostBuffer::from_external(odd, 2, ()) };
        assert!(misaligned.is_err());
        // SAFETY: refused before any use.
        let huge = unsafe { HostBuffer::from_external(v.as_mut_ptr(), usize::MAX / 2, ()) };
        assert!(huge.unwrap_err().to_string().contains("length"));
        // SAFETY: an empty buffer reads nothing.
        let empty = unsafe { HostBuffer::<f32>::from_external(std::ptr::null_mut(), 0, ()) };
        assert!(empty.unwrap().is_empty());
    }
}
