//! Running the batched engine's programs: a graph's steps over a row
//! range (eager, per task, lazy), fused elementwise groups, GEMMs and the
//! built-in ops, each on the rows' buffer views.

use std::collections::HashMap;

use cudarc::driver::CudaFunction;

use ramus_core::fusion::{FusedGroup, InputKind, SliceView};
use ramus_core::graph::{Graph, NodeId, NodeKind, Source, Space};
use ramus_core::op::OpDef;
use ramus_core::ops::Op;
use ramus_exec::Range;
use ramus_graph::Schedule;

use crate::blas::Gemm;
use crate::error::InCall;
use crate::error::Result;
use crate::launch::{FusedArgs, RowMove, SMALL_GEMM_ROWS};
use crate::pool::DeviceView;
use crate::program::{ExecStep, GraphProgram, PlannedStep, EAGER};

use super::{
    is_tokens, model_err, no_buffer, rows_of_view, u32_of, Buf, CudaEngine, Lane, Topology,
};

impl CudaEngine {
    /// Runs phase `phase` of graph `g`'s program over `range`; `f` names the vertex
    /// function whose topology (edges, children) the steps may use.
    #[allow(clippy::too_many_arguments)] // graph, steps, buffers, rows, function, lane
    pub(super) fn run_steps(
        &self,
        g: &Graph,
        prog: &GraphProgram,
        phase: usize,
        bufs: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        f: Option<usize>,
        lane: &Lane,
    ) -> Result<()> {
        let topo = f.map(|f| self.topology(f)).transpose()?;
        for step in &prog.phases[phase] {
            self.run_step(g, step, bufs, fwd, range, topo, lane, &prog.views)?;
        }
        Ok(())
    }

    /// Runs every function's eager steps on the eager lane once the pass's
    /// inputs are on the device, recording one event per function.
    pub(super) fn run_eager(
        &self,
        graphs: &[&Graph],
        programs: &[&GraphProgram],
        bufs: &[Vec<Buf>],
        fwd: Option<&[Vec<Buf>]>,
        s: &Schedule,
    ) -> Result<()> {
        self.inputs_ready
            .record(&self.main.stream)
            .in_call("cuEventRecord")?;
        self.eager
            .stream
            .wait(&self.inputs_ready)
            .in_call("cuStreamWaitEvent")?;
        for (f, g) in graphs.iter().enumerate() {
            let range = Range::all(&s.functions[f]);
            let fwd_f = fwd.map(|b| b[f].as_slice());
            self.run_steps(
                g,
                programs[f],
                EAGER,
                &bufs[f],
                fwd_f,
                range,
                Some(f),
                &self.eager,
            )?;
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

    #[allow(clippy::too_many_arguments)] // graph, step, buffers, rows, topology, lane, views
    pub(crate) fn run_step(
        &self,
        g: &Graph,
        step: &ExecStep,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
    ) -> Result<()> {
        match &step.step {
            PlannedStep::Fused(group) => {
                self.run_fused(g, group, step.kernel()?, own, fwd, range, topo, lane)
            }
            PlannedStep::GemmBias {
                matmul,
                bias,
                group,
            } => {
                let a_space = g.nodes[g.nodes[*matmul].inputs[0]].ty.space;
                let (lo, hi) = range.span(a_space);
                if hi - lo > SMALL_GEMM_ROWS {
                    self.run_op(g, *matmul, own, fwd, range, topo, lane, views)?;
                    return self.run_fused(g, group, step.kernel()?, own, fwd, range, topo, lane);
                }
                let bias = self.float_view(g, *bias, own, fwd, range)?;
                let out = self.float_view(g, group.nodes[0], own, fwd, range)?;
                self.run_matmul(g, *matmul, own, fwd, range, lane, views, Some(bias), out)
            }
            PlannedStep::Op(n) => self.run_op(g, *n, own, fwd, range, topo, lane, views),
        }
    }

    /// Launches fused group `group` (compiled as `kernel`) over `range`
    /// (child-sum and parent-row inputs read `topo`).
    #[allow(clippy::too_many_arguments)] // graph, group, kernel, buffers, rows, topology, lane
    pub(super) fn run_fused(
        &self,
        g: &Graph,
        group: &FusedGroup,
        kernel: &CudaFunction,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
    ) -> Result<()> {
        let stream = &lane.stream;
        let need_topo = || {
            topo.ok_or_else(|| {
                model_err("a child-sum or parent-row read outside a vertex function")
            })
        };
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
    #[allow(clippy::too_many_arguments)] // graph, node, buffers, rows, lane, views, bias, output
    pub(super) fn run_matmul(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
        bias: Option<DeviceView<f32>>,
        c: DeviceView<f32>,
    ) -> Result<()> {
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
            let lda = lda.unwrap_or(k);
            return self
                .launcher
                .gemm_abt_small(stream, c, a_view, lda, b_view, bias, (m, nn, k));
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

    #[allow(clippy::too_many_arguments)] // graph, node, buffers, rows, topology, lane, views
    pub(super) fn run_op(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
    ) -> Result<()> {
        let stream = lane.stream.clone();
        let node = &g.nodes[n];
        let NodeKind::Op(op) = &node.kind else {
            return Ok(());
        };
        let rows_of = |space: Space| {
            let (lo, hi) = range.span(space);
            hi - lo
        };
        let out_rows = rows_of(node.ty.space);
        let arg = |i: usize| node.inputs[i];
        let fv = |i: usize| self.float_view(g, arg(i), own, fwd, range);
        let out = || self.float_view(g, n, own, fwd, range);
        let in_ty = |i: usize| &g.nodes[arg(i)].ty;
        let need_topo =
            || topo.ok_or_else(|| model_err(format!("{} outside a vertex function", op.name())));
        match op {
            Op::MatMul(_) => self.run_matmul(g, n, own, fwd, range, lane, views, None, out()?),
            Op::Concat(_) => {
                let (o, ow) = (out()?, node.ty.width());
                let mut start = 0;
                for i in 0..node.inputs.len() {
                    let w = in_ty(i).width();
                    self.launcher
                        .copy_columns(&stream, o, ow, start, fv(i)?, w, 0, w, out_rows)?;
                    start += w;
                }
                Ok(())
            }
            Op::Slice(sl) => {
                let w = in_ty(0).width();
                self.launcher.copy_columns(
                    &stream,
                    out()?,
                    sl.len,
                    0,
                    fv(0)?,
                    w,
                    sl.start,
                    sl.len,
                    out_rows,
                )
            }
            Op::Pad(pad) => {
                let (o, w) = (out()?, in_ty(0).width());
                self.launcher.fill(&stream, o, 0.0)?;
                self.launcher.copy_columns(
                    &stream,
                    o,
                    pad.total,
                    pad.start,
                    fv(0)?,
                    w,
                    0,
                    w,
                    out_rows,
                )
            }
            Op::SumChildren(_) => {
                let t = need_topo()?;
                let offsets = t.edge_offsets.slice(range.r0..range.r1 + 1)?;
                let width = node.ty.width();
                // a viewed slice: the rows of its source, read with a stride
                let (src, window) = match views.get(&arg(0)) {
                    Some(v) => (
                        self.float_view(g, v.source, own, fwd, range)?,
                        (v.stride, v.offset),
                    ),
                    None => (fv(0)?, (width, 0)),
                };
                self.launcher.sum_children(
                    &stream,
                    out()?,
                    src,
                    window,
                    offsets,
                    range.e0,
                    out_rows,
                    width,
                )
            }
            Op::ExpandChildren(_) => {
                let t = need_topo()?;
                let parent = t.edge_parent.slice(range.e0..range.e1)?;
                self.launcher.expand_children(
                    &stream,
                    out()?,
                    fv(0)?,
                    parent,
                    range.r0,
                    out_rows,
                    node.ty.width(),
                )
            }
            Op::SumRows(sr) => {
                let rows = rows_of(in_ty(0).space);
                let scale = mean_scale(sr.mean, rows);
                self.launcher
                    .sum_rows(&stream, out()?, fv(0)?, rows, in_ty(0).width(), scale)
            }
            Op::BroadcastRows(br) => {
                let rows = rows_of(in_ty(1).space);
                let scale = mean_scale(br.mean, rows);
                self.launcher
                    .broadcast_rows(&stream, out()?, fv(0)?, rows, node.ty.width(), scale)
            }
            Op::Reshape(_) => {
                let len = node.ty.width();
                self.launcher
                    .copy_columns(&stream, out()?, len, 0, fv(0)?, len, 0, len, 1)
            }
            Op::Embedding(_) => {
                let table = in_ty(0);
                let (vocab, h) = (table.shape[0], table.shape[1]);
                let idx = self.index_view(g, arg(1), own, fwd, range)?;
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
                    &stream,
                    &[RowMove {
                        dst: out()?,
                        src: fv(0)?,
                        dst_rows: None,
                        src_rows: Some(idx),
                        rows: out_rows,
                        width: h,
                        accumulate: false,
                    }],
                )
            }
            Op::RowMatMul(product) => self.launcher.row_matmul(
                &stream,
                out()?,
                fv(0)?,
                in_ty(0).is_rows(),
                fv(1)?,
                in_ty(1).is_rows(),
                out_rows,
                product,
            ),
            Op::EmbeddingUnk(_) | Op::EmbeddingUnkBackward(_) => {
                let unk_backward = match op {
                    Op::EmbeddingUnkBackward(b) => Some(b),
                    _ => None,
                };
                let tokens = self.index_view(g, arg(1), own, fwd, range)?;
                let (table_rows, width) = match unk_backward {
                    Some(b) => (b.rows, in_ty(0).width()),
                    None => (in_ty(0).shape[0], in_ty(0).shape[1]),
                };
                let rows = rows_of(in_ty(1).space);
                self.launcher.embedding_unk(
                    &stream,
                    out()?,
                    fv(0)?,
                    tokens,
                    rows,
                    table_rows,
                    width,
                    unk_backward.is_some(),
                )
            }
            Op::SoftmaxXent(_) | Op::SoftmaxXentBackward(_) => {
                let xent = matches!(op, Op::SoftmaxXent(_));
                let classes = in_ty(0).width();
                if self.state.max_label as usize >= classes {
                    return Err(model_err(format!(
                        "softmax_xent: label {} out of range for {classes} classes",
                        self.state.max_label
                    )));
                }
                let labels = self.index_view(g, arg(1), own, fwd, range)?;
                let up = if xent { None } else { Some(fv(2)?) };
                self.launcher
                    .softmax_xent(&stream, out()?, fv(0)?, labels, up, out_rows, classes)
            }
            ramus_core::image_op!() => self.run_cnn_op(op, g, n, own, fwd, range, lane),
            // elementwise ops run inside fused groups (`Program`), never alone
            ramus_core::elementwise_op!() => Err(model_err(format!(
                "op `{}` (node %{n}) has no CUDA implementation",
                op.signature()
            ))),
        }
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
