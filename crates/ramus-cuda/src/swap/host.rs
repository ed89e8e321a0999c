//! The pinned host backing store of offloaded tensors: one page-locked
//! slot per tensor, allocated the first time the tensor leaves the device
//! and kept for later iterations.
//!
//! A slot does no synchronisation of its own: the swap path orders every
//! copy into or out of it with events (an offload after the compute that
//! wrote the tensor, a prefetch after that offload; a slot is written again
//! only after the compute stream waited for the prefetch that read it), and
//! drains both copy streams before any slot is freed.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};

/// One pinned host allocation (flags 0: cached, not write-combined, since
/// the device both writes and reads it back).
#[derive(Debug)]
pub(crate) struct HostSlot {
    context: Arc<CudaContext>,
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the slot exclusively owns its pinned allocation (like a
// `Box<[u8]>`); pinned host memory may be used from any thread.
unsafe impl Send for HostSlot {}

impl HostSlot {
    /// A slot of `bytes` (at least one) on `device`.
    pub(crate) fn new(device: &CudaDevice, bytes: usize) -> Result<HostSlot> {
        let bytes = bytes.max(1);
        device
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: a plain page-locked allocation with flags 0; the memory is
        // uninitialised bytes, only ever written by device-to-host copies
        // before a host-to-device copy reads them.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.in_call("cuMemHostAlloc")?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| {
            CudaError::BadArgument(format!("cuMemHostAlloc returned null for {bytes} bytes"))
        })?;
        Ok(HostSlot {
            context: Arc::clone(device.context()),
            ptr,
            bytes,
        })
    }

    /// Capacity in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    fn check(&self, bytes: usize) -> Result<()> {
        if bytes > self.bytes {
            return Err(CudaError::BadArgument(format!(
                "a copy of {bytes} bytes through a host slot of {} bytes",
                self.bytes
            )));
        }
        Ok(())
    }

    /// Queues a copy of `bytes` from device address `src` into the slot on
    /// `stream`.
    ///
    /// # Safety
    ///
    /// `src` must be live device memory of at least `bytes` for as long as
    /// the copy runs, and nothing may read or write the slot (host or
    /// device) until the copy has completed, nor free it before then.
    pub(crate) unsafe fn copy_from_device(
        &self,
        src: u64,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check(bytes)?;
        stream
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: the slot holds at least `bytes` (checked above) of pinned
        // memory owned by `self`; the caller guarantees exclusive use of it
        // until the copy completes and that `src` is live device memory.
        unsafe {
            let host = std::slice::from_raw_parts_mut(self.ptr.as_ptr(), bytes);
            result::memcpy_dtoh_async(host, src, stream.cu_stream())
        }
        .in_call("cuMemcpyDtoHAsync")
    }

    /// Queues a copy of the slot's first `bytes` to device address `dst` on
    /// `stream`.
    ///
    /// # Safety
    ///
    /// `dst` must be live device memory of at least `bytes` that nothing
    /// else uses until the copy has completed, and the slot must not be
    /// written or freed before then.
    pub(crate) unsafe fn copy_to_device(
        &self,
        dst: u64,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check(bytes)?;
        stream
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: the slot holds at least `bytes` (checked above) and the
        // caller guarantees it is not written or freed until the copy
        // completes, and that `dst` is live device memory.
        unsafe {
            let host = std::slice::from_raw_parts(self.ptr.as_ptr().cast_const(), bytes);
            result::memcpy_htod_async(dst, host, stream.cu_stream())
        }
        .in_call("cuMemcpyHtoDAsync")
    }
}

impl Drop for HostSlot {
    fn drop(&mut self) {
        if let Err(e) = self.context.bind_to_thread() {
            eprintln!("ramus-cuda: could not free a pinned host slot: {e}");
            return;
        }
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once; the
        // owner drained every copy that used the slot before dropping it.
        if let Err(e) = unsafe { result::free_host(self.ptr.as_ptr().cast::<c_void>()) } {
            eprintln!("ramus-cuda: could not free a pinned host slot: {e}");
        }
    }
}
