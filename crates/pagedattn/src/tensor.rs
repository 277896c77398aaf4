//! Tensors: a shape and typed, row-major storage on a [`Device`]. [`HostStorage`] is host
//! memory; [`Storage`] is memory on any device, and [`Storage::to_device`] is the one place
//! data crosses between devices.

use half::{bf16, f16};

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{ensure, Error, Result};
pub use crate::host_buffer::HostBuffer;

/// Typed, contiguous element storage in host memory: owned, or lent by another library
/// ([`HostBuffer::from_external`]).
#[derive(Debug, Clone, PartialEq)]
pub enum HostStorage {
    /// f32 elements.
    F32(HostBuffer<f32>),
    /// f16 elements.
    F16(HostBuffer<f16>),
    /// bf16 elements.
    BF16(HostBuffer<bf16>),
    /// Bytes (fp8 codes).
    U8(HostBuffer<u8>),
}

/// The host elements of a tensor or cache, writable in place: slices, whose length and type
/// cannot change.
///
/// Kernels trust that a tensor's or cache's buffers hold what its shape or spec says: the
/// forward gate checks shapes, not buffers, so that a call's checks take the same time
/// whatever the sizes. That holds by construction: every constructor checks the length, and
/// nothing hands out a tensor's, cache's or workspace's [`HostStorage`] or [`Storage`]
/// mutably, only this view. (Re-checking lengths at every gate would leave each other path
/// that reads a buffer — cache writes, swaps, copies, conversions — to remember it too.)
///
/// None of these compile:
/// ```compile_fail,E0614
/// # fn probe(cache: &mut pagedattn::KvCache) -> pagedattn::Result<()> {
/// *cache.host_buffers_mut()?.0 = pagedattn::HostStorage::F32(vec![0.0; 256].into());
/// # Ok(()) }
/// ```
/// ```compile_fail,E0614
/// # fn probe(t: &mut pagedattn::Tensor) -> pagedattn::Result<()> {
/// *t.host_mut()? = pagedattn::HostStorage::F32(vec![].into());
/// # Ok(()) }
/// ```
/// ```compile_fail
/// # fn probe(t: &mut pagedattn::Tensor) {
/// let _ = t.storage_mut();
/// # }
/// ```
/// ```compile_fail
/// # fn probe(cache: &mut pagedattn::KvCache) {
/// let _ = cache.buffers_mut();
/// # }
/// ```
/// ```compile_fail,E0624
/// # fn probe(workspace: &mut pagedattn::Workspace) {
/// let _ = workspace.storage_mut();
/// # }
/// ```
#[derive(Debug, PartialEq)]
pub enum HostSliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
    /// Bytes (fp8 codes).
    U8(&'a mut [u8]),
}

impl<'a> HostSliceMut<'a> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostSliceMut::F32(_) => DType::F32,
            HostSliceMut::F16(_) => DType::F16,
            HostSliceMut::BF16(_) => DType::BF16,
            HostSliceMut::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostSliceMut::F32(v) => v.len(),
            HostSliceMut::F16(v) => v.len(),
            HostSliceMut::BF16(v) => v.len(),
            HostSliceMut::U8(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw bytes.
    pub fn into_bytes(self) -> &'a mut [u8] {
        match self {
            HostSliceMut::F32(v) => bytemuck::cast_slice_mut(v),
            HostSliceMut::F16(v) => bytemuck::cast_slice_mut(v),
            HostSliceMut::BF16(v) => bytemuck::cast_slice_mut(v),
            HostSliceMut::U8(v) => v,
        }
    }

    /// The elements as `T`, if `T` is their type.
    pub fn into_slice<T: Element>(self) -> Option<&'a mut [T]> {
        (self.dtype() == T::DTYPE).then(|| bytemuck::cast_slice_mut(self.into_bytes()))
    }

    /// The raw bytes, reborrowed.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.reborrow().into_bytes()
    }

    /// The elements as `T`, reborrowed, if `T` is their type.
    pub fn as_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        self.reborrow().into_slice()
    }

    /// A shorter-lived view of the same elements.
    pub fn reborrow(&mut self) -> HostSliceMut<'_> {
        match self {
            HostSliceMut::F32(v) => HostSliceMut::F32(v),
            HostSliceMut::F16(v) => HostSliceMut::F16(v),
            HostSliceMut::BF16(v) => HostSliceMut::BF16(v),
            HostSliceMut::U8(v) => HostSliceMut::U8(v),
        }
    }
}

/// `len` zeros of `T` from a zeroed allocation (the kernel's zero pages for large buffers,
/// untouched, so that a cache can still ask for huge pages), or [`Error::OutOfMemory`].
pub(crate) fn zeroed_vec<T: bytemuck::Zeroable>(len: usize) -> Result<Vec<T>> {
    bytemuck::allocation::try_zeroed_vec(len)
        .map_err(|()| host_out_of_memory(len.saturating_mul(std::mem::size_of::<T>())))
}

/// A vector with room for exactly `len` elements, or [`Error::OutOfMemory`]: every host
/// allocation whose size a caller chooses goes through here or [`zeroed_vec`].
pub(crate) fn vec_with_capacity<T>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| host_out_of_memory(len.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

/// The elements of `items`, collected into a vector allocated fallibly (`len` of them).
pub(crate) fn try_collect<T>(len: usize, items: impl IntoIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = vec_with_capacity(len)?;
    v.extend(items.into_iter().take(len));
    Ok(v)
}

/// The error for a host allocation of `bytes` that failed.
pub(crate) fn host_out_of_memory(bytes: usize) -> Error {
    Error::OutOfMemory {
        device: Device::Cpu.to_string(),
        bytes,
    }
}

impl HostStorage {
    /// `len` zeros of `dtype`, from zeroed allocations: large buffers come straight from the
    /// kernel's zero pages, untouched, so that a cache can still ask for huge pages. An
    /// allocation the host cannot make is [`Error::OutOfMemory`].
    pub fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => HostStorage::F32(zeroed_vec(len)?.into()),
            DType::F16 => HostStorage::F16(zeroed_vec(len)?.into()),
            DType::BF16 => HostStorage::BF16(zeroed_vec(len)?.into()),
            DType::U8 => HostStorage::U8(zeroed_vec(len)?.into()),
        })
    }

    /// A copy, or [`Error::OutOfMemory`] (`Clone` aborts the process instead).
    pub fn try_clone(&self) -> Result<Self> {
        fn copy<T: Clone>(v: &[T]) -> Result<HostBuffer<T>> {
            let mut out = vec_with_capacity(v.len())?;
            out.extend_from_slice(v);
            Ok(out.into())
        }
        Ok(match self {
            HostStorage::F32(v) => HostStorage::F32(copy(v)?),
            HostStorage::F16(v) => HostStorage::F16(copy(v)?),
            HostStorage::BF16(v) => HostStorage::BF16(copy(v)?),
            HostStorage::U8(v) => HostStorage::U8(copy(v)?),
        })
    }

    /// The elements as slices: writable in place, never resized.
    pub fn view_mut(&mut self) -> HostSliceMut<'_> {
        match self {
            HostStorage::F32(v) => HostSliceMut::F32(v),
            HostStorage::F16(v) => HostSliceMut::F16(v),
            HostStorage::BF16(v) => HostSliceMut::BF16(v),
            HostStorage::U8(v) => HostSliceMut::U8(v),
        }
    }

    /// Builds storage of `dtype` from raw little-endian bytes.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        let size = dtype.size_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::invalid(
                "byte length",
                bytes.len(),
                format!("a multiple of {size} for {dtype}"),
            ));
        }
        fn cast<T: bytemuck::Pod>(bytes: &[u8]) -> Result<HostBuffer<T>> {
            let size = std::mem::size_of::<T>();
            try_collect(
                bytes.len() / size,
                bytes.chunks_exact(size).map(bytemuck::pod_read_unaligned),
            )
            .map(HostBuffer::from)
        }
        Ok(match dtype {
            DType::F32 => HostStorage::F32(cast(bytes)?),
            DType::F16 => HostStorage::F16(cast(bytes)?),
            DType::BF16 => HostStorage::BF16(cast(bytes)?),
            DType::U8 => HostStorage::U8(cast(bytes)?),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostStorage::F32(_) => DType::F32,
            HostStorage::F16(_) => DType::F16,
            HostStorage::BF16(_) => DType::BF16,
            HostStorage::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostStorage::F32(v) => v.len(),
            HostStorage::F16(v) => v.len(),
            HostStorage::BF16(v) => v.len(),
            HostStorage::U8(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostStorage::F32(v) => bytemuck::cast_slice(v),
            HostStorage::F16(v) => bytemuck::cast_slice(v),
            HostStorage::BF16(v) => bytemuck::cast_slice(v),
            HostStorage::U8(v) => v,
        }
    }

    /// The raw bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.view_mut().into_bytes()
    }

    /// The elements as `T`, if `T` is the storage's type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (self.dtype() == T::DTYPE).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements as mutable `T`, if `T` is the storage's type.
    pub fn as_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        self.view_mut().into_slice()
    }

    /// Every element widened to f64 (fp8 codes are not decoded here: see the KV cache), or
    /// [`Error::OutOfMemory`].
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let n = self.len();
        match self {
            HostStorage::F32(v) => try_collect(n, v.iter().map(|&x| x as f64)),
            HostStorage::F16(v) => try_collect(n, v.iter().map(|&x| x.to_f64())),
            HostStorage::BF16(v) => try_collect(n, v.iter().map(|&x| x.to_f64())),
            HostStorage::U8(v) => try_collect(n, v.iter().map(|&x| x as f64)),
        }
    }
}

/// Typed, contiguous element storage on some device.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Host(HostStorage),
    /// Memory of a CUDA GPU, or pinned host memory registered with one.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

impl PartialEq for Storage {
    /// Host storage compares by element; storage on a device never compares equal (move it
    /// to the host first).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Storage::Host(a), Storage::Host(b)) => a == b,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

impl From<HostStorage> for Storage {
    fn from(host: HostStorage) -> Self {
        Storage::Host(host)
    }
}

impl Storage {
    /// `len` zeros of `dtype` on `device`.
    pub fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Storage::Host(HostStorage::zeros(dtype, len)?)),
            _ => Storage::Host(HostStorage::zeros(dtype, 0)?).to_device_empty(device, dtype, len),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Host(h) => h.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.dtype(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(h) => h.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        match self {
            Storage::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.device(),
        }
    }

    /// The host elements, or [`Error::DeviceMismatch`] naming `what` if they live elsewhere.
    pub fn host(&self, what: &str) -> Result<&HostStorage> {
        #[cfg(not(feature = "cuda"))]
        let _ = what;
        match self {
            Storage::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Err(not_on_host(what, c.device())),
        }
    }

    /// The host elements, mutably (see [`Storage::host`]).
    pub fn host_mut(&mut self, what: &str) -> Result<&mut HostStorage> {
        #[cfg(not(feature = "cuda"))]
        let _ = what;
        match self {
            Storage::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Err(not_on_host(what, c.device())),
        }
    }

    /// The host elements by value, or [`Error::DeviceMismatch`] (see [`Storage::host`]).
    pub fn into_host(self, what: &str) -> Result<HostStorage> {
        #[cfg(not(feature = "cuda"))]
        let _ = what;
        match self {
            Storage::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Err(not_on_host(what, c.device())),
        }
    }

    /// A copy on `device`: the one host/device boundary (uploads, downloads and copies
    /// between devices all go through here).
    pub fn to_device(&self, device: Device) -> Result<Storage> {
        match (self, device) {
            (Storage::Host(h), Device::Cpu) => Ok(Storage::Host(h.try_clone()?)),
            #[cfg(feature = "cuda")]
            (Storage::Host(h), _) => crate::cuda::CudaStorage::upload(h, device).map(Storage::Cuda),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(c), Device::Cpu) => c.download().map(Storage::Host),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(c), _) => c.copy_to(device).map(Storage::Cuda),
            #[cfg(not(feature = "cuda"))]
            (Storage::Host(_), _) => Err(no_cuda(device)),
        }
    }

    /// Overwrites the contents with `src`'s (the same dtype and length, on any device),
    /// keeping this storage's memory. A copy into a GPU's memory is queued on its stream
    /// (`src` may be dropped when this returns); a copy out of one waits for it.
    pub fn copy_from(&mut self, src: &Storage) -> Result<()> {
        ensure(
            (self.dtype(), self.len()) == (src.dtype(), src.len()),
            || "copy source".into(),
            format_args!("{} elements of {}", src.len(), src.dtype()),
            || format!("{} elements of {}", self.len(), self.dtype()),
        )?;
        match (self, src) {
            (Storage::Host(dst), Storage::Host(src)) => {
                dst.as_bytes_mut().copy_from_slice(src.as_bytes());
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(dst), Storage::Host(src)) => dst.write_from_host(src),
            #[cfg(feature = "cuda")]
            (Storage::Host(dst), Storage::Cuda(src)) => {
                *dst = src.download()?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(dst), Storage::Cuda(src)) => {
                let bytes = src.len() * src.dtype().size_bytes();
                dst.copy_ranges_from(src, std::iter::once((0, 0, bytes)))
            }
        }
    }

    /// `len` zeros of `dtype` on `device` (a device other than the host).
    fn to_device_empty(&self, device: Device, dtype: DType, len: usize) -> Result<Storage> {
        #[cfg(feature = "cuda")]
        {
            let _ = self;
            crate::cuda::CudaStorage::zeros(device, dtype, len).map(Storage::Cuda)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (self, dtype, len);
            Err(no_cuda(device))
        }
    }
}

/// The error for host access to memory that lives on `device`.
#[cfg(feature = "cuda")]
fn not_on_host(what: &str, device: Device) -> Error {
    Error::device_mismatch(
        what,
        device,
        "host memory: move it with to_device(Device::Cpu) first",
    )
}

/// The error for a device this build cannot reach.
#[cfg(not(feature = "cuda"))]
fn no_cuda(device: Device) -> Error {
    Error::unsupported(
        "pagedattn",
        format!("{device}: this build has no `cuda` feature"),
    )
}

/// A row-major tensor on some device.
#[derive(Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl Tensor {
    /// Wraps storage whose length matches the shape.
    pub fn new(shape: Vec<usize>, storage: impl Into<Storage>) -> Result<Self> {
        let storage = storage.into();
        let numel = numel(&shape)?;
        if numel != storage.len() {
            return Err(Error::invalid(
                "tensor storage length",
                storage.len(),
                format!("{numel} elements for shape {shape:?}"),
            ));
        }
        Ok(Tensor { shape, storage })
    }

    /// A host tensor of zeros: an [`Error::Invalid`] if the shape's element count overflows,
    /// [`Error::OutOfMemory`] if the host cannot hold it.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        Tensor::zeros_on(Device::Cpu, dtype, shape)
    }

    /// A tensor of zeros on `device`.
    pub fn zeros_on(device: Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::zeros(device, dtype, numel(shape)?)?,
        })
    }

    /// A host float tensor of `dtype` from f32 values, rounded to nearest even.
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self> {
        let storage = match dtype {
            DType::U8 => return Err(Error::invalid("dtype", dtype, "f32, f16 or bf16")),
            _ => crate::with_element!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
                HostStorage::from_bytes(dtype, bytemuck::cast_slice(&v))?
            }),
        };
        Tensor::new(shape.to_vec(), storage)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The storage, mutably, for the backends: never public, because a caller could put
    /// storage of another length, dtype or device in its place (see [`HostSliceMut`]).
    #[cfg(feature = "cuda")]
    pub(crate) fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// The host elements ([`Error::DeviceMismatch`] for a tensor on a device).
    pub fn host(&self) -> Result<&HostStorage> {
        self.storage.host("tensor")
    }

    /// The host elements, writable in place ([`Error::DeviceMismatch`] for a tensor on a
    /// device).
    pub fn host_mut(&mut self) -> Result<HostSliceMut<'_>> {
        Ok(self.storage.host_mut("tensor")?.view_mut())
    }

    /// A copy of this tensor on `device`.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        Ok(Tensor {
            shape: self.shape.clone(),
            storage: self.storage.to_device(device)?,
        })
    }

    /// A copy of this tensor on its own device.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_device(self.device())
    }

    /// A copy of this tensor in host memory.
    pub fn to_host(&self) -> Result<Tensor> {
        self.to_device(Device::Cpu)
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Every element as f32 (fp8 bytes as their integer value), copied to the host first if
    /// the tensor lives on a device.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let host = self.storage.to_device(Device::Cpu)?;
        let wide = host.host("tensor")?.to_f64_vec()?;
        try_collect(wide.len(), wide.into_iter().map(|x| x as f32))
    }

    /// Overwrites the contents with `src`'s (the same dtype and shape, on any device), keeping
    /// this tensor's memory: how an engine refills the inputs a captured CUDA graph reads.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        ensure(
            self.shape == src.shape,
            || "copy source shape".into(),
            format_args!("{:?}", src.shape),
            || format!("{:?}", self.shape),
        )?;
        self.storage.copy_from(&src.storage)
    }

    /// Fills every element with NaN (float tensors) or 0xFF (bytes), in place on whatever
    /// device the tensor lives: for poisoning outputs in tests.
    pub fn fill_nan(&mut self) -> Result<()> {
        let mut poison = HostStorage::zeros(self.dtype(), self.numel())?;
        match &mut poison {
            HostStorage::F32(v) => v.fill(f32::NAN),
            HostStorage::F16(v) => v.fill(f16::NAN),
            HostStorage::BF16(v) => v.fill(bf16::NAN),
            HostStorage::U8(v) => v.fill(0xFF),
        }
        // In place: the tensor keeps its memory (a captured CUDA graph may hold its address).
        self.storage.copy_from(&Storage::Host(poison))
    }
}

/// The element count of `shape`, or an error if it overflows.
pub(crate) fn numel(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            Error::invalid(
                "tensor shape",
                format!("{shape:?}"),
                "an element count that fits in usize",
            )
        })
}
