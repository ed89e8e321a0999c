//! Input graphs (Cavs' `G`): one sample's structure — vertices with ordered
//! children, a token id, an optional class label, a *kind* and optional
//! float features per vertex (what a vertex function's `pull()` reads:
//! image pixels, feature vectors). Trees, chains (sequences) and DAGs share
//! this one representation.
//!
//! The kind is a small integer naming the vertex's role for models whose
//! vertex function is chosen per role rather than per number of children
//! (`FunctionSelector::ByKind` in `ramus-core`): the forward step, backward
//! step and output vertex of a BiLSTM sentence ([`crate::sequence`]) all
//! have the same shape of children but run different functions. Readers
//! that do not set kinds leave every vertex at kind 0.

use std::fmt;
use std::sync::Arc;

use crate::GraphError;

/// Marker for "no label" in [`InputGraph::labels`].
pub const NO_LABEL: i32 = -1;

/// Where a graph was read from: its file and 1-based line (0 when the
/// whole file is one graph, as an image is), so that an error about the
/// graph found after reading (a vertex a model cannot use, a label out of
/// range) names the input to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub file: Arc<str>,
    pub line: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            0 => write!(f, "{}", self.file),
            line => write!(f, "{}:{line}", self.file),
        }
    }
}

/// One sample's structure. Vertices are numbered `0..len()`; the children of
/// a vertex are listed in order (child 0 first). Every child must have a
/// smaller id than its parent (a topological numbering: post-order for
/// trees, left-to-right for chains), which makes cycles impossible and lets
/// schedules be computed in one pass.
///
/// Equality compares the structure and the per-vertex data, not the
/// [`Origin`].
#[derive(Clone, Debug, Default)]
pub struct InputGraph {
    /// `child_offsets[v]..child_offsets[v + 1]` indexes `children` for vertex `v`.
    child_offsets: Vec<u32>,
    children: Vec<u32>,
    /// Token (word id) of each vertex; internal tree nodes use token 0.
    pub tokens: Vec<u32>,
    /// Class label of each vertex, or [`NO_LABEL`].
    pub labels: Vec<i32>,
    /// Kind of each vertex (see the module docs); 0 by default.
    kinds: Vec<u16>,
    /// `feature_width` floats per vertex (vertex-major), or none.
    features: Vec<f32>,
    feature_width: usize,
    origin: Option<Origin>,
}

impl PartialEq for InputGraph {
    fn eq(&self, o: &Self) -> bool {
        self.child_offsets == o.child_offsets
            && self.children == o.children
            && self.tokens == o.tokens
            && self.labels == o.labels
            && self.kinds == o.kinds
            && self.features == o.features
            && self.feature_width == o.feature_width
    }
}

impl InputGraph {
    /// An empty graph, to be filled with [`InputGraph::push_vertex`].
    pub fn new() -> Self {
        InputGraph {
            child_offsets: vec![0],
            ..Default::default()
        }
    }

    /// An empty graph with room for `vertices` vertices and `edges` child
    /// edges, for a builder that knows its size (a pyramid).
    pub fn with_capacity(vertices: usize, edges: usize) -> Self {
        let mut child_offsets = Vec::with_capacity(vertices + 1);
        child_offsets.push(0);
        InputGraph {
            child_offsets,
            children: Vec::with_capacity(edges),
            tokens: Vec::with_capacity(vertices),
            labels: Vec::with_capacity(vertices),
            kinds: Vec::with_capacity(vertices),
            ..Default::default()
        }
    }

    /// Appends a vertex whose children are `children` (ids of vertices added
    /// before it) and returns its id.
    pub fn push_vertex(
        &mut self,
        children: &[u32],
        token: u32,
        label: i32,
    ) -> Result<u32, GraphError> {
        self.push_vertex_of_kind(0, children, token, label)
    }

    /// Appends a vertex of `kind` (see the module docs) whose children are
    /// `children` and returns its id.
    pub fn push_vertex_of_kind(
        &mut self,
        kind: u16,
        children: &[u32],
        token: u32,
        label: i32,
    ) -> Result<u32, GraphError> {
        let id = self.tokens.len() as u32;
        if let Some(&bad) = children.iter().find(|&&c| c >= id) {
            return Err(GraphError::Structure(format!(
                "vertex {id}: child {bad} is not an earlier vertex (children must be added before their parents)"
            )));
        }
        self.children.extend_from_slice(children);
        self.child_offsets.push(self.children.len() as u32);
        self.tokens.push(token);
        self.labels.push(label);
        self.kinds.push(kind);
        Ok(id)
    }

    /// A chain `0 <- 1 <- ... <- n-1`: vertex `t` has vertex `t-1` as its only child.
    pub fn chain(tokens: &[u32], labels: &[i32]) -> Result<Self, GraphError> {
        if tokens.len() != labels.len() {
            return Err(GraphError::Structure(format!(
                "chain: {} tokens but {} labels",
                tokens.len(),
                labels.len()
            )));
        }
        let mut g = InputGraph::new();
        for (t, (&tok, &lab)) in tokens.iter().zip(labels).enumerate() {
            if t == 0 {
                g.push_vertex(&[], tok, lab)?;
            } else {
                g.push_vertex(&[t as u32 - 1], tok, lab)?;
            }
        }
        Ok(g)
    }

    /// Attaches `width` float features to every vertex (`data` is
    /// vertex-major, `len() * width` floats); `pull(width)` reads them.
    pub fn set_features(&mut self, width: usize, data: Vec<f32>) -> Result<(), GraphError> {
        if data.len() != self.len() * width {
            return Err(GraphError::Structure(format!(
                "features: {} floats for {} vertices of width {width} (expected {})",
                data.len(),
                self.len(),
                self.len() * width
            )));
        }
        self.features = data;
        self.feature_width = width;
        Ok(())
    }

    /// Floats of features per vertex (0 when the graph has none).
    pub fn feature_width(&self) -> usize {
        self.feature_width
    }

    /// The features of vertex `v` (empty when the graph has none).
    pub fn features(&self, v: usize) -> &[f32] {
        let w = self.feature_width;
        self.features.get(v * w..(v + 1) * w).unwrap_or(&[])
    }

    /// The kind of vertex `v` (0 for a vertex added without one).
    pub fn kind(&self, v: usize) -> u16 {
        self.kinds.get(v).copied().unwrap_or(0)
    }

    /// Where the graph was read from, if a reader said.
    pub fn origin(&self) -> Option<&Origin> {
        self.origin.as_ref()
    }

    /// Records where the graph was read from.
    pub fn set_origin(&mut self, origin: Origin) {
        self.origin = Some(origin);
    }

    /// [`InputGraph::set_origin`], by value.
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// The graph's place for messages: `file:line`, or `graph N` (its
    /// index in a batch) for a graph no reader made.
    pub fn describe(&self, index: usize) -> String {
        match &self.origin {
            Some(o) => o.to_string(),
            None => format!("graph {index}"),
        }
    }

    /// Number of vertices.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the graph has no vertex.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Ordered children of vertex `v`.
    pub fn children(&self, v: usize) -> &[u32] {
        &self.children[self.child_offsets[v] as usize..self.child_offsets[v + 1] as usize]
    }

    /// The kind and number of children of every vertex, in id order.
    pub fn kinds_and_child_counts(&self) -> impl Iterator<Item = (u16, usize)> + '_ {
        self.kinds
            .iter()
            .zip(self.child_offsets.windows(2))
            .map(|(&kind, w)| (kind, (w[1] - w[0]) as usize))
    }

    /// Total number of child edges.
    pub fn num_edges(&self) -> usize {
        self.children.len()
    }

    /// Vertices that are nobody's child (the root of a tree, the last
    /// vertex of a chain, the sinks of a DAG), in increasing id order.
    pub fn roots(&self) -> Vec<u32> {
        let mut has_parent = vec![false; self.len()];
        for &c in &self.children {
            has_parent[c as usize] = true;
        }
        (0..self.len() as u32)
            .filter(|&v| !has_parent[v as usize])
            .collect()
    }

    /// Height of every vertex: 0 for leaves, else 1 + the largest child height.
    pub fn heights(&self) -> Vec<u32> {
        let mut h = vec![0u32; self.len()];
        for v in 0..self.len() {
            h[v] = self
                .children(v)
                .iter()
                .map(|&c| h[c as usize] + 1)
                .max()
                .unwrap_or(0);
        }
        h
    }

    /// True when every vertex has at most one parent (a forest).
    pub fn is_forest(&self) -> bool {
        let mut seen = vec![false; self.len()];
        for &c in &self.children {
            if std::mem::replace(&mut seen[c as usize], true) {
                return false;
            }
        }
        true
    }

    /// Label of the first root, if it has one (the sentence label of a tree).
    pub fn root_label(&self) -> Option<i32> {
        let r = *self.roots().last()?;
        let l = self.labels[r as usize];
        (l != NO_LABEL).then_some(l)
    }

    /// The counts its memory depends on (see [`GraphShape`]).
    pub fn shape(&self) -> GraphShape {
        let mut vertices: Vec<(u16, usize, u64)> = Vec::new();
        for (kind, kids) in self.kinds_and_child_counts() {
            match vertices.iter_mut().find(|c| (c.0, c.1) == (kind, kids)) {
                Some(c) => c.2 += 1,
                None => vertices.push((kind, kids, 1)),
            }
        }
        vertices.sort_unstable();
        GraphShape {
            vertices,
            roots: self.roots().len() as u64,
            labelled: self.labels.iter().filter(|&&l| l != NO_LABEL).count() as u64,
            features: self.features.len() as u64,
        }
    }
}

/// Bytes an [`InputGraph`] keeps per vertex: its child offset, token,
/// label and kind.
pub const INPUT_BYTES_PER_VERTEX: u64 = 4 + 4 + 4 + 2;
/// Bytes an [`InputGraph`] keeps per child edge (the child's id).
pub const INPUT_BYTES_PER_EDGE: u64 = 4;

/// What the memory of a graph, and of a batch's work on it, depends on:
/// its vertices by kind and number of children, its roots, labelled
/// vertices and feature floats. [`InputGraph::shape`] counts them; a
/// builder whose size follows from its input computes them before building
/// ([`crate::sequence::pyramid_shape`]), so that what cannot fit is refused
/// before it is allocated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphShape {
    /// `(kind, children, number of such vertices)`, each pair once, sorted.
    pub vertices: Vec<(u16, usize, u64)>,
    /// Vertices that are nobody's child.
    pub roots: u64,
    /// Vertices with a label.
    pub labelled: u64,
    /// Feature floats, all vertices together.
    pub features: u64,
}

impl GraphShape {
    /// Number of vertices (saturating).
    pub fn vertex_count(&self) -> u64 {
        self.vertices
            .iter()
            .fold(0u64, |s, c| s.saturating_add(c.2))
    }

    /// Number of child edges (saturating).
    pub fn edge_count(&self) -> u64 {
        self.vertices.iter().fold(0u64, |s, c| {
            s.saturating_add((c.1 as u64).saturating_mul(c.2))
        })
    }

    /// Bytes the graph itself holds ([`INPUT_BYTES_PER_VERTEX`],
    /// [`INPUT_BYTES_PER_EDGE`], 4 per feature float), saturating.
    pub fn input_bytes(&self) -> u64 {
        self.vertex_count()
            .saturating_mul(INPUT_BYTES_PER_VERTEX)
            .saturating_add(self.edge_count().saturating_mul(INPUT_BYTES_PER_EDGE))
            .saturating_add(self.features.saturating_mul(4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_tree_and_reports_structure() {
        let mut g = InputGraph::new();
        let a = g.push_vertex(&[], 1, 2).unwrap();
        let b = g.push_vertex(&[], 2, 3).unwrap();
        let r = g.push_vertex(&[a, b], 0, 4).unwrap();
        assert_eq!(g.children(r as usize), &[0, 1]);
        assert_eq!(g.roots(), vec![2]);
        assert_eq!(g.heights(), vec![0, 0, 1]);
        assert!(g.is_forest());
        assert_eq!(g.root_label(), Some(4));
    }

    #[test]
    fn shape_counts_vertices_by_kind_and_children_and_the_graphs_bytes() {
        let mut g = InputGraph::with_capacity(5, 4);
        let a = g.push_vertex(&[], 1, NO_LABEL).unwrap();
        let b = g.push_vertex_of_kind(2, &[], 2, 1).unwrap();
        let ab = g.push_vertex(&[a, b], 0, NO_LABEL).unwrap();
        g.push_vertex(&[ab], 0, 3).unwrap();
        g.push_vertex(&[b], 0, NO_LABEL).unwrap();
        g.set_features(3, vec![0.0; 15]).unwrap();
        let s = g.shape();
        assert_eq!(s.vertices, vec![(0, 0, 1), (0, 1, 2), (0, 2, 1), (2, 0, 1)]);
        assert_eq!((s.roots, s.labelled, s.features), (2, 2, 15));
        assert_eq!((s.vertex_count(), s.edge_count()), (5, 4));
        // what the graph holds: its vectors' lengths
        let held = 4 * (g.child_offsets.len() - 1)
            + 4 * g.children.len()
            + 4 * g.tokens.len()
            + 4 * g.labels.len()
            + 2 * g.kinds.len()
            + 4 * g.features.len();
        assert_eq!(s.input_bytes(), held as u64);
        assert_eq!(InputGraph::new().shape(), GraphShape::default());
    }

    #[test]
    fn kinds_default_to_zero_and_are_kept() {
        let mut g = InputGraph::new();
        let a = g.push_vertex(&[], 1, NO_LABEL).unwrap();
        let b = g.push_vertex_of_kind(3, &[a], 2, 1).unwrap();
        assert_eq!((g.kind(a as usize), g.kind(b as usize)), (0, 3));
        assert_eq!(g.kind(9), 0, "out of range reads as kind 0");
        assert!(g.push_vertex_of_kind(1, &[7], 0, 0).is_err());
    }

    #[test]
    fn origin_names_the_input_and_is_not_compared() {
        let g = InputGraph::chain(&[1], &[0]).unwrap();
        assert_eq!(g.describe(4), "graph 4");
        let file: Arc<str> = Arc::from("a.txt");
        let located = g.clone().with_origin(Origin { file, line: 7 });
        assert_eq!(located.describe(4), "a.txt:7");
        assert_eq!(located, g);
        let whole = Origin {
            file: Arc::from("img.png"),
            line: 0,
        };
        assert_eq!(whole.to_string(), "img.png");
    }

    #[test]
    fn rejects_forward_child() {
        let mut g = InputGraph::new();
        assert!(g.push_vertex(&[0], 0, 0).is_err());
    }

    #[test]
    fn dag_with_shared_child_is_not_forest() {
        let mut g = InputGraph::new();
        g.push_vertex(&[], 0, NO_LABEL).unwrap();
        g.push_vertex(&[0], 0, NO_LABEL).unwrap();
        g.push_vertex(&[0, 1], 0, NO_LABEL).unwrap();
        assert!(!g.is_forest());
        assert_eq!(g.roots(), vec![2]);
    }

    #[test]
    fn features_attach_per_vertex_and_are_checked() {
        let mut g = InputGraph::chain(&[1, 2], &[0, 1]).unwrap();
        assert_eq!(g.feature_width(), 0);
        assert!(g.features(0).is_empty());
        assert!(g.set_features(3, vec![0.0; 5]).is_err());
        g.set_features(3, (0..6).map(|i| i as f32).collect())
            .unwrap();
        assert_eq!(g.feature_width(), 3);
        assert_eq!(g.features(1), &[3.0, 4.0, 5.0]);
    }

    #[test]
    fn chain_links_predecessors() {
        let g = InputGraph::chain(&[5, 6, 7], &[6, 7, NO_LABEL]).unwrap();
        assert_eq!(g.children(2), &[1]);
        assert_eq!(g.heights(), vec![0, 1, 2]);
    }
}
