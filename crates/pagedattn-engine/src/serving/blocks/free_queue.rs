//! The device pool's free blocks in eviction order (vLLM v1's `FreeKVCacheBlockQueue`): a
//! doubly linked list over block indices, so that a cached block revived by a prefix hit leaves
//! the middle of the queue in O(1).

use super::{filled, BlockError};

/// No neighbour.
const NONE: usize = usize::MAX;

/// Free blocks, least recently freed at the front: allocation takes the front, a freed block
/// joins the back, so a cached block survives as long as possible.
#[derive(Clone, Debug)]
pub(crate) struct FreeQueue {
    prev: Vec<usize>,
    next: Vec<usize>,
    queued: Vec<bool>,
    head: usize,
    tail: usize,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every block of a pool of `num_blocks`, in id order.
    pub(crate) fn full(num_blocks: usize) -> Result<Self, BlockError> {
        let mut queue = FreeQueue {
            prev: filled(num_blocks, NONE)?,
            next: filled(num_blocks, NONE)?,
            queued: filled(num_blocks, false)?,
            head: NONE,
            tail: NONE,
            len: 0,
        };
        for block in 0..num_blocks {
            queue.push_back(block);
        }
        Ok(queue)
    }

    /// How many blocks are queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `block` is queued.
    pub(crate) fn contains(&self, block: usize) -> bool {
        self.queued[block]
    }

    /// Queues `block` at the back; false (and no change) if it is already queued.
    pub(crate) fn push_back(&mut self, block: usize) -> bool {
        if self.queued[block] {
            return false;
        }
        self.queued[block] = true;
        self.prev[block] = self.tail;
        self.next[block] = NONE;
        match self.tail {
            NONE => self.head = block,
            t => self.next[t] = block,
        }
        self.tail = block;
        self.len += 1;
        true
    }

    /// Takes the front block (the least recently freed).
    pub(crate) fn pop_front(&mut self) -> Option<usize> {
        let block = self.head;
        (block != NONE).then(|| {
            self.remove(block);
            block
        })
    }

    /// Takes `block` out of the queue wherever it is; false (and no change) if it is not
    /// queued.
    pub(crate) fn remove(&mut self, block: usize) -> bool {
        if !self.queued[block] {
            return false;
        }
        let (p, n) = (self.prev[block], self.next[block]);
        match p {
            NONE => self.head = n,
            p => self.next[p] = n,
        }
        match n {
            NONE => self.tail = p,
            n => self.prev[n] = p,
        }
        self.prev[block] = NONE;
        self.next[block] = NONE;
        self.queued[block] = false;
        self.len -= 1;
        true
    }

    /// The queued blocks front to back, or a description of how the links are broken (a
    /// cycle, a link to an unqueued block, a length that disagrees with the links).
    pub(crate) fn walk(&self) -> Result<Vec<usize>, String> {
        let mut order = Vec::with_capacity(self.len);
        let mut prev = NONE;
        let mut at = self.head;
        while at != NONE {
            if order.len() >= self.len || !self.queued[at] || self.prev[at] != prev {
                return Err(format!("free queue link broken at block {at}"));
            }
            order.push(at);
            prev = at;
            at = self.next[at];
        }
        let marked = self.queued.iter().filter(|&&q| q).count();
        if order.len() != self.len || marked != self.len || self.tail != prev {
            return Err(format!(
                "free queue holds {} linked and {marked} marked blocks, its length says {}",
                order.len(),
                self.len
            ));
        }
        Ok(order)
    }
}

#[cfg(test)]
mod tests {
    use super::FreeQueue;

    #[test]
    fn pops_in_free_order_and_removes_from_the_middle() {
        let mut q = FreeQueue::full(4).unwrap();
        assert_eq!(q.pop_front(), Some(0));
        assert!(q.remove(2));
        assert!(!q.remove(2));
        assert!(q.push_back(0));
        assert!(!q.push_back(0));
        assert_eq!(q.walk(), Ok(vec![1, 3, 0]));
        assert_eq!(
            [q.pop_front(), q.pop_front(), q.pop_front()],
            [Some(1), Some(3), Some(0)]
        );
        assert_eq!(q.pop_front(), None);
        assert_eq!(q.walk(), Ok(vec![]));
    }
}
