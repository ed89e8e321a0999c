//! Host-side bookkeeping for carving one contiguous range (a pool chunk) into
//! blocks: best-fit over a free list, coalescing on free, 256-byte alignment.
//! Pure logic with no CUDA calls, so it is tested exhaustively on the CPU.
//!
//! The CUDA back end's device pool carves its chunks with it, and the
//! simulated device ([`SimDevice::with_pool`](crate::SimDevice::with_pool))
//! models that pool with the very same allocator, so that fragmentation the
//! device would meet shows in the CPU tests too.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// [`OffsetAllocator::free`] of an offset where no block starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("offset {0} is not the start of an allocated block")]
pub struct UnknownBlock(pub u64);

/// Alignment of every block offset and size, in bytes. 256 covers every
/// vector width CUDA kernels and cuBLAS use, and matches `cuMemAlloc`.
pub const ALIGNMENT: u64 = 256;

/// Rounds `bytes` up to a multiple of [`ALIGNMENT`] (at least one unit, so
/// every block has a distinct offset). `None` on overflow.
pub fn aligned_size(bytes: u64) -> Option<u64> {
    bytes.max(1).checked_next_multiple_of(ALIGNMENT)
}

/// A block handed out by [`OffsetAllocator::alloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Offset from the start of the managed range; a multiple of [`ALIGNMENT`].
    pub offset: u64,
    /// Size reserved for the block: the request rounded up to [`ALIGNMENT`].
    pub size: u64,
}

/// Best-fit allocator over the offsets `[0, capacity)`.
#[derive(Debug, Clone)]
pub struct OffsetAllocator {
    capacity: u64,
    /// Free ranges, offset -> size. Adjacent free ranges never coexist.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same ranges ordered by (size, offset), for best-fit lookup.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Live blocks, offset -> size.
    allocated: HashMap<u64, u64>,
    used: u64,
}

impl OffsetAllocator {
    /// Manages `capacity` bytes (rounded down to [`ALIGNMENT`]).
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity - capacity % ALIGNMENT;
        let mut allocator = Self {
            capacity,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            allocated: HashMap::new(),
            used: 0,
        };
        if capacity > 0 {
            allocator.insert_free(0, capacity);
        }
        allocator
    }

    /// Reserves `bytes` (rounded up to [`ALIGNMENT`]) from the smallest free
    /// range that fits; `None` if no single free range is large enough.
    pub fn alloc(&mut self, bytes: u64) -> Option<Allocation> {
        let size = aligned_size(bytes)?;
        let &(free_size, offset) = self.free_by_size.range((size, 0)..).next()?;
        self.remove_free(offset, free_size);
        if free_size > size {
            self.insert_free(offset + size, free_size - size);
        }
        self.allocated.insert(offset, size);
        self.used += size;
        Some(Allocation { offset, size })
    }

    /// Reserves `bytes` (rounded up to [`ALIGNMENT`]) exactly at `offset`
    /// (a multiple of [`ALIGNMENT`]); `None` if any of that range is in use
    /// or outside the managed range.
    pub fn alloc_at(&mut self, offset: u64, bytes: u64) -> Option<Allocation> {
        let size = aligned_size(bytes)?;
        if !offset.is_multiple_of(ALIGNMENT) {
            return None;
        }
        let end = offset.checked_add(size)?;
        let (&start, &free_size) = self.free_by_offset.range(..=offset).next_back()?;
        if start + free_size < end {
            return None;
        }
        self.remove_free(start, free_size);
        if start < offset {
            self.insert_free(start, offset - start);
        }
        if end < start + free_size {
            self.insert_free(end, start + free_size - end);
        }
        self.allocated.insert(offset, size);
        self.used += size;
        Some(Allocation { offset, size })
    }

    /// Returns the block at `offset` and merges it with free neighbours.
    /// Returns the block's size.
    pub fn free(&mut self, offset: u64) -> Result<u64, UnknownBlock> {
        let size = self.allocated.remove(&offset).ok_or(UnknownBlock(offset))?;
        self.used -= size;
        let (mut start, mut end) = (offset, offset + size);
        if let Some((&before, &before_size)) = self.free_by_offset.range(..start).next_back() {
            if before + before_size == start {
                self.remove_free(before, before_size);
                start = before;
            }
        }
        if let Some(&after_size) = self.free_by_offset.get(&end) {
            self.remove_free(end, after_size);
            end += after_size;
        }
        self.insert_free(start, end - start);
        Ok(size)
    }

    /// Bytes managed.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in live blocks (aligned sizes).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Bytes not in live blocks.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used
    }

    /// The largest request that [`OffsetAllocator::alloc`] can satisfy now.
    pub fn largest_free_block(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(size, _)| size)
    }

    /// Number of disjoint free ranges (1 when everything is free).
    pub fn free_block_count(&self) -> usize {
        self.free_by_offset.len()
    }

    /// Number of live blocks.
    pub fn allocation_count(&self) -> usize {
        self.allocated.len()
    }

    fn insert_free(&mut self, offset: u64, size: u64) {
        self.free_by_offset.insert(offset, size);
        self.free_by_size.insert((size, offset));
    }

    fn remove_free(&mut self, offset: u64, size: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(size, offset));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut a = OffsetAllocator::new(10 * ALIGNMENT);
        let blocks: Vec<_> = (0..5)
            .map(|i| a.alloc((i as u64 % 2 + 1) * ALIGNMENT).unwrap())
            .collect();
        // Layout: [1][2][1][2][1] units, 3 units free at the end.
        a.free(blocks[1].offset).unwrap(); // 2-unit hole
        a.free(blocks[3].offset).unwrap(); // 2-unit hole
        let small = a.alloc(ALIGNMENT).unwrap();
        assert_eq!(small.offset, blocks[1].offset, "first of the 2-unit holes");
        let three = a.alloc(3 * ALIGNMENT).unwrap();
        assert_eq!(three.offset, 7 * ALIGNMENT, "only the tail fits 3 units");
    }

    #[test]
    fn fragmentation_fails_then_coalescing_recovers() {
        let mut a = OffsetAllocator::new(8 * ALIGNMENT);
        let blocks: Vec<_> = (0..8).map(|_| a.alloc(1).unwrap()).collect();
        assert!(a.alloc(1).is_none(), "full");
        for b in blocks.iter().step_by(2) {
            a.free(b.offset).unwrap();
        }
        assert_eq!(a.free_bytes(), 4 * ALIGNMENT);
        assert!(
            a.alloc(2 * ALIGNMENT).is_none(),
            "4 units free, but no 2 adjacent"
        );
        for b in blocks.iter().skip(1).step_by(2) {
            a.free(b.offset).unwrap();
        }
        assert_eq!(a.free_block_count(), 1);
        assert_eq!(a.alloc(8 * ALIGNMENT).map(|b| b.offset), Some(0));
    }

    #[test]
    fn freeing_an_unknown_offset_is_an_error() {
        let mut a = OffsetAllocator::new(4 * ALIGNMENT);
        let b = a.alloc(10).unwrap();
        assert!(a.free(b.offset + ALIGNMENT).is_err());
        assert_eq!(a.free(b.offset).unwrap(), ALIGNMENT);
        assert!(a.free(b.offset).is_err(), "double free");
    }

    #[test]
    fn placing_at_an_offset_splits_the_free_range() {
        let mut a = OffsetAllocator::new(8 * ALIGNMENT);
        let mid = a.alloc_at(3 * ALIGNMENT, 2 * ALIGNMENT).unwrap();
        assert_eq!(mid.offset, 3 * ALIGNMENT);
        assert_eq!(a.free_block_count(), 2);
        assert!(a.alloc_at(4 * ALIGNMENT, 1).is_none(), "in use");
        assert!(
            a.alloc_at(7 * ALIGNMENT, 2 * ALIGNMENT).is_none(),
            "past the end"
        );
        assert!(a.alloc_at(ALIGNMENT + 1, 1).is_none(), "misaligned");
        assert_eq!(a.largest_free_block(), 3 * ALIGNMENT);
        a.free(mid.offset).unwrap();
        assert_eq!(a.free_block_count(), 1);
    }

    #[test]
    fn sizes_round_up_to_the_alignment() {
        assert_eq!(aligned_size(0), Some(ALIGNMENT));
        assert_eq!(aligned_size(1), Some(ALIGNMENT));
        assert_eq!(aligned_size(ALIGNMENT), Some(ALIGNMENT));
        assert_eq!(aligned_size(ALIGNMENT + 1), Some(2 * ALIGNMENT));
        assert_eq!(aligned_size(u64::MAX), None);
        assert_eq!(OffsetAllocator::new(1000).capacity(), 3 * ALIGNMENT);
        assert_eq!(OffsetAllocator::new(0).alloc(1), None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        AllocAt(u64, u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..6000).prop_map(Op::Alloc),
            1 => (0u64..220, 0u64..3000).prop_map(|(u, b)| Op::AllocAt(u * ALIGNMENT, b)),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn random_alloc_free_sequences_keep_the_invariants(
            capacity_units in 1u64..200,
            ops in proptest::collection::vec(op(), 0..300),
        ) {
            let capacity = capacity_units * ALIGNMENT;
            let mut a = OffsetAllocator::new(capacity);
            let mut live: Vec<Allocation> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(bytes) => {
                        let largest = a.largest_free_block();
                        match a.alloc(bytes) {
                            Some(block) => {
                                prop_assert_eq!(block.offset % ALIGNMENT, 0);
                                prop_assert_eq!(block.size, aligned_size(bytes).unwrap());
                                prop_assert!(block.offset + block.size <= capacity);
                                for other in &live {
                                    let disjoint = block.offset + block.size <= other.offset
                                        || other.offset + other.size <= block.offset;
                                    prop_assert!(disjoint, "{:?} overlaps {:?}", block, other);
                                }
                                live.push(block);
                            }
                            // Fails only when no single free range fits.
                            None => prop_assert!(largest < aligned_size(bytes).unwrap()),
                        }
                    }
                    Op::AllocAt(offset, bytes) => {
                        let size = aligned_size(bytes).unwrap();
                        let free = offset + size <= capacity
                            && live.iter().all(|o| offset + size <= o.offset || o.offset + o.size <= offset);
                        match a.alloc_at(offset, bytes) {
                            Some(block) => {
                                prop_assert!(free, "{:?} placed over a live block", block);
                                prop_assert_eq!(block, Allocation { offset, size });
                                live.push(block);
                            }
                            None => prop_assert!(!free, "{} bytes at {} were free", size, offset),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let block = live.swap_remove(i % live.len());
                        prop_assert_eq!(a.free(block.offset).unwrap(), block.size);
                    }
                    Op::Free(_) => {}
                }
                let used: u64 = live.iter().map(|b| b.size).sum();
                prop_assert_eq!(a.used_bytes(), used);
                prop_assert_eq!(a.allocation_count(), live.len());
                // Free ranges are never adjacent, so there is at most one more
                // free range than there are live blocks.
                prop_assert!(a.free_block_count() <= live.len() + 1);
            }
            for block in live.drain(..) {
                a.free(block.offset).unwrap();
            }
            prop_assert_eq!(a.free_block_count(), 1);
            prop_assert_eq!(a.largest_free_block(), capacity);
            prop_assert_eq!(a.used_bytes(), 0);
        }
    }
}
