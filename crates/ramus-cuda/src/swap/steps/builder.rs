//! The builder both iteration builders (static and [`super::dynamic`]) use:
//! tensors of the graphs' nodes, resolving a node to its tensor, emitting
//! ops with their host-only producers, steps, seeds and gradient
//! accumulations.

use std::collections::{HashMap, HashSet};

use ramus_core::graph::{DType, Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::op::OpDef;
use ramus_core::Model;
use ramus_swap::{Phase, TensorId, TensorKind, TraceBuilder};

use super::types::{
    pool_bytes, GraphRef, Home, Kind, MoveSpec, Piece, Rows, Segment, Shape, SwapOp, SwapProgram,
    WHOLE,
};
use crate::error::{CudaError, Result};
use crate::program::{PlannedStep, Program, HEAD_ALL, HEAD_SCORES};

pub(super) fn unsupported(model: &Model, what: String) -> CudaError {
    CudaError::Model(format!(
        "swap execution runs static-graph models (the CNNs: every step over all rows at \
         once); model `{}` {what}",
        model.name
    ))
}

pub(super) struct Builder<'a> {
    pub(super) model: &'a Model,
    pub(super) program: &'a Program,
    pub(super) kind: Kind,
    pub(super) shape: &'a Shape,
    pub(super) conv_workspace: usize,
    pub(super) t: TraceBuilder,
    pub(super) homes: Vec<Option<Home>>,
    /// Each node's tensor, by (graph, node, segment); [`WHOLE`] for the
    /// head and for static-graph models.
    pub(super) own: HashMap<(GraphRef, NodeId, usize), TensorId>,
    /// Dynamic models: the segments, and the one function tensors resolve
    /// in now.
    pub(super) segments: Vec<Segment>,
    pub(super) pieces: Vec<Piece>,
    pub(super) current: usize,
    pub(super) move_sets: Vec<Vec<MoveSpec>>,
    pub(super) indices: Vec<u32>,
    pub(super) empty: Vec<(GraphRef, NodeId, DType)>,
    pub(super) params: Vec<TensorId>,
    pub(super) grads: Vec<TensorId>,
    pub(super) states: Vec<TensorId>,
    /// Host-only producers waiting for their tensor's first use.
    pub(super) pending: HashMap<TensorId, (SwapOp, String)>,
    pub(super) ops: Vec<SwapOp>,
    pub(super) workspace_floats: usize,
    /// Parameter-gradient outputs accumulated right after a step: by
    /// (graph, phase, step index).
    pub(super) early: HashMap<(GraphRef, usize, usize), Vec<usize>>,
    /// Outputs accumulated so far.
    pub(super) accumulated: HashSet<(GraphRef, usize)>,
    /// Bytes of each tensor, and the estimated work of each op.
    pub(super) sizes: Vec<u64>,
    pub(super) costs: Vec<(f64, f64)>,
    /// The work of the step being emitted (other ops: their bytes).
    pub(super) step_cost: Option<(f64, f64)>,
}

impl<'a> Builder<'a> {
    pub(super) fn new(
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
    pub(super) fn head_outputs(&mut self, kind: Kind) -> Result<bool> {
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
    pub(super) fn persistent_tensors(&mut self) {
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

    pub(super) fn tensor(
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
    pub(super) fn graph_tensors(&mut self, graph: GraphRef) {
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
    pub(super) fn resolve(&self, graph: GraphRef, n: NodeId) -> Result<Option<TensorId>> {
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

    pub(super) fn resolve_all(&self, graph: GraphRef, nodes: &[NodeId]) -> Result<Vec<TensorId>> {
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
    pub(super) fn emit(
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
    pub(super) fn producer(&mut self, t: TensorId, op: SwapOp, name: String) {
        self.pending.insert(t, (op, name));
    }

    /// Seeds of the output-gradient inputs of backward graph `graph`.
    pub(super) fn seeds(&mut self, graph: GraphRef, forward: &Graph) -> Result<()> {
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
    pub(super) fn accumulate(&mut self, graph: GraphRef, rows: Rows) -> Result<()> {
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
    pub(super) fn accumulate_output(
        &mut self,
        graph: GraphRef,
        output: usize,
        rows: Rows,
    ) -> Result<()> {
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
    pub(super) fn plan_early_accumulations(
        &mut self,
        graphs: &[GraphRef],
        phases: &[usize],
    ) -> Result<()> {
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

impl Builder<'_> {
    /// The fused optimizer step over every parameter.
    pub(super) fn optimizer_step(&mut self) {
        let mut reads = self.params.clone();
        reads.extend(&self.grads);
        reads.extend(&self.states);
        let mut writes = self.params.clone();
        writes.extend(&self.states);
        self.emit(
            SwapOp::Optimizer,
            "optimizer step".into(),
            Phase::Optimizer,
            &reads,
            &writes,
        );
    }

    pub(super) fn finish(self, masks: Vec<(GraphRef, NodeId, usize, u16)>) -> Result<SwapProgram> {
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

/// The estimated work of a step over `rows` rows: (flops, bytes), summed
/// over its op nodes by the op registry's cost model.
pub(super) fn step_cost(g: &Graph, step: &PlannedStep, rows: usize) -> (f64, f64) {
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
pub(super) fn step_nodes(
    g: &Graph,
    step: &PlannedStep,
    label: &str,
) -> (Vec<NodeId>, Vec<NodeId>, String) {
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
