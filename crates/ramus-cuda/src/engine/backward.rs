//! The batched engine's backward pass: the tasks in reverse, child
//! gradients accumulated into the state-gradient buffer, parameter
//! gradients accumulated on the device and brought back to the host (dense
//! ones in one copy, embedding rows only where touched).

use cudarc::driver::CudaStream;
use ramus_core::graph::{Graph, NodeKind, Role, Source};
use ramus_core::{Grads, Model, Params};
use ramus_exec::{Batch, Range};
use ramus_graph::Schedule;

use crate::error::Result;
use crate::launch::RowMove;
use crate::program::{GraphProgram, LAZY, PER_TASK};

use super::overlap::{grad_param, Overlap, PhaseRun};
use super::{is_tokens, model_err, Buf, CudaEngine, GraphBufs, Topology};

impl CudaEngine {
    pub(super) fn backward_pass(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        grads: &mut Grads<f32>,
    ) -> Result<()> {
        self.backward_on_device(model, params, batch, None)?;
        self.download_grads(model, &batch.schedule, grads)
    }

    /// The backward pass up to the parameter gradients in device memory;
    /// with `overlap`, each summed over the ranks as soon as it is done.
    pub(super) fn backward_on_device(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mut overlap: Option<&mut Overlap<'_>>,
    ) -> Result<()> {
        if !std::mem::take(&mut self.state.forward_done) {
            return Err(model_err(
                "backward needs a preceding forward pass in train mode",
            ));
        }
        self.check_model(model)?;
        if self.params.as_ref().map(|p| p.version) != Some(params.version()) {
            return Err(model_err(
                "the parameters changed between the forward and the backward pass",
            ));
        }
        let s = &batch.schedule;
        let stream = self.device.stream().clone();
        let w = model.state_width;
        let grad_all = self.param_views()?.grad_all;
        self.launcher.fill(&stream, grad_all, 0.0)?;
        // head backward
        let head = &model.head;
        let hb = &head.backward;
        let h = self.state.head_vertices.len();
        let program = self.program.clone();
        let head_bwd = self.alloc_bufs(hb, &program.head_backward, h, 0, None)?;
        self.seed_output_grads(hb, &head_bwd, &head.forward)?;
        let head_fwd = std::mem::take(&mut self.state.head_fwd);
        let head_bufs = GraphBufs::new(hb, &head_bwd, Some(&head_fwd));
        let run = PhaseRun {
            bufs: head_bufs,
            prog: &program.head_backward,
            phase: 0,
            range: Range::rows_only(h),
            f: None,
            lane: &self.main,
        };
        match overlap.as_deref_mut() {
            Some(overlap) => {
                let order = overlap.sums.order();
                self.run_reporting(run, order.head_after(), overlap)?
            }
            None => {
                self.run_steps(run.bufs, run.prog, 0, run.range, None, run.lane)?;
                self.accumulate_param_grads(head_bufs, run.range, None)?;
            }
        }
        // per function backward buffers; push gradients from the head
        let fwd = std::mem::take(&mut self.state.fwd);
        let mut bwd = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let fr = &s.functions[f];
            let tokens = self.state.topo[f].as_ref().map(|t| t.tokens);
            let bufs = self.alloc_bufs(
                &func.backward,
                &program.functions[f].1,
                fr.rows(),
                fr.edges(),
                tokens,
            )?;
            self.seed_output_grads(&func.backward, &bufs, &func.forward)?;
            bwd.push(bufs);
        }
        if let Some(out) = hb.output(Role::HeadInputGrad) {
            let src = self.float_view(
                hb,
                out.node,
                &head_bwd,
                Some(&head_fwd),
                Range::rows_only(h),
            )?;
            let pw = hb.nodes[out.node].ty.width();
            let moves = self.push_grad_moves(model, src, pw, |f, pg| bwd[f][pg])?;
            self.launcher.move_rows(&stream, &moves)?;
        }
        let state_grad = self.arena_alloc::<f32>(s.num_vertices() * w, &|| {
            "the vertex-state gradients".into()
        })?;
        self.launcher.fill(&stream, state_grad, 0.0)?;
        let backward = model.functions.iter().map(|f| &f.backward);
        let graphs = GraphBufs::each(backward, &bwd, Some(&fwd));
        let programs: Vec<&GraphProgram> = program.functions.iter().map(|p| &p.1).collect();
        self.run_eager(&graphs, &programs, s, overlap.as_deref_mut())?;
        let mut joined = vec![false; model.functions.len()];
        for task in s.tasks.iter().rev() {
            let f = task.function;
            let func = &model.functions[f];
            let range = Range::task(task);
            self.join_eager(f, &mut joined)?;
            let topo = self.topology(f)?;
            if let Some(sg) = func.output_grad_node(Role::Scatter) {
                if let Buf::Floats(dst) = bwd[f][sg] {
                    let len = task.len as usize;
                    let src = state_grad
                        .slice(task.begin as usize * w..(task.begin as usize + len) * w)?;
                    let dst = dst.slice(range.r0 * w..range.r1 * w)?;
                    self.launcher.copy_rows(&stream, dst, src, w, len)?;
                }
            }
            self.run_steps(graphs[f], programs[f], PER_TASK, range, Some(f), &self.main)?;
            let mut moves = Vec::new();
            for o in &func.backward.outputs {
                let (dst_rows, lo, hi) = match o.role {
                    Role::ChildGrad(k) => (
                        topo.children
                            .get(k)
                            .copied()
                            .ok_or_else(|| model_err(format!("child gradient {k} beyond arity")))?,
                        range.r0,
                        range.r1,
                    ),
                    Role::ChildGradAll => (topo.edge_child, range.e0, range.e1),
                    _ => continue,
                };
                let (g, own, fwd) = (graphs[f].g, graphs[f].own, graphs[f].fwd);
                let src = self.float_view(g, o.node, own, fwd, range)?;
                moves.push(RowMove {
                    dst: state_grad,
                    src,
                    dst_rows: Some(dst_rows.slice(lo..hi)?),
                    src_rows: None,
                    rows: hi - lo,
                    width: w,
                    accumulate: true,
                });
            }
            self.launcher.move_rows(&stream, &moves)?;
        }
        self.lazy_phases(&graphs, &programs, s, &mut joined, overlap)
    }

    /// Every vertex function's lazy steps, then its parameter gradients
    /// added (with `overlap`: those its eager steps did not add already).
    fn lazy_phases(
        &self,
        graphs: &[GraphBufs<'_>],
        programs: &[&GraphProgram],
        s: &Schedule,
        joined: &mut [bool],
        mut overlap: Option<&mut Overlap<'_>>,
    ) -> Result<()> {
        for (f, &bufs) in graphs.iter().enumerate() {
            self.join_eager(f, joined)?;
            let range = Range::all(&s.functions[f]);
            self.run_steps(bufs, programs[f], LAZY, range, Some(f), &self.main)?;
            let topo = self.topology(f)?;
            let Some(overlap) = overlap.as_deref_mut() else {
                self.accumulate_param_grads(bufs, range, Some(topo))?;
                continue;
            };
            for &o in overlap.sums.order().lazy(f) {
                let out = &bufs.g.outputs[o];
                self.accumulate_output(bufs, out, range, Some(topo), &self.main.stream)?;
                if let Some(p) = grad_param(out) {
                    overlap.arrived(self, p, &self.main)?;
                }
            }
        }
        Ok(())
    }

    /// Zeroes every `OutputGrad` input of a backward graph, then seeds the
    /// loss gradient with 1.
    pub(super) fn seed_output_grads(
        &mut self,
        g: &Graph,
        bufs: &[Buf],
        forward: &Graph,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        for (n, node) in g.nodes.iter().enumerate() {
            if let (NodeKind::Input(Source::OutputGrad(i)), Buf::Floats(v)) = (&node.kind, bufs[n])
            {
                let is_loss = forward
                    .outputs
                    .get(*i)
                    .is_some_and(|o| o.role == Role::Loss);
                self.launcher
                    .fill(&stream, v, if is_loss { 1.0 } else { 0.0 })?;
            }
        }
        Ok(())
    }

    /// Adds a backward graph's parameter-gradient outputs into the device
    /// gradient buffer, on the main lane.
    pub(super) fn accumulate_param_grads(
        &self,
        bufs: GraphBufs<'_>,
        range: Range,
        topo: Option<&Topology>,
    ) -> Result<()> {
        for o in &bufs.g.outputs {
            self.accumulate_output(bufs, o, range, topo, &self.main.stream)?;
        }
        Ok(())
    }

    /// Adds output `o` of backward graph `bufs.g` over `range` into its
    /// parameter's device gradient if it is one (dense, or an embedding
    /// table's rows indexed by the vertex tokens), on `stream`.
    pub(crate) fn accumulate_output(
        &self,
        bufs: GraphBufs<'_>,
        o: &ramus_core::graph::Output,
        range: Range,
        topo: Option<&Topology>,
        stream: &CudaStream,
    ) -> Result<()> {
        let GraphBufs { g, own, fwd } = bufs;
        match o.role {
            Role::ParamGrad(p) => {
                let src = self.float_view(g, o.node, own, fwd, range)?;
                let dst = self.param_views()?.grads[p];
                self.launcher.scale_add(stream, (dst, 1.0), (src, 1.0))?;
            }
            Role::ParamRowGrad(p) => {
                let values = self.float_view(g, o.node, own, fwd, range)?;
                let index_node = o.aux.unwrap_or(o.node);
                let index = self.index_view(g, index_node, own, fwd, range)?;
                let dst = self.param_views()?.grads[p];
                let rows = index.len();
                let width = values.len().checked_div(rows).unwrap_or(0);
                // the index must be the vertex tokens, whose range the
                // host checked when it staged them
                match topo {
                    Some(t) if is_tokens(index, t, range) => {
                        if rows > 0 && (t.max_token as usize + 1) * width > dst.len() {
                            return Err(model_err(format!(
                                "row gradient: token {} outside parameter {p}",
                                t.max_token
                            )));
                        }
                    }
                    _ => {
                        return Err(model_err(
                            "row gradients are supported for token-indexed tables only",
                        ))
                    }
                }
                self.launcher.move_rows(
                    stream,
                    &[RowMove {
                        dst,
                        src: values,
                        dst_rows: Some(index),
                        src_rows: None,
                        rows,
                        width,
                        accumulate: true,
                    }],
                )?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Adds the device gradients into `grads`: dense ones in one copy, row
    /// gradients of each table only for the rows the batch touched.
    pub(super) fn download_grads(
        &mut self,
        model: &Model,
        s: &Schedule,
        grads: &mut Grads<f32>,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        let dp = self.param_views()?;
        let (dense_len, grad_all) = (dp.dense_len, dp.grad_all);
        let grad_views = dp.grads.clone();
        let dense = self
            .staging
            .download_to_vec(grad_all.slice(0..dense_len)?, &stream)?;
        let rows_params = &self.program.row_grad_params;
        let mut at = 0;
        for (p, t) in grads.values.iter_mut().enumerate() {
            if rows_params.contains(&p) {
                continue;
            }
            let len = t.data().len();
            for (d, &x) in t.data_mut().iter_mut().zip(&dense[at..at + len]) {
                *d += x;
            }
            at += len;
        }
        for p in 0..grads.values.len() {
            if !rows_params.contains(&p) {
                grads.mark_dense(p);
            }
        }
        for (p, touched) in self.touched_rows(model, s)? {
            let width = grads.row_width(p);
            let gathered = self.arena_alloc::<f32>(touched.len() * width, &|| {
                format!("touched rows of parameter {p}")
            })?;
            let gather = RowMove::gather(gathered, grad_views[p], touched, width);
            self.launcher.move_rows(&stream, &[gather])?;
            let host = self.staging.download_to_vec(gathered, &stream)?;
            let rows = self.staging.download_to_vec(touched, &stream)?;
            for (i, &row) in rows.iter().enumerate() {
                grads.mark_row(p, row);
                let dst = &mut grads.values[p].data_mut()
                    [row as usize * width..(row as usize + 1) * width];
                for (d, &x) in dst.iter_mut().zip(&host[i * width..(i + 1) * width]) {
                    *d += x;
                }
            }
        }
        grads.finish_rows();
        Ok(())
    }
}
