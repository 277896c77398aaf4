//! NCCL through cudarc's bindings, loaded at run time as the driver, NVRTC and cuBLAS are (no
//! toolkit to build): [`Communicators`], one per GPU of a tensor-parallel group on one host,
//! made together by `ncclCommInitAll` in one process whose threads drive one GPU each; the
//! all-reduce the sharded model needs; and an abort that any thread may call to make every
//! rank waiting in a collective return.
//!
//! cudarc asks the dynamic loader for `libnccl.so`; NCCL's pip wheel (`nvidia-nccl-cu13`)
//! ships only `libnccl.so.2`. [`library_link_dir`] makes a directory holding a `libnccl.so`
//! link to it, for a program to put on `LD_LIBRARY_PATH` before it starts (the loader reads
//! that variable once, at start: the CLI restarts itself with it).

use std::ffi::{c_void, CStr};
use std::path::PathBuf;
use std::sync::{RwLock, RwLockReadGuard};

use cudarc::nccl::{result, sys};

use crate::{Error, Result};

/// The file NCCL's wheel and packages install, and the directory of the wheel that has it.
const SONAME: &str = "libnccl.so.2";
const WHEEL_DIR: &str = "nvidia/nccl/lib";

/// Whether cudarc finds NCCL by the names it asks the dynamic loader for.
pub fn library_loadable() -> bool {
    // SAFETY: tries to load the library by name (a failure is only a `false`); NCCL's
    // initializers set up the library and nothing else.
    unsafe { sys::is_culib_present() }
}

/// A directory under `cache` holding a `libnccl.so` link to the `libnccl.so.2` found in a
/// CUDA toolkit or NCCL's pip wheel (made if missing), to put on `LD_LIBRARY_PATH`; `None`
/// where no such library is found.
pub fn library_link_dir(cache: &std::path::Path) -> Result<Option<PathBuf>> {
    let Some(found) = pagedattn::cuda::find_cuda_library(&[WHEEL_DIR], SONAME) else {
        return Ok(None);
    };
    let dir = cache.join("nccl-lib");
    let link = dir.join("libnccl.so");
    let io = |what: &str, e: std::io::Error| {
        Error::Model(format!("making {}: {what}: {e}", link.display()))
    };
    std::fs::create_dir_all(&dir).map_err(|e| io("the directory", e))?;
    if std::fs::read_link(&link).ok().as_ref() != Some(&found) {
        // (A stale link, to a library since moved, is replaced.)
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&found, &link).map_err(|e| io("the link", e))?;
    }
    Ok(Some(dir))
}

/// An NCCL error as the engine reports it: what failed and NCCL's reason.
fn nccl_error(what: &str, e: result::NcclError) -> Error {
    // SAFETY: ncclGetErrorString returns a static C string for any result code.
    let reason = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    Error::Model(format!("nccl: {what}: {}", reason.to_string_lossy()))
}

/// The communicators of a tensor-parallel group on one host: rank i's is GPU `ordinals[i]`'s.
/// Each rank's thread uses its own communicator only; [`abort`](Self::abort) may come from
/// any thread.
pub struct Communicators {
    comms: Vec<sys::ncclComm_t>,
    /// `true` once aborted: collectives hold the read lock while they queue, the abort the
    /// write lock, so that no communicator is destroyed under a call that uses it.
    aborted: RwLock<bool>,
}

// SAFETY: the handles are used by one thread a rank (the engine runs rank i's forward, which
// alone calls `all_reduce` for rank i, on one thread at a time), and `abort` excludes every
// call by the lock; NCCL communicators may be used from any thread, one at a time.
unsafe impl Send for Communicators {}
// SAFETY: as above: shared references only reach `all_reduce` (one caller a rank) and
// `abort` (serialized against it by the lock).
unsafe impl Sync for Communicators {}

impl Communicators {
    /// One communicator per GPU of `ordinals` (rank i on `ordinals[i]`), made together.
    pub fn new(ordinals: &[usize]) -> Result<Self> {
        if !library_loadable() {
            return Err(Error::Model(format!(
                "nccl: libnccl.so not found by the dynamic loader (tensor parallelism needs \
                 NCCL: `pip install nvidia-nccl-cu13`, then put a directory with a \
                 libnccl.so link to its {WHEEL_DIR}/{SONAME} on LD_LIBRARY_PATH; the CLI \
                 does this itself)"
            )));
        }
        let devices = ordinals
            .iter()
            .map(|&o| i32::try_from(o).map_err(|_| Error::Model(format!("GPU ordinal {o}"))))
            .collect::<Result<Vec<i32>>>()?;
        let count = i32::try_from(devices.len())
            .map_err(|_| Error::Model(format!("{} GPUs", devices.len())))?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one handle per device, `devices` lists `count` ordinals.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), count, devices.as_ptr()) }
            .map_err(|e| nccl_error(&format!("ncclCommInitAll over GPUs {ordinals:?}"), e))?;
        Ok(Communicators {
            comms,
            aborted: RwLock::new(false),
        })
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comms.len()
    }

    /// Rank `rank`'s communicator, with the read lock that keeps it from being aborted while
    /// a call queues on it; an error once the group was aborted.
    fn communicator(&self, rank: usize) -> Result<(RwLockReadGuard<'_, bool>, sys::ncclComm_t)> {
        let aborted = self.aborted.read().unwrap_or_else(|p| p.into_inner());
        if *aborted {
            return Err(Error::Model(
                "nccl: the group was aborted (another rank failed)".into(),
            ));
        }
        let comm = *self
            .comms
            .get(rank)
            .ok_or_else(|| Error::Model(format!("nccl: rank {rank} of {}", self.size())))?;
        Ok((aborted, comm))
    }

    /// Queues on `stream` the in-place sum over every rank of `count` f32 values at device
    /// address `buffer` (rank `rank`'s copy). Returns once queued; every rank must queue its
    /// part, in the same order of collectives.
    ///
    /// # Safety
    /// `buffer` holds `count` f32 values on rank `rank`'s GPU, alive until the stream passes
    /// the call; `stream` is a stream of that GPU's context; only rank `rank`'s thread calls
    /// this for `rank`.
    pub unsafe fn all_reduce_sum_f32(
        &self,
        rank: usize,
        buffer: u64,
        count: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let (_alive, comm) = self.communicator(rank)?;
        // SAFETY: the caller's contract; the communicator is alive (not aborted, and the
        // read lock keeps it so while this call queues).
        unsafe {
            result::all_reduce(
                buffer as *const c_void,
                buffer as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                comm,
                stream as sys::cudaStream_t,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclAllReduce", e))
    }

    /// Queues on `stream` the in-place all-gather of `count` values a rank: `buffer` holds
    /// `[ranks, count]` values of type `T`, rank `rank`'s part at its place, and every rank's
    /// ends up in every rank's copy. Returns once queued, as
    /// [`all_reduce_sum_f32`](Self::all_reduce_sum_f32).
    ///
    /// # Safety
    /// As [`all_reduce_sum_f32`](Self::all_reduce_sum_f32), `buffer` holding `ranks · count`
    /// values.
    pub unsafe fn all_gather_in_place<T: cudarc::nccl::NcclType>(
        &self,
        rank: usize,
        buffer: u64,
        count: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let (_alive, comm) = self.communicator(rank)?;
        let part = buffer + (rank * count * std::mem::size_of::<T>()) as u64;
        // SAFETY: the caller's contract; this rank's part lies inside `buffer` (NCCL's in-place
        // form: the send buffer is the receive buffer's part `rank`); the communicator is
        // alive (`_alive`).
        unsafe {
            result::all_gather(
                part as *const c_void,
                buffer as *mut c_void,
                count,
                T::as_nccl_type(),
                comm,
                stream as sys::cudaStream_t,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclAllGather", e))
    }

    /// Aborts every communicator (once): collectives queued or running on any rank return
    /// (their results undefined), and later ones fail. What a rank's failure calls, so that
    /// the others do not wait for it forever.
    pub fn abort(&self) {
        let mut aborted = self.aborted.write().unwrap_or_else(|p| p.into_inner());
        if std::mem::replace(&mut *aborted, true) {
            return;
        }
        for &comm in &self.comms {
            // SAFETY: each handle is a live communicator (aborted at most once: the flag)
            // and no call uses it (the write lock). Its error, if any, has no one to go to.
            let _ = unsafe { result::comm_abort(comm) };
        }
    }
}

impl Drop for Communicators {
    fn drop(&mut self) {
        // Abort, not destroy: destroying waits for queued collectives, which a failed peer
        // may never join (cudarc's communicators do the same).
        self.abort();
    }
}
