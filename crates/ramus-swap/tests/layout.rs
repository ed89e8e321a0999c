//! Address-aware placement: laid-out plans run in the CUDA pool's model
//! (one chunk of the budget, carved by the pool's best-fit allocator)
//! without a refused allocation; the simulated device models the pool's
//! fragmentation, checks every placement and every reuse of memory an
//! offload may still read; broken layouts are rejected.

mod common;

use common::{all_traces, cost, peak};
use ramus_swap::{
    AutoVmPlanner, Block, ExecOptions, Executor, ExecutorError, Layout, Phase, PlanError, Planner,
    PlannerConfig, PrefetchTiming, SimDevice, SwapDevice, SwapPlan, TensorId, TensorKind, Trace,
    TraceBuilder,
};

const MIB: u64 = 1 << 20;

/// The planner as the CUDA engine configures it: persistent tensors stay,
/// every allocation laid out.
fn planner(budget: u64, timing: PrefetchTiming) -> AutoVmPlanner {
    let mut c = PlannerConfig::new(budget);
    c.cost = cost();
    c.timing = timing;
    c.offload_kinds = vec![TensorKind::Activation, TensorKind::Gradient];
    c.layout = true;
    AutoVmPlanner::new(c)
}

/// Runs `plan` on the pool model of `budget` bytes.
fn run_in_pool(
    trace: &Trace,
    plan: &SwapPlan,
    budget: u64,
    latency: usize,
) -> Result<(ramus_swap::ExecReport, ramus_swap::SimDeviceCounts), ExecutorError> {
    let ex = Executor::new(trace, Some(plan), ExecOptions::planned(plan.budget_bytes))?;
    let mut dev = SimDevice::with_pool(trace, budget, 0)?.with_latency(latency);
    let r = ex.run(&mut dev)?;
    Ok((r, dev.counts().clone()))
}

#[test]
fn laid_out_plans_run_in_the_pool_model_as_planned() {
    for (name, trace) in all_traces() {
        let p = peak(&trace);
        for nm in [1.25, 1.5, 2.0, 2.5] {
            let budget = (p as f64 / nm) as u64;
            for timing in [PrefetchTiming::Earliest, PrefetchTiming::Auto] {
                let plan = match planner(budget, timing).plan(&trace) {
                    Ok(plan) => plan,
                    // weights that must stay resident can make a budget infeasible
                    Err(
                        e @ (PlanError::NoPlan { .. } | PlanError::WorkingSetExceedsBudget { .. }),
                    ) => {
                        println!("{name} Nm {nm}: no plan: {e}");
                        continue;
                    }
                    Err(e) => panic!("{name} Nm {nm}: {e}"),
                };
                let layout = plan.layout.as_ref().expect("a layout");
                layout.check(&trace, &plan).unwrap();
                assert!(layout.arena_bytes <= budget - trace.persistent_bytes());
                assert!(layout.max_live_bytes <= layout.arena_bytes);
                assert!(plan.budget_bytes.is_some_and(|b| b <= budget));
                let back = SwapPlan::from_json(&plan.to_json()).unwrap();
                assert_eq!(back, plan);
                for latency in [0, 1, 4, 64] {
                    let (r, c) = run_in_pool(&trace, &plan, budget, latency)
                        .unwrap_or_else(|e| panic!("{name} Nm {nm} latency {latency}: {e}"));
                    assert_eq!(c.refused_allocations, 0, "{name} Nm {nm}");
                    assert_eq!(r.fallback_evictions + r.sync_evictions, 0);
                    assert_eq!(r.bytes_to_host, plan.predicted.bytes_to_host, "{name}");
                    assert_eq!(r.bytes_to_device, plan.predicted.bytes_to_device, "{name}");
                    assert!(c.peak_bytes <= budget);
                    assert_eq!(c.used_bytes, trace.persistent_bytes());
                    // never a host wait for memory: reuse is ordered on the device
                    assert_eq!(r.offload_waits, 0, "{name} Nm {nm} latency {latency}");
                }
                println!(
                    "{name} Nm {nm} {timing:?}: {} ({} moved each way)",
                    layout.summary(),
                    plan.predicted.bytes_to_host
                );
            }
        }
    }
}

/// Four 1 MiB tensors fill a 4 MiB pool; with the first and third freed,
/// 2 MiB are free but no 2 MiB range: the pool model refuses, as the CUDA
/// pool would.
#[test]
fn the_pool_model_refuses_what_fragmentation_leaves_no_room_for() {
    let mut b = TraceBuilder::new();
    let t: Vec<TensorId> = (0..4)
        .map(|i| b.tensor(format!("x{i}"), MIB, TensorKind::Activation))
        .collect();
    let big = b.tensor("big", 2 * MIB, TensorKind::Activation);
    b.op("f", Phase::Forward, &[], &t);
    b.op("g", Phase::Forward, &[t[1], t[3]], &[big]);
    let trace = b.build().unwrap();
    let mut dev = SimDevice::with_pool(&trace, 4 * MIB, 0).unwrap();
    for &x in &t {
        assert!(dev.allocate(x, MIB).unwrap());
    }
    dev.release(t[0]).unwrap();
    dev.release(t[2]).unwrap();
    assert!(!dev.allocate(big, 2 * MIB).unwrap(), "no 2 MiB range");
    assert_eq!(dev.counts().fragmented_refusals, 1);
    dev.release(t[1]).unwrap();
    assert!(dev.allocate(big, 2 * MIB).unwrap(), "coalesced");
    // a counting device of the same budget would have taken it
    let mut counting = SimDevice::new(&trace, Some(4 * MIB));
    for &x in &t {
        assert!(counting.allocate(x, MIB).unwrap());
    }
    counting.release(t[0]).unwrap();
    counting.release(t[2]).unwrap();
    assert!(counting.allocate(big, 2 * MIB).unwrap());
}

/// x is offloaded after op 0 and its range reused by y at op 1 while the
/// copy may still read it.
fn reuse_trace() -> Trace {
    let mut b = TraceBuilder::new();
    let x = b.tensor("x", MIB, TensorKind::Activation);
    let y = b.tensor("y", MIB, TensorKind::Activation);
    b.op("make x", Phase::Forward, &[], &[x]);
    b.op("make y", Phase::Forward, &[], &[y]);
    b.op("use both", Phase::Backward, &[x, y], &[]);
    b.build().unwrap()
}

#[test]
fn the_simulated_device_checks_placements_and_reuse_after_an_offload() {
    let trace = reuse_trace();
    let (x, y) = (TensorId(0), TensorId(1));
    // a placement over a tensor that still holds its memory
    let mut dev = SimDevice::new(&trace, Some(4 * MIB)).with_latency(5);
    dev.reserve_arena(2 * MIB).unwrap();
    dev.allocate_at(x, 0, MIB).unwrap();
    let e = dev.allocate_at(y, MIB / 2, MIB).unwrap_err();
    assert!(e.to_string().contains("over t0 `x`"), "{e}");
    let e = dev.allocate_at(y, 2 * MIB, MIB).unwrap_err();
    assert!(e.to_string().contains("past the arena"), "{e}");

    // reuse of memory an offload still reads, with and without ordering
    for ordered in [false, true] {
        let mut dev = SimDevice::new(&trace, Some(4 * MIB)).with_latency(5);
        dev.reserve_arena(MIB).unwrap();
        dev.allocate_at(x, 0, MIB).unwrap();
        dev.run_op(0).unwrap();
        dev.offload(x).unwrap();
        dev.release_offloading(x).unwrap();
        dev.allocate_at(y, 0, MIB).unwrap();
        if ordered {
            dev.order_after_offload(y, x).unwrap();
            dev.run_op(1).unwrap();
            assert_eq!(dev.counts().device_waits, 1);
            assert!(dev.offload_complete(x).unwrap(), "the write waited for it");
        } else {
            let e = dev.run_op(1).unwrap_err();
            assert!(e.to_string().contains("still reads"), "{e}");
        }
    }
}

#[test]
fn a_broken_layout_is_rejected_naming_the_tensors() {
    let (_, trace) = all_traces().remove(1); // resnet50
    let budget = peak(&trace) / 2;
    let mut plan = planner(budget, PrefetchTiming::Earliest)
        .plan(&trace)
        .unwrap();
    let mut layout = plan.layout.take().unwrap();
    // move a block onto another one it coexists with
    let (i, j) = (0..layout.blocks.len())
        .flat_map(|i| (0..layout.blocks.len()).map(move |j| (i, j)))
        .find(|&(i, j)| {
            let (a, b) = (&layout.blocks[i], &layout.blocks[j]);
            i != j && a.coexists_with(b) && a.bytes == b.bytes && !a.overlaps(b)
        })
        .expect("two coexisting blocks");
    layout.blocks[i].offset = layout.blocks[j].offset;
    let e = layout.check(&trace, &plan).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    plan.layout = Some(layout);
    let e = Executor::new(&trace, Some(&plan), ExecOptions::planned(Some(budget))).unwrap_err();
    assert!(matches!(e, ExecutorError::Mismatch(_)), "{e}");

    // a block that ends before its tensor's last use
    let mut plan = planner(budget, PrefetchTiming::Earliest)
        .plan(&trace)
        .unwrap();
    let mut layout = plan.layout.take().unwrap();
    let k = layout
        .blocks
        .iter()
        .position(|b| {
            b.until_op > b.from_op + 1 && plan.actions.iter().all(|a| a.tensor() != b.tensor)
        })
        .unwrap();
    layout.blocks[k].until_op = layout.blocks[k].from_op + 1;
    let e = layout.check(&trace, &plan).unwrap_err();
    let name = &trace.tensor(layout.blocks[k].tensor).name;
    assert!(e.to_string().contains(name.as_str()), "{e}");
}

#[test]
fn a_layout_needs_persistent_tensors_to_stay() {
    let (_, trace) = all_traces().remove(0);
    let mut c = PlannerConfig::new(peak(&trace) / 2);
    c.layout = true; // the default offload kinds include parameters
    let e = AutoVmPlanner::new(c).plan(&trace).unwrap_err();
    assert!(matches!(e, PlanError::Config(_)), "{e}");
    assert!(e.to_string().contains("parameter"), "{e}");
}

/// A gradient written by `b1`, then accumulated (read and written) by
/// `b0`; `act` in between takes its room, so the gradient is offloaded
/// after `b1` and prefetched for `b0`.
fn accumulate_trace() -> Trace {
    let mut b = TraceBuilder::new();
    let g = b.tensor("dx", MIB, TensorKind::Gradient);
    let a = b.tensor("act", 3 * MIB, TensorKind::Activation);
    let c = b.tensor("other", MIB, TensorKind::Activation);
    b.op("b1", Phase::Backward, &[], &[g]);
    b.op("make act", Phase::Backward, &[], &[a]);
    b.op("use act", Phase::Backward, &[a], &[c]);
    b.op("b0", Phase::Backward, &[c, g], &[g]);
    b.build().unwrap()
}

/// Regression (props `laid_out_plans_run_in_the_pool_model`): `dx` is
/// offloaded after `b1` and, still being copied out when `b0` comes, placed
/// elsewhere and prefetched; `b0` accumulates into it. The prefetch waits for
/// the offload on the device and `b0` for the prefetch, so the write is
/// ordered after the offload (which reads the old range anyway), with no host
/// wait. Writing the offloaded memory itself without that order stays an
/// error.
#[test]
fn a_gradient_offloaded_then_accumulated_after_its_prefetch_runs() {
    let trace = accumulate_trace();
    let (dx, act, other) = (TensorId(0), TensorId(1), TensorId(2));
    let mut plan = planner(4 * MIB, PrefetchTiming::Earliest)
        .plan(&trace)
        .unwrap();
    assert_eq!(plan.actions.len(), 2, "{:?}", plan.actions);
    assert!(plan.actions.iter().all(|a| a.tensor() == dx));
    // nothing takes dx's old range before b0, whose dx lies elsewhere: only
    // the prefetch orders b0's write after the offload
    let place = |tensor, offset, bytes, from_op, until_op| Block {
        tensor,
        offset,
        bytes,
        from_op,
        until_op,
    };
    plan.layout = Some(Layout {
        arena_bytes: 6 * MIB,
        max_live_bytes: 5 * MIB,
        blocks: vec![
            place(dx, 0, MIB, 0, 2),
            place(act, MIB, 3 * MIB, 1, 3),
            place(other, 4 * MIB, MIB, 2, 4),
            place(dx, 5 * MIB, MIB, 3, 4),
        ],
    });
    plan.layout.as_ref().unwrap().check(&trace, &plan).unwrap();
    plan.budget_bytes = Some(6 * MIB);
    for latency in [0, 1, 4, 64] {
        let ex = Executor::new(&trace, Some(&plan), ExecOptions::planned(Some(6 * MIB))).unwrap();
        let mut dev = SimDevice::new(&trace, Some(6 * MIB)).with_latency(latency);
        let r = ex
            .run(&mut dev)
            .unwrap_or_else(|e| panic!("latency {latency}: {e}"));
        assert_eq!((r.offloads, r.prefetches), (1, 1));
        assert_eq!(r.offload_waits, 0, "no host wait");
        assert_eq!(dev.counts().blocking_waits, 0, "no host wait");
        // b0 waited on the device for the offload still in flight
        let waited = usize::from(latency >= 3);
        assert_eq!(dev.counts().device_waits, waited, "latency {latency}");
    }

    // b0 writing the memory its offload still reads is rejected
    let mut dev = SimDevice::new(&trace, Some(6 * MIB)).with_latency(4);
    dev.reserve_arena(6 * MIB).unwrap();
    dev.allocate_at(dx, 0, MIB).unwrap();
    dev.run_op(0).unwrap();
    dev.offload(dx).unwrap();
    dev.allocate_at(act, MIB, 3 * MIB).unwrap();
    dev.run_op(1).unwrap();
    dev.allocate_at(other, 4 * MIB, MIB).unwrap();
    dev.run_op(2).unwrap();
    let e = dev.run_op(3).unwrap_err();
    assert!(
        e.to_string()
            .contains("op `b0` writes t0 `dx` while its offload reads it"),
        "{e}"
    );
}
