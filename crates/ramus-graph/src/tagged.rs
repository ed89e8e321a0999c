//! Reader for tagged text — one sentence a line, tokens `word|TAG`
//! separated by whitespace, as in the WikiNER corpus of the DyNet benchmark
//! (`010|I-MISC is|O the|O tenth|O album|O ...`, IOB tags) — and what the
//! BiLSTM taggers need from it: a deterministic train / dev / test split of
//! one file, the word, tag and character vocabularies of the training
//! sentences, training word frequencies, and each sentence as a tagger
//! graph ([`crate::sequence::tagger_graph`]).
//!
//! A token is split at its *last* `|`, so a word may itself contain `|`
//! but a tag may not. Blank lines are skipped. Errors carry the file, the
//! 1-based line and the 1-based character column of the offending token.
//!
//! # Rare words
//!
//! [`TaggedVocab::build`] keeps in the word vocabulary only the words seen
//! at least `min_count` times in the training sentences (plus `<unk>`,
//! id 0). A word *not* in the vocabulary is **rare**: the plain tagger reads
//! it as `<unk>`, the character tagger spells it out through its character
//! LSTMs instead (DyNet's `bilstm-tagger-withchar` does this for words seen
//! fewer than 5 times). Deciding rarity by vocabulary membership alone means
//! that a checkpoint's vocabulary is all that is needed to rebuild the same
//! graphs later.

use std::collections::HashMap;
use std::path::Path;

use crate::input::{InputGraph, NO_LABEL};
use crate::sequence::{tagger_graph, WordInput};
use crate::text::read_utf8;
use crate::vocab::Vocab;
use crate::GraphError;

/// Every `SPLIT_PERIOD`-th sentence of a file goes to test, the one before
/// it to dev (see [`split_tagged`]).
pub const SPLIT_PERIOD: usize = 10;

/// The DyNet benchmark's threshold: words seen fewer times than this in
/// training are spelled out by the character tagger.
pub const RARE_BELOW: usize = 5;

/// One tagged sentence as read, with where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaggedSentence {
    /// 1-based line of the sentence in its file.
    pub line: usize,
    /// 1-based character column of each token.
    pub columns: Vec<usize>,
    pub words: Vec<String>,
    /// One tag per word; none for a line read without tags
    /// ([`Tags::Optional`]).
    pub tags: Vec<String>,
}

impl TaggedSentence {
    /// Number of words.
    pub fn len(&self) -> usize {
        self.words.len()
    }
    /// True for a sentence without words (never produced by the parser).
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }
}

/// Whether every token must carry its tag (`word|TAG`: training and
/// evaluation), or a line may give its words alone (prediction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tags {
    /// Every token is `word|TAG`.
    Required,
    /// A line is either all `word|TAG` or all plain words (split at
    /// whitespace, read without tags: [`TaggedSentence::tags`] empty); a
    /// line mixing both is an error naming the first token that differs.
    /// A plain word holding `|` reads as tagged.
    Optional,
}

/// Parses every non-blank line of `text` as a tagged sentence; `file_name`
/// labels errors (a token without `|`, with an empty word or an empty tag;
/// text without a sentence, [`GraphError::Empty`]).
pub fn parse_tagged(text: &str, file_name: &str) -> Result<Vec<TaggedSentence>, GraphError> {
    parse_tagged_with(text, file_name, Tags::Required)
}

/// [`parse_tagged`], with the tags `tags` says.
pub fn parse_tagged_with(
    text: &str,
    file_name: &str,
    tags: Tags,
) -> Result<Vec<TaggedSentence>, GraphError> {
    let mut out = Vec::new();
    for (k, line) in text.lines().enumerate() {
        let s = parse_line(line, k + 1, tags).map_err(|(column, message)| GraphError::Parse {
            file: file_name.to_string(),
            line: k + 1,
            column,
            message,
        })?;
        if !s.words.is_empty() {
            out.push(s);
        }
    }
    if out.is_empty() {
        return Err(GraphError::Empty {
            file: file_name.to_string(),
            what: "tagged sentences",
        });
    }
    Ok(out)
}

/// Line `line` of a tagged file, or the column of its first bad token and
/// what is wrong with it.
fn parse_line(text: &str, line: usize, tags: Tags) -> Result<TaggedSentence, (usize, String)> {
    let mut s = TaggedSentence {
        line,
        columns: Vec::new(),
        words: Vec::new(),
        tags: Vec::new(),
    };
    // with optional tags, whether the line's first token had one
    let mut tagged: Option<bool> = None;
    let mut token = String::new();
    let mut token_column = 0;
    // walk characters so that columns count characters, not bytes
    for (column, c) in (1..).zip(text.chars().chain(std::iter::once(' '))) {
        if !c.is_whitespace() {
            if token.is_empty() {
                token_column = column;
            }
            token.push(c);
            continue;
        }
        if token.is_empty() {
            continue;
        }
        let has_tag = tags == Tags::Required || token.contains('|');
        match (*tagged.get_or_insert(has_tag), has_tag) {
            (true, true) => {
                let (word, tag) = split_token(&token).map_err(|m| (token_column, m))?;
                s.words.push(word.to_string());
                s.tags.push(tag.to_string());
            }
            (false, false) => s.words.push(token.clone()),
            (true, false) => {
                return Err((
                    token_column,
                    format!("token {token:?} has no `|TAG` but the line's first token has one (tag every word of a line or none)"),
                ))
            }
            (false, true) => {
                return Err((
                    token_column,
                    format!("token {token:?} has a `|TAG` but the line's first token has none (tag every word of a line or none)"),
                ))
            }
        }
        s.columns.push(token_column);
        token.clear();
    }
    Ok(s)
}

/// `word|TAG` split at the last `|`, or why it cannot be.
fn split_token(token: &str) -> Result<(&str, &str), String> {
    match token.rsplit_once('|') {
        None => Err(format!("token {token:?} has no `|TAG` (expected word|TAG)")),
        Some(("", _)) => Err(format!("token {token:?} has an empty word")),
        Some((_, "")) => Err(format!("token {token:?} has an empty tag")),
        Some(pair) => Ok(pair),
    }
}

/// Reads a tagged-text file (one sentence a line, blank lines skipped; at
/// least one sentence).
pub fn read_tagged(path: &Path) -> Result<Vec<TaggedSentence>, GraphError> {
    read_tagged_with(path, Tags::Required)
}

/// [`read_tagged`], with the tags `tags` says.
pub fn read_tagged_with(path: &Path, tags: Tags) -> Result<Vec<TaggedSentence>, GraphError> {
    let text = read_utf8(path)?;
    parse_tagged_with(&text, &path.display().to_string(), tags)
}

/// Train, dev and test sentences.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaggedSplits {
    pub train: Vec<TaggedSentence>,
    pub dev: Vec<TaggedSentence>,
    pub test: Vec<TaggedSentence>,
}

/// Splits one file's sentences by position: sentence `i` (0-based, file
/// order) goes to test when `i % 10 == 9`, to dev when `i % 10 == 8`, and
/// to train otherwise — 80 / 10 / 10, the same on every run and machine,
/// and every part spread evenly over the file.
pub fn split_tagged(sentences: Vec<TaggedSentence>) -> TaggedSplits {
    let mut out = TaggedSplits::default();
    for (i, s) in sentences.into_iter().enumerate() {
        match i % SPLIT_PERIOD {
            r if r == SPLIT_PERIOD - 1 => out.test.push(s),
            r if r == SPLIT_PERIOD - 2 => out.dev.push(s),
            _ => out.train.push(s),
        }
    }
    out
}

/// Word, tag and character vocabularies (see the module docs for which
/// words are kept).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaggedVocab {
    /// Words seen at least `min_count` times in training, `<unk>` at id 0.
    pub words: Vocab,
    /// Tags in first-seen order; a tag's label is its index.
    pub tags: Vec<String>,
    /// Characters of every training word, `<unk>` at id 0 (for characters
    /// never seen in training).
    pub chars: Vocab,
    /// How often each word occurs in the training sentences (empty for a
    /// vocabulary rebuilt with [`TaggedVocab::from_parts`]).
    pub counts: HashMap<String, usize>,
    tag_ids: HashMap<String, i32>,
}

impl TaggedVocab {
    /// The vocabularies of `train`, keeping the words seen at least
    /// `min_count` times (ids in first-seen order).
    pub fn build(train: &[TaggedSentence], min_count: usize) -> TaggedVocab {
        let counts = word_counts(train);
        let mut words = Vocab::new();
        let mut chars = Vocab::new();
        let mut tags = Vec::new();
        let mut tag_ids = HashMap::new();
        for s in train {
            for (w, t) in s.words.iter().zip(&s.tags) {
                if counts.get(w).copied().unwrap_or(0) >= min_count {
                    words.add(w);
                }
                let mut buf = [0u8; 4];
                for c in w.chars() {
                    chars.add(c.encode_utf8(&mut buf));
                }
                if !tag_ids.contains_key(t) {
                    tag_ids.insert(t.clone(), tags.len() as i32);
                    tags.push(t.clone());
                }
            }
        }
        TaggedVocab {
            words,
            tags,
            chars,
            counts,
            tag_ids,
        }
    }

    /// Vocabularies kept elsewhere (a checkpoint): tags must be distinct and
    /// every character entry but `<unk>` one character.
    pub fn from_parts(words: Vocab, tags: Vec<String>, chars: Vocab) -> Result<Self, GraphError> {
        let mut tag_ids = HashMap::new();
        for (i, t) in tags.iter().enumerate() {
            if tag_ids.insert(t.clone(), i as i32).is_some() {
                return Err(GraphError::Structure(format!(
                    "tag {t:?} appears twice in the tag list"
                )));
            }
        }
        if let Some(bad) = chars.words()[1..].iter().find(|c| c.chars().count() != 1) {
            return Err(GraphError::Structure(format!(
                "character vocabulary entry {bad:?} is not one character"
            )));
        }
        Ok(TaggedVocab {
            words,
            tags,
            chars,
            counts: HashMap::new(),
            tag_ids,
        })
    }

    /// The label of `tag`, if it is a training tag.
    pub fn tag_id(&self, tag: &str) -> Option<i32> {
        self.tag_ids.get(tag).copied()
    }

    /// True when `word` is not in the word vocabulary (see the module docs).
    pub fn is_rare(&self, word: &str) -> bool {
        self.words.get(word).is_none()
    }

    /// The character ids of `word` (unknown characters are `<unk>`, 0).
    pub fn spell(&self, word: &str) -> Vec<u32> {
        let mut buf = [0u8; 4];
        word.chars()
            .map(|c| self.chars.id(c.encode_utf8(&mut buf)))
            .collect()
    }

    /// Sentence `s` (read from `file`) as a tagger graph: with `chars`,
    /// rare words are spelled out for the character LSTMs, else they are
    /// `<unk>`; a sentence without tags has unlabelled outputs. A tag outside [`TaggedVocab::tags`] is an error naming the
    /// token.
    pub fn graph(
        &self,
        s: &TaggedSentence,
        file: &str,
        chars: bool,
    ) -> Result<InputGraph, GraphError> {
        // an untagged sentence: its outputs unlabelled
        let mut labels = if s.tags.is_empty() {
            vec![NO_LABEL; s.len()]
        } else {
            Vec::with_capacity(s.len())
        };
        for (k, (w, t)) in s.words.iter().zip(&s.tags).enumerate() {
            let label = self.tag_id(t).ok_or_else(|| GraphError::Parse {
                file: file.to_string(),
                line: s.line,
                column: s.columns.get(k).copied().unwrap_or(1),
                message: format!(
                    "token {w}|{t}: tag {t:?} is not one of the {} training tags ({})",
                    self.tags.len(),
                    self.tags.join(", ")
                ),
            })?;
            labels.push(label);
        }
        let spelled: Vec<Option<Vec<u32>>> = s
            .words
            .iter()
            .map(|w| (chars && self.is_rare(w)).then(|| self.spell(w)))
            .collect();
        let inputs: Vec<WordInput<'_>> = s
            .words
            .iter()
            .zip(&spelled)
            .map(|(w, sp)| match sp {
                Some(cs) => WordInput::Chars(cs),
                None => WordInput::Token(self.words.id(w)),
            })
            .collect();
        let graph = tagger_graph(&inputs, &labels).map_err(|e| GraphError::Parse {
            file: file.to_string(),
            line: s.line,
            column: 1,
            message: e.to_string(),
        })?;
        Ok(graph.with_origin(crate::Origin {
            file: file.into(),
            line: s.line,
        }))
    }

    /// Every sentence of `sentences` as a tagger graph ([`TaggedVocab::graph`]).
    pub fn graphs(
        &self,
        sentences: &[TaggedSentence],
        file: &str,
        chars: bool,
    ) -> Result<Vec<InputGraph>, GraphError> {
        sentences
            .iter()
            .map(|s| self.graph(s, file, chars))
            .collect()
    }
}

/// How often each word occurs in `sentences`.
pub fn word_counts(sentences: &[TaggedSentence]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for w in sentences.iter().flat_map(|s| &s.words) {
        *counts.entry(w.clone()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::tagger_kinds as k;
    use crate::NO_LABEL;

    const TEXT: &str = "The|O Mad|I-ORG Capsule|I-ORG .|O\n\n  \nMad|I-ORG a|b|O\tgo|O\n";

    #[test]
    fn parses_words_tags_lines_and_columns() {
        let s = parse_tagged(TEXT, "t.txt").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].words, ["The", "Mad", "Capsule", "."]);
        assert_eq!(s[0].tags, ["O", "I-ORG", "I-ORG", "O"]);
        assert_eq!(s[0].columns, [1, 7, 17, 31]);
        assert_eq!(s[0].line, 1);
        // blank lines are skipped but counted; a word may hold `|`
        assert_eq!(s[1].line, 4);
        assert_eq!(s[1].words, ["Mad", "a|b", "go"]);
        assert_eq!(s[1].tags, ["I-ORG", "O", "O"]);
    }

    #[test]
    fn malformed_tokens_are_located() {
        for (text, col, needle) in [
            ("ok|O bad ok|O", 6, "no `|TAG`"),
            ("ok|O |O", 6, "empty word"),
            ("ok|O\nék|O x|", 6, "empty tag"),
        ] {
            let e = parse_tagged(text, "f.txt").unwrap_err().to_string();
            let line = 1 + text.matches('\n').count();
            assert!(e.starts_with(&format!("f.txt:{line}:{col}:")), "{e}");
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn optional_tags_read_plain_lines_and_refuse_mixed_ones() {
        let s = parse_tagged_with("a b|c\nx|O y|I", "p", Tags::Optional).unwrap_err();
        assert!(s.to_string().starts_with("p:1:3:"), "{s}");
        let s = parse_tagged_with("x|O y\n", "p", Tags::Optional).unwrap_err();
        assert!(s.to_string().contains("has no `|TAG`"), "{s}");
        let s = parse_tagged_with("Mad Capsule\nx|O y|X", "p", Tags::Optional).unwrap();
        assert_eq!(s[0].words, ["Mad", "Capsule"]);
        assert!(s[0].tags.is_empty());
        assert_eq!(s[1].tags, ["O", "X"]);
        let v = TaggedVocab::build(&s[1..], 1);
        let g = v.graph(&s[0], "p", false).unwrap();
        assert!(g.labels.iter().all(|&l| l == NO_LABEL));
        assert!(parse_tagged("Mad Capsule", "p").is_err());
    }

    #[test]
    fn empty_or_blank_text_is_an_error_naming_the_file() {
        for text in ["", "\n \n", "\t\r\n"] {
            let e = parse_tagged(text, "ner.txt").unwrap_err();
            assert!(
                matches!(&e, GraphError::Empty { file, .. } if file == "ner.txt"),
                "{text:?}: {e:?}"
            );
        }
    }

    #[test]
    fn split_is_by_position_and_deterministic() {
        let text: String = (0..25).map(|i| format!("w{i}|O\n")).collect();
        let all = parse_tagged(&text, "s").unwrap();
        let a = split_tagged(all.clone());
        let b = split_tagged(all);
        assert_eq!(a, b);
        let firsts =
            |v: &[TaggedSentence]| v.iter().map(|s| s.words[0].clone()).collect::<Vec<_>>();
        assert_eq!(firsts(&a.test), ["w9", "w19"]);
        assert_eq!(firsts(&a.dev), ["w8", "w18"]);
        assert_eq!(a.train.len(), 21);
        assert!(!firsts(&a.train).contains(&"w9".to_string()));
    }

    #[test]
    fn vocabularies_counts_and_rare_words() {
        let s = parse_tagged("a|O b|X a|O\na|O c|Y", "v").unwrap();
        let v = TaggedVocab::build(&s, 2);
        assert_eq!(v.counts["a"], 3);
        assert_eq!(v.counts["b"], 1);
        assert_eq!(v.words.words(), ["<unk>", "a"]);
        assert_eq!(v.tags, ["O", "X", "Y"]);
        assert_eq!(v.tag_id("Y"), Some(2));
        assert_eq!(v.chars.words(), ["<unk>", "a", "b", "c"]);
        assert!(v.is_rare("b") && !v.is_rare("a"));
        assert_eq!(v.spell("cab?"), [3, 1, 2, 0]);
        let all = TaggedVocab::build(&s, 1);
        assert_eq!(all.words.len(), 4);
    }

    #[test]
    fn sentences_become_tagger_graphs() {
        let s = parse_tagged("a|O bc|X a|O", "g").unwrap();
        let v = TaggedVocab::build(&s, 2);
        // plain: 3 vertices per word, `bc` is <unk>
        let g = v.graph(&s[0], "g", false).unwrap();
        assert_eq!(g.len(), 9);
        assert_eq!(&g.tokens[0..3], &[1, 0, 1]);
        let outs: Vec<i32> = (6..9).map(|i| g.labels[i]).collect();
        assert_eq!(outs, [0, 1, 0]);
        assert!(g.labels[..6].iter().all(|&l| l == NO_LABEL));
        // with characters: `bc` is spelled (2 + 2 char vertices)
        let g = v.graph(&s[0], "g", true).unwrap();
        assert_eq!(g.len(), 13);
        assert_eq!(&g.tokens[0..4], &[2, 3, 3, 2]);
        assert_eq!(g.kind(0), k::CHAR_FORWARD);
        assert_eq!(g.kind(3), k::CHAR_BACKWARD);
        assert_eq!(g.kind(5), k::FORWARD_FROM_CHARS);
    }

    #[test]
    fn unknown_tags_name_the_token() {
        let train = parse_tagged("a|O b|X", "train").unwrap();
        let v = TaggedVocab::build(&train, 1);
        let test = parse_tagged("\nb|X  a|Z", "test").unwrap();
        let e = v
            .graph(&test[0], "test.txt", false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("test.txt:2:6:"), "{e}");
        assert!(e.contains("a|Z") && e.contains("O, X"), "{e}");
    }

    #[test]
    fn parts_are_checked() {
        let chars = Vocab::from_words(vec!["<unk>".into(), "ab".into()]).unwrap();
        assert!(TaggedVocab::from_parts(Vocab::new(), vec!["O".into()], chars).is_err());
        let twice = vec!["O".to_string(), "O".to_string()];
        assert!(TaggedVocab::from_parts(Vocab::new(), twice, Vocab::new()).is_err());
        let ok = TaggedVocab::from_parts(Vocab::new(), vec!["O".into(), "X".into()], Vocab::new())
            .unwrap();
        assert_eq!(ok.tag_id("X"), Some(1));
    }
}
