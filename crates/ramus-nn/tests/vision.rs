//! The CNN model zoo (`vision.rs`): every model builds with the documented
//! parameters, its whole gradient (batch norm, pooling, residual adds,
//! dropout with fixed masks) matches f64 central finite differences on tiny
//! images, bad architectures are refused by name, and a small CNN learns
//! the built-in synthetic images.

use std::time::Instant;

use ramus_core::{Grads, Init, Params};
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::images::{self, ImageSpec};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::vision::{parse_blocks, VISION_MODELS};
use ramus_nn::{
    build_model, build_vision_model, data_kind, DataKind, ImageShape, ModelConfig, ModelOptions,
    Trainer, VisionConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn tiny_images(n: usize, spec: &ImageSpec, seed: u64) -> Vec<InputGraph> {
    images::generate(spec, seed, (n, 0, 0)).unwrap().train
}

fn tiny_spec() -> ImageSpec {
    ImageSpec {
        channels: 3,
        height: 8,
        width: 8,
        classes: 3,
        noise: 0.3,
    }
}

fn tiny_vision() -> VisionConfig {
    VisionConfig {
        image: ImageShape {
            channels: 3,
            height: 8,
            width: 8,
        },
        vgg_depth: 11,
        resnet_blocks: vec![1, 2, 1],
    }
}

/// Loss with dropout masks drawn from a fixed seed (every call sees the
/// same masks), and optionally the gradients.
fn run(
    model: &ramus_core::Model,
    params: &Params<f64>,
    graphs: &[InputGraph],
    grads: Option<&mut Grads<f64>>,
) -> f64 {
    let mut engine = CpuEngine::<f64>::new();
    engine.set_seed(77);
    let batch = Batch::new(model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
    let loss = engine
        .forward(model, params, &batch, Mode::Train)
        .unwrap()
        .loss
        .unwrap();
    if let Some(g) = grads {
        engine.backward(model, params, &batch, g).unwrap();
    }
    loss
}

/// Checks up to `per_param` evenly spread elements of every parameter.
fn check_gradients(name: &str, dropout: f64, per_param: usize) {
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 2,
        classes: 3,
    };
    let model = build_vision_model(name, &cfg, &tiny_vision(), &ModelOptions { dropout }).unwrap();
    let graphs = tiny_images(5, &tiny_spec(), 4);
    let mut params: Params<f64> = Params::init(&model, 11);
    // perturb the batch-norm scales and shifts, so every term counts
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for (spec, t) in model.params.iter().zip(params.values.iter_mut()) {
        if matches!(spec.init, Init::Constant { .. } | Init::Zeros) {
            for x in t.data_mut() {
                *x += rng.random_range(-0.3..0.3);
            }
        }
    }
    params.touch();
    let mut grads = Grads::zeros(&model);
    run(&model, &params, &graphs, Some(&mut grads));
    let eps = 1e-6;
    let mut checked = 0;
    for p in 0..params.values.len() {
        let n = params.values[p].len();
        let step = n.div_ceil(per_param).max(1);
        for i in (0..n).step_by(step) {
            let orig = params.values[p].data()[i];
            params.values[p].data_mut()[i] = orig + eps;
            params.touch();
            let up = run(&model, &params, &graphs, None);
            params.values[p].data_mut()[i] = orig - eps;
            params.touch();
            let down = run(&model, &params, &graphs, None);
            params.values[p].data_mut()[i] = orig;
            params.touch();
            let fd = (up - down) / (2.0 * eps);
            let an = grads.values[p].data()[i];
            let tol = 1e-5 * fd.abs().max(an.abs()) + 1e-8;
            assert!(
                (fd - an).abs() <= tol,
                "{name}: d loss / d {}[{i}]: autodiff {an:.10e} vs finite difference {fd:.10e}",
                model.params[p].name
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "{name}: only {checked} elements checked");
    assert!(grads.norm() > 1e-6, "{name}: gradient vanished");
}

#[test]
fn alexnet_gradients_match_finite_differences() {
    check_gradients("alexnet", 0.3, 12);
}

#[test]
fn vgg11_gradients_match_finite_differences() {
    check_gradients("vgg11", 0.0, 12);
}

#[test]
fn vgg19_gradients_match_finite_differences() {
    check_gradients("vgg19", 0.2, 6);
}

#[test]
fn resnet_gradients_match_finite_differences() {
    check_gradients("resnet", 0.0, 16);
}

#[test]
fn every_model_builds_with_the_documented_layout() {
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 8,
        classes: 10,
    };
    for name in VISION_MODELS {
        assert_eq!(data_kind(name), Some(DataKind::Images), "{name}");
        let m = build_model(name, &cfg).unwrap();
        assert_eq!(m.settings["image"], "3x32x32");
        assert_eq!(m.settings["model"], name);
        assert_eq!(m.functions.len(), 1);
        // the whole network runs eagerly, once over all images of a batch
        let f = &m.functions[0];
        assert!(f.forward_plan.per_task.is_empty() && f.backward_plan.per_task.is_empty());
        // trained parameters end with the classifier; running statistics
        // (buffers, two per norm layer) follow
        let trained: Vec<&ramus_core::ParamSpec> = m
            .params
            .iter()
            .filter(|p| p.kind == ramus_core::ParamKind::Trained)
            .collect();
        assert_eq!(
            trained.last().map(|p| p.name.as_str()),
            Some("b_out"),
            "{name}"
        );
        let norms = m
            .params
            .iter()
            .filter(|p| p.name.ends_with(".gamma"))
            .count();
        assert_eq!(m.params.len(), trained.len() + 2 * norms, "{name}");
        assert!(m.params[..trained.len()]
            .iter()
            .all(|p| p.kind == ramus_core::ParamKind::Trained));
        let convs: Vec<&ramus_core::ParamSpec> =
            m.params.iter().filter(|p| p.shape.len() == 4).collect();
        assert!(convs.iter().all(|p| p.init == Init::Kaiming), "{name}");
        let count = convs.len();
        let want = match name {
            "alexnet" => 5,
            "vgg" | "vgg11" => 8,
            "vgg13" => 10,
            "vgg16" => 13,
            "vgg19" => 16,
            // stem + 3 convs per block + one projection per stage
            "resnet" => 1 + 3 * 3 + 3,
            _ => unreachable!(),
        };
        assert_eq!(count, want, "{name}: convolutions");
    }
    // width knob: the first convolution has `hidden` output channels
    let m = build_model("vgg19", &cfg).unwrap();
    assert_eq!(m.params[0].shape, vec![8, 3, 3, 3]);
    let id = m.param_id("conv16.W").unwrap();
    assert_eq!(m.params[id].shape, vec![64, 64, 3, 3]);
    let m = build_model("resnet", &cfg).unwrap();
    let id = m.param_id("s3.b1.conv3.W").unwrap();
    assert_eq!(m.params[id].shape, vec![4 * 32, 32, 1, 1]);
    let id = m.param_id("W_out").unwrap();
    assert_eq!(m.params[id].shape, vec![10, 128]);
    // deeper ResNets: blocks per stage from the configuration
    let deep = VisionConfig {
        resnet_blocks: vec![3, 4, 6, 3],
        ..VisionConfig::default()
    };
    let m = build_vision_model("resnet", &cfg, &deep, &ModelOptions::default()).unwrap();
    assert_eq!(m.settings["blocks"], "3,4,6,3");
    let blocks = m
        .params
        .iter()
        .filter(|p| p.name.ends_with(".conv3.W"))
        .count();
    assert_eq!(blocks, 16);
    assert_eq!(
        VisionConfig::from_settings(&m.settings)
            .unwrap()
            .resnet_blocks,
        vec![3, 4, 6, 3]
    );
    assert_eq!(VisionConfig::resnet_depth(29).unwrap(), vec![3, 3, 3]);
}

#[test]
fn bad_architectures_are_refused_by_name() {
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 4,
        classes: 10,
    };
    let opts = ModelOptions::default();
    let err = |name: &str, v: &VisionConfig, cfg: &ModelConfig| {
        build_vision_model(name, cfg, v, &opts)
            .unwrap_err()
            .to_string()
    };
    let v = VisionConfig {
        vgg_depth: 12,
        ..VisionConfig::default()
    };
    let e = err("vgg", &v, &cfg);
    assert!(
        e.contains("`vgg`") && e.contains("11, 13, 16, 19") && e.contains("12"),
        "{e}"
    );
    let v = VisionConfig {
        resnet_blocks: vec![2, 0],
        ..VisionConfig::default()
    };
    assert!(err("resnet", &v, &cfg).contains("[2, 0]"));
    let v = VisionConfig {
        image: ImageShape {
            channels: 3,
            height: 0,
            width: 8,
        },
        ..VisionConfig::default()
    };
    let e = err("alexnet", &v, &cfg);
    assert!(e.contains("`alexnet`") && e.contains("3x0x8"), "{e}");
    // "same" padding and skipped pools: even 2x2 images build
    let v = VisionConfig {
        image: ImageShape {
            channels: 1,
            height: 2,
            width: 2,
        },
        ..VisionConfig::default()
    };
    for name in VISION_MODELS {
        build_vision_model(name, &cfg, &v, &opts).unwrap();
    }
    let e = err(
        "resnet",
        &VisionConfig::default(),
        &ModelConfig { classes: 1, ..cfg },
    );
    assert!(e.contains("2 classes"), "{e}");
    let e = err("lenet", &VisionConfig::default(), &cfg);
    assert!(e.contains("lenet") && e.contains("resnet"), "{e}");
    assert!(VisionConfig::resnet_depth(12)
        .unwrap_err()
        .contains("9n + 2"));
    assert!(parse_blocks("3,x").unwrap_err().contains("3,x"));
    assert!("3x32".parse::<ImageShape>().unwrap_err().contains("CxHxW"));
    // graphs whose images have another size are refused at the batch
    let model = build_model("resnet", &ModelConfig { hidden: 2, ..cfg }).unwrap();
    let params: Params<f32> = Params::init(&model, 1);
    let graphs = tiny_images(2, &tiny_spec(), 1);
    let mut engine = CpuEngine::<f32>::new();
    let batch = Batch::new(&model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
    let e = engine
        .forward(&model, &params, &batch, Mode::Train)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3072") && e.contains("192"), "{e}");
}

/// A small ResNet (bottleneck blocks, batch norm, projection shortcuts)
/// learns the 10-class synthetic images: loss falls and dev accuracy is far
/// above chance (10 %) within a few seconds.
#[test]
fn small_resnet_learns_synthetic_images() {
    let spec = ImageSpec {
        channels: 3,
        height: 16,
        width: 16,
        ..ImageSpec::default()
    };
    let data = images::generate(&spec, 7, (1000, 300, 0)).unwrap();
    let vision = VisionConfig {
        image: ImageShape {
            channels: 3,
            height: 16,
            width: 16,
        },
        resnet_blocks: vec![1, 1],
        ..VisionConfig::default()
    };
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 4,
        classes: 10,
    };
    let model = build_vision_model("resnet", &cfg, &vision, &ModelOptions::default()).unwrap();
    let params: Params<f32> = Params::init(&model, 1);
    let mut t = Trainer::new(
        model,
        params,
        OptimizerConfig::new(OptimizerKind::Adam, 0.01),
    );
    let start = Instant::now();
    let before = t.evaluate(&data.dev, 50).unwrap();
    let mut rng = ramus_nn::train::rng(1);
    for epoch in 0..3 {
        let loss = t
            .train_epoch(&data.train, 25, &mut rng, |_, _, _| {})
            .unwrap();
        println!("epoch {epoch}: train loss {loss:.4}");
    }
    let after = t.evaluate(&data.dev, 50).unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!("dev before {before:?}\ndev after {after:?}\n{secs:.1} s");
    assert!(
        after.loss < 0.6 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.root_accuracy >= 0.7,
        "dev accuracy {} (chance 0.1)",
        after.root_accuracy
    );
}
