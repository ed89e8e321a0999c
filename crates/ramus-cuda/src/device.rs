//! The device: checks that the CUDA libraries can be loaded, owns the CUDA
//! context and the main stream, creates further streams and events, and
//! reports the device's properties (name, compute capability, memory, SMs).

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::{CudaError, InCall, Result};

/// One opened GPU: a CUDA context plus the stream that engines submit to by
/// default. Shared as `Arc<CudaDevice>`; everything allocated or compiled for
/// the device keeps its context alive.
#[derive(Debug)]
pub struct CudaDevice {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (u32, u32),
    total_memory: usize,
    sm_count: u32,
}

/// A device's properties as [`CudaDevice::probe`] reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
}

impl CudaDevice {
    /// Whether CUDA can be used here: the driver, NVRTC and cuBLAS libraries
    /// load and the driver reports at least one device. Tests and callers use
    /// it to decide whether to skip; the error says what is missing.
    pub fn available() -> Result<()> {
        check_libraries()?;
        match device_count()? {
            0 => Err(CudaError::NoDevice {
                ordinal: 0,
                count: 0,
            }),
            _ => Ok(()),
        }
    }

    /// What code for device `ordinal` is compiled for, read without a
    /// context: cheap next to [`open`](Self::open), so that a caller can
    /// compile while another thread opens the device.
    pub fn probe(ordinal: usize) -> Result<DeviceFacts> {
        // The driver first, NVRTC once the facts are read: a thread running
        // `open` beside this one loads NVRTC while this one waits for
        // `cuInit` (each reads about 100 MB where the page cache does not
        // hold them yet, as on a machine's first CUDA program since boot).
        // Not cuBLAS: the first `Blas` loads it.
        check_driver()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let dev = i32::try_from(ordinal)
            .map_err(|_| CudaError::NoDevice { ordinal, count })
            .and_then(|o| cudarc::driver::result::device::get(o).in_call("cuDeviceGet"))?;
        let attribute = |a: CUdevice_attribute| {
            // SAFETY: `dev` is a device handle the driver just returned and
            // `a` a valid attribute; the call only reads.
            unsafe { cudarc::driver::result::device::get_attribute(dev, a) }
                .in_call("cuDeviceGetAttribute")
                .map(non_negative)
        };
        let facts = DeviceFacts {
            name: cudarc::driver::result::device::get_name(dev).in_call("cuDeviceGetName")?,
            compute_capability: (
                attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        };
        check_nvrtc()?;
        Ok(facts)
    }

    /// Opens device `ordinal`: retains its primary context, creates the main
    /// stream and reads the device's properties. cuBLAS is loaded by the
    /// first [`Blas`](crate::Blas) instead: it and cuBLASLt are some 570 MB
    /// to read where the page cache does not hold them yet, which would
    /// delay a compile beside this, and the persistent engine may not need
    /// them at all.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        check_compile_libraries()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let context = CudaContext::new(ordinal).in_call("cuDevicePrimaryCtxRetain")?;
        // A stream of our own rather than the legacy NULL stream: work on it
        // can overlap with other streams and it can be captured into graphs.
        let stream = context.new_stream().in_call("cuStreamCreate")?;
        let name = context.name().in_call("cuDeviceGetName")?;
        let (major, minor) = context
            .compute_capability()
            .in_call("cuDeviceGetAttribute")?;
        let total_memory = context.total_mem().in_call("cuDeviceTotalMem")?;
        let sm_count = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .in_call("cuDeviceGetAttribute")?;
        Ok(Arc::new(Self {
            context,
            stream,
            name,
            compute_capability: (non_negative(major), non_negative(minor)),
            total_memory,
            sm_count: non_negative(sm_count),
        }))
    }

    /// The device's ordinal, as passed to [`CudaDevice::open`].
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// The device's marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// The device's own architecture as NVRTC names it, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.total_memory
    }

    /// Device memory currently free (for every process on the device), in bytes.
    pub fn free_memory(&self) -> Result<usize> {
        let (free, _total) = self.context.mem_get_info().in_call("cuMemGetInfo")?;
        Ok(free)
    }

    /// The CUDA context (for cudarc calls this crate does not wrap).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The main stream: kernels, copies and cuBLAS calls go here unless an
    /// engine orders work on another stream explicitly.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A further non-blocking stream (e.g. for eager work that runs ahead of
    /// the main stream); order it against others with events.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.context.new_stream().in_call("cuStreamCreate")
    }

    /// An event without timing, for ordering streams:
    /// `event.record(&a).in_call("cuEventRecord")?` then
    /// `b.wait(&event).in_call("cuStreamWaitEvent")?` makes later work on `b`
    /// wait for the work recorded on `a`, without blocking the host.
    pub fn new_event(&self) -> Result<CudaEvent> {
        self.context.new_event(None).in_call("cuEventCreate")
    }

    /// Blocks the host until all work on the device has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.context.synchronize().in_call("cuCtxSynchronize")
    }

    /// Runs `work` as the one stretch an attached profiler records (for
    /// `ncu --replay-mode app-range` or `nsys --capture-range=cudaProfilerApi`):
    /// profiling starts before it and stops once the device has finished
    /// everything it queued. Without a profiler attached the calls do nothing.
    pub fn profiled<T, E: From<CudaError>>(
        &self,
        work: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        cudarc::driver::profiler_start().in_call("cuProfilerStart")?;
        let out = work();
        let synced = self.synchronize();
        cudarc::driver::profiler_stop().in_call("cuProfilerStop")?;
        synced?;
        out
    }
}

fn non_negative(value: i32) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

fn device_count() -> Result<usize> {
    let count = CudaContext::device_count().in_call("cuInit / cuDeviceGetCount")?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Loads each CUDA library once per process (cudarc panics when a missing
/// library is first used, so this must run before any CUDA call).
fn check_libraries() -> Result<()> {
    check_compile_libraries()?;
    check_cublas()
}

/// [`check_libraries`] for cuBLAS only, before its first use.
pub(crate) fn check_cublas() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED.get_or_init(find_cublas).clone()
}

/// [`check_libraries`] for the driver and NVRTC only.
fn check_compile_libraries() -> Result<()> {
    check_driver()?;
    check_nvrtc()
}

fn check_driver() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED.get_or_init(find_driver).clone()
}

fn check_nvrtc() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED.get_or_init(find_nvrtc).clone()
}

fn find_driver() -> Result<()> {
    // SAFETY: the check only tries `dlopen` on the library's usual names and
    // closes it again; loading runs the library's initialisers, which for the
    // NVIDIA libraries have no preconditions.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(CudaError::LibraryMissing {
            library: "libcuda (the CUDA driver)",
            help: "install the NVIDIA GPU driver (libcuda.so ships with it); machines without \
                   an NVIDIA GPU cannot run the CUDA engines",
        });
    }
    Ok(())
}

fn find_nvrtc() -> Result<()> {
    // SAFETY: as in `find_driver`.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc {
        return Err(CudaError::LibraryMissing {
            library: "libnvrtc (the CUDA runtime compiler)",
            help: "install the CUDA 13 toolkit's NVRTC (e.g. the cuda-nvrtc-13-0 package) and \
                   put its directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH",
        });
    }
    Ok(())
}

fn find_cublas() -> Result<()> {
    // SAFETY: as in `find_driver`.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    if !cublas {
        return Err(CudaError::LibraryMissing {
            library: "libcublas",
            help: "install the CUDA 13 toolkit's cuBLAS (e.g. the libcublas-13-0 package) and \
                   put its directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH",
        });
    }
    Ok(())
}
