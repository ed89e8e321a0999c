//! Random input graphs for tests and benchmarks: trees of chosen arities
//! (including degenerate shapes: chains, wide nodes), perfect binary
//! trees, labelled chains and grid DAGs.

use rand::Rng;

use crate::input::{GraphShape, InputGraph};
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

/// A perfect binary tree of `height` levels of internal vertices above
/// `2^height` leaves (Cortex's TreeFC input, height 7: 128 leaves, 255
/// vertices); height 0 is a single leaf. Random tokens below `vocab` on the
/// leaves, random labels below `classes`. Heights above 20 (two million
/// leaves) are refused.
pub fn perfect_tree(
    rng: &mut impl Rng,
    height: u32,
    vocab: u32,
    classes: i32,
) -> Result<InputGraph, GraphError> {
    if height > 20 {
        return Err(GraphError::Structure(format!(
            "a perfect tree of height {height}: at most 20 (2^20 leaves)"
        )));
    }
    let mut g = InputGraph::new();
    let mut level = Vec::with_capacity(1 << height);
    for _ in 0..1usize << height {
        let token = rng.random_range(0..vocab.max(1));
        level.push(g.push_vertex(&[], token, rng.random_range(0..classes.max(1)))?);
    }
    while level.len() > 1 {
        let mut parents = Vec::with_capacity(level.len() / 2);
        for pair in level.chunks(2) {
            parents.push(g.push_vertex(pair, 0, rng.random_range(0..classes.max(1)))?);
        }
        level = parents;
    }
    Ok(g)
}

/// The shape of [`perfect_tree`]`(height)`, computed without building it
/// (every vertex labelled; saturating).
pub fn perfect_tree_shape(height: u32) -> GraphShape {
    let leaves = 1u64.checked_shl(height).unwrap_or(u64::MAX);
    let mut vertices = vec![(0, 0, leaves)];
    if leaves > 1 {
        vertices.push((0, 2, leaves - 1));
    }
    one_root_all_labelled(vertices)
}

/// The shape of a graph of `vertices` (see [`GraphShape`]) with one root
/// and a label on every vertex, as the builders here make them.
fn one_root_all_labelled(vertices: Vec<(u16, usize, u64)>) -> GraphShape {
    let mut shape = GraphShape {
        vertices,
        roots: 1,
        ..GraphShape::default()
    };
    shape.labelled = shape.vertex_count();
    shape
}

/// The shape of [`grid_dag`]`(rows, cols)`, computed without building it
/// (every vertex labelled; saturating): the corner without children, the
/// rest of the first row and column with one, the others with two.
pub fn grid_dag_shape(rows: usize, cols: usize) -> GraphShape {
    let (r, c) = (rows as u64, cols as u64);
    if r == 0 || c == 0 {
        return GraphShape::default();
    }
    let counts = [
        (0, 1),
        (1, (r - 1) + (c - 1)),
        (2, (r - 1).saturating_mul(c - 1)),
    ];
    let vertices: Vec<(u16, usize, u64)> = counts
        .into_iter()
        .filter(|&(_, n)| n > 0)
        .map(|(kids, n)| (0, kids, n))
        .collect();
    one_root_all_labelled(vertices)
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
    let shape = grid_dag_shape(rows, cols);
    // vertex ids are u32 (and child offsets count edges in u32)
    if shape.edge_count() > u64::from(u32::MAX) {
        return Err(GraphError::Structure(format!(
            "a {rows}x{cols} grid has {} vertices and {} edges, more than a graph can number",
            shape.vertex_count(),
            shape.edge_count()
        )));
    }
    let mut g =
        InputGraph::with_capacity(shape.vertex_count() as usize, shape.edge_count() as usize);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn shapes_count_what_the_builders_build() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for height in 0..6 {
            let g = perfect_tree(&mut rng, height, 50, 5).unwrap();
            assert_eq!(perfect_tree_shape(height), g.shape(), "height {height}");
        }
        for (rows, cols) in [(1, 1), (1, 4), (3, 1), (3, 5), (6, 6)] {
            let g = grid_dag(&mut rng, rows, cols, 50, 5).unwrap();
            assert_eq!(grid_dag_shape(rows, cols), g.shape(), "{rows}x{cols}");
        }
        assert_eq!(perfect_tree_shape(200).vertex_count(), u64::MAX);
        let huge = grid_dag_shape(100_000, 100_000);
        assert_eq!(huge.vertex_count(), 10_000_000_000);
        let e = grid_dag(&mut rng, 100_000, 100_000, 50, 5).unwrap_err();
        assert!(e.to_string().contains("100000x100000"), "{e}");
    }

    #[test]
    fn perfect_trees_have_two_children_everywhere_and_the_asked_height() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for height in [0u32, 1, 3, 7] {
            let g = perfect_tree(&mut rng, height, 50, 5).expect("tree");
            assert_eq!(g.len(), (1usize << (height + 1)) - 1, "height {height}");
            assert_eq!(g.roots().len(), 1);
            assert!(g.is_forest());
            let leaves = (0..g.len()).filter(|&v| g.children(v).is_empty()).count();
            assert_eq!(leaves, 1 << height);
            assert!((0..g.len()).all(|v| matches!(g.children(v).len(), 0 | 2)));
            assert_eq!(g.heights().into_iter().max(), Some(height));
        }
        assert!(perfect_tree(&mut rng, 21, 50, 5).is_err());
    }
}
