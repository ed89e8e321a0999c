//! [`CudaSwapDevice`]: the CUDA side of [`ramus_swap::SwapDevice`], which
//! carries out the executor's orders for one swap-path step — tensor
//! memory from the pool or an arena, offloads and prefetches on the copy
//! streams ordered by events, and each op of the step's program run on the
//! engine's kernels.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use ramus_core::graph::{DType, NodeId, NodeKind, Role, Source};
use ramus_core::Model;
use ramus_exec::{Batch, Range};
use ramus_swap::{SwapDevice, TensorId};

use super::runtime::{Mem, Profile, Slot, SwapRuntime, Training};
use super::steps::{self, GraphRef, Home, Rows, SwapOp, SwapProgram};
use crate::batch::{Buf, GraphBufs};
use crate::engine::CudaEngine;
use crate::error::{model_err, CudaError, InCall, Result};
use crate::pool::DeviceView;

/// The CUDA side of [`ramus_swap::SwapDevice`]: the engine, the swap
/// runtime and the buffers of the step in progress.
pub(super) struct CudaSwapDevice<'a> {
    pub(super) engine: &'a mut CudaEngine,
    pub(super) rt: &'a mut SwapRuntime,
    pub(super) program: &'a SwapProgram,
    /// The uploaded index words of the program's moves.
    pub(super) move_indices: Option<DeviceView<u32>>,
    /// The touched row ids of every row-gradient table (training only).
    pub(super) touched: Vec<DeviceView<u32>>,
    pub(super) model: &'a Model,
    /// A training step's optimizer, and whether it ends in the fused
    /// update (else its caller updates after the gradients are summed over
    /// the ranks: a split step).
    pub(super) training: Option<Training<'a>>,
    pub(super) batch: &'a Batch<'a>,
    /// Buffers of every graph's nodes, by [`GraphRef::index`]: index inputs
    /// and empty buffers fixed, every tensor present only while an op that
    /// uses it runs (a tensor the op list missed is a clear error, never a
    /// stale address).
    pub(super) bufs: Vec<Vec<Buf>>,
    pub(super) masks: Vec<Vec<f32>>,
    pub(super) profile: Option<&'a mut Profile>,
}

impl CudaSwapDevice<'_> {
    fn graphs(&self) -> usize {
        2 * self.model.functions.len() + 2
    }

    /// Fixed buffers: tokens, labels, empty views.
    pub(super) fn init_bufs(&mut self) -> Result<()> {
        let nf = self.model.functions.len();
        let mut bufs = Vec::with_capacity(self.graphs());
        for gi in 0..self.graphs() {
            let graph = if gi < 2 * nf {
                if gi % 2 == 0 {
                    GraphRef::Forward(gi / 2)
                } else {
                    GraphRef::Backward(gi / 2)
                }
            } else if gi == 2 * nf {
                GraphRef::Head
            } else {
                GraphRef::HeadBackward
            };
            let g = graph.graph(self.model);
            let mut b = vec![Buf::Absent; g.nodes.len()];
            for (n, node) in g.nodes.iter().enumerate() {
                b[n] = match node.kind {
                    NodeKind::Input(Source::Token) => match graph.function() {
                        Some(f) => Buf::Indices(self.engine.topology(f)?.tokens),
                        None => Buf::Absent,
                    },
                    NodeKind::Input(Source::Label) => {
                        self.engine.batch_labels().map_or(Buf::Absent, Buf::Indices)
                    }
                    _ => Buf::Absent,
                };
            }
            bufs.push(b);
        }
        for &(graph, n, dtype) in &self.program.empty {
            bufs[graph.index(nf)][n] = match dtype {
                DType::Float => Buf::Floats(DeviceView::empty()),
                DType::Index => Buf::Indices(DeviceView::empty()),
            };
        }
        self.bufs = bufs;
        Ok(())
    }

    fn tensor(&self, t: TensorId) -> Result<&Slot> {
        self.rt
            .slots
            .get(t.index())
            .ok_or_else(|| model_err(format!("swap path: no tensor {t}")))
    }

    fn tensor_mut(&mut self, t: TensorId) -> Result<&mut Slot> {
        self.rt
            .slots
            .get_mut(t.index())
            .ok_or_else(|| model_err(format!("swap path: no tensor {t}")))
    }

    /// The event of tensor `t`'s offload (an error if it never had one).
    fn offload_event(&self, t: TensorId) -> Result<&CudaEvent> {
        self.tensor(t)?
            .offloaded
            .as_ref()
            .ok_or_else(|| model_err(format!("swap path: tensor {t} was never offloaded")))
    }

    /// The event of tensor `t`'s prefetch (an error if it never had one).
    fn prefetch_event(&self, t: TensorId) -> Result<&CudaEvent> {
        self.tensor(t)?
            .prefetched
            .as_ref()
            .ok_or_else(|| model_err(format!("swap path: tensor {t} was never prefetched")))
    }

    /// The node tensor `t` holds.
    fn home(&self, t: TensorId) -> Result<Home> {
        self.program
            .homes
            .get(t.index())
            .copied()
            .flatten()
            .ok_or_else(|| model_err(format!("swap path: tensor {t} has no node")))
    }

    /// Gives tensor `t` its memory (an error if it has some already).
    fn place(&mut self, t: TensorId, mem: Mem) -> Result<&mut Slot> {
        let slot = self.tensor_mut(t)?;
        if slot.mem.is_some() {
            return Err(model_err(format!("swap path: tensor {t} allocated twice")));
        }
        slot.mem = Some(mem);
        Ok(slot)
    }

    /// Makes `stream` wait for the offloads of `tensors` that were issued
    /// (they may still read the memory `stream` is about to write).
    fn wait_offloads(&self, stream: &CudaStream, tensors: Vec<TensorId>) -> Result<()> {
        for u in tensors {
            let offloaded = self
                .rt
                .slots
                .get(u.index())
                .and_then(|s| s.offloaded.as_ref());
            if let Some(e) = offloaded {
                stream.wait(e).in_call("cuStreamWaitEvent")?;
            }
        }
        Ok(())
    }

    /// A start and an end event when the step is profiled.
    fn timing(&self) -> Result<Option<(CudaEvent, CudaEvent)>> {
        match self.profile.is_some() {
            true => Ok(Some((self.timing_event()?, self.timing_event()?))),
            false => Ok(None),
        }
    }

    /// Records the end of a timed copy of `bytes` on `stream` (started at
    /// `timing`'s start) into the profile.
    fn end_copy(
        &mut self,
        timing: Option<(CudaEvent, CudaEvent)>,
        stream: &CudaStream,
        to_host: bool,
        bytes: usize,
    ) -> Result<()> {
        if let (Some((start, end)), Some(p)) = (timing, self.profile.as_deref_mut()) {
            end.record(stream).in_call("cuEventRecord")?;
            p.copies.push((to_host, bytes, start, end));
        }
        Ok(())
    }

    fn mem(&self, t: TensorId) -> Result<&Mem> {
        self.tensor(t)?.mem.as_ref().ok_or_else(|| {
            model_err(format!(
                "swap path: tensor {t} `{}` has no device memory",
                self.program.trace.tensor(t).name
            ))
        })
    }

    /// Points the buffers of op `op`'s tensors at their memory (or clears them).
    fn bind(&mut self, op: usize, present: bool) -> Result<()> {
        let nf = self.model.functions.len();
        for &t in self.program.trace.uses(op) {
            let Some(home) = self.program.homes.get(t.index()).copied().flatten() else {
                continue;
            };
            let buf = match (present, self.mem(t).map(Mem::buf)) {
                (false, _) => Buf::Absent,
                // a segment's tensor, addressed by the node's row numbers
                (true, Ok(Buf::Floats(v))) if home.at > 0 => {
                    Buf::Floats(v.shifted(0, home.at, home.len)?)
                }
                (true, Ok(Buf::Indices(v))) if home.at > 0 => {
                    Buf::Indices(v.shifted(0, home.at, home.len)?)
                }
                (true, b) => b?,
            };
            self.bufs[home.graph.index(nf)][home.node] = buf;
        }
        Ok(())
    }

    /// Records `mark` on the compute stream unless nothing was queued
    /// there since it was last recorded.
    fn mark_compute(&mut self) -> Result<()> {
        if self.rt.mark_epoch != Some(self.rt.epoch) {
            self.rt
                .mark
                .record(&self.engine.main.stream)
                .in_call("cuEventRecord")?;
            self.rt.mark_epoch = Some(self.rt.epoch);
        }
        Ok(())
    }

    fn timing_event(&self) -> Result<CudaEvent> {
        self.engine
            .device
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .in_call("cuEventCreate")
    }

    fn event<'s>(
        slot: &'s mut Option<CudaEvent>,
        device: &crate::device::CudaDevice,
    ) -> Result<&'s CudaEvent> {
        if slot.is_none() {
            *slot = Some(device.new_event()?);
        }
        slot.as_ref()
            .ok_or_else(|| model_err("swap path: event missing"))
    }

    /// The rows `rows` of `graph` (the head: every head row).
    fn range_of(&self, graph: GraphRef, rows: Rows) -> Result<Range> {
        let s = &self.batch.schedule;
        match (graph.function(), rows) {
            (None, _) => Ok(Range::rows_only(self.engine.batch_head_vertices().len())),
            (Some(f), Rows::All) => Ok(Range::all(&s.functions[f])),
            (Some(_), Rows::Segment(i)) => self
                .program
                .segments
                .get(i)
                .map(steps::Segment::range)
                .ok_or_else(|| model_err(format!("swap path: no segment {i}"))),
            (Some(_), Rows::Piece(p)) => self
                .program
                .pieces
                .get(p)
                .map(steps::Piece::range)
                .ok_or_else(|| model_err(format!("swap path: no piece {p}"))),
        }
    }

    /// The node buffers of `graph`.
    fn own(&self, graph: GraphRef) -> &[Buf] {
        self.bufs[graph.index(self.model.functions.len())].as_slice()
    }

    /// The node buffers of the forward graph `graph` differentiates, if any.
    fn fwd_of(&self, graph: GraphRef) -> Option<&[Buf]> {
        graph.forward().map(|fg| self.own(fg))
    }

    /// Node `n` of `graph` over all its rows, as floats.
    fn view(&self, graph: GraphRef, n: NodeId) -> Result<DeviceView<f32>> {
        self.engine.float_view(
            graph.graph(self.model),
            n,
            self.own(graph),
            self.fwd_of(graph),
            self.range_of(graph, Rows::All)?,
        )
    }

    /// The memory of the tensor op `op` writes (its only one).
    fn written(&self, op: usize) -> Result<DeviceView<f32>> {
        let t = self.program.trace.ops()[op]
            .writes
            .first()
            .copied()
            .ok_or_else(|| model_err(format!("swap path: op {op} writes nothing")))?;
        match self.mem(t)?.buf() {
            Buf::Floats(v) => Ok(v),
            _ => Err(model_err(format!("swap path: tensor {t} is not floats"))),
        }
    }

    /// The rows `rows` of function `f`, as indices into its rows.
    fn rows_of(&self, f: usize, rows: Rows) -> Result<std::ops::Range<usize>> {
        match rows {
            Rows::All => Ok(0..self.batch.schedule.functions[f].rows()),
            other => {
                let r = self.range_of(GraphRef::Forward(f), other)?;
                Ok(r.r0..r.r1)
            }
        }
    }

    /// Runs op `op` (its tensors bound).
    fn execute(&mut self, op: usize) -> Result<()> {
        let stream = self.engine.main.stream.clone();
        match self.program.ops[op] {
            SwapOp::Step {
                graph,
                phase,
                index,
                rows,
            } => self.run_step(graph, phase, index, rows)?,
            SwapOp::UploadPull { f, node, rows } => self.upload_pull(op, f, node, rows)?,
            SwapOp::UploadMask { mask, rows } => self.upload_mask(op, mask, rows)?,
            SwapOp::HeadInput => self.head_input()?,
            SwapOp::ReadLogits => {
                if let Some(l) = self.model.head.logits {
                    let v = self.view(GraphRef::Head, l)?;
                    self.rt.logits.download(v, &stream)?;
                    self.rt.logits_len = v.len();
                }
            }
            SwapOp::ReadLoss => self.read_loss()?,
            SwapOp::ZeroGrads => {
                let grad_all = self.engine.param_views()?.grad_all;
                self.engine.launcher.fill(&stream, grad_all, 0.0)?;
            }
            SwapOp::Seed { value, .. } => {
                self.engine
                    .launcher
                    .fill(&stream, self.written(op)?, value)?;
            }
            SwapOp::Moves { set } => self.run_moves(set)?,
            SwapOp::PushGrads => {
                let model = self.model;
                let hb = &model.head.backward;
                let Some(out) = hb.output(Role::HeadInputGrad) else {
                    return Ok(());
                };
                let src = self.view(GraphRef::HeadBackward, out.node)?;
                let pw = hb.nodes[out.node].ty.width();
                let moves = self
                    .engine
                    .push_grad_moves(model, src, pw, |f, pg| self.own(GraphRef::Backward(f))[pg])?;
                self.engine.launcher.move_rows(&stream, &moves)?;
            }
            SwapOp::AccumulateGrad {
                graph,
                output,
                rows,
            } => self.accumulate_grad(graph, output, rows)?,
            SwapOp::Optimizer if !Training::fused(self.training) => {}
            SwapOp::Optimizer => {
                let config = self.training.map(|t| t.config).ok_or_else(|| {
                    model_err("swap path: an optimizer step without an optimizer")
                })?;
                let opt = self.engine.device_optimizer(self.model, config)?;
                let loss = opt.loss_slot()?;
                let report = opt.step(&stream, &self.touched, Some(loss), false)?;
                for _ in 0..report.launches {
                    self.engine.launcher.count();
                }
            }
        }
        Ok(())
    }

    /// Step `index` of phase `phase` of `graph`'s program, over `rows`.
    fn run_step(&self, graph: GraphRef, phase: usize, index: usize, rows: Rows) -> Result<()> {
        let engine: &CudaEngine = self.engine;
        let prog = graph.program(&engine.program, self.program.kind);
        let step = prog.phases[phase]
            .get(index)
            .ok_or_else(|| model_err(format!("swap path: no step {index} in phase {phase}")))?;
        let topo = graph.function().map(|f| engine.topology(f)).transpose()?;
        let bufs = GraphBufs::new(graph.graph(self.model), self.own(graph), self.fwd_of(graph));
        engine.run_step(
            bufs,
            step,
            self.range_of(graph, rows)?,
            topo,
            &engine.main,
            &prog.views,
        )
    }

    /// Uploads the pulled inputs of node `node` of function `f` over
    /// `rows` into the memory op `op` writes.
    fn upload_pull(&mut self, op: usize, f: usize, node: NodeId, rows: Rows) -> Result<()> {
        let engine: &CudaEngine = self.engine;
        let s = &self.batch.schedule;
        let func = &self.model.functions[f];
        let g = &func.forward;
        let pw = g.nodes[node].ty.width();
        let explicit = engine.pull_values.is_some();
        let values = engine.pull_values.as_deref().unwrap_or(&s.features);
        let values = ramus_exec::pulled_values(values, s, pw, &func.name, explicit)
            .map_err(|e| model_err(e.to_string()))?;
        let fr = &s.functions[f];
        let span = self.rows_of(f, rows)?;
        let mut host = Vec::with_capacity(span.len() * pw);
        for &v in &fr.vertex[span] {
            host.extend_from_slice(&values[v as usize * pw..(v as usize + 1) * pw]);
        }
        let dst = self.written(op)?;
        let stream = self.engine.main.stream.clone();
        self.rt.upload.upload_slice(&host, dst, &stream)?;
        self.engine.launcher.count();
        Ok(())
    }

    /// Uploads dropout mask `mask` over `rows` into the memory op `op` writes.
    fn upload_mask(&mut self, op: usize, mask: usize, rows: Rows) -> Result<()> {
        let &(graph, node, _, _) = self
            .program
            .masks
            .get(mask)
            .ok_or_else(|| model_err(format!("swap path: no mask {mask}")))?;
        let ty = &graph.graph(self.model).nodes[node].ty;
        let (lo, hi) = match (graph.function(), rows) {
            (Some(_), Rows::Segment(_) | Rows::Piece(_)) => {
                self.range_of(graph, rows)?.span(ty.space)
            }
            _ => (0, self.masks[mask].len() / ty.width().max(1)),
        };
        let values = self.masks[mask]
            .get(lo * ty.width()..hi * ty.width())
            .ok_or_else(|| model_err(format!("swap path: mask {mask} rows {lo}..{hi}")))?;
        let dst = self.written(op)?;
        let stream = self.engine.main.stream.clone();
        self.rt.upload.upload_slice(values, dst, &stream)?;
        self.engine.launcher.count();
        Ok(())
    }

    /// Copies every function's pushed rows into the head's input.
    fn head_input(&self) -> Result<()> {
        let engine: &CudaEngine = self.engine;
        let model = self.model;
        let g = &model.head.forward;
        let Some(inp) = g.input_node(Source::HeadInput) else {
            return Ok(());
        };
        let dst = self.view(GraphRef::Head, inp)?;
        let pw = g.nodes[inp].ty.width();
        let mut moves = Vec::new();
        for (f, func) in model.functions.iter().enumerate() {
            let topo = engine.topology(f)?;
            if topo.head_rows.is_empty() {
                continue;
            }
            let push = func
                .push
                .ok_or_else(|| model_err(format!("function `{}` pushes nothing", func.name)))?;
            let graph = GraphRef::Forward(f);
            let src = engine.whole_view(&func.forward, push, self.own(graph), None)?;
            moves.push(crate::launch::RowMove {
                dst,
                src,
                dst_rows: Some(topo.head_rows),
                src_rows: Some(topo.head_sources),
                rows: topo.head_rows.len(),
                width: pw,
                accumulate: false,
            });
        }
        engine
            .launcher
            .move_rows(&engine.main.stream.clone(), &moves)
    }

    /// Downloads the loss and, when training, copies it where the optimizer
    /// step (set up before the run) checks it after the loss's memory is freed.
    fn read_loss(&mut self) -> Result<()> {
        let v = self.view(GraphRef::Head, self.model.head.loss)?;
        let loss = v.slice(0..1.min(v.len()))?;
        let stream = self.engine.main.stream.clone();
        self.rt.loss.download(loss, &stream)?;
        let engine: &CudaEngine = self.engine;
        if let (Some(_), Some((_, opt))) = (self.training, engine.optimizer.as_ref()) {
            let slot = opt.loss_slot()?;
            engine.launcher.move_rows(
                &stream,
                &[crate::launch::RowMove {
                    dst: slot,
                    src: loss,
                    dst_rows: None,
                    src_rows: None,
                    rows: loss.len(),
                    width: 1,
                    accumulate: false,
                }],
            )?;
        }
        Ok(())
    }

    /// Runs the row moves of move set `set`.
    fn run_moves(&self, set: usize) -> Result<()> {
        let specs = self
            .program
            .move_sets
            .get(set)
            .ok_or_else(|| model_err(format!("swap path: no move set {set}")))?;
        let words = self
            .move_indices
            .ok_or_else(|| model_err("swap path: the moves' index words are missing"))?;
        let floats = |t: TensorId| -> Result<DeviceView<f32>> {
            match self.mem(t)?.buf() {
                Buf::Floats(v) => Ok(v),
                _ => Err(model_err(format!("swap path: tensor {t} is not floats"))),
            }
        };
        let index = |w: Option<steps::Words>| {
            w.map(|w| words.slice(w.offset..w.offset + w.len))
                .transpose()
        };
        let mut moves = Vec::with_capacity(specs.len());
        for m in specs {
            let dst = floats(m.dst)?;
            let src = match m.src {
                Some(t) => floats(t)?,
                // every source row is NONE: never read
                None => dst,
            };
            moves.push(crate::launch::RowMove {
                dst,
                src,
                dst_rows: index(m.dst_rows)?,
                src_rows: index(m.src_rows)?,
                rows: m.rows,
                width: m.width,
                accumulate: m.accumulate,
            });
        }
        let engine: &CudaEngine = self.engine;
        engine
            .launcher
            .move_rows(&engine.main.stream.clone(), &moves)
    }

    /// Adds output `output` of `graph` (a parameter gradient) over `rows`
    /// into the parameter's gradient.
    fn accumulate_grad(&self, graph: GraphRef, output: usize, rows: Rows) -> Result<()> {
        let engine: &CudaEngine = self.engine;
        let g = graph.graph(self.model);
        let o = g
            .outputs
            .get(output)
            .ok_or_else(|| model_err(format!("swap path: no output {output}")))?;
        if !matches!(o.role, Role::ParamGrad(_) | Role::ParamRowGrad(_)) {
            return Err(model_err("swap path: accumulating a non-gradient output"));
        }
        let topo = graph.function().map(|f| engine.topology(f)).transpose()?;
        let bufs = GraphBufs::new(g, self.own(graph), self.fwd_of(graph));
        let range = self.range_of(graph, rows)?;
        engine.accumulate_output(bufs, o, range, topo, &engine.main.stream)
    }
}

impl SwapDevice for CudaSwapDevice<'_> {
    type Error = CudaError;

    fn budget_bytes(&self) -> Option<u64> {
        self.engine.pool.max_bytes()
    }

    fn allocate(&mut self, tensor: TensorId, _bytes: u64) -> Result<bool> {
        let home = self.home(tensor)?;
        let allocated = match home.dtype {
            DType::Float => self.engine.pool.alloc::<f32>(home.len).map(Mem::Floats),
            DType::Index => self.engine.pool.alloc::<u32>(home.len).map(Mem::Indices),
        };
        match allocated {
            Ok(mem) => {
                self.place(tensor, mem)?;
                Ok(true)
            }
            Err(CudaError::OutOfPoolMemory { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn release(&mut self, tensor: TensorId) -> Result<()> {
        let slot = self.tensor_mut(tensor)?;
        // later compute is ordered after the tensor's last op on the compute
        // stream; copies into recycled memory wait for the compute stream
        slot.mem = None;
        Ok(())
    }

    fn offload(&mut self, tensor: TensorId) -> Result<()> {
        self.mark_compute()?;
        let device = Arc::clone(&self.engine.device);
        let timing = self.timing()?;
        let (ptr, bytes) = self.mem(tensor)?.raw();
        let d2h = Arc::clone(&self.rt.d2h);
        d2h.wait(&self.rt.mark).in_call("cuStreamWaitEvent")?;
        self.rt.ensure_host(tensor.index(), bytes, &device)?;
        let slot = &mut self.rt.slots[tensor.index()];
        if let Some((start, _)) = &timing {
            start.record(&d2h).in_call("cuEventRecord")?;
        }
        let host = slot
            .host
            .as_ref()
            .ok_or_else(|| model_err("swap path: host slot missing"))?;
        // SAFETY: `ptr` is the tensor's live device memory: a pool block the
        // executor releases only after this copy's event (recorded next)
        // completed, or a range of the step's arena, which outlives every
        // copy (released once the executor drained them) and whose next
        // writer waits for this event (`order_after_offload`); the copy
        // starts after the compute stream's work so far (the wait on `mark`
        // above), so the tensor's last write is done. The slot is not read
        // by a prefetch until that event completes (the prefetch waits on
        // it), and a previous prefetch from it completed before the compute
        // stream went on (ops await prefetches), which is before `mark`.
        unsafe { host.copy_from_device(ptr, bytes, &d2h)? };
        let event = Self::event(&mut slot.offloaded, &device)?;
        event.record(&d2h).in_call("cuEventRecord")?;
        self.end_copy(timing, &d2h, true, bytes)
    }

    fn offload_complete(&mut self, tensor: TensorId) -> Result<bool> {
        self.offload_event(tensor)?
            .try_is_complete()
            .in_call("cuEventQuery")
    }

    fn wait_offload(&mut self, tensor: TensorId) -> Result<()> {
        self.offload_event(tensor)?
            .synchronize()
            .in_call("cuEventSynchronize")
    }

    fn prefetch(&mut self, tensor: TensorId) -> Result<()> {
        self.mark_compute()?;
        let device = Arc::clone(&self.engine.device);
        let timing = self.timing()?;
        let (ptr, bytes) = self.mem(tensor)?.raw();
        let h2d = Arc::clone(&self.rt.h2d);
        h2d.wait(&self.rt.mark).in_call("cuStreamWaitEvent")?;
        h2d.wait(self.offload_event(tensor)?)
            .in_call("cuStreamWaitEvent")?;
        // memory that other tensors' offloads may still read
        let waits = std::mem::take(&mut self.tensor_mut(tensor)?.write_after);
        self.wait_offloads(&h2d, waits)?;
        let slot = &mut self.rt.slots[tensor.index()];
        if let Some((start, _)) = &timing {
            start.record(&h2d).in_call("cuEventRecord")?;
        }
        let host = slot
            .host
            .as_ref()
            .ok_or_else(|| model_err(format!("swap path: tensor {tensor} has no host copy")))?;
        // SAFETY: `ptr` is the tensor's freshly allocated device memory; the
        // copy waits for the compute stream's work so far (memory it
        // recycles was last used there), for the offloads that may still
        // read it (`write_after`, arena ranges only) and for the tensor's
        // own offload (the slot's contents). No op reads the memory before
        // the compute stream waits on this copy's event (recorded next),
        // the executor never releases it while the copy is pending, and the
        // slot is written again only by a later offload, which follows
        // compute that waited for this copy.
        unsafe { host.copy_to_device(ptr, bytes, &h2d)? };
        let event = Self::event(&mut slot.prefetched, &device)?;
        event.record(&h2d).in_call("cuEventRecord")?;
        self.end_copy(timing, &h2d, false, bytes)
    }

    fn await_prefetch(&mut self, tensor: TensorId) -> Result<()> {
        let event = self.prefetch_event(tensor)?;
        self.engine
            .main
            .stream
            .wait(event)
            .in_call("cuStreamWaitEvent")
    }

    fn wait_prefetch(&mut self, tensor: TensorId) -> Result<()> {
        self.prefetch_event(tensor)?
            .synchronize()
            .in_call("cuEventSynchronize")
    }

    fn run_op(&mut self, op: usize) -> Result<()> {
        self.bind(op, true)?;
        // layout mode: memory that offloads may still read is written only
        // after them
        let compute = Arc::clone(&self.engine.main.stream);
        for &t in self.program.trace.uses(op) {
            let waits = match self.rt.slots.get_mut(t.index()) {
                Some(slot) => std::mem::take(&mut slot.write_after),
                None => continue,
            };
            self.wait_offloads(&compute, waits)?;
        }
        let timing = self.timing()?;
        if let Some((start, _)) = &timing {
            start
                .record(&self.engine.main.stream)
                .in_call("cuEventRecord")?;
        }
        let ran = self.execute(op).map_err(|e| match e {
            CudaError::Model(m) => CudaError::Model(format!(
                "op {op} `{}`: {m}",
                self.program.trace.ops()[op].name
            )),
            other => other,
        });
        self.rt.epoch += 1;
        ran?;
        if let (Some((start, end)), Some(p)) = (timing, self.profile.as_deref_mut()) {
            end.record(&self.engine.main.stream)
                .in_call("cuEventRecord")?;
            if p.ops.len() <= op {
                p.ops.resize_with(op + 1, || None);
            }
            p.ops[op] = Some((start, end));
        }
        self.bind(op, false)
    }

    fn reserve_arena(&mut self, bytes: u64) -> Result<()> {
        let floats = usize::try_from(bytes.div_ceil(4))
            .map_err(|_| model_err(format!("swap path: an arena of {bytes} bytes")))?;
        self.rt.arena = None;
        match self.engine.pool.alloc::<f32>(floats.max(1)) {
            Ok(arena) => {
                self.rt.arena = Some(arena);
                Ok(())
            }
            Err(CudaError::OutOfPoolMemory {
                free, pool_size, ..
            }) => Err(model_err(format!(
                "the swap plan's arena of {bytes} bytes ({}) does not fit the pool: {free} of \
                 its {pool_size} bytes are free (device memory budget {})",
                ramus_swap::human_bytes(bytes),
                self.engine
                    .pool
                    .max_bytes()
                    .map_or("unlimited".to_string(), |b| format!("{b} bytes"))
            ))),
            Err(e) => Err(e),
        }
    }

    fn allocate_at(&mut self, tensor: TensorId, offset: u64, bytes: u64) -> Result<()> {
        let home = self.home(tensor)?;
        let arena = self
            .rt
            .arena
            .as_ref()
            .ok_or_else(|| model_err(format!("swap path: tensor {tensor} placed with no arena")))?
            .view();
        let at = usize::try_from(offset / 4)
            .ok()
            .filter(|_| offset.is_multiple_of(4) && (home.len as u64) * 4 <= bytes)
            .ok_or_else(|| {
                model_err(format!(
                    "swap path: tensor {tensor} placed at byte {offset} with {bytes} bytes for \
                     {} elements",
                    home.len
                ))
            })?;
        // `slice` checks the range against the arena
        let floats = arena.slice(at..at + home.len)?;
        let buf = match home.dtype {
            DType::Float => Buf::Floats(floats),
            DType::Index => Buf::Indices(floats.reinterpret::<u32>()),
        };
        self.place(tensor, Mem::Placed(buf))?.write_after.clear();
        Ok(())
    }

    fn release_offloading(&mut self, tensor: TensorId) -> Result<()> {
        // the copy was queued with the memory's address; the arena outlives
        // it (released only after the executor drained every copy), and
        // whatever the executor places here next waits for its event
        self.release(tensor)
    }

    fn order_after_offload(&mut self, tensor: TensorId, previous: TensorId) -> Result<()> {
        self.tensor_mut(tensor)?.write_after.push(previous);
        Ok(())
    }

    fn release_arena(&mut self) -> Result<()> {
        // every copy has completed (the executor drained them) and later
        // compute is ordered after this step's on the compute stream;
        // copies into recycled memory wait for the compute stream
        self.rt.arena = None;
        Ok(())
    }
}
