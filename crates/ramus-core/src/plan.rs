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
