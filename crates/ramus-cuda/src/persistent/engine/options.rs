//! How a [`PersistentEngine`](super::PersistentEngine) is set up and what
//! one batch reports: its options, the item thresholds and environment
//! variables that tune it, and the step it returns.

use std::path::PathBuf;

use ramus_codegen::persistent::UpdateRule;
use ramus_exec::OptimizerKind;

use crate::error::{CudaError, Result};

/// How to set up a [`PersistentEngine`](super::PersistentEngine).
#[derive(Clone, Debug, Default)]
pub struct PersistentOptions {
    /// Device ordinal.
    pub device: usize,
    /// Rows per warp of the register partitions (default: the choice of
    /// the profile-guided search, remembered in the kernel cache).
    pub rpw: Option<usize>,
    /// CTAs per SM (default: chosen from the weights' size).
    pub ctas_per_sm: Option<usize>,
    /// Kernel cache directory (default: the user cache).
    pub cache_dir: Option<PathBuf>,
    /// Keep the weight gradients in registers (default: where they fit);
    /// without, the outer products go to cuBLAS after the kernel and a
    /// second launch updates the cached matrices (VPPS §III-C2).
    pub grads_in_registers: Option<bool>,
    /// Items from which a product instruction runs as a tiled GEMM over
    /// its matrix's holders instead of on the held rows (default:
    /// [`WIDE_PRODUCT_ITEMS`](ramus_core::vpps::WIDE_PRODUCT_ITEMS), or the `RAMUS_VPPS_WIDE` environment
    /// variable for tuning; `Some(u32::MAX)`: never).
    pub wide_items: Option<u32>,
    /// Items from which a level's product (or, with register gradients, a
    /// weight-gradient product) runs as one cuBLAS GEMM between two
    /// launches of the kernel instead of inside it (default:
    /// [`HOST_PRODUCT_ITEMS`], or the `RAMUS_VPPS_HOST` environment
    /// variable for tuning; `Some(usize::MAX)`: never).
    pub host_items: Option<usize>,
    /// The batch size the engine will train on, if known. The `rpw`
    /// search times the first batches submitted, so its choice suits their
    /// size: a choice is remembered per batch-size class (powers of two),
    /// and a later run of another class searches again: the best plan for
    /// a batch of 1 is not the best for 128
    /// (`docs/benchmarks.md#persistent-engine-rpw-search`).
    pub batch_size: Option<usize>,
    /// Where the kernel must be compiled (no cached image), train the first
    /// batches on a bridge kernel, the same source compiled in a fraction
    /// of the time ([`PersistentKernel::bridge`](crate::persistent::PersistentKernel::bridge)), while the kernel proper
    /// compiles on other threads (default: yes, unless tracing; NVRTC
    /// older than 12.8 cannot, and then set-up waits for the kernel).
    pub bridge: Option<bool>,
    /// Device memory the engine may take at most (its pool's budget, and
    /// what [`PersistentEngine::with_check`](super::PersistentEngine::with_check) checks against besides the
    /// free memory); `None`: as much as the device has free.
    pub memory_budget: Option<u64>,
}

/// The key of a remembered `rpw` choice: `base` (model, kernel, device
/// and options) and the batch-size class, the power of two at or above
/// [`PersistentOptions::batch_size`]; without one, `base` alone (the key
/// of earlier versions).
pub(super) fn choice_key(base: String, batch_size: Option<usize>) -> String {
    match batch_size {
        Some(b) => format!("{base}|batch {}", b.max(1).next_power_of_two()),
        None => base,
    }
}

/// What one training batch did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PersistentStep {
    /// Mean loss over the batch's head rows (NaN until the batch is back).
    pub loss: f64,
    /// Host seconds to schedule, lower and encode the batch.
    pub host_seconds: f64,
    /// Device seconds of the batch's kernel launches (NaN until it is back).
    pub kernel_seconds: f64,
    /// Instructions of tasks (before merging) and barrier levels.
    pub tasks: usize,
    pub levels: usize,
    /// An update met a non-finite gradient or value (the kernel's fault
    /// word; false until the batch is back).
    pub nonfinite: bool,
}

/// Items from which a product is host work between launches (see
/// [`PersistentOptions::host_items`]): cuBLAS runs a wide level's product
/// faster than the kernel's tiles (which share the SMs with the held
/// weights), once that saves more than a launch costs; 512 was about the
/// best of the thresholds swept at h 256 and 512
/// (`docs/benchmarks.md#persistent-engine-host-products`).
pub const HOST_PRODUCT_ITEMS: usize = 512;

/// The environment variable that overrides [`HOST_PRODUCT_ITEMS`] (for
/// tuning; see [`PersistentOptions::host_items`]).
pub const HOST_ENV: &str = "RAMUS_VPPS_HOST";

/// The environment variable that overrides [`WIDE_PRODUCT_ITEMS`] (for
/// tuning; see [`PersistentOptions::wide_items`]).
pub const WIDE_ENV: &str = "RAMUS_VPPS_WIDE";

/// The environment variable that, set to `scalar`, builds every kernel
/// with the wide products' scalar epilogue (for tuning and diagnosis; see
/// [`KernelOptions::vector_epilogue`](ramus_codegen::persistent::KernelOptions::vector_epilogue)).
pub const EPILOGUE_ENV: &str = "RAMUS_VPPS_EPILOGUE";

/// The environment variable that turns the persistent kernel's instruction
/// trace on: a file each launch's records are appended to.
pub const TRACE_ENV: &str = "RAMUS_VPPS_TRACE";

pub(super) fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

/// An item threshold: `given`, else the environment variable `env` (for
/// tuning; an error names a value that is not a number), else `default`.
pub(super) fn items_option<T: std::str::FromStr>(
    given: Option<T>,
    env: &str,
    default: T,
) -> Result<T> {
    if let Some(items) = given {
        return Ok(items);
    }
    match std::env::var(env) {
        Ok(v) => v
            .trim()
            .parse::<T>()
            .map_err(|_| CudaError::BadArgument(format!("{env}={v:?} is not a number of items"))),
        Err(_) => Ok(default),
    }
}

pub(super) fn rule_of(kind: OptimizerKind) -> UpdateRule {
    match kind {
        OptimizerKind::Sgd => UpdateRule::Sgd,
        OptimizerKind::Adagrad => UpdateRule::Adagrad,
        OptimizerKind::Adam => UpdateRule::Adam,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_is_remembered_per_power_of_two_of_batch_size() {
        let key = |b| choice_key("model".to_string(), b);
        // no batch size: the key of earlier versions
        assert_eq!(key(None), "model");
        assert_eq!(key(Some(5)), key(Some(8)));
        assert_eq!(key(Some(0)), key(Some(1)));
        assert_ne!(key(Some(8)), key(Some(9)));
        assert_ne!(key(Some(1)), key(Some(2)));
        assert_ne!(key(Some(128)), key(None));
    }
}
