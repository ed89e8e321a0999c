//! Pretrained word vectors in the text formats GloVe and word2vec write
//! (`.safetensors` files: [`crate::safetensors_vectors`]):
//! one word a line followed by its values, separated by spaces (word2vec's
//! first line, `COUNT DIM`, is recognised and skipped). The file is read
//! as a stream and only the vectors of words in the vocabulary are kept,
//! so memory stays `vocabulary × dimension` whatever the file's size.
//! Every line must have the same number of values; a malformed one is an
//! error naming the file, line and column.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use crate::vocab::Vocab;
use crate::GraphError;

/// The vectors of the vocabulary's words that the file holds.
#[derive(Clone, Debug, PartialEq)]
pub struct WordVectors {
    /// Values per vector.
    pub dim: usize,
    /// `(token id, vector)` of every vocabulary word the file holds (the
    /// first line of a word given twice).
    pub found: Vec<(u32, Vec<f32>)>,
    /// Words in the file (vectors read, whether kept or not).
    pub file_words: usize,
}

/// Reads the vectors of `vocab`'s words from the text file `path`;
/// `progress(bytes)` is called as the file is read.
pub fn read_text(
    path: &Path,
    vocab: &Vocab,
    progress: impl FnMut(u64),
) -> Result<WordVectors, GraphError> {
    let file = std::fs::File::open(path).map_err(|source| GraphError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&path.display().to_string(), file, vocab, progress)
}

/// [`read_text`] from any reader; `name` is the source's name in errors.
pub fn parse(
    name: &str,
    source: impl Read,
    vocab: &Vocab,
    mut progress: impl FnMut(u64),
) -> Result<WordVectors, GraphError> {
    let err = |line: usize, column: usize, message: String| GraphError::Parse {
        file: name.to_string(),
        line,
        column,
        message,
    };
    let mut reader = BufReader::with_capacity(1 << 20, source);
    let mut seen = vec![false; vocab.len()];
    let mut out = WordVectors {
        dim: 0,
        found: Vec::new(),
        file_words: 0,
    };
    let (mut line, mut read, mut text) = (0usize, 0u64, String::new());
    loop {
        text.clear();
        let n = reader.read_line(&mut text).map_err(|e| GraphError::Io {
            path: name.into(),
            source: e,
        })?;
        if n == 0 {
            break;
        }
        line += 1;
        read += n as u64;
        if line % 4096 == 0 {
            progress(read);
        }
        let body = text.trim_end_matches(['\n', '\r']);
        if body.trim().is_empty() {
            continue;
        }
        let mut fields = body.split(' ').filter(|f| !f.is_empty());
        let word = fields.next().unwrap_or_default();
        let values: Vec<&str> = fields.collect();
        if line == 1 && values.len() == 1 && word.parse::<u64>().is_ok() {
            continue; // word2vec's `COUNT DIM` header
        }
        if values.is_empty() {
            return Err(err(line, 1, format!("`{word}` has no values")));
        }
        if out.dim == 0 {
            out.dim = values.len();
        } else if values.len() != out.dim {
            return Err(err(
                line,
                word.len() + 2,
                format!(
                    "`{word}` has {} values, the lines before {} (a word with a space in it?)",
                    values.len(),
                    out.dim
                ),
            ));
        }
        out.file_words += 1;
        let Some(id) = vocab.get(word).filter(|&id| !seen[id as usize]) else {
            continue;
        };
        let mut vector = Vec::with_capacity(out.dim);
        let mut column = word.len() + 2;
        for v in &values {
            let x: f32 = v
                .parse()
                .ok()
                .filter(|x: &f32| x.is_finite())
                .ok_or_else(|| err(line, column, format!("`{v}` is not a finite number")))?;
            vector.push(x);
            column += v.len() + 1;
        }
        seen[id as usize] = true;
        out.found.push((id, vector));
    }
    progress(read);
    if out.file_words == 0 {
        return Err(GraphError::Empty {
            file: name.into(),
            what: "word vectors",
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(words: &[&str]) -> Vocab {
        let mut v = Vocab::new();
        words.iter().for_each(|w| {
            v.add(w);
        });
        v
    }

    #[test]
    fn keeps_the_vocabulary_s_words_of_glove_and_word2vec_files() {
        let v = vocab(&["the", "cat"]);
        let glove = "the 0.1 0.2\ndog 1 2\ncat -1 3.5e-1\n";
        let got = parse("g.txt", glove.as_bytes(), &v, |_| {}).unwrap();
        assert_eq!(got.dim, 2);
        assert_eq!(got.file_words, 3);
        assert_eq!(got.found, vec![(1, vec![0.1, 0.2]), (2, vec![-1.0, 0.35])]);
        let word2vec = format!("3 2\n{glove}");
        assert_eq!(
            parse("w.txt", word2vec.as_bytes(), &v, |_| {}).unwrap(),
            got
        );
    }

    #[test]
    fn malformed_lines_are_located() {
        let v = vocab(&["a"]);
        let cases = [
            (
                "a 1 2\nb 1\n",
                "w.txt:2:3: `b` has 1 values, the lines before 2",
            ),
            ("a 1 x\n", "w.txt:1:5: `x` is not a finite number"),
            ("a 1 nan\n", "w.txt:1:5: `nan` is not a finite number"),
            ("a\n", "w.txt:1:1: `a` has no values"),
            ("\n\n", "w.txt: no word vectors to read"),
        ];
        for (text, want) in cases {
            let e = parse("w.txt", text.as_bytes(), &v, |_| {}).unwrap_err();
            assert!(e.to_string().starts_with(want), "{text:?}: {e}");
        }
    }
}
