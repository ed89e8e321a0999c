//! The CNN models of the zoo (`ramus-nn/src/vision.rs`: AlexNet, VGG and
//! the bottleneck ResNet, also with ImageNet's 7x7 stride-2 stem and max
//! pool) on the CUDA engine against the CPU engine, at tiny sizes: loss,
//! scores and every parameter gradient (relative 1e-4 of each tensor's
//! largest element, plus 1e-6 absolute), with convolution columns in one
//! chunk and in many; a few training steps with the fused device optimizer
//! against the CPU trainer; no device allocation in steady state.
//!
//! The CPU half of every test runs everywhere: the f32 CPU engine must
//! match the f64 one at the tolerance the device is held to (so a device
//! mismatch points at the device, not at an ill-conditioned case), and the
//! CPU trainer's losses must be finite. The device half skips with a notice
//! where no CUDA driver is found.

mod common;

use std::path::PathBuf;

use ramus_core::{Grads, HeadRows, Init, Model, Params};
use ramus_cpu::CpuEngine;
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{build_vision_model, ImageShape, ModelConfig, ModelOptions, Trainer, VisionConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CLASSES: usize = 3;

fn device_ready() -> bool {
    common::cuda_ready("skipping the device half")
}

fn cache_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ramus-cuda-cnn-{name}-{}", std::process::id()))
}

/// Engine options; `conv_workspace` caps the convolution columns (in
/// floats) so that convolutions run over chunks of images.
fn options(name: &str, conv_workspace: Option<usize>) -> CudaEngineOptions {
    CudaEngineOptions {
        cache_dir: Some(cache_dir(name)),
        conv_workspace,
        ..CudaEngineOptions::default()
    }
}

/// One CNN at tiny size.
struct Case {
    model: &'static str,
    image: [usize; 3],
    blocks: &'static [usize],
    hidden: usize,
    dropout: f64,
    /// Images per compared batch.
    batches: &'static [usize],
}

const ALEXNET: Case = Case {
    model: "alexnet",
    image: [3, 8, 8],
    blocks: &[1],
    hidden: 2,
    dropout: 0.3,
    batches: &[1, 5],
};

/// VGG's deepest blocks normalise 1x1 maps over the images alone; at
/// 32x32 with a few images the f32 CPU engine stays within 2e-5 of f64
/// (smaller images and batches can be ill-conditioned enough to miss the
/// tolerance in f32 on any engine).
const VGG11: Case = Case {
    model: "vgg11",
    image: [3, 32, 32],
    blocks: &[1],
    hidden: 2,
    dropout: 0.2,
    batches: &[2, 5],
};

const VGG16: Case = Case {
    model: "vgg16",
    image: [3, 32, 32],
    blocks: &[1],
    hidden: 2,
    dropout: 0.0,
    batches: &[4],
};

/// Strided 3x3 convolutions, projection and identity shortcuts.
const RESNET: Case = Case {
    model: "resnet",
    image: [3, 16, 16],
    blocks: &[1, 2, 1],
    hidden: 2,
    dropout: 0.0,
    batches: &[2, 5],
};

/// 96-pixel images get the 7x7 stride-2 stem and a 3x3 stride-2 max pool.
const RESNET_STEM: Case = Case {
    model: "resnet",
    image: [3, 96, 96],
    blocks: &[1, 1],
    hidden: 2,
    dropout: 0.0,
    batches: &[2],
};

impl Case {
    fn shape(&self) -> ImageShape {
        ImageShape {
            channels: self.image[0],
            height: self.image[1],
            width: self.image[2],
        }
    }

    fn label(&self) -> String {
        let [c, h, w] = self.image;
        format!("{} {c}x{h}x{w}", self.model)
    }

    fn build(&self) -> Model {
        let cfg = ModelConfig {
            vocab: 0,
            hidden: self.hidden,
            classes: CLASSES,
        };
        let vision = VisionConfig {
            image: self.shape(),
            vgg_depth: 11,
            resnet_blocks: self.blocks.to_vec(),
        };
        let opts = ModelOptions {
            dropout: self.dropout,
        };
        build_vision_model(self.model, &cfg, &vision, &opts).expect("model builds")
    }

    /// `n` single-vertex graphs with random pixels in [-1, 1] and labels
    /// cycling through the classes.
    fn images(&self, n: usize, seed: u64) -> Vec<InputGraph> {
        let shape = self.shape();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let mut g = InputGraph::new();
                g.push_vertex(&[], 0, (i % CLASSES) as i32).expect("vertex");
                let pixels = (0..shape.len())
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                g.set_features(shape.len(), pixels).expect("features");
                g
            })
            .collect()
    }
}

/// Initial parameters with the constant ones (batch-norm scales and
/// shifts, biases) perturbed, so every term of the gradient counts.
fn params(model: &Model, seed: u64) -> Params<f32> {
    let mut params: Params<f32> = Params::init(model, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    for (spec, t) in model.params.iter().zip(params.values.iter_mut()) {
        if matches!(spec.init, Init::Constant { .. } | Init::Zeros) {
            for x in t.data_mut() {
                *x += rng.random_range(-0.3..0.3);
            }
        }
    }
    params.touch();
    params
}

/// `got` within 1e-4 of `want`'s largest magnitude, plus 1e-6.
fn close(want: &[f32], got: &[f32], what: &str) {
    assert_eq!(want.len(), got.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let tol = 1e-4 * scale + 1e-6;
    for (i, (x, y)) in want.iter().zip(got).enumerate() {
        assert!(
            (x - y).abs() <= tol,
            "{what}[{i}]: want {x} got {y} (largest {scale}, tolerance {tol})"
        );
    }
}

fn close_loss(want: f64, got: f64, what: &str) {
    assert!(
        (want - got).abs() <= 1e-4 * want.abs().max(1e-3),
        "{what}: loss {want} vs {got}"
    );
}

/// What one engine makes of a training batch: loss, scores, gradients, and
/// the scores of every labelled vertex in inference.
struct Outcome {
    loss: f64,
    logits: Vec<f32>,
    grads: Vec<Vec<f32>>,
    scores: Vec<f32>,
}

/// [`Outcome`] of `$engine` (the CPU or the CUDA batched engine, whose
/// reference passes take the model and parameters) on `$batch`.
macro_rules! run {
    ($engine:expr, $model:expr, $params:expr, $batch:expr) => {{
        let (engine, model, params, batch) = ($engine, $model, $params, $batch);
        engine.set_seed(9);
        let out = engine
            .forward(model, params, batch, Mode::Train)
            .expect("forward");
        let mut grads = Grads::zeros(model);
        engine
            .backward(model, params, batch, &mut grads)
            .expect("backward");
        let infer = engine
            .forward_rows(model, params, batch, Mode::Infer, HeadRows::Labelled)
            .expect("inference");
        assert!(infer.loss.is_none());
        Outcome {
            loss: out.loss.expect("a training pass has a loss"),
            logits: out.logits,
            grads: grads.values.iter().map(|t| t.data().to_vec()).collect(),
            scores: infer.logits,
        }
    }};
}

/// The f64 CPU engine's view of the same batch, rounded to f32.
fn run_f64(model: &Model, params: &Params<f32>, batch: &Batch<'_>) -> Outcome {
    let params: Params<f64> = params.cast();
    let mut cpu = CpuEngine::<f64>::new();
    cpu.set_seed(9);
    let out = cpu
        .forward(model, &params, batch, Mode::Train)
        .expect("forward");
    let mut grads = Grads::zeros(model);
    cpu.backward(model, &params, batch, &mut grads)
        .expect("backward");
    let infer = cpu
        .forward_rows(model, &params, batch, Mode::Infer, HeadRows::Labelled)
        .expect("inference");
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    Outcome {
        loss: out.loss.expect("loss"),
        logits: f32s(&out.logits),
        grads: grads.values.iter().map(|t| f32s(t.data())).collect(),
        scores: f32s(&infer.logits),
    }
}

fn compare(model: &Model, want: &Outcome, got: &Outcome, what: &str) {
    close_loss(want.loss, got.loss, what);
    close(&want.logits, &got.logits, &format!("{what}: logits"));
    close(
        &want.scores,
        &got.scores,
        &format!("{what}: labelled scores"),
    );
    for (p, spec) in model.params.iter().enumerate() {
        close(
            &want.grads[p],
            &got.grads[p],
            &format!("{what}: d{}", spec.name),
        );
    }
}

/// Every batch size of `case` through the CPU engine (checked against f64)
/// and, where there is a device, through CUDA engines with one and with
/// many chunks of images per convolution.
fn check_case(case: &Case) {
    let model = case.build();
    let params = params(&model, 3);
    let name = case.label();
    let device = device_ready();
    // 3000 floats of columns: chunks of one to a few images, with remainders
    let mut engines: Vec<(String, CudaEngine)> = if device {
        [None, Some(3000)]
            .into_iter()
            .map(|cap| {
                let tag = format!("{}-{}", case.model, case.image[1]);
                let engine = CudaEngine::new(&model, &options(&tag, cap)).expect("engine set-up");
                let label = match cap {
                    None => "one chunk".to_string(),
                    Some(c) => format!("chunks of {c} floats"),
                };
                (label, engine)
            })
            .collect()
    } else {
        Vec::new()
    };
    for (i, &bs) in case.batches.iter().enumerate() {
        let graphs = case.images(bs, 10 + i as u64);
        let batch =
            Batch::new(&model, graphs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
        let what = format!("{name} bs{bs}");
        let mut cpu = CpuEngine::<f32>::new();
        let want = run!(&mut cpu, &model, &params, &batch);
        assert!(want.loss.is_finite(), "{what}: CPU loss {}", want.loss);
        let norm: f64 = want
            .grads
            .iter()
            .flatten()
            .map(|&g| f64::from(g).powi(2))
            .sum();
        assert!(norm > 1e-12, "{what}: the CPU gradient vanished");
        // the CPU half: f32 arithmetic reaches the tolerance on this case
        let exact = run_f64(&model, &params, &batch);
        compare(&model, &exact, &want, &format!("{what} CPU f32 vs f64"));
        for (label, cuda) in engines.iter_mut() {
            let got = run!(cuda, &model, &params, &batch);
            compare(&model, &want, &got, &format!("{what} CUDA ({label})"));
        }
    }
    let _ = std::fs::remove_dir_all(cache_dir(&format!("{}-{}", case.model, case.image[1])));
}

#[test]
fn alexnet_matches_the_cpu_engine() {
    check_case(&ALEXNET);
}

#[test]
fn vgg11_matches_the_cpu_engine() {
    check_case(&VGG11);
}

#[test]
fn vgg16_matches_the_cpu_engine() {
    check_case(&VGG16);
}

#[test]
fn resnet_matches_the_cpu_engine() {
    check_case(&RESNET);
}

#[test]
fn resnet_with_the_imagenet_stem_matches_the_cpu_engine() {
    check_case(&RESNET_STEM);
}

/// A few training steps with the fused device optimizer against the CPU
/// trainer: same losses, same updated parameters, same evaluation.
fn follows_the_cpu_trajectory(case: &Case, config: OptimizerConfig, tag: &str) {
    let model = case.build();
    let params = params(&model, 5);
    let initial = params.clone();
    let data = case.images(16, 21);
    let mut cpu = Trainer::new(model.clone(), params.clone(), config);
    let losses: Vec<f64> = data
        .chunks(4)
        .map(|chunk| {
            let refs: Vec<&InputGraph> = chunk.iter().collect();
            cpu.train_batch(&refs).expect("cpu step")
        })
        .collect();
    assert!(
        losses.iter().all(|l| l.is_finite()),
        "{tag}: CPU losses {losses:?}"
    );
    if !device_ready() {
        return;
    }
    let engine = CudaEngine::new(&model, &options(tag, None)).expect("engine");
    let engine = CudaTrainer::new(engine, model.clone(), params, config).expect("trainer");
    let mut gpu = Trainer::with_engine(Box::new(engine));
    for (chunk, &a) in data.chunks(4).zip(&losses) {
        let refs: Vec<&InputGraph> = chunk.iter().collect();
        let b = gpu.train_batch(&refs).expect("cuda step");
        assert!(
            (a - b).abs() <= 1e-3 * a.abs().max(1.0),
            "{tag}: loss CPU {a} vs CUDA {b}"
        );
    }
    let cpu_params = cpu.state().expect("cpu state").params;
    let gpu_params = gpu
        .state()
        .expect("parameters come back from the device")
        .params;
    // every parameter, the running statistics (buffers) included
    for (p, spec) in model.params.iter().enumerate() {
        let (x, y) = (cpu_params.values[p].data(), gpu_params.values[p].data());
        let scale = x.iter().fold(1f32, |m, v| m.max(v.abs()));
        let what = if model.is_buffer(p) {
            "running statistic"
        } else {
            "updated"
        };
        for (i, (a, b)) in x.iter().zip(y).enumerate() {
            assert!(
                (a - b).abs() <= 2e-4 * scale,
                "{tag}: {what} {}[{i}]: CPU {a} vs CUDA {b}",
                spec.name
            );
        }
        if model.is_buffer(p) {
            assert_ne!(
                gpu_params.values[p], initial.values[p],
                "{tag}: CUDA training steps left {} alone",
                spec.name
            );
        }
    }
    // AlexNet has no batch normalisation; the others must keep statistics
    assert_eq!(
        (0..model.params.len()).any(|p| model.is_buffer(p)),
        case.model != "alexnet",
        "{tag}: running statistics kept by exactly the batch-normalised models"
    );
    let (x, y) = (
        cpu.evaluate(&data, 8).expect("cpu eval"),
        gpu.evaluate(&data, 8).expect("cuda eval"),
    );
    assert!(
        (x.loss - y.loss).abs() <= 1e-3 * x.loss.abs().max(1.0),
        "{tag}: eval loss {} vs {}",
        x.loss,
        y.loss
    );
    let _ = std::fs::remove_dir_all(cache_dir(tag));
}

#[test]
fn resnet_training_on_cuda_follows_the_cpu_trajectory() {
    let mut config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    config.weight_decay = 1e-4;
    config.clip_norm = Some(5.0);
    follows_the_cpu_trajectory(&RESNET, config, "resnet-adamw");
}

#[test]
fn vgg_training_on_cuda_follows_the_cpu_trajectory() {
    follows_the_cpu_trajectory(
        &VGG11,
        OptimizerConfig::new(OptimizerKind::Sgd, 0.05),
        "vgg-sgd",
    );
}

#[test]
fn alexnet_training_on_cuda_follows_the_cpu_trajectory() {
    follows_the_cpu_trajectory(
        &ALEXNET,
        OptimizerConfig::new(OptimizerKind::Adagrad, 0.05),
        "alexnet-adagrad",
    );
}

/// After the first round, batches of the same sizes take their columns and
/// scratch from the arena without a device allocation.
#[test]
fn steady_state_cnn_batches_allocate_nothing() {
    if !device_ready() {
        return;
    }
    let model = RESNET.build();
    let params = params(&model, 7);
    let data = RESNET.images(12, 30);
    let mut cuda = CudaEngine::new(&model, &options("steady", None)).expect("engine");
    common::assert_steady_state(&mut cuda, &model, &params, &data, 6, "images");
    let _ = std::fs::remove_dir_all(cache_dir("steady"));
}
