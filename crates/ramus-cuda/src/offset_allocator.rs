//! The allocator that carves pool chunks: [`ramus_swap::offset_allocator`],
//! shared with the swap crate's simulated device so that the CPU tests
//! model the pool's fragmentation with the same code.

pub use ramus_swap::offset_allocator::{aligned_size, Allocation, OffsetAllocator, ALIGNMENT};
