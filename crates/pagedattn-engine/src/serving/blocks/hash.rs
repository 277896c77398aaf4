//! The prefix cache's block hashes: a full block's hash chains its parent's hash with its
//! token ids, so equal hashes mean equal whole prefixes.
//!
//! A hash is 128 bits: two SipHash-1-3 outputs (std's `RandomState`) under two independent
//! random keys. The keys are drawn per manager, so the hashes are not predictable from outside
//! (a prompt cannot be crafted to collide with another user's prefix), and with 128 bits an
//! accidental collision among even 2^40 cached blocks has odds below 2^-47. The hashes live
//! only in memory, so that they differ between runs does not matter.

use std::hash::{BuildHasher, Hasher, RandomState};

/// A full block's chained hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockHash(u128);

/// Hashes blocks under this manager's keys.
#[derive(Clone, Debug)]
pub(crate) struct BlockHasher {
    low: RandomState,
    high: RandomState,
}

impl BlockHasher {
    /// A hasher with fresh random keys.
    pub(crate) fn new() -> Self {
        BlockHasher {
            low: RandomState::new(),
            high: RandomState::new(),
        }
    }

    /// The hash of a block holding `tokens` after the block whose hash is `parent` (`None` for
    /// a sequence's first block).
    pub(crate) fn hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let half = |keys: &RandomState| {
            let mut h = keys.build_hasher();
            // The parent's presence is written, so a first block never equals a later block
            // whose parent hash happens to be some fixed value.
            match parent {
                None => h.write_u8(0),
                Some(BlockHash(p)) => {
                    h.write_u8(1);
                    h.write_u128(p);
                }
            }
            h.write_usize(tokens.len());
            for &t in tokens {
                h.write_u32(t);
            }
            h.finish()
        };
        BlockHash(u128::from(half(&self.high)) << 64 | u128::from(half(&self.low)))
    }
}

#[cfg(test)]
mod tests {
    use super::BlockHasher;

    #[test]
    fn chains_the_parent() {
        let h = BlockHasher::new();
        let a = h.hash(None, &[1, 2]);
        assert_eq!(a, h.hash(None, &[1, 2]));
        assert_ne!(a, h.hash(None, &[2, 1]));
        assert_ne!(h.hash(Some(a), &[3, 4]), h.hash(None, &[3, 4]));
        assert_ne!(
            h.hash(Some(a), &[3, 4]),
            h.hash(Some(h.hash(None, &[1])), &[3, 4])
        );
    }
}
