//! Random input graphs for tests and benchmarks: trees of chosen arities
//! (including degenerate shapes: chains, wide nodes), labelled chains and
//! grid DAGs.

use rand::Rng;

use crate::input::InputGraph;
use crate::GraphError;

/// A random tree over `leaves` leaves: repeatedly joins `k` adjacent
/// frontier vertices (`k` drawn from `arities`, capped by what is left)
/// under a new parent. Leaves get random tokens below `vocab`; every vertex
/// a random label below `classes`. An arity of 1 makes a one-child vertex;
/// if no arity is at least 2, pairs are joined (so the tree is finite).
pub fn random_tree(
    rng: &mut impl Rng,
    leaves: usize,
    arities: &[usize],
    vocab: u32,
    classes: i32,
) -> Result<InputGraph, GraphError> {
    let mut g = InputGraph::new();
    let mut frontier = Vec::with_capacity(leaves.max(1));
    for _ in 0..leaves.max(1) {
        let token = rng.random_range(0..vocab.max(1));
        frontier.push(g.push_vertex(&[], token, rng.random_range(0..classes.max(1)))?);
    }
    let joins = arities.iter().any(|&k| k >= 2);
    while frontier.len() > 1 {
        let pick = if joins {
            arities[rng.random_range(0..arities.len())]
        } else {
            2
        };
        let k = pick.clamp(1, frontier.len());
        let at = rng.random_range(0..=frontier.len() - k);
        let kids: Vec<u32> = frontier.drain(at..at + k).collect();
        let v = g.push_vertex(&kids, 0, rng.random_range(0..classes.max(1)))?;
        frontier.insert(at, v);
    }
    Ok(g)
}

/// A tree whose internal vertices each have one child: `depth` vertices in
/// a line above one leaf (the deepest shape for a given size).
pub fn random_path(
    rng: &mut impl Rng,
    depth: usize,
    vocab: u32,
    classes: i32,
) -> Result<InputGraph, GraphError> {
    let mut g = InputGraph::new();
    let token = rng.random_range(0..vocab.max(1));
    let mut top = g.push_vertex(&[], token, rng.random_range(0..classes.max(1)))?;
    for _ in 1..depth.max(1) {
        top = g.push_vertex(&[top], 0, rng.random_range(0..classes.max(1)))?;
    }
    Ok(g)
}

/// A chain of `len` random tokens whose labels are random tokens too (a
/// language-model sample).
pub fn random_chain(rng: &mut impl Rng, len: usize, vocab: u32) -> Result<InputGraph, GraphError> {
    let tokens: Vec<u32> = (0..len)
        .map(|_| rng.random_range(0..vocab.max(1)))
        .collect();
    let labels: Vec<i32> = (0..len)
        .map(|_| rng.random_range(0..vocab.max(1)) as i32)
        .collect();
    InputGraph::chain(&tokens, &labels)
}

/// A `rows × cols` grid DAG (Cortex's DAG-RNN input): vertex `(i, j)` is
/// number `i · cols + j` and its children (predecessors) are `(i - 1, j)` and
/// `(i, j - 1)` where they exist, so inner vertices have two parents and the
/// bottom-right corner is the one root. Random tokens below `vocab`, random
/// labels below `classes`.
pub fn grid_dag(
    rng: &mut impl Rng,
    rows: usize,
    cols: usize,
    vocab: u32,
    classes: i32,
) -> Result<InputGraph, GraphError> {
    let mut g = InputGraph::new();
    for i in 0..rows {
        for j in 0..cols {
            let mut kids = Vec::with_capacity(2);
            if i > 0 {
                kids.push(((i - 1) * cols + j) as u32);
            }
            if j > 0 {
                kids.push((i * cols + j - 1) as u32);
            }
            let token = rng.random_range(0..vocab.max(1));
            g.push_vertex(&kids, token, rng.random_range(0..classes.max(1)))?;
        }
    }
    Ok(g)
}
