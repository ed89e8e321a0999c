//! Budgets no plan can meet give errors naming the op, the tensor and the budget.

mod common;
use common::*;
use ramus_swap::{
    analyze, AutoVmPlanner, LruPlanner, PlanError, Planner, PrefetchTiming, TensorKind,
};

#[test]
fn budget_below_the_largest_working_set_is_named() {
    for (name, trace) in all_traces() {
        let an = analyze(&trace, &cost());
        let budget = an.max_working_set_bytes - 1;
        let planners: Vec<Box<dyn Planner>> = vec![
            Box::new(AutoVmPlanner::new(config(budget, PrefetchTiming::Earliest))),
            Box::new(AutoVmPlanner::new(config(budget, PrefetchTiming::Profiled))),
            Box::new(LruPlanner::new(budget, cost())),
        ];
        for p in planners {
            let e = p.plan(&trace).unwrap_err();
            let PlanError::WorkingSetExceedsBudget {
                op,
                ref op_name,
                tensor,
                ref tensor_name,
                tensor_bytes,
                working_set,
                budget: b,
            } = e
            else {
                panic!("{name}: {e}");
            };
            assert_eq!(b, budget);
            assert!(working_set > budget);
            assert_eq!(working_set, trace.working_set_bytes(op));
            assert_eq!(op_name, &trace.ops()[op].name);
            assert!(trace.uses(op).contains(&tensor));
            assert_eq!(tensor_name, &trace.tensor(tensor).name);
            // The largest tensor of the op.
            assert!(trace
                .uses(op)
                .iter()
                .all(|&t| trace.tensor(t).bytes <= tensor_bytes));
            let msg = e.to_string();
            for part in [op_name.as_str(), tensor_name.as_str(), &budget.to_string()] {
                assert!(msg.contains(part), "{msg} lacks {part}");
            }
        }
        // One byte more than the largest working set is not necessarily
        // enough (other tensors must stay), but the whole peak always is.
        assert!(
            AutoVmPlanner::new(config(an.peak_bytes, PrefetchTiming::Auto))
                .plan(&trace)
                .is_ok()
        );
    }
}

#[test]
fn a_tensor_that_cannot_move_is_named_with_the_reason() {
    let (_, trace) = cnn_traces().remove(0); // VGG-19
    let budget = peak(&trace) / 2;
    // Parameters may not move, so VGG's 400 MB fc6 weight blocks Nm = 2.
    let mut cfg = config(budget, PrefetchTiming::Earliest);
    cfg.offload_kinds = vec![
        TensorKind::Activation,
        TensorKind::Gradient,
        TensorKind::OptimizerState,
    ];
    let e = AutoVmPlanner::new(cfg.clone()).plan(&trace).unwrap_err();
    let PlanError::NoPlan {
        op,
        ref tensor_name,
        resident,
        budget: b,
        ref reason,
        ..
    } = e
    else {
        panic!("{e}");
    };
    assert_eq!(b, budget);
    assert!(resident > budget);
    assert!(trace.working_set_bytes(op) <= budget);
    let msg = e.to_string();
    assert!(
        msg.contains(&trace.ops()[op].name) && msg.contains(tensor_name.as_str()),
        "{msg}"
    );
    assert!(
        reason.contains("not offloadable") || reason.contains("threshold"),
        "{reason}"
    );
    // A reuse threshold no gap meets.
    cfg.offload_kinds.push(TensorKind::Parameter);
    cfg.min_reuse_ops = 10_000;
    let e = AutoVmPlanner::new(cfg.clone()).plan(&trace).unwrap_err();
    assert!(e.to_string().contains("reuse distance"), "{e}");
    // A size threshold nothing meets.
    cfg.min_reuse_ops = 2;
    cfg.size_threshold_bytes = u64::MAX;
    let e = AutoVmPlanner::new(cfg).plan(&trace).unwrap_err();
    assert!(e.to_string().contains("size threshold"), "{e}");
}

#[test]
fn bad_configuration_is_an_error() {
    let (_, trace) = cnn_traces().remove(0);
    let mut cfg = config(1 << 40, PrefetchTiming::Auto);
    cfg.cost.h2d_bytes_per_s = f64::NAN;
    assert!(matches!(
        AutoVmPlanner::new(cfg).plan(&trace),
        Err(PlanError::Config(_))
    ));
    let mut cfg = config(1 << 40, PrefetchTiming::Auto);
    cfg.min_reuse_time_s = Some(-1.0);
    assert!(matches!(
        AutoVmPlanner::new(cfg).plan(&trace),
        Err(PlanError::Config(_))
    ));
}
