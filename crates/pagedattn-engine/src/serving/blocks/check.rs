//! The accounting check: every block is free exactly once or held, each reference count equals
//! the number of tables holding the block, the prefix index agrees with the blocks (and with
//! the count of free cached blocks), and every sequence's table fits its tokens.

use std::collections::HashSet;

use super::pool::Pool;
use super::{BlockError, BlockManager, Location, SeqState};

impl BlockManager {
    /// Verifies the bookkeeping (see the module's docs); the engine runs it at the end of a
    /// run, the tests after every operation. Returns the first inconsistency found.
    pub fn check(&self) -> Result<(), BlockError> {
        for (&seq, s) in &self.seqs {
            self.check_seq(s)
                .map_err(|e| BlockError::Accounting(format!("sequence {seq}: {e}")))?;
        }
        for location in [Location::Device, Location::Host] {
            let pool = match location {
                Location::Device => &self.device.pool,
                Location::Host => &self.host,
            };
            self.check_pool(pool, location)
                .map_err(|e| BlockError::Accounting(format!("{location} pool: {e}")))?;
        }
        self.check_prefix_index().map_err(BlockError::Accounting)
    }

    fn check_seq(&self, s: &SeqState) -> Result<(), String> {
        let bs = self.config.block_size;
        let pool_len = match s.location {
            Location::Device => self.config.num_device_blocks,
            Location::Host => self.config.num_host_blocks,
        };
        if s.table.len() != self.blocks_for(s.tokens.len()) || s.computed > s.tokens.len() {
            return Err(format!(
                "{} blocks for {} tokens ({} computed)",
                s.table.len(),
                s.tokens.len(),
                s.computed
            ));
        }
        let hashed = if self.config.prefix_caching && !s.cross {
            s.computed / bs
        } else {
            0
        };
        if s.hashes.len() != hashed {
            return Err(format!(
                "{} block hashes, expected {hashed}",
                s.hashes.len()
            ));
        }
        let released = self
            .config
            .sliding_window
            .filter(|_| !s.cross)
            .map_or(0, |w| {
                ((s.computed + 1).saturating_sub(w) / bs).min(s.table.len())
            });
        if s.released != released {
            return Err(format!(
                "{} blocks released, the window implies {released}",
                s.released
            ));
        }
        let mut seen = HashSet::new();
        for &b in s.owned() {
            if b >= pool_len || !seen.insert(b) {
                return Err(format!("block {b} out of the pool or held twice"));
            }
        }
        if s.location == Location::Device {
            for i in s.released..s.hashes.len() {
                if let Some(h) = self.device.hash_of[s.table[i]] {
                    if h != s.hashes[i] {
                        return Err(format!(
                            "block {} is indexed under another prefix",
                            s.table[i]
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_pool(&self, pool: &Pool, location: Location) -> Result<(), String> {
        let mut holders = vec![0u32; pool.refs.len()];
        for s in self.seqs.values().filter(|s| s.location == location) {
            for &b in s.owned() {
                holders[b] += 1;
            }
        }
        pool.free.walk()?;
        for (b, (&refs, &held)) in pool.refs.iter().zip(&holders).enumerate() {
            if refs != held {
                return Err(format!(
                    "block {b} counts {refs} references, {held} tables hold it"
                ));
            }
            if (refs == 0) != pool.free.contains(b) {
                return Err(format!(
                    "block {b} has {refs} references but its queued state disagrees"
                ));
            }
        }
        Ok(())
    }

    fn check_prefix_index(&self) -> Result<(), String> {
        let dev = &self.device;
        for (h, &b) in &dev.cached {
            if dev.hash_of[b] != Some(*h) {
                return Err(format!(
                    "prefix index points at block {b}, which holds another hash"
                ));
            }
        }
        let cached_free = (0..dev.hash_of.len())
            .filter(|&b| dev.pool.refs[b] == 0 && dev.hash_of[b].is_some())
            .count();
        if cached_free != dev.cached_free {
            return Err(format!(
                "{cached_free} free blocks hold a prefix hash, {} counted",
                dev.cached_free
            ));
        }
        let hashed = dev.hash_of.iter().filter(|h| h.is_some()).count();
        if hashed != dev.cached.len() || (!self.config.prefix_caching && hashed > 0) {
            return Err(format!(
                "{hashed} hashed blocks, {} in the prefix index",
                dev.cached.len()
            ));
        }
        Ok(())
    }
}
