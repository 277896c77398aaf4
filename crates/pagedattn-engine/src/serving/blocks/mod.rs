//! The block manager: which cache blocks each sequence's tokens live in.
//!
//! A fixed pool of device blocks and one of host (swap) blocks, `block_size` tokens each; every
//! layer uses the same ids, so each move the manager returns is applied to every layer. Per
//! sequence it keeps a block table, the sequence's token ids and how many of them are computed
//! (their keys and values written). Blocks are reference counted: forks and prefix-cache hits
//! share them, a shared partly filled block is copied before it is written (copy-on-write).
//!
//! Prefix caching (vLLM v1's design): a full, computed block is indexed by its chained hash
//! (a 128-bit SipHash pair under per-manager random keys); a block whose count drops to 0
//! keeps its hash and stays in the free queue, in least-recently-freed order, until it is
//! taken for new contents — a prompt that starts with the same blocks revives it instead.
//!
//! Sliding window: blocks no future query of the sequence can see are released; their table
//! entries then read as [`RELEASED_PLACEHOLDER`].

mod check;
mod free_queue;
mod hash;
mod pool;

use std::collections::HashMap;
use std::fmt;

use pagedattn::BlockId;

use crate::serving::batch::SeqId;
use hash::{BlockHash, BlockHasher};
use pool::{DevicePool, Pool};

/// What a released (out-of-window) table entry reads as: block 0, a valid id that the sequence
/// does not own. The attention contract never lets a key outside the window reach an output
/// whatever its slot holds, and nothing writes through an entry below the sequence's newest
/// tokens, so the entry only has to be an id in `[0, num_device_blocks)`.
pub const RELEASED_PLACEHOLDER: BlockId = 0;

/// Which pool a sequence's blocks are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// The device cache: the sequence can be computed.
    Device,
    /// The host swap space: the sequence is swapped out.
    Host,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Location::Device => "device",
            Location::Host => "host",
        })
    }
}

/// The block manager's geometry and features.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// Tokens per block (> 0).
    pub block_size: usize,
    /// Device cache blocks (> 0, at most `i32::MAX`).
    pub num_device_blocks: usize,
    /// Host swap blocks (at most `i32::MAX`; 0 disables swapping).
    pub num_host_blocks: usize,
    /// Whether full computed blocks are indexed and reused by later prompts.
    pub prefix_caching: bool,
    /// The attention's sliding window W (> 0) if it has one: a query at position p sees keys
    /// `p - W + 1 ..= p`, so blocks entirely before the next query's window are released.
    pub sliding_window: Option<usize>,
    /// Device blocks [`BlockManager::can_allocate`] keeps free for running sequences to grow
    /// into, so that admitting a prompt does not force an immediate preemption.
    pub watermark_blocks: usize,
}

impl BlockConfig {
    /// Refuses a zero block size, an empty device pool, a pool larger than a [`BlockId`]
    /// can index, or a zero window.
    pub fn validate(&self) -> Result<(), BlockError> {
        let max = BlockId::MAX as usize;
        if self.block_size == 0 {
            return Err(invalid("block_size", 0, "> 0"));
        }
        if self.num_device_blocks == 0 || self.num_device_blocks > max {
            return Err(invalid(
                "num_device_blocks",
                self.num_device_blocks,
                format!("in [1, {max}]"),
            ));
        }
        if self.num_host_blocks > max {
            return Err(invalid(
                "num_host_blocks",
                self.num_host_blocks,
                format!("at most {max}"),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(invalid("sliding_window", 0, "> 0 tokens, or none"));
        }
        Ok(())
    }
}

/// A refused block-manager call; a refused call changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// An argument out of its domain.
    #[error("{field} = {value}: expected {expected}")]
    Invalid {
        /// The argument (or config field).
        field: String,
        /// Its value.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// Not enough free blocks in a pool.
    #[error("{needed} free {location} blocks needed, {free} free")]
    OutOfBlocks {
        /// The pool.
        location: Location,
        /// Blocks the call needs.
        needed: usize,
        /// Free blocks (on the device, cached ones included).
        free: usize,
    },
    /// [`BlockManager::check`] found broken bookkeeping.
    #[error("block accounting broken: {0}")]
    Accounting(String),
    /// The host could not hold the bookkeeping of a pool this large.
    #[error("out of host memory for the bookkeeping of {blocks} blocks ({bytes} bytes)")]
    OutOfMemory {
        /// The pool's blocks.
        blocks: usize,
        /// The allocation that failed.
        bytes: usize,
    },
}

/// `len` copies of `value` in a vector allocated fallibly: the pools' per-block bookkeeping,
/// whose size comes from a flag or a caller.
pub(crate) fn filled<T: Clone>(len: usize, value: T) -> Result<Vec<T>, BlockError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| BlockError::OutOfMemory {
            blocks: len,
            bytes: len.saturating_mul(std::mem::size_of::<T>()),
        })?;
    v.resize(len, value);
    Ok(v)
}

fn invalid(
    field: impl Into<String>,
    value: impl fmt::Display,
    expected: impl Into<String>,
) -> BlockError {
    BlockError::Invalid {
        field: field.into(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// Counters and gauges for reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStats {
    /// Device blocks held by at least one sequence.
    pub device_blocks_in_use: usize,
    /// Host blocks held by swapped-out sequences.
    pub host_blocks_in_use: usize,
    /// Free device blocks still holding a cached prefix.
    pub cached_free_blocks: usize,
    /// Token slots filled in the device blocks in use (a shared block counts once).
    pub tokens_stored: usize,
    /// Token slots of the device blocks in use (`device_blocks_in_use * block_size`).
    pub slots_allocated: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_query_tokens: u64,
    /// Of those, tokens found (not computed again).
    pub prefix_hit_tokens: u64,
    /// Cached blocks taken for new contents.
    pub evicted_blocks: u64,
    /// Copy-on-write block copies.
    pub cow_copies: u64,
    /// Blocks copied device to host.
    pub swapped_out_blocks: u64,
    /// Blocks copied host to device.
    pub swapped_in_blocks: u64,
    /// Blocks released because they left every future query's sliding window.
    pub window_released_blocks: u64,
}

impl BlockStats {
    /// Internal fragmentation: the share of allocated device slots holding no token (0 when
    /// nothing is allocated).
    pub fn internal_waste(&self) -> f64 {
        match self.slots_allocated {
            0 => 0.0,
            slots => 1.0 - self.tokens_stored as f64 / slots as f64,
        }
    }
}

/// One sequence's blocks and tokens.
#[derive(Clone, Debug)]
struct SeqState {
    location: Location,
    /// Block indices in the pool of `location`; entries before `released` are not owned.
    table: Vec<usize>,
    /// Leading entries released by the sliding window.
    released: usize,
    /// Every token id of the sequence (computed or not): hashing a block needs its tokens.
    tokens: Vec<u32>,
    /// Tokens whose keys and values are in the cache.
    computed: usize,
    /// Chained hashes of the full computed blocks (prefix caching only), block by block.
    hashes: Vec<BlockHash>,
    /// Whether the blocks hold an encoder's cross-attention keys and values (a cross cache):
    /// never indexed for prefix caching (their contents are the cross layers', not the
    /// decoder's), never released by the sliding window (a decoder query sees every encoder
    /// token).
    cross: bool,
}

impl SeqState {
    /// The entries this sequence holds a reference on.
    fn owned(&self) -> &[usize] {
        &self.table[self.released..]
    }
}

/// Counters that live outside the pools.
#[derive(Clone, Debug, Default)]
struct Counters {
    prefix_query_tokens: u64,
    prefix_hit_tokens: u64,
    cow_copies: u64,
    swapped_out_blocks: u64,
    swapped_in_blocks: u64,
    window_released_blocks: u64,
}

/// The block manager (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct BlockManager {
    config: BlockConfig,
    device: DevicePool,
    host: Pool,
    hasher: BlockHasher,
    seqs: HashMap<SeqId, SeqState>,
    counters: Counters,
}

/// A pool index as a block id; [`BlockManager::new`] bounds the pools by `i32::MAX`.
fn id(block: usize) -> BlockId {
    block as BlockId
}

impl BlockManager {
    /// A manager with every block free; refuses what [`BlockConfig::validate`] refuses, and
    /// a pool whose bookkeeping the host cannot hold ([`BlockError::OutOfMemory`]).
    pub fn new(config: BlockConfig) -> Result<Self, BlockError> {
        config.validate()?;
        Ok(BlockManager {
            device: DevicePool::new(config.num_device_blocks)?,
            host: Pool::new(config.num_host_blocks)?,
            hasher: BlockHasher::new(),
            seqs: HashMap::new(),
            counters: Counters::default(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BlockConfig {
        &self.config
    }

    /// Free device blocks, cached ones included (they are evicted on demand).
    pub fn free_device_blocks(&self) -> usize {
        self.device.pool.num_free()
    }

    /// Free host blocks.
    pub fn free_host_blocks(&self) -> usize {
        self.host.num_free()
    }

    /// Whether `seq` has blocks (on the device or the host).
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Where `seq`'s blocks are.
    pub fn location(&self, seq: SeqId) -> Result<Location, BlockError> {
        Ok(self.state(seq)?.location)
    }

    /// `seq`'s token count (computed or not).
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, BlockError> {
        Ok(self.state(seq)?.tokens.len())
    }

    /// `seq`'s tokens already in the cache.
    pub fn num_computed(&self, seq: SeqId) -> Result<usize, BlockError> {
        Ok(self.state(seq)?.computed)
    }

    /// `seq`'s device block table, one entry per `block_size` tokens; entries released by the
    /// sliding window read as [`RELEASED_PLACEHOLDER`]. Refused while `seq` is swapped out.
    pub fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>, BlockError> {
        let s = self.state_at(seq, Location::Device)?;
        Ok((0..s.table.len())
            .map(|i| {
                if i < s.released {
                    RELEASED_PLACEHOLDER
                } else {
                    id(s.table[i])
                }
            })
            .collect())
    }

    /// Device blocks that [`allocate`](Self::allocate) would take from the free queue for a
    /// prompt of `tokens` (prefix hits on blocks in use cost nothing).
    pub fn blocks_needed_to_allocate(&self, tokens: &[u32]) -> usize {
        self.allocation_cost(tokens, &self.prefix_hits(tokens))
    }

    /// Whether a prompt of `tokens` can be allocated leaving the watermark free.
    pub fn can_allocate(&self, tokens: &[u32]) -> bool {
        self.blocks_needed_to_allocate(tokens) + self.config.watermark_blocks
            <= self.free_device_blocks()
    }

    /// Gives the new sequence `seq` blocks for all of `tokens` (its prompt), reusing the
    /// leading full blocks found in the prefix cache, and returns how many tokens are thereby
    /// computed already. At least one token is always left to compute (so the prompt's logits
    /// exist): only the blocks before the one holding the last token are looked up, so a
    /// prompt that fills whole blocks recomputes its last block.
    pub fn allocate(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize, BlockError> {
        if tokens.is_empty() {
            return Err(invalid(
                "tokens",
                "[] (0 tokens)",
                "a prompt of at least one token",
            ));
        }
        if self.seqs.contains_key(&seq) {
            return Err(invalid("seq", seq, "a sequence without blocks"));
        }
        let hits = self.prefix_hits(tokens);
        self.ensure_device_free(self.allocation_cost(tokens, &hits))?;
        let mut table = Vec::with_capacity(self.blocks_for(tokens.len()));
        // Hits are taken first: they may sit in the free queue, and taking fresh blocks before
        // them could evict them.
        for &(_, block) in &hits {
            self.device.incref(block, 1);
            table.push(block);
        }
        while table.len() < self.blocks_for(tokens.len()) {
            table.push(self.take_device()?);
        }
        let computed = hits.len() * self.config.block_size;
        self.counters.prefix_query_tokens += tokens.len() as u64;
        self.counters.prefix_hit_tokens += computed as u64;
        let mut state = SeqState {
            location: Location::Device,
            table,
            released: 0,
            tokens: tokens.to_vec(),
            computed,
            hashes: hits.into_iter().map(|(h, _)| h).collect(),
            cross: false,
        };
        self.release_out_of_window(&mut state);
        self.seqs.insert(seq, state);
        Ok(computed)
    }

    /// Gives the new sequence `seq` device blocks for the cross-attention keys and values of
    /// an encoder prompt of `tokens` (an encoder-decoder request's cross cache), none of them
    /// computed. Such a sequence is never looked up in nor added to the prefix cache, nor
    /// released by the sliding window; it swaps and frees like any other.
    pub fn allocate_cross(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), BlockError> {
        if tokens.is_empty() {
            return Err(invalid(
                "tokens",
                "[] (0 tokens)",
                "an encoder prompt of at least one token",
            ));
        }
        if self.seqs.contains_key(&seq) {
            return Err(invalid("seq", seq, "a sequence without blocks"));
        }
        let blocks = self.blocks_for(tokens.len());
        self.ensure_device_free(blocks)?;
        let table = (0..blocks)
            .map(|_| self.take_device())
            .collect::<Result<Vec<_>, _>>()?;
        self.seqs.insert(
            seq,
            SeqState {
                location: Location::Device,
                table,
                released: 0,
                tokens: tokens.to_vec(),
                computed: 0,
                hashes: Vec::new(),
                cross: true,
            },
        );
        Ok(())
    }

    /// Device blocks that [`append`](Self::append)ing `n` tokens to `seq` would take: one per
    /// block boundary crossed, plus one if its partly filled last block is shared and must be
    /// copied first.
    pub fn blocks_needed_to_append(&self, seq: SeqId, n: usize) -> Result<usize, BlockError> {
        let s = self.state_at(seq, Location::Device)?;
        Ok(self.append_need(s, n))
    }

    /// Device blocks that appending one token to each of `seqs` in turn would take, the
    /// sequences on the device or swapped out together (what it would take once swapped
    /// in): one per block boundary crossed, plus a copy of each shared, partly filled last
    /// block for every holder that appends but the last, which keeps it (or for all of them
    /// where a sequence outside `seqs` holds it too). Summing
    /// [`blocks_needed_to_append`](Self::blocks_needed_to_append) over forked samples counts
    /// that last copy too: one block more than there is to take.
    pub fn blocks_needed_to_append_one_each(&self, seqs: &[SeqId]) -> Result<usize, BlockError> {
        let mut needed = 0;
        // (location, shared partly filled last block) -> its holders among `seqs`
        let mut holders: HashMap<(Location, usize), u32> = HashMap::new();
        for &seq in seqs {
            let s = self.state(seq)?;
            needed += self.blocks_for(s.tokens.len() + 1) - s.table.len();
            if let Some(&last) = s.table.last() {
                if !s.tokens.len().is_multiple_of(self.config.block_size) {
                    *holders.entry((s.location, last)).or_default() += 1;
                }
            }
        }
        for ((location, block), appending) in holders {
            let refs = match location {
                Location::Device => self.device.pool.refs[block],
                Location::Host => self.host.refs[block],
            };
            if refs > 1 {
                needed += (appending - u32::from(appending >= refs)) as usize;
            }
        }
        Ok(needed)
    }

    /// Appends `tokens` (not yet computed) to `seq`, taking blocks as it crosses block
    /// boundaries. If its partly filled last block is shared, `seq` first gets a private copy:
    /// the returned (source, destination) pair is for `copy_blocks` before the step writes.
    pub fn append(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
    ) -> Result<Option<(BlockId, BlockId)>, BlockError> {
        let needed = self.blocks_needed_to_append(seq, tokens.len())?;
        self.ensure_device_free(needed)?;
        let mut s = self.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
        let result = self.append_to(&mut s, tokens);
        self.seqs.insert(seq, s);
        result
    }

    /// Records that `seq`'s first `computed` tokens are now in the cache (after a step):
    /// indexes its newly full blocks for the prefix cache and releases the blocks that left
    /// the sliding window.
    pub fn mark_computed(&mut self, seq: SeqId, computed: usize) -> Result<(), BlockError> {
        let s = self.state_at(seq, Location::Device)?;
        if computed < s.computed || computed > s.tokens.len() {
            return Err(invalid(
                "computed",
                computed,
                format!(
                    "in [{}, {}] (computed so far, tokens of sequence {seq})",
                    s.computed,
                    s.tokens.len()
                ),
            ));
        }
        let mut s = self.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
        s.computed = computed;
        if self.config.prefix_caching && !s.cross {
            let bs = self.config.block_size;
            for i in s.hashes.len()..computed / bs {
                let h = self
                    .hasher
                    .hash(s.hashes.last().copied(), &s.tokens[i * bs..(i + 1) * bs]);
                s.hashes.push(h);
                self.device.register(s.table[i], h);
            }
        }
        self.release_out_of_window(&mut s);
        self.seqs.insert(seq, s);
        Ok(())
    }

    /// Makes `child` a copy of `parent` (parallel sampling) sharing all its blocks.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), BlockError> {
        if self.seqs.contains_key(&child) {
            return Err(invalid("child", child, "a sequence without blocks"));
        }
        let s = self.state_at(parent, Location::Device)?.clone();
        for &b in s.owned() {
            self.device.incref(b, 1);
        }
        self.seqs.insert(child, s);
        Ok(())
    }

    /// Distinct blocks that swapping `seqs` (together) moves.
    pub fn blocks_to_swap(&self, seqs: &[SeqId]) -> Result<usize, BlockError> {
        let location = match seqs.first() {
            Some(&s) => self.location(s)?,
            None => return Ok(0),
        };
        Ok(self.group_blocks(seqs, location)?.len())
    }

    /// Swaps `seqs` out to host blocks, together, so a block they share is copied once and
    /// stays shared; returns the (device, host) pairs to copy, every layer. Device blocks
    /// drop the group's references (blocks also held outside the group stay).
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, BlockError> {
        let blocks = self.group_blocks(seqs, Location::Device)?;
        if blocks.len() > self.host.num_free() {
            return Err(BlockError::OutOfBlocks {
                location: Location::Host,
                needed: blocks.len(),
                free: self.host.num_free(),
            });
        }
        let mut moved = HashMap::with_capacity(blocks.len());
        let mut pairs = Vec::with_capacity(blocks.len());
        for (d, holders) in blocks {
            let h = self
                .host
                .take(holders)
                .ok_or_else(|| accounting("host free queue ran dry"))?;
            self.device.decref(d, holders);
            moved.insert(d, h);
            pairs.push((id(d), id(h)));
        }
        self.relocate(seqs, &moved, Location::Host);
        self.counters.swapped_out_blocks += pairs.len() as u64;
        Ok(pairs)
    }

    /// Swaps `seqs` back in to fresh device blocks; returns the (host, device) pairs to copy,
    /// every layer. Sharing inside the group is kept; their full blocks rejoin the prefix
    /// index where no other block holds the same prefix.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, BlockError> {
        let blocks = self.group_blocks(seqs, Location::Host)?;
        self.ensure_device_free(blocks.len())?;
        let mut moved = HashMap::with_capacity(blocks.len());
        let mut pairs = Vec::with_capacity(blocks.len());
        for (h, holders) in blocks {
            let d = self.take_device()?;
            self.device.pool.refs[d] = holders;
            self.host.decref(h, holders);
            moved.insert(h, d);
            pairs.push((id(h), id(d)));
        }
        self.relocate(seqs, &moved, Location::Device);
        for seq in seqs {
            if let Some(s) = self.seqs.get(seq) {
                for i in s.released..s.hashes.len() {
                    self.device.register(s.table[i], s.hashes[i]);
                }
            }
        }
        self.counters.swapped_in_blocks += pairs.len() as u64;
        Ok(pairs)
    }

    /// Releases `seq`'s blocks (finished, or preempted to be recomputed) and forgets it. Its
    /// last blocks are queued first, so they are evicted before its prefix (vLLM's order).
    pub fn free(&mut self, seq: SeqId) -> Result<(), BlockError> {
        let s = self.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
        for &b in s.owned().iter().rev() {
            match s.location {
                Location::Device => self.device.decref(b, 1),
                Location::Host => self.host.decref(b, 1),
            }
        }
        Ok(())
    }

    /// The counters and gauges.
    pub fn stats(&self) -> BlockStats {
        let bs = self.config.block_size;
        // Each device block's tokens: the most any table holding it has in it. Over the live
        // tables only (the engine reads this every step, and a GPU's pool can hold a million
        // blocks); a block with one holder counts at once, only shared ones are gathered.
        let mut tokens_stored = 0;
        let mut shared: HashMap<usize, usize> = HashMap::new();
        for s in self
            .seqs
            .values()
            .filter(|s| s.location == Location::Device)
        {
            for i in s.released..s.table.len() {
                let (block, fill) = (s.table[i], (s.tokens.len() - i * bs).min(bs));
                if self.device.pool.refs[block] == 1 {
                    tokens_stored += fill;
                } else {
                    let f = shared.entry(block).or_default();
                    *f = (*f).max(fill);
                }
            }
        }
        tokens_stored += shared.values().sum::<usize>();
        // (A block is free exactly when its count is 0.)
        let in_use = self.config.num_device_blocks - self.device.pool.num_free();
        BlockStats {
            device_blocks_in_use: in_use,
            host_blocks_in_use: self.config.num_host_blocks - self.host.num_free(),
            cached_free_blocks: self.device.cached_free,
            tokens_stored,
            slots_allocated: in_use * bs,
            prefix_query_tokens: self.counters.prefix_query_tokens,
            prefix_hit_tokens: self.counters.prefix_hit_tokens,
            evicted_blocks: self.device.evictions,
            cow_copies: self.counters.cow_copies,
            swapped_out_blocks: self.counters.swapped_out_blocks,
            swapped_in_blocks: self.counters.swapped_in_blocks,
            window_released_blocks: self.counters.window_released_blocks,
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn state(&self, seq: SeqId) -> Result<&SeqState, BlockError> {
        self.seqs.get(&seq).ok_or_else(|| unknown(seq))
    }

    fn state_at(&self, seq: SeqId, location: Location) -> Result<&SeqState, BlockError> {
        let s = self.state(seq)?;
        if s.location != location {
            return Err(invalid(
                format!("location of sequence {seq}"),
                s.location,
                location.to_string(),
            ));
        }
        Ok(s)
    }

    fn ensure_device_free(&self, needed: usize) -> Result<(), BlockError> {
        let free = self.free_device_blocks();
        if needed > free {
            return Err(BlockError::OutOfBlocks {
                location: Location::Device,
                needed,
                free,
            });
        }
        Ok(())
    }

    fn take_device(&mut self) -> Result<usize, BlockError> {
        self.device
            .take()
            .ok_or_else(|| accounting("device free queue ran dry after a capacity check"))
    }

    /// Free-queue blocks a prompt of `tokens` with prefix `hits` takes: all its blocks but the
    /// hits on blocks in use (a hit on a free cached block takes it off the queue).
    fn allocation_cost(&self, tokens: &[u32], hits: &[(BlockHash, usize)]) -> usize {
        let shared = hits
            .iter()
            .filter(|&&(_, b)| self.device.pool.refs[b] > 0)
            .count();
        self.blocks_for(tokens.len()) - shared
    }

    /// The cached leading full blocks of a prompt of `tokens`, with their hashes, stopping at
    /// the first miss and before the block holding the last token.
    fn prefix_hits(&self, tokens: &[u32]) -> Vec<(BlockHash, usize)> {
        let mut hits = Vec::new();
        if !self.config.prefix_caching || tokens.is_empty() {
            return hits;
        }
        let bs = self.config.block_size;
        let mut parent = None;
        for chunk in tokens[..tokens.len() - 1].chunks_exact(bs) {
            let h = self.hasher.hash(parent, chunk);
            match self.device.cached.get(&h) {
                Some(&b) => hits.push((h, b)),
                None => break,
            }
            parent = Some(h);
        }
        hits
    }

    fn append_need(&self, s: &SeqState, n: usize) -> usize {
        let len = s.tokens.len();
        let grow = self.blocks_for(len + n) - s.table.len();
        let cow = n > 0 && self.must_copy_last(s);
        grow + usize::from(cow)
    }

    /// Whether the last block is partly filled and shared, so appending must copy it first.
    fn must_copy_last(&self, s: &SeqState) -> bool {
        let partial = !s.tokens.len().is_multiple_of(self.config.block_size);
        partial
            && s.table
                .last()
                .is_some_and(|&b| self.device.pool.refs[b] > 1)
    }

    fn append_to(
        &mut self,
        s: &mut SeqState,
        tokens: &[u32],
    ) -> Result<Option<(BlockId, BlockId)>, BlockError> {
        let mut copy = None;
        if !tokens.is_empty() && self.must_copy_last(s) {
            let fresh = self.take_device()?;
            let last = s.table.len() - 1;
            let shared = std::mem::replace(&mut s.table[last], fresh);
            self.device.decref(shared, 1);
            self.counters.cow_copies += 1;
            copy = Some((id(shared), id(fresh)));
        }
        s.tokens.extend_from_slice(tokens);
        while s.table.len() < self.blocks_for(s.tokens.len()) {
            s.table.push(self.take_device()?);
        }
        Ok(copy)
    }

    /// Releases the leading blocks entirely before the window of the sequence's next query
    /// (at position `computed`, seeing keys from `computed + 1 - W`).
    fn release_out_of_window(&mut self, s: &mut SeqState) {
        let Some(w) = self.config.sliding_window.filter(|_| !s.cross) else {
            return;
        };
        let keep_from =
            ((s.computed + 1).saturating_sub(w) / self.config.block_size).min(s.table.len());
        while s.released < keep_from {
            self.device.decref(s.table[s.released], 1);
            s.released += 1;
            self.counters.window_released_blocks += 1;
        }
    }

    /// The distinct owned blocks of `seqs` (all at `location`, no repeats), first-seen order,
    /// each with how many of `seqs` hold it.
    fn group_blocks(
        &self,
        seqs: &[SeqId],
        location: Location,
    ) -> Result<Vec<(usize, u32)>, BlockError> {
        let mut index = HashMap::new();
        let mut blocks: Vec<(usize, u32)> = Vec::new();
        for (i, &seq) in seqs.iter().enumerate() {
            if seqs[..i].contains(&seq) {
                return Err(invalid(
                    format!("seqs[{i}]"),
                    seq,
                    "a sequence not already listed",
                ));
            }
            for &b in self.state_at(seq, location)?.owned() {
                let slot = *index.entry(b).or_insert_with(|| {
                    blocks.push((b, 0));
                    blocks.len() - 1
                });
                blocks[slot].1 += 1;
            }
        }
        Ok(blocks)
    }

    /// Points `seqs`' owned entries at their moved blocks, now at `location`.
    fn relocate(&mut self, seqs: &[SeqId], moved: &HashMap<usize, usize>, location: Location) {
        for seq in seqs {
            if let Some(s) = self.seqs.get_mut(seq) {
                for i in s.released..s.table.len() {
                    if let Some(&to) = moved.get(&s.table[i]) {
                        s.table[i] = to;
                    }
                }
                s.location = location;
            }
        }
    }
}

fn unknown(seq: SeqId) -> BlockError {
    invalid("seq", seq, "a sequence with blocks")
}

fn accounting(what: &str) -> BlockError {
    BlockError::Accounting(what.into())
}
