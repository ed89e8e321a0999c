//! `ramus infer --text`: plain sentences for the tree models, which need a
//! tree an unparsed sentence does not have.
//!
//! * **Tokens.** A line is split at whitespace, then every character that
//!   is neither a letter nor a digit (`char::is_alphanumeric`) becomes a
//!   token of its own: `It's great, isn't it?` reads as `It ' s great ,
//!   isn ' t it ?`. Case is kept (the vocabulary is case-sensitive, as in
//!   training); a word the checkpoint's vocabulary lacks is its unknown
//!   word `<unk>`, as in training. Blank lines are skipped.
//! * **Tree.** The words are the leaves, in order, under a right-branching
//!   binary tree, `w1 (w2 (… (w(n−1) wn)))` (`--binarize left` nests them
//!   to the left instead): the tree `--binarize right` makes of the flat
//!   bracketing `(w1 … wn)`. English phrases mostly branch to the right
//!   (a head before its complement), so each word joining the phrase after
//!   it is the closest a fixed shape comes to the parsed trees the models
//!   learn from (SST's), and every binary model can run it. No vertex is
//!   labelled. For `td-rnn` / `td-lstm` the words make their time-delay
//!   pyramid as a tree's leaves do.

use ramus_graph::binarize::{binarize, Side};
use ramus_graph::{InputGraph, Origin, Vocab, NO_LABEL};

use crate::result::AnyResult;

/// The tokens of `line` (see the module docs).
pub fn tokenize(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for chunk in line.split_whitespace() {
        let mut start = 0;
        for (i, c) in chunk.char_indices() {
            if !c.is_alphanumeric() {
                if start < i {
                    out.push(&chunk[start..i]);
                }
                out.push(&chunk[i..i + c.len_utf8()]);
                start = i + c.len_utf8();
            }
        }
        if start < chunk.len() {
            out.push(&chunk[start..]);
        }
    }
    out
}

/// The tree of `tokens` (token ids), nested to `side`, unlabelled.
pub fn sentence_tree(tokens: &[u32], side: Side) -> AnyResult<InputGraph> {
    let mut flat = InputGraph::new();
    let mut leaves = Vec::with_capacity(tokens.len());
    for &t in tokens {
        leaves.push(flat.push_vertex(&[], t, NO_LABEL)?);
    }
    flat.push_vertex(&leaves, 0, NO_LABEL)?;
    Ok(binarize(&flat, side, 0)?)
}

/// Every non-blank line of `text` (read from `file`) as a tree over its
/// tokens with `vocab`'s ids, nested to `side`; an error when no line
/// holds a word.
pub fn parse_text(text: &str, file: &str, vocab: &Vocab, side: Side) -> AnyResult<Vec<InputGraph>> {
    let name: std::sync::Arc<str> = file.into();
    let mut trees = Vec::new();
    for (k, line) in text.lines().enumerate() {
        let ids: Vec<u32> = tokenize(line).into_iter().map(|w| vocab.id(w)).collect();
        if ids.is_empty() {
            continue;
        }
        let origin = Origin {
            file: name.clone(),
            line: k + 1,
        };
        let tree = sentence_tree(&ids, side).map_err(|e| format!("{origin}: {e}"))?;
        trees.push(tree.with_origin(origin));
    }
    if trees.is_empty() {
        return Err(
            format!("{file}: no sentences to read: it is empty or holds only blank lines").into(),
        );
    }
    Ok(trees)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn punctuation_splits_off_and_trees_branch_right() {
        assert_eq!(
            tokenize(" It's great,  isn't it?"),
            ["It", "'", "s", "great", ",", "isn", "'", "t", "it", "?"]
        );
        assert_eq!(tokenize("naïve café"), ["naïve", "café"]);
        let t = sentence_tree(&[1, 2, 3], Side::Right).unwrap();
        // w1 (w2 w3): the inner pair first, the root last
        assert_eq!(t.len(), 5);
        let root = t.roots()[0] as usize;
        let kids = t.children(root);
        assert_eq!(t.tokens[kids[0] as usize], 1);
        assert!(t.children(kids[1] as usize).len() == 2);
        assert!(t.labels.iter().all(|&l| l == NO_LABEL));
        assert_eq!(sentence_tree(&[4], Side::Right).unwrap().len(), 1);
        let mut v = Vocab::new();
        v.add("good");
        let trees = parse_text("\ngood film\n", "in.txt", &v, Side::Right).unwrap();
        assert_eq!(trees[0].describe(0), "in.txt:2");
        let g = &trees[0];
        let leaves: Vec<u32> = (0..g.len())
            .filter(|&i| g.children(i).is_empty())
            .map(|i| g.tokens[i])
            .collect();
        assert_eq!(leaves, [1, 0]);
        assert!(parse_text(" \n", "e.txt", &v, Side::Right).is_err());
    }
}
