//! Non-finite training steps on the CUDA engines (skips with a notice
//! without a CUDA driver): the batched engine and its swap path hold a
//! non-finite update back on the device — parameters, running statistics
//! and optimizer state stay bit for bit as they were — and report it one
//! step late, naming the batch and parameter; the persistent engine stops
//! on a non-finite loss or update at the batch that produced it, naming the
//! parameter, and cannot skip.

mod common;

use rand::seq::SliceRandom;

use ramus_core::{Model, Params};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer, SwapConfig, SwapMode, SwapTrainer};
use ramus_exec::{ExecError, OnNonFinite, OptimizerConfig, OptimizerKind, TensorPart, TrainEngine};
use ramus_graph::random::random_tree;
use ramus_graph::testing::{images_with_nan_pixel, SMALL_IMAGES};
use ramus_graph::InputGraph;
use ramus_nn::{
    build_model, build_vision_model, ImageShape, ModelConfig, ModelOptions, Trainer, VisionConfig,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const BATCH: usize = 8;

fn options(name: &str) -> CudaEngineOptions {
    CudaEngineOptions {
        cache_dir: Some(std::env::temp_dir().join(format!(
            "ramus-cuda-nonfinite-{name}-{}",
            std::process::id()
        ))),
        ..CudaEngineOptions::default()
    }
}

/// The epoch's batches as the trainer draws them with `seed`.
fn batches(n: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ramus_nn::train::rng(seed));
    order.chunks(BATCH).map(<[usize]>::to_vec).collect()
}

fn bits(params: &Params<f32>) -> Vec<Vec<u32>> {
    params
        .values
        .iter()
        .map(|t| t.data().iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A small ResNet (batch norm with running statistics: buffers) for
/// [`SMALL_IMAGES`].
fn small_resnet() -> Model {
    let vision = VisionConfig {
        image: ImageShape {
            channels: SMALL_IMAGES.channels,
            height: SMALL_IMAGES.height,
            width: SMALL_IMAGES.width,
        },
        resnet_blocks: vec![1],
        ..VisionConfig::default()
    };
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 4,
        classes: SMALL_IMAGES.classes,
    };
    build_vision_model("resnet", &cfg, &vision, &ModelOptions::default()).unwrap()
}

/// A small ResNet (batch norm with running statistics) and 8×8 images,
/// those at `poisoned` with a NaN pixel: their batches have a NaN loss.
fn poisoned_images(poisoned: &[usize]) -> (Vec<InputGraph>, Model) {
    (images_with_nan_pixel(64, poisoned), small_resnet())
}

/// On `swap` (off: the batched path; otherwise the swap path): a clean
/// step, then a poisoned one that leaves every parameter (running
/// statistics included) bit for bit as it was; a further clean step then
/// matches a run that never saw the poisoned batch (the optimizer state
/// did not move either); a skip-batch epoch skips exactly the poisoned
/// batches and learns.
fn skipped_steps_change_nothing(swap: SwapMode) {
    if !common::cuda_ready("skipping") {
        return;
    }
    let poisoned = [3, 40];
    let (data, model) = poisoned_images(&poisoned);
    let all = batches(data.len(), 2);
    let is_bad = |b: &[usize]| b.iter().any(|i| poisoned.contains(i));
    let graphs = |b: &[usize]| b.iter().map(|&i| &data[i]).collect::<Vec<_>>();
    let clean: Vec<&Vec<usize>> = all.iter().filter(|b| !is_bad(b)).collect();
    let bad = all.iter().find(|b| is_bad(b)).unwrap();
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    let trainer = |name: &str| {
        let params = Params::init(&model, 1);
        let swap = SwapConfig::with_mode(swap);
        let engine =
            SwapTrainer::new(model.clone(), &options(name), swap, params, config).expect("trainer");
        Trainer::with_engine(Box::new(engine))
    };
    let params = |t: &mut Trainer<f32>| t.state().expect("state").params;
    let (mut skipping, mut reference) = (trainer("skipping"), trainer("reference"));
    for t in [&mut skipping, &mut reference] {
        t.train_batch(&graphs(clean[0])).expect("clean step");
    }
    let before = bits(&params(&mut skipping));
    let err = skipping.train_batch(&graphs(bad)).unwrap_err();
    assert!(err.nonfinite().is_some(), "{swap}: {err}");
    // the NaN pixel reaches the first convolution's weight gradient (the
    // loss itself may stay finite: a ReLU maps NaN to 0 on the device)
    assert!(
        err.to_string().contains("`stem.W` (gradient)"),
        "{swap}: {err}"
    );
    assert_eq!(
        bits(&params(&mut skipping)),
        before,
        "{swap}: the skipped step moved parameters"
    );
    for t in [&mut skipping, &mut reference] {
        t.train_batch(&graphs(clean[1])).expect("clean step");
    }
    let (skipped, unseen) = (params(&mut skipping), params(&mut reference));
    for (p, spec) in model.params.iter().enumerate() {
        let (a, b) = (skipped.values[p].data(), unseen.values[p].data());
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                "{swap}: `{}` {x} vs {y} after the skipped step",
                spec.name
            );
        }
    }

    let mut t = trainer("epoch");
    t.on_nonfinite = OnNonFinite::SkipBatch;
    let at = t
        .train_epoch_progress(&data, BATCH, &mut ramus_nn::train::rng(2), |_, _, _| {})
        .expect("a skip-batch epoch");
    let loss = at.mean_loss();
    assert_eq!(at.skipped, all.len() - clean.len(), "{swap}");
    assert!(loss.is_finite(), "{swap}: loss {loss}");
    assert_eq!(
        ramus_exec::nonfinite::first_nonfinite(&model, &params(&mut t), None),
        None
    );
}

#[test]
fn batched_engine_skipped_steps_change_nothing() {
    skipped_steps_change_nothing(SwapMode::Off);
}

#[test]
fn swap_path_skipped_steps_change_nothing() {
    skipped_steps_change_nothing(SwapMode::Resident);
}

/// Random binary trees over 40 words; the embedding of word 7 holds
/// `poison` in the trainer's parameters, so the first batch with it is the
/// bad one. NaN makes that batch's loss NaN; infinity saturates the gates
/// (the loss stays finite) but makes the gradient of `W_iou` NaN (0 · ∞).
fn poisoned_trees(poison: f32) -> (Vec<InputGraph>, Model, Params<f32>, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let data: Vec<InputGraph> = (0..96)
        .map(|_| random_tree(&mut rng, 3, &[2], 40, 5).unwrap())
        .collect();
    let cfg = ModelConfig {
        vocab: 40,
        hidden: 16,
        classes: 5,
    };
    let model = build_model("treelstm", &cfg).unwrap();
    let mut params = Params::<f32>::init(&model, 1);
    let emb = model.param_id("emb").unwrap();
    let hidden = model.params[emb].shape[1];
    params.values[emb].data_mut()[7 * hidden] = poison;
    let bad = batches(data.len(), 6)
        .iter()
        .position(|b| b.iter().any(|&i| data[i].tokens.contains(&7)))
        .expect("a batch with word 7");
    (data, model, params, bad)
}

/// The stop error names the bad batch (whose fault the engine may learn of
/// a step later), its first graph and the first non-finite parameter;
/// returns the loss it reported.
fn stops_naming_the_batch(
    name: &str,
    poison: f32,
    engine: impl FnOnce(&Model, &Params<f32>) -> Box<dyn TrainEngine<f32>>,
) -> f64 {
    let (data, model, params, bad) = poisoned_trees(poison);
    let mut t = Trainer::with_engine(engine(&model, &params));
    let err = t
        .train_epoch(&data, BATCH, &mut ramus_nn::train::rng(6), |_, _, _| {})
        .unwrap_err();
    let fault = err.nonfinite().unwrap_or_else(|| panic!("{name}: {err}"));
    let place = fault.place.as_ref().expect("place");
    assert_eq!(place.batch, bad + 1, "{name}: {err}");
    let first = batches(data.len(), 6)[bad][0];
    assert_eq!(place.first_graph, data[first].describe(first));
    let param = fault.step.param.as_ref().expect("a parameter");
    assert_eq!(
        (param.name.as_str(), param.part),
        ("emb", TensorPart::Value),
        "{name}: {err}"
    );
    fault.step.loss
}

#[test]
fn batched_engine_stops_naming_the_batch_and_parameter() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let batched = |model: &Model, params: &Params<f32>| -> Box<dyn TrainEngine<f32>> {
        let engine = CudaEngine::new(model, &options("stop")).expect("engine");
        let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        let params = params.clone();
        Box::new(CudaTrainer::new(engine, model.clone(), params, config).expect("trainer"))
    };
    stops_naming_the_batch("batched", f32::NAN, batched);
    stops_naming_the_batch("batched", f32::INFINITY, batched);
}

#[test]
fn persistent_engine_stops_naming_the_parameter_and_refuses_to_skip() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
    let persistent = |model: &Model, params: &Params<f32>| -> Box<dyn TrainEngine<f32>> {
        let options = PersistentOptions {
            batch_size: Some(BATCH),
            cache_dir: options("persistent").cache_dir,
            ..PersistentOptions::default()
        };
        Box::new(
            PersistentTrainer::new(model, params, config, &options).expect("persistent engine"),
        )
    };
    stops_naming_the_batch("persistent", f32::NAN, persistent);
    // a non-finite gradient under a finite loss: the kernel's fault word
    // names its own batch, not the next one whose loss it poisons
    let loss = stops_naming_the_batch("persistent", f32::INFINITY, persistent);
    assert!(loss.is_finite(), "the saturated batch's loss: {loss}");
    let (data, model, params, _) = poisoned_trees(f32::NAN);
    let mut t = Trainer::with_engine(persistent(&model, &params));
    t.on_nonfinite = OnNonFinite::SkipBatch;
    let err = t
        .train_epoch(&data, BATCH, &mut ramus_nn::train::rng(6), |_, _, _| {})
        .unwrap_err();
    assert!(matches!(err, ExecError::Config(_)), "{err}");
    assert!(err.to_string().contains("cannot skip"), "{err}");
}
