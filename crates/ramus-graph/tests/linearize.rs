//! Properties of the linearizer (`ramus_graph::linearize`) on random trees,
//! layered random DAGs with shared children, raw CSR graphs in arbitrary
//! vertex order, and degenerate shapes (single vertices, a 500-deep path, a
//! 64-ary node): every node exactly once, children before parents, batches
//! contiguous and covering the internal nodes, leaves last, roots and
//! origins mapped back, and agreement with the Cavs `Schedule`.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ramus_graph::random::{random_chain, random_path, random_tree};
use ramus_graph::{
    BatchingPolicy, CsrGraph, GraphError, InputGraph, LinearBatch, Linearizer, Schedule, NO_CHILD,
};

/// A graph as plain adjacency lists: the reference the checks compare with.
struct Plain {
    children: Vec<Vec<u32>>,
    tokens: Vec<u32>,
}

impl Plain {
    fn of(g: &InputGraph) -> Plain {
        Plain {
            children: (0..g.len()).map(|v| g.children(v).to_vec()).collect(),
            tokens: g.tokens.clone(),
        }
    }

    /// Heights by repeated relaxation (independent of any vertex order).
    fn heights(&self) -> Vec<u32> {
        let mut h = vec![0u32; self.children.len()];
        loop {
            let mut changed = false;
            for v in 0..h.len() {
                let want = self.children[v]
                    .iter()
                    .map(|&c| h[c as usize] + 1)
                    .max()
                    .unwrap_or(0);
                if want != h[v] {
                    h[v] = want;
                    changed = true;
                }
            }
            if !changed {
                return h;
            }
        }
    }

    fn roots(&self) -> Vec<u32> {
        let mut has_parent = vec![false; self.children.len()];
        for kids in &self.children {
            for &c in kids {
                has_parent[c as usize] = true;
            }
        }
        (0..self.children.len() as u32)
            .filter(|&v| !has_parent[v as usize])
            .collect()
    }
}

/// Every property the engines rely on.
fn check(lb: &LinearBatch, graphs: &[Plain]) {
    let n: usize = graphs.iter().map(|g| g.children.len()).sum();
    assert_eq!(lb.num_nodes(), n);
    assert_eq!(lb.num_graphs(), graphs.len());
    let ni = lb.num_internal();
    assert_eq!(lb.leaves(), ni as u32..n as u32);
    assert_eq!(lb.num_leaves(), n - ni);

    // Batches: contiguous, in execution order from just below the leaves down
    // to 0, tiling exactly the internal nodes.
    assert_eq!(lb.batch_begin().len(), lb.batch_length().len());
    let mut batch_of = vec![usize::MAX; n];
    let mut top = ni as u32;
    for i in 0..lb.num_batches() {
        let r = lb.batch(i);
        assert!(!r.is_empty(), "batch {i} is empty");
        assert_eq!(
            r.end,
            top,
            "batch {i} is not right below batch {}",
            i as i64 - 1
        );
        assert_eq!(r.start, lb.batch_begin()[i]);
        assert_eq!(r.end - r.start, lb.batch_length()[i]);
        for m in r.clone() {
            batch_of[m as usize] = i;
        }
        top = r.start;
    }
    assert_eq!(top, 0, "batches do not reach node 0");
    assert!(lb.batch(lb.num_batches()).is_empty());

    // Every vertex is exactly one node and maps back.
    let mut seen = vec![false; n];
    let mut max_level = 0;
    for (g, plain) in graphs.iter().enumerate() {
        let heights = plain.heights();
        let base = lb.graph_offsets()[g] as usize;
        for v in 0..plain.children.len() {
            let m = lb.node(g, v).expect("every vertex has a node");
            assert_eq!(lb.node_of_vertex()[base + v], m);
            assert!(
                !std::mem::replace(&mut seen[m as usize], true),
                "node {m} twice"
            );
            assert_eq!(lb.origin(m), (g, v));
            assert_eq!(lb.tokens()[m as usize], plain.tokens[v]);
            let kids = &plain.children[v];
            let is_leaf = kids.is_empty();
            assert_eq!(lb.is_leaf(m), is_leaf, "graph {g} vertex {v}: leaf check");
            assert_eq!(is_leaf, heights[v] == 0);
            max_level = max_level.max(heights[v]);
            if !is_leaf {
                let i = batch_of[m as usize];
                assert_eq!(
                    i as u32 + 1,
                    heights[v],
                    "batch {i} holds level {}",
                    heights[v]
                );
            }
            // Children in order, numbered higher, run earlier (or leaves).
            let want: Vec<u32> = kids
                .iter()
                .map(|&c| lb.node(g, c as usize).unwrap())
                .collect();
            assert_eq!(lb.children(m), &want[..]);
            for (k, &c) in want.iter().enumerate() {
                assert_eq!(lb.child(m, k), c);
                assert!(c > m, "child {c} not numbered after parent {m}");
                assert!(heights[kids[k] as usize] < heights[v]);
                assert!(lb.is_leaf(c) || batch_of[c as usize] < batch_of[m as usize]);
            }
            assert_eq!(lb.child(m, kids.len()), NO_CHILD);
        }
        let roots: Vec<u32> = plain
            .roots()
            .iter()
            .map(|&r| lb.node(g, r as usize).unwrap())
            .collect();
        assert_eq!(lb.roots(g), &roots[..]);
        assert_eq!(lb.root(g), *roots.last().unwrap());
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(lb.num_batches(), max_level as usize);

    // CSR arrays and the dense view agree.
    let offsets = lb.child_offsets();
    assert_eq!(offsets.len(), n + 1);
    assert_eq!(offsets[ni..].iter().min(), offsets[ni..].iter().max());
    assert_eq!(*offsets.last().unwrap() as usize, lb.child_nodes().len());
    let arity = lb.max_children().max(1);
    let mut dense = Vec::new();
    lb.dense_children(arity, &mut dense).unwrap();
    assert_eq!(dense.len(), arity * ni);
    for m in 0..ni {
        for k in 0..arity {
            assert_eq!(dense[k * ni + m], lb.child(m as u32, k));
        }
    }
    assert_eq!(lb.leaf_tokens(), &lb.tokens()[ni..]);
}

/// Checks an InputGraph batch, including agreement with the Cavs schedule
/// (leaf/internal functions, and a single function): same nodes per level,
/// in fact the same numbers.
fn check_graphs(graphs: &[InputGraph]) -> LinearBatch {
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let lb = LinearBatch::new(&refs).unwrap();
    let plain: Vec<Plain> = graphs.iter().map(Plain::of).collect();
    check(&lb, &plain);
    for functions in [1, 2] {
        let s = Schedule::build(&refs, BatchingPolicy::Cavs, functions, |_, k| {
            Ok(usize::from(functions == 2 && k > 0))
        })
        .unwrap();
        assert_eq!(s.first_leaf as usize, lb.num_internal());
        assert_eq!(s.number, lb.node_of_vertex());
        // Schedule tasks: leaves first, then level 1, 2, ...
        let internal: Vec<(u32, u32)> = s.tasks[1..].iter().map(|t| (t.begin, t.len)).collect();
        let batches: Vec<(u32, u32)> = (0..lb.num_batches())
            .map(|i| (lb.batch_begin()[i], lb.batch_length()[i]))
            .collect();
        assert_eq!(internal, batches);
        let mut roots = s.roots.clone();
        roots.sort_unstable();
        let mut ours = lb.root_nodes().to_vec();
        ours.sort_unstable();
        assert_eq!(roots, ours);
    }
    lb
}

/// A layered random DAG: layer 0 is leaves; a vertex of a later layer has
/// 0..=4 children drawn from earlier layers (shared between parents,
/// repeats allowed), so some leaves sit high and many vertices have several
/// parents.
fn layered_dag(rng: &mut impl Rng, layers: usize, width: usize) -> InputGraph {
    let mut g = InputGraph::new();
    let mut count = 0u32;
    for layer in 0..layers.max(1) {
        let w = rng.random_range(1..=width.max(1));
        let below = count;
        for _ in 0..w {
            let k = if layer == 0 {
                0
            } else {
                rng.random_range(0..=4)
            };
            let kids: Vec<u32> = (0..k).map(|_| rng.random_range(0..below)).collect();
            g.push_vertex(&kids, rng.random_range(0..100), 0).unwrap();
            count += 1;
        }
    }
    g
}

/// One random graph of a random kind.
fn random_graph(rng: &mut impl Rng) -> InputGraph {
    match rng.random_range(0..6) {
        0 => {
            let depth = rng.random_range(1..20);
            random_path(rng, depth, 50, 5).unwrap()
        }
        1 => {
            let len = rng.random_range(1..20);
            random_chain(rng, len, 50).unwrap()
        }
        2 | 3 => {
            let layers = rng.random_range(1..7);
            layered_dag(rng, layers, 6)
        }
        _ => {
            let arities: &[&[usize]] = &[&[2], &[1, 2], &[2, 3, 5], &[1, 8]];
            let a = arities[rng.random_range(0..arities.len())];
            let leaves = rng.random_range(1..40);
            random_tree(rng, leaves, a, 50, 5).unwrap()
        }
    }
}

/// `g` with its vertices renumbered by a random permutation, as raw CSR
/// arrays (children then usually have higher ids than their parents).
fn shuffled_csr(rng: &mut impl Rng, g: &InputGraph) -> (Vec<u32>, Vec<u32>, Vec<u32>, Plain) {
    let n = g.len();
    let mut perm: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        perm.swap(i, rng.random_range(0..=i));
    }
    // new id perm[v] for old vertex v
    let mut old_of = vec![0usize; n];
    for (v, &p) in perm.iter().enumerate() {
        old_of[p as usize] = v;
    }
    let mut plain = Plain {
        children: Vec::new(),
        tokens: Vec::new(),
    };
    let (mut offsets, mut children, mut tokens) = (vec![0u32], Vec::new(), Vec::new());
    for &old in &old_of {
        let kids: Vec<u32> = g.children(old).iter().map(|&c| perm[c as usize]).collect();
        children.extend_from_slice(&kids);
        offsets.push(children.len() as u32);
        tokens.push(g.tokens[old]);
        plain.children.push(kids);
        plain.tokens.push(g.tokens[old]);
    }
    (offsets, children, tokens, plain)
}

fn csr<'a>(parts: &'a (Vec<u32>, Vec<u32>, Vec<u32>, Plain)) -> CsrGraph<'a> {
    CsrGraph {
        child_offsets: &parts.0,
        children: &parts.1,
        tokens: &parts.2,
    }
}

fn structure_error(e: GraphError) -> String {
    match e {
        GraphError::Structure(m) => m,
        other => panic!("expected a structure error, got {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_trees(seed in any::<u64>(), sizes in prop::collection::vec(1usize..80, 1..12)) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let graphs: Vec<InputGraph> = sizes
            .iter()
            .map(|&leaves| {
                let arities: &[usize] = if rng.random_bool(0.5) { &[2] } else { &[1, 2, 3, 6] };
                random_tree(&mut rng, leaves, arities, 1000, 5).unwrap()
            })
            .collect();
        check_graphs(&graphs);
    }

    #[test]
    fn random_dags_and_mixed_batches(seed in any::<u64>(), count in 1usize..10) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let graphs: Vec<InputGraph> = (0..count).map(|_| random_graph(&mut rng)).collect();
        let lb = check_graphs(&graphs);
        for g in &graphs {
            if !g.is_forest() {
                // a shared child is one node with several parents
                let edges: usize = (0..lb.num_nodes() as u32).map(|m| lb.children(m).len()).sum();
                prop_assert_eq!(edges, graphs.iter().map(|g| g.num_edges()).sum::<usize>());
            }
        }
    }

    #[test]
    fn csr_graphs_in_any_vertex_order(seed in any::<u64>(), count in 1usize..8) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let graphs: Vec<InputGraph> = (0..count).map(|_| random_graph(&mut rng)).collect();
        let parts: Vec<_> = graphs.iter().map(|g| shuffled_csr(&mut rng, g)).collect();
        let views: Vec<CsrGraph> = parts.iter().map(csr).collect();
        let mut lin = Linearizer::new();
        let lb = lin.linearize_csr(&views).unwrap();
        let plain: Vec<Plain> = parts.into_iter().map(|p| p.3).collect();
        check(lb, &plain);
        // same batch sizes as the topologically numbered originals
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let original = LinearBatch::new(&refs).unwrap();
        prop_assert_eq!(lb.batch_length(), original.batch_length());
    }

    #[test]
    fn cycles_are_found_and_named(seed in any::<u64>(), count in 1usize..5) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut graphs: Vec<InputGraph> = (0..count).map(|_| random_graph(&mut rng)).collect();
        // make the last graph have an internal vertex, then close a cycle
        // from one of its descendants back to it
        graphs.push(random_tree(&mut rng, 5, &[2], 10, 2).unwrap());
        let bad = graphs.len() - 1;
        let mut parts: Vec<_> = graphs.iter().map(|g| shuffled_csr(&mut rng, g)).collect();
        let p = &mut parts[bad];
        let root = p.3.roots()[0];
        // walk down to a leaf and point it at the root
        let mut v = root;
        while let Some(&c) = p.3.children[v as usize].first() {
            v = c;
        }
        let start = p.0[v as usize] as usize;
        p.1.insert(start, root);
        for o in &mut p.0[v as usize + 1..] {
            *o += 1;
        }
        let views: Vec<CsrGraph> = parts.iter().map(csr).collect();
        let msg = structure_error(Linearizer::new().linearize_csr(&views).unwrap_err());
        prop_assert!(msg.contains(&format!("graph {bad} vertex")), "{}", msg);
        prop_assert!(msg.contains("cycle"), "{}", msg);
    }

    #[test]
    fn a_kept_linearizer_equals_a_fresh_one(seed in any::<u64>(), a in 1usize..10, b in 1usize..10) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let first: Vec<InputGraph> = (0..a).map(|_| random_graph(&mut rng)).collect();
        let second: Vec<InputGraph> = (0..b).map(|_| random_graph(&mut rng)).collect();
        let r1: Vec<&InputGraph> = first.iter().collect();
        let r2: Vec<&InputGraph> = second.iter().collect();
        let mut lin = Linearizer::new();
        lin.linearize(&r1).unwrap();
        // an error in between leaves nothing behind either
        let empty = InputGraph::new();
        prop_assert!(lin.linearize(&[&empty]).is_err());
        let kept = lin.linearize(&r2).unwrap().clone();
        prop_assert_eq!(kept, LinearBatch::new(&r2).unwrap());
    }
}

#[test]
fn single_vertex_graphs() {
    let graphs: Vec<InputGraph> = (0..5)
        .map(|t| InputGraph::chain(&[t], &[0]).unwrap())
        .collect();
    let lb = check_graphs(&graphs);
    assert_eq!(lb.num_internal(), 0);
    assert_eq!(lb.num_batches(), 0);
    assert_eq!(lb.leaf_tokens(), &[0, 1, 2, 3, 4]);
    assert_eq!(
        (0..5).map(|g| lb.root(g)).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    let mut dense = vec![7];
    lb.dense_children(2, &mut dense).unwrap();
    assert!(dense.is_empty());
}

#[test]
fn a_500_deep_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let path = random_path(&mut rng, 500, 10, 2).unwrap();
    let tree = random_tree(&mut rng, 30, &[2], 10, 2).unwrap();
    let tree_height = *tree.heights().iter().max().unwrap() as usize;
    let lb = check_graphs(&[path, tree]);
    assert_eq!(lb.num_batches(), 499);
    assert_eq!(lb.root(0), 0, "the tallest root is node 0");
    assert_eq!(lb.num_leaves(), 1 + 30);
    assert!(lb.batch_length()[..tree_height].iter().all(|&l| l >= 2));
    assert!(lb.batch_length()[tree_height..].iter().all(|&l| l == 1));
}

#[test]
fn a_64_ary_node() {
    let mut g = InputGraph::new();
    let kids: Vec<u32> = (0..64).map(|t| g.push_vertex(&[], t, 0).unwrap()).collect();
    g.push_vertex(&kids, 0, 1).unwrap();
    let lb = check_graphs(&[g]);
    assert_eq!(lb.num_internal(), 1);
    assert_eq!(lb.max_children(), 64);
    assert_eq!(lb.children(0), &(1..65).collect::<Vec<u32>>()[..]);
    let mut dense = Vec::new();
    let err = structure_error(lb.dense_children(2, &mut dense).unwrap_err());
    assert!(err.contains("graph 0 vertex 64"), "{err}");
}

#[test]
fn a_shared_child_is_numbered_once() {
    // diamond: 0 <- 1, 0 <- 2, (1, 2) <- 3, and 0 <- 3 directly
    let mut g = InputGraph::new();
    g.push_vertex(&[], 5, 0).unwrap();
    g.push_vertex(&[0], 0, 0).unwrap();
    g.push_vertex(&[0], 0, 0).unwrap();
    g.push_vertex(&[1, 2, 0], 0, 0).unwrap();
    let lb = check_graphs(&[g]);
    assert_eq!(lb.num_nodes(), 4);
    assert_eq!(lb.batch_length(), &[2, 1]);
    assert_eq!(lb.children(0), &[1, 2, 3]);
    assert_eq!(lb.children(1), &[3]);
    assert_eq!(lb.children(2), &[3]);
}

#[test]
fn errors_name_the_graph_and_vertex() {
    let mut lin = Linearizer::new();
    assert!(matches!(lin.linearize(&[]), Err(GraphError::Schedule(_))));
    let ok = InputGraph::chain(&[1, 2], &[0, 0]).unwrap();
    let empty = InputGraph::new();
    let e = lin.linearize(&[&ok, &empty]).unwrap_err().to_string();
    assert!(e.contains("graph 1"), "{e}");

    let tokens = [0u32; 3];
    let view = |offsets: &'static [u32], children: &'static [u32]| CsrGraph {
        child_offsets: offsets,
        children,
        tokens: &tokens,
    };
    let good = view(&[0, 0, 1, 2], &[0, 1]);
    let cases: [(CsrGraph, &str); 7] = [
        (
            view(&[0, 0, 1, 3], &[0, 1, 3]),
            "graph 1 vertex 2: child 1 is vertex 3, out of range",
        ),
        (
            view(&[0, 0, 1, 2], &[2, 1]),
            "graph 1 vertex 2: child 0 (vertex 1) closes a cycle",
        ),
        (
            view(&[0, 0, 1, 1], &[1]),
            "graph 1 vertex 1: child 0 (vertex 1) closes a cycle",
        ),
        (
            view(&[0, 1, 2, 3], &[1, 2, 0]),
            "graph 1 vertex 2: child 0 (vertex 0) closes a cycle",
        ),
        (
            view(&[0, 2, 1, 2], &[0, 1]),
            "graph 1 vertex 1: child offsets decrease",
        ),
        (
            view(&[0, 0, 1], &[0]),
            "graph 1: 3 child offsets for 3 vertices",
        ),
        (
            view(&[0, 0, 1, 1], &[0, 1]),
            "graph 1 vertex 2: child offsets end at 1",
        ),
    ];
    for (bad, want) in cases {
        let msg = structure_error(lin.linearize_csr(&[good, bad]).unwrap_err());
        assert!(msg.contains(want), "{msg:?} does not contain {want:?}");
    }
    // and the linearizer still works afterwards
    let lb = lin.linearize_csr(&[good]).unwrap();
    assert_eq!(lb.num_batches(), 2);
    assert_eq!(lb.root(0), 0);
}
