//! What each CUDA engine will allocate on its device, worked out before it
//! allocates anything large ([`DeviceNeed`]), and the room it has
//! ([`device_room`]): the batched engine's need here, the persistent and
//! compiled engines' next to their allocation code
//! (`persistent/memory.rs`, `compiled/memory.rs`), each from the same
//! sizing functions the engine allocates with.
//!
//! The batched engine is checked once it exists (it allocates nothing
//! large until its first batch, see [`crate::CudaEngine::memory_room`]);
//! the persistent and compiled engines take a [`DeviceCheck`] at
//! construction and call it right after opening the device, before their
//! pools hold anything, refusing the run with its message
//! ([`CudaError::DoesNotFit`]) when it does not fit.
//!
//! Counted: every pool buffer the engine allocates, at the pool's aligned
//! sizes, and the local memory the driver takes for a kernel that spills
//! (the compiled engine's level kernel, the persistent engine's bridge
//! kernel). Not counted: the kernels' code and the driver's own
//! reservations (a few MiB, loaded as the kernels are), cuBLAS's
//! workspaces, and the pool's geometric growth beyond what is in use (when
//! the device is short the pool takes just the size asked for).

use ramus_core::Model;
use ramus_exec::memory::{training_state, ActivationCost, DeviceNeed, DeviceRoom, Fitted, Pass};
use ramus_exec::OptimizerKind;
use ramus_swap::human_bytes;

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::offset_allocator::aligned_size;
use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR;

pub use ramus_exec::memory::DeviceCheck;

/// Bytes of a pool block of `elements` 4-byte elements (the pool aligns
/// every block; engines ask for at least one element).
pub fn block_bytes(elements: usize) -> u64 {
    aligned_size(4 * elements.max(1) as u64).unwrap_or(u64::MAX)
}

/// The room an engine on `device` has: its free memory, within `budget`.
pub fn device_room(device: &CudaDevice, budget: Option<u64>) -> Result<DeviceRoom> {
    Ok(DeviceRoom {
        free: device.free_memory()? as u64,
        budget,
    })
}

/// Local memory the driver takes for a kernel that spills `per_thread`
/// bytes: as much for every thread the device can hold at once.
pub fn local_memory_bytes(device: &CudaDevice, per_thread: u64) -> Result<u64> {
    if per_thread == 0 {
        return Ok(0);
    }
    let threads = device
        .context()
        .attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)
        .in_call("cuDeviceGetAttribute")?;
    let threads = u64::try_from(threads).unwrap_or(0);
    Ok(per_thread * threads * u64::from(device.sm_count()))
}

/// Runs `check` on `need` with `room`; a refusal is [`CudaError::DoesNotFit`].
pub fn run_check(check: DeviceCheck<'_>, need: &DeviceNeed, room: DeviceRoom) -> Result<Fitted> {
    check(need, room).map_err(CudaError::DoesNotFit)
}

/// The check of a caller that knows nothing of the batches to come (an
/// engine made with `new`): the model-sized parts must fit.
pub fn model_fits(need: &DeviceNeed, room: DeviceRoom) -> std::result::Result<Fitted, String> {
    let parts = need.parts_bytes();
    if parts <= room.bytes() {
        return Ok(Fitted::default());
    }
    let listed: Vec<String> = need
        .parts
        .iter()
        .filter(|p| p.1 > 0)
        .map(|(what, b)| format!("{what} {}", human_bytes(*b)))
        .collect();
    let limit = match room.budget {
        Some(b) if b < room.free => format!("the budget of {}", human_bytes(b)),
        _ => format!("the {} the device has free", human_bytes(room.free)),
    };
    Err(format!(
        "device memory: the {} engine needs {} for the model ({}), more than {limit}",
        need.engine,
        human_bytes(parts),
        listed.join(" + ")
    ))
}

/// What the batched engine allocates: the parameters and their gradient
/// buffer (`sync_params`), with `optimizer` (a training run) its fused
/// optimizer's state, and a batch arena of `pass`'s activations
/// ([`ActivationCost::new`]; a training run's evaluation batches reuse
/// it).
pub fn batched_need(model: &Model, optimizer: Option<OptimizerKind>, pass: Pass) -> DeviceNeed {
    let parts = match optimizer {
        Some(kind) => training_state(model, kind),
        None => {
            let p = ramus_exec::memory::param_bytes(model);
            vec![("parameters", p), ("gradients", p)]
        }
    };
    let (train, eval) = match (pass, optimizer) {
        (Pass::Train, Some(_)) => (Some(Pass::Train), Some(Pass::Evaluate)),
        (Pass::Train, None) => (Some(Pass::Train), None),
        (pass, _) => (None, Some(pass)),
    };
    DeviceNeed {
        engine: "cuda-batched",
        parts,
        train: train.map(|p| ActivationCost::new(model, p)),
        eval: eval.map(|p| ActivationCost::new(model, p)),
        train_kept: false,
        train_extra: None,
        eval_extra: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_nn::{build_model, ModelConfig};

    #[test]
    fn blocks_are_aligned_and_never_empty() {
        let align = crate::ALIGNMENT;
        assert_eq!(block_bytes(0), align);
        assert_eq!(block_bytes(1), align);
        assert_eq!(block_bytes(align as usize / 4 + 1), 2 * align);
    }

    #[test]
    fn the_model_must_fit_without_batches_and_the_budget_is_named() {
        let cfg = ModelConfig {
            vocab: 10,
            hidden: 64,
            classes: 5,
        };
        let model = build_model("treelstm", &cfg).unwrap();
        let n = batched_need(&model, Some(OptimizerKind::Adam), Pass::Train);
        // parameters, gradients and Adam's two moments
        let parts = n.parts_bytes();
        assert_eq!(parts, 4 * ramus_exec::memory::param_bytes(&model));
        let room = |free, budget| DeviceRoom { free, budget };
        assert!(model_fits(&n, room(parts, None)).is_ok());
        let e = model_fits(&n, room(parts - 1, None)).unwrap_err();
        assert!(
            e.contains("device has free") && e.contains("cuda-batched"),
            "{e}"
        );
        let e = model_fits(&n, room(1 << 40, Some(parts / 2))).unwrap_err();
        assert!(e.contains("the budget of"), "{e}");
        assert!(n.train.is_some() && n.eval.is_some());
        let inference = batched_need(&model, None, Pass::Infer);
        assert_eq!(inference.parts_bytes(), parts / 2);
        assert!(inference.train.is_none() && inference.eval.is_some());
    }
}
