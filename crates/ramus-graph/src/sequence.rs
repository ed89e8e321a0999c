//! Graph shapes of the sequence benchmarks of VPPS §IV-E, built from a
//! sentence's word (and character) ids:
//!
//! * [`tagger_graph`] — a BiLSTM tagger sentence: a forward chain over the
//!   words, a backward chain over the reversed words, and one output vertex
//!   per word that reads both directions and carries the word's tag; rare
//!   words of the character tagger first run forward and backward
//!   character chains. Vertices carry kinds ([`tagger_kinds`]) so that a
//!   `FunctionSelector::ByKind` model runs the right step at each.
//! * [`pyramid`] — the time-delay networks' triangle: `n` word vertices,
//!   then layers of `n − 1`, `n − 2`, …, 1 vertices, vertex `i` of a layer
//!   combining vertices `i` and `i + 1` of the layer below; the top vertex
//!   carries the sentence label. [`pyramid_of_tree`] builds it from a
//!   parsed tree's leaves (in order) and root label.

use crate::input::{GraphShape, InputGraph, NO_LABEL};
use crate::GraphError;

/// Vertex kinds of a tagger graph; entry `k` of the tagger models'
/// `ByKind` table is the function of kind `k`.
pub mod tagger_kinds {
    /// Forward word step on the word's embedding; children `[previous forward step]`.
    pub const FORWARD: u16 = 0;
    /// Backward word step on the word's embedding; children `[next word's backward step]`.
    pub const BACKWARD: u16 = 1;
    /// Output vertex of a word, children `[forward step, backward step]`, labelled with the tag.
    pub const OUTPUT: u16 = 2;
    /// Forward character step; children `[previous character's step]`.
    pub const CHAR_FORWARD: u16 = 3;
    /// Backward character step (over the reversed word); children `[next character's step]`.
    pub const CHAR_BACKWARD: u16 = 4;
    /// Forward word step of a spelled-out word; children `[last forward
    /// character step, last backward character step, previous forward step]`
    /// (the previous step last: the first word has none).
    pub const FORWARD_FROM_CHARS: u16 = 5;
    /// Backward word step of a spelled-out word; children like
    /// [`FORWARD_FROM_CHARS`] with the next word's backward step last.
    pub const BACKWARD_FROM_CHARS: u16 = 6;
    /// Number of kinds.
    pub const COUNT: usize = 7;
}

use tagger_kinds as k;

/// How a tagger reads one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WordInput<'a> {
    /// Through the word embedding (the token id).
    Token(u32),
    /// Spelled out: character ids for the character LSTMs.
    Chars(&'a [u32]),
}

/// A tagger graph over `words` with one tag label per word (see the module
/// docs). Vertices are numbered: the character chains of the spelled words
/// in word order (each word's forward chain, then its backward chain), the
/// forward word chain, the backward word chain (last word first), then the
/// `n` output vertices in word order. Only the outputs are labelled.
pub fn tagger_graph(words: &[WordInput<'_>], tags: &[i32]) -> Result<InputGraph, GraphError> {
    let n = words.len();
    if n == 0 {
        return Err(GraphError::Structure("tagger graph: empty sentence".into()));
    }
    if tags.len() != n {
        return Err(GraphError::Structure(format!(
            "tagger graph: {n} words but {} tags",
            tags.len()
        )));
    }
    let mut g = InputGraph::new();
    // final (forward, backward) character states of each spelled word
    let mut spelled: Vec<Option<[u32; 2]>> = vec![None; n];
    for (i, w) in words.iter().enumerate() {
        let WordInput::Chars(chars) = *w else {
            continue;
        };
        if chars.is_empty() {
            return Err(GraphError::Structure(format!(
                "tagger graph: word {i} is spelled with no characters"
            )));
        }
        let fwd = chain(&mut g, k::CHAR_FORWARD, chars.iter().copied())?;
        let bwd = chain(&mut g, k::CHAR_BACKWARD, chars.iter().rev().copied())?;
        spelled[i] = Some([fwd, bwd]);
    }
    let step = |g: &mut InputGraph, i: usize, prev: Option<u32>, forward: bool| {
        let (plain, from_chars) = if forward {
            (k::FORWARD, k::FORWARD_FROM_CHARS)
        } else {
            (k::BACKWARD, k::BACKWARD_FROM_CHARS)
        };
        match (words[i], spelled[i]) {
            (WordInput::Token(t), _) => g.push_vertex_of_kind(plain, prev.as_slice(), t, NO_LABEL),
            (WordInput::Chars(_), Some([cf, cb])) => {
                let mut kids = vec![cf, cb];
                kids.extend(prev);
                g.push_vertex_of_kind(from_chars, &kids, 0, NO_LABEL)
            }
            (WordInput::Chars(_), None) => Err(GraphError::Structure(format!(
                "tagger graph: word {i} has no character chain"
            ))),
        }
    };
    let mut fwd = Vec::with_capacity(n);
    for i in 0..n {
        let prev = fwd.last().copied();
        fwd.push(step(&mut g, i, prev, true)?);
    }
    let mut bwd = vec![0u32; n];
    let mut prev = None;
    for i in (0..n).rev() {
        bwd[i] = step(&mut g, i, prev, false)?;
        prev = Some(bwd[i]);
    }
    for i in 0..n {
        g.push_vertex_of_kind(k::OUTPUT, &[fwd[i], bwd[i]], 0, tags[i])?;
    }
    Ok(g)
}

/// Appends a chain of `kind` over `tokens` (each vertex's child is the
/// previous one) and returns its last vertex.
fn chain(
    g: &mut InputGraph,
    kind: u16,
    tokens: impl Iterator<Item = u32>,
) -> Result<u32, GraphError> {
    let mut prev: Option<u32> = None;
    for t in tokens {
        prev = Some(g.push_vertex_of_kind(kind, prev.as_slice(), t, NO_LABEL)?);
    }
    prev.ok_or_else(|| GraphError::Structure("empty chain".into()))
}

/// The time-delay pyramid over `tokens` with `label` on its top vertex
/// (see the module docs): `n (n + 1) / 2` vertices, layer by layer, the
/// word vertices first; vertex `i` of layer `l > 0` has children
/// `[vertex i, vertex i + 1]` of layer `l − 1`. All vertices are kind 0
/// (word vertices are the leaves). Its size grows with the square of the
/// sentence's: [`pyramid_shape`] gives it without building it.
pub fn pyramid(tokens: &[u32], label: i32) -> Result<InputGraph, GraphError> {
    let n = tokens.len();
    if n == 0 {
        return Err(GraphError::Structure("pyramid: empty sentence".into()));
    }
    let shape = pyramid_shape(n as u64, label != NO_LABEL);
    let (vertices, edges) = (shape.vertex_count(), shape.edge_count());
    // vertex ids are u32 (and child offsets count edges in u32)
    if edges > u64::from(u32::MAX) {
        return Err(GraphError::Structure(format!(
            "pyramid: {n} words make {vertices} vertices and {edges} edges, more than a graph can number"
        )));
    }
    let mut g = InputGraph::with_capacity(vertices as usize, edges as usize);
    let top_label = |width: usize| if width == 1 { label } else { NO_LABEL };
    for &t in tokens {
        g.push_vertex(&[], t, top_label(n))?;
    }
    let mut below = 0u32; // id of the first vertex of the layer below
    for width in (1..n).rev() {
        for i in 0..width as u32 {
            g.push_vertex(&[below + i, below + i + 1], 0, top_label(width))?;
        }
        below += width as u32 + 1;
    }
    Ok(g)
}

/// The shape of [`pyramid`] over `words` words, with a label on its top
/// vertex or not, computed without building it: `words` leaves and
/// `words (words − 1) / 2` vertices of two children, all of kind 0, one
/// root (none of it for no words). Saturates rather than wraps.
pub fn pyramid_shape(words: u64, labelled: bool) -> GraphShape {
    if words == 0 {
        return GraphShape::default();
    }
    let inner = words.saturating_mul(words - 1) / 2;
    let mut vertices = vec![(0, 0, words)];
    if inner > 0 {
        vertices.push((0, 2, inner));
    }
    GraphShape {
        vertices,
        roots: 1,
        labelled: u64::from(labelled),
        features: 0,
    }
}

/// The tokens of a parsed tree's leaves, left to right (its vertices
/// without children, in id order — post-order keeps them in sentence order).
fn leaf_tokens(tree: &InputGraph) -> Vec<u32> {
    (0..tree.len())
        .filter(|&v| tree.children(v).is_empty())
        .map(|v| tree.tokens[v])
        .collect()
}

/// The pyramid over a parsed tree's leaves, left to right, labelled with
/// the tree's root label (none if it has none).
pub fn pyramid_of_tree(tree: &InputGraph) -> Result<InputGraph, GraphError> {
    let label = tree.root_label().unwrap_or(NO_LABEL);
    let mut p = pyramid(&leaf_tokens(tree), label)?;
    if let Some(o) = tree.origin() {
        p.set_origin(o.clone());
    }
    Ok(p)
}

/// The number of words of a parsed tree (its leaves) and the shape of
/// [`pyramid_of_tree`] over them, counted without building it.
pub fn pyramid_shape_of_tree(tree: &InputGraph) -> (u64, GraphShape) {
    let words = tree.kinds_and_child_counts().filter(|c| c.1 == 0).count() as u64;
    (words, pyramid_shape(words, tree.root_label().is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_tagger_graph_has_three_vertices_per_word() {
        let words = [
            WordInput::Token(5),
            WordInput::Token(6),
            WordInput::Token(7),
        ];
        let g = tagger_graph(&words, &[1, 2, 3]).unwrap();
        assert_eq!(g.len(), 9);
        // forward chain 0 <- 1 <- 2
        assert_eq!(g.children(0), &[] as &[u32]);
        assert_eq!(g.children(2), &[1]);
        // backward chain: vertex 3 is the last word, 5 the first
        assert_eq!(g.children(3), &[] as &[u32]);
        assert_eq!(g.children(5), &[4]);
        assert_eq!(&g.tokens[..6], &[5, 6, 7, 7, 6, 5]);
        // outputs: [forward_i, backward_i]
        assert_eq!(g.children(6), &[0, 5]);
        assert_eq!(g.children(8), &[2, 3]);
        let kinds: Vec<u16> = (0..9).map(|v| g.kind(v)).collect();
        assert_eq!(kinds, [0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!(&g.labels[6..], &[1, 2, 3]);
        assert!(g.labels[..6].iter().all(|&l| l == NO_LABEL));
        assert_eq!(g.roots(), vec![6, 7, 8]);
    }

    #[test]
    fn spelled_words_run_character_chains_first() {
        let chars = [4, 5, 6];
        let words = [WordInput::Chars(&chars), WordInput::Token(9)];
        let g = tagger_graph(&words, &[0, 1]).unwrap();
        // 3 + 3 character vertices, 2 forward, 2 backward, 2 outputs
        assert_eq!(g.len(), 12);
        assert_eq!(&g.tokens[..6], &[4, 5, 6, 6, 5, 4]);
        assert_eq!(g.children(2), &[1]);
        assert_eq!(g.children(5), &[4]);
        // forward step of the spelled first word: [char fwd last, char bwd last]
        assert_eq!(g.kind(6), k::FORWARD_FROM_CHARS);
        assert_eq!(g.children(6), &[2, 5]);
        assert_eq!(g.kind(7), k::FORWARD);
        assert_eq!(g.children(7), &[6]);
        // backward: word 1 first, then the spelled word with its predecessor last
        assert_eq!(g.kind(8), k::BACKWARD);
        assert_eq!(g.kind(9), k::BACKWARD_FROM_CHARS);
        assert_eq!(g.children(9), &[2, 5, 8]);
        assert_eq!(g.children(10), &[6, 9]);
        assert_eq!(g.children(11), &[7, 8]);
        let kinds: Vec<u16> = (0..6).map(|v| g.kind(v)).collect();
        assert_eq!(kinds, [3, 3, 3, 4, 4, 4]);
        assert_eq!(g.tokens[6], 0, "a spelled word has no word token");
    }

    #[test]
    fn bad_tagger_input_is_an_error() {
        assert!(tagger_graph(&[], &[]).is_err());
        assert!(tagger_graph(&[WordInput::Token(1)], &[0, 1]).is_err());
        let e = tagger_graph(&[WordInput::Token(1), WordInput::Chars(&[])], &[0, 1]).unwrap_err();
        assert!(e.to_string().contains("word 1"), "{e}");
    }

    #[test]
    fn pyramid_layers_shrink_to_one_top_vertex() {
        let g = pyramid(&[1, 2, 3, 4], 3).unwrap();
        assert_eq!(g.len(), 10);
        assert_eq!(&g.tokens[..4], &[1, 2, 3, 4]);
        // layer 1: 4, 5, 6
        assert_eq!(g.children(4), &[0, 1]);
        assert_eq!(g.children(6), &[2, 3]);
        // layer 2: 7, 8; layer 3: 9
        assert_eq!(g.children(7), &[4, 5]);
        assert_eq!(g.children(8), &[5, 6]);
        assert_eq!(g.children(9), &[7, 8]);
        assert_eq!(g.roots(), vec![9]);
        assert_eq!(g.root_label(), Some(3));
        assert_eq!(g.labels.iter().filter(|&&l| l != NO_LABEL).count(), 1);
        assert_eq!(g.heights()[9], 3);
        assert!(!g.is_forest(), "inner vertices are shared by two parents");
        let one = pyramid(&[8], 2).unwrap();
        assert_eq!((one.len(), one.root_label()), (1, Some(2)));
        assert!(pyramid(&[], 0).is_err());
    }

    #[test]
    fn pyramid_of_a_tree_reads_its_leaves_in_order() {
        let mut t = InputGraph::new();
        let a = t.push_vertex(&[], 1, 0).unwrap();
        let b = t.push_vertex(&[], 2, 0).unwrap();
        let ab = t.push_vertex(&[a, b], 0, 0).unwrap();
        let c = t.push_vertex(&[], 3, 0).unwrap();
        t.push_vertex(&[ab, c], 0, 4).unwrap();
        let p = pyramid_of_tree(&t).unwrap();
        assert_eq!(p.len(), 6);
        assert_eq!(&p.tokens[..3], &[1, 2, 3]);
        assert_eq!(p.root_label(), Some(4));
        assert_eq!(pyramid_shape_of_tree(&t), (3, p.shape()));
    }

    #[test]
    fn pyramid_shape_counts_what_pyramid_builds() {
        for words in 1..=40u32 {
            let tokens: Vec<u32> = (0..words).map(|t| t % 7).collect();
            for label in [NO_LABEL, 2] {
                let built = pyramid(&tokens, label).unwrap();
                let shape = pyramid_shape(u64::from(words), label != NO_LABEL);
                assert_eq!(shape, built.shape(), "{words} words, label {label}");
                let n = u64::from(words);
                assert_eq!(shape.vertex_count(), n * (n + 1) / 2);
                assert_eq!(shape.vertex_count(), built.len() as u64);
                assert_eq!(shape.edge_count(), built.num_edges() as u64);
            }
        }
        assert_eq!(pyramid_shape(0, true), GraphShape::default());
        // 30000 words: 450 million vertices, counted without building them
        let long = pyramid_shape(30_000, true);
        assert_eq!(long.vertex_count(), 450_015_000);
        assert_eq!(long.edge_count(), 2 * 449_985_000);
        // saturates instead of wrapping
        assert_eq!(pyramid_shape(u64::MAX, true).vertex_count(), u64::MAX);
        // a pyramid whose edges a u32 cannot number is an error, not a wrap
        let too_long = vec![0u32; 70_000];
        let e = pyramid(&too_long, 0).unwrap_err().to_string();
        assert!(e.contains("70000 words"), "{e}");
    }
}
