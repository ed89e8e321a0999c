//! Input structure a model cannot read is refused, never ignored: every
//! model whose functions read a fixed pair of children refuses a vertex
//! with three children or one, naming its file:line and vertex, in the
//! batched engines' schedule and in the compiled engine; child-sum models
//! take any number; chains, taggers and CNNs pass on their own data (the
//! built-in sets, and SST, WikiNER and PTB where `../shared/data` or
//! `$RAMUS_DATA` has them); `binarize` makes a ternary tree trainable.

mod common;

use std::sync::Arc;

use ramus_core::{Arity, Model, Params, VertexRules};
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::binarize::{binarize, Side};
use ramus_graph::sequence::{pyramid_of_tree, tagger_graph, tagger_kinds, WordInput};
use ramus_graph::tagged::{read_tagged, TaggedVocab, RARE_BELOW};
use ramus_graph::{
    check_structure, images, ptb, synthetic, text, BatchingPolicy, InputGraph, Origin, Vocab,
    VocabMode, NO_LABEL,
};
use ramus_nn::{
    build_model, build_sequence_model, data_kind, DataKind, ModelConfig, ModelOptions,
    SequenceConfig, Trainer, MODEL_NAMES,
};

const CFG: ModelConfig = ModelConfig {
    vocab: 10,
    hidden: 4,
    classes: 3,
};

/// The models whose internal function reads exactly two children.
const BINARY: [&str; 6] = [
    "treefc",
    "treelstm-nary",
    "mvrnn",
    "rvnn",
    "td-rnn",
    "td-lstm",
];

/// Three leaves under one root, read from `t.txt` line 3.
fn ternary() -> InputGraph {
    let mut g = InputGraph::new();
    for t in 1..=3 {
        g.push_vertex(&[], t, 1).unwrap();
    }
    g.push_vertex(&[0, 1, 2], 0, 2).unwrap();
    g.with_origin(Origin {
        file: Arc::from("t.txt"),
        line: 3,
    })
}

/// Two leaves under a root whose left child has one child (line 5).
fn one_child() -> InputGraph {
    let mut g = InputGraph::new();
    g.push_vertex(&[], 1, 0).unwrap();
    g.push_vertex(&[0], 0, 1).unwrap();
    g.push_vertex(&[], 2, 0).unwrap();
    g.push_vertex(&[1, 2], 0, 2).unwrap();
    g.with_origin(Origin {
        file: Arc::from("t.txt"),
        line: 5,
    })
}

fn model(name: &str) -> Model {
    build_model(name, &CFG).unwrap()
}

fn check(model: &Model, graphs: &[InputGraph]) -> Result<(), String> {
    let rules = VertexRules::of(model);
    check_structure(graphs, |kind, children| rules.check(kind, children)).map_err(|e| e.to_string())
}

#[test]
fn binary_models_refuse_three_children_and_one_naming_file_line_and_vertex() {
    for name in BINARY {
        let m = model(name);
        let internal = &m.functions[m.function_for(0, 2).unwrap()];
        assert!(internal.arity.is_binary(), "{name}: {:?}", internal.arity);
        let params = Params::<f32>::init(&m, 1);
        let mut compiled = CpuCompiledEngine::new(&m, &params, false).unwrap();
        for (g, start, fate) in [
            (
                ternary(),
                "t.txt:3: vertex 3 has 3 children",
                "child 2 would be ignored",
            ),
            (
                one_child(),
                "t.txt:5: vertex 1 has 1 child",
                "child 1 would read zeros",
            ),
        ] {
            let batched = Batch::new(&m, vec![&g], BatchingPolicy::Cavs)
                .err()
                .unwrap_or_else(|| panic!("{name}: {start} was scheduled"))
                .to_string();
            let agenda = Batch::new(&m, vec![&g], BatchingPolicy::Agenda)
                .err()
                .map(|e| e.to_string());
            let up_front = check(&m, std::slice::from_ref(&g)).unwrap_err();
            for e in [&batched, &up_front] {
                assert!(e.starts_with(start), "{name}: {e}");
                assert!(e.contains(fate), "{name}: {e}");
                assert!(
                    e.contains(&format!("`{}` of model `{name}`", internal.name)),
                    "{name}: {e}"
                );
                assert!(e.contains("--binarize"), "{name}: {e}");
            }
            assert_eq!(agenda.as_ref(), Some(&batched), "{name}");
            let e = compiled.infer(&[&g]).err().map(|e| e.to_string());
            assert_eq!(e.as_ref(), Some(&up_front), "{name}: compiled engine");
        }
    }
}

#[test]
fn child_sum_models_read_any_number_of_children() {
    let mut wide = InputGraph::new();
    for t in 0..6 {
        wide.push_vertex(&[], t, 0).unwrap();
    }
    wide.push_vertex(&[0], 0, 1).unwrap();
    wide.push_vertex(&[1, 2, 3], 0, 1).unwrap();
    wide.push_vertex(&[6, 7, 4, 5], 0, 2).unwrap();
    let graphs = [wide, ternary(), one_child()];
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    for name in ["treelstm", "treegru", "dagrnn"] {
        let m = model(name);
        assert!(m.functions.iter().any(|f| f.arity == Arity::Any), "{name}");
        check(&m, &graphs).unwrap();
        let params = Params::<f32>::init(&m, 1);
        let batch = Batch::new(&m, refs.clone(), BatchingPolicy::Cavs).unwrap();
        let out = CpuEngine::<f32>::new()
            .forward(&m, &params, &batch, Mode::Evaluate)
            .unwrap();
        assert!(out.loss.unwrap().is_finite(), "{name}");
    }
}

#[test]
fn chains_and_tagger_steps_may_start_without_children() {
    let lm = model("lstm-lm");
    check(
        &lm,
        &[InputGraph::chain(&[1, 2, 3], &[2, 3, NO_LABEL]).unwrap()],
    )
    .unwrap();
    let mut fork = InputGraph::new();
    fork.push_vertex(&[], 1, 0).unwrap();
    fork.push_vertex(&[], 1, 0).unwrap();
    fork.push_vertex(&[0, 1], 2, 0).unwrap();
    let e = check(&lm, &[fork]).unwrap_err();
    assert!(e.starts_with("graph 0: vertex 2 has 2 children"), "{e}");

    let tagger = char_tagger();
    // a spelled first word: its forward step has no previous step
    let chars = [1, 2, 3];
    let words = [
        WordInput::Chars(&chars),
        WordInput::Token(4),
        WordInput::Chars(&chars),
    ];
    let g = tagger_graph(&words, &[0, 1, 2]).unwrap();
    check(&tagger, &[g]).unwrap();
    let from_chars = tagger_kinds::FORWARD_FROM_CHARS;
    assert!(tagger.function_for(from_chars, 2).is_ok());
    assert!(tagger.function_for(from_chars, 3).is_ok());
    let e = tagger.function_for(from_chars, 1).unwrap_err();
    assert!(e.contains("reads 2 to 3 children"), "{e}");
    assert!(!e.contains("--binarize"), "{e}");
    let e = tagger.function_for(tagger_kinds::OUTPUT, 3).unwrap_err();
    assert!(e.contains("`output`"), "{e}");
    let e = tagger
        .function_for(tagger_kinds::COUNT as u16, 1)
        .unwrap_err();
    assert!(e.contains("no vertex function"), "{e}");
}

#[test]
fn binarized_ternary_trees_train() {
    let trees: Vec<InputGraph> = (0..4)
        .map(|i| {
            let mut g = ternary();
            g.labels[3] = i % 3;
            g
        })
        .collect();
    let m = model("treefc");
    assert!(check(&m, &trees).is_err());
    for side in [Side::Left, Side::Right] {
        let binary: Vec<InputGraph> = trees
            .iter()
            .enumerate()
            .map(|(i, g)| binarize(g, side, i).unwrap())
            .collect();
        check(&m, &binary).unwrap();
        let params = Params::init(&m, 1);
        let mut t = Trainer::<f32>::new(
            m.clone(),
            params,
            OptimizerConfig::new(OptimizerKind::Adagrad, 0.1),
        );
        let mut rng = ramus_nn::train::rng(1);
        let loss = t.train_epoch(&binary, 2, &mut rng, |_, _, _| {}).unwrap();
        assert!(loss.is_finite(), "{side:?}");
    }
}

/// Checks `graphs` against every model that reads data of `kind`.
fn check_models_of(kind: DataKind, graphs: &[InputGraph]) {
    let names = MODEL_NAMES.iter().filter(|&&n| data_kind(n) == Some(kind));
    for name in names {
        let m = match name {
            &"bilstm-char-tagger" => char_tagger(),
            _ => model(name),
        };
        check(&m, graphs).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

fn char_tagger() -> Model {
    let seq = SequenceConfig {
        chars: 8,
        ..SequenceConfig::default()
    };
    build_sequence_model("bilstm-char-tagger", &CFG, &seq, &ModelOptions::default()).unwrap()
}

/// Checks `trees` and their pyramids against the models that read them.
fn check_tree_models(trees: &[InputGraph]) {
    check_models_of(DataKind::Trees, trees);
    let pyramids: Vec<InputGraph> = trees.iter().map(|t| pyramid_of_tree(t).unwrap()).collect();
    check_models_of(DataKind::SentencePyramid, &pyramids);
}

#[test]
fn built_in_data_fits_its_models() {
    let tb = synthetic::default_treebank();
    let mut vocab = Vocab::new();
    let mut sentences = String::new();
    for (lines, name) in [(&tb.train, "train"), (&tb.dev, "dev"), (&tb.test, "test")] {
        let trees = ptb::parse_trees(&lines.join("\n"), name, VocabMode::Grow(&mut vocab)).unwrap();
        check_tree_models(&trees);
        for t in &trees {
            let leaves = (0..t.len()).filter(|&v| t.children(v).is_empty());
            let words: Vec<&str> = leaves.filter_map(|v| vocab.word(t.tokens[v])).collect();
            sentences += &(words.join(" ") + "\n");
        }
    }
    let chains =
        text::parse_sentences(&sentences, "built-in", VocabMode::Grow(&mut vocab)).unwrap();
    check_models_of(DataKind::Sentences, &chains);
    let set = images::generate(&images::ImageSpec::default(), 1, (4, 0, 0)).unwrap();
    check_models_of(DataKind::Images, &set.train);
}

#[test]
fn shared_data_fits_its_models() {
    if let Some(sst) = common::data_file("sst") {
        let mut vocab = Vocab::new();
        for split in ["train.txt", "dev.txt", "test.txt"] {
            let trees = ptb::read_trees(&sst.join(split), VocabMode::Grow(&mut vocab)).unwrap();
            check_tree_models(&trees);
        }
    }
    if let Some(wikiner) = common::data_file("wikiner/dev.txt") {
        let sentences = read_tagged(&wikiner).unwrap();
        let file = wikiner.display().to_string();
        for (chars, min_count) in [(false, 2), (true, RARE_BELOW)] {
            let graphs = TaggedVocab::build(&sentences, min_count)
                .graphs(&sentences, &file, chars)
                .unwrap();
            check_models_of(DataKind::Tagged { chars }, &graphs);
        }
    }
    if let Some(ptb_dir) = common::data_file("ptb") {
        let mut vocab = Vocab::new();
        for split in ["train.txt", "valid.txt", "test.txt"] {
            let chains =
                text::read_sentences(&ptb_dir.join(split), VocabMode::Grow(&mut vocab)).unwrap();
            check_models_of(DataKind::Sentences, &chains);
        }
    }
}

#[test]
fn the_rules_snapshot_answers_as_the_model_does() {
    let mut models: Vec<Model> = MODEL_NAMES
        .iter()
        .filter(|&&n| n != "bilstm-char-tagger")
        .map(|n| model(n))
        .collect();
    models.push(char_tagger());
    for m in &models {
        let rules = VertexRules::of(m);
        // past 64 children the snapshot's bit table gives way to the model's answer
        for kind in 0..9u16 {
            for children in (0..70).chain([200, 4096]) {
                let want = m.function_for(kind, children).map(drop);
                assert_eq!(
                    rules.check(kind, children),
                    want,
                    "{} {kind} {children}",
                    m.name
                );
            }
        }
    }
}
