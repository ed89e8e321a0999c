//! Resuming a run on the device: a run interrupted in its second epoch —
//! its parameters, optimizer state (moments and step count, downloaded
//! from the device) and dropout stream saved in a resumable checkpoint,
//! then loaded into a fresh engine — ends where the uninterrupted run
//! ends, to rounding, on the batched engine, the persistent engine and the
//! CNN swap path (under a budget that makes it swap). Skips with a notice where no CUDA driver is found.

mod common;

use ramus_core::{Model, Params};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{
    CudaEngine, CudaEngineOptions, CudaTrainer, PoolConfig, SwapConfig, SwapMode, SwapStepReport,
    SwapTrainer,
};
use ramus_exec::Batch;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine, TrainState};
use ramus_graph::random::random_tree;
use ramus_graph::{InputGraph, Vocab};
use ramus_nn::resume::{self, RunState};
use ramus_nn::train::{shuffled_order, EpochProgress, Pauses, Span, SpanEnd};
use ramus_nn::{build_model_with, ModelConfig, ModelOptions, Trainer};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

type MakeEngine<'a> =
    &'a dyn Fn(&Model, &Params<f32>, OptimizerConfig) -> Box<dyn TrainEngine<f32>>;

const BATCH: usize = 6;
const EPOCHS: usize = 3;

fn trainer(
    model: &Model,
    params: &Params<f32>,
    config: OptimizerConfig,
    make: MakeEngine,
) -> Trainer<f32> {
    let mut t = Trainer::with_engine(make(model, params, config));
    t.engine.set_seed(3);
    t
}

/// `EPOCHS` epochs uninterrupted, and again stopped after 4 batches of
/// epoch 2, saved, loaded into a fresh trainer and finished; the two final
/// parameter sets must agree to `tol` (relative).
fn resumed_matches(
    what: &str,
    model: &Model,
    data: &[InputGraph],
    config: OptimizerConfig,
    make: MakeEngine,
    tol: f32,
) {
    let params = Params::<f32>::init(model, 5);
    let mut whole = trainer(model, &params, config, make);
    let mut rng = ramus_nn::train::rng(9);
    for _ in 0..EPOCHS {
        whole
            .train_epoch(data, BATCH, &mut rng, |_, _, _| {})
            .expect("epoch");
    }
    // the interrupted run: epoch 1, then 4 batches of epoch 2
    let mut first = trainer(model, &params, config, make);
    let mut shuffle = ramus_nn::train::rng(9);
    first
        .train_epoch(data, BATCH, &mut shuffle, |_, _, _| {})
        .expect("epoch 1");
    let epoch2 = shuffle.clone();
    let order = shuffled_order(data.len(), &mut shuffle);
    let span = Span {
        data,
        order: &order,
        batch_size: BATCH,
        rates: None,
    };
    let mut at = EpochProgress::default();
    let pauses = Pauses {
        every: Some(4),
        ..Pauses::default()
    };
    let end = first
        .train_span(&span, &mut at, &pauses, |_, _, _| {})
        .expect("span");
    assert_eq!(end, SpanEnd::Checkpoint, "{what}");
    let saved = first.state().expect("state read back");
    let state = RunState {
        epochs_done: 1,
        progress: at,
        shuffle: epoch2,
        dropout: saved.dropout.clone(),
        best: None,
        plateau: Default::default(),
        config: Default::default(),
        data: String::new(),
        ranks: 1,
    };
    let path = std::env::temp_dir().join(format!(
        "ramus-cuda-resume-{what}-{}.safetensors",
        std::process::id()
    ));
    resume::save(
        &path,
        model,
        &saved.params,
        &Vocab::new(),
        (&state, &saved.optimizer, None),
    )
    .expect("save");
    drop(first);
    // a fresh engine from the checkpoint
    let bytes = std::fs::read(&path).expect("read");
    let (state, steps) = resume::read_state(&path, &bytes).expect("state");
    let r = resume::load(&path, &bytes, model, config, &state, steps).expect("load");
    let mut second = trainer(model, &r.params, config, make);
    second
        .engine
        .restore(TrainState {
            params: r.params,
            optimizer: r.optimizer,
            dropout: state.dropout.clone(),
        })
        .expect("state restored");
    let mut at = state.progress;
    let end = second
        .train_span(&span, &mut at, &Pauses::default(), |_, _, _| {})
        .expect("rest");
    assert_eq!(end, SpanEnd::EpochDone);
    for _ in 2..EPOCHS {
        second
            .train_epoch(data, BATCH, &mut shuffle, |_, _, _| {})
            .expect("epoch");
    }
    let (whole, second) = (
        whole.state().expect("state"),
        second.state().expect("state"),
    );
    let mut worst = 0f32;
    for (p, spec) in model.params.iter().enumerate() {
        for (&a, &b) in whole.params.values[p]
            .data()
            .iter()
            .zip(second.params.values[p].data())
        {
            let d = (a - b).abs() / (1.0 + a.abs());
            worst = worst.max(d);
            assert!(
                d <= tol,
                "{what}: `{}`: uninterrupted {a}, resumed {b}",
                spec.name
            );
        }
    }
    eprintln!("{what}: resumed run within {worst:e} of the uninterrupted one");
    std::fs::remove_file(&path).ok();
}

fn trees(count: usize) -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    (0..count)
        .map(|_| random_tree(&mut rng, 6, &[2], 40, 5).expect("tree"))
        .collect()
}

fn tree_model(name: &str, dropout: f64) -> Model {
    let cfg = ModelConfig {
        vocab: 40,
        hidden: 16,
        classes: 5,
    };
    build_model_with(name, &cfg, &ModelOptions { dropout }).expect("model")
}

#[test]
fn the_batched_engine_resumes_to_rounding() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let make: MakeEngine = &|model, params, config| {
        let engine = CudaEngine::new(model, &CudaEngineOptions::default()).expect("engine");
        Box::new(CudaTrainer::new(engine, model.clone(), params.clone(), config).expect("trainer"))
    };
    let data = trees(60);
    for kind in [OptimizerKind::Adam, OptimizerKind::Adagrad] {
        let config = OptimizerConfig::new(kind, 0.01);
        let what = format!("batched {kind:?}");
        resumed_matches(
            &what,
            &tree_model("treelstm-nary", 0.2),
            &data,
            config,
            make,
            1e-4,
        );
    }
}

#[test]
fn the_persistent_engine_resumes_to_rounding() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let make: MakeEngine = &|model, params, config| {
        let options = PersistentOptions::default();
        Box::new(PersistentTrainer::new(model, params, config, &options).expect("engine"))
    };
    let data = trees(60);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    resumed_matches(
        "persistent",
        &tree_model("treelstm", 0.0),
        &data,
        config,
        make,
        1e-4,
    );
}

/// The swap path's trainer for the resume test, under `budget` (`None`:
/// resident, to measure the step).
fn swap_engine(
    model: &Model,
    mode: SwapMode,
    budget: Option<u64>,
    params: Params<f32>,
    config: OptimizerConfig,
) -> SwapTrainer {
    let mut swap = SwapConfig::with_mode(mode);
    swap.size_threshold_bytes = 0;
    let options = CudaEngineOptions {
        conv_workspace: Some(1 << 16),
        pool: PoolConfig {
            max_bytes: budget,
            ..PoolConfig::default()
        },
        ..CudaEngineOptions::default()
    };
    SwapTrainer::new(model.clone(), &options, swap, params, config).expect("trainer")
}

/// One training step in `mode` under `budget` on the first batch; its swap report.
fn swap_step(
    mode: SwapMode,
    budget: Option<u64>,
    model: &Model,
    data: &[InputGraph],
) -> SwapStepReport {
    let params = Params::<f32>::init(model, 5);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.001);
    let mut engine = swap_engine(model, mode, budget, params, config);
    let batch = Batch::new(
        model,
        data[..BATCH].iter().collect(),
        ramus_graph::BatchingPolicy::Cavs,
    )
    .expect("batch");
    engine.train_step(&batch).expect("step");
    engine.last_report().cloned().expect("a swap report")
}

#[test]
fn the_swap_path_resumes_to_rounding() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, data) = common::tiny_resnet(36);
    // a budget the step's tensors exceed by a third (as the swap tests
    // give the engine), checked to make the planner swap
    let measured = swap_step(SwapMode::Resident, None, &model, &data);
    let tensors = measured.trace_peak_bytes * 2 / 3;
    let budget = ((measured.overhead_bytes + tensors) as f64 / 0.98) as u64;
    let swapped = swap_step(SwapMode::Planner, Some(budget), &model, &data);
    assert!(
        swapped.exec.bytes_to_host > 0 && swapped.pool_peak_bytes <= budget,
        "budget {budget}: {}",
        swapped.to_json()
    );
    eprintln!(
        "swap: budget {budget} bytes, {} bytes to the host a step",
        swapped.exec.bytes_to_host
    );
    let make: MakeEngine = &|model, params, config| {
        Box::new(swap_engine(
            model,
            SwapMode::Planner,
            Some(budget),
            params.clone(),
            config,
        ))
    };
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.001);
    resumed_matches("swap", &model, &data, config, make, 1e-3);
}
