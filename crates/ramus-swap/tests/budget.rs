//! Plans never exceed the budget in simulated replay, on CNN and dynamic
//! model traces, at budgets from 0.5 to 1.0 of the unplanned peak.

mod common;
use common::*;
use ramus_swap::{
    analyze, AutoVmPlanner, NoBudgetPlanner, PlacementOrder, PlanError, Planner, PrefetchTiming,
    Selection,
};

const FRACTIONS: [f64; 6] = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

fn fits_everywhere(traces: Vec<(&'static str, ramus_swap::Trace)>) {
    for (name, trace) in traces {
        let an = analyze(&trace, &cost());
        for f in FRACTIONS {
            let budget = (an.peak_bytes as f64 * f) as u64;
            for timing in [PrefetchTiming::Earliest, PrefetchTiming::Profiled] {
                let result = AutoVmPlanner::new(config(budget, timing)).plan(&trace);
                if budget < an.max_working_set_bytes {
                    // No plan can exist: one op alone needs more.
                    match result {
                        Err(PlanError::WorkingSetExceedsBudget { op, budget: b, .. }) => {
                            assert_eq!(b, budget);
                            assert!(trace.working_set_bytes(op) > budget);
                        }
                        other => {
                            panic!("{name} at {f}: expected the working-set error, got {other:?}")
                        }
                    }
                    continue;
                }
                let plan = result.unwrap_or_else(|e| panic!("{name} at {f} of peak: {e}"));
                let rep = check_plan(&trace, &plan, Some(budget), cost());
                if f < 1.0 {
                    assert!(!plan.actions.is_empty(), "{name} at {f}: nothing moved");
                } else {
                    assert!(plan.actions.is_empty(), "{name} fits without swapping");
                    assert_eq!(rep.stall_s, 0.0);
                }
            }
        }
    }
}

#[test]
fn cnn_plans_fit_the_budget() {
    fits_everywhere(cnn_traces());
}

#[test]
fn vgg_and_resnet_fit_at_half_their_peak() {
    // Nm = 2 is above every op's working set for these two.
    for (name, trace) in cnn_traces().into_iter().take(2) {
        let an = analyze(&trace, &cost());
        assert!(an.max_working_set_bytes <= an.peak_bytes / 2, "{name}");
    }
}

#[test]
fn sequence_and_tree_plans_fit_the_budget() {
    fits_everywhere(dynamic_traces());
}

#[test]
fn deep_resnet_fits_at_half_its_peak() {
    let trace = ramus_swap::synthetic::resnet([3, 8, 36, 3], 16, 224, speed())
        .trace()
        .unwrap();
    let budget = peak(&trace) / 2;
    let plan = autovm(&trace, budget, PrefetchTiming::Profiled);
    check_plan(&trace, &plan, Some(budget), cost());
}

#[test]
fn thesis_variants_fit_too() {
    // Every candidate offloaded (thesis behaviour) and Listing 3.4 in
    // offload order, with and without reordering.
    for (name, trace) in cnn_traces() {
        let budget = peak(&trace) * 3 / 4;
        for (sel, order, reorder) in [
            (Selection::AllCandidates, PlacementOrder::Need, true),
            (Selection::Needed, PlacementOrder::Offload, true),
            (Selection::Needed, PlacementOrder::Offload, false),
        ] {
            let mut cfg = config(budget, PrefetchTiming::Earliest);
            cfg.selection = sel;
            cfg.placement_order = order;
            cfg.reorder_prefetches = reorder;
            let plan = AutoVmPlanner::new(cfg)
                .plan(&trace)
                .unwrap_or_else(|e| panic!("{name} {sel:?} {order:?}: {e}"));
            check_plan(&trace, &plan, Some(budget), cost());
        }
    }
}

#[test]
fn no_budget_baseline_reports_the_peak() {
    for (name, trace) in all_traces() {
        let plan = NoBudgetPlanner::new(cost()).plan(&trace).unwrap();
        assert!(plan.actions.is_empty());
        assert_eq!(plan.predicted.peak_bytes, peak(&trace), "{name}");
        assert_eq!(plan.predicted.stall_s, 0.0);
        let rep = check_plan(&trace, &plan, None, cost());
        assert_eq!(rep.copies_to_host + rep.copies_to_device, 0);
    }
}
