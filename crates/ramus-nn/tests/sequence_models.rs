//! The VPPS sequence benchmarks (`bilstm-tagger`, `bilstm-char-tagger`,
//! `td-rnn`, `td-lstm`, `rvnn`): the batched engine's scores against a
//! plain-loop reference of each model, how they are declared (selectors,
//! settings, bad sizes), and end-to-end training on synthetic data that
//! only the intended structure can fit — the backward LSTM, the character
//! LSTMs — plus WikiNER when `../shared/data` is present.

mod common;

use ramus_core::model::FunctionSelector;
use ramus_core::{Model, Params};
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::sequence::{pyramid, tagger_graph, tagger_kinds, WordInput};
use ramus_graph::tagged::{parse_tagged, read_tagged, split_tagged, TaggedVocab, RARE_BELOW};
use ramus_graph::{ptb, synthetic, BatchingPolicy, InputGraph, Vocab, VocabMode};
use ramus_nn::{
    build_model, build_sequence_model, EvalResult, ModelConfig, ModelOptions, SequenceConfig,
    Trainer,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Parameter `name` of `model` as a slice.
fn param<'a>(model: &Model, params: &'a Params<f64>, name: &str) -> &'a [f64] {
    params.values[model.param_id(name).unwrap()].data()
}

/// `W x (+ b)` for a row-major `W` of `x.len()` columns.
fn affine(w: &[f64], x: &[f64], b: Option<&[f64]>) -> Vec<f64> {
    let out = w.len() / x.len();
    (0..out)
        .map(|o| {
            let dot: f64 = w[o * x.len()..(o + 1) * x.len()]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum();
            dot + b.map_or(0.0, |b| b[o])
        })
        .collect()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// One LSTM step of direction `prefix` (gates `i, f, o, u`).
fn lstm(
    model: &Model,
    p: &Params<f64>,
    prefix: &str,
    x: &[f64],
    hc: &(Vec<f64>, Vec<f64>),
) -> (Vec<f64>, Vec<f64>) {
    let hd = hc.0.len();
    let zx = affine(
        param(model, p, &format!("{prefix}.W_x")),
        x,
        Some(param(model, p, &format!("{prefix}.b"))),
    );
    let zh = affine(param(model, p, &format!("{prefix}.W_h")), &hc.0, None);
    let z: Vec<f64> = zx.iter().zip(&zh).map(|(a, b)| a + b).collect();
    let c: Vec<f64> = (0..hd)
        .map(|j| sigmoid(z[hd + j]) * hc.1[j] + sigmoid(z[j]) * z[3 * hd + j].tanh())
        .collect();
    let h = (0..hd)
        .map(|j| sigmoid(z[2 * hd + j]) * c[j].tanh())
        .collect();
    (h, c)
}

/// Runs an LSTM of `hd` units over `xs`; the final `h`.
fn run_lstm(
    model: &Model,
    p: &Params<f64>,
    prefix: &str,
    xs: &[Vec<f64>],
    hd: usize,
) -> Vec<Vec<f64>> {
    let mut state = (vec![0.0; hd], vec![0.0; hd]);
    xs.iter()
        .map(|x| {
            state = lstm(model, p, prefix, x, &state);
            state.0.clone()
        })
        .collect()
}

fn embedding(table: &[f64], width: usize, id: u32) -> Vec<f64> {
    table[id as usize * width..(id as usize + 1) * width].to_vec()
}

/// `W_out tanh(W_mlp x + b_mlp) + b_out`.
fn mlp(model: &Model, p: &Params<f64>, x: &[f64]) -> Vec<f64> {
    let hidden: Vec<f64> = affine(param(model, p, "W_mlp"), x, Some(param(model, p, "b_mlp")))
        .into_iter()
        .map(f64::tanh)
        .collect();
    affine(
        param(model, p, "W_out"),
        &hidden,
        Some(param(model, p, "b_out")),
    )
}

/// Tag scores of one sentence by plain loops (the BiLSTM taggers).
fn reference_tagger(
    model: &Model,
    p: &Params<f64>,
    words: &[WordInput<'_>],
    hd: usize,
    char_embed: usize,
) -> Vec<Vec<f64>> {
    let xs: Vec<Vec<f64>> = words
        .iter()
        .map(|w| match w {
            WordInput::Token(t) => embedding(param(model, p, "emb"), hd, *t),
            WordInput::Chars(cs) => {
                let ce: Vec<Vec<f64>> = cs
                    .iter()
                    .map(|&c| embedding(param(model, p, "char_emb"), char_embed, c))
                    .collect();
                let rev: Vec<Vec<f64>> = ce.iter().rev().cloned().collect();
                let mut x = run_lstm(model, p, "char_fwd", &ce, hd / 2).pop().unwrap();
                x.extend(run_lstm(model, p, "char_bwd", &rev, hd / 2).pop().unwrap());
                x
            }
        })
        .collect();
    let fwd = run_lstm(model, p, "fwd", &xs, hd);
    let rev: Vec<Vec<f64>> = xs.iter().rev().cloned().collect();
    let mut bwd = run_lstm(model, p, "bwd", &rev, hd);
    bwd.reverse();
    fwd.iter()
        .zip(&bwd)
        .map(|(f, b)| mlp(model, p, &[f.as_slice(), b.as_slice()].concat()))
        .collect()
}

/// The engine's scores for vertices `vertices` of a one-graph batch.
fn engine_scores(
    model: &Model,
    p: &Params<f64>,
    g: &InputGraph,
    vertices: &[usize],
) -> Vec<Vec<f64>> {
    let batch = Batch::new(model, vec![g], BatchingPolicy::Cavs).unwrap();
    let out = CpuEngine::<f64>::new()
        .forward(model, p, &batch, Mode::Infer)
        .unwrap();
    vertices
        .iter()
        .map(|&v| {
            let number = batch.schedule.number[v];
            let row = out.head_vertices.iter().position(|&h| h == number).unwrap();
            out.logits[row * out.classes..(row + 1) * out.classes].to_vec()
        })
        .collect()
}

fn assert_close(name: &str, want: &[Vec<f64>], got: &[Vec<f64>]) {
    assert_eq!(want.len(), got.len(), "{name}: rows");
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        for (a, b) in w.iter().zip(g) {
            assert!(
                (a - b).abs() < 1e-12,
                "{name} row {i}: reference {w:?} vs engine {g:?}"
            );
        }
    }
}

fn sizes() -> (ModelConfig, SequenceConfig) {
    (
        ModelConfig {
            vocab: 11,
            hidden: 6,
            classes: 4,
        },
        SequenceConfig {
            mlp: 5,
            char_embed: 3,
            chars: 7,
        },
    )
}

fn build(name: &str, cfg: &ModelConfig, seq: &SequenceConfig) -> Model {
    build_sequence_model(name, cfg, seq, &ModelOptions::default()).unwrap()
}

#[test]
fn taggers_compute_what_a_plain_bilstm_computes() {
    let (cfg, seq) = sizes();
    let chars_a = [1u32, 2, 3];
    let chars_b = [6u32];
    let sentences: Vec<Vec<WordInput<'_>>> = vec![
        vec![WordInput::Token(3)],
        vec![
            WordInput::Token(4),
            WordInput::Token(9),
            WordInput::Token(1),
            WordInput::Token(4),
        ],
        vec![
            WordInput::Chars(&chars_a),
            WordInput::Token(2),
            WordInput::Chars(&chars_b),
        ],
    ];
    for name in ["bilstm-tagger", "bilstm-char-tagger"] {
        let model = build(name, &cfg, &seq);
        let p: Params<f64> = Params::init(&model, 4);
        for words in &sentences {
            let spelled = words.iter().any(|w| matches!(w, WordInput::Chars(_)));
            if spelled && name == "bilstm-tagger" {
                continue;
            }
            let n = words.len();
            let g = tagger_graph(words, &vec![0; n]).unwrap();
            let outputs: Vec<usize> = (g.len() - n..g.len()).collect();
            let want = reference_tagger(&model, &p, words, cfg.hidden, seq.char_embed);
            assert_close(name, &want, &engine_scores(&model, &p, &g, &outputs));
        }
    }
}

#[test]
fn td_rnn_and_rvnn_compute_their_compositions() {
    let (cfg, seq) = sizes();
    let hd = cfg.hidden;
    // td-rnn on a pyramid of 4 words: layer by layer
    let model = build("td-rnn", &cfg, &seq);
    let p: Params<f64> = Params::init(&model, 5);
    let toks = [2u32, 7, 7, 1];
    let mut layer: Vec<Vec<f64>> = toks
        .iter()
        .map(|&t| embedding(param(&model, &p, "emb"), hd, t))
        .collect();
    while layer.len() > 1 {
        layer = layer
            .windows(2)
            .map(|ab| {
                let l = affine(
                    param(&model, &p, "W_l"),
                    &ab[0],
                    Some(param(&model, &p, "b")),
                );
                let r = affine(param(&model, &p, "W_r"), &ab[1], None);
                l.iter().zip(&r).map(|(x, y)| (x + y).tanh()).collect()
            })
            .collect();
    }
    let g = pyramid(&toks, 1).unwrap();
    let want = vec![mlp(&model, &p, &layer[0])];
    assert_close(
        "td-rnn",
        &want,
        &engine_scores(&model, &p, &g, &[g.len() - 1]),
    );
    // rvnn on ((a b) c): untied leaf transform, then the composition
    let model = build("rvnn", &cfg, &seq);
    let p: Params<f64> = Params::init(&model, 6);
    let leaf = |t: u32| -> Vec<f64> {
        let x = embedding(param(&model, &p, "emb"), hd, t);
        affine(
            param(&model, &p, "W_leaf"),
            &x,
            Some(param(&model, &p, "b_leaf")),
        )
        .into_iter()
        .map(f64::tanh)
        .collect()
    };
    let compose = |l: &[f64], r: &[f64]| -> Vec<f64> {
        affine(
            param(&model, &p, "W"),
            &[l, r].concat(),
            Some(param(&model, &p, "b")),
        )
        .into_iter()
        .map(f64::tanh)
        .collect()
    };
    let root = compose(&compose(&leaf(3), &leaf(5)), &leaf(8));
    let want = vec![affine(
        param(&model, &p, "W_out"),
        &root,
        Some(param(&model, &p, "b_out")),
    )];
    let mut t = InputGraph::new();
    let a = t.push_vertex(&[], 3, 0).unwrap();
    let b = t.push_vertex(&[], 5, 0).unwrap();
    let ab = t.push_vertex(&[a, b], 0, 0).unwrap();
    let c = t.push_vertex(&[], 8, 0).unwrap();
    t.push_vertex(&[ab, c], 0, 2).unwrap();
    assert_close("rvnn", &want, &engine_scores(&model, &p, &t, &[4]));
}

#[test]
fn taggers_select_functions_by_kind_and_record_their_sizes() {
    let (cfg, seq) = sizes();
    let plain = build("bilstm-tagger", &cfg, &seq);
    let FunctionSelector::ByKind(table) = &plain.selector else {
        panic!("bilstm-tagger selects by kind");
    };
    assert_eq!(table.len(), usize::from(tagger_kinds::OUTPUT) + 1);
    let names: Vec<&str> = table
        .iter()
        .map(|&f| plain.functions[f].name.as_str())
        .collect();
    assert_eq!(names, ["forward", "backward", "output"]);
    let chars = build("bilstm-char-tagger", &cfg, &seq);
    let FunctionSelector::ByKind(table) = &chars.selector else {
        panic!("bilstm-char-tagger selects by kind");
    };
    assert_eq!(table.len(), tagger_kinds::COUNT);
    assert_eq!(
        chars.functions[table[usize::from(tagger_kinds::CHAR_BACKWARD)]].name,
        "char_backward"
    );
    assert_eq!(chars.settings["chars"], "7");
    assert_eq!(chars.settings["mlp"], "5");
    assert_eq!(SequenceConfig::from_settings(&chars.settings).unwrap(), seq);
    // a spelled word cannot run in the plain tagger: the error names the vertex
    let g = tagger_graph(&[WordInput::Chars(&[1])], &[0]).unwrap();
    let err = Batch::new(&plain, vec![&g], BatchingPolicy::Cavs)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("vertex 0 has kind 3"), "{err}");
}

#[test]
fn bad_sizes_are_refused_by_name() {
    let (cfg, seq) = sizes();
    let opts = ModelOptions::default();
    let odd = ModelConfig { hidden: 5, ..cfg };
    let e = build_sequence_model("bilstm-char-tagger", &odd, &seq, &opts).unwrap_err();
    assert!(e.to_string().contains("even"), "{e}");
    let no_chars = SequenceConfig { chars: 0, ..seq };
    let e = build_sequence_model("bilstm-char-tagger", &cfg, &no_chars, &opts).unwrap_err();
    assert!(e.to_string().contains("character vocabulary"), "{e}");
    // build_model has no character vocabulary to give
    assert!(build_model("bilstm-char-tagger", &cfg).is_err());
    let no_mlp = SequenceConfig { mlp: 0, ..seq };
    assert!(build_sequence_model("td-rnn", &cfg, &no_mlp, &opts).is_err());
    let e = build_sequence_model("lstm-lm", &cfg, &seq, &opts).unwrap_err();
    assert!(e.to_string().contains("lstm-lm"), "{e}");
    let e = ramus_graph::sequence::pyramid(&[], 0).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}

// ---------------------------------------------------------------- training

fn trainer(model: Model, opt: OptimizerKind, lr: f64) -> Trainer<f32> {
    let params = Params::init(&model, 1);
    Trainer::new(model, params, OptimizerConfig::new(opt, lr))
}

fn train_epochs(t: &mut Trainer<f32>, data: &[InputGraph], epochs: usize, batch: usize) {
    let mut rng = ramus_nn::train::rng(1);
    for _ in 0..epochs {
        t.train_epoch(data, batch, &mut rng, |_, _, _| {}).unwrap();
    }
}

/// Tagged sentences whose tags need both directions: a word before the
/// marker `mark` is tagged `LATE`, the marker `MARK`, and any other word
/// by its class (`w3` → `C0`, `w4` → `C1`, ...). Rare words (`spell`
/// only) are unique strings tagged `UP` / `LOW` by the case of their first
/// letter, which only their characters tell.
fn synthetic_tagged(rng: &mut ChaCha8Rng, sentences: usize, spell: bool) -> String {
    let mut out = String::new();
    for _ in 0..sentences {
        let n = rng.random_range(3..9);
        let mark = if rng.random_bool(0.5) {
            Some(rng.random_range(1..n))
        } else {
            None
        };
        let mut toks = Vec::new();
        for i in 0..n {
            let tok = if Some(i) == mark {
                "mark|MARK".to_string()
            } else if mark.is_some_and(|m| i < m) {
                format!("w{}|LATE", rng.random_range(0..12))
            } else if spell && rng.random_bool(0.3) {
                let up = rng.random_bool(0.5);
                let first = if up { 'A' } else { 'a' };
                let first = (first as u8 + rng.random_range(0..4)) as char;
                let rest: String = (0..rng.random_range(2..5))
                    .map(|_| (b'a' + rng.random_range(0..4)) as char)
                    .collect();
                format!("{first}{rest}|{}", if up { "UP" } else { "LOW" })
            } else {
                let w = rng.random_range(0..12);
                format!("w{w}|C{}", w % 3)
            };
            toks.push(tok);
        }
        out += &toks.join(" ");
        out.push('\n');
    }
    out
}

#[test]
fn bilstm_tagger_learns_tags_that_need_the_backward_direction() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let train = parse_tagged(&synthetic_tagged(&mut rng, 300, false), "train").unwrap();
    let dev = parse_tagged(&synthetic_tagged(&mut rng, 80, false), "dev").unwrap();
    let vocab = TaggedVocab::build(&train, 1);
    let (tr, dv) = (
        vocab.graphs(&train, "train", false).unwrap(),
        vocab.graphs(&dev, "dev", false).unwrap(),
    );
    let cfg = ModelConfig {
        vocab: vocab.words.len(),
        hidden: 16,
        classes: vocab.tags.len(),
    };
    let seq = SequenceConfig {
        mlp: 16,
        ..SequenceConfig::default()
    };
    let mut t = trainer(
        build("bilstm-tagger", &cfg, &seq),
        OptimizerKind::Adam,
        0.02,
    );
    let before = t.evaluate(&dv, 64).unwrap();
    train_epochs(&mut t, &tr, 6, 10);
    let after = t.evaluate(&dv, 64).unwrap();
    println!("bilstm-tagger dev: {before:?} -> {after:?}");
    assert!(
        after.loss < 0.3 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    // about a third of the words are LATE, decided by a later word
    assert!(
        after.node_accuracy > 0.95,
        "tag accuracy {}",
        after.node_accuracy
    );
    assert_eq!(
        after.node_accuracy, after.root_accuracy,
        "every output is a root"
    );
}

/// Tag accuracy on the words the vocabulary does not hold.
fn rare_word_accuracy(t: &mut Trainer<f32>, graphs: &[InputGraph], rare: &[bool]) -> f64 {
    let mut engine = CpuEngine::<f32>::new();
    let params = t.state().unwrap().params;
    let (mut ok, mut seen, mut at) = (0usize, 0usize, 0usize);
    for g in graphs {
        let batch = Batch::new(t.model(), vec![g], BatchingPolicy::Cavs).unwrap();
        let out = engine
            .forward(t.model(), &params, &batch, Mode::Evaluate)
            .unwrap();
        let preds = out.predictions();
        let n = (0..g.len())
            .filter(|&v| g.kind(v) == tagger_kinds::OUTPUT)
            .count();
        for (i, v) in (g.len() - n..g.len()).enumerate() {
            if rare[at + i] {
                let number = batch.schedule.number[v];
                let row = out.head_vertices.iter().position(|&h| h == number).unwrap();
                ok += usize::from(preds[row] as i32 == g.labels[v]);
                seen += 1;
            }
        }
        at += n;
    }
    ok as f64 / seen.max(1) as f64
}

#[test]
fn character_lstms_tag_words_never_seen_in_training() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let train = parse_tagged(&synthetic_tagged(&mut rng, 300, true), "train").unwrap();
    let dev = parse_tagged(&synthetic_tagged(&mut rng, 80, true), "dev").unwrap();
    let vocab = TaggedVocab::build(&train, RARE_BELOW);
    let rare: Vec<bool> = dev
        .iter()
        .flat_map(|s| s.words.iter().map(|w| vocab.is_rare(w)))
        .collect();
    assert!(
        rare.iter().filter(|&&r| r).count() > 50,
        "too few rare dev words"
    );
    let cfg = ModelConfig {
        vocab: vocab.words.len(),
        hidden: 16,
        classes: vocab.tags.len(),
    };
    let seq = SequenceConfig {
        mlp: 16,
        char_embed: 8,
        chars: vocab.chars.len(),
    };
    let mut results = Vec::new();
    for (name, spell) in [("bilstm-char-tagger", true), ("bilstm-tagger", false)] {
        let tr = vocab.graphs(&train, "train", spell).unwrap();
        let dv = vocab.graphs(&dev, "dev", spell).unwrap();
        let mut t = trainer(build(name, &cfg, &seq), OptimizerKind::Adam, 0.02);
        train_epochs(&mut t, &tr, 6, 10);
        let all: EvalResult = t.evaluate(&dv, 64).unwrap();
        let on_rare = rare_word_accuracy(&mut t, &dv, &rare);
        println!("{name}: dev {all:?}, rare-word accuracy {on_rare:.3}");
        results.push(on_rare);
    }
    // the rare words' tags are in their first letter: characters see it,
    // `<unk>` cannot (the plain tagger is left with a coin toss, or
    // with what the context of the word tells, e.g. LATE)
    assert!(
        results[0] > 0.9,
        "character tagger on rare words: {}",
        results[0]
    );
    assert!(
        results[0] > results[1] + 0.15,
        "characters did not help: {results:?}"
    );
}

#[test]
fn pyramid_and_tree_models_losses_fall_on_the_synthetic_treebank() {
    let tb = synthetic::generate(7, (300, 1, 1));
    let mut vocab = Vocab::new();
    let trees =
        ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab)).unwrap();
    let pyramids: Vec<InputGraph> = trees
        .iter()
        .map(|t| ramus_graph::sequence::pyramid_of_tree(t).unwrap())
        .collect();
    let cfg = ModelConfig {
        vocab: vocab.len(),
        hidden: 24,
        classes: 5,
    };
    let seq = SequenceConfig {
        mlp: 24,
        ..SequenceConfig::default()
    };
    for (name, data) in [
        ("td-rnn", &pyramids),
        ("td-lstm", &pyramids),
        ("rvnn", &trees),
    ] {
        let mut t = trainer(build(name, &cfg, &seq), OptimizerKind::Adam, 0.01);
        let before = t.evaluate(data, 64).unwrap();
        train_epochs(&mut t, data, 5, 20);
        let after = t.evaluate(data, 64).unwrap();
        println!("{name}: {before:?} -> {after:?}");
        assert!(
            after.loss < 0.9 * before.loss,
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
fn bilstm_tagger_beats_the_majority_tag_on_wikiner() {
    let Some(path) = common::data_file("wikiner/dev.txt") else {
        return;
    };
    let splits = split_tagged(read_tagged(&path).unwrap());
    let train = &splits.train;
    let vocab = TaggedVocab::build(train, 2);
    let file = path.display().to_string();
    let tr = vocab.graphs(train, &file, false).unwrap();
    let dv = vocab.graphs(&splits.dev, &file, false).unwrap();
    let majority = {
        let tags: Vec<&String> = splits.dev.iter().flat_map(|s| &s.tags).collect();
        tags.iter().filter(|t| t.as_str() == "O").count() as f64 / tags.len() as f64
    };
    let cfg = ModelConfig {
        vocab: vocab.words.len(),
        hidden: 32,
        classes: vocab.tags.len(),
    };
    let seq = SequenceConfig {
        mlp: 32,
        ..SequenceConfig::default()
    };
    let mut t = trainer(
        build("bilstm-tagger", &cfg, &seq),
        OptimizerKind::Adagrad,
        0.05,
    );
    let before = t.evaluate(&dv, 64).unwrap();
    train_epochs(&mut t, &tr, 2, 25);
    let after = t.evaluate(&dv, 64).unwrap();
    println!("wikiner: majority {majority:.3}, dev {before:?} -> {after:?}");
    assert!(
        after.loss < 0.6 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.node_accuracy > majority + 0.02,
        "tag accuracy {} vs majority tag {majority}",
        after.node_accuracy
    );
}
