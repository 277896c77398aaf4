//! Finding libnvrtc where the CUDA toolkit or Python's NVIDIA wheels put it (`nvidia/cu13/lib`
//! under a site-packages directory: what `pip install torch` brings), so that a machine whose
//! only CUDA libraries came with PyTorch needs no `LD_LIBRARY_PATH`. The library is loaded by its
//! full path before cudarc asks for it by name: the dynamic loader then answers cudarc's
//! request with the library already loaded under that name (its SONAME).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The name cudarc (built for CUDA 13) asks for, and the library's SONAME.
const SONAME: &str = "libnvrtc.so.13";

/// Where the NVIDIA wheels put it, under a site-packages directory.
const WHEEL_DIRS: [&str; 2] = ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"];

/// Directories the embedding program adds (the Python module adds `sys.path`).
static EXTRA_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Adds directories to search for Python's NVIDIA wheels (site-packages directories), before
/// the first use of NVRTC in the process.
pub fn add_nvrtc_search_dirs(dirs: impl IntoIterator<Item = PathBuf>) {
    let mut extra = EXTRA_DIRS.lock().unwrap_or_else(|e| e.into_inner());
    extra.extend(dirs);
}

/// Loads libnvrtc from a CUDA toolkit (`CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`) or a
/// Python wheel if the dynamic loader does not find it by name (if neither has it, cudarc's
/// own lookup reports it missing).
pub(crate) fn preload() {
    if open(SONAME) {
        return;
    }
    // The first that loads; the rest are not tried.
    let _loaded = candidates(&WHEEL_DIRS, SONAME)
        .any(|path| path.is_file() && path.to_str().is_some_and(open));
}

/// Where a CUDA library `soname` is found outside the dynamic loader's search path: the
/// first file of that name in a CUDA toolkit's `lib64` (`CUDA_HOME`, `CUDA_PATH`,
/// `/usr/local/cuda`) or in one of `wheel_dirs` under a site-packages directory (NCCL's wheel:
/// `nvidia/nccl/lib`).
pub fn find_cuda_library(wheel_dirs: &[&str], soname: &str) -> Option<PathBuf> {
    candidates(wheel_dirs, soname).find(|path| path.is_file())
}

/// The places [`find_cuda_library`] looks, in order.
fn candidates<'d>(wheel_dirs: &'d [&str], soname: &'d str) -> impl Iterator<Item = PathBuf> + 'd {
    let toolkits = [std::env::var_os("CUDA_HOME"), std::env::var_os("CUDA_PATH")]
        .into_iter()
        .flatten()
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")])
        .map(move |home| home.join("lib64").join(soname));
    let wheels = site_packages().into_iter().flat_map(move |site| {
        wheel_dirs
            .iter()
            .map(move |dir| site.join(dir).join(soname))
    });
    toolkits.chain(wheels)
}

/// Whether `dlopen` loads `name` (a name to search for, or a path). The handle is kept: the
/// library stays loaded for the process, as cudarc keeps it.
fn open(name: &str) -> bool {
    let Ok(name) = CString::new(name) else {
        return false;
    };
    // SAFETY: loads a library by a valid C string; a failure is a null handle. libnvrtc's
    // initializers do nothing but set up the library.
    !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) }.is_null()
}

/// Site-packages directories to look in: those added by the embedding program, the active
/// virtual or conda environment's, those of the `python3` on `PATH`, the user's and the
/// system's.
fn site_packages() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = EXTRA_DIRS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let var = |name| std::env::var_os(name).map(PathBuf::from);
    let mut prefixes: Vec<PathBuf> = [var("VIRTUAL_ENV"), var("CONDA_PREFIX")]
        .into_iter()
        .flatten()
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        let python = std::env::split_paths(&path).find(|d| d.join("python3").is_file());
        prefixes.extend(python.and_then(|bin| bin.parent().map(Path::to_path_buf)));
    }
    if let Some(home) = var("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("python3") {
                dirs.extend(["site-packages", "dist-packages"].map(|d| entry.path().join(d)));
            }
        }
    }
    dirs
}
