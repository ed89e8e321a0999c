//! The executor (the mechanism's ordering logic) on the simulated device:
//! plans of the AutoVM planner and of the LRU baseline run within their
//! budget and move exactly the bytes the plan says; naive on-demand
//! swapping fits any budget an op's working set fits; broken plans are
//! rejected with errors naming the op and the tensor; and the simulated
//! device itself catches an executor that reuses memory too early.

mod common;

use common::{cnn_traces, cost, peak};
use ramus_swap::{
    Action, AutoVmPlanner, ExecOptions, Executor, ExecutorError, LruPlanner, Phase, Planner,
    PlannerConfig, PrefetchTiming, SimDevice, SwapDevice, SwapPlan, TensorId, TensorKind, Trace,
    TraceBuilder,
};

/// The planner as the CUDA engine configures it: persistent tensors stay.
fn planner(budget: u64, timing: PrefetchTiming) -> AutoVmPlanner {
    let mut c = PlannerConfig::new(budget);
    c.cost = cost();
    c.timing = timing;
    c.offload_kinds = vec![TensorKind::Activation, TensorKind::Gradient];
    AutoVmPlanner::new(c)
}

fn run_plan(
    trace: &Trace,
    plan: &SwapPlan,
    budget: u64,
    latency: usize,
) -> Result<(ramus_swap::ExecReport, ramus_swap::SimDeviceCounts), ExecutorError> {
    let ex = Executor::new(trace, Some(plan), ExecOptions::planned(Some(budget)))?;
    let mut dev = SimDevice::new(trace, Some(budget)).with_latency(latency);
    let report = ex.run(&mut dev)?;
    Ok((report, dev.counts().clone()))
}

#[test]
fn autovm_plans_execute_within_budget_and_move_the_planned_bytes() {
    for (name, trace) in cnn_traces() {
        let p = peak(&trace);
        for nm in [1.25, 1.5, 2.0] {
            let budget = (p as f64 / nm) as u64;
            for timing in [PrefetchTiming::Earliest, PrefetchTiming::Auto] {
                let plan = match planner(budget, timing).plan(&trace) {
                    Ok(plan) => plan,
                    // weights that must stay resident can make a budget infeasible
                    Err(e) => {
                        println!("{name} Nm {nm}: no plan: {e}");
                        continue;
                    }
                };
                assert!(plan
                    .actions
                    .iter()
                    .any(|a| matches!(a, Action::Offload { .. })));
                for latency in [0, 1, 4, 1000] {
                    let (r, counts) = run_plan(&trace, &plan, budget, latency)
                        .unwrap_or_else(|e| panic!("{name} Nm {nm} latency {latency}: {e}"));
                    assert_eq!(r.bytes_to_host, plan.predicted.bytes_to_host, "{name}");
                    assert_eq!(r.bytes_to_device, plan.predicted.bytes_to_device, "{name}");
                    assert_eq!(r.copies_to_host, plan.predicted.copies_to_host);
                    assert_eq!(r.copies_to_device, plan.predicted.copies_to_device);
                    assert_eq!(
                        (r.fallback_evictions, r.sync_evictions, r.unused_prefetches),
                        (0, 0, 0)
                    );
                    assert!(
                        r.peak_bytes <= budget,
                        "{name}: {} > {budget}",
                        r.peak_bytes
                    );
                    assert!(counts.peak_bytes <= budget);
                    assert_eq!(counts.refused_allocations, 0);
                    assert_eq!(counts.bytes_to_host, r.bytes_to_host);
                    assert_eq!(counts.bytes_to_device, r.bytes_to_device);
                    assert_eq!(counts.ops, trace.num_ops());
                    // only the persistent tensors remain
                    assert_eq!(counts.used_bytes, trace.persistent_bytes());
                }
            }
        }
    }
}

/// Whether `budget` can hold the persistent tensors plus the other tensors
/// of every op's working set (else no policy keeping weights resident fits).
fn feasible(trace: &Trace, budget: u64) -> bool {
    let persistent = trace.persistent_bytes();
    (0..trace.num_ops()).all(|op| {
        let transient: u64 = trace
            .uses(op)
            .iter()
            .map(|&t| trace.tensor(t))
            .filter(|t| !t.kind.is_persistent())
            .map(|t| t.bytes)
            .sum();
        persistent + transient <= budget
    })
}

#[test]
fn lru_plans_execute_like_their_prediction() {
    let mut ran = 0;
    for (name, trace) in cnn_traces() {
        let p = peak(&trace);
        // (VGG-19's 400 MB classifier weights, kept resident, rule out Nm = 2)
        for nm in [1.25, 1.5] {
            let budget = (p as f64 / nm) as u64;
            if !feasible(&trace, budget) {
                continue;
            }
            ran += 1;
            let plan = LruPlanner::new(budget, cost())
                .keep_persistent_resident()
                .plan(&trace)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(plan.host_resident_at_start.is_empty());
            let (r, counts) = run_plan(&trace, &plan, budget, 2).unwrap();
            assert_eq!(r.bytes_to_host, plan.predicted.bytes_to_host, "{name}");
            assert_eq!(r.bytes_to_device, plan.predicted.bytes_to_device, "{name}");
            assert_eq!(r.fallback_evictions, 0);
            assert!(counts.peak_bytes <= budget);
        }
    }
    assert!(ran >= 3, "{ran} cases");
}

#[test]
fn naive_on_demand_swapping_fits_the_device_and_matches_the_lru_planner() {
    let mut ran = 0;
    for (name, trace) in cnn_traces() {
        let p = peak(&trace);
        for nm in [1.0, 1.25, 1.5] {
            let budget = (p as f64 / nm) as u64;
            if !feasible(&trace, budget) {
                continue;
            }
            ran += 1;
            // the device refuses what does not fit; the executor has no budget of its own
            let ex = Executor::new(&trace, None, ExecOptions::on_demand(None)).unwrap();
            let mut dev = SimDevice::new(&trace, Some(budget)).with_latency(3);
            let r = ex
                .run(&mut dev)
                .unwrap_or_else(|e| panic!("{name} Nm {nm}: {e}"));
            assert!(dev.counts().peak_bytes <= budget);
            assert_eq!(r.sync_evictions, r.copies_to_host);
            assert_eq!(r.sync_fetches, r.copies_to_device);
            if nm <= 1.0 {
                assert_eq!(r.bytes_to_host, 0, "{name} fits");
            } else {
                assert!(r.bytes_to_host > 0, "{name} Nm {nm} must swap");
            }
            // with the budget as its own, it evicts exactly what the LRU planner plans
            let lru = LruPlanner::new(budget, cost())
                .keep_persistent_resident()
                .plan(&trace)
                .unwrap();
            let ex = Executor::new(&trace, None, ExecOptions::on_demand(Some(budget))).unwrap();
            let r = ex.run(&mut SimDevice::new(&trace, Some(budget))).unwrap();
            assert_eq!(
                r.bytes_to_host, lru.predicted.bytes_to_host,
                "{name} Nm {nm}"
            );
            assert_eq!(r.bytes_to_device, lru.predicted.bytes_to_device, "{name}");
        }
    }
    assert!(ran >= 6, "{ran} cases");
}

#[test]
fn no_swapping_over_the_budget_names_the_op_tensor_and_budget() {
    let (_, trace) = cnn_traces().remove(0);
    let budget = peak(&trace) / 2;
    let ex = Executor::new(&trace, None, ExecOptions::resident(None)).unwrap();
    let e = ex
        .run(&mut SimDevice::new(&trace, Some(budget)))
        .unwrap_err();
    let ExecutorError::OutOfMemory {
        budget: b,
        ref tensor_name,
        ..
    } = e
    else {
        panic!("{e}")
    };
    assert_eq!(b, Some(budget));
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{budget} bytes")) && msg.contains(tensor_name.as_str()),
        "{msg}"
    );
    // without a budget everything fits, nothing moves
    let r = ex.run(&mut SimDevice::new(&trace, None)).unwrap();
    assert_eq!(r.bytes_to_host + r.bytes_to_device, 0);
    assert_eq!(r.peak_bytes, peak(&trace));
}

/// A valid plan for ResNet-50 at Nm = 2.
fn resnet_plan() -> (Trace, SwapPlan, u64) {
    let (_, trace) = cnn_traces().remove(1);
    let budget = peak(&trace) / 2;
    let plan = planner(budget, PrefetchTiming::Earliest)
        .plan(&trace)
        .unwrap();
    (trace, plan, budget)
}

#[test]
fn a_plan_missing_a_prefetch_is_rejected_naming_the_op_and_tensor() {
    let (trace, mut plan, budget) = resnet_plan();
    let i = plan
        .actions
        .iter()
        .position(|a| matches!(a, Action::Prefetch { .. }))
        .unwrap();
    let Action::Prefetch {
        tensor,
        needed_by_op,
        ..
    } = plan.actions.remove(i)
    else {
        unreachable!()
    };
    let e = run_plan(&trace, &plan, budget, 1).unwrap_err();
    match &e {
        ExecutorError::NotResident { op, tensor: t, .. } => {
            assert_eq!((*op, *t), (needed_by_op, tensor))
        }
        other => panic!("{other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&trace.tensor(tensor).name), "{msg}");
    assert!(msg.contains(&trace.ops()[needed_by_op].name), "{msg}");
}

#[test]
fn a_prefetch_before_its_offload_is_rejected() {
    let (trace, mut plan, budget) = resnet_plan();
    let (t, after) = plan
        .actions
        .iter()
        .find_map(|a| match a {
            Action::Offload {
                tensor, after_op, ..
            } => Some((*tensor, *after_op)),
            _ => None,
        })
        .unwrap();
    for a in &mut plan.actions {
        if let Action::Prefetch {
            tensor,
            issue_before_op,
            ..
        } = a
        {
            if *tensor == t {
                *issue_before_op = after;
            }
        }
    }
    plan.actions.sort_by_key(|a| a.position());
    let e = run_plan(&trace, &plan, budget, 1).unwrap_err();
    assert!(matches!(e, ExecutorError::InvalidAction { .. }), "{e}");
    assert!(e.to_string().contains("not on the host"), "{e}");
}

#[test]
fn a_plan_over_a_smaller_budget_is_rejected_naming_the_budget() {
    let (trace, plan, budget) = resnet_plan();
    let smaller = budget * 9 / 10;
    let e = run_plan(&trace, &plan, smaller, 1).unwrap_err();
    match &e {
        ExecutorError::OutOfMemory { budget, .. } => assert_eq!(*budget, Some(smaller)),
        other => panic!("{other}"),
    }
    assert!(e
        .to_string()
        .contains("the plan does not free enough memory"));
}

#[test]
fn plans_that_move_persistent_tensors_or_belong_elsewhere_are_refused() {
    let (trace, plan, budget) = resnet_plan();
    let mut moved = plan.clone();
    let w = trace
        .tensors()
        .iter()
        .position(|t| t.kind == TensorKind::Parameter)
        .unwrap();
    moved.actions.insert(
        0,
        Action::Offload {
            tensor: TensorId(w as u32),
            name: trace.tensors()[w].name.clone(),
            bytes: trace.tensors()[w].bytes,
            after_op: 0,
        },
    );
    let e = Executor::new(&trace, Some(&moved), ExecOptions::planned(Some(budget))).unwrap_err();
    assert!(e.to_string().contains("stays on the device"), "{e}");
    let mut other = plan;
    other.num_ops += 1;
    let e = Executor::new(&trace, Some(&other), ExecOptions::planned(Some(budget))).unwrap_err();
    assert!(matches!(e, ExecutorError::Mismatch(_)), "{e}");
}

#[test]
fn persistent_tensors_carry_over_iterations() {
    let (trace, plan, budget) = resnet_plan();
    let ex = Executor::new(&trace, Some(&plan), ExecOptions::planned(Some(budget))).unwrap();
    let mut dev = SimDevice::new(&trace, Some(budget)).with_latency(2);
    for _ in 0..3 {
        ex.run(&mut dev).unwrap();
        dev.start_iteration().unwrap();
    }
    assert_eq!(dev.counts().ops, 3 * trace.num_ops());
}

/// x (offloaded after op 0) is needed by op 3; y and z fill the device.
fn small_trace() -> Trace {
    let mut b = TraceBuilder::new();
    let x = b.tensor("x", 100, TensorKind::Activation);
    let y = b.tensor("y", 100, TensorKind::Activation);
    let z = b.tensor("z", 50, TensorKind::Activation);
    b.op("a", Phase::Forward, &[], &[x]);
    b.op("b", Phase::Forward, &[], &[y]);
    b.op("c", Phase::Forward, &[y], &[z]);
    b.op("d", Phase::Backward, &[x, z], &[]);
    b.build().unwrap()
}

#[test]
fn the_simulated_device_catches_reuse_before_an_offload_completes() {
    let trace = small_trace();
    let x = TensorId(0);
    let mut dev = SimDevice::new(&trace, Some(200)).with_latency(5);
    assert!(dev.allocate(x, 100).unwrap());
    dev.run_op(0).unwrap();
    dev.offload(x).unwrap();
    assert!(!dev.offload_complete(x).unwrap());
    let e = dev.release(x).unwrap_err();
    assert!(
        e.to_string().contains("before its offload completed"),
        "{e}"
    );
    dev.wait_offload(x).unwrap();
    dev.release(x).unwrap();
    // a prefetched tensor must be awaited (or complete) before an op reads it
    assert!(dev.allocate(TensorId(1), 100).unwrap());
    dev.run_op(1).unwrap();
    assert!(dev.allocate(TensorId(2), 50).unwrap());
    dev.run_op(2).unwrap();
    assert!(!dev.allocate(x, 100).unwrap(), "over the budget of 200");
    dev.release(TensorId(1)).unwrap();
    assert!(dev.allocate(x, 100).unwrap());
    dev.prefetch(x).unwrap();
    let e = dev.run_op(3).unwrap_err();
    assert!(
        e.to_string().contains("before its prefetch completed"),
        "{e}"
    );
    dev.await_prefetch(x).unwrap();
    dev.run_op(3).unwrap();
    assert_eq!(dev.counts().bytes_to_host, 100);
    assert_eq!(dev.counts().bytes_to_device, 100);
}

#[test]
fn the_simulated_device_catches_stale_and_missing_data() {
    let trace = small_trace();
    let mut dev = SimDevice::new(&trace, None);
    // op c reads y, which op b never wrote
    assert!(dev.allocate(TensorId(0), 100).unwrap());
    dev.run_op(0).unwrap();
    assert!(dev.allocate(TensorId(1), 100).unwrap());
    let e = dev.run_op(2).unwrap_err();
    assert!(e.to_string().contains("out of order"), "{e}");
    let e = dev.prefetch(TensorId(1)).unwrap_err();
    assert!(e.to_string().contains("no host copy"), "{e}");
}

#[test]
fn a_device_refusing_what_the_plan_allows_falls_back_to_eviction() {
    // the device holds 8 % less than the plan was made for (as a fragmented
    // heap would): the executor evicts least-recently-used tensors itself,
    // fetches them back when touched, and skips the plan's moves of them
    let (trace, plan, budget) = resnet_plan();
    let smaller = budget - budget / 12;
    for latency in [0, 1, 5] {
        let ex = Executor::new(&trace, Some(&plan), ExecOptions::planned(Some(budget))).unwrap();
        let mut dev = SimDevice::new(&trace, Some(smaller)).with_latency(latency);
        let r = ex
            .run(&mut dev)
            .unwrap_or_else(|e| panic!("latency {latency}: {e}"));
        assert!(r.fallback_evictions > 0, "latency {latency}");
        assert!(dev.counts().peak_bytes <= smaller);
        assert_eq!(dev.counts().used_bytes, trace.persistent_bytes());
    }
}

#[test]
fn naive_swapping_in_a_fragmented_pool_clears_the_ops_tensors_and_places_them_again() {
    // a pool of 4 MiB: `a` at 0, `x` at 1 MiB, `b` at 2 MiB; once `x` is
    // freed the 2 MiB `c` fits the budget but no contiguous range, and every
    // other resident tensor is an input of the op that writes `c`
    const MIB: u64 = 1 << 20;
    let mut t = TraceBuilder::new();
    let a = t.tensor("a", MIB, TensorKind::Activation);
    let x = t.tensor("x", MIB, TensorKind::Activation);
    let b = t.tensor("b", MIB, TensorKind::Activation);
    let c = t.tensor("c", 2 * MIB, TensorKind::Activation);
    t.op("make a", Phase::Forward, &[], &[a]);
    t.op("make x", Phase::Forward, &[], &[x]);
    t.op("make b", Phase::Forward, &[x], &[b]);
    t.op("make c", Phase::Forward, &[a, b], &[c]);
    let trace = t.build().unwrap();
    let ex = Executor::new(&trace, None, ExecOptions::on_demand(None)).unwrap();
    let mut dev = SimDevice::with_pool(&trace, 4 * MIB, 0).unwrap();
    // both inputs leave and come back; `c` is placed first (largest)
    let r = ex
        .run(&mut dev)
        .expect("naive swapping defragments by eviction");
    assert_eq!((r.sync_evictions, r.sync_fetches), (2, 2), "{r:?}");
    assert_eq!((r.bytes_to_host, r.bytes_to_device), (2 * MIB, 2 * MIB));
    assert_eq!(dev.counts().refused_allocations, 1);
    // without swapping the same step fails, naming the op and the tensor
    let ex = Executor::new(&trace, None, ExecOptions::resident(None)).unwrap();
    let mut dev = SimDevice::with_pool(&trace, 4 * MIB, 0).unwrap();
    let e = ex.run(&mut dev).unwrap_err().to_string();
    assert!(e.contains("make c") && e.contains("`c`"), "{e}");
}
