//! The planner against the baselines, on the simulated device.

mod common;
use common::*;
use ramus_swap::{
    Action, AutoVmPlanner, LruPlanner, NoBudgetPlanner, Phase, Planner, Policy, PrefetchTiming,
    SimError, Simulator, TensorId, TensorKind, TraceBuilder,
};

#[test]
fn planner_moves_fewer_bytes_and_stalls_less_than_lru() {
    let mut compared = 0;
    let cnns = cnn_traces().len();
    for (i, (name, trace)) in all_traces().into_iter().enumerate() {
        let cnn = i < cnns;
        let peak = peak(&trace);
        for f in [0.5, 0.6, 0.7, 0.8, 0.9] {
            let budget = (peak as f64 * f) as u64;
            let Ok(lru) = LruPlanner::new(budget, cost()).plan(&trace) else {
                continue; // below the largest working set
            };
            check_plan(&trace, &lru, Some(budget), cost());
            assert!(lru
                .actions
                .iter()
                .all(|a| matches!(a, Action::Evict { .. } | Action::Fetch { .. })));
            for timing in [PrefetchTiming::Earliest, PrefetchTiming::Profiled] {
                let p = autovm(&trace, budget, timing);
                let (a, b) = (&p.predicted, &lru.predicted);
                if cnn {
                    assert!(
                        a.bytes_to_host < b.bytes_to_host,
                        "{name} {f} {timing:?}: to host {} >= {}",
                        a.bytes_to_host,
                        b.bytes_to_host
                    );
                    assert!(
                        a.bytes_to_device < b.bytes_to_device,
                        "{name} {f} {timing:?}: to device {} >= {}",
                        a.bytes_to_device,
                        b.bytes_to_device
                    );
                } else {
                    // On a chain LRU evicts in farthest-next-use order too;
                    // it may also evict sub-threshold tensors the planner
                    // keeps. Same bytes up to that rounding.
                    assert!(
                        a.bytes_to_host as f64 <= b.bytes_to_host as f64 * 1.001,
                        "{name} {f} {timing:?}"
                    );
                    assert!(
                        a.bytes_to_device as f64 <= b.bytes_to_device as f64 * 1.001,
                        "{name} {f} {timing:?}"
                    );
                }
                assert!(
                    a.stall_s < b.stall_s,
                    "{name} {f} {timing:?}: stall {} >= {}",
                    a.stall_s,
                    b.stall_s
                );
                assert!(a.peak_bytes <= budget && b.peak_bytes <= budget);
                compared += 1;
            }
        }
    }
    assert!(compared >= 40, "{compared}");
}

#[test]
fn lru_evicts_the_least_recently_used_tensor() {
    let mib = 1u64 << 20;
    let mut b = TraceBuilder::new();
    let a = b.tensor("a", 4 * mib, TensorKind::Activation);
    let bb = b.tensor("b", 4 * mib, TensorKind::Activation);
    let c = b.tensor("c", 4 * mib, TensorKind::Activation);
    b.op("make a", Phase::Forward, &[], &[a]);
    b.op("make b", Phase::Forward, &[], &[bb]);
    b.op("make c", Phase::Forward, &[], &[c]); // needs room: evict a
    b.op("use b", Phase::Backward, &[bb, c], &[]);
    b.op("use a", Phase::Backward, &[a], &[]); // fetch a back
    let t = b.build().unwrap();
    let plan = LruPlanner::new(8 * mib, cost()).plan(&t).unwrap();
    assert_eq!(plan.policy, Policy::Lru);
    let kinds: Vec<(&str, TensorId, usize)> = plan
        .actions
        .iter()
        .map(|x| match x {
            Action::Evict {
                tensor, before_op, ..
            } => ("evict", *tensor, *before_op),
            Action::Fetch {
                tensor, before_op, ..
            } => ("fetch", *tensor, *before_op),
            _ => ("other", x.tensor(), 0),
        })
        .collect();
    assert_eq!(kinds, vec![("evict", a, 2), ("fetch", a, 4)]);
    let rep = check_plan(&t, &plan, Some(8 * mib), cost());
    // Synchronous: compute waits for both copies in full.
    let copy = cost().d2h_time(4 * mib) + cost().h2d_time(4 * mib);
    assert!((rep.stall_s - copy).abs() < 1e-12);
}

#[test]
fn unplanned_iteration_over_budget_names_op_tensor_and_budget() {
    for (name, trace) in all_traces() {
        let plan = NoBudgetPlanner::new(cost()).plan(&trace).unwrap();
        let budget = peak(&trace) * 9 / 10;
        match Simulator::new(cost(), Some(budget)).run(&trace, &plan) {
            Err(e @ SimError::BudgetExceeded { .. }) => {
                let SimError::BudgetExceeded {
                    op,
                    tensor,
                    budget: b,
                    op_name,
                    tensor_name,
                    ..
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!(*b, budget);
                assert_eq!(op_name, &trace.ops()[*op].name);
                assert_eq!(tensor_name, &trace.tensor(*tensor).name);
                let msg = e.to_string();
                assert!(
                    msg.contains(op_name)
                        && msg.contains(tensor_name)
                        && msg.contains(&budget.to_string()),
                    "{msg}"
                );
            }
            other => panic!("{name}: expected BudgetExceeded, got {other:?}"),
        }
    }
}

#[test]
fn planner_moves_nothing_when_everything_fits() {
    for (_, trace) in all_traces() {
        let peak = peak(&trace);
        let p = AutoVmPlanner::new(config(peak, PrefetchTiming::Profiled))
            .plan(&trace)
            .unwrap();
        let lru = LruPlanner::new(peak, cost()).plan(&trace).unwrap();
        let none = NoBudgetPlanner::new(cost()).plan(&trace).unwrap();
        assert!(p.actions.is_empty() && lru.actions.is_empty());
        assert_eq!(p.predicted.total_s, none.predicted.total_s);
        assert_eq!(lru.predicted.total_s, none.predicted.total_s);
    }
}
