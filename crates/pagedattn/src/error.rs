//! The one error type of the library.

use std::fmt;

/// Everything that can go wrong in pagedattn. Each message is one line that names the field,
/// the value and what was expected (specs and configs described in words, never dumped as
/// structs), so that a caller can print it as it is. `Debug` prints the same line, so that
/// `fn main() -> Result<(), pagedattn::Error>` reports an error readably; match on the
/// variants to tell errors apart.
#[derive(Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// An argument, tensor or metadata field has a value the contract does not allow.
    #[error("{field} = {value}: expected {expected}")]
    Invalid {
        /// The field (or tensor) at fault, e.g. `metadata.seq_lens[2]`.
        field: String,
        /// The value it had.
        value: String,
        /// What the contract expects instead.
        expected: String,
    },
    /// The backend does not implement a feature the call asks for.
    #[error("backend `{backend}` does not support {feature}")]
    Unsupported {
        /// Name of the backend that refused.
        backend: String,
        /// The feature, in words, e.g. `head size 72`.
        feature: String,
    },
    /// A file (replay case or output) could not be parsed; the message says what is wrong.
    #[error("{0}")]
    Format(String),
    /// A tensor, cache or workspace is on another device than the operation needs.
    #[error("{what} is on {found}: expected {expected}")]
    DeviceMismatch {
        /// The argument at fault, e.g. `query` or `kv_cache`.
        what: String,
        /// The device it is on.
        found: String,
        /// The device the operation needs, and how to get there.
        expected: String,
    },
    /// The device's driver or run-time compiler failed (or no device is usable).
    #[error("{0}")]
    Driver(String),
    /// A CUDA driver call failed with a `CUresult` other than out of memory.
    #[error("{call} failed: {name} ({description})")]
    CudaDriver {
        /// The call and what it was for, e.g. `cuLaunchKernel(write_kv)`.
        call: String,
        /// The `CUresult` code, e.g. 700 for `CUDA_ERROR_ILLEGAL_ADDRESS`.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`.
        name: String,
        /// The driver's description of it.
        description: String,
    },
    /// A device allocation failed for lack of memory.
    #[error("out of memory on {device}: {bytes} bytes requested")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The size of the allocation that failed.
        bytes: usize,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's message.
        message: String,
    },
}

impl Error {
    /// Builds [`Error::Invalid`] from anything printable.
    pub fn invalid(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Error::Invalid {
            field: field.into(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// Builds [`Error::Unsupported`].
    pub fn unsupported(backend: impl Into<String>, feature: impl Into<String>) -> Self {
        Error::Unsupported {
            backend: backend.into(),
            feature: feature.into(),
        }
    }

    /// Builds [`Error::DeviceMismatch`].
    pub fn device_mismatch(
        what: impl Into<String>,
        found: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Error::DeviceMismatch {
            what: what.into(),
            found: found.to_string(),
            expected: expected.into(),
        }
    }
}

impl fmt::Debug for Error {
    /// The message, as `Display` writes it: what `main` prints of a returned error.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns [`Error::Invalid`] unless `ok` holds.
pub(crate) fn ensure(
    ok: bool,
    field: impl FnOnce() -> String,
    value: impl std::fmt::Display,
    expected: impl FnOnce() -> String,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(field(), value, expected()))
    }
}
