//! A batch's task DAG: each task one instruction for the kernel's
//! interpreter plus a [`Placement`] saying which virtual processors run it
//! (see [`super::schedule`] for how it becomes scripts).

use super::isa::OP_FIRST_ENGINE;
use super::script::MAX_OPERANDS;
use crate::error::{CoreError, Result};

/// Error context of a malformed graph (shared with the scheduler's own
/// checks, so messages read the same).
const WHAT: &str = "schedule";

/// Which virtual processors execute a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Exactly one VPP, the one with the least accumulated load.
    Any,
    /// Every CTA holding a piece of this register-cached matrix (an index
    /// into [`RegisterPlan::matrices`](super::RegisterPlan::matrices)), each on its own rows.
    Holders {
        /// The cached matrix.
        matrix: u16,
    },
    /// All VPPs (e.g. the final optimizer update).
    Every,
}

/// One node of a batch's task DAG: an interpreter instruction and where it
/// runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VppTask {
    /// Engine opcode (at least [`OP_FIRST_ENGINE`]).
    pub op: u8,
    /// The instruction's 16-bit immediate.
    pub arg: u16,
    /// Operand words (pool offsets, counts). `Any`/`Every` tasks carry them
    /// inline (at most [`MAX_OPERANDS`]); `Holders` tasks through the operand
    /// pool, and merged tasks must have equal operand counts.
    pub operands: Vec<u32>,
    /// Tasks that must complete (on all their VPPs) before this one starts.
    pub deps: Vec<u32>,
    /// Estimated cost, for load balancing.
    pub load: u64,
    /// Where the task runs.
    pub placement: Placement,
}

/// A batch's tasks; dependencies always point to earlier tasks, so the graph
/// is acyclic by construction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VppTaskGraph {
    /// Tasks in push order; a task's id is its index.
    pub tasks: Vec<VppTask>,
}

/// Checks what can be checked about task `index` without a scheduler.
pub(super) fn check_task(index: usize, task: &VppTask) -> Result<()> {
    if let Some(&dep) = task.deps.iter().find(|&&d| d as usize >= index) {
        return Err(CoreError::vpps(
            WHAT,
            format!("task {index} depends on task {dep}, which is not an earlier task"),
        ));
    }
    if task.op < OP_FIRST_ENGINE {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "task {index} has opcode {}, below the first engine opcode {OP_FIRST_ENGINE}",
                task.op
            ),
        ));
    }
    if !matches!(task.placement, Placement::Holders { .. }) && task.operands.len() > MAX_OPERANDS {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "task {index} has {} operands, at most {MAX_OPERANDS} fit in an instruction",
                task.operands.len()
            ),
        ));
    }
    Ok(())
}

impl VppTaskGraph {
    /// An empty graph.
    pub fn new() -> Self {
        VppTaskGraph::default()
    }

    /// Appends `task` and returns its id. Errors (and does not append) if it
    /// depends on a task not pushed yet, has a control opcode, or carries more
    /// inline operands than an instruction holds.
    pub fn push(&mut self, task: VppTask) -> Result<u32> {
        let index = self.tasks.len();
        let id = u32::try_from(index)
            .map_err(|_| CoreError::vpps(WHAT, "more than 2^32 tasks in one batch"))?;
        check_task(index, &task)?;
        self.tasks.push(task);
        Ok(id)
    }

    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether there are no tasks.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}
