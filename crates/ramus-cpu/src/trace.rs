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
use ramus_graph::Schedule;

/// Bytes per element of every engine buffer (f32 values and u32 indices).
const ELEMENT: u64 = 4;

/// Tensors of one graph instance, by node (`None` for nodes without a
/// buffer of their own: parameters, and a backward graph's forward reads).
struct GraphTensors(Vec<Option<TensorId>>);

/// Builds the trace; see the module docs. `optimizer_states` is the
/// number of parameter-sized state tensors the optimizer keeps (0 for SGD,
/// 1 for Adagrad, 2 for Adam).
pub fn training_trace(model: &Model, batch: &Batch<'_>, optimizer_states: usize) -> Result<Trace> {
    let mut it = Iteration::new(model, &batch.schedule, optimizer_states);
    let (fwd, head_fwd) = it.forward_tensors();
    it.forward(&fwd, &head_fwd);
    let head_bwd = it.head_backward(&head_fwd);
    let bwd = it.backward_tensors(&fwd);
    it.push_grads(&head_bwd, &bwd);
    it.backward(&fwd, &bwd);
    it.optimizer();
    it.t.build()
        .map_err(|e| ExecError::Input(format!("memory trace of model `{}`: {e}", model.name)))
}

/// The trace being built, with the tensors every step may touch: the
/// persistent ones and the vertex-state buffers.
struct Iteration<'a> {
    model: &'a Model,
    s: &'a Schedule,
    t: TraceBuilder,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    /// Per parameter, its optimizer state tensors.
    states: Vec<Vec<TensorId>>,
    state: TensorId,
    state_grad: TensorId,
    head_rows: usize,
}

impl<'a> Iteration<'a> {
    /// The persistent tensors (parameters, gradients, optimizer state) and
    /// the vertex-state buffers, in that order.
    fn new(model: &'a Model, s: &'a Schedule, optimizer_states: usize) -> Self {
        let mut t = TraceBuilder::new();
        let mut persistent = |what: &str, kind| -> Vec<TensorId> {
            model
                .params
                .iter()
                .map(|p| {
                    t.tensor(
                        format!("{what} {}", p.name),
                        numel(&p.shape) * ELEMENT,
                        kind,
                    )
                })
                .collect()
        };
        let params = persistent("param", TensorKind::Parameter);
        let grads = persistent("grad", TensorKind::Gradient);
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
        Iteration {
            model,
            s,
            t,
            params,
            grads,
            states,
            state,
            state_grad,
            head_rows,
        }
    }

    /// The forward graphs' tensors: each function's, then the head's.
    fn forward_tensors(&mut self) -> (Vec<GraphTensors>, GraphTensors) {
        let model = self.model;
        let mut fwd = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let rows = &self.s.functions[f];
            fwd.push(graph_tensors(
                &mut self.t,
                &func.forward,
                None,
                rows.rows(),
                rows.edges(),
                &format!("F {}", func.name),
                TensorKind::Activation,
            ));
        }
        let head_fwd = graph_tensors(
            &mut self.t,
            &model.head.forward,
            None,
            self.head_rows,
            0,
            "head",
            TensorKind::Activation,
        );
        (fwd, head_fwd)
    }

    /// The forward pass: eager steps, per task the gather, the task's ops
    /// and the scatter, the lazy steps, the head input and the head.
    fn forward(&mut self, fwd: &[GraphTensors], head_fwd: &GraphTensors) {
        let (model, s) = (self.model, self.s);
        for (f, func) in model.functions.iter().enumerate() {
            let label = format!("F {} eager", func.name);
            let plan = &func.forward_plan;
            self.steps(
                &func.forward,
                &plan.eager,
                &fwd[f],
                None,
                Phase::Forward,
                &label,
            );
        }
        for (i, task) in s.tasks.iter().enumerate() {
            let func = &model.functions[task.function];
            let own = &fwd[task.function];
            let gathered = input_tensors(&func.forward, own, |src| {
                matches!(src, Source::Gather(_) | Source::GatherAll)
            });
            if !gathered.is_empty() {
                let name = format!("task {i} gather");
                self.t.op(name, Phase::Forward, &[self.state], &gathered);
            }
            let (plan, label) = (&func.forward_plan.per_task, format!("task {i}"));
            self.steps(&func.forward, plan, own, None, Phase::Forward, &label);
            if let Some(sc) = func.scatter.and_then(|n| own.0[n]) {
                let name = format!("task {i} scatter");
                self.t.op(name, Phase::Forward, &[sc], &[self.state]);
            }
        }
        for (f, func) in model.functions.iter().enumerate() {
            let label = format!("F {} lazy", func.name);
            let plan = &func.forward_plan;
            self.steps(
                &func.forward,
                &plan.lazy,
                &fwd[f],
                None,
                Phase::Forward,
                &label,
            );
        }
        let pushed: Vec<TensorId> = model
            .functions
            .iter()
            .zip(fwd)
            .filter_map(|(func, own)| func.push.and_then(|n| own.0[n]))
            .collect();
        let head_in = input_tensors(&model.head.forward, head_fwd, |src| {
            src == Source::HeadInput
        });
        self.t.op("head input", Phase::Forward, &pushed, &head_in);
        let all_head: Vec<NodeId> = op_nodes(&model.head.forward);
        let head = &model.head.forward;
        self.steps(head, &all_head, head_fwd, None, Phase::Forward, "head");
    }

    /// The head's backward graph: its tensors, steps and parameter
    /// gradients.
    fn head_backward(&mut self, head_fwd: &GraphTensors) -> GraphTensors {
        let g = &self.model.head.backward;
        let head_bwd = graph_tensors(
            &mut self.t,
            g,
            Some(head_fwd),
            self.head_rows,
            0,
            "head ∂",
            TensorKind::Gradient,
        );
        let all_head_bwd = op_nodes(g);
        let fwd = Some(head_fwd);
        self.steps(g, &all_head_bwd, &head_bwd, fwd, Phase::Backward, "head ∂");
        self.param_grads(g, &head_bwd, "head ∂");
        head_bwd
    }

    /// Each function's backward graph's tensors.
    fn backward_tensors(&mut self, fwd: &[GraphTensors]) -> Vec<GraphTensors> {
        let model = self.model;
        let mut bwd = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let rows = &self.s.functions[f];
            bwd.push(graph_tensors(
                &mut self.t,
                &func.backward,
                Some(&fwd[f]),
                rows.rows(),
                rows.edges(),
                &format!("∂F {}", func.name),
                TensorKind::Gradient,
            ));
        }
        bwd
    }

    /// The head input's gradient pushed into every function's backward.
    fn push_grads(&mut self, head_bwd: &GraphTensors, bwd: &[GraphTensors]) {
        let model = self.model;
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
            .zip(bwd)
            .flat_map(|(func, own)| {
                input_tensors(&func.backward, own, |src| {
                    matches!(src, Source::OutputGrad(_))
                })
            })
            .collect();
        self.t
            .op("push gradients", Phase::Backward, &head_grad, &push_grads);
    }

    /// The functions' backward passes: eager steps, per task in reverse the
    /// scattered state's gradient, the task's ops and the children's
    /// gradients, then the lazy steps and the parameter gradients.
    fn backward(&mut self, fwd: &[GraphTensors], bwd: &[GraphTensors]) {
        let (model, s) = (self.model, self.s);
        for (f, func) in model.functions.iter().enumerate() {
            let label = format!("∂F {} eager", func.name);
            let (g, plan, fwd_f) = (&func.backward, &func.backward_plan.eager, Some(&fwd[f]));
            self.steps(g, plan, &bwd[f], fwd_f, Phase::Backward, &label);
        }
        for (i, task) in s.tasks.iter().enumerate().rev() {
            let func = &model.functions[task.function];
            let (own, fwd_f) = (&bwd[task.function], &fwd[task.function]);
            let scatter_grad = func.output_grad_node(Role::Scatter).and_then(|n| own.0[n]);
            if let Some(sg) = scatter_grad {
                let name = format!("task {i} ∂scatter");
                self.t.op(name, Phase::Backward, &[self.state_grad], &[sg]);
            }
            let (plan, label) = (&func.backward_plan.per_task, format!("task {i} ∂"));
            self.steps(
                &func.backward,
                plan,
                own,
                Some(fwd_f),
                Phase::Backward,
                &label,
            );
            let child_grads: Vec<TensorId> = func
                .backward
                .outputs
                .iter()
                .filter(|o| matches!(o.role, Role::ChildGrad(_) | Role::ChildGradAll))
                .filter_map(|o| resolve(&func.backward, o.node, own, Some(fwd_f)))
                .collect();
            if !child_grads.is_empty() {
                let name = format!("task {i} ∂gather");
                self.t
                    .op(name, Phase::Backward, &child_grads, &[self.state_grad]);
            }
        }
        for (f, func) in model.functions.iter().enumerate() {
            let label = format!("∂F {} lazy", func.name);
            let (g, plan, fwd_f) = (&func.backward, &func.backward_plan.lazy, Some(&fwd[f]));
            self.steps(g, plan, &bwd[f], fwd_f, Phase::Backward, &label);
            self.param_grads(g, &bwd[f], &format!("∂F {}", func.name));
        }
    }

    /// One optimizer step per parameter.
    fn optimizer(&mut self) {
        for (p, spec) in self.model.params.iter().enumerate() {
            let mut reads = vec![self.params[p], self.grads[p]];
            reads.extend(&self.states[p]);
            let mut writes = vec![self.params[p]];
            writes.extend(&self.states[p]);
            self.t.op(
                format!("update {}", spec.name),
                Phase::Optimizer,
                &reads,
                &writes,
            );
        }
    }

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
    fn param_grads(&mut self, g: &Graph, own: &GraphTensors, label: &str) {
        for o in &g.outputs {
            if let Role::ParamGrad(p) | Role::ParamRowGrad(p) = o.role {
                let src: Vec<TensorId> = resolve(g, o.node, own, None).into_iter().collect();
                if let Some(&dst) = self.grads.get(p) {
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
