//! Loading data for the CLI: tree or sentence splits from a directory, or
//! the built-in synthetic treebank when no directory is given.

use std::path::Path;

use ramus_graph::{ptb, synthetic, text, InputGraph, Vocab, VocabMode};
use ramus_nn::DataKind;

/// Train / dev / test graphs with the vocabulary built from train.
pub struct Splits {
    pub source: String,
    pub train: Vec<InputGraph>,
    pub dev: Vec<InputGraph>,
    pub test: Vec<InputGraph>,
    pub vocab: Vocab,
    pub classes: usize,
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Reads `dir/{train,dev,test}.txt` (`valid.txt` also accepted for dev) or,
/// without a directory, generates the built-in treebank.
pub fn load_splits(dir: Option<&Path>, kind: DataKind) -> AnyResult<Splits> {
    let mut vocab = Vocab::new();
    let (source, train, dev, test) = match dir {
        None => {
            let tb = synthetic::default_treebank();
            let (train, dev, test) = match kind {
                DataKind::Trees => (
                    ptb::parse_trees(
                        &tb.train.join("\n"),
                        "<built-in train>",
                        VocabMode::Grow(&mut vocab),
                    )?,
                    ptb::parse_trees(
                        &tb.dev.join("\n"),
                        "<built-in dev>",
                        VocabMode::Frozen(&vocab),
                    )?,
                    ptb::parse_trees(
                        &tb.test.join("\n"),
                        "<built-in test>",
                        VocabMode::Frozen(&vocab),
                    )?,
                ),
                DataKind::Sentences => {
                    let train = text::parse_sentences(
                        &sentences_of(&tb.train)?,
                        "<built-in train>",
                        VocabMode::Grow(&mut vocab),
                    )?;
                    let dev = text::parse_sentences(
                        &sentences_of(&tb.dev)?,
                        "<built-in dev>",
                        VocabMode::Frozen(&vocab),
                    )?;
                    let test = text::parse_sentences(
                        &sentences_of(&tb.test)?,
                        "<built-in test>",
                        VocabMode::Frozen(&vocab),
                    )?;
                    (train, dev, test)
                }
            };
            (
                "built-in synthetic treebank (seed 7)".to_string(),
                train,
                dev,
                test,
            )
        }
        Some(dir) => {
            let file = |names: &[&str]| -> AnyResult<std::path::PathBuf> {
                names
                    .iter()
                    .map(|n| dir.join(n))
                    .find(|p| p.exists())
                    .ok_or_else(|| {
                        format!("{}: no {} found", dir.display(), names.join(" or ")).into()
                    })
            };
            let (tr, dv, te) = (
                file(&["train.txt"])?,
                file(&["dev.txt", "valid.txt"])?,
                file(&["test.txt"])?,
            );
            let read = |p: &Path, mode: VocabMode<'_>| -> AnyResult<Vec<InputGraph>> {
                Ok(match kind {
                    DataKind::Trees => ptb::read_trees(p, mode)?,
                    DataKind::Sentences => text::read_sentences(p, mode)?,
                })
            };
            let train = read(&tr, VocabMode::Grow(&mut vocab))?;
            let dev = read(&dv, VocabMode::Frozen(&vocab))?;
            let test = read(&te, VocabMode::Frozen(&vocab))?;
            (dir.display().to_string(), train, dev, test)
        }
    };
    if train.is_empty() || dev.is_empty() || test.is_empty() {
        return Err(format!(
            "{source}: a split is empty (train {}, dev {}, test {})",
            train.len(),
            dev.len(),
            test.len()
        )
        .into());
    }
    let classes = match kind {
        DataKind::Sentences => 0,
        DataKind::Trees => {
            train
                .iter()
                .flat_map(|g| g.labels.iter())
                .copied()
                .max()
                .unwrap_or(0)
                .max(1) as usize
                + 1
        }
    };
    Ok(Splits {
        source,
        train,
        dev,
        test,
        vocab,
        classes,
    })
}

/// Reads one file with a fixed vocabulary.
pub fn read_frozen(path: &Path, kind: DataKind, vocab: &Vocab) -> AnyResult<Vec<InputGraph>> {
    Ok(match kind {
        DataKind::Trees => ptb::read_trees(path, VocabMode::Frozen(vocab))?,
        DataKind::Sentences => text::read_sentences(path, VocabMode::Frozen(vocab))?,
    })
}

/// The leaf words of bracketed trees, one sentence per line.
fn sentences_of(lines: &[String]) -> AnyResult<String> {
    let mut vocab = Vocab::new();
    let trees = ptb::parse_trees(&lines.join("\n"), "<built-in>", VocabMode::Grow(&mut vocab))?;
    let mut out = String::new();
    for t in &trees {
        let words: Vec<&str> = (0..t.len())
            .filter(|&v| t.children(v).is_empty())
            .filter_map(|v| vocab.word(t.tokens[v]))
            .collect();
        out += &words.join(" ");
        out.push('\n');
    }
    Ok(out)
}
