//! Declaring a model of your own and training it on the CPU.
//!
//! The model is a *gated* recursive net, which the model zoo does not
//! have: a leaf is `tanh` of its word's embedding, an internal vertex
//! mixes its two children through a gate,
//!
//! ```text
//! [g; c] = W [h_left; h_right] + b      h = σ(g) · tanh(c)
//! ```
//!
//! and a classifier reads every labelled vertex (the sentiment of every
//! phrase, not only of the sentence). It is declared vertex-centrically
//! with [`ModelBuilder`]: one function for leaves, one for internal
//! vertices, and a head; `build` derives the backward pass.
//!
//! The data is Ramus's built-in synthetic sentiment treebank (labels that
//! depend on negation scope, so a bag of words cannot learn them), read
//! from its bracket-format lines as `ramus train` reads it. Training runs a
//! few epochs of Adagrad on the CPU batched engine and prints the loss and
//! the dev accuracy after each.
//!
//! Run it from the repository root (a few seconds in release):
//!
//! ```text
//! cargo run --release --example custom_model
//! ```

use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
use ramus_core::{Model, Params};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::{ptb, synthetic, InputGraph, Vocab, VocabMode};
use ramus_nn::Trainer;

/// Hidden size of the vertex state.
const HIDDEN: usize = 32;
/// Sentiment classes of the treebank (0 = very negative ... 4 = very positive).
const CLASSES: usize = 5;
const EPOCHS: usize = 5;
const BATCH: usize = 25;

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
    let (train, dev, vocab) = treebank()?;
    println!(
        "built-in treebank: {} training trees, {} dev trees, {} words",
        train.len(),
        dev.len(),
        vocab.len()
    );

    let model = gated_tree_net(vocab.len(), HIDDEN, CLASSES)?;
    let params = Params::<f32>::init(&model, 1);
    let optimizer = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);
    // `Trainer::new` trains on the CPU batched engine; `Trainer::with_engine`
    // takes any other `TrainEngine` (see the `cuda` example).
    let mut trainer = Trainer::new(model, params, optimizer);

    let before = trainer.evaluate(&dev, 100)?;
    println!(
        "before training: dev root accuracy {:.3}",
        before.root_accuracy
    );
    let mut rng = ramus_nn::train::rng(1);
    for epoch in 1..=EPOCHS {
        let started = Instant::now();
        let loss = trainer.train_epoch(&train, BATCH, &mut rng, |_, _, _| {})?;
        let dev_result = trainer.evaluate(&dev, 100)?;
        println!(
            "epoch {epoch}: train loss {loss:.4}, dev loss {:.4}, dev root accuracy {:.3}, \
             all-node accuracy {:.3} ({:.2} s)",
            dev_result.loss,
            dev_result.root_accuracy,
            dev_result.node_accuracy,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The training and dev trees, and the vocabulary they were read with.
type Splits = (Vec<InputGraph>, Vec<InputGraph>, Vocab);

/// The built-in synthetic treebank's training and dev splits, parsed with
/// one vocabulary: the training words (dev words it lacks read as `<unk>`).
fn treebank() -> Result<Splits, Box<dyn Error>> {
    let tb = synthetic::default_treebank();
    let mut vocab = Vocab::new();
    let train = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab))?;
    let dev = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab))?;
    Ok((train, dev, vocab))
}

/// The gated recursive net of the module docs, for `vocab` words, a
/// `hidden`-wide state and `classes` classes.
fn gated_tree_net(vocab: usize, hidden: usize, classes: usize) -> ramus_core::Result<Model> {
    let h = hidden;
    // The vertex state (what `scatter` writes and a parent's `gather` reads) is `h` wide.
    let mut m = ModelBuilder::new("gated-treenet", h);
    let emb = m.param("emb", &[vocab, h], Init::Normal { std: 0.1 });
    let w = m.param("W", &[2 * h, 2 * h], Init::Xavier);
    let b = m.param("b", &[2 * h], Init::Zeros);
    let w_out = m.param("W_out", &[classes, h], Init::Xavier);
    let b_out = m.param("b_out", &[classes], Init::Zeros);

    let leaf = m.vertex_fn("leaf", |f| {
        let x = f.embed(emb); // the vertex's token, looked up in `emb`
        let h = f.tanh(x);
        f.scatter(h); // the state the parent gathers
        f.push(h); // the value the head reads
    })?;
    let internal = m.vertex_fn("internal", |f| {
        let (l, r) = (f.gather(0), f.gather(1)); // the children's states
        let lr = f.concat(&[l, r]);
        let (w, b) = (f.param(w), f.param(b));
        let z = f.linear(lr, w, Some(b));
        let gc = f.split(z, 2);
        let gate = f.sigmoid(gc[0]);
        let cand = f.tanh(gc[1]);
        let h = f.mul(gate, cand);
        f.scatter(h);
        f.push(h);
    })?;
    // Leaves run `leaf`, vertices with children `internal`.
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    // A softmax classifier over every labelled vertex, mean loss.
    m.head(HeadRows::Labelled, h, |hd| {
        let x = hd.input();
        let (w, b) = (hd.param(w_out), hd.param(b_out));
        let logits = hd.linear(x, w, Some(b));
        let labels = hd.labels();
        let loss = hd.softmax_xent(logits, labels);
        let loss = hd.mean_rows(loss);
        hd.loss(loss);
        hd.logits(logits);
    })?;
    // Recorded in checkpoints (`ramus_nn::checkpoint::save`).
    m.setting("hidden", hidden);
    m.setting("classes", classes);
    m.build()
}
