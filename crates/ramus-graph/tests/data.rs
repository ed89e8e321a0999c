//! Readers against the real data sets in `../shared/data` (or `$RAMUS_DATA`):
//! the Stanford Sentiment Treebank, the Penn Treebank language-model text
//! and WikiNER (tagged text).
//! Each test prints a notice and passes when its data is absent.
//!
//! Expected numbers come from this Python reference (post-order, leaf words
//! joined by single spaces with `\/` and `\*` unescaped, vocabulary in
//! first-appearance order plus `<unk>`):
//!
//! ```python
//! toks = re.findall(r'\(|\)|[^\s()]+', line)   # then a stack: '(' label ... ')'
//! ```

use std::path::{Path, PathBuf};

use ramus_graph::ptb::{read_trees, write_tree};
use ramus_graph::text::{read_sentences, EOS};
use ramus_graph::vocab::{VocabMode, UNK};
use ramus_graph::{InputGraph, Vocab};

/// `$RAMUS_DATA/<sub>`, else `<workspace>/../shared/data/<sub>`, if it exists.
fn data_dir(sub: &str) -> Option<PathBuf> {
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    let dir = root.join(sub);
    if dir.is_dir() {
        Some(dir)
    } else {
        // written to stderr directly: the test harness does not capture it, so CI logs show the skip
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("skipping: {sub} data not found at {}\n", dir.display()),
        );
        None
    }
}

/// (sentences, vertices, leaves, leaves with token 0, root label counts).
fn tree_stats(trees: &[InputGraph]) -> (usize, usize, usize, usize, [usize; 5]) {
    let mut s = (trees.len(), 0, 0, 0, [0usize; 5]);
    for g in trees {
        s.1 += g.len();
        for v in 0..g.len() {
            if g.children(v).is_empty() {
                s.2 += 1;
                s.3 += usize::from(g.tokens[v] == 0);
            }
        }
        s.4[g.root_label().expect("every SST root is labelled") as usize] += 1;
    }
    s
}

/// Every tree is one binary tree with labels 0..=4 and token 0 exactly on internal vertices.
fn check_sst_shape(name: &str, trees: &[InputGraph]) {
    for (k, g) in trees.iter().enumerate() {
        assert_eq!(
            g.roots(),
            vec![g.len() as u32 - 1],
            "{name} tree {k}: root is not last"
        );
        assert!(g.is_forest(), "{name} tree {k}");
        for v in 0..g.len() {
            let n = g.children(v).len();
            assert!(
                n == 0 || n == 2,
                "{name} tree {k} vertex {v} has {n} children"
            );
            assert!(
                (0..=4).contains(&g.labels[v]),
                "{name} tree {k} vertex {v} label {}",
                g.labels[v]
            );
            if n == 2 {
                assert_eq!(g.tokens[v], 0, "{name} tree {k} vertex {v}");
            }
        }
    }
}

#[test]
fn sst_splits_parse_completely() {
    let Some(dir) = data_dir("sst") else { return };
    let mut vocab = Vocab::new();
    let train = read_trees(&dir.join("train.txt"), VocabMode::Grow(&mut vocab)).unwrap();
    check_sst_shape("train", &train);
    assert_eq!(
        tree_stats(&train),
        (8544, 318_582, 163_563, 0, [1092, 2218, 1624, 2322, 1288])
    );
    // 18280 distinct leaf words in first-appearance order, plus <unk>.
    assert_eq!(vocab.len(), 18_281);
    assert_eq!(
        &vocab.words()[..6],
        &[UNK, "The", "Rock", "is", "destined", "to"]
    );
    // Multi-token leaves (written with a no-break space in the file) and escapes.
    for w in ["8 1/2", "2 1/2", "writer/director", "***", "*", "-LRB-"] {
        assert!(
            vocab.get(w).is_some(),
            "{w:?} missing from the SST train vocabulary"
        );
    }
    assert!(vocab.get("1\\/2").is_none() && vocab.get("8\u{a0}1/2").is_none());

    let size = vocab.len();
    let dev = read_trees(&dir.join("dev.txt"), VocabMode::Frozen(&vocab)).unwrap();
    check_sst_shape("dev", &dev);
    assert_eq!(
        tree_stats(&dev),
        (1101, 41_447, 21_274, 1231, [139, 289, 229, 279, 165])
    );
    let test = read_trees(&dir.join("test.txt"), VocabMode::Frozen(&vocab)).unwrap();
    check_sst_shape("test", &test);
    assert_eq!(
        tree_stats(&test),
        (2210, 82_600, 42_405, 2562, [279, 633, 389, 510, 399])
    );
    assert_eq!(
        vocab.len(),
        size,
        "frozen reads must not grow the vocabulary"
    );

    let json = vocab.to_json();
    assert_eq!(Vocab::from_json(&json, "vocab").unwrap(), vocab);
}

#[test]
fn sst_train_writes_back_line_for_line() {
    let Some(dir) = data_dir("sst") else { return };
    let path = dir.join("train.txt");
    let mut vocab = Vocab::new();
    let trees = read_trees(&path, VocabMode::Grow(&mut vocab)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), trees.len());
    let mut nbsp_lines = 0;
    for (k, (line, g)) in lines.iter().zip(&trees).enumerate() {
        // The only normalisation: a no-break space inside a leaf becomes a space.
        nbsp_lines += usize::from(line.contains('\u{a0}'));
        assert_eq!(
            write_tree(g, &vocab).unwrap(),
            line.replace('\u{a0}', " "),
            "train.txt line {}",
            k + 1
        );
    }
    assert_eq!(nbsp_lines, 3);
}

#[test]
fn ptb_text_splits_read_as_language_model_chains() {
    let Some(dir) = data_dir("ptb") else { return };
    let mut vocab = Vocab::new();
    let train = read_sentences(&dir.join("train.txt"), VocabMode::Grow(&mut vocab)).unwrap();
    assert_eq!(train.len(), 42_068);
    assert_eq!(train.iter().map(InputGraph::len).sum::<usize>(), 887_521);
    // Mikolov's 10k vocabulary already contains <unk>; <eos> is added.
    assert_eq!(vocab.len(), 10_000);
    let eos = vocab.get(EOS).expect("<eos> was added") as i32;
    // <eos> is added right after the first sentence's words.
    let first_words = train[0]
        .tokens
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len();
    assert_eq!(eos as usize, first_words + 1);
    assert_eq!(
        train[0].tokens[..2],
        [vocab.id("aer"), vocab.id("banknote")]
    );

    let size = vocab.len();
    for (name, sentences, tokens, unks) in
        [("valid", 3370, 70_390, 3485), ("test", 3761, 78_669, 4794)]
    {
        let split =
            read_sentences(&dir.join(format!("{name}.txt")), VocabMode::Frozen(&vocab)).unwrap();
        assert_eq!(split.len(), sentences, "{name}");
        assert_eq!(
            split.iter().map(InputGraph::len).sum::<usize>(),
            tokens,
            "{name}"
        );
        // Every word of valid/test is in the train vocabulary: id 0 only for literal <unk>.
        let zeros: usize = split
            .iter()
            .map(|g| g.tokens.iter().filter(|&&t| t == 0).count())
            .sum();
        assert_eq!(zeros, unks, "{name}");
    }
    assert_eq!(vocab.len(), size);

    for g in &train {
        let n = g.len();
        for t in 0..n - 1 {
            assert_eq!(g.labels[t], g.tokens[t + 1] as i32);
            assert_eq!(g.children(t + 1), &[t as u32]);
        }
        assert_eq!(g.labels[n - 1], eos);
    }
}

#[test]
fn wikiner_reads_splits_and_becomes_tagger_graphs() {
    use ramus_graph::sequence::tagger_kinds;
    use ramus_graph::tagged::{read_tagged, split_tagged, TaggedVocab, RARE_BELOW};
    let Some(dir) = data_dir("wikiner") else {
        return;
    };
    let path = dir.join("dev.txt");
    let all = read_tagged(&path).expect("WikiNER parses");
    // numbers from `awk` over the file: sentences, tokens, tag counts
    assert_eq!(all.len(), 1696);
    assert_eq!(all.iter().map(|s| s.len()).sum::<usize>(), 39007);
    let count = |tag: &str| {
        all.iter()
            .flat_map(|s| &s.tags)
            .filter(|t| *t == tag)
            .count()
    };
    assert_eq!(
        ["O", "I-PER", "I-ORG", "I-LOC", "I-MISC"].map(count),
        [32576, 1634, 1958, 1447, 1392]
    );
    let splits = split_tagged(all.clone());
    assert_eq!(
        (splits.train.len(), splits.dev.len(), splits.test.len()),
        (1358, 169, 169)
    );
    assert_eq!(splits.test[0], all[9]);
    assert_eq!(splits, split_tagged(all), "the split is deterministic");
    let file = path.display().to_string();
    let vocab = TaggedVocab::build(&splits.train, RARE_BELOW);
    assert_eq!(vocab.tags.len(), 5);
    for chars in [false, true] {
        let graphs = vocab
            .graphs(&splits.test, &file, chars)
            .expect("test tags are known");
        for (g, s) in graphs.iter().zip(&splits.test) {
            let outputs = (0..g.len())
                .filter(|&v| g.kind(v) == tagger_kinds::OUTPUT)
                .count();
            assert_eq!(outputs, s.len());
            let spelled: usize = s
                .words
                .iter()
                .filter(|w| chars && vocab.is_rare(w))
                .map(|w| 2 * w.chars().count())
                .sum();
            // three vertices per word, two per spelled character
            assert_eq!(g.len(), 3 * s.len() + spelled);
        }
    }
}
