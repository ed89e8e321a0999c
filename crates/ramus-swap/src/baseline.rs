//! Baselines, as planners: no budget, and naive on-demand LRU swapping.
//!
//! [`NoBudgetPlanner`] keeps everything resident and reports the peak: the
//! in-memory reference. [`LruPlanner`] stands in for the default virtual
//! memory behaviour the thesis compares against: when an op's allocations
//! would exceed the budget, the least-recently-used tensors it does not use
//! are evicted synchronously; a tensor on the host is fetched back
//! synchronously when an op touches it. Both produce [`SwapPlan`]s, so the
//! [`Simulator`] compares all policies on the same terms.
//!
//! Persistent tensors (parameters, optimizer state) exist when the iteration
//! starts, and the device holds no more than the budget then either. When
//! they all fit, [`LruPlanner`] starts with all of them resident. When they
//! do not, it starts with those the iteration touches first resident, as
//! many as fit in that order, and the rest on the host
//! ([`SwapPlan::host_resident_at_start`]), fetched on demand like any other
//! evicted tensor. Nothing can be evicted before it is on the device, so
//! evicting the surplus "before the first op" is not an option.
//!
//! An engine that keeps persistent tensors in buffers of their own (the CUDA
//! engine's parameters, gradients and optimizer state) plans with
//! [`LruPlanner::keep_persistent_resident`]: only activations, gradients
//! and workspaces are then evicted, as its mechanism does on demand.

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
            layout: None,
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
    /// Whether persistent tensors (parameters, their gradients, optimizer
    /// state) may be evicted and homed on the host like any other.
    pub evict_persistent: bool,
}

impl LruPlanner {
    /// Naive swapping under `budget_bytes`; any tensor may be evicted.
    pub fn new(budget_bytes: u64, cost: CostModel) -> LruPlanner {
        LruPlanner {
            budget_bytes,
            cost,
            evict_persistent: true,
        }
    }

    /// The same planner, evicting only tensors that are not persistent
    /// (what an engine whose persistent tensors never move can execute).
    pub fn keep_persistent_resident(mut self) -> LruPlanner {
        self.evict_persistent = false;
        self
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
        let host_resident_at_start = start_state(trace, budget);
        if !self.evict_persistent {
            if let Some(&t) = host_resident_at_start.first() {
                return Err(persistent_error(trace, t, budget));
            }
        }
        let mut lru = Lru::new(self, trace, &host_resident_at_start);
        for op in 0..trace.num_ops() {
            if trace.working_set_bytes(op) > budget {
                // A working set over the budget is not empty: the error names
                // the op's largest tensor.
                return Err(PlanError::working_set_exceeded(trace, op, budget));
            }
            lru.make_room(op)?;
            lru.touch_uses(op);
            lru.free_last_uses(op);
        }
        let mut plan = SwapPlan {
            policy: Policy::Lru,
            budget_bytes: Some(budget),
            unplanned_peak_bytes: an.peak_bytes,
            num_ops: trace.num_ops(),
            host_resident_at_start,
            actions: lru.actions,
            offloads: Vec::new(),
            predicted: Default::default(),
            notes: Vec::new(),
            layout: None,
        };
        let rep = Simulator::new(self.cost, Some(budget)).run(trace, &plan)?;
        if !rep.end_state_consistent {
            plan.notes.push(
                "some persistent tensors end the iteration elsewhere than they started it \
                 (the next iteration would fetch or evict them on demand)"
                    .to_string(),
            );
        }
        plan.predicted = rep.prediction();
        Ok(plan)
    }
}

/// Naive swapping walked op by op: what is resident, what is on the host,
/// the order of last touches, and the evictions and fetches so far.
struct Lru<'a> {
    planner: &'a LruPlanner,
    trace: &'a Trace,
    last_use: Vec<Option<usize>>,
    resident: Vec<bool>,
    on_host: Vec<bool>,
    touched: Vec<usize>,
    /// (last touch + 1, tensor): 0 means "not touched this iteration".
    lru: BTreeSet<(usize, usize)>,
    used: u64,
    actions: Vec<Action>,
}

impl<'a> Lru<'a> {
    /// The iteration's start: persistent tensors resident, but those in
    /// `homed`, which are on the host.
    fn new(planner: &'a LruPlanner, trace: &'a Trace, homed: &[TensorId]) -> Lru<'a> {
        let nt = trace.num_tensors();
        let mut s = Lru {
            planner,
            trace,
            last_use: trace.last_uses(),
            resident: vec![false; nt],
            on_host: vec![false; nt],
            touched: vec![0usize; nt],
            lru: BTreeSet::new(),
            used: 0,
            actions: Vec::new(),
        };
        for &t in homed {
            s.on_host[t.index()] = true;
        }
        for (t, info) in trace.tensors().iter().enumerate() {
            if info.kind.is_persistent() && !s.on_host[t] {
                s.resident[t] = true;
                s.used += info.bytes;
                s.lru.insert((0, t));
            }
        }
        s
    }

    /// Evicts least-recently-used tensors op `op` does not use until its
    /// tensors that are not resident fit the budget.
    fn make_room(&mut self, op: usize) -> Result<(), PlanError> {
        let trace = self.trace;
        let budget = self.planner.budget_bytes;
        let evict_persistent = self.planner.evict_persistent;
        let uses = trace.uses(op);
        let need: u64 = uses
            .iter()
            .filter(|t| !self.resident[t.index()])
            .map(|&t| trace.tensor(t).bytes)
            .sum();
        while self.used + need > budget {
            // The resident tensors are exactly those in `lru`; were they
            // all among the op's uses, `used + need` would be its working
            // set, which fits. So a victim outside the uses exists.
            let evictable = |t: usize| evict_persistent || !trace.tensors()[t].kind.is_persistent();
            let Some(&(key, victim)) = self
                .lru
                .iter()
                .find(|&&(_, t)| evictable(t) && !uses.contains(&TensorId(t as u32)))
            else {
                return Err(no_victim(
                    trace,
                    op,
                    &self.resident,
                    self.used + need,
                    budget,
                    evict_persistent,
                ));
            };
            self.lru.remove(&(key, victim));
            let info = &trace.tensors()[victim];
            self.actions.push(Action::Evict {
                tensor: TensorId(victim as u32),
                name: info.name.clone(),
                bytes: info.bytes,
                before_op: op,
            });
            self.resident[victim] = false;
            self.on_host[victim] = true;
            self.used -= info.bytes;
        }
        Ok(())
    }

    /// Makes op `op`'s tensors resident, fetching those on the host, and
    /// marks them used last by it.
    fn touch_uses(&mut self, op: usize) {
        for &t in self.trace.uses(op) {
            let i = t.index();
            if !self.resident[i] {
                let info = self.trace.tensor(t);
                if self.on_host[i] {
                    self.actions.push(Action::Fetch {
                        tensor: t,
                        name: info.name.clone(),
                        bytes: info.bytes,
                        before_op: op,
                    });
                    self.on_host[i] = false;
                }
                self.resident[i] = true;
                self.used += info.bytes;
            } else {
                self.lru.remove(&(self.touched[i], i));
            }
            self.touched[i] = op + 1;
            self.lru.insert((op + 1, i));
        }
    }

    /// Frees the tensors (not persistent) op `op` used last.
    fn free_last_uses(&mut self, op: usize) {
        for &t in self.trace.uses(op) {
            let i = t.index();
            let info = self.trace.tensor(t);
            if !info.kind.is_persistent() && self.last_use[i] == Some(op) {
                self.resident[i] = false;
                self.used -= info.bytes;
                self.lru.remove(&(self.touched[i], i));
            }
        }
    }
}

/// The persistent tensors [`LruPlanner`] starts the iteration with on the
/// host: none if they all fit the budget; otherwise, taking them in order of
/// first use (unused ones last, ties by tensor number), those after the
/// longest prefix that fits. Sorted by tensor number.
fn start_state(trace: &Trace, budget: u64) -> Vec<TensorId> {
    if trace.persistent_bytes() <= budget {
        return Vec::new();
    }
    let mut first_use: Vec<Option<usize>> = vec![None; trace.num_tensors()];
    for op in (0..trace.num_ops()).rev() {
        for &t in trace.uses(op) {
            first_use[t.index()] = Some(op);
        }
    }
    let mut order: Vec<usize> = (0..trace.num_tensors())
        .filter(|&t| trace.tensors()[t].kind.is_persistent())
        .collect();
    order.sort_by_key(|&t| (first_use[t].unwrap_or(usize::MAX), t));
    let mut used = 0u64;
    let mut fits = order.len();
    for (k, &t) in order.iter().enumerate() {
        let bytes = trace.tensors()[t].bytes;
        if used + bytes > budget {
            fits = k;
            break;
        }
        used += bytes;
    }
    let mut homed: Vec<TensorId> = order[fits..].iter().map(|&t| TensorId(t as u32)).collect();
    homed.sort();
    homed
}

/// The error for persistent tensors that do not fit the budget when they
/// must stay resident: names the first one left out.
fn persistent_error(trace: &Trace, t: TensorId, budget: u64) -> PlanError {
    let info = trace.tensor(t);
    PlanError::NoPlan {
        op: 0,
        op_name: trace.ops()[0].name.clone(),
        tensor: t,
        tensor_name: info.name.clone(),
        tensor_bytes: info.bytes,
        resident: trace.persistent_bytes(),
        budget,
        reason: format!(
            "persistent tensors ({}s and the like) stay resident, and together they exceed \
             the budget",
            info.kind.label()
        ),
    }
}

/// The error for an op whose allocations cannot be made room for because
/// every resident tensor is one of its own. The working-set check rules this
/// out; should the accounting ever disagree, the caller gets an error naming
/// the op and the budget rather than a plan that fails its replay.
fn no_victim(
    trace: &Trace,
    op: usize,
    resident: &[bool],
    needed: u64,
    budget: u64,
    evict_persistent: bool,
) -> PlanError {
    let largest = trace
        .uses(op)
        .iter()
        .copied()
        .filter(|t| resident[t.index()])
        .max_by_key(|&t| (trace.tensor(t).bytes, std::cmp::Reverse(t)))
        .unwrap_or(TensorId(0));
    let info = trace.get_tensor(largest);
    PlanError::NoPlan {
        op,
        op_name: trace.ops()[op].name.clone(),
        tensor: largest,
        tensor_name: info.map(|t| t.name.clone()).unwrap_or_default(),
        tensor_bytes: info.map(|t| t.bytes).unwrap_or(0),
        resident: needed,
        budget,
        reason: if evict_persistent {
            "the op itself uses it, as it does every resident tensor: nothing is left to evict"
                .into()
        } else {
            "the op itself uses it, and every other resident tensor is persistent (kept \
             resident): nothing is left to evict"
                .into()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Phase, TensorKind, TraceBuilder};

    const MIB: u64 = 1 << 20;

    /// The case `lru_is_sound` shrank to (tests/props.proptest-regressions):
    /// two layers with parameters and momentum, 40 MiB of persistent tensors
    /// against a budget of about 31.3 MiB.
    fn two_layers_with_momentum() -> Trace {
        let mut b = TraceBuilder::new();
        let input = b.tensor("input", 2 * MIB, TensorKind::Activation);
        let w0 = b.tensor("w0", 10 * MIB, TensorKind::Parameter);
        let dw0 = b.tensor("dw0", 10 * MIB, TensorKind::Gradient);
        let m0 = b.tensor("m0", 10 * MIB, TensorKind::OptimizerState);
        let y0 = b.tensor("y0", MIB, TensorKind::Activation);
        let w1 = b.tensor("w1", 10 * MIB, TensorKind::Parameter);
        let dw1 = b.tensor("dw1", 10 * MIB, TensorKind::Gradient);
        let m1 = b.tensor("m1", 10 * MIB, TensorKind::OptimizerState);
        let y1 = b.tensor("y1", MIB, TensorKind::Activation);
        let dlast = b.tensor("dlast", MIB, TensorKind::Gradient);
        let d1 = b.tensor("d1.0", MIB, TensorKind::Gradient);
        let d0 = b.tensor("d0.0", 2 * MIB, TensorKind::Gradient);
        b.timed_op("f0", Phase::Forward, &[input, w0], &[y0], 5e-5);
        b.timed_op("f1", Phase::Forward, &[y0, w1], &[y1], 5e-5);
        b.timed_op("loss", Phase::Forward, &[y1], &[dlast], 1e-4);
        b.timed_op(
            "b1",
            Phase::Backward,
            &[dlast, y0, y1, w1],
            &[d1, dw1],
            5e-5,
        );
        b.timed_op(
            "b0",
            Phase::Backward,
            &[d1, input, y0, w0],
            &[d0, dw0],
            5e-5,
        );
        b.timed_op("opt0", Phase::Optimizer, &[w0, dw0, m0], &[w0, m0], 2e-5);
        b.timed_op("opt1", Phase::Optimizer, &[w1, dw1, m1], &[w1, m1], 2e-5);
        b.build().unwrap()
    }

    #[test]
    fn lru_homes_persistent_tensors_that_do_not_fit_at_the_start() {
        let trace = two_layers_with_momentum();
        let cost = CostModel::pcie3_x16();
        let budget = 32_831_431; // 0.474 of the unplanned peak
        assert!(trace.persistent_bytes() > budget);
        assert!((0..trace.num_ops()).all(|op| trace.working_set_bytes(op) <= budget));

        let plan = LruPlanner::new(budget, cost).plan(&trace).unwrap();
        // w0, w1 and m0 (first used by f0, f1 and opt0) fill 30 MiB; m1,
        // first used by the last op, starts on the host.
        let m1 = TensorId(7);
        assert_eq!(trace.tensor(m1).name, "m1");
        assert_eq!(plan.host_resident_at_start, vec![m1]);
        assert!(plan
            .actions
            .iter()
            .all(|a| matches!(a, Action::Evict { .. } | Action::Fetch { .. })));
        assert!(plan.actions.iter().any(|a| matches!(
            a,
            Action::Fetch { tensor, before_op: 6, .. } if *tensor == m1
        )));
        // Nothing is evicted that was never resident, and the replay the
        // prediction comes from keeps the budget throughout.
        let rep = Simulator::new(cost, Some(budget))
            .run(&trace, &plan)
            .unwrap();
        assert!(rep.peak_bytes <= budget);
        assert!(rep.resident_bytes.iter().all(|&r| r <= budget));
        assert_eq!(rep.prediction(), plan.predicted);
        // m1 ends the iteration on the device: the plan says so.
        assert!(!rep.end_state_consistent);
        assert_eq!(plan.notes.len(), 1);
    }

    #[test]
    fn lru_keeps_every_persistent_tensor_resident_when_they_fit() {
        let trace = two_layers_with_momentum();
        let cost = CostModel::pcie3_x16();
        let plan = LruPlanner::new(trace.persistent_bytes() + 3 * MIB, cost)
            .plan(&trace)
            .unwrap();
        assert!(plan.host_resident_at_start.is_empty());
    }
}
