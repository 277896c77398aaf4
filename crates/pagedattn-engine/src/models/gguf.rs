//! Reading GGUF files (versions 2 and 3, little-endian): the header, the metadata key/values,
//! the tensor infos and the data section, and the Llama configuration their metadata describes.
//!
//! The reader is written here rather than taken from a crate: the format is a short header, a
//! list of tagged values and a list of tensor records, and the crates that read it either come
//! with a whole tensor framework (`candle-core`'s `gguf_file` drags all of candle) or are small
//! single-author crates that panic or allocate unchecked sizes on malformed files, which this
//! reader must not. Every length, count, dimension and offset read from the file is checked
//! against the bytes that are there before anything is allocated or sliced, so a hostile or
//! truncated file gives a [`GgufError`], never a panic or an out-of-memory abort.
//!
//! Layout (all integers little-endian): `"GGUF"`, `u32` version, `u64` tensor count, `u64`
//! key/value count; the key/values (`string` key, `u32` value type, value); the tensor infos
//! (`string` name, `u32` dimension count, `u64` dims — `dims[0]` is the contiguous row length —,
//! `u32` ggml type, `u64` offset into the data section); padding to `general.alignment`
//! (default 32); the data section. A `string` is a `u64` byte length and UTF-8 bytes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use thiserror::Error;

use crate::models::weights::WeightType;

/// The alignment of the data section and of each tensor in it when `general.alignment` is
/// absent (GGUF's `GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: usize = 32;

/// ggml's `GGML_MAX_DIMS`: a tensor has at most this many dimensions.
pub const MAX_DIMS: usize = 4;

/// How deep arrays of arrays may nest. GGUF allows nesting, no file in use nests at all, and an
/// unbounded depth would let a hostile file overflow the stack of the recursive reader.
pub const MAX_ARRAY_NESTING: usize = 4;

/// A malformed, truncated or unsupported GGUF file, or metadata that is missing or of the wrong
/// type. Each message names what is wrong in one line.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file ends inside a field.
    #[error(
        "truncated GGUF file: {what} at byte {offset} needs {needed} bytes, the file has {len}"
    )]
    Truncated {
        /// The field being read.
        what: String,
        /// Where it starts.
        offset: usize,
        /// How many bytes it needs.
        needed: u64,
        /// The file's length.
        len: usize,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic bytes {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version other than 2 or 3 (version 1 used 32-bit counts; a byte-swapped version is a
    /// big-endian file, which this reader does not read).
    #[error("unsupported GGUF version {0} (this reader reads versions 2 and 3, little-endian)")]
    UnsupportedVersion(u32),
    /// A count read from the file (tensors, key/values, array elements) that cannot fit in the
    /// bytes left, checked before anything is allocated for it.
    #[error("{what}: count {count} cannot fit in the {remaining} bytes left in the file")]
    CountTooLarge {
        /// What is counted.
        what: String,
        /// The count read.
        count: u64,
        /// The bytes left after the count.
        remaining: usize,
    },
    /// A metadata value type code outside GGUF's 0..=12.
    #[error("metadata key {key:?}: unknown value type {code}")]
    BadValueType {
        /// The key.
        key: String,
        /// The type code read.
        code: u32,
    },
    /// Arrays nested deeper than [`MAX_ARRAY_NESTING`].
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_NESTING}")]
    NestingTooDeep {
        /// The key.
        key: String,
    },
    /// A string (a key, a value, a tensor name) that is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
    },
    /// A boolean byte other than 0 or 1.
    #[error("metadata key {key:?}: boolean byte {byte} is neither 0 nor 1")]
    BadBool {
        /// The key.
        key: String,
        /// The byte read.
        byte: u8,
    },
    /// The same metadata key twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    /// The same tensor name twice.
    #[error("duplicate tensor {0:?}")]
    DuplicateTensor(String),
    /// A metadata key that is needed and absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value of another type than asked for (or an integer out of the asked type's
    /// range).
    #[error("metadata key {key:?} is {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type (and, for an out-of-range integer, the value) found.
        found: String,
    },
    /// A metadata value of the right type that the engine cannot use.
    #[error("metadata key {key:?}: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// Why the value is unusable.
        reason: String,
    },
    /// A tensor with more than [`MAX_DIMS`] dimensions (or none).
    #[error("tensor {name:?} has {n_dims} dimensions; 1 to {MAX_DIMS} are allowed")]
    BadDimCount {
        /// The tensor.
        name: String,
        /// The count read.
        n_dims: u32,
    },
    /// A tensor whose element or byte count overflows.
    #[error("tensor {name:?}: dimensions {dims:?} overflow the address space")]
    DimsOverflow {
        /// The tensor.
        name: String,
        /// Its dimensions as read.
        dims: Vec<u64>,
    },
    /// A tensor type the engine does not read (see [`WeightType`]).
    #[error(
        "tensor {name:?} has ggml type {type_name} ({code}), which the engine does not read \
         (it reads F32, F16, BF16, Q4_0, Q4_1 and Q8_0)"
    )]
    UnsupportedType {
        /// The tensor.
        name: String,
        /// ggml's name of the type, or `unknown`.
        type_name: &'static str,
        /// The type code read.
        code: u32,
    },
    /// A tensor whose rows are not a whole number of its type's blocks.
    #[error(
        "tensor {name:?}: row length {row_len} is not a multiple of {ty:?}'s block of {block_len}"
    )]
    RaggedRow {
        /// The tensor.
        name: String,
        /// Its type.
        ty: WeightType,
        /// `dims[0]`.
        row_len: u64,
        /// The type's block length.
        block_len: usize,
    },
    /// A tensor offset that is not a multiple of the file's alignment.
    #[error("tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// The file's alignment.
        alignment: usize,
    },
    /// A tensor whose data runs past the end of the file.
    #[error(
        "tensor {name:?}: {bytes} bytes at data offset {offset} (file byte {data_start} + offset) \
         run past the end of the file ({len} bytes)"
    )]
    DataPastEnd {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// Its size in bytes.
        bytes: u64,
        /// Where the data section starts.
        data_start: u64,
        /// The file's length.
        len: usize,
    },
    /// A tensor that is needed and absent.
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
    /// A tensor of another shape or type than the model needs.
    #[error("tensor {name:?}: {reason}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// An allocation for a size read from the file failed.
    #[error("cannot allocate {what}")]
    Alloc {
        /// What was being allocated.
        what: String,
    },
    /// A model of another architecture than Llama.
    #[error(
        "unsupported architecture {0:?} (general.architecture): the engine runs \"llama\" models"
    )]
    UnsupportedArchitecture(String),
}

/// `Result` with a [`GgufError`].
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// `GGUF_TYPE_UINT8` (0).
    U8(u8),
    /// `GGUF_TYPE_INT8` (1).
    I8(i8),
    /// `GGUF_TYPE_UINT16` (2).
    U16(u16),
    /// `GGUF_TYPE_INT16` (3).
    I16(i16),
    /// `GGUF_TYPE_UINT32` (4).
    U32(u32),
    /// `GGUF_TYPE_INT32` (5).
    I32(i32),
    /// `GGUF_TYPE_FLOAT32` (6).
    F32(f32),
    /// `GGUF_TYPE_BOOL` (7).
    Bool(bool),
    /// `GGUF_TYPE_STRING` (8).
    String(String),
    /// `GGUF_TYPE_ARRAY` (9).
    Array(MetaArray),
    /// `GGUF_TYPE_UINT64` (10).
    U64(u64),
    /// `GGUF_TYPE_INT64` (11).
    I64(i64),
    /// `GGUF_TYPE_FLOAT64` (12).
    F64(f64),
}

/// A metadata array: its elements all have one type, stored unboxed.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    /// Of `u8`.
    U8(Vec<u8>),
    /// Of `i8`.
    I8(Vec<i8>),
    /// Of `u16`.
    U16(Vec<u16>),
    /// Of `i16`.
    I16(Vec<i16>),
    /// Of `u32`.
    U32(Vec<u32>),
    /// Of `i32`.
    I32(Vec<i32>),
    /// Of `f32`.
    F32(Vec<f32>),
    /// Of `bool`.
    Bool(Vec<bool>),
    /// Of strings.
    String(Vec<String>),
    /// Of arrays.
    Array(Vec<MetaArray>),
    /// Of `u64`.
    U64(Vec<u64>),
    /// Of `i64`.
    I64(Vec<i64>),
    /// Of `f64`.
    F64(Vec<f64>),
}

impl MetaValue {
    /// The value's type as a short name (`u32`, `string`, `array of i32`, …), for messages.
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::Array(a) => format!("array of {}", a.element_type_name()),
            other => scalar_type_name(other).to_string(),
        }
    }

    /// The value as an integer, if it is one (of any width and sign).
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }
}

fn scalar_type_name(v: &MetaValue) -> &'static str {
    match v {
        MetaValue::U8(_) => "u8",
        MetaValue::I8(_) => "i8",
        MetaValue::U16(_) => "u16",
        MetaValue::I16(_) => "i16",
        MetaValue::U32(_) => "u32",
        MetaValue::I32(_) => "i32",
        MetaValue::F32(_) => "f32",
        MetaValue::Bool(_) => "bool",
        MetaValue::String(_) => "string",
        MetaValue::Array(_) => "array",
        MetaValue::U64(_) => "u64",
        MetaValue::I64(_) => "i64",
        MetaValue::F64(_) => "f64",
    }
}

impl MetaArray {
    /// The elements' type as a short name, for messages.
    pub fn element_type_name(&self) -> &'static str {
        match self {
            MetaArray::U8(_) => "u8",
            MetaArray::I8(_) => "i8",
            MetaArray::U16(_) => "u16",
            MetaArray::I16(_) => "i16",
            MetaArray::U32(_) => "u32",
            MetaArray::I32(_) => "i32",
            MetaArray::F32(_) => "f32",
            MetaArray::Bool(_) => "bool",
            MetaArray::String(_) => "string",
            MetaArray::Array(_) => "array",
            MetaArray::U64(_) => "u64",
            MetaArray::I64(_) => "i64",
            MetaArray::F64(_) => "f64",
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// ggml's name of a `ggml_type` code, for the message of an unsupported type.
pub fn ggml_type_name(code: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("unknown")
}

/// A tensor's record in the file: name, type, shape and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    ty: WeightType,
    dims: Vec<usize>,
    /// Byte range in the whole file (data section start + offset), checked to lie inside it.
    start: usize,
    len: usize,
}

impl TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`, …).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its storage type.
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// Its dimensions in GGUF order: `dims[0]` is the contiguous row length, so a matrix of
    /// `n` rows of `k` elements is `[k, n]`.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The number of elements (the product of the dimensions).
    pub fn n_elements(&self) -> usize {
        // Checked to fit when the file was read.
        self.dims.iter().product()
    }

    /// The size of its data in bytes.
    pub fn n_bytes(&self) -> usize {
        self.len
    }
}

/// A tensor's record and its bytes, borrowed from a [`Gguf`].
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// The record: name, type, dimensions.
    pub info: &'a TensorInfo,
    /// The raw bytes as stored (blocks of the type's quantization, rows in order).
    pub data: &'a [u8],
}

/// The file's bytes: memory-mapped, or owned (files built in memory, tests).
#[derive(Debug)]
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: its metadata, its tensor records, and its bytes (mapped or owned), from
/// which each tensor's data is borrowed without copying.
#[derive(Debug)]
pub struct Gguf {
    storage: Storage,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

impl Gguf {
    /// Memory-maps and parses the file at `path`.
    ///
    /// The file must not be modified or truncated while the returned value lives (as with any
    /// memory map: a file shortened underneath would fault on access).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this value; the documented contract is
        // that the model file is not modified while it is in use, as every GGUF loader assumes.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self> {
        let mut r = Reader {
            buf: storage.bytes(),
            pos: 0,
        };
        let magic = r.take(4, || "magic".into())?;
        if magic != b"GGUF" {
            let mut found = [0; 4];
            found.copy_from_slice(magic);
            return Err(GgufError::BadMagic { found });
        }
        let version = r.u32(|| "version".into())?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64(|| "tensor count".into())?;
        let n_kv = r.u64(|| "key/value count".into())?;
        // A key/value takes at least 12 bytes (an empty key, a type, a byte); a tensor info at
        // least 24 (an empty name, one dimension, a type, an offset).
        r.check_count(n_kv, 12, || "key/value count".into())?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(|| format!("metadata key #{i}"))?;
            let code = r.u32(|| format!("value type of metadata key {key:?}"))?;
            let value = r.value(&key, code, 0)?;
            if metadata.contains_key(&key) {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v
                    .as_integer()
                    .filter(|&a| a > 0 && (a as u128).is_power_of_two())
                    .and_then(|a| usize::try_from(a).ok());
                a.ok_or_else(|| GgufError::BadValue {
                    key: "general.alignment".into(),
                    reason: format!("{v:?} is not a power of two"),
                })?
            }
        };

        r.check_count(n_tensors, 24, || "tensor count".into())?;
        // Bounded by the file's size through check_count.
        let n_tensors = n_tensors as usize;
        let mut raw = Vec::new();
        raw.try_reserve_exact(n_tensors)
            .map_err(|_| GgufError::Alloc {
                what: format!("{n_tensors} tensor infos"),
            })?;
        for i in 0..n_tensors {
            let name = r.string(|| format!("name of tensor #{i}"))?;
            let n_dims = r.u32(|| format!("dimension count of tensor {name:?}"))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(GgufError::BadDimCount { name, n_dims });
            }
            let mut dims = [0u64; MAX_DIMS];
            for d in dims.iter_mut().take(n_dims as usize) {
                *d = r.u64(|| format!("dimensions of tensor {name:?}"))?;
            }
            let code = r.u32(|| format!("type of tensor {name:?}"))?;
            let offset = r.u64(|| format!("offset of tensor {name:?}"))?;
            raw.push((name, dims[..n_dims as usize].to_vec(), code, offset));
        }
        let data_start =
            r.pos
                .checked_next_multiple_of(alignment)
                .ok_or_else(|| GgufError::Truncated {
                    what: "data section".into(),
                    offset: r.pos,
                    needed: alignment as u64,
                    len: r.buf.len(),
                })?;
        let len = r.buf.len();

        let mut tensors = Vec::new();
        tensors
            .try_reserve_exact(n_tensors)
            .map_err(|_| GgufError::Alloc {
                what: format!("{n_tensors} tensor infos"),
            })?;
        let mut by_name = HashMap::new();
        for (name, dims, code, offset) in raw {
            let info = tensor_info(name, dims, code, offset, alignment, data_start, len)?;
            if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(info.name));
            }
            tensors.push(info);
        }

        Ok(Gguf {
            storage,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_start,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and the tensors in it.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The byte offset in the file where the data section starts.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The value of `key`, or [`GgufError::MissingKey`].
    pub fn value(&self, key: &str) -> Result<&MetaValue> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    /// The unsigned integer at `key` (stored as any integer type whose value fits a `u32`).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.value(key).and_then(|v| integer(key, v, "u32"))
    }

    /// Like [`Gguf::get_u32`], `None` when the key is absent.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get(key).map(|v| integer(key, v, "u32")).transpose()
    }

    /// The unsigned integer at `key` (stored as any integer type whose value fits a `u64`).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.value(key).and_then(|v| integer(key, v, "u64"))
    }

    /// The float at `key` (`f32`, or `f64` rounded to `f32`).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.value(key).and_then(|v| float(key, v))
    }

    /// Like [`Gguf::get_f32`], `None` when the key is absent.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.get(key).map(|v| float(key, v)).transpose()
    }

    /// The boolean at `key`.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.value(key).and_then(|v| boolean(key, v))
    }

    /// Like [`Gguf::get_bool`], `None` when the key is absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| boolean(key, v)).transpose()
    }

    /// The string at `key`.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.value(key).and_then(|v| string(key, v))
    }

    /// Like [`Gguf::get_str`], `None` when the key is absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|v| string(key, v)).transpose()
    }

    /// The array at `key`.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray> {
        match self.value(key)? {
            MetaValue::Array(a) => Ok(a),
            v => Err(wrong_type(key, "an array", v)),
        }
    }

    /// The array of strings at `key`.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            MetaArray::String(a) => Ok(a),
            a => Err(GgufError::WrongType {
                key: key.into(),
                expected: "an array of string",
                found: format!("an array of {}", a.element_type_name()),
            }),
        }
    }

    /// The tensor records, in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Whether a tensor named `name` exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The tensor named `name` with its bytes, or [`GgufError::MissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i = self
            .by_name
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))?;
        Ok(self.view(&self.tensors[i]))
    }

    /// Every tensor with its bytes, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.tensors.iter().map(|info| self.view(info))
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        // In bounds: checked against the file's length when the record was read.
        TensorView {
            info,
            data: &self.storage.bytes()[info.start..info.start + info.len],
        }
    }
}

/// Checks one tensor record and places it in the file.
fn tensor_info(
    name: String,
    dims: Vec<u64>,
    code: u32,
    offset: u64,
    alignment: usize,
    data_start: usize,
    len: usize,
) -> Result<TensorInfo> {
    let ty = WeightType::from_ggml(code).ok_or_else(|| GgufError::UnsupportedType {
        name: name.clone(),
        type_name: ggml_type_name(code),
        code,
    })?;
    let overflow = |name: &String, dims: &Vec<u64>| GgufError::DimsOverflow {
        name: name.clone(),
        dims: dims.clone(),
    };
    let mut udims = Vec::with_capacity(dims.len());
    for &d in &dims {
        udims.push(usize::try_from(d).map_err(|_| overflow(&name, &dims))?);
    }
    let n_elements = udims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow(&name, &dims))?;
    if !udims[0].is_multiple_of(ty.block_len()) {
        return Err(GgufError::RaggedRow {
            name,
            ty,
            row_len: dims[0],
            block_len: ty.block_len(),
        });
    }
    // Not `WeightType::row_bytes`: its product is unchecked, and a hostile row length
    // overflows it.
    let row_bytes = (udims[0] / ty.block_len())
        .checked_mul(ty.block_bytes())
        .ok_or_else(|| overflow(&name, &dims))?;
    let n_rows = n_elements.checked_div(udims[0]).unwrap_or(0);
    let bytes = row_bytes
        .checked_mul(n_rows)
        .ok_or_else(|| overflow(&name, &dims))?;
    if !offset.is_multiple_of(alignment as u64) {
        return Err(GgufError::Misaligned {
            name,
            offset,
            alignment,
        });
    }
    let start = usize::try_from(offset)
        .ok()
        .and_then(|o| o.checked_add(data_start));
    match start.and_then(|s| s.checked_add(bytes).map(|e| (s, e))) {
        Some((start, end)) if end <= len => Ok(TensorInfo {
            name,
            ty,
            dims: udims,
            start,
            len: bytes,
        }),
        _ => Err(GgufError::DataPastEnd {
            name,
            offset,
            bytes: bytes as u64,
            data_start: data_start as u64,
            len,
        }),
    }
}

fn wrong_type(key: &str, expected: &'static str, v: &MetaValue) -> GgufError {
    GgufError::WrongType {
        key: key.into(),
        expected,
        found: format!("a {}", v.type_name()),
    }
}

fn integer<T: TryFrom<i128>>(key: &str, v: &MetaValue, expected: &'static str) -> Result<T> {
    match v.as_integer() {
        Some(i) => T::try_from(i).map_err(|_| GgufError::WrongType {
            key: key.into(),
            expected,
            found: format!("a {} of value {i}, out of range", v.type_name()),
        }),
        None => Err(wrong_type(key, expected, v)),
    }
}

fn float(key: &str, v: &MetaValue) -> Result<f32> {
    match *v {
        MetaValue::F32(f) => Ok(f),
        MetaValue::F64(f) => Ok(f as f32),
        _ => Err(wrong_type(key, "f32", v)),
    }
}

fn boolean(key: &str, v: &MetaValue) -> Result<bool> {
    match *v {
        MetaValue::Bool(b) => Ok(b),
        _ => Err(wrong_type(key, "bool", v)),
    }
}

fn string<'a>(key: &str, v: &'a MetaValue) -> Result<&'a str> {
    match v {
        MetaValue::String(s) => Ok(s),
        _ => Err(wrong_type(key, "string", v)),
    }
}

/// A cursor over the file's bytes whose every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// `n` bytes; `what` names the field for the error and is built only on error.
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        match usize::try_from(n) {
            Ok(k) if k <= self.remaining() => {
                let s = &self.buf[self.pos..self.pos + k];
                self.pos += k;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                what: what(),
                offset: self.pos,
                needed: n,
                len: self.buf.len(),
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N]> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N as u64, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Fails unless `count` items of at least `min_size` bytes each fit in what is left, so
    /// that nothing sized by a hostile count is allocated.
    fn check_count(&self, count: u64, min_size: u64, what: impl FnOnce() -> String) -> Result<()> {
        if count.saturating_mul(min_size) > self.remaining() as u64 {
            return Err(GgufError::CountTooLarge {
                what: what(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: impl Fn() -> String) -> Result<String> {
        let n = self.u64(|| format!("length of {}", what()))?;
        let bytes = self.take(n, &what)?;
        let s = std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 { what: what() })?;
        let mut out = String::new();
        out.try_reserve_exact(s.len())
            .map_err(|_| GgufError::Alloc { what: what() })?;
        out.push_str(s);
        Ok(out)
    }

    fn value(&mut self, key: &str, code: u32, depth: usize) -> Result<MetaValue> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match code {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => MetaValue::Bool(self.boolean(key)?),
            8 => MetaValue::String(self.string(what)?),
            9 => MetaValue::Array(self.meta_array(key, depth)?),
            10 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            code => {
                return Err(GgufError::BadValueType {
                    key: key.into(),
                    code,
                })
            }
        })
    }

    fn boolean(&mut self, key: &str) -> Result<bool> {
        match self.array::<1>(|| format!("value of metadata key {key:?}"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            byte => Err(GgufError::BadBool {
                key: key.into(),
                byte,
            }),
        }
    }

    fn meta_array(&mut self, key: &str, depth: usize) -> Result<MetaArray> {
        if depth >= MAX_ARRAY_NESTING {
            return Err(GgufError::NestingTooDeep { key: key.into() });
        }
        let code = self.u32(|| format!("element type of metadata key {key:?}"))?;
        let count = self.u64(|| format!("element count of metadata key {key:?}"))?;
        // The smallest encoding of one element: strings carry an 8-byte length, arrays a type
        // and a count.
        let min_size = match code {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            code => {
                return Err(GgufError::BadValueType {
                    key: key.into(),
                    code,
                })
            }
        };
        self.check_count(count, min_size, || format!("array of metadata key {key:?}"))?;
        // Bounded by the file's size through check_count.
        let n = count as usize;
        let what = || format!("array of metadata key {key:?}");

        /// Reads `n` fixed-size little-endian numbers into a vector reserved up front.
        macro_rules! numbers {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(n as u64 * size_of::<$t>() as u64, what)?;
                let mut v = Vec::new();
                v.try_reserve_exact(n)
                    .map_err(|_| GgufError::Alloc { what: what() })?;
                v.extend(
                    bytes
                        .chunks_exact(size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk of the size"))),
                );
                MetaArray::$variant(v)
            }};
        }
        /// Reads `n` elements one at a time into a vector reserved up front.
        macro_rules! each {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::new();
                v.try_reserve_exact(n)
                    .map_err(|_| GgufError::Alloc { what: what() })?;
                for _ in 0..n {
                    v.push($read(&mut *self)?);
                }
                MetaArray::$variant(v)
            }};
        }
        Ok(match code {
            0 => {
                let bytes = self.take(n as u64, what)?;
                let mut v = Vec::new();
                v.try_reserve_exact(n)
                    .map_err(|_| GgufError::Alloc { what: what() })?;
                v.extend_from_slice(bytes);
                MetaArray::U8(v)
            }
            1 => numbers!(I8, i8),
            2 => numbers!(U16, u16),
            3 => numbers!(I16, i16),
            4 => numbers!(U32, u32),
            5 => numbers!(I32, i32),
            6 => numbers!(F32, f32),
            7 => each!(Bool, |r: &mut Self| r.boolean(key)),
            8 => each!(String, |r: &mut Self| r
                .string(|| format!("string in the array of metadata key {key:?}"))),
            9 => each!(Array, |r: &mut Self| r.meta_array(key, depth + 1)),
            10 => numbers!(U64, u64),
            11 => numbers!(I64, i64),
            _ => numbers!(F64, f64),
        })
    }
}

/// The architecture hyperparameters of a Llama-architecture GGUF model, read from its metadata
/// (`llama.*` keys) and checked for consistency.
///
/// **RoPE mode.** llama.cpp's converter permutes the rows of `attn_q.weight` and `attn_k.weight`
/// (per head) so that rotary position embedding applies to *adjacent pairs* `(x[2i], x[2i+1])`
/// with frequency `rope_freq_base^(-2i/rope_dim)` — ggml's "normal" rope mode. A model reading
/// these weights must apply that mode, not the "rotate-half" pairing `(x[i], x[i + d/2])` of the
/// Hugging Face checkpoints (transformers un-permutes the weights on load and rotates halves; the
/// two give the same attention scores).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks (`llama.block_count`).
    pub n_layers: usize,
    /// Model width (`llama.embedding_length`).
    pub hidden: usize,
    /// Feed-forward width (`llama.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`llama.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`, default `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head size: `hidden / n_heads` (`llama.attention.key_length` when present).
    pub head_size: usize,
    /// Dimensions rotated by RoPE (`llama.rope.dimension_count`, default `head_size`).
    pub rope_dim: usize,
    /// RoPE base frequency (`llama.rope.freq_base`, default 10000 as in llama.cpp).
    pub rope_freq_base: f32,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Vocabulary size: the rows of `token_embd.weight` (`llama.vocab_size` must agree).
    pub vocab_size: usize,
    /// Training context length (`llama.context_length`).
    pub context_length: usize,
    /// Whether the LM head is `token_embd.weight` (no `output.weight` tensor).
    pub tied_embeddings: bool,
}

impl LlamaConfig {
    /// Reads the configuration. Only `general.architecture == "llama"` is accepted: the
    /// architectures llama.cpp files under other names (qwen2's biases, granite's multipliers,
    /// mistral3's and llama4's extra fields, …) differ in ways that would silently run wrong.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::UnsupportedArchitecture(arch.into()));
        }
        let usize_of = |key: &str| -> Result<usize> {
            let v = g.get_u64(key)?;
            usize::try_from(v).map_err(|_| GgufError::BadValue {
                key: key.into(),
                reason: format!("{v} does not fit in memory"),
            })
        };
        let positive = |key: &str, v: usize| -> Result<usize> {
            if v == 0 {
                Err(GgufError::BadValue {
                    key: key.into(),
                    reason: "is 0".into(),
                })
            } else {
                Ok(v)
            }
        };
        let n_layers = positive("llama.block_count", usize_of("llama.block_count")?)?;
        let hidden = positive(
            "llama.embedding_length",
            usize_of("llama.embedding_length")?,
        )?;
        let ffn = positive(
            "llama.feed_forward_length",
            usize_of("llama.feed_forward_length")?,
        )?;
        let n_heads = positive(
            "llama.attention.head_count",
            usize_of("llama.attention.head_count")?,
        )?;
        let kv_key = "llama.attention.head_count_kv";
        let n_kv_heads = match g.get(kv_key) {
            Some(_) => positive(kv_key, usize_of(kv_key)?)?,
            None => n_heads,
        };
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(GgufError::BadValue {
                key: kv_key.into(),
                reason: format!("{n_kv_heads} does not divide the {n_heads} query heads"),
            });
        }
        let head_size = match g.get("llama.attention.key_length") {
            Some(_) => positive(
                "llama.attention.key_length",
                usize_of("llama.attention.key_length")?,
            )?,
            None if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            None => {
                return Err(GgufError::BadValue {
                    key: "llama.attention.head_count".into(),
                    reason: format!("{n_heads} does not divide the width {hidden}"),
                })
            }
        };
        let rope_key = "llama.rope.dimension_count";
        let rope_dim = match g.get(rope_key) {
            Some(_) => usize_of(rope_key)?,
            None => head_size,
        };
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > head_size {
            return Err(GgufError::BadValue {
                key: rope_key.into(),
                reason: format!(
                    "{rope_dim} is not an even size of at most the head size {head_size}"
                ),
            });
        }
        for key in ["llama.rope.scaling.type", "llama.rope.scaling.factor"] {
            if let Some(v) = g.get(key) {
                let none = matches!(v, MetaValue::String(s) if s == "none")
                    || matches!(v, MetaValue::F32(f) if *f == 0.0 || *f == 1.0);
                if !none {
                    return Err(GgufError::BadValue {
                        key: key.into(),
                        reason: format!("RoPE scaling {v:?} is not supported"),
                    });
                }
            }
        }
        let rope_freq_base = g.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0);
        // RoPE's wavelengths must grow from 2π: a base of at most 1 (or NaN) turns every
        // rotation into noise or NaN, and the model then runs and prints garbage.
        if !(rope_freq_base > 1.0 && rope_freq_base.is_finite()) {
            return Err(GgufError::BadValue {
                key: "llama.rope.freq_base".into(),
                reason: format!("{rope_freq_base} is not a finite base above 1"),
            });
        }
        let rms_eps = g.get_f32("llama.attention.layer_norm_rms_epsilon")?;
        // Models use 1e-6 or 1e-5; 0 divides by zero on a zero row, a negative one or NaN
        // turns rows to NaN, and 1 or more drowns the activations.
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(GgufError::BadValue {
                key: "llama.attention.layer_norm_rms_epsilon".into(),
                reason: format!("{rms_eps} is not in (0, 1)"),
            });
        }
        let context_length = positive("llama.context_length", usize_of("llama.context_length")?)?;
        // A layer's tensors past `block_count` mean the count is wrong: running the first
        // `block_count` layers alone prints garbage.
        let extra = format!("blk.{n_layers}.");
        if let Some(t) = g.tensors().find(|t| t.info.name().starts_with(&extra)) {
            return Err(GgufError::BadValue {
                key: "llama.block_count".into(),
                reason: format!(
                    "{n_layers}, but the file holds {} of a later layer",
                    t.info.name()
                ),
            });
        }

        let embd = g.tensor("token_embd.weight")?.info;
        if embd.dims().len() != 2 || embd.dims()[0] != hidden {
            return Err(GgufError::BadTensor {
                name: embd.name().into(),
                reason: format!("dimensions {:?}, expected [{hidden}, vocab]", embd.dims()),
            });
        }
        let vocab_size = embd.dims()[1];
        if let Some(v) = g.opt_u32("llama.vocab_size")? {
            if v as usize != vocab_size {
                return Err(GgufError::BadValue {
                    key: "llama.vocab_size".into(),
                    reason: format!("{v} disagrees with token_embd.weight's {vocab_size} rows"),
                });
            }
        }
        Ok(LlamaConfig {
            n_layers,
            hidden,
            ffn,
            n_heads,
            n_kv_heads,
            head_size,
            rope_dim,
            rope_freq_base,
            rms_eps,
            vocab_size,
            context_length,
            tied_embeddings: !g.has_tensor("output.weight"),
        })
    }
}
