//! Listing 3.1's rules: nothing below the size threshold, nothing with a
//! short reuse distance, nothing of a kind that is not offloadable.

mod common;
use common::*;
use ramus_swap::{analyze, Action, AutoVmPlanner, PlanError, Planner, PrefetchTiming, TensorKind};

/// Reuse distance in ops of an offload/prefetch pair.
fn reuse_ops(after: usize, needed: usize, n: usize) -> usize {
    if needed > after {
        needed - after - 1
    } else {
        (n - 1 - after) + needed
    }
}

#[test]
fn size_and_reuse_thresholds_are_respected() {
    let mut checked = 0;
    for (name, trace) in all_traces() {
        let n = trace.num_ops();
        let budget = peak(&trace) * 7 / 10;
        for (size, reuse) in [(1u64 << 20, 2usize), (64 << 20, 4), (256 << 20, 8)] {
            let mut cfg = config(budget, PrefetchTiming::Profiled);
            cfg.size_threshold_bytes = size;
            cfg.min_reuse_ops = reuse;
            let plan = match AutoVmPlanner::new(cfg).plan(&trace) {
                Ok(p) => p,
                // Strict thresholds may leave nothing to offload: the error
                // then says which threshold kept the blocking tensor.
                Err(PlanError::NoPlan { reason, .. }) if size > 1 << 20 => {
                    assert!(
                        reason.contains("threshold") || reason.contains("kind"),
                        "{reason}"
                    );
                    continue;
                }
                Err(e) => panic!("{name}: {e}"),
            };
            check_plan(&trace, &plan, Some(budget), cost());
            assert!(!plan.offloads.is_empty());
            checked += 1;
            for a in &plan.actions {
                assert!(a.bytes() >= size, "{name}: {} below {size}", a.tensor());
            }
            for o in &plan.offloads {
                assert!(o.bytes >= size);
                assert_eq!(
                    o.reuse_ops,
                    reuse_ops(o.offload_after_op, o.needed_by_op, n)
                );
                assert!(
                    o.reuse_ops >= reuse,
                    "{name}: {} reuse {} < {reuse}",
                    o.name,
                    o.reuse_ops
                );
            }
            // The offload/prefetch pairs themselves, independently of the
            // planner's own summary.
            for a in &plan.actions {
                if let Action::Prefetch {
                    tensor,
                    needed_by_op,
                    ..
                } = a
                {
                    let off = plan.actions.iter().find_map(|b| match b {
                        Action::Offload {
                            tensor: t,
                            after_op,
                            ..
                        } if t == tensor => {
                            let d = reuse_ops(*after_op, *needed_by_op, n);
                            let next_use_after = (after_op + 1..n)
                                .chain(0..=*after_op)
                                .find(|&op| trace.uses(op).contains(tensor));
                            (next_use_after == Some(*needed_by_op)).then_some(d)
                        }
                        _ => None,
                    });
                    assert!(off.expect("prefetch without offload") >= reuse);
                }
            }
        }
    }
    assert!(checked >= 8, "only {checked} plans checked");
}

#[test]
fn reuse_time_threshold_is_respected() {
    for (name, trace) in cnn_traces() {
        let an = analyze(&trace, &cost());
        let budget = an.peak_bytes * 8 / 10;
        let min_time = 0.05;
        let mut cfg = config(budget, PrefetchTiming::Profiled);
        cfg.min_reuse_time_s = Some(min_time);
        let plan = AutoVmPlanner::new(cfg).plan(&trace).unwrap();
        check_plan(&trace, &plan, Some(budget), cost());
        for o in &plan.offloads {
            assert!(
                o.reuse_time_s >= min_time,
                "{name}: {} {}",
                o.name,
                o.reuse_time_s
            );
            let t = an.time_between(o.offload_after_op, o.needed_by_op);
            assert!((t - o.reuse_time_s).abs() < 1e-12);
        }
    }
}

#[test]
fn only_offloadable_kinds_move() {
    let mut checked = 0;
    for (name, trace) in all_traces() {
        let budget = peak(&trace) * 7 / 10;
        let mut cfg = config(budget, PrefetchTiming::Earliest);
        cfg.offload_kinds = vec![TensorKind::Activation];
        let plan = match AutoVmPlanner::new(cfg).plan(&trace) {
            Ok(p) => p,
            Err(PlanError::NoPlan { reason, .. }) => {
                assert!(!reason.is_empty());
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        check_plan(&trace, &plan, Some(budget), cost());
        assert!(plan.host_resident_at_start.is_empty());
        checked += 1;
        for a in &plan.actions {
            assert_eq!(
                trace.tensor(a.tensor()).kind,
                TensorKind::Activation,
                "{name}"
            );
        }
    }
    assert!(checked >= 3, "only {checked} plans checked");
}

#[test]
fn candidates_follow_listing_3_1() {
    let (_, trace) = cnn_traces().remove(0);
    let mut cfg = config(peak(&trace), PrefetchTiming::Earliest);
    cfg.size_threshold_bytes = 100 << 20;
    cfg.min_reuse_ops = 3;
    let planner = AutoVmPlanner::new(cfg);
    let (cands, an) = planner.candidates(&trace);
    assert!(!cands.is_empty());
    for c in &cands {
        assert!(c.bytes >= 100 << 20);
        assert!(c.gap.ops_between >= 3);
        assert_ne!(trace.tensor(c.tensor).kind, TensorKind::Workspace);
    }
    // Every big activation's forward→backward gap is a candidate.
    for l in &an.tensors {
        if let Some(g) = l.forward_backward {
            if l.kind == TensorKind::Activation && l.bytes >= 100 << 20 && g.ops_between >= 3 {
                assert!(cands
                    .iter()
                    .any(|c| c.tensor == l.tensor && c.gap.after_op == g.after_op));
            }
        }
    }
}
