//! Reader for plain-text sentences, one a line, tokens separated by
//! whitespace (the Penn Treebank language-modelling files). Each non-blank
//! line becomes a chain ([`InputGraph::chain`]) whose vertex `t` holds token
//! `t` and is labelled with the id of token `t + 1` — the next-word target —
//! the last vertex being labelled with the id of [`EOS`]. This module also
//! owns reading a text file as UTF-8 with located errors, shared with
//! [`crate::ptb`], [`crate::tagged`] and the CLI's standard input.

use std::path::Path;

use crate::input::InputGraph;
use crate::vocab::VocabMode;
use crate::GraphError;

/// End-of-sentence word: the target after a sentence's last token.
pub const EOS: &str = "<eos>";

/// Parses every non-blank line of `text` as a sentence; `file_name` labels
/// errors. Text without a sentence (empty or blank) is
/// [`GraphError::Empty`].
///
/// With [`VocabMode::Grow`], a line's tokens are added in order and then
/// [`EOS`] (so `<eos>` gets the id after the first sentence's new words).
/// With [`VocabMode::Frozen`], unknown tokens map to id 0, and the
/// vocabulary must already hold [`EOS`]: without it every sentence's last
/// target would silently become `<unk>`.
pub fn parse_sentences(
    text: &str,
    file_name: &str,
    mut vocab: VocabMode<'_>,
) -> Result<Vec<InputGraph>, GraphError> {
    if let VocabMode::Frozen(v) = &vocab {
        if v.get(EOS).is_none() {
            return Err(GraphError::Structure(format!(
                "reading {file_name}: the frozen vocabulary ({} words) has no {EOS:?}, needed as the last target of every sentence",
                v.len()
            )));
        }
    }
    let mut sentences = Vec::new();
    let file: std::sync::Arc<str> = file_name.into();
    for (k, line) in text.lines().enumerate() {
        let ids: Vec<u32> = line.split_whitespace().map(|w| vocab.lookup(w)).collect();
        if ids.is_empty() {
            continue;
        }
        let eos = vocab.lookup(EOS);
        let labels = ids[1..]
            .iter()
            .chain(std::iter::once(&eos))
            .map(|&id| {
                i32::try_from(id).map_err(|_| GraphError::Parse {
                    file: file_name.to_string(),
                    line: k + 1,
                    column: 1,
                    message: format!("token id {id} does not fit in an i32 label"),
                })
            })
            .collect::<Result<Vec<i32>, _>>()?;
        sentences.push(
            InputGraph::chain(&ids, &labels)?.with_origin(crate::Origin {
                file: file.clone(),
                line: k + 1,
            }),
        );
    }
    if sentences.is_empty() {
        return Err(GraphError::Empty {
            file: file_name.to_string(),
            what: "sentences",
        });
    }
    Ok(sentences)
}

/// Reads a sentence file (one sentence a line, blank lines skipped; at
/// least one sentence).
pub fn read_sentences(path: &Path, vocab: VocabMode<'_>) -> Result<Vec<InputGraph>, GraphError> {
    let text = read_utf8(path)?;
    parse_sentences(&text, &path.display().to_string(), vocab)
}

/// The contents of `path` as a string: [`GraphError::Io`] when it cannot
/// be read, [`GraphError::Parse`] at the first byte that is not UTF-8.
pub fn read_utf8(path: &Path) -> Result<String, GraphError> {
    let bytes = std::fs::read(path).map_err(|source| GraphError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    decode_utf8(bytes, &path.display().to_string())
}

/// `bytes` read from `source` (a file name, `<stdin>`) as a string, or
/// [`GraphError::Parse`] at the line and column of the first byte that is
/// not UTF-8.
pub fn decode_utf8(bytes: Vec<u8>, source: &str) -> Result<String, GraphError> {
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        // `valid` is UTF-8 by construction, so this never falls back.
        let before = std::str::from_utf8(valid).unwrap_or_default();
        let line_start = before.rfind('\n').map_or(0, |p| p + 1);
        GraphError::Parse {
            file: source.to_string(),
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
            message: format!("invalid UTF-8 (byte offset {})", valid.len()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::NO_LABEL;
    use crate::vocab::Vocab;

    #[test]
    fn sentences_become_chains_with_next_word_targets() {
        let mut v = Vocab::new();
        let text = "the cat sat\n\n  \nthe  dog\t<unk> sat \r\nsat\n";
        let s = parse_sentences(text, "s.txt", VocabMode::Grow(&mut v)).unwrap();
        assert_eq!(v.words(), &["<unk>", "the", "cat", "sat", EOS, "dog"]);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].tokens, vec![1, 2, 3]);
        assert_eq!(s[0].labels, vec![2, 3, 4]);
        assert_eq!(s[0].children(2), &[1]);
        assert_eq!(s[0].children(0), &[] as &[u32]);
        assert_eq!(s[1].tokens, vec![1, 5, 0, 3]);
        assert_eq!(s[1].labels, vec![5, 0, 3, 4]);
        assert_eq!(s[2].tokens, vec![3]);
        assert_eq!(s[2].labels, vec![4]);
        assert!(s.iter().all(|g| g.labels.iter().all(|&l| l != NO_LABEL)));
    }

    #[test]
    fn frozen_vocab_maps_unknowns_to_unk_and_needs_eos() {
        let mut v = Vocab::new();
        parse_sentences("a b", "train", VocabMode::Grow(&mut v)).unwrap();
        assert_eq!(v.len(), 4);
        let s = parse_sentences("b z a", "valid", VocabMode::Frozen(&v)).unwrap();
        assert_eq!(s[0].tokens, vec![2, 0, 1]);
        assert_eq!(s[0].labels, vec![0, 1, 3]);
        assert_eq!(v.len(), 4);
        let e = parse_sentences("a", "valid.txt", VocabMode::Frozen(&Vocab::new())).unwrap_err();
        assert!(
            matches!(e, GraphError::Structure(ref m) if m.contains("valid.txt") && m.contains(EOS)),
            "{e}"
        );
    }

    #[test]
    fn empty_or_blank_text_is_an_error_naming_the_file() {
        let mut v = Vocab::new();
        parse_sentences("a", "train", VocabMode::Grow(&mut v)).unwrap();
        for text in ["", "\n\n", " \t\r\n "] {
            for mode in [VocabMode::Grow(&mut Vocab::new()), VocabMode::Frozen(&v)] {
                let e = parse_sentences(text, "lm.txt", mode).unwrap_err();
                assert!(
                    matches!(&e, GraphError::Empty { file, what: "sentences" } if file == "lm.txt"),
                    "{text:?}: {e:?}"
                );
            }
        }
    }

    #[test]
    fn invalid_utf8_from_any_source_is_located() {
        let e = decode_utf8(b"(1 a)\n(2 \xc3(".to_vec(), "<stdin>").unwrap_err();
        assert_eq!(e.to_string(), "<stdin>:2:4: invalid UTF-8 (byte offset 9)");
        assert_eq!(decode_utf8(b"ok".to_vec(), "x").unwrap(), "ok");
    }

    #[test]
    fn read_errors_name_the_file_and_place() {
        let missing = Path::new("/nonexistent/ramus/ptb.txt");
        match read_sentences(missing, VocabMode::Grow(&mut Vocab::new())) {
            Err(GraphError::Io { path, .. }) => assert_eq!(path, missing),
            other => panic!("expected an Io error, got {other:?}"),
        }
        let dir = std::env::temp_dir().join(format!("ramus-text-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.txt");
        std::fs::write(&bad, b"ok line\ncaf\xc3\xa9 \xff here\n").unwrap();
        let result = read_sentences(&bad, VocabMode::Grow(&mut Vocab::new()));
        std::fs::remove_dir_all(&dir).unwrap();
        match result {
            Err(GraphError::Parse {
                file,
                line,
                column,
                message,
            }) => {
                assert_eq!(file, bad.display().to_string());
                assert_eq!((line, column), (2, 6), "{message}");
            }
            other => panic!("expected a parse error, got {other:?}"),
        }
    }
}
