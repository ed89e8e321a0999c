//! Shared helpers: synthetic traces and the invariants every plan must keep.
#![allow(dead_code)]

use ramus_swap::synthetic::{alexnet, resnet, vgg19, DeviceSpeed, LstmSpec, TreeSpec};
use ramus_swap::{
    analyze, Action, AutoVmPlanner, CostModel, Direction, Planner, PlannerConfig, PrefetchTiming,
    SimReport, Simulator, SwapPlan, Trace,
};

pub fn cost() -> CostModel {
    CostModel::pcie3_x16()
}

pub fn speed() -> DeviceSpeed {
    DeviceSpeed::rtx_2080_ti()
}

/// CNN training traces with realistic activation sizes.
pub fn cnn_traces() -> Vec<(&'static str, Trace)> {
    vec![
        ("vgg19", vgg19(64, 224, speed()).trace().unwrap()),
        (
            "resnet50",
            resnet([3, 4, 6, 3], 32, 224, speed()).trace().unwrap(),
        ),
        ("alexnet", alexnet(512, speed()).trace().unwrap()),
    ]
}

/// A long sequence and a batch of large trees.
pub fn dynamic_traces() -> Vec<(&'static str, Trace)> {
    vec![
        (
            "lstm",
            LstmSpec::new(256, 128, 2048, speed()).trace().unwrap(),
        ),
        (
            "tree-lstm",
            TreeSpec::new(32, 2048, 512, 3, speed()).trace().unwrap(),
        ),
    ]
}

pub fn all_traces() -> Vec<(&'static str, Trace)> {
    let mut v = cnn_traces();
    v.extend(dynamic_traces());
    v
}

pub fn peak(trace: &Trace) -> u64 {
    analyze(trace, &cost()).peak_bytes
}

pub fn config(budget: u64, timing: PrefetchTiming) -> PlannerConfig {
    let mut c = PlannerConfig::new(budget);
    c.cost = cost();
    c.timing = timing;
    c
}

pub fn autovm(trace: &Trace, budget: u64, timing: PrefetchTiming) -> SwapPlan {
    AutoVmPlanner::new(config(budget, timing))
        .plan(trace)
        .unwrap_or_else(|e| panic!("no plan at budget {budget}: {e}"))
}

/// Replays `plan` on an independent simulated device with `budget` and
/// checks every invariant a plan must keep; returns the report.
pub fn check_plan(
    trace: &Trace,
    plan: &SwapPlan,
    budget: Option<u64>,
    cost: CostModel,
) -> SimReport {
    let rep = Simulator::new(cost, budget)
        .run(trace, plan)
        .unwrap_or_else(|e| panic!("replay failed: {e}\n{}", plan.listing(Some(trace))));
    if let Some(b) = budget {
        assert!(
            rep.peak_bytes <= b,
            "peak {} over budget {b}",
            rep.peak_bytes
        );
        assert!(rep.resident_bytes.iter().all(|&r| r <= b));
    }
    assert!(rep.end_state_consistent || plan.policy == ramus_swap::Policy::Lru);
    assert_eq!(
        rep.prediction(),
        plan.predicted,
        "prediction differs from replay"
    );
    assert_eq!(
        rep.bytes_to_host,
        plan.actions
            .iter()
            .filter(|a| !a.is_to_device())
            .map(|a| a.bytes())
            .sum::<u64>()
    );
    // Actions are in position order.
    assert!(plan
        .actions
        .windows(2)
        .all(|w| w[0].position() <= w[1].position()));
    // Every copy to the device is complete before the op that uses it starts,
    // and that op is the one the plan names.
    for r in rep
        .transfers
        .iter()
        .filter(|r| r.direction == Direction::ToDevice)
    {
        let op = r.used_by_op.expect("prefetched tensor never used");
        assert!(
            rep.op_start_s[op] >= r.end_s - 1e-12,
            "op {op} started before its data arrived"
        );
        if let Action::Prefetch { needed_by_op, .. } = &plan.actions[r.action] {
            assert_eq!(*needed_by_op, op);
        }
    }
    // Every offloaded tensor comes back before its next use, after the offload.
    let n = trace.num_ops();
    for a in &plan.actions {
        if let Action::Offload {
            tensor, after_op, ..
        } = a
        {
            let next = (after_op + 1..n)
                .chain(0..=*after_op)
                .find(|&op| trace.uses(op).contains(tensor))
                .expect("offloaded tensor is used");
            let wraps = next <= *after_op;
            let back = plan.actions.iter().any(|b| match b {
                Action::Prefetch {
                    tensor: t,
                    issue_before_op,
                    needed_by_op,
                    ..
                } => {
                    t == tensor
                        && *needed_by_op == next
                        && *issue_before_op <= next
                        && (wraps || *issue_before_op > *after_op)
                }
                _ => false,
            });
            assert!(
                back,
                "{tensor} offloaded after op {after_op} is not back for op {next}"
            );
            if wraps {
                assert!(plan.host_resident_at_start.contains(tensor));
            }
        }
    }
    rep
}
