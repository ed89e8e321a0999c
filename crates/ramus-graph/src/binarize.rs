//! Binarization: rewrites a tree so that every internal vertex has exactly
//! two children, for models whose internal function reads a fixed pair
//! (`ramus train --binarize left|right`). Without it such models refuse
//! other vertices (ramus-core's `Model::function_for`); nothing is
//! rewritten unless asked.
//!
//! * A vertex with `k > 2` children `c1 … ck` becomes a chain of `k − 1`
//!   binary vertices. [`Side::Left`] nests to the left, `((c1 c2) c3) … ck`;
//!   [`Side::Right`] to the right, `c1 (c2 (… (c(k−1) ck)))`. The outermost
//!   vertex of the chain is the original vertex (its token, label, kind
//!   and features); the `k − 2` new inner vertices have token 0, no label
//!   ([`NO_LABEL`]), the original vertex's kind and zero features.
//! * A vertex with one child is removed: its parent reads the child in its
//!   place. The child keeps its own token, kind, features and children and
//!   takes the removed vertex's label, unless that is [`NO_LABEL`] (then it
//!   keeps its own): in a chain of one-child vertices the outermost label
//!   wins, so a tree's root label (its sentence label) always survives.
//!   Relabelling a child that has another parent would change that parent's
//!   input too, so it is an error (a DAG, not a tree).
//! * Vertices with no or two children are kept. A graph that has only
//!   such vertices is returned unchanged.
//!
//! Vertices are renumbered (still children before parents: each chain's
//! inner vertices come right before its outermost one); the origin is kept.

use std::str::FromStr;

use crate::input::{InputGraph, NO_LABEL};
use crate::GraphError;

/// Which way a vertex with more than two children is nested.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// `((c1 c2) c3) … ck`.
    Left,
    /// `c1 (c2 (… (c(k−1) ck)))`.
    Right,
}

impl FromStr for Side {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "left" => Ok(Side::Left),
            "right" => Ok(Side::Right),
            other => Err(format!("unknown side `{other}` (known: left, right)")),
        }
    }
}

/// `graph` binarized toward `side` (see the module docs); graph `index` of
/// its file or batch, for errors ([`InputGraph::describe`]).
pub fn binarize(graph: &InputGraph, side: Side, index: usize) -> Result<InputGraph, GraphError> {
    let n = graph.len();
    if (0..n).all(|v| matches!(graph.children(v).len(), 0 | 2)) {
        return Ok(graph.clone());
    }
    let mut parents = vec![0u32; n];
    for v in 0..n {
        for &c in graph.children(v) {
            parents[c as usize] += 1;
        }
    }
    let fw = graph.feature_width();
    let mut out = Rewrite {
        graph: InputGraph::new(),
        features: Vec::with_capacity(n * fw),
        fw,
    };
    // new id of each old vertex (a removed one-child vertex: its child's)
    let mut new_id = vec![0u32; n];
    let mut kids = Vec::new();
    for v in 0..n {
        kids.clear();
        kids.extend(graph.children(v).iter().map(|&c| new_id[c as usize]));
        let (kind, token, label) = (graph.kind(v), graph.tokens[v], graph.labels[v]);
        new_id[v] = match kids.as_slice() {
            &[only] => {
                let old = graph.children(v)[0] as usize;
                if label != NO_LABEL {
                    if parents[old] > 1 {
                        return Err(GraphError::Structure(format!(
                            "{}: vertex {v} has one child, vertex {old}, which has another \
                             parent: binarizing would relabel it for both (binarize trees, not DAGs)",
                            graph.describe(index)
                        )));
                    }
                    out.graph.labels[only as usize] = label;
                }
                only
            }
            &[] | &[_, _] => out.push(kind, &kids, token, label, graph.features(v))?,
            _ => {
                let k = kids.len();
                let inner =
                    |out: &mut Rewrite, pair: [u32; 2]| out.push(kind, &pair, 0, NO_LABEL, &[]);
                match side {
                    Side::Left => {
                        let mut acc = inner(&mut out, [kids[0], kids[1]])?;
                        for &c in &kids[2..k - 1] {
                            acc = inner(&mut out, [acc, c])?;
                        }
                        out.push(kind, &[acc, kids[k - 1]], token, label, graph.features(v))?
                    }
                    Side::Right => {
                        let mut acc = inner(&mut out, [kids[k - 2], kids[k - 1]])?;
                        for &c in kids[1..k - 2].iter().rev() {
                            acc = inner(&mut out, [c, acc])?;
                        }
                        out.push(kind, &[kids[0], acc], token, label, graph.features(v))?
                    }
                }
            }
        };
    }
    let mut rewritten = out.graph;
    if fw > 0 {
        rewritten.set_features(fw, out.features)?;
    }
    if let Some(o) = graph.origin() {
        rewritten.set_origin(o.clone());
    }
    Ok(rewritten)
}

/// The graph being rebuilt, with its features (`fw` per vertex).
struct Rewrite {
    graph: InputGraph,
    features: Vec<f32>,
    fw: usize,
}

impl Rewrite {
    /// Appends a vertex; `features` empty: zeros.
    fn push(
        &mut self,
        kind: u16,
        children: &[u32],
        token: u32,
        label: i32,
        features: &[f32],
    ) -> Result<u32, GraphError> {
        let id = self
            .graph
            .push_vertex_of_kind(kind, children, token, label)?;
        match features.len() {
            0 => self.features.resize(self.features.len() + self.fw, 0.0),
            _ => self.features.extend_from_slice(features),
        }
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::ptb::parse_tree;
    use crate::random::random_tree;
    use crate::{Vocab, VocabMode};

    /// A tree of single-letter words, read as `file.txt` line 4.
    fn tree(text: &str, vocab: &mut Vocab) -> InputGraph {
        parse_tree(text, &mut VocabMode::Grow(vocab), "file.txt", 4).unwrap()
    }

    /// `label(children)` for an internal vertex, `label:word` for a leaf,
    /// `-` for no label.
    fn render(g: &InputGraph, v: usize, vocab: &Vocab) -> String {
        let label = match g.labels[v] {
            NO_LABEL => "-".to_string(),
            l => l.to_string(),
        };
        let kids = g.children(v);
        if kids.is_empty() {
            return format!("{label}:{}", vocab.word(g.tokens[v]).unwrap_or("?"));
        }
        let inner: Vec<String> = kids.iter().map(|&c| render(g, c as usize, vocab)).collect();
        format!("{label}({})", inner.join(" "))
    }

    fn shape(text: &str, side: Side) -> String {
        let mut vocab = Vocab::new();
        let b = binarize(&tree(text, &mut vocab), side, 0).unwrap();
        let root = *b.roots().last().unwrap() as usize;
        render(&b, root, &vocab)
    }

    #[test]
    fn binary_trees_are_returned_unchanged() {
        let mut vocab = Vocab::new();
        let t = tree("(3 (2 a) (4 (2 b) (1 c)))", &mut vocab);
        for side in [Side::Left, Side::Right] {
            let b = binarize(&t, side, 0).unwrap();
            assert_eq!(b, t);
            assert_eq!(b.describe(0), "file.txt:4");
        }
    }

    #[test]
    fn wide_vertices_become_chains_to_the_chosen_side() {
        let three = "(3 (1 a) (2 b) (4 c))";
        assert_eq!(shape(three, Side::Left), "3(-(1:a 2:b) 4:c)");
        assert_eq!(shape(three, Side::Right), "3(1:a -(2:b 4:c))");
        let five = "(0 (1 a) (1 b) (2 c) (3 d) (4 e))";
        assert_eq!(shape(five, Side::Left), "0(-(-(-(1:a 1:b) 2:c) 3:d) 4:e)");
        assert_eq!(shape(five, Side::Right), "0(1:a -(1:b -(2:c -(3:d 4:e))))");
        // nested wide vertices, and the chain's inner vertices have token 0
        let mut vocab = Vocab::new();
        let t = tree("(2 (1 (0 a) (0 b) (0 c)) (3 d) (4 e))", &mut vocab);
        let b = binarize(&t, Side::Left, 0).unwrap();
        let root = *b.roots().last().unwrap() as usize;
        assert_eq!(render(&b, root, &vocab), "2(-(1(-(0:a 0:b) 0:c) 3:d) 4:e)");
        assert_eq!(b.len(), t.len() + 2);
        let inner: Vec<usize> = (0..b.len()).filter(|&v| b.labels[v] == NO_LABEL).collect();
        assert_eq!(inner.len(), 2);
        assert!(inner.iter().all(|&v| b.tokens[v] == 0));
    }

    #[test]
    fn one_child_vertices_give_their_label_to_the_child() {
        // the sentence label (3) of a one-child root survives
        assert_eq!(shape("(3 (2 (1 a) (1 b)))", Side::Left), "3(1:a 1:b)");
        // a chain of one-child vertices: the outermost label wins
        assert_eq!(shape("(1 (2 (3 a)))", Side::Right), "1:a");
        assert_eq!(shape("(4 (0 a) (2 (3 b)))", Side::Left), "4(0:a 2:b)");
        // an unlabelled one-child vertex leaves its child's label
        let mut g = InputGraph::new();
        g.push_vertex(&[], 7, 2).unwrap();
        g.push_vertex(&[0], 0, NO_LABEL).unwrap();
        let b = binarize(&g, Side::Left, 0).unwrap();
        assert_eq!((b.len(), b.labels[0], b.tokens[0]), (1, 2, 7));
    }

    #[test]
    fn relabelling_a_shared_child_is_an_error() {
        let mut g = InputGraph::new();
        g.push_vertex(&[], 1, 0).unwrap();
        g.push_vertex(&[], 2, 0).unwrap();
        g.push_vertex(&[0], 0, 3).unwrap();
        g.push_vertex(&[0, 1, 2], 0, 4).unwrap();
        let e = binarize(&g, Side::Left, 5).unwrap_err().to_string();
        assert!(
            e.contains("graph 5: vertex 2") && e.contains("vertex 0"),
            "{e}"
        );
    }

    #[test]
    fn features_are_kept_and_inner_vertices_get_zeros() {
        let mut g = InputGraph::new();
        for t in 1..=3 {
            g.push_vertex(&[], t, 0).unwrap();
        }
        g.push_vertex(&[0, 1, 2], 0, 1).unwrap();
        g.set_features(2, (0..8).map(|x| x as f32).collect())
            .unwrap();
        let b = binarize(&g, Side::Right, 0).unwrap();
        assert_eq!(b.children(3), &[1, 2]);
        assert_eq!(b.children(4), &[0, 3]);
        assert_eq!(b.features(3), &[0.0, 0.0]);
        assert_eq!(b.features(4), &[6.0, 7.0]);
        assert_eq!(b.features(2), &[4.0, 5.0]);
    }

    #[test]
    fn random_trees_become_binary_with_their_leaves_and_root_label() {
        let leaves = |g: &InputGraph| -> Vec<(u32, i32)> {
            (0..g.len())
                .filter(|&v| g.children(v).is_empty())
                .map(|v| (g.tokens[v], g.labels[v]))
                .collect()
        };
        for seed in 0..40 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let t = random_tree(&mut rng, 1 + seed as usize % 13, &[1, 2, 3, 5], 50, 5).unwrap();
            for side in [Side::Left, Side::Right] {
                let b = binarize(&t, side, 0).unwrap();
                assert!((0..b.len()).all(|v| matches!(b.children(v).len(), 0 | 2)));
                assert_eq!(b.roots().len(), 1);
                assert_eq!(b.root_label(), t.root_label());
                let (before, after) = (leaves(&t), leaves(&b));
                assert_eq!(
                    before.iter().map(|l| l.0).collect::<Vec<_>>(),
                    after.iter().map(|l| l.0).collect::<Vec<_>>(),
                    "the words, in order"
                );
                assert_eq!(
                    binarize(&b, side, 0).unwrap(),
                    b,
                    "binarizing twice changes nothing"
                );
            }
        }
    }
}
