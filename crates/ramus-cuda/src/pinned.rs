//! Pinned (page-locked) host staging buffers and the asynchronous copies
//! between them and device memory.
//!
//! A [`PinnedBuffer`] is allocated with `cuMemHostAlloc` and flags 0 — not
//! write-combined, because the host reads results back from it. It grows on
//! demand and is reused: an engine fills it with a batch's index arrays and
//! uploads them with one copy per batch, and downloads results through it.
//! Every copy records an event; any host access to the buffer (or growing or
//! dropping it) first waits for that event, so the host never touches memory
//! a copy is still reading or writing.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pool::{DeviceScalar, DeviceView};

/// A growable pinned host buffer for staging copies.
#[derive(Debug)]
pub struct PinnedBuffer {
    context: Arc<CudaContext>,
    /// Start of the allocation; `None` while nothing is allocated.
    host: Option<NonNull<u8>>,
    capacity: usize,
    copy_done: CudaEvent,
    /// The last copy issued, until a host access has waited for it.
    pending: PendingCopy,
}

/// What a [`PinnedBuffer`]'s last copy does to its allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PendingCopy {
    None,
    /// Reads it (an upload).
    Upload,
    /// Writes it (a download).
    Download,
}

// SAFETY: the buffer exclusively owns its pinned allocation (like a
// `Box<[u8]>`); pinned host memory may be used from any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&self` methods only read the allocation, after waiting for the
// copies that write it.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// An empty buffer on `device`; it allocates when first used.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        Ok(Self {
            context: Arc::clone(device.context()),
            host: None,
            capacity: 0,
            copy_done: device.new_event()?,
            pending: PendingCopy::None,
        })
    }

    /// Bytes allocated.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity
    }

    /// Blocks until the last copy issued through this buffer has finished.
    pub fn wait(&self) -> Result<()> {
        if self.pending != PendingCopy::None {
            self.copy_done.synchronize().in_call("cuEventSynchronize")?;
        }
        Ok(())
    }

    /// The first `len` elements, for the host to fill before an
    /// [`upload`](PinnedBuffer::upload). Waits for pending copies and grows
    /// the buffer if needed (growing does not keep the old contents).
    pub fn host_mut<T: DeviceScalar>(&mut self, len: usize) -> Result<&mut [T]> {
        self.wait()?;
        self.pending = PendingCopy::None;
        self.reserve(byte_len::<T>(len)?)?;
        let Some(host) = self.host else {
            return Ok(&mut []);
        };
        // SAFETY: the allocation holds at least `len` elements (reserved
        // above), is page-aligned (so aligned for `T`), and no copy is using
        // it (waited above); `T` is f32 or u32, valid for any bit pattern,
        // and `&mut self` makes the slice the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(host.as_ptr().cast::<T>(), len) })
    }

    /// The first `len` elements, e.g. after a
    /// [`download`](PinnedBuffer::download). Waits for pending copies.
    pub fn host<T: DeviceScalar>(&self, len: usize) -> Result<&[T]> {
        self.wait()?;
        // SAFETY: no copy writes the allocation any more (waited above).
        unsafe { host_slice(self.host, self.capacity, len, "pinned") }
    }

    /// Copies the first `dst.len()` staged elements to `dst`, asynchronously
    /// on `stream`. Fill them first with [`host_mut`](PinnedBuffer::host_mut).
    pub fn upload<T: DeviceScalar>(
        &mut self,
        dst: DeviceView<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.upload_from(0, dst, stream)
    }

    /// Copies the `dst.len()` staged elements from element `first` on to
    /// `dst`, asynchronously on `stream`, without waiting for an upload
    /// still in flight (copies only read the staged words). The buffer's
    /// next host access waits for this copy only: a caller that uploads on
    /// several streams orders the last one behind the others.
    pub fn upload_from<T: DeviceScalar>(
        &mut self,
        first: usize,
        dst: DeviceView<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        if self.pending == PendingCopy::Download {
            self.wait()?;
        }
        // SAFETY: no copy writes the allocation (a pending download was
        // waited for above), and `&mut self` keeps the host from writing it
        // while the slice lives.
        let staged =
            &unsafe { host_slice::<T>(self.host, self.capacity, first + dst.len(), "pinned") }?
                [first..];
        if staged.is_empty() {
            return Ok(());
        }
        stream
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: `staged` is pinned host memory owned by `self`, which is
        // not written or freed before `copy_done` (recorded next) completes:
        // every mutable access and the destructor wait for it first. `dst` is
        // device memory, so a stale view cannot corrupt host memory.
        unsafe { result::memcpy_htod_async(dst.device_ptr(), staged, stream.cu_stream()) }
            .in_call("cuMemcpyHtoDAsync")?;
        self.record_copy(stream, PendingCopy::Upload)
    }

    /// Stages `data` and uploads it to `dst` (which must hold `data.len()`
    /// elements), asynchronously on `stream`.
    pub fn upload_slice<T: DeviceScalar>(
        &mut self,
        data: &[T],
        dst: DeviceView<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        if dst.len() != data.len() {
            return Err(CudaError::BadArgument(format!(
                "uploading {} elements into a device view of {}",
                data.len(),
                dst.len()
            )));
        }
        self.host_mut::<T>(data.len())?.copy_from_slice(data);
        self.upload(dst, stream)
    }

    /// Copies `src` into the first `src.len()` elements of the buffer,
    /// asynchronously on `stream`; read them with
    /// [`host`](PinnedBuffer::host), which waits for the copy.
    pub fn download<T: DeviceScalar>(
        &mut self,
        src: DeviceView<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let staging = self.host_mut::<T>(src.len())?;
        if staging.is_empty() {
            return Ok(());
        }
        stream
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: `staging` is pinned host memory owned by `self` and large
        // enough; nothing reads, writes or frees it before `copy_done`
        // (recorded next) completes, as every access waits for it first.
        unsafe { result::memcpy_dtoh_async(staging, src.device_ptr(), stream.cu_stream()) }
            .in_call("cuMemcpyDtoHAsync")?;
        self.record_copy(stream, PendingCopy::Download)
    }

    /// Downloads `src` and returns it once the copy has finished.
    pub fn download_to_vec<T: DeviceScalar>(
        &mut self,
        src: DeviceView<T>,
        stream: &CudaStream,
    ) -> Result<Vec<T>> {
        self.download(src, stream)?;
        Ok(self.host::<T>(src.len())?.to_vec())
    }

    /// Records the copy (`copy`) just issued on `stream`.
    fn record_copy(&mut self, stream: &CudaStream, copy: PendingCopy) -> Result<()> {
        if let Err(e) = self.copy_done.record(stream).in_call("cuEventRecord") {
            // Without the event, later host accesses could not wait for the
            // copy just issued: wait for it here instead.
            stream.synchronize().in_call("cuStreamSynchronize")?;
            return Err(e);
        }
        self.pending = copy;
        Ok(())
    }

    /// Ensures at least `bytes` are allocated, growing geometrically.
    /// The caller has waited for pending copies.
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.capacity {
            return Ok(());
        }
        let new_capacity = bytes.max(self.capacity.saturating_mul(2));
        self.free_host()?;
        self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        // SAFETY: a plain page-locked allocation; flags 0 (not write-combined,
        // not mapped, not portable). The memory is uninitialised, which is
        // fine for f32/u32 staging: every bit pattern is valid.
        let host = unsafe { result::malloc_host(new_capacity, 0) }.in_call("cuMemHostAlloc")?;
        self.host = NonNull::new(host.cast::<u8>());
        self.capacity = if self.host.is_some() { new_capacity } else { 0 };
        Ok(())
    }

    fn free_host(&mut self) -> Result<()> {
        if let Some(host) = self.host.take() {
            self.capacity = 0;
            self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
            // SAFETY: `host` came from `cuMemHostAlloc` and is freed once
            // (taken out of `self.host`); pending copies were waited for.
            unsafe { result::free_host(host.as_ptr().cast::<c_void>()) }
                .in_call("cuMemFreeHost")?;
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            // Freeing memory a copy may still use would be unsound: leak it.
            eprintln!("ramus-cuda: leaking a pinned buffer whose copy failed: {e}");
            return;
        }
        if let Err(e) = self.free_host() {
            eprintln!("ramus-cuda: could not free a pinned buffer: {e}");
        }
    }
}

/// The first `len` elements of a page-aligned host allocation of
/// `capacity` bytes (`what` names the buffer kind in the error).
///
/// # Safety
/// Nothing may write the allocation while the slice lives.
unsafe fn host_slice<'a, T: DeviceScalar>(
    host: Option<NonNull<u8>>,
    capacity: usize,
    len: usize,
    what: &str,
) -> Result<&'a [T]> {
    let bytes = byte_len::<T>(len)?;
    if bytes > capacity {
        return Err(CudaError::BadArgument(format!(
            "{len} elements ({bytes} bytes) read from a {what} buffer of {capacity} bytes"
        )));
    }
    let Some(host) = host else {
        return Ok(&[]);
    };
    // SAFETY: in bounds (checked above) of a page-aligned (so aligned for
    // `T`) allocation nothing writes (the caller's contract); `T` is f32 or
    // u32, valid for any bit pattern.
    Ok(unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<T>(), len) })
}

fn byte_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| CudaError::BadArgument(format!("{len} elements overflow the address space")))
}

/// A pinned host buffer mapped into the device's address space: a kernel
/// writes results straight into it (no copy to issue), and the host reads
/// them once the stream that ran the kernel has finished. Small outputs
/// (the compiled engine's root scores) come back this way with one
/// stream synchronization instead of a copy and an event.
#[derive(Debug)]
pub struct MappedBuffer {
    context: Arc<CudaContext>,
    host: Option<NonNull<u8>>,
    device_ptr: u64,
    capacity: usize,
}

// SAFETY: the buffer exclusively owns its mapped allocation; pinned host
// memory may be used from any thread.
unsafe impl Send for MappedBuffer {}
// SAFETY: `&self` methods only read the allocation, after synchronizing
// the stream whose kernels write it.
unsafe impl Sync for MappedBuffer {}

impl MappedBuffer {
    /// An empty buffer on `device`; it allocates when first reserved.
    pub fn new(device: &CudaDevice) -> Self {
        Self {
            context: Arc::clone(device.context()),
            host: None,
            device_ptr: 0,
            capacity: 0,
        }
    }

    /// The device address of the first `len` elements of type `T` for a
    /// kernel on `stream` to write, growing the buffer if needed (after
    /// waiting for the stream, so no running kernel writes a freed
    /// allocation; growing does not keep the old contents).
    pub fn device_ptr_for<T: DeviceScalar>(
        &mut self,
        len: usize,
        stream: &CudaStream,
    ) -> Result<u64> {
        let bytes = byte_len::<T>(len)?.max(1);
        if bytes > self.capacity {
            stream.synchronize().in_call("cuStreamSynchronize")?;
            self.free_host()?;
            let new_capacity = bytes.max(self.capacity.saturating_mul(2)).max(256);
            self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
            // SAFETY: a page-locked allocation mapped into the device's
            // address space; uninitialised, which is fine for f32/u32: every
            // bit pattern is valid.
            let host = unsafe {
                result::malloc_host(new_capacity, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP)
            }
            .in_call("cuMemHostAlloc(DEVICEMAP)")?;
            self.host = NonNull::new(host.cast::<u8>());
            let mut device_ptr = 0;
            // SAFETY: `host` is a live mapped allocation from the call above;
            // flags must be 0.
            unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host, 0) }
                .result()
                .in_call("cuMemHostGetDevicePointer")?;
            self.device_ptr = device_ptr;
            self.capacity = if self.host.is_some() { new_capacity } else { 0 };
        }
        Ok(self.device_ptr)
    }

    /// Waits for `stream` (whose kernels write the buffer) and returns the
    /// first `len` elements.
    pub fn read<T: DeviceScalar>(&self, len: usize, stream: &CudaStream) -> Result<&[T]> {
        stream.synchronize().in_call("cuStreamSynchronize")?;
        // SAFETY: the stream that writes the allocation has finished
        // (synchronized above) and `&self` excludes a concurrent
        // `device_ptr_for` (the only way to hand out an address to write).
        unsafe { host_slice(self.host, self.capacity, len, "mapped") }
    }

    fn free_host(&mut self) -> Result<()> {
        if let Some(host) = self.host.take() {
            self.capacity = 0;
            self.device_ptr = 0;
            self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
            // SAFETY: `host` came from `cuMemHostAlloc` and is freed once;
            // the callers waited for the kernels that write it.
            unsafe { result::free_host(host.as_ptr().cast::<c_void>()) }
                .in_call("cuMemFreeHost")?;
        }
        Ok(())
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        // a kernel still writing the allocation would write freed memory
        if let Err(e) = self.context.synchronize() {
            eprintln!("ramus-cuda: leaking a mapped buffer whose device did not finish: {e}");
            return;
        }
        if let Err(e) = self.free_host() {
            eprintln!("ramus-cuda: could not free a mapped buffer: {e}");
        }
    }
}
