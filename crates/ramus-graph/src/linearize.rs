//! The data-structure linearizer of the compiled inference engine (Cortex
//! §4.2 and appendix B): turns a batch of trees, chains or DAGs into flat
//! arrays on the host, with dynamic batching done here, before any tensor
//! work.
//!
//! # Numbering
//!
//! A node's **level** is 0 for a leaf (no children) and 1 + the largest
//! level of its children otherwise; nodes of one level never depend on each
//! other, so each level is one batch. Nodes are numbered, as in Cortex
//! appendix B, so that
//!
//! * the nodes of a batch are **consecutive**: batch `i` is
//!   `batch_begin[i]..batch_begin[i] + batch_length[i]`;
//! * every node is numbered **higher than its parents**: internal nodes
//!   take `0..num_internal` by *decreasing* level (the highest level, where
//!   the tallest roots are, first; level 1 last), and
//! * the **leaves come after all internal nodes**: `num_internal..num_nodes`,
//!   so the leaf check is the single comparison `n >= num_internal`, with no
//!   memory load.
//!
//! Batches are listed in **execution order**: batch `i` holds the nodes of
//! level `i + 1`, so batch 0 (the lowest internal level, just below the
//! leaves) is numbered highest and the last batch holds the tallest roots
//! at `0..`. A compiled kernel runs the leaves first, all at once, on their
//! leaf-specialized path (or reads them from a per-token table), then walks
//! the batches in order with one barrier between them: every child of a node
//! in batch `i` is a leaf or lies in a batch before `i`. Inside a level,
//! nodes follow (graph, vertex) order. This is exactly the numbering of
//! [`Schedule`](crate::Schedule) under the Cavs policy (with one vertex
//! function, or one for leaves and one for internal vertices), so state
//! buffers can be shared between engines.
//!
//! A DAG vertex with several parents is one node, numbered once. Children
//! are kept in their order, in CSR form (`child_offsets`, `child_nodes`),
//! with [`LinearBatch::child`] (returning [`NO_CHILD`] for a missing child)
//! and [`LinearBatch::dense_children`] (`left[n]` / `right[n]`-style tables
//! for fixed-arity models) on top.
//!
//! # Cost
//!
//! A [`Linearizer`] keeps its output and scratch vectors between calls, so a
//! steady stream of batches allocates nothing once the buffers have grown.
//! Linearizing is a few linear passes over the vertices and edges (levels,
//! a counting sort by level, the per-node arrays, the child lists),
//! measured against Cortex's figures by `cargo run --release -p
//! ramus-graph --example linearize_bench` (`docs/benchmarks.md#linearizer`).
//!
//! # Inputs and errors
//!
//! [`Linearizer::linearize`] takes [`InputGraph`]s, whose constructor
//! guarantees that children precede their parents (no cycles, no child out
//! of range). [`Linearizer::linearize_csr`] takes raw CSR views
//! ([`CsrGraph`]) whose children may be listed in any order: those are
//! checked, and a malformed offset array, a child index out of range or a
//! cycle is an error naming the graph and the vertex. An empty batch or an
//! empty graph is an error too. Nothing in here panics on user input (an
//! `InputGraph` whose public `tokens` vector was lengthened by hand, out of
//! step with its child lists, is not a valid graph: `InputGraph::children`
//! itself panics on it).

use std::ops::Range;

use crate::{GraphError, InputGraph};

/// Returned by [`LinearBatch::child`] and stored in
/// [`LinearBatch::dense_children`] where a node has no such child.
pub const NO_CHILD: u32 = u32::MAX;

/// A graph given as raw CSR arrays: vertex `v` has the children
/// `children[child_offsets[v]..child_offsets[v + 1]]` (local vertex ids, in
/// any order: unlike [`InputGraph`], a child may have a higher id than its
/// parent) and the token `tokens[v]`. Everything is checked when the batch
/// is linearized.
#[derive(Clone, Copy, Debug)]
pub struct CsrGraph<'a> {
    /// `tokens.len() + 1` non-decreasing offsets, from 0 to `children.len()`.
    pub child_offsets: &'a [u32],
    pub children: &'a [u32],
    pub tokens: &'a [u32],
}

/// One batch of graphs laid out as arrays; see the module docs for the
/// numbering. Node numbers are `u32`, as uploaded to a device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinearBatch {
    num_internal: u32,
    /// First node of each batch (level `i + 1`), in execution order.
    batch_begin: Vec<u32>,
    /// Number of nodes of each batch.
    batch_length: Vec<u32>,
    /// `child_offsets[n]..child_offsets[n + 1]` indexes `child_nodes`.
    child_offsets: Vec<u32>,
    child_nodes: Vec<u32>,
    max_children: u32,
    /// Token of each node (internal tree nodes usually have token 0).
    tokens: Vec<u32>,
    /// Graph and local vertex of each node.
    node_graph: Vec<u32>,
    node_vertex: Vec<u32>,
    /// Node of local vertex `v` of graph `g`: `node[graph_offsets[g] + v]`.
    node: Vec<u32>,
    graph_offsets: Vec<u32>,
    /// Nodes without parent, graph by graph in local vertex order:
    /// `root_nodes[root_offsets[g]..root_offsets[g + 1]]`.
    root_nodes: Vec<u32>,
    root_offsets: Vec<u32>,
}

impl LinearBatch {
    /// Linearizes `graphs` with a fresh [`Linearizer`]; use a kept
    /// [`Linearizer`] to reuse buffers from batch to batch.
    pub fn new(graphs: &[&InputGraph]) -> Result<LinearBatch, GraphError> {
        let mut lin = Linearizer::new();
        lin.linearize(graphs)?;
        Ok(lin.out)
    }

    /// Number of nodes (all graphs).
    pub fn num_nodes(&self) -> usize {
        self.tokens.len()
    }

    /// Number of internal nodes, which is also the first leaf's number.
    pub fn num_internal(&self) -> usize {
        self.num_internal as usize
    }

    /// Number of leaves.
    pub fn num_leaves(&self) -> usize {
        self.num_nodes() - self.num_internal()
    }

    /// The leaves' numbers, `num_internal..num_nodes`.
    pub fn leaves(&self) -> Range<u32> {
        self.num_internal..self.tokens.len() as u32
    }

    /// Whether node `n` is a leaf: one comparison.
    #[inline]
    pub fn is_leaf(&self, n: u32) -> bool {
        n >= self.num_internal
    }

    /// Number of graphs in the batch.
    pub fn num_graphs(&self) -> usize {
        self.graph_offsets.len().saturating_sub(1)
    }

    /// Number of batches of internal nodes (the largest level).
    pub fn num_batches(&self) -> usize {
        self.batch_begin.len()
    }

    /// First node of each batch, in execution order (batch `i` is level
    /// `i + 1`; the values decrease).
    pub fn batch_begin(&self) -> &[u32] {
        &self.batch_begin
    }

    /// Number of nodes of each batch, in execution order.
    pub fn batch_length(&self) -> &[u32] {
        &self.batch_length
    }

    /// The nodes of batch `i` (level `i + 1`), or an empty range past the
    /// last batch.
    pub fn batch(&self, i: usize) -> Range<u32> {
        match (self.batch_begin.get(i), self.batch_length.get(i)) {
            (Some(&b), Some(&l)) => b..b + l,
            _ => 0..0,
        }
    }

    /// CSR offsets of the child lists, `num_nodes + 1` entries; the leaves'
    /// lists are empty.
    pub fn child_offsets(&self) -> &[u32] {
        &self.child_offsets
    }

    /// All child lists, node after node (node numbers).
    pub fn child_nodes(&self) -> &[u32] {
        &self.child_nodes
    }

    /// The children of node `n`, in order (empty for a leaf or an unknown node).
    pub fn children(&self, n: u32) -> &[u32] {
        let n = n as usize;
        match (self.child_offsets.get(n), self.child_offsets.get(n + 1)) {
            (Some(&a), Some(&b)) => &self.child_nodes[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Child `k` of node `n`, or [`NO_CHILD`].
    #[inline]
    pub fn child(&self, n: u32, k: usize) -> u32 {
        self.children(n).get(k).copied().unwrap_or(NO_CHILD)
    }

    /// The largest number of children of any node in the batch.
    pub fn max_children(&self) -> usize {
        self.max_children as usize
    }

    /// Fills `out` with a dense, slot-major child table for the internal
    /// nodes of a model of fixed `arity`: child `k` of internal node `n` is
    /// `out[k * num_internal + n]`, [`NO_CHILD`] where `n` has fewer
    /// children (so `left = &out[..num_internal]`, `right =
    /// &out[num_internal..2 * num_internal]`). Leaves have no entry. Fails,
    /// naming the graph and vertex, when a node has more than `arity`
    /// children.
    pub fn dense_children(&self, arity: usize, out: &mut Vec<u32>) -> Result<(), GraphError> {
        let ni = self.num_internal();
        out.clear();
        if self.max_children() > arity {
            let n = (0..self.num_internal)
                .find(|&n| self.children(n).len() > arity)
                .unwrap_or(0);
            let (g, v) = self.origin(n);
            return Err(GraphError::Structure(format!(
                "graph {g} vertex {v}: {} children, more than the arity {arity}",
                self.children(n).len()
            )));
        }
        let Some(len) = arity.checked_mul(ni) else {
            return Err(GraphError::Structure(format!(
                "a dense child table of arity {arity} for {ni} internal nodes is too large"
            )));
        };
        out.resize(len, NO_CHILD);
        for n in 0..ni {
            for (k, &c) in self.children(n as u32).iter().enumerate() {
                out[k * ni + n] = c;
            }
        }
        Ok(())
    }

    /// Token of every node; [`LinearBatch::leaf_tokens`] for the leaves only.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens of the leaves, leaf `num_internal + i` at `i`.
    pub fn leaf_tokens(&self) -> &[u32] {
        &self.tokens[self.num_internal()..]
    }

    /// The graph (index in the batch) and local vertex id of node `n`.
    ///
    /// # Panics
    ///
    /// If `n` is not a node of the batch (`n >= num_nodes`).
    pub fn origin(&self, n: u32) -> (usize, usize) {
        let n = n as usize;
        (self.node_graph[n] as usize, self.node_vertex[n] as usize)
    }

    /// Graph of each node.
    pub fn node_graph(&self) -> &[u32] {
        &self.node_graph
    }

    /// Local vertex id of each node.
    pub fn node_vertex(&self) -> &[u32] {
        &self.node_vertex
    }

    /// The node of local vertex `v` of graph `g`, if both exist.
    pub fn node(&self, g: usize, v: usize) -> Option<u32> {
        let base = *self.graph_offsets.get(g)? as usize;
        let end = *self.graph_offsets.get(g + 1)? as usize;
        (v < end - base).then(|| self.node[base + v])
    }

    /// Node of every vertex, graph by graph: `node_of_vertex()[graph_offsets()[g] + v]`.
    pub fn node_of_vertex(&self) -> &[u32] {
        &self.node
    }

    /// Offsets of each graph's vertices in [`LinearBatch::node_of_vertex`].
    pub fn graph_offsets(&self) -> &[u32] {
        &self.graph_offsets
    }

    /// Root node of graph `g`: its last vertex without parent (the root of
    /// a tree, the end of a chain). For DAGs with several sinks see
    /// [`LinearBatch::roots`].
    pub fn root(&self, g: usize) -> u32 {
        self.roots(g).last().copied().unwrap_or(NO_CHILD)
    }

    /// Nodes of graph `g` without parent, in local vertex order.
    pub fn roots(&self, g: usize) -> &[u32] {
        match (self.root_offsets.get(g), self.root_offsets.get(g + 1)) {
            (Some(&a), Some(&b)) => &self.root_nodes[a as usize..b as usize],
            _ => &[],
        }
    }

    /// All parentless nodes, graph by graph; see [`LinearBatch::root_offsets`].
    pub fn root_nodes(&self) -> &[u32] {
        &self.root_nodes
    }

    /// `root_nodes()[root_offsets()[g]..root_offsets()[g + 1]]` are graph `g`'s roots.
    pub fn root_offsets(&self) -> &[u32] {
        &self.root_offsets
    }

    fn clear(&mut self) {
        self.num_internal = 0;
        self.max_children = 0;
        self.batch_begin.clear();
        self.batch_length.clear();
        self.child_offsets.clear();
        self.child_nodes.clear();
        self.tokens.clear();
        self.node_graph.clear();
        self.node_vertex.clear();
        self.node.clear();
        self.graph_offsets.clear();
        self.root_nodes.clear();
        self.root_offsets.clear();
    }
}

/// Linearizes batches into a [`LinearBatch`] it keeps, reusing its buffers
/// from call to call.
#[derive(Clone, Debug, Default)]
pub struct Linearizer {
    out: LinearBatch,
    /// Level of each vertex, by global id (graph offset + local id).
    level: Vec<u32>,
    /// Nodes per level, then the next free number of each level.
    cursor: Vec<u32>,
    has_parent: Vec<bool>,
    /// Depth-first search over a graph whose children are not all earlier:
    /// per-vertex state (0 new, 1 open, 2 done) and (vertex, next child).
    state: Vec<u8>,
    stack: Vec<(u32, u32)>,
}

impl Linearizer {
    /// A linearizer with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Linearizes a batch of input graphs.
    pub fn linearize(&mut self, graphs: &[&InputGraph]) -> Result<&LinearBatch, GraphError> {
        self.run(graphs)?;
        Ok(&self.out)
    }

    /// Linearizes a batch of raw CSR graphs, checking their structure.
    pub fn linearize_csr(&mut self, graphs: &[CsrGraph<'_>]) -> Result<&LinearBatch, GraphError> {
        self.run(graphs)?;
        Ok(&self.out)
    }

    /// The last batch linearized (empty before the first, unspecified after an error).
    pub fn batch(&self) -> &LinearBatch {
        &self.out
    }

    /// Gives up the last batch linearized.
    pub fn into_batch(self) -> LinearBatch {
        self.out
    }

    fn run<G: Source>(&mut self, graphs: &[G]) -> Result<(), GraphError> {
        if graphs.is_empty() {
            return Err(GraphError::Schedule("the batch holds no graph".into()));
        }
        self.out.clear();
        let (n, edges) = count_graphs(&mut self.out, graphs)?;
        self.levels(graphs, n)?;
        let num_internal = number_levels(&mut self.out, &mut self.cursor, n);
        self.number_nodes(graphs, n);
        child_lists(&mut self.out, graphs, n, edges, num_internal);
        Ok(())
    }

    /// Levels, in one pass when every child precedes its parent (always
    /// for an InputGraph), else by a depth-first search that also finds
    /// cycles and children out of range; nodes per level are counted on
    /// the way (into `cursor`).
    fn levels<G: Source>(&mut self, graphs: &[G], n: usize) -> Result<(), GraphError> {
        self.level.clear();
        self.level.resize(n, 0);
        self.has_parent.clear();
        self.has_parent.resize(n, false);
        self.cursor.clear();
        self.cursor.push(0);
        let cursor = &mut self.cursor;
        for (gi, g) in graphs.iter().enumerate() {
            let base = self.out.graph_offsets[gi] as usize;
            let len = g.len();
            let level = &mut self.level[base..base + len];
            let has_parent = &mut self.has_parent[base..base + len];
            let mut ordered = len;
            'vertices: for v in 0..len {
                let mut h = 0;
                for &c in g.children(v) {
                    let c = c as usize;
                    if c >= v {
                        ordered = v;
                        break 'vertices;
                    }
                    h = h.max(level[c] + 1);
                    has_parent[c] = true;
                }
                level[v] = h;
                let h = h as usize;
                if h >= cursor.len() {
                    cursor.resize(h + 1, 0);
                }
                cursor[h] += 1;
            }
            if ordered < len {
                // Take back what the ordered pass counted, search, count again.
                for &h in &level[..ordered] {
                    cursor[h as usize] -= 1;
                }
                has_parent.fill(false);
                let max =
                    levels_by_search(g, gi, level, has_parent, &mut self.state, &mut self.stack)?;
                if max as usize >= cursor.len() {
                    cursor.resize(max as usize + 1, 0);
                }
                for &h in level.iter() {
                    cursor[h as usize] += 1;
                }
            }
        }
        Ok(())
    }

    /// Numbers, and per node: graph, vertex, token; roots graph by graph.
    fn number_nodes<G: Source>(&mut self, graphs: &[G], n: usize) {
        let out = &mut self.out;
        out.node.resize(n, 0);
        out.node_graph.resize(n, 0);
        out.node_vertex.resize(n, 0);
        out.tokens.resize(n, 0);
        out.root_offsets.push(0);
        let node = &mut out.node[..];
        let node_graph = &mut out.node_graph[..];
        let node_vertex = &mut out.node_vertex[..];
        let tokens = &mut out.tokens[..];
        let (level, has_parent) = (&self.level[..], &self.has_parent[..]);
        let cursor = &mut self.cursor;
        let mut id = 0usize;
        for (gi, g) in graphs.iter().enumerate() {
            for v in 0..g.len() {
                let slot = &mut cursor[level[id] as usize];
                let m = *slot;
                *slot += 1;
                node[id] = m;
                let m = m as usize;
                node_graph[m] = gi as u32;
                node_vertex[m] = v as u32;
                tokens[m] = g.token(v);
                if !has_parent[id] {
                    out.root_nodes.push(m as u32);
                }
                id += 1;
            }
            out.root_offsets.push(out.root_nodes.len() as u32);
        }
    }
}

/// Vertex and edge counts of the batch, with the structure of raw graphs
/// checked; fills `out`'s graph offsets.
fn count_graphs<G: Source>(
    out: &mut LinearBatch,
    graphs: &[G],
) -> Result<(usize, u64), GraphError> {
    out.graph_offsets.push(0);
    let (mut n, mut edges) = (0u64, 0u64);
    for (gi, g) in graphs.iter().enumerate() {
        if g.len() == 0 {
            return Err(GraphError::Schedule(format!(
                "graph {gi} of the batch has no vertex"
            )));
        }
        g.check(gi)?;
        n += g.len() as u64;
        edges += g.num_edges() as u64;
        // NO_CHILD must never be a node number.
        if n >= u64::from(NO_CHILD) || edges >= u64::from(NO_CHILD) {
            return Err(GraphError::Schedule(format!(
                "the batch is too large at graph {gi}: {n} vertices, {edges} edges"
            )));
        }
        out.graph_offsets.push(n as u32);
    }
    Ok((n as usize, edges))
}

/// Counting sort by level: internal levels from the top down, leaves last.
/// `cursor[l]` (nodes of level `l`) becomes the next free number of level
/// `l`; returns the number of internal nodes.
fn number_levels(out: &mut LinearBatch, cursor: &mut [u32], n: usize) -> u32 {
    let levels = cursor.len();
    let num_internal = n as u32 - cursor[0];
    out.num_internal = num_internal;
    out.batch_begin.resize(levels - 1, 0);
    out.batch_length.resize(levels - 1, 0);
    let mut next = 0u32;
    for l in (1..levels).rev() {
        let count = cursor[l];
        out.batch_begin[l - 1] = next;
        out.batch_length[l - 1] = count;
        cursor[l] = next;
        next += count;
    }
    cursor[0] = num_internal;
    num_internal
}

/// Child lists in node order.
fn child_lists<G: Source>(
    out: &mut LinearBatch,
    graphs: &[G],
    n: usize,
    edges: u64,
    num_internal: u32,
) {
    let child_offsets = &mut out.child_offsets;
    let child_nodes = &mut out.child_nodes;
    child_offsets.reserve(n + 1);
    child_offsets.push(0);
    child_nodes.reserve(edges as usize);
    let (node, graph_offsets) = (&out.node[..], &out.graph_offsets[..]);
    let mut max_children = 0;
    for (&gi, &v) in out.node_graph[..num_internal as usize]
        .iter()
        .zip(&out.node_vertex[..num_internal as usize])
    {
        let base = graph_offsets[gi as usize] as usize;
        let kids = graphs[gi as usize].children(v as usize);
        max_children = max_children.max(kids.len());
        child_nodes.extend(kids.iter().map(|&c| node[base + c as usize]));
        child_offsets.push(child_nodes.len() as u32);
    }
    child_offsets.resize(n + 1, child_nodes.len() as u32);
    out.max_children = max_children as u32;
}

/// Levels of one graph whose children are not all earlier vertices, by an
/// iterative depth-first search; returns the largest level. `level` and
/// `has_parent` are the graph's slices.
fn levels_by_search<G: Source>(
    g: &G,
    gi: usize,
    level: &mut [u32],
    has_parent: &mut [bool],
    state: &mut Vec<u8>,
    stack: &mut Vec<(u32, u32)>,
) -> Result<u32, GraphError> {
    const NEW: u8 = 0;
    const OPEN: u8 = 1;
    const DONE: u8 = 2;
    let len = g.len();
    state.clear();
    state.resize(len, NEW);
    stack.clear();
    let mut max_level = 0;
    for start in 0..len {
        if state[start] != NEW {
            continue;
        }
        state[start] = OPEN;
        stack.push((start as u32, 0));
        while let Some(top) = stack.last_mut() {
            let (u, k) = (top.0 as usize, top.1 as usize);
            let kids = g.children(u);
            if let Some(&c) = kids.get(k) {
                top.1 += 1;
                let c = c as usize;
                if c >= len {
                    return Err(GraphError::Structure(format!(
                        "graph {gi} vertex {u}: child {k} is vertex {c}, out of range (the graph has {len} vertices)"
                    )));
                }
                has_parent[c] = true;
                match state[c] {
                    NEW => {
                        state[c] = OPEN;
                        stack.push((c as u32, 0));
                    }
                    OPEN => {
                        return Err(GraphError::Structure(format!(
                            "graph {gi} vertex {u}: child {k} (vertex {c}) closes a cycle"
                        )));
                    }
                    _ => {}
                }
            } else {
                let h = kids
                    .iter()
                    .map(|&c| level[c as usize] + 1)
                    .max()
                    .unwrap_or(0);
                level[u] = h;
                max_level = max_level.max(h);
                state[u] = DONE;
                stack.pop();
            }
        }
    }
    Ok(max_level)
}

/// What the linearizer reads from a graph. `children(v)` must not panic for
/// `v < len()` once `check` has passed; child ids are checked by the caller.
trait Source {
    fn len(&self) -> usize;
    fn num_edges(&self) -> usize;
    fn children(&self, v: usize) -> &[u32];
    fn token(&self, v: usize) -> u32;
    fn check(&self, gi: usize) -> Result<(), GraphError>;
}

impl Source for &InputGraph {
    #[inline]
    fn len(&self) -> usize {
        InputGraph::len(self)
    }
    fn num_edges(&self) -> usize {
        InputGraph::num_edges(self)
    }
    #[inline]
    fn children(&self, v: usize) -> &[u32] {
        InputGraph::children(self, v)
    }
    #[inline]
    fn token(&self, v: usize) -> u32 {
        self.tokens[v]
    }
    /// `InputGraph::push_vertex` keeps the structure consistent.
    fn check(&self, _gi: usize) -> Result<(), GraphError> {
        Ok(())
    }
}

impl Source for CsrGraph<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn num_edges(&self) -> usize {
        self.children.len()
    }
    #[inline]
    fn children(&self, v: usize) -> &[u32] {
        &self.children[self.child_offsets[v] as usize..self.child_offsets[v + 1] as usize]
    }
    #[inline]
    fn token(&self, v: usize) -> u32 {
        self.tokens[v]
    }
    fn check(&self, gi: usize) -> Result<(), GraphError> {
        let len = self.tokens.len();
        let offsets = self.child_offsets;
        if offsets.len() != len + 1 {
            return Err(GraphError::Structure(format!(
                "graph {gi}: {} child offsets for {len} vertices (expected {})",
                offsets.len(),
                len + 1
            )));
        }
        if offsets[0] != 0 {
            return Err(GraphError::Structure(format!(
                "graph {gi} vertex 0: child offsets start at {}, not 0",
                offsets[0]
            )));
        }
        if let Some(v) = (0..len).find(|&v| offsets[v + 1] < offsets[v]) {
            return Err(GraphError::Structure(format!(
                "graph {gi} vertex {v}: child offsets decrease ({} then {})",
                offsets[v],
                offsets[v + 1]
            )));
        }
        if offsets[len] as usize != self.children.len() {
            return Err(GraphError::Structure(format!(
                "graph {gi} vertex {}: child offsets end at {}, but there are {} children",
                len.saturating_sub(1),
                offsets[len],
                self.children.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_a_small_tree_as_in_cortex_appendix_b() {
        // ((a b) c): vertices a=0 b=1 (ab)=2 c=3 root=4
        let mut g = InputGraph::new();
        let a = g.push_vertex(&[], 10, 0).unwrap();
        let b = g.push_vertex(&[], 11, 0).unwrap();
        let ab = g.push_vertex(&[a, b], 0, 0).unwrap();
        let c = g.push_vertex(&[], 12, 0).unwrap();
        let r = g.push_vertex(&[ab, c], 0, 0).unwrap();
        let lb = LinearBatch::new(&[&g]).unwrap();
        assert_eq!(lb.num_internal(), 2);
        assert_eq!(lb.batch_begin(), &[1, 0]); // level 1 runs first
        assert_eq!(lb.batch_length(), &[1, 1]);
        assert_eq!(lb.root(0), 0);
        assert_eq!(lb.node(0, r as usize), Some(0));
        assert_eq!(lb.node(0, ab as usize), Some(1));
        assert_eq!(lb.leaf_tokens(), &[10, 11, 12]);
        assert_eq!(lb.children(0), &[1, 4]);
        assert_eq!(lb.children(1), &[2, 3]);
        assert_eq!(lb.child(0, 2), NO_CHILD);
        let mut dense = Vec::new();
        lb.dense_children(2, &mut dense).unwrap();
        assert_eq!(dense, vec![1, 2, 4, 3]); // left = [1, 2], right = [4, 3]
        assert!(lb.dense_children(1, &mut dense).is_err());
    }
}
