//! Host tensors: a shape and typed, row-major storage.

use half::vec::HalfBitsVecExt;
use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Typed, contiguous element storage.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// Bytes (fp8 codes).
    U8(Vec<u8>),
}

impl Storage {
    /// `len` zeros of `dtype`, from zeroed allocations: large buffers come straight from the
    /// kernel's zero pages, untouched, so that a cache can still ask for huge pages.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::F16 => Storage::F16(vec![0u16; len].reinterpret_into()),
            DType::BF16 => Storage::BF16(vec![0u16; len].reinterpret_into()),
            DType::U8 => Storage::U8(vec![0; len]),
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
        fn cast<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
            bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect()
        }
        Ok(match dtype {
            DType::F32 => Storage::F32(cast(bytes)),
            DType::F16 => Storage::F16(cast(bytes)),
            DType::BF16 => Storage::BF16(cast(bytes)),
            DType::U8 => Storage::U8(bytes.to_vec()),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
            Storage::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::BF16(v) => v.len(),
            Storage::U8(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Storage::F32(v) => bytemuck::cast_slice(v),
            Storage::F16(v) => bytemuck::cast_slice(v),
            Storage::BF16(v) => bytemuck::cast_slice(v),
            Storage::U8(v) => v,
        }
    }

    /// The raw bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::F32(v) => bytemuck::cast_slice_mut(v),
            Storage::F16(v) => bytemuck::cast_slice_mut(v),
            Storage::BF16(v) => bytemuck::cast_slice_mut(v),
            Storage::U8(v) => v,
        }
    }

    /// The elements as `T`, if `T` is the storage's type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (self.dtype() == T::DTYPE).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements as mutable `T`, if `T` is the storage's type.
    pub fn as_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        (self.dtype() == T::DTYPE).then(|| bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// Every element widened to f64 (fp8 codes are not decoded here: see the KV cache).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            Storage::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Storage::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Storage::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Storage::U8(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }
}

/// A row-major host tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl Tensor {
    /// Wraps storage whose length matches the shape.
    pub fn new(shape: Vec<usize>, storage: Storage) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != storage.len() {
            return Err(Error::invalid(
                "tensor storage length",
                storage.len(),
                format!("{numel} elements for shape {shape:?}"),
            ));
        }
        Ok(Tensor { shape, storage })
    }

    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Self {
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::zeros(dtype, shape.iter().product()),
        }
    }

    /// A float tensor of `dtype` from f32 values, rounded to nearest even.
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self> {
        let storage = match dtype {
            DType::U8 => return Err(Error::invalid("dtype", dtype, "f32, f16 or bf16")),
            _ => crate::with_element!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
                Storage::from_bytes(dtype, bytemuck::cast_slice(&v))?
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

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The storage, mutably (the shape stays fixed).
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Every element as f32 (fp8 bytes as their integer value).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.storage
            .to_f64_vec()
            .into_iter()
            .map(|x| x as f32)
            .collect()
    }

    /// Fills every element with NaN (float tensors) or 0xFF (bytes): for poisoning outputs in tests.
    pub fn fill_nan(&mut self) {
        match &mut self.storage {
            Storage::F32(v) => v.fill(f32::NAN),
            Storage::F16(v) => v.fill(f16::NAN),
            Storage::BF16(v) => v.fill(bf16::NAN),
            Storage::U8(v) => v.fill(0xFF),
        }
    }
}
