//! Plans and traces round-trip through JSON; the listing is readable.

mod common;
use common::*;
use ramus_swap::{
    AutoVmPlanner, LruPlanner, NoBudgetPlanner, PlanError, Planner, PrefetchTiming, SwapPlan, Trace,
};

#[test]
fn plans_round_trip_through_json() {
    for (name, trace) in all_traces() {
        let budget = peak(&trace) * 2 / 3;
        let plans: Vec<SwapPlan> = vec![
            NoBudgetPlanner::new(cost()).plan(&trace).unwrap(),
            LruPlanner::new(budget, cost()).plan(&trace).unwrap(),
            autovm(&trace, budget, PrefetchTiming::Earliest),
            autovm(&trace, budget, PrefetchTiming::Profiled),
        ];
        for plan in plans {
            let json = plan.to_json();
            assert!(json.contains('\n'), "pretty-printed");
            let back = SwapPlan::from_json(&json).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(back, plan, "{name} {:?}", plan.policy);
            // The replay of the read-back plan predicts the same.
            let rep = check_plan(&trace, &back, plan.budget_bytes, cost());
            assert_eq!(rep.prediction(), plan.predicted);
        }
    }
}

#[test]
fn json_is_self_describing() {
    let (_, trace) = cnn_traces().remove(0);
    let plan = autovm(&trace, peak(&trace) * 2 / 3, PrefetchTiming::Profiled);
    let v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    assert_eq!(v["policy"], "auto_vm_profiled");
    assert!(v["predicted"]["peak_bytes"].as_u64().unwrap() <= v["budget_bytes"].as_u64().unwrap());
    let actions = v["actions"].as_array().unwrap();
    let off = actions.iter().find(|a| a["action"] == "offload").unwrap();
    assert!(off["tensor"].is_u64() && off["name"].is_string() && off["after_op"].is_u64());
    let pre = actions.iter().find(|a| a["action"] == "prefetch").unwrap();
    assert!(pre["issue_before_op"].is_u64() && pre["needed_by_op"].is_u64());
}

#[test]
fn listing_names_ops_and_tensors() {
    let (_, trace) = cnn_traces().remove(0);
    let plan = autovm(&trace, peak(&trace) * 2 / 3, PrefetchTiming::Profiled);
    let text = plan.listing(Some(&trace));
    assert!(
        text.contains("offload") && text.contains("prefetch"),
        "{text}"
    );
    assert!(text.contains("`conv1.out`"), "{text}");
    assert!(text.contains("(fwd)") && text.contains("(bwd)"), "{text}");
    assert!(text.contains("needed by op"), "{text}");
    // Without the trace, ops are numbered.
    assert!(plan.to_string().contains("after  op "));
}

#[test]
fn malformed_json_is_an_error() {
    assert!(matches!(
        SwapPlan::from_json("{\"policy\": 3}"),
        Err(PlanError::Json(_))
    ));
    assert!(Trace::from_json("[]").is_err());
}

#[test]
fn traces_round_trip_through_json() {
    for (name, trace) in all_traces() {
        let back = Trace::from_json(&trace.to_json()).unwrap();
        assert_eq!(back, trace, "{name}");
        // A plan made from the read-back trace is the same plan.
        let budget = peak(&trace) * 3 / 4;
        let a = AutoVmPlanner::new(config(budget, PrefetchTiming::Auto))
            .plan(&trace)
            .unwrap();
        let b = AutoVmPlanner::new(config(budget, PrefetchTiming::Auto))
            .plan(&back)
            .unwrap();
        assert_eq!(a, b);
    }
}
