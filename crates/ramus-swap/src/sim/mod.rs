//! A simulated device that replays a trace under a plan and a budget.
//!
//! The model is the one the CUDA mechanism implements: one compute stream,
//! one copy stream per direction (each a FIFO: copies on it complete in
//! issue order), and events ordering copies against compute.
//!
//! * An op's outputs (and any tensor at its first use) are allocated when it
//!   is launched ("pre-access"); tensors are freed after their last use.
//! * An offload is issued once its op has finished; the tensor's device
//!   memory is released only when the copy completes.
//! * A prefetch allocates its destination when it is issued (at the launch
//!   of its op) and starts when the host→device stream is free and the
//!   tensor's own offload has completed; the op that needs the tensor waits
//!   for it.
//! * An allocation that does not fit waits for in-flight offloads to
//!   complete (a stall); if it still does not fit, replay fails with
//!   [`SimError::BudgetExceeded`] naming the op, the tensor and the budget.
//! * Using a tensor that is on the host, or on its way there, fails with
//!   [`SimError::NotResident`].
//!
//! * With a [`Layout`](crate::Layout) in the plan, each allocation also
//!   takes its block: an op whose block overlaps memory an offload is still
//!   reading waits for that copy (a memory stall), and so does a prefetch's
//!   copy; a block over memory still in use fails the replay.
//!
//! The report counts bytes and copies each way, peak memory, the compute
//! stream's stalls and whether prefetches completed in the order their ops
//! need them.
//!
//! The code: `report.rs` holds what a replay reports, `replay.rs` the
//! replay itself, one method per step.

mod replay;
mod report;
#[cfg(test)]
mod tests;

use crate::cost::CostModel;
use crate::error::SimError;
use crate::plan::SwapPlan;
use crate::trace::Trace;
pub use report::{Direction, SimReport, TransferRecord};

/// The simulated device: a cost model and a memory budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Simulator {
    /// Copy and op times.
    pub cost: CostModel,
    /// Device memory budget (`None`: unlimited).
    pub budget_bytes: Option<u64>,
}

impl Simulator {
    /// A device with this cost model and budget.
    pub fn new(cost: CostModel, budget_bytes: Option<u64>) -> Simulator {
        Simulator { cost, budget_bytes }
    }

    /// A device with the plan's own budget.
    pub fn for_plan(cost: CostModel, plan: &SwapPlan) -> Simulator {
        Simulator::new(cost, plan.budget_bytes)
    }

    /// Replays one iteration of `trace` under `plan`.
    pub fn run(&self, trace: &Trace, plan: &SwapPlan) -> Result<SimReport, SimError> {
        replay::replay(self.cost, self.budget_bytes, trace, plan)
    }
}
