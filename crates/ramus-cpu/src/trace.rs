//! The memory trace of one training iteration of a model on a batch, in the
//! batched engines' execution order (the input of the swap planner,
//! `ramus_swap`): every buffer the engines allocate — each symbol's dynamic
//! tensor, the vertex-state and state-gradient buffers, parameters, their
//! gradients and optimizer state — and every step that reads or writes
//! them: eager steps, then per task the gather, the task's ops and the
//! scatter, the lazy steps and the head; the backward pass in reverse task
//! order; one optimizer step per parameter. Because the schedule of a batch
//! is known before it runs, dynamic models (long sequences, large trees)
//! get a plan per batch exactly like static ones.
//!
//! A per-task op reads and writes slices of whole dynamic tensors; the
//! trace lists the whole tensors, which is what must be resident.

use ramus_core::graph::{Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::{Model, OpDef};
use ramus_swap::{Phase, TensorId, TensorKind, Trace, TraceBuilder};

use ramus_exec::Batch;
use ramus_exec::{ExecError, Result};

/// Bytes per element of every engine buffer (f32 values and u32 indices).
const ELEMENT: u64 = 4;

/// Tensors of one graph instance, by node (`None` for nodes without a
/// buffer of their own: parameters, and a backward graph's forward reads).
struct GraphTensors(Vec<Option<TensorId>>);

/// Builds the trace; see the module docs. `optimizer_states` is the
/// number of parameter-sized state tensors the optimizer keeps (0 for SGD,
/// 1 for Adagrad, 2 for Adam).
pub fn training_trace(model: &Model, batch: &Batch<'_>, optimizer_states: usize) -> Result<Trace> {
    let s = &batch.schedule;
    let mut t = TraceBuilder::new();
    let params: Vec<TensorId> = model
        .params
        .iter()
        .map(|p| {
            t.tensor(
                format!("param {}", p.name),
                numel(&p.shape) * ELEMENT,
                TensorKind::Parameter,
            )
        })
        .collect();
    let grads: Vec<TensorId> = model
        .params
        .iter()
        .map(|p| {
            t.tensor(
                format!("grad {}", p.name),
                numel(&p.shape) * ELEMENT,
                TensorKind::Gradient,
            )
        })
        .collect();
    let states: Vec<Vec<TensorId>> = model
        .params
        .iter()
        .map(|p| {
            (0..optimizer_states)
                .map(|k| {
                    t.tensor(
                        format!("opt{k} {}", p.name),
                        numel(&p.shape) * ELEMENT,
                        TensorKind::OptimizerState,
                    )
                })
                .collect()
        })
        .collect();
    let w = model.state_width as u64;
    let state = t.tensor(
        "vertex state",
        s.num_vertices() as u64 * w * ELEMENT,
        TensorKind::Activation,
    );
    let state_grad = t.tensor(
        "vertex state gradient",
        s.num_vertices() as u64 * w * ELEMENT,
        TensorKind::Gradient,
    );
    let head_rows = match model.head.rows {
        ramus_core::HeadRows::Roots => s.roots.len(),
        ramus_core::HeadRows::Labelled => s
            .labels
            .iter()
            .filter(|&&l| l != ramus_graph::NO_LABEL)
            .count(),
    };
    // forward tensors
    let mut fwd = Vec::with_capacity(model.functions.len());
    for (f, func) in model.functions.iter().enumerate() {
        let rows = &s.functions[f];
        fwd.push(graph_tensors(
            &mut t,
            &func.forward,
            None,
            rows.rows(),
            rows.edges(),
            &format!("F {}", func.name),
            TensorKind::Activation,
        ));
    }
    let head_fwd = graph_tensors(
        &mut t,
        &model.head.forward,
        None,
        head_rows,
        0,
        "head",
        TensorKind::Activation,
    );
    let mut ctx = Ops {
        t: &mut t,
        params: &params,
    };
    // forward pass
    for (f, func) in model.functions.iter().enumerate() {
        ctx.steps(
            &func.forward,
            &func.forward_plan.eager,
            &fwd[f],
            None,
            Phase::Forward,
            &format!("F {} eager", func.name),
        );
    }
    for (i, task) in s.tasks.iter().enumerate() {
        let func = &model.functions[task.function];
        let own = &fwd[task.function];
        let gathered = input_tensors(&func.forward, own, |src| {
            matches!(src, Source::Gather(_) | Source::GatherAll)
        });
        if !gathered.is_empty() {
            ctx.t.op(
                format!("task {i} gather"),
                Phase::Forward,
                &[state],
                &gathered,
            );
        }
        ctx.steps(
            &func.forward,
            &func.forward_plan.per_task,
            own,
            None,
            Phase::Forward,
            &format!("task {i}"),
        );
        if let Some(sc) = func.scatter.and_then(|n| own.0[n]) {
            ctx.t
                .op(format!("task {i} scatter"), Phase::Forward, &[sc], &[state]);
        }
    }
    for (f, func) in model.functions.iter().enumerate() {
        ctx.steps(
            &func.forward,
            &func.forward_plan.lazy,
            &fwd[f],
            None,
            Phase::Forward,
            &format!("F {} lazy", func.name),
        );
    }
    let pushed: Vec<TensorId> = model
        .functions
        .iter()
        .zip(&fwd)
        .filter_map(|(func, own)| func.push.and_then(|n| own.0[n]))
        .collect();
    let head_in = input_tensors(&model.head.forward, &head_fwd, |src| {
        src == Source::HeadInput
    });
    ctx.t.op("head input", Phase::Forward, &pushed, &head_in);
    let all_head: Vec<NodeId> = op_nodes(&model.head.forward);
    ctx.steps(
        &model.head.forward,
        &all_head,
        &head_fwd,
        None,
        Phase::Forward,
        "head",
    );
    // backward pass
    let head_bwd = graph_tensors(
        ctx.t,
        &model.head.backward,
        Some(&head_fwd),
        head_rows,
        0,
        "head ∂",
        TensorKind::Gradient,
    );
    let all_head_bwd = op_nodes(&model.head.backward);
    ctx.steps(
        &model.head.backward,
        &all_head_bwd,
        &head_bwd,
        Some(&head_fwd),
        Phase::Backward,
        "head ∂",
    );
    ctx.param_grads(&model.head.backward, &head_bwd, &grads, "head ∂");
    let mut bwd = Vec::with_capacity(model.functions.len());
    for (f, func) in model.functions.iter().enumerate() {
        let rows = &s.functions[f];
        bwd.push(graph_tensors(
            ctx.t,
            &func.backward,
            Some(&fwd[f]),
            rows.rows(),
            rows.edges(),
            &format!("∂F {}", func.name),
            TensorKind::Gradient,
        ));
    }
    let head_grad: Vec<TensorId> = model
        .head
        .backward
        .output(Role::HeadInputGrad)
        .and_then(|o| head_bwd.0[o.node])
        .into_iter()
        .collect();
    let push_grads: Vec<TensorId> = model
        .functions
        .iter()
        .zip(&bwd)
        .flat_map(|(func, own)| {
            input_tensors(&func.backward, own, |src| {
                matches!(src, Source::OutputGrad(_))
            })
        })
        .collect();
    ctx.t
        .op("push gradients", Phase::Backward, &head_grad, &push_grads);
    for (f, func) in model.functions.iter().enumerate() {
        ctx.steps(
            &func.backward,
            &func.backward_plan.eager,
            &bwd[f],
            Some(&fwd[f]),
            Phase::Backward,
            &format!("∂F {} eager", func.name),
        );
    }
    for (i, task) in s.tasks.iter().enumerate().rev() {
        let func = &model.functions[task.function];
        let (own, fwd_f) = (&bwd[task.function], &fwd[task.function]);
        let scatter_grad = func.output_grad_node(Role::Scatter).and_then(|n| own.0[n]);
        if let Some(sg) = scatter_grad {
            ctx.t.op(
                format!("task {i} ∂scatter"),
                Phase::Backward,
                &[state_grad],
                &[sg],
            );
        }
        ctx.steps(
            &func.backward,
            &func.backward_plan.per_task,
            own,
            Some(fwd_f),
            Phase::Backward,
            &format!("task {i} ∂"),
        );
        let child_grads: Vec<TensorId> = func
            .backward
            .outputs
            .iter()
            .filter(|o| matches!(o.role, Role::ChildGrad(_) | Role::ChildGradAll))
            .filter_map(|o| resolve(&func.backward, o.node, own, Some(fwd_f)))
            .collect();
        if !child_grads.is_empty() {
            ctx.t.op(
                format!("task {i} ∂gather"),
                Phase::Backward,
                &child_grads,
                &[state_grad],
            );
        }
    }
    for (f, func) in model.functions.iter().enumerate() {
        ctx.steps(
            &func.backward,
            &func.backward_plan.lazy,
            &bwd[f],
            Some(&fwd[f]),
            Phase::Backward,
            &format!("∂F {} lazy", func.name),
        );
        ctx.param_grads(
            &func.backward,
            &bwd[f],
            &grads,
            &format!("∂F {}", func.name),
        );
    }
    // optimizer
    for (p, spec) in model.params.iter().enumerate() {
        let mut reads = vec![params[p], grads[p]];
        reads.extend(&states[p]);
        let mut writes = vec![params[p]];
        writes.extend(&states[p]);
        ctx.t.op(
            format!("update {}", spec.name),
            Phase::Optimizer,
            &reads,
            &writes,
        );
    }
    t.build()
        .map_err(|e| ExecError::Input(format!("memory trace of model `{}`: {e}", model.name)))
}

fn numel(shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64
}

fn op_nodes(g: &Graph) -> Vec<NodeId> {
    (0..g.nodes.len())
        .filter(|&n| matches!(g.nodes[n].kind, NodeKind::Op(_)))
        .collect()
}

/// One tensor per node of `g` that has a buffer of its own.
fn graph_tensors(
    t: &mut TraceBuilder,
    g: &Graph,
    forward: Option<&GraphTensors>,
    rows: usize,
    edges: usize,
    label: &str,
    kind: TensorKind,
) -> GraphTensors {
    let ids = g
        .nodes
        .iter()
        .enumerate()
        .map(|(n, node)| match node.kind {
            NodeKind::Param(_) => None,
            NodeKind::Input(Source::Forward(m)) => {
                forward.and_then(|f| f.0.get(m).copied().flatten())
            }
            _ => {
                let count = match node.ty.space {
                    Space::Vertex => rows,
                    Space::Edge => edges,
                    Space::Static => 1,
                } as u64;
                Some(t.tensor(
                    format!("{label} %{n}"),
                    count * node.ty.width() as u64 * ELEMENT,
                    kind,
                ))
            }
        })
        .collect();
    GraphTensors(ids)
}

/// The tensor holding node `n`'s value.
fn resolve(
    g: &Graph,
    n: NodeId,
    own: &GraphTensors,
    fwd: Option<&GraphTensors>,
) -> Option<TensorId> {
    match g.nodes[n].kind {
        NodeKind::Input(Source::Forward(m)) => fwd.and_then(|f| f.0.get(m).copied().flatten()),
        _ => own.0[n],
    }
}

/// Tensors of `g`'s input nodes whose source matches.
fn input_tensors(g: &Graph, own: &GraphTensors, wanted: impl Fn(Source) -> bool) -> Vec<TensorId> {
    g.nodes
        .iter()
        .enumerate()
        .filter_map(|(n, node)| match node.kind {
            NodeKind::Input(src) if wanted(src) => own.0[n],
            _ => None,
        })
        .collect()
}

/// Appends ops to the trace.
struct Ops<'a> {
    t: &'a mut TraceBuilder,
    params: &'a [TensorId],
}

impl Ops<'_> {
    /// One trace op per op node of `nodes`.
    fn steps(
        &mut self,
        g: &Graph,
        nodes: &[NodeId],
        own: &GraphTensors,
        fwd: Option<&GraphTensors>,
        phase: Phase,
        label: &str,
    ) {
        for &n in nodes {
            let Some(op) = g.nodes[n].op() else { continue };
            let reads: Vec<TensorId> = g.nodes[n]
                .inputs
                .iter()
                .filter_map(|&i| match g.nodes[i].kind {
                    NodeKind::Param(p) => self.params.get(p).copied(),
                    _ => resolve(g, i, own, fwd),
                })
                .collect();
            let writes: Vec<TensorId> = own.0[n].into_iter().collect();
            self.t.op(
                format!("{label} %{n} {}", op.signature()),
                phase,
                &reads,
                &writes,
            );
        }
    }

    /// The accumulation of a backward graph's parameter gradients.
    fn param_grads(&mut self, g: &Graph, own: &GraphTensors, grads: &[TensorId], label: &str) {
        for o in &g.outputs {
            if let Role::ParamGrad(p) | Role::ParamRowGrad(p) = o.role {
                let src: Vec<TensorId> = resolve(g, o.node, own, None).into_iter().collect();
                if let Some(&dst) = grads.get(p) {
                    self.t.op(
                        format!("{label} accumulate grad {p}"),
                        Phase::Backward,
                        &src,
                        &[dst],
                    );
                }
            }
        }
    }
}
