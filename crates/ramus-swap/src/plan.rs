//! Swap plans: what to copy where, and when, relative to the ops of a trace.
//!
//! A [`SwapPlan`] is a list of [`Action`]s placed before or after ops and,
//! optionally, a [`Layout`] fixing where each allocation lives. It is what
//! the mechanism (copy streams, events and pinned buffers in the CUDA back
//! end) executes and what the [`Simulator`](crate::Simulator) replays.
//! Every planner — the AutoVM planner and both baselines — produces one.
//!
//! This module holds the plan's data only, so that the simulator, the
//! layout algorithm ([`layout`](crate::layout)) and the planners above it
//! all build on it without importing one another.

use crate::cost::{human_bytes, human_seconds};
use crate::error::PlanError;
use crate::trace::{TensorId, Trace};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One copy between host and device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Copy the tensor to the host on the device-to-host stream once op
    /// `after_op` has finished; its device memory is freed when the copy
    /// completes. Asynchronous: compute continues.
    Offload {
        /// The tensor.
        tensor: TensorId,
        /// Its name (for people reading the plan).
        name: String,
        /// Its size.
        bytes: u64,
        /// The op after which the copy is issued.
        after_op: usize,
    },
    /// Allocate the tensor and copy it back on the host-to-device stream,
    /// issued when op `issue_before_op` is launched; it must be complete
    /// before op `needed_by_op` starts (which waits for it if it is not).
    Prefetch {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Its size.
        bytes: u64,
        /// The op at whose launch the copy is issued.
        issue_before_op: usize,
        /// The first op that needs the tensor again.
        needed_by_op: usize,
    },
    /// Synchronous eviction before op `before_op` (naive swapping): compute
    /// waits until the copy to the host is done and the memory is free.
    Evict {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Its size.
        bytes: u64,
        /// The op whose allocation needed the room.
        before_op: usize,
    },
    /// Synchronous demand fetch before op `before_op` (naive swapping):
    /// compute waits until the tensor is back.
    Fetch {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Its size.
        bytes: u64,
        /// The op that touched the tensor.
        before_op: usize,
    },
}

impl Action {
    /// The tensor moved.
    pub fn tensor(&self) -> TensorId {
        match self {
            Action::Offload { tensor, .. }
            | Action::Prefetch { tensor, .. }
            | Action::Evict { tensor, .. }
            | Action::Fetch { tensor, .. } => *tensor,
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        match self {
            Action::Offload { bytes, .. }
            | Action::Prefetch { bytes, .. }
            | Action::Evict { bytes, .. }
            | Action::Fetch { bytes, .. } => *bytes,
        }
    }

    /// Where the action sits in the op stream: `2 * op` is "before op",
    /// `2 * op + 1` is "after op". Actions execute in this order.
    pub fn position(&self) -> usize {
        match self {
            Action::Offload { after_op, .. } => 2 * after_op + 1,
            Action::Prefetch {
                issue_before_op, ..
            } => 2 * issue_before_op,
            Action::Evict { before_op, .. } | Action::Fetch { before_op, .. } => 2 * before_op,
        }
    }

    /// Whether the copy goes host → device.
    pub fn is_to_device(&self) -> bool {
        matches!(self, Action::Prefetch { .. } | Action::Fetch { .. })
    }
}

/// Which planner made a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Everything stays resident; no budget.
    NoBudget,
    /// Naive on-demand swapping: least-recently-used eviction, synchronous.
    Lru,
    /// The AutoVM planner with prefetches placed as early as the budget
    /// allows (Listing 3.4; no measured op times).
    AutoVmEarliest,
    /// The AutoVM planner with prefetches placed as late as measured op
    /// times still hide them (Listing 3.3).
    AutoVmProfiled,
}

impl Policy {
    /// A short description.
    pub fn label(self) -> &'static str {
        match self {
            Policy::NoBudget => "no budget",
            Policy::Lru => "naive LRU swapping",
            Policy::AutoVmEarliest => "AutoVM planner, earliest prefetch",
            Policy::AutoVmProfiled => "AutoVM planner, profiled prefetch",
        }
    }
}

/// One round trip chosen by the AutoVM planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OffloadDecision {
    /// The tensor.
    pub tensor: TensorId,
    /// Its name.
    pub name: String,
    /// Its size.
    pub bytes: u64,
    /// Offloaded after this op (its last use before the gap; Listing 3.2).
    pub offload_after_op: usize,
    /// Prefetch issued when this op is launched.
    pub prefetch_before_op: usize,
    /// First op that needs it again.
    pub needed_by_op: usize,
    /// Whether the gap crosses the iteration boundary (the tensor starts
    /// and ends the iteration on the host).
    pub wraps: bool,
    /// Reuse distance in ops.
    pub reuse_ops: usize,
    /// Reuse distance in estimated seconds.
    pub reuse_time_s: f64,
}

/// What the simulated device predicts for a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Peak device memory (resident tensors, in-flight copies included).
    pub peak_bytes: u64,
    /// Bytes copied device → host.
    pub bytes_to_host: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Number of device → host copies.
    pub copies_to_host: usize,
    /// Number of host → device copies.
    pub copies_to_device: usize,
    /// Sum of op durations.
    pub compute_s: f64,
    /// Iteration time, copy streams drained.
    pub total_s: f64,
    /// Time compute waited: `total_s - compute_s`.
    pub stall_s: f64,
}

/// A swap plan for one training iteration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwapPlan {
    /// The planner that made it.
    pub policy: Policy,
    /// The device memory budget planned for (`None`: unlimited).
    pub budget_bytes: Option<u64>,
    /// Peak device memory of the trace without swapping.
    pub unplanned_peak_bytes: u64,
    /// Number of ops in the trace the plan is for.
    pub num_ops: usize,
    /// Persistent tensors that start (and end) the iteration on the host.
    pub host_resident_at_start: Vec<TensorId>,
    /// The copies, ordered by [`Action::position`]; at one position in the
    /// order they are issued.
    pub actions: Vec<Action>,
    /// The AutoVM planner's round trips (empty for the baselines).
    pub offloads: Vec<OffloadDecision>,
    /// What the simulated device predicts.
    pub predicted: Prediction,
    /// Remarks from the planner (fallbacks taken and the like).
    pub notes: Vec<String>,
    /// Where each allocation lives, if the planner laid the iteration out
    /// (see [`layout`](crate::layout)); the executor then places tensors
    /// at these offsets of one arena instead of asking an allocator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
}

impl SwapPlan {
    /// The plan as pretty-printed JSON (what `ramus plan-memory --json` prints).
    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialization cannot fail; should it
        // ever, the caller still gets JSON saying why.
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| format!("{{\"error\": \"cannot serialize plan: {e}\"}}"))
    }

    /// Reads a plan written by [`SwapPlan::to_json`].
    pub fn from_json(s: &str) -> Result<SwapPlan, PlanError> {
        Ok(serde_json::from_str(s)?)
    }

    /// Actions issued before op `op` is launched, in issue order.
    pub fn before(&self, op: usize) -> impl Iterator<Item = &Action> {
        self.actions.iter().filter(move |a| a.position() == 2 * op)
    }

    /// Actions issued after op `op` finishes, in issue order.
    pub fn after(&self, op: usize) -> impl Iterator<Item = &Action> {
        self.actions
            .iter()
            .filter(move |a| a.position() == 2 * op + 1)
    }

    /// A readable listing; with the trace, ops are named too.
    pub fn listing(&self, trace: Option<&Trace>) -> String {
        let mut s = String::new();
        let p = &self.predicted;
        let budget = match self.budget_bytes {
            Some(b) => format!("budget {}", human_bytes(b)),
            None => "no budget".to_string(),
        };
        s.push_str(&format!("swap plan: {}, {}\n", self.policy.label(), budget));
        s.push_str(&format!(
            "  peak without swapping {}; predicted peak {}\n",
            human_bytes(self.unplanned_peak_bytes),
            human_bytes(p.peak_bytes)
        ));
        s.push_str(&format!(
            "  to host {} in {} copies; to device {} in {} copies\n",
            human_bytes(p.bytes_to_host),
            p.copies_to_host,
            human_bytes(p.bytes_to_device),
            p.copies_to_device
        ));
        s.push_str(&format!(
            "  predicted iteration {}: compute {}, stall {}\n",
            human_seconds(p.total_s),
            human_seconds(p.compute_s),
            human_seconds(p.stall_s)
        ));
        if !self.host_resident_at_start.is_empty() {
            s.push_str(&format!(
                "  {} persistent tensors are homed on the host between iterations\n",
                self.host_resident_at_start.len()
            ));
        }
        if let Some(layout) = &self.layout {
            s.push_str(&format!("  layout: {}\n", layout.summary()));
        }
        for note in &self.notes {
            s.push_str(&format!("  note: {note}\n"));
        }
        let op_name = |op: usize| -> String {
            match trace.and_then(|t| t.ops().get(op)) {
                Some(o) => format!("op {op} `{}` ({})", o.name, o.phase.label()),
                None => format!("op {op}"),
            }
        };
        for a in &self.actions {
            let line = match a {
                Action::Offload {
                    tensor,
                    name,
                    bytes,
                    after_op,
                } => format!(
                    "after  {}: offload  {tensor} `{name}` {}",
                    op_name(*after_op),
                    human_bytes(*bytes)
                ),
                Action::Prefetch {
                    tensor,
                    name,
                    bytes,
                    issue_before_op,
                    needed_by_op,
                } => format!(
                    "before {}: prefetch {tensor} `{name}` {}, needed by {}",
                    op_name(*issue_before_op),
                    human_bytes(*bytes),
                    op_name(*needed_by_op)
                ),
                Action::Evict {
                    tensor,
                    name,
                    bytes,
                    before_op,
                } => format!(
                    "before {}: evict    {tensor} `{name}` {} (synchronous)",
                    op_name(*before_op),
                    human_bytes(*bytes)
                ),
                Action::Fetch {
                    tensor,
                    name,
                    bytes,
                    before_op,
                } => format!(
                    "before {}: fetch    {tensor} `{name}` {} (synchronous)",
                    op_name(*before_op),
                    human_bytes(*bytes)
                ),
            };
            s.push_str("  ");
            s.push_str(&line);
            s.push('\n');
        }
        s
    }
}

impl fmt::Display for SwapPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.listing(None))
    }
}

/// One allocation of one tensor at a fixed offset of the arena.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// The tensor.
    pub tensor: TensorId,
    /// Offset in the arena, bytes.
    pub offset: u64,
    /// Size, bytes.
    pub bytes: u64,
    /// Allocated before this op runs (at its first use or its prefetch).
    pub from_op: usize,
    /// Its memory may be reused by allocations made before this op on
    /// (the number of ops: only after the iteration).
    pub until_op: usize,
}

impl Block {
    /// Whether the two blocks are alive at the same time.
    pub fn coexists_with(&self, other: &Block) -> bool {
        self.from_op < other.until_op && other.from_op < self.until_op
    }

    /// Whether the two blocks share bytes of the arena.
    pub fn overlaps(&self, other: &Block) -> bool {
        self.offset < other.offset + other.bytes && other.offset < self.offset + self.bytes
    }

    /// One past the block's last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// Where every allocation of a plan's iteration lives; made and checked
/// by [`layout`](crate::layout), whose docs tell how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Bytes of the arena: the end of the highest block.
    pub arena_bytes: u64,
    /// The most bytes alive at once: no layout can use a smaller arena.
    pub max_live_bytes: u64,
    /// Every allocation in the order the executor makes them.
    pub blocks: Vec<Block>,
}

impl Layout {
    /// A one-line summary.
    pub fn summary(&self) -> String {
        format!(
            "{} blocks in an arena of {} (at least {} live at once)",
            self.blocks.len(),
            human_bytes(self.arena_bytes),
            human_bytes(self.max_live_bytes)
        )
    }
}
