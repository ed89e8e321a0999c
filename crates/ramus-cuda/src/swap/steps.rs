//! The ops and tensors of one static-graph training iteration, in the order
//! the CUDA engine's swap path runs them — built without a device from the
//! same planned program (fusion, views, steps) the engine launches, so the
//! trace the planner sees and the ops the executor runs are one list.
//!
//! A tensor is every buffer the engine gives a node of a graph (forward and
//! backward of each vertex function, the head and its backward): each
//! materialized node, sized for the batch's rows, rounded up to the pool's
//! alignment as the pool allocates it. Parameters, their gradients and the
//! optimizer's state are persistent tensors (the engine's own buffers).
//! Index inputs (tokens, labels) and empty buffers are no tensors: they
//! live in the batch arena with the rest of the per-batch overhead.
//!
//! The ops, on one compute stream:
//!
//! 1. every function's eager steps, then its lazy ones (per-task steps, and
//!    with them gathers and scatters, make a model dynamic: built by the
//!    `dynamic` module instead, one tensor per node and segment of rows);
//! 2. the head input (pushed rows of every function), the head's steps and
//!    an asynchronous copy of the loss to the host;
//! 3. zeroing the parameter gradients; the head's backward steps and the
//!    accumulation of its parameter gradients; the head input's gradient
//!    pushed into every function's backward; every function's backward
//!    eager and lazy steps, each parameter gradient accumulated right after
//!    the step that completes it (so it does not live to the end of the
//!    pass) where that parameter has no other gradient to add;
//! 4. one fused optimizer step over every parameter.
//!
//! Ops that only produce a tensor from the host — the pulled inputs (the
//! images), dropout masks (drawn on the host in the plain engine's order at
//! the start of the step), and the seeds of the output gradients — run
//! right before the first op that uses their tensor, so the tensor is not
//! live longer than needed.

mod dynamic;

pub(crate) use dynamic::{build as build_dynamic, check_dynamic};

mod builder;
mod types;

pub(crate) use types::{
    GraphRef, Home, Kind, Piece, Rows, Segment, Shape, SwapOp, SwapProgram, Words,
};

use ramus_core::graph::{NodeId, NodeKind, Role, Source};
use ramus_core::{HeadRows, Model};
use ramus_exec::OptimizerKind;
use ramus_graph::Schedule;
use ramus_swap::Phase;

use crate::engine::cnn_workspace_floats;
use crate::error::Result;
use crate::program::{PlannedStep, Program, EAGER, LAZY, PER_TASK};
use builder::{step_cost, step_nodes, unsupported, Builder};

/// Checks that `model` is a static-graph model the swap path runs.
pub(crate) fn check_static(model: &Model, program: &Program) -> Result<()> {
    for (f, func) in model.functions.iter().enumerate() {
        let (fwd, bwd) = &program.functions[f];
        if !fwd.phases[PER_TASK].is_empty() || !bwd.phases[PER_TASK].is_empty() {
            return Err(unsupported(
                model,
                format!("has per-task steps in function `{}`", func.name),
            ));
        }
        if func.scatter.is_some() || func.gather_arity > 0 {
            return Err(unsupported(
                model,
                format!("gathers or scatters vertex states in `{}`", func.name),
            ));
        }
        for g in [&func.forward, &func.backward] {
            for node in &g.nodes {
                if let NodeKind::Input(Source::Gather(_) | Source::GatherAll) = node.kind {
                    return Err(unsupported(
                        model,
                        format!("gathers children in `{}`", func.name),
                    ));
                }
            }
        }
    }
    if !program.row_grad_params.is_empty() {
        return Err(unsupported(
            model,
            "has row-gradient (embedding) tables".into(),
        ));
    }
    Ok(())
}

/// Parameter-sized optimizer state tensors per parameter.
pub(crate) fn optimizer_states(kind: OptimizerKind) -> usize {
    match kind {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam => 2,
    }
}

/// Builds the iteration of `kind` of `model` (whose planned or compiled
/// program is `program`) on batches of `shape`; convolutions chunk their
/// columns at `conv_workspace` floats. An iteration that does not train has
/// only the forward ops (masks filled with ones), the loss unless
/// inferring, and the scores.
pub(crate) fn build(
    model: &Model,
    program: &Program,
    shape: &Shape,
    kind: Kind,
    conv_workspace: usize,
) -> Result<SwapProgram> {
    check_static(model, program)?;
    let nf = model.functions.len();
    let training = kind.training();
    let mut b = Builder::new(model, program, shape, kind, conv_workspace);
    b.persistent_tensors();
    let graphs: Vec<GraphRef> = (0..nf)
        .flat_map(|f| [GraphRef::Forward(f), GraphRef::Backward(f)])
        .chain([GraphRef::Head, GraphRef::HeadBackward])
        .filter(|g| training || g.forward().is_none())
        .collect();
    for &g in &graphs {
        b.graph_tensors(g);
    }
    let masks = b.static_producers(&graphs)?;
    // forward
    for f in 0..nf {
        b.steps(GraphRef::Forward(f), EAGER, Phase::Forward)?;
    }
    for f in 0..nf {
        b.steps(GraphRef::Forward(f), LAZY, Phase::Forward)?;
    }
    let head = &model.head;
    let head_input = match head.forward.input_node(Source::HeadInput) {
        Some(n) => b.resolve_all(GraphRef::Head, &[n])?,
        None => Vec::new(),
    };
    let mut pushed = Vec::new();
    for (f, func) in model.functions.iter().enumerate() {
        if shape.head_rows_of[f] == 0 {
            continue;
        }
        if let Some(p) = func.push {
            pushed.extend(b.resolve_all(GraphRef::Forward(f), &[p])?);
        }
    }
    b.emit(
        SwapOp::HeadInput,
        "head input".into(),
        Phase::Forward,
        &pushed,
        &head_input,
    );
    if !b.head_outputs(kind)? {
        return b.finish(masks);
    }
    b.static_backward()?;
    b.optimizer_step();
    b.finish(masks)
}

// The static builder's own steps, and the steps of a graph's phase both
// builders emit (see the note at `impl Shape` below).
impl Builder<'_> {
    /// Host-only producers of the forward pass: pulled inputs and masks, the
    /// masks drawn in the plain engine's order (functions, then the head).
    /// Returns the masks in draw order.
    fn static_producers(
        &mut self,
        graphs: &[GraphRef],
    ) -> Result<Vec<(GraphRef, NodeId, usize, u16)>> {
        let training = self.kind.training();
        let mut masks = Vec::new();
        for &graph in graphs.iter().filter(|g| g.forward().is_none()) {
            let g = graph.graph(self.model);
            for (n, node) in g.nodes.iter().enumerate() {
                let Some(t) = self.resolve(graph, n)? else {
                    continue;
                };
                match node.kind {
                    NodeKind::Input(Source::Pull) => {
                        if let Some(f) = graph.function() {
                            let name =
                                format!("upload {} %{n} (pulled inputs)", graph.label(self.model));
                            self.producer(
                                t,
                                SwapOp::UploadPull {
                                    f,
                                    node: n,
                                    rows: Rows::All,
                                },
                                name,
                            );
                        }
                    }
                    NodeKind::Input(Source::DropoutMask { rate, .. }) if training => {
                        let len = self.homes[t.index()].map_or(0, |h| h.len);
                        let name =
                            format!("upload {} %{n} (dropout mask)", graph.label(self.model));
                        let op = SwapOp::UploadMask {
                            mask: masks.len(),
                            rows: Rows::All,
                        };
                        self.producer(t, op, name);
                        masks.push((graph, n, len, rate));
                    }
                    NodeKind::Input(Source::DropoutMask { .. }) => {
                        let name =
                            format!("fill {} %{n} (dropout mask) = 1", graph.label(self.model));
                        let op = SwapOp::Seed {
                            graph,
                            node: n,
                            value: 1.0,
                        };
                        self.producer(t, op, name);
                    }
                    _ => {}
                }
            }
        }
        Ok(masks)
    }

    /// The backward pass of a static-graph model: the head's backward, the
    /// pushed gradients, every function's backward steps and the
    /// accumulation of the parameter gradients.
    fn static_backward(&mut self) -> Result<()> {
        let model = self.model;
        let nf = model.functions.len();
        let head = &model.head;
        let backward: Vec<GraphRef> = (0..nf).map(GraphRef::Backward).collect();
        self.plan_early_accumulations(&backward, &[EAGER, LAZY])?;
        self.seeds(GraphRef::HeadBackward, &head.forward)?;
        self.steps(GraphRef::HeadBackward, 0, Phase::Backward)?;
        self.accumulate(GraphRef::HeadBackward, Rows::All)?;
        for (f, func) in model.functions.iter().enumerate() {
            self.seeds(GraphRef::Backward(f), &func.forward)?;
        }
        let head_grad = match head.backward.output(Role::HeadInputGrad) {
            Some(o) => self.resolve_all(GraphRef::HeadBackward, &[o.node])?,
            None => Vec::new(),
        };
        let mut push_grads = Vec::new();
        for (f, func) in model.functions.iter().enumerate() {
            if let Some(n) = func.output_grad_node(Role::Push) {
                push_grads.extend(self.resolve_all(GraphRef::Backward(f), &[n])?);
            }
        }
        if !head_grad.is_empty() {
            let mut reads = head_grad;
            reads.extend(&push_grads);
            self.emit(
                SwapOp::PushGrads,
                "push gradients".into(),
                Phase::Backward,
                &reads,
                &push_grads,
            );
        }
        for f in 0..nf {
            self.steps(GraphRef::Backward(f), EAGER, Phase::Backward)?;
        }
        for f in 0..nf {
            self.steps(GraphRef::Backward(f), LAZY, Phase::Backward)?;
            self.accumulate(GraphRef::Backward(f), Rows::All)?;
        }
        Ok(())
    }

    /// The steps of `phase` of `graph` over every row.
    pub(super) fn steps(&mut self, graph: GraphRef, phase: usize, op_phase: Phase) -> Result<()> {
        let rows = match graph.function() {
            Some(f) => self.shape.rows[f],
            None => self.shape.head_rows,
        };
        self.steps_over(graph, phase, op_phase, Rows::All, rows)
    }

    /// The steps of `phase` of `graph` over `rows` (`count` of them).
    pub(super) fn steps_over(
        &mut self,
        graph: GraphRef,
        phase: usize,
        op_phase: Phase,
        rows: Rows,
        count: usize,
    ) -> Result<()> {
        let g = graph.graph(self.model);
        let prog = graph.program(self.program, self.kind);
        let label = match rows {
            Rows::All => graph.label(self.model),
            Rows::Segment(s) => format!("{} segment {s}", graph.label(self.model)),
            Rows::Piece(p) => match self.pieces.get(p) {
                Some(piece) => format!(
                    "{} task {} rows {}..{}",
                    graph.label(self.model),
                    piece.task,
                    piece.r0,
                    piece.r1
                ),
                None => format!("{} piece {p}", graph.label(self.model)),
            },
        };
        for (index, step) in prog.phases[phase].iter().enumerate() {
            if let PlannedStep::Op(n) = &step.step {
                if let NodeKind::Op(op) = &g.nodes[*n].kind {
                    self.workspace_floats = self.workspace_floats.max(cnn_workspace_floats(
                        op,
                        count,
                        self.conv_workspace,
                    ));
                }
            }
            let (reads, writes, name) = step_nodes(g, &step.step, &label);
            self.step_cost = Some(step_cost(g, &step.step, count));
            let reads = self.resolve_all(graph, &reads)?;
            let writes = self.resolve_all(graph, &writes)?;
            self.emit(
                SwapOp::Step {
                    graph,
                    phase,
                    index,
                    rows,
                },
                name,
                op_phase,
                &reads,
                &writes,
            );
            if let Some(outputs) = self.early.remove(&(graph, phase, index)) {
                for output in outputs {
                    self.accumulate_output(graph, output, Rows::All)?;
                }
            }
        }
        Ok(())
    }
}

// Here, not in `types`, with the steps below: they ask the engine (which
// vertices the head reads, the convolution workspace), so `types` and
// `builder` stay out of the engine <-> swap import cycle.
impl Shape {
    /// The shape of batch `s` with the head on `rows`.
    pub(crate) fn of(model: &Model, s: &Schedule, rows: HeadRows) -> Shape {
        let head: Vec<u32> = crate::batch::head_vertices(rows, s);
        let mut head_rows_of = vec![0; model.functions.len()];
        for &v in &head {
            if let Some(n) = head_rows_of.get_mut(s.vertex_function[v as usize] as usize) {
                *n += 1;
            }
        }
        Shape {
            rows: s.functions.iter().map(|f| f.rows()).collect(),
            edges: s.functions.iter().map(|f| f.edges()).collect(),
            head_rows: head.len(),
            head_rows_of,
        }
    }
}
