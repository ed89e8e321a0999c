//! A run paused inside an epoch, saved as a resumable checkpoint and
//! loaded into a fresh trainer ends bit-identical to the run never paused
//! (parameters, optimizer moments and steps, dropout stream, epoch loss).

use ramus_core::Params;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainState};
use ramus_graph::{ptb, synthetic, InputGraph, Vocab, VocabMode};
use ramus_nn::resume::{self, Best, RunState};
use ramus_nn::train::{shuffled_order, EpochProgress, Pauses, Span, SpanEnd};
use ramus_nn::{build_model_with, ModelConfig, ModelOptions, Trainer};

fn treebank() -> (Vec<InputGraph>, Vocab) {
    let tb = synthetic::generate(7, (60, 1, 1));
    let mut vocab = Vocab::new();
    let tr = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab)).unwrap();
    (tr, vocab)
}

fn trainer(vocab: usize) -> Trainer<f32> {
    let cfg = ModelConfig {
        vocab,
        hidden: 6,
        classes: 5,
    };
    let model = build_model_with("treelstm-nary", &cfg, &ModelOptions { dropout: 0.3 }).unwrap();
    let params = Params::init(&model, 2);
    let mut t = Trainer::new(
        model,
        params,
        OptimizerConfig::new(OptimizerKind::Adam, 0.01),
    );
    t.engine.set_seed(5);
    t
}

#[test]
fn a_run_paused_saved_and_loaded_continues_bit_for_bit() {
    let (data, vocab) = treebank();
    // uninterrupted: two epochs of 60 graphs in batches of 4 (15 batches)
    let mut whole = trainer(vocab.len());
    let mut rng = ramus_nn::train::rng(3);
    whole.train_epoch(&data, 4, &mut rng, |_, _, _| {}).unwrap();
    let whole_loss = whole.train_epoch(&data, 4, &mut rng, |_, _, _| {}).unwrap();
    // paused after 6 batches of epoch 2
    let mut first = trainer(vocab.len());
    let mut shuffle = ramus_nn::train::rng(3);
    first
        .train_epoch(&data, 4, &mut shuffle, |_, _, _| {})
        .unwrap();
    let epoch2 = shuffle.clone();
    let order = shuffled_order(data.len(), &mut shuffle);
    let span = Span {
        data: &data,
        order: &order,
        batch_size: 4,
        rates: None,
    };
    let mut at = EpochProgress::default();
    let pauses = Pauses {
        every: Some(6),
        ..Pauses::default()
    };
    assert_eq!(
        first
            .train_span(&span, &mut at, &pauses, |_, _, _| {})
            .unwrap(),
        SpanEnd::Checkpoint
    );
    assert_eq!(at.batches, 6);
    let saved = first.state().unwrap();
    let state = RunState {
        epochs_done: 1,
        progress: at,
        shuffle: epoch2,
        dropout: saved.dropout.clone(),
        best: Some(Best {
            score: 0.1 + 0.2,
            epoch: 1,
        }),
        plateau: ramus_nn::schedule::Plateau {
            best: Some(0.1 + 0.2),
            stale_epochs: 2,
            decays: 3,
        },
        config: [("hidden".to_string(), Some(vec!["6".to_string()]))].into(),
        data: resume::fingerprint(&[&data], &vocab),
        ranks: 3,
    };
    let dir = std::env::temp_dir().join(format!("ramus-nn-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("last.safetensors");
    let best = saved.params.clone();
    resume::save(
        &path,
        first.model(),
        &saved.params,
        &vocab,
        (&state, &saved.optimizer, Some(&best)),
    )
    .unwrap();
    // loaded into a fresh trainer
    let bytes = std::fs::read(&path).unwrap();
    let (back, steps) = resume::read_state(&path, &bytes).unwrap();
    assert_eq!(back, state, "the run state round-trips exactly");
    assert_eq!(steps, 15 + 6);
    let model = first.model().clone();
    let r = resume::load(&path, &bytes, &model, saved.optimizer.config, &back, steps).unwrap();
    assert_eq!(r.best.as_ref(), Some(&best));
    let mut second = trainer(vocab.len());
    second
        .engine
        .restore(TrainState {
            params: r.params,
            optimizer: r.optimizer,
            dropout: back.dropout.clone(),
        })
        .unwrap();
    let mut at = back.progress;
    assert_eq!(
        second
            .train_span(&span, &mut at, &Pauses::default(), |_, _, _| {})
            .unwrap(),
        SpanEnd::EpochDone
    );
    assert_eq!(at.mean_loss(), whole_loss, "the epoch's loss");
    let (second, whole) = (second.state().unwrap(), whole.state().unwrap());
    assert_eq!(second.params.values, whole.params.values);
    assert_eq!(
        second.optimizer.second_moments(),
        whole.optimizer.second_moments()
    );
    // the resume tensors are named apart from the model's
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra = st
        .names()
        .into_iter()
        .filter(|n| resume::is_resume_tensor(n))
        .count();
    assert_eq!(
        extra,
        3 * model.params.len(),
        "first, second moments and best of each"
    );
    std::fs::remove_dir_all(&dir).ok();
}
