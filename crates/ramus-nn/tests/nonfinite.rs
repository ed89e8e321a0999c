//! Numerical faults on the CPU engine: a batch whose loss or a gradient is
//! not finite is never applied; by default it stops training with an error
//! naming the batch, its first graph and the first non-finite parameter;
//! `skip-batch` leaves parameters and optimizer state bit for bit as they
//! were and trains on. Hyper-parameters no one can mean are refused.

use rand::seq::SliceRandom;

use ramus_core::Params;
use ramus_exec::nonfinite::first_nonfinite;
use ramus_exec::{ExecError, OnNonFinite, OptimizerConfig, OptimizerKind, Setting, TensorPart};
use ramus_graph::testing::{images_with_nan_pixel, SMALL_IMAGES};
use ramus_graph::{ptb, synthetic, InputGraph, VocabMode};
use ramus_nn::{
    build_model, build_vision_model, ImageShape, ModelConfig, ModelOptions, Trainer, VisionConfig,
};

const BATCH: usize = 10;

/// The synthetic treebank's training split (graphs know their `train:LINE`).
fn treebank(n: usize) -> (Vec<InputGraph>, usize) {
    let tb = synthetic::generate(7, (n, 1, 1));
    let mut vocab = ramus_graph::Vocab::new();
    let train =
        ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab)).unwrap();
    (train, vocab.len())
}

/// A leaf word that some graphs have and most do not.
fn rare_word(data: &[InputGraph]) -> u32 {
    let mut counts = std::collections::BTreeMap::new();
    for g in data {
        let mut words: Vec<u32> = g.tokens.iter().copied().filter(|&t| t > 1).collect();
        words.dedup();
        words.sort_unstable();
        words.dedup();
        for w in words {
            *counts.entry(w).or_insert(0usize) += 1;
        }
    }
    let (&word, _) = counts
        .iter()
        .find(|(_, &c)| c >= 3 && c * 10 <= data.len())
        .expect("a rare word");
    word
}

/// A binary Tree-LSTM whose embedding of `poisoned` is NaN: every batch
/// with that word has a NaN loss and NaN gradients, the others are clean.
fn poisoned_trainer(vocab: usize, poisoned: u32, config: OptimizerConfig) -> Trainer<f32> {
    let cfg = ModelConfig {
        vocab,
        hidden: 8,
        classes: 5,
    };
    let model = build_model("treelstm-nary", &cfg).unwrap();
    let mut params = Params::<f32>::init(&model, 1);
    let emb = model.param_id("emb").unwrap();
    params.values[emb].data_mut()[poisoned as usize * 8] = f32::NAN;
    Trainer::new(model, params, config)
}

/// The epoch's batches as the trainer draws them with `seed`.
fn batches(data: &[InputGraph], seed: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..data.len()).collect();
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

#[test]
fn a_nonfinite_batch_stops_training_naming_batch_graph_and_parameter() {
    let (data, vocab) = treebank(300);
    let word = rare_word(&data);
    let config = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);
    let mut t = poisoned_trainer(vocab, word, config);
    let has_word = |b: &[usize]| b.iter().any(|&i| data[i].tokens.contains(&word));
    let all = batches(&data, 3);
    let bad = all.iter().position(|b| has_word(b)).unwrap();
    let err = t
        .train_epoch(&data, BATCH, &mut ramus_nn::train::rng(3), |_, _, _| {})
        .expect_err("a NaN embedding must stop training");
    let fault = err.nonfinite().expect("a non-finite fault").clone();
    let place = fault.place.clone().expect("the batch's place");
    assert_eq!(place.batch, bad + 1, "{err}");
    assert_eq!(place.batches, all.len());
    let first = all[bad][0];
    assert_eq!(place.first_graph, data[first].describe(first));
    assert!(place.first_graph.starts_with("train:"), "{err}");
    assert!(fault.step.loss.is_nan());
    // the NaN embedding is the cause: its value is named, not a gradient
    let param = fault.step.param.clone().expect("a parameter");
    assert_eq!(
        (param.name.as_str(), param.part),
        ("emb", TensorPart::Value)
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!("batch {} of {}", bad + 1, all.len()))
            && text.contains(&place.first_graph)
            && text.contains("`emb` (value)"),
        "{text}"
    );
    // the bad batch was not applied: only the poisoned row is not finite
    let emb = t.model().param_id("emb").unwrap();
    let mut params = t.state().unwrap().params;
    params.values[emb].data_mut()[word as usize * 8] = 0.0;
    assert_eq!(first_nonfinite(t.model(), &params, None), None);
}

/// A small ResNet (batch norm with running statistics: buffers) for
/// [`SMALL_IMAGES`].
fn small_resnet() -> ramus_core::Model {
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

/// A small ResNet (batch norm with running statistics: buffers) on 8×8
/// images; the images at `poisoned` have a NaN pixel, so every batch with
/// one has a NaN loss while the parameters stay finite.
fn poisoned_images(poisoned: &[usize]) -> (Vec<InputGraph>, ramus_core::Model) {
    let data = images_with_nan_pixel(120, poisoned);
    let model = small_resnet();
    assert!((0..model.params.len()).any(|p| model.is_buffer(p)));
    (data, model)
}

#[test]
fn skip_batch_leaves_parameters_and_optimizer_state_bit_for_bit_and_trains_on() {
    let poisoned = [7, 61, 62, 100];
    let (data, model) = poisoned_images(&poisoned);
    let all = batches(&data, 5);
    let is_bad = |b: &[usize]| b.iter().any(|i| poisoned.contains(i));
    let skipped = all.iter().filter(|b| is_bad(b)).count();
    assert!(skipped > 1 && skipped < all.len());
    for clip in [None, Some(1.0)] {
        let config = OptimizerConfig {
            clip_norm: clip,
            ..OptimizerConfig::new(OptimizerKind::Adam, 0.01)
        };
        let fresh = || Trainer::new(model.clone(), Params::init(&model, 1), config);
        // one step on a clean batch, then a bad one: nothing moves, the
        // running statistics (buffers) included
        let mut t = fresh();
        let clean = all.iter().find(|b| !is_bad(b)).unwrap();
        let bad = all.iter().find(|b| is_bad(b)).unwrap();
        let graphs = |b: &[usize]| b.iter().map(|&i| &data[i]).collect::<Vec<_>>();
        t.train_batch(&graphs(clean)).unwrap();
        let before = t.state().unwrap();
        let err = t.train_batch(&graphs(bad)).unwrap_err();
        assert!(matches!(err, ExecError::NonFinite(_)), "{err}");
        let after = t.state().unwrap();
        assert_eq!(
            bits(&after.params),
            bits(&before.params),
            "clip {clip:?}: parameters moved"
        );
        assert_eq!(
            after.optimizer, before.optimizer,
            "clip {clip:?}: optimizer state moved"
        );
        assert_eq!(after.optimizer.steps(), 1);

        // a whole epoch: the bad batches are skipped, the rest train, and
        // the parameters are those of training on the clean batches alone
        let mut t = fresh();
        t.on_nonfinite = OnNonFinite::SkipBatch;
        let at = t
            .train_epoch_progress(&data, BATCH, &mut ramus_nn::train::rng(5), |_, _, _| {})
            .unwrap();
        let loss = at.mean_loss();
        assert_eq!(at.skipped, skipped, "clip {clip:?}");
        assert!(loss.is_finite(), "clip {clip:?}: loss {loss}");
        let trained = t.state().unwrap();
        assert_eq!(trained.optimizer.steps(), (all.len() - skipped) as u64);
        let mut reference = fresh();
        for b in all.iter().filter(|b| !is_bad(b)) {
            reference.train_batch(&graphs(b)).unwrap();
        }
        let reference = reference.state().unwrap();
        assert_eq!(
            bits(&trained.params),
            bits(&reference.params),
            "clip {clip:?}"
        );
        assert_eq!(trained.optimizer, reference.optimizer, "clip {clip:?}");
    }
}

/// Once a parameter's value is not finite, skipping cannot help: the run
/// stops all the same, saying so.
#[test]
fn skip_batch_stops_once_the_parameters_themselves_are_not_finite() {
    let (data, vocab) = treebank(100);
    let model = build_model(
        "treelstm-nary",
        &ModelConfig {
            vocab,
            hidden: 8,
            classes: 5,
        },
    )
    .unwrap();
    let mut params = Params::<f32>::init(&model, 1);
    let w = model.param_id("W_out").unwrap();
    params.values[w].data_mut()[0] = f32::INFINITY;
    let mut t = Trainer::new(model, params, OptimizerConfig::new(OptimizerKind::Sgd, 0.1));
    t.on_nonfinite = OnNonFinite::SkipBatch;
    let err = t
        .train_epoch(&data, BATCH, &mut ramus_nn::train::rng(1), |_, _, _| {})
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("batch 1 of") && text.contains("cannot undo"),
        "{text}"
    );
}

#[test]
fn hyper_parameters_no_one_can_mean_are_refused_naming_the_setting() {
    let ok = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    assert!(ok.validate().is_ok());
    let zero_lr = OptimizerConfig { lr: 0.0, ..ok };
    assert!(
        zero_lr.validate().is_ok(),
        "a learning rate of 0 can be meant"
    );
    let cases = [
        (
            OptimizerConfig { lr: -0.1, ..ok },
            Setting::LearningRate,
            "--lr",
        ),
        (
            OptimizerConfig { lr: f64::NAN, ..ok },
            Setting::LearningRate,
            "--lr",
        ),
        (
            OptimizerConfig {
                lr: f64::INFINITY,
                ..ok
            },
            Setting::LearningRate,
            "--lr",
        ),
        (
            OptimizerConfig {
                weight_decay: -1e-4,
                ..ok
            },
            Setting::WeightDecay,
            "--weight-decay",
        ),
        (
            OptimizerConfig {
                weight_decay: f64::NAN,
                ..ok
            },
            Setting::WeightDecay,
            "--weight-decay",
        ),
        (
            OptimizerConfig {
                clip_norm: Some(0.0),
                ..ok
            },
            Setting::Clip,
            "--clip",
        ),
        (
            OptimizerConfig {
                clip_norm: Some(-1.0),
                ..ok
            },
            Setting::Clip,
            "--clip",
        ),
        (
            OptimizerConfig {
                clip_norm: Some(f64::INFINITY),
                ..ok
            },
            Setting::Clip,
            "--clip",
        ),
        (
            OptimizerConfig { beta1: 1.0, ..ok },
            Setting::Beta1,
            "beta1",
        ),
        (
            OptimizerConfig {
                beta2: f64::NAN,
                ..ok
            },
            Setting::Beta2,
            "beta2",
        ),
        (
            OptimizerConfig {
                eps: f64::NAN,
                ..ok
            },
            Setting::Eps,
            "eps",
        ),
    ];
    for (config, setting, named) in cases {
        match config.validate() {
            Err(e @ ExecError::InvalidSetting { setting: s, .. }) => {
                assert_eq!(s, setting, "{config:?}");
                assert!(e.to_string().contains(named), "{e}");
            }
            other => panic!("{config:?}: {other:?}"),
        }
    }
    for dropout in [-0.1, 1.0, 1.5, f64::NAN] {
        let e = ModelOptions { dropout }.validate().unwrap_err();
        assert!(e.to_string().contains("--dropout"), "{e}");
    }
    assert!(ModelOptions { dropout: 0.5 }.validate().is_ok());
}

/// What the check costs per batch on the CPU engine: the CLI's default
/// run (binary Tree-LSTM, hidden 64, batches of 25, Adagrad) on the
/// built-in treebank. Every batch runs twice, its forward and backward pass
/// followed by the optimizer step with the check (`step_if_finite` and the
/// loss test, as a training engine's step does) and without (`step`), in
/// alternating order, so a busy machine slows both alike; and the check
/// alone. Run with
/// `cargo test --release -p ramus-nn --test nonfinite -- --ignored --nocapture`.
#[test]
#[ignore]
fn nonfinite_check_cost_per_batch() {
    use ramus_cpu::CpuEngine;
    use ramus_exec::nonfinite::gradients_finite;
    use ramus_exec::Optimizer;
    use ramus_exec::{Batch, Mode};
    use ramus_graph::BatchingPolicy;
    use std::time::Instant;

    let (data, vocab) = treebank(3000);
    let cfg = ModelConfig {
        vocab,
        hidden: 64,
        classes: 5,
    };
    let model = build_model("treelstm-nary", &cfg).unwrap();
    let config = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);
    let mut params = Params::<f32>::init(&model, 1);
    let mut optimizer = Optimizer::new(config, &params);
    let mut grads = ramus_core::Grads::zeros(&model);
    let mut engine = CpuEngine::<f32>::new();
    let batches: Vec<Batch> = data
        .chunks(25)
        .map(|c| Batch::new(&model, c.iter().collect(), BatchingPolicy::Cavs).unwrap())
        .collect();
    // seconds with and without the check, and of the check alone
    let mut time = [0.0f64; 2];
    let mut check = Vec::new();
    let epochs = 4;
    for epoch in 0..epochs {
        for (i, b) in batches.iter().enumerate() {
            for k in 0..2 {
                let checked = (i + k) % 2 == 0;
                let started = Instant::now();
                let out = engine.forward(&model, &params, b, Mode::Train).unwrap();
                grads.clear();
                engine.backward(&model, &params, b, &mut grads).unwrap();
                if checked {
                    let loss = out.loss.unwrap();
                    assert!(loss.is_finite() && optimizer.step_if_finite(&mut params, &grads));
                } else {
                    optimizer.step(&mut params, &grads);
                }
                // the first epoch warms up
                if epoch > 0 {
                    time[usize::from(checked)] += started.elapsed().as_secs_f64();
                }
            }
            let t = Instant::now();
            assert!(gradients_finite(&grads));
            check.push(t.elapsed().as_secs_f64());
        }
    }
    check.sort_by(f64::total_cmp);
    let runs = ((epochs - 1) * batches.len()) as f64;
    println!(
        "{} batches of 25 x {} epochs: {:.3} ms a batch with the check, {:.3} ms without \
         ({:+.2} %); the check alone: median {:.2} us a batch",
        batches.len(),
        epochs - 1,
        1e3 * time[1] / runs,
        1e3 * time[0] / runs,
        100.0 * (time[1] / time[0] - 1.0),
        1e6 * check[check.len() / 2]
    );
}
