//! A step's metadata on a GPU: sections of i64 packed one after another into one device
//! buffer, uploaded by one asynchronous copy from pinned memory: the slot mapping the cache
//! write reads, and the attention kernels' sequences, block-table entries and work list.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::device::Gpu;
use super::memory::{self, Pinned};
use crate::error::Result;

/// The packed buffer, and the staging memory it was uploaded from.
pub(crate) struct Packed {
    /// The device buffer; `None` when every section is empty.
    device: Option<CudaSlice<u8>>,
    /// Kept until the plan drops: the upload may still be reading it (its event tells when
    /// it is done, and it waits for that before freeing).
    _staging: Option<Pinned>,
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
                _staging: None,
            };
            return Ok((empty, ranges));
        }
        let mut staging = Pinned::zeroed(gpu, bytes, memory::WRITE_COMBINED)?;
        let host = staging.bytes_mut()?;
        for (section, range) in sections.iter().zip(&ranges) {
            host[range.start * 8..range.end * 8].copy_from_slice(bytemuck::cast_slice(section));
        }
        // SAFETY: the copy below overwrites every byte.
        let device = unsafe { memory::alloc_device(gpu, bytes)? };
        // SAFETY: both buffers hold `bytes` bytes and live until the copy is done: the device
        // buffer is freed in stream order, the staging memory after its event, recorded next.
        unsafe {
            memory::copy_async(
                gpu,
                memory::device_address(gpu, &device),
                staging.address()?,
                bytes,
            )?
        };
        staging.mark_used(gpu)?;
        let packed = Packed {
            device: Some(device),
            _staging: Some(staging),
        };
        Ok((packed, ranges))
    }

    /// The device address of element `index` (0 when the buffer is empty, for empty sections
    /// that no kernel reads).
    pub(crate) fn address(&self, gpu: &Gpu, index: usize) -> u64 {
        self.device.as_ref().map_or(0, |device| {
            memory::device_address(gpu, device) + (index * std::mem::size_of::<i64>()) as u64
        })
    }
}
