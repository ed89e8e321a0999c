//! A chain of layers: no swapping when it fits, needed selection under a
//! budget, and an impossible budget named.

use super::{AutoVmPlanner, Planner, PlannerConfig, PrefetchTiming};
use crate::analysis::analyze;
use crate::cost::CostModel;
use crate::error::PlanError;
use crate::trace::{Phase, TensorKind, Trace, TraceBuilder};

/// A chain of `k` forward layers and their backward, every activation
/// `mib` MiB, each op 1 ms.
fn chain(k: usize, mib: u64) -> Trace {
    let mut b = TraceBuilder::new();
    let mut acts = vec![b.tensor("x0", mib << 20, TensorKind::Activation)];
    for i in 0..k {
        let y = b.tensor(format!("y{}", i + 1), mib << 20, TensorKind::Activation);
        b.timed_op(
            format!("f{}", i + 1),
            Phase::Forward,
            &[acts[i]],
            &[y],
            1e-3,
        );
        acts.push(y);
    }
    let mut d = b.tensor(format!("d{k}"), mib << 20, TensorKind::Gradient);
    b.timed_op("loss", Phase::Forward, &[acts[k]], &[d], 1e-3);
    for i in (0..k).rev() {
        let dx = b.tensor(format!("d{i}"), mib << 20, TensorKind::Gradient);
        b.timed_op(
            format!("b{}", i + 1),
            Phase::Backward,
            &[d, acts[i], acts[i + 1]],
            &[dx],
            1e-3,
        );
        d = dx;
    }
    b.build().unwrap()
}

#[test]
fn fits_without_swapping_when_the_budget_allows() {
    let t = chain(6, 10);
    let an = analyze(&t, &CostModel::default());
    let plan = AutoVmPlanner::new(PlannerConfig::new(an.peak_bytes))
        .plan(&t)
        .unwrap();
    assert!(plan.actions.is_empty());
    assert_eq!(plan.predicted.peak_bytes, an.peak_bytes);
}

#[test]
fn needed_selection_fits_the_budget() {
    let t = chain(8, 10);
    let an = analyze(&t, &CostModel::default());
    let budget = an.peak_bytes * 6 / 10;
    let mut cfg = PlannerConfig::new(budget);
    cfg.timing = PrefetchTiming::Earliest;
    let plan = AutoVmPlanner::new(cfg).plan(&t).unwrap();
    assert!(!plan.actions.is_empty());
    assert!(plan.predicted.peak_bytes <= budget);
    // The earliest activations (needed last) leave first.
    assert_eq!(plan.offloads[0].name, "x0");
}

#[test]
fn impossible_budget_names_op_tensor_and_budget() {
    let t = chain(4, 10);
    let e = AutoVmPlanner::new(PlannerConfig::new(25 << 20))
        .plan(&t)
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, PlanError::WorkingSetExceedsBudget { .. }),
        "{msg}"
    );
    assert!(msg.contains("`loss`") || msg.contains("`b"), "{msg}");
    assert!(msg.contains(&(25u64 << 20).to_string()), "{msg}");
}
