//! Step 6: a plan whose every allocation has a fixed offset in one arena
//! (see [`layout`](crate::layout)), searching over planning budgets.

use super::config::{PlannerConfig, PrefetchTiming};
use super::AutoVmPlanner;
use crate::cost::human_bytes;
use crate::error::PlanError;
use crate::plan::{Layout, SwapPlan};
use crate::sim::SimReport;
use crate::trace::Trace;

/// Laying out never tries more planning budgets than this, nor more than
/// the second for a layout that holds memory until copies complete once
/// one that does not was found.
const MAX_LAYOUT_ATTEMPTS: usize = 12;
const MAX_EXTRA_LAYOUT_ATTEMPTS: usize = 4;

impl AutoVmPlanner {
    /// Step 6 (see [`layout`](crate::layout)): plans and lays the plan
    /// out holding offloaded memory until the replay finds the copy
    /// complete; while no layout fits, also holding it for half, a quarter
    /// or none of the copy (the reuse then waits for the copy on the
    /// device). While nothing fits, or for a few more attempts until a
    /// layout holding memory for the whole copy does, plans again under a
    /// smaller budget: smaller by the excess (at least 0.1 % of the
    /// budget), doubling with every attempt as the arena need not shrink
    /// with the budget at once, and halfway back up to the last budget that
    /// did not lay out once one is too small to plan for at all. Of the
    /// candidates, replayed with their layout, the fastest is kept. A
    /// profiled placement that cannot be laid out falls back to the
    /// earliest placement.
    pub(super) fn plan_laid_out(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        match self.lay_out(trace, &self.config) {
            Err(e @ PlanError::LayoutDoesNotFit { .. })
                if self.config.timing != PrefetchTiming::Earliest =>
            {
                let earliest = PlannerConfig {
                    timing: PrefetchTiming::Earliest,
                    ..self.config.clone()
                };
                match self.lay_out(trace, &earliest) {
                    Ok(mut plan) => {
                        plan.notes.push(format!(
                            "the profiled placement could not be laid out ({e}); the earliest \
                             placement is kept"
                        ));
                        Ok(plan)
                    }
                    Err(_) => Err(e),
                }
            }
            other => other,
        }
    }

    /// [`AutoVmPlanner::plan_laid_out`] with settings `cfg`.
    fn lay_out(&self, trace: &Trace, cfg: &PlannerConfig) -> Result<SwapPlan, PlanError> {
        let mut search = Search::new(trace, cfg.budget_bytes);
        let mut budget = cfg.budget_bytes;
        for attempt in 0..MAX_LAYOUT_ATTEMPTS {
            let inner = AutoVmPlanner::new(PlannerConfig {
                budget_bytes: budget,
                layout: false,
                ..cfg.clone()
            });
            let (plan, replay) = match inner.plan_with_replay(trace) {
                Ok(p) => p,
                Err(e) if attempt == 0 => return Err(e),
                Err(e) => {
                    search.too_small = Some((budget, e));
                    budget = budget + (search.too_large - budget) / 2;
                    if search.too_large - budget < search.min_step {
                        break;
                    }
                    continue;
                }
            };
            let (smallest, held_fits) =
                self.lay_out_holding(trace, &mut search, (&plan, &replay), budget)?;
            if held_fits {
                break; // smaller budgets only copy more
            }
            if search.best.is_some() {
                search.since_first += 1;
                if search.since_first > MAX_EXTRA_LAYOUT_ATTEMPTS {
                    break;
                }
            }
            search.last = Some(smallest);
            search.too_large = budget;
            budget = search.next_budget(budget, smallest, attempt);
            if search.too_large - budget < search.min_step {
                break;
            }
        }
        search.finish()
    }

    /// Lays out `plan` (made for `budget`, with its `replay`) holding
    /// offloaded memory until the replay's copy completes; as long as no
    /// layout fits yet, also shorter (the reuse waits for the copy it
    /// overwrites). The candidates are replayed with their layout and the
    /// fastest is kept: waiting for some copies can beat more copies under
    /// a smaller budget, and the other way round. Returns the smallest
    /// arena any layout needed and whether one holding memory for the whole
    /// copy fitted.
    fn lay_out_holding(
        &self,
        trace: &Trace,
        search: &mut Search,
        (plan, replay): (&SwapPlan, &SimReport),
        budget: u64,
    ) -> Result<(u64, bool), PlanError> {
        let mut smallest = u64::MAX;
        let holds: &[f64] = if search.best.is_none() {
            &[1.0, 0.5, 0.25, 0.0]
        } else {
            &[1.0]
        };
        for &hold in holds {
            let layout = Layout::within(trace, plan, Some(replay), hold, search.arena)?;
            smallest = smallest.min(layout.arena_bytes);
            if layout.arena_bytes > search.arena {
                continue;
            }
            let mut laid = plan.clone();
            laid.layout = Some(layout);
            let rep = self.simulate(trace, &laid)?;
            laid.predicted = rep.prediction();
            let faster = search
                .best
                .as_ref()
                .is_none_or(|(b, _, _)| rep.total_s < b.predicted.total_s);
            if faster {
                search.best = Some((laid, hold, budget));
            }
            if hold == 1.0 {
                // nothing waits for a copy: as good as this budget gets
                return Ok((smallest, true));
            }
        }
        Ok((smallest, false))
    }
}

/// Where the search over planning budgets of step 6 stands.
struct Search {
    /// The budget asked for.
    budget: u64,
    /// Bytes the budget leaves the iteration's tensors: the arena.
    arena: u64,
    /// The least a planning budget moves by (0.1 % of the budget).
    min_step: u64,
    /// The smallest budget known not to lay out with memory held until
    /// copies complete.
    too_large: u64,
    /// The largest budget known to be too small to plan for, and why.
    too_small: Option<(u64, PlanError)>,
    /// The smallest arena the last budget's layouts needed.
    last: Option<u64>,
    /// The fastest laid-out plan so far (predicted), with its hold and
    /// planning budget.
    best: Option<(SwapPlan, f64, u64)>,
    /// Plans made since the first one that laid out.
    since_first: usize,
}

impl Search {
    fn new(trace: &Trace, budget: u64) -> Search {
        Search {
            budget,
            arena: budget.saturating_sub(trace.persistent_bytes()),
            min_step: (budget / 1024).max(1),
            too_large: budget,
            too_small: None,
            last: None,
            best: None,
            since_first: 0,
        }
    }

    /// The budget to plan for after `budget` did not lay out (its layouts
    /// needed at least `smallest` bytes): halfway back up to it once a
    /// budget was too small to plan for, else smaller by the excess,
    /// doubling with every attempt.
    fn next_budget(&self, budget: u64, smallest: u64, attempt: usize) -> u64 {
        match &self.too_small {
            Some((small, _)) => small + (self.too_large - small) / 2,
            None => {
                let step = smallest.saturating_sub(self.arena).max(self.min_step);
                budget.saturating_sub(step.saturating_mul(1 << attempt.min(16)))
            }
        }
    }

    /// The fastest laid-out plan, with notes on what it took, or why none
    /// fitted.
    fn finish(self) -> Result<SwapPlan, PlanError> {
        let arena = self.arena;
        if let Some((mut plan, hold, planned_for)) = self.best {
            if hold < 1.0 {
                plan.notes.push(format!(
                    "offloaded memory is reused after {:.0} % of its copy's predicted time (the \
                     reuse waits for the copy on the device) so that the layout fits",
                    hold * 100.0
                ));
            }
            if planned_for < self.budget {
                plan.notes.push(format!(
                    "planned for {} so that the layout fits the {} the budget leaves the \
                     iteration's tensors",
                    human_bytes(planned_for),
                    human_bytes(arena)
                ));
            }
            return Ok(plan);
        }
        Err(PlanError::LayoutDoesNotFit {
            arena,
            laid_out: self.last.unwrap_or(0),
            budget: self.budget,
            reason: match self.too_small {
                Some((small, e)) => format!(
                    "a planning budget of {small} bytes ({}) is too small: {e}",
                    human_bytes(small)
                ),
                None => format!("no layout fitted after {MAX_LAYOUT_ATTEMPTS} plans"),
            },
        })
    }
}
