//! Algebraic simplification passes over the graph IR.
//!
//! [`pads_to_concat`]: the gradient of a `slice` is a `pad` (the slice's
//! gradient placed at its columns of zero rows), so a value split into
//! column windows — the gates of an LSTM, the `[h; c]` halves of a state —
//! gets as gradient a sum of pads. When the pads' windows are disjoint and
//! cover every column, that sum is a concatenation: one `concat` (which the
//! fusion pass can even write in place) instead of zero-filled copies and
//! additions.

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, NodeId, NodeKind};
use crate::op::OpDef;
use crate::ops::{Concat, Op};

fn op_at(graph: &Graph, node: NodeId) -> Option<&Op> {
    graph.nodes.get(node)?.op()
}

/// A rewritable tree: its inner `add` nodes and its `pad` leaves.
struct PadTree {
    inner: Vec<NodeId>,
    /// `(start, pad node, padded value)`, sorted by start.
    leaves: Vec<(usize, NodeId, NodeId)>,
}

/// Replaces every tree of `add` nodes whose leaves are `pad` ops of row
/// values of the tree's space, with pairwise disjoint windows that exactly
/// tile the columns `0..total`, by one `concat` of the padded values ordered
/// by column.
///
/// The tree's root node becomes the concat (so its users and any output
/// naming it are unchanged); inner adds (an add belongs to the tree when its
/// only user is the tree's add and it is no graph output) and pads that
/// nothing else reads are removed, and the remaining nodes are renumbered,
/// outputs and their `aux` nodes included. Inputs such as
/// [`Source::Forward`](crate::graph::Source::Forward) refer to another
/// graph and are unchanged. A graph without such a tree comes back as is.
///
/// Errors: a graph whose nodes are not in topological order.
pub fn pads_to_concat(graph: &Graph) -> Result<Graph> {
    let n = graph.nodes.len();
    for (i, node) in graph.nodes.iter().enumerate() {
        if let Some(&x) = node.inputs.iter().find(|&&x| x >= i) {
            return Err(CoreError::Shape {
                context: "pads_to_concat".into(),
                op: node.describe(&[]),
                message: format!("node %{i} reads %{x}: graph nodes are not in topological order"),
            });
        }
    }
    let is_output = graph.output_mask();
    let users = graph.users();
    let is_add = |v: NodeId| matches!(op_at(graph, v), Some(Op::Add(_)));

    let mut out = graph.clone();
    let mut consumed = vec![false; n];
    let mut candidate = vec![false; n];
    let mut changed = false;
    // parents before children: a tree is rewritten whole when it can be
    for root in (0..n).rev() {
        if consumed[root] || !is_add(root) {
            continue;
        }
        let Some(tree) = pad_tree(graph, root, &users, &is_output) else {
            continue;
        };
        let concat = Op::Concat(Concat);
        let parts: Vec<NodeId> = tree.leaves.iter().map(|&(_, _, x)| x).collect();
        let tys: Vec<_> = parts.iter().map(|&x| &graph.nodes[x].ty).collect();
        if concat.infer(&tys).as_ref() != Ok(&graph.nodes[root].ty) {
            continue;
        }
        let node = &mut out.nodes[root];
        node.kind = NodeKind::Op(concat);
        node.inputs = parts;
        for &a in &tree.inner {
            consumed[a] = true;
            candidate[a] = true;
        }
        for &(_, p, _) in &tree.leaves {
            candidate[p] = true;
        }
        changed = true;
    }
    if !changed {
        return Ok(out);
    }

    // drop the tree nodes nothing reads any more
    let users_after = out.users();
    let mut keep = vec![true; n];
    for i in (0..n).rev() {
        keep[i] = !candidate[i] || is_output[i] || users_after[i].iter().any(|&u| keep[u]);
    }
    Ok(out.retain(&keep))
}

/// The pad tree rooted at add `root`, if it is one that tiles its columns.
fn pad_tree(
    graph: &Graph,
    root: NodeId,
    users: &[Vec<NodeId>],
    is_output: &[bool],
) -> Option<PadTree> {
    let ty = &graph.nodes[root].ty;
    if !ty.is_rows() || ty.dtype != DType::Float {
        return None;
    }
    let total = ty.width();
    let mut inner = Vec::new();
    let mut leaves = Vec::new();
    let mut stack = vec![root];
    while let Some(a) = stack.pop() {
        for &x in &graph.nodes[a].inputs {
            if matches!(op_at(graph, x), Some(Op::Add(_)))
                && !is_output[x]
                && users[x].iter().all(|&u| u == a)
            {
                inner.push(x);
                stack.push(x);
            } else if let Some(Op::Pad(pad)) = op_at(graph, x) {
                let &[value] = graph.nodes[x].inputs.as_slice() else {
                    return None;
                };
                let (pt, vt) = (&graph.nodes[x].ty, &graph.nodes[value].ty);
                if pad.total != total
                    || pt != ty
                    || vt.space != ty.space
                    || !vt.is_rows()
                    || vt.dtype != DType::Float
                    || vt.width() == 0
                {
                    return None;
                }
                leaves.push((pad.start, x, value));
            } else {
                return None;
            }
        }
    }
    leaves.sort_by_key(|&(start, _, _)| start);
    let mut next = 0;
    for &(start, _, x) in &leaves {
        if start != next {
            return None; // a gap or an overlap
        }
        next += graph.nodes[x].ty.width();
    }
    (next == total && leaves.len() >= 2).then_some(PadTree { inner, leaves })
}
