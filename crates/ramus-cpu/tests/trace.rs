//! The memory trace of a training iteration: it follows the engine's
//! execution order (eager, per task gather / ops / scatter, lazy, head,
//! backward in reverse task order, optimizer), sizes tensors from the
//! batch's rows, and the swap planner fits it into a smaller budget.

use ramus_conformance::fixtures::{binary_cell, softmax_head};
use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
use ramus_core::Model;
use ramus_cpu::training_trace;
use ramus_exec::Batch;
use ramus_graph::random::random_tree;
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_swap::{analyze, AutoVmPlanner, CostModel, Phase, Planner, PlannerConfig, Simulator};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const H: usize = 64;

fn tree_fc() -> Model {
    let mut m = ModelBuilder::new("tree-fc", H);
    let emb = m.param("emb", &[50, H], Init::Normal { std: 0.1 });
    let w = m.param("W", &[H, 2 * H], Init::Xavier);
    let b = m.param("b", &[H], Init::Zeros);
    let w_out = m.param("W_out", &[3, H], Init::Xavier);
    let leaf = m
        .vertex_fn("leaf", |f| {
            let x = f.embed(emb);
            let h = f.tanh(x);
            f.scatter(h);
            f.push(h);
        })
        .expect("leaf");
    let internal = m
        .vertex_fn("internal", |f| binary_cell(f, w, Some(b), |f, z| f.tanh(z)))
        .expect("internal");
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, H, |hd| softmax_head(hd, w_out))
        .expect("head");
    m.build().expect("model")
}

#[test]
fn the_trace_follows_the_schedule_and_the_planner_fits_it() {
    let model = tree_fc();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let graphs: Vec<InputGraph> = (0..40)
        .map(|i| random_tree(&mut rng, 8 + i % 13, &[2], 50, 3).expect("tree"))
        .collect();
    let batch =
        Batch::new(&model, graphs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    let trace = training_trace(&model, &batch, 2).expect("trace");
    let s = &batch.schedule;
    let ops = trace.ops();
    // one scatter per task forward, one state-gradient read per task backward
    let scatters = ops
        .iter()
        .filter(|o| o.name.ends_with(" scatter") && !o.name.contains('∂'))
        .count();
    assert_eq!(scatters, s.tasks.len());
    let scatter_grads = ops.iter().filter(|o| o.name.ends_with("∂scatter")).count();
    assert_eq!(scatter_grads, s.tasks.len());
    // phases in order: forward, backward, then one update per parameter
    let phases: Vec<Phase> = ops.iter().map(|o| o.phase).collect();
    let first_bwd = phases
        .iter()
        .position(|&p| p == Phase::Backward)
        .expect("backward ops");
    let first_opt = phases
        .iter()
        .position(|&p| p == Phase::Optimizer)
        .expect("optimizer ops");
    assert!(phases[..first_bwd].iter().all(|&p| p == Phase::Forward));
    assert!(phases[first_bwd..first_opt]
        .iter()
        .all(|&p| p == Phase::Backward));
    assert_eq!(phases.len() - first_opt, model.params.len());
    // the vertex state is one row of H floats per vertex
    let state = trace
        .tensors()
        .iter()
        .find(|t| t.name == "vertex state")
        .expect("state");
    assert_eq!(state.bytes, (s.num_vertices() * H * 4) as u64);
    // a budget two thirds of the peak is met in the simulated replay
    let cost = CostModel::pcie5_x16();
    let peak = analyze(&trace, &cost).peak_bytes;
    let mut config = PlannerConfig::new(peak * 2 / 3);
    config.cost = cost;
    config.size_threshold_bytes = 16 << 10;
    let plan = AutoVmPlanner::new(config).plan(&trace).expect("a plan");
    assert!(plan.predicted.peak_bytes <= peak * 2 / 3);
    let report = Simulator::for_plan(cost, &plan)
        .run(&trace, &plan)
        .expect("replay");
    assert!(report.total_s >= report.compute_s);
}
