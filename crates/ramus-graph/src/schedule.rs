//! Batch schedules: the host-side plan for evaluating vertex functions over
//! a batch of input graphs.
//!
//! The vertices of all graphs are grouped into **batching tasks** (each task
//! runs one vertex function over vertices whose children are all done). With
//! the Cavs policy every step takes *all* activated vertices (so a task is a
//! height level, split by function); with DyNet's agenda policy each step
//! takes the ready vertices of the function with the lowest average depth.
//!
//! Vertices are then **numbered** as in Cortex (appendix B): every task is a
//! contiguous range, a parent's number is lower than its children's, and the
//! leaves (run first) get the highest numbers, so a leaf check is one
//! comparison (`number >= first_leaf`). Vertex state buffers are indexed by
//! this number. Each vertex function also gets its own **rows**: the
//! vertices it runs on, task after task, which is the layout of Cavs'
//! dynamic tensors (a task reads and writes a contiguous row range; backward
//! walks the same ranges in reverse). Child edges are laid out the same way.

use crate::{GraphError, InputGraph, NO_LABEL};

/// How vertices are grouped into batching tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BatchingPolicy {
    /// Cavs: each step batches every activated vertex of every graph.
    #[default]
    Cavs,
    /// DyNet's agenda: each step runs the ready vertices of the one
    /// function whose ready vertices have the lowest average depth.
    Agenda,
}

impl std::str::FromStr for BatchingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cavs" => Ok(BatchingPolicy::Cavs),
            "agenda" => Ok(BatchingPolicy::Agenda),
            _ => Err(format!(
                "unknown batching policy `{s}` (expected cavs or agenda)"
            )),
        }
    }
}

/// One batching task: `len` vertices numbered `begin..begin + len`, run by
/// vertex function `function` on its rows `row_offset..row_offset + len`
/// and edges `edge_offset..edge_offset + edge_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task {
    pub function: usize,
    pub begin: u32,
    pub len: u32,
    pub row_offset: u32,
    pub edge_offset: u32,
    pub edge_len: u32,
}

/// The rows and edges of one vertex function in a batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionRows {
    /// Vertex number of each row.
    pub vertex: Vec<u32>,
    /// Row `r`'s edges are `edge_offsets[r]..edge_offsets[r + 1]`.
    pub edge_offsets: Vec<u32>,
    /// Vertex number of each edge's child.
    pub edge_child: Vec<u32>,
    /// Row of each edge's parent.
    pub edge_parent: Vec<u32>,
}

impl FunctionRows {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.vertex.len()
    }
    /// Number of edges.
    pub fn edges(&self) -> usize {
        self.edge_child.len()
    }
    /// The vertex number of child `k` of row `r`, if it has one.
    pub fn child(&self, r: usize, k: usize) -> Option<u32> {
        let (a, b) = (
            self.edge_offsets[r] as usize,
            self.edge_offsets[r + 1] as usize,
        );
        (k < b - a).then(|| self.edge_child[a + k])
    }
}

/// The plan for one batch; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub policy: BatchingPolicy,
    /// Tasks in execution order (backward runs them in reverse).
    pub tasks: Vec<Task>,
    /// Rows and edges per vertex function.
    pub functions: Vec<FunctionRows>,
    /// Per vertex number: the function that runs it and its row there.
    pub vertex_function: Vec<u32>,
    pub vertex_row: Vec<u32>,
    /// Per vertex number: token, label, graph index in the batch.
    pub tokens: Vec<u32>,
    /// `feature_width` floats per vertex number: the graphs' own features
    /// (all graphs of a batch carry the same width, or none).
    pub features: Vec<f32>,
    pub feature_width: usize,
    pub labels: Vec<i32>,
    pub graph: Vec<u32>,
    /// Vertex number of each graph's vertex, indexed by `graph_offsets[g] + local id`.
    pub number: Vec<u32>,
    pub graph_offsets: Vec<u32>,
    /// Root vertex numbers (vertices without parent), graph by graph.
    pub roots: Vec<u32>,
    /// Vertices numbered at or above this are leaves.
    pub first_leaf: u32,
}

impl Schedule {
    /// Total number of vertices.
    pub fn num_vertices(&self) -> usize {
        self.tokens.len()
    }
    /// Number of graphs.
    pub fn num_graphs(&self) -> usize {
        self.graph_offsets.len().saturating_sub(1)
    }

    /// Schedules `graphs`. `select(kind, children)` names the vertex
    /// function for a vertex of that kind ([`InputGraph::kind`]) with that
    /// many children, or says why no function can run it (a
    /// [`GraphError::Unfit`] naming the graph's place and the vertex: the
    /// structure check of [`crate::check_structure`], made here on the
    /// way); there are `num_functions` functions.
    pub fn build(
        graphs: &[&InputGraph],
        policy: BatchingPolicy,
        num_functions: usize,
        select: impl Fn(u16, usize) -> Result<usize, String>,
    ) -> Result<Schedule, GraphError> {
        if graphs.is_empty() {
            return Err(GraphError::Schedule("the batch holds no graph".into()));
        }
        let mut graph_offsets = vec![0u32];
        for (i, g) in graphs.iter().enumerate() {
            if g.is_empty() {
                return Err(GraphError::Schedule(format!(
                    "graph {i} of the batch has no vertex"
                )));
            }
            graph_offsets.push(graph_offsets[i] + g.len() as u32);
        }
        let n = *graph_offsets.last().unwrap_or(&0) as usize;
        let topo = Topology::of(graphs, &graph_offsets, num_functions, select)?;
        let kids_of = |id: usize| topo.children(id);
        let groups = match policy {
            BatchingPolicy::Cavs => levels(n, &topo.height, &topo.function, num_functions),
            BatchingPolicy::Agenda => {
                agenda(n, &kids_of, &topo.height, &topo.function, num_functions)
            }
        };
        let (number, tasks, functions) = number_tasks(&groups, n, num_functions, &kids_of);
        let mut s = Schedule {
            policy,
            tasks,
            vertex_function: vec![0; n],
            vertex_row: vec![0; n],
            tokens: vec![0; n],
            features: Vec::new(),
            feature_width: 0,
            labels: vec![NO_LABEL; n],
            graph: vec![0; n],
            number,
            graph_offsets,
            roots: Vec::new(),
            first_leaf: n as u32,
            functions: Vec::new(),
        };
        for (f, rows) in functions.iter().enumerate() {
            for (r, &v) in rows.vertex.iter().enumerate() {
                s.vertex_function[v as usize] = f as u32;
                s.vertex_row[v as usize] = r as u32;
            }
        }
        s.functions = functions;
        s.fill_vertices(graphs)?;
        Ok(s)
    }

    /// Per vertex number: features, token, label, graph; the first leaf and
    /// the roots. Every graph of the batch must carry the same feature width.
    fn fill_vertices(&mut self, graphs: &[&InputGraph]) -> Result<(), GraphError> {
        let s = self;
        let n = s.tokens.len();
        let fw = graphs.first().map_or(0, |g| g.feature_width());
        if let Some(gi) = graphs.iter().position(|g| g.feature_width() != fw) {
            return Err(GraphError::Structure(format!(
                "graph {gi} of the batch has {} features per vertex, graph 0 has {fw}",
                graphs[gi].feature_width()
            )));
        }
        s.feature_width = fw;
        s.features = vec![0.0; n * fw];
        for (gi, g) in graphs.iter().enumerate() {
            let base = s.graph_offsets[gi] as usize;
            for v in 0..g.len() {
                let num = s.number[base + v] as usize;
                s.features[num * fw..(num + 1) * fw].copy_from_slice(g.features(v));
                s.tokens[num] = g.tokens[v];
                s.labels[num] = g.labels[v];
                s.graph[num] = gi as u32;
                if g.children(v).is_empty() {
                    s.first_leaf = s.first_leaf.min(num as u32);
                }
            }
            s.roots
                .extend(g.roots().into_iter().map(|r| s.number[base + r as usize]));
        }
        Ok(())
    }
}

/// The batch's vertices by global id (graph offset + local id): children,
/// heights and vertex functions.
struct Topology {
    child_offsets: Vec<u32>,
    children: Vec<u32>,
    height: Vec<u32>,
    function: Vec<u32>,
}

impl Topology {
    /// The topology of `graphs` (starting at `graph_offsets`), each vertex's
    /// function chosen by `select` (see [`Schedule::build`]).
    fn of(
        graphs: &[&InputGraph],
        graph_offsets: &[u32],
        num_functions: usize,
        select: impl Fn(u16, usize) -> Result<usize, String>,
    ) -> Result<Topology, GraphError> {
        let n = *graph_offsets.last().unwrap_or(&0) as usize;
        let mut child_offsets = Vec::with_capacity(n + 1);
        child_offsets.push(0u32);
        let mut children = Vec::new();
        let mut height = vec![0u32; n];
        let mut function = vec![0u32; n];
        for (gi, g) in graphs.iter().enumerate() {
            let base = graph_offsets[gi];
            for v in 0..g.len() {
                let id = (base as usize) + v;
                let kids = g.children(v);
                for &c in kids {
                    let c = base + c;
                    children.push(c);
                    height[id] = height[id].max(height[c as usize] + 1);
                }
                child_offsets.push(children.len() as u32);
                let f = select(g.kind(v), kids.len())
                    .map_err(|message| crate::structure::unfit(g, gi, v, message))?;
                if f >= num_functions {
                    return Err(GraphError::Schedule(format!(
                        "vertex function {f} selected for graph {gi} vertex {v}, but only {num_functions} exist"
                    )));
                }
                function[id] = f as u32;
            }
        }
        Ok(Topology {
            child_offsets,
            children,
            height,
            function,
        })
    }

    /// The children of vertex `id`.
    fn children(&self, id: usize) -> &[u32] {
        &self.children[self.child_offsets[id] as usize..self.child_offsets[id + 1] as usize]
    }
}

/// Numbers the vertices — task blocks from the top down, ascending inside
/// a block — and lays out the tasks and each function's rows and edges.
fn number_tasks<'a>(
    groups: &[(usize, Vec<u32>)],
    n: usize,
    num_functions: usize,
    kids_of: &impl Fn(usize) -> &'a [u32],
) -> (Vec<u32>, Vec<Task>, Vec<FunctionRows>) {
    let mut number = vec![0u32; n];
    let mut tasks = Vec::with_capacity(groups.len());
    let mut functions = vec![
        FunctionRows {
            edge_offsets: vec![0],
            ..Default::default()
        };
        num_functions
    ];
    let mut done = 0usize;
    for (f, members) in groups {
        let begin = (n - done - members.len()) as u32;
        for (i, &v) in members.iter().enumerate() {
            number[v as usize] = begin + i as u32;
        }
        done += members.len();
        let rows = &mut functions[*f];
        let row_offset = rows.vertex.len() as u32;
        let edge_offset = rows.edge_child.len() as u32;
        for (i, &v) in members.iter().enumerate() {
            let row = row_offset + i as u32;
            rows.vertex.push(begin + i as u32);
            for &c in kids_of(v as usize) {
                rows.edge_child.push(number[c as usize]);
                rows.edge_parent.push(row);
            }
            rows.edge_offsets.push(rows.edge_child.len() as u32);
        }
        tasks.push(Task {
            function: *f,
            begin,
            len: members.len() as u32,
            row_offset,
            edge_offset,
            edge_len: rows.edge_child.len() as u32 - edge_offset,
        });
    }
    (number, tasks, functions)
}

/// Cavs policy: tasks are (height, function) buckets in height order.
fn levels(
    n: usize,
    height: &[u32],
    function: &[u32],
    num_functions: usize,
) -> Vec<(usize, Vec<u32>)> {
    let max_h = height.iter().copied().max().unwrap_or(0) as usize;
    let mut buckets = vec![Vec::new(); (max_h + 1) * num_functions];
    for v in 0..n {
        buckets[height[v] as usize * num_functions + function[v] as usize].push(v as u32);
    }
    buckets
        .into_iter()
        .enumerate()
        .filter(|(_, b)| !b.is_empty())
        .map(|(i, b)| (i % num_functions, b))
        .collect()
}

/// DyNet's agenda policy (see [`BatchingPolicy::Agenda`]).
fn agenda<'a>(
    n: usize,
    kids_of: &impl Fn(usize) -> &'a [u32],
    height: &[u32],
    function: &[u32],
    num_functions: usize,
) -> Vec<(usize, Vec<u32>)> {
    let mut parents: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut waiting = vec![0u32; n];
    let mut ready: Vec<Vec<u32>> = vec![Vec::new(); num_functions];
    for v in 0..n {
        let kids = kids_of(v);
        waiting[v] = kids.len() as u32;
        for &c in kids {
            parents[c as usize].push(v as u32);
        }
        if kids.is_empty() {
            ready[function[v] as usize].push(v as u32);
        }
    }
    let mut groups = Vec::new();
    loop {
        let best = (0..num_functions)
            .filter(|&f| !ready[f].is_empty())
            .min_by(|&a, &b| {
                let avg = |f: usize| {
                    ready[f]
                        .iter()
                        .map(|&v| height[v as usize] as f64)
                        .sum::<f64>()
                        / ready[f].len() as f64
                };
                avg(a).total_cmp(&avg(b))
            });
        let Some(f) = best else { break };
        let mut members = std::mem::take(&mut ready[f]);
        members.sort_unstable();
        for &v in &members {
            for &p in &parents[v as usize] {
                waiting[p as usize] -= 1;
                if waiting[p as usize] == 0 {
                    ready[function[p as usize] as usize].push(p);
                }
            }
        }
        groups.push((f, members));
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(shape: &str) -> InputGraph {
        // "((a b) c)" style, leaves are single letters.
        let mut g = InputGraph::new();
        let mut stack: Vec<Vec<u32>> = vec![Vec::new()];
        for ch in shape.chars() {
            match ch {
                '(' => stack.push(Vec::new()),
                ')' => {
                    let kids = stack.pop().unwrap();
                    let id = g.push_vertex(&kids, 0, 1).unwrap();
                    stack.last_mut().unwrap().push(id);
                }
                ' ' => {}
                c => {
                    let id = g.push_vertex(&[], c as u32, 0).unwrap();
                    stack.last_mut().unwrap().push(id);
                }
            }
        }
        g
    }

    fn leaf_internal(_kind: u16, children: usize) -> Result<usize, String> {
        Ok(usize::from(children > 0))
    }

    fn check_invariants(s: &Schedule, graphs: &[&InputGraph]) {
        let n = s.num_vertices();
        // every vertex exactly once, tasks contiguous and tiling 0..n from the top
        let mut seen = vec![false; n];
        let mut top = n as u32;
        for t in &s.tasks {
            assert_eq!(
                t.begin + t.len,
                top,
                "tasks are contiguous blocks from the top"
            );
            top = t.begin;
            for v in t.begin..t.begin + t.len {
                assert!(!std::mem::replace(&mut seen[v as usize], true));
                assert_eq!(s.vertex_function[v as usize] as usize, t.function);
            }
        }
        assert_eq!(top, 0);
        // children are numbered higher than parents and run in earlier tasks
        for (gi, g) in graphs.iter().enumerate() {
            let base = s.graph_offsets[gi] as usize;
            for v in 0..g.len() {
                let num = s.number[base + v];
                for &c in g.children(v) {
                    assert!(s.number[base + c as usize] > num);
                }
                let is_leaf = g.children(v).is_empty();
                assert_eq!(is_leaf, num >= s.first_leaf, "leaf check is one comparison");
            }
        }
        // rows mirror tasks
        for t in &s.tasks {
            let rows = &s.functions[t.function];
            for i in 0..t.len {
                assert_eq!(rows.vertex[(t.row_offset + i) as usize], t.begin + i);
            }
        }
    }

    #[test]
    fn cavs_policy_batches_levels_across_graphs() {
        let a = tree("((a b) c)");
        let b = tree("(d (e (f g)))");
        let graphs = [&a, &b];
        let s = Schedule::build(&graphs, BatchingPolicy::Cavs, 2, leaf_internal).unwrap();
        check_invariants(&s, &graphs);
        let lens: Vec<u32> = s.tasks.iter().map(|t| t.len).collect();
        assert_eq!(lens, vec![7, 2, 2, 1]); // leaves, height 1, 2, 3
        assert_eq!(s.tasks[0].function, 0);
        assert_eq!(s.roots.len(), 2);
        assert_eq!(s.roots, vec![s.number[4], s.number[5 + 6]]);
    }

    #[test]
    fn agenda_policy_keeps_invariants() {
        let a = tree("((a b) (c (d e)))");
        let b = tree("(f g)");
        let graphs = [&a, &b];
        let s = Schedule::build(&graphs, BatchingPolicy::Agenda, 2, leaf_internal).unwrap();
        check_invariants(&s, &graphs);
        assert_eq!(
            s.tasks.iter().map(|t| t.len as usize).sum::<usize>(),
            a.len() + b.len()
        );
    }

    #[test]
    fn empty_batch_is_an_error() {
        assert!(Schedule::build(&[], BatchingPolicy::Cavs, 1, |_, _| Ok(0)).is_err());
        let e = InputGraph::new();
        let err = Schedule::build(&[&e], BatchingPolicy::Cavs, 1, |_, _| Ok(0)).unwrap_err();
        assert!(err.to_string().contains("graph 0"));
    }

    #[test]
    fn edges_follow_rows() {
        let a = tree("((a b) c)");
        let s = Schedule::build(&[&a], BatchingPolicy::Cavs, 1, |_, _| Ok(0)).unwrap();
        let rows = &s.functions[0];
        for (e, &p) in rows.edge_parent.iter().enumerate() {
            let r = p as usize;
            assert!(rows.edge_offsets[r] as usize <= e && e < rows.edge_offsets[r + 1] as usize);
        }
        let root_row = s.vertex_row[s.roots[0] as usize] as usize;
        assert_eq!(rows.child(root_row, 1), Some(s.number[3])); // c
        assert_eq!(rows.child(root_row, 2), None);
    }

    proptest::proptest! {
        #[test]
        fn random_forests_and_dags_schedule_correctly(
            specs in proptest::collection::vec(proptest::collection::vec((0u32..4, 0u32..1000), 1..30), 1..6),
            agenda in proptest::bool::ANY,
        ) {
            // vertex v gets up to 3 children drawn among earlier vertices (a DAG)
            let graphs: Vec<InputGraph> = specs.iter().map(|spec| {
                let mut g = InputGraph::new();
                for (v, &(k, seed)) in spec.iter().enumerate() {
                    let kids: Vec<u32> = if v == 0 { vec![] } else {
                        (0..k.min(v as u32)).map(|i| (seed.wrapping_mul(31).wrapping_add(i * 7)) % v as u32).collect()
                    };
                    g.push_vertex(&kids, v as u32, 0).unwrap();
                }
                g
            }).collect();
            let refs: Vec<&InputGraph> = graphs.iter().collect();
            let policy = if agenda { BatchingPolicy::Agenda } else { BatchingPolicy::Cavs };
            let s = Schedule::build(&refs, policy, 2, leaf_internal).unwrap();
            check_invariants(&s, &refs);
        }
    }
}
