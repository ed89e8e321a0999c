//! Errors of the CUDA layer: one enum for missing libraries, failed driver /
//! NVRTC / cuBLAS calls (each naming the call), kernel compilation failures
//! (with NVRTC's log), pool exhaustion and bad arguments.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Everything that can go wrong in `ramus-cuda`. Nothing in this crate panics
/// on a user-reachable path; it returns one of these instead.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// A CUDA shared library could not be loaded.
    #[error("{library} could not be loaded: {help}")]
    LibraryMissing {
        /// The library, e.g. `libcuda (the CUDA driver)`.
        library: &'static str,
        /// What to install or set so that it can be found.
        help: &'static str,
    },
    /// The driver has no device with this ordinal.
    #[error("no CUDA device with ordinal {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    /// A CUDA driver API call failed.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        call: &'static str,
        source: DriverError,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC call {call} failed: {source}")]
    Nvrtc {
        call: &'static str,
        source: NvrtcError,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile kernel(s) {kernels} for {target}; compiler log:\n{log}")]
    Compile {
        /// The kernels the source was meant to provide, comma-separated.
        kernels: String,
        /// The `--gpu-architecture` it was compiled for.
        target: String,
        log: String,
    },
    /// A compiled module does not contain a requested kernel.
    #[error(
        "kernel `{name}` is not in the compiled module (is it declared `extern \"C\" __global__`?)"
    )]
    KernelNotFound { name: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {source}")]
    Blas {
        call: &'static str,
        source: CublasError,
    },
    /// The device memory pool could not provide a block.
    #[error(
        "device memory pool exhausted: asked for {requested} bytes, {free} bytes free in a pool \
         of {pool_size} bytes, and the pool cannot grow (device full or pool budget reached); \
         lower the batch size or raise the pool budget"
    )]
    OutOfPoolMemory {
        requested: u64,
        free: u64,
        pool_size: u64,
    },
    /// A run whose buffers cannot fit the device, refused by its
    /// [`ramus_exec::memory::DeviceCheck`] before they were allocated (the
    /// message names what to change).
    #[error("{0}")]
    DoesNotFit(String),
    /// NCCL is missing, or an NCCL call failed (the message names the
    /// library paths, or the call and the rank).
    #[error("NCCL: {0}")]
    Nccl(String),
    /// An argument is out of range or inconsistent (the message says which).
    #[error("bad argument: {0}")]
    BadArgument(String),
    /// A model or batch the CUDA engine cannot run (the message names the
    /// op, node or input).
    #[error("{0}")]
    Model(String),
    /// The swap path could not carry out an iteration (names the op, the
    /// tensor and the budget, or the plan action).
    #[error(transparent)]
    Swap(#[from] ramus_swap::ExecutorError),
}

impl From<ramus_core::CoreError> for CudaError {
    fn from(e: ramus_core::CoreError) -> Self {
        CudaError::Model(e.to_string())
    }
}

impl From<ramus_graph::GraphError> for CudaError {
    fn from(e: ramus_graph::GraphError) -> Self {
        CudaError::Model(e.to_string())
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Names the failing call when turning a cudarc error into a [`CudaError`]:
/// `stream.synchronize().in_call("cuStreamSynchronize")?`.
pub trait InCall<T> {
    fn in_call(self, call: &'static str) -> Result<T>;
}

impl<T> InCall<T> for std::result::Result<T, DriverError> {
    fn in_call(self, call: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Driver { call, source })
    }
}

impl<T> InCall<T> for std::result::Result<T, NvrtcError> {
    fn in_call(self, call: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Nvrtc { call, source })
    }
}

impl<T> InCall<T> for std::result::Result<T, CublasError> {
    fn in_call(self, call: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Blas { call, source })
    }
}

/// A model- or batch-level failure (a missing buffer, a tensor over the
/// budget, a step the engine cannot run): [`CudaError::Model`].
pub(crate) fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_failed() {
        let e = CudaError::OutOfPoolMemory {
            requested: 1024,
            free: 512,
            pool_size: 4096,
        };
        let text = e.to_string();
        assert!(text.contains("1024") && text.contains("512") && text.contains("4096"));

        let e = CudaError::Compile {
            kernels: "saxpy".into(),
            target: "sm_90".into(),
            log: "error: expected a \";\"".into(),
        };
        let text = e.to_string();
        assert!(text.contains("saxpy") && text.contains("sm_90") && text.contains("expected"));
    }
}
