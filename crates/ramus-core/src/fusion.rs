//! Kernel fusion: the NNVM "Fusion" pass (Cavs §3.5); its "CodeGen" is
//! `ramus_codegen::fused`.
//!
//! [`fuse`] takes one phase's op list (an [`ExecPlan`](crate::plan::ExecPlan)
//! list, in topological order) and groups connected elementwise ops — ops
//! with an [`OpDef::elementwise_template`](crate::op::OpDef::elementwise_template)
//! — with union-find into [`FusedGroup`]s, each of which becomes a single
//! kernel. Two connected elementwise ops join when both are in the list,
//! agree in space and row width, and the merge keeps the graph of steps
//! acyclic: a path producer → other step → consumer would make the fused
//! kernel wait for itself. Groups that are not connected merge as
//! *siblings*: two groups of listed elementwise ops that agree in space and
//! width and read a common value (any node read by members of both) become
//! one kernel when neither can reach the other through a third unit
//! (checked in both directions: no producer/consumer edge orients the
//! check). This takes, say, the two products `x · p` and `x · q` of one
//! expanded row `x` into one kernel that reads `x` once. The
//! producer/consumer and sibling passes repeat until neither merges
//! anything (a merge can absorb the third unit that blocked another). The
//! result is a [`FusionPlan`]: steps (single ops or fused groups) in an
//! order that respects every dependency.
//!
//! A fused group reads its *inputs* (values computed outside it, each read
//! per element or, for a static bias of a row group, broadcast over rows)
//! and materializes only its *outputs* (members read outside the group, by
//! another phase, by the backward graph or as graph outputs). Everything
//! else stays in registers.
//!
//! Four data-movement ops need no kernel of their own:
//! * a `slice` whose every user reads it in place — a fused group (as an
//!   [`InputKind::Window`] of the slice's source) or a `matmul` operand
//!   that cuBLAS can take with a leading dimension — becomes a
//!   [`SliceView`];
//! * a `concat` whose every input is a fused-group member is written in
//!   place: each group stores those members straight into the concat's
//!   buffer at their column offset ([`ConcatWrite`]), and a member the
//!   concat alone read needs no buffer of its own;
//! * a `sum_children` whose every user is a fused elementwise op on vertex
//!   rows of its width is an *inline read* ([`FusionPlan::inline_reads`]):
//!   each reading group sums the child edge rows itself through the CSR
//!   edge offsets ([`InputKind::ChildSum`]);
//! * likewise an `expand_children` whose every user is a fused elementwise
//!   op on edge rows of its width: each reading group reads the parent
//!   vertex row of each edge through the parent indices
//!   ([`InputKind::ParentRow`]).
//!
//! Together with [`crate::simplify::pads_to_concat`] (which turns the
//! pad-and-add gradients of slices back into concats) this removes the
//! copy kernels around the fused cells of an LSTM-like function, and the
//! child-sum and expand kernels around the cells of a child-sum Tree-LSTM
//! and its derivative.
//!
//! For each group this module renders the members as C expressions from
//! the ops' registered templates ([`FusedGroup::members_code`], from which
//! `ramus_codegen::fused` generates one CUDA C++ kernel per group); the
//! CPU engine evaluates a group through the ops' own kernels
//! (`ramus_cpu::fused::eval_group`): the oracle the generated code is
//! tested against.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
use std::fmt;

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, NodeId, NodeKind, Source, Space};
use crate::op::OpDef;
use crate::ops::Op;

// ---------------------------------------------------------------- plan types

/// How a fused kernel reads one of its inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// One element per output element (`in[i]`): a row value of the group's
    /// space and width, or, in a static group, a tensor of the group's shape.
    PerElement,
    /// A static row repeated for every row of a row group (`in[i % width]`):
    /// a bias.
    Broadcast,
    /// A column window of a wider row value, read in place: the input node
    /// is a `slice` that has no step of its own (a [`SliceView`]), and the
    /// kernel reads its `source` directly. Element `i` of the window is
    /// `source[(i / width) * stride + offset + i % width]` (`width` = the
    /// group's width = the slice's length, `stride` = the source's row width,
    /// `offset` = the slice's first column).
    Window {
        source: NodeId,
        offset: usize,
        stride: usize,
    },
    /// The sum over a vertex's child edges of an edge-row value (an inlined
    /// `sum_children`): element `i` (row `r = i / width`, column
    /// `j = i % width`) is `Σ_{e = rows[r] - base .. rows[r + 1] - base}
    /// source[e * width + j]`, summed in edge order from zero. The input's
    /// `node` is the `sum_children` node (an inline read, without a step),
    /// `source` its operand; `rows` are the CSR edge offsets of the group's
    /// vertex rows.
    ChildSum { source: NodeId },
    /// An edge row's parent vertex row (an inlined `expand_children`):
    /// element `i` (edge `e = i / width`) is
    /// `source[(rows[e] - base) * width + i % width]`. The input's `node` is
    /// the `expand_children` node (an inline read, without a step),
    /// `source` its operand; `rows` holds the parent vertex of each of the
    /// group's edge rows.
    ParentRow { source: NodeId },
}

impl InputKind {
    /// Short name of the kind, for errors.
    pub fn short(self) -> &'static str {
        match self {
            InputKind::PerElement => "elem",
            InputKind::Broadcast => "bcast",
            InputKind::Window { .. } => "win",
            InputKind::ChildSum { .. } => "csum",
            InputKind::ParentRow { .. } => "parent",
        }
    }

    /// True for the kinds read through the row topology
    /// ([`ChildSum`](InputKind::ChildSum), [`ParentRow`](InputKind::ParentRow)):
    /// their kernels take an index array and a base besides the data (see
    /// `ramus_codegen::fused` and `ramus_cpu::fused::eval_group`).
    pub fn is_csr(self) -> bool {
        matches!(
            self,
            InputKind::ChildSum { .. } | InputKind::ParentRow { .. }
        )
    }

    /// The node whose buffer the kernel reads for an input of this kind
    /// whose own node is `node`: the source of a window or an inline read,
    /// otherwise `node` itself.
    pub fn buffer(self, node: NodeId) -> NodeId {
        match self {
            InputKind::PerElement | InputKind::Broadcast => node,
            InputKind::Window { source, .. }
            | InputKind::ChildSum { source }
            | InputKind::ParentRow { source } => source,
        }
    }
}

/// A value a fused group reads from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedInput {
    /// The value the members read (for a window: the viewed slice; for a
    /// child sum or parent row: the inlined `sum_children` or
    /// `expand_children` node).
    pub node: NodeId,
    pub kind: InputKind,
}

impl FusedInput {
    /// The node whose buffer the kernel reads (see [`InputKind::buffer`]).
    pub fn buffer(&self) -> NodeId {
        self.kind.buffer(self.node)
    }
}

/// A member of a fused group that the kernel also stores into the buffer of
/// a `concat` written in place (see [`FusionPlan::in_place_concats`]): row
/// `r` of the member goes to columns `offset..offset + width` of row `r` of
/// the concat, i.e. element `i` to `concat[(i / width) * stride + offset + i % width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConcatWrite {
    pub member: NodeId,
    pub concat: NodeId,
    /// First column of the member inside the concat's rows.
    pub offset: usize,
    /// Row width of the concat.
    pub stride: usize,
}

/// Connected elementwise ops run as one kernel. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedGroup {
    /// Member op nodes in topological order.
    pub nodes: Vec<NodeId>,
    /// Values read from outside the group, in first-use order, each once.
    pub inputs: Vec<FusedInput>,
    /// Members whose values are materialized in buffers of their own, in
    /// member order.
    pub outputs: Vec<NodeId>,
    /// Members also stored into concats written in place, in member order
    /// (for one member: concats in node order, then column order).
    pub concat_writes: Vec<ConcatWrite>,
    /// Space of every member (the rows the kernel runs over).
    pub space: Space,
    /// Elements per row of every member (all elements for a static group).
    pub width: usize,
}

/// A `slice` that has no step: its users read a window of its source in
/// place (fused groups through [`InputKind::Window`], matmuls through the
/// leading dimension, `sum_children` with a row stride). Row `r` of the slice is
/// `source[r * stride + offset .. r * stride + offset + len]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceView {
    pub slice: NodeId,
    pub source: NodeId,
    /// First column (the slice's `start`).
    pub offset: usize,
    /// Row width of the source.
    pub stride: usize,
    /// Columns in the window (the slice's `len`).
    pub len: usize,
}

/// One step of a [`FusionPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A non-elementwise op node, run by its own kernel.
    Op(NodeId),
    /// Elementwise ops run as one kernel (possibly a single op).
    Fused(FusedGroup),
}

/// One phase's op nodes as kernels to launch, in dependency order.
///
/// Every op node of the phase is in exactly one step, or is a slice in
/// [`views`](FusionPlan::views), a concat in
/// [`in_place_concats`](FusionPlan::in_place_concats), or a `sum_children`
/// / `expand_children` in [`inline_reads`](FusionPlan::inline_reads): those
/// three have no step. A step that reads a viewed slice or an inline read
/// comes after the step computing its source; a step that reads an
/// in-place concat comes after every group writing into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FusionPlan {
    pub steps: Vec<Step>,
    /// Slices read in place, in list order.
    pub views: Vec<SliceView>,
    /// Concats without a step: every input is a fused-group member that its
    /// group stores into the concat's buffer ([`FusedGroup::concat_writes`]).
    /// The concat still has its buffer (rows × its width); in list order.
    pub in_place_concats: Vec<NodeId>,
    /// `sum_children` and `expand_children` nodes without a step or a
    /// buffer: every reader is a fused group that reads the operand through
    /// the row topology ([`InputKind::ChildSum`], [`InputKind::ParentRow`]);
    /// in list order.
    pub inline_reads: Vec<NodeId>,
}

// ---------------------------------------------------------------- errors

/// An error at node `node` of `graph` in fusion (also the CPU evaluator's).
pub fn node_error(graph: &Graph, node: NodeId, message: impl Into<String>) -> CoreError {
    let op = graph
        .nodes
        .get(node)
        .map(|n| n.describe(&[]))
        .unwrap_or_else(|| "?".into());
    CoreError::Shape {
        context: "fusion".into(),
        op,
        message: format!("node %{node}: {}", message.into()),
    }
}

/// An error of the whole group `group` (also the CPU evaluator's).
pub fn group_error(group: &FusedGroup, message: impl Into<String>) -> CoreError {
    CoreError::Kernel {
        op: group.describe(),
        message: message.into(),
    }
}

// ---------------------------------------------------------------- fusion pass

/// Union-find over graph nodes (union by size); each root holds its members.
struct Groups {
    parent: Vec<NodeId>,
    members: Vec<Vec<NodeId>>,
}

impl Groups {
    fn new(n: usize) -> Self {
        Groups {
            parent: (0..n).collect(),
            members: (0..n).map(|i| vec![i]).collect(),
        }
    }
    /// The root of `x`'s group (union by size keeps the chains short).
    fn find(&self, mut x: NodeId) -> NodeId {
        while self.parent[x] != x {
            x = self.parent[x];
        }
        x
    }
    fn union(&mut self, a: NodeId, b: NodeId) {
        let (big, small) = if self.members[a].len() >= self.members[b].len() {
            (a, b)
        } else {
            (b, a)
        };
        self.parent[small] = big;
        let moved = std::mem::take(&mut self.members[small]);
        self.members[big].extend(moved);
    }
}

/// State of the fusion pass over one graph.
struct Fuser {
    users: Vec<Vec<NodeId>>,
    groups: Groups,
    /// Scratch for reachability searches.
    seen: Vec<bool>,
    stack: Vec<NodeId>,
}

impl Fuser {
    /// True if some path leaves unit `from`, passes through a third unit and
    /// reaches unit `to` (both roots). In the graph of units (a group is one
    /// unit, every other node its own) such a path would close a cycle once
    /// `from` and `to` are merged; direct edges `from → to` are harmless.
    fn path_through_other(&mut self, from: NodeId, to: NodeId) -> bool {
        let Fuser {
            users,
            groups,
            seen,
            stack,
        } = self;
        seen.iter_mut().for_each(|s| *s = false);
        stack.clear();
        for &m in &groups.members[from] {
            stack.extend(users[m].iter().copied().filter(|&u| {
                let r = groups.find(u);
                r != from && r != to
            }));
        }
        while let Some(w) = stack.pop() {
            if seen[w] {
                continue;
            }
            let r = groups.find(w);
            if r == to {
                return true;
            }
            // reaching a unit means waiting for all of it: go on from every member
            for &m in &groups.members[r] {
                seen[m] = true;
                stack.extend(users[m].iter().copied().filter(|&u| !seen[u]));
            }
        }
        false
    }

    /// Merges the groups of `producer` and its user `consumer` unless that
    /// closes a cycle. Only a path producer group → third unit → consumer
    /// group can: a path back from the consumer's group to the producer's
    /// would already be a cycle through the edge `producer → consumer`.
    fn try_merge(&mut self, producer: NodeId, consumer: NodeId) -> bool {
        let (rp, rc) = (self.groups.find(producer), self.groups.find(consumer));
        if rp == rc || self.path_through_other(rp, rc) {
            return false;
        }
        self.groups.union(rp, rc);
        true
    }

    /// Merges the groups of `a` and `b`, two readers of a common value,
    /// unless that closes a cycle. Neither group need feed the other, so
    /// paths through a third unit are ruled out in both directions.
    fn try_merge_siblings(&mut self, a: NodeId, b: NodeId) -> bool {
        let (ra, rb) = (self.groups.find(a), self.groups.find(b));
        if ra == rb || self.path_through_other(ra, rb) || self.path_through_other(rb, ra) {
            return false;
        }
        self.groups.union(ra, rb);
        true
    }
}

/// Groups the elementwise ops of one phase's op list `nodes` (topological
/// order) into fused kernels; see the module docs.
///
/// A member's value is materialized (becomes a group output) when a node
/// outside the group other than a concat written in place reads it, it is a
/// graph output, nothing reads it at all (so the plan computes everything
/// the unfused list did), or `keep` says it is needed elsewhere — pass the
/// forward values the backward graph reads (see [`forward_reads`]) when
/// fusing a forward graph.
///
/// A listed `slice` of a row value becomes a [`SliceView`] (no step) when
/// it is not kept, not a graph output, and every user is a listed node that
/// reads it in place: an elementwise op (fused, so it reads an
/// [`InputKind::Window`]), operand A of a `matmul` without `trans_a`, or
/// either operand of a `matmul` with `trans_a`. A listed `concat` whose
/// inputs are all fused-group members is written in place (no step; see
/// [`FusedGroup::concat_writes`]). Grouping itself is unchanged: views and
/// in-place concats still separate the groups before and after them.
///
/// A listed `sum_children` (`expand_children`) becomes an inline read (no
/// step, no buffer; see [`FusionPlan::inline_reads`]) when it is not kept,
/// not a graph output, its operand is a float edge-row (vertex-row) value
/// of its width that is not a viewed slice, and it has users, all of them
/// listed elementwise ops on vertex (edge) rows of its width: the fused
/// groups read it as an [`InputKind::ChildSum`] ([`InputKind::ParentRow`])
/// of the operand. Like views, inline reads still separate the groups of
/// their operand and their readers.
///
/// Besides producer → consumer edges, groups of listed elementwise ops of
/// one space and width that read a common value merge when that keeps the
/// steps acyclic (see the module docs).
///
/// Errors name the offending node: a node that is not an op, listed twice or
/// out of order, a graph whose nodes are not in topological order, or a list
/// that reads a value computed outside it from its own results.
pub fn fuse(graph: &Graph, nodes: &[NodeId], keep: &dyn Fn(NodeId) -> bool) -> Result<FusionPlan> {
    let n = graph.nodes.len();
    for (i, node) in graph.nodes.iter().enumerate() {
        if let Some(&x) = node.inputs.iter().find(|&&x| x >= i) {
            return Err(node_error(
                graph,
                i,
                format!("reads %{x}: graph nodes are not in topological order"),
            ));
        }
    }
    // position of each listed node in `nodes`
    let mut position: Vec<Option<usize>> = vec![None; n];
    for (p, &v) in nodes.iter().enumerate() {
        let Some(node) = graph.nodes.get(v) else {
            return Err(CoreError::Shape {
                context: "fusion".into(),
                op: "?".into(),
                message: format!("node %{v} does not exist (the graph has {n} nodes)"),
            });
        };
        if node.op().is_none() {
            return Err(node_error(graph, v, "is not an op node"));
        }
        if position[v].is_some() {
            return Err(node_error(graph, v, "is listed twice"));
        }
        position[v] = Some(p);
    }
    // listed inputs come first; unlisted inputs do not depend on the list
    let mut depends_on_list = vec![false; n];
    for (i, node) in graph.nodes.iter().enumerate() {
        depends_on_list[i] = node
            .inputs
            .iter()
            .any(|&x| position[x].is_some() || depends_on_list[x]);
    }
    for (p, &v) in nodes.iter().enumerate() {
        for &x in &graph.nodes[v].inputs {
            match position[x] {
                Some(q) if q >= p => {
                    return Err(node_error(
                        graph,
                        v,
                        format!("reads %{x}, which is listed after it"),
                    ))
                }
                None if depends_on_list[x] => {
                    return Err(node_error(
                        graph,
                        v,
                        format!("reads %{x}, which is not listed but depends on listed nodes"),
                    ))
                }
                _ => {}
            }
        }
    }

    let elementwise: Vec<bool> = (0..n)
        .map(|i| {
            position[i].is_some()
                && graph.nodes[i]
                    .op()
                    .is_some_and(|op| op.elementwise_template().is_some())
        })
        .collect();
    // two listed elementwise ops that may share a kernel
    let fusable_pair = |a: NodeId, b: NodeId| {
        elementwise[a]
            && elementwise[b]
            && graph.nodes[a].ty.space == graph.nodes[b].ty.space
            && graph.nodes[a].ty.width() == graph.nodes[b].ty.width()
    };

    let mut fuser = Fuser {
        users: graph.users(),
        groups: Groups::new(n),
        seen: vec![false; n],
        stack: Vec::new(),
    };
    // the listed elementwise readers of each value read by at least two
    let sibling_readers: Vec<Vec<NodeId>> = fuser
        .users
        .iter()
        .filter_map(|us| {
            // users come in node order: a node reading a value twice is
            // listed twice in a row
            let mut readers: Vec<NodeId> = us.iter().copied().filter(|&u| elementwise[u]).collect();
            readers.dedup();
            (readers.len() >= 2).then_some(readers)
        })
        .collect();
    // Greedy passes in topological order, producer → consumer edges first,
    // then readers of a common value, repeated until nothing changes: later
    // merges can absorb the third unit that blocked an earlier one.
    loop {
        loop {
            let mut changed = false;
            for &v in nodes {
                for &x in &graph.nodes[v].inputs {
                    if fusable_pair(x, v) && fuser.try_merge(x, v) {
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
        let mut changed = false;
        for readers in &sibling_readers {
            for (k, &a) in readers.iter().enumerate() {
                for &b in &readers[k + 1..] {
                    if fusable_pair(a, b) && fuser.try_merge_siblings(a, b) {
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }

    let is_graph_output = graph.output_mask();
    let users = std::mem::take(&mut fuser.users);
    let groups = fuser.groups;

    // slices read in place (views) and concats written in place
    let mut view: Vec<Option<SliceView>> = vec![None; n];
    let mut views = Vec::new();
    let mut in_place = vec![false; n];
    let mut in_place_concats = Vec::new();
    for &v in nodes {
        let node = &graph.nodes[v];
        let Some(op) = node.op() else { continue };
        if let Op::Slice(slice) = op {
            let Some(&source) = node.inputs.first() else {
                continue;
            };
            let src = &graph.nodes[source].ty;
            let viewable = src.is_rows()
                && src.dtype == DType::Float
                && slice
                    .start
                    .checked_add(slice.len)
                    .is_some_and(|end| end <= src.width())
                && node.ty.width() == slice.len
                && !keep(v)
                && !is_graph_output[v]
                && users[v]
                    .iter()
                    .all(|&u| position[u].is_some() && reads_in_place(graph, u, v, elementwise[u]));
            if viewable {
                let sv = SliceView {
                    slice: v,
                    source,
                    offset: slice.start,
                    stride: src.width(),
                    len: slice.len,
                };
                view[v] = Some(sv);
                views.push(sv);
            }
        } else if matches!(op, Op::Concat(_))
            && node.ty.is_rows()
            && !node.inputs.is_empty()
            && node
                .inputs
                .iter()
                .all(|&x| elementwise[x] && graph.nodes[x].ty.space == node.ty.space)
        {
            in_place[v] = true;
            in_place_concats.push(v);
        }
    }

    // sum_children / expand_children read inline by every reader
    let mut inline: Vec<Option<InputKind>> = vec![None; n];
    let mut inline_reads = Vec::new();
    for &v in nodes {
        let node = &graph.nodes[v];
        let (from, to) = match node.op() {
            Some(op) if op.is_child_sum() => (Space::Edge, Space::Vertex),
            Some(op) if op.is_expand_children() => (Space::Vertex, Space::Edge),
            _ => continue,
        };
        let [source] = node.inputs[..] else { continue };
        let (ty, src) = (&node.ty, &graph.nodes[source].ty);
        let width = ty.width();
        let readable = ty.space == to
            && src.space == from
            && src.dtype == DType::Float
            && src.width() == width
            && view[source].is_none()
            && !keep(v)
            && !is_graph_output[v]
            && !users[v].is_empty()
            && users[v].iter().all(|&u| {
                elementwise[u]
                    && graph.nodes[u].ty.space == to
                    && graph.nodes[u].ty.width() == width
            });
        if readable {
            inline[v] = Some(if to == Space::Vertex {
                InputKind::ChildSum { source }
            } else {
                InputKind::ParentRow { source }
            });
            inline_reads.push(v);
        }
    }

    // units: a group root, or a non-elementwise node (views, in-place
    // concats and inline reads included: they order their readers);
    // numbered by first appearance
    let mut unit_of: Vec<Option<usize>> = vec![None; n];
    let mut unit_root: Vec<NodeId> = Vec::new();
    let mut root_unit: Vec<Option<usize>> = vec![None; n];
    for &v in nodes {
        let r = groups.find(v);
        let u = match root_unit[r] {
            Some(u) => u,
            None => {
                unit_root.push(r);
                root_unit[r] = Some(unit_root.len() - 1);
                unit_root.len() - 1
            }
        };
        unit_of[v] = Some(u);
    }
    let units = unit_root.len();
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); units];
    let mut pending = vec![0usize; units];
    for &v in nodes {
        let Some(uv) = unit_of[v] else { continue };
        for &x in &graph.nodes[v].inputs {
            if let Some(ux) = unit_of[x] {
                if ux != uv && !successors[ux].contains(&uv) {
                    successors[ux].push(uv);
                    pending[uv] += 1;
                }
            }
        }
    }
    // Kahn, earliest first appearance first
    let mut ready: BinaryHeap<Reverse<usize>> = (0..units)
        .filter(|&u| pending[u] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(units);
    while let Some(Reverse(u)) = ready.pop() {
        order.push(u);
        for &s in &successors[u] {
            pending[s] -= 1;
            if pending[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() != units {
        return Err(CoreError::Shape {
            context: "fusion".into(),
            op: "fuse".into(),
            message: "internal error: fused steps depend on each other cyclically".into(),
        });
    }

    let mut steps = Vec::with_capacity(units);
    for u in order {
        let root = unit_root[u];
        if !elementwise[root] {
            // views, in-place concats and inline reads run no kernel; the
            // order still put them after their producers and before their
            // readers
            if view[root].is_none() && !in_place[root] && inline[root].is_none() {
                steps.push(Step::Op(root));
            }
            continue;
        }
        let mut members = groups.members[root].clone();
        members.sort_by_key(|&m| position[m]);
        let in_group = |x: NodeId| unit_of[x] == Some(u);
        let ty = &graph.nodes[root].ty;
        let (space, width) = (ty.space, ty.width());
        let mut inputs: Vec<FusedInput> = Vec::new();
        for &m in &members {
            for &x in &graph.nodes[m].inputs {
                if in_group(x) || inputs.iter().any(|i| i.node == x) {
                    continue;
                }
                let kind = if let Some(sv) = view[x] {
                    InputKind::Window {
                        source: sv.source,
                        offset: sv.offset,
                        stride: sv.stride,
                    }
                } else if let Some(kind) = inline[x] {
                    kind
                } else if space != Space::Static && graph.nodes[x].ty.space == Space::Static {
                    InputKind::Broadcast
                } else {
                    InputKind::PerElement
                };
                inputs.push(FusedInput { node: x, kind });
            }
        }
        let outputs = members
            .iter()
            .copied()
            .filter(|&m| {
                is_graph_output[m]
                    || keep(m)
                    || users[m].is_empty()
                    || users[m].iter().any(|&x| !in_group(x) && !in_place[x])
            })
            .collect();
        let mut concat_writes = Vec::new();
        for &m in &members {
            let mut last = None;
            for &c in &users[m] {
                if !in_place[c] || last == Some(c) {
                    continue;
                }
                last = Some(c);
                let stride = graph.nodes[c].ty.width();
                let mut offset = 0;
                for &x in &graph.nodes[c].inputs {
                    if x == m {
                        concat_writes.push(ConcatWrite {
                            member: m,
                            concat: c,
                            offset,
                            stride,
                        });
                    }
                    offset += graph.nodes[x].ty.width();
                }
            }
        }
        steps.push(Step::Fused(FusedGroup {
            nodes: members,
            inputs,
            outputs,
            concat_writes,
            space,
            width,
        }));
    }
    Ok(FusionPlan {
        steps,
        views,
        in_place_concats,
        inline_reads,
    })
}

/// True if `user` can read slice `slice` as a window of its source in
/// place: a fused elementwise op of the slice's space and width, operand A
/// of a `matmul` without `trans_a`, or either operand of one with
/// `trans_a` (the engine passes the window through the leading dimension),
/// or the operand of a `sum_children` (the engine's child-sum kernel reads
/// rows with a stride). `elementwise`: `user` is fused (an unfused
/// elementwise op reads its operands whole, not in place).
pub fn reads_in_place(graph: &Graph, user: NodeId, slice: NodeId, elementwise: bool) -> bool {
    let node = &graph.nodes[user];
    if elementwise {
        let st = &graph.nodes[slice].ty;
        return node.ty.space == st.space && node.ty.width() == st.width();
    }
    let mm = match node.op() {
        Some(Op::SumChildren(_)) => return true,
        Some(Op::MatMul(mm)) => mm,
        _ => return false,
    };
    match node.inputs.as_slice() {
        [a, b] if mm.trans_a => *a == slice || *b == slice,
        [a, b] => *a == slice && *b != slice,
        _ => false,
    }
}

/// The nodes of a forward graph that its backward graph reads
/// ([`Source::Forward`]): values a fusion plan of the forward graph must
/// materialize (use as `keep` in [`fuse`]).
pub fn forward_reads(backward: &Graph) -> BTreeSet<NodeId> {
    backward
        .nodes
        .iter()
        .filter_map(|n| match n.kind {
            NodeKind::Input(Source::Forward(m)) => Some(m),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------- plan queries and listing

impl FusionPlan {
    /// The fused groups, in step order.
    pub fn groups(&self) -> impl Iterator<Item = &FusedGroup> {
        self.steps.iter().filter_map(|s| match s {
            Step::Fused(g) => Some(g),
            Step::Op(_) => None,
        })
    }

    /// Kernels launched per run of the phase (one per step).
    pub fn kernel_launches(&self) -> usize {
        self.steps.len()
    }

    /// Op nodes covered by the plan (steps, views, in-place concats and
    /// inline reads).
    pub fn op_count(&self) -> usize {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Op(_) => 1,
                Step::Fused(g) => g.nodes.len(),
            })
            .sum::<usize>()
            + self.views.len()
            + self.in_place_concats.len()
            + self.inline_reads.len()
    }

    /// The view of `slice`, if the plan reads that slice in place.
    pub fn view(&self, slice: NodeId) -> Option<&SliceView> {
        self.views.iter().find(|v| v.slice == slice)
    }

    /// True if `concat` has no step: fused groups write it in place.
    pub fn is_in_place_concat(&self, concat: NodeId) -> bool {
        self.in_place_concats.contains(&concat)
    }

    /// True if `node` (a `sum_children` or `expand_children`) has no step
    /// and no buffer: the fused groups reading it read its operand through
    /// the row topology.
    pub fn is_inline_read(&self, node: NodeId) -> bool {
        self.inline_reads.contains(&node)
    }

    /// A readable listing with each node's op, operands and type
    /// (`ramus inspect`); `params` names parameters.
    pub fn listing(&self, graph: &Graph, params: &[String]) -> String {
        let line = |v: NodeId| match graph.nodes.get(v) {
            Some(node) => {
                let ins: Vec<String> = node.inputs.iter().map(|x| format!("%{x}")).collect();
                format!(
                    "%{v} = {}({}) : {}",
                    node.describe(params),
                    ins.join(", "),
                    node.ty
                )
            }
            None => format!("%{v} = ? (not in the graph)"),
        };
        let mut s = format!(
            "{} ops in {} kernels ({} fused groups",
            self.op_count(),
            self.kernel_launches(),
            self.groups().count()
        );
        if !self.views.is_empty() || !self.in_place_concats.is_empty() {
            s += &format!(
                ", {} slice views, {} concats in place",
                self.views.len(),
                self.in_place_concats.len()
            );
        }
        if !self.inline_reads.is_empty() {
            s += &format!(", {} inline reads", self.inline_reads.len());
        }
        s += ")\n";
        for step in &self.steps {
            match step {
                Step::Op(v) => s += &format!("{}\n", line(*v)),
                Step::Fused(g) => {
                    s += &format!("{}\n", g.header());
                    for &v in &g.nodes {
                        s += &format!("    {}\n", line(v));
                    }
                }
            }
        }
        for v in &self.views {
            s += &format!(
                "view {}  (in place: columns {}..{} of %{}, stride {})\n",
                line(v.slice),
                v.offset,
                v.offset + v.len,
                v.source,
                v.stride
            );
        }
        for &c in &self.in_place_concats {
            s += &format!("in place {}  (written by fused groups)\n", line(c));
        }
        for &v in &self.inline_reads {
            let how = match graph.nodes.get(v).and_then(|n| n.op()) {
                Some(op) if op.is_child_sum() => "CSR offsets",
                _ => "parent indices",
            };
            s += &format!("inline {}  (read by fused groups through {how})\n", line(v));
        }
        s
    }
}

impl fmt::Display for FusionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for step in &self.steps {
            match step {
                Step::Op(v) => writeln!(f, "op %{v}")?,
                Step::Fused(g) => writeln!(f, "{}", g.header())?,
            }
        }
        for v in &self.views {
            writeln!(
                f,
                "view %{} = %{}[{}..{}]",
                v.slice,
                v.source,
                v.offset,
                v.offset + v.len
            )?;
        }
        for &c in &self.in_place_concats {
            writeln!(f, "concat in place %{c}")?;
        }
        for &v in &self.inline_reads {
            writeln!(f, "inline read %{v}")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- member code

/// Replaces the placeholders `{0}`, `{1}`, ... of an elementwise template by
/// `operands`; `{{` and `}}` stand for literal braces.
pub fn instantiate(template: &str, operands: &[String]) -> std::result::Result<String, String> {
    let bytes = template.as_bytes();
    let mut out = String::with_capacity(template.len() + 8 * operands.len());
    let mut i = 0;
    let mut literal_start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' if bytes.get(i + 1) == Some(&b'{') => {
                out.push_str(&template[literal_start..i]);
                out.push('{');
                i += 2;
                literal_start = i;
            }
            b'{' => {
                out.push_str(&template[literal_start..i]);
                let digits_end = bytes[i + 1..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(bytes.len(), |p| i + 1 + p);
                if digits_end == i + 1 || bytes.get(digits_end) != Some(&b'}') {
                    return Err(format!(
                        "malformed placeholder at byte {i} of template `{template}`"
                    ));
                }
                let k: usize = template[i + 1..digits_end]
                    .parse()
                    .map_err(|_| format!("placeholder at byte {i} of `{template}` is too large"))?;
                let operand = operands.get(k).ok_or_else(|| {
                    format!(
                        "template `{template}` uses operand {{{k}}} but the op has {} operands",
                        operands.len()
                    )
                })?;
                out.push_str(operand);
                i = digits_end + 1;
                literal_start = i;
            }
            b'}' if bytes.get(i + 1) == Some(&b'}') => {
                out.push_str(&template[literal_start..i]);
                out.push('}');
                i += 2;
                literal_start = i;
            }
            b'}' => {
                return Err(format!(
                    "unmatched `}}` at byte {i} of template `{template}`"
                ))
            }
            _ => i += 1,
        }
    }
    out.push_str(&template[literal_start..]);
    Ok(out)
}

/// A member of a group as code (see [`FusedGroup::members_code`]): its op
/// signature, operand variables and C expression.
pub struct MemberCode {
    pub signature: String,
    pub operands: Vec<String>,
    pub expr: String,
}

impl FusedGroup {
    /// `fused vertex×256 [%7 %8] in(%5, %4 bcast, %3 window %2[0..256]/512,
    /// %6 childsum %1) out(%8) cat(%8→%9[0..256])`.
    fn header(&self) -> String {
        let space = match self.space {
            Space::Vertex => "vertex",
            Space::Edge => "edge",
            Space::Static => "static",
        };
        let ids = |xs: &[NodeId]| {
            let shown: Vec<String> = xs.iter().map(|v| format!("%{v}")).collect();
            shown.join(" ")
        };
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .map(|i| match i.kind {
                InputKind::PerElement => format!("%{}", i.node),
                InputKind::Broadcast => format!("%{} bcast", i.node),
                InputKind::Window {
                    source,
                    offset,
                    stride,
                } => format!(
                    "%{} window %{source}[{offset}..{}]/{stride}",
                    i.node,
                    offset + self.width
                ),
                InputKind::ChildSum { source } => format!("%{} childsum %{source}", i.node),
                InputKind::ParentRow { source } => format!("%{} parent %{source}", i.node),
            })
            .collect();
        let mut s = format!(
            "fused {space}×{} [{}] in({}) out({})",
            self.width,
            ids(&self.nodes),
            inputs.join(", "),
            ids(&self.outputs),
        );
        if !self.concat_writes.is_empty() {
            let writes: Vec<String> = self
                .concat_writes
                .iter()
                .map(|w| {
                    format!(
                        "%{}→%{}[{}..{}]",
                        w.member,
                        w.concat,
                        w.offset,
                        w.offset + self.width
                    )
                })
                .collect();
            s += &format!(" cat({})", writes.join(", "));
        }
        s
    }

    /// Short name for errors: `fused group [%7 %8]`.
    pub fn describe(&self) -> String {
        let ids: Vec<String> = self.nodes.iter().map(|v| format!("%{v}")).collect();
        format!("fused group [{}]", ids.join(" "))
    }

    /// The concats this group writes into, each once, in order of their
    /// first entry in [`concat_writes`](Self::concat_writes) (the buffers
    /// `ramus_cpu::fused::eval_group` takes).
    pub fn concat_targets(&self) -> Vec<NodeId> {
        let mut targets: Vec<NodeId> = Vec::new();
        for w in &self.concat_writes {
            if !targets.contains(&w.concat) {
                targets.push(w.concat);
            }
        }
        targets
    }

    /// The variable holding value `x` inside the kernel: `t<j>` for member
    /// `j` computed before member `before`, `a<k>` for input `k`.
    fn variable(&self, x: NodeId, before: usize) -> Option<String> {
        if let Some(j) = self.nodes[..before].iter().position(|&m| m == x) {
            return Some(format!("t{j}"));
        }
        self.inputs
            .iter()
            .position(|i| i.node == x)
            .map(|k| format!("a{k}"))
    }

    /// Checks that a window or concat `what` of `self.width` columns at
    /// `offset` fits rows of `stride`, and that `node` is a row value of
    /// the group's space and that width — or, for a forward value a
    /// backward graph reads (stored by the forward graph's plan, whose row
    /// stride the backward graph does not know), of the group's width.
    fn check_strided(
        &self,
        graph: &Graph,
        what: &str,
        node: NodeId,
        offset: usize,
        stride: usize,
    ) -> Result<()> {
        if offset
            .checked_add(self.width)
            .is_none_or(|end| end > stride)
        {
            return Err(group_error(
                self,
                format!(
                    "{what} columns {offset}..{} do not fit rows of width {stride}",
                    offset.saturating_add(self.width)
                ),
            ));
        }
        let ty = &graph
            .nodes
            .get(node)
            .ok_or_else(|| group_error(self, format!("{what} %{node} is not in the graph")))?
            .ty;
        let forward_value = matches!(graph.nodes[node].kind, NodeKind::Input(Source::Forward(_)));
        let width = if forward_value { self.width } else { stride };
        if ty.space != self.space || !ty.is_rows() || ty.width() != width {
            return Err(group_error(
                self,
                format!(
                    "{what} %{node} has type {ty}, expected {:?} rows of width {width}",
                    self.space
                ),
            ));
        }
        Ok(())
    }

    /// Checks that a [`ChildSum`](InputKind::ChildSum) or
    /// [`ParentRow`](InputKind::ParentRow) input is what its kind says: the
    /// input node is a `sum_children` (`expand_children`) of `source`, a
    /// float edge-row (vertex-row) value of the group's width, and the group
    /// runs over vertex (edge) rows.
    fn check_inline_read(&self, graph: &Graph, input: &FusedInput) -> Result<()> {
        let (source, from, to, op) = match input.kind {
            InputKind::ChildSum { source } => (source, Space::Edge, Space::Vertex, "sum_children"),
            InputKind::ParentRow { source } => {
                (source, Space::Vertex, Space::Edge, "expand_children")
            }
            _ => return Ok(()),
        };
        let what = format!(
            "input %{} ({} of %{source})",
            input.node,
            input.kind.short()
        );
        let node = graph
            .nodes
            .get(input.node)
            .ok_or_else(|| group_error(self, format!("{what} is not in the graph")))?;
        let is_op = match input.kind {
            InputKind::ChildSum { .. } => node.op().is_some_and(Op::is_child_sum),
            _ => node.op().is_some_and(Op::is_expand_children),
        };
        if !is_op || node.inputs != [source] {
            return Err(group_error(self, format!("{what} is not {op}(%{source})")));
        }
        if self.space != to {
            return Err(group_error(
                self,
                format!(
                    "{what} is read by a group of {:?} rows, expected {to:?}",
                    self.space
                ),
            ));
        }
        let ty = &graph
            .nodes
            .get(source)
            .ok_or_else(|| group_error(self, format!("{what}: source is not in the graph")))?
            .ty;
        if ty.space != from || ty.dtype != DType::Float || ty.width() != self.width {
            return Err(group_error(
                self,
                format!(
                    "{what}: source has type {ty}, expected float {from:?} rows of width {}",
                    self.width
                ),
            ));
        }
        Ok(())
    }

    /// Checks the group against `graph` and renders each member as code.
    pub fn members_code(&self, graph: &Graph) -> Result<Vec<MemberCode>> {
        if self.nodes.is_empty() {
            return Err(group_error(self, "has no members"));
        }
        if let Some(&o) = self.outputs.iter().find(|o| !self.nodes.contains(o)) {
            return Err(group_error(self, format!("output %{o} is not a member")));
        }
        for input in &self.inputs {
            if let InputKind::Window {
                source,
                offset,
                stride,
            } = input.kind
            {
                self.check_strided(graph, "window source", source, offset, stride)?;
            }
            self.check_inline_read(graph, input)?;
        }
        for w in &self.concat_writes {
            if !self.nodes.contains(&w.member) {
                return Err(group_error(
                    self,
                    format!("concat write of %{}, which is not a member", w.member),
                ));
            }
            self.check_strided(graph, "concat", w.concat, w.offset, w.stride)?;
        }
        let mut code = Vec::with_capacity(self.nodes.len());
        for (j, &m) in self.nodes.iter().enumerate() {
            let node = graph
                .nodes
                .get(m)
                .ok_or_else(|| group_error(self, format!("member %{m} is not in the graph")))?;
            let op = node
                .op()
                .ok_or_else(|| node_error(graph, m, "fused member is not an op node"))?;
            let template = op
                .elementwise_template()
                .ok_or_else(|| node_error(graph, m, "fused member has no elementwise template"))?;
            if node.ty.space != self.space || node.ty.width() != self.width {
                return Err(node_error(
                    graph,
                    m,
                    format!(
                        "type {} does not match the group's {:?} rows of width {}",
                        node.ty, self.space, self.width
                    ),
                ));
            }
            let operands = node
                .inputs
                .iter()
                .map(|&x| {
                    self.variable(x, j).ok_or_else(|| {
                        node_error(
                            graph,
                            m,
                            format!("operand %{x} is neither an earlier member nor an input"),
                        )
                    })
                })
                .collect::<Result<Vec<String>>>()?;
            let expr = instantiate(&template, &operands).map_err(|e| node_error(graph, m, e))?;
            code.push(MemberCode {
                signature: op.signature(),
                operands,
                expr,
            });
        }
        Ok(code)
    }

    /// A normalized description of the computation — input kinds, member op
    /// signatures with operand variables, outputs, concat writes —
    /// independent of node ids, space, width, window and concat strides and
    /// offsets: equal signatures mean equal kernels (a cache key).
    pub fn signature(&self, graph: &Graph) -> Result<String> {
        let code = self.members_code(graph)?;
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .enumerate()
            .map(|(k, i)| format!("a{k}:{}", i.kind.short()))
            .collect();
        let members: Vec<String> = code
            .iter()
            .enumerate()
            .map(|(j, c)| format!("t{j}={}({})", c.signature, c.operands.join(",")))
            .collect();
        let outputs = self.output_members()?;
        let outputs: Vec<String> = outputs.iter().map(|j| format!("t{j}")).collect();
        let mut s = format!(
            "in[{}] {} out[{}]",
            inputs.join(","),
            members.join(" "),
            outputs.join(",")
        );
        if !self.concat_writes.is_empty() {
            let writes: Vec<String> = self
                .concat_write_members()?
                .iter()
                .map(|j| format!("t{j}"))
                .collect();
            s += &format!(" cat[{}]", writes.join(","));
        }
        Ok(s)
    }

    /// Member index of each output.
    pub fn output_members(&self) -> Result<Vec<usize>> {
        self.outputs
            .iter()
            .map(|o| {
                self.nodes
                    .iter()
                    .position(|m| m == o)
                    .ok_or_else(|| group_error(self, format!("output %{o} is not a member")))
            })
            .collect()
    }

    /// Member index of each concat write.
    pub fn concat_write_members(&self) -> Result<Vec<usize>> {
        self.concat_writes
            .iter()
            .map(|w| {
                self.nodes
                    .iter()
                    .position(|&m| m == w.member)
                    .ok_or_else(|| {
                        group_error(
                            self,
                            format!("concat write of %{}, which is not a member", w.member),
                        )
                    })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_parsed_not_pattern_replaced() {
        let ops = ["t0".to_string(), "a11".to_string()];
        assert_eq!(
            instantiate("({0} * {1} + {0})", &ops).as_deref(),
            Ok("(t0 * a11 + t0)")
        );
        assert_eq!(instantiate("{{x}} {1}", &ops).as_deref(), Ok("{x} a11"));
        assert!(instantiate("{2}", &ops)
            .unwrap_err()
            .contains("operand {2}"));
        assert!(instantiate("{a}", &ops).unwrap_err().contains("malformed"));
        assert!(instantiate("{0", &ops).unwrap_err().contains("malformed"));
        assert!(instantiate("x}", &ops).unwrap_err().contains("unmatched"));
        assert_eq!(
            instantiate("expf(-1.0f)", &[]).as_deref(),
            Ok("expf(-1.0f)")
        );
    }
}
