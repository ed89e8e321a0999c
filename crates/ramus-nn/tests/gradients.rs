//! Whole-model gradients on random small graphs against central finite
//! differences of the loss, in f64, for every model of the zoo (the VPPS
//! sequence benchmarks on their own graph shapes: tagger graphs with and
//! without spelled words, time-delay pyramids, trees); and the agenda
//! policy against the Cavs policy.

use ramus_core::{Grads, Params};
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_graph::sequence::{pyramid, tagger_graph, WordInput};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{
    build_model, build_mvrnn, build_sequence_model, ModelConfig, ModelOptions, SequenceConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_tree(
    rng: &mut ChaCha8Rng,
    leaves: usize,
    arities: &[usize],
    cfg: &ModelConfig,
) -> InputGraph {
    ramus_graph::random::random_tree(rng, leaves, arities, cfg.vocab as u32, cfg.classes as i32)
        .unwrap()
}

fn random_chain(rng: &mut ChaCha8Rng, len: usize, cfg: &ModelConfig) -> InputGraph {
    ramus_graph::random::random_chain(rng, len, cfg.vocab as u32).unwrap()
}

fn loss_and_grads(
    model: &ramus_core::Model,
    params: &Params<f64>,
    graphs: &[InputGraph],
    policy: BatchingPolicy,
) -> (f64, Grads<f64>) {
    let mut engine = CpuEngine::<f64>::new();
    let batch = Batch::new(model, graphs.iter().collect(), policy).unwrap();
    let out = engine.forward(model, params, &batch, Mode::Train).unwrap();
    let mut grads = Grads::zeros(model);
    engine.backward(model, params, &batch, &mut grads).unwrap();
    (out.loss.unwrap(), grads)
}

fn loss_only(model: &ramus_core::Model, params: &Params<f64>, graphs: &[InputGraph]) -> f64 {
    let mut engine = CpuEngine::<f64>::new();
    let batch = Batch::new(model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
    engine
        .forward(model, params, &batch, Mode::Train)
        .unwrap()
        .loss
        .unwrap()
}

fn check_model(name: &str, graphs: &[InputGraph], cfg: &ModelConfig) {
    check_built(name, &build_model(name, cfg).unwrap(), graphs);
}

fn check_built(name: &str, model: &ramus_core::Model, graphs: &[InputGraph]) {
    let model = model.clone();
    let mut params: Params<f64> = Params::init(&model, 11);
    // non-zero biases so every term of the gradient is exercised
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for t in params.values.iter_mut() {
        for x in t.data_mut() {
            *x += rng.random_range(-0.3..0.3);
        }
    }
    let (_, grads) = loss_and_grads(&model, &params, graphs, BatchingPolicy::Cavs);
    let eps = 1e-6;
    let mut checked = 0;
    for p in 0..params.values.len() {
        for i in 0..params.values[p].len() {
            let orig = params.values[p].data()[i];
            params.values[p].data_mut()[i] = orig + eps;
            let up = loss_only(&model, &params, graphs);
            params.values[p].data_mut()[i] = orig - eps;
            let down = loss_only(&model, &params, graphs);
            params.values[p].data_mut()[i] = orig;
            let fd = (up - down) / (2.0 * eps);
            let an = grads.values[p].data()[i];
            let tol = 1e-6 * fd.abs().max(an.abs()) + 1e-8;
            assert!(
                (fd - an).abs() <= tol,
                "{name}: d loss / d {}[{i}]: autodiff {an:.10e} vs finite difference {fd:.10e}",
                model.params[p].name
            );
            checked += 1;
        }
    }
    assert!(checked > 50, "{name}: too few parameters checked");
    assert!(grads.norm() > 1e-6, "{name}: gradient vanished");
}

fn small() -> ModelConfig {
    ModelConfig {
        vocab: 7,
        hidden: 3,
        classes: 3,
    }
}

#[test]
fn reference_treelstm_gradients_match_finite_differences() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // child-sum over any arity: 1, 2 and 3 children
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 2 + 2 * i, &[1, 2, 3], &cfg))
        .collect();
    check_model("treelstm", &graphs, &cfg);
}

#[test]
fn nary_treelstm_gradients_match_finite_differences() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 2 + 2 * i, &[2], &cfg))
        .collect();
    check_model("treelstm-nary", &graphs, &cfg);
}

#[test]
fn treefc_gradients_match_finite_differences() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 2 + 3 * i, &[2], &cfg))
        .collect();
    check_model("treefc", &graphs, &cfg);
}

#[test]
fn treegru_gradients_match_finite_differences() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 2 + 2 * i, &[1, 2, 3], &cfg))
        .collect();
    check_model("treegru", &graphs, &cfg);
}

#[test]
fn mvrnn_gradients_match_finite_differences() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 1 + 2 * i, &[2], &cfg))
        .collect();
    check_model("mvrnn", &graphs, &cfg);
    // four of the seven words with a matrix: the rest train the unknown word's
    let model = build_mvrnn(&cfg, 4, &ModelOptions::default()).unwrap();
    assert_eq!(model.params[1].shape, vec![4, 9]);
    check_built("mvrnn (4 word matrices)", &model, &graphs);
}

#[test]
fn dagrnn_gradients_match_finite_differences_on_grid_dags() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (v, c) = (cfg.vocab as u32, cfg.classes as i32);
    let graphs: Vec<InputGraph> = [(1, 1), (2, 3), (3, 3)]
        .iter()
        .map(|&(r, k)| ramus_graph::random::grid_dag(&mut rng, r, k, v, c).unwrap())
        .collect();
    check_model("dagrnn", &graphs, &cfg);
}

#[test]
fn lstm_lm_gradients_match_finite_differences() {
    let cfg = ModelConfig {
        vocab: 6,
        hidden: 3,
        classes: 0,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let graphs: Vec<InputGraph> = [1, 4, 6]
        .iter()
        .map(|&n| random_chain(&mut rng, n, &cfg))
        .collect();
    check_model("lstm-lm", &graphs, &cfg);
}

#[test]
fn agenda_policy_gives_the_same_loss_and_gradients() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let graphs: Vec<InputGraph> = (0..5)
        .map(|i| random_tree(&mut rng, 1 + 3 * i, &[1, 2, 3], &cfg))
        .collect();
    for name in ["treelstm", "treefc"] {
        let graphs: Vec<InputGraph> = if name == "treefc" {
            (0..5)
                .map(|i| random_tree(&mut rng, 1 + 3 * i, &[2], &cfg))
                .collect()
        } else {
            graphs.clone()
        };
        let model = build_model(name, &cfg).unwrap();
        let params: Params<f64> = Params::init(&model, 3);
        let (l1, g1) = loss_and_grads(&model, &params, &graphs, BatchingPolicy::Cavs);
        let (l2, g2) = loss_and_grads(&model, &params, &graphs, BatchingPolicy::Agenda);
        assert!(
            (l1 - l2).abs() < 1e-12,
            "{name}: losses differ {l1} vs {l2}"
        );
        for (a, b) in g1.values.iter().zip(&g2.values) {
            assert!(a.max_abs_diff(b).unwrap() < 1e-12);
        }
    }
}

#[test]
fn batched_equals_one_graph_at_a_time() {
    // the mean loss over a batch equals the mean of per-graph losses
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let graphs: Vec<InputGraph> = (0..4)
        .map(|i| random_tree(&mut rng, 2 + i, &[2], &cfg))
        .collect();
    let model = build_model("treelstm", &cfg).unwrap();
    let params: Params<f64> = Params::init(&model, 8);
    let batched = loss_only(&model, &params, &graphs);
    let single: f64 = graphs
        .iter()
        .map(|g| loss_only(&model, &params, std::slice::from_ref(g)))
        .sum::<f64>()
        / graphs.len() as f64;
    assert!((batched - single).abs() < 1e-12, "{batched} vs {single}");
}

/// Loss with dropout masks drawn from a fixed seed, so every evaluation
/// sees the same masks.
fn seeded_loss(
    model: &ramus_core::Model,
    params: &Params<f64>,
    graphs: &[InputGraph],
    mode: Mode,
) -> f64 {
    let mut engine = CpuEngine::<f64>::new();
    engine.set_seed(77);
    let batch = Batch::new(model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
    engine
        .forward(model, params, &batch, mode)
        .unwrap()
        .loss
        .unwrap()
}

#[test]
fn dropout_gradients_match_finite_differences_with_fixed_masks() {
    let cfg = small();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 3 + i, &[2], &cfg))
        .collect();
    let opts = ramus_nn::ModelOptions { dropout: 0.4 };
    let model = ramus_nn::build_model_with("treelstm", &cfg, &opts).unwrap();
    let mut params: Params<f64> = Params::init(&model, 2);
    let mut engine = CpuEngine::<f64>::new();
    engine.set_seed(77);
    let batch = Batch::new(&model, graphs.iter().collect(), BatchingPolicy::Cavs).unwrap();
    let train_loss = engine
        .forward(&model, &params, &batch, Mode::Train)
        .unwrap()
        .loss
        .unwrap();
    let mut grads = Grads::zeros(&model);
    engine
        .backward(&model, &params, &batch, &mut grads)
        .unwrap();
    // dropout is active in training and off in evaluation, where the model
    // equals the one built without dropout
    let eval_loss = seeded_loss(&model, &params, &graphs, Mode::Evaluate);
    let plain = build_model("treelstm", &cfg).unwrap();
    assert!((eval_loss - seeded_loss(&plain, &params, &graphs, Mode::Evaluate)).abs() < 1e-12);
    assert!(
        (train_loss - eval_loss).abs() > 1e-6,
        "dropout changed nothing"
    );
    let eps = 1e-6;
    for p in 0..params.values.len() {
        for i in (0..params.values[p].len()).step_by(3) {
            let orig = params.values[p].data()[i];
            params.values[p].data_mut()[i] = orig + eps;
            let up = seeded_loss(&model, &params, &graphs, Mode::Train);
            params.values[p].data_mut()[i] = orig - eps;
            let down = seeded_loss(&model, &params, &graphs, Mode::Train);
            params.values[p].data_mut()[i] = orig;
            let (fd, an) = ((up - down) / (2.0 * eps), grads.values[p].data()[i]);
            assert!(
                (fd - an).abs() <= 1e-6 * fd.abs().max(an.abs()) + 1e-8,
                "{}[{i}]: {an} vs {fd}",
                model.params[p].name
            );
        }
    }
}

/// Tiny sizes for the sequence models (hidden even for the character LSTMs).
fn sequence_sizes() -> (ModelConfig, SequenceConfig) {
    let cfg = ModelConfig {
        vocab: 7,
        hidden: 4,
        classes: 3,
    };
    let seq = SequenceConfig {
        mlp: 3,
        char_embed: 2,
        chars: 5,
    };
    (cfg, seq)
}

/// Tagger graphs of `lengths` words; with `spell`, about every third word
/// is spelled out (1 to 3 characters).
fn random_tagger_graphs(
    rng: &mut ChaCha8Rng,
    lengths: &[usize],
    cfg: &ModelConfig,
    seq: &SequenceConfig,
    spell: bool,
) -> Vec<InputGraph> {
    lengths
        .iter()
        .map(|&n| {
            let spelled: Vec<Vec<u32>> = (0..n)
                .map(|_| {
                    let len = rng.random_range(1..4);
                    (0..len)
                        .map(|_| rng.random_range(0..seq.chars as u32))
                        .collect()
                })
                .collect();
            let words: Vec<WordInput<'_>> = spelled
                .iter()
                .enumerate()
                .map(|(i, cs)| {
                    if spell && (i % 3 == 1 || n == 1) {
                        WordInput::Chars(cs)
                    } else {
                        WordInput::Token(rng.random_range(0..cfg.vocab as u32))
                    }
                })
                .collect();
            let tags: Vec<i32> = (0..n)
                .map(|_| rng.random_range(0..cfg.classes as i32))
                .collect();
            tagger_graph(&words, &tags).unwrap()
        })
        .collect()
}

fn sequence_model(name: &str, cfg: &ModelConfig, seq: &SequenceConfig) -> ramus_core::Model {
    build_sequence_model(name, cfg, seq, &ModelOptions::default()).unwrap()
}

#[test]
fn bilstm_tagger_gradients_match_finite_differences() {
    let (cfg, seq) = sequence_sizes();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let graphs = random_tagger_graphs(&mut rng, &[1, 3, 5], &cfg, &seq, false);
    check_built(
        "bilstm-tagger",
        &sequence_model("bilstm-tagger", &cfg, &seq),
        &graphs,
    );
}

#[test]
fn bilstm_char_tagger_gradients_match_finite_differences() {
    let (cfg, seq) = sequence_sizes();
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    let graphs = random_tagger_graphs(&mut rng, &[1, 4, 5], &cfg, &seq, true);
    let model = sequence_model("bilstm-char-tagger", &cfg, &seq);
    check_built("bilstm-char-tagger", &model, &graphs);
    // the character weights are reached only through spelled words
    let params: Params<f64> = Params::init(&model, 2);
    let (_, grads) = loss_and_grads(&model, &params, &graphs, BatchingPolicy::Cavs);
    let id = model.param_id("char_fwd.W_x").unwrap();
    assert!(grads.values[id].data().iter().any(|g| g.abs() > 1e-9));
}

#[test]
fn td_rnn_and_td_lstm_gradients_match_finite_differences_on_pyramids() {
    let (cfg, seq) = sequence_sizes();
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    let graphs: Vec<InputGraph> = [1, 3, 5]
        .iter()
        .map(|&n| {
            let toks: Vec<u32> = (0..n).map(|_| rng.random_range(0..7)).collect();
            pyramid(&toks, rng.random_range(0..3)).unwrap()
        })
        .collect();
    for name in ["td-rnn", "td-lstm"] {
        check_built(name, &sequence_model(name, &cfg, &seq), &graphs);
    }
}

#[test]
fn rvnn_gradients_match_finite_differences() {
    let (cfg, seq) = sequence_sizes();
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    let graphs: Vec<InputGraph> = (0..3)
        .map(|i| random_tree(&mut rng, 1 + 3 * i, &[2], &cfg))
        .collect();
    check_built("rvnn", &sequence_model("rvnn", &cfg, &seq), &graphs);
}

#[test]
fn sequence_models_agree_across_batching_policies() {
    let (cfg, seq) = sequence_sizes();
    let mut rng = ChaCha8Rng::seed_from_u64(35);
    let graphs = random_tagger_graphs(&mut rng, &[2, 6, 3], &cfg, &seq, true);
    let model = sequence_model("bilstm-char-tagger", &cfg, &seq);
    let params: Params<f64> = Params::init(&model, 3);
    let (l1, g1) = loss_and_grads(&model, &params, &graphs, BatchingPolicy::Cavs);
    let (l2, g2) = loss_and_grads(&model, &params, &graphs, BatchingPolicy::Agenda);
    assert!((l1 - l2).abs() < 1e-12, "losses differ {l1} vs {l2}");
    for (a, b) in g1.values.iter().zip(&g2.values) {
        assert!(a.max_abs_diff(b).unwrap() < 1e-12);
    }
}
