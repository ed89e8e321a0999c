//! Every CPU inference engine through the one inference trait
//! (`ramus_exec::InferEngine`): the compiled engine (with and without
//! per-token tables) and the measuring chooser `AutoInfer` give the CPU
//! batched reference's root scores, built and run the same way a library
//! user would. (The CUDA engines' twin of this test is in
//! `ramus-cuda/tests/compiled.rs`.)

use ramus_conformance::close::{assert_scores_close, Tolerance};
use ramus_conformance::engines::reference_infer;
use ramus_core::Params;
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_exec::{AutoInfer, BatchShape, InferEngine, Offer, Scores};
use ramus_graph::random::random_tree;
use ramus_graph::InputGraph;
use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const CFG: ModelConfig = ModelConfig {
    vocab: 13,
    hidden: 8,
    classes: 4,
};

/// How close the engines' scores come to the reference's (the compiled level loop's own dot products).
const SCORES: Tolerance = Tolerance::element(1e-4);

fn assert_close(name: &str, want: &Scores<f32>, got: &Scores<f32>) {
    assert_scores_close(name, want, got, SCORES);
}

#[test]
fn every_cpu_inference_engine_gives_the_batched_reference_scores() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for name in ["treelstm", "treegru", "treefc"] {
        let model = build_model_with(name, &CFG, &ModelOptions { dropout: 0.0 }).expect("model");
        let params: Params<f32> = Params::init(&model, 5);
        let graphs: Vec<InputGraph> = [1, 2, 7, 19]
            .iter()
            .map(|&leaves| random_tree(&mut rng, leaves, &[2], CFG.vocab as u32, 4).expect("tree"))
            .collect();
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let mut reference = reference_infer(&model, &params);
        assert_eq!(reference.name(), "cpu-batched");
        let want = reference.infer(&refs).expect("reference");
        assert_eq!(
            want.rows().count(),
            graphs.len(),
            "{name}: one row per tree"
        );

        let engines: Vec<Box<dyn InferEngine<f32> + '_>> = vec![
            Box::new(CpuCompiledEngine::new(&model, &params, true).expect("compiles")),
            Box::new(CpuCompiledEngine::new(&model, &params, false).expect("compiles")),
        ];
        for mut engine in engines {
            assert_eq!(engine.name(), "cpu-compiled");
            for round in 0..2 {
                let got = engine.infer(&refs).expect("infers");
                assert_close(&format!("{name} round {round}"), &want, &got);
            }
        }

        let mut notices = Vec::new();
        let offers: Vec<Offer<'_, f32>> = vec![
            (
                "cpu-compiled",
                CpuCompiledEngine::new(&model, &params, true)
                    .map(|e| Box::new(e) as Box<dyn InferEngine<f32>>)
                    .map_err(|e| e.to_string()),
            ),
            (
                "cpu-batched",
                Ok(Box::new(reference_infer(&model, &params))),
            ),
        ];
        let mut auto =
            AutoInfer::new(offers, |l: &str| notices.push(l.to_string())).expect("two candidates");
        for round in 0..2 {
            let got = auto.infer(&refs).expect("auto infers");
            assert_close(&format!("{name} auto round {round}"), &want, &got);
        }
        let chosen = auto.chosen(BatchShape::of(&refs)).expect("a choice");
        assert!(["cpu-compiled", "cpu-batched"].contains(&chosen));
        drop(auto);
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(
            notices[0].contains("cpu-compiled") && notices[0].contains("cpu-batched"),
            "{notices:?}"
        );
        assert!(notices[0].ends_with(&format!(": {chosen}")), "{notices:?}");
    }
}
