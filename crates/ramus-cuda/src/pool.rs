//! Device memory: a pool of a few large `cuMemAlloc` chunks carved by
//! [`OffsetAllocator`]s, per-batch bump [`Arena`]s carved from the pool, and
//! the typed [`DeviceView`]s that engines hand to kernels.
//!
//! The pool only calls the driver when a request does not fit in any chunk,
//! and then grows geometrically (the new chunk is at least as large as
//! everything reserved so far), so steady-state training makes no driver
//! allocation per tensor or per batch. Freed blocks are reused at once by the
//! host; that is safe for work ordered on one stream (the usual case). Work on
//! another stream must be ordered with events before its memory is freed or
//! an arena is reset. Chunks are returned to the driver when the pool drops.
//! CUDA managed memory is never used.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{result, CudaContext, CudaStream, DeviceRepr, DriverError};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::offset_allocator::{aligned_size, OffsetAllocator, ALIGNMENT};

/// Element types that device buffers hold: plain 4-byte values for which
/// every bit pattern is valid.
pub trait DeviceScalar: sealed::Sealed + DeviceRepr + Copy + Default + 'static {}

impl DeviceScalar for f32 {}
impl DeviceScalar for u32 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
}

/// A typed range of device memory: a raw device address and a length in
/// elements. It is plain data (like a pointer): it does not keep the memory
/// alive, and the owner (a [`PoolBuffer`] or an [`Arena`] batch) must outlive
/// the device work that uses it.
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceView<T> {
    ptr: u64,
    len: usize,
    marker: PhantomData<fn() -> T>,
}

impl<T> Clone for DeviceView<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceView<T> {}

impl<T: DeviceScalar> DeviceView<T> {
    fn new(ptr: u64, len: usize) -> Self {
        Self {
            ptr,
            len,
            marker: PhantomData,
        }
    }

    /// A view of no elements.
    pub(crate) fn empty() -> Self {
        Self::new(0, 0)
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address as a kernel argument:
    /// `stream.launch_builder(&f).arg(x.kernel_arg())`.
    pub fn kernel_arg(&self) -> &u64 {
        &self.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The elements `range` of this view.
    pub fn slice(&self, range: Range<usize>) -> Result<Self> {
        if range.start > range.end || range.end > self.len {
            return Err(CudaError::BadArgument(format!(
                "slice {range:?} of a device view of {} elements",
                self.len
            )));
        }
        let offset = (range.start * std::mem::size_of::<T>()) as u64;
        Ok(Self::new(self.ptr + offset, range.len()))
    }

    /// A view of `at + len` elements whose elements `at..at + len` are this
    /// view's `start..start + len`. Its elements before `at` are not this
    /// memory and must never be touched: for a caller that only ever reads
    /// rows from `at` on (a task's rows of a per-function buffer, redirected
    /// into the rows of another buffer).
    pub(crate) fn shifted(&self, start: usize, at: usize, len: usize) -> Result<Self> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::BadArgument(format!(
                "elements {start}..{} of a device view of {} elements",
                start.saturating_add(len),
                self.len
            )));
        }
        let size = std::mem::size_of::<T>() as u64;
        let ptr = (self.ptr + start as u64 * size).wrapping_sub(at as u64 * size);
        Ok(Self::new(ptr, at + len))
    }

    /// The same memory seen as elements of `U` (both are 4-byte plain
    /// values, see [`DeviceScalar`]): a pool of floats that also carries
    /// index words.
    pub fn reinterpret<U: DeviceScalar>(&self) -> DeviceView<U> {
        DeviceView::new(self.ptr, self.byte_len() / std::mem::size_of::<U>())
    }

    /// Sets every byte to zero, asynchronously on `stream`.
    pub fn fill_zero(&self, stream: &CudaStream) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        stream
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: the range is device memory (never host memory), so a stale
        // view can at worst make the driver report an error or overwrite
        // other device data; it cannot touch host memory.
        unsafe { result::memset_d8_async(self.ptr, 0, self.byte_len(), stream.cu_stream()) }
            .in_call("cuMemsetD8Async")
    }
}

/// How the pool grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Size of the first chunk, reserved at the first allocation.
    pub initial_bytes: u64,
    /// Device memory budget: the pool never reserves more than this.
    /// `None` means as much as the device gives.
    pub max_bytes: Option<u64>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            initial_bytes: 64 << 20,
            max_bytes: None,
        }
    }
}

/// Chunk sizes are multiples of this (the driver's large-page size), unless
/// the budget leaves less.
const CHUNK_GRANULE: u64 = 2 << 20;

/// Counters of a [`DevicePool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// `cuMemAlloc` calls made (one per chunk).
    pub driver_allocations: u64,
    /// Bytes held from the driver.
    pub reserved_bytes: u64,
    /// Bytes in live blocks (arena blocks count whole).
    pub in_use_bytes: u64,
    /// The largest `in_use_bytes` so far.
    pub peak_in_use_bytes: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        write!(
            f,
            "pool: {:.1} MiB reserved in {} driver allocation(s), {:.1} MiB in use, peak {:.1} MiB",
            self.reserved_bytes as f64 / MIB,
            self.driver_allocations,
            self.in_use_bytes as f64 / MIB,
            self.peak_in_use_bytes as f64 / MIB,
        )
    }
}

/// Where chunks come from: the driver, or a fake in the CPU tests.
pub(crate) trait ChunkMemory: Send + fmt::Debug {
    /// Reserves `bytes` of device memory; `Ok(None)` when the device is full.
    fn allocate(&mut self, bytes: u64) -> Result<Option<u64>>;
    /// Returns a chunk obtained from [`ChunkMemory::allocate`].
    fn release(&mut self, base: u64) -> Result<()>;
}

#[derive(Debug)]
struct DriverMemory {
    context: Arc<CudaContext>,
}

impl ChunkMemory for DriverMemory {
    fn allocate(&mut self, bytes: u64) -> Result<Option<u64>> {
        let bytes = usize::try_from(bytes)
            .map_err(|_| CudaError::BadArgument(format!("{bytes} bytes do not fit in usize")))?;
        self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        // SAFETY: the context is current (bound above); the returned memory
        // is uninitialised device memory, which the pool hands out as raw
        // bytes that kernels write before reading.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(Some(ptr)),
            Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => Ok(None),
            Err(source) => Err(CudaError::Driver {
                call: "cuMemAlloc",
                source,
            }),
        }
    }

    fn release(&mut self, base: u64) -> Result<()> {
        // No kernel may still use the chunk when it goes back.
        self.context.synchronize().in_call("cuCtxSynchronize")?;
        // SAFETY: `base` came from `cuMemAlloc` in `allocate` and the pool
        // releases each chunk exactly once, after all work has finished.
        unsafe { result::free_sync(base) }.in_call("cuMemFree")
    }
}

#[derive(Debug)]
struct Chunk {
    base: u64,
    allocator: OffsetAllocator,
}

#[derive(Debug)]
struct PoolState {
    memory: Box<dyn ChunkMemory>,
    chunks: Vec<Chunk>,
    stats: PoolStats,
}

/// The device memory pool. Shared as `Arc<DevicePool>`; blocks and arenas
/// keep it alive.
#[derive(Debug)]
pub struct DevicePool {
    config: PoolConfig,
    state: Mutex<PoolState>,
}

impl DevicePool {
    /// A pool on `device`. Nothing is reserved until the first allocation.
    pub fn new(device: &CudaDevice, config: PoolConfig) -> Arc<Self> {
        let memory = DriverMemory {
            context: Arc::clone(device.context()),
        };
        Self::with_memory(Box::new(memory), config)
    }

    pub(crate) fn with_memory(memory: Box<dyn ChunkMemory>, config: PoolConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            state: Mutex::new(PoolState {
                memory,
                chunks: Vec::new(),
                stats: PoolStats::default(),
            }),
        })
    }

    /// A buffer of `len` elements, freed when dropped. Its contents are
    /// undefined until written.
    pub fn alloc<T: DeviceScalar>(self: &Arc<Self>, len: usize) -> Result<PoolBuffer<T>> {
        let bytes = byte_size::<T>(len)?;
        Ok(PoolBuffer {
            block: self.alloc_block(bytes)?,
            len,
            marker: PhantomData,
        })
    }

    /// An empty arena whose first block will hold at least `initial_bytes`.
    pub fn arena(self: &Arc<Self>, initial_bytes: u64) -> Arena {
        Arena {
            pool: Arc::clone(self),
            initial_bytes,
            blocks: Vec::new(),
            current: 0,
            cursor: 0,
            batch_bytes: 0,
            peak_batch_bytes: 0,
        }
    }

    /// The pool's budget (`None`: as much as the device gives).
    pub fn max_bytes(&self) -> Option<u64> {
        self.config.max_bytes
    }

    /// The largest block an allocation can get without reserving more
    /// from the driver: the largest free range of any chunk, or the room
    /// the budget leaves for a new chunk if that is larger (`None`: no
    /// budget, and so no bound).
    pub fn largest_free_block(&self) -> Option<u64> {
        let state = self.lock();
        let in_chunks = state
            .chunks
            .iter()
            .map(|c| c.allocator.largest_free_block())
            .max()
            .unwrap_or(0);
        let room = self
            .config
            .max_bytes?
            .saturating_sub(state.stats.reserved_bytes)
            / ALIGNMENT
            * ALIGNMENT;
        Some(in_chunks.max(room))
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // The state stays consistent even if a holder panicked: every update
        // is completed before anything that could panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn alloc_block(self: &Arc<Self>, bytes: u64) -> Result<PoolBlock> {
        let size = aligned_size(bytes)
            .ok_or_else(|| CudaError::BadArgument(format!("{bytes} bytes is too large")))?;
        let mut state = self.lock();
        let found = state
            .chunks
            .iter_mut()
            .enumerate()
            .find_map(|(index, chunk)| Some((index, chunk.allocator.alloc(size)?)));
        let (chunk, allocation) = match found {
            Some(found) => found,
            None => {
                self.grow(&mut state, bytes, size)?;
                let index = state.chunks.len() - 1;
                let allocation = state.chunks[index].allocator.alloc(size).ok_or_else(|| {
                    out_of_memory(&state, bytes) // cannot happen: `grow` made room for `size`
                })?;
                (index, allocation)
            }
        };
        let stats = &mut state.stats;
        stats.in_use_bytes += allocation.size;
        stats.peak_in_use_bytes = stats.peak_in_use_bytes.max(stats.in_use_bytes);
        Ok(PoolBlock {
            pool: Arc::clone(self),
            chunk,
            offset: allocation.offset,
            size: allocation.size,
            ptr: state.chunks[chunk].base + allocation.offset,
        })
    }

    /// Adds a chunk that holds at least `size` bytes: as large as everything
    /// reserved so far (so reservations double), within the budget.
    fn grow(&self, state: &mut PoolState, requested: u64, size: u64) -> Result<()> {
        let reserved = state.stats.reserved_bytes;
        let room = self
            .config
            .max_bytes
            .map_or(u64::MAX, |max| max.saturating_sub(reserved))
            / ALIGNMENT
            * ALIGNMENT;
        if room < size {
            return Err(out_of_memory(state, requested));
        }
        let granular = |bytes: u64| {
            bytes
                .checked_next_multiple_of(CHUNK_GRANULE)
                .unwrap_or(bytes)
        };
        let geometric = granular(size.max(reserved).max(self.config.initial_bytes)).min(room);
        let minimal = granular(size).min(room);
        let mut base = state
            .memory
            .allocate(geometric)?
            .map(|base| (base, geometric));
        if base.is_none() && minimal < geometric {
            base = state.memory.allocate(minimal)?.map(|base| (base, minimal));
        }
        let Some((base, chunk_bytes)) = base else {
            return Err(out_of_memory(state, requested));
        };
        state.chunks.push(Chunk {
            base,
            allocator: OffsetAllocator::new(chunk_bytes),
        });
        state.stats.driver_allocations += 1;
        state.stats.reserved_bytes += chunk_bytes;
        Ok(())
    }

    fn release(&self, chunk: usize, offset: u64) {
        let mut state = self.lock();
        match state.chunks[chunk].allocator.free(offset) {
            Ok(size) => state.stats.in_use_bytes -= size,
            Err(e) => eprintln!("ramus-cuda: pool bookkeeping error (ignored): {e}"),
        }
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        for chunk in state.chunks.drain(..) {
            if let Err(e) = state.memory.release(chunk.base) {
                eprintln!("ramus-cuda: could not release a pool chunk: {e}");
            }
        }
    }
}

fn out_of_memory(state: &PoolState, requested: u64) -> CudaError {
    CudaError::OutOfPoolMemory {
        requested,
        free: state.stats.reserved_bytes - state.stats.in_use_bytes,
        pool_size: state.stats.reserved_bytes,
    }
}

fn byte_size<T>(len: usize) -> Result<u64> {
    len.checked_mul(std::mem::size_of::<T>())
        .map(|bytes| bytes as u64)
        .ok_or_else(|| CudaError::BadArgument(format!("{len} elements overflow the address space")))
}

/// A live block of the pool, returned to it when dropped.
#[derive(Debug)]
struct PoolBlock {
    pool: Arc<DevicePool>,
    chunk: usize,
    offset: u64,
    size: u64,
    ptr: u64,
}

impl Drop for PoolBlock {
    fn drop(&mut self) {
        self.pool.release(self.chunk, self.offset);
    }
}

/// A typed buffer owned by the pool (weights, optimizer state, anything
/// that outlives a batch). Freed when dropped.
#[derive(Debug)]
pub struct PoolBuffer<T> {
    block: PoolBlock,
    len: usize,
    marker: PhantomData<fn() -> T>,
}

impl<T: DeviceScalar> PoolBuffer<T> {
    /// The whole buffer as a view for kernels and copies.
    pub fn view(&self) -> DeviceView<T> {
        DeviceView::new(self.block.ptr, self.len)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A per-batch bump allocator for dynamic tensors, carved from the pool.
///
/// Allocation is a pointer bump. [`Arena::reset`] makes all of the batch's
/// memory available again; if the batch overflowed into extra blocks, reset
/// replaces them with one block as large as all of them, so later batches of
/// the same size need no allocation at all, from the pool or the driver.
#[derive(Debug)]
pub struct Arena {
    pool: Arc<DevicePool>,
    initial_bytes: u64,
    blocks: Vec<PoolBlock>,
    current: usize,
    cursor: u64,
    batch_bytes: u64,
    peak_batch_bytes: u64,
}

impl Arena {
    /// `len` elements, valid until the next [`Arena::reset`]. Contents are
    /// undefined until written. An empty request gets an empty view.
    pub fn alloc<T: DeviceScalar>(&mut self, len: usize) -> Result<DeviceView<T>> {
        let bytes = byte_size::<T>(len)?;
        if bytes == 0 {
            return Ok(DeviceView::new(0, 0));
        }
        let size = aligned_size(bytes)
            .ok_or_else(|| CudaError::BadArgument(format!("{bytes} bytes is too large")))?;
        while let Some(block) = self.blocks.get(self.current) {
            if self.cursor + size <= block.size {
                let ptr = block.ptr + self.cursor;
                self.cursor += size;
                self.batch_bytes += size;
                return Ok(DeviceView::new(ptr, len));
            }
            self.current += 1;
            self.cursor = 0;
        }
        let block_bytes = size.max(self.capacity_bytes()).max(self.initial_bytes);
        // growing geometrically may not fit a memory budget; the request
        // itself might
        let block = match self.pool.alloc_block(block_bytes) {
            Err(CudaError::OutOfPoolMemory { .. }) if block_bytes > size => {
                self.pool.alloc_block(size)?
            }
            other => other?,
        };
        let ptr = block.ptr;
        self.blocks.push(block);
        self.current = self.blocks.len() - 1;
        self.cursor = size;
        self.batch_bytes += size;
        Ok(DeviceView::new(ptr, len))
    }

    /// Ends the batch: every view handed out since the last reset becomes
    /// invalid and its memory is reused by the next batch. Device work that
    /// used those views must be ordered before the next batch's work (same
    /// stream, or an event).
    pub fn reset(&mut self) -> Result<()> {
        self.peak_batch_bytes = self.peak_batch_bytes.max(self.batch_bytes);
        self.batch_bytes = 0;
        self.current = 0;
        self.cursor = 0;
        if self.blocks.len() > 1 {
            let sizes: Vec<u64> = self.blocks.iter().map(|b| b.size).collect();
            let total = sizes.iter().sum();
            self.blocks.clear();
            match self.pool.alloc_block(total) {
                Ok(block) => self.blocks.push(block),
                // under a memory budget one merged block may not fit where
                // the separate ones did: keep them separate
                Err(CudaError::OutOfPoolMemory { .. }) => {
                    for size in sizes {
                        self.blocks.push(self.pool.alloc_block(size)?);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Returns the arena's blocks to the pool if they hold more than its
    /// initial size (after [`Arena::reset`], with no device work using
    /// them still to be ordered on another stream): for callers that share
    /// the pool with allocations of their own under a budget.
    pub fn trim(&mut self) {
        if self.capacity_bytes() > self.initial_bytes {
            self.blocks.clear();
            self.current = 0;
            self.cursor = 0;
        }
    }

    /// Bytes held from the pool.
    pub fn capacity_bytes(&self) -> u64 {
        self.blocks.iter().map(|block| block.size).sum()
    }

    /// Bytes handed out in the current batch (aligned sizes).
    pub fn used_bytes(&self) -> u64 {
        self.batch_bytes
    }

    /// The largest batch so far, in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.peak_batch_bytes.max(self.batch_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out fake, far-apart addresses; `capacity` simulates a full
    /// device. `live` is shared with the test to check releases.
    #[derive(Debug)]
    struct FakeMemory {
        next_base: u64,
        live: Arc<Mutex<Vec<u64>>>,
        capacity: u64,
        reserved: u64,
    }

    impl ChunkMemory for FakeMemory {
        fn allocate(&mut self, bytes: u64) -> Result<Option<u64>> {
            if self.reserved + bytes > self.capacity {
                return Ok(None);
            }
            self.reserved += bytes;
            let base = self.next_base;
            self.next_base += bytes.next_multiple_of(1 << 30) + (1 << 30);
            self.live.lock().unwrap().push(base);
            Ok(Some(base))
        }

        fn release(&mut self, base: u64) -> Result<()> {
            let mut live = self.live.lock().unwrap();
            let index = live.iter().position(|&b| b == base).ok_or_else(|| {
                CudaError::BadArgument(format!("fake chunk {base:#x} released twice"))
            })?;
            live.swap_remove(index);
            Ok(())
        }
    }

    const MIB: u64 = 1 << 20;

    fn pool_with_live(
        initial_bytes: u64,
        max_bytes: Option<u64>,
        device_bytes: u64,
    ) -> (Arc<DevicePool>, Arc<Mutex<Vec<u64>>>) {
        let live = Arc::new(Mutex::new(Vec::new()));
        let memory = FakeMemory {
            next_base: 1 << 40,
            live: Arc::clone(&live),
            capacity: device_bytes,
            reserved: 0,
        };
        let config = PoolConfig {
            initial_bytes,
            max_bytes,
        };
        (DevicePool::with_memory(Box::new(memory), config), live)
    }

    fn pool(initial_bytes: u64, max_bytes: Option<u64>, device_bytes: u64) -> Arc<DevicePool> {
        pool_with_live(initial_bytes, max_bytes, device_bytes).0
    }

    #[test]
    fn an_arena_under_a_budget_uses_what_fits_instead_of_doubling() {
        // a 10 MiB budget: the arena's geometric growth (8 -> 16 MiB) cannot
        // fit, the requests themselves do, in this batch and the next
        let pool = pool(2 * MIB, Some(10 * MIB), 1 << 40);
        let mut arena = pool.arena(8 * MIB);
        for _ in 0..3 {
            let a = arena
                .alloc::<f32>((7 * MIB / 4) as usize)
                .expect("7 MiB fits");
            let b = arena
                .alloc::<f32>((2 * MIB / 4) as usize)
                .expect("2 more MiB fit");
            assert_ne!(a.device_ptr(), b.device_ptr());
            assert!(pool.stats().reserved_bytes <= 10 * MIB);
            arena.reset().expect("reset keeps within the budget");
        }
        let err = arena
            .alloc::<f32>((11 * MIB / 4) as usize)
            .expect_err("over budget");
        assert!(matches!(err, CudaError::OutOfPoolMemory { .. }), "{err}");
    }

    #[test]
    fn buffers_are_aligned_disjoint_and_freed() {
        let pool = pool(2 * MIB, None, u64::MAX);
        let a = pool.alloc::<f32>(1000).unwrap();
        let b = pool.alloc::<u32>(3).unwrap();
        assert_eq!(a.view().device_ptr() % ALIGNMENT, 0);
        assert_eq!(b.view().device_ptr() % ALIGNMENT, 0);
        assert!(a.view().device_ptr() + 4000 <= b.view().device_ptr());
        assert_eq!(pool.stats().in_use_bytes, 4096 + 256);
        drop(a);
        drop(b);
        let stats = pool.stats();
        assert_eq!(stats.in_use_bytes, 0);
        assert_eq!(stats.peak_in_use_bytes, 4096 + 256);
        assert_eq!(stats.driver_allocations, 1);
        assert_eq!(stats.reserved_bytes, 2 * MIB);
    }

    #[test]
    fn the_pool_grows_geometrically() {
        let pool = pool(2 * MIB, None, u64::MAX);
        let one_mib = MIB as usize / 4;
        let buffers: Vec<_> = (0..64)
            .map(|_| pool.alloc::<f32>(one_mib).unwrap())
            .collect();
        let stats = pool.stats();
        assert_eq!(stats.in_use_bytes, 64 * MIB);
        // Chunks of 2, 2, 4, 8, 16, 32 MiB: reservations double.
        assert_eq!(stats.driver_allocations, 6, "{stats}");
        assert_eq!(stats.reserved_bytes, 64 * MIB, "{stats}");
        drop(buffers);
        let again: Vec<_> = (0..64)
            .map(|_| pool.alloc::<f32>(one_mib).unwrap())
            .collect();
        assert_eq!(pool.stats().driver_allocations, 6);
        drop(again);
    }

    #[test]
    fn the_budget_gives_out_of_pool_memory() {
        let pool = pool(2 * MIB, Some(4 * MIB), u64::MAX);
        let _a = pool.alloc::<u32>(MIB as usize / 4).unwrap();
        let _b = pool.alloc::<u32>(MIB as usize / 2).unwrap();
        match pool.alloc::<u32>(MIB as usize / 2) {
            Err(CudaError::OutOfPoolMemory {
                requested,
                free,
                pool_size,
            }) => {
                assert_eq!(requested, 2 * MIB);
                assert_eq!(pool_size, 4 * MIB);
                assert_eq!(free, MIB);
            }
            other => panic!("expected OutOfPoolMemory, got {other:?}"),
        }
    }

    #[test]
    fn the_largest_free_block_is_what_one_allocation_can_get() {
        let pool = pool(4 * MIB, Some(4 * MIB), u64::MAX);
        assert_eq!(
            pool.largest_free_block(),
            Some(4 * MIB),
            "all of the budget"
        );
        let a = pool.alloc::<u32>(MIB as usize / 4).unwrap();
        let _b = pool.alloc::<u32>(MIB as usize / 4).unwrap();
        drop(a); // a 1 MiB hole below `_b`, 2 MiB free above it
        assert_eq!(pool.largest_free_block(), Some(2 * MIB));
        let _c = pool.alloc::<u32>(2 * MIB as usize / 4).unwrap();
        assert_eq!(pool.largest_free_block(), Some(MIB));
        assert_eq!(self::pool(MIB, None, u64::MAX).largest_free_block(), None);
    }

    #[test]
    fn a_full_device_falls_back_to_an_exact_chunk_then_reports_out_of_memory() {
        let pool = pool(4 * MIB, None, 7 * MIB);
        let _a = pool.alloc::<u32>(MIB as usize).unwrap(); // the 4 MiB first chunk
                                                           // The geometric chunk (4 MiB) no longer fits on the device; a 2 MiB one does.
        let _b = pool.alloc::<u32>(MIB as usize / 4).unwrap();
        assert_eq!(pool.stats().reserved_bytes, 6 * MIB);
        let _c = pool.alloc::<u32>(MIB as usize / 4).unwrap(); // fits the 2 MiB chunk
        assert!(matches!(
            pool.alloc::<u32>(MIB as usize / 2),
            Err(CudaError::OutOfPoolMemory { requested, .. }) if requested == 2 * MIB
        ));
    }

    /// Tensor sizes of one simulated batch, in f32 elements.
    fn batch_sizes(count: usize) -> Vec<usize> {
        let mut seed = 12345u64;
        (0..count)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 33) as usize % 50_000
            })
            .collect()
    }

    #[test]
    fn arena_batches_stop_allocating_after_the_first() {
        let pool = pool(2 * MIB, None, u64::MAX);
        let mut arena = pool.arena(64 << 10);
        let sizes = batch_sizes(30);
        let mut driver_allocations_after_first = None;
        for batch in 0..100 {
            // The same tensors in another order, some batches with fewer.
            let mut this_batch = sizes.clone();
            this_batch.rotate_left(batch % sizes.len());
            this_batch.truncate(sizes.len() - batch % 5);
            for len in this_batch {
                let view = arena.alloc::<f32>(len).unwrap();
                assert_eq!(view.len(), len);
                assert_eq!(view.device_ptr() % ALIGNMENT, 0);
            }
            arena.reset().unwrap();
            assert_eq!(arena.blocks.len(), 1);
            let allocations = pool.stats().driver_allocations;
            match driver_allocations_after_first {
                None => driver_allocations_after_first = Some(allocations),
                Some(first) => assert_eq!(allocations, first, "batch {batch} grew the pool"),
            }
        }
        let needed: u64 = sizes
            .iter()
            .map(|&n| aligned_size(4 * n as u64).unwrap())
            .sum();
        assert_eq!(arena.peak_bytes(), needed);
        assert!(arena.capacity_bytes() >= needed);
        assert!(
            arena.capacity_bytes() < 4 * needed,
            "{}",
            arena.capacity_bytes()
        );

        // A batch larger than any before may grow the pool once; repeating
        // it does not.
        let capacity = arena.capacity_bytes();
        let larger = |arena: &mut Arena| {
            for _ in 0..4 {
                for &len in &sizes {
                    arena.alloc::<f32>(len).unwrap();
                }
            }
            arena.reset().unwrap();
        };
        larger(&mut arena);
        assert!(arena.capacity_bytes() > capacity);
        let after_growth = pool.stats().driver_allocations;
        for _ in 0..10 {
            larger(&mut arena);
        }
        assert_eq!(pool.stats().driver_allocations, after_growth);
    }

    #[test]
    fn arena_views_within_a_batch_do_not_overlap() {
        let pool = pool(2 * MIB, None, u64::MAX);
        let mut arena = pool.arena(4096);
        let mut views: Vec<(u64, u64)> = Vec::new();
        for len in [1usize, 64, 1000, 0, 70_000, 3, 300_000] {
            let v = arena.alloc::<u32>(len).unwrap();
            if len > 0 {
                views.push((v.device_ptr(), v.device_ptr() + v.byte_len() as u64));
            }
        }
        for (i, a) in views.iter().enumerate() {
            for b in &views[i + 1..] {
                assert!(a.1 <= b.0 || b.1 <= a.0, "{a:?} overlaps {b:?}");
            }
        }
        assert!(
            arena.blocks.len() > 1,
            "the batch overflowed its first block"
        );
        arena.reset().unwrap();
        assert_eq!(arena.blocks.len(), 1);
        assert_eq!(arena.used_bytes(), 0);
    }

    #[test]
    fn views_slice_within_bounds() {
        let view = DeviceView::<f32>::new(1 << 20, 10);
        let part = view.slice(2..5).unwrap();
        assert_eq!(part.device_ptr(), (1 << 20) + 8);
        assert_eq!(part.len(), 3);
        assert!(view.slice(5..11).is_err());
        assert!(view.slice(10..10).unwrap().is_empty());
        assert_eq!(view.byte_len(), 40);
    }

    #[test]
    fn dropping_the_pool_returns_every_chunk() {
        let (pool, live) = pool_with_live(2 * MIB, None, u64::MAX);
        let mut arena = pool.arena(MIB);
        arena.alloc::<f32>(1000).unwrap();
        let buffer = pool.alloc::<f32>(3 * MIB as usize).unwrap();
        assert_eq!(live.lock().unwrap().len(), 2);
        drop(buffer);
        drop(arena);
        assert_eq!(pool.stats().in_use_bytes, 0);
        drop(pool);
        assert!(live.lock().unwrap().is_empty());
    }
}
