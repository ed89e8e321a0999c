//! Running the batched engine's programs: a graph's steps over a row
//! range (eager, per task, lazy), fused elementwise groups, GEMMs and the
//! built-in ops, each on the rows' buffer views.

use std::collections::HashMap;

use cudarc::driver::CudaFunction;

use ramus_core::fusion::{FusedGroup, InputKind, SliceView};
use ramus_core::graph::{Graph, Node, NodeId, NodeKind, Source, Space, ValueType};
use ramus_core::op::OpDef;
use ramus_core::ops::Op;
use ramus_exec::Range;
use ramus_graph::Schedule;

use crate::blas::Gemm;
use crate::error::{CudaError, InCall, Result};
use crate::launch::{
    AbtOperands, ColumnWindow, EmbeddingShape, FusedArgs, IndexRows, RowMove, RowOperand,
    XentOperands, SMALL_GEMM_ROWS,
};
use crate::pool::DeviceView;
use crate::program::{ExecStep, GraphProgram, PlannedStep, EAGER};

use super::overlap::{Overlap, PhaseRun};
use super::{
    is_tokens, model_err, no_buffer, rows_of_view, u32_of, Buf, CudaEngine, GraphBufs, Lane,
    Topology,
};

/// What one step runs on: the graph and its buffers, the rows of this run,
/// the vertex function's topology (`None` in the head), the lane and the
/// program's viewed slices (read in place from their sources).
#[derive(Clone, Copy)]
struct StepCtx<'a> {
    bufs: GraphBufs<'a>,
    range: Range,
    topo: Option<&'a Topology>,
    lane: &'a Lane,
    views: &'a HashMap<NodeId, SliceView>,
}

impl StepCtx<'_> {
    /// Rows of `space` in this run.
    fn rows_of(&self, space: Space) -> usize {
        let (lo, hi) = self.range.span(space);
        hi - lo
    }

    /// The topology, or an error naming `what` when the step runs outside
    /// a vertex function.
    fn need_topo(&self, what: &str) -> Result<&Topology> {
        self.topo
            .ok_or_else(|| model_err(format!("{what} outside a vertex function")))
    }
}

impl CudaEngine {
    /// Runs phase `phase` of graph `bufs.g`'s program over `range`; `f` names the vertex
    /// function whose topology (edges, children) the steps may use.
    pub(super) fn run_steps(
        &self,
        bufs: GraphBufs<'_>,
        prog: &GraphProgram,
        phase: usize,
        range: Range,
        f: Option<usize>,
        lane: &Lane,
    ) -> Result<()> {
        let topo = f.map(|f| self.topology(f)).transpose()?;
        for step in &prog.phases[phase] {
            self.run_step(bufs, step, range, topo, lane, &prog.views)?;
        }
        Ok(())
    }

    /// Runs every function's eager steps on the eager lane once the pass's
    /// inputs are on the device, recording one event per function; with
    /// `overlap` (a backward pass), adds the gradients they finish as they
    /// do.
    pub(super) fn run_eager(
        &self,
        graphs: &[GraphBufs<'_>],
        programs: &[&GraphProgram],
        s: &Schedule,
        mut overlap: Option<&mut Overlap<'_>>,
    ) -> Result<()> {
        self.inputs_ready
            .record(&self.main.stream)
            .in_call("cuEventRecord")?;
        self.eager
            .stream
            .wait(&self.inputs_ready)
            .in_call("cuStreamWaitEvent")?;
        for (f, &bufs) in graphs.iter().enumerate() {
            let run = PhaseRun {
                bufs,
                prog: programs[f],
                phase: EAGER,
                range: Range::all(&s.functions[f]),
                f: Some(f),
                lane: &self.eager,
            };
            match overlap.as_deref_mut() {
                Some(overlap) => {
                    let order = overlap.sums.order();
                    self.run_reporting(run, order.eager_after(f), overlap)?
                }
                None => self.run_steps(bufs, run.prog, EAGER, run.range, run.f, run.lane)?,
            }
            self.eager_done[f]
                .record(&self.eager.stream)
                .in_call("cuEventRecord")?;
        }
        Ok(())
    }

    /// Makes the main lane wait for function `f`'s eager steps (once).
    pub(super) fn join_eager(&self, f: usize, joined: &mut [bool]) -> Result<()> {
        if !joined[f] {
            self.main
                .stream
                .wait(&self.eager_done[f])
                .in_call("cuStreamWaitEvent")?;
            joined[f] = true;
        }
        Ok(())
    }

    /// The buffer of node `n` (a backward graph's `Forward(m)` inputs live
    /// in the forward buffers; parameters in the parameter buffer).
    pub(super) fn buf(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
    ) -> Result<Buf> {
        match g.nodes[n].kind {
            NodeKind::Param(p) => Ok(Buf::Floats(
                *self
                    .param_views()?
                    .values
                    .get(p)
                    .ok_or_else(|| model_err(format!("no parameter {p}")))?,
            )),
            NodeKind::Input(Source::Forward(m)) => {
                let fwd = fwd
                    .ok_or_else(|| model_err("forward value requested outside a backward graph"))?;
                Ok(fwd[m])
            }
            _ => Ok(own[n]),
        }
    }

    /// Node `n`'s floats restricted to `range` (whole for static values).
    pub(crate) fn float_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
    ) -> Result<DeviceView<f32>> {
        let v = self.whole_view(g, n, own, fwd)?;
        rows_of_view(v, &g.nodes[n].ty, range)
    }

    /// Node `n`'s whole float buffer.
    pub(crate) fn whole_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
    ) -> Result<DeviceView<f32>> {
        match self.buf(g, n, own, fwd)? {
            Buf::Floats(v) => Ok(v),
            _ => Err(no_buffer(g, n, "float")),
        }
    }

    /// Node `n`'s indices restricted to `range`.
    pub(super) fn index_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
    ) -> Result<DeviceView<u32>> {
        match self.buf(g, n, own, fwd)? {
            Buf::Indices(v) => rows_of_view(v, &g.nodes[n].ty, range),
            _ => Err(no_buffer(g, n, "index")),
        }
    }

    /// Runs `step` of graph `bufs.g` over `range` on `lane` (`views`: the
    /// program's viewed slices).
    pub(crate) fn run_step(
        &self,
        bufs: GraphBufs<'_>,
        step: &ExecStep,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
    ) -> Result<()> {
        let ctx = &StepCtx {
            bufs,
            range,
            topo,
            lane,
            views,
        };
        let GraphBufs { g, own, fwd } = bufs;
        match &step.step {
            PlannedStep::Fused(group) => self.run_fused(ctx, group, step.kernel()?),
            PlannedStep::GemmBias {
                matmul,
                bias,
                group,
            } => {
                let a_space = g.nodes[g.nodes[*matmul].inputs[0]].ty.space;
                let (lo, hi) = range.span(a_space);
                if hi - lo > SMALL_GEMM_ROWS {
                    self.run_op(ctx, *matmul)?;
                    return self.run_fused(ctx, group, step.kernel()?);
                }
                let bias = self.float_view(g, *bias, own, fwd, range)?;
                let out = self.float_view(g, group.nodes[0], own, fwd, range)?;
                self.run_matmul(ctx, *matmul, Some(bias), out)
            }
            PlannedStep::Op(n) => self.run_op(ctx, *n),
        }
    }

    /// Launches fused group `group` (compiled as `kernel`) over the rows of
    /// `ctx` (child-sum and parent-row inputs read its topology).
    fn run_fused(
        &self,
        ctx: &StepCtx<'_>,
        group: &FusedGroup,
        kernel: &CudaFunction,
    ) -> Result<()> {
        let StepCtx {
            bufs: GraphBufs { g, own, fwd },
            range,
            lane,
            ..
        } = *ctx;
        let stream = &lane.stream;
        let need_topo = || ctx.need_topo("a child-sum or parent-row read");
        let (lo, hi) = range.span(group.space);
        let n = (hi - lo) * group.width;
        if n == 0 {
            return Ok(());
        }
        let mut args = FusedArgs {
            n,
            width: group.width,
            ..FusedArgs::default()
        };
        let mut concat_strides = Vec::new();
        for input in &group.inputs {
            let view = match input.kind {
                InputKind::Window {
                    source,
                    offset,
                    stride,
                } => {
                    args.strides.push([
                        u32_of(stride, "window stride")?,
                        u32_of(offset, "window offset")?,
                    ]);
                    self.float_view(g, source, own, fwd, range)?
                }
                InputKind::PerElement | InputKind::Broadcast => {
                    self.float_view(g, input.node, own, fwd, range)?
                }
                InputKind::ChildSum { source } => {
                    let t = need_topo()?;
                    args.csr.push((
                        t.edge_offsets.slice(range.r0..range.r1 + 1)?,
                        u32_of(range.e0, "edge base")?,
                    ));
                    self.float_view(g, source, own, fwd, range)?
                }
                InputKind::ParentRow { source } => {
                    let t = need_topo()?;
                    args.csr.push((
                        t.edge_parent.slice(range.e0..range.e1)?,
                        u32_of(range.r0, "row base")?,
                    ));
                    self.float_view(g, source, own, fwd, range)?
                }
            };
            args.inputs.push(view);
        }
        for &o in &group.outputs {
            args.outputs.push(self.float_view(g, o, own, fwd, range)?);
        }
        for cw in &group.concat_writes {
            args.concats
                .push(self.float_view(g, cw.concat, own, fwd, range)?);
            concat_strides.push([
                u32_of(cw.stride, "concat stride")?,
                u32_of(cw.offset, "concat offset")?,
            ]);
        }
        args.strides.extend(concat_strides);
        self.launcher.fused(stream, kernel, &args)
    }

    /// Matmul node `n` into `c`, plus a broadcast `bias` row if given:
    /// over few rows a product `A·Bᵀ` with a static `B` runs on the
    /// small-product kernel (which also adds the bias), anything else on
    /// cuBLAS (a bias needs the small kernel: callers fall back before).
    fn run_matmul(
        &self,
        ctx: &StepCtx<'_>,
        n: NodeId,
        bias: Option<DeviceView<f32>>,
        c: DeviceView<f32>,
    ) -> Result<()> {
        let StepCtx {
            bufs: GraphBufs { g, own, fwd },
            range,
            lane,
            views,
            ..
        } = *ctx;
        let node = &g.nodes[n];
        let Some(Op::MatMul(mm)) = node.op() else {
            return Err(model_err(format!("%{n} is not a matmul")));
        };
        let arg = |i: usize| node.inputs[i];
        let (a, b) = (&g.nodes[arg(0)].ty, &g.nodes[arg(1)].ty);
        let rows_of = |space: Space| {
            let (lo, hi) = range.span(space);
            hi - lo
        };
        let dims = |t: &ramus_core::ValueType, rows: usize| {
            if t.is_rows() {
                (rows, t.width())
            } else {
                (t.shape[0], t.shape[1])
            }
        };
        let (ar, ac) = dims(a, rows_of(a.space));
        let (br, bc) = dims(b, rows_of(b.space));
        let (m, k) = if mm.trans_a { (ac, ar) } else { (ar, ac) };
        let nn = if mm.trans_b { br } else { bc };
        if m * nn == 0 {
            return Ok(());
        }
        // a viewed slice is read in place: its source, from the column
        // offset, with the source's row width as leading dimension
        let operand = |i: usize| -> Result<(DeviceView<f32>, Option<usize>)> {
            match views.get(&arg(i)) {
                Some(v) => {
                    let (lo, hi) = range.span(g.nodes[v.source].ty.space);
                    let src = self.whole_view(g, v.source, own, fwd)?;
                    Ok((
                        src.slice(lo * v.stride + v.offset..hi * v.stride)?,
                        Some(v.stride),
                    ))
                }
                None => Ok((self.float_view(g, arg(i), own, fwd, range)?, None)),
            }
        };
        let ((a_view, lda), (b_view, ldb)) = (operand(0)?, operand(1)?);
        let stream = &lane.stream;
        let small = !mm.trans_a && mm.trans_b && !b.is_rows() && ldb.is_none();
        if small && m <= SMALL_GEMM_ROWS && k > 0 {
            let operands = AbtOperands {
                a: a_view,
                lda: lda.unwrap_or(k),
                b: b_view,
                bias,
            };
            return (self.launcher).gemm_abt_small(stream, c, operands, (m, nn, k));
        }
        if bias.is_some() {
            return Err(model_err(format!(
                "%{n}: a bias is added in the product only over at most {SMALL_GEMM_ROWS} rows"
            )));
        }
        if k == 0 {
            return self.launcher.fill(stream, c, 0.0);
        }
        let gemm = Gemm {
            trans_a: mm.trans_a,
            trans_b: mm.trans_b,
            lda,
            ldb,
            ..Gemm::new(m, nn, k)
        };
        lane.blas.sgemm(&gemm, a_view, b_view, c)?;
        self.launcher.count();
        Ok(())
    }

    /// Runs node `n`, a built-in op, over the rows of `ctx` (elementwise
    /// ops run inside fused groups, never alone).
    fn run_op(&self, ctx: &StepCtx<'_>, n: NodeId) -> Result<()> {
        let node = &ctx.bufs.g.nodes[n];
        let NodeKind::Op(op) = &node.kind else {
            return Ok(());
        };
        let site = &NodeSite { ctx, n, node };
        let stream = &ctx.lane.stream;
        let fv = |i: usize| self.input(site, i);
        let out = || self.output(site);
        match op {
            Op::MatMul(_) => self.run_matmul(ctx, n, None, out()?),
            Op::Concat(_) | Op::Slice(_) | Op::Pad(_) | Op::Reshape(_) => {
                self.run_column_op(site, op)
            }
            Op::SumChildren(_) | Op::ExpandChildren(_) => self.run_topology_op(site, op),
            Op::SumRows(sr) => {
                let rows = ctx.rows_of(site.in_ty(0).space);
                let scale = mean_scale(sr.mean, rows);
                let width = site.in_ty(0).width();
                (self.launcher).sum_rows(stream, out()?, fv(0)?, rows, width, scale)
            }
            Op::BroadcastRows(br) => {
                let rows = ctx.rows_of(site.in_ty(1).space);
                let scale = mean_scale(br.mean, rows);
                let width = node.ty.width();
                (self.launcher).broadcast_rows(stream, out()?, fv(0)?, rows, width, scale)
            }
            Op::Embedding(_) => self.run_embedding(site),
            Op::RowMatMul(product) => self.launcher.row_matmul(
                stream,
                out()?,
                RowOperand {
                    data: fv(0)?,
                    per_row: site.in_ty(0).is_rows(),
                },
                RowOperand {
                    data: fv(1)?,
                    per_row: site.in_ty(1).is_rows(),
                },
                site.out_rows(),
                product,
            ),
            Op::EmbeddingUnk(_) | Op::EmbeddingUnkBackward(_) => self.run_embedding_unk(site, op),
            Op::SoftmaxXent(_) | Op::SoftmaxXentBackward(_) => self.run_softmax_xent(site, op),
            ramus_core::image_op!() => self.run_cnn_op(op, ctx.bufs, n, ctx.range, ctx.lane),
            // elementwise ops run inside fused groups (`Program`), never alone
            ramus_core::elementwise_op!() => Err(model_err(format!(
                "op `{}` (node %{n}) has no CUDA implementation",
                op.signature()
            ))),
        }
    }

    /// Node `n`'s floats over the rows of `ctx`.
    fn step_view(&self, ctx: &StepCtx<'_>, n: NodeId) -> Result<DeviceView<f32>> {
        let GraphBufs { g, own, fwd } = ctx.bufs;
        self.float_view(g, n, own, fwd, ctx.range)
    }

    /// Input `i` of the node at `site`, as floats of this run's rows.
    fn input(&self, site: &NodeSite<'_>, i: usize) -> Result<DeviceView<f32>> {
        self.step_view(site.ctx, site.arg(i))
    }

    /// Input `i` of the node at `site`, as indices of this run's rows.
    fn input_indices(&self, site: &NodeSite<'_>, i: usize) -> Result<DeviceView<u32>> {
        let GraphBufs { g, own, fwd } = site.ctx.bufs;
        self.index_view(g, site.arg(i), own, fwd, site.ctx.range)
    }

    /// The output of the node at `site`, as floats of this run's rows.
    fn output(&self, site: &NodeSite<'_>) -> Result<DeviceView<f32>> {
        self.step_view(site.ctx, site.n)
    }

    /// Column copies: concat, slice, pad and reshape.
    fn run_column_op(&self, site: &NodeSite<'_>, op: &Op) -> Result<()> {
        let stream = &site.ctx.lane.stream;
        let (node, out_rows) = (site.node, site.out_rows());
        let fv = |i: usize| self.input(site, i);
        let out = || self.output(site);
        match op {
            Op::Concat(_) => {
                let (o, ow) = (out()?, node.ty.width());
                let mut start = 0;
                for i in 0..node.inputs.len() {
                    let w = site.in_ty(i).width();
                    let (dst, src) = (
                        ColumnWindow::new(o, ow, start),
                        ColumnWindow::whole(fv(i)?, w),
                    );
                    self.launcher.copy_columns(stream, dst, src, w, out_rows)?;
                    start += w;
                }
                Ok(())
            }
            Op::Slice(sl) => {
                let w = site.in_ty(0).width();
                let (dst, src) = (
                    ColumnWindow::whole(out()?, sl.len),
                    ColumnWindow::new(fv(0)?, w, sl.start),
                );
                (self.launcher).copy_columns(stream, dst, src, sl.len, out_rows)
            }
            Op::Pad(pad) => {
                let (o, w) = (out()?, site.in_ty(0).width());
                self.launcher.fill(stream, o, 0.0)?;
                let (dst, src) = (
                    ColumnWindow::new(o, pad.total, pad.start),
                    ColumnWindow::whole(fv(0)?, w),
                );
                self.launcher.copy_columns(stream, dst, src, w, out_rows)
            }
            Op::Reshape(_) => {
                let len = node.ty.width();
                self.launcher.copy_rows(stream, out()?, fv(0)?, len, 1)
            }
            _ => Err(site.not_a(op, "column copy")),
        }
    }

    /// Topology ops: a child sum over the CSR edges, or each edge reading
    /// its parent's row.
    fn run_topology_op(&self, site: &NodeSite<'_>, op: &Op) -> Result<()> {
        let ctx = site.ctx;
        let (stream, range) = (&ctx.lane.stream, ctx.range);
        let (width, out_rows) = (site.node.ty.width(), site.out_rows());
        let t = ctx.need_topo(op.name())?;
        match op {
            Op::SumChildren(_) => {
                let offsets = IndexRows {
                    index: t.edge_offsets.slice(range.r0..range.r1 + 1)?,
                    base: range.e0,
                };
                // a viewed slice: the rows of its source, read with a stride
                let src = match ctx.views.get(&site.arg(0)) {
                    Some(v) => {
                        ColumnWindow::new(self.step_view(ctx, v.source)?, v.stride, v.offset)
                    }
                    None => ColumnWindow::whole(self.input(site, 0)?, width),
                };
                let out = self.output(site)?;
                (self.launcher).sum_children(stream, out, src, offsets, out_rows, width)
            }
            Op::ExpandChildren(_) => {
                let parent = IndexRows {
                    index: t.edge_parent.slice(range.e0..range.e1)?,
                    base: range.r0,
                };
                let (out, src) = (self.output(site)?, self.input(site, 0)?);
                (self.launcher).expand_children(stream, out, src, parent, out_rows, width)
            }
            _ => Err(site.not_a(op, "topology op")),
        }
    }

    /// An embedding: rows of its table by the vertex tokens.
    fn run_embedding(&self, site: &NodeSite<'_>) -> Result<()> {
        let (range, topo) = (site.ctx.range, site.ctx.topo);
        let table = site.in_ty(0);
        let (vocab, h) = (table.shape[0], table.shape[1]);
        let idx = self.input_indices(site, 1)?;
        match topo {
            Some(t) if is_tokens(idx, t, range) => {
                if t.max_token as usize >= vocab {
                    return Err(model_err(format!(
                        "embedding: token id {} out of range for a table of {vocab} rows",
                        t.max_token
                    )));
                }
            }
            _ => {
                return Err(model_err(
                    "embedding: the CUDA engine looks up rows by the vertex tokens only",
                ))
            }
        }
        self.launcher.move_rows(
            &site.ctx.lane.stream,
            &[RowMove {
                dst: self.output(site)?,
                src: self.input(site, 0)?,
                dst_rows: None,
                src_rows: Some(idx),
                rows: site.out_rows(),
                width: h,
                accumulate: false,
            }],
        )
    }

    /// `embedding_unk` (`op`), or its table gradient.
    fn run_embedding_unk(&self, site: &NodeSite<'_>, op: &Op) -> Result<()> {
        let unk_backward = match op {
            Op::EmbeddingUnkBackward(b) => Some(b),
            _ => None,
        };
        let tokens = self.input_indices(site, 1)?;
        let table = site.in_ty(0);
        let (table_rows, width) = match unk_backward {
            Some(b) => (b.rows, table.width()),
            None => (table.shape[0], table.shape[1]),
        };
        let shape = EmbeddingShape {
            rows: site.ctx.rows_of(site.in_ty(1).space),
            table_rows,
            width,
        };
        self.launcher.embedding_unk(
            &site.ctx.lane.stream,
            self.output(site)?,
            self.input(site, 0)?,
            tokens,
            shape,
            unk_backward.is_some(),
        )
    }

    /// Softmax cross-entropy (`op`), or its gradient.
    fn run_softmax_xent(&self, site: &NodeSite<'_>, op: &Op) -> Result<()> {
        let xent = matches!(op, Op::SoftmaxXent(_));
        let classes = site.in_ty(0).width();
        if self.state.max_label as usize >= classes {
            return Err(model_err(format!(
                "softmax_xent: label {} out of range for {classes} classes",
                self.state.max_label
            )));
        }
        let operands = XentOperands {
            scores: self.input(site, 0)?,
            labels: self.input_indices(site, 1)?,
            upstream: if xent {
                None
            } else {
                Some(self.input(site, 2)?)
            },
        };
        let (out, rows) = (self.output(site)?, site.out_rows());
        (self.launcher).softmax_xent(&site.ctx.lane.stream, out, operands, rows, classes)
    }
}

/// Node `n` of a step (`node`), for the op helpers: its inputs and rows.
struct NodeSite<'a> {
    ctx: &'a StepCtx<'a>,
    n: NodeId,
    node: &'a Node,
}

impl<'a> NodeSite<'a> {
    /// The node's input `i`.
    fn arg(&self, i: usize) -> NodeId {
        self.node.inputs[i]
    }

    /// The value type of input `i`.
    fn in_ty(&self, i: usize) -> &'a ValueType {
        &self.ctx.bufs.g.nodes[self.node.inputs[i]].ty
    }

    /// Rows of the node's output in this run.
    fn out_rows(&self) -> usize {
        self.ctx.rows_of(self.node.ty.space)
    }

    /// The error of a helper handed an op (`op`) of another family.
    fn not_a(&self, op: &Op, family: &str) -> CudaError {
        model_err(format!(
            "op `{}` (node %{}) is not a {family}",
            op.signature(),
            self.n
        ))
    }
}

/// The factor a row sum is scaled by: `1 / rows` for a mean (over at least
/// one row), else 1.
fn mean_scale(mean: bool, rows: usize) -> f32 {
    if mean && rows > 0 {
        1.0 / rows as f32
    } else {
        1.0
    }
}
