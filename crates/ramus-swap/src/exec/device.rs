//! The device side of the executor: what it asks of a device, and why it
//! stops.

use crate::cost::human_bytes;
use crate::trace::TensorId;

/// What the executor asks of a device. Implementations queue work
/// asynchronously where they can; the executor orders it.
pub trait SwapDevice {
    /// The device's error; executor errors convert into it.
    type Error: From<ExecutorError>;

    /// The device's own memory limit, for error messages (`None`: none).
    fn budget_bytes(&self) -> Option<u64> {
        None
    }

    /// Reserves `bytes` of device memory for `tensor`. `Ok(false)` when
    /// they do not fit now (the executor then makes room and asks again).
    fn allocate(&mut self, tensor: TensorId, bytes: u64) -> Result<bool, Self::Error>;

    /// Returns `tensor`'s device memory. The executor calls it once no
    /// device work issued later can conflict: after the tensor's last op
    /// was queued on the compute stream, or after its offload completed.
    fn release(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues the copy of `tensor` to its host slot on the device→host
    /// stream, after everything queued on the compute stream so far.
    fn offload(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Whether `tensor`'s last offload has completed, without blocking.
    fn offload_complete(&mut self, tensor: TensorId) -> Result<bool, Self::Error>;

    /// Blocks until `tensor`'s last offload has completed.
    fn wait_offload(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues the copy of `tensor`'s host slot into its (just allocated)
    /// device memory on the host→device stream, after its offload and
    /// after everything queued on the compute stream so far (the memory
    /// may have been another tensor's).
    fn prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Makes the compute stream wait for `tensor`'s prefetch (on the
    /// device; the host does not block).
    fn await_prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Blocks until `tensor`'s prefetch has completed.
    fn wait_prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues op `op` on the compute stream; every tensor it uses is
    /// allocated and every one it reads is on the device (or awaited).
    fn run_op(&mut self, op: usize) -> Result<(), Self::Error>;

    /// Layout mode (a plan with a [`Layout`](crate::Layout)): reserves the
    /// arena of `bytes` in which every tensor of the iteration is placed.
    /// A device that cannot place tensors refuses.
    fn reserve_arena(&mut self, bytes: u64) -> Result<(), Self::Error> {
        Err(ExecutorError::Mismatch(format!(
            "the plan places its tensors in an arena of {bytes} bytes; this device cannot \
             place tensors at offsets"
        ))
        .into())
    }

    /// Layout mode: gives `tensor` the `bytes` at `offset` of the arena.
    /// No tensor the executor holds there overlaps them; memory released
    /// while an offload still read it is ordered by
    /// [`SwapDevice::order_after_offload`].
    fn allocate_at(
        &mut self,
        tensor: TensorId,
        offset: u64,
        bytes: u64,
    ) -> Result<(), Self::Error> {
        let _ = (offset, bytes);
        Err(ExecutorError::Mismatch(format!(
            "tensor {tensor} placed at an offset on a device that cannot place tensors"
        ))
        .into())
    }

    /// Layout mode: releases `tensor`'s device memory while its offload
    /// may still be reading it (the executor orders every later write into
    /// that memory after the offload). By default the host waits for the
    /// offload and releases the memory then.
    fn release_offloading(&mut self, tensor: TensorId) -> Result<(), Self::Error> {
        self.wait_offload(tensor)?;
        self.release(tensor)
    }

    /// Layout mode: every write into `tensor`'s just placed memory — its
    /// prefetch, or the op that first writes it — must wait on the device
    /// for `previous`'s last offload, which may still read that memory
    /// ([`SwapDevice::release_offloading`] released it). By default
    /// nothing: the default `release_offloading` waited already.
    fn order_after_offload(
        &mut self,
        tensor: TensorId,
        previous: TensorId,
    ) -> Result<(), Self::Error> {
        let _ = (tensor, previous);
        Ok(())
    }

    /// Layout mode: returns the arena once the iteration's copies have
    /// completed and its tensors are released.
    fn release_arena(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Why the executor cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecutorError {
    /// An allocation that neither the budget nor the device can hold.
    #[error(
        "op {op} `{op_name}`: tensor {tensor} `{tensor_name}` ({bytes} bytes, {}) does not fit: \
         {resident} bytes ({}) are resident and the device memory budget is {}{}",
        human_bytes(*.bytes),
        human_bytes(*.resident),
        .budget.map_or("the device's memory".to_string(), |b| format!("{b} bytes ({})", human_bytes(b))),
        .hint
    )]
    OutOfMemory {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The tensor being allocated.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Its size.
        bytes: u64,
        /// Bytes resident (the executor's accounting).
        resident: u64,
        /// The budget, if one is known.
        budget: Option<u64>,
        /// What to do about it.
        hint: String,
    },
    /// An op uses a tensor that is not on the device and nothing brings it back.
    #[error(
        "op {op} `{op_name}` uses tensor {tensor} `{tensor_name}`, which is {state}: the plan \
         does not bring it back before the op"
    )]
    NotResident {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Where it is instead.
        state: String,
    },
    /// A plan action that cannot be carried out.
    #[error("plan action {index} ({action}): {message}")]
    InvalidAction {
        /// Index into the plan's actions.
        index: usize,
        /// The action, briefly.
        action: String,
        /// What is wrong.
        message: String,
    },
    /// The plan was made for another trace or asks for what this executor
    /// does not do.
    #[error("the swap plan does not fit this iteration: {0}")]
    Mismatch(String),
    /// A device found its orders inconsistent (the simulated device's
    /// checks), or failed.
    #[error("device{}: {message}", .op.map_or(String::new(), |op| format!(" at op {op}")))]
    Device {
        /// The op being prepared or run, if any.
        op: Option<usize>,
        /// What happened.
        message: String,
    },
}
