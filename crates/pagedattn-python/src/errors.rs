//! The library's errors as Python exceptions: `TypeError` for a wrong dtype or device,
//! `ValueError` for other bad values, `NotImplementedError` for a feature a backend lacks,
//! `MemoryError`, and `RuntimeError` for the driver and files. The message is the library's.

use pyo3::exceptions::{
    PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::PyErr;

/// The exception for `e`.
pub fn to_py(e: pagedattn::Error) -> PyErr {
    use pagedattn::Error;
    let message = e.to_string();
    match e {
        // A tensor's dtype (`query.dtype`, `key_cache dtype`), not the `kv_cache_dtype` setting.
        Error::Invalid { field, .. } if field.ends_with("dtype") && !field.ends_with("_dtype") => {
            PyTypeError::new_err(message)
        }
        Error::Invalid { .. } => PyValueError::new_err(message),
        Error::DeviceMismatch { .. } => PyTypeError::new_err(message),
        Error::Unsupported { .. } => PyNotImplementedError::new_err(message),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(message),
        Error::Format(_) | Error::Driver(_) | Error::CudaDriver { .. } | Error::Io { .. } => {
            PyRuntimeError::new_err(message)
        }
    }
}

/// `?` on the library's results inside functions returning `PyResult`.
pub trait OrPyErr<T> {
    /// The value, or the exception for the error.
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> OrPyErr<T> for pagedattn::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}

/// A `ValueError` in the library's words: `field = value: expected expected`.
pub fn value_error(field: &str, value: impl std::fmt::Display, expected: &str) -> PyErr {
    PyValueError::new_err(format!("{field} = {value}: expected {expected}"))
}

/// A `TypeError` in the same words.
pub fn type_error(field: &str, value: impl std::fmt::Display, expected: &str) -> PyErr {
    PyTypeError::new_err(format!("{field} = {value}: expected {expected}"))
}
