//! A step's metadata on a GPU: sections of i64 packed one after another into one device
//! buffer, uploaded by one asynchronous copy from pinned memory: the slot mapping the cache
//! write reads, and the attention kernels' sequences, block-table entries and work list.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::device::Gpu;
use super::memory::{self, Pinned};
use crate::error::Result;

/// The packed buffer, and the staging memory it was uploaded from.
#[derive(Default)]
pub(crate) struct Packed {
    /// The device buffer; `None` when every section is empty.
    device: Option<CudaSlice<u8>>,
    /// Where uploads are copied from; kept until the plan drops: an upload may still be
    /// reading it (its event tells when it is done, and it waits for that before freeing).
    staging: Option<Pinned>,
}

impl Packed {
    /// Packs `sections` and queues their upload on `gpu`'s stream; returns the buffer and the
    /// element range of each section in it.
    pub(crate) fn upload<const N: usize>(
        gpu: &Gpu,
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
        let staging = Pinned::zeroed(gpu, bytes, memory::WRITE_COMBINED)?;
        // SAFETY: the upload (queued by `rewrite`, before anything reads the buffer)
        // overwrites every byte.
        let device = unsafe { memory::alloc_device(gpu, bytes)? };
        let mut packed = Packed {
            device: Some(device),
            staging: Some(staging),
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
        let (Some(device), Some(staging)) = (&self.device, &mut self.staging) else {
            return Ok(());
        };
        let host = staging.bytes_mut()?;
        for (section, range) in sections.iter().zip(ranges) {
            assert_eq!(section.len(), range.len(), "a section keeps its length");
            host[range.start * 8..range.end * 8].copy_from_slice(bytemuck::cast_slice(section));
        }
        let bytes = host.len();
        // SAFETY: both buffers hold `bytes` bytes (made together by `upload`) and live
        // until the copy is done: the device buffer is freed in stream order, the staging
        // memory after its event, recorded next.
        unsafe {
            memory::copy_async(
                gpu,
                memory::device_address(gpu, device),
                staging.address()?,
                bytes,
            )?
        };
        staging.mark_used(gpu)
    }

    /// The device address of element `index` (0 when the buffer is empty, for empty sections
    /// that no kernel reads).
    pub(crate) fn address(&self, gpu: &Gpu, index: usize) -> u64 {
        self.device.as_ref().map_or(0, |device| {
            memory::device_address(gpu, device) + (index * std::mem::size_of::<i64>()) as u64
        })
    }
}
