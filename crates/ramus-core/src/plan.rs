//! Execution classification (Cavs §3.5, Proposition 2). Given the sources
//! that only exist once a task's dependencies ran (`gather` in `F`, the
//! scattered-state gradient in `∂F`) and the outputs a task must produce
//! for later tasks (`scatter` in `F`, child gradients in `∂F`), every op
//! node is one of:
//! * **eager** — does not depend on a dynamic source: run once over all
//!   rows before the tasks (input projections, `pull`, embeddings);
//! * **per-task** — on a path from a dynamic source to a task output: run
//!   in every batching task on that task's rows;
//! * **lazy** — depends on a dynamic source but no task output depends on
//!   it: run once over all rows after the tasks (`push`, weight gradients).

use crate::error::{CoreError, Result};
use crate::graph::{Graph, NodeId, NodeKind, Role, Source, Space};
use crate::op::OpDef;

/// When an op node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Eager,
    PerTask,
    Lazy,
}

/// Op nodes of a graph grouped by phase, each list in topological order.
#[derive(Clone, Debug, Default)]
pub struct ExecPlan {
    pub eager: Vec<NodeId>,
    pub per_task: Vec<NodeId>,
    pub lazy: Vec<NodeId>,
    /// Phase of every node (`None` for inputs and parameters).
    pub phase: Vec<Option<Phase>>,
}

/// Classifies `graph`'s op nodes; see the module docs.
pub fn classify(
    graph: &Graph,
    is_dynamic: impl Fn(Source) -> bool,
    task_output: impl Fn(Role) -> bool,
    context: &str,
) -> Result<ExecPlan> {
    let n = graph.nodes.len();
    let mut dynamic = vec![false; n];
    for (i, node) in graph.nodes.iter().enumerate() {
        dynamic[i] = match node.kind {
            NodeKind::Input(s) => is_dynamic(s),
            NodeKind::Param(_) => false,
            NodeKind::Op(_) => node.inputs.iter().any(|&x| dynamic[x]),
        };
    }
    let mut feeds_task = vec![false; n];
    for o in graph.outputs.iter().filter(|o| task_output(o.role)) {
        feeds_task[o.node] = true;
    }
    for i in (0..n).rev() {
        if feeds_task[i] {
            for &x in &graph.nodes[i].inputs {
                feeds_task[x] = true;
            }
        }
    }
    let mut plan = ExecPlan {
        phase: vec![None; n],
        ..Default::default()
    };
    for (i, node) in graph.nodes.iter().enumerate() {
        let NodeKind::Op(op) = &node.kind else {
            continue;
        };
        let phase = if !dynamic[i] {
            Phase::Eager
        } else if feeds_task[i] {
            if node.ty.space == Space::Static {
                return Err(CoreError::model(
                    context,
                    format!("op `{}` (node %{i}) reduces over rows on the path between gather and scatter; a task sees only some rows", op.signature()),
                ));
            }
            if op.couples_rows() {
                return Err(CoreError::model(
                    context,
                    format!("op `{}` (node %{i}) couples the rows of a run (batch statistics) and lies on the path between gather and scatter, where a task sees only some rows; use it where all rows run together (a function without gather, e.g. single-vertex graphs, or the head)", op.signature()),
                ));
            }
            Phase::PerTask
        } else {
            Phase::Lazy
        };
        plan.phase[i] = Some(phase);
        match phase {
            Phase::Eager => plan.eager.push(i),
            Phase::PerTask => plan.per_task.push(i),
            Phase::Lazy => plan.lazy.push(i),
        }
    }
    Ok(plan)
}

/// Leaf specialisation with computation hoisting (Cortex §4) for engines
/// that run with fixed parameters: the vertex-row values computed from the
/// vertex token and parameters alone (dropout masks, constant outside
/// training, count as parameters) depend only on the token, so they can be
/// computed once per vocabulary entry and looked up per batch.
#[derive(Clone, Debug, Default)]
pub struct TokenHoist {
    /// Token-dependent vertex-row nodes whose values are read by the rest of
    /// the graph (or are outputs): these become per-token tables.
    pub tabulated: Vec<NodeId>,
    /// Op nodes that must still run per batch when the tables are used.
    pub keep: Vec<bool>,
    /// Nodes computed while building the tables (ancestors of `tabulated`).
    pub build: Vec<NodeId>,
}

/// Finds what can be tabulated by token; see [`TokenHoist`].
pub fn token_hoist(graph: &Graph) -> TokenHoist {
    let n = graph.nodes.len();
    let (mut invariant, mut uses_token) = (vec![false; n], vec![false; n]);
    for (i, node) in graph.nodes.iter().enumerate() {
        match node.kind {
            NodeKind::Input(Source::Token) => {
                invariant[i] = true;
                uses_token[i] = true;
            }
            NodeKind::Input(Source::DropoutMask { .. }) | NodeKind::Param(_) => invariant[i] = true,
            NodeKind::Input(_) => {}
            NodeKind::Op(ref op) => {
                // values that depend on other rows of the batch (batch
                // statistics, reductions over rows) are not per-token
                let batch_dependent = op.couples_rows()
                    || (node.ty.space == Space::Static
                        && node.inputs.iter().any(|&x| graph.nodes[x].ty.is_rows()));
                invariant[i] = !batch_dependent && node.inputs.iter().all(|&x| invariant[x]);
                uses_token[i] = node.inputs.iter().any(|&x| uses_token[x]);
            }
        }
    }
    let candidate = |i: usize| {
        let node = &graph.nodes[i];
        invariant[i]
            && uses_token[i]
            && matches!(node.kind, NodeKind::Op(_))
            && node.ty.space == Space::Vertex
            && node.ty.dtype == crate::graph::DType::Float
    };
    let users = graph.users();
    let is_output = graph.output_mask();
    let tabulated: Vec<NodeId> = (0..n)
        .filter(|&i| candidate(i) && (is_output[i] || users[i].iter().any(|&u| !candidate(u))))
        .collect();
    let mut tab = vec![false; n];
    tabulated.iter().for_each(|&i| tab[i] = true);
    // a node is needed if an output or a needed, non-tabulated user reads it
    let mut need = vec![false; n];
    for i in (0..n).rev() {
        need[i] = is_output[i] || !invariant[i] || users[i].iter().any(|&u| need[u] && !tab[u]);
    }
    let keep = (0..n).map(|i| !tab[i] && need[i]).collect();
    let mut anc = vec![false; n];
    tabulated.iter().for_each(|&i| anc[i] = true);
    for i in (0..n).rev() {
        if anc[i] {
            graph.nodes[i].inputs.iter().for_each(|&x| anc[x] = true);
        }
    }
    let build = (0..n)
        .filter(|&i| anc[i] && matches!(graph.nodes[i].kind, NodeKind::Op(_)))
        .collect();
    TokenHoist {
        tabulated,
        keep,
        build,
    }
}
