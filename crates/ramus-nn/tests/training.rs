//! End-to-end training on the built-in synthetic treebank: every model's
//! loss falls, and the binary Tree-LSTM reaches a stated accuracy.

use ramus_core::Params;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::{ptb, synthetic, text, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, ModelConfig, Trainer};

fn treebank(train: usize, dev: usize) -> (Vec<InputGraph>, Vec<InputGraph>, Vocab) {
    let tb = synthetic::generate(7, (train, dev, 1));
    let mut vocab = Vocab::new();
    let tr = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab)).unwrap();
    let dv = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab)).unwrap();
    (tr, dv, vocab)
}

fn trainer(
    name: &str,
    vocab: usize,
    hidden: usize,
    classes: usize,
    opt: OptimizerKind,
    lr: f64,
) -> Trainer<f32> {
    let model = build_model(
        name,
        &ModelConfig {
            vocab,
            hidden,
            classes,
        },
    )
    .unwrap();
    let params = Params::init(&model, 1);
    Trainer::new(model, params, OptimizerConfig::new(opt, lr))
}

#[test]
fn binary_treelstm_learns_negation_scope() {
    let (train, dev, vocab) = treebank(1200, 300);
    let mut t = trainer(
        "treelstm-nary",
        vocab.len(),
        32,
        5,
        OptimizerKind::Adagrad,
        0.05,
    );
    let before = t.evaluate(&dev, 64).unwrap();
    let mut rng = ramus_nn::train::rng(1);
    for _ in 0..4 {
        t.train_epoch(&train, 25, &mut rng, |_, _, _| {}).unwrap();
    }
    let after = t.evaluate(&dev, 64).unwrap();
    println!("dev before {before:?}\ndev after {after:?}");
    assert!(
        after.loss < 0.5 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    // a bag-of-words baseline gets 47 % root accuracy on this data
    assert!(
        after.root_accuracy >= 0.85,
        "root accuracy {}",
        after.root_accuracy
    );
    assert!(
        after.node_accuracy >= 0.90,
        "all-node accuracy {}",
        after.node_accuracy
    );
}

#[test]
fn reference_treelstm_treefc_treegru_mvrnn_and_dagrnn_losses_fall() {
    let (train, _, vocab) = treebank(300, 1);
    for (name, opt, lr) in [
        ("treelstm", OptimizerKind::Adam, 0.01),
        ("treefc", OptimizerKind::Sgd, 0.3),
        ("treegru", OptimizerKind::Adam, 0.01),
        ("mvrnn", OptimizerKind::Adam, 0.01),
        ("dagrnn", OptimizerKind::Adam, 0.01),
    ] {
        let mut t = trainer(name, vocab.len(), 24, 5, opt, lr);
        let before = t.evaluate(&train, 64).unwrap();
        let mut rng = ramus_nn::train::rng(2);
        for _ in 0..5 {
            t.train_epoch(&train, 20, &mut rng, |_, _, _| {}).unwrap();
        }
        let after = t.evaluate(&train, 64).unwrap();
        println!("{name}: {before:?} -> {after:?}");
        assert!(
            after.loss < 0.8 * before.loss,
            "{name}: loss {} -> {}",
            before.loss,
            after.loss
        );
        assert!(
            after.root_accuracy > before.root_accuracy + 0.1,
            "{name}: accuracy did not rise"
        );
    }
}

#[test]
fn lstm_language_model_loss_falls() {
    // sentences count upwards through 20 words from a random start, so the
    // next word is predictable from the current one (after the first)
    let words: Vec<String> = (0..20).map(|i| format!("w{i}")).collect();
    let sentences: Vec<String> = (0..150)
        .map(|s: usize| {
            let (start, len) = ((s * 7) % 20, 4 + s % 6);
            (0..len)
                .map(|i| words[(start + i) % 20].as_str())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let mut lm_vocab = Vocab::new();
    let data =
        text::parse_sentences(&sentences.join("\n"), "lm", VocabMode::Grow(&mut lm_vocab)).unwrap();
    let mut t = trainer("lstm-lm", lm_vocab.len(), 32, 0, OptimizerKind::Adam, 0.02);
    let before = t.evaluate(&data, 64).unwrap();
    let mut rng = ramus_nn::train::rng(3);
    for _ in 0..8 {
        t.train_epoch(&data, 10, &mut rng, |_, _, _| {}).unwrap();
    }
    let after = t.evaluate(&data, 64).unwrap();
    println!("lstm-lm: {before:?} -> {after:?}");
    assert!(
        after.loss < 0.5 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.node_accuracy > 0.6,
        "next-word accuracy {}",
        after.node_accuracy
    );
}

/// An engine that takes batches three at a time and returns each window's
/// losses only with the next window (as the persistent engine does): the
/// CPU engine underneath, steps run in order.
struct WindowedCpu {
    inner: ramus_cpu::CpuTrainer<f32>,
    held: Vec<ramus_exec::StepOutcome>,
    /// The rates of the next steps, one each (as the persistent engine
    /// takes them).
    lrs: std::collections::VecDeque<f64>,
}

impl TrainEngine<f32> for WindowedCpu {
    fn name(&self) -> &'static str {
        "windowed-cpu"
    }
    fn model(&self) -> &ramus_core::Model {
        self.inner.model()
    }
    fn forward_rows(
        &mut self,
        batch: &ramus_exec::Batch<'_>,
        mode: ramus_exec::Mode,
        rows: ramus_core::HeadRows,
    ) -> ramus_exec::Result<ramus_exec::ForwardOutput<f32>> {
        self.inner.forward_rows(batch, mode, rows)
    }
    fn set_seed(&mut self, seed: u64) {
        self.inner.set_seed(seed);
    }
    fn state(&mut self) -> ramus_exec::Result<ramus_exec::TrainState<f32>> {
        self.inner.state()
    }
    fn restore(&mut self, state: ramus_exec::TrainState<f32>) -> ramus_exec::Result<()> {
        self.inner.restore(state)
    }
    fn lookahead(&self) -> usize {
        3
    }
    fn set_lr(&mut self, lr: f64) -> ramus_exec::Result<()> {
        self.lrs.clear();
        self.inner.set_lr(lr)
    }
    fn set_step_lrs(&mut self, lrs: &[f64]) -> ramus_exec::Result<()> {
        self.lrs = lrs.iter().copied().collect();
        Ok(())
    }
    fn set_lr_scales(&mut self, scales: &[f64]) -> ramus_exec::Result<()> {
        self.inner.set_lr_scales(scales)
    }
    fn submit(
        &mut self,
        batches: &[ramus_exec::Batch<'_>],
    ) -> ramus_exec::Result<Vec<ramus_exec::StepOutcome>> {
        assert!(batches.len() <= 3, "a window of {} batches", batches.len());
        let mut now = Vec::new();
        for batch in batches {
            if let Some(lr) = self.lrs.pop_front() {
                self.inner.set_lr(lr)?;
            }
            now.extend(self.inner.submit(std::slice::from_ref(batch))?);
        }
        Ok(std::mem::replace(&mut self.held, now))
    }
    fn finish(&mut self) -> ramus_exec::Result<Vec<ramus_exec::StepOutcome>> {
        Ok(std::mem::take(&mut self.held))
    }
}

/// An engine taking windows of batches, its losses a window late, trains
/// exactly as one taking a batch at a time: the same epoch loss, the same
/// progress reports and the same parameters.
#[test]
fn windowed_engines_train_as_one_batch_at_a_time() {
    let (train, _, vocab) = treebank(50, 1);
    let mut plain = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.1);
    let mut built = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.1);
    let start = built.state().unwrap();
    let inner =
        ramus_cpu::CpuTrainer::new(built.model().clone(), start.params, start.optimizer.config);
    let mut windowed = Trainer::with_engine(Box::new(WindowedCpu {
        inner,
        held: Vec::new(),
        lrs: Default::default(),
    }));
    for epoch in 0..2 {
        let (mut r1, mut r2) = (ramus_nn::train::rng(epoch), ramus_nn::train::rng(epoch));
        let (mut p1, mut p2) = (Vec::new(), Vec::new());
        // 50 graphs in batches of 4: 13 batches, five windows
        let a = plain
            .train_epoch(&train, 4, &mut r1, |b, g, l| p1.push((b, g, l)))
            .unwrap();
        let b = windowed
            .train_epoch(&train, 4, &mut r2, |b, g, l| p2.push((b, g, l)))
            .unwrap();
        assert_eq!(p1.len(), 13);
        assert_eq!(p1, p2, "epoch {epoch}: progress reports");
        assert_eq!(a, b, "epoch {epoch}: mean loss");
    }
    let (p1, p2) = (plain.state().unwrap(), windowed.state().unwrap());
    assert_eq!(p1.params.values, p2.params.values);
}

/// `state()` reads back what `restore()` takes: a trainer restored from
/// another's state trains on exactly as it does (parameters, optimizer
/// moments and step count, dropout stream); a state for another model or
/// another kind of update is refused, naming what differs.
#[test]
fn restored_state_trains_on_exactly_and_misfits_are_refused() {
    let (train, _, vocab) = treebank(24, 1);
    let graphs: Vec<&InputGraph> = train.iter().collect();
    let mut a = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Adam, 0.05);
    a.engine.set_seed(4);
    a.train_batch(&graphs[..8]).unwrap();
    let mut b = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Adam, 0.05);
    b.engine.restore(a.state().unwrap()).unwrap();
    for chunk in graphs[8..].chunks(8) {
        assert_eq!(a.train_batch(chunk).unwrap(), b.train_batch(chunk).unwrap());
    }
    let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
    assert_eq!(sa.params.values, sb.params.values);
    assert_eq!(sa.optimizer, sb.optimizer);
    assert_eq!(sa.optimizer.steps(), 3);
    assert_eq!(sa.dropout, sb.dropout);

    let mut wider = trainer("treelstm", vocab.len(), 16, 5, OptimizerKind::Adam, 0.05);
    let err = wider.engine.restore(sa.clone()).unwrap_err().to_string();
    assert!(
        err.contains("restored parameter `emb`") && err.contains(", 8]") && err.contains(", 16]"),
        "{err}"
    );
    let mut sgd = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.05);
    let err = sgd.engine.restore(sa).unwrap_err().to_string();
    assert!(err.contains("Adam") && err.contains("Sgd"), "{err}");
}

/// A span's per-batch rates reach every step: an engine taking windows of
/// batches (each step its own rate) trains exactly as one taking a batch
/// at a time, and both differ from a run at the constant rate.
#[test]
fn scheduled_rates_reach_each_step_of_a_window() {
    use ramus_nn::train::{shuffled_order, EpochProgress, Pauses, Span};
    let (train, _, vocab) = treebank(40, 1);
    let mut plain = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.1);
    let mut constant = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.1);
    let start = plain.state().unwrap();
    let inner =
        ramus_cpu::CpuTrainer::new(plain.model().clone(), start.params, start.optimizer.config);
    let mut windowed = Trainer::with_engine(Box::new(WindowedCpu {
        inner,
        held: Vec::new(),
        lrs: Default::default(),
    }));
    let order = shuffled_order(train.len(), &mut ramus_nn::train::rng(2));
    let rate = |i: usize| 0.3 / (i + 1) as f64;
    for (t, rates) in [
        (&mut plain, Some(&rate as &dyn Fn(usize) -> f64)),
        (&mut windowed, Some(&rate as &dyn Fn(usize) -> f64)),
        (&mut constant, None),
    ] {
        let span = Span {
            data: &train,
            order: &order,
            batch_size: 4,
            rates,
        };
        let mut at = EpochProgress::default();
        t.train_span(&span, &mut at, &Pauses::default(), |_, _, _| {})
            .unwrap();
        assert_eq!(at.batches, 10);
    }
    let (p, w, c) = (
        plain.state().unwrap(),
        windowed.state().unwrap(),
        constant.state().unwrap(),
    );
    assert_eq!(p.params.values, w.params.values);
    assert_ne!(p.params.values, c.params.values);
    // the last step's rate stays the engine's
    assert_eq!(p.optimizer.config.lr, rate(9));
}

/// A rate of 0 leaves every parameter as it was; a multiplier of 0 leaves
/// its parameter alone while the others train; multipliers survive a
/// restore; bad rates and multipliers are refused.
#[test]
fn rates_and_multipliers_rule_the_cpu_update() {
    let (train, _, vocab) = treebank(16, 1);
    let graphs: Vec<&InputGraph> = train.iter().collect();
    for kind in [
        OptimizerKind::Sgd,
        OptimizerKind::Adagrad,
        OptimizerKind::Adam,
    ] {
        let mut t = trainer("treelstm", vocab.len(), 8, 5, kind, 0.1);
        let before = t.state().unwrap().params;
        t.engine.set_lr(0.0).unwrap();
        t.train_batch(&graphs[..8]).unwrap();
        assert_eq!(t.state().unwrap().params.values, before.values, "{kind:?}");

        t.engine.set_lr(0.1).unwrap();
        let emb = t.model().param_id("emb").unwrap();
        let mut scales = vec![1.0; t.model().params.len()];
        scales[emb] = 0.0;
        t.engine.set_lr_scales(&scales).unwrap();
        let state = t.state().unwrap();
        t.engine.restore(state).unwrap();
        t.train_batch(&graphs[8..]).unwrap();
        let after = t.state().unwrap().params;
        assert_eq!(
            after.values[emb], before.values[emb],
            "{kind:?}: frozen table"
        );
        let moved = (0..before.values.len()).filter(|&p| after.values[p] != before.values[p]);
        assert!(moved.count() >= 2, "{kind:?}: the other parameters train");

        assert!(t.engine.set_lr(-1.0).is_err());
        assert!(t.engine.set_lr(f64::NAN).is_err());
        assert!(t.engine.set_lr_scales(&[1.0]).is_err());
        scales[emb] = -0.5;
        let err = t.engine.set_lr_scales(&scales).unwrap_err().to_string();
        assert!(err.contains(&format!("parameter {emb}")), "{err}");
    }
}

/// A half-rate multiplier on SGD takes exactly half the step of the
/// table's rows (the same `f32` product the device takes).
#[test]
fn a_multiplier_scales_the_tables_sgd_step() {
    let (train, _, vocab) = treebank(8, 1);
    let graphs: Vec<&InputGraph> = train.iter().collect();
    let mut full = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.5);
    let mut half = trainer("treelstm", vocab.len(), 8, 5, OptimizerKind::Sgd, 0.25);
    let emb = full.model().param_id("emb").unwrap();
    let tables = ramus_exec::optim::embedding_tables(full.model());
    assert_eq!(tables, [emb]);
    let mut scales = vec![2.0; full.model().params.len()];
    scales[emb] = 1.0;
    // full: everything at 0.5 but the table at 0.5 · 0.5; half: 0.25 · 2
    // everywhere but the table at 0.25
    full.engine
        .set_lr_scales(
            &(0..scales.len())
                .map(|p| if p == emb { 0.5 } else { 1.0 })
                .collect::<Vec<_>>(),
        )
        .unwrap();
    half.engine.set_lr_scales(&scales).unwrap();
    full.train_batch(&graphs).unwrap();
    half.train_batch(&graphs).unwrap();
    assert_eq!(
        full.state().unwrap().params.values,
        half.state().unwrap().params.values
    );
}
