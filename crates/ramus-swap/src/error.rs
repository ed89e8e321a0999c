//! Errors of the planners, the layout and the simulated device.
//!
//! This module sits below everything that returns these errors: it builds
//! on the trace (ids, names, sizes) and nothing else of the crate, so no
//! module that returns an error is imported by it. The executor's
//! [`ExecutorError`](crate::ExecutorError) lives with the [`SwapDevice`](crate::SwapDevice)
//! contract it is part of; the trace's own [`TraceError`] with the trace.

use crate::cost::human_bytes;
use crate::trace::{TensorId, Trace, TraceError};

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
    Layout(#[from] LayoutError),
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

impl PlanError {
    /// The error for op `op` whose working set exceeds `budget`, naming its
    /// largest tensor.
    pub(crate) fn working_set_exceeded(trace: &Trace, op: usize, budget: u64) -> PlanError {
        let uses = trace.uses(op);
        let largest = uses
            .iter()
            .copied()
            .max_by_key(|&t| (trace.tensor(t).bytes, std::cmp::Reverse(t)))
            .unwrap_or(TensorId(0));
        let (tensor_name, tensor_bytes) = match trace.get_tensor(largest) {
            Some(t) if !uses.is_empty() => (t.name.clone(), t.bytes),
            _ => (String::from("(none)"), 0),
        };
        PlanError::WorkingSetExceedsBudget {
            op,
            op_name: trace.ops()[op].name.clone(),
            tensor: largest,
            tensor_name,
            tensor_bytes,
            working_set: trace.working_set_bytes(op),
            budget,
        }
    }
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

/// Why a layout does not fit its trace and plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("memory layout: {0}")]
pub struct LayoutError(pub String);
