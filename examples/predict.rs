//! Loading a checkpoint and predicting.
//!
//! Without an argument, the program first trains a zoo model (the binary
//! Tree-LSTM `treelstm-nary`, a few epochs on the built-in synthetic
//! treebank, about a second in release) and saves it with
//! [`checkpoint::save`]; with one, it uses that checkpoint instead (a tree
//! model saved by `ramus train --save FILE` or by this program). Either
//! way it then does what a serving program does:
//!
//! 1. reads the checkpoint's metadata ([`checkpoint::read_info`]): the
//!    model's name, its settings (vocabulary, hidden size, classes) and the
//!    vocabulary;
//! 2. rebuilds the model from them and loads its parameters
//!    ([`checkpoint::load_params`], which checks every name, shape and
//!    value);
//! 3. parses a few sentences in PTB-bracket form with the checkpoint's
//!    vocabulary (unknown words read as `<unk>`) and scores them with the
//!    CPU compiled inference engine, printing each tree's class and
//!    probabilities under the line (whose labels the engine does not read).
//!
//! Run it from the repository root:
//!
//! ```text
//! cargo run --release --example predict                  # trains and saves one first
//! cargo run --release --example predict -- model.safetensors
//! ```

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ramus_core::model::HeadRows;
use ramus_core::{Model, Params};
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_exec::{InferEngine, OptimizerConfig, OptimizerKind};
use ramus_graph::{ptb, synthetic, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, checkpoint, data_kind, DataKind, ModelConfig, Trainer};

/// Sentences to score, one tree a line, labelled by the treebank's rules
/// (`ramus_graph::synthetic`: negators flip their scope, intensifiers
/// double it).
const SENTENCES: &str = "\
(3 (2 a) (3 (2 film) (3 good)))
(1 (2 not) (3 good))
(0 (2 very) (1 bad))
(0 (2 very) (1 (2 not) (3 good)))
(2 (3 (2 not) (1 bad)) (1 (2 but) (1 boring)))";

/// The zoo model `train_and_save` trains (a loss at every labelled node).
const MODEL: &str = "treelstm-nary";

/// The sentiment classes of the built-in treebank.
const CLASS_NAMES: [&str; 5] = [
    "very negative",
    "negative",
    "neutral",
    "positive",
    "very positive",
];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let path = match std::env::args_os().nth(1) {
        Some(given) => PathBuf::from(given),
        None => train_and_save()?,
    };

    // 1-2: the model and its parameters, from the checkpoint alone.
    let (model, params, vocab) = load(&path)?;
    println!(
        "loaded `{}` from {} ({} words)",
        model.name,
        path.display(),
        vocab.len()
    );

    // 3: parse with the checkpoint's vocabulary, frozen, and score the roots.
    let trees = ptb::parse_trees(SENTENCES, "<sentences>", VocabMode::Frozen(&vocab))?;
    // The compiled engine lowers the model's cells and tabulates the leaf
    // cell over the vocabulary (`true`). `ramus_exec::BatchedInfer` over a
    // `ramus_cpu::CpuTrainer` runs the training engine's forward pass instead.
    // As an `InferEngine` (the trait every inference engine implements),
    // it scores each tree's root.
    let mut engine: Box<dyn InferEngine<f32>> =
        Box::new(CpuCompiledEngine::new(&model, &params, true)?);
    let refs: Vec<&InputGraph> = trees.iter().collect();
    let scores = engine.infer(&refs)?;
    for ((line, row), class) in SENTENCES
        .lines()
        .zip(scores.rows())
        .zip(scores.predictions())
    {
        let probs = softmax(row);
        let name = CLASS_NAMES.get(class).copied().unwrap_or("?");
        let shown: Vec<String> = probs.iter().map(|p| format!("{p:.2}")).collect();
        println!(
            "{line}\n  -> predicted {class} ({name}), p = [{}]",
            shown.join(", ")
        );
    }
    Ok(())
}

/// Trains `treelstm-nary` briefly on the built-in treebank and saves it in
/// the temporary directory; returns the checkpoint's path.
fn train_and_save() -> Result<PathBuf, Box<dyn Error>> {
    let tb = synthetic::default_treebank();
    let mut vocab = Vocab::new();
    let train = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab))?;
    let cfg = ModelConfig {
        vocab: vocab.len(),
        hidden: 32,
        classes: CLASS_NAMES.len(),
    };
    // `build_model` records the name and `cfg` in the model's settings,
    // which the checkpoint keeps so that `load` can rebuild it.
    let model = build_model(MODEL, &cfg)?;
    let params = Params::<f32>::init(&model, 1);
    let optimizer = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);
    let mut trainer = Trainer::new(model, params, optimizer);
    let mut rng = ramus_nn::train::rng(1);
    for epoch in 1..=3 {
        let loss = trainer.train_epoch(&train, 25, &mut rng, |_, _, _| {})?;
        println!("training {MODEL}: epoch {epoch}, loss {loss:.4}");
    }
    // The engine owns the trained parameters: read them back to save them.
    let state = trainer.state()?;
    let path = std::env::temp_dir().join(format!("ramus-example-{MODEL}.safetensors"));
    checkpoint::save(&path, trainer.model(), &state.params, &vocab)?;
    println!("saved {}", path.display());
    Ok(path)
}

/// The model a checkpoint's metadata describes, its parameters and its
/// vocabulary (as `ramus eval` and `ramus infer` load one).
fn load(path: &Path) -> Result<(Model, Params<f32>, Vocab), Box<dyn Error>> {
    let (info, bytes) = checkpoint::read_info(path)?;
    if data_kind(&info.model) != Some(DataKind::Trees) {
        return Err(format!("{}: `{}` is not a tree model", path.display(), info.model).into());
    }
    let setting = |key: &str| -> Result<usize, String> {
        let value = info.settings.get(key);
        value.and_then(|v| v.parse().ok()).ok_or_else(|| {
            format!(
                "{}: setting `{key}` missing or not a number",
                path.display()
            )
        })
    };
    let cfg = ModelConfig {
        vocab: setting("vocab")?,
        hidden: setting("hidden")?,
        classes: setting("classes")?,
    };
    if cfg.vocab != info.vocab.len() {
        let words = info.vocab.len();
        return Err(format!(
            "{}: {words} words, model built for {}",
            path.display(),
            cfg.vocab
        )
        .into());
    }
    let mut model = build_model(&info.model, &cfg)?;
    // `ramus train --loss-at all` records where the loss was taken.
    if info.settings.get("loss_at").map(String::as_str) == Some("all") {
        model.head.rows = HeadRows::Labelled;
    }
    let params = checkpoint::load_params(path, &bytes, &model)?;
    Ok((model, params, info.vocab))
}

/// Probabilities from a row of scores (a numerically stable softmax).
fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}
