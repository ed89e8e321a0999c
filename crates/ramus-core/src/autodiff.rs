//! The autodiff pass: derives the backward graph `∂F` of a forward graph
//! (a vertex function or a head). Each op's registered gradient builder
//! emits its part; gradients reaching a value from several users are summed.
//! `gather(k)` turns into a `ChildGrad(k)` output that the engine scatters
//! (adds) into child `k`'s state gradient, `gather_all` into `ChildGradAll`,
//! `pull` into `PullGrad` (a push to the external side), and the head's
//! input into `HeadInputGrad`, which flows back into the pushed values.

use std::collections::HashMap;

use crate::error::{CoreError, Result};
use crate::gradient::{emit, GradCtx, GradTerm};
use crate::graph::{DType, Graph, GraphBuilder, NodeId, NodeKind, Role, Source, Sym};
use crate::op::OpDef;

/// Roles whose gradient seeds the backward pass.
fn seeded(role: Role) -> bool {
    matches!(role, Role::Scatter | Role::Push | Role::Loss)
}

/// Builds `∂graph`. Its inputs are `Forward(n)` (forward values),
/// `OutputGrad(i)` (the gradient arriving at forward output `i`) and
/// parameters; its outputs are the gradient roles described in the module docs.
pub fn differentiate(graph: &Graph, param_shapes: &[Vec<usize>], context: &str) -> Result<Graph> {
    let mut b = GraphBuilder::new(&format!("∂{context}"), param_shapes);
    let mut terms: HashMap<NodeId, Vec<Sym>> = HashMap::new();
    for (i, o) in graph.outputs.iter().enumerate() {
        if seeded(o.role) {
            let seed = b.input(Source::OutputGrad(i), graph.nodes[o.node].ty.clone());
            terms.entry(o.node).or_default().push(seed);
        }
    }
    let mut forward: HashMap<NodeId, Sym> = HashMap::new();
    let mut fwd = |b: &mut GraphBuilder, n: NodeId| -> Sym {
        if let NodeKind::Param(p) = graph.nodes[n].kind {
            return b.param(p);
        }
        *forward
            .entry(n)
            .or_insert_with(|| b.input(Source::Forward(n), graph.nodes[n].ty.clone()))
    };
    for n in (0..graph.nodes.len()).rev() {
        let Some(ts) = terms.remove(&n) else { continue };
        let mut g = ts[0];
        for &t in &ts[1..] {
            g = b.add(g, t);
        }
        let node = &graph.nodes[n];
        match &node.kind {
            NodeKind::Input(Source::Gather(k)) => b.output(Role::ChildGrad(*k), g, None),
            NodeKind::Input(Source::GatherAll) => b.output(Role::ChildGradAll, g, None),
            NodeKind::Input(Source::Pull) => b.output(Role::PullGrad, g, None),
            NodeKind::Input(Source::HeadInput) => b.output(Role::HeadInputGrad, g, None),
            NodeKind::Input(_) => {}
            NodeKind::Param(p) => b.output(Role::ParamGrad(*p), g, None),
            NodeKind::Op(op) => {
                let inputs: Vec<Sym> = node.inputs.iter().map(|&i| fwd(&mut b, i)).collect();
                let out = fwd(&mut b, n);
                let mut ctx = GradCtx::new(&mut b, inputs, out, g);
                emit(op, &mut ctx);
                let grads = std::mem::take(&mut ctx.grads);
                for (&input, term) in node.inputs.iter().zip(grads) {
                    let in_node = &graph.nodes[input];
                    match term {
                        None => {}
                        Some(_) if in_node.ty.dtype == DType::Index => {}
                        Some(GradTerm::Dense(s)) => terms.entry(input).or_default().push(s),
                        Some(GradTerm::Rows { values, index }) => match in_node.kind {
                            NodeKind::Param(p) => {
                                b.output(Role::ParamRowGrad(p), values, Some(index))
                            }
                            _ => {
                                return Err(CoreError::model(
                                    context,
                                    format!(
                                        "op `{}` gives a row gradient to a non-parameter input",
                                        op.name()
                                    ),
                                ))
                            }
                        },
                    }
                }
            }
        }
    }
    Ok(b.finish()?.prune())
}
