//! Compares the planners on synthetic traces at several memory pressures.
//!
//! `cargo run --release -p ramus-swap --example compare [pcie3|pcie5]`
//!
//! For each model and each Nm (peak memory without swapping / budget) it
//! prints, per policy, the simulated iteration time relative to the
//! in-memory one, stall, bytes each way and peak memory.

use ramus_swap::synthetic::{resnet, vgg19, DeviceSpeed, LstmSpec, TreeSpec};
use ramus_swap::{
    analyze, human_bytes, AutoVmPlanner, CostModel, LruPlanner, NoBudgetPlanner, Planner,
    PlannerConfig, PrefetchTiming, Trace,
};

fn main() {
    let (cost, speed) = match std::env::args().nth(1).as_deref() {
        Some("pcie5") => (CostModel::pcie5_x16(), DeviceSpeed::h100()),
        _ => (CostModel::pcie3_x16(), DeviceSpeed::rtx_2080_ti()),
    };
    let models: Vec<(&str, Trace)> = vec![
        ("vgg19 b64", vgg19(64, 224, speed).trace()),
        (
            "resnet152 b32",
            resnet([3, 8, 36, 3], 32, 224, speed).trace(),
        ),
        (
            "lstm 1024 steps",
            LstmSpec::new(1024, 128, 2048, speed).trace(),
        ),
        (
            "tree-lstm 64×2048",
            TreeSpec::new(64, 2048, 512, 1, speed).trace(),
        ),
    ]
    .into_iter()
    .filter_map(|(n, t)| match t {
        Ok(t) => Some((n, t)),
        Err(e) => {
            eprintln!("{n}: {e}");
            None
        }
    })
    .collect();
    for (name, trace) in &models {
        let an = analyze(trace, &cost);
        let base = match NoBudgetPlanner::new(cost).plan(trace) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{name}: {e}");
                continue;
            }
        };
        println!(
            "\n{name}: {} ops, peak {} at op {}, largest working set {} ({:.2} of peak), in-memory step {:.1} ms",
            trace.num_ops(),
            human_bytes(an.peak_bytes),
            an.peak_op,
            human_bytes(an.max_working_set_bytes),
            an.max_working_set_bytes as f64 / an.peak_bytes as f64,
            base.predicted.total_s * 1e3
        );
        println!(
            "  {:>5} {:<18} {:>8} {:>10} {:>11} {:>11} {:>11}",
            "Nm", "policy", "time", "stall ms", "to host", "to device", "peak"
        );
        for nm in [1.0, 1.25, 1.5, 1.75, 2.0] {
            let budget = (an.peak_bytes as f64 / nm) as u64;
            let mut earliest = PlannerConfig::new(budget);
            earliest.cost = cost;
            earliest.timing = PrefetchTiming::Earliest;
            let mut profiled = earliest.clone();
            profiled.timing = PrefetchTiming::Profiled;
            let planners: Vec<(&str, Box<dyn Planner>)> = vec![
                ("lru", Box::new(LruPlanner::new(budget, cost))),
                ("autovm earliest", Box::new(AutoVmPlanner::new(earliest))),
                ("autovm profiled", Box::new(AutoVmPlanner::new(profiled))),
            ];
            for (pname, p) in planners {
                match p.plan(trace) {
                    Ok(plan) => {
                        let q = &plan.predicted;
                        println!(
                            "  {nm:>5.2} {pname:<18} {:>7.3}x {:>10.1} {:>11} {:>11} {:>11}",
                            q.total_s / base.predicted.total_s,
                            q.stall_s * 1e3,
                            human_bytes(q.bytes_to_host),
                            human_bytes(q.bytes_to_device),
                            human_bytes(q.peak_bytes)
                        );
                    }
                    Err(e) => println!("  {nm:>5.2} {pname:<18} error: {e}"),
                }
            }
        }
    }
}
