//! The AutoVM planner's settings.

use crate::cost::CostModel;
use crate::error::PlanError;
use crate::trace::TensorKind;
use serde::{Deserialize, Serialize};

/// How many candidates to offload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// Only as many as the budget requires (farthest next use first).
    Needed,
    /// Every candidate, as the thesis does.
    AllCandidates,
}

/// How prefetches are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchTiming {
    /// As early as the budget allows (Listing 3.4); op times not needed.
    Earliest,
    /// As late as measured op times allow (Listing 3.3); every op of the
    /// trace must carry a measured duration.
    Profiled,
    /// Profiled if every op has a measured duration, else earliest.
    Auto,
}

/// The order in which Listing 3.4 places prefetches. The greedy favours the
/// tensors placed first (thesis §3.3.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementOrder {
    /// The tensor needed soonest first: it gets first claim on memory.
    Need,
    /// The tensor offloaded first first, as the thesis iterates; later
    /// consumers then often get earlier slots, which step 4 reorders.
    Offload,
}

/// Settings of the AutoVM planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Device memory the iteration may use, bytes.
    pub budget_bytes: u64,
    /// Tensors smaller than this are never offloaded (Listing 3.1).
    pub size_threshold_bytes: u64,
    /// Gaps with fewer ops inside are never offloaded (Listing 3.1).
    pub min_reuse_ops: usize,
    /// Gaps shorter than this many (estimated) seconds are never offloaded.
    pub min_reuse_time_s: Option<f64>,
    /// Kinds of tensor that may be offloaded.
    pub offload_kinds: Vec<TensorKind>,
    /// How many candidates to offload.
    pub selection: Selection,
    /// How prefetches are placed.
    pub timing: PrefetchTiming,
    /// The order of the earliest placement (Listing 3.4).
    pub placement_order: PlacementOrder,
    /// Whether to reorder prefetches that would complete out of order.
    pub reorder_prefetches: bool,
    /// Copy and op times.
    pub cost: CostModel,
    /// Lay the iteration out (see [`layout`](crate::layout)): fix every
    /// allocation's offset in one arena of the budget less the persistent
    /// tensors, planning under a smaller budget until the layout fits.
    /// Persistent tensors must then stay resident (no persistent kind in
    /// [`PlannerConfig::offload_kinds`]).
    #[serde(default)]
    pub layout: bool,
}

impl PlannerConfig {
    /// Defaults for a budget: 1 MiB size threshold; reuse distance of at
    /// least 2 ops (the thesis' default skips the last two layers'
    /// outputs); every kind but workspaces offloadable (the thesis keeps
    /// weights resident as ≈ 1 % of memory; here selection only offloads
    /// what the budget needs, and VGG's 400 MB fc6 weight can be what makes
    /// Nm = 2 fit); only as many offloads as needed; profiled placement when
    /// the trace has op times; PCIe 3.0 costs.
    pub fn new(budget_bytes: u64) -> PlannerConfig {
        PlannerConfig {
            budget_bytes,
            size_threshold_bytes: 1 << 20,
            min_reuse_ops: 2,
            min_reuse_time_s: None,
            offload_kinds: vec![
                TensorKind::Parameter,
                TensorKind::Activation,
                TensorKind::Gradient,
                TensorKind::OptimizerState,
            ],
            selection: Selection::Needed,
            timing: PrefetchTiming::Auto,
            placement_order: PlacementOrder::Need,
            reorder_prefetches: true,
            cost: CostModel::default(),
            layout: false,
        }
    }

    /// Checks the values a caller may set out of range.
    pub(super) fn validate(&self) -> Result<(), PlanError> {
        self.cost.validate().map_err(PlanError::Config)?;
        if self.layout {
            if let Some(k) = self.offload_kinds.iter().find(|k| k.is_persistent()) {
                return Err(PlanError::Config(format!(
                    "a memory layout places the iteration's own tensors; {} tensors are \
                     persistent and cannot be offloaded with one (remove them from offload_kinds)",
                    k.label()
                )));
            }
        }
        if let Some(t) = self.min_reuse_time_s {
            if !(t.is_finite() && t >= 0.0) {
                return Err(PlanError::Config(format!(
                    "min_reuse_time_s must be finite and non-negative, got {t}"
                )));
            }
        }
        Ok(())
    }
}
