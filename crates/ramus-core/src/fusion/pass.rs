//! The fusion pass: [`fuse`] and the queries it is built on.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, NodeId, NodeKind, Source, Space};
use crate::op::OpDef;
use crate::ops::Op;

use super::types::{
    node_error, ConcatWrite, FusedGroup, FusedInput, FusionPlan, InputKind, SliceView, Step,
};
use super::units::{Fuser, Groups};

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
    let position = check_list(graph, nodes)?;
    let n = graph.nodes.len();
    let elementwise: Vec<bool> = (0..n)
        .map(|i| {
            position[i].is_some()
                && graph.nodes[i]
                    .op()
                    .is_some_and(|op| op.elementwise_template().is_some())
        })
        .collect();
    let (users, groups) = merge_groups(graph, nodes, &elementwise);
    let list = Listed {
        graph,
        nodes,
        keep,
        position,
        elementwise,
        users,
        is_graph_output: graph.output_mask(),
        groups,
    };
    let in_place = list.views_and_concats();
    let inline = list.inline_reads(&in_place);
    let units = list.order_units()?;

    let mut steps = Vec::with_capacity(units.order.len());
    for &u in &units.order {
        let root = units.unit_root[u];
        if !list.elementwise[root] {
            // views, in-place concats and inline reads run no kernel; the
            // order still put them after their producers and before their
            // readers
            if in_place.view[root].is_none()
                && !in_place.in_place[root]
                && inline.inline[root].is_none()
            {
                steps.push(Step::Op(root));
            }
            continue;
        }
        steps.push(Step::Fused(list.group(u, &units, &in_place, &inline)));
    }
    Ok(FusionPlan {
        steps,
        views: in_place.views,
        in_place_concats: in_place.in_place_concats,
        inline_reads: inline.inline_reads,
    })
}

/// Checks the graph's topological order and the list `nodes` (existing op
/// nodes, each once, listed inputs first, unlisted inputs independent of
/// the list); returns the position of each listed node in `nodes`.
fn check_list(graph: &Graph, nodes: &[NodeId]) -> Result<Vec<Option<usize>>> {
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
    Ok(position)
}

/// The merge loop: groups the listed elementwise ops (`elementwise`)
/// along producer → consumer edges and among readers of a common value.
/// Returns the users of every node and the groups.
fn merge_groups(
    graph: &Graph,
    nodes: &[NodeId],
    elementwise: &[bool],
) -> (Vec<Vec<NodeId>>, Groups) {
    let n = graph.nodes.len();
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
    let users = std::mem::take(&mut fuser.users);
    (users, fuser.groups)
}

/// What [`fuse`] knows about the list once the groups are merged.
struct Listed<'a> {
    graph: &'a Graph,
    nodes: &'a [NodeId],
    keep: &'a dyn Fn(NodeId) -> bool,
    position: Vec<Option<usize>>,
    /// Listed elementwise ops.
    elementwise: Vec<bool>,
    users: Vec<Vec<NodeId>>,
    is_graph_output: Vec<bool>,
    groups: Groups,
}

/// Slices read in place (views) and concats written in place.
struct InPlace {
    view: Vec<Option<SliceView>>,
    views: Vec<SliceView>,
    in_place: Vec<bool>,
    in_place_concats: Vec<NodeId>,
}

/// `sum_children` / `expand_children` read inline by every reader.
struct Inline {
    inline: Vec<Option<InputKind>>,
    inline_reads: Vec<NodeId>,
}

/// Units in step order: a group root, or a non-elementwise node (views,
/// in-place concats and inline reads included: they order their readers);
/// numbered by first appearance.
struct Units {
    unit_of: Vec<Option<usize>>,
    unit_root: Vec<NodeId>,
    order: Vec<usize>,
}

impl Listed<'_> {
    fn views_and_concats(&self) -> InPlace {
        let (graph, n) = (self.graph, self.graph.nodes.len());
        let (position, elementwise, users) = (&self.position, &self.elementwise, &self.users);
        // slices read in place (views) and concats written in place
        let mut view: Vec<Option<SliceView>> = vec![None; n];
        let mut views = Vec::new();
        let mut in_place = vec![false; n];
        let mut in_place_concats = Vec::new();
        for &v in self.nodes {
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
                    && !(self.keep)(v)
                    && !self.is_graph_output[v]
                    && users[v].iter().all(|&u| {
                        position[u].is_some() && reads_in_place(graph, u, v, elementwise[u])
                    });
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
        InPlace {
            view,
            views,
            in_place,
            in_place_concats,
        }
    }

    fn inline_reads(&self, in_place: &InPlace) -> Inline {
        let (graph, users) = (self.graph, &self.users);
        // sum_children / expand_children read inline by every reader
        let mut inline: Vec<Option<InputKind>> = vec![None; graph.nodes.len()];
        let mut inline_reads = Vec::new();
        for &v in self.nodes {
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
                && in_place.view[source].is_none()
                && !(self.keep)(v)
                && !self.is_graph_output[v]
                && !users[v].is_empty()
                && users[v].iter().all(|&u| {
                    self.elementwise[u]
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
        Inline {
            inline,
            inline_reads,
        }
    }

    /// Numbers the units and orders them (Kahn, earliest first appearance
    /// first).
    fn order_units(&self) -> Result<Units> {
        let (graph, n) = (self.graph, self.graph.nodes.len());
        let mut unit_of: Vec<Option<usize>> = vec![None; n];
        let mut unit_root: Vec<NodeId> = Vec::new();
        let mut root_unit: Vec<Option<usize>> = vec![None; n];
        for &v in self.nodes {
            let r = self.groups.find(v);
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
        for &v in self.nodes {
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
        Ok(Units {
            unit_of,
            unit_root,
            order,
        })
    }

    /// The fused group of elementwise unit `u`.
    fn group(&self, u: usize, units: &Units, in_place: &InPlace, inline: &Inline) -> FusedGroup {
        let (graph, users) = (self.graph, &self.users);
        let root = units.unit_root[u];
        let mut members = self.groups.members[root].clone();
        members.sort_by_key(|&m| self.position[m]);
        let in_group = |x: NodeId| units.unit_of[x] == Some(u);
        let ty = &graph.nodes[root].ty;
        let (space, width) = (ty.space, ty.width());
        let mut inputs: Vec<FusedInput> = Vec::new();
        for &m in &members {
            for &x in &graph.nodes[m].inputs {
                if in_group(x) || inputs.iter().any(|i| i.node == x) {
                    continue;
                }
                let kind = if let Some(sv) = in_place.view[x] {
                    InputKind::Window {
                        source: sv.source,
                        offset: sv.offset,
                        stride: sv.stride,
                    }
                } else if let Some(kind) = inline.inline[x] {
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
                self.is_graph_output[m]
                    || (self.keep)(m)
                    || users[m].is_empty()
                    || users[m]
                        .iter()
                        .any(|&x| !in_group(x) && !in_place.in_place[x])
            })
            .collect();
        let concat_writes = self.concat_writes(&members, &in_place.in_place);
        FusedGroup {
            nodes: members,
            inputs,
            outputs,
            concat_writes,
            space,
            width,
        }
    }

    /// The stores of `members` into the concats written in place.
    fn concat_writes(&self, members: &[NodeId], in_place: &[bool]) -> Vec<ConcatWrite> {
        let graph = self.graph;
        let mut concat_writes = Vec::new();
        for &m in members {
            let mut last = None;
            for &c in &self.users[m] {
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
        concat_writes
    }
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
