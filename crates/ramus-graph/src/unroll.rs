//! Recursion unrolled once (Cortex §3.1, Fig. 4), as a plan over a
//! [`LinearBatch`]: the compiled engines compute a node **together with its
//! children** of the level below, so the children's fresh states are read
//! back on chip (or from cache) by the parent right away, and one pass
//! covers two levels.
//!
//! # Steps and groups
//!
//! Step `s` covers batch `2s` (the **child level**) and batch `2s + 1` (the
//! **parent level**; absent for the last step of an odd number of levels).
//! Its **groups** are, in order:
//!
//! * one per node `p` of the parent level: `p` and those of its children
//!   that lie in the child level (every node of the parent level has at
//!   least one: its level is one more than its tallest child's), then
//! * one per remaining node of the child level (its parent is taller, or it
//!   is a root), alone.
//!
//! An engine runs a group's children, then (after a barrier local to the
//! group: a thread block's on CUDA) its parent; groups of a step are
//! independent, and steps follow each other with one global barrier, half
//! as many as level by level. Every child of the children (and every other
//! child of the parent) lies in an earlier step or is a leaf.
//!
//! A node with two parents (a DAG) could be needed by two groups of one
//! step; [`UnrolledPlan::plan`] refuses such a batch with an error naming
//! the vertex (Cortex, too, unrolls trees and sequences only).

use crate::{GraphError, LinearBatch, NO_CHILD};

/// Groups of a linearized batch, step by step; see the module docs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnrolledPlan {
    /// Groups of step `s`: `step_begin[s]..step_begin[s + 1]`.
    step_begin: Vec<u32>,
    /// The parent node of each group, [`NO_CHILD`] for a lone child.
    group_parent: Vec<u32>,
    /// Children of group `g`: `group_children[group_child_begin[g]..group_child_begin[g + 1]]`.
    group_child_begin: Vec<u32>,
    group_children: Vec<u32>,
    /// Scratch: parents per node, and whether a child-level node is taken.
    parents: Vec<u32>,
    taken: Vec<bool>,
}

impl UnrolledPlan {
    pub fn new() -> Self {
        Self::default()
    }

    /// Plans `batch` (buffers are reused from call to call). A batch in
    /// which an internal node has several parents is an error.
    pub fn plan(&mut self, batch: &LinearBatch) -> Result<(), GraphError> {
        let ni = batch.num_internal();
        self.parents.clear();
        self.parents.resize(ni, 0);
        for n in 0..ni as u32 {
            for &c in batch.children(n) {
                if (c as usize) < ni {
                    self.parents[c as usize] += 1;
                    if self.parents[c as usize] > 1 {
                        let (g, v) = batch.origin(c);
                        return Err(GraphError::Schedule(format!(
                            "graph {g} vertex {v} has several parents: recursion unrolling \
                             runs on trees and sequences only (switch unrolling off for DAGs)"
                        )));
                    }
                }
            }
        }
        self.step_begin.clear();
        self.group_parent.clear();
        self.group_child_begin.clear();
        self.group_children.clear();
        self.taken.clear();
        self.taken.resize(ni, false);
        let levels = batch.num_batches();
        let mut b = 0;
        while b < levels {
            self.step_begin.push(self.group_parent.len() as u32);
            let child_level = batch.batch(b);
            if b + 1 < levels {
                for p in batch.batch(b + 1) {
                    self.group_parent.push(p);
                    self.group_child_begin
                        .push(self.group_children.len() as u32);
                    for &c in batch.children(p) {
                        if child_level.contains(&c) {
                            self.group_children.push(c);
                            self.taken[c as usize] = true;
                        }
                    }
                }
            }
            for c in child_level {
                if !self.taken[c as usize] {
                    self.group_parent.push(NO_CHILD);
                    self.group_child_begin
                        .push(self.group_children.len() as u32);
                    self.group_children.push(c);
                }
            }
            b += 2;
        }
        self.step_begin.push(self.group_parent.len() as u32);
        self.group_child_begin
            .push(self.group_children.len() as u32);
        Ok(())
    }

    /// Number of steps (half the levels, rounded up).
    pub fn num_steps(&self) -> usize {
        self.step_begin.len().saturating_sub(1)
    }

    /// The groups of step `s`.
    pub fn step(&self, s: usize) -> std::ops::Range<usize> {
        self.step_begin[s] as usize..self.step_begin[s + 1] as usize
    }

    /// First group of each step, then the group count (`num_steps + 1` entries).
    pub fn step_begin(&self) -> &[u32] {
        &self.step_begin
    }

    /// Parent node of each group ([`NO_CHILD`]: a lone child).
    pub fn group_parent(&self) -> &[u32] {
        &self.group_parent
    }

    /// Offsets of each group's children (`groups + 1` entries).
    pub fn group_child_begin(&self) -> &[u32] {
        &self.group_child_begin
    }

    /// The groups' children, group by group.
    pub fn group_children(&self) -> &[u32] {
        &self.group_children
    }

    /// The children of group `g`.
    pub fn children(&self, g: usize) -> &[u32] {
        &self.group_children
            [self.group_child_begin[g] as usize..self.group_child_begin[g + 1] as usize]
    }

    /// The parent of group `g`, if it has one.
    pub fn parent(&self, g: usize) -> Option<u32> {
        Some(self.group_parent[g]).filter(|&p| p != NO_CHILD)
    }

    /// The most groups in one step.
    pub fn widest_step(&self) -> usize {
        (0..self.num_steps())
            .map(|s| self.step(s).len())
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InputGraph;

    /// A tree from (token, children) pairs in child-first order.
    fn tree(nodes: &[&[u32]]) -> InputGraph {
        let mut g = InputGraph::new();
        for kids in nodes {
            g.push_vertex(kids, 0, -1).expect("valid tree");
        }
        g
    }

    #[test]
    fn groups_cover_every_internal_node_once_children_before_parents() {
        // a left-deep chain of 6 internal nodes over leaves, plus a bushy tree
        let chain = {
            let mut nodes: Vec<Vec<u32>> = vec![vec![], vec![]];
            let mut last = 0;
            for i in 0..6 {
                let leaf = nodes.len() as u32;
                nodes.push(vec![]);
                let kids = if i == 0 { vec![0, 1] } else { vec![last, leaf] };
                nodes.push(kids);
                last = nodes.len() as u32 - 1;
            }
            nodes
        };
        let chain: Vec<&[u32]> = chain.iter().map(|v| v.as_slice()).collect();
        let bushy = tree(&[&[], &[], &[], &[0, 1], &[2], &[3, 4]]);
        let chain = tree(&chain);
        let batch = LinearBatch::new(&[&chain, &bushy]).expect("linearizes");
        let mut plan = UnrolledPlan::new();
        plan.plan(&batch).expect("trees unroll");
        assert_eq!(plan.num_steps(), batch.num_batches().div_ceil(2));
        let mut seen = vec![0usize; batch.num_internal()];
        let mut done = vec![false; batch.num_nodes()];
        for n in batch.leaves() {
            done[n as usize] = true;
        }
        for s in 0..plan.num_steps() {
            let groups = plan.step(s);
            // children of every group of the step first, then the parents
            for g in groups.clone() {
                for &c in plan.children(g) {
                    seen[c as usize] += 1;
                    for &k in batch.children(c) {
                        assert!(done[k as usize], "child {k} of {c} not ready");
                    }
                }
            }
            for g in groups.clone() {
                for &c in plan.children(g) {
                    done[c as usize] = true;
                }
            }
            for g in groups {
                if let Some(p) = plan.parent(g) {
                    seen[p as usize] += 1;
                    for &k in batch.children(p) {
                        assert!(done[k as usize], "child {k} of {p} not ready");
                    }
                    done[p as usize] = true;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn a_dag_is_refused_naming_the_shared_vertex() {
        // vertex 2 is read by vertices 3 and 4
        let dag = tree(&[&[], &[], &[0, 1], &[2, 0], &[2, 1], &[3, 4]]);
        let batch = LinearBatch::new(&[&dag]).expect("linearizes");
        let err = UnrolledPlan::new().plan(&batch).expect_err("a DAG");
        assert!(err.to_string().contains("graph 0 vertex 2"), "{err}");
    }
}
