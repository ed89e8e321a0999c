//! The CUDA inference engines through the one inference trait
//! (`ramus_exec::InferEngine`): the compiled engine, the batched engine
//! (through `BatchedInfer`) and `AutoInfer` over both give the CPU batched
//! reference's root scores, as on the CPU (`ramus-nn/tests/infer_engines.rs`).
//! Skips with a notice where no CUDA driver is found.

mod common;

use ramus_conformance::close::{assert_scores_close, Tolerance};
use ramus_conformance::engines::reference_infer;
use ramus_core::Params;
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_exec::{
    AutoInfer, BatchShape, BatchedInfer, InferEngine, Offer, OptimizerConfig, Scores,
};
use ramus_graph::random::random_tree;
use ramus_graph::InputGraph;
use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const CFG: ModelConfig = ModelConfig {
    vocab: 13,
    hidden: 16,
    classes: 4,
};

/// How close the engines' scores come to the reference's (reordered f32 sums on the device).
const SCORES: Tolerance = Tolerance::element(1e-3);

fn assert_close(name: &str, want: &Scores<f32>, got: &Scores<f32>) {
    assert_scores_close(name, want, got, SCORES);
}

#[test]
fn cuda_inference_engines_give_the_cpu_reference_scores() {
    if !common::cuda_ready("skipping cuda_inference_engines_give_the_cpu_reference_scores") {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for name in ["treelstm", "treegru", "treefc"] {
        let model = build_model_with(name, &CFG, &ModelOptions { dropout: 0.0 }).expect("model");
        let params: Params<f32> = Params::init(&model, 5);
        let graphs: Vec<InputGraph> = [1, 2, 7, 19, 60]
            .iter()
            .map(|&leaves| random_tree(&mut rng, leaves, &[2], CFG.vocab as u32, 4).expect("tree"))
            .collect();
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let mut reference = reference_infer(&model, &params);
        let want = reference.infer(&refs).expect("reference");

        let compiled = || {
            CompiledEngine::new(&model, &params, &CompiledOptions::default())
                .map(|e| Box::new(e) as Box<dyn InferEngine<f32>>)
                .map_err(|e| e.to_string())
        };
        let batched = || -> Result<Box<dyn InferEngine<f32> + '_>, String> {
            let engine = CudaEngine::new(&model, &CudaEngineOptions::default())
                .map_err(|e| e.to_string())?;
            Ok(Box::new(BatchedInfer::new(Box::new(
                CudaTrainer::new(
                    engine,
                    model.clone(),
                    params.clone(),
                    OptimizerConfig::forward_only(),
                )
                .map_err(|e| e.to_string())?,
            ))))
        };
        let engines = [
            compiled().expect("cuda-compiled"),
            batched().expect("cuda-batched"),
        ];
        for (mut engine, expected) in engines.into_iter().zip(["cuda-compiled", "cuda-batched"]) {
            assert_eq!(engine.name(), expected);
            for round in 0..2 {
                let got = engine.infer(&refs).expect("infers");
                assert_close(&format!("{name} {expected} round {round}"), &want, &got);
            }
        }

        let mut notices = Vec::new();
        let offers: Vec<Offer<'_, f32>> =
            vec![("cuda-compiled", compiled()), ("cuda-batched", batched())];
        let mut auto =
            AutoInfer::new(offers, |l: &str| notices.push(l.to_string())).expect("candidates");
        for round in 0..2 {
            let got = auto.infer(&refs).expect("auto infers");
            assert_close(&format!("{name} auto round {round}"), &want, &got);
        }
        let chosen = auto.chosen(BatchShape::of(&refs)).expect("a choice");
        drop(auto);
        assert!(notices[0].ends_with(&format!(": {chosen}")), "{notices:?}");
        eprintln!("{name}: {}", notices[0]);
    }
}
