//! `ramus plan-memory`: the swap plan (AutoVM policy, `ramus_swap`) for one
//! training iteration of a model on a batch under a device memory budget,
//! as a listing or JSON, with the simulated device's verdict. The trace
//! comes from the batch's own schedule (`ramus_cpu::training_trace`), so
//! dynamic models (trees, long sequences) are planned per batch.

use crate::result::AnyResult;
use ramus_core::Model;
use ramus_cpu::training_trace;
use ramus_exec::Batch;
use ramus_exec::OptimizerKind;
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{
    build_model, build_sequence_model, is_sequence_model, DataKind, ModelConfig, ModelOptions,
    SequenceConfig,
};
use ramus_swap::{
    analyze, human_bytes, human_seconds, AutoVmPlanner, CostModel, LruPlanner, NoBudgetPlanner,
    Planner, PlannerConfig, Simulator, TensorKind,
};

use crate::data;
use crate::device::Device;
use crate::output::outln;

#[derive(clap::Args)]
pub struct PlanMemoryArgs {
    /// Model name (see `ramus train --help`).
    #[arg(long, default_value = "treelstm")]
    model: String,
    /// Directory with train.txt (default: the built-in data set).
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// The batch: the first B graphs of the training split.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Device memory budget in bytes.
    #[arg(long, conflicts_with = "budget_ratio")]
    device_memory_budget: Option<u64>,
    /// Budget as a fraction: peak / RATIO (the thesis' Nm; 2 = half the peak).
    #[arg(long, default_value_t = 2.0)]
    budget_ratio: f64,
    /// planner (AutoVM), lru (naive on-demand swapping) or none (no budget).
    #[arg(long, default_value = "planner")]
    policy: String,
    /// Optimizer whose state is part of the trace: sgd, adagrad or adam.
    #[arg(long, default_value = "sgd")]
    optimizer: String,
    /// Host link: pcie3 or pcie5.
    #[arg(long, default_value = "pcie5")]
    link: String,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    structure: crate::structure::StructureArgs,
    #[command(flatten)]
    host: crate::limits::HostBudgetArgs,
    /// Whose iteration to plan: cpu (the batched engines' trace) or cuda
    /// (the CUDA swap path's own op list and pool-sized tensors; a dynamic
    /// model's rows cut into segments in the batched engine's task order,
    /// planned as that path does: parameters, their gradients and optimizer
    /// state stay resident, every allocation laid out in one arena). Needs
    /// no GPU.
    #[arg(long, default_value = "cpu")]
    engine: String,
}

/// The planner `--policy` names, for a device of `budget` bytes (on CUDA
/// as the CUDA swap path plans).
fn planner(policy: &str, budget: u64, cost: CostModel, cuda: bool) -> AnyResult<Box<dyn Planner>> {
    Ok(match policy {
        "planner" => {
            let mut config = PlannerConfig::new(budget);
            config.cost = cost;
            if cuda {
                // as the CUDA swap path plans: persistent tensors stay, and
                // every allocation is laid out in one arena
                config.offload_kinds = vec![TensorKind::Activation, TensorKind::Gradient];
                config.layout = true;
            }
            Box::new(AutoVmPlanner::new(config))
        }
        "lru" if cuda => Box::new(LruPlanner::new(budget, cost).keep_persistent_resident()),
        "lru" => Box::new(LruPlanner::new(budget, cost)),
        "none" => Box::new(NoBudgetPlanner::new(cost)),
        other => {
            return Err(format!("--policy must be planner, lru or none, got `{other}`").into())
        }
    })
}

pub fn run(a: PlanMemoryArgs) -> AnyResult {
    let kind = crate::data::data_kind_of(&a.model)?;
    if a.batch_size == 0 || a.hidden == 0 {
        return Err("--batch-size and --hidden must be at least 1".into());
    }
    if a.budget_ratio.is_nan() || a.budget_ratio < 1.0 {
        return Err(format!("--budget-ratio must be at least 1, got {}", a.budget_ratio).into());
    }
    let states = match a.optimizer.parse::<OptimizerKind>()? {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam => 2,
    };
    let cost = match a.link.as_str() {
        "pcie3" => CostModel::pcie3_x16(),
        "pcie5" => CostModel::pcie5_x16(),
        other => return Err(format!("--link must be pcie3 or pcie5, got `{other}`").into()),
    };
    let build = |vocab, classes, chars| -> AnyResult<Model> {
        let cfg = ModelConfig {
            vocab,
            hidden: a.hidden,
            classes,
        };
        Ok(if is_sequence_model(&a.model) {
            let seq = SequenceConfig {
                chars,
                ..SequenceConfig::default()
            };
            build_sequence_model(&a.model, &cfg, &seq, &ModelOptions::default())?
        } else {
            build_model(&a.model, &cfg)?
        })
    };
    // a pyramid's schedule does not depend on the vocabulary: a model of
    // one word costs it before the pyramids are built. Planning runs no
    // vertex function, so the host holds what it holds for a device run
    let reader = match kind {
        DataKind::SentencePyramid => Some(build(1, 1, 0)?),
        _ => None,
    };
    let mut guard = a
        .host
        .build_guard(reader.as_ref().map(|m| (m, Device::Cuda)));
    let mut splits =
        data::load_splits(a.data.as_deref(), kind, &mut guard, data::SplitWords::Train)?;
    let model = build(splits.vocab.len(), splits.classes, splits.chars())?;
    a.structure.fit(&model, kind, &mut splits.train)?;
    let graphs: Vec<&InputGraph> = splits.train.iter().take(a.batch_size).collect();
    let batch = Batch::new(&model, graphs, BatchingPolicy::Cavs)?;
    let optimizer: OptimizerKind = a.optimizer.parse()?;
    let cuda = match a.engine.as_str() {
        "cpu" => false,
        "cuda" => true,
        other => return Err(format!("--engine must be cpu or cuda, got `{other}`").into()),
    };
    let trace = if cuda {
        ramus_cuda::training_trace(&model, &batch, optimizer, None)?
    } else {
        training_trace(&model, &batch, states)?
    };
    let peak = analyze(&trace, &cost).peak_bytes;
    let budget = a
        .device_memory_budget
        .unwrap_or((peak as f64 / a.budget_ratio) as u64);
    let plan = planner(&a.policy, budget, cost, cuda)?.plan(&trace)?;
    let report = Simulator::for_plan(cost, &plan).run(&trace, &plan)?;
    if a.json {
        outln!("{}", plan.to_json())?;
        return Ok(());
    }
    outln!(
        "model {} hidden {} | batch of {} graphs ({} vertices, {} tasks) | {} ops, {} tensors",
        a.model,
        a.hidden,
        batch.len(),
        batch.schedule.num_vertices(),
        batch.schedule.tasks.len(),
        trace.num_ops(),
        trace.num_tensors()
    )?;
    crate::output::write(format_args!("{}", plan.listing(Some(&trace))))?;
    outln!(
        "simulated: step {} (compute {}, stall {}), peak {}",
        human_seconds(report.total_s),
        human_seconds(report.compute_s),
        human_seconds(report.stall_s),
        human_bytes(plan.predicted.peak_bytes)
    )?;
    Ok(())
}
