//! Property tests on random training traces: random layer sizes, skip
//! connections, parameters, op times, budgets and planner settings.

mod common;
use common::*;
use proptest::prelude::*;
use ramus_swap::{
    analyze, Action, AutoVmPlanner, ExecOptions, Executor, LruPlanner, Phase, PlacementOrder,
    PlanError, Planner, PrefetchTiming, Selection, SimDevice, SwapPlan, TensorId, TensorKind,
    Trace, TraceBuilder,
};
use std::collections::HashMap;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
struct Layer {
    out_mib: u64,
    skip: usize,
    param_mib: Option<u64>,
    fwd_ms: f64,
    bwd_ms: f64,
}

fn layer() -> impl Strategy<Value = Layer> {
    (
        1u64..=64,
        0usize..4,
        prop::option::of(1u64..=16),
        0.05f64..5.0,
        0.05f64..10.0,
    )
        .prop_map(|(out_mib, skip, param_mib, fwd_ms, bwd_ms)| Layer {
            out_mib,
            skip,
            param_mib,
            fwd_ms,
            bwd_ms,
        })
}

/// A training iteration over `layers`: forward (with skip inputs), loss,
/// backward in reverse (gradients accumulate where a tensor feeds several
/// layers), one optimizer op per parameter (with momentum if `state`).
fn build(layers: &[Layer], state: bool) -> Trace {
    let mut b = TraceBuilder::new();
    let mut acts = vec![b.tensor("input", 2 * MIB, TensorKind::Activation)];
    let mut recs = Vec::new();
    let mut params = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let x = acts[i];
        let skip = (l.skip > 0 && i >= l.skip).then(|| acts[i - l.skip]);
        let p = l.param_mib.map(|m| {
            let p = b.tensor(format!("w{i}"), m * MIB, TensorKind::Parameter);
            let g = b.tensor(format!("dw{i}"), m * MIB, TensorKind::Gradient);
            let s = state.then(|| b.tensor(format!("m{i}"), m * MIB, TensorKind::OptimizerState));
            params.push((i, p, g, s));
            (p, g)
        });
        let y = b.tensor(format!("y{i}"), l.out_mib * MIB, TensorKind::Activation);
        let mut reads = vec![x];
        reads.extend(skip);
        reads.extend(p.map(|(p, _)| p));
        b.timed_op(
            format!("f{i}"),
            Phase::Forward,
            &reads,
            &[y],
            l.fwd_ms * 1e-3,
        );
        acts.push(y);
        recs.push((x, skip, p, y));
    }
    let last = *acts.last().unwrap();
    let mut grads: HashMap<TensorId, TensorId> = HashMap::new();
    let d = b.tensor("dlast", MIB, TensorKind::Gradient);
    grads.insert(last, d);
    b.timed_op("loss", Phase::Forward, &[last], &[d], 1e-4);
    for (i, &(x, skip, p, y)) in recs.iter().enumerate().rev() {
        let dy = grads[&y];
        let mut reads = vec![dy, x, y];
        let mut writes = Vec::new();
        for (k, input) in [Some(x), skip].into_iter().flatten().enumerate() {
            let bytes = b_bytes(&acts, layers, input);
            match grads.get(&input) {
                Some(&g) => {
                    reads.push(g);
                    writes.push(g);
                }
                None => {
                    let g = b.tensor(format!("d{i}.{k}"), bytes, TensorKind::Gradient);
                    grads.insert(input, g);
                    writes.push(g);
                }
            }
        }
        if let Some(s) = skip {
            reads.push(s);
        }
        if let Some((p, g)) = p {
            reads.push(p);
            writes.push(g);
        }
        b.timed_op(
            format!("b{i}"),
            Phase::Backward,
            &reads,
            &writes,
            layers[i].bwd_ms * 1e-3,
        );
    }
    for (i, p, g, s) in params {
        let mut reads = vec![p, g];
        let mut writes = vec![p];
        if let Some(s) = s {
            reads.push(s);
            writes.push(s);
        }
        b.timed_op(format!("opt{i}"), Phase::Optimizer, &reads, &writes, 2e-5);
    }
    b.build().unwrap()
}

/// Size of activation `t` (the input or a layer output).
fn b_bytes(acts: &[TensorId], layers: &[Layer], t: TensorId) -> u64 {
    match acts.iter().position(|&a| a == t) {
        Some(0) | None => 2 * MIB,
        Some(i) => layers[i - 1].out_mib * MIB,
    }
}

fn trace_strategy() -> impl Strategy<Value = Trace> {
    (prop::collection::vec(layer(), 2..18), any::<bool>()).prop_map(|(l, s)| build(&l, s))
}

#[derive(Clone, Debug)]
struct Settings {
    fraction: f64,
    size: u64,
    reuse: usize,
    all: bool,
    offload_order: bool,
    reorder: bool,
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        0.3f64..=1.0,
        prop::sample::select(vec![0, MIB, 8 * MIB]),
        0usize..4,
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.8),
    )
        .prop_map(
            |(fraction, size, reuse, all, offload_order, reorder)| Settings {
                fraction,
                size,
                reuse,
                all,
                offload_order,
                reorder,
            },
        )
}

fn reuse_ops(after: usize, needed: usize, n: usize) -> usize {
    if needed > after {
        needed - after - 1
    } else {
        (n - 1 - after) + needed
    }
}

fn plan_with(
    trace: &Trace,
    budget: u64,
    s: &Settings,
    timing: PrefetchTiming,
) -> Result<SwapPlan, PlanError> {
    let mut cfg = config(budget, timing);
    cfg.size_threshold_bytes = s.size;
    cfg.min_reuse_ops = s.reuse;
    cfg.selection = if s.all {
        Selection::AllCandidates
    } else {
        Selection::Needed
    };
    cfg.placement_order = if s.offload_order {
        PlacementOrder::Offload
    } else {
        PlacementOrder::Need
    };
    cfg.reorder_prefetches = s.reorder;
    AutoVmPlanner::new(cfg).plan(trace)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any plan the planner returns replays within its budget with every
    /// tensor back before use and the thresholds kept; any refusal is
    /// justified.
    #[test]
    fn plans_are_sound_or_refusals_justified(trace in trace_strategy(), s in settings()) {
        let an = analyze(&trace, &cost());
        let budget = ((an.peak_bytes as f64 * s.fraction) as u64).max(1);
        let n = trace.num_ops();
        for timing in [PrefetchTiming::Earliest, PrefetchTiming::Profiled] {
            match plan_with(&trace, budget, &s, timing) {
                Ok(plan) => {
                    let rep = check_plan(&trace, &plan, Some(budget), cost());
                    if budget >= an.peak_bytes {
                        prop_assert!(plan.actions.is_empty());
                    }
                    for o in &plan.offloads {
                        prop_assert!(o.bytes >= s.size);
                        prop_assert!(o.reuse_ops >= s.reuse);
                        prop_assert_eq!(o.reuse_ops, reuse_ops(o.offload_after_op, o.needed_by_op, n));
                        prop_assert!(trace.tensor(o.tensor).kind != TensorKind::Workspace);
                    }
                    if s.reorder {
                        prop_assert_eq!(rep.out_of_order_prefetches, 0);
                        let needs: Vec<usize> = plan.actions.iter().filter_map(|a| match a {
                            Action::Prefetch { needed_by_op, .. } => Some(*needed_by_op),
                            _ => None,
                        }).collect();
                        prop_assert!(needs.windows(2).all(|w| w[0] <= w[1]));
                    }
                    let back = SwapPlan::from_json(&plan.to_json()).unwrap();
                    prop_assert_eq!(&back, &plan);
                }
                Err(PlanError::WorkingSetExceedsBudget { op, budget: b, .. }) => {
                    prop_assert_eq!(b, budget);
                    prop_assert!(trace.working_set_bytes(op) > budget);
                }
                Err(PlanError::NoPlan { op, resident, budget: b, .. }) => {
                    // Infeasible under these thresholds: even offloading
                    // every candidate does not fit that op.
                    prop_assert_eq!(b, budget);
                    prop_assert!(resident > budget);
                    prop_assert!(budget < an.peak_bytes);
                    let all = Settings { all: true, ..s.clone() };
                    let e = plan_with(&trace, budget, &all, PrefetchTiming::Earliest);
                    prop_assert!(matches!(e, Err(PlanError::NoPlan { op: o, .. }) if o <= op), "{:?}", e);
                }
                Err(e) => prop_assert!(false, "unexpected error: {}", e),
            }
        }
    }

    /// Profiled placement is never predicted to stall more than earliest
    /// placement, and only moves a prefetch earlier if it was late.
    #[test]
    fn profiled_never_worse(trace in trace_strategy(), fraction in 0.4f64..0.95) {
        let an = analyze(&trace, &cost());
        let budget = (an.peak_bytes as f64 * fraction) as u64;
        let s = Settings { fraction, size: 0, reuse: 1, all: false, offload_order: false, reorder: true };
        let (Ok(e), Ok(p)) = (
            plan_with(&trace, budget, &s, PrefetchTiming::Earliest),
            plan_with(&trace, budget, &s, PrefetchTiming::Profiled),
        ) else {
            return Ok(());
        };
        prop_assert!(p.predicted.stall_s <= e.predicted.stall_s * (1.0 + 1e-9) + 1e-12);
        let rep = ramus_swap::Simulator::new(cost(), Some(budget)).run(&trace, &e).unwrap();
        prop_assert_eq!(e.offloads.len(), p.offloads.len());
        for (a, b) in e.offloads.iter().zip(&p.offloads) {
            prop_assert_eq!(a.tensor, b.tensor);
            if b.prefetch_before_op < a.prefetch_before_op {
                let late = rep.transfers.iter().any(|r| {
                    r.tensor == a.tensor && r.used_by_op == Some(a.needed_by_op) && r.wait_s > 0.0
                });
                prop_assert!(late, "{} moved earlier though on time", a.name);
            }
        }
    }

    /// Naive swapping always replays within its budget when one exists.
    #[test]
    fn lru_is_sound(trace in trace_strategy(), fraction in 0.3f64..=1.0) {
        let an = analyze(&trace, &cost());
        let budget = (an.peak_bytes as f64 * fraction) as u64;
        match LruPlanner::new(budget, cost()).plan(&trace) {
            Ok(plan) => {
                check_plan(&trace, &plan, Some(budget), cost());
                if budget >= an.peak_bytes {
                    prop_assert!(plan.actions.is_empty());
                }
            }
            Err(PlanError::WorkingSetExceedsBudget { .. }) => {
                prop_assert!(an.max_working_set_bytes > budget);
            }
            Err(e) => prop_assert!(false, "{}", e),
        }
    }

    /// A laid-out plan places every allocation inside the budget (less the
    /// persistent tensors) and runs on the CUDA pool's model of that budget
    /// without a refused allocation, a host wait for memory or an order the
    /// simulated device rejects; a refusal names why.
    #[test]
    fn laid_out_plans_run_in_the_pool_model(
        trace in trace_strategy(),
        fraction in 0.4f64..=1.0,
        profiled in any::<bool>(),
        latency in 0usize..6,
    ) {
        let an = analyze(&trace, &cost());
        let budget = (an.peak_bytes as f64 * fraction) as u64;
        let timing = if profiled { PrefetchTiming::Profiled } else { PrefetchTiming::Earliest };
        let mut cfg = config(budget, timing);
        cfg.offload_kinds = vec![TensorKind::Activation, TensorKind::Gradient];
        cfg.layout = true;
        match AutoVmPlanner::new(cfg).plan(&trace) {
            Ok(plan) => {
                let layout = plan.layout.as_ref().expect("a layout");
                prop_assert!(layout.check(&trace, &plan).is_ok());
                prop_assert!(layout.arena_bytes <= budget - trace.persistent_bytes());
                let ex = Executor::new(&trace, Some(&plan), ExecOptions::planned(plan.budget_bytes)).unwrap();
                let mut dev = SimDevice::with_pool(&trace, budget, 0).unwrap().with_latency(latency);
                let r = ex.run(&mut dev);
                prop_assert!(r.is_ok(), "{:?}", r);
                let r = r.unwrap();
                prop_assert_eq!(dev.counts().refused_allocations, 0);
                prop_assert_eq!(r.offload_waits, 0);
                prop_assert_eq!(r.bytes_to_device, plan.predicted.bytes_to_device);
                check_plan(&trace, &plan, plan.budget_bytes, cost());
            }
            Err(PlanError::WorkingSetExceedsBudget { .. } | PlanError::NoPlan { .. }) => {
                prop_assert!(budget < an.peak_bytes);
            }
            Err(PlanError::LayoutDoesNotFit { arena, laid_out, .. }) => {
                prop_assert!(laid_out > arena || laid_out == 0);
            }
            Err(e) => prop_assert!(false, "unexpected error: {}", e),
        }
    }
}
