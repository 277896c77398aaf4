//! Run-time compilation of the kernel sources with NVRTC, to CUBIN for one GPU architecture,
//! cached in the process and on disk.
//!
//! A disk entry is named by a hash of everything the image depends on (source, options,
//! architecture, NVRTC version) and carries a header with the payload's length and checksum:
//! an entry that does not match is compiled again and overwritten, never trusted. Disk errors
//! only cost a compilation.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::nvrtc::result::{self as nvrtc, NvrtcError};
use cudarc::nvrtc::sys;

use super::kernels::{fixed_sources, KernelSource};
use super::variant::Variant;
use crate::error::{Error, Result};

/// Environment variable naming the directory of compiled kernels (see [`DiskCache::from_env`]).
pub const CACHE_DIR_ENV: &str = "PAGEDATTN_CACHE_DIR";

/// The architecture kernels are compiled for on a GPU of compute capability `major.minor`:
/// `sm_{major}{minor}`, with the `a` suffix on 9.0 (`sm_90a`) so that Hopper kernels may use
/// its architecture-specific instructions (wgmma, the tensor memory accelerator).
pub fn arch_for(major: u32, minor: u32) -> String {
    let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
    format!("sm_{major}{minor}{suffix}")
}

/// The NVRTC options of every kernel besides the architecture, fixed here. IEEE division and
/// denormals are asked for explicitly: the cache write must round exactly as the host does.
fn options(arch: &str) -> Vec<String> {
    let mut options = vec![
        "-std=c++17".to_string(),
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "-lineinfo".to_string(),
        // The assembler's report of each kernel's registers, stack and spills (an
        // informational log, parsed by `resources`; it changes no code).
        "--ptxas-options=-v".to_string(),
    ];
    // The kernels include no CUDA header (conversions are bit operations and PTX); a CUDA
    // include directory, when there is one, costs nothing.
    if let Some(dir) = cuda_include_dir() {
        options.push(format!("--include-path={}", dir.display()));
    }
    options
}

/// `$CUDA_HOME/include` or `/usr/local/cuda/include`, if it exists.
fn cuda_include_dir() -> Option<PathBuf> {
    let home = std::env::var_os("CUDA_HOME").filter(|h| !h.is_empty());
    [
        home.map(|h| Path::new(&h).join("include")),
        Some("/usr/local/cuda/include".into()),
    ]
    .into_iter()
    .flatten()
    .find(|dir| dir.is_dir())
}

/// The NVRTC version (major, minor), or why libnvrtc cannot be used.
pub fn nvrtc_version() -> Result<(u32, u32)> {
    static VERSION: OnceLock<Result<(u32, u32)>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            super::nvrtc_path::preload();
            // SAFETY: only tries to open the library under the names cudarc loads it by;
            // cudarc panics on its first call into a library it cannot find.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::Driver(
                    "libnvrtc not found: the cuda backend compiles its kernels with NVRTC at run \
                     time; install the CUDA 13 NVRTC (`pip install torch` brings it, or `pip install \
                     nvidia-cuda-nvrtc`; it is found in Python's site-packages) or put the \
                     directory of libnvrtc.so.13 on LD_LIBRARY_PATH"
                        .into(),
                ));
            }
            let (mut major, mut minor) = (0, 0);
            // SAFETY: writes two ints through valid pointers.
            unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
                .result()
                .map_err(|e| nvrtc_error("nvrtcVersion", e))?;
            Ok((major.max(0) as u32, minor.max(0) as u32))
        })
        .clone()
}

/// How far [`compile_check`] compiles each program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckDepth {
    /// Every program to machine code (CUBIN), exactly as a GPU compiles it at its first use.
    Full,
    /// Every program through NVRTC's front end to PTX for the architecture (`compute_XY`:
    /// every C++ error and warning of every variant), and to machine code the fixed kernels
    /// and, for each dtype, storage and head size, the variant with every score modifier on
    /// (window mask, ALiBi, soft cap: the most code and registers, so the assembler's limits
    /// and the inline PTX are checked where they bind): for CI, about a fifth of the time
    /// (the PTX at NVVM's fastest optimization, which checks the same C++).
    Representative,
    /// [`Representative`](Self::Representative) spread over `count` slots (architectures,
    /// or architectures times runs: a sweep split over several runs): this one (`index` of
    /// them) compiles to PTX only the variants whose number is `index` modulo `count`, and
    /// to machine code only the every-modifier variants whose number among them is `index`
    /// modulo `count`, so that one call per slot puts every variant's C++ through the front
    /// end once and each heaviest variant through one architecture's assembler, in
    /// `1 / count` of the time (the fixed kernels to machine code in every call). Giving
    /// an architecture another slot moves each variant to another one. What CI runs (a
    /// part per commit, the architectures' order turning too).
    Spread {
        /// This call's slot.
        index: usize,
        /// How many slots share the sweep.
        count: usize,
    },
}

/// Compiles every kernel source for `arch` (e.g. `sm_80`, `sm_90a`) with NVRTC alone, no
/// GPU and no cache, to `depth`, and returns each kernel's name with, where it was compiled to
/// machine code, what the assembler reports of it: a check for CI (any warning fails it;
/// [`KernelResources::spills`] tells a kernel that must not ship). Each program is compiled as
/// a GPU compiles it at its first use (an attention variant's kernels each their own), in
/// parallel, one thread per CPU. `only`: just the programs whose name contains it (e.g.
/// `bf16_bf16_d128_causal` for a few attention variants), a quick check while editing a
/// kernel.
pub fn compile_check(
    arch: &str,
    only: Option<&str>,
    depth: CheckDepth,
) -> Result<Vec<(String, Option<KernelResources>)>> {
    check_arch(arch)?;
    let fixed = fixed_sources().iter().map(|s| (s.clone(), Output::Cubin));
    // Each variant's number among all, and among the every-modifier ones (for `Spread`).
    let mut heaviest_seen = 0;
    let numbered = Variant::all().enumerate().map(|(i, v)| {
        let heaviest = v.has_every_modifier().then(|| {
            heaviest_seen += 1;
            heaviest_seen - 1
        });
        (i, heaviest, v)
    });
    let variants = numbered.flat_map(|(i, heaviest, v)| {
        let output = match (depth, heaviest) {
            (CheckDepth::Full, _) => Some(Output::Cubin),
            (CheckDepth::Representative, Some(_)) => Some(Output::Cubin),
            (CheckDepth::Representative, None) => Some(Output::Ptx),
            (CheckDepth::Spread { index, count }, heaviest) => {
                let mine = |number: usize| number % count.max(1) == index;
                match heaviest {
                    Some(k) => mine(k).then_some(Output::Cubin),
                    None => mine(i).then_some(Output::Ptx),
                }
            }
        };
        output
            .into_iter()
            .flat_map(move |output| v.sources(arch).into_iter().map(move |s| (s, output)))
    });
    let mut sources: Vec<(KernelSource, Output)> = fixed.chain(variants).collect();
    sources.retain(|(s, _)| wanted(&s.name, only));
    let compiled = in_parallel(&sources, |(source, output)| {
        compile_to(source, arch, *output)
    })?;
    Ok(sources
        .iter()
        .zip(compiled)
        .flat_map(|((source, _), compiled)| {
            source.kernels.iter().map(move |name| {
                let found = compiled.resources.iter().find(|r| &r.kernel == name);
                (name.clone(), found.cloned())
            })
        })
        .collect())
}

/// Compiles a caller's program (what [`Cuda::load_kernels`](super::Cuda::load_kernels)
/// compiles at its first use) for `arch` with NVRTC alone, no GPU and no cache, to machine
/// code: a check for CI. Any warning fails.
pub fn compile_program_check(name: &str, code: &str, arch: &str) -> Result<()> {
    let source = KernelSource {
        name: name.to_string(),
        code: code.to_string(),
        kernels: Vec::new(),
    };
    compile_to(&source, arch, Output::Cubin).map(drop)
}

/// What the assembler reports of one kernel compiled to machine code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's (`extern "C"`) name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame (local memory) per thread.
    pub stack_bytes: u32,
    /// Bytes of registers spilled to local memory (stores).
    pub spill_stores: u32,
    /// Bytes of spilled registers loaded back from local memory.
    pub spill_loads: u32,
}

impl KernelResources {
    /// Whether the kernel spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// The kernels known to spill registers, one `ARCH KERNEL` per line (`#` starts a comment):
/// each one a debt of the kernel work, listed so that the check can hold every other kernel
/// to no spills while it is paid off.
const KNOWN_SPILLS: &str = include_str!("../../kernels/attention/known-spills.txt");

/// Checks what [`compile_check`] returned for `arch`: no kernel compiled to machine code
/// spills registers unless `known-spills.txt` lists it. Returns the listed kernels that were
/// compiled to machine code and no longer spill, whose lines should go (not an error: the
/// assembler of another NVRTC version than the one the list was made with, CI's, may
/// allocate registers differently).
pub fn check_spills(
    arch: &str,
    kernels: &[(String, Option<KernelResources>)],
) -> Result<Vec<String>> {
    let known: Vec<&str> = KNOWN_SPILLS
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter_map(|l| l.strip_prefix(arch)?.strip_prefix(' '))
        .collect();
    let mut new = Vec::new();
    let mut paid = Vec::new();
    for (name, resources) in kernels {
        let Some(r) = resources else { continue };
        match (r.spills(), known.contains(&name.as_str())) {
            (true, false) => new.push(format!("{name} ({} bytes)", r.spill_stores)),
            (false, true) => paid.push(name.clone()),
            _ => {}
        }
    }
    if new.is_empty() {
        return Ok(paid);
    }
    let nvrtc = nvrtc_version().map_or(String::new(), |(a, b)| format!(" with NVRTC {a}.{b}"));
    Err(Error::Driver(format!(
        "{arch}: {} kernels spill registers to local memory{nvrtc} (kernels/attention/\
         known-spills.txt lists the known ones, made with CI's NVRTC): {}",
        new.len(),
        new.join(", ")
    )))
}

/// The kernels' resources in an NVRTC log with the assembler's `-v` report: per kernel, a
/// `Function properties for NAME` line, then its stack and spills, then
/// `Used N registers`.
fn resources(log: &str) -> Vec<KernelResources> {
    // The number before `word` in `line`, e.g. 24 in "24 bytes spill stores" for "bytes spill
    // stores".
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let end = line.find(word)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    let mut found: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            found.push(KernelResources {
                kernel: name.trim().to_string(),
                registers: 0,
                stack_bytes: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(last) = found.last_mut() {
            if let Some(n) = number_before(line, "bytes stack frame") {
                last.stack_bytes = n;
                last.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                last.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if let Some(n) = number_before(line, "registers") {
                last.registers = n;
            }
        }
    }
    found
}

/// Whether a line of NVRTC's log is the assembler's report (`ptxas info ...` and its
/// continuation lines `ptxas    . ...`), not a warning. The assembler's notes of a "Potential
/// Performance Loss" (e.g. wgmma serialized) come as `ptxas info` too: they count as warnings.
fn is_report(line: &str) -> bool {
    !line.contains("Performance Loss")
        && line
            .strip_prefix("ptxas")
            .is_some_and(|rest| rest.starts_with(" info") || rest.trim_start().starts_with('.'))
}

/// What NVRTC is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// Machine code for the real architecture (`sm_XY`).
    Cubin,
    /// PTX for its virtual architecture (`compute_XY`): the front end's check of the C++,
    /// with NVVM's optimizer at its fastest where NVRTC has the option (12.8 on), since the
    /// PTX itself is thrown away and the optimizer is nine tenths of a program's time.
    Ptx,
}

/// The fixed sources, then every attention variant's programs, for `arch`.
fn every_source(arch: &str) -> Vec<KernelSource> {
    fixed_sources()
        .iter()
        .cloned()
        .chain(Variant::all().flat_map(|v| v.sources(arch)))
        .collect()
}

/// Whether a program named `name` is among those `only` asks for (all without it).
fn wanted(name: &str, only: Option<&str>) -> bool {
    only.is_none_or(|o| name.contains(o))
}

/// `f` of every source, in order, run on one thread per CPU. Once one fails no further source
/// is started, and the first error (in source order) among those that ran is returned.
fn in_parallel<S: Sync, T: Send>(
    sources: &[S],
    f: impl Fn(&S) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(sources.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Vec<Mutex<Option<Result<T>>>> = sources.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(source) = sources.get(i) else {
                        break;
                    };
                    let result = f(source);
                    failed.fetch_or(result.is_err(), Ordering::Relaxed);
                    *results[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
                }
            });
        }
    });
    // A source is left unstarted only after another failed, so without an error every
    // result is here, in order.
    let mut out = Vec::with_capacity(sources.len());
    let mut first_error = None;
    for result in results {
        match result.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some(Ok(value)) => out.push(value),
            Some(Err(e)) => {
                first_error.get_or_insert(e);
            }
            None => {}
        }
    }
    first_error.map_or(Ok(out), Err)
}

/// The CUBIN of `source` for `arch`: from the process's map, else the disk cache (when there
/// is a cache directory), else compiled.
pub(crate) fn image(source: &KernelSource, arch: &str) -> Result<Arc<[u8]>> {
    /// One image's place in the map: locked while it is compiled, so that two threads never
    /// compile the same image, while other images compile beside it. Empty until it is had
    /// (a failed compilation leaves it empty: the next call tries again).
    type Slot = Arc<Mutex<Option<Arc<[u8]>>>>;
    static IMAGES: OnceLock<Mutex<HashMap<u64, Slot>>> = OnceLock::new();
    let key = key(source, arch)?;
    // Nothing panics while a lock is held, and the map stays valid if something did.
    let slot = IMAGES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(key)
        .or_default()
        .clone();
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(image) = &*slot {
        return Ok(image.clone());
    }
    let image: Arc<[u8]> = match DiskCache::from_env() {
        Some(disk) => disk.fetch(source, arch, key)?.0.into(),
        None => compile(source, arch)?.into(),
    };
    *slot = Some(image.clone());
    Ok(image)
}

/// [`image`] of each of `sources`, side by side (one thread per CPU): a first call waits for
/// the slowest compilation rather than their sum.
pub(crate) fn images(sources: &[KernelSource], arch: &str) -> Result<Vec<Arc<[u8]>>> {
    in_parallel(sources, |source| image(source, arch))
}

/// The hash naming `source`'s image for `arch` with this NVRTC: FNV-1a over every input, each
/// prefixed by its length so that no two different inputs run together.
fn key(source: &KernelSource, arch: &str) -> Result<u64> {
    let (major, minor) = nvrtc_version()?;
    let options = options(arch).join("\0");
    let nvrtc = format!("{major}.{minor}");
    let mut hash = Fnv::new();
    for part in [&source.name, &source.code, &options, arch, &nvrtc] {
        hash.write(&(part.len() as u64).to_le_bytes());
        hash.write(part.as_bytes());
    }
    Ok(hash.finish())
}

/// Where a kernel image came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageOrigin {
    /// A valid entry of the disk cache.
    Disk,
    /// NVRTC (the entry was missing or invalid, and has been written).
    Compiled,
}

/// One kernel source's image, as [`DiskCache::load_all`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedImage {
    /// The kernel source (file name without `.cu`, or an attention variant's name).
    pub source: String,
    /// Where the image came from.
    pub origin: ImageOrigin,
    /// Its size in bytes.
    pub bytes: usize,
    /// Its FNV-1a 64 checksum.
    pub checksum: u64,
}

/// The directory of compiled kernel images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCache {
    dir: PathBuf,
}

/// Identifies a cache entry and the version of its header.
const MAGIC: &[u8; 8] = b"PAGECUB1";
/// Magic, key, payload length, payload checksum.
const HEADER: usize = 32;

impl DiskCache {
    /// The directory the GPUs use: `$PAGEDATTN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/pagedattn/kernels`, else `$HOME/.cache/pagedattn/kernels`; `None`
    /// when none is set (kernels are then compiled in every process).
    pub fn from_env() -> Option<Self> {
        cache_dir(|name| std::env::var_os(name)).map(Self::at)
    }

    /// A cache in `dir` (created when an entry is first written).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        DiskCache { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The image of every fixed kernel source for `arch` (the ones a GPU loads at its first
    /// use: the cache write, the block copy, the split-K merge), each read from this cache if
    /// it holds a valid entry, else compiled and stored. The process's in-memory map is
    /// neither read nor filled: this is what a process's first use of a GPU does, for tools
    /// and tests that watch the cache.
    pub fn load_all(&self, arch: &str) -> Result<Vec<CachedImage>> {
        fixed_sources()
            .iter()
            .map(|source| self.cached(source, arch))
            .collect()
    }

    /// [`load_all`](Self::load_all) for every kernel source, every attention variant
    /// included (or those whose program name contains `only`), in parallel (one thread per
    /// CPU): fills the cache ahead, so that no call waits for NVRTC (`pagedattn
    /// compile-kernels --cache`).
    pub fn fill(&self, arch: &str, only: Option<&str>) -> Result<Vec<CachedImage>> {
        check_arch(arch)?;
        let mut sources = every_source(arch);
        sources.retain(|s| wanted(&s.name, only));
        in_parallel(&sources, |source| self.cached(source, arch))
    }

    /// `source`'s image for `arch` from this cache, or compiled and stored.
    fn cached(&self, source: &KernelSource, arch: &str) -> Result<CachedImage> {
        let (image, origin) = self.fetch(source, arch, key(source, arch)?)?;
        Ok(CachedImage {
            source: source.name.clone(),
            origin,
            bytes: image.len(),
            checksum: fnv(&image),
        })
    }

    /// The entry `key` of `source` if valid, else a fresh compilation (written back; a write
    /// that fails only costs the next process a compilation).
    fn fetch(&self, source: &KernelSource, arch: &str, key: u64) -> Result<(Vec<u8>, ImageOrigin)> {
        let path = self
            .dir
            .join(format!("{}-{arch}-{key:016x}.cubin", source.name));
        if let Some(image) = read_entry(&path, key) {
            return Ok((image, ImageOrigin::Disk));
        }
        let image = compile(source, arch)?;
        let _ = write_entry(&self.dir, &path, key, &image);
        Ok((image, ImageOrigin::Compiled))
    }
}

/// The cache directory from the environment `var`.
fn cache_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set(CACHE_DIR_ENV)
        .or_else(|| {
            set("XDG_CACHE_HOME")
                .filter(|p| p.is_absolute())
                .map(|p| p.join("pagedattn/kernels"))
        })
        .or_else(|| set("HOME").map(|p| p.join(".cache/pagedattn/kernels")))
}

/// The payload of the entry at `path` if its header matches `key`, its length and checksum.
fn read_entry(path: &Path, key: u64) -> Option<Vec<u8>> {
    let mut entry = std::fs::read(path).ok()?;
    let word = |i: usize| {
        let mut le = [0u8; 8];
        le.copy_from_slice(&entry[8 + 8 * i..16 + 8 * i]);
        u64::from_le_bytes(le)
    };
    let valid = entry.len() >= HEADER
        && entry[..8] == *MAGIC
        && word(0) == key
        && word(1) == (entry.len() - HEADER) as u64
        && word(2) == fnv(&entry[HEADER..]);
    valid.then(|| entry.split_off(HEADER))
}

/// Writes an entry through a temporary file renamed into place, so that a reader never sees
/// half of one (another process may be writing the same entry).
fn write_entry(dir: &Path, path: &Path, key: u64, image: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut entry = Vec::with_capacity(HEADER + image.len());
    entry.extend_from_slice(MAGIC);
    for word in [key, image.len() as u64, fnv(image)] {
        entry.extend_from_slice(&word.to_le_bytes());
    }
    entry.extend_from_slice(image);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &entry)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Compiles `source` for `arch` to CUBIN and checks that it defines every kernel it names.
fn compile(source: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    compile_to(source, arch, Output::Cubin).map(|c| c.image)
}

/// A compiled program.
struct Compiled {
    /// CUBIN or PTX.
    image: Vec<u8>,
    /// What the assembler reported of each kernel (CUBIN only).
    resources: Vec<KernelResources>,
}

/// [`compile`], or only NVRTC's front end to PTX for `arch`'s virtual architecture.
fn compile_to(source: &KernelSource, arch: &str, output: Output) -> Result<Compiled> {
    check_arch(arch)?;
    nvrtc_version()?;
    let file = format!("{}.cu", source.name);
    let fail = |what: &str, e: NvrtcError| nvrtc_error(&format!("{what} of {file} for {arch}"), e);
    // A caller's program (`Cuda::load_kernels`) may hold a NUL byte: an error, not a panic.
    let code = CString::new(source.code.as_str())
        .map_err(|_| Error::Driver(format!("{file}: NUL byte")))?;
    let name =
        CString::new(file.as_str()).map_err(|_| Error::Driver(format!("{file}: NUL byte")))?;
    let program = Program(
        nvrtc::create_program(&code, Some(&name)).map_err(|e| fail("nvrtcCreateProgram", e))?,
    );
    let target = match output {
        Output::Cubin => arch.to_string(),
        Output::Ptx => arch.replacen("sm_", "compute_", 1),
    };
    let mut options = options(&target);
    if output == Output::Ptx && nvrtc_version()? >= (12, 8) {
        options.push("--Ofast-compile=max".to_string());
    }
    // SAFETY: `program` was created above and is destroyed only when it drops.
    let compiled = unsafe { nvrtc::compile_program(program.0, &options) };
    let log = program.log().map_err(|e| fail("nvrtcGetProgramLog", e))?;
    let warnings: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !is_report(l))
        .collect();
    if compiled.is_err() || !warnings.is_empty() {
        let verdict = match compiled {
            Err(e) => format!("failed ({:?})", e.0),
            Ok(()) => "warned (warnings are errors)".to_string(),
        };
        // The log's first lines on one line: an error reads as one sentence.
        let first = &warnings[..warnings.len().min(12)];
        return Err(Error::Driver(format!(
            "NVRTC {verdict} compiling {file} for {arch}: {}",
            first.join(" | ")
        )));
    }
    let (image, delimiters) = match output {
        Output::Cubin => (
            program.cubin().map_err(|e| fail("nvrtcGetCUBIN", e))?,
            // A kernel's name sits NUL-delimited in the CUBIN's symbol string table.
            (&b"\0"[..], &b"\0"[..]),
        ),
        Output::Ptx => (
            program.ptx().map_err(|e| fail("nvrtcGetPTX", e))?,
            (&b".entry "[..], &b"("[..]),
        ),
    };
    for kernel in &source.kernels {
        let symbol = [delimiters.0, kernel.as_bytes(), delimiters.1].concat();
        if !image.windows(symbol.len()).any(|w| w == symbol) {
            return Err(Error::Driver(format!(
                "{file} compiled for {arch} defines no kernel `{kernel}`"
            )));
        }
    }
    Ok(Compiled {
        image,
        resources: resources(&log),
    })
}

/// Checks that `arch` is `sm_<digits>`, optionally with the `a` suffix, before it becomes
/// an option.
fn check_arch(arch: &str) -> Result<()> {
    let valid = arch
        .strip_prefix("sm_")
        .map(|n| n.strip_suffix('a').unwrap_or(n))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if valid {
        Ok(())
    } else {
        Err(Error::invalid(
            "arch",
            arch,
            "sm_<digits>, optionally with an `a` suffix (e.g. sm_80, sm_90a)",
        ))
    }
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    /// The compilation log, trimmed.
    fn log(&self) -> Result<String, NvrtcError> {
        // SAFETY: the program is alive (destroyed only on drop).
        let log = unsafe { nvrtc::get_program_log(self.0) }?;
        let bytes: Vec<u8> = log
            .iter()
            .take_while(|&&c| c != 0)
            // `c_char` is i8 on x86-64 and u8 on aarch64: its byte either way.
            .map(|&c| c.to_ne_bytes()[0])
            .collect();
        Ok(String::from_utf8_lossy(&bytes).trim().to_string())
    }

    /// The PTX of a compiled program.
    fn ptx(&self) -> Result<Vec<u8>, NvrtcError> {
        let mut size = 0;
        // SAFETY: the program is alive; writes one usize.
        unsafe { sys::nvrtcGetPTXSize(self.0, &mut size) }.result()?;
        let mut ptx = vec![0u8; size];
        // SAFETY: the program is alive; writes `size` bytes, the buffer's length.
        unsafe { sys::nvrtcGetPTX(self.0, ptx.as_mut_ptr().cast()) }.result()?;
        Ok(ptx)
    }

    /// The CUBIN of a compiled program.
    fn cubin(&self) -> Result<Vec<u8>, NvrtcError> {
        let mut size = 0;
        // SAFETY: the program is alive; writes one usize.
        unsafe { sys::nvrtcGetCUBINSize(self.0, &mut size) }.result()?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the program is alive; writes `size` bytes, the buffer's length.
        unsafe { sys::nvrtcGetCUBIN(self.0, cubin.as_mut_ptr().cast()) }.result()?;
        Ok(cubin)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here. Nothing can be done
        // about a failure to free it.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn nvrtc_error(what: &str, e: NvrtcError) -> Error {
    Error::Driver(format!("{what} failed: {:?}", e.0))
}

/// FNV-1a, 64 bits: the cache's names and checksums (no security is asked of it).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The FNV-1a 64 hash of `bytes`.
fn fnv(bytes: &[u8]) -> u64 {
    let mut hash = Fnv::new();
    hash.write(bytes);
    hash.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures() {
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 6), "sm_86");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(12, 0), "sm_120");
    }

    #[test]
    fn cache_dir_precedence() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let all = env(&[
            (CACHE_DIR_ENV, "/a"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(cache_dir(all), Some("/a".into()));
        let xdg = env(&[
            (CACHE_DIR_ENV, ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(cache_dir(xdg), Some("/x/pagedattn/kernels".into()));
        // A relative XDG_CACHE_HOME is invalid by the XDG spec and ignored.
        let home = env(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")]);
        assert_eq!(cache_dir(home), Some("/h/.cache/pagedattn/kernels".into()));
        assert_eq!(cache_dir(env(&[])), None);
    }

    #[test]
    fn the_assemblers_report_is_read_and_is_no_warning() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'a' for 'sm_90a'\n\
                   ptxas info    : Function properties for a\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 1 barriers, 2048 bytes smem\n\
                   ptxas info    : Function properties for b\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 40 registers, used 0 barriers";
        assert!(log.lines().all(is_report));
        assert!(!is_report(
            "k.cu(3): warning #177-D: variable \"x\" was declared but never referenced"
        ));
        // A serialized wgmma is a warning, though the assembler says it as info.
        assert!(!is_report(
            "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions \
             are serialized due to non wgmma instructions defining accumulator registers"
        ));
        assert_eq!(
            resources(log),
            [
                KernelResources {
                    kernel: "a".into(),
                    registers: 168,
                    stack_bytes: 8,
                    spill_stores: 4,
                    spill_loads: 12
                },
                KernelResources {
                    kernel: "b".into(),
                    registers: 40,
                    stack_bytes: 0,
                    spill_stores: 0,
                    spill_loads: 0
                }
            ]
        );
    }

    #[test]
    fn entries_are_checked() {
        let dir = std::env::temp_dir().join(format!("pagedattn-entry-{}", std::process::id()));
        let path = dir.join("e.cubin");
        write_entry(&dir, &path, 7, b"image").unwrap();
        assert_eq!(read_entry(&path, 7).as_deref(), Some(&b"image"[..]));
        assert_eq!(read_entry(&path, 8), None, "another key");
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read_entry(&path, 7), None, "a flipped payload bit");
        std::fs::write(&path, &bytes[..HEADER + 2]).unwrap();
        assert_eq!(read_entry(&path, 7), None, "a truncated payload");
        std::fs::write(&path, &bytes[..5]).unwrap();
        assert_eq!(read_entry(&path, 7), None, "a truncated header");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
