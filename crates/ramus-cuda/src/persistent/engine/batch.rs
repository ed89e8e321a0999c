//! One batch on its way to the device: its graphs scheduled
//! ([`schedule_graphs`]), then lowered, levelled, encoded into each
//! launch's scripts and staged ([`PreparedBatch`]; see `prepare.rs`).

use ramus_core::vpps::BatchScripts;
use ramus_core::Model;
use ramus_graph::{BatchingPolicy, InputGraph, Schedule};

use super::options::model_err;
use crate::error::Result;
use crate::persistent::unroll::BatchProgram;

/// One batch lowered, scheduled and staged on the host, ready to launch.
pub(super) struct PreparedBatch {
    pub(super) variant: usize,
    /// The slot whose staging buffer holds the batch's words.
    pub(super) slot: usize,
    /// Tasks of the batch's graph (the graph itself is freed once staged).
    pub(super) tasks: usize,
    /// The batch's layout and gradient products (graphs and words freed).
    pub(super) batch: BatchProgram,
    /// The batch's launches, one unless it has host work (see
    /// [`ramus_core::vpps::split_launches`]).
    pub(super) launches: Vec<LaunchScripts>,
    /// Without register gradients: the matrices' update, a last script.
    pub(super) updates: Option<BatchScripts>,
    pub(super) host_seconds: f64,
}

/// One launch of a batch: its scripts (`None` for a launch with only host
/// work), `at` words into the slot's script buffer, and the indices of the
/// batch's host work ([`BatchProgram::host_work`]) that follows it.
pub(super) struct LaunchScripts {
    pub(super) scripts: Option<BatchScripts>,
    pub(super) at: usize,
    pub(super) host_after: Vec<u32>,
}

/// Schedules one batch's graphs (levels, as the trainer's batches are).
pub(super) fn schedule_graphs(model: &Model, graphs: &[&InputGraph]) -> Result<Schedule> {
    if graphs.is_empty() {
        return Err(model_err("an empty batch"));
    }
    Ok(
        ramus_exec::Batch::new(model, graphs.to_vec(), BatchingPolicy::Cavs)
            .map_err(|e| model_err(format!("scheduling the batch: {e}")))?
            .schedule,
    )
}
