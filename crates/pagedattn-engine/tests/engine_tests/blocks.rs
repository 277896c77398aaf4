//! The block manager: a random-schedule test against a shadow of the cache contents (a
//! million operations, `check()` after each), and one targeted test per feature.

use std::collections::HashMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use pagedattn::BlockId;
use pagedattn_engine::serving::batch::SeqId;
use pagedattn_engine::serving::blocks::{
    BlockConfig, BlockError, BlockManager, Location, RELEASED_PLACEHOLDER,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A slot's contents in the shadow cache: the (position, token) written there.
type Slot = Option<(usize, u32)>;

/// The manager plus what the cache would hold: moves returned by the manager are applied to
/// the shadow blocks, tokens are written through the block tables as they are computed, and
/// every sequence must read back its own tokens.
struct Harness {
    m: BlockManager,
    dev: Vec<Vec<Slot>>,
    host: Vec<Vec<Slot>>,
    /// Per live sequence: its tokens and its family (a fork joins its parent's family).
    seqs: HashMap<SeqId, (Vec<u32>, u64)>,
    next_seq: SeqId,
}

impl Harness {
    fn new(config: BlockConfig) -> Self {
        let slots = vec![None; config.block_size];
        Harness {
            dev: vec![slots.clone(); config.num_device_blocks],
            host: vec![slots; config.num_host_blocks],
            m: BlockManager::new(config).expect("valid config"),
            seqs: HashMap::new(),
            next_seq: 0,
        }
    }

    fn bs(&self) -> usize {
        self.m.config().block_size
    }

    fn allocate(&mut self, tokens: &[u32]) -> Result<(SeqId, usize), BlockError> {
        let seq = self.next_seq;
        let cached = self.m.allocate(seq, tokens)?;
        self.next_seq += 1;
        self.seqs.insert(seq, (tokens.to_vec(), seq));
        Ok((seq, cached))
    }

    fn append(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
    ) -> Result<Option<(BlockId, BlockId)>, BlockError> {
        let copy = self.m.append(seq, tokens)?;
        if let Some((src, dst)) = copy {
            self.dev[dst as usize] = self.dev[src as usize].clone();
        }
        self.seqs
            .get_mut(&seq)
            .expect("live")
            .0
            .extend_from_slice(tokens);
        Ok(copy)
    }

    /// Writes `seq`'s tokens up to `upto` through its table (what a step does), then marks
    /// them computed.
    fn compute(&mut self, seq: SeqId, upto: usize) -> Result<(), BlockError> {
        let table = self.m.block_table(seq)?;
        let from = self.m.num_computed(seq)?;
        let tokens = &self.seqs[&seq].0;
        let bs = self.bs();
        for p in from..upto.min(tokens.len()) {
            self.dev[table[p / bs] as usize][p % bs] = Some((p, tokens[p]));
        }
        self.m.mark_computed(seq, upto)
    }

    fn fork(&mut self, parent: SeqId) -> Result<SeqId, BlockError> {
        let child = self.next_seq;
        self.m.fork(parent, child)?;
        self.next_seq += 1;
        let copy = self.seqs[&parent].clone();
        self.seqs.insert(child, copy);
        Ok(child)
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, BlockError> {
        let pairs = self.m.swap_out(seqs)?;
        for &(d, h) in &pairs {
            self.host[h as usize] = self.dev[d as usize].clone();
        }
        Ok(pairs)
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, BlockError> {
        let pairs = self.m.swap_in(seqs)?;
        for &(h, d) in &pairs {
            self.dev[d as usize] = self.host[h as usize].clone();
        }
        Ok(pairs)
    }

    fn free(&mut self, seq: SeqId) -> Result<(), BlockError> {
        self.m.free(seq)?;
        self.seqs.remove(&seq);
        Ok(())
    }

    /// Every device sequence reads back its computed tokens inside its next query's window.
    fn verify(&self) {
        let bs = self.bs();
        let window = self.m.config().sliding_window;
        for (&seq, (tokens, _)) in &self.seqs {
            assert_eq!(self.m.num_tokens(seq), Ok(tokens.len()), "sequence {seq}");
            if self.m.location(seq) != Ok(Location::Device) {
                continue;
            }
            let table = self.m.block_table(seq).expect("device table");
            let computed = self.m.num_computed(seq).expect("live");
            let start = window.map_or(0, |w| (computed + 1).saturating_sub(w));
            for p in start..computed {
                assert_eq!(
                    self.dev[table[p / bs] as usize][p % bs],
                    Some((p, tokens[p])),
                    "sequence {seq} position {p}, table {table:?}"
                );
            }
        }
        self.m.check().expect("accounting");
    }

    /// The ids of the live sequences at `location`, sorted (the map's order is random).
    fn at(&self, location: Location) -> Vec<SeqId> {
        let mut ids: Vec<_> = self
            .seqs
            .keys()
            .copied()
            .filter(|&s| self.m.location(s) == Ok(location))
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// A random prompt over a 2-token alphabet, often starting with one of a few shared bases, so
/// that prefixes repeat.
fn prompt(rng: &mut StdRng, bases: &[Vec<u32>]) -> Vec<u32> {
    let mut p = if rng.random_bool(0.7) {
        let base = &bases[rng.random_range(0..bases.len())];
        base[..rng.random_range(0..=base.len())].to_vec()
    } else {
        Vec::new()
    };
    for _ in 0..rng.random_range(1..8) {
        p.push(rng.random_range(0..2));
    }
    p
}

/// What a random schedule exercised, summed over runs to show the test is not vacuous.
#[derive(Default)]
struct Coverage {
    hits: u64,
    cow: u64,
    swapped_in: u64,
    released: u64,
    evicted: u64,
    refused: u64,
}

/// Runs `ops` random operations on a random configuration; panics (the caller prints the
/// seed) at the first wrong result.
fn random_schedule(seed: u64, ops: usize) -> Coverage {
    let mut refused = 0;
    let mut rng = StdRng::seed_from_u64(seed);
    let config = BlockConfig {
        block_size: [1, 2, 3, 4, 8][rng.random_range(0..5)],
        num_device_blocks: rng.random_range(1..48),
        num_host_blocks: rng.random_range(0..32),
        prefix_caching: rng.random_bool(0.7),
        sliding_window: rng.random_bool(0.3).then(|| rng.random_range(1..20)),
        watermark_blocks: 0,
    };
    let bases: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..32).map(|_| rng.random_range(0..2)).collect())
        .collect();
    let mut h = Harness::new(config);
    // Only performed operations count (a draw that finds nothing to act on is redrawn).
    let mut done = 0;
    while done < ops {
        let before = (
            h.m.stats(),
            h.m.free_device_blocks(),
            h.m.free_host_blocks(),
        );
        let device = h.at(Location::Device);
        let host = h.at(Location::Host);
        let pick = |rng: &mut StdRng, ids: &[SeqId]| ids[rng.random_range(0..ids.len())];
        let result = match rng.random_range(0..100) {
            0..20 if h.seqs.len() < 12 => {
                let p = prompt(&mut rng, &bases);
                let needed = h.m.blocks_needed_to_allocate(&p);
                let r = h.allocate(&p);
                if let Ok((seq, cached)) = r {
                    let cost = before.1 - h.m.free_device_blocks();
                    // Hits already outside the window are released at once.
                    match h.m.config().sliding_window {
                        None => assert_eq!(cost, needed, "allocation's cost"),
                        Some(_) => assert!(cost <= needed, "allocation cost {cost} > {needed}"),
                    }
                    assert!(
                        cached < p.len() && cached % h.bs() == 0,
                        "cached {cached} of {}",
                        p.len()
                    );
                    assert_eq!(h.m.num_computed(seq), Ok(cached));
                } else {
                    assert!(
                        needed > before.1,
                        "{r:?} though {needed} <= {} free",
                        before.1
                    );
                }
                r.map(|_| ())
            }
            20..45 if !device.is_empty() => {
                let seq = pick(&mut rng, &device);
                let tokens: Vec<u32> = (0..rng.random_range(1..4))
                    .map(|_| rng.random_range(0..2))
                    .collect();
                let needed =
                    h.m.blocks_needed_to_append(seq, tokens.len())
                        .expect("device sequence");
                let r = h.append(seq, &tokens);
                if r.is_ok() {
                    assert_eq!(before.1 - h.m.free_device_blocks(), needed, "append's cost");
                }
                r.map(|_| ())
            }
            45..70 if !device.is_empty() => {
                let seq = pick(&mut rng, &device);
                let (from, len) = (h.m.num_computed(seq).expect("live"), h.seqs[&seq].0.len());
                h.compute(seq, rng.random_range(from..=len))
            }
            70..75 if !device.is_empty() && h.seqs.len() < 12 => {
                let parent = pick(&mut rng, &device);
                h.fork(parent).map(|child| {
                    let family = h.seqs[&parent].1;
                    h.seqs.get_mut(&child).expect("forked").1 = family;
                })
            }
            75..90 => {
                // Swap a family (or one sequence) that sits wholly at one location.
                let (ids, out) = if rng.random_bool(0.5) {
                    (&device, true)
                } else {
                    (&host, false)
                };
                if ids.is_empty() {
                    continue;
                }
                let first = pick(&mut rng, ids);
                let group: Vec<SeqId> = if rng.random_bool(0.7) {
                    ids.iter()
                        .copied()
                        .filter(|s| h.seqs[s].1 == h.seqs[&first].1)
                        .collect()
                } else {
                    vec![first]
                };
                let moved = h.m.blocks_to_swap(&group).expect("one location");
                let r = if out {
                    h.swap_out(&group)
                } else {
                    h.swap_in(&group)
                };
                match &r {
                    Ok(pairs) => assert_eq!(pairs.len(), moved),
                    Err(BlockError::OutOfBlocks { needed, .. }) => assert_eq!(*needed, moved),
                    Err(e) => panic!("swap refused: {e}"),
                }
                r.map(|_| ())
            }
            90..100 if !h.seqs.is_empty() => {
                let mut all: Vec<_> = h.seqs.keys().copied().collect();
                all.sort_unstable();
                h.free(pick(&mut rng, &all))
            }
            _ => continue,
        };
        match result {
            Ok(()) => {}
            Err(BlockError::OutOfBlocks { .. }) => {
                refused += 1;
                let after = (
                    h.m.stats(),
                    h.m.free_device_blocks(),
                    h.m.free_host_blocks(),
                );
                assert_eq!(before, after, "a refused call changed the manager");
            }
            Err(e) => panic!("unexpected refusal: {e}"),
        }
        h.verify();
        done += 1;
    }
    let stats = h.m.stats();
    let all: Vec<SeqId> = h.seqs.keys().copied().collect();
    for seq in all {
        h.free(seq).expect("live");
    }
    h.m.check().expect("accounting after freeing everything");
    assert_eq!(h.m.free_device_blocks(), h.m.config().num_device_blocks);
    assert_eq!(h.m.free_host_blocks(), h.m.config().num_host_blocks);
    Coverage {
        hits: stats.prefix_hit_tokens,
        cow: stats.cow_copies,
        swapped_in: stats.swapped_in_blocks,
        released: stats.window_released_blocks,
        evicted: stats.evicted_blocks,
        refused,
    }
}

/// Runs `f(seed)`, naming the seed if it panics.
fn with_seed<T>(seed: u64, f: impl FnOnce(u64) -> T) -> T {
    catch_unwind(AssertUnwindSafe(|| f(seed))).unwrap_or_else(|panic| {
        eprintln!("failed with seed {seed} (replay: BLOCKS_SEED={seed})");
        resume_unwind(panic)
    })
}

#[test]
fn a_million_random_operations_keep_every_sequence_readable() {
    const RUNS: usize = 200;
    const OPS: usize = 5_000;
    if let Some(seed) = std::env::var("BLOCKS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        with_seed(seed, |s| random_schedule(s, OPS));
        return;
    }
    // Runs spread over the cores; each thread sums what its runs exercised.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    let coverage: Vec<Coverage> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut sum = Coverage::default();
                    for _ in (t..RUNS).step_by(threads) {
                        let c = with_seed(rand::random(), |s| random_schedule(s, OPS));
                        sum.hits += c.hits;
                        sum.cow += c.cow;
                        sum.swapped_in += c.swapped_in;
                        sum.released += c.released;
                        sum.evicted += c.evicted;
                        sum.refused += c.refused;
                    }
                    sum
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|p| resume_unwind(p)))
            .collect()
    });
    let total = |f: fn(&Coverage) -> u64| coverage.iter().map(f).sum::<u64>();
    for (what, n) in [
        ("prefix hit tokens", total(|c| c.hits)),
        ("copy-on-write copies", total(|c| c.cow)),
        ("swapped-in blocks", total(|c| c.swapped_in)),
        ("window-released blocks", total(|c| c.released)),
        ("evicted blocks", total(|c| c.evicted)),
        ("refused calls", total(|c| c.refused)),
    ] {
        assert!(n > 100, "the random schedules exercised only {n} {what}");
    }
}

fn config(block_size: usize, num_device_blocks: usize, num_host_blocks: usize) -> BlockConfig {
    BlockConfig {
        block_size,
        num_device_blocks,
        num_host_blocks,
        prefix_caching: true,
        sliding_window: None,
        watermark_blocks: 0,
    }
}

#[test]
fn appending_into_a_shared_partial_block_copies_it_first() {
    let mut h = Harness::new(config(4, 8, 0));
    let (a, _) = h.allocate(&[1, 2, 3, 4, 5, 6]).unwrap();
    h.compute(a, 6).unwrap();
    let b = h.fork(a).unwrap();
    let shared = h.m.block_table(a).unwrap();
    assert_eq!(h.m.block_table(b).unwrap(), shared);
    assert_eq!(h.m.blocks_needed_to_append(b, 1), Ok(1));
    let (src, dst) = h.append(b, &[7]).unwrap().expect("a copy-on-write pair");
    assert_eq!(src, shared[1]);
    let table_b = h.m.block_table(b).unwrap();
    assert_eq!(table_b, vec![shared[0], dst]);
    assert_eq!(
        h.m.block_table(a).unwrap(),
        shared,
        "the parent keeps its blocks"
    );
    // The parent is now the last holder: it writes in place.
    assert_eq!(h.append(a, &[8]), Ok(None));
    // A full shared block is never copied: the next token opens a new block.
    h.append(b, &[9]).unwrap();
    h.compute(b, 8).unwrap();
    let c = h.fork(b).unwrap();
    assert_eq!(h.append(c, &[10]), Ok(None));
    assert_eq!(h.m.stats().cow_copies, 1);
    h.verify();
}

#[test]
fn forked_samples_appending_together_copy_a_shared_block_for_all_but_the_last() {
    let mut h = Harness::new(config(4, 8, 4));
    let (a, _) = h.allocate(&[1, 2, 3, 4, 5, 6]).unwrap();
    h.compute(a, 6).unwrap();
    let (b, c) = (h.fork(a).unwrap(), h.fork(a).unwrap());
    let (d, _) = h.allocate(&[9, 9, 9, 9]).unwrap();
    h.compute(d, 4).unwrap();
    // One at a time each would copy the shared block; together the last one keeps it.
    assert_eq!(h.m.blocks_needed_to_append(c, 1), Ok(1));
    assert_eq!(h.m.blocks_needed_to_append_one_each(&[a, b, c]), Ok(2));
    // a holds it too and does not append: b and c both copy. d's block is full: it grows.
    assert_eq!(h.m.blocks_needed_to_append_one_each(&[b, c]), Ok(2));
    assert_eq!(h.m.blocks_needed_to_append_one_each(&[a, d]), Ok(2));
    // Swapped out, the count is what the group takes once back on the device.
    h.swap_out(&[a, b, c]).unwrap();
    assert_eq!(h.m.blocks_needed_to_append_one_each(&[a, b, c]), Ok(2));
    h.swap_in(&[a, b, c]).unwrap();
    let free = h.m.free_device_blocks();
    for (seq, token) in [(a, 7), (b, 8), (c, 9)] {
        h.append(seq, &[token]).unwrap();
    }
    assert_eq!(free - h.m.free_device_blocks(), 2);
    h.verify();
}

#[test]
fn a_prompt_reuses_its_cached_prefix_but_computes_at_least_one_token() {
    let mut h = Harness::new(config(4, 16, 0));
    let (a, cached) = h.allocate(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
    assert_eq!(cached, 0);
    // Known but not yet computed blocks are not offered to other prompts.
    let (early, cached) = h.allocate(&[1, 2, 3, 4, 0]).unwrap();
    assert_eq!(cached, 0);
    h.free(early).unwrap();
    h.compute(a, 10).unwrap();
    let (b, cached) = h.allocate(&[1, 2, 3, 4, 5, 6, 7, 8, 0]).unwrap();
    assert_eq!(cached, 8);
    assert_eq!(
        h.m.block_table(b).unwrap()[..2],
        h.m.block_table(a).unwrap()[..2]
    );
    // A prompt of exactly two cached blocks recomputes its last block.
    let (c, cached) = h.allocate(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    assert_eq!(cached, 4);
    // A different first block breaks the chain even though the second block's tokens match.
    let (d, cached) = h.allocate(&[0, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    assert_eq!(cached, 0);
    let stats = h.m.stats();
    assert_eq!(stats.prefix_hit_tokens, 12);
    assert_eq!(stats.prefix_query_tokens, 10 + 5 + 9 + 8 + 9);
    for seq in [b, c, d] {
        h.compute(seq, h.seqs[&seq].0.len()).unwrap();
    }
    h.verify();
}

#[test]
fn blocks_filled_by_decoding_join_the_prefix_cache() {
    let mut h = Harness::new(config(2, 8, 0));
    let (a, _) = h.allocate(&[1, 2, 3]).unwrap();
    h.compute(a, 3).unwrap();
    h.append(a, &[4]).unwrap();
    let (b, cached) = h.allocate(&[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(cached, 2, "block 1 is full but not computed yet");
    h.free(b).unwrap();
    h.compute(a, 4).unwrap();
    let (_, cached) = h.allocate(&[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(cached, 4);
    h.verify();
}

#[test]
fn free_cached_blocks_are_evicted_least_recently_freed_first_tail_first() {
    let mut h = Harness::new(config(2, 5, 0));
    let (a, _) = h.allocate(&[1, 1, 2, 2]).unwrap();
    let (b, _) = h.allocate(&[3, 3, 4, 4]).unwrap();
    h.compute(a, 4).unwrap();
    h.compute(b, 4).unwrap();
    h.free(a).unwrap();
    h.free(b).unwrap();
    // Free queue, front first: the never used block 4, then a's blocks tail first, then b's.
    assert_eq!(h.m.stats().cached_free_blocks, 4);
    let (c, _) = h.allocate(&[9]).unwrap();
    assert_eq!(h.m.stats().evicted_blocks, 0, "an empty block goes first");
    h.allocate(&[8]).unwrap();
    assert_eq!(h.m.stats().evicted_blocks, 1);
    let (_, cached) = h.allocate(&[1, 1, 5]).unwrap();
    assert_eq!(cached, 2, "a's last block went before its first");
    assert_eq!(
        h.m.stats().evicted_blocks,
        2,
        "the new block evicted b's last block"
    );
    h.free(c).unwrap();
    let (_, cached) = h.allocate(&[3, 3, 4]).unwrap();
    assert_eq!(
        cached, 2,
        "b's first block is still cached, its second is gone"
    );
    h.verify();
}

#[test]
fn a_swap_round_trip_keeps_sharing_and_contents() {
    let mut h = Harness::new(config(4, 8, 4));
    let (a, _) = h.allocate(&[1, 2, 3, 4, 5, 6]).unwrap();
    h.compute(a, 6).unwrap();
    let b = h.fork(a).unwrap();
    let c = h.fork(a).unwrap();
    h.append(c, &[7]).unwrap();
    h.compute(c, 7).unwrap();
    assert_eq!(h.m.blocks_to_swap(&[a, b, c]), Ok(3));
    let out = h.swap_out(&[a, b, c]).unwrap();
    assert_eq!(out.len(), 3, "shared blocks are copied once");
    assert_eq!(h.m.free_device_blocks(), 8);
    assert_eq!(h.m.stats().host_blocks_in_use, 3);
    assert!(
        h.m.block_table(a).is_err(),
        "no device table while swapped out"
    );
    h.m.check().unwrap();
    let back = h.swap_in(&[a, b, c]).unwrap();
    assert_eq!(back.len(), 3);
    assert_eq!(h.m.free_host_blocks(), 4);
    let (ta, tb, tc) = (
        h.m.block_table(a).unwrap(),
        h.m.block_table(b).unwrap(),
        h.m.block_table(c).unwrap(),
    );
    assert_eq!(ta, tb);
    assert_eq!(ta[0], tc[0]);
    assert_ne!(ta[1], tc[1]);
    // Still shared: appending to b copies its partial block.
    assert!(h.append(b, &[8]).unwrap().is_some());
    h.verify();
    let stats = h.m.stats();
    assert_eq!((stats.swapped_out_blocks, stats.swapped_in_blocks), (3, 3));
}

#[test]
fn swapping_part_of_a_sharing_group_leaves_the_rest_on_the_device() {
    let mut h = Harness::new(config(2, 8, 8));
    let (a, _) = h.allocate(&[1, 2, 3]).unwrap();
    h.compute(a, 3).unwrap();
    let b = h.fork(a).unwrap();
    assert_eq!(h.swap_out(&[b]).unwrap().len(), 2);
    assert_eq!(h.m.free_device_blocks(), 6, "a still holds both blocks");
    h.append(a, &[4]).unwrap();
    h.compute(a, 4).unwrap();
    h.swap_in(&[b]).unwrap();
    h.verify();
}

#[test]
fn the_sliding_window_releases_blocks_no_future_query_sees() {
    let mut c = config(2, 8, 0);
    c.sliding_window = Some(4);
    let mut h = Harness::new(c);
    let (a, _) = h.allocate(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
    h.compute(a, 9).unwrap();
    // The next query, at 9, sees keys 6..=9: blocks 0..3 (positions 0..6) are out.
    let table = h.m.block_table(a).unwrap();
    assert_eq!(table[..3], [RELEASED_PLACEHOLDER; 3]);
    assert_eq!(h.m.free_device_blocks(), 8 - 2);
    h.compute(a, 10).unwrap();
    // At 10 it sees 7..=10: block 3 (positions 6, 7) stays, since 7 is still needed.
    assert_eq!(h.m.free_device_blocks(), 8 - 2);
    h.append(a, &[11]).unwrap();
    h.compute(a, 11).unwrap();
    assert_eq!(h.m.block_table(a).unwrap()[..4], [RELEASED_PLACEHOLDER; 4]);
    assert_eq!(h.m.stats().window_released_blocks, 4);
    h.verify();
    h.free(a).unwrap();
    assert_eq!(h.m.free_device_blocks(), 8);
}

#[test]
fn a_full_pool_refuses_with_an_error_and_changes_nothing() {
    let mut h = Harness::new(config(2, 3, 1));
    let (a, _) = h.allocate(&[1, 2, 3, 4, 5]).unwrap();
    h.compute(a, 5).unwrap();
    let b = h.fork(a).unwrap();
    let snapshot = |h: &Harness| {
        (
            h.m.stats(),
            h.m.free_device_blocks(),
            h.m.free_host_blocks(),
            h.m.block_table(a),
        )
    };
    let before = snapshot(&h);
    let full = BlockError::OutOfBlocks {
        location: Location::Device,
        needed: 1,
        free: 0,
    };
    assert_eq!(h.allocate(&[7]), Err(full.clone()));
    assert_eq!(
        h.append(a, &[6]),
        Err(full.clone()),
        "a copy-on-write needs a block"
    );
    assert_eq!(
        h.swap_out(&[a, b]),
        Err(BlockError::OutOfBlocks {
            location: Location::Host,
            needed: 3,
            free: 1
        })
    );
    assert_eq!(snapshot(&h), before);
    h.m.check().unwrap();
    let message = h.m.allocate(99, &[7]).unwrap_err().to_string();
    assert_eq!(message, "1 free device blocks needed, 0 free");
}

#[test]
fn bad_arguments_name_the_field_the_value_and_the_expectation() {
    let mut c = config(0, 4, 0);
    let e = BlockManager::new(c.clone()).unwrap_err().to_string();
    assert_eq!(e, "block_size = 0: expected > 0");
    c.block_size = 2;
    c.sliding_window = Some(0);
    assert!(BlockManager::new(c)
        .unwrap_err()
        .to_string()
        .starts_with("sliding_window = 0"));
    let mut m = BlockManager::new(config(2, 4, 2)).unwrap();
    assert_eq!(
        m.allocate(1, &[]).unwrap_err().to_string(),
        "tokens = [] (0 tokens): expected a prompt of at least one token"
    );
    m.allocate(1, &[5, 6, 7]).unwrap();
    assert!(m
        .allocate(1, &[5])
        .unwrap_err()
        .to_string()
        .starts_with("seq = 1"));
    assert_eq!(
        m.mark_computed(1, 4).unwrap_err().to_string(),
        "computed = 4: expected in [0, 3] (computed so far, tokens of sequence 1)"
    );
    assert!(m.fork(1, 1).is_err());
    assert_eq!(
        m.free(2).unwrap_err().to_string(),
        "seq = 2: expected a sequence with blocks"
    );
    m.swap_out(&[1]).unwrap();
    assert_eq!(
        m.append(1, &[8]).unwrap_err().to_string(),
        "location of sequence 1 = host: expected device"
    );
    assert!(m.swap_out(&[1]).is_err());
    assert!(m
        .swap_in(&[1, 1])
        .unwrap_err()
        .to_string()
        .starts_with("seqs[1] = 1"));
    m.check().unwrap();
}

#[test]
fn without_prefix_caching_nothing_is_shared_between_prompts() {
    let mut c = config(2, 8, 0);
    c.prefix_caching = false;
    let mut h = Harness::new(c);
    let (a, _) = h.allocate(&[1, 2, 3]).unwrap();
    h.compute(a, 3).unwrap();
    assert_eq!(h.allocate(&[1, 2, 3]).unwrap().1, 0);
    assert_eq!(h.m.stats().cached_free_blocks, 0);
    h.verify();
}
