//! The AutoVM planner: which tensors leave the device, after which op, and
//! when they come back.
//!
//! The steps follow the thesis (chapter 3) with a device memory budget in
//! place of managed memory. Bytes are accounted per op: while op `k` runs,
//! the device holds every live tensor not on the host, plus every tensor
//! whose prefetch has been issued.
//!
//! 1. **Candidates** (Listing 3.1). Every gap between two consecutive uses of
//!    a tensor of an offloadable kind is a candidate if the tensor is at
//!    least [`PlannerConfig::size_threshold_bytes`] and the gap's reuse
//!    distance is at least [`PlannerConfig::min_reuse_ops`] ops (and
//!    [`PlannerConfig::min_reuse_time_s`] seconds, if set). For a CNN
//!    activation this is the gap between its last forward use and its first
//!    backward use; the offload is issued right after the op that opens the
//!    gap (Listing 3.2). Gaps of persistent tensors may wrap around the
//!    iteration boundary (optimizer state then lives on the host between
//!    updates).
//! 2. **Selection.** Walking the ops in order, wherever the bytes that must
//!    be resident exceed the budget, the candidate covering that op whose
//!    next use is farthest away (Belady's rule) is offloaded, until the op
//!    fits. Choices a later one made redundant are then undone, largest
//!    first. [`Selection::AllCandidates`] offloads every candidate instead,
//!    as the thesis does. An op that cannot fit is an error naming it, the
//!    tensor in the way (and why it cannot move) and the budget.
//! 3. **Earliest placement** (Listing 3.4). One tensor at a time, each
//!    prefetch is issued at the earliest op from which every op up to its
//!    consumer holds it within the budget, together with everything resident
//!    and every prefetch placed before it.
//! 4. **Reordering** (Fig. 3.5). The host→device stream is a FIFO, so a
//!    prefetch issued earlier for a later consumer delays one needed sooner
//!    (Fig. 3.4). Such pairs swap issue points where the budget permits;
//!    otherwise the later one is issued right after the sooner one. Copies
//!    then complete in the order they are needed.
//! 5. **Profiled placement** (Listing 3.3, the thesis' future work), with
//!    measured op times. Working back from the last consumer, each prefetch
//!    gets the latest op at which its copy — queued behind the prefetches
//!    needed before it — still completes before its consumer starts. In
//!    need order each then takes that op, or the first op after it where
//!    the budget holds it; a prefetch that was on time in step 4's
//!    placement is never issued earlier than there, one that was late may
//!    move earlier. The plan is replayed on the [`Simulator`] and
//!    prefetches that still arrive late are moved earlier where the budget
//!    allows. A profiled plan is never predicted to stall more than step
//!    4's; if it would, step 4's is kept and a note says so.
//!
//! 6. **Layout** ([`PlannerConfig::layout`]; see [`layout`](crate::layout)):
//!    every allocation gets a fixed offset in one arena of the budget less
//!    the persistent tensors, planning under a smaller budget where no
//!    layout fits; of the candidates, the one whose replay is fastest.
//!
//! The plan's prediction (peak memory, bytes each way, stall) comes from a
//! replay on the [`Simulator`] with the same cost model.
//!
//! The code follows the steps: `select.rs` (1–2), `place.rs` (3–5) and
//! `lay_out.rs` (6) each add their step's methods to [`AutoVmPlanner`];
//! this file runs them in order, and `config.rs` holds the settings.

mod config;
mod lay_out;
mod place;
mod select;
#[cfg(test)]
mod tests;

use crate::analysis::{analyze, ReuseGap};
use crate::cost::human_bytes;
use crate::error::PlanError;
use crate::plan::{Policy, SwapPlan};
use crate::sim::{SimReport, Simulator};
use crate::trace::{TensorId, Trace};
pub use config::{PlacementOrder, PlannerConfig, PrefetchTiming, Selection};
use serde::{Deserialize, Serialize};

/// Anything that turns a trace into a [`SwapPlan`]: the AutoVM planner and
/// the baselines.
pub trait Planner {
    /// Which policy the planner implements.
    fn policy(&self) -> Policy;
    /// Plans one iteration of `trace`.
    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError>;
}

/// One offload candidate: a tensor and a gap between two of its uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The tensor.
    pub tensor: TensorId,
    /// Its size.
    pub bytes: u64,
    /// The gap it would spend on the host.
    pub gap: ReuseGap,
}

/// The AutoVM planner.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoVmPlanner {
    /// Its settings.
    pub config: PlannerConfig,
}

impl Planner for AutoVmPlanner {
    fn policy(&self) -> Policy {
        match self.config.timing {
            PrefetchTiming::Earliest => Policy::AutoVmEarliest,
            _ => Policy::AutoVmProfiled,
        }
    }

    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        self.config.validate()?;
        if self.config.layout {
            self.plan_laid_out(trace)
        } else {
            Ok(self.plan_with_replay(trace)?.0)
        }
    }
}

impl AutoVmPlanner {
    /// A planner with these settings.
    pub fn new(config: PlannerConfig) -> AutoVmPlanner {
        AutoVmPlanner { config }
    }

    /// Steps 1–5 and the replay of the plan they make.
    fn plan_with_replay(&self, trace: &Trace) -> Result<(SwapPlan, SimReport), PlanError> {
        let cfg = &self.config;
        let profiled = match cfg.timing {
            PrefetchTiming::Earliest => false,
            PrefetchTiming::Auto => trace.has_durations(),
            PrefetchTiming::Profiled => {
                if let Some((op, o)) = trace
                    .ops()
                    .iter()
                    .enumerate()
                    .find(|(_, o)| o.duration_s.is_none())
                {
                    return Err(PlanError::MissingDuration {
                        op,
                        op_name: o.name.clone(),
                    });
                }
                true
            }
        };
        let an = analyze(trace, &cfg.cost);
        let (mut trips, r_off) = self.select(trace, &an)?;
        let mut r = self.place_earliest(&mut trips, &r_off);
        if cfg.reorder_prefetches {
            self.reorder(&mut trips, &mut r);
        }
        let mut plan = self.build(trace, &an, &trips, Policy::AutoVmEarliest);
        let mut rep = self.simulate(trace, &plan)?;
        if profiled {
            // Prefetches that were on time stay at or after their earliest
            // placement; late ones may move earlier.
            let late = Self::late_in(&plan, &rep, &trips);
            let floor: Vec<usize> = trips
                .iter()
                .zip(&late)
                .map(|(t, &l)| if l { t.lo } else { t.p })
                .collect();
            let mut alap = trips.clone();
            self.place_profiled(&mut alap, &r_off, &an, &floor);
            let (p2, rep2) = self.refine(trace, &an, &mut alap, &floor, &r_off)?;
            if rep2.stall_s <= rep.stall_s * (1.0 + 1e-9) + 1e-12 {
                plan = p2;
                rep = rep2;
            } else {
                plan.policy = Policy::AutoVmProfiled;
                plan.notes.push(format!(
                    "profiled placement predicted {:.6} s of stall against {:.6} s for the \
                     earliest placement; the earliest placement is kept",
                    rep2.stall_s, rep.stall_s
                ));
            }
        }
        plan.predicted = rep.prediction();
        if cfg.selection == Selection::AllCandidates {
            plan.notes
                .push("every candidate is offloaded (thesis behaviour)".to_string());
        }
        if plan.actions.is_empty() {
            plan.notes.push(format!(
                "the iteration fits in {} without swapping",
                human_bytes(cfg.budget_bytes)
            ));
        }
        Ok((plan, rep))
    }

    /// Replays `plan` under its own budget with the planner's cost model.
    fn simulate(&self, trace: &Trace, plan: &SwapPlan) -> Result<SimReport, PlanError> {
        Ok(Simulator::new(self.config.cost, plan.budget_bytes).run(trace, plan)?)
    }
}
