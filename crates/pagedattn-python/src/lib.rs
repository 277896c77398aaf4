//! pagedattn for Python: the native module `pagedattn._native` (PyO3). Tensors cross by
//! DLPack without a copy; on CUDA every call is ordered on the caller's stream. The API is
//! described in `python/pagedattn/_native.pyi`.

mod attention;
mod backend;
mod dlpack;
mod errors;
mod metadata;
mod stream;
mod tensors;

use pyo3::prelude::*;

/// The backend names this build knows.
#[pyfunction]
fn backends() -> Vec<&'static str> {
    let mut names = vec!["reference", "cpu"];
    if cfg!(feature = "cuda") {
        names.push("cuda");
    }
    names
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Python's NVIDIA wheels (torch's libnvrtc) are found under sys.path, without a
    // library path set.
    #[cfg(feature = "cuda")]
    {
        let path: Vec<std::path::PathBuf> = m.py().import("sys")?.getattr("path")?.extract()?;
        pagedattn::cuda::add_nvrtc_search_dirs(path);
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_class::<backend::PyBackend>()?;
    m.add_class::<metadata::PyMetadata>()?;
    m.add_class::<attention::PyAttention>()?;
    m.add_class::<attention::PyPlan>()?;
    Ok(())
}
