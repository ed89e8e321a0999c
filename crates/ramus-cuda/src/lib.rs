//! Ramus on NVIDIA GPUs: the foundation layers the CUDA engines build on.
//!
//! | layer | module | owns |
//! |---|---|---|
//! | device | [`device`] | library checks, context, main stream, more streams and events, device properties, `sm_XX` |
//! | memory | [`pool`], [`offset_allocator`] | one pool of a few large `cuMemAlloc` chunks, per-batch [`Arena`]s, typed [`DeviceView`]s |
//! | memory checks | [`memory`] | what each engine will allocate ([`ramus_exec::memory::DeviceNeed`]), checked against the device's room before it allocates |
//! | transfers | [`pinned`] | pinned host staging buffers and async host↔device copies |
//! | kernels | [`rtc`], [`cache`] | NVRTC compilation for the device's architecture; the memory + disk kernel cache |
//! | persistent | [`persistent`] | the VPPS persistent training kernel: build (spill and residency checks) and cooperative launch on packed scripts |
//! | optimizer | [`optimizer`] | the fused SGD / Adagrad / Adam(W) step with global-norm clipping, generated per kind |
//! | GEMM | [`blas`] | row-major cuBLAS SGEMM and strided-batched SGEMM on a stream |
//! | swapping | [`swap`] | training past device memory: [`SwapTrainer`], a wrapper around the batched engine with per-tensor pool memory, pinned host slots, copy streams and events executing a swap plan |
//! | errors | [`error`] | [`CudaError`]: every failure, naming the call, the library or the kernel |
//!
//! `cudarc` loads libcuda, libnvrtc and libcublas at run time, so this crate
//! builds without CUDA. [`CudaDevice::available`] says whether CUDA can be
//! used here (and, if not, what is missing); [`CudaDevice::open`] checks the
//! same before the first CUDA call, so a missing library is an error, never a
//! panic. CUDA managed memory is never used: all device memory comes from the
//! pool, and host↔device traffic goes through explicit pinned copies.
//!
//! A typical set-up:
//!
//! ```no_run
//! use ramus_cuda::{default_cache_dir, Blas, CudaDevice, DevicePool, KernelCache, PinnedBuffer, PoolConfig};
//!
//! # fn main() -> ramus_cuda::Result<()> {
//! let device = CudaDevice::open(0)?;
//! let pool = DevicePool::new(&device, PoolConfig::default());
//! let kernels = KernelCache::for_device(&device, default_cache_dir())?;
//! let blas = Blas::new(&device, device.stream().clone())?;
//! let mut staging = PinnedBuffer::new(&device)?;
//! let mut arena = pool.arena(64 << 20);
//! // per batch: stage + upload indices, allocate dynamic tensors from `arena`,
//! // launch kernels from `kernels` and products through `blas`, then:
//! arena.reset()?;
//! # Ok(())
//! # }
//! ```

mod batch;
pub mod blas;
pub mod cache;
pub mod compiled;
pub mod device;
pub mod engine;
pub mod error;
mod infer;
pub mod launch;
pub mod memory;
pub mod nccl;
pub mod offset_allocator;
pub mod optimizer;
pub mod persistent;
pub mod pinned;
pub mod pool;
pub(crate) mod program;
pub mod rtc;
pub mod support;
pub mod swap;

pub use blas::{Blas, Gemm, MathMode, StridedBatch};
pub use cache::{default_cache_dir, normalize_source, KernelCache, KernelCacheStats};
pub use device::{CudaDevice, DeviceFacts};
pub use engine::{CudaEngine, CudaEngineOptions, CudaTrainer};
pub use error::{CudaError, InCall, Result};
pub use offset_allocator::{OffsetAllocator, ALIGNMENT};
pub use optimizer::{
    DeviceOptimizer, DeviceStep, GradLayout, ParamSlot, ParamState, UpdateArgs, UpdateKernelSpec,
};
pub use pinned::PinnedBuffer;
pub use pool::{Arena, DevicePool, DeviceScalar, DeviceView, PoolBuffer, PoolConfig, PoolStats};
pub use program::fusion_listing;
pub use rtc::{CompileTarget, ImageKind, LoadedModule, NvrtcCompiler};
pub use swap::{
    plan_budget, plan_training, resident_plan, segment_rows, training_iteration,
    training_iteration_with, training_trace, OpSpeed, SwapConfig, SwapIteration, SwapMode,
    SwapStepReport, SwapTrainer,
};

/// The cudarc version this crate is built on, for engines that launch
/// kernels (`LaunchConfig`, `PushKernelArg`) and order streams.
pub use cudarc;
