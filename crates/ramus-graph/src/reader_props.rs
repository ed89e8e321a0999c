//! Property tests of the text readers — bracket trees, plain sentences,
//! tagged text — and the vocabulary's JSON, over randomly mutated real
//! inputs ([`crate::testing`]): a few lines of the built-in synthetic
//! treebank and, when the shared data sets are present (`$RAMUS_DATA`, else
//! `../shared/data` beside the checkout), of SST, PTB and WikiNER. Each
//! mutated input is written to a file and read back: the reader never
//! panics, and it either succeeds (every graph naming its file and a
//! non-blank line of it) or fails naming the file, and for text the line
//! and column, inside the file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

use crate::tagged::{read_tagged, TaggedVocab};
use crate::testing::{apply, config, mutations};
use crate::{ptb, synthetic, text, GraphError, InputGraph, Vocab, VocabMode};

/// Lines of a real input per base text.
const WINDOW: usize = 4;
/// Base texts taken from each source.
const BASES: usize = 24;

/// `$RAMUS_DATA/<file>`, else `../shared/data/<file>` beside the checkout,
/// if it exists (else a notice, and `None`).
fn shared(file: &str) -> Option<PathBuf> {
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    let path = root.join(file);
    if path.is_file() {
        return Some(path);
    }
    // written to stderr directly: the test harness does not capture it
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr(),
        format_args!(
            "notice: {} absent; mutating only built-in inputs\n",
            path.display()
        ),
    );
    None
}

/// Base texts: windows of [`WINDOW`] consecutive lines of `lines`.
fn windows(lines: &[String]) -> Vec<String> {
    lines
        .chunks(WINDOW)
        .take(BASES)
        .map(|w| w.join("\n") + "\n")
        .collect()
}

/// The first lines of a shared data file, or none.
fn shared_lines(file: &str) -> Vec<String> {
    shared(file)
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|t| t.lines().take(WINDOW * BASES).map(String::from).collect())
        .unwrap_or_default()
}

/// Built-in synthetic trees, one a line.
fn synthetic_trees() -> Vec<String> {
    synthetic::default_treebank().train[..WINDOW * BASES].to_vec()
}

/// The leaf words of bracket-tree lines, one sentence a line.
fn leaf_sentences(trees: &[String]) -> Vec<String> {
    trees
        .iter()
        .map(|t| {
            let mut v = Vocab::new();
            let g = ptb::parse_tree(t, &mut VocabMode::Grow(&mut v), "t", 1).unwrap();
            leaves(&g, &v).join(" ")
        })
        .collect()
}

/// Tagged text from bracket-tree lines: each leaf word tagged with its label.
fn tagged_lines(trees: &[String]) -> Vec<String> {
    trees
        .iter()
        .map(|t| {
            let mut v = Vocab::new();
            let g = ptb::parse_tree(t, &mut VocabMode::Grow(&mut v), "t", 1).unwrap();
            let words = leaves(&g, &v);
            let labels = (0..g.len()).filter(|&u| g.children(u).is_empty());
            words
                .iter()
                .zip(labels)
                .map(|(w, u)| format!("{w}|L{}", g.labels[u]))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

fn leaves<'v>(g: &InputGraph, v: &'v Vocab) -> Vec<&'v str> {
    (0..g.len())
        .filter(|&u| g.children(u).is_empty())
        .filter_map(|u| v.word(g.tokens[u]))
        .collect()
}

/// A file for one test's cases (tests run on parallel threads).
fn case_file(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-reader-props-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{test}.txt"))
}

/// Fails unless `line` (1-based) and `column` (1-based characters) lie in
/// `bytes`: a line that exists, a column at most one past its end.
fn check_place(bytes: &[u8], line: usize, column: usize) -> Result<(), TestCaseError> {
    let Some(text) = bytes.split(|&b| b == b'\n').nth(line.wrapping_sub(1)) else {
        return Err(TestCaseError::fail(format!(
            "line {line} is not in the input"
        )));
    };
    let chars = String::from_utf8_lossy(text).chars().count();
    prop_assert!(
        (1..=chars + 1).contains(&column),
        "column {} outside line {} ({} characters)",
        column,
        line,
        chars
    );
    Ok(())
}

/// Fails unless `result`, from reading the file `path` holding `bytes`,
/// is a success whose graphs name that file and a non-blank line of it, or
/// an error naming the file (and a place in it, for a parse error).
fn check_read(
    result: &Result<Vec<InputGraph>, GraphError>,
    path: &str,
    bytes: &[u8],
) -> Result<(), TestCaseError> {
    match result {
        Ok(graphs) => {
            prop_assert!(!graphs.is_empty(), "no graphs and no error");
            let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
            for g in graphs {
                let o = g
                    .origin()
                    .ok_or_else(|| TestCaseError::fail("a graph without origin"))?;
                prop_assert_eq!(&*o.file, path);
                let line = lines
                    .get(o.line.wrapping_sub(1))
                    .copied()
                    .unwrap_or_default();
                prop_assert!(
                    !String::from_utf8_lossy(line).trim().is_empty(),
                    "graph from blank or absent line {}",
                    o.line
                );
            }
            Ok(())
        }
        Err(e) => check_error(e, path, bytes),
    }
}

/// Fails unless `e` names `path` and, for a parse error, a place in `bytes`.
fn check_error(e: &GraphError, path: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    match e {
        GraphError::Parse {
            file, line, column, ..
        } => {
            prop_assert_eq!(file, path, "{}", e);
            check_place(bytes, *line, *column)
        }
        GraphError::Empty { file, .. } => {
            prop_assert_eq!(file, path);
            let blank = String::from_utf8_lossy(bytes).trim().is_empty();
            prop_assert!(blank, "{} for a file with text", e);
            Ok(())
        }
        GraphError::Structure(m) => {
            prop_assert!(m.contains(path), "{} does not name {}", e, path);
            Ok(())
        }
        other => Err(TestCaseError::fail(format!("unexpected error {other}"))),
    }
}

/// Writes `bytes` to the case file of `test` and returns its path.
fn write_case(test: &str, bytes: &[u8]) -> (PathBuf, String) {
    let path = case_file(test);
    std::fs::write(&path, bytes).unwrap();
    let name = path.display().to_string();
    (path, name)
}

/// Synthetic and SST tree windows, with each one's vocabulary (the frozen
/// vocabulary of the mutated copy, as a dev file's is the train file's).
fn tree_bases() -> &'static [(String, Vocab)] {
    static BASES: OnceLock<Vec<(String, Vocab)>> = OnceLock::new();
    BASES.get_or_init(|| {
        let mut lines = synthetic_trees();
        lines.extend(shared_lines("sst/dev.txt"));
        windows(&lines)
            .into_iter()
            .map(|w| {
                let mut v = Vocab::new();
                ptb::parse_trees(&w, "base", VocabMode::Grow(&mut v)).unwrap();
                (w, v)
            })
            .collect()
    })
}

/// Synthetic sentences (the trees' leaves) and PTB windows.
fn sentence_bases() -> &'static [String] {
    static BASES: OnceLock<Vec<String>> = OnceLock::new();
    BASES.get_or_init(|| {
        let mut lines = leaf_sentences(&synthetic_trees());
        lines.extend(shared_lines("ptb/valid.txt"));
        windows(&lines)
    })
}

/// Synthetic tagged text (leaves tagged with their labels) and WikiNER
/// windows.
fn tagged_bases() -> &'static [String] {
    static BASES: OnceLock<Vec<String>> = OnceLock::new();
    BASES.get_or_init(|| {
        let mut lines = tagged_lines(&synthetic_trees());
        lines.extend(shared_lines("wikiner/dev.txt"));
        windows(&lines)
    })
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn mutated_trees_read_or_fail_located(base in any::<Index>(), muts in mutations()) {
        let (text, vocab) = base.get(tree_bases());
        let bytes = apply(text.as_bytes(), &muts);
        let (path, name) = write_case("trees", &bytes);
        let grown = ptb::read_trees(&path, VocabMode::Grow(&mut Vocab::new()));
        check_read(&grown, &name, &bytes)?;
        let frozen = ptb::read_trees(&path, VocabMode::Frozen(vocab));
        check_read(&frozen, &name, &bytes)?;
    }

    #[test]
    fn mutated_sentences_read_or_fail_located(base in any::<Index>(), muts in mutations()) {
        let text = base.get(sentence_bases());
        let mut vocab = Vocab::new();
        text::parse_sentences(text, "base", VocabMode::Grow(&mut vocab)).unwrap();
        let bytes = apply(text.as_bytes(), &muts);
        let (path, name) = write_case("sentences", &bytes);
        let grown = text::read_sentences(&path, VocabMode::Grow(&mut Vocab::new()));
        check_read(&grown, &name, &bytes)?;
        for frozen in [&vocab, &Vocab::new()] {
            check_read(&text::read_sentences(&path, VocabMode::Frozen(frozen)), &name, &bytes)?;
        }
    }

    #[test]
    fn mutated_tagged_text_reads_or_fails_located(base in any::<Index>(), muts in mutations()) {
        let text = base.get(tagged_bases());
        let trained = TaggedVocab::build(&crate::tagged::parse_tagged(text, "base").unwrap(), 1);
        let bytes = apply(text.as_bytes(), &muts);
        let (path, name) = write_case("tagged", &bytes);
        match read_tagged(&path) {
            Err(e) => check_error(&e, &name, &bytes)?,
            Ok(sentences) => {
                for (vocab, chars) in [
                    (&TaggedVocab::build(&sentences, 1), false),
                    (&TaggedVocab::build(&sentences, 2), true),
                    (&trained, true),
                ] {
                    check_read(&vocab.graphs(&sentences, &name, chars), &name, &bytes)?;
                }
            }
        }
    }

    #[test]
    fn mutated_vocabulary_json_parses_or_fails_located(base in any::<Index>(), muts in mutations()) {
        let mut tricky = Vocab::new();
        for w in ["quo\"te", "back\\slash", "new\nline", "\u{1}", "caf\u{e9}", "\u{1F600}", "[,]", ""] {
            tricky.add(w);
        }
        let bases = [tree_bases()[0].1.to_json(), tree_bases().last().unwrap().1.to_json(), tricky.to_json()];
        let json = base.get(&bases);
        let bytes = apply(json.as_bytes(), &muts);
        // the JSON comes from a checkpoint's metadata, a string: invalid
        // UTF-8 is refused before (see ramus-nn's checkpoint tests)
        let json = String::from_utf8_lossy(&bytes);
        match Vocab::from_json(&json, "vocab.json") {
            Ok(v) => {
                prop_assert_eq!(v.word(0), Some(crate::vocab::UNK));
                prop_assert_eq!(Vocab::from_json(&v.to_json(), "again").unwrap(), v);
            }
            Err(e) => check_error(&e, "vocab.json", json.as_bytes())?,
        }
    }
}
