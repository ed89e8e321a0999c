//! Leaf specialisation: evaluation with per-token tables equals evaluation
//! without them, for every model, and tables follow parameter updates.

use ramus_core::Params;
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_graph::sequence::{pyramid_of_tree, tagger_graph, WordInput};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{
    build_model_with, build_sequence_model, is_sequence_model, DataKind, ModelConfig, ModelOptions,
    SequenceConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_tree(rng: &mut ChaCha8Rng, leaves: usize, vocab: u32) -> InputGraph {
    let mut g = InputGraph::new();
    let mut frontier: Vec<u32> = (0..leaves)
        .map(|_| {
            g.push_vertex(&[], rng.random_range(0..vocab), rng.random_range(0..3))
                .unwrap()
        })
        .collect();
    while frontier.len() > 1 {
        let at = rng.random_range(0..frontier.len() - 1);
        let kids: Vec<u32> = frontier.drain(at..at + 2).collect();
        let v = g.push_vertex(&kids, 0, rng.random_range(0..3)).unwrap();
        frontier.insert(at, v);
    }
    g
}

#[test]
fn tables_change_nothing_but_speed() {
    let cfg = ModelConfig {
        vocab: 9,
        hidden: 5,
        classes: 3,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let trees: Vec<InputGraph> = (0..6).map(|i| random_tree(&mut rng, 1 + i, 9)).collect();
    let chains: Vec<InputGraph> = (0..4)
        .map(|n| {
            let toks: Vec<u32> = (0..=n).map(|_| rng.random_range(0..9)).collect();
            let labels: Vec<i32> = (0..=n).map(|_| rng.random_range(0..9)).collect();
            InputGraph::chain(&toks, &labels).unwrap()
        })
        .collect();
    // the models with tokens (the CNNs read pixels, never tokens)
    let token_models = ramus_nn::MODEL_NAMES
        .into_iter()
        .filter(|n| ramus_nn::data_kind(n) != Some(ramus_nn::DataKind::Images));
    // the sequence benchmarks' own shapes: tagger graphs (some words
    // spelled with characters 0..4) and pyramids
    let taggers: Vec<InputGraph> = (1..5)
        .map(|n| {
            let spelled: Vec<Vec<u32>> = (0..n)
                .map(|_| (0..2).map(|_| rng.random_range(0..4)).collect())
                .collect();
            let words: Vec<WordInput<'_>> = (0..n)
                .map(|i| match i % 2 {
                    0 => WordInput::Token(rng.random_range(0..9)),
                    _ => WordInput::Chars(&spelled[i]),
                })
                .collect();
            let tags: Vec<i32> = (0..n).map(|_| rng.random_range(0..3)).collect();
            tagger_graph(&words, &tags).unwrap()
        })
        .collect();
    let plain_taggers: Vec<InputGraph> = (1..5)
        .map(|n| {
            let words: Vec<WordInput<'_>> = (0..n)
                .map(|_| WordInput::Token(rng.random_range(0..9)))
                .collect();
            tagger_graph(&words, &vec![1; n]).unwrap()
        })
        .collect();
    let pyramids: Vec<InputGraph> = trees.iter().map(|t| pyramid_of_tree(t).unwrap()).collect();
    for name in token_models {
        let graphs = match ramus_nn::data_kind(name) {
            Some(DataKind::Sentences) => &chains,
            Some(DataKind::Tagged { chars: false }) => &plain_taggers,
            Some(DataKind::Tagged { chars: true }) => &taggers,
            Some(DataKind::SentencePyramid) => &pyramids,
            _ => &trees,
        };
        let opts = ModelOptions { dropout: 0.3 };
        let model = if is_sequence_model(name) {
            // 4 characters: fewer rows than the 9 tabulated words
            let seq = SequenceConfig {
                mlp: 4,
                char_embed: 3,
                chars: 4,
            };
            let cfg = ModelConfig { hidden: 6, ..cfg };
            build_sequence_model(name, &cfg, &seq, &opts).unwrap()
        } else {
            build_model_with(name, &cfg, &opts).unwrap()
        };
        let mut params: Params<f64> = Params::init(&model, 6);
        let batch = Batch::new(&model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
        let mut plain = CpuEngine::new();
        let mut tabled = CpuEngine::new();
        tabled.use_token_tables(Some(cfg.vocab));
        assert!(
            tabled.prepare_token_tables(&model, &params).unwrap(),
            "{name}: nothing tabulated"
        );
        for round in 0..2 {
            for mode in [Mode::Evaluate, Mode::Infer] {
                let a = plain.forward(&model, &params, &batch, mode).unwrap();
                let b = tabled.forward(&model, &params, &batch, mode).unwrap();
                assert_eq!(
                    a.loss.map(f64::to_bits),
                    b.loss.map(f64::to_bits),
                    "{name} {mode:?} round {round}"
                );
                let diff = a
                    .logits
                    .iter()
                    .zip(&b.logits)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max);
                assert!(diff < 1e-12, "{name} {mode:?}: logits differ by {diff}");
            }
            // change the embeddings: the tables must follow
            for x in params.values[0].data_mut() {
                *x += 0.25;
            }
            params.touch();
        }
        // tokens beyond the tables are an error, not a wrong answer
        let mut g = InputGraph::new();
        g.push_vertex(&[], 50, 0).unwrap();
        let bad = Batch::new(&model, vec![&g], BatchingPolicy::Cavs).unwrap();
        let err = tabled
            .forward(&model, &params, &bad, Mode::Infer)
            .unwrap_err()
            .to_string();
        assert!(err.contains("token id 50"), "{name}: {err}");
    }
}
