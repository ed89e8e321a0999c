//! The training iteration of a *dynamic* model (trees, sequences: vertex
//! functions that gather their children's states) as the swap path runs it
//! — AutoVM's planner applied beyond the thesis to a batch whose schedule
//! Ramus knows before running it.
//!
//! The batched engine keeps each node of a vertex function in one buffer
//! over all the function's rows, and its eager and lazy steps run once over
//! all of them: every activation of the batch would be live at once, with
//! nothing to offload. Here the function's rows are cut into **segments**
//! (pieces of batching tasks of one function with contiguous rows — a task
//! larger than `segment_rows` rows cut into pieces, its rows being
//! independent — merged until a segment has `segment_rows` rows) and every node buffer into one
//! tensor per segment. The ops, in the batched engine's task order:
//!
//! * forward, per segment: its eager steps over the segment's rows; per
//!   piece of a task, one launch gathering the children's states straight from the
//!   scattered-state tensors of the segments holding them (there is no
//!   whole-batch state buffer), then the task's per-task steps; the lazy
//!   steps over the segment's rows; its rows of the head input;
//! * the head, its loss, zeroing the parameter gradients and the head's
//!   backward, as for a static-graph model;
//! * backward, per segment in reverse: the head's gradient of its pushed
//!   rows; its eager steps; per piece in reverse, the per-task steps and one
//!   launch adding the child gradients into the scattered-state gradient
//!   tensors of the children's segments; its lazy steps (the weight
//!   gradients of its rows) and their accumulation into the parameters'
//!   gradients (row gradients of embedding tables too);
//! * the optimizer step.
//!
//! Running eager and lazy steps per segment is exact only for steps that
//! treat rows independently; [`check_dynamic`] refuses a model whose eager
//! or lazy steps couple rows (batch statistics) or reduce over rows into
//! anything but a parameter gradient (whose per-segment partial sums are
//! added up). The parameter gradients are then sums over segments, so the
//! swap path's losses equal the plain engine's to rounding — and are
//! bit-identical in every swap mode, which all run this one op list.

use std::collections::BTreeMap;

use ramus_core::graph::{Graph, NodeId, NodeKind, Role, Source};
use ramus_core::op::OpDef;
use ramus_core::{HeadRows, Model};
use ramus_graph::Schedule;
use ramus_swap::{Phase, TensorId};

use super::builder::Builder;
use super::types::{
    GraphRef, Kind, MoveSpec, Piece, Rows, Segment, Shape, SwapOp, SwapProgram, Words, WHOLE,
};
use crate::error::{CudaError, Result};
use crate::launch::NONE;
use crate::program::{PlannedStep, Program, EAGER, LAZY, PER_TASK};

fn refused(model: &Model, what: String) -> CudaError {
    CudaError::Model(format!(
        "the swap path cannot cut model `{}` into segments of rows: {what}",
        model.name
    ))
}

/// Op nodes a planned step computes.
fn step_op_nodes(step: &PlannedStep) -> Vec<NodeId> {
    match step {
        PlannedStep::Op(n) => vec![*n],
        PlannedStep::Fused(group) => group.nodes.clone(),
        PlannedStep::GemmBias { matmul, group, .. } => {
            let mut v = vec![*matmul];
            v.extend(&group.nodes);
            v
        }
    }
}

/// Whether `model` is a dynamic model the swap path runs in segments: its
/// eager and lazy steps treat rows independently (see the module docs),
/// and each scattered state is a float node of the state's width with a
/// buffer of its own.
pub(crate) fn check_dynamic(model: &Model, program: &Program) -> Result<()> {
    for (f, func) in model.functions.iter().enumerate() {
        let (fwd, bwd) = &program.functions[f];
        for (g, prog, label) in [
            (&func.forward, fwd, format!("F {}", func.name)),
            (&func.backward, bwd, format!("∂F {}", func.name)),
        ] {
            let mut consumers = vec![0usize; g.nodes.len()];
            for node in &g.nodes {
                for &i in &node.inputs {
                    consumers[i] += 1;
                }
            }
            for phase in [EAGER, LAZY] {
                for step in &prog.phases[phase] {
                    for n in step_op_nodes(&step.step) {
                        check_row_local(model, g, n, consumers[n], &label)?;
                    }
                }
            }
        }
        if let Some(sc) = func.scatter {
            let node = &func.forward.nodes[sc];
            let (fwd, _) = &program.functions[f];
            if node.ty.width() != model.state_width
                || node.ty.dtype != ramus_core::graph::DType::Float
                || !(fwd.materialized[sc] || fwd.scatter_in_place == Some(sc))
                || fwd.views.contains_key(&sc)
            {
                return Err(refused(
                    model,
                    format!(
                        "the scattered state %{sc} of `{}` is not a float buffer of the state \
                         width {}",
                        func.name, model.state_width
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Node `n` of `g` may run over a segment's rows instead of all of them.
fn check_row_local(
    model: &Model,
    g: &Graph,
    n: NodeId,
    consumers: usize,
    label: &str,
) -> Result<()> {
    let node = &g.nodes[n];
    let Some(op) = node.op() else {
        return Ok(());
    };
    if op.couples_rows() {
        return Err(refused(
            model,
            format!(
                "op `{}` (node %{n} of {label}) couples the rows of a run (batch statistics)",
                op.signature()
            ),
        ));
    }
    let reduces = node.ty.space == ramus_core::graph::Space::Static
        && node.inputs.iter().any(|&x| g.nodes[x].ty.is_rows());
    let param_grad = g
        .outputs
        .iter()
        .any(|o| o.node == n && matches!(o.role, Role::ParamGrad(_)));
    if reduces && (!param_grad || consumers > 0) {
        return Err(refused(
            model,
            format!(
                "op `{}` (node %{n} of {label}) reduces over rows into a value other than a \
                 parameter gradient",
                op.signature()
            ),
        ));
    }
    Ok(())
}

/// The pieces and segments of batch `s`: each task cut into pieces of at
/// most `segment_rows` rows, and consecutive pieces of one function with
/// contiguous rows and edges merged while a segment has fewer than
/// `segment_rows` rows. Every row of every function is in one segment.
pub(crate) fn segments_of(s: &Schedule, segment_rows: usize) -> Result<(Vec<Segment>, Vec<Piece>)> {
    let most = segment_rows.max(1);
    let mut pieces: Vec<Piece> = Vec::new();
    for (t, task) in s.tasks.iter().enumerate() {
        let fr = s.functions.get(task.function).ok_or_else(|| {
            CudaError::Model(format!("task {t} runs unknown function {}", task.function))
        })?;
        let first = task.row_offset as usize;
        let end = first + task.len as usize;
        let mut r0 = first;
        while r0 < end {
            let r1 = (r0 + most).min(end);
            let edge = |r: usize| -> Result<usize> {
                fr.edge_offsets.get(r).map(|&e| e as usize).ok_or_else(|| {
                    CudaError::Model(format!("task {t}: row {r} has no edge offset"))
                })
            };
            pieces.push(Piece {
                task: t,
                r0,
                r1,
                e0: edge(r0)?,
                e1: edge(r1)?,
            });
            r0 = r1;
        }
    }
    let mut segs: Vec<Segment> = Vec::new();
    for (p, piece) in pieces.iter().enumerate() {
        let function = s.tasks[piece.task].function;
        if let Some(last) = segs.last_mut() {
            if last.function == function
                && last.r1 == piece.r0
                && last.e1 == piece.e0
                && last.r1 - last.r0 < most
            {
                last.pieces.end = p + 1;
                last.r1 = piece.r1;
                last.e1 = piece.e1;
                continue;
            }
        }
        segs.push(Segment {
            function,
            pieces: p..p + 1,
            r0: piece.r0,
            r1: piece.r1,
            e0: piece.e0,
            e1: piece.e1,
        });
    }
    for (f, fr) in s.functions.iter().enumerate() {
        let rows: usize = segs
            .iter()
            .filter(|g| g.function == f)
            .map(|g| g.r1 - g.r0)
            .sum();
        if rows != fr.rows() {
            return Err(CudaError::Model(format!(
                "the batch's tasks cover {rows} of the {} rows of function {f}",
                fr.rows()
            )));
        }
    }
    Ok((segs, pieces))
}

/// Builds the iteration of `kind` of dynamic `model` on batch `s` (head on
/// `head_rows`), its function tensors cut into segments of at least
/// `segment_rows` rows (see the module docs).
pub(crate) fn build(
    model: &Model,
    program: &Program,
    s: &Schedule,
    head_rows: HeadRows,
    kind: Kind,
    conv_workspace: usize,
    segment_rows: usize,
) -> Result<SwapProgram> {
    check_dynamic(model, program)?;
    let shape = Shape::of(model, s, head_rows);
    let (segments, pieces) = segments_of(s, segment_rows)?;
    // per function, the segment of each row
    let mut seg_of_row: Vec<Vec<usize>> = s.functions.iter().map(|fr| vec![0; fr.rows()]).collect();
    for (i, sg) in segments.iter().enumerate() {
        if let Some(rows) = seg_of_row
            .get_mut(sg.function)
            .and_then(|rows| rows.get_mut(sg.r0..sg.r1))
        {
            rows.fill(i);
        }
    }
    let head_vertices = crate::batch::head_vertices(head_rows, s);
    let training = kind.training();
    let mut b = Builder::new(model, program, &shape, kind, conv_workspace);
    b.segments = segments.clone();
    b.pieces = pieces.clone();
    b.persistent_tensors();
    let nf = model.functions.len();
    let graphs: Vec<GraphRef> = (0..nf)
        .flat_map(|f| [GraphRef::Forward(f), GraphRef::Backward(f)])
        .chain([GraphRef::Head, GraphRef::HeadBackward])
        .filter(|g| training || g.forward().is_none())
        .collect();
    for &g in &graphs {
        b.graph_tensors(g);
    }
    let masks = b.forward_producers(&graphs, &shape)?;
    let dynamic = Dynamic {
        s,
        seg_of_row: &seg_of_row,
        head_vertices: &head_vertices,
    };
    // forward
    for (i, sg) in segments.iter().enumerate() {
        b.current = i;
        let f = sg.function;
        let rows = sg.r1 - sg.r0;
        let fwd = GraphRef::Forward(f);
        b.steps_over(fwd, EAGER, Phase::Forward, Rows::Segment(i), rows)?;
        for p in sg.pieces.clone() {
            b.gather(&dynamic, p)?;
            let len = pieces[p].r1 - pieces[p].r0;
            b.steps_over(fwd, PER_TASK, Phase::Forward, Rows::Piece(p), len)?;
        }
        b.steps_over(fwd, LAZY, Phase::Forward, Rows::Segment(i), rows)?;
        b.head_input(&dynamic, i)?;
    }
    b.current = WHOLE;
    let head = &model.head;
    if !b.head_outputs(kind)? {
        return b.finish(masks);
    }
    b.seeds(GraphRef::HeadBackward, &head.forward)?;
    b.steps(GraphRef::HeadBackward, 0, Phase::Backward)?;
    b.accumulate(GraphRef::HeadBackward, Rows::All)?;
    for (i, sg) in segments.iter().enumerate() {
        b.current = i;
        b.seeds(
            GraphRef::Backward(sg.function),
            &model.functions[sg.function].forward,
        )?;
    }
    for (i, sg) in segments.iter().enumerate().rev() {
        b.current = i;
        let f = sg.function;
        let rows = sg.r1 - sg.r0;
        let bwd = GraphRef::Backward(f);
        b.push_grads(&dynamic, i)?;
        b.steps_over(bwd, EAGER, Phase::Backward, Rows::Segment(i), rows)?;
        for p in sg.pieces.clone().rev() {
            let len = pieces[p].r1 - pieces[p].r0;
            b.steps_over(bwd, PER_TASK, Phase::Backward, Rows::Piece(p), len)?;
            b.child_grads(&dynamic, p)?;
        }
        b.steps_over(bwd, LAZY, Phase::Backward, Rows::Segment(i), rows)?;
        b.accumulated.clear();
        b.accumulate(bwd, Rows::Segment(i))?;
    }
    b.current = WHOLE;
    b.optimizer_step();
    b.finish(masks)
}

/// The batch's topology as the move builders need it.
struct Dynamic<'a> {
    s: &'a Schedule,
    seg_of_row: &'a [Vec<usize>],
    head_vertices: &'a [u32],
}

/// Rows of one move, grouped by the segment on the other end.
#[derive(Default)]
struct Pairs {
    dst: Vec<u32>,
    src: Vec<u32>,
}

fn local(row: usize, first: usize) -> u32 {
    (row - first) as u32
}

impl Builder<'_> {
    /// The host-only producers of the forward graphs' tensors (pulled
    /// inputs, dropout masks), per segment; returns the masks in the plain
    /// engine's draw order, each drawn over all the function's rows.
    fn forward_producers(
        &mut self,
        graphs: &[GraphRef],
        shape: &Shape,
    ) -> Result<Vec<(GraphRef, NodeId, usize, u16)>> {
        let model = self.model;
        let training = self.kind.training();
        let mut masks = Vec::new();
        for &graph in graphs.iter().filter(|g| g.forward().is_none()) {
            let g = graph.graph(model);
            let parts: Vec<(usize, Rows)> = match graph.function() {
                Some(f) => self
                    .segments
                    .iter()
                    .enumerate()
                    .filter(|(_, sg)| sg.function == f)
                    .map(|(i, _)| (i, Rows::Segment(i)))
                    .collect(),
                None => vec![(WHOLE, Rows::All)],
            };
            for (n, node) in g.nodes.iter().enumerate() {
                let mask = match node.kind {
                    NodeKind::Input(Source::DropoutMask { rate, .. }) if training => {
                        let len = shape.count(graph, node.ty.space) * node.ty.width();
                        masks.push((graph, n, len, rate));
                        Some(masks.len() - 1)
                    }
                    NodeKind::Input(Source::DropoutMask { .. } | Source::Pull) => None,
                    _ => continue,
                };
                for &(seg, rows) in &parts {
                    self.current = seg;
                    let Some(t) = self.resolve(graph, n)? else {
                        continue;
                    };
                    let label = graph.label(model);
                    let pull = matches!(node.kind, NodeKind::Input(Source::Pull));
                    let (op, name) = match (pull, mask, graph.function()) {
                        (_, Some(mask), _) => (
                            SwapOp::UploadMask { mask, rows },
                            format!("upload {label} %{n} (dropout mask) {rows:?}"),
                        ),
                        (true, _, Some(f)) => (
                            SwapOp::UploadPull { f, node: n, rows },
                            format!("upload {label} %{n} (pulled inputs) {rows:?}"),
                        ),
                        (true, _, None) => continue,
                        _ => (
                            SwapOp::Seed {
                                graph,
                                node: n,
                                value: 1.0,
                            },
                            format!("fill {label} %{n} (dropout mask) = 1 {rows:?}"),
                        ),
                    };
                    self.producer(t, op, name);
                }
            }
        }
        self.current = WHOLE;
        Ok(masks)
    }

    /// Node `n`'s own tensor in segment `seg` (`None`: an empty buffer); a
    /// node that is a view of another is an error (moves address rows of
    /// the node's own width).
    fn own_tensor(&self, graph: GraphRef, n: NodeId, seg: usize) -> Result<Option<TensorId>> {
        if graph
            .program(self.program, self.kind)
            .views
            .contains_key(&n)
        {
            return Err(refused(
                self.model,
                format!(
                    "node %{n} of {} moves rows but is a view of another node",
                    graph.label(self.model)
                ),
            ));
        }
        Ok(self.own.get(&(graph, n, seg)).copied())
    }

    fn words(&mut self, words: &[u32]) -> Words {
        let offset = self.indices.len();
        self.indices.extend_from_slice(words);
        Words {
            offset,
            len: words.len(),
        }
    }

    /// Emits one [`SwapOp::Moves`] op of `specs` (nothing if empty).
    fn emit_moves(&mut self, name: String, phase: Phase, specs: Vec<MoveSpec>) {
        if specs.is_empty() {
            return;
        }
        let mut reads: Vec<TensorId> = Vec::new();
        let mut writes: Vec<TensorId> = Vec::new();
        for m in &specs {
            reads.extend(m.src);
            if m.accumulate {
                reads.push(m.dst);
            }
            writes.push(m.dst);
        }
        reads.sort_unstable();
        reads.dedup();
        writes.sort_unstable();
        writes.dedup();
        self.move_sets.push(specs);
        let set = self.move_sets.len() - 1;
        self.emit(SwapOp::Moves { set }, name, phase, &reads, &writes);
    }

    /// Turns rows grouped by the segment on the other end into moves.
    fn group_moves(
        &mut self,
        groups: BTreeMap<Option<(usize, TensorId)>, Pairs>,
        here: TensorId,
        width: usize,
        gathering: bool,
    ) -> Vec<MoveSpec> {
        let mut specs = Vec::new();
        for (other, pairs) in groups {
            let rows = pairs.dst.len();
            let dst_rows = Some(self.words(&pairs.dst));
            let src_rows = Some(self.words(&pairs.src));
            let (dst, src) = match (gathering, other) {
                (true, other) => (here, other.map(|(_, t)| t)),
                (false, Some((_, t))) => (t, Some(here)),
                (false, None) => continue,
            };
            specs.push(MoveSpec {
                dst,
                src,
                dst_rows,
                src_rows,
                rows,
                width,
                accumulate: !gathering,
            });
        }
        specs
    }

    /// The child of row (or edge) `r` for gather source `k` (`None`: all
    /// children, edge `r`), as (function, row, segment), if it has one whose
    /// function scatters.
    fn child_of(
        &self,
        d: &Dynamic<'_>,
        f: usize,
        r: usize,
        k: Option<usize>,
    ) -> Option<(usize, usize, usize)> {
        let fr = &d.s.functions[f];
        let v = match k {
            Some(k) => fr.child(r, k)?,
            None => *fr.edge_child.get(r)?,
        } as usize;
        if v == NONE as usize {
            return None;
        }
        let fc = *d.s.vertex_function.get(v)? as usize;
        let rc = *d.s.vertex_row.get(v)? as usize;
        let seg = *d.seg_of_row.get(fc)?.get(rc)?;
        Some((fc, rc, seg))
    }

    /// Piece `p`'s gather: each gathered node's rows copied from the
    /// scattered-state tensors of the children's segments (zeros for a
    /// missing child).
    fn gather(&mut self, d: &Dynamic<'_>, p: usize) -> Result<()> {
        let piece = self.pieces[p];
        let t = piece.task;
        let f = d.s.tasks[t].function;
        let func = &self.model.functions[f];
        let seg = self.current;
        let (sr0, se0) = (self.segments[seg].r0, self.segments[seg].e0);
        let mut specs = Vec::new();
        for (n, node) in func.forward.nodes.iter().enumerate() {
            let (k, span, first) = match node.kind {
                NodeKind::Input(Source::Gather(k)) => (Some(k), piece.r0..piece.r1, sr0),
                NodeKind::Input(Source::GatherAll) => (None, piece.e0..piece.e1, se0),
                _ => continue,
            };
            let Some(here) = self.own_tensor(GraphRef::Forward(f), n, seg)? else {
                continue;
            };
            let mut groups: BTreeMap<Option<(usize, TensorId)>, Pairs> = BTreeMap::new();
            for r in span {
                let source = match self.child_of(d, f, r, k) {
                    Some((fc, rc, sc)) => match self.model.functions[fc].scatter {
                        Some(sn) => self
                            .own_tensor(GraphRef::Forward(fc), sn, sc)?
                            .map(|st| ((sc, st), local(rc, self.segments[sc].r0))),
                        None => None,
                    },
                    None => None,
                };
                let (key, src) = match source {
                    Some((key, row)) => (Some(key), row),
                    None => (None, NONE),
                };
                let p = groups.entry(key).or_default();
                p.dst.push(local(r, first));
                p.src.push(src);
            }
            let width = node.ty.width();
            specs.extend(self.group_moves(groups, here, width, true));
        }
        let name = format!(
            "F {} task {t} rows {}..{} gather",
            func.name, piece.r0, piece.r1
        );
        self.emit_moves(name, Phase::Forward, specs);
        Ok(())
    }

    /// Piece `p`'s child gradients added into the scattered-state gradient
    /// tensors of the children's segments.
    fn child_grads(&mut self, d: &Dynamic<'_>, p: usize) -> Result<()> {
        let piece = self.pieces[p];
        let t = piece.task;
        let f = d.s.tasks[t].function;
        let func = &self.model.functions[f];
        let seg = self.current;
        let (sr0, se0) = (self.segments[seg].r0, self.segments[seg].e0);
        let mut specs = Vec::new();
        for o in &func.backward.outputs {
            let (k, span, first) = match o.role {
                Role::ChildGrad(k) => (Some(k), piece.r0..piece.r1, sr0),
                Role::ChildGradAll => (None, piece.e0..piece.e1, se0),
                _ => continue,
            };
            let Some(here) = self.own_tensor(GraphRef::Backward(f), o.node, seg)? else {
                continue;
            };
            let mut groups: BTreeMap<Option<(usize, TensorId)>, Pairs> = BTreeMap::new();
            for r in span {
                let Some((fc, rc, sc)) = self.child_of(d, f, r, k) else {
                    continue;
                };
                let Some(sg) = self.model.functions[fc].output_grad_node(Role::Scatter) else {
                    continue;
                };
                let Some(target) = self.own_tensor(GraphRef::Backward(fc), sg, sc)? else {
                    continue;
                };
                let p = groups.entry(Some((sc, target))).or_default();
                p.dst.push(local(rc, self.segments[sc].r0));
                p.src.push(local(r, first));
            }
            let width = func.backward.nodes[o.node].ty.width();
            specs.extend(self.group_moves(groups, here, width, false));
        }
        let name = format!(
            "∂F {} task {t} rows {}..{} child gradients",
            func.name, piece.r0, piece.r1
        );
        self.emit_moves(name, Phase::Backward, specs);
        Ok(())
    }

    /// Pairs (head row, row in segment `seg`) of the head rows it serves.
    fn head_pairs(&self, d: &Dynamic<'_>, seg: usize) -> Pairs {
        let sg = &self.segments[seg];
        let mut pairs = Pairs::default();
        for (i, &v) in d.head_vertices.iter().enumerate() {
            let v = v as usize;
            if d.s.vertex_function.get(v).map(|&f| f as usize) != Some(sg.function) {
                continue;
            }
            let r = d.s.vertex_row[v] as usize;
            if (sg.r0..sg.r1).contains(&r) {
                pairs.dst.push(i as u32);
                pairs.src.push(local(r, sg.r0));
            }
        }
        pairs
    }

    /// Segment `seg`'s pushed values copied into their head input rows.
    fn head_input(&mut self, d: &Dynamic<'_>, seg: usize) -> Result<()> {
        let f = self.segments[seg].function;
        let func = &self.model.functions[f];
        let Some(inp) = self.model.head.forward.input_node(Source::HeadInput) else {
            return Ok(());
        };
        let pairs = self.head_pairs(d, seg);
        if pairs.dst.is_empty() {
            return Ok(());
        }
        let push = func
            .push
            .ok_or_else(|| CudaError::Model(format!("function `{}` pushes nothing", func.name)))?;
        let (Some(dst), Some(src)) = (
            self.own_tensor(GraphRef::Head, inp, WHOLE)?,
            self.own_tensor(GraphRef::Forward(f), push, seg)?,
        ) else {
            return Ok(());
        };
        let width = self.model.head.forward.nodes[inp].ty.width();
        let spec = MoveSpec {
            dst,
            src: Some(src),
            dst_rows: Some(self.words(&pairs.dst)),
            src_rows: Some(self.words(&pairs.src)),
            rows: pairs.dst.len(),
            width,
            accumulate: false,
        };
        self.emit_moves(
            format!("head input from segment {seg}"),
            Phase::Forward,
            vec![spec],
        );
        Ok(())
    }

    /// The head input's gradient of segment `seg`'s pushed rows added into
    /// their pushed-value gradient.
    fn push_grads(&mut self, d: &Dynamic<'_>, seg: usize) -> Result<()> {
        let f = self.segments[seg].function;
        let func = &self.model.functions[f];
        let hb = &self.model.head.backward;
        let Some(out) = hb.output(Role::HeadInputGrad) else {
            return Ok(());
        };
        let Some(pg) = func.output_grad_node(Role::Push) else {
            return Ok(());
        };
        let pairs = self.head_pairs(d, seg);
        if pairs.dst.is_empty() {
            return Ok(());
        }
        let (Some(src), Some(dst)) = (
            self.own_tensor(GraphRef::HeadBackward, out.node, WHOLE)?,
            self.own_tensor(GraphRef::Backward(f), pg, seg)?,
        ) else {
            return Ok(());
        };
        let width = hb.nodes[out.node].ty.width();
        let spec = MoveSpec {
            dst,
            src: Some(src),
            dst_rows: Some(self.words(&pairs.src)),
            src_rows: Some(self.words(&pairs.dst)),
            rows: pairs.dst.len(),
            width,
            accumulate: true,
        };
        self.emit_moves(
            format!("push gradients into segment {seg}"),
            Phase::Backward,
            vec![spec],
        );
        Ok(())
    }
}
