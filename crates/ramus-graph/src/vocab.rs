//! The vocabulary: a two-way mapping between words and `u32` token ids, with
//! id 0 reserved for the unknown word [`UNK`]. Ids are assigned in
//! first-seen order. This module also owns [`VocabMode`], the choice readers
//! make between growing a vocabulary and looking words up in a frozen one,
//! and the vocabulary's on-disk form: a JSON array of strings, written and
//! parsed here by hand (the crate does not depend on `serde_json`); parse
//! errors name the source, line and column.

use std::collections::HashMap;

use crate::GraphError;

/// The unknown word; always id 0.
pub const UNK: &str = "<unk>";

/// Words and their ids. Id `i` is `words()[i]`; id 0 is [`UNK`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    words: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Default for Vocab {
    fn default() -> Self {
        Vocab::new()
    }
}

impl Vocab {
    /// A vocabulary holding only [`UNK`] (id 0).
    pub fn new() -> Self {
        let mut ids = HashMap::new();
        ids.insert(UNK.to_string(), 0);
        Vocab {
            words: vec![UNK.to_string()],
            ids,
        }
    }

    /// The id of `w`, appending it with the next free id when it is new.
    pub fn add(&mut self, w: &str) -> u32 {
        if let Some(&id) = self.ids.get(w) {
            return id;
        }
        let id = self.words.len() as u32;
        self.words.push(w.to_string());
        self.ids.insert(w.to_string(), id);
        id
    }

    /// The id of `w`, or 0 ([`UNK`]) when it is not in the vocabulary.
    pub fn id(&self, w: &str) -> u32 {
        self.get(w).unwrap_or(0)
    }

    /// The id of `w`, or `None` when it is not in the vocabulary.
    pub fn get(&self, w: &str) -> Option<u32> {
        self.ids.get(w).copied()
    }

    /// The word with id `id`, if there is one.
    pub fn word(&self, id: u32) -> Option<&str> {
        self.words.get(id as usize).map(String::as_str)
    }

    /// Number of words, [`UNK`] included (so never 0).
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Always false: a vocabulary holds at least [`UNK`].
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// All words in id order.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// A vocabulary whose id `i` is `words[i]`. The first word must be
    /// [`UNK`] and no word may appear twice.
    pub fn from_words(words: Vec<String>) -> Result<Vocab, GraphError> {
        match words.first() {
            None => {
                return Err(GraphError::Structure(format!(
                    "vocabulary word list is empty; it must start with {UNK:?}"
                )))
            }
            Some(first) if first != UNK => {
                return Err(GraphError::Structure(format!(
                    "vocabulary word list starts with {first:?}; id 0 must be {UNK:?}"
                )))
            }
            Some(_) => {}
        }
        if words.len() > u32::MAX as usize {
            return Err(GraphError::Structure(format!(
                "vocabulary has {} words; ids must fit in u32",
                words.len()
            )));
        }
        let mut ids = HashMap::with_capacity(words.len());
        for (i, w) in words.iter().enumerate() {
            if let Some(prev) = ids.insert(w.clone(), i as u32) {
                return Err(GraphError::Structure(format!(
                    "vocabulary word {w:?} appears twice (ids {prev} and {i})"
                )));
            }
        }
        Ok(Vocab { words, ids })
    }

    /// The words in id order as a JSON array of strings, one word a line.
    pub fn to_json(&self) -> String {
        let mut out =
            String::with_capacity(self.words.iter().map(|w| w.len() + 4).sum::<usize>() + 4);
        out.push('[');
        for (i, w) in self.words.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push('\n');
            write_json_string(&mut out, w);
        }
        out.push_str("\n]\n");
        out
    }

    /// Parses a JSON array of strings (as written by [`Vocab::to_json`]) and
    /// builds the vocabulary as [`Vocab::from_words`] does. Every error is a
    /// [`GraphError::Parse`] naming `source` (a file, a checkpoint's
    /// metadata key) and the line and column: of the bad character, of a
    /// first word other than [`UNK`], of a word's second occurrence.
    pub fn from_json(json: &str, source: &str) -> Result<Vocab, GraphError> {
        let mut reader = JsonReader::new(json, source);
        let (words, places) = reader.string_array()?;
        let at = |i: usize, message: String| {
            let (line, column) = places[i];
            reader.error(line, column, message)
        };
        match words.first() {
            None => {
                return Err(at(
                    0,
                    format!("the word array is empty; it must start with {UNK:?}"),
                ))
            }
            Some(first) if first != UNK => {
                return Err(at(
                    1,
                    format!("the first word is {first:?}; id 0 must be {UNK:?}"),
                ))
            }
            Some(_) => {}
        }
        let mut seen = HashMap::with_capacity(words.len());
        for (i, w) in words.iter().enumerate() {
            if let Some(prev) = seen.insert(w.as_str(), i) {
                return Err(at(
                    i + 1,
                    format!("word {w:?} appears twice (ids {prev} and {i})"),
                ));
            }
        }
        Vocab::from_words(words)
    }
}

/// Whether a reader adds the words it meets to a vocabulary or only looks
/// them up.
#[derive(Debug)]
pub enum VocabMode<'a> {
    /// New words are appended to the vocabulary.
    Grow(&'a mut Vocab),
    /// The vocabulary is left alone; unknown words map to id 0 ([`UNK`]).
    Frozen(&'a Vocab),
}

impl VocabMode<'_> {
    /// The id of `w`: added when growing, 0 when frozen and unknown.
    pub fn lookup(&mut self, w: &str) -> u32 {
        match self {
            VocabMode::Grow(v) => v.add(w),
            VocabMode::Frozen(v) => v.id(w),
        }
    }

    /// The vocabulary, read-only.
    pub fn vocab(&self) -> &Vocab {
        match self {
            VocabMode::Grow(v) => v,
            VocabMode::Frozen(v) => v,
        }
    }
}

/// Appends `s` to `out` as a JSON string literal.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // Other control characters, plus the two line separators that
            // some JSON consumers (JavaScript) mishandle.
            c if (c as u32) < 0x20 || c == '\u{7f}' || c == '\u{2028}' || c == '\u{2029}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A minimal JSON reader for one array of strings, tracking line and column.
struct JsonReader<'s> {
    chars: std::iter::Peekable<std::str::Chars<'s>>,
    line: usize,
    column: usize,
    /// What errors name as the file.
    source: &'s str,
}

/// A line and column (1-based) in the JSON text.
type Place = (usize, usize);

impl<'s> JsonReader<'s> {
    fn new(text: &'s str, source: &'s str) -> Self {
        JsonReader {
            chars: text.chars().peekable(),
            line: 1,
            column: 1,
            source,
        }
    }

    fn error(&self, line: usize, column: usize, message: impl Into<String>) -> GraphError {
        GraphError::Parse {
            file: self.source.to_string(),
            line,
            column,
            message: message.into(),
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.chars.peek().copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.chars.next()?;
        if c == '\n' {
            self.line += 1;
            self.column = 1;
        } else {
            self.column += 1;
        }
        Some(c)
    }

    fn skip_ws(&mut self) {
        while let Some(' ' | '\t' | '\n' | '\r') = self.peek() {
            self.bump();
        }
    }

    /// Consumes `want` after optional whitespace, or fails naming it.
    fn expect(&mut self, want: char, what: &str) -> Result<(), GraphError> {
        self.skip_ws();
        let (line, column) = (self.line, self.column);
        match self.bump() {
            Some(c) if c == want => Ok(()),
            Some(c) => Err(self.error(line, column, format!("expected {what}, found {c:?}"))),
            None => Err(self.error(line, column, format!("expected {what}, found end of input"))),
        }
    }

    /// The words of the array and where each starts, after the place of
    /// its `[` (so `places[i + 1]` is word `i`'s).
    fn string_array(&mut self) -> Result<(Vec<String>, Vec<Place>), GraphError> {
        self.skip_ws();
        let mut places = vec![(self.line, self.column)];
        self.expect('[', "'[' starting the word array")?;
        let mut words = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.bump();
        } else {
            loop {
                self.skip_ws();
                places.push((self.line, self.column));
                words.push(self.string()?);
                self.skip_ws();
                let (line, column) = (self.line, self.column);
                match self.bump() {
                    Some(',') => continue,
                    Some(']') => break,
                    Some(c) => {
                        return Err(self.error(
                            line,
                            column,
                            format!("expected ',' or ']' after a word, found {c:?}"),
                        ))
                    }
                    None => {
                        return Err(self.error(
                            line,
                            column,
                            "unterminated word array: expected ',' or ']'",
                        ))
                    }
                }
            }
        }
        self.skip_ws();
        let (line, column) = (self.line, self.column);
        if let Some(c) = self.bump() {
            return Err(self.error(
                line,
                column,
                format!("unexpected {c:?} after the word array"),
            ));
        }
        Ok((words, places))
    }

    fn string(&mut self) -> Result<String, GraphError> {
        let (line, column) = (self.line, self.column);
        match self.bump() {
            Some('"') => {}
            Some(c) => {
                return Err(self.error(line, column, format!("expected a string, found {c:?}")))
            }
            None => return Err(self.error(line, column, "expected a string, found end of input")),
        }
        let mut s = String::new();
        loop {
            let (line, column) = (self.line, self.column);
            match self.bump() {
                None => return Err(self.error(line, column, "unterminated string")),
                Some('"') => return Ok(s),
                Some('\\') => s.push(self.escape(line, column)?),
                Some(c) if (c as u32) < 0x20 => {
                    return Err(self.error(
                        line,
                        column,
                        format!(
                            "raw control character U+{:04X} in string (must be escaped)",
                            c as u32
                        ),
                    ))
                }
                Some(c) => s.push(c),
            }
        }
    }

    /// Decodes the escape whose backslash was at (`line`, `column`).
    fn escape(&mut self, line: usize, column: usize) -> Result<char, GraphError> {
        let c = match self.bump() {
            None => return Err(self.error(line, column, "unterminated escape sequence")),
            Some(c) => c,
        };
        Ok(match c {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let hi = self.hex4(line, column)?;
                if (0xDC00..0xE000).contains(&hi) {
                    return Err(self.error(
                        line,
                        column,
                        format!("unpaired low surrogate \\u{hi:04x}"),
                    ));
                }
                if (0xD800..0xDC00).contains(&hi) {
                    let (l2, c2) = (self.line, self.column);
                    if self.bump() != Some('\\') || self.bump() != Some('u') {
                        return Err(self.error(
                            l2,
                            c2,
                            format!("high surrogate \\u{hi:04x} must be followed by a \\u low surrogate"),
                        ));
                    }
                    let lo = self.hex4(l2, c2)?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return Err(self.error(
                            l2,
                            c2,
                            format!("high surrogate \\u{hi:04x} followed by \\u{lo:04x}, not a low surrogate"),
                        ));
                    }
                    let code = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                    return char::from_u32(code).ok_or_else(|| {
                        self.error(line, column, format!("invalid code point U+{code:X}"))
                    });
                }
                return char::from_u32(hi).ok_or_else(|| {
                    self.error(line, column, format!("invalid code point U+{hi:04X}"))
                });
            }
            other => return Err(self.error(line, column, format!("unknown escape '\\{other}'"))),
        })
    }

    /// Reads four hex digits of a `\u` escape that started at (`line`, `column`).
    fn hex4(&mut self, line: usize, column: usize) -> Result<u32, GraphError> {
        let mut v = 0u32;
        for _ in 0..4 {
            match self.bump().and_then(|c| c.to_digit(16)) {
                Some(d) => v = v * 16 + d,
                None => return Err(self.error(line, column, "\\u escape needs four hex digits")),
            }
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_holds_only_unk() {
        let v = Vocab::new();
        assert_eq!(v.len(), 1);
        assert!(!v.is_empty());
        assert_eq!(v.word(0), Some(UNK));
        assert_eq!(v.get(UNK), Some(0));
        assert_eq!(v.word(1), None);
        assert_eq!(Vocab::default(), v);
    }

    #[test]
    fn ids_follow_first_seen_order() {
        let mut v = Vocab::new();
        assert_eq!(v.add("the"), 1);
        assert_eq!(v.add("cat"), 2);
        assert_eq!(v.add("the"), 1);
        assert_eq!(v.add(UNK), 0);
        assert_eq!(v.add("sat"), 3);
        assert_eq!(v.len(), 4);
        assert_eq!(v.id("cat"), 2);
        assert_eq!(v.id("dog"), 0);
        assert_eq!(v.get("dog"), None);
        assert_eq!(v.word(3), Some("sat"));
        assert_eq!(v.words(), &["<unk>", "the", "cat", "sat"]);
    }

    #[test]
    fn from_words_validates() {
        let ok = Vocab::from_words(vec![UNK.into(), "a".into(), "b".into()]).unwrap();
        assert_eq!(ok.id("b"), 2);
        assert!(matches!(
            Vocab::from_words(vec![]),
            Err(GraphError::Structure(_))
        ));
        let e = Vocab::from_words(vec!["a".into(), UNK.into()]).unwrap_err();
        assert!(e.to_string().contains("\"a\""), "{e}");
        let e =
            Vocab::from_words(vec![UNK.into(), "a".into(), "b".into(), "a".into()]).unwrap_err();
        assert!(e.to_string().contains("ids 1 and 3"), "{e}");
        let e = Vocab::from_words(vec![UNK.into(), UNK.into()]).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn json_round_trips_tricky_words() {
        let mut v = Vocab::new();
        let tricky = [
            "plain",
            "quo\"te",
            "back\\slash",
            "\\",
            "\"",
            "\\\"",
            "new\nline",
            "tab\there",
            "cr\r",
            "\u{0}nul",
            "\u{1f}unit",
            "\u{7f}del",
            "bell\u{8}form\u{c}",
            "/slash\\/",
            "caf\u{e9}",
            "8\u{a0}1/2",
            "\u{2028}sep\u{2029}",
            "emoji \u{1F600}",
            "[,]",
            " ",
            "",
            "\\u0041",
        ];
        for w in tricky {
            v.add(w);
        }
        assert_eq!(v.len(), tricky.len() + 1);
        let json = v.to_json();
        // Every control character is escaped, so the word list stays one word a line.
        assert_eq!(json.lines().count(), v.len() + 2, "{json}");
        assert!(
            !json.chars().any(|c| (c as u32) < 0x20 && c != '\n'),
            "{json}"
        );
        assert!(json.contains(r#""quo\"te""#), "{json}");
        assert!(json.contains(r#""back\\slash""#), "{json}");
        assert!(json.contains(r#""\u0000nul""#), "{json}");
        assert!(json.contains(r#""\\u0041""#), "{json}");
        let back = Vocab::from_json(&json, "v").unwrap();
        assert_eq!(back, v);
        assert_eq!(back.id("\\u0041"), v.id("\\u0041"));
    }

    #[test]
    fn json_accepts_standard_escapes_and_whitespace() {
        let v = Vocab::from_json(
            " [ \"<unk>\" ,\"a\\/b\", \"\\u00e9\\uD83D\\uDE00\",\t\"\\b\\f\\n\\r\\t\" ] \n",
            "v",
        )
        .unwrap();
        assert_eq!(
            v.words(),
            &["<unk>", "a/b", "\u{e9}\u{1F600}", "\u{8}\u{c}\n\r\t"]
        );
        assert_eq!(
            Vocab::from_json(&Vocab::new().to_json(), "v").unwrap(),
            Vocab::new()
        );
    }

    fn parse_err(json: &str) -> (usize, usize, String) {
        match Vocab::from_json(json, "vocab.json") {
            Err(GraphError::Parse {
                file,
                line,
                column,
                message,
            }) => {
                assert_eq!(file, "vocab.json");
                (line, column, message)
            }
            other => panic!("expected a parse error for {json:?}, got {other:?}"),
        }
    }

    #[test]
    fn json_errors_point_at_the_problem() {
        assert_eq!(parse_err("").0, 1);
        assert_eq!(parse_err("{}").1, 1);
        let (l, c, m) = parse_err("[\"<unk>\",\n  \"a\" \"b\"]");
        assert_eq!((l, c), (2, 7), "{m}");
        let (l, c, m) = parse_err("[\"<unk>\", \"a\\q\"]");
        assert_eq!((l, c), (1, 13), "{m}");
        assert!(m.contains("\\q"), "{m}");
        let (l, c, _) = parse_err("[\"<unk>\", \"a\\u12\"]");
        assert_eq!((l, c), (1, 13));
        let (l, c, m) = parse_err("[\"<unk>\", \"\\uDC00\"]");
        assert_eq!((l, c), (1, 12));
        assert!(m.contains("surrogate"), "{m}");
        let (_, _, m) = parse_err("[\"<unk>\", \"\\uD800x\"]");
        assert!(m.contains("low surrogate"), "{m}");
        let (l, c, m) = parse_err("[\"<unk>\", \"a\nb\"]");
        assert_eq!((l, c), (1, 13), "{m}");
        let (l, c, _) = parse_err("[\"<unk>\", \"open");
        assert_eq!((l, c), (1, 16));
        let (l, c, m) = parse_err("[\"<unk>\"] x");
        assert_eq!((l, c), (1, 11), "{m}");
        let (_, _, m) = parse_err("[\"<unk>\",]");
        assert!(m.contains("expected a string"), "{m}");
        let (_, _, m) = parse_err("[\"<unk>\"");
        assert!(m.contains("unterminated"), "{m}");
    }

    #[test]
    fn json_structure_errors_point_at_the_word() {
        let (l, c, m) = parse_err(" \n [ ]");
        assert_eq!((l, c), (2, 2), "{m}");
        assert!(m.contains("empty"), "{m}");
        let (l, c, m) = parse_err("[\n  \"a\"]");
        assert_eq!((l, c), (2, 3), "{m}");
        assert!(m.contains("id 0 must be"), "{m}");
        let (l, c, m) = parse_err("[\"<unk>\",\n\"x\",\n \"x\"]");
        assert_eq!((l, c), (3, 2), "{m}");
        assert!(m.contains("ids 1 and 2"), "{m}");
        let e =
            Vocab::from_json("[\"<unk>\", \"<unk>\"]", "m.st: metadata `ramus.vocab`").unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.st: metadata `ramus.vocab`:1:11: word \"<unk>\" appears twice (ids 0 and 1)"
        );
    }

    #[test]
    fn vocab_mode_grows_or_not() {
        let mut v = Vocab::new();
        let mut grow = VocabMode::Grow(&mut v);
        assert_eq!(grow.lookup("a"), 1);
        assert_eq!(grow.lookup("a"), 1);
        assert_eq!(grow.vocab().len(), 2);
        let mut frozen = VocabMode::Frozen(&v);
        assert_eq!(frozen.lookup("a"), 1);
        assert_eq!(frozen.lookup("b"), 0);
        assert_eq!(v.len(), 2);
    }
}
