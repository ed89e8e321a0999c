//! Whether the CUDA cases can run here: a driver that loads. Without one
//! each test says so once, on stderr (which the test harness does not
//! capture, so CI logs show what was skipped).

use std::io::Write;

/// Whether a CUDA driver is usable; otherwise prints
/// `"{skip}: no CUDA driver: …"` and returns `false`.
pub fn cuda_ready(skip: &str) -> bool {
    match ramus_cuda::CudaDevice::available() {
        Ok(()) => true,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{skip}: no CUDA driver: {e}");
            false
        }
    }
}

/// Whether a CUDA driver is usable, asked once per process; the first
/// call without one prints that the CUDA cases are skipped.
pub fn cuda_available() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| cuda_ready("skipping the CUDA cases"))
}
