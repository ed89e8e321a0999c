//! Replays of a four-op trace: budget, timing, residency and action checks.

use crate::cost::CostModel;
use crate::error::SimError;
use crate::plan::{Action, Policy, Prediction, SwapPlan};
use crate::sim::Simulator;
use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceBuilder};

fn plan(actions: Vec<Action>, n: usize, budget: Option<u64>) -> SwapPlan {
    SwapPlan {
        policy: Policy::AutoVmEarliest,
        budget_bytes: budget,
        unplanned_peak_bytes: 0,
        num_ops: n,
        host_resident_at_start: vec![],
        actions,
        offloads: vec![],
        predicted: Prediction::default(),
        notes: vec![],
        layout: None,
    }
}

/// x: used by ops 0 and 3; y: 100 bytes written at 1, 2.
fn trace() -> Trace {
    let mut b = TraceBuilder::new();
    let x = b.tensor("x", 100, TensorKind::Activation);
    let y = b.tensor("y", 100, TensorKind::Activation);
    let z = b.tensor("z", 50, TensorKind::Activation);
    b.timed_op("a", Phase::Forward, &[], &[x], 1.0);
    b.timed_op("b", Phase::Forward, &[], &[y], 1.0);
    b.timed_op("c", Phase::Forward, &[y], &[z], 1.0);
    b.timed_op("d", Phase::Backward, &[x, z], &[], 1.0);
    b.build().unwrap()
}

fn cost() -> CostModel {
    CostModel {
        h2d_bytes_per_s: 100.0,
        d2h_bytes_per_s: 100.0,
        latency_s: 0.0,
        default_op_time_s: 1.0,
    }
}

fn x_round_trip(issue: usize) -> Vec<Action> {
    vec![
        Action::Offload {
            tensor: TensorId(0),
            name: "x".into(),
            bytes: 100,
            after_op: 0,
        },
        Action::Prefetch {
            tensor: TensorId(0),
            name: "x".into(),
            bytes: 100,
            issue_before_op: issue,
            needed_by_op: 3,
        },
    ]
}

#[test]
fn unplanned_replay_exceeds_a_budget_and_names_the_tensor() {
    let t = trace();
    let e = Simulator::new(cost(), Some(200))
        .run(&t, &plan(vec![], 4, Some(200)))
        .unwrap_err();
    match &e {
        SimError::BudgetExceeded {
            op, tensor, budget, ..
        } => assert_eq!((*op, *tensor, *budget), (2, TensorId(2), 200)),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("`c`") && e.to_string().contains("`z`"));
}

#[test]
fn offload_and_prefetch_fit_and_are_timed() {
    let t = trace();
    // Offloads take 2 s here.
    let slow = CostModel {
        d2h_bytes_per_s: 50.0,
        ..cost()
    };
    let r = Simulator::new(slow, Some(200))
        .run(&t, &plan(x_round_trip(3), 4, Some(200)))
        .unwrap();
    // The offload of x runs from t=1 to t=3 while b computes; c's output
    // only fits once it has completed (memory stall of 1 s), and d waits
    // for the prefetch issued at its own launch (data stall of 1 s).
    assert_eq!(r.op_start_s, vec![0.0, 1.0, 3.0, 5.0]);
    assert_eq!(r.peak_bytes, 200);
    assert_eq!((r.bytes_to_host, r.bytes_to_device), (100, 100));
    assert_eq!(r.stall_memory_s, 1.0);
    assert_eq!(r.stall_data_s, 1.0);
    assert_eq!(r.total_s, 6.0);
    assert_eq!(r.stall_s, 2.0);
    assert_eq!(r.late_prefetches, 1);
    assert!(r.end_state_consistent);
}

#[test]
fn using_an_offloaded_tensor_is_an_error() {
    let t = trace();
    let mut actions = x_round_trip(3);
    actions.pop();
    let e = Simulator::new(cost(), None)
        .run(&t, &plan(actions, 4, None))
        .unwrap_err();
    assert!(matches!(e, SimError::NotResident { op: 3, .. }), "{e}");
}

#[test]
fn prefetch_needs_the_tensor_on_the_host() {
    let t = trace();
    let actions = vec![x_round_trip(3).remove(1)];
    let e = Simulator::new(cost(), None)
        .run(&t, &plan(actions, 4, None))
        .unwrap_err();
    assert!(matches!(e, SimError::InvalidAction { .. }), "{e}");
}
