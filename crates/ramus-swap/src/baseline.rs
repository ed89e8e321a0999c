//! Baselines, as planners: no budget, and naive on-demand LRU swapping.
//!
//! [`NoBudgetPlanner`] keeps everything resident and reports the peak: the
//! in-memory reference. [`LruPlanner`] stands in for the default virtual
//! memory behaviour the thesis compares against: when an op's allocations
//! would exceed the budget, the least-recently-used tensors it does not use
//! are evicted synchronously; a tensor on the host is fetched back
//! synchronously when an op touches it. Both produce [`SwapPlan`]s, so the
//! [`Simulator`] compares all policies on the same terms.

use crate::analysis::analyze;
use crate::cost::CostModel;
use crate::error::PlanError;
use crate::plan::{Action, Policy, SwapPlan};
use crate::planner::Planner;
use crate::sim::Simulator;
use crate::trace::{TensorId, Trace};
use std::collections::BTreeSet;

/// Everything resident, no budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NoBudgetPlanner {
    /// Op times for the prediction.
    pub cost: CostModel,
}

impl NoBudgetPlanner {
    /// The in-memory baseline.
    pub fn new(cost: CostModel) -> NoBudgetPlanner {
        NoBudgetPlanner { cost }
    }
}

impl Planner for NoBudgetPlanner {
    fn policy(&self) -> Policy {
        Policy::NoBudget
    }

    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        self.cost.validate().map_err(PlanError::Config)?;
        let an = analyze(trace, &self.cost);
        let mut plan = SwapPlan {
            policy: Policy::NoBudget,
            budget_bytes: None,
            unplanned_peak_bytes: an.peak_bytes,
            num_ops: trace.num_ops(),
            host_resident_at_start: Vec::new(),
            actions: Vec::new(),
            offloads: Vec::new(),
            predicted: Default::default(),
            notes: Vec::new(),
        };
        plan.predicted = Simulator::new(self.cost, None)
            .run(trace, &plan)?
            .prediction();
        Ok(plan)
    }
}

/// Naive on-demand swapping with least-recently-used eviction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LruPlanner {
    /// Device memory budget, bytes.
    pub budget_bytes: u64,
    /// Copy and op times for the prediction.
    pub cost: CostModel,
}

impl LruPlanner {
    /// Naive swapping under `budget_bytes`.
    pub fn new(budget_bytes: u64, cost: CostModel) -> LruPlanner {
        LruPlanner { budget_bytes, cost }
    }
}

impl Planner for LruPlanner {
    fn policy(&self) -> Policy {
        Policy::Lru
    }

    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        self.cost.validate().map_err(PlanError::Config)?;
        let budget = self.budget_bytes;
        let an = analyze(trace, &self.cost);
        let nt = trace.num_tensors();
        let n = trace.num_ops();
        let mut last_use = vec![None; nt];
        for op in 0..n {
            for &t in trace.uses(op) {
                last_use[t.index()] = Some(op);
            }
        }
        let mut resident = vec![false; nt];
        let mut on_host = vec![false; nt];
        let mut touched = vec![0usize; nt];
        // (last touch + 1, tensor): 0 means "not touched this iteration".
        let mut lru: BTreeSet<(usize, usize)> = BTreeSet::new();
        let mut used: u64 = 0;
        for (t, info) in trace.tensors().iter().enumerate() {
            if info.kind.is_persistent() {
                resident[t] = true;
                used += info.bytes;
                lru.insert((0, t));
            }
        }
        let mut actions = Vec::new();
        for op in 0..n {
            let uses = trace.uses(op);
            let ws = trace.working_set_bytes(op);
            if ws > budget {
                let largest = uses
                    .iter()
                    .copied()
                    .max_by_key(|&t| (trace.tensor(t).bytes, std::cmp::Reverse(t)))
                    .unwrap_or(TensorId(0));
                return Err(PlanError::WorkingSetExceedsBudget {
                    op,
                    op_name: trace.ops()[op].name.clone(),
                    tensor: largest,
                    tensor_name: trace
                        .get_tensor(largest)
                        .map(|t| t.name.clone())
                        .unwrap_or_default(),
                    tensor_bytes: trace.get_tensor(largest).map(|t| t.bytes).unwrap_or(0),
                    working_set: ws,
                    budget,
                });
            }
            let need: u64 = uses
                .iter()
                .filter(|t| !resident[t.index()])
                .map(|&t| trace.tensor(t).bytes)
                .sum();
            while used + need > budget {
                // ws <= budget, so a victim outside the op's uses exists.
                let Some(&(key, victim)) = lru
                    .iter()
                    .find(|&&(_, t)| !uses.contains(&TensorId(t as u32)))
                else {
                    break;
                };
                lru.remove(&(key, victim));
                let info = &trace.tensors()[victim];
                actions.push(Action::Evict {
                    tensor: TensorId(victim as u32),
                    name: info.name.clone(),
                    bytes: info.bytes,
                    before_op: op,
                });
                resident[victim] = false;
                on_host[victim] = true;
                used -= info.bytes;
            }
            for &t in uses {
                let i = t.index();
                if !resident[i] {
                    let info = trace.tensor(t);
                    if on_host[i] {
                        actions.push(Action::Fetch {
                            tensor: t,
                            name: info.name.clone(),
                            bytes: info.bytes,
                            before_op: op,
                        });
                        on_host[i] = false;
                    }
                    resident[i] = true;
                    used += info.bytes;
                } else {
                    lru.remove(&(touched[i], i));
                }
                touched[i] = op + 1;
                lru.insert((op + 1, i));
            }
            for &t in uses {
                let i = t.index();
                if !trace.tensor(t).kind.is_persistent() && last_use[i] == Some(op) {
                    resident[i] = false;
                    used -= trace.tensor(t).bytes;
                    lru.remove(&(touched[i], i));
                }
            }
        }
        let mut plan = SwapPlan {
            policy: Policy::Lru,
            budget_bytes: Some(budget),
            unplanned_peak_bytes: an.peak_bytes,
            num_ops: n,
            host_resident_at_start: Vec::new(),
            actions,
            offloads: Vec::new(),
            predicted: Default::default(),
            notes: Vec::new(),
        };
        let rep = Simulator::new(self.cost, Some(budget)).run(trace, &plan)?;
        if !rep.end_state_consistent {
            plan.notes.push(
                "some persistent tensors end the iteration on the host (the next iteration \
                 would fetch them on demand)"
                    .to_string(),
            );
        }
        plan.predicted = rep.prediction();
        Ok(plan)
    }
}
