//! The CUDA batched engine against the CPU reference engine: losses, scores
//! and every parameter gradient of every model of the zoo, on random trees
//! (deep, wide, single vertices) and chains, at several batch sizes, with
//! and without dropout; training steps; steady-state memory; the kernel
//! cache across engines. Skips with a notice where no CUDA driver is found.

mod common;

use std::path::PathBuf;

use ramus_core::{Grads, HeadRows, Model, Params};
use ramus_cpu::CpuEngine;
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{build_model_with, ModelConfig, ModelOptions, Trainer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cuda_ready() -> bool {
    common::cuda_ready("skipping")
}

fn cache_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ramus-cuda-engine-{name}-{}", std::process::id()))
}

fn options(name: &str) -> CudaEngineOptions {
    CudaEngineOptions {
        cache_dir: Some(cache_dir(name)),
        ..CudaEngineOptions::default()
    }
}

const CFG: ModelConfig = ModelConfig {
    vocab: 40,
    hidden: 24,
    classes: 5,
};

/// Random graphs for `model`: chains for the language model, trees of the
/// model's arities otherwise, including a single vertex and a deep path.
fn graphs(model: &str, count: usize, seed: u64) -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (v, c) = (CFG.vocab as u32, CFG.classes as i32);
    (0..count)
        .map(|i| {
            let leaves = 1 + rng.random_range(0..12);
            let g = match model {
                "lstm-lm" => random_chain(&mut rng, 1 + (i * 7) % 23, v),
                "dagrnn" => grid_dag(&mut rng, 1 + i % 7, 1 + (i * 3) % 10, v, c),
                "treelstm" if i % 5 == 3 => random_path(&mut rng, 60, v, c),
                "treelstm" => random_tree(&mut rng, leaves, &[1, 2, 3, 6], v, c),
                _ if i % 5 == 3 => random_tree(&mut rng, 40, &[2], v, c),
                _ => random_tree(&mut rng, leaves, &[2], v, c),
            };
            g.expect("valid random graph")
        })
        .collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-4 * scale,
            "{what}[{i}]: CPU {x} vs CUDA {y} (scale {scale})"
        );
    }
}

fn model(name: &str, dropout: f64) -> Model {
    build_model_with(name, &CFG, &ModelOptions { dropout }).expect("model builds")
}

/// One training batch through both engines: loss, scores and gradients.
fn compare_batch(
    name: &str,
    model: &Model,
    params: &Params<f32>,
    gs: &[InputGraph],
    cuda: &mut CudaEngine,
) {
    let mut cpu = CpuEngine::<f32>::new();
    cpu.set_seed(9);
    cuda.set_seed(9);
    let batch = Batch::new(model, gs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    let want = cpu
        .forward(model, params, &batch, Mode::Train)
        .expect("cpu forward");
    let got = CudaEngine::forward(cuda, model, params, &batch, Mode::Train).expect("cuda forward");
    let what = format!("{name} bs{}", gs.len());
    let (l0, l1) = (want.loss.unwrap_or(f64::NAN), got.loss.unwrap_or(f64::NAN));
    assert!(
        (l0 - l1).abs() <= 1e-4 * l0.abs().max(1.0),
        "{what}: loss CPU {l0} vs CUDA {l1}"
    );
    assert_eq!(want.head_vertices, got.head_vertices, "{what}: head rows");
    close(&want.logits, &got.logits, &format!("{what} logits"));
    let (mut g0, mut g1) = (Grads::zeros(model), Grads::zeros(model));
    cpu.backward(model, params, &batch, &mut g0)
        .expect("cpu backward");
    CudaEngine::backward(cuda, model, params, &batch, &mut g1).expect("cuda backward");
    for (p, spec) in model.params.iter().enumerate() {
        close(
            g0.values[p].data(),
            g1.values[p].data(),
            &format!("{what} d{}", spec.name),
        );
    }
    assert!(g1.norm() > 0.0, "{what}: zero gradient");
    // scores of every labelled vertex, as evaluation asks for them
    let want = cpu
        .forward_rows(model, params, &batch, Mode::Infer, HeadRows::Labelled)
        .expect("cpu infer");
    let got =
        CudaEngine::forward_rows(cuda, model, params, &batch, Mode::Infer, HeadRows::Labelled)
            .expect("cuda infer");
    assert!(got.loss.is_none());
    close(
        &want.logits,
        &got.logits,
        &format!("{what} labelled scores"),
    );
}

fn check_model(name: &str, dropout: f64) {
    if !cuda_ready() {
        return;
    }
    let model = model(name, dropout);
    let mut params: Params<f32> = Params::init(&model, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for t in params.values.iter_mut() {
        for x in t.data_mut() {
            *x += rng.random_range(-0.1..0.1);
        }
    }
    params.touch();
    let mut cuda = CudaEngine::new(&model, &options(name)).expect("engine set-up");
    for (bs, seed) in [(1, 1), (7, 2), (32, 3), (128, 4)] {
        compare_batch(name, &model, &params, &graphs(name, bs, seed), &mut cuda);
    }
}

#[test]
fn reference_treelstm_matches_the_cpu_engine() {
    check_model("treelstm", 0.0);
}

#[test]
fn nary_treelstm_matches_the_cpu_engine() {
    check_model("treelstm-nary", 0.0);
}

#[test]
fn treegru_matches_the_cpu_engine() {
    check_model("treegru", 0.1);
}

#[test]
fn mvrnn_matches_the_cpu_engine() {
    // per-row matrix products, the shared-row word matrices, their dense gradient
    check_model("mvrnn", 0.1);
}

#[test]
fn dagrnn_on_grid_dags_matches_the_cpu_engine() {
    check_model("dagrnn", 0.1);
}

#[test]
fn treefc_matches_the_cpu_engine() {
    check_model("treefc", 0.0);
}

#[test]
fn lstm_language_model_matches_the_cpu_engine() {
    check_model("lstm-lm", 0.0);
}

#[test]
fn dropout_masks_match_the_cpu_engine() {
    check_model("treelstm", 0.3);
}

/// A few training steps with the fused device optimizer against the CPU
/// engine with the host optimizer: same losses, same updated parameters.
fn follows_the_cpu_trajectory(config: OptimizerConfig, name: &str) {
    if !cuda_ready() {
        return;
    }
    let model = model("treelstm", 0.0);
    let params: Params<f32> = Params::init(&model, 5);
    let data = graphs("treelstm", 48, 8);
    let mut cpu = Trainer::new(model.clone(), params.clone(), config);
    let engine = CudaEngine::new(&model, &options(name)).expect("engine");
    let engine = CudaTrainer::new(engine, model.clone(), params, config).expect("trainer");
    let mut gpu = Trainer::with_engine(Box::new(engine));
    for chunk in data.chunks(12) {
        let refs: Vec<&InputGraph> = chunk.iter().collect();
        let a = cpu.train_batch(&refs).expect("cpu step");
        let b = gpu.train_batch(&refs).expect("cuda step");
        assert!(
            (a - b).abs() <= 1e-3 * a.abs().max(1.0),
            "{name}: loss CPU {a} vs CUDA {b}"
        );
    }
    let cpu_params = cpu.state().expect("cpu state").params;
    let gpu_params = gpu
        .state()
        .expect("parameters come back from the device")
        .params;
    for (p, spec) in model.params.iter().enumerate() {
        close(
            cpu_params.values[p].data(),
            gpu_params.values[p].data(),
            &format!("{name}: updated {}", spec.name),
        );
    }
    // evaluation after device steps sees the device parameters
    let (x, y) = (
        cpu.evaluate(&data, 16).expect("cpu eval"),
        gpu.evaluate(&data, 16).expect("cuda eval"),
    );
    assert!(
        (x.loss - y.loss).abs() <= 1e-3 * x.loss.abs().max(1.0),
        "{name}: eval loss {} vs {}",
        x.loss,
        y.loss
    );
}

#[test]
fn adagrad_training_on_cuda_follows_the_cpu_trajectory() {
    follows_the_cpu_trajectory(
        OptimizerConfig::new(OptimizerKind::Adagrad, 0.05),
        "adagrad",
    );
}

#[test]
fn clipped_adamw_training_on_cuda_follows_the_cpu_trajectory() {
    let mut config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    config.weight_decay = 1e-3;
    config.clip_norm = Some(0.5);
    follows_the_cpu_trajectory(config, "adamw");
}

#[test]
fn steady_state_batches_allocate_nothing_and_the_cache_serves_a_second_engine() {
    if !cuda_ready() {
        return;
    }
    let model = model("treelstm", 0.0);
    let params: Params<f32> = Params::init(&model, 6);
    let opts = options("steady");
    let mut cuda = CudaEngine::new(&model, &opts).expect("engine");
    let first = cuda.cache_stats();
    println!(
        "set-up {:.3} s, {} fused kernels, {first}",
        cuda.setup_seconds(),
        cuda.fused_kernels()
    );
    let data = graphs("treelstm", 64, 10);
    common::assert_steady_state(&mut cuda, &model, &params, &data, 16, "graphs");
    println!("{}", cuda.pool_stats());
    let second = CudaEngine::new(&model, &opts).expect("second engine");
    let stats = second.cache_stats();
    println!("second set-up {:.3} s, {stats}", second.setup_seconds());
    assert_eq!(stats.compiled, 0, "the second engine compiled kernels");
    assert!(
        stats.disk_hits >= 2,
        "the second engine did not load from disk"
    );
    let _ = std::fs::remove_dir_all(cache_dir("steady"));
}

#[test]
fn a_batch_of_another_model_is_refused() {
    if !cuda_ready() {
        return;
    }
    let a = model("treelstm", 0.0);
    let b = model("treefc", 0.0);
    let params: Params<f32> = Params::init(&b, 1);
    let mut cuda = CudaEngine::new(&a, &options("refuse")).expect("engine");
    let gs = graphs("treefc", 2, 1);
    let batch = Batch::new(&b, gs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    let err =
        CudaEngine::forward(&mut cuda, &b, &params, &batch, Mode::Train).expect_err("refused");
    assert!(err.to_string().contains("another model"), "{err}");
}

#[test]
fn a_batch_over_the_memory_budget_names_the_tensor_and_the_budget() {
    if !cuda_ready() {
        return;
    }
    let model = model("treelstm", 0.0);
    let params: Params<f32> = Params::init(&model, 1);
    let mut opts = options("budget");
    opts.pool.max_bytes = Some(256 << 10);
    let mut cuda = CudaEngine::new(&model, &opts).expect("engine");
    let gs = graphs("treelstm", 128, 5);
    let batch = Batch::new(&model, gs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    let err = CudaEngine::forward(&mut cuda, &model, &params, &batch, Mode::Train)
        .expect_err("over the budget");
    let msg = err.to_string();
    assert!(msg.contains("device memory budget is exceeded"), "{msg}");
    // it names the tensor that did not fit (a node's buffer or an engine buffer)
    assert!(
        msg.contains("node %") || msg.contains("the vertex states"),
        "{msg}"
    );
    assert!(msg.contains("does not fit"), "{msg}");
    // a small batch fits the same budget
    let small = graphs("treelstm", 1, 6);
    let batch = Batch::new(&model, small.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    CudaEngine::forward(&mut cuda, &model, &params, &batch, Mode::Train)
        .expect("a small batch fits");
}
