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

use std::collections::{HashMap, HashSet};

use ramus_core::graph::{DType, Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::op::OpDef;
use ramus_core::{HeadRows, Model};
use ramus_exec::OptimizerKind;
use ramus_graph::Schedule;
use ramus_swap::{Phase, TensorId, TensorKind, Trace, TraceBuilder};

use crate::engine::cnn_workspace_floats;
use crate::error::{CudaError, Result};
use crate::offset_allocator::aligned_size;
use crate::program::{
    GraphProgram, PlannedStep, Program, EAGER, HEAD_ALL, HEAD_SCORES, LAZY, PER_TASK,
};

/// A graph of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GraphRef {
    /// Vertex function `f`'s forward graph.
    Forward(usize),
    /// Vertex function `f`'s backward graph.
    Backward(usize),
    /// The head.
    Head,
    /// The head's backward graph.
    HeadBackward,
}

impl GraphRef {
    /// Position in per-graph arrays: `2f`, `2f + 1`, then the head's two.
    pub(crate) fn index(self, functions: usize) -> usize {
        match self {
            GraphRef::Forward(f) => 2 * f,
            GraphRef::Backward(f) => 2 * f + 1,
            GraphRef::Head => 2 * functions,
            GraphRef::HeadBackward => 2 * functions + 1,
        }
    }

    /// The graph itself.
    pub(crate) fn graph(self, model: &Model) -> &Graph {
        match self {
            GraphRef::Forward(f) => &model.functions[f].forward,
            GraphRef::Backward(f) => &model.functions[f].backward,
            GraphRef::Head => &model.head.forward,
            GraphRef::HeadBackward => &model.head.backward,
        }
    }

    /// Its program for an iteration of `kind` (training keeps the values
    /// the backward graphs read; evaluation and inference keep fewer).
    pub(crate) fn program(self, program: &Program, kind: Kind) -> &GraphProgram {
        match (self, kind) {
            (GraphRef::Forward(f), Kind::Train { .. }) => &program.functions[f].0,
            (GraphRef::Forward(f), _) => &program.infer_functions[f],
            (GraphRef::Backward(f), _) => &program.functions[f].1,
            (GraphRef::Head, Kind::Train { .. }) => &program.head_forward,
            (GraphRef::Head, _) => &program.head_forward_infer,
            (GraphRef::HeadBackward, _) => &program.head_backward,
        }
    }

    /// The forward graph whose values a backward graph reads.
    pub(crate) fn forward(self) -> Option<GraphRef> {
        match self {
            GraphRef::Backward(f) => Some(GraphRef::Forward(f)),
            GraphRef::HeadBackward => Some(GraphRef::Head),
            _ => None,
        }
    }

    /// The vertex function whose rows (and topology) the graph runs over.
    pub(crate) fn function(self) -> Option<usize> {
        match self {
            GraphRef::Forward(f) | GraphRef::Backward(f) => Some(f),
            _ => None,
        }
    }

    fn label(self, model: &Model) -> String {
        match self {
            GraphRef::Forward(f) => format!("F {}", model.functions[f].name),
            GraphRef::Backward(f) => format!("∂F {}", model.functions[f].name),
            GraphRef::Head => "head".into(),
            GraphRef::HeadBackward => "head ∂".into(),
        }
    }
}

/// What an iteration computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// Forward, backward and the optimizer step, with this many
    /// parameter-sized optimizer state tensors per parameter.
    Train { states: usize },
    /// The forward pass with the loss (and scores).
    Evaluate,
    /// The forward pass up to the scores.
    Infer,
}

impl Kind {
    fn training(self) -> bool {
        matches!(self, Kind::Train { .. })
    }
}

/// The rows an op runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Rows {
    /// Every row of the graph (static-graph models, the head).
    All,
    /// The rows of segment `.0` of [`SwapProgram::segments`] (dynamic
    /// models: eager and lazy steps, uploads, accumulations).
    Segment(usize),
    /// The rows of piece `.0` of [`SwapProgram::pieces`] (dynamic models:
    /// per-task steps on a batching task, or on part of a large one).
    Piece(usize),
}

/// A batching task's rows, or a run of the rows of a large one (its rows
/// are independent of each other): what a dynamic model's per-task steps
/// run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Piece {
    /// The schedule's task.
    pub task: usize,
    pub r0: usize,
    pub r1: usize,
    pub e0: usize,
    pub e1: usize,
}

impl Piece {
    pub(crate) fn range(&self) -> ramus_exec::Range {
        ramus_exec::Range {
            r0: self.r0,
            r1: self.r1,
            e0: self.e0,
            e1: self.e1,
        }
    }
}

/// Consecutive pieces of batching tasks of one vertex function whose rows
/// (and edges) are contiguous: the unit in which a dynamic model's node
/// buffers become tensors (see the `dynamic` module).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Segment {
    pub function: usize,
    /// Its pieces `pieces.start..pieces.end` of [`SwapProgram::pieces`].
    pub pieces: std::ops::Range<usize>,
    /// Function rows `r0..r1` and edges `e0..e1`.
    pub r0: usize,
    pub r1: usize,
    pub e0: usize,
    pub e1: usize,
}

impl Segment {
    pub(crate) fn range(&self) -> ramus_exec::Range {
        ramus_exec::Range {
            r0: self.r0,
            r1: self.r1,
            e0: self.e0,
            e1: self.e1,
        }
    }
}

/// A run of index words in [`SwapProgram::indices`]: `offset..offset + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Words {
    pub offset: usize,
    pub len: usize,
}

/// One row move between two tensors' own memory (rows counted from each
/// tensor's first row; `NONE` rows as in [`crate::launch::RowMove`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MoveSpec {
    pub dst: TensorId,
    /// `None`: zeros (every source row is `NONE`).
    pub src: Option<TensorId>,
    pub dst_rows: Option<Words>,
    pub src_rows: Option<Words>,
    pub rows: usize,
    pub width: usize,
    pub accumulate: bool,
}

/// One op of the iteration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum SwapOp {
    /// Copy function `f`'s pulled inputs (the images) of `rows` from the host.
    UploadPull { f: usize, node: NodeId, rows: Rows },
    /// Copy `rows` of dropout mask `mask` (drawn at the start of the step)
    /// from the host.
    UploadMask { mask: usize, rows: Rows },
    /// A planned step of a graph's phase over `rows`.
    Step {
        graph: GraphRef,
        phase: usize,
        index: usize,
        rows: Rows,
    },
    /// Gather every function's pushed rows into the head input.
    HeadInput,
    /// Copy the loss to the host (asynchronously; read at the end).
    ReadLoss,
    /// Copy the scores to the host (asynchronously; read at the end).
    ReadLogits,
    /// Zero every parameter gradient.
    ZeroGrads,
    /// Fill an output-gradient input of a backward graph (1 for the loss),
    /// or a dropout mask with ones when not training.
    Seed {
        graph: GraphRef,
        node: NodeId,
        value: f32,
    },
    /// Add the head input's gradient into every function's pushed gradient.
    PushGrads,
    /// Add output `output` (a parameter gradient, or an embedding table's
    /// row gradient) of a backward graph over `rows` into the parameter's
    /// gradient.
    AccumulateGrad {
        graph: GraphRef,
        output: usize,
        rows: Rows,
    },
    /// Row moves [`SwapProgram::move_sets`]`[set]` in one launch (a dynamic
    /// model's gathers, child gradients, head input and pushed gradients).
    Moves { set: usize },
    /// The fused optimizer step.
    Optimizer,
}

/// Where a (non-persistent) tensor lives: a node of a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Home {
    pub graph: GraphRef,
    pub node: NodeId,
    pub dtype: DType,
    /// Elements.
    pub len: usize,
    /// Elements of the node's buffer before the tensor's first one: a
    /// dynamic model's segment tensor holds rows `r0..` of its node, and the
    /// engine addresses them by their row in the function (0 when the
    /// tensor is the whole buffer).
    pub at: usize,
}

/// The iteration: ops, tensors and the trace the planner reads.
#[derive(Clone, Debug)]
pub(crate) struct SwapProgram {
    pub ops: Vec<SwapOp>,
    /// Per trace tensor: its node, or `None` for persistent tensors.
    pub homes: Vec<Option<Home>>,
    /// Nodes whose buffer is empty (no tensor): they get an empty view.
    pub empty: Vec<(GraphRef, NodeId, DType)>,
    /// Dropout masks in draw order: graph, node, elements, rate (in 1e-4).
    pub masks: Vec<(GraphRef, NodeId, usize, u16)>,
    /// Floats of scratch memory the largest op needs.
    pub workspace_floats: usize,
    /// Per op, its estimated work: floating-point operations and bytes
    /// moved (the op registry's cost model; host copies count their bytes).
    pub costs: Vec<(f64, f64)>,
    pub kind: Kind,
    pub trace: Trace,
    /// Dynamic models: the segments their function tensors are cut into
    /// (empty for static-graph models: one tensor per node).
    pub segments: Vec<Segment>,
    /// Dynamic models: the pieces of tasks the segments are made of.
    pub pieces: Vec<Piece>,
    /// Row moves of the [`SwapOp::Moves`] ops.
    pub move_sets: Vec<Vec<MoveSpec>>,
    /// Index words of the moves, uploaded once per step.
    pub indices: Vec<u32>,
}

impl SwapProgram {
    /// A hash of what a plan depends on: tensor sizes and kinds, each op's
    /// reads and writes, the segments and the moves' shapes (not the index
    /// words, which change with the batch's topology while the plan holds).
    pub(crate) fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for t in self.trace.tensors() {
            t.bytes.hash(&mut h);
            t.kind.hash(&mut h);
        }
        for op in self.trace.ops() {
            op.reads.hash(&mut h);
            op.writes.hash(&mut h);
            op.phase.hash(&mut h);
        }
        self.segments.hash(&mut h);
        self.pieces.hash(&mut h);
        self.move_sets.hash(&mut h);
        h.finish()
    }

    /// Whether `other` runs the same ops on the same tensors (a plan made
    /// for one holds for the other), checked in full after fingerprints
    /// matched.
    pub(crate) fn same_structure(&self, other: &SwapProgram) -> bool {
        let (a, b) = (&self.trace, &other.trace);
        a.tensors() == b.tensors()
            && a.num_ops() == b.num_ops()
            && a.ops().iter().zip(b.ops()).all(|(x, y)| {
                x.reads == y.reads && x.writes == y.writes && x.phase == y.phase && x.name == y.name
            })
            && self.ops == other.ops
            && self.segments == other.segments
            && self.pieces == other.pieces
            && self.move_sets == other.move_sets
            && self.homes == other.homes
    }
}

/// Rows of each function and of the head for a batch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    pub rows: Vec<usize>,
    pub edges: Vec<usize>,
    pub head_rows: usize,
    /// Head rows served by each function.
    pub head_rows_of: Vec<usize>,
}

impl Shape {
    /// The shape of batch `s` with the head on `rows`.
    pub(crate) fn of(model: &Model, s: &Schedule, rows: HeadRows) -> Shape {
        let head: Vec<u32> = crate::engine::head_vertices(rows, s);
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

    fn count(&self, graph: GraphRef, space: Space) -> usize {
        match (graph.function(), space) {
            (_, Space::Static) => 1,
            (Some(f), Space::Vertex) => self.rows[f],
            (Some(f), Space::Edge) => self.edges[f],
            (None, _) => self.head_rows,
        }
    }
}

/// The segment key of tensors that are a node's whole buffer.
const WHOLE: usize = usize::MAX;

/// Bytes of a buffer of `len` 4-byte elements as the pool allocates it.
fn pool_bytes(len: usize) -> u64 {
    aligned_size(len as u64 * 4).unwrap_or(u64::MAX)
}

fn unsupported(model: &Model, what: String) -> CudaError {
    CudaError::Model(format!(
        "swap execution runs static-graph models (the CNNs: every step over all rows at \
         once); model `{}` {what}",
        model.name
    ))
}

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

struct Builder<'a> {
    model: &'a Model,
    program: &'a Program,
    kind: Kind,
    shape: &'a Shape,
    conv_workspace: usize,
    t: TraceBuilder,
    homes: Vec<Option<Home>>,
    /// Each node's tensor, by (graph, node, segment); [`WHOLE`] for the
    /// head and for static-graph models.
    own: HashMap<(GraphRef, NodeId, usize), TensorId>,
    /// Dynamic models: the segments, and the one function tensors resolve
    /// in now.
    segments: Vec<Segment>,
    pieces: Vec<Piece>,
    current: usize,
    move_sets: Vec<Vec<MoveSpec>>,
    indices: Vec<u32>,
    empty: Vec<(GraphRef, NodeId, DType)>,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    states: Vec<TensorId>,
    /// Host-only producers waiting for their tensor's first use.
    pending: HashMap<TensorId, (SwapOp, String)>,
    ops: Vec<SwapOp>,
    workspace_floats: usize,
    /// Parameter-gradient outputs accumulated right after a step: by
    /// (graph, phase, step index).
    early: HashMap<(GraphRef, usize, usize), Vec<usize>>,
    /// Outputs accumulated so far.
    accumulated: HashSet<(GraphRef, usize)>,
    /// Bytes of each tensor, and the estimated work of each op.
    sizes: Vec<u64>,
    costs: Vec<(f64, f64)>,
    /// The work of the step being emitted (other ops: their bytes).
    step_cost: Option<(f64, f64)>,
}

impl<'a> Builder<'a> {
    fn new(
        model: &'a Model,
        program: &'a Program,
        shape: &'a Shape,
        kind: Kind,
        conv_workspace: usize,
    ) -> Builder<'a> {
        Builder {
            model,
            program,
            kind,
            shape,
            conv_workspace,
            t: TraceBuilder::new(),
            homes: Vec::new(),
            own: HashMap::new(),
            segments: Vec::new(),
            pieces: Vec::new(),
            current: WHOLE,
            move_sets: Vec::new(),
            indices: Vec::new(),
            empty: Vec::new(),
            params: Vec::new(),
            grads: Vec::new(),
            states: Vec::new(),
            pending: HashMap::new(),
            ops: Vec::new(),
            workspace_floats: 0,
            early: HashMap::new(),
            accumulated: HashSet::new(),
            sizes: Vec::new(),
            costs: Vec::new(),
            step_cost: None,
        }
    }
}

impl Builder<'_> {
    /// The head's forward steps (scores only for inference), then reading
    /// the loss (not for inference) and, without training, the scores;
    /// when training, zeroing the gradients before the backward pass.
    /// Returns whether a backward pass follows.
    fn head_outputs(&mut self, kind: Kind) -> Result<bool> {
        let head = &self.model.head;
        let head_phase = if kind == Kind::Infer {
            HEAD_SCORES
        } else {
            HEAD_ALL
        };
        self.steps(GraphRef::Head, head_phase, Phase::Forward)?;
        if kind != Kind::Infer {
            let loss = self.resolve_all(GraphRef::Head, &[head.loss])?;
            self.emit(
                SwapOp::ReadLoss,
                "read loss".into(),
                Phase::Forward,
                &loss,
                &[],
            );
        }
        if !kind.training() {
            if let Some(l) = head.logits {
                let logits = self.resolve_all(GraphRef::Head, &[l])?;
                self.emit(
                    SwapOp::ReadLogits,
                    "read scores".into(),
                    Phase::Forward,
                    &logits,
                    &[],
                );
            }
            return Ok(false);
        }
        let grads = self.grads.clone();
        self.emit(
            SwapOp::ZeroGrads,
            "zero gradients".into(),
            Phase::Backward,
            &[],
            &grads,
        );
        Ok(true)
    }

    /// The parameters, and when training their gradients and the
    /// optimizer's state.
    fn persistent_tensors(&mut self) {
        let model = self.model;
        let training = self.kind.training();
        let states = match self.kind {
            Kind::Train { states } => states,
            _ => 0,
        };
        for p in &model.params {
            let bytes = pool_bytes(p.shape.iter().product());
            let id = self.tensor(
                format!("param {}", p.name),
                bytes,
                TensorKind::Parameter,
                None,
            );
            self.params.push(id);
        }
        for p in model.params.iter().filter(|_| training) {
            let bytes = pool_bytes(p.shape.iter().product());
            let id = self.tensor(
                format!("grad {}", p.name),
                bytes,
                TensorKind::ParameterGradient,
                None,
            );
            self.grads.push(id);
        }
        for k in 0..states {
            for p in &model.params {
                let bytes = pool_bytes(p.shape.iter().product());
                let id = self.tensor(
                    format!("opt{k} {}", p.name),
                    bytes,
                    TensorKind::OptimizerState,
                    None,
                );
                self.states.push(id);
            }
        }
    }

    fn tensor(
        &mut self,
        name: String,
        bytes: u64,
        kind: TensorKind,
        home: Option<Home>,
    ) -> TensorId {
        let id = self.t.tensor(name, bytes, kind);
        self.homes.push(home);
        self.sizes.push(bytes);
        id
    }

    /// One tensor per node of `graph` with a buffer of its own (per
    /// segment of the function for a dynamic model).
    fn graph_tensors(&mut self, graph: GraphRef) {
        let g = graph.graph(self.model);
        let prog = graph.program(self.program, self.kind);
        let kind = match graph {
            GraphRef::Forward(_) | GraphRef::Head => TensorKind::Activation,
            _ => TensorKind::Gradient,
        };
        let label = graph.label(self.model);
        let parts: Vec<(usize, Option<Segment>)> = match graph.function() {
            Some(f) if !self.segments.is_empty() => self
                .segments
                .iter()
                .enumerate()
                .filter(|(_, sg)| sg.function == f)
                .map(|(i, sg)| (i, Some(sg.clone())))
                .collect(),
            _ => vec![(WHOLE, None)],
        };
        for (n, node) in g.nodes.iter().enumerate() {
            match node.kind {
                NodeKind::Param(_)
                | NodeKind::Input(Source::Forward(_) | Source::Token | Source::Label) => continue,
                // a scattered state the plain engine writes straight into
                // the batch's state buffer is a tensor of its own here
                _ if !prog.materialized[n] && prog.scatter_in_place != Some(n) => continue,
                _ => {}
            }
            let width = node.ty.width();
            for (seg, part) in &parts {
                let (count, first, rows) = match (part, node.ty.space) {
                    (None, space) => (self.shape.count(graph, space), 0, String::new()),
                    (Some(_), Space::Static) => (1, 0, format!(" [segment {seg}]")),
                    (Some(sg), Space::Vertex) => (
                        sg.r1 - sg.r0,
                        sg.r0,
                        format!(" [segment {seg}: rows {}..{}]", sg.r0, sg.r1),
                    ),
                    (Some(sg), Space::Edge) => (
                        sg.e1 - sg.e0,
                        sg.e0,
                        format!(" [segment {seg}: edges {}..{}]", sg.e0, sg.e1),
                    ),
                };
                let len = count * width;
                if len == 0 {
                    if *seg == WHOLE || !self.empty.contains(&(graph, n, node.ty.dtype)) {
                        self.empty.push((graph, n, node.ty.dtype));
                    }
                    continue;
                }
                let home = Home {
                    graph,
                    node: n,
                    dtype: node.ty.dtype,
                    len,
                    at: first * width,
                };
                let id = self.tensor(
                    format!("{label} %{n} {}{rows}", node.describe(&[])),
                    pool_bytes(len),
                    kind,
                    Some(home),
                );
                self.own.insert((graph, n, *seg), id);
            }
        }
    }

    /// The tensor holding node `n` of `graph` (`None`: an index input or
    /// an empty buffer).
    fn resolve(&self, graph: GraphRef, n: NodeId) -> Result<Option<TensorId>> {
        let g = graph.graph(self.model);
        let node = g.nodes.get(n).ok_or_else(|| {
            CudaError::Model(format!("node %{n} is not in {}", graph.label(self.model)))
        })?;
        match node.kind {
            NodeKind::Param(p) => Ok(self.params.get(p).copied()),
            NodeKind::Input(Source::Forward(m)) => match graph.forward() {
                Some(fg) => self.resolve(fg, m),
                None => Err(CudaError::Model(format!(
                    "forward value %{m} read outside a backward graph"
                ))),
            },
            NodeKind::Input(Source::Token | Source::Label) => Ok(None),
            _ => match graph.program(self.program, self.kind).views.get(&n) {
                Some(v) => self.resolve(graph, v.source),
                None => {
                    let seg = match graph.function() {
                        Some(_) if !self.segments.is_empty() => self.current,
                        _ => WHOLE,
                    };
                    Ok(self.own.get(&(graph, n, seg)).copied())
                }
            },
        }
    }

    fn resolve_all(&self, graph: GraphRef, nodes: &[NodeId]) -> Result<Vec<TensorId>> {
        let mut out = Vec::with_capacity(nodes.len());
        for &n in nodes {
            if let Some(t) = self.resolve(graph, n)? {
                out.push(t);
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// Appends an op; host-only producers of the tensors it uses go first.
    fn emit(
        &mut self,
        op: SwapOp,
        name: String,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
    ) {
        let size = |t: &TensorId| self.sizes.get(t.index()).copied().unwrap_or(0) as f64;
        for t in reads.iter().chain(writes) {
            if let Some((producer, pname)) = self.pending.remove(t) {
                self.ops.push(producer);
                self.costs.push((0.0, size(t)));
                self.t.op(pname, phase, &[], &[*t]);
            }
        }
        let cost = self.step_cost.take().unwrap_or_else(|| {
            let moved: f64 = reads.iter().chain(writes).map(size).sum();
            (moved / 4.0, moved)
        });
        self.ops.push(op);
        self.costs.push(cost);
        self.t.op(name, phase, reads, writes);
    }

    /// Registers a host-only producer of `t`, emitted before its first use.
    fn producer(&mut self, t: TensorId, op: SwapOp, name: String) {
        self.pending.insert(t, (op, name));
    }

    /// The steps of `phase` of `graph` over every row.
    fn steps(&mut self, graph: GraphRef, phase: usize, op_phase: Phase) -> Result<()> {
        let rows = match graph.function() {
            Some(f) => self.shape.rows[f],
            None => self.shape.head_rows,
        };
        self.steps_over(graph, phase, op_phase, Rows::All, rows)
    }

    /// The steps of `phase` of `graph` over `rows` (`count` of them).
    fn steps_over(
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

    /// Seeds of the output-gradient inputs of backward graph `graph`.
    fn seeds(&mut self, graph: GraphRef, forward: &Graph) -> Result<()> {
        let g = graph.graph(self.model);
        for (n, node) in g.nodes.iter().enumerate() {
            if let NodeKind::Input(Source::OutputGrad(i)) = node.kind {
                if node.ty.dtype != DType::Float {
                    continue;
                }
                let Some(t) = self.resolve(graph, n)? else {
                    continue;
                };
                let is_loss = forward.outputs.get(i).is_some_and(|o| o.role == Role::Loss);
                let value = if is_loss { 1.0 } else { 0.0 };
                let name = format!("seed {} %{n} = {value}", graph.label(self.model));
                self.producer(
                    t,
                    SwapOp::Seed {
                        graph,
                        node: n,
                        value,
                    },
                    name,
                );
            }
        }
        Ok(())
    }

    /// Accumulation ops of backward graph `graph`'s parameter gradients
    /// (those not accumulated early, right after their last writer) over
    /// `rows`; row gradients (embedding tables) only for a dynamic model.
    fn accumulate(&mut self, graph: GraphRef, rows: Rows) -> Result<()> {
        let g = graph.graph(self.model);
        for (output, o) in g.outputs.iter().enumerate() {
            match o.role {
                Role::ParamGrad(_) if !self.accumulated.contains(&(graph, output)) => {
                    self.accumulate_output(graph, output, rows)?
                }
                Role::ParamRowGrad(_) if self.segments.is_empty() => {
                    return Err(unsupported(self.model, "has row gradients".into()))
                }
                Role::ParamRowGrad(_) => self.accumulate_output(graph, output, rows)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// The accumulation op of output `output` (a parameter gradient or row
    /// gradient) of backward graph `graph` over `rows`.
    fn accumulate_output(&mut self, graph: GraphRef, output: usize, rows: Rows) -> Result<()> {
        let g = graph.graph(self.model);
        let Some(o) = g.outputs.get(output) else {
            return Err(CudaError::Model(format!("swap path: no output {output}")));
        };
        let (Role::ParamGrad(p) | Role::ParamRowGrad(p)) = o.role else {
            return Err(CudaError::Model(
                "swap path: accumulating a non-gradient output".into(),
            ));
        };
        let mut src = self.resolve_all(graph, &[o.node])?;
        if let Some(aux) = o.aux {
            src.extend(self.resolve_all(graph, &[aux])?);
        }
        let dst = *self
            .grads
            .get(p)
            .ok_or_else(|| CudaError::Model(format!("gradient of unknown parameter {p}")))?;
        let mut reads = src;
        reads.push(dst);
        let name = match rows {
            Rows::Segment(s) => format!(
                "{} segment {s} accumulate grad {}",
                graph.label(self.model),
                self.model.params[p].name
            ),
            _ => format!(
                "{} accumulate grad {}",
                graph.label(self.model),
                self.model.params[p].name
            ),
        };
        self.emit(
            SwapOp::AccumulateGrad {
                graph,
                output,
                rows,
            },
            name,
            Phase::Backward,
            &reads,
            &[dst],
        );
        self.accumulated.insert((graph, output));
        Ok(())
    }

    /// Schedules the accumulation of each of the backward graphs'
    /// parameter gradients right after the step that last writes it, so
    /// that the gradient's own tensor is freed at once instead of living to
    /// the end of the backward pass (the functions' `graphs`; the head's
    /// backward is short). Only parameters with exactly one gradient output
    /// of any backward graph move (their gradient buffer is zeroed, so `0 + g`
    /// is the same value whenever it is added); the others keep the plain
    /// engine's order of additions.
    fn plan_early_accumulations(&mut self, graphs: &[GraphRef], phases: &[usize]) -> Result<()> {
        let mut count = vec![0usize; self.model.params.len()];
        let every = (0..self.model.functions.len())
            .map(GraphRef::Backward)
            .chain([GraphRef::HeadBackward]);
        for graph in every {
            for o in &graph.graph(self.model).outputs {
                if let Role::ParamGrad(p) = o.role {
                    if let Some(c) = count.get_mut(p) {
                        *c += 1;
                    }
                }
            }
        }
        for &graph in graphs {
            let g = graph.graph(self.model);
            let prog = graph.program(self.program, self.kind);
            let label = graph.label(self.model);
            // the last step (phase, index) writing each tensor
            let mut last_writer: HashMap<TensorId, (usize, usize)> = HashMap::new();
            for &phase in phases {
                for (index, step) in prog.phases[phase].iter().enumerate() {
                    let (_, writes, _) = step_nodes(g, &step.step, &label);
                    for t in self.resolve_all(graph, &writes)? {
                        last_writer.insert(t, (phase, index));
                    }
                }
            }
            for (output, o) in g.outputs.iter().enumerate() {
                let Role::ParamGrad(p) = o.role else {
                    continue;
                };
                if count.get(p) != Some(&1) {
                    continue;
                }
                let src = self.resolve_all(graph, &[o.node])?;
                let last = src
                    .iter()
                    .map(|t| last_writer.get(t).copied())
                    .collect::<Option<Vec<_>>>();
                // every source written by a step of these phases: after the last one
                let Some(at) = last.and_then(|l| {
                    l.into_iter().max_by_key(|&(phase, index)| {
                        (phases.iter().position(|&x| x == phase), index)
                    })
                }) else {
                    continue;
                };
                self.early
                    .entry((graph, at.0, at.1))
                    .or_default()
                    .push(output);
            }
        }
        Ok(())
    }
}

/// The estimated work of a step over `rows` rows: (flops, bytes), summed
/// over its op nodes by the op registry's cost model.
fn step_cost(g: &Graph, step: &PlannedStep, rows: usize) -> (f64, f64) {
    let node = |n: NodeId| -> (f64, f64) {
        let node = &g.nodes[n];
        let Some(op) = node.op() else {
            return (0.0, 0.0);
        };
        let inputs: Vec<&ramus_core::graph::ValueType> =
            node.inputs.iter().map(|&i| &g.nodes[i].ty).collect();
        let c = op.cost(&inputs, &node.ty, rows);
        (c.flops, c.bytes)
    };
    let sum = |nodes: &mut dyn Iterator<Item = NodeId>| {
        nodes
            .map(node)
            .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    match step {
        PlannedStep::Op(n) => node(*n),
        PlannedStep::Fused(group) => sum(&mut group.nodes.iter().copied()),
        PlannedStep::GemmBias { matmul, group, .. } => {
            sum(&mut std::iter::once(*matmul).chain(group.nodes.iter().copied()))
        }
    }
}

/// Nodes a step reads (buffers of its inputs) and writes, and its name.
fn step_nodes(g: &Graph, step: &PlannedStep, label: &str) -> (Vec<NodeId>, Vec<NodeId>, String) {
    match step {
        PlannedStep::Op(n) => {
            let node = &g.nodes[*n];
            let sig = node.op().map(|o| o.signature()).unwrap_or_default();
            (node.inputs.clone(), vec![*n], format!("{label} %{n} {sig}"))
        }
        PlannedStep::Fused(group) => {
            let (r, w) = group_nodes(group);
            let name = format!(
                "{label} fused %{}..%{} ({} ops)",
                group.nodes.first().copied().unwrap_or(0),
                group.nodes.last().copied().unwrap_or(0),
                group.nodes.len()
            );
            (r, w, name)
        }
        PlannedStep::GemmBias {
            matmul,
            bias,
            group,
        } => {
            let (mut r, mut w) = group_nodes(group);
            // the product is the step's own (written, then read)
            r.retain(|&n| n != *matmul);
            r.extend(&g.nodes[*matmul].inputs);
            r.push(*bias);
            w.push(*matmul);
            (r, w, format!("{label} %{matmul} matmul + bias"))
        }
    }
}

/// Nodes a fused group reads (buffers of its inputs) and writes (its
/// outputs and the concats it writes in place).
fn group_nodes(group: &ramus_core::fusion::FusedGroup) -> (Vec<NodeId>, Vec<NodeId>) {
    let reads = group.inputs.iter().map(|i| i.buffer()).collect();
    let mut writes = group.outputs.clone();
    writes.extend(group.concat_writes.iter().map(|c| c.concat));
    (reads, writes)
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
    // host-only producers of the forward pass: pulled inputs and masks, the
    // masks drawn in the plain engine's order (functions, then the head)
    let mut masks = Vec::new();
    for &graph in graphs.iter().filter(|g| g.forward().is_none()) {
        let g = graph.graph(model);
        for (n, node) in g.nodes.iter().enumerate() {
            let Some(t) = b.resolve(graph, n)? else {
                continue;
            };
            match node.kind {
                NodeKind::Input(Source::Pull) => {
                    if let Some(f) = graph.function() {
                        let name = format!("upload {} %{n} (pulled inputs)", graph.label(model));
                        b.producer(
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
                    let len = b.homes[t.index()].map_or(0, |h| h.len);
                    let name = format!("upload {} %{n} (dropout mask)", graph.label(model));
                    let op = SwapOp::UploadMask {
                        mask: masks.len(),
                        rows: Rows::All,
                    };
                    b.producer(t, op, name);
                    masks.push((graph, n, len, rate));
                }
                NodeKind::Input(Source::DropoutMask { .. }) => {
                    let name = format!("fill {} %{n} (dropout mask) = 1", graph.label(model));
                    let op = SwapOp::Seed {
                        graph,
                        node: n,
                        value: 1.0,
                    };
                    b.producer(t, op, name);
                }
                _ => {}
            }
        }
    }
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
    let backward: Vec<GraphRef> = (0..nf).map(GraphRef::Backward).collect();
    b.plan_early_accumulations(&backward, &[EAGER, LAZY])?;
    b.seeds(GraphRef::HeadBackward, &head.forward)?;
    b.steps(GraphRef::HeadBackward, 0, Phase::Backward)?;
    b.accumulate(GraphRef::HeadBackward, Rows::All)?;
    for (f, func) in model.functions.iter().enumerate() {
        b.seeds(GraphRef::Backward(f), &func.forward)?;
    }
    let head_grad = match head.backward.output(Role::HeadInputGrad) {
        Some(o) => b.resolve_all(GraphRef::HeadBackward, &[o.node])?,
        None => Vec::new(),
    };
    let mut push_grads = Vec::new();
    for (f, func) in model.functions.iter().enumerate() {
        if let Some(n) = func.output_grad_node(Role::Push) {
            push_grads.extend(b.resolve_all(GraphRef::Backward(f), &[n])?);
        }
    }
    if !head_grad.is_empty() {
        let mut reads = head_grad;
        reads.extend(&push_grads);
        b.emit(
            SwapOp::PushGrads,
            "push gradients".into(),
            Phase::Backward,
            &reads,
            &push_grads,
        );
    }
    for f in 0..nf {
        b.steps(GraphRef::Backward(f), EAGER, Phase::Backward)?;
    }
    for f in 0..nf {
        b.steps(GraphRef::Backward(f), LAZY, Phase::Backward)?;
        b.accumulate(GraphRef::Backward(f), Rows::All)?;
    }
    let mut reads = b.params.clone();
    reads.extend(&b.grads);
    reads.extend(&b.states);
    let mut writes = b.params.clone();
    writes.extend(&b.states);
    b.emit(
        SwapOp::Optimizer,
        "optimizer step".into(),
        Phase::Optimizer,
        &reads,
        &writes,
    );
    b.finish(masks)
}

impl Builder<'_> {
    fn finish(self, masks: Vec<(GraphRef, NodeId, usize, u16)>) -> Result<SwapProgram> {
        let trace = self.t.build().map_err(|e| {
            CudaError::Model(format!("swap trace of model `{}`: {e}", self.model.name))
        })?;
        Ok(SwapProgram {
            ops: self.ops,
            homes: self.homes,
            empty: self.empty,
            masks,
            workspace_floats: self.workspace_floats,
            costs: self.costs,
            kind: self.kind,
            trace,
            segments: self.segments,
            pieces: self.pieces,
            move_sets: self.move_sets,
            indices: self.indices,
        })
    }
}
