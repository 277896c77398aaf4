//! A step's metadata on a GPU: sections of i64 packed one after another into one device
//! buffer, uploaded by one asynchronous copy from pinned memory: the slot mapping the cache
//! write reads, and the attention kernels' sequences, block-table entries and work list.
//!
//! The pinned staging memory goes back to its GPU's pool when the plan drops and the next plan
//! takes it from there: allocating pinned memory takes longer than a decode step, and freeing
//! it waits for the whole GPU.

use std::ops::Range;
use std::sync::{Arc, PoisonError};

use super::device::Gpu;
use super::memory::{self, DeviceBuffer, Pinned};
use crate::error::Result;

/// Staging buffers a GPU's pool keeps at most (a step's plans, a few steps deep).
const POOLED: usize = 16;

/// The packed buffer, and the staging memory it was uploaded from.
#[derive(Default)]
pub(crate) struct Packed {
    /// The device buffer; `None` when every section is empty.
    device: Option<DeviceBuffer>,
    /// Where uploads are copied from, and the GPU whose pool it returns to; kept until the
    /// plan drops: an upload may still be reading it (its event tells when it is done, and
    /// whoever takes it from the pool waits for that before writing).
    staging: Option<(Pinned, Arc<Gpu>)>,
}

impl Drop for Packed {
    fn drop(&mut self) {
        if let Some((staging, gpu)) = self.staging.take() {
            // Nothing panics while the lock is held, and the pool stays valid if something did.
            let mut pool = gpu.staging.lock().unwrap_or_else(PoisonError::into_inner);
            if pool.len() < POOLED {
                pool.push(staging);
            }
        }
    }
}

/// Pinned staging memory of at least `bytes` bytes: the smallest that fits from `gpu`'s pool,
/// else new (a power of two, so that it fits later plans of similar size).
fn take_staging(gpu: &Gpu, bytes: usize) -> Result<Pinned> {
    let mut pool = gpu.staging.lock().unwrap_or_else(PoisonError::into_inner);
    let best = (0..pool.len())
        .filter(|&i| pool[i].len() >= bytes)
        .min_by_key(|&i| pool[i].len());
    if let Some(i) = best {
        return Ok(pool.swap_remove(i));
    }
    drop(pool);
    let size = bytes.checked_next_power_of_two().unwrap_or(bytes).max(4096);
    Pinned::zeroed(gpu, size, memory::WRITE_COMBINED)
}

impl Packed {
    /// Packs `sections` and queues their upload on `gpu`'s stream; returns the buffer and the
    /// element range of each section in it.
    pub(crate) fn upload<const N: usize>(
        gpu: &Arc<Gpu>,
        sections: [&[i64]; N],
    ) -> Result<(Packed, [Range<usize>; N])> {
        let mut end = 0;
        let ranges = sections.map(|section| {
            end += section.len();
            end - section.len()..end
        });
        let bytes = end * std::mem::size_of::<i64>();
        if bytes == 0 {
            let empty = Packed {
                device: None,
                staging: None,
            };
            return Ok((empty, ranges));
        }
        let staging = take_staging(gpu, bytes)?;
        // SAFETY: the upload (queued by `rewrite`, before anything reads the buffer)
        // overwrites every byte.
        let device = unsafe { DeviceBuffer::uninit(gpu, bytes)? };
        let mut packed = Packed {
            device: Some(device),
            staging: Some((staging, gpu.clone())),
        };
        packed.rewrite(gpu, sections, &ranges)?;
        Ok((packed, ranges))
    }

    /// Queues the upload of new `sections` into the same device memory: each as long as its
    /// range of `ranges` (those `upload` returned), so that every address stays valid (a CUDA
    /// graph holds them). Waits for the previous upload to have left the staging memory; the
    /// new one runs after the work queued before it, in stream order.
    pub(crate) fn rewrite<const N: usize>(
        &mut self,
        gpu: &Gpu,
        sections: [&[i64]; N],
        ranges: &[Range<usize>; N],
    ) -> Result<()> {
        let (Some(device), Some((staging, _))) = (&self.device, &mut self.staging) else {
            return Ok(());
        };
        let host = staging.bytes_mut()?;
        for (section, range) in sections.iter().zip(ranges) {
            assert_eq!(section.len(), range.len(), "a section keeps its length");
            host[range.start * 8..range.end * 8].copy_from_slice(bytemuck::cast_slice(section));
        }
        let bytes = ranges.last().map_or(0, |r| r.end * 8);
        gpu.with_queue(|stream| {
            // SAFETY: the device buffer holds `bytes` bytes and the staging memory at least as
            // many (both made by `upload` for these ranges); both live until the copy is done:
            // the device buffer is freed after the streams that use it, the staging memory is
            // reused or freed only after its event, recorded next.
            unsafe { memory::copy_async(stream, device.address(), staging.address()?, bytes)? };
            staging.mark_used(stream)
        })
    }

    /// The device address of element `index` (0 when the buffer is empty, for empty sections
    /// that no kernel reads).
    pub(crate) fn address(&self, index: usize) -> u64 {
        self.device.as_ref().map_or(0, |device| {
            device.address() + (index * std::mem::size_of::<i64>()) as u64
        })
    }
}
