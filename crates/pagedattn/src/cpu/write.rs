//! Parallel cache write, swap and copy for the CPU backend.

use rayon::prelude::*;

use crate::dtype::Element;
use crate::error::Result;
use crate::kv_cache::{self, KvCache, KvScales};
use crate::tensor::{Storage, Tensor};

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

/// Writes token `t` of `key`/`value` to `slot_mapping[t]` (-1 skipped), tokens in parallel.
/// Slots are distinct (validated), so the tokens' rows are disjoint.
pub(crate) fn write_parallel(
    cache: &mut KvCache,
    key: &Tensor,
    value: &Tensor,
    slot_mapping: &[i64],
    scales: KvScales,
) -> Result<()> {
    cache.check_write(key, value, slot_mapping, "slot_mapping")?;
    scales.validate(cache.spec().kv_cache_dtype)?;
    let spec = *cache.spec();
    let layout = cache.layout();
    let fp8 = spec.kv_cache_dtype.fp8_format();
    let (d, hkv) = (spec.head_size, spec.num_kv_heads);
    let (kbuf, vbuf) = cache.buffers_mut();
    for (src, dst, scale) in [(key, kbuf, scales.k_scale), (value, vbuf, scales.v_scale)] {
        crate::with_element!(spec.dtype, T => {
            let src = src.storage().as_slice::<T>().expect("dtype checked");
            match (dst, fp8) {
                (Storage::U8(out), Some(format)) => {
                    let out = SharedMut(out.as_mut_ptr());
                    slot_mapping.par_iter().enumerate().with_min_len(8).for_each(|(t, &slot)| {
                        if slot < 0 { return; }
                        for h in 0..hkv {
                            let at = layout.row_start(&spec, slot as usize, h);
                            let row = &src[(t * hkv + h) * d..][..d];
                            for (i, &x) in row.iter().enumerate() {
                                // SAFETY: distinct slots own distinct rows of the buffer.
                                unsafe { *out.ptr().add(at + i) = format.encode(x.to_f32() / scale) };
                            }
                        }
                    });
                }
                (dst, _) => {
                    let out = SharedMut(dst.as_slice_mut::<T>().expect("auto cache has the input dtype").as_mut_ptr());
                    slot_mapping.par_iter().enumerate().with_min_len(16).for_each(|(t, &slot)| {
                        if slot < 0 { return; }
                        for h in 0..hkv {
                            let at = layout.row_start(&spec, slot as usize, h);
                            let row = &src[(t * hkv + h) * d..][..d];
                            // SAFETY: distinct slots own distinct rows of the buffer.
                            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.ptr().add(at), d) };
                        }
                    });
                }
            }
        });
    }
    Ok(())
}

/// Swaps blocks with the pairs copied in parallel (destinations are distinct, validated).
pub(crate) fn swap_parallel(
    src: &KvCache,
    dst: &mut KvCache,
    pairs: &[(usize, usize)],
) -> Result<()> {
    kv_cache::check_swap(src, dst, pairs)?;
    let block_bytes = src.spec().block_elems() * src.spec().storage_dtype().size_bytes();
    let (dk, dv) = dst.buffers_mut();
    for (from, to) in [(src.key(), dk), (src.value(), dv)] {
        let s = from.as_bytes();
        let d = SharedMut(to.as_bytes_mut().as_mut_ptr());
        pairs.par_iter().for_each(|&(sb, db)| {
            // SAFETY: destination blocks are distinct, so the writes are disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s[sb * block_bytes..].as_ptr(),
                    d.ptr().add(db * block_bytes),
                    block_bytes,
                )
            };
        });
    }
    Ok(())
}

/// Copies blocks inside every layer's cache, the layers in parallel (each layer's pairs in
/// order, as the sequential semantics require).
pub(crate) fn copy_parallel(caches: &mut [KvCache], pairs: &[(usize, usize)]) -> Result<()> {
    for cache in caches.iter() {
        kv_cache::check_pairs(pairs, cache.spec().num_blocks, cache.spec().num_blocks)?;
    }
    caches
        .par_iter_mut()
        .try_for_each(|c| kv_cache::copy_blocks(std::slice::from_mut(c), pairs))
}
