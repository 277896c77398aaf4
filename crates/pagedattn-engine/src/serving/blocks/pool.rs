//! One pool of blocks (device or host): reference counts and the free queue; the device pool
//! adds the prefix cache's hash index.

use std::collections::HashMap;

use super::free_queue::FreeQueue;
use super::hash::BlockHash;
use super::{filled, BlockError};

/// Reference counts over a fixed number of blocks; a block is free (queued) exactly when its
/// count is 0.
#[derive(Clone, Debug)]
pub(crate) struct Pool {
    pub(crate) refs: Vec<u32>,
    pub(crate) free: FreeQueue,
}

impl Pool {
    /// A pool of `num_blocks`, all free.
    pub(crate) fn new(num_blocks: usize) -> Result<Self, BlockError> {
        Ok(Pool {
            refs: filled(num_blocks, 0)?,
            free: FreeQueue::full(num_blocks)?,
        })
    }

    /// Free blocks (on the device, cached ones included: they are evicted on demand).
    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Adds `by` holders to `block`, taking it off the free queue if it was free.
    pub(crate) fn incref(&mut self, block: usize, by: u32) {
        if self.refs[block] == 0 {
            self.free.remove(block);
        }
        self.refs[block] += by;
    }

    /// Removes `by` holders from `block`, queueing it as free when none is left.
    pub(crate) fn decref(&mut self, block: usize, by: u32) {
        debug_assert!(self.refs[block] >= by, "block {block} released too often");
        self.refs[block] -= by;
        if self.refs[block] == 0 {
            self.free.push_back(block);
        }
    }

    /// Takes the least recently freed block for `holders` holders.
    pub(crate) fn take(&mut self, holders: u32) -> Option<usize> {
        let block = self.free.pop_front()?;
        self.refs[block] = holders;
        Some(block)
    }
}

/// The device pool: a [`Pool`] whose full, computed blocks may carry a prefix hash, kept
/// (while free) until the block is taken for new contents.
#[derive(Clone, Debug)]
pub(crate) struct DevicePool {
    pub(crate) pool: Pool,
    pub(crate) hash_of: Vec<Option<BlockHash>>,
    pub(crate) cached: HashMap<BlockHash, usize>,
    pub(crate) evictions: u64,
    /// Free blocks holding a prefix hash (kept up to date: the statistics of every step
    /// read it, and counting would visit the whole pool).
    pub(crate) cached_free: usize,
}

impl DevicePool {
    /// A device pool of `num_blocks`, all free and none cached.
    pub(crate) fn new(num_blocks: usize) -> Result<Self, BlockError> {
        Ok(DevicePool {
            pool: Pool::new(num_blocks)?,
            hash_of: filled(num_blocks, None)?,
            cached: HashMap::new(),
            evictions: 0,
            cached_free: 0,
        })
    }

    /// [`Pool::incref`], counting a cached block that stops being free.
    pub(crate) fn incref(&mut self, block: usize, by: u32) {
        if self.pool.refs[block] == 0 && self.hash_of[block].is_some() {
            self.cached_free -= 1;
        }
        self.pool.incref(block, by);
    }

    /// [`Pool::decref`], counting a cached block that becomes free.
    pub(crate) fn decref(&mut self, block: usize, by: u32) {
        self.pool.decref(block, by);
        if self.pool.refs[block] == 0 && self.hash_of[block].is_some() {
            self.cached_free += 1;
        }
    }

    /// Takes a free block for new contents (one holder), dropping the prefix hash it held.
    pub(crate) fn take(&mut self) -> Option<usize> {
        let block = self.pool.take(1)?;
        if let Some(h) = self.hash_of[block].take() {
            self.cached.remove(&h);
            self.evictions += 1;
            self.cached_free -= 1;
        }
        Some(block)
    }

    /// Records that `block` holds the prefix hashed `hash`, unless another block already
    /// does (two computations of one prefix: the first stays the cached one) or `block`
    /// already has its hash.
    pub(crate) fn register(&mut self, block: usize, hash: BlockHash) {
        if self.hash_of[block].is_none() && !self.cached.contains_key(&hash) {
            self.hash_of[block] = Some(hash);
            self.cached.insert(hash, block);
            if self.pool.refs[block] == 0 {
                self.cached_free += 1;
            }
        }
    }
}
