//! Listing 3.3 with measured op times: prefetches as late as possible while
//! still hidden; never later-and-worse than the unprofiled placement.

mod common;
use common::*;
use ramus_swap::{
    analyze, AutoVmPlanner, CostModel, Phase, PlanError, Planner, PlannerConfig, Policy,
    PrefetchTiming, Simulator, SwapPlan, TensorKind, Trace, TraceBuilder,
};

/// Whether each round trip of `earliest` was late in its own replay.
fn late_in_earliest(trace: &Trace, earliest: &SwapPlan, budget: u64) -> Vec<bool> {
    let rep = Simulator::new(cost(), Some(budget))
        .run(trace, earliest)
        .unwrap();
    earliest
        .offloads
        .iter()
        .map(|o| {
            rep.transfers.iter().any(|r| {
                r.tensor == o.tensor && r.used_by_op == Some(o.needed_by_op) && r.wait_s > 0.0
            })
        })
        .collect()
}

#[test]
fn profiled_prefetches_later_and_stalls_no_more() {
    let (mut later, mut earlier_where_late, mut better) = (0, 0, 0);
    for (name, trace) in all_traces() {
        let peak = peak(&trace);
        for f in [0.5, 0.6, 0.7, 0.8, 0.9] {
            let budget = (peak as f64 * f) as u64;
            let Ok(e) = AutoVmPlanner::new(config(budget, PrefetchTiming::Earliest)).plan(&trace)
            else {
                continue; // below the largest working set
            };
            let p = autovm(&trace, budget, PrefetchTiming::Profiled);
            assert_eq!(e.policy, Policy::AutoVmEarliest);
            assert_eq!(p.policy, Policy::AutoVmProfiled);
            check_plan(&trace, &p, Some(budget), cost());
            // Same round trips, different timing.
            assert_eq!(e.offloads.len(), p.offloads.len(), "{name} {f}");
            let late = late_in_earliest(&trace, &e, budget);
            for (i, (a, b)) in e.offloads.iter().zip(&p.offloads).enumerate() {
                assert_eq!((a.tensor, a.needed_by_op), (b.tensor, b.needed_by_op));
                if b.prefetch_before_op > a.prefetch_before_op {
                    later += 1;
                } else if b.prefetch_before_op < a.prefetch_before_op {
                    // Only a prefetch that was late may move earlier.
                    assert!(
                        late[i],
                        "{name} {f}: {} moved earlier though on time",
                        a.name
                    );
                    earlier_where_late += 1;
                }
            }
            assert!(
                p.predicted.stall_s <= e.predicted.stall_s * (1.0 + 1e-9) + 1e-12,
                "{name} {f}: profiled {} > earliest {}",
                p.predicted.stall_s,
                e.predicted.stall_s
            );
            if p.predicted.stall_s < e.predicted.stall_s * 0.99 {
                better += 1;
            }
        }
    }
    println!("later {later}, earlier where late {earlier_where_late}, better {better}");
    assert!(
        later > 100,
        "profiled placement should delay most prefetches ({later})"
    );
    assert!(better >= 1, "profiled placement should help somewhere");
}

/// A chain of layers whose backward ops (4 ms) each hide one 10 MiB
/// prefetch (2.5 ms); offloads are instant; memory is not binding in the
/// backward pass.
fn chain() -> (Trace, CostModel) {
    let mib = 1u64 << 20;
    let mut b = TraceBuilder::new();
    let k = 12;
    let mut acts = vec![b.tensor("x0", 10 * mib, TensorKind::Activation)];
    for i in 0..k {
        let y = b.tensor(format!("x{}", i + 1), 10 * mib, TensorKind::Activation);
        b.timed_op(format!("f{i}"), Phase::Forward, &[acts[i]], &[y], 1e-3);
        acts.push(y);
    }
    let mut d = b.tensor("d", mib, TensorKind::Gradient);
    b.timed_op("loss", Phase::Forward, &[acts[k]], &[d], 1e-3);
    for i in (0..k).rev() {
        let dx = b.tensor(format!("dx{i}"), mib, TensorKind::Gradient);
        b.timed_op(format!("b{i}"), Phase::Backward, &[d, acts[i]], &[dx], 4e-3);
        d = dx;
    }
    let cost = CostModel {
        h2d_bytes_per_s: 4.0 * mib as f64 * 1e3,
        d2h_bytes_per_s: 1e15,
        latency_s: 0.0,
        default_op_time_s: 1e-3,
    };
    (b.build().unwrap(), cost)
}

#[test]
fn profiled_prefetch_is_as_late_as_still_hidden() {
    let (trace, cost) = chain();
    let an = analyze(&trace, &cost);
    let budget = an.peak_bytes / 2;
    let mut cfg = PlannerConfig::new(budget);
    cfg.cost = cost;
    cfg.timing = PrefetchTiming::Profiled;
    let plan = AutoVmPlanner::new(cfg.clone()).plan(&trace).unwrap();
    let rep = check_plan(&trace, &plan, Some(budget), cost);
    assert!(!plan.offloads.is_empty());
    assert_eq!(rep.stall_data_s, 0.0, "every prefetch is hidden");
    // Independent Listing 3.3: walking back from the last consumer, the
    // latest op from which the copy, queued behind the earlier ones, still
    // completes in time.
    let s = &an.op_start_s;
    let mut next_start = f64::INFINITY;
    let mut trips = plan.offloads.clone();
    trips.sort_by_key(|o| o.needed_by_op);
    for o in trips.iter().rev() {
        let start = s[o.needed_by_op].min(next_start) - cost.h2d_time(o.bytes);
        let expect = (o.offload_after_op + 1..=o.needed_by_op)
            .rev()
            .find(|&k| s[k] <= start + 1e-15)
            .unwrap_or(o.offload_after_op + 1);
        assert_eq!(o.prefetch_before_op, expect, "{}", o.name);
        // One op later would no longer be hidden.
        if expect < o.needed_by_op {
            assert!(s[expect + 1] + cost.h2d_time(o.bytes) > s[o.needed_by_op].min(next_start));
        }
        next_start = start.max(s[expect]);
    }
    // The unprofiled placement holds the same tensors longer.
    cfg.timing = PrefetchTiming::Earliest;
    let early = AutoVmPlanner::new(cfg).plan(&trace).unwrap();
    let held = |p: &SwapPlan| -> u64 {
        p.offloads
            .iter()
            .map(|o| o.bytes * (o.needed_by_op - o.prefetch_before_op) as u64)
            .sum()
    };
    assert!(
        held(&plan) < held(&early),
        "{} vs {}",
        held(&plan),
        held(&early)
    );
    assert!(plan.predicted.peak_bytes <= early.predicted.peak_bytes);
}

#[test]
fn profiled_placement_needs_measured_times() {
    let (_, trace) = cnn_traces().remove(0);
    let bare = trace.without_durations();
    let budget = peak(&trace) * 3 / 4;
    match AutoVmPlanner::new(config(budget, PrefetchTiming::Profiled)).plan(&bare) {
        Err(e @ PlanError::MissingDuration { op: 0, .. }) => {
            assert!(e.to_string().contains("conv1"), "{e}");
        }
        other => panic!("expected MissingDuration, got {other:?}"),
    }
    // Auto: earliest without times, profiled with them.
    let auto = |t: &Trace| {
        AutoVmPlanner::new(config(budget, PrefetchTiming::Auto))
            .plan(t)
            .unwrap()
            .policy
    };
    assert_eq!(auto(&bare), Policy::AutoVmEarliest);
    assert_eq!(auto(&trace), Policy::AutoVmProfiled);
    // Without times the earliest plan is the same as with them: placement
    // does not look at durations.
    let a = autovm(&bare, budget, PrefetchTiming::Earliest);
    let b = autovm(&trace, budget, PrefetchTiming::Earliest);
    assert_eq!(a.actions, b.actions);
}
