//! Reader and writer for labelled PTB-bracket trees, one tree a line, as in
//! the Stanford Sentiment Treebank: `(3 (2 It) (4 (2 's) (3 (2 a) (2 film))))`.
//!
//! A node is `(LABEL CHILD...)` with child nodes, or `(LABEL TEXT...)` for a
//! leaf. Labels are non-negative integers that fit in `i32`. A leaf's text
//! may be several whitespace-separated tokens (SST has `(2 8 1\/2)`, whose
//! separator is a no-break space); the leaf's word is those tokens joined by
//! single ASCII spaces, with the escapes `\/` and `\*` undone.
//!
//! Trees become [`InputGraph`]s in post-order: a vertex is appended when its
//! closing parenthesis is read, so children come before parents and the root
//! is last. Internal vertices get token 0; a leaf gets its word's id from the
//! [`VocabMode`]. The parser keeps an explicit stack (no recursion), so
//! arbitrarily deep trees cannot overflow the call stack. Errors carry the
//! file, 1-based line and 1-based character column of the offending
//! character.

use std::path::Path;

use crate::input::{InputGraph, NO_LABEL};
use crate::vocab::{Vocab, VocabMode};
use crate::GraphError;

/// A node whose closing parenthesis has not been read yet.
struct Open {
    /// 1-based column of its `(`.
    column: usize,
    label: i32,
    children: Vec<u32>,
    /// The leaf word so far (tokens joined by single spaces), if any text was read.
    text: Option<String>,
}

/// Parses one tree from `text` (one line of a treebank file). `file` and
/// `line` (1-based) only label errors. Leaves are looked up in (or, with
/// [`VocabMode::Grow`], added to) `vocab`.
pub fn parse_tree(
    text: &str,
    vocab: &mut VocabMode<'_>,
    file: &str,
    line: usize,
) -> Result<InputGraph, GraphError> {
    let mut p = Parser {
        chars: text.chars().collect(),
        file,
        line,
        graph: InputGraph::new(),
        stack: Vec::new(),
        finished: false,
    };
    let n = p.chars.len();
    let mut i = 0;
    while i < n {
        let c = p.chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if p.finished {
            return Err(p.err(i + 1, format!("unexpected {c:?} after the end of the tree")));
        }
        i = match c {
            '(' => p.open(i)?,
            ')' => p.close(i, vocab)?,
            _ => p.text(i)?,
        };
    }
    p.finish()
}

/// One line's parse in progress: the tree so far and its open nodes.
struct Parser<'a> {
    chars: Vec<char>,
    file: &'a str,
    line: usize,
    graph: InputGraph,
    stack: Vec<Open>,
    /// The root was closed.
    finished: bool,
}

impl Parser<'_> {
    /// An error at 1-based `column` of the line.
    fn err(&self, column: usize, message: String) -> GraphError {
        parse_error(self.file, self.line, column, message)
    }

    /// Index of the first character at or after `i` that ends a token.
    fn token_end(&self, mut i: usize) -> usize {
        let chars = &self.chars;
        while i < chars.len() && !chars[i].is_whitespace() && chars[i] != '(' && chars[i] != ')' {
            i += 1;
        }
        i
    }

    /// Opens a node at the `(` at `i` and reads its label; returns where
    /// parsing goes on.
    fn open(&mut self, mut i: usize) -> Result<usize, GraphError> {
        let (chars, n) = (&self.chars, self.chars.len());
        if let Some(top) = self.stack.last() {
            if top.text.is_some() {
                return Err(self.err(
                    i + 1,
                    format!(
                        "node opened at column {} mixes text and child nodes",
                        top.column
                    ),
                ));
            }
        }
        let column = i + 1;
        i += 1;
        while i < n && chars[i].is_whitespace() {
            i += 1;
        }
        let end = self.token_end(i);
        if end == i {
            return Err(match chars.get(i) {
                Some(')') if i == column => self.err(i + 1, "empty node '()'".to_string()),
                Some(c) => self.err(
                    i + 1,
                    format!("missing label: expected an integer after '(', found {c:?}"),
                ),
                None => self.err(i + 1, "missing label: line ends after '('".to_string()),
            });
        }
        let label_text: String = chars[i..end].iter().collect();
        let label = parse_label(&label_text).map_err(|m| self.err(i + 1, m))?;
        self.stack.push(Open {
            column,
            label,
            children: Vec::new(),
            text: None,
        });
        Ok(end)
    }

    /// Closes the open node at the `)` at `i`: a leaf's word becomes its
    /// token; returns where parsing goes on.
    fn close(&mut self, i: usize, vocab: &mut VocabMode<'_>) -> Result<usize, GraphError> {
        let Some(open) = self.stack.pop() else {
            return Err(self.err(i + 1, "unbalanced ')': no node is open".to_string()));
        };
        let id = match open.text {
            Some(word) => self
                .graph
                .push_vertex(&[], vocab.lookup(&word), open.label)?,
            None if open.children.is_empty() => {
                return Err(self.err(
                    i + 1,
                    format!(
                        "node opened at column {} has a label but no text or children",
                        open.column
                    ),
                ))
            }
            None => self.graph.push_vertex(&open.children, 0, open.label)?,
        };
        match self.stack.last_mut() {
            Some(parent) => parent.children.push(id),
            None => self.finished = true,
        }
        Ok(i + 1)
    }

    /// Appends the token at `i` to the open leaf's word; returns where
    /// parsing goes on.
    fn text(&mut self, i: usize) -> Result<usize, GraphError> {
        let c = self.chars[i];
        let end = self.token_end(i);
        let (file, line) = (self.file, self.line);
        let Some(top) = self.stack.last_mut() else {
            return Err(parse_error(
                file,
                line,
                i + 1,
                format!("expected '(' to start a tree, found {c:?}"),
            ));
        };
        if !top.children.is_empty() {
            return Err(parse_error(
                file,
                line,
                i + 1,
                format!(
                    "node opened at column {} mixes child nodes and text",
                    top.column
                ),
            ));
        }
        let word = top.text.get_or_insert_with(String::new);
        if !word.is_empty() {
            word.push(' ');
        }
        unescape_into(&self.chars[i..end], word);
        Ok(end)
    }

    /// The finished tree, or the error of a line whose tree is not closed
    /// or missing.
    fn finish(self) -> Result<InputGraph, GraphError> {
        if let Some(open) = self.stack.last() {
            return Err(self.err(
                open.column,
                format!("unbalanced '(': {} node(s) still open at the end of the line; this one is never closed", self.stack.len()),
            ));
        }
        if !self.finished {
            return Err(self.err(1, "no tree on this line".to_string()));
        }
        Ok(self.graph.with_origin(crate::Origin {
            file: self.file.into(),
            line: self.line,
        }))
    }
}

/// An error at `file:line:column`.
fn parse_error(file: &str, line: usize, column: usize, message: String) -> GraphError {
    GraphError::Parse {
        file: file.to_string(),
        line,
        column,
        message,
    }
}

/// A label: decimal digits only, fitting in `i32`.
fn parse_label(s: &str) -> Result<i32, String> {
    if !s.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("label {s:?} is not a non-negative integer"));
    }
    s.parse::<i32>()
        .map_err(|_| format!("label {s} is too large (at most {})", i32::MAX))
}

/// Appends `token` to `out`, turning `\/` into `/` and `\*` into `*`.
fn unescape_into(token: &[char], out: &mut String) {
    let mut k = 0;
    while k < token.len() {
        if token[k] == '\\' && matches!(token.get(k + 1), Some('/' | '*')) {
            out.push(token[k + 1]);
            k += 2;
        } else {
            out.push(token[k]);
            k += 1;
        }
    }
}

/// Parses every non-blank line of `text` as a tree; `file_name` labels
/// errors. Text without a tree (empty or blank) is [`GraphError::Empty`].
pub fn parse_trees(
    text: &str,
    file_name: &str,
    mut vocab: VocabMode<'_>,
) -> Result<Vec<InputGraph>, GraphError> {
    let mut trees = Vec::new();
    for (k, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        trees.push(parse_tree(line, &mut vocab, file_name, k + 1)?);
    }
    if trees.is_empty() {
        return Err(GraphError::Empty {
            file: file_name.to_string(),
            what: "trees",
        });
    }
    Ok(trees)
}

/// Reads a treebank file (one tree a line, blank lines skipped; at least one tree).
pub fn read_trees(path: &Path, vocab: VocabMode<'_>) -> Result<Vec<InputGraph>, GraphError> {
    let text = crate::text::read_utf8(path)?;
    parse_trees(&text, &path.display().to_string(), vocab)
}

/// Renders a tree back to one line of the bracket format, escaping `/` and
/// `*` in leaf words, so that [`parse_tree`] reads back an equal graph.
///
/// Fails when `graph` is not a single tree, when a vertex has no label, when
/// an internal vertex has a nonzero token (the format has no place for it),
/// or when a leaf's token is not in `vocab` or its word cannot be written so
/// that it reads back unchanged (empty, parentheses, irregular whitespace).
pub fn write_tree(graph: &InputGraph, vocab: &Vocab) -> Result<String, GraphError> {
    let roots = graph.roots();
    let root = match roots.as_slice() {
        [r] if graph.is_forest() => *r,
        [] => {
            return Err(GraphError::Structure(
                "cannot write an empty graph as a tree".to_string(),
            ))
        }
        _ => {
            return Err(GraphError::Structure(format!(
                "cannot write a graph with {} roots{} as one tree",
                roots.len(),
                if graph.is_forest() {
                    ""
                } else {
                    " and shared children"
                }
            )))
        }
    };

    enum Step {
        Open(u32),
        Close,
    }
    let mut out = String::new();
    let mut todo = vec![Step::Open(root)];
    while let Some(step) = todo.pop() {
        let v = match step {
            Step::Close => {
                out.push(')');
                continue;
            }
            Step::Open(v) => v as usize,
        };
        if !out.is_empty() {
            out.push(' ');
        }
        let label = graph.labels[v];
        if label < 0 {
            return Err(GraphError::Structure(format!(
                "vertex {v} has {} (label {label}); every node of a bracket tree needs a label",
                if label == NO_LABEL {
                    "no label"
                } else {
                    "a negative label"
                }
            )));
        }
        out.push('(');
        out.push_str(&label.to_string());
        let token = graph.tokens[v];
        let children = graph.children(v);
        if children.is_empty() {
            let word = vocab.word(token).ok_or_else(|| {
                GraphError::Structure(format!(
                    "vertex {v}: token {token} is not in the vocabulary ({} words)",
                    vocab.len()
                ))
            })?;
            check_writable(v, word)?;
            out.push(' ');
            for c in word.chars() {
                if c == '/' || c == '*' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push(')');
        } else {
            if token != 0 {
                return Err(GraphError::Structure(format!(
                    "vertex {v} has children and token {token}; internal nodes of a bracket tree carry no word"
                )));
            }
            todo.push(Step::Close);
            todo.extend(children.iter().rev().map(|&c| Step::Open(c)));
        }
    }
    Ok(out)
}

/// Errors unless `word` reads back unchanged after being written as leaf text.
fn check_writable(v: usize, word: &str) -> Result<(), GraphError> {
    let problem = if word.is_empty() {
        Some("is empty")
    } else if word.contains(['(', ')']) {
        Some("contains a parenthesis")
    } else if word.split_whitespace().collect::<Vec<_>>().join(" ") != word {
        Some("has whitespace other than single spaces between tokens")
    } else {
        None
    };
    match problem {
        Some(p) => Err(GraphError::Structure(format!(
            "vertex {v}: leaf word {word:?} {p}, so it cannot be written as bracket-tree text"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grow(text: &str, vocab: &mut Vocab) -> Result<InputGraph, GraphError> {
        parse_tree(text, &mut VocabMode::Grow(vocab), "t.txt", 7)
    }

    /// (line, column, message) of the parse error for `text`.
    fn error_at(text: &str) -> (usize, usize, String) {
        let mut v = Vocab::new();
        match grow(text, &mut v) {
            Err(GraphError::Parse {
                file,
                line,
                column,
                message,
            }) => {
                assert_eq!(file, "t.txt");
                (line, column, message)
            }
            other => panic!("expected a parse error for {text:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_in_post_order() {
        let mut v = Vocab::new();
        let g = grow("(3 (2 It) (4 (2 's) (3 (2 a) (2 film))))", &mut v).unwrap();
        assert_eq!(g.len(), 7);
        assert_eq!(g.labels, vec![2, 2, 2, 2, 3, 4, 3]);
        assert_eq!(g.tokens, vec![1, 2, 3, 4, 0, 0, 0]);
        assert_eq!(v.words(), &["<unk>", "It", "'s", "a", "film"]);
        assert_eq!(g.children(4), &[2, 3]);
        assert_eq!(g.children(5), &[1, 4]);
        assert_eq!(g.children(6), &[0, 5]);
        assert_eq!(g.roots(), vec![6]);
        assert_eq!(g.root_label(), Some(3));
    }

    #[test]
    fn leaf_text_tokens_are_joined_and_unescaped() {
        let mut v = Vocab::new();
        let g = grow(
            "(2 (2 8 1\\/2) (1 \\*\\*)  (3\t a\\b  \u{a0}c\\/ ))",
            &mut v,
        )
        .unwrap();
        assert_eq!(v.words(), &["<unk>", "8 1/2", "**", "a\\b c/"]);
        assert_eq!(g.tokens, vec![1, 2, 3, 0]);
        assert_eq!(g.children(3), &[0, 1, 2]);
        // SST writes "8 1\/2" with a no-break space; it reads as the same word.
        grow("(2 8\u{a0}1\\/2)", &mut v).unwrap();
        assert_eq!(v.len(), 4);
    }

    #[test]
    fn frozen_vocab_maps_unknown_words_to_unk() {
        let mut v = Vocab::new();
        v.add("good");
        let g = parse_tree("(3 (3 good) (2 film))", &mut VocabMode::Frozen(&v), "f", 1).unwrap();
        assert_eq!(g.tokens, vec![1, 0, 0]);
        assert_eq!(v.len(), 2);
    }

    #[test]
    fn accepts_large_labels_and_loose_spacing() {
        let mut v = Vocab::new();
        let g = grow(&format!("  ( {} (0 a)(7(1 b)) ) ", i32::MAX), &mut v).unwrap();
        assert_eq!(g.labels, vec![0, 1, 7, i32::MAX]);
        assert_eq!(g.children(2), &[1]);
    }

    #[test]
    fn malformed_lines_report_line_and_column() {
        let cases: &[(&str, usize, &str)] = &[
            ("(3 (2 a) (2 b)", 1, "never closed"),
            ("(3 (2 a) (2 b", 10, "never closed"),
            ("(3 (2 a)) (2 b))", 11, "after the end"),
            ("(3 (2 a)))", 10, "after the end"),
            ("(2 a))", 6, "after the end"),
            (")", 1, "unbalanced ')'"),
            ("(3 (2 a) ())", 11, "empty node"),
            ("()", 2, "empty node"),
            ("(3 (a) (2 b))", 5, "not a non-negative integer"),
            ("(3 ( ) (2 b))", 6, "missing label"),
            ("(3 ((2 a) (2 b)))", 5, "missing label"),
            ("(", 2, "line ends"),
            ("(x (2 a))", 2, "\"x\" is not a non-negative integer"),
            ("(3 (-1 a) (2 b))", 5, "\"-1\""),
            ("(3 (2.5 a))", 5, "\"2.5\""),
            ("(3 (2147483648 a))", 5, "too large"),
            ("(3 (2 a) (2))", 12, "no text or children"),
            ("(3 word (2 a))", 9, "mixes text and child nodes"),
            ("(3 (2 a) word)", 10, "mixes child nodes and text"),
            ("word (2 a)", 1, "expected '('"),
            ("(2 caf\u{e9}) \u{e9}", 10, "after the end"),
        ];
        for &(text, column, needle) in cases {
            let (line, col, message) = error_at(text);
            assert_eq!((line, col), (7, column), "{text:?}: {message}");
            assert!(
                message.contains(needle),
                "{text:?}: {message:?} lacks {needle:?}"
            );
        }
        assert!(error_at("   ").2.contains("no tree"));
    }

    #[test]
    fn parse_trees_skips_blank_lines_and_numbers_lines() {
        let mut v = Vocab::new();
        let text = "(1 a)\n\n   \r\n(2 b)\r\n(3 c)\n";
        let trees = parse_trees(text, "x.txt", VocabMode::Grow(&mut v)).unwrap();
        assert_eq!(trees.len(), 3);
        assert_eq!(
            trees.iter().map(|t| t.labels[0]).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(v.len(), 4);
        let err = parse_trees("(1 a)\n\n(2 b))\n", "x.txt", VocabMode::Grow(&mut v)).unwrap_err();
        assert!(
            matches!(&err, GraphError::Parse { file, line: 3, column: 6, .. } if file == "x.txt"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "x.txt:3:6: unexpected ')' after the end of the tree"
        );
    }

    #[test]
    fn empty_or_blank_text_is_an_error_naming_the_file() {
        for text in ["", "\n", "  \r\n\t\n \u{a0}\n"] {
            let e = parse_trees(text, "e.txt", VocabMode::Grow(&mut Vocab::new())).unwrap_err();
            assert!(
                matches!(&e, GraphError::Empty { file, what: "trees" } if file == "e.txt"),
                "{text:?}: {e:?}"
            );
            assert!(e.to_string().starts_with("e.txt: no trees"), "{e}");
        }
    }

    #[test]
    fn read_trees_reports_missing_file() {
        let path = Path::new("/nonexistent/ramus/trees.txt");
        match read_trees(path, VocabMode::Grow(&mut Vocab::new())) {
            Err(GraphError::Io { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected an Io error, got {other:?}"),
        }
    }

    #[test]
    fn hundred_thousand_deep_tree_parses_and_writes_without_recursion() {
        const DEPTH: usize = 100_000;
        let mut line = "(1 ".repeat(DEPTH);
        line.push_str("(2 deep\\/leaf)");
        line.push_str(&")".repeat(DEPTH));
        let mut v = Vocab::new();
        let g = grow(&line, &mut v).unwrap();
        assert_eq!(g.len(), DEPTH + 1);
        assert_eq!(g.tokens[0], v.id("deep/leaf"));
        assert_eq!(g.labels[0], 2);
        assert_eq!(g.children(DEPTH), &[DEPTH as u32 - 1]);
        assert_eq!(g.heights()[DEPTH], DEPTH as u32);
        assert_eq!(write_tree(&g, &v).unwrap(), line);
        // An unclosed deep line points at the innermost open node.
        let (_, col, _) = error_at(&line[..line.len() - 1]);
        assert_eq!(col, 1);
        let (_, col, _) = error_at(&"(1 ".repeat(DEPTH));
        assert_eq!(col, 3 * DEPTH - 2);
    }

    #[test]
    fn write_tree_escapes_and_round_trips() {
        let mut v = Vocab::new();
        let text = "(4 (2 8 1\\/2) (3 (0 a\\*b) (1 back\\slash\\\\/)))";
        let g = grow(text, &mut v).unwrap();
        assert_eq!(v.word(g.tokens[1]), Some("a*b"));
        assert_eq!(v.word(g.tokens[2]), Some("back\\slash\\/"));
        let written = write_tree(&g, &v).unwrap();
        assert_eq!(written, text);
        assert_eq!(
            parse_tree(&written, &mut VocabMode::Frozen(&v), "w", 1).unwrap(),
            g
        );
    }

    #[test]
    fn write_tree_rejects_what_the_format_cannot_hold() {
        let mut v = Vocab::new();
        v.add("ok");
        let paren = v.add("a(b");
        let spaced = v.add("a  b");
        let leaf = |tok: u32, label: i32| {
            let mut g = InputGraph::new();
            g.push_vertex(&[], tok, label).unwrap();
            g
        };
        assert_eq!(write_tree(&leaf(1, 3), &v).unwrap(), "(3 ok)");
        for (g, needle) in [
            (InputGraph::new(), "empty graph"),
            (leaf(1, NO_LABEL), "no label"),
            (leaf(99, 2), "token 99 is not in the vocabulary"),
            (leaf(paren, 2), "parenthesis"),
            (leaf(spaced, 2), "whitespace"),
            (
                InputGraph::chain(&[1, 1], &[2, 2]).unwrap(),
                "internal nodes",
            ),
        ] {
            let e = write_tree(&g, &v).unwrap_err();
            assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
        }
        let mut two_roots = InputGraph::new();
        two_roots.push_vertex(&[], 1, 2).unwrap();
        two_roots.push_vertex(&[], 1, 2).unwrap();
        assert!(write_tree(&two_roots, &v)
            .unwrap_err()
            .to_string()
            .contains("2 roots"));
        let mut dag = two_roots.clone();
        dag.push_vertex(&[0, 1, 1], 0, 2).unwrap();
        assert!(write_tree(&dag, &v)
            .unwrap_err()
            .to_string()
            .contains("shared"));
    }

    mod roundtrip {
        use super::*;
        use proptest::prelude::*;

        /// Canonical bracket text of a random binary tree over `words`,
        /// bracketed by `splits`, labelled from `labels`.
        fn render(
            words: &[String],
            splits: &[usize],
            labels: &[u8],
            next: &mut usize,
            out: &mut String,
        ) {
            let label = labels[*next % labels.len()];
            let s = splits[*next % splits.len()];
            *next += 1;
            out.push_str(&format!("({label} "));
            if words.len() == 1 {
                for c in words[0].chars() {
                    if c == '/' || c == '*' {
                        out.push('\\');
                    }
                    out.push(c);
                }
            } else {
                let cut = 1 + s % (words.len() - 1);
                render(&words[..cut], splits, labels, next, out);
                out.push(' ');
                render(&words[cut..], splits, labels, next, out);
            }
            out.push(')');
        }

        proptest! {
            #[test]
            fn parse_write_parse_round_trips(
                words in prop::collection::vec("[a-c/*\\\\é]{1,4}( [a-c/]{1,2})?", 1..40),
                splits in prop::collection::vec(any::<usize>(), 1..80),
                labels in prop::collection::vec(0u8..=9, 1..80),
            ) {
                let mut text = String::new();
                render(&words, &splits, &labels, &mut 0, &mut text);
                let mut v = Vocab::new();
                let g = parse_tree(&text, &mut VocabMode::Grow(&mut v), "p", 1).unwrap();
                prop_assert_eq!(g.len(), 2 * words.len() - 1);
                let leaves: Vec<&str> = (0..g.len())
                    .filter(|&u| g.children(u).is_empty())
                    .map(|u| v.word(g.tokens[u]).unwrap())
                    .collect();
                prop_assert_eq!(leaves, words.iter().map(String::as_str).collect::<Vec<_>>());
                let written = write_tree(&g, &v).unwrap();
                prop_assert_eq!(&written, &text);
                let again = parse_tree(&written, &mut VocabMode::Frozen(&v), "p", 1).unwrap();
                prop_assert_eq!(again, g);
            }
        }
    }
}
