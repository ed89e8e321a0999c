//! Errors of the planners and the simulated device.

use crate::cost::human_bytes;
use crate::trace::{TensorId, TraceError};

/// Why no plan could be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// One op alone needs more than the budget: no plan can exist.
    #[error(
        "op {op} `{op_name}` needs {working_set} bytes ({}) for its own inputs and outputs, \
         more than the device memory budget of {budget} bytes ({}); its largest tensor is \
         {tensor} `{tensor_name}` ({tensor_bytes} bytes)",
        human_bytes(*.working_set),
        human_bytes(*.budget)
    )]
    WorkingSetExceedsBudget {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The op's largest tensor.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Its size.
        tensor_bytes: u64,
        /// Bytes of everything the op reads and writes.
        working_set: u64,
        /// The budget.
        budget: u64,
    },
    /// The op fits by itself, but what must stay resident with it does not.
    #[error(
        "op {op} `{op_name}`: {resident} bytes ({}) must stay resident, more than the device \
         memory budget of {budget} bytes ({}); tensor {tensor} `{tensor_name}` \
         ({tensor_bytes} bytes) is resident and cannot be offloaded: {reason}",
        human_bytes(*.resident),
        human_bytes(*.budget)
    )]
    NoPlan {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The largest resident tensor the op does not use.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Its size.
        tensor_bytes: u64,
        /// Bytes resident at the op after every possible offload.
        resident: u64,
        /// The budget.
        budget: u64,
        /// Why that tensor cannot be offloaded there.
        reason: String,
    },
    /// Profiled placement was asked for, but an op has no measured time.
    #[error(
        "profiled prefetch placement needs a measured duration for every op; op {op} \
         `{op_name}` has none (profile an iteration first, or use earliest placement)"
    )]
    MissingDuration {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
    },
    /// A configuration value out of range.
    #[error("invalid planner configuration: {0}")]
    Config(String),
    /// No plan could be laid out in the memory the budget leaves.
    #[error(
        "no memory layout fits the {arena} bytes ({}) that the device memory budget of {budget} \
         bytes ({}) leaves the iteration's tensors (the last layout needed {laid_out} bytes): \
         {reason}",
        human_bytes(*.arena),
        human_bytes(*.budget)
    )]
    LayoutDoesNotFit {
        /// Bytes of the arena: the budget less the persistent tensors.
        arena: u64,
        /// Bytes the last layout needed.
        laid_out: u64,
        /// The budget.
        budget: u64,
        /// What stopped the planner.
        reason: String,
    },
    /// A layout that does not match its plan (a bug in the planner).
    #[error("internal error: {0}")]
    Layout(#[from] crate::layout::LayoutError),
    /// The trace itself is malformed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The planner's own replay of its plan failed (a bug in the planner).
    #[error("internal error: the plan failed its own replay: {0}")]
    Replay(#[from] SimError),
    /// A plan could not be read from JSON.
    #[error("invalid plan JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Why a plan cannot be replayed on the simulated device.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// An allocation would exceed the budget even after every in-flight
    /// offload has completed.
    #[error(
        "op {op} `{op_name}`: allocating tensor {tensor} `{tensor_name}` ({bytes} bytes) with \
         {resident} bytes ({}) resident exceeds the device memory budget of {budget} bytes ({})",
        human_bytes(*.resident),
        human_bytes(*.budget)
    )]
    BudgetExceeded {
        /// Index of the op (for a prefetch: the op it is issued before).
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The tensor being allocated.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Its size.
        bytes: u64,
        /// Bytes already resident.
        resident: u64,
        /// The budget.
        budget: u64,
    },
    /// An op used a tensor that is on the host (or on its way there).
    #[error(
        "op {op} `{op_name}` uses tensor {tensor} `{tensor_name}`, which is not resident ({state})"
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
    /// An action that cannot be carried out (offloading what is not
    /// resident, prefetching what is not on the host, naming an op or a
    /// tensor the trace does not have).
    #[error("action {index} ({action}): {message}")]
    InvalidAction {
        /// Index into the plan's actions.
        index: usize,
        /// The action, briefly.
        action: String,
        /// What is wrong.
        message: String,
    },
    /// The plan was made for a different trace.
    #[error("plan does not match the trace: {0}")]
    TraceMismatch(String),
}
