//! Transparent huge pages for the cache (and buffers of the caller's that should be backed
//! like it).

use std::mem::MaybeUninit;

/// Asks the kernel to back a freshly allocated (not yet touched) buffer with transparent huge
/// pages: a decode walks hundreds of scattered blocks per sequence, and with 4 KiB pages each
/// block would cost a TLB miss. Harmless where huge pages are unavailable.
pub(super) fn advise_huge_pages(buf: &mut [u8]) {
    advise_range(buf.as_mut_ptr() as usize, buf.len());
}

/// [`Cpu`](super::Cpu)'s huge-page advice for a buffer of the caller's, before its first touch
/// (as `pagedattn bench` does for its bandwidth buffer, so that it is backed like a cache).
pub fn advise_huge_pages_uninit<T>(buf: &mut [MaybeUninit<T>]) {
    advise_range(buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
}

/// `madvise(MADV_HUGEPAGE)` on the whole huge pages inside `start..start + len`.
fn advise_range(start: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (first, end) = (start.next_multiple_of(HUGE), (start + len) & !(HUGE - 1));
        if end > first {
            // SAFETY: the range lies inside the caller's buffer; MADV_HUGEPAGE changes no
            // contents.
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}
