//! The learning rate a schedule sets reaches the device's next step, on the
//! batched engine, the swap path and the persistent engine: a rate of 0
//! leaves every parameter as it was, a rate set back trains again, and a
//! window of batches takes one rate each (the persistent engine) exactly
//! as batches submitted one at a time do. Per-parameter multipliers (a
//! frozen embedding table) on the batched engine; the persistent engine
//! takes them only with its updates split out of its kernel. Skips with a notice where no CUDA driver is found.

mod common;

use ramus_core::{Model, Params};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer, SwapConfig, SwapMode, SwapTrainer};
use ramus_exec::{Batch, OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::random::random_tree;
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{build_model, ModelConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn trees(count: usize) -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    (0..count)
        .map(|_| random_tree(&mut rng, 6, &[2], 40, 5).expect("tree"))
        .collect()
}

fn model() -> Model {
    let cfg = ModelConfig {
        vocab: 40,
        hidden: 16,
        classes: 5,
    };
    build_model("treelstm", &cfg).expect("model")
}

fn batches<'a>(model: &Model, data: &'a [InputGraph]) -> Vec<Batch<'a>> {
    data.chunks(6)
        .map(|c| Batch::new(model, c.iter().collect(), BatchingPolicy::Cavs).expect("batch"))
        .collect()
}

/// The trained parameters' values (buffers, e.g. running statistics, move
/// in every training pass whatever the rate: left empty).
fn values(engine: &mut dyn TrainEngine<f32>) -> Vec<Vec<f32>> {
    let model = engine.model().clone();
    let state = engine.state().expect("state");
    let values = state.params.values.iter().enumerate();
    values
        .map(|(p, t)| match model.is_buffer(p) {
            true => Vec::new(),
            false => t.data().to_vec(),
        })
        .collect()
}

/// Rate 0: a step changes nothing; the rate set back: it trains.
fn rate_reaches_the_next_step(what: &str, engine: &mut dyn TrainEngine<f32>, b: &[Batch<'_>]) {
    let before = values(engine);
    engine.set_lr(0.0).expect("set_lr");
    engine.train_step(&b[0]).expect("step at 0");
    assert_eq!(values(engine), before, "{what}: a step at rate 0 moved");
    engine.set_lr(0.05).expect("set_lr");
    engine.train_step(&b[1]).expect("step");
    assert_ne!(
        values(engine),
        before,
        "{what}: a step at 0.05 did not train"
    );
    assert!(engine.set_lr(-1.0).is_err(), "{what}");
}

#[test]
fn the_batched_engine_and_swap_path_take_the_new_rate() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, data) = (model(), trees(24));
    let b = batches(&model, &data);
    let params = Params::<f32>::init(&model, 5);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.05);
    let engine = CudaEngine::new(&model, &CudaEngineOptions::default()).expect("engine");
    let mut batched =
        CudaTrainer::new(engine, model.clone(), params.clone(), config).expect("trainer");
    rate_reaches_the_next_step("batched", &mut batched, &b);

    // the word table frozen: it stays, the rest trains
    let emb = model.param_id("emb").expect("emb");
    let before = values(&mut batched);
    let mut scales = vec![1.0; model.params.len()];
    scales[emb] = 0.0;
    batched.set_lr_scales(&scales).expect("scales");
    batched.train_step(&b[2]).expect("step");
    batched.train_step(&b[3]).expect("step");
    let after = values(&mut batched);
    assert_eq!(after[emb], before[emb], "the frozen table moved");
    assert_ne!(after, before, "nothing else trained");
}

#[test]
fn the_swap_path_takes_the_new_rate() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, data) = common::tiny_resnet(12);
    let b = batches(&model, &data);
    let params = Params::<f32>::init(&model, 5);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.001);
    let mut swap = SwapConfig::with_mode(SwapMode::Naive);
    swap.size_threshold_bytes = 0;
    let options = CudaEngineOptions::default();
    let mut swapping =
        SwapTrainer::new(model.clone(), &options, swap, params, config).expect("swap trainer");
    rate_reaches_the_next_step("swap", &mut swapping, &b);
}

#[test]
fn the_persistent_engine_takes_a_rate_per_step_of_a_window() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, data) = (model(), trees(24));
    let b = batches(&model, &data);
    let params = Params::<f32>::init(&model, 5);
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.05);
    let make = || {
        PersistentTrainer::new(&model, &params, config, &PersistentOptions::default())
            .expect("persistent")
    };
    let mut engine = make();
    rate_reaches_the_next_step("persistent", &mut engine, &b);

    // a window of four at rates 0, 0.1, 0, 0.05 against one at a time
    let rates = [0.0, 0.1, 0.0, 0.05];
    let (mut window, mut single) = (make(), make());
    window.set_step_lrs(&rates).expect("rates");
    window.submit(&b).expect("window");
    window.finish().expect("finish");
    for (batch, &lr) in b.iter().zip(&rates) {
        single.set_lr(lr).expect("rate");
        single.train_step(batch).expect("step");
    }
    let (w, s) = (values(&mut window), values(&mut single));
    for (p, (a, b)) in w.iter().zip(&s).enumerate() {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                "parameter {p}: {x} vs {y}"
            );
        }
    }

    let mut scales = vec![1.0; model.params.len()];
    scales[model.param_id("emb").expect("emb")] = 0.0;
    let err = engine.set_lr_scales(&scales).unwrap_err().to_string();
    assert!(
        err.contains("`emb`") && err.contains("split_updates"),
        "{err}"
    );
    // split, the device optimizer takes them
    let mut split = make();
    split.split_updates().expect("split");
    split
        .set_lr_scales(&scales)
        .expect("multipliers when split");
}
