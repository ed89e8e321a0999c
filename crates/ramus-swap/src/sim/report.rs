//! What a replay reports: every copy, the time and the memory.

use crate::plan::Prediction;
use crate::trace::TensorId;
use serde::{Deserialize, Serialize};

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Device → host (offload, evict).
    ToHost,
    /// Host → device (prefetch, fetch).
    ToDevice,
}

/// One simulated copy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferRecord {
    /// Index of the action in the plan.
    pub action: usize,
    /// The tensor.
    pub tensor: TensorId,
    /// Which way.
    pub direction: Direction,
    /// Bytes copied.
    pub bytes: u64,
    /// Whether compute waited for the whole copy (evict, fetch).
    pub synchronous: bool,
    /// When the copy was issued (its destination allocated).
    pub issue_s: f64,
    /// When the copy engine started it.
    pub start_s: f64,
    /// When it completed.
    pub end_s: f64,
    /// For copies to the device: the op that first used the tensor after it.
    pub used_by_op: Option<usize>,
    /// For copies to the device: how long that op waited for this copy.
    pub wait_s: f64,
    /// For offloads: the op whose allocations first found the tensor's
    /// device memory released (the copy complete); the number of ops if
    /// only the end of the iteration did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_before_op: Option<usize>,
}

/// The result of a replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Iteration time: compute finished and both copy streams drained.
    pub total_s: f64,
    /// Sum of op durations.
    pub compute_s: f64,
    /// Time the compute stream was idle: `total_s - compute_s`.
    pub stall_s: f64,
    /// Part of the stall spent waiting for tensors to arrive.
    pub stall_data_s: f64,
    /// Part of the stall spent waiting for memory (offloads to complete).
    pub stall_memory_s: f64,
    /// Part of the stall spent draining the copy streams after the last op.
    pub drain_s: f64,
    /// The largest device memory in use at any time.
    pub peak_bytes: u64,
    /// The budget enforced (`None`: unlimited).
    pub budget_bytes: Option<u64>,
    /// Bytes copied device → host.
    pub bytes_to_host: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Copies device → host.
    pub copies_to_host: usize,
    /// Copies host → device.
    pub copies_to_device: usize,
    /// Per op: device memory in use when it started.
    pub resident_bytes: Vec<u64>,
    /// Per op: when it started.
    pub op_start_s: Vec<f64>,
    /// Every copy, in issue order.
    pub transfers: Vec<TransferRecord>,
    /// Copies to the device that an op had to wait for.
    pub late_prefetches: usize,
    /// Adjacent pairs of copies to the device that completed in the
    /// opposite order of the ops that use them (Fig. 3.4's problem).
    pub out_of_order_prefetches: usize,
    /// Whether the iteration ends where it started: persistent tensors
    /// homed on the host are back there, every other persistent tensor is
    /// resident, and no prefetched tensor was left unused.
    pub end_state_consistent: bool,
}

impl SimReport {
    /// The summary a [`SwapPlan`](crate::SwapPlan) carries.
    pub fn prediction(&self) -> Prediction {
        Prediction {
            peak_bytes: self.peak_bytes,
            bytes_to_host: self.bytes_to_host,
            bytes_to_device: self.bytes_to_device,
            copies_to_host: self.copies_to_host,
            copies_to_device: self.copies_to_device,
            compute_s: self.compute_s,
            total_s: self.total_s,
            stall_s: self.stall_s,
        }
    }
}
