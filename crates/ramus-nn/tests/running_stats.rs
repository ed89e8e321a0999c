//! Batch normalisation's running statistics on the CPU engine: training
//! steps blend each batch's per-channel mean and unbiased variance into the
//! buffers (momentum 0.1) exactly as a hand-written reference does, the
//! optimizer (with weight decay) leaves them alone, evaluation normalises
//! with them (so it differs from the training-mode output and does not
//! depend on the rest of the batch), and checkpoints carry them (old
//! checkpoints without them load with the initial values, named).

use ramus_core::ops::NormGeom;
use ramus_core::{Init, Model, ModelBuilder, ParamKind, Params};
use ramus_cpu::{CpuEngine, CpuTrainer};
use ramus_exec::{Batch, Mode};
use ramus_exec::{HostState, OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::images::{self, ImageSpec};
use ramus_graph::{BatchingPolicy, InputGraph, Vocab};
use ramus_nn::vision::BN_EPS;
use ramus_nn::{
    build_vision_model, checkpoint, ImageShape, ModelConfig, ModelOptions, VisionConfig,
};

const C: usize = 3;
const S: usize = 16; // 4x4 images
const CLASSES: usize = 3;

fn spec() -> ImageSpec {
    ImageSpec {
        channels: C,
        height: 4,
        width: 4,
        classes: CLASSES,
        noise: 0.5,
    }
}

fn images(n: usize, seed: u64) -> Vec<InputGraph> {
    images::generate(&spec(), seed, (n, 0, 0)).unwrap().train
}

/// Pull an image, batch-normalise it with running statistics, push it; a
/// linear classifier on top. The norm's input is the image itself, so the
/// reference statistics come straight from the data.
fn tiny_bn_model() -> Model {
    let mut m = ModelBuilder::new("tiny_bn", 1);
    let gamma = m.param("bn.gamma", &[C], Init::Uniform { bound: 1.0 });
    let beta = m.param("bn.beta", &[C], Init::Uniform { bound: 1.0 });
    let w = m.param("W_out", &[CLASSES, C * S], Init::LinearDefault);
    let b = m.param("b_out", &[CLASSES], Init::LinearDefault);
    let mean = m.buffer("bn.running_mean", &[C], Init::Zeros);
    let var = m.buffer("bn.running_var", &[C], Init::Constant { value: 1.0 });
    let geom = NormGeom {
        channels: C,
        spatial: S,
        eps: BN_EPS,
    };
    m.vertex_fn("image", |f| {
        let x = f.pull(C * S);
        let (g, bt) = (f.param(gamma), f.param(beta));
        let stats = (f.param(mean), f.param(var));
        let y = f.batch_norm_tracked(x, g, bt, stats, geom);
        f.push(y);
    })
    .unwrap();
    m.head(ramus_core::HeadRows::Labelled, C * S, |h| {
        let x = h.input();
        let (w, b) = (h.param(w), h.param(b));
        let logits = h.linear(x, w, Some(b));
        let labels = h.labels();
        let per_row = h.softmax_xent(logits, labels);
        let loss = h.mean_rows(per_row);
        h.loss(loss);
        h.logits(logits);
    })
    .unwrap();
    m.build().unwrap()
}

/// Per-channel batch mean and unbiased variance of the images, by hand.
fn batch_moments(graphs: &[InputGraph]) -> Vec<(f64, f64)> {
    (0..C)
        .map(|ch| {
            let xs: Vec<f64> = graphs
                .iter()
                .flat_map(|g| {
                    g.features(0)[ch * S..(ch + 1) * S]
                        .iter()
                        .map(|&v| f64::from(v))
                })
                .collect();
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
            (mean, var)
        })
        .collect()
}

fn batch<'a>(model: &Model, graphs: &'a [InputGraph]) -> Batch<'a> {
    Batch::new(model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap()
}

#[test]
fn training_steps_update_running_statistics_like_the_reference() {
    let model = tiny_bn_model();
    assert!(model.is_buffer(model.param_id("bn.running_var").unwrap()));
    assert!(!model.is_buffer(model.param_id("bn.gamma").unwrap()));
    let params: Params<f64> = Params::init(&model, 3);
    let (pm, pv) = (
        model.param_id("bn.running_mean").unwrap(),
        model.param_id("bn.running_var").unwrap(),
    );
    assert_eq!(params.values[pm].data(), &[0.0; C]);
    assert_eq!(params.values[pv].data(), &[1.0; C]);
    let batches = [images(6, 1), images(4, 2), images(9, 3)];
    // weight decay would shrink the buffers if the optimizer touched them
    let mut config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
    config.weight_decay = 0.5;
    let mut trainer = CpuTrainer::new(model.clone(), params, config);
    let (mut mean, mut var) = (vec![0.0; C], vec![1.0; C]);
    for step in 0..5 {
        let graphs = &batches[step % batches.len()];
        let gamma_before = trainer.host().params.values[0].data().to_vec();
        trainer.train_step(&batch(&model, graphs)).unwrap();
        let params = &trainer.host().params;
        assert_ne!(params.values[0].data(), &gamma_before[..], "gamma trains");
        for (ch, (bm, bv)) in batch_moments(graphs).into_iter().enumerate() {
            mean[ch] = 0.9 * mean[ch] + 0.1 * bm;
            var[ch] = 0.9 * var[ch] + 0.1 * bv;
        }
        for ch in 0..C {
            let (got_m, got_v) = (params.values[pm].data()[ch], params.values[pv].data()[ch]);
            assert!(
                (got_m - mean[ch]).abs() < 1e-12 && (got_v - var[ch]).abs() < 1e-12,
                "step {step} channel {ch}: running ({got_m}, {got_v}) vs reference ({}, {})",
                mean[ch],
                var[ch]
            );
        }
    }
    let HostState {
        mut params, grads, ..
    } = trainer.host().clone();
    let engine = trainer.engine_mut();
    assert!(grads.is_buffer(pm) && grads.is_buffer(pv));
    assert!(
        grads.values[pm].data().iter().all(|&g| g == 0.0),
        "no gradient"
    );

    // a bare forward pass (no training step) leaves the buffers alone, and
    // evaluation passes never change them
    let before = (params.values[pm].clone(), params.values[pv].clone());
    let probe = images(5, 9);
    engine
        .forward(&model, &params, &batch(&model, &probe), Mode::Evaluate)
        .unwrap();
    assert!(!engine.apply_running_stats(&mut params).unwrap());
    assert_eq!(
        (params.values[pm].clone(), params.values[pv].clone()),
        before
    );

    // evaluation normalises with the running statistics: logits by hand
    let out = engine
        .forward(&model, &params, &batch(&model, &probe), Mode::Evaluate)
        .unwrap();
    let (gamma, beta) = (params.values[0].data(), params.values[1].data());
    let (w, b) = (params.values[2].data(), params.values[3].data());
    for (row, &v) in out.head_vertices.iter().enumerate() {
        let x = probe[v as usize].features(0);
        let y: Vec<f64> = (0..C * S)
            .map(|i| {
                let ch = i / S;
                let scale = gamma[ch] / (var[ch] + BN_EPS).sqrt();
                (f64::from(x[i]) - mean[ch]) * scale + beta[ch]
            })
            .collect();
        for k in 0..CLASSES {
            let want = b[k] + (0..C * S).map(|i| w[k * C * S + i] * y[i]).sum::<f64>();
            let got = out.logits[row * CLASSES + k];
            assert!(
                (got - want).abs() < 1e-9,
                "row {row} class {k}: {got} vs {want}"
            );
        }
    }
    // ... so it differs from the training-mode output (batch statistics)
    let train_out = engine
        .forward(&model, &params, &batch(&model, &probe), Mode::Train)
        .unwrap();
    let diff = train_out
        .logits
        .iter()
        .zip(&out.logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff > 1e-3, "train and eval outputs differ by only {diff}");
    // the inference pass agrees with evaluation
    let infer = engine
        .forward(&model, &params, &batch(&model, &probe), Mode::Infer)
        .unwrap();
    assert_eq!(infer.logits, out.logits);
}

#[test]
fn vision_models_keep_running_statistics_and_checkpoint_them() {
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 2,
        classes: 3,
    };
    let vision = VisionConfig {
        image: ImageShape {
            channels: 3,
            height: 8,
            width: 8,
        },
        vgg_depth: 11,
        resnet_blocks: vec![1, 1],
    };
    let model = build_vision_model("resnet", &cfg, &vision, &ModelOptions::default()).unwrap();
    // buffers follow every trained parameter, two per norm layer
    let norms = model
        .params
        .iter()
        .filter(|p| p.name.ends_with(".gamma"))
        .count();
    let buffers: Vec<&ramus_core::ParamSpec> = model
        .params
        .iter()
        .filter(|p| p.kind == ParamKind::Buffer)
        .collect();
    assert_eq!(buffers.len(), 2 * norms);
    let first_buffer = model.params.len() - buffers.len();
    assert_eq!(model.params[first_buffer - 1].name, "b_out");
    assert_eq!(model.params[first_buffer].name, "stem.bn.running_mean");
    assert!(model.listing().contains("buffer stem.bn.running_var [2]"));

    let spec8 = ImageSpec {
        height: 8,
        width: 8,
        ..spec()
    };
    let train = images::generate(&spec8, 4, (24, 0, 0)).unwrap().train;
    let initial: Params<f32> = Params::init(&model, 1);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    let mut trainer = CpuTrainer::new(model.clone(), initial.clone(), config);
    for chunk in train.chunks(8) {
        let b = Batch::new(&model, chunk.iter().collect(), BatchingPolicy::Cavs).unwrap();
        trainer.train_step(&b).unwrap();
    }
    let params = trainer.state().unwrap().params;
    for p in first_buffer..model.params.len() {
        assert_ne!(
            params.values[p], initial.values[p],
            "{} was not updated",
            model.params[p].name
        );
    }
    // evaluation of an image does not depend on the rest of its batch
    let eval = |graphs: Vec<&InputGraph>| -> Vec<f32> {
        let b = Batch::new(&model, graphs, BatchingPolicy::Cavs).unwrap();
        let out = CpuEngine::<f32>::new()
            .forward(&model, &params, &b, Mode::Evaluate)
            .unwrap();
        let row = out.head_vertices.iter().position(|&v| v == 0).unwrap();
        out.logits[row * 3..row * 3 + 3].to_vec()
    };
    let alone = eval(vec![&train[0]]);
    let with_others = eval(vec![&train[0], &train[5], &train[9]]);
    for (a, b) in alone.iter().zip(&with_others) {
        assert!((a - b).abs() < 1e-5, "{alone:?} vs {with_others:?}");
    }

    // checkpoint round trip keeps the buffers
    let dir = std::env::temp_dir().join(format!("ramus-bn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("resnet.safetensors");
    let vocab = Vocab::default();
    checkpoint::save(&path, &model, &params, &vocab).unwrap();
    let (_, bytes) = checkpoint::read_info(&path).unwrap();
    let (back, defaulted) = checkpoint::load_params_reporting(&path, &bytes, &model).unwrap();
    assert!(defaulted.is_empty());
    assert_eq!(back, params);

    // a checkpoint from before running statistics (no buffers) still loads,
    // with the initial values, and names what it lacked
    let trained_only: Vec<(String, &ramus_core::Tensor<f32>)> = model.params[..first_buffer]
        .iter()
        .zip(&params.values)
        .map(|(spec, t)| (spec.name.clone(), t))
        .collect();
    let old_bytes = safetensors_of(&trained_only);
    let (loaded, defaulted) = checkpoint::load_params_reporting(&path, &old_bytes, &model).unwrap();
    assert_eq!(defaulted.len(), buffers.len());
    assert_eq!(defaulted[0], "stem.bn.running_mean");
    for p in 0..model.params.len() {
        let want = if p < first_buffer {
            &params.values[p]
        } else {
            &initial.values[p]
        };
        assert_eq!(&loaded.values[p], want, "{}", model.params[p].name);
    }
    // a missing trained parameter is still an error naming it
    let damaged = safetensors_of(&trained_only[1..]);
    let err = checkpoint::load_params(&path, &damaged, &model)
        .unwrap_err()
        .to_string();
    assert!(err.contains("stem.W"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A safetensors file holding `named` tensors (an old or damaged checkpoint).
fn safetensors_of(named: &[(String, &ramus_core::Tensor<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = named
        .iter()
        .map(|(_, t)| t.data().iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = named
        .iter()
        .zip(&bytes)
        .map(|((name, t), b)| {
            let dtype = safetensors::tensor::Dtype::F32;
            let view = safetensors::tensor::TensorView::new(dtype, t.shape().to_vec(), b).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}
